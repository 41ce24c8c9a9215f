"""train_pretrain.py end to end on the smoke preset, as subprocesses (~45 s on 2 idle CPU cores).

All runs share one token/tokenizer cache (--cache-dir), so the tokenizer is trained once.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import env
from data.tasks import generate_tasks, load_humaneval
from tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_pretrain.py")
STEPS = 16                               # the smoke preset's --max-steps


def run(out_dir, cache, *flags, ddp=False, expect=0, timeout=150, patch=None):
    """The script as `python train_pretrain.py ...` (or under torchrun with ddp). patch: Python code run
    first in the same process (a monkeypatch), then the script through runpy, as `python` runs it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if ddp \
        else [sys.executable]
    if patch:
        launcher += ["-c", patch + "\nimport runpy, sys\nsys.argv = sys.argv[1:]\n"
                     "runpy.run_path(sys.argv[0], run_name='__main__')\n"]
    # --device cpu: on a machine with GPUs too, the runs compare gloo on CPU (two processes could not
    # share one GPU, and one process on a GPU would not match them to 1e-5)
    cmd = launcher + [SCRIPT, "--preset", "smoke", "--out-dir", str(out_dir), "--cache-dir", str(cache),
                      "--device", "cpu", *flags]
    # one thread per process: the model is tiny, and 2 cores are shared with the rest of the suite
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == expect, f"exit {p.returncode}\n{p.stderr[-3000:]}"
    return (json.loads(p.stdout.strip().splitlines()[-1]) if expect == 0 else None), p


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f)]


def train_text(summary, tok):
    """Every training token of a run, decoded (documents joined by end-of-text)."""
    return {k: tok.decode(np.fromfile(p, dtype=np.uint16) % tok.vocab_size) for k, p in summary["caches"].items()
            if k.endswith("/train")}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("smoke")
    summary, p = run(out, cache)
    return out, summary, p


def test_smoke_run_end_to_end(smoke):
    out, s, p = smoke
    for f in ("ckpt.pt", "tokenizer.json", "metrics.jsonl"):
        assert (out / f).is_file(), f
    assert s["steps"] == STEPS and s["ckpt"] == str(out / "ckpt.pt") and s["out_dir"] == str(out)
    for k in ("train_loss", "val_loss", "val_bpb", "tokens_per_s", "mfu", "wall_s"):
        assert math.isfinite(s[k]) and s[k] > 0, k
    assert 0 < s["params_active"] < s["params_total"]      # MoE by default
    assert s["val_loss"] < math.log(Tokenizer.load(out / "tokenizer.json").vocab_size)   # it learned something
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        for k, v in r.items():
            assert not isinstance(v, float) or math.isfinite(v), (r["step"], k, v)
    assert "val_bpb" in records[-1] and "moe/max_mean_load" in records[-1] and "sample" in records[-1]
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == STEPS and ckpt["data"]["step"] == STEPS and ckpt["optimizer"]["state"]
    assert Tokenizer.from_dict(ckpt["tokenizer"]).fingerprint() == Tokenizer.load(out / "tokenizer.json").fingerprint()


@pytest.mark.slow   # end to end: a run, stopped, resumed
def test_resume_is_exact_and_keeps_the_runs_arguments(tmp_path, cache):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    s0, _ = run(straight, cache, "--lr", "2e-3")
    half = STEPS // 2
    s1, _ = run(cut, cache, "--lr", "2e-3", "--stop-at-step", str(half))
    assert s1["steps"] == half and torch.load(cut / "ckpt.pt", weights_only=False)["step"] == half
    s2, p = run(cut, cache, "--resume")     # no --lr: the checkpoint's 2e-3 wins over the preset's
    assert "data: prepared before, reused" in p.stderr    # no second preparation of the same data
    assert s2["steps"] == STEPS
    a, b = losses(straight), losses(cut)
    assert len(b) == STEPS and max(abs(x - y) for x, y in zip(a, b)) <= 1e-6, (a, b)
    assert s2["val_loss"] == pytest.approx(s0["val_loss"], abs=1e-6)


