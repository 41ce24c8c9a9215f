import argparse
import os
import subprocess
import sys

import pytest
import torch

from infra import common, plan

PRESETS = {"smoke": {"steps": 3, "lr": 0.1}, "cpu": {"steps": 100, "lr": 0.01}, "gpu": {"steps": 1000, "lr": 0.001}}


def make_parser():
    p = argparse.ArgumentParser(prog="demo.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, help="steps")
    p.add_argument("--lr", type=float, help="learning rate")
    return p


def test_preset_sets_defaults_and_flags_override(tmp_path):
    args = common.parse_args(make_parser(), PRESETS, ["--preset", "smoke"])
    assert (args.steps, args.lr, args.preset) == (3, 0.1, "smoke")
    args = common.parse_args(make_parser(), PRESETS, ["--preset", "smoke", "--lr", "0.5", "--out-dir", str(tmp_path)])
    assert (args.steps, args.lr, args.out_dir) == (3, 0.5, str(tmp_path))
    args = common.parse_args(make_parser(), PRESETS, [])
    assert args.preset == ("gpu" if torch.cuda.is_available() else "cpu")
    assert args.out_dir == os.path.join("runs", f"demo-{args.preset}")


def test_help_shows_the_chosen_presets_values(capsys):
    for preset, lr in (("smoke", "0.1"), ("cpu", "0.01")):
        with pytest.raises(SystemExit) as e:
            common.parse_args(make_parser(), PRESETS, ["--preset", preset, "--help"])
        assert e.value.code == 0
        assert f"learning rate (default: {lr})" in " ".join(capsys.readouterr().out.split())


def test_unknown_preset_is_an_argparse_error():
    with pytest.raises(SystemExit) as e:
        common.parse_args(make_parser(), PRESETS, ["--preset", "huge"])
    assert e.value.code == 2


def test_atomic_save_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "x.pt"
    common.atomic_save({"a": 1}, path)
    common.atomic_save({"a": 2}, path)
    assert torch.load(path)["a"] == 2
    assert os.listdir(path.parent) == ["x.pt"]


def test_missing_and_corrupt_checkpoint_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        common.load_checkpoint(str(tmp_path / "nope.pt"))
    assert e.value.code == 2
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit):
        common.load_checkpoint(str(bad))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "nope.pt" in err[0] and "bad.pt" in err[1]


def test_typed_options_are_the_flags_on_the_command_line():
    p = make_parser()
    p.add_argument("--data", action="append", default=[])
    p.add_argument("--compile", action="store_true")
    argv = ["--preset", "smoke", "--lr=0.5", "--data", "a", "--compile"]
    args = common.parse_args(p, PRESETS, argv)
    assert args.steps == 3 and args.data == ["a"]
    assert common.typed_options(p, argv) == {"preset", "lr", "data", "compile"}    # not steps: the preset's
    assert common.typed_options(p, ["--steps", "3"]) == {"steps"}                   # typed, even if equal


def test_parse_args_twice_on_one_parser():
    # train_rl.main / eval.main build their parser once at import and may run several times (tests)
    p = make_parser()
    assert common.parse_args(p, PRESETS, ["--preset", "smoke"]).steps == 3
    assert common.parse_args(p, PRESETS, ["--preset", "cpu", "--seed", "2"]).seed == 2


def test_fit_micro_batch_keeps_the_global_batch_and_names_the_fix(capsys):
    assert plan.fit_micro_batch(131072, 1024, 1, 32, typed=False) == (32, 4)
    assert plan.fit_micro_batch(131072, 1024, 8, 32, typed=False) == (16, 1)   # the preset's shrinks
    assert plan.fit_micro_batch(131072, 1024, 16, 32, typed=False) == (8, 1)
    assert plan.fit_micro_batch(3 * 1024, 1024, 1, 2, typed=False) == (1, 3)   # the largest divisor
    with pytest.raises(SystemExit):
        plan.fit_micro_batch(131072, 1024, 8, 32, typed=True)                # a typed one is kept or refused
    assert "use --micro-batch 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.fit_micro_batch(1000, 1024, 8, 32, typed=False)
    assert "use --batch-tokens 8192" in capsys.readouterr().err


def test_device_table_takes_the_longest_name():
    assert plan.device_spec("NVIDIA H100 80GB HBM3")[:2] == ("H100", 989e12)
    assert plan.device_spec("NVIDIA H100 PCIe")[:2] == ("H100 PCIe", 756e12)
    assert plan.device_spec("NVIDIA GH200 480GB")[0] == "GH200"
    assert plan.device_spec("NVIDIA L40S")[0] == "L40S" and plan.device_spec("NVIDIA L4")[0] == "L4"
    assert plan.device_spec("Tesla T4") is None


def test_ddp_on_gpus_is_one_group_with_gloo_for_cpu_tensors(monkeypatch):
    """Under torchrun on GPUs the statistics reduced as CPU tensors need gloo beside NCCL."""
    seen = []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(common.dist, "init_process_group", lambda backend: seen.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    assert common.setup_ddp("auto")[:3] == (0, 0, 2) and seen == ["cpu:gloo,cuda:nccl"]
    assert common.setup_ddp("cpu")[3].type == "cpu" and seen[-1] == "gloo"


@pytest.mark.slow   # 11 interpreters, each paying its imports: ~7 s
def test_argparse_errors_are_one_line_and_exit_code_2():
    """Every script's bad flag is one stderr line `error: ...` and exit code 2 (infra/cli.py's ArgumentParser),
    not argparse's usage block: the scripts, the preset's own pre-parse, a subcommand. Side by side, to keep
    it quick (each pays its imports, about a second)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    unknown = "unrecognized arguments: --no-such-flag"
    cases = [([s, "--preset", "smoke", "--no-such-flag"], unknown) for s in
             ("train_pretrain.py", "train_rl.py", "train_mtp.py", "eval.py", "agent.py")]
    cases += [(["train_rl.py", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
              (["-m", "lab.bench", "--no-such-flag"], unknown), (["-m", "lab.gpu_check", "--no-such-flag"], unknown),
              (["-m", "lab.plot", "runs/x", "--out-dir", "f", "--no-such-flag"], unknown),
              (["-m", "data.tasks", "stats", "--n", "x"], "argument --n: invalid int value: 'x'"),
              (["-m", "lab.experiments.report"], "the following arguments are required: out_dir")]
    procs = [subprocess.Popen([sys.executable] + c, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c, _ in cases]
    for (c, message), p in zip(cases, procs):
        err = p.communicate(timeout=120)[1]
        assert p.returncode == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: {message}"), (c, err)
