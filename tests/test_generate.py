"""The reference sampler (sampling.py generate) against every speed path beside it (sampling.py:
finished rows retired, sync-free decoding, two decode streams, the fused decode step, continuous
batching's rows; speculative decoding, speculative.py), on tiny models:
python -m pytest tests/test_generate.py -q -x

Greedy, every path must give the reference's tokens, routes and pasts, with log-probs within float
rounding (a retired row is computed in a smaller batch). Sampled, a path that draws for the same rows
in the same order (no row retires: no stop id) must give the very same tokens and log-probs; through
the fused decode step (sampling.fused_step), the same tokens and routes with log-probs within 1e-5:
its ops add in another order (the dense experts' sum, attention over grouped query rows), so equality holds to
float rounding only, a sampled token differing only where a uniform falls within ~1e-7 of a bin's
edge (none does at these seeds)."""
import pytest
import torch

import sampling
import speculative
from model import GPT, GPTConfig, MoE

TINY = dict(vocab_size=61, seq_len=96, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, n_expert=6, top_k=2,
            n_shared_expert=1, expert_hidden=16, n_dense_layers=1)
RAGGED = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8], [4, 4, 2, 7, 1], [5, 3, 9]]    # padded, one duplicate
EVEN = [[5, 3, 9], [4, 4, 4]] * 4                                               # no padding, no mask
MANY = [[5, 3, 9]] * 12 + [[1, 2, 3, 4, 5, 6, 7]] * 12 + [[8]] * 12 + [[4, 4]] * 12   # two streams
PROMPTS = {"ragged": RAGGED, "even": EVEN, "many": MANY}


def stops_for(model, prompts, kind):
    """No stop id, or ids that end rows at several steps: the greedy tokens at steps 2 and 5 of two rows."""
    if kind == "none":
        return ()
    full = sampling.reference(model, prompts, 10, temperature=0)
    return full[0]["tokens"][2], full[-1]["tokens"][5]


STEPS = {"reference": (False, 0), "fused": (True, 16), "fused_sparse": (True, 0)}   # FUSED, DENSE_ROWS


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw})).eval()


@pytest.fixture(autouse=True)
def _restore():
    yield
    MoE.dispatch = "auto"


def use_step(monkeypatch, name):
    """Decode through the reference's step, the fused one, or the fused one with no dense experts."""
    monkeypatch.setattr(sampling, "FUSED", STEPS[name][0])
    monkeypatch.setattr(sampling, "DENSE_ROWS", STEPS[name][1])


def assert_same(ref, got, exact=False):
    """got's outputs are ref's: tokens and routes equal; log-probs and pasts equal (exact) or within
    float rounding."""
    assert len(ref) == len(got)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=0, atol=1e-5)
    for a, b in zip(ref, got):
        assert a["tokens"] == b["tokens"]
        torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), **tol)
        assert set(a) == set(b)
        if "routes" in a:
            assert torch.equal(a["routes"], b["routes"])
        if "past" in a:
            torch.testing.assert_close(b["past"], a["past"], **tol)


def run(fn, model, prompts, n=10, seed=0, **kw):
    g = torch.Generator().manual_seed(seed) if kw.get("temperature", 1.0) else None
    return fn(model, prompts, n, generator=g, **kw)


@pytest.mark.parametrize("prompts", sorted(PROMPTS))
@pytest.mark.parametrize("stops", ["none", "some"])
@pytest.mark.parametrize("dispatch", ["auto", "dense", "sorted"])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_retiring_and_sync_free_sample_what_generate_does(monkeypatch, prompts, stops, dispatch, step):
    """Each decode step, the reference's and the fused one (its dense experts at up to 16 rows: all of
    RAGGED's and EVEN's rows, MANY's once they retire; or none), against the reference sampler."""
    MoE.dispatch = dispatch
    model, prompts = tiny(), PROMPTS[prompts]
    stop = stops_for(model, prompts, stops)
    kw = dict(stop_ids=stop, return_routes=True, return_past=True)
    ref = run(sampling.reference, model, prompts, temperature=0, **kw)
    if stop:
        assert {len(o["tokens"]) for o in ref} != {10}       # rows stop at different steps
    use_step(monkeypatch, step)
    for free in (False, True):
        monkeypatch.setattr(sampling, "SYNC_FREE", free)
        monkeypatch.setattr(sampling, "DONE_EVERY", 4)
        assert_same(ref, run(sampling.retiring, model, prompts, temperature=0, **kw))
    # sampled, no stop id: no row retires, the same draws for the same rows
    monkeypatch.setattr(sampling, "SYNC_FREE", False)
    kw = dict(return_routes=True, temperature=1.0, top_k=20, top_p=0.9)
    assert_same(run(sampling.reference, model, prompts, **kw), run(sampling.retiring, model, prompts, **kw),
                exact=step == "reference")


