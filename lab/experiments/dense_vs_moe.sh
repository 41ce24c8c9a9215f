#!/usr/bin/env bash
# Dense vs MoE at equal active parameters: the preset's MoE (top-k routed + shared experts of width H) against a
# dense MLP of width (top_k + n_shared) * H (--n-expert 1 --top-k 1 --n-shared-expert 0 --expert-hidden that width;
# 384 on cpu), same data, same steps; then the same RL run on each. Pretraining curves, the RL gain, and both
# models' active/total parameters.
#   PRESET=smoke OUT=/tmp/dm bash lab/experiments/dense_vs_moe.sh       # wiring check, under a minute on 2 cores
#   bash lab/experiments/dense_vs_moe.sh                                # cpu preset
set -euo pipefail
cd "$(dirname "$0")/../.."
source lab/experiments/lib.sh
PRESET=${PRESET:-cpu}
OUT=${OUT:-runs/exp/dense_vs_moe_$PRESET}
SEEDS=${SEEDS:-0}
RL_ARGS=${RL_ARGS:-}
mkdir -p "$OUT"
# the dense width = (top_k + n_shared_expert) x expert_hidden of the preset's MoE (train_pretrain.py PRESETS);
# the table's "active params" column shows the two match
case $PRESET in
  smoke) DENSE_H=192 ;;    # (2 + 1) x 64
  cpu)   DENSE_H=384 ;;    # (2 + 1) x 128
  gpu)   DENSE_H=1536 ;;   # (2 + 1) x 512
  *) echo "error: unknown PRESET=$PRESET (smoke, cpu, gpu)" >&2; exit 2 ;;
esac
for S in $SEEDS; do
  run_stage "pretrain_moe_s$S" python train_pretrain.py --preset "$PRESET" --seed "$S" --cache-dir "$OUT/cache" \
    --out-dir "$OUT/moe_s$S"
  run_stage "pretrain_dense_s$S" python train_pretrain.py --preset "$PRESET" --seed "$S" --cache-dir "$OUT/cache" \
    --n-expert 1 --top-k 1 --n-shared-expert 0 --expert-hidden "$DENSE_H" --out-dir "$OUT/dense_s$S"
  for M in moe dense; do
    run_stage "rl_${M}_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS \
      --init-from "$(json_get "$OUT/pretrain_${M}_s$S.json" ckpt)" --out-dir "$OUT/rl_${M}_s$S"
  done
done
python -m lab.experiments.report "$OUT" --title "Dense vs MoE at equal active parameters ($PRESET)"
python -m lab.plot $(for S in $SEEDS; do echo "$OUT/moe_s$S $OUT/dense_s$S $OUT/rl_moe_s$S $OUT/rl_dense_s$S"; done) \
  --out-dir "$OUT" > /dev/null
echo "table and figures: $OUT/results.md $OUT/pretrain.png $OUT/rl.png"
