#!/usr/bin/env bash
# Dr. GRPO (the report's choice: advantage = reward - group mean, a constant loss normaliser) vs GRPO
# (advantages divided by the group's std, per-sequence length normalisation), over seeds, from one checkpoint.
#   PRESET=smoke OUT=/tmp/gv bash lab/experiments/grpo_variants.sh      # wiring check, under a minute on 2 cores
#   CKPT=runs/cpu/pretrain/ckpt.pt bash lab/experiments/grpo_variants.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source lab/experiments/lib.sh
PRESET=${PRESET:-cpu}
OUT=${OUT:-runs/exp/grpo_variants_$PRESET}
SEEDS=${SEEDS:-0 1}
RL_ARGS=${RL_ARGS:-}
mkdir -p "$OUT"
base_ckpt
for S in $SEEDS; do
  run_stage "rl_drgrpo_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS --init-from "$CKPT" \
    --out-dir "$OUT/drgrpo_s$S"
  run_stage "rl_grpo_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS --init-from "$CKPT" \
    --adv-std --loss-norm sequence --out-dir "$OUT/grpo_s$S"
done
python -m lab.experiments.report "$OUT" --title "Dr. GRPO vs GRPO ($PRESET)" --curve entropy --curve len_mean
python -m lab.plot $(for S in $SEEDS; do echo "$OUT/drgrpo_s$S $OUT/grpo_s$S"; done) --out-dir "$OUT" > /dev/null
echo "table and figures: $OUT/results.md $OUT/rl.png $OUT/rl_time.png"
