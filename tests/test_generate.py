"""The reference sampler (sampling.py generate) against every speed path beside it (sampling.py:
finished rows retired, sync-free decoding, two decode streams, a compiled decode step; speculative
decoding, speculative.py), on tiny models: python -m pytest tests/test_generate.py -q -x

Greedy, every path must give the reference's tokens, routes and pasts, with log-probs within float
rounding (a retired row is computed in a smaller batch). Sampled, a path that draws for the same rows
in the same order (no row retires: no stop id) must give the very same tokens and log-probs."""
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


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw})).eval()


@pytest.fixture(autouse=True)
def _restore():
    yield
    MoE.dispatch = "auto"


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
def test_retiring_and_sync_free_sample_what_generate_does(monkeypatch, prompts, stops, dispatch):
    MoE.dispatch = dispatch
    model, prompts = tiny(), PROMPTS[prompts]
    stop = stops_for(model, prompts, stops)
    kw = dict(stop_ids=stop, return_routes=True, return_past=True)
    ref = run(sampling.reference, model, prompts, temperature=0, **kw)
    if stop:
        assert {len(o["tokens"]) for o in ref} != {10}       # rows stop at different steps
    for free in (False, True):
        monkeypatch.setattr(sampling, "SYNC_FREE", free)
        monkeypatch.setattr(sampling, "DONE_EVERY", 4)
        assert_same(ref, run(sampling.retiring, model, prompts, temperature=0, **kw))
    # sampled, no stop id: no row retires, the same draws for the same rows
    monkeypatch.setattr(sampling, "SYNC_FREE", False)
    kw = dict(return_routes=True, temperature=1.0, top_k=20, top_p=0.9)
    assert_same(run(sampling.reference, model, prompts, **kw), run(sampling.retiring, model, prompts, **kw),
                exact=True)


@pytest.mark.parametrize("n_expert", [6, 1])
def test_pasts_continue_alike(n_expert):
    """A second turn from each row's past (multi-turn episodes): the speed paths continue as the
    reference does, and the reference as one call on the whole context."""
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
    model has MTP modules (not when routes are asked for), the compiled step where COMPILE is set;
    every choice gives the reference's greedy tokens."""
    model, taken = tiny(n_mtp=1), []
    spy = lambda name, f: lambda *a, **k: taken.append(name) or f(*a, **k)
    monkeypatch.setattr(sampling, "retiring", spy("retiring", sampling.retiring))
    monkeypatch.setattr(sampling, "compiled_trunk", lambda m: taken.append("compiled") or m.trunk)
    ref = run(sampling.reference, model, RAGGED, temperature=0)
    for spec, compiled, routes, want in [(False, False, False, ["retiring"]), (True, False, False, ["speculative"]),
                                         (True, False, True, ["retiring"]), (False, True, False, ["compiled", "retiring"])]:
        monkeypatch.setattr(sampling, "SPECULATIVE", spy("speculative", speculative.generate) if spec else None)
        monkeypatch.setattr(sampling, "COMPILE", compiled)
        taken.clear()
        got = run(sampling.generate, model, RAGGED, temperature=0, return_routes=routes)
        assert taken == want and [o["tokens"] for o in got] == [o["tokens"] for o in ref]


@pytest.mark.slow   # a torch.compile of the decode step (minutes on 2 cores)
def test_compiled_decode_samples_what_generate_does(monkeypatch):
    model = tiny()
    monkeypatch.setattr(sampling, "_COMPILED", {})
    for prompts in (RAGGED, EVEN):
        kw = dict(temperature=0, stop_ids=stops_for(model, prompts, "some"), return_routes=True, return_past=True)
        ref = run(sampling.reference, model, prompts, **kw)
        assert_same(ref, run(sampling.retiring, model, prompts, trunk=sampling.compiled_trunk(model), **kw))
    assert sampling._COMPILED["trunk"] is not False
