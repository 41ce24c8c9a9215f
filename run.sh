#!/usr/bin/env bash
# The whole Composer-2-style recipe in miniature, end to end:
#   1. tokenizer + code corpus + continued pretraining of a small MoE   (train_pretrain.py)
#   2. group-relative RL against sandboxed unit-test tasks              (train_rl.py)
#   3. side-by-side evaluation of the pretrained and the RL checkpoint  (eval.py)
#   4. figures of both runs' curves next to the evaluation table        (plot.py)
# Usage:  bash run.sh              # preset: gpu if a GPU is visible, else cpu (<= 30 min on 2 cores)
#         PRESET=smoke bash run.sh # a one-minute-per-stage check that everything is wired up
#         OUT=runs/mine bash run.sh
# Stops at the first failing stage and shows that stage's error.
set -euo pipefail
# Idle OpenMP threads sleep instead of spinning: the sandbox workers share these cores with torch.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
cd "$(dirname "$0")"
PRESET=${PRESET:-$(python -c "import torch; print('gpu' if torch.cuda.is_available() else 'cpu')")}
OUT=${OUT:-runs/$PRESET}
mkdir -p "$OUT"
echo "preset: $PRESET   run directory: $OUT"

# run_stage NAME CMD...: runs CMD, keeps its log in $OUT/NAME.log, stops the whole script with the
# stage's last lines if it fails, and leaves the stage's final JSON summary line in $OUT/NAME.json.
run_stage() {
  local name=$1; shift
  local start=$SECONDS
  echo; echo "=== stage $name: $*"
  if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
    echo; echo "!!! stage $name failed after $((SECONDS - start)) s; its last lines:" >&2
    tail -n 15 "$OUT/$name.log" >&2
    exit 1
  fi
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
  echo "=== stage $name done in $((SECONDS - start)) s"
}
json_get() { python -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

run_stage pretrain python train_pretrain.py --preset "$PRESET" --out-dir "$OUT/pretrain"
PRE_CKPT=$(json_get "$OUT/pretrain.json" ckpt)
run_stage rl python train_rl.py --preset "$PRESET" --init-from "$PRE_CKPT" --out-dir "$OUT/rl"
RL_CKPT=$(json_get "$OUT/rl.json" ckpt)
run_stage eval python eval.py --preset "$PRESET" --ckpt "$PRE_CKPT" --ckpt "$RL_CKPT" \
  --label pretrained --label rl --out-dir "$OUT/eval"
run_stage plots python plot.py "$OUT" --out-dir "$OUT/eval"

echo
echo "artefacts:"
echo "  pretraining : $OUT/pretrain/  (checkpoint $PRE_CKPT, tokenizer, metrics.jsonl)"
echo "  RL          : $OUT/rl/        (checkpoint $RL_CKPT, metrics.jsonl)"
echo "  evaluation  : $OUT/eval/      (eval.md side-by-side table, eval.json)"
echo "  stage logs  : $OUT/{pretrain,rl,eval}.log, summaries $OUT/{pretrain,rl,eval}.json"
[ -f "$OUT/eval/eval.md" ] && cat "$OUT/eval/eval.md"
