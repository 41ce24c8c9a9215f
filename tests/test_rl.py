"""Tests for rl/algo.py, rl/rollouts.py and train_rl.py: the algorithm's pieces (rl/algo.py) on hand-made numbers, router replay,
and the script end to end (smoke run, exact resume, 2-process DDP == 1 process, clear errors).
< 3 min on 2 cores."""
import concurrent.futures
import json
import math
import os
import pickle
import subprocess
import sys
import zlib

import pytest
import torch

from types import SimpleNamespace

from infra import common
import env
from sandbox import Result
import sampling
from data.tasks import generate_tasks
from rl import algo as rl
from rl import rollouts
import train_rl
from model import GPT, GPTConfig
from tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def seq(prompt_ids, g):
    """A one-turn training Sequence from a prompt and a sampling.generate output (tokens, logprobs, routes)."""
    return rl.Sequence([env.Turn(prompt_ids, g["tokens"], g["logprobs"], routes=g.get("routes"))],
                       episode_tokens=len(g["tokens"]))

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


def test_dynamic_sampling_filters_on_correctness():
    # Two groups: all fail (shaped by a length penalty, so their shaped rewards differ) and mixed.
    correct = [0, 0, 0,  1, 0, 1]
    shaped = [-0.1, -0.3, -0.2,  0.9, -0.1, 0.8]
    g = [0, 0, 0,  1, 1, 1]
    adv, sig = rl.group_advantages(shaped, g)
    assert sig.tolist() == [True] * 6                                   # the shaped reward varies everywhere
    adv2, sig = rl.group_advantages(shaped, g, signal_from=correct)
    assert sig.tolist() == [False] * 3 + [True] * 3                     # DAPO: only correctness decides
    assert adv2.tolist() == pytest.approx(adv.tolist())                 # the advantages stay the shaped ones
    assert adv2[3:].tolist() == pytest.approx([0.9 - 1.6 / 3, -0.1 - 1.6 / 3, 0.8 - 1.6 / 3])


def test_pass_sums_weigh_by_tasks_scored():
    # (slice, valid samples, correct): the last task lost all its samples to sandbox errors, the
    # third has fewer valid samples than k = 4 and so no pass@4 (not a pass@4 of 0).
    per_task = [("near", 4, 1), ("novel", 4, 0), ("near", 2, 2), ("novel", 0, 0)]
    s = rl.pass_sums(per_task, (1, 4))
    assert s["pass@1"] == pytest.approx([0.25 + 0 + 1.0, 3])
    assert s["pass@1_near"] == pytest.approx([1.25, 2]) and s["pass@1_novel"] == pytest.approx([0.0, 1])
    assert s["pass@4"] == pytest.approx([1.0, 2])                        # 1 - C(3,4)/C(4,4) = 1, and 0
    assert s["pass@4_near"] == pytest.approx([1.0, 1]) and s["pass@4_novel"] == pytest.approx([0.0, 1])
    # Two ranks combine by summing: rank A scored 1 task (pass 1.0), rank B 3 tasks (0 each) -> 0.25,
    # whatever the tasks each was assigned.
    a, b = rl.pass_sums([("", 1, 1)], (1,)), rl.pass_sums([("", 1, 0)] * 3 + [("", 0, 0)] * 5, (1,))
    assert (a["pass@1"][0] + b["pass@1"][0]) / (a["pass@1"][1] + b["pass@1"][1]) == 0.25


def test_mixed_group_odds():
    odds = rl.mixed_group_odds(torch.tensor([0.5, 0.1, 1.0, 0.0]).log(), 8)
    assert odds.tolist() == pytest.approx([1 - 2 * 0.5 ** 8, 1 - 0.1 ** 8 - 0.9 ** 8, 0.0, 0.0])
    assert rl.mixed_group_odds(torch.tensor(0.5).log(), 2).item() == pytest.approx(0.5)


def test_prefilter_keeps_the_tasks_likeliest_to_give_a_mixed_group(tiny_ckpt, monkeypatch):
    # The policy's log-probability of each reference solution is faked (one value per candidate, in
    # order); the real part is what the prefilter feeds the model and which tasks it keeps.
    model, tok, _ = common.load_checkpoint(tiny_ckpt, "cpu")
    q = [1e-4, 0.5, 0.99, 0.2, 1e-3, 0.9999]              # mixed-group odds (G 8): 0.99 and 0.83 are best
    cands = generate_tasks("train", len(q), seed=0)
    fed = []

    def fake_logprobs(model, idx, tgt, routes, temperature, valid):
        fed.extend((tgt >= 0).sum(-1).tolist())
        rows = [math.log(q[len(fed) - len(idx) + i]) for i in range(len(idx))]
        return (tgt >= 0) * torch.tensor(rows)[:, None] / (tgt >= 0).sum(-1, keepdim=True), None
    monkeypatch.setattr(rollouts, "token_logprobs", fake_logprobs)
    args = SimpleNamespace(max_new_tokens=96, micro_batch=4, temperature=1.0, group_size=8)
    ctx = SimpleNamespace(model=model, tok=tok, args=args, device=torch.device("cpu"))
    stats = rollouts.new_stats(SimpleNamespace(ppo_epochs=1))
    kept = rollouts.prefilter(ctx, cands, 2, stats)
    assert [t.task_id for t in kept] == [cands[1].task_id, cands[3].task_id]
    assert fed == [min(len(tok.encode(t.solution)) + 1, 96) for t in cands]   # each reference body + end-of-text, cut
    assert stats["prefilter_n"] == 2 and stats["prefilter_kept"] > stats["prefilter_all"]
    assert rollouts.prefilter(ctx, cands[:2], 2, stats) == cands[:2]    # nothing to choose: all kept


