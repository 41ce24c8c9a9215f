"""lab/plot.py: PNG figures from metrics.jsonl files, several runs overlaid; clear errors on bad input."""
import json
import os
import subprocess
import sys

import pytest

from lab import plot


def write_run(d, records):
    d.mkdir(parents=True)
    lines = [json.dumps(r) for r in records]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 9, \"torn")  # a run killed mid-write


def fake_runsh_dir(root, scale=1.0):
    write_run(root / "pretrain", [{"step": s, "loss": 3.0 / s, "tokens": 1000 * s,
                                   **({"val_bpb": 1.5 / s} if s % 2 == 0 else {})} for s in range(1, 7)])
    rl = []
    for s in range(1, 6):
        rl.append({"step": s, "reward": 0.1 * s * scale, "pass_rate": 0.1 * s, "entropy": 0.5, "zero_var_frac": 0.4,
                   "len_mean": 20 + s, "gen_s": 1.0, "sandbox_s": 0.5, "train_s": 0.7})
        if s in (1, 5):
            rl.append({"eval": "before" if s == 1 else "after", "step": s, "pass@1": 0.2 * s / 5, "pass@8": 0.5,
                       "pass@1_near": 0.3, "pass@1_novel": 0.1, "pass@8_novel": 0.4, "eval_s": 2.0})
    write_run(root / "rl", rl)


def test_figures_from_two_runsh_dirs(tmp_path):
    fake_runsh_dir(tmp_path / "a")
    fake_runsh_dir(tmp_path / "b", scale=2.0)
    out = tmp_path / "figs"
    p = subprocess.run([sys.executable, "-m", "lab.plot", str(tmp_path / "a"), str(tmp_path / "b"), "--label", "A",
                        "--label", "B", "--out-dir", str(out)], cwd=os.path.dirname(os.path.dirname(plot.__file__)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert summary["runs"] == 4
    assert sorted(f.rsplit("/", 1)[1] for f in summary["figures"]) == ["pretrain.png", "rl.png", "rl_time.png"]
    for f in summary["figures"]:
        with open(f, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_eval_keys_found_per_slice(tmp_path):
    fake_runsh_dir(tmp_path / "a")
    runs = plot.find_runs([str(tmp_path / "a" / "rl")], [])
    assert [k for k, _, _ in runs] == ["rl"]
    assert plot.eval_keys(runs[0][2]) == ["pass@1", "pass@1_near", "pass@1_novel", "pass@8", "pass@8_novel"]
    assert plot.series(runs[0][2], "pass@1_novel") == ([1, 5], [0.1, 0.1])


def test_bad_input_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path), "--out-dir", str(tmp_path / "f")])
    assert "no metrics.jsonl" in capsys.readouterr().err
    fake_runsh_dir(tmp_path / "a")
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "a"), "--label", "x", "--label", "y", "--out-dir", str(tmp_path / "f")])
    assert "--label" in capsys.readouterr().err
