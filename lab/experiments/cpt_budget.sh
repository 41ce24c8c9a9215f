#!/usr/bin/env bash
# Finding 1 of the Composer 2 report in miniature: does lower loss after continued pretraining predict a better
# result after an identical RL run? One base model; three log-spaced continued-pretraining budgets from it (same
# data order: same --seed, each with its own LR decay: WSD decays over each run's own --max-steps); the same RL
# run on each; the table and finding1.png put final validation loss next to held-out pass@1 (near / novel slices,
# before and after RL).
#   PRESET=smoke OUT=/tmp/f1 bash lab/experiments/cpt_budget.sh         # wiring check, under a minute on 2 cores
#   bash lab/experiments/cpt_budget.sh                                  # cpu preset: ~1 h per seed on 2 cores
#   SEEDS="0 1" RL_ARGS="--max-minutes 6" bash lab/experiments/cpt_budget.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source lab/experiments/lib.sh
PRESET=${PRESET:-cpu}
OUT=${OUT:-runs/exp/cpt_budget_$PRESET}
SEEDS=${SEEDS:-0}
RL_ARGS=${RL_ARGS:-}
case $PRESET in   # base steps, then the three budgets (x3 apart) of continued pretraining
  smoke) BASE=8;    BUDGETS="4 12 36" ;;
  cpu)   BASE=300;  BUDGETS="100 300 900" ;;
  gpu)   BASE=1500; BUDGETS="500 1500 4500" ;;
  *) echo "error: unknown PRESET=$PRESET (smoke, cpu, gpu)" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
for S in $SEEDS; do
  run_stage "base_s$S" python train_pretrain.py --preset "$PRESET" --max-steps "$BASE" --seed "$S" \
    --cache-dir "$OUT/cache" --out-dir "$OUT/base_s$S"
  BASE_CKPT=$(json_get "$OUT/base_s$S.json" ckpt)
  for B in $BUDGETS; do
    run_stage "pretrain_b${B}_s$S" python train_pretrain.py --preset "$PRESET" --init-from "$BASE_CKPT" \
      --max-steps "$B" --seed "$S" --cache-dir "$OUT/cache" --out-dir "$OUT/cpt_b${B}_s$S"
    run_stage "rl_b${B}_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS \
      --init-from "$(json_get "$OUT/pretrain_b${B}_s$S.json" ckpt)" --out-dir "$OUT/rl_b${B}_s$S"
  done
done
python -m lab.experiments.report "$OUT" --title "Finding 1: continued-pretraining budget vs RL ($PRESET)" --scatter
python -m lab.plot $(for S in $SEEDS; do for B in $BUDGETS; do echo "$OUT/cpt_b${B}_s$S"; done; done) \
  --out-dir "$OUT" --prefix cpt_ > /dev/null
python -m lab.plot $(for S in $SEEDS; do for B in $BUDGETS; do echo "$OUT/rl_b${B}_s$S"; done; done) \
  --out-dir "$OUT" --prefix cpt_ > /dev/null
echo "table and figures: $OUT/results.md $OUT/finding1.png $OUT/cpt_pretrain.png $OUT/cpt_rl.png"