def test_prefilter_check_scores_kept_and_dropped_tasks(tiny_ckpt, capsys):
    from lab.experiments import prefilter_check
    s = prefilter_check.main(["--ckpt", tiny_ckpt, "--n-tasks", "6", "--k", "2", "--max-new-tokens", "8",
                              "--group-size", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == s
    assert (s["kept"]["tasks"], s["dropped"]["tasks"], s["all"]["tasks"]) == (3, 3, 6)
    assert sum(s["all"]["levels"].values()) == 6 and 0 <= s["all"]["mixed"] <= 1


def test_refills_sample_full_batches_and_queue_the_surplus(monkeypatch):
    # per rank 4 groups; a generation batch holds 4 tasks (gen_batch 8 / group 2). A fake rollout gives
    # a mixed group (one pass, one fail) to the first k tasks of a round and a failed one to the rest,
    # k from `informative`; group g<key> is task <key>'s. Training is recorded, not run: which tasks
    # were asked for, and what each step trains on, is all that is checked.
    args = SimpleNamespace(dynamic_sampling=True, ds_max_tries=3, gen_batch=8, group_size=2, prefilter=1,
                           adv_std=False, len_penalty=0.0, lr=1e-3, warmup_steps=0, lr_schedule="constant",
                           ppo_epochs=1)
    informative = iter([2, 3, 4, 0, 0, 0, 1])       # informative groups found by successive rounds
    asked, trained = [], []

    def fake_rollout(ctx, tasks, seed, stats):
        asked.append(len(tasks))
        k = next(informative)
        samples = [env.Episode(i, [env.Turn([t.key], [j], [0.0], completion="x")], group=i)
                   for i, t in enumerate(tasks) for j in range(2)]
        wins = [s.task_idx < k and s.turns[0].tokens == [0] for s in samples]
        return samples, [Result(float(w), w, "pass" if w else "wrong_answer", "", int(w), 1) for w in wins]
    def fake_tasks(ctx, n):
        pos = ctx.state["stream_pos"]
        ctx.state["stream_pos"] += n
        return [SimpleNamespace(difficulty=1, key=k) for k in range(pos, pos + n)]
    def recorded(ctx, groups):      # the step's groups, as names
        trained.append([f"g{g[0].turns[0].prompt_ids[0]}" for g in groups])
        return [], [], train_rl.Counts(0, 0, 0, 0)
    monkeypatch.setattr(rollouts, "next_tasks", fake_tasks)
    monkeypatch.setattr(train_rl, "training_batches", recorded)
    ctx = SimpleNamespace(args=args, per_rank=4, rank=0, ref=None, rollout=fake_rollout,
                          state={"queue": [], "stream_pos": 0}, optimizer=SimpleNamespace(param_groups=[]),
                          model=SimpleNamespace(n_moe_layers=0, train=lambda: None))
    queued = lambda: [f"g{g[0].turns[0].prompt_ids[0]}" for g in ctx.state["queue"]]
    s1 = train_rl.rl_step(ctx, 0)
    assert asked == [4, 4] and trained[0] == ["g0", "g1", "g4", "g5"]   # 2 + 3 found: the refill sampled 4 tasks, not 2
    assert queued() == ["g6"] and s1["rounds"] == 2                    # the surplus waits for the next step
    s2 = train_rl.rl_step(ctx, 1)
    assert asked == [4, 4, 4] and trained[1] == ["g6", "g8", "g9", "g10"] and queued() == ["g11"]
    assert s2["queued_groups"] == 1 and s2["groups"] == 4 and s2["zero_var_groups"] == 0
    s3 = train_rl.rl_step(ctx, 2)                             # nothing informative: 4 rounds, then give up
    assert asked[3:] == [4, 4, 4, 4] and trained[2] == ["g11", "g24"] and queued() == []
    assert s3["rounds"] == 4 and s3["zero_var_groups"] == 15 and s3["signal/d1"] == 1
    names = [g for t in trained for g in t]
    assert len(names) == len(set(names)), "no group is trained on twice"


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
    gen = sampling.reference(model, prompts, max_new_tokens=12, temperature=1.3, return_routes=True,
                         generator=torch.Generator().manual_seed(0))
    samples = [seq(p, g) for p, g in zip(prompts, gen)]
    idx, tgt, old, routes, valid = rl.collate(samples, 0, model.n_moe_layers, 2, True)
    model.train()
    logp, _ = rl.token_logprobs(model, idx, tgt, routes, temperature=1.3, valid=valid)
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


def test_padding_batch_runs_the_moe_and_adds_nothing():
    # A DDP rank with fewer micro-batches than another runs padding_batch forwards: the MoE runs (with
    # balance="aux" every training forward all-reduces expert loads), but no position counts as load,
    # and the loss, its statistics and every gradient are zero.
    model = tiny_moe()
    model.train()
    args = SimpleNamespace(temperature=1.0, eps_low=0.2, eps_high=0.28, loss_norm="constant", batch_tasks=2,
                           group_size=2, max_new_tokens=8, moe_aux_scale=0.0, ppo_epochs=1)
    ctx = SimpleNamespace(args=args, model=model, device=torch.device("cpu"), replay=True,
                          tok=SimpleNamespace(eot_id=1, pad_id=0))
    stats = rollouts.new_stats(args)
    train_rl.micro_batch_loss(ctx, train_rl.padding_batch(ctx), [0.0], train_rl.Counts(4, 10, 30, 1), stats, 0)
    assert all(m.load is not None and m.load.sum() == 0 for m in model.moe_layers())
    assert all(q.grad is None or not q.grad.any() for q in model.parameters())
    assert all(v == 0 for k, v in stats.items() if k.endswith("_e0"))


def test_router_replay_flag():
    parse = lambda *a: common.parse_args(train_rl.p, train_rl.PRESETS, ["--preset", "smoke", *a]).router_replay
    assert parse() and parse("--router-replay") and not parse("--no-router-replay")


def test_packed_groups_give_collates_logprobs_and_gradients():
    # Two groups of three samples each (prompts of different lengths, samples ending at different
    # lengths), interleaved: pack_groups feeds each prompt once, collate feeds it per sample.
    model = tiny_moe()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10]] * 3
    gen = sampling.reference(model, prompts, max_new_tokens=10, temperature=1.3, return_routes=True, stop_ids=tuple(range(0, 64, 5)),
                         generator=torch.Generator().manual_seed(1))
    samples = [seq(p, g) for p, g in zip(prompts, gen)]
    assert len({len(g["tokens"]) for g in gen}) > 1
    model.train()
    grads = []
    for packed in (False, True):
        if packed:
            idx, tgt, old, routes, valid, layout = rl.pack_groups(samples, 0, model.n_moe_layers, 2, True)
            assert idx.shape[0] == 2 and valid.sum() == rl.packed_len(samples) == 7 + 2 + sum(len(g["tokens"]) - 1
                                                                                   for g in gen)
        else:
            (idx, tgt, old, routes, valid), layout = rl.collate(samples, 0, model.n_moe_layers, 2, True), {}
        model.zero_grad()
        logp, ent = rl.token_logprobs(model, idx, tgt, routes, 1.3, valid, **layout)
        m = tgt >= 0
        assert torch.allclose(logp[m], old[m], atol=1e-4), "replayed logprobs == generation logprobs"
        (-(logp * m).sum() - ent[m].sum().detach()).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        per_sample = [logp[i][m[i]] for i in range(len(samples))]
        if not packed:
            first = per_sample
    for a, b in zip(first, per_sample):
        assert torch.allclose(a, b, atol=1e-5)
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_micro_batches_keep_groups_whole_and_tensors_line_up_with_their_samples():
    # Three groups: prompts of 4, 2 and 3 tokens; completions of 3 and 1, 5 x 3, 2 x 2 tokens, each
    # sample with tokens and log-probs of its own, so a sample in the wrong row shows.
    k = iter(range(100))
    s = lambda p, n: (lambda j: seq(list(range(1, p + 1)), {"tokens": list(range(10 * j, 10 * j + n)),
                                                         "logprobs": [-0.1 * j] * n}))(next(k))
    groups = [[s(4, 3), s(4, 1)], [s(2, 5), s(2, 5), s(2, 5)], [s(3, 2), s(3, 2)]]
    # packed: whole groups sorted by packed length (4 + 2 + 0 = 6, 2 + 3*4 = 14, 3 + 1 + 1 = 5), up to `size` samples
    packed = rl.micro_batches(groups, 3, pack=True)
    assert packed == [groups[2], groups[0], groups[1]] and [rl.packed_len(mb) for mb in packed] == [5, 6, 14]
    assert rl.micro_batches(groups, 4, pack=True) == [groups[2] + groups[0], groups[1]]    # 2 + 2 <= 4: one forward
    # unpacked: single samples sorted by the length fed (prompt + tokens - 1: 6, 4 | 6, 6, 6 | 4, 4), 3 each
    flat = rl.micro_batches(groups, 3, pack=False)
    assert flat == [[groups[0][1], groups[2][0], groups[2][1]], [groups[0][0]] + groups[1][:2], groups[1][2:]]
    for mbs, pack, fed in ((packed, True, 5 + 6 + 14), (flat, False, 6 + 4 + 3 * 6 + 4 + 4)):
        t = [rl.batch_tensors(mb, 0, 0, 1, False, pack) for mb in mbs]
        for mb, (_, tgt, old, *_) in zip(mbs, t):    # row i = sample i: its tokens, its log-probs
            assert tgt.size(0) == len(mb)
            for i, x in enumerate(mb):
                assert tgt[i][tgt[i] >= 0].tolist() == x.turns[0].tokens
                assert torch.allclose(old[i][tgt[i] >= 0], torch.tensor(x.turns[0].logprobs))
        assert fed == sum(rl.packed_len(mb) if pack else sum(len(rl.flatten(x)[0]) for x in mb) for mb in mbs)
        n_tokens = sum(rl.n_generated(x) for g in groups for x in g)
        assert train_rl.global_counts(SimpleNamespace(ddp=False), t) == (7, n_tokens, fed, len(mbs)) == (7, 23, fed, 3)
    # an episode of two turns: every token it wrote is a target, the feedback is fed, never a target
    ep = rl.Sequence([env.Turn([1, 2], [5, 6], [-1.0, -2.0]), env.Turn([3], [7, 8, 9], [-3.0, -4.0, -5.0])])
    _, tgt, old, _, valid, layout, *_ = rl.batch_tensors([ep], 0, 0, 1, False, False)
    assert tgt[0][tgt[0] >= 0].tolist() == [5, 6, 7, 8, 9] and old[0][tgt[0] >= 0].tolist() == [-1, -2, -3, -4, -5]
    assert valid.sum() == len(rl.flatten(ep)[0]) == 2 + 1 + 1 + 2 and rl.n_generated(ep) == 5
    assert list(layout) == ["at"] and layout["at"].tolist() == (tgt[0] >= 0).nonzero().squeeze(1).tolist()


