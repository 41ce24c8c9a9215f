#!/usr/bin/env bash
# Memory that matters (docs/agent.md): self-summarization against observation masking and a sliding window,
# each trained as much as the others. One boot from the pretrained checkpoint (its long transcripts a third
# in each memory's format: data/repos.BOOT_MEMORIES), then for each memory and seed one RL run with
# --memory M from it (the same preset, the same clock), then one eval of the boot and every RL checkpoint on
# the long tasks under every memory and the oracle summary (eval.py --agent --agent-tasks 0), on a held-out
# seed; report.py --memory writes memory.md (pass@1 per slice, the oracle summary, retention, summaries or
# rebuilds per episode, over-cap and step-limit hits, the paired gains) and memory.png.
#   PRESET=smoke OUT=/tmp/mem bash lab/experiments/memory.sh      # wiring check, a few minutes on 2 cores
#   BOOT=runs/agent-cpu/boot/ckpt.pt bash lab/experiments/memory.sh   # AGENT=1 bash run.sh's boot
#   bash lab/experiments/memory.sh    # cpu, from scratch: pretrain, boot, 6 RL runs of 13.5 min, the eval
# Its time on 2 cores (cpu preset, BOOT given): four RL runs and the eval took 3,965 s; all six, ~94 min
# (an estimate): docs/agent.md, "Memory, trained alike".
set -euo pipefail
cd "$(dirname "$0")/../.."
source lab/experiments/lib.sh
PRESET=${PRESET:-cpu}
OUT=${OUT:-runs/exp/memory_$PRESET}
SEEDS=${SEEDS:-0 1}
TEST_SEED=${TEST_SEED:-11}
LONG_TASKS=${LONG_TASKS:-40}   # the eval preset's own; 80 halves the variance at twice the time
mkdir -p "$OUT"
start=$SECONDS
if [ -z "${BOOT:-}" ]; then
  base_ckpt
  agent_boot "$CKPT"
  BOOT=$BOOT_CKPT
fi
CKPTS=(--ckpt "$BOOT" --label boot)
for M in summary mask window; do
  for S in $SEEDS; do
    agent_rl "rl_${M}_s$S" "$BOOT" --memory "$M" --seed "$S"
    CKPTS+=(--ckpt "$(json_get "$OUT/rl_${M}_s$S.json" ckpt)" --label "${M}_s$S")
  done
done
run_stage eval python eval.py --preset "$PRESET" --agent --agent-tasks 0 --long-tasks "$LONG_TASKS" \
  "${CKPTS[@]}" --out-dir "$OUT/eval" --task-seed "$TEST_SEED"
python -m lab.experiments.report "$OUT" --memory
echo "memory.sh: $((SECONDS - start)) s; table and figure: $OUT/memory.md $OUT/memory.png"
