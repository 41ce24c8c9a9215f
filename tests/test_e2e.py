"""End to end: run.sh with the smoke presets (pretrain -> mtp -> rl -> eval -> plots) in a temporary directory;
every artefact must exist and every metric of every stage's summary must be finite."""
import pytest
import json
import math
import os
import re
import subprocess

pytestmark = pytest.mark.slow   # the slow suite: python -m pytest -q -m slow tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finite_numbers(obj, path=""):
    """Yield (path, value) for every number inside a JSON value."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from finite_numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from finite_numbers(v, f"{path}[{i}]")


def test_run_sh_smoke_end_to_end(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PRESET="smoke", OUT=str(out))
    p = subprocess.run(["bash", "run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for rel in ["pretrain/ckpt.pt", "pretrain/metrics.jsonl", "pretrain/tokenizer.json", "mtp/ckpt.pt", "mtp.log", "rl/ckpt.pt",
                "rl/metrics.jsonl", "eval/eval.md", "eval/eval.json", "pretrain.log", "rl.log", "eval.log",
                "eval/pretrain.png", "eval/rl.png", "eval/rl_time.png"]:
        assert (out / rel).is_file() and (out / rel).stat().st_size > 0, rel
    summaries = {s: json.loads((out / f"{s}.json").read_text()) for s in ("pretrain", "mtp", "rl", "eval")}
    for stage, summary in summaries.items():
        numbers = list(finite_numbers(summary))
        assert numbers, stage
        bad = [(k, v) for k, v in numbers if not math.isfinite(v)]
        assert not bad, (stage, bad)
    assert summaries["pretrain"]["val_bpb"] > 0
    assert summaries["mtp"]["ckpt"] == str(out / "mtp" / "ckpt.pt") and 0 <= summaries["mtp"]["mtp_top1_agreement"][0] <= 1
    for key in ("pass@1_before", "pass@1_after", "pass@8_before", "pass@8_after"):
        assert 0.0 <= summaries["rl"][key] <= 1.0, key
    for line in (out / "rl" / "metrics.jsonl").read_text().splitlines():
        for k, v in finite_numbers(json.loads(line)):
            assert math.isfinite(v), (k, v)
    # the side-by-side table has a column for each checkpoint, on held-out tasks of a seed no recipe was tuned on
    table = (out / "eval" / "eval.md").read_text()
    assert "pretrained" in table and "rl" in table
    assert "env test split, seed 11," in table and "seed 0," not in table
    assert set(summaries["eval"]["checkpoints"]) == {"pretrained", "rl"}
    assert "artefacts:" in p.stdout


def test_run_sh_agent_smoke_runs_the_summary_turn_and_reports_its_keys(tmp_path):
    """AGENT=1: pretrain -> boot -> rl (short tasks) -> eval -> plots; the eval stage gives, per checkpoint,
    the agent's keys and the long tasks' (each memory, the oracle summary, what a whole episode needs)."""
    out = tmp_path / "agent"
    env = dict(os.environ, PRESET="smoke", OUT=str(out), AGENT="1")
    p = subprocess.run(["bash", "run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    figs = json.loads((out / "eval.json").read_text())["checkpoints"]
    assert set(figs) == {"boot", "rl"}
    boot = json.loads((out / "boot.json").read_text())     # the teacher's actions on what it was shown
    assert 0.0 <= boot["unpredictable_actions"] == boot["data"]["agent"]["unpredictable_actions"] < 0.5
    assert "search/pass@1" in figs["boot"]
    for f in figs.values():
        for key in ("agent/pass@1", "oracle/pass@1", "no_run/pass@1", "summary/pass@1", "mask/pass@1",
                    "window/pass@1", "oracle_summary/pass@1", "summary/slice=novel/pass@1", "summary/per_episode",
                    "mask/per_episode"):
            assert 0.0 <= f[key] <= 8, key
        assert "summary/fact_retention" in f and "summary/pass@1 - window" in f and "summary/pass@1 - mask" in f
        assert f["long/full_tokens_p50"] >= 1.5 * f["long/context"]
    steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    # run.sh's RL trains on short tasks only (--long-share 0): no step had a long task to report
    assert steps and all(s["long_pass_rate"] is None and s["summaries_per_episode"] is None
                         for s in steps if "eval" not in s)
    assert "summary/pass@1" in (out / "eval" / "agent.md").read_text()


def test_eval_cpu_preset_measures_the_levels_rl_is_measured_on():
    """The cpu eval (run.sh's eval stage) draws held-out tasks of the levels the cpu RL preset evaluates,
    not the world's own mix (mostly levels 4-5, where every model here scores ~0)."""
    import eval as evaluation
    import train_rl
    assert evaluation.PRESETS["cpu"]["difficulties"] == train_rl.PRESETS["cpu"]["eval_difficulties"] == "1-2"


def test_run_sh_stops_at_first_failing_stage(tmp_path):
    """A broken stage stops the script with that stage's error, and later stages never run."""
    out = tmp_path / "run"
    env = dict(os.environ, PRESET="no-such-preset", OUT=str(out))
    p = subprocess.run(["bash", "run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "stage pretrain failed" in p.stderr
    assert "invalid choice" in p.stderr           # argparse's own message, shown from the stage log
    assert not (out / "rl.log").exists()


def test_run_sh_turns_builds_repair_data_and_runs_episodes(tmp_path):
    """TURNS=2: a continued pretraining of the base adds repair transcripts, single-turn RL starts
    from it, RL with repair groups from that, and eval reports the self-repair curve (a list of two
    values per checkpoint) of all three."""
    out = tmp_path / "run"
    env = dict(os.environ, PRESET="smoke", OUT=str(out), TURNS="2")
    p = subprocess.run(["bash", "run.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    stage = dict(re.findall(r"^=== stage (\w+): (.*)$", p.stdout, re.M))   # each stage's command line
    assert "--repair-frac 0.25" in stage["repair"]
    assert f"--init-from {out}/repair/ckpt.pt" in stage["rl1"] and "--turns 1" in stage["rl1"]
    assert f"--init-from {out}/rl1/ckpt.pt" in stage["rl"]
    assert "--turns 1 --repair-groups --task-seed 2 --eval-tasks 0" in stage["rl"]
    assert f"--ckpt {out}/repair/ckpt.pt --ckpt {out}/rl1/ckpt.pt --ckpt {out}/rl/ckpt.pt" in stage["eval"]
    repair = json.loads((out / "repair.json").read_text())
    assert repair["data"]["tasks"]["docs"] > 0 and (out / "pretrain" / "ckpt.pt").is_file()
    rl1 = json.loads((out / "rl1.json").read_text())
    assert rl1["steps"] > 0 and "pass@1_by_turn_after" not in rl1     # single-turn
    rl = json.loads((out / "rl.json").read_text())
    assert rl["steps"] > 0 and rl["pass@1_after"] is None           # no in-run evals: the eval stage's job
    with open(out / "rl" / "metrics.jsonl") as f:
        assert all("repair_roots" in r for r in map(json.loads, f) if "eval" not in r)
    ev = json.loads((out / "eval.json").read_text())
    labels = {"repair-base", "rl-1turn", "rl"}
    assert {k: len(v) for k, v in ev["pass@1_by_turn"].items()} == dict.fromkeys(labels, 2)
    assert set(ev["pass@2_resample"]) == labels