# ---------------------------------------------------------------------------------------------
# The script end to end, from a tiny checkpoint built here (seconds, independent of pretraining)

def make_tiny_ckpt(d, balance):
    texts = [env.corpus_text(t) for t in generate_tasks("train", 300, seed=0)]
    tok = train_tokenizer(texts, 320)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=160, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1, balance=balance))
    with torch.no_grad():   # a loud end-of-text row: completions end at varied lengths (groups differ)
        model.lm_head.weight[tok.eot_id] *= 20
    path = str(d / f"tiny-{balance}.pt")
    common.save_checkpoint(path, model, tok)
    return path


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_tiny_ckpt(tmp_path_factory.mktemp("rl"), "bias")


@pytest.fixture(scope="module")
def tiny_aux_ckpt(tmp_path_factory):
    return make_tiny_ckpt(tmp_path_factory.mktemp("rl-aux"), "aux")


def run(args, nproc=1, timeout=120, **settings):
    """train_rl.py in processes of its own (torchrun for nproc > 1), with train_rl.FIXED settings
    through tests/rl_main.py."""
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                               "--master_port", str(29500 + os.getpid() % 1000)] if nproc > 1 else [])
    env_ = dict(os.environ, OMP_NUM_THREADS="1")
    fixed = json.dumps(settings)
    p = subprocess.run(cmd + ["tests/rl_main.py", fixed, "--preset", "smoke", "--device", "cpu"] + args, cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env_)
    return p


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval" not in r]


