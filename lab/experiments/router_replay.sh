#!/usr/bin/env bash
# Router replay on vs off (Composer 2: the trainer forces the experts the sampler chose): RL curves, and the
# train-inference log-prob mismatch and clip fraction with and without it, over seeds, from one checkpoint.
#   PRESET=smoke OUT=/tmp/rr bash lab/experiments/router_replay.sh      # wiring check, under a minute on 2 cores
#   bash lab/experiments/router_replay.sh                               # cpu preset: 2 seeds x 2 RL runs
#   CKPT=runs/cpu/pretrain/ckpt.pt bash lab/experiments/router_replay.sh  # skip the pretraining stage
set -euo pipefail
cd "$(dirname "$0")/../.."
source lab/experiments/lib.sh
PRESET=${PRESET:-cpu}
OUT=${OUT:-runs/exp/router_replay_$PRESET}
SEEDS=${SEEDS:-0 1}
RL_ARGS=${RL_ARGS:-}
mkdir -p "$OUT"
base_ckpt
for S in $SEEDS; do
  run_stage "rl_replay_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS --init-from "$CKPT" \
    --out-dir "$OUT/replay_s$S"
  run_stage "rl_noreplay_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS --init-from "$CKPT" \
    --no-router-replay --out-dir "$OUT/noreplay_s$S"
done
python -m lab.experiments.report "$OUT" --title "Router replay on / off ($PRESET)" --curve logp_mismatch --curve clip_frac
python -m lab.plot $(for S in $SEEDS; do echo "$OUT/replay_s$S $OUT/noreplay_s$S"; done) --out-dir "$OUT" > /dev/null
echo "table and figures: $OUT/results.md $OUT/rl.png $OUT/rl_time.png"
