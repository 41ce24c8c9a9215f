"""Continuous batching (env.episodes_continuous over sampling.Rows) against the reference episode loop
(env.run_episodes turn by turn, sampling.EPISODES = "turns"), on tiny random models and the real
sandbox: python -m pytest tests/test_episodes.py -q

Each row draws from a random stream of its own (sampling.Streams), so the two loops sample the same
episodes, greedy or not, although their rows share batches differently: the same tokens, fed ids,
observations, segments, routes, actions and verdicts, log-probs within float rounding (a row is
computed beside other rows: 1e-5 here, as tests/test_generate.py allows)."""
import copy

import pytest
import torch

import env
import sampling
from data.repos import generate_repo_tasks
from data.tasks import generate_tasks
from model import GPT, GPTConfig
from tokenizer import train_tokenizer

SPLITMIX = (1 << 64) - 1


def splitmix64(seed, u):
    """The u-th number of SplitMix64 from seed (Steele et al. 2014), on Python ints: what Streams hashes."""
    z = (seed + u * 0x9E3779B97F4A7C15) & SPLITMIX
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & SPLITMIX
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & SPLITMIX
    return (z ^ (z >> 31)) >> 40


def tiny_model(vocab, seq_len=640, **loud):
    """A random model; loud: {token id: weight} rows of the head that read a constant direction of the
    residual stream, so that those tokens come often (tests/test_summary.py's loud_model)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1))
    with torch.no_grad():
        model.wte.weight[:, 0] = 30.0
        for i, w in loud.items():
            model.lm_head.weight[int(i), 0] = w
    return model.eval()


@pytest.fixture(scope="module")
def functions():
    """Two random models, for greedy and sampled episodes, whose turns end at different tokens: greedy,
    the end-of-text row is a copy of the row of a token that some of the greedy continuations of the
    tasks' prompts write and others do not (a random model's continuations barely depend on the
    prompt), scaled up until they end at two lengths or more; sampled, end-of-text's row x 20."""
    texts = [env.corpus_text(t) for t in generate_tasks("train", 200, seed=0)]
    tok, tasks = train_tokenizer(texts, 400), generate_tasks("test", 5, seed=1, difficulties=[1, 2])
    model, prompts = tiny_model(tok.vocab_size), [tok.encode(env.render_prompt(t)) for t in tasks]
    greedy = lambda: [o["tokens"] for o in sampling.reference(model, prompts, 12, temperature=0,  # noqa: E731
                                                              stop_ids=[tok.eot_id])]
    with torch.no_grad():
        model.wte.weight[:, 0].normal_(0, 0.02)       # no constant direction here
        first, row = greedy(), model.lm_head.weight[tok.eot_id].clone()
        loud = copy.deepcopy(model)
        loud.lm_head.weight[tok.eot_id] *= 20
        for t in sorted({t for o in first for t in o if 0 < sum(t in g for g in first) < len(first)}):
            for scale in (1.001, 1.01, 1.05):
                model.lm_head.weight[tok.eot_id] = scale * model.lm_head.weight[t]
                if len({len(o) for o in greedy()}) > 1:
                    return {0.0: model, 1.0: loud}, tok, tasks
        model.lm_head.weight[tok.eot_id] = row
    raise AssertionError("no token ends greedy turns at two lengths")


@pytest.fixture(scope="module")
def repos():
    tasks = generate_repo_tasks("test", 2, seed=3, difficulties=[1, 2], kinds=("long",))
    tok = train_tokenizer([x for t in tasks for x in list(t.files.values()) + [t.issue]] * 4, 400).with_tools()
    loud = {"<|ls|>": 0.9, "<|read|>": 1.3, "<|test|>": 0.8, "<|submit|>": 0.4, "<|end|>": 1.2}
    return tiny_model(tok.vocab_size, 1024, **{str(tok.tool_ids[k]): w for k, w in loud.items()}), tok, tasks


def both(monkeypatch, *args, **kw):
    """run_episodes by the reference loop, then by continuous batching (counting its steps)."""
    out, steps, real = [], [], sampling.Rows.step
    monkeypatch.setattr(sampling.Rows, "step", lambda self: steps.append(len(self)) or real(self))
    for loop in ("turns", "continuous"):
        monkeypatch.setattr(sampling, "EPISODES", loop)
        out.append(env.run_episodes(*args, generator=torch.Generator().manual_seed(5), return_routes=True, **kw))
        assert bool(steps) == (loop == "continuous")
    return out[0], out[1], steps


def assert_same_episodes(ref, got):
    assert len(ref) == len(got)
    worst = 0.0
    for a, b in zip(ref, got):
        assert (a.task_idx, a.end, a.errors, a.blind, a.summaries) == (b.task_idx, b.end, b.errors, b.blind, b.summaries)
        assert a.actions == b.actions and len(a.turns) == len(b.turns)
        assert (a.result.outcome, a.result.reward) == (b.result.outcome, b.result.reward)
        assert [r.outcome for r in a.results] == [r.outcome for r in b.results]
        for x, y in zip(a.turns, b.turns):
            assert (x.prompt_ids, x.tokens, x.text, x.completion, x.feedback) == \
                   (y.prompt_ids, y.tokens, y.text, y.completion, y.feedback)
            assert (x.stopped, x.prompt_truncated, x.segment, x.summary, x.visible_passed) == \
                   (y.stopped, y.prompt_truncated, y.segment, y.summary, y.visible_passed)
            assert torch.equal(x.routes, y.routes) and x.past is None and y.past is None
            assert x.routes.size(1) == len(x.prompt_ids) + len(x.tokens) - 1      # router replay: every id fed
            if x.tokens:
                worst = max(worst, max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)))
    assert worst < 1e-5


