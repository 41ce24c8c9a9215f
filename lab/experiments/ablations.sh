#!/usr/bin/env bash
# The ablations of the README's recipe table, each against the recipe, over seeds, from one checkpoint: every
# RL flag the table names (one RL run per variant and seed), and the MoE balancing of pretraining (aux loss,
# none; one pretraining run each, then RL). Router replay (router_replay.sh), dense vs MoE (dense_vs_moe.sh),
# the pretraining budget (cpt_budget.sh) and the agent's memory (memory.sh: --memory) have experiments of
# their own; --n-mtp / --train-trunk and agent.py --no-speculative are documented commands (docs/agent.md,
# docs/speculative.md).
#   PRESET=smoke OUT=/tmp/ab bash lab/experiments/ablations.sh            # wiring check, a few minutes on 2 cores
#   CKPT=runs/cpu/pretrain/ckpt.pt bash lab/experiments/ablations.sh     # cpu preset: ~14 min per RL run
#   VARIANTS="recipe grpo" SEEDS="0 1" bash lab/experiments/ablations.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
source lab/experiments/lib.sh
PRESET=${PRESET:-cpu}
OUT=${OUT:-runs/exp/ablations_$PRESET}
SEEDS=${SEEDS:-0 1}
RL_ARGS=${RL_ARGS:-}
declare -A FLAGS=(
  [recipe]="" [grpo]="--adv-std --loss-norm sequence" [dapo_token]="--loss-norm token" [kl]="--kl-coef 0.01"
  [ppo2]="--ppo-epochs 2" [no_clip_higher]="--ppo-epochs 2 --eps-high 0.2" [length]="--len-penalty 0.02"
  [fractional]="--fractional" [no_dynamic]="--no-dynamic-sampling" [unpacked]="--no-pack-prompts"
  [no_prefilter]="--prefilter 1")
VARIANTS=${VARIANTS:-recipe grpo dapo_token kl ppo2 no_clip_higher length fractional no_dynamic unpacked no_prefilter}
BALANCE=${BALANCE:-aux none}      # pretraining variants: --balance (the recipe's is bias)
mkdir -p "$OUT"
base_ckpt
for S in $SEEDS; do
  for V in $VARIANTS; do
    [ -n "${FLAGS[$V]+x}" ] || { echo "error: unknown variant $V (${!FLAGS[*]})" >&2; exit 2; }
    run_stage "rl_${V}_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS --init-from "$CKPT" \
      ${FLAGS[$V]} --out-dir "$OUT/${V}_s$S"
  done
done
for B in $BALANCE; do
  run_stage "pretrain_balance_${B}" python train_pretrain.py --preset "$PRESET" --balance "$B" --out-dir "$OUT/pre_$B"
  for S in $SEEDS; do
    run_stage "rl_balance_${B}_s$S" python train_rl.py --preset "$PRESET" --seed "$S" $RL_ARGS \
      --init-from "$(json_get "$OUT/pretrain_balance_${B}.json" ckpt)" --out-dir "$OUT/balance_${B}_s$S"
  done
done
python -m lab.experiments.report "$OUT" --title "Ablations of the recipe table ($PRESET)" --curve entropy --curve len_mean
python -m lab.plot $(for S in $SEEDS; do for V in $VARIANTS; do echo "$OUT/${V}_s$S"; done; done) --out-dir "$OUT" > /dev/null
echo "table and figures: $OUT/results.md $OUT/rl.png $OUT/rl_time.png"