@pytest.mark.parametrize("n_expert", [6, 1])
@pytest.mark.parametrize("step", ["reference", "fused"])
def test_pasts_continue_alike(monkeypatch, n_expert, step):
    """A second turn from each row's past (multi-turn episodes): the speed paths continue as the
    reference does, and the reference as one call on the whole context."""
    use_step(monkeypatch, step)
    model = tiny(n_expert=n_expert)
    first = run(sampling.reference, model, RAGGED * 3, 6, temperature=1.0, stop_ids=(5, 17, 23, 40), return_past=True)
    feeds = [[30, 31], [32, 33, 34, 35], [36], [37, 38, 39], [30]] * 3
    past = [o["past"] for o in first]
    kw = dict(temperature=0, return_routes=True, return_past=True, stop_ids=(11, 12))
    ref = sampling.reference(model, feeds, 5, past=past, **kw)
    assert_same(ref, sampling.retiring(model, feeds, 5, past=past, **kw))
    for p, o, f, c in zip(RAGGED * 3, first, feeds, ref):
        whole = p + o["tokens"][:-1] + f
        alone = sampling.reference(model, [whole], 5, **{**kw, "return_past": False})[0]
        assert c["tokens"] == alone["tokens"]
        assert torch.equal(c["routes"], alone["routes"][:, -c["routes"].size(1):])


def test_two_streams_sample_what_generate_does():
    """sampling.generate on a CPU splits >= 32 rows into two decode streams, each with a random stream of
    its own: greedy, the reference's outputs; sampled, each row's draws come from its stream's seed
    (tests/test_agent.py checks the shares one by one)."""
    model = tiny()
    kw = dict(temperature=0, stop_ids=stops_for(model, MANY, "some"), return_routes=True, return_past=True)
    ref = run(sampling.reference, model, MANY, **kw)
    assert {len(o["tokens"]) for o in ref} != {10}
    calls = []
    real = sampling.retiring

    def counted(*a, **k):
        calls.append(len(a[1]))
        return real(*a, **k)
    sampling.retiring = counted
    try:
        got = run(sampling.generate, model, MANY, streams=2, **kw)
    finally:
        sampling.retiring = real
    assert sorted(calls) == [24, 24]                        # it did run two streams
    assert_same(ref, got)


@pytest.mark.parametrize("prompts", ["ragged", "even"])
def test_speculative_decoding_gives_generate_tokens(prompts):
    """Speculative decoding, greedy, gives the reference's tokens whatever the drafts (an untrained
    MTP module: most drafts are rejected and rolled back); its distribution at T > 0 is tested in
    tests/test_speculative.py."""
    model = tiny(n_mtp=2)
    for stop in (stops_for(model, PROMPTS[prompts], kind) for kind in ("none", "some")):
        ref = run(sampling.reference, model, PROMPTS[prompts], 16, temperature=0, stop_ids=stop)
        got = run(speculative.generate, model, PROMPTS[prompts], 16, temperature=0, stop_ids=stop)
        assert [o["tokens"] for o in got] == [o["tokens"] for o in ref]
        for a, b in zip(ref, got):
            torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), rtol=0, atol=1e-5)


def test_the_chooser_takes_each_path(monkeypatch):
    """sampling.generate is the one place a path is chosen: speculative where SPECULATIVE is set and the
    model has MTP modules (not when routes are asked for), else retiring, whose decode step is the
    fused one where FUSED is set (on a CPU), the reference's trunk and LM head where not; every choice
    gives the reference's greedy tokens."""
    model, taken = tiny(n_mtp=1), []
    spy = lambda name, f: lambda *a, **k: taken.append(name) or f(*a, **k)
    monkeypatch.setattr(sampling, "retiring", spy("retiring", sampling.retiring))
    monkeypatch.setattr(sampling, "fused_step", spy("fused", sampling.fused_step))
    ref = run(sampling.reference, model, RAGGED, temperature=0)
    for spec, fused, routes, want in [(False, True, False, ["fused", "retiring"]), (True, True, False, ["speculative"]),
                                      (True, True, True, ["fused", "retiring"]), (False, False, False, ["retiring"])]:
        monkeypatch.setattr(sampling, "SPECULATIVE", spy("speculative", speculative.generate) if spec else None)
        monkeypatch.setattr(sampling, "FUSED", fused)
        taken.clear()
        got = run(sampling.generate, model, RAGGED, temperature=0, return_routes=routes)
        assert taken == want and [o["tokens"] for o in got] == [o["tokens"] for o in ref]