@pytest.mark.slow   # DDP: two processes
def test_ddp_two_processes_match_one(smoke, tmp_path, cache):
    out, s, _ = smoke
    s2, _ = run(tmp_path, cache, ddp=True, timeout=240)
    a, b = losses(out), losses(tmp_path)
    assert len(b) == STEPS and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    assert s2["val_loss"] == pytest.approx(s["val_loss"], abs=1e-5)


@pytest.mark.slow   # DDP: two processes
def test_ddp_init_from_a_checkpoint_with_mtp_modules(smoke, tmp_path, cache):
    """MTP modules get no gradient in pretraining; DDP refuses such parameters at the second step,
    so --init-from drops them (train_mtp.py adds them after)."""
    out, _, _ = smoke
    mtp = tmp_path / "mtp"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_mtp.py"), "--preset", "smoke", "--init-from",
                        str(out / "ckpt.pt"), "--out-dir", str(mtp), "--cache-dir", str(cache), "--device", "cpu"], capture_output=True, text=True,
                       timeout=150, cwd=ROOT)
    assert p.returncode == 0 and json.loads(p.stdout.strip().splitlines()[-1])["n_mtp"] >= 1, p.stderr[-2000:]
    s, p = run(tmp_path / "pre", cache, "--init-from", str(mtp / "ckpt.pt"), "--max-steps", "3", ddp=True, timeout=240)
    assert s["steps"] == 3 and "MTP modules are dropped" in p.stderr
    ck = torch.load(s["ckpt"], map_location="cpu", weights_only=False)
    assert ck["model_config"]["n_mtp"] == 0 and not [k for k in ck["model"] if k.startswith("mtp.")]


def test_no_heldout_prompt_in_training_tokens(smoke):
    out, s, _ = smoke
    text = "".join(train_text(s, Tokenizer.load(out / "tokenizer.json")).values())
    assert "def " in text
    prompts = [env.render_prompt(t) for t in generate_tasks("test", 200, seed=0)]
    prompts += [t.prompt for t in load_humaneval()]
    assert not [pr for pr in prompts if pr in text]


