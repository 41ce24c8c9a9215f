"""Multi-token prediction (model.py: MTP, train_mtp.py) and speculative sampling (speculative.py:
generate), on tiny models, seconds each: python -m pytest tests/test_speculative.py -q -x"""
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from data import corpus
import sampling
import speculative
from model import GPT, GPTConfig
import train_mtp

TINY = dict(vocab_size=61, seq_len=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, n_expert=6, top_k=2,
            n_shared_expert=1, expert_hidden=16, n_dense_layers=1)
PROMPTS = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8], [4, 4, 2, 7, 1], [5, 3, 9]]   # ragged, one duplicate


def totals(stats):
    """speculative.generate's counts (one dict per call) summed."""
    return {k: [sum(x) for x in zip(*(c[k] for c in stats))] if isinstance(stats[0][k], list)
            else sum(c[k] for c in stats) for k in stats[0]}


def tiny(n_mtp=1, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, "n_mtp": n_mtp, **kw})).eval()


def toy_batch(g, B=16, T=32):
    """A toy language with some structure: mostly (80%) each token is the previous one plus 1, 2 or 3
    (mod 61), chosen by the one before it; otherwise a random token."""
    x, noise = torch.randint(0, 61, (B, T), generator=g), torch.rand(B, T, generator=g)
    for t in range(2, T):
        x[:, t] = torch.where(noise[:, t] < 0.8, (x[:, t - 1] + 1 + x[:, t - 2] % 3) % 61, x[:, t])
    return x