def test_streams_are_splitmix64_and_a_row_draws_alike_in_any_batch():
    seeds = [1, 2 ** 61 + 12345, 0, 2 ** 62 - 1]
    s = sampling.Streams(seeds, [0, 5, 0, 9])
    for u in range(1, 4):
        want = [splitmix64(x, u + d) / 2 ** 24 for x, d in zip(seeds, [0, 5, 0, 9])]
        assert s.uniform()[:, 0].tolist() == want
    # sampled with stop ids (rows retire at different steps), in one batch, two decode streams, or alone:
    # each row's tokens are its own
    model = tiny_model(61, 96)
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8], [4, 4, 2, 7, 1]] * 8
    seeds = sampling.row_seeds(len(prompts), torch.Generator().manual_seed(0))
    kw = dict(temperature=1.0, top_k=20, stop_ids=(3, 7, 11))
    alone = [sampling.reference(model, [p], 12, generator=sampling.Streams([s]), **kw)[0]["tokens"]
             for p, s in zip(prompts, seeds)]
    assert len({len(t) for t in alone}) > 2
    for fn in (sampling.reference, sampling.retiring, sampling.generate):
        assert [o["tokens"] for o in fn(model, prompts, 12, generator=sampling.Streams(seeds), **kw)] == alone


CASES = {"feedback1": lambda: env.Feedback(1), "feedback3": lambda: env.Feedback(3),
         "tools": lambda: env.Tools(max_actions=6, max_errors=5),
         "summary": lambda: env.Tools(max_actions=8, max_errors=6, memory="summary", window=200, max_summaries=2),
         "window": lambda: env.Tools(max_actions=8, max_errors=6, memory="window", window=400),
         "mask": lambda: env.Tools(max_actions=8, max_errors=6, memory="mask", window=400),
         "oracle": lambda: env.Tools(max_actions=8, max_errors=6, memory="oracle", window=400)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("case", sorted(CASES))
def test_continuous_episodes_are_the_reference_loops(monkeypatch, pool, functions, repos, case, temperature):
    """Greedy and sampled, with more rows than the batch holds (finished episodes' places refilled),
    rows whose turns end at different tokens, and (long tasks) summaries cut at their cap and windows
    rebuilt: the same episodes."""
    tools = CASES[case]()
    model, tok, tasks = functions if case.startswith("feedback") else repos
    model = model[temperature] if case.startswith("feedback") else model
    n, batch, new = (3, 8, 12) if case.startswith("feedback") else (3, 4, 72 if case == "summary" else 24)
    ref, got, steps = both(monkeypatch, model, tok, tasks, n, tools, pool, temperature, new, batch_size=batch)
    assert_same_episodes(ref, got)
    assert max(steps) == batch and len(ref) > batch                         # refilled places
    # turns that end at different tokens (greedy, a loud tool row writes until max_new_tokens but for
    # the summaries' cap)
    lengths = {len(x.tokens) for e in ref for x in e.turns}
    assert case in ("tools", "window", "mask", "oracle") and not temperature or len(lengths) > 1 and \
        min(lengths) < new
    if temperature and case in ("tools", "window", "mask", "oracle"):       # episodes of different lengths
        assert len({len(e.turns) for e in ref}) > 1
    if case == "summary":
        assert any(x.summary for e in ref for x in e.turns)
        assert temperature or any(x.summary and len(x.tokens) < new for e in ref for x in e.turns)
    if case in ("window", "mask", "oracle"):
        assert any(x.segment for e in ref for x in e.turns)                 # a context rebuilt


def test_the_chooser(monkeypatch):
    """sampling.continuous: continuous batching unless EPISODES says turns, generate would decode
    speculatively (agent.py at batch 1: the turn loop's speed path), or one-turn rows fit one batch
    (nothing to refill)."""
    model = tiny_model(61, 96)
    assert sampling.continuous(model, False, 3, 8, 8) and sampling.continuous(model, False, 1, 9, 8)
    assert not sampling.continuous(model, False, 1, 8, 8)
    monkeypatch.setattr(sampling, "EPISODES", "turns")
    assert not sampling.continuous(model, False, 3, 8, 8)
    monkeypatch.setattr(sampling, "EPISODES", "continuous")
    spec = tiny_model(61, 96)
    spec.config.n_mtp = 1
    monkeypatch.setattr(sampling, "SPECULATIVE", lambda *a, **k: None)
    assert not sampling.continuous(spec, False, 3, 8, 8) and sampling.continuous(spec, True, 3, 8, 8)