# A length penalty makes every group's rewards differ, so an untrained model (reward 0 everywhere)
# still trains: these tests exercise the update path, not the learning.
SIGNAL, SIGNAL_K = ["--len-penalty", "0.05"], dict(len_k=0.1)


def test_smoke_run_end_to_end(tiny_ckpt, tmp_path):
    out = str(tmp_path / "rl")
    p = run(["--init-from", tiny_ckpt, "--out-dir", out] + SIGNAL, **SIGNAL_K)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    for k in ("pass@1_before", "pass@1_after", "pass@8_before", "pass@8_after"):
        assert 0.0 <= s[k] <= 1.0
    assert s["eval_seed"] == 0 and "pass@1_novel_after" in s and "pass@8_near_before" in s
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


@pytest.mark.slow   # end to end: a run, stopped, resumed
def test_resume_is_exact(tiny_ckpt, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = ["--init-from", tiny_ckpt, "--eval-tasks", "0", "--prefilter", "2"] + SIGNAL
    fixed = dict(SIGNAL_K, canary_every=0)
    p = run(base + ["--out-dir", a, "--steps", "3"], **fixed)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(base + ["--out-dir", b, "--steps", "2"], **fixed)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run(base + ["--out-dir", b, "--steps", "3", "--resume"], **fixed)
    assert p.returncode == 0, p.stderr[-3000:]
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3] and all(r["prefilter_odds_kept"] >= 0 for r in ra + rb)
    for x, y in zip(ra, rb):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-9)
        assert x["reward"] == pytest.approx(y["reward"], rel=1e-6)
    # a fresh run (no --resume) into a used directory replaces the old run's log, as it does ckpt.pt
    p = run(base + ["--out-dir", a, "--steps", "1"], **fixed)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in metrics(a)] == [1]