@pytest.fixture(scope="module")
def user_data(tmp_path_factory, cache):
    """A --data directory of good files plus every kind of bad file and two held-out leaks, trained
    dense (n_expert 1), so that the upcycling test can start from it."""
    root = tmp_path_factory.mktemp("data")
    src = os.path.join(os.path.dirname(json.__file__))   # the json package: a few small real modules
    for name in sorted(os.listdir(src)):
        if name.endswith(".py"):
            shutil.copy(os.path.join(src, name), root / name)
    for i in range(8):
        (root / f"gen_{i}.py").write_text("".join(f"def f_{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(60)))
    (root / "binary.py").write_bytes(b"x = 1\n\0\0\0\x01\x02")
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (root / "empty.py").write_text("\n\n")
    (root / "huge.py").write_text("y = 2\n" * 200000)    # 1.2 MB > train_pretrain.MAX_FILE_KB (1024 KB)
    (root / "notes.txt").write_text("not a .py file\n")
    he, test_task = load_humaneval()[0], generate_tasks("test", 5, seed=0)[2]
    (root / "leak_he.py").write_text("import math\n\n" + he.prompt + "    return False\n")
    (root / "leak_test.py").write_text("# copied from somewhere\n" + env.corpus_text(test_task))
    jsonl = root.parent / "docs.jsonl"        # a JSONL source too, with one malformed line
    lines = [json.dumps({"text": f"def g_{i}(s):\n    return s.strip() + {i!r} * 3\n" * 4}) for i in range(40)]
    jsonl.write_text("\n".join(lines[:20] + ["{not json", json.dumps({"body": "no text field"})] + lines[20:]) + "\n")
    out = tmp_path_factory.mktemp("dense")
    s, _ = run(out, cache, "--data", f"mine={root}", "--data", str(jsonl), "--mix", "mine=1,data=0.3",
               "--n-expert", "1", "--top-k", "1", "--max-steps", "4")
    return root, out, s, (he, test_task)


def test_bad_files_are_skipped_and_counted_and_leaks_filtered(user_data):
    root, out, s, (he, test_task) = user_data
    assert s["data"]["mine"]["skipped"] == {"binary": 1, "non_utf8": 1, "empty": 1, "huge": 1, "heldout": 2}
    assert s["data"]["data"] == {"docs": 40, "val_docs": 1, "skipped": {"bad_json": 2}}
    assert s["params_active"] == s["params_total"]          # dense
    text = "".join(train_text(s, Tokenizer.load(out / "tokenizer.json")).values())
    assert "def f_" in text and "class JSONDecoder" in text or "class JSONEncoder" in text
    assert he.prompt not in text and env.render_prompt(test_task) not in text


def test_context_extension(user_data, tmp_path, cache):
    _, dense_dir, dense, _ = user_data
    s, p = run(tmp_path, cache, "--init-from", str(dense_dir / "ckpt.pt"), "--seq-len", "256",
               "--batch-tokens", "2048", "--max-steps", "3", "--mix", "tasks=1")
    assert "context extension 128 -> 256" in p.stderr
    cfg = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model_config"]
    assert cfg["seq_len"] == 256
    d = cfg["n_embd"] // cfg["n_head"]
    assert cfg["rope_theta"] == pytest.approx(10000.0 * 2 ** (d / (d - 2)))
    assert s["params_total"] == dense["params_total"] and math.isfinite(s["val_loss"])
    # the checkpoint's tokenizer was reused, not retrained
    assert Tokenizer.load(tmp_path / "tokenizer.json").fingerprint() == \
        Tokenizer.load(dense_dir / "tokenizer.json").fingerprint()


# The weights turn NaN after the 5th optimizer step (GPT.after_optimizer_step runs once per step, after
# it), so the 6th step's forward gives a NaN loss, as a diverged run would.
NAN_AFTER_STEP_5 = """
import torch, model
after_step, steps = model.GPT.after_optimizer_step, []
def after_optimizer_step(self):
    after_step(self)
    steps.append(1)
    if len(steps) == 5:
        with torch.no_grad():
            self.lm_head.weight.fill_(float("nan"))
model.GPT.after_optimizer_step = after_optimizer_step
"""


def test_nan_stops_with_clear_error_and_keeps_last_good_checkpoint(tmp_path, cache):
    _, p = run(tmp_path, cache, "--ckpt-every", "4", patch=NAN_AFTER_STEP_5, expect=2)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "non-finite loss" in err[0] and "step 6" in err[0] and "(step 4)" in err[0]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 4
    assert len(losses(tmp_path)) == 5 and not list(tmp_path.glob("*.tmp.*"))


@pytest.mark.parametrize("flags, message", [
    (["--data", "/nonexistent/dir", "--mix", "data=1"], "no such file or directory"),
    (["--init-from", "/nonexistent/ckpt.pt"], "no checkpoint at"),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in (     # ~1.6 s each: a fresh interpreter
        (["--resume"], "no checkpoint at"),
        (["--data", "mine=DIR"], "has no weight in --mix"),
        (["--source-mb", "-1"], "--source-mb must be >= 0"),
        (["--task-difficulties", "0-2"], "--task-difficulties: difficulties '0-2'"))],
    (["--mix", "stdlib=1,nope=1"], "unknown source"),
    (["--data", "DIR", "--mix", "data=1"], "has no usable documents"),
    (["--expert-hidden", "100"], "use expert_hidden 104 (--expert-hidden)"),   # crashes grouped_mm on a GPU
])
def test_clear_one_line_errors(tmp_path, cache, flags, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no python here\n")
    flags = [f.replace("DIR", str(empty)) for f in flags]
    _, p = run(tmp_path / "out", cache, *flags, expect=2, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], p.stderr
