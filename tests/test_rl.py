"""Tests for train_rl.py: the algorithm's pieces on hand-made numbers, router replay, and the script
end to end (smoke run, exact resume, 2-process DDP == 1 process, clear errors). < 3 min on 2 cores."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import common
import env
from tasks import generate_tasks
import train_rl as rl
from model import GPT, GPTConfig
from tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# Pure functions

def test_length_cost_values_increasing_concave():
    k, q = 0.01, 0.5
    assert rl.length_cost(0, k, q).item() == 0.0
    assert rl.length_cost(100, k, q).item() == pytest.approx((math.sqrt(2) - 1) / 0.005)   # 82.84
    assert rl.length_cost(50, 0.1, 1.0).item() == pytest.approx(math.log(6) / 0.1)           # q = 1: log
    assert rl.length_cost(37, 0.1, 0.0).item() == pytest.approx(37)                          # q = 0: linear
    c = rl.length_cost(torch.arange(0, 500, 10), k, q)
    d = c.diff()
    assert (d > 0).all(), "increasing"
    assert (d.diff() < 0).all(), "concave: each extra token costs less"


def test_advantages_dr_grpo_vs_grpo():
    r = [1, 0, 0, 0,  1, 1, 1, 1,  1, 0]
    g = [0, 0, 0, 0,  1, 1, 1, 1,  2, 2]
    adv, sig = rl.group_advantages(r, g)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 0.5, -0.5])
    assert sig.tolist() == [True] * 4 + [False] * 4 + [True] * 2        # all-equal group: no signal
    adv, sig = rl.group_advantages(r, g, std=True)                      # GRPO: / unbiased group std
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0, 2 ** -0.5, -2 ** -0.5], abs=1e-5)
    # The reason Dr. GRPO drops the std: a group that differs by a hair gets full-size advantages.
    tiny = [0.01, 0, 0, 0]
    assert rl.group_advantages(tiny, [0] * 4)[0].abs().max().item() < 0.01
    assert rl.group_advantages(tiny, [0] * 4, std=True)[0].abs().max().item() > 1.0
    # A group of one (the rest dropped as sandbox errors) carries no signal.
    assert rl.group_advantages([1.0, 0.0, 1.0], [0, 0, 1])[1].tolist() == [True, True, False]


def test_loss_norms():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float)   # lengths 2 and 4
    loss = torch.tensor([[1, 2, 9, 9], [3, 4, 5, 6]], dtype=torch.float)   # 9s are padding
    total = lambda norm: (rl.token_weights(mask, norm, max_new_tokens=8, n_seqs=2, n_tokens=6) * loss).sum().item()
    assert total("constant") == pytest.approx(21 / (2 * 8))               # Dr. GRPO: / (n_seqs * budget)
    assert total("token") == pytest.approx(21 / 6)                        # DAPO: / all tokens
    assert total("sequence") == pytest.approx((1.5 + 4.5) / 2)            # GRPO: per-sequence mean, then mean
    # Dr. GRPO's point: under "sequence" a token of the short sequence weighs twice one of the long.
    w = rl.token_weights(mask, "sequence", 8, 2, 6)
    assert w[0, 0].item() == pytest.approx(2 * w[1, 0].item())
    assert rl.token_weights(mask, "constant", 8, 2, 6)[0, 0] == rl.token_weights(mask, "constant", 8, 2, 6)[1, 0]


def test_clip_higher():
    old = torch.zeros(1, 6)
    ratios = torch.tensor([[0.7, 0.9, 1.1, 1.25, 1.3, 1.5]])
    for sign in (1.0, -1.0):
        logp = ratios.log().clone().requires_grad_(True)
        loss, clipped = rl.ppo_token_loss(logp, old, torch.tensor([sign]), eps_low=0.2, eps_high=0.28)
        loss.sum().backward()
        moving = logp.grad[0] != 0
        if sign > 0:   # A > 0: the ratio may grow to 1.28 (clip-higher), not beyond; shrinking is never clipped
            assert clipped[0].tolist() == [False, False, False, False, True, True]
        else:          # A < 0: the ratio may shrink to 0.8, not below; growing is never clipped (pessimistic min)
            assert clipped[0].tolist() == [True, False, False, False, False, False]
        assert (moving == ~clipped[0]).all(), "clipped tokens get no gradient, the others do"
    # symmetric clipping (eps_high = eps_low) would already stop 1.25
    assert rl.ppo_token_loss(torch.tensor([[math.log(1.25)]]), torch.zeros(1, 1), torch.tensor([1.0]),
                             0.2, 0.2)[1].item()
    # on-policy (ratio 1): loss = -A per token, gradient = -A * grad log pi (REINFORCE)
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, _ = rl.ppo_token_loss(logp, logp.detach(), torch.tensor([0.5]))
    loss.sum().backward()
    assert loss.tolist() == [[-0.5] * 3] and logp.grad.tolist() == [[-0.5] * 3]


def test_kl_k1():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert rl.kl_k1(logp, ref, mask).tolist() == pytest.approx([0.5 - 1.0 + 0.0, 0.2 + 0.0])


# ---------------------------------------------------------------------------------------------
# Router replay: the training forward on the recorded experts reproduces generation's logprobs

def tiny_moe(vocab=64, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, seq_len=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                         n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=0, balance="bias"))


def test_router_replay_matches_generation():
    model = tiny_moe()
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    gen = model.generate(prompts, max_new_tokens=12, temperature=1.3, return_routes=True,
                         generator=torch.Generator().manual_seed(0))
    samples = [{"prompt_ids": p, **g} for p, g in zip(prompts, gen)]
    idx, tgt, old, routes = rl.collate(samples, 0, model.n_moe_layers, 2, True)
    model.train()
    logp, _ = rl.token_logprobs(model, idx, tgt, routes, temperature=1.3)
    mask = tgt >= 0
    assert mask.sum().item() == sum(len(g["tokens"]) for g in gen)
    assert torch.allclose(logp[mask], old[mask], atol=1e-4), "replayed logprobs == generation logprobs"
    # The routes are really used: other experts give other logprobs ...
    other = (routes + 1) % 4
    logp2, _ = rl.token_logprobs(model, idx, tgt, other, temperature=1.3)
    assert (logp2[mask] - old[mask]).abs().max() > 1e-3
    # ... and the gates still learn under replay (gradients reach the router).
    model.zero_grad()
    (-(logp * mask).sum()).backward()
    router_grads = [m.router.weight.grad for m in model.moe_layers()]
    assert all(g is not None and g.abs().sum() > 0 for g in router_grads)


# ---------------------------------------------------------------------------------------------
# The script end to end, from a tiny checkpoint built here (seconds, independent of pretraining)

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    texts = [env.corpus_text(t) for t in generate_tasks("train", 300, seed=0)]
    tok = train_tokenizer(texts, 320)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=160, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1, balance="bias"))
    with torch.no_grad():   # a loud end-of-text row: completions end at varied lengths (groups differ)
        model.lm_head.weight[tok.eot_id] *= 20
    path = str(d / "tiny.pt")
    common.save_checkpoint(path, model, tok)
    return path


def run(args, nproc=1, timeout=120):
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                               "--master_port", str(29500 + os.getpid() % 1000)] if nproc > 1 else [])
    env_ = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd + ["train_rl.py", "--preset", "smoke", "--device", "cpu"] + args, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env_)
    return p


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval" not in r]


# A length penalty makes every group's rewards differ, so an untrained model (reward 0 everywhere)
# still trains: these tests exercise the update path, not the learning.
SIGNAL = ["--len-penalty", "0.05", "--len-k", "0.1"]


def test_smoke_run_end_to_end(tiny_ckpt, tmp_path):
    out = str(tmp_path / "rl")
    p = run(["--init-from", tiny_ckpt, "--out-dir", out] + SIGNAL)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    for k in ("pass@1_before", "pass@1_after", "pass@8_before", "pass@8_after"):
        assert 0.0 <= s[k] <= 1.0
    assert s["steps"] == 2 and os.path.isfile(s["ckpt"]) and s["out_dir"] == out
    assert set(s["time_split"]) >= {"gen_s", "sandbox_s", "train_s", "eval_s"}
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("reward", "pass_rate", "zero_var_frac", "len_mean", "len_max", "entropy", "kl_old",
                  "clip_frac", "gen_s", "sandbox_s", "train_s", "loss", "canary_samples"):
            assert math.isfinite(r[k]), k
        assert r["trained_seqs"] > 0
        assert r["logp_mismatch"] < 1e-3, "router replay + on-policy: training logprobs == sampling logprobs"
        assert sum(v for k, v in r.items() if k.startswith("outcome/")) > 0
    assert rows[0]["canary_samples"] > 0          # smoke preset mixes a canary in at step 0
    ck = torch.load(s["ckpt"], weights_only=False)
    assert ck["step"] == 2 and ck["stream_pos"] == [4] and "optimizer" in ck and ck["kind"] == "rl"
    common.load_checkpoint(s["ckpt"])              # loadable by eval.py and friends


def test_resume_is_exact(tiny_ckpt, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = ["--init-from", tiny_ckpt, "--no-eval", "--canary-every", "0"] + SIGNAL
    p = run(base + ["--out-dir", a, "--steps", "3"])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(base + ["--out-dir", b, "--steps", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(base + ["--out-dir", b, "--steps", "3", "--resume"])
    assert p.returncode == 0, p.stderr[-3000:]
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra, rb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-9)
        assert x["reward"] == pytest.approx(y["reward"], rel=1e-6)
    # a fresh run (no --resume) into a used directory replaces the old run's log, as it does ckpt.pt
    p = run(base + ["--out-dir", a, "--steps", "1"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in metrics(a)] == [1]


def test_dynamic_sampling_refills_zero_variance_groups(tiny_ckpt, tmp_path):
    # The untrained model fails every task, so without a length penalty every group is all-zero:
    # dynamic sampling draws fresh tasks up to --ds-max-tries more times, then skips the update.
    base = ["--init-from", tiny_ckpt, "--no-eval", "--canary-every", "0", "--steps", "1"]
    out = str(tmp_path / "ds")
    p = run(base + ["--out-dir", out, "--dynamic-sampling", "--ds-max-tries", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = metrics(out)
    assert r["rounds"] == 3 and r["zero_var_frac"] == 1.0 and r["trained_seqs"] == 0
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["stream_pos"] == [6]  # 3 rounds x 2 tasks
    # --no-dynamic-sampling never refills: one round, nothing to train on
    out = str(tmp_path / "no-ds")
    p = run(base + ["--out-dir", out, "--no-dynamic-sampling"])
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = metrics(out)
    assert r["rounds"] == 1 and r["trained_seqs"] == 0


def test_ddp_two_processes_equal_one(tiny_ckpt, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    base = ["--init-from", tiny_ckpt, "--no-eval", "--canary-every", "0", "--batch-tasks", "4",
            "--group-size", "3", "--micro-batch", "4", "--sample-seeding", "task"] + SIGNAL
    p1 = run(base + ["--out-dir", one])
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = run(base + ["--out-dir", two], nproc=2, timeout=170)
    assert p2.returncode == 0, p2.stderr[-3000:]
    r1, r2 = metrics(one), metrics(two)
    assert len(r1) == len(r2) == 2
    for x, y in zip(r1, r2):
        assert x["trained_seqs"] == y["trained_seqs"] >= 6
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-7)
        assert x["reward"] == pytest.approx(y["reward"], rel=1e-6)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
    assert torch.load(os.path.join(two, "ckpt.pt"), weights_only=False)["stream_pos"] == [4, 4]


# ---------------------------------------------------------------------------------------------
# Clear errors (in-process: each dies with a one-line message before doing any work)

def fails(argv, capsys):
    with pytest.raises(SystemExit) as e:
        rl.main(["--preset", "smoke", "--device", "cpu"] + argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_errors(tiny_ckpt, tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "x")]
    assert "no checkpoint at" in fails(["--init-from", str(tmp_path / "nope.pt")] + out, capsys)
    assert "--init-from CKPT is required" in fails(out, capsys)
    assert "--resume: no checkpoint" in fails(["--resume"] + out, capsys)
    err = fails(["--init-from", tiny_ckpt, "--difficulties", "99"] + out, capsys)
    assert "empty train task set" in err or "cannot generate tasks" in err
    # a checkpoint whose tokenizer has more tokens than the model's vocabulary
    ck = torch.load(tiny_ckpt, weights_only=False)
    small = GPT(GPTConfig(**{**ck["model_config"], "vocab_size": 100}))
    bad = str(tmp_path / "bad.pt")
    from tokenizer import Tokenizer
    common.save_checkpoint(bad, small, Tokenizer.from_dict(ck["tokenizer"]))
    err = fails(["--init-from", bad] + out, capsys)
    assert "tokenizer has" in err and "model only 100" in err