def test_dynamic_sampling_refills_zero_variance_groups(tiny_ckpt, tmp_path):
    # The untrained model fails every task, so without a length penalty every group is all-zero:
    # dynamic sampling draws fresh tasks up to ds_max_tries more times, then skips the update.
    base = ["--init-from", tiny_ckpt, "--eval-tasks", "0", "--steps", "1"]
    out = str(tmp_path / "ds")
    p = run(base + ["--out-dir", out, "--dynamic-sampling"], ds_max_tries=2, canary_every=0)
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = metrics(out)
    assert r["rounds"] == 3 and r["zero_var_frac"] == 1.0 and r["trained_seqs"] == 0
    # every round samples the rank's whole share (smoke: 2 tasks), whatever is missing
    assert torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["stream_pos"] == [3 * 2]
    # --no-dynamic-sampling never refills: one round, nothing to train on
    out = str(tmp_path / "no-ds")
    p = run(base + ["--out-dir", out, "--no-dynamic-sampling"])
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = metrics(out)
    assert r["rounds"] == 1 and r["trained_seqs"] == 0


class CoinPool:
    """A stand-in sandbox: a completion passes when a hash of it is even, so an untrained model's
    groups vary and dynamic sampling has surplus groups to queue. Deterministic across runs."""
    def __init__(self, workers=None, timeout_s=None):
        pass

    def submit_batch(self, runs, fractional=False):
        f = concurrent.futures.Future()
        completions = ["" if r.program is None else r.program[len(r.prompt):] for r in runs]
        ok = [zlib.crc32(c.encode()) % 2 == 0 for c in completions]
        f.set_result([Result(float(o), o, "pass" if o else "wrong_answer", "", int(o), 1) for o in ok])
        return f

    def close(self):
        pass


def test_queue_resume_is_exact(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(train_rl, "SandboxPool", CoinPool)
    monkeypatch.setattr(env, "extract_completion", lambda text: text)   # the raw samples differ, their cuts not
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = ["--preset", "smoke", "--device", "cpu", "--init-from", tiny_ckpt, "--eval-tasks", "0",
            "--dynamic-sampling", "--batch-tasks", "3", "--group-size", "2", "--max-new-tokens", "12"]
    for seed in range(20):   # a seed whose step 2 leaves groups in the queue (a refill round found surplus)
        train_rl.main(base + ["--out-dir", b, "--steps", "2", "--seed", str(seed)], canary_every=0)
        queued = torch.load(os.path.join(b, "ckpt.pt"), weights_only=False)["queues"]
        if queued[0]:
            break
    base += ["--seed", str(seed)]
    train_rl.main(base + ["--out-dir", a, "--steps", "3"], canary_every=0)
    train_rl.main(base + ["--out-dir", b, "--steps", "3", "--resume"], canary_every=0)
    ra, rb = metrics(a), metrics(b)
    assert [r["step"] for r in rb] == [1, 2, 3]
    assert len(queued[0]) > 0 and rb[2]["queued_groups"] == len(queued[0]), "the queue survived the checkpoint"
    for x, y in zip(ra, rb):
        assert x["trained_seqs"] == y["trained_seqs"] == 3 * 2
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-9)
        assert x["reward"] == pytest.approx(y["reward"], rel=1e-6)
    # queued groups are one step stale: the PPO ratio is no longer 1 on them
    assert max(r["logp_mismatch"] for r in ra[1:]) > 0


