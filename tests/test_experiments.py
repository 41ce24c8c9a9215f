"""lab/experiments/*.sh with PRESET=smoke: each runs end to end and writes its markdown table and PNG figures;
lab/experiments/report.py turns stage summaries into rows per run and a mean row per config."""
import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow   # the slow suite: python -m pytest -q -m slow tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


def run_experiment(name, out, **env):
    p = subprocess.run(["bash", f"lab/experiments/{name}.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PRESET="smoke", OUT=str(out), **env))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return (out / "results.md").read_text()


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG


@pytest.fixture(scope="module")
def dense_vs_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense_vs_moe")
    return out, run_experiment("dense_vs_moe", out)


def test_dense_vs_moe(dense_vs_moe):
    out, table = dense_vs_moe
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "_s0" in line}
    assert set(rows) == {"moe_s0", "dense_s0"}
    active = {k: int(v.split("|")[2].strip().replace(",", "")) for k, v in rows.items()}
    assert abs(active["moe_s0"] - active["dense_s0"]) / active["moe_s0"] < 0.01   # equal active parameters
    assert all(is_png(out / f) for f in ("pretrain.png", "rl.png"))


def test_cpt_budget_finding1(tmp_path):
    table = run_experiment("cpt_budget", tmp_path)
    runs = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| b")]
    assert runs == ["b4_s0", "b12_s0", "b36_s0"]
    assert all(is_png(tmp_path / f) for f in ("finding1.png", "cpt_pretrain.png", "cpt_rl.png"))
    losses = [json.loads((tmp_path / f"pretrain_{r}.json").read_text())["val_loss"] for r in runs]
    assert losses[0] > losses[-1]     # the budgets really differ: more continued pretraining, lower loss


@pytest.mark.parametrize("name,runs,extra", [
    ("router_replay", {"replay_s0", "noreplay_s0", "replay_s1", "noreplay_s1"}, {}),
    ("ablations", {"recipe_s0", "grpo_s0", "kl_s0", "recipe_s1", "grpo_s1", "kl_s1", "balance_aux_s0"},
     {"VARIANTS": "recipe grpo kl", "BALANCE": "aux"})])
def test_rl_ablation_over_seeds(name, runs, extra, dense_vs_moe, tmp_path):
    ckpt = json.loads((dense_vs_moe[0] / "pretrain_moe_s0.json").read_text())["ckpt"]
    table = run_experiment(name, tmp_path, CKPT=ckpt, **extra)
    rows = [line.split("|")[1].strip() for line in table.splitlines()[4:] if line.startswith("| ")]
    assert runs <= set(rows)
    assert any("(mean of 2)" in r for r in rows)      # seed noise is shown next to the effect
    assert is_png(tmp_path / "rl.png")


def test_run_stage_resume_keeps_finished_stages(tmp_path):
    """RESUME=1 skips a stage whose summary exists (and only then); a failing stage stops the script."""
    (tmp_path / "done.json").write_text('{"x": 1}\n')
    script = ('set -euo pipefail; source lab/experiments/lib.sh; run_stage done python -c "print(\'{\\"x\\": 2}\')"; '
              'run_stage new python -c "print(\'{\\"y\\": 3}\')"; run_stage bad false; echo unreachable')
    run = lambda resume: subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                                        env=dict(os.environ, OUT=str(tmp_path), RESUME=resume))
    p = run("1")
    assert p.returncode == 1 and "unreachable" not in p.stdout and "stage bad failed" in p.stderr
    assert json.loads((tmp_path / "done.json").read_text()) == {"x": 1}      # kept, not re-run
    assert json.loads((tmp_path / "new.json").read_text()) == {"y": 3}
    run("0")
    assert json.loads((tmp_path / "done.json").read_text()) == {"x": 2}      # without RESUME: run again


def test_memory_trains_each_memory_over_seeds_and_measures_each_under_every_memory(tmp_path):
    p = subprocess.run(["bash", "lab/experiments/memory.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PRESET="smoke", OUT=str(tmp_path), LONG_TASKS="4"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    table = (tmp_path / "memory.md").read_text()
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert {"boot", "summary_s0", "summary_s1", "mask_s0", "mask_s1", "window_s0", "window_s1",
            "summary (mean of 2)", "mask (mean of 2)", "window (mean of 2)"} <= set(rows)
    import torch
    for m in ("summary", "mask", "window"):      # each RL run trained its own memory, as many steps
        run = json.loads((tmp_path / f"rl_{m}_s0.json").read_text())
        assert run["steps"] == 2 and torch.load(run["ckpt"], weights_only=False)["args"]["memory"] == m
        steps = [json.loads(line) for line in open(run["metrics"])]      # the default long share: long tasks
        assert any(s.get("long_pass_rate") is not None for s in steps if "eval" not in s), m
    figs = json.loads((tmp_path / "eval" / "agent.json").read_text())["figures"]
    for f in figs.values():
        assert {"summary/pass@1", "mask/pass@1", "window/pass@1", "oracle_summary/pass@1"} <= set(f)
        assert "agent/pass@1" not in f and f["long/full_tokens_p50"] >= 1.5 * f["long/context"]
    # per slice: the smoke's few long tasks may all fall in one slice (the world draws them)
    assert "summary - mask, all" in table and is_png(tmp_path / "memory.png")
    assert any(f"summary - mask, {s}" in table for s in ("near", "novel"))