def trained(n_mtp):
    """A tiny model trained on the toy language, then its MTP modules distilled (train_mtp.distill):
    confident predictions and drafts that are mostly kept, so that every path of accept runs."""
    model, g = tiny(n_mtp).train(), torch.Generator().manual_seed(1)
    trunk = [q for n, q in model.named_parameters() if not n.startswith("mtp.")]
    opt = torch.optim.AdamW(trunk, lr=1e-2)
    for _ in range(120):
        xy = toy_batch(g)
        _, loss = model(xy[:, :-1], xy[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    opt = torch.optim.AdamW(model.mtp.parameters(), lr=1e-2)
    for _ in range(80):
        loss, agree = train_mtp.distill(model, toy_batch(g))
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.zero_grad(set_to_none=True)
    return model


@pytest.fixture(scope="module")
def trained2():
    return trained(2)


def test_mtp_is_off_by_default_and_counted_apart(tmp_path):
    assert GPTConfig().n_mtp == 0 and len(tiny(0).mtp) == 0
    plain, mtp = tiny(0), tiny(2)
    assert plain.num_params() == mtp.num_params() and mtp.mtp_params() > 0 and plain.mtp_params() == 0
    assert mtp.estimate_flops_per_token() == plain.estimate_flops_per_token()
    assert all(not b.is_moe for b in (m.block for m in mtp.mtp))            # dense drafting blocks
    # a checkpoint written before MTP existed (no n_mtp in its config) loads unchanged
    cfg = asdict(plain.config)
    del cfg["n_mtp"]
    torch.save({"model_config": cfg, "model": plain.state_dict()}, tmp_path / "old.pt")
    ck = torch.load(tmp_path / "old.pt", weights_only=True)
    old = GPT(GPTConfig(**ck["model_config"]))
    old.load_state_dict(ck["model"])
    assert old.config.n_mtp == 0
    # train_mtp adds modules to it and keeps every trunk weight
    grown = train_mtp.model_with_mtp(old, 2)
    assert grown.config.n_mtp == 2
    for k, v in old.state_dict().items():
        assert torch.equal(grown.state_dict()[k], v)


def test_mtp_level_m_reads_the_trunk_m_tokens_back():
    """Every level is causal (its logits at slot j depend on tokens up to j only), and level 1 at slot
    j reads the trunk's state at j - 1, not at j."""
    model = tiny(2)
    idx = torch.randint(0, 61, (1, 12))
    pos = torch.arange(12)[None]
    h, _ = model.trunk(idx, pos)
    base = model.mtp_logits(h, idx, pos)
    later = idx.clone()
    later[0, 8:] = (later[0, 8:] + 1) % 61
    h2, _ = model.trunk(later, pos)
    for a, b in zip(base, model.mtp_logits(h2, later, pos)):
        torch.testing.assert_close(a[:, :8], b[:, :8], rtol=0, atol=1e-5)
        assert not torch.allclose(a[:, 8:], b[:, 8:])
    # level 1 at slot j = combine(trunk at j-1, embedding at j): replacing the trunk's state at j with
    # garbage changes level 1 only from slot j+1 on
    bad = h.clone()
    bad[:, 5] = torch.randn(32)
    got = model.mtp_logits(bad, idx, pos)[0]
    torch.testing.assert_close(got[:, :6], base[0][:, :6], rtol=0, atol=1e-5)
    assert not torch.allclose(got[:, 6], base[0][:, 6])


@pytest.mark.parametrize("n_mtp", [1, 2, 3])
def test_greedy_speculative_is_greedy_on_a_random_model(n_mtp):
    model = tiny(n_mtp)
    full = sampling.reference(model, PROMPTS, 16, temperature=0)
    for stop in ([], [full[0]["tokens"][2], full[3]["tokens"][5]]):
        ref = sampling.reference(model, PROMPTS, 16, temperature=0, stop_ids=stop)
        got = speculative.generate(model, PROMPTS, 16, temperature=0, stop_ids=stop)
        for r, o in zip(ref, got):
            assert o["tokens"] == r["tokens"]
            torch.testing.assert_close(torch.tensor(o["logprobs"]), torch.tensor(r["logprobs"]), rtol=0, atol=1e-5)
        assert {len(o["tokens"]) for o in got} != {16} or not stop                     # some stopped early
    for p in PROMPTS[:3]:   # batch 1: the interactive path
        assert speculative.generate(model, [p], 16, temperature=0)[0]["tokens"] == \
            sampling.reference(model, [p], 16, temperature=0)[0]["tokens"]


def test_greedy_speculative_is_greedy_on_a_trained_model(trained2):
    """Drafts mostly kept (several tokens per forward), the rest rolled back: still greedy's tokens."""
    g = torch.Generator().manual_seed(5)
    prompts = toy_batch(g, B=6, T=5).tolist() + [[3], [10, 11, 12, 13, 14, 15, 16, 17], [5, 40, 2, 33, 9]]
    ref = sampling.reference(trained2, prompts, 24, temperature=0, stop_ids=[0])
    got = speculative.generate(trained2, prompts, 24, temperature=0, stop_ids=[0])
    assert [o["tokens"] for o in got] == [r["tokens"] for r in ref]
    one = []
    for p, r in zip(prompts, ref):
        assert speculative.generate(trained2, [p], 24, temperature=0, stop_ids=[0], stats=one)[0]["tokens"] \
            == r["tokens"]
    one = totals(one)
    assert one["advanced"] / one["forwards"] > 1.5                  # drafts kept at batch 1 ...
    assert one["kept"][1] > 0 and one["kept"][0] < one["reached"][0]   # ... at both positions; some rolled back


def test_speculative_continues_a_past_like_the_full_prompt(trained2):
    """Multi-turn (agent.py): return_past's keys/values, MTP layers included, continue a row exactly as
    one call on the whole context does (greedy)."""
    first = speculative.generate(trained2, PROMPTS, 6, temperature=1.0, stop_ids=[20, 40], return_past=True,
                                        generator=torch.Generator().manual_seed(0))
    feeds = [[30, 31], [32], [33, 34, 35], [36, 37], [38]]
    cont = speculative.generate(trained2, feeds, 8, temperature=0, past=[o["past"] for o in first])
    for p, o, f, c in zip(PROMPTS, first, feeds, cont):
        assert o["past"].shape[:2] == (3 + 2, 2) and o["past"].size(3) == len(p) + len(o["tokens"]) - 1
        whole = p + o["tokens"][:-1] + f
        assert c["tokens"] == sampling.reference(trained2, [whole], 8, temperature=0)[0]["tokens"]


def test_cache_after_rejections_equals_the_cache_of_the_accepted_prefix(trained2):
    """After decoding with rolled-back rejections, every row's keys/values (trunk and MTP layers) are
    those a single prefill of its accepted tokens computes."""
    stats = []
    prompts = PROMPTS + [[10, 11, 12]]
    outs = speculative.generate(trained2, prompts, 12, temperature=1.0, stop_ids=[50], return_past=True,
                                       generator=torch.Generator().manual_seed(2), stats=stats)
    stats = totals(stats)
    assert 0 < sum(stats["kept"]) and stats["kept"][0] < stats["reached"][0]    # kept and rejected drafts
    for p, o in zip(prompts, outs):
        ref = speculative.generate(trained2, [p + o["tokens"][:-1]], 1, temperature=0, return_past=True)[0]
        assert o["past"].shape == ref["past"].shape
        torch.testing.assert_close(o["past"], ref["past"], rtol=0, atol=1e-5)


def total_variation(draws, probs):
    freq = torch.bincount(draws, minlength=probs.numel()).double() / len(draws)
    return 0.5 * (freq - probs.double()).abs().sum().item()


def second_token_tv(model, n=40000):
    """Speculative sampling at temperature 1 of n rows of one prompt, 2 tokens each: the first comes
    from the prefill, the second from a draft kept or replaced. The empirical distribution of the
    second token against the model's, sum_t p(t) p(. | t) (a full forward for every first token t)."""
    p, V = [5, 3, 9, 1], model.config.vocab_size
    outs = speculative.generate(model, [p] * n, 2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    second = torch.tensor([o["tokens"][1] for o in outs])
    with torch.no_grad():
        first = model(torch.tensor([p]))[0][0, -1].softmax(-1)
        then = model(torch.tensor([p + [t] for t in range(V)]))[0][:, -1].softmax(-1)
    return total_variation(second, first @ then)


@pytest.fixture(scope="module")
def overlapping():
    """A random model whose LM head is scaled up (peaked distributions) with a random drafter: the
    drafter's and the model's distributions overlap by about two thirds (two drafts in three are
    kept, the third replaced), and a rule that does not sample the model's distribution is far off."""
    model = tiny(1, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    return model


def test_speculative_sampling_matches_the_model_distribution(overlapping):
    """Tolerance: total variation < 0.04. With 40000 draws from a distribution of ~45 effective tokens
    it is about sqrt(45 / (2 pi 40000)) = 0.013 by chance (0.015 measured); a wrong acceptance rule
    (next test) gives 0.18."""
    tv = second_token_tv(overlapping)
    assert tv < 0.04, tv


@pytest.mark.slow   # ~4 s: the test of the test
@pytest.mark.parametrize("wrong", ["keep always", "q / p"])
def test_the_distribution_test_fails_on_a_wrong_acceptance_rule(overlapping, monkeypatch, wrong):
    rule = {"keep always": lambda p, q: torch.ones_like(p), "q / p": lambda p, q: (q / p).clamp(max=1.0)}[wrong]
    monkeypatch.setattr(speculative, "keep_probability", rule)
    tv = second_token_tv(overlapping)
    assert tv > 0.1, tv


def test_accept_one_row_gives_each_position_the_model_distribution(monkeypatch):
    """accept() alone, one row at a time (the interactive case: every draft position and the bonus
    token are reached), with fixed model distributions p_0..p_2 and drafter q_1, q_2: the first token
    follows p_0, the second (when the first draft was kept) p_1, the bonus p_2. 10000 rows; TV < 0.05
    at each position (by chance ~0.01-0.02 over 12 tokens), while keeping every draft or the inverted
    ratio is off by > 0.1 somewhere."""
    g = torch.Generator().manual_seed(0)
    V = 12
    logits = torch.randn(1, 3, V, generator=g) * 2
    p = logits.softmax(-1)[0]
    q = 0.5 * p[None, :2] + 0.5 * torch.randn(1, 2, V, generator=g).mul(2).softmax(-1)   # overlap ~ 3/4

    def run():
        by_pos = [[], [], []]
        gen = torch.Generator().manual_seed(1)
        with sampling.cpu_threads(1):   # 10000 calls of a few small ops each
            for _ in range(10000):
                d = torch.stack([sampling.draw(q[:, j], gen) for j in range(2)], 1)
                toks, _, _ = speculative.accept(logits, d, q, 1.0, 0, 1.0, gen, torch.ones(1, dtype=torch.bool))
                for j, t in enumerate(toks[0].tolist()):
                    by_pos[j].append(t)
        return [total_variation(torch.tensor(x), p[j]) for j, x in enumerate(by_pos)], [len(x) for x in by_pos]
    tv, n = run()
    assert min(n) > 3000 and max(tv) < 0.05, (tv, n)
    monkeypatch.setattr(speculative, "keep_probability", lambda p, q: torch.ones_like(p))
    assert max(run()[0]) > 0.1
    monkeypatch.setattr(speculative, "keep_probability", lambda p, q: (q / p).clamp(max=1.0))
    assert max(run()[0]) > 0.1


def test_distill_agreement_and_the_interactive_path(trained2, monkeypatch):
    """corpus.mtp_agreement gives each level's top-1 agreement with the main head (what distill
    reports on the same tokens); sampling.generate takes speculative.generate where SPECULATIVE is set
    and the model has MTP modules."""
    idx = toy_batch(torch.Generator().manual_seed(9), B=4, T=64)
    agree = corpus.mtp_agreement(trained2, SimpleNamespace(eot_id=0), [idx.flatten().tolist()[1:]])
    assert len(agree) == 2 and 0.5 < agree[0] <= 1.0
    with torch.no_grad():
        _, same = train_mtp.distill(trained2, torch.tensor([[0] + idx.flatten().tolist()[1:]]).view(4, 64))
    assert agree == pytest.approx(same.tolist(), abs=1e-6)
    calls = []
    monkeypatch.setattr(speculative, "generate", lambda *a, **k: calls.append(k) or [{"tokens": [1]}])
    monkeypatch.setattr(sampling, "SPECULATIVE", speculative.generate)
    sampling.generate(trained2, [[1, 2]], 4, temperature=0.8)
    assert len(calls) == 1 and "trunk" not in calls[0]
    sampling.generate(trained2, [[1, 2]], 4, temperature=0.8, return_routes=True)   # routes: plain generate
    sampling.generate(tiny(0), [[1, 2]], 4, temperature=0.8)                          # no MTP: plain generate
    assert len(calls) == 1


def test_mtp_agreement_runs_as_the_drafting_does(monkeypatch):
    """corpus.mtp_agreement scores under model.autocast, as speculative decoding drafts (bf16 on a
    GPU): measured in fp32 there it would take the math attention kernel and the syncing MoE path,
    and score other numbers than the drafts'."""
    seen, real = [], corpus.autocast
    monkeypatch.setattr(corpus, "autocast", lambda device: seen.append(device.type) or real(device))
    assert len(corpus.mtp_agreement(tiny(2), SimpleNamespace(eot_id=0), [list(range(1, 60))])) == 2
    assert seen == ["cpu"]


@pytest.mark.slow   # torchrun: two processes with torch
def test_train_mtp_refuses_more_than_one_process(tmp_path):
    """Under torchrun train_mtp.py used to run on every rank at once, each on the same device and
    writing the same checkpoint. It runs in one process: more are refused with one line per rank,
    before anything is loaded."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(29700 + os.getpid() % 200), "train_mtp.py", "--preset", "smoke",
                        "--device", "cpu", "--init-from", str(tmp_path / "absent.pt"), "--out-dir", str(tmp_path)],
                       cwd=root, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # counted, not split by line: the two ranks write at once, and their lines may interleave
    assert p.returncode != 0, p.stderr[-2000:]
    assert p.stderr.count("error: train_mtp.py runs in one process (torchrun started 2)") == 2, p.stderr[-2000:]
    assert not list(tmp_path.glob("*.pt"))