def test_held_out_slices(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(train_rl, "SandboxPool", CoinPool)
    monkeypatch.setattr(env, "extract_completion", lambda text: text)
    real = train_rl.generate_tasks

    def sliced(split, n, **kw):          # test tasks get their slice by hand (tasks.py sets it in the real run)
        tasks = real(split, n, **kw)
        for i, t in enumerate(tasks):
            t.slice = ("near", "novel")[i % 2] if split == "test" else ""
        return tasks
    monkeypatch.setattr(train_rl, "generate_tasks", sliced)   # setup's task sets (the stream's refills: rollouts.py)
    out = str(tmp_path / "slices")
    s = train_rl.main(["--preset", "smoke", "--device", "cpu", "--init-from", tiny_ckpt, "--out-dir", out, "--steps", "1",
                       "--eval-tasks", "6"], eval_seed=3, canary_every=0)
    assert s["eval_seed"] == 3
    for when in ("before", "after"):
        for k in (1, 8):
            near, novel = s[f"pass@{k}_near_{when}"], s[f"pass@{k}_novel_{when}"]
            assert 0 <= near <= 1 and 0 <= novel <= 1
            assert s[f"pass@{k}_{when}"] == pytest.approx((near + novel) / 2)     # 3 tasks each
    assert 0 < s["pass@1_before"] < 1
    with open(os.path.join(out, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "eval" in r]
    assert [e["eval"] for e in evals] == ["before", "after"]
    assert all(e["eval_seed"] == 3 and "pass@1_novel" in e and "pass@8_near" in e for e in evals)


def test_dynamic_sampling_ignores_length_shaping(tiny_ckpt, tmp_path):
    # A length penalty makes every group's shaped reward vary; dynamic sampling still filters on
    # correctness (DAPO), so all-fail groups are refilled, not trained on length noise.
    out = str(tmp_path / "ds-len")
    p = run(["--init-from", tiny_ckpt, "--eval-tasks", "0", "--steps", "1", "--out-dir", out,
             "--dynamic-sampling"] + SIGNAL, ds_max_tries=2, canary_every=0, **SIGNAL_K)
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = metrics(out)
    assert r["rounds"] == 3 and r["zero_var_frac"] == 1.0 and r["trained_seqs"] == 0
    # without evals the summary is still strict JSON (no NaN), as tools reading it expect
    s = json.loads(p.stdout.strip().splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} in the summary"))
    assert s["pass@1_after"] is None and s["curve"]["after"] is None


def test_kl_coef_folds_the_reference_kl_into_the_reward(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(train_rl, "SandboxPool", CoinPool)
    monkeypatch.setattr(env, "extract_completion", lambda text: text)
    base = ["--preset", "smoke", "--device", "cpu", "--init-from", tiny_ckpt, "--eval-tasks", "0",
            "--steps", "3", "--lr", "1e-2"]
    train_rl.main(base + ["--out-dir", str(tmp_path / "kl"), "--kl-coef", "0.5"], canary_every=0)
    train_rl.main(base + ["--out-dir", str(tmp_path / "no-kl")], canary_every=0)
    kl, no_kl = metrics(str(tmp_path / "kl")), metrics(str(tmp_path / "no-kl"))
    assert "kl_ref" not in no_kl[0], "no reference model without --kl-coef"
    # step 1 samples from the reference itself: KL ~ 0, so the first update is the one without the term
    assert abs(kl[0]["kl_ref"]) < 1e-4
    assert kl[0]["loss"] == pytest.approx(no_kl[0]["loss"], rel=1e-3, abs=1e-6)
    # once the policy has moved, the KL is measurable and is subtracted from every reward (CoinPool: 0/1)
    assert max(abs(r["kl_ref"]) for r in kl[1:]) > 1e-3
    for r in kl:
        assert r["reward"] == pytest.approx(r["pass_rate"] - 0.5 * r["kl_ref"], abs=1e-9)


def given_groups(ckpt, path, n_groups, g=3):
    """n_groups groups of g samples of the checkpoint's model (routes recorded), advantages +-1 and 0.5,
    pickled for tests/ddp_step.py: the same groups for one process and for two."""
    model, tok, _ = common.load_checkpoint(ckpt)
    prompts = [tok.encode(env.render_prompt(t)) for t in generate_tasks("train", n_groups, seed=3)]
    groups = []
    for i, p in enumerate(prompts):
        outs = sampling.reference(model, [p] * g, 8, temperature=1.0, return_routes=True,
                                  generator=torch.Generator().manual_seed(i))
        groups.append([rl.Sequence([env.Turn(p, o["tokens"], o["logprobs"], routes=o["routes"])],
                                   adv=[1.0, -1.0, 0.5][j], episode_tokens=len(o["tokens"])) for j, o in enumerate(outs)])
    with open(path, "wb") as f:
        pickle.dump(groups, f)
    return path


def ddp_step(path, steps, args, nproc=1, **settings):
    """tests/ddp_step.py: rl_step on the given groups, in nproc processes; its JSON line per step."""
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                               "--master_port", str(29500 + os.getpid() % 1000)] if nproc > 1 else [])
    p = subprocess.run(cmd + ["tests/ddp_step.py", path, str(steps), json.dumps(settings), "--preset", "smoke",
                              "--device", "cpu", "--eval-tasks", "0", "--no-dynamic-sampling"] + args, cwd=ROOT,
                       capture_output=True, text=True, timeout=170, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow   # DDP: two processes
@pytest.mark.parametrize("balance", ["bias", "aux"])
def test_ddp_two_processes_equal_one(balance, tiny_ckpt, tiny_aux_ckpt, tmp_path):
    # aux: the MoE aux loss scaled up until it is most of the gradient; its term used to be per rank,
    # so 2 processes had twice the aux gradient of 1
    ckpt, fixed = (tiny_ckpt, {}) if balance == "bias" else (tiny_aux_ckpt, {"moe_aux_scale": 100})
    groups = given_groups(ckpt, str(tmp_path / "groups.pkl"), 8)
    base = ["--init-from", ckpt, "--batch-tasks", "4", "--group-size", "3", "--micro-batch", "4"]
    r1 = ddp_step(groups, 2, base + ["--out-dir", str(tmp_path / "one")], canary_every=0, **fixed)
    r2 = ddp_step(groups, 2, base + ["--out-dir", str(tmp_path / "two")], nproc=2, canary_every=0, **fixed)
    assert len(r1) == len(r2) == 2
    for x, y in zip(r1, r2):
        assert x["trained_seqs"] == y["trained_seqs"] == 12
        # aux: the global-batch loads are complete only at a step's last micro-batch, and micro-batches
        # differ between 1 and 2 processes, so the aux term (in the loss) and its gradient agree to ~1e-3
        # and ~1%, not exactly
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4 if balance == "bias" else 1e-3, abs=1e-7)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4 if balance == "bias" else 0.03)


