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
