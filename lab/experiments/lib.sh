# Shared by run.sh and lab/experiments/*.sh (source it): one way to run a stage and keep its summary.
# run_stage NAME CMD...: runs CMD, keeps its log in $OUT/NAME.log, stops the whole script with the stage's
# last lines if it fails, and leaves the stage's final JSON summary line in $OUT/NAME.json.
# RESUME=1: a stage whose summary is already in $OUT is not run again (a long experiment picks up where it stopped).
run_stage() {
  local name=$1; shift
  local start=$SECONDS
  if [ "${RESUME:-0}" = 1 ] && [ -s "$OUT/$name.json" ]; then
    echo; echo "=== stage $name: done before, kept ($OUT/$name.json)"; return 0
  fi
  echo; echo "=== stage $name: $*"
  if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
    echo; echo "!!! stage $name failed after $((SECONDS - start)) s; its last lines:" >&2
    tail -n 15 "$OUT/$name.log" >&2
    exit 1
  fi
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
  echo "=== stage $name done in $((SECONDS - start)) s"
}
# json_get FILE KEY: one value of a stage's JSON summary (e.g. the checkpoint it wrote).
json_get() { python -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }
# Idle OpenMP threads sleep instead of spinning: the sandbox workers share these cores with torch.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# base_ckpt: sets CKPT to a pretrained checkpoint for RL experiments: $CKPT if given, else one pretraining run
# of the preset (stage "base" in $OUT).
base_ckpt() {
  if [ -z "${CKPT:-}" ]; then
    run_stage base python train_pretrain.py --preset "$PRESET" --out-dir "$OUT/base"
    CKPT=$(json_get "$OUT/base.json" ckpt)
  fi
}
# agent_boot PRE_CKPT: the agent's bootstrap (AGENT=1 bash run.sh's boot stage, lab/experiments/memory.sh):
# continued pretraining from PRE_CKPT with a teacher's tool-use transcripts of repository tasks
# (data/repos.py), which adds the tool tokens and extends the context to hold an episode; sets BOOT_CKPT.
# cpu: 2,400 steps, about 1.8 passes over the transcripts: at 1,200 the boot passed 0.08 of seed 11's
# short tasks, at 2,400 0.35 (docs/agent.md, "The boot at twice the steps").
agent_boot() {
  local args
  case $PRESET in
    smoke) args=(--max-steps 8 --agent-n 200 --seq-len 512) ;;
    cpu)   args=(--max-steps 2400 --agent-n 8000 --seq-len 1024 --micro-batch 4 --source-mb 12) ;;
    *)     args=(--max-steps 1000 --agent-n 100000 --seq-len 2048) ;;
  esac
  run_stage boot python train_pretrain.py --preset "$PRESET" --init-from "$1" \
    --mix stdlib=0.05,tasks=0.25,agent=0.7 --task-difficulties 1-2 "${args[@]}" --out-dir "$OUT/boot"
  BOOT_CKPT=$(json_get "$OUT/boot.json" ckpt)
}
# agent_rl NAME BOOT_CKPT ARGS...: the agent's RL stage from the boot (run.sh's rl, memory.sh's runs).
# --no-dynamic-sampling: a refill round of tool episodes costs a whole round (docs/agent.md); under the
# clock, more and smaller steps. Levels 1-2 (the cpu eval's), where the bootstrapped agent has signal.
agent_rl() {
  local name=$1 boot=$2; shift 2
  run_stage "$name" python train_rl.py --preset "$PRESET" --agent --init-from "$boot" --out-dir "$OUT/$name" \
    --eval-tasks 0 --no-dynamic-sampling --difficulties 1-2 "$@"
}