@pytest.mark.slow   # DDP: two processes
def test_ddp_ppo_epochs_with_an_idle_rank_and_aux_loss(tiny_aux_ckpt, tmp_path):
    # one group: under 2 processes one rank trains and the other runs only padding forwards. That used
    # to break --ppo-epochs 2 (ranks reduced statistics of different lengths). The MoE aux term is scaled
    # up until it dominates the gradient: it used to grow with the number of ranks.
    groups = given_groups(tiny_aux_ckpt, str(tmp_path / "groups.pkl"), 1)
    base = ["--init-from", tiny_aux_ckpt, "--batch-tasks", "2", "--group-size", "3", "--ppo-epochs", "2"]
    fixed = dict(canary_every=0, moe_aux_scale=100)
    (x,) = ddp_step(groups, 1, base + ["--out-dir", str(tmp_path / "one")], **fixed)
    (y,) = ddp_step(groups, 1, base + ["--out-dir", str(tmp_path / "two")], nproc=2, **fixed)
    assert x["trained_seqs"] == y["trained_seqs"] == 3       # the one group: the other rank is idle
    assert x["loss"] == pytest.approx(y["loss"], rel=1e-4, abs=1e-7)
    assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-3)
    assert x["clip_last"] == pytest.approx(y["clip_last"], abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Clear errors (in-process: each dies with a one-line message before doing any work)

def fails(argv, capsys, **settings):
    with pytest.raises(SystemExit) as e:
        train_rl.main(["--preset", "smoke", "--device", "cpu"] + argv, **settings)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_errors(tiny_ckpt, tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "x")]
    assert "no checkpoint at" in fails(["--init-from", str(tmp_path / "nope.pt")] + out, capsys)
    assert "--init-from CKPT is required" in fails(out, capsys)
    assert "--resume: no checkpoint" in fails(["--resume"] + out, capsys)
    assert "--repair-groups is for --turns 1" in fails(["--init-from", tiny_ckpt, "--repair-groups", "--turns", "2"]
                                                        + out, capsys)
    err = fails(["--init-from", tiny_ckpt, "--difficulties", "99"] + out, capsys)
    assert err.startswith("error: --difficulties:") and "levels 1..5" in err
    # a checkpoint whose tokenizer has more tokens than the model's vocabulary
    ck = torch.load(tiny_ckpt, weights_only=False)
    small = GPT(GPTConfig(**{**ck["model_config"], "vocab_size": 100}))
    bad = str(tmp_path / "bad.pt")
    from tokenizer import Tokenizer
    common.save_checkpoint(bad, small, Tokenizer.from_dict(ck["tokenizer"]))
    err = fails(["--init-from", bad] + out, capsys)
    assert "tokenizer has" in err and "model only 100" in err


@pytest.mark.slow   # DDP: two processes
def test_ddp_held_out_eval_when_ranks_hold_different_slices(tiny_ckpt, tmp_path):
    # Two test tasks of different slices, one per rank: each rank's held-out sums have only one
    # slice's keys. The ranks used to all-reduce vectors built from their own key lists (a length
    # mismatch, or sums added under the wrong names).
    seed = next(s for s in range(50) if len({t.slice for t in generate_tasks("test", 2, seed=s)}) == 2)
    out = str(tmp_path / "two")
    p = run(["--init-from", tiny_ckpt, "--batch-tasks", "2", "--group-size", "2", "--steps", "1",
             "--eval-tasks", "2", "--out-dir", out], nproc=2, timeout=170,
            canary_every=0, eval_n=2, eval_k=2, eval_seed=seed)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("pass@1_near_before", "pass@1_novel_before", "pass@2_near_after", "pass@2_novel_after"):
        assert summary[key] is not None and 0.0 <= summary[key] <= 1.0, key