def rows_session(model, kw):
    """A scripted run of sampling.Rows (continuous batching's rows): rows join with seeds of their own,
    are fed again after their turns (on top of their cache, or fresh), and leave; -> every output."""
    batch, outs, turns = sampling.Rows(model, 6, **kw), [], {}
    feeds = {i: [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8], [4, 4, 2, 7, 1]][i % 4] for i in range(9)}
    for i in range(5):
        batch.feed(i, feeds[i], seed=100 + i)
    waiting = list(range(5, 9))
    while len(batch):
        for i, o in batch.step():
            outs.append((i, o))
            turns[i] = turns.get(i, 0) + 1
            if turns[i] < 3:
                batch.feed(i, [30 + turns[i], 31], fresh=turns[i] == 2 and i % 2 == 0, limit=4 if i == 1 else None)
            else:
                batch.leave(i)
                if waiting:
                    j = waiting.pop(0)
                    batch.feed(j, feeds[j], seed=100 + j)
    return outs


@pytest.mark.parametrize("dense", [0, 16])
def test_rows_decode_through_the_fused_step_as_through_the_reference(monkeypatch, dense):
    """Continuous batching (sampling.Rows, env.episodes_continuous) decodes through the chosen step
    too: through the fused one, every turn's tokens, routes and cache lengths are those of the
    reference's step, log-probs within float rounding (module docstring), sampled and greedy."""
    model = tiny()
    for temperature in (1.0, 0):
        kw = dict(max_new_tokens=6, temperature=temperature, stop_ids=(5, 17, 23, 40), return_routes=True)
        use_step(monkeypatch, "reference")
        ref = rows_session(model, kw)
        monkeypatch.setattr(sampling, "FUSED", True)
        monkeypatch.setattr(sampling, "DENSE_ROWS", dense)
        got = rows_session(model, kw)
        assert [i for i, _ in ref] == [i for i, _ in got] and len(ref) == 27
        assert {len(o["tokens"]) for _, o in ref} != {6}                  # turns end at different steps
        for (_, a), (_, b) in zip(ref, got):
            assert a["tokens"] == b["tokens"] and a["context"] == b["context"]
            assert torch.equal(a["routes"], b["routes"])
            torch.testing.assert_close(torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("prompts", ["ragged", "many"])
def test_router_replay_sees_the_experts_the_fused_step_used(monkeypatch, prompts):
    """The routes the fused step records are the experts it used: the trainer's forward that replays
    them (model(idx, routes=...), router replay) scores each sampled token at its recorded log-prob."""
    use_step(monkeypatch, "fused")
    model = tiny()
    outs = run(sampling.generate, model, PROMPTS[prompts], 8, temperature=1.0, return_routes=True)
    for p, o in zip(PROMPTS[prompts], outs):
        idx = torch.tensor([p + o["tokens"][:-1]])
        logits, _ = model(idx, routes=o["routes"][:, None].long())
        lp = logits[0, len(p) - 1:].log_softmax(-1).gather(-1, torch.tensor(o["tokens"])[:, None]).squeeze(1)
        torch.testing.assert_close(lp, torch.tensor(o["logprobs"]), rtol=0, atol=1e-5)


def test_fused_step_handles_every_config_option(monkeypatch):
    """The options open-weights models bring (hf.py): q/k norm across the width or none, Granite's
    multipliers, more shared experts or none, a dense model: the fused step's logits are the
    reference step's to float rounding, and its experts the same, at a few rows and at many."""
    for kw in (dict(qk_norm="width"), dict(qk_norm="none", residual_multiplier=0.5, embedding_multiplier=2.0,
                                                 attention_multiplier=0.1, logits_scaling=2.0),
               dict(n_shared_expert=2), dict(n_shared_expert=0), dict(n_expert=1), dict(norm_topk_prob=False)):
        model = tiny(**kw)
        for rows in (3, 40):
            cache = sampling.KVCache(model.config.n_layer, 16)
            g = torch.Generator().manual_seed(rows)
            with torch.no_grad():
                model.trunk(torch.randint(0, 61, (rows, 7), generator=g), torch.arange(7)[None], cache)
            token, pos = torch.randint(0, 61, (rows,), generator=g), torch.full((rows,), 7)
            mask = torch.rand(rows, 1, 1, 8, generator=g) > 0.3
            mask[..., -1] = True
            out = []
            for fused in (False, True):
                monkeypatch.setattr(sampling, "FUSED", fused)
                cache.pos = 7
                with torch.no_grad():
                    out.append(sampling.decoder(model)(token, pos, cache, mask))
            (a, ca), (b, cb) = out
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
            assert len(ca) == len(cb) == model.n_moe_layers and all(torch.equal(x, y) for x, y in zip(ca, cb))