def _queue_and_save(rank, world, ckpt, out, sizes):
    """One gloo rank of test_queued_routes_travel_compactly: a queue of real sampled groups (routes
    recorded by the sampler), gathered and checkpointed by train_rl.save."""
    import pickle
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    model, tok, _ = common.load_checkpoint(ckpt)
    prompts = [[tok.eot_id, 5 + rank + i % 4] for i in range(16)]
    outs = sampling.reference(model, prompts, 24, temperature=1.0, return_routes=True,
                           generator=torch.Generator().manual_seed(rank))
    samples = [env.Episode(i // 4, [env.Turn(p, o["tokens"], o["logprobs"], routes=o["routes"])], group=i // 4)
               for i, (p, o) in enumerate(zip(prompts, outs))]
    scored = [(s, None) for s in samples]
    queue = rollouts.signal_groups(scored, torch.zeros(16, dtype=torch.float64), torch.ones(16, dtype=torch.bool))
    own = sum(t.routes.numel() * t.routes.element_size() for g in queue for s in g for t in s.turns)
    sizes[rank] = (len(pickle.dumps(queue)), own, queue[0][0].turns[0].routes.dtype)
    ctx = SimpleNamespace(state={"stream_pos": 0, "queue": queue, "step": 1, "totals": {}, "evals": {}, "hack_hist": []},
                          world=world, ddp=True, master=rank == 0, model=model, tok=tok,
                          optimizer=torch.optim.AdamW(model.parameters()), ckpt_path=os.path.join(out, "ckpt.pt"),
                          args=SimpleNamespace(init_from=ckpt))
    train_rl.save(ctx)
    dist.destroy_process_group()


@pytest.mark.slow   # two gloo processes
def test_queued_routes_travel_compactly(tiny_ckpt, tmp_path):
    """The queue of surplus groups goes between ranks through all_gather_object, which pickles, and
    pickle writes the whole storage of a view once per view: routes that were views of the sampler's
    (layers, rows, steps, top_k) int64 tensor made every sample carry all the call's routes (16x
    their own bytes with 16 samples), gigabytes per checkpoint at the gpu preset. Each sample's
    routes are one byte per expert id, in a storage of their own: the bytes gathered and the
    checkpoint stay within a small factor of the routes' own."""
    import torch.multiprocessing as mp
    sizes = mp.Manager().dict()
    mp.spawn(_queue_and_save, args=(2, tiny_ckpt, str(tmp_path), sizes), nprocs=2)
    for rank in range(2):
        pickled, own, dtype = sizes[rank]
        assert dtype == torch.uint8 and pickled < 3 * own + 20_000, (pickled, own)
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert len(ck["queues"]) == 2 and all(len(q) == 4 for q in ck["queues"])
    weights = sum(t.numel() * t.element_size() for t in ck["model"].values())
    routes = sum(sizes[r][1] for r in range(2))
    assert os.path.getsize(tmp_path / "ckpt.pt") < 2 * weights + 3 * routes + 1_000_000


@pytest.mark.slow   # torchrun: 1 + 2 + 4 processes
def test_rounds_sample_the_ranks_share_at_any_world_size(tiny_ckpt, tmp_path):
    """A dynamic-sampling round draws the rank's share of --batch-tasks, so the rows generated per
    round and rank are B / W x G at any world size W. It drew max(need, --gen-batch / G) tasks per
    rank, --gen-batch being per rank: on 8 GPUs each rank generated 512 rows a round and used 128.
    The untrained model gives no group with signal, so every step runs all 1 + ds_max_tries rounds."""
    for world in (1, 2, 4):
        out = str(tmp_path / f"w{world}")
        p = run(["--init-from", tiny_ckpt, "--eval-tasks", "0", "--steps", "1", "--batch-tasks", "4",
                 "--group-size", "2", "--dynamic-sampling", "--out-dir", out],
                nproc=world, timeout=240, ds_max_tries=1, canary_every=0, gen_batch=64)
        assert p.returncode == 0, p.stderr[-3000:]
        (r,) = metrics(out)
        assert r["rounds"] == 2
        ck = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
        assert ck["stream_pos"] == [2 * 4 // world] * world      # 2 rounds x B / W tasks, x G = 2 rows each


@pytest.mark.parametrize("pack", [False, True])
def test_a_training_micro_batch_reads_nothing_back_from_the_device(pack):
    # Issue 44, item 7: every read of tensor data into the host (.item(), a boolean-mask index, nonzero,
    # bincount, ...) stalls a GPU's queue. micro_batch_loss, forward and backward, with router replay and
    # the valid mask as a step runs it, makes none (gpu_check.count_host_syncs sees them inside aten too);
    # before the fix, token_logprobs' h[tgt >= 0] and masked_scatter made three.
    from lab import gpu_check
    model = tiny_moe().train()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10]] * 2
    gen = sampling.reference(model, prompts, max_new_tokens=6, temperature=1.0, return_routes=True,
                          generator=torch.Generator().manual_seed(0))
    samples = [seq(p, g) for p, g in zip(prompts, gen)]
    batch = rl.batch_tensors(samples, 0, model.n_moe_layers, 2, True, pack)
    args = SimpleNamespace(temperature=1.0, eps_low=0.2, eps_high=0.28, loss_norm="constant", batch_tasks=2,
                           group_size=2, max_new_tokens=6, moe_aux_scale=0.0, ppo_epochs=1)
    ctx = SimpleNamespace(args=args, model=model, device=torch.device("cpu"), replay=True)
    counts = train_rl.Counts(4, float((batch.tgt >= 0).sum()), float(batch.valid.sum()), 1)
    stats = rollouts.new_stats(args)
    _, n = gpu_check.count_host_syncs(
        lambda: train_rl.micro_batch_loss(ctx, batch, [1.0, -1.0, 0.5, -0.5], counts, stats, 0), torch.device("cpu"))
    assert n == 0
    assert stats["tokens_e0"] == (batch.tgt >= 0).sum() and all(p.grad is not None for p in model.parameters())
