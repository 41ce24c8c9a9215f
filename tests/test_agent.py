"""Multi-turn episodes (agent.py, env.py's episode text, train_rl.py / eval.py --turns), on a tiny
random model and the real sandbox: timeout 300 python -m pytest tests/test_agent.py -q -x"""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from infra import common  # noqa: E402
import env  # noqa: E402
from sandbox import Result  # noqa: E402
import sampling  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from rl.algo import flatten  # noqa: E402
from data.tasks import Task, generate_tasks, load_humaneval  # noqa: E402
from tokenizer import train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random model with a context long enough for several turns, its tokenizer, its checkpoint."""
    texts = [env.corpus_text(t) for t in generate_tasks("train", 300, seed=0)]
    tok = train_tokenizer(texts, 400)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=640, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1))
    with torch.no_grad():   # a loud end-of-text row: attempts end after a few tokens
        model.lm_head.weight[tok.eot_id] *= 20
    path = str(tmp_path_factory.mktemp("agent") / "tiny.pt")
    common.save_checkpoint(path, model, tok)
    return model.eval(), tok, path


def test_two_streams_are_generate_retiring_per_share():
    """Two streams = generate() on each share of the rows with the share's own generator (seeded from
    the caller's), the rows of one prompt kept in one share, side by side in threads: same tokens,
    log-probs, routes and pasts (each call collects its own experts, so the threads do not mix
    them up), and a second turn continues each row's past through the streams."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, n_expert=4,
                          top_k=2, expert_hidden=32, n_dense_layers=1)).eval()
    prompts = [[5, 3, 9]] * 12 + [[1, 2, 3, 4, 5, 6, 7]] * 12 + [[8]] * 12 + [[4, 4]] * 12
    kw = dict(temperature=1.0, return_routes=True, return_past=True)

    def per_share(prompts, n, seed, past=None):
        seeds = torch.randint(0, 2 ** 62, (2,), generator=torch.Generator().manual_seed(seed)).tolist()
        with sampling.cpu_threads(1):   # as the streams run (the thread count moves float rounding)
            return [o for (a, b), s in zip([(0, 24), (24, 48)], seeds)
                    for o in sampling.retiring(model, prompts[a:b], n, generator=torch.Generator().manual_seed(s),
                                            past=past[a:b] if past else None, **kw)]

    def same(got, want):
        assert len(got) == len(want) == 48
        for x, y in zip(got, want):
            assert x["tokens"] == y["tokens"] and x["logprobs"] == y["logprobs"]
            assert torch.equal(x["routes"], y["routes"]) and torch.equal(x["past"], y["past"])
    g = torch.Generator()
    for _ in range(3):   # threads interleave differently each time
        first = sampling.generate(model, prompts, 8, streams=2, generator=g.manual_seed(0), **kw)
        same(first, per_share(prompts, 8, 0))
    feeds = [[7, 7]] * 48
    pasts = [o["past"] for o in first]
    same(sampling.generate(model, feeds, 5, streams=2, generator=g.manual_seed(1), past=pasts, **kw),
         per_share(feeds, 5, 1, pasts))
    # under 16 rows per stream, or one prompt only (one share): plain generate with the caller's generator
    for rows in (prompts[:20], prompts[:1] * 40, prompts[:3]):
        one = sampling.generate(model, rows, 6, streams=2, generator=g.manual_seed(2), temperature=1.0)
        with sampling.cpu_threads(1):
            assert one == sampling.retiring(model, rows, 6, generator=g.manual_seed(2), temperature=1.0)


def test_visible_tests_are_the_docstring_examples():
    for t in generate_tasks("test", 200, seed=3) + generate_tasks("train", 200, seed=3):
        cases = env.visible_tests(t)
        k = t.prompt.count(">>> ")
        assert k >= 1 and cases == list(zip(t.inputs[:k], t.outputs[:k])), t.task_id
        v = env.visible_task(t)
        assert v.inputs == t.inputs[:k] and v.outputs == t.outputs[:k] and v.prompt == t.prompt
    he = {t.task_id: t for t in load_humaneval()}
    assert env.visible_tests(he["HumanEval/0"]) == [([[1.0, 2.0, 3.0], 0.5], False), ([[1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3], True)]
    assert env.visible_task(Task("x", 'def f(a):\n    """Add one."""\n', "f")) is None


def test_feedback_shows_only_visible_examples(pool):
    """A wrong body's feedback names a failing docstring example, never a hidden input or answer."""
    ts = [t for t in generate_tasks("test", 40, seed=5) if t.outputs[0] != t.inputs[0][0]][:20]
    wrong = "    return " + "{}\n"
    for t, r in zip(ts, pool.run_batch(env.runs([env.visible_task(t) for t in ts], [wrong] * len(ts)))):
        assert not r.passed
        fb = env.render_feedback(t, r, wrong)
        k = t.prompt.count(">>> ")
        assert fb.startswith("# Test failed: ") and fb.endswith(t.prompt.splitlines()[0] + "\n")
        calls = [f"{t.entry_point}({', '.join(map(repr, a))})" for a in t.inputs]
        assert any(c in fb for c in calls[:k])
        assert not any(c in fb for c in calls[k:] if c not in calls[:k])
    assert env.render_feedback(ts[0], r, "    return 1").startswith("\n# Test failed")   # a line of its own


def test_episodes_feed_exactly_the_rendered_context(tiny, pool):
    """Every episode's tokens are env.render_episode's text, turns continue only after a failed
    visible example, and the hidden tests judged every attempt."""
    model, tok, _ = tiny
    ts = generate_tasks("test", 6, seed=1, difficulties=[1, 2])
    eps = env.run_episodes(model, tok, ts, 3, env.Feedback(3), pool, temperature=1.0, max_new_tokens=12,
                              batch_size=8, generator=torch.Generator().manual_seed(0))
    assert [e.task_idx for e in eps] == [i for i in range(6) for _ in range(3)]
    assert max(len(e.turns) for e in eps) == 3                         # a random model fails and retries
    for e in eps:
        t = ts[e.task_idx]
        ids = flatten(e)[0] + e.turns[-1].tokens[-1:]                  # every token, the last included
        text = tok.decode([i for i in ids if i < tok.eot_id])
        assert text == env.render_episode(t, [(x.text, x.feedback) for x in e.turns])
        assert len(e.results) == len(e.turns) and e.result is e.results[-1]
        assert all(x.feedback for x in e.turns[:-1]) and not e.turns[-1].feedback
        for x, r in zip(e.turns, e.results):
            assert r.outcome == pool.run_batch(env.runs([t], [x.completion]))[0].outcome
    # one turn is exactly generate() on the prompts, each row drawing from its own stream (seeded from the
    # generator): single-turn sampling
    one = env.run_episodes(model, tok, ts, 3, env.Feedback(1), pool, 1.0, 12, batch_size=8,
                              generator=torch.Generator().manual_seed(0))
    prompts = [tok.encode(env.render_prompt(t)) for t in ts for _ in range(3)]
    seeds = sampling.row_seeds(18, torch.Generator().manual_seed(0))
    ref = [o for i in range(0, 18, 8) for o in sampling.generate(model, prompts[i:i + 8], 12, temperature=1.0,
                                                             stop_ids=[tok.eot_id],
                                                             generator=sampling.Streams(seeds[i:i + 8]))]
    assert [e.turns[0].tokens for e in one] == [o["tokens"] for o in ref]
    assert [e.result.outcome for e in one] == [r.outcome for r in pool.run_batch(
        env.runs([ts[e.task_idx] for e in one], [e.turns[0].completion for e in one]))]


def test_repair_prompt_is_what_the_second_turn_reads(tiny, pool):
    """env.repair_prompt (the context --repair-groups samples repairs from) is, id for id, what an
    episode's second turn continues from: turn 1's prompt and tokens as its cache holds them, then
    turn 2's feed."""
    model, tok, _ = tiny
    ts = generate_tasks("test", 6, seed=1, difficulties=[1, 2])
    eps = env.run_episodes(model, tok, ts, 2, env.Feedback(2), pool, 1.0, 12, generator=torch.Generator().manual_seed(0))
    two = [e for e in eps if len(e.turns) == 2]
    assert two
    for e in two:
        t = ts[e.task_idx]
        a, b = e.turns
        seen = pool.run_batch(env.runs([env.visible_task(t)], [a.completion]))[0]
        assert env.repair_prompt(tok, t, a, seen) == a.prompt_ids + a.tokens[:-1] + b.prompt_ids


def test_repair_groups_branch_failed_attempts_and_train_on_policy(tiny, pool, tmp_path, monkeypatch):
    """--repair-groups: in each task a first attempt solved, G repairs branch from the first attempt
    that fails a visible example, each reading env.repair_prompt's context; they form a group next
    to their task's, and the training forward over them (their shared context packed once, router
    replay) reproduces the sampler's log-probs. The random model solves nothing, so the test calls
    the first attempt of tasks 0 and 1, and the first repair of each group, a pass."""
    from rl import rollouts
    import train_rl
    model, tok, path = tiny
    args = common.parse_args(train_rl.p, train_rl.PRESETS, ["--preset", "smoke", "--device", "cpu", "--init-from",
                                                            path, "--out-dir", str(tmp_path), "--repair-groups",
                                                            "--eval-tasks", "0", "--group-size", "4"])
    ctx = train_rl.setup(args)
    assert ctx.rollout is rollouts.repair_groups        # chosen once, in setup
    ts = generate_tasks("train", 3, seed=0, difficulties=[1])
    win = lambda r: Result(1.0, True, "pass", "", r.n_tests, r.n_tests)
    first_attempts, branch, seen = rollouts.single_turn, rollouts.sample_repairs, {}

    def rigged_attempts(*a):
        samples, results = first_attempts(*a)
        results = [win(r) if i in (0, 4) else r for i, r in enumerate(results)]   # task 0's, task 1's first
        seen.update(samples=samples, results=results)
        return samples, results

    def rigged_repairs(*a):
        repairs, results = branch(*a)
        seen.update(repairs=repairs, repair_results=results)
        if seen.get("resubmit"):     # every repair fails (the random model's do)
            return repairs, results
        return repairs, [win(r) if i % 4 == 0 else r for i, r in enumerate(results)]

    find_roots, run = rollouts.repair_roots, rollouts.env.run_episodes

    def recorded_roots(*a):
        seen["roots"] = find_roots(*a)
        return seen["roots"]

    def resubmitting(*a, **kw):      # with "resubmit": the second repair of each root writes the root's
        tools = kw["tools"]          # code, the others code of their own that fails (before the judge)
        if kw.get("prompts") is not None and seen.get("resubmit"):
            parents, step = sorted(seen["roots"]), tools.step

            def edited(tok, pool, items, more):
                for k, (_, e, x) in enumerate(items):
                    root = seen["roots"][parents[e.task_idx]][1].turns[0].completion
                    x.completion = root + "\n" if k % 4 == 1 else "    raise ValueError('edited')\n"
                return step(tok, pool, items, more)
            tools.step = edited
        return run(*a, **kw)
    monkeypatch.setattr(rollouts, "single_turn", rigged_attempts)
    monkeypatch.setattr(rollouts, "sample_repairs", rigged_repairs)
    monkeypatch.setattr(rollouts, "repair_roots", recorded_roots)
    monkeypatch.setattr(rollouts.env, "run_episodes", resubmitting)
    monkeypatch.setattr(sampling, "EPISODES", "turns")   # the rig counts rows in one step call: all of a turn's
    rounds = []

    def one_round():     # rl_step over one round of the tasks ts, its groups recorded and not trained on
        with monkeypatch.context() as m:
            m.setattr(rollouts, "draw_tasks", lambda ctx, need, stats: ts)
            m.setattr(train_rl, "micro_batches", lambda groups, *a: rounds.append(groups) or [])
            return train_rl.rl_step(ctx, 0), rounds[-1]
    try:
        ctx.per_rank = 4     # a step takes up to 4 groups: all of the round's
        stats, groups = one_round()
        assert stats["trained_seqs"] == 0 and ctx.state["queue"] == []
        repairs = seen["repairs"]
        assert stats["repair_roots"] == 2 and [s.task_idx for s in repairs] == [0] * 4 + [1] * 4
        for i in (0, 1):     # the root: the task's first attempt failing the hidden tests and a visible example
            root = next(s for s, r in zip(seen["samples"], seen["results"]) if s.task_idx == i and not r.passed)
            root = root.turns[0]
            v = pool.run_batch(env.runs([env.visible_task(ts[i])], [root.completion]))[0]
            assert not v.passed
            assert all(s.turns[0].prompt_ids == env.repair_prompt(tok, ts[i], root, v) and s.repair
                       and s.repeat == (s.turns[0].completion.rstrip() == root.completion.rstrip())
                       for s in repairs if s.task_idx == i)
        again = pool.run_batch(env.runs([ts[s.task_idx] for s in repairs], [s.turns[0].completion for s in repairs]))
        assert [r.outcome for r in seen["repair_results"]] == [r.outcome for r in again]
        # task 0's group, its repairs, task 1's group, its repairs; task 2 (all fail) has no signal
        assert [len(g) for g in groups] == [4] * 4
        prompt = lambda x: x.turns[0].prompt_ids
        assert [prompt(g[0]) for g in groups[1::2]] == [prompt(repairs[0]), prompt(repairs[4])]
        # the pass rate, outcomes and lengths are of the first attempts only
        assert stats["n_scored"] == 12 and stats["passes"] == 2 and stats["len_n"] == 12
        assert sum(v for k, v in stats.items() if k.startswith("outcome/")) == 12 and stats["repair_n"] == 8
        assert stats["repair_repeats"] == sum(s.repeat for s in repairs)
        # a repair that resubmits its root (up to trailing whitespace) is marked and counted in
        # repair_repeat_rate; it scores as the failure it is, so a group of failed repairs has no signal
        seen["resubmit"] = True
        resub, failed = one_round()
        assert [s.repeat for s in seen["repairs"]] == [k % 4 == 1 for k in range(8)]
        assert resub["repair_repeats"] == 2
        rollouts.record(ctx, 0, resub, tqdm(disable=True))
        with open(ctx.metrics_path) as f:
            assert json.loads(f.read().splitlines()[-1])["repair_repeat_rate"] == 0.25
        assert [len(g) for g in failed] == [4, 4]         # the first attempts' groups, no repair group
        assert [prompt(g[0]) for g in failed] == [prompt(groups[0][0]), prompt(groups[2][0])]
        seen["resubmit"] = False
        # rl_step trains on the groups of the first round (queued: nothing is sampled), on-policy
        ctx.state["queue"] = groups
        s = train_rl.rl_step(ctx, 0)
        assert s["trained_seqs"] == 16 and s["rounds"] == 0 and s["mismatch_e0"] / s["tokens_e0"] < 1e-3
        ctx.per_rank = 2
        # a step needs 2 groups (--batch-tasks 2): its two tasks give four, two wait in the queue, and the
        # next step trains on those alone, sampling nothing
        first = train_rl.rl_step(ctx, 0)
        assert first["trained_seqs"] == 2 * 4 and len(ctx.state["queue"]) == 2
        second = train_rl.rl_step(ctx, 1)
        assert second["trained_seqs"] == 2 * 4 and second["rounds"] == 0 and second["n_scored"] == 0
        assert ctx.state["queue"] == []
        rollouts.record(ctx, 1, second, tqdm(disable=True))    # no rates of a step that sampled nothing
        with open(ctx.metrics_path) as f:
            rec = json.loads(f.read().splitlines()[-1])
        assert rec["reward"] is None and rec["pass_rate"] is None and rec["repair_pass_rate"] is None
        assert rec["repair_repeat_rate"] is None
    finally:
        ctx.pool.close()


def test_an_episode_ends_when_another_turn_would_not_fit(tiny, pool):
    model, tok, _ = tiny
    ts = generate_tasks("test", 4, seed=1, difficulties=[1, 2])
    room = model.config.seq_len - min(len(tok.encode(t.prompt)) for t in ts)   # turn 2 cannot fit
    eps = env.run_episodes(model, tok, ts, 2, env.Feedback(3), pool, 1.0, room, generator=torch.Generator().manual_seed(0))
    assert all(len(e.turns) == 1 and e.turns[0].feedback == "" for e in eps)


class LosingPool:
    """The real pool, except that every visible-example run comes back as a sandbox failure."""
    def __init__(self, pool):
        self.pool = pool

    def submit_batch(self, *a, **kw):
        return self.pool.submit_batch(*a, **kw)

    def run_batch(self, runs, fractional=False):
        return [Result(0.0, False, "sandbox_error", "worker died", 0, 1) for _ in runs]


def test_a_lost_feedback_run_is_not_the_models_failure(tiny, pool):
    model, tok, _ = tiny
    ts = generate_tasks("test", 2, seed=1, difficulties=[1, 2])
    eps = env.run_episodes(model, tok, ts, 2, env.Feedback(3), LosingPool(pool), 1.0, 12,
                              generator=torch.Generator().manual_seed(0))
    assert all(len(e.turns) == 1 and e.result.outcome == "sandbox_error" for e in eps)
    assert all(e.results[0].outcome != "sandbox_error" for e in eps)      # the hidden verdict is still kept


def test_resample_baseline_is_the_episode_rule_without_feedback():
    """resample_pass against brute force over every ordered draw; and a worked case where picking by
    the visible examples loses to the hidden-test oracle: samples (visible, hidden) = (pass, fail),
    (fail, pass), (fail, pass), T = 2: a draw holding the first keeps it and fails (4 of 6 orders),
    else the last of two hidden passes is kept: 1/3, while pass@2 is 1."""
    import itertools
    import random
    import eval as evaluation
    assert evaluation.resample_pass([(True, False), (False, True), (False, True)], 2) == pytest.approx(1 / 3)
    r = random.Random(0)
    for _ in range(30):
        cases = [(r.random() < 0.5, r.random() < 0.5) for _ in range(r.randint(2, 6))]
        T = r.randint(1, len(cases))
        draws = list(itertools.permutations(range(len(cases)), T))
        kept = [next((i for i in d if cases[i][0]), d[-1]) for d in draws]
        assert evaluation.resample_pass(cases, T) == pytest.approx(sum(cases[i][1] for i in kept) / len(draws))


def test_episode_figures_on_worked_numbers():
    """Task 0 (near): episodes pass at turns [F,T], [F,F], [T]; task 1 (novel): [F,F], [F,F], [F,T].
    pass@1 by turn: turn 1: 1/6, turn 2: 3/6. Repair rate: 2 of the 5 turn-1 failures. pass@2
    without feedback from the turn-1 attempts: task 0 has 1 pass in 3 (1 - C(2,2)/C(3,2) = 2/3),
    task 1 none: 1/3. Repeat rate: of the 5 second attempts, the two failed ones of task 1 resubmit
    their first attempt (one with other trailing whitespace): 2/5; near 0/2, novel 2/3. A 3-turn
    episode A, B, A repeats no previous attempt: 0/2."""
    import eval as evaluation
    R = lambda ok: Result(float(ok), ok, "pass" if ok else "wrong_answer", "", 0, 1)
    ts = [Task("a", "def f(x):\n", "f", slice="near"), Task("b", "def g(x):\n", "g", slice="novel")]
    runs = [(0, [0, 1]), (0, [0, 0]), (0, [1]), (1, [0, 0]), (1, [0, 0]), (1, [0, 1])]
    turn = lambda code: env.Turn([], [], [], completion=code)
    eps = [env.Episode(i, [turn(f"    return {j}{t}\n") for t in range(len(v))], results=[R(bool(x)) for x in v])
           for j, (i, v) in enumerate(runs)]
    for e in eps:
        e.result = e.results[-1]
    eps[3].turns[1].completion = eps[3].turns[0].completion          # same code ...
    eps[4].turns[1].completion = eps[4].turns[0].completion + "  \n"  # ... up to whitespace
    f = evaluation.episode_figures(ts, eps, 2)
    assert f["repeat_rate"] == pytest.approx(2 / 5) and f["repeat_rate_near"] == 0
    assert f["repeat_rate_novel"] == pytest.approx(2 / 3)
    aba = env.Episode(0, [turn(c) for c in ("    return 1\n", "    return 2\n", "    return 1\n")],
                      result=R(False), results=[R(False)] * 3)
    assert evaluation.episode_figures(ts, [aba], 3)["repeat_rate"] == 0
    assert f["pass@1_by_turn"] == pytest.approx([1 / 6, 3 / 6]) and f["repair_rate"] == pytest.approx(2 / 5)
    assert f["pass@2_no_feedback"] == pytest.approx(1 / 3) and f["pass@2_no_feedback_near"] == pytest.approx(2 / 3)
    assert f["pass@1_by_turn_novel"] == pytest.approx([0, 1 / 3]) and f["repair_rate_novel"] == pytest.approx(1 / 3)
    assert f["turns_mean"] == pytest.approx(11 / 6)


def test_train_rl_turns_trains_on_every_turn(tiny, tmp_path):
    """--turns 2 end to end: the training forward over the whole episode (feedback tokens fed,
    not trained) reproduces the sampler's log-probs of every generated token (router replay,
    on-policy), and the summary carries the self-repair curve before and after."""
    out = str(tmp_path / "rl")
    p = subprocess.run([sys.executable, "tests/rl_main.py", '{"len_k": 0.1}', "--preset", "smoke", "--device", "cpu",
                        "--init-from", tiny[2], "--out-dir", out, "--turns", "2", "--len-penalty", "0.05"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    for when in ("before", "after"):
        curve = s[f"pass@1_by_turn_{when}"]
        assert len(curve) == 2 and all(0 <= x <= 1 for x in curve)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "eval" not in r]
    assert any(r["turns_mean"] > 1 for r in rows)
    for r in rows:
        assert r["trained_seqs"] > 0 and r["logp_mismatch"] < 1e-3


def test_eval_turns_reports_the_repair_curve_and_its_baseline(tiny, tmp_path):
    import eval as evaluation
    evaluation.main(["--preset", "smoke", "--device", "cpu", "--ckpt", tiny[2], "--turns", "2", "--no-humaneval",
                     "--no-bpb", "--n-samples", "2", "--difficulties", "1-2", "--out-dir", str(tmp_path)])
    with open(os.path.join(tmp_path, "eval.json")) as f:
        figs = json.load(f)["figures"][tiny[2]]
    assert figs["test/pass@1_by_turn[turn 2]"] == pytest.approx(figs["test/pass@1"])   # the last turn is the score
    assert figs["test/turns_mean"] > 1 and 0 <= figs["test/pass@2_no_feedback"] <= 1 and "test/repair_rate" in figs
    assert 0 <= figs["test/repeat_rate"] <= 1
    recs = []
    for path in glob.glob(os.path.join(tmp_path, "samples-*test.jsonl")):
        with open(path) as f:
            recs += [json.loads(line) for line in f]
    # every attempt is kept: as many as verdicts, and the repeat rate is the share of retries that copy the one before
    assert recs and all(len(r["attempts"]) == len(r["passed_by_turn"]) for r in recs)
    retries = [(a.rstrip(), b.rstrip()) for r in recs for a, b in zip(r["attempts"], r["attempts"][1:])]
    assert retries and figs["test/repeat_rate"] == pytest.approx(sum(a == b for a, b in retries) / len(retries))


def test_agent_command(tiny, tmp_path):
    prompt, out = tmp_path / "f.py", tmp_path / "out"
    prompt.write_text('def add_two(x):\n    """Add two.\n    >>> add_two(1)\n    3\n    """\n')
    p = subprocess.run([sys.executable, "agent.py", "--preset", "smoke", "--ckpt", tiny[2], "--prompt-file", str(prompt),
                        "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["task_id"] == "user/0" and 1 <= s["turns"] <= 2 and len(s["outcomes"]) == s["turns"]
    assert "# --- attempt 1" in p.stdout and "# --- verdict after" in p.stdout
    assert s["out_dir"] == str(out) and s["speculative"] is False    # the tiny model has no MTP modules
    # --out-dir keeps the episode: the transcript as printed, and the summary with every attempt
    transcript = (out / "transcript.txt").read_text()
    assert transcript.startswith("def add_two(x):") and transcript in p.stdout and "# --- verdict after" in transcript
    kept = json.loads((out / "summary.json").read_text())
    assert {k: kept[k] for k in s if k != "out_dir"} == {k: v for k, v in s.items() if k != "out_dir"}
    assert len(kept["attempts"]) == s["turns"] and kept["prompt"].startswith("def add_two(x):")
    prompt.write_text('def add_two(x):\n    """Add two."""\n')
    p = subprocess.run([sys.executable, "agent.py", "--ckpt", tiny[2], "--prompt-file", str(prompt)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().startswith("error:") and len(p.stderr.strip().splitlines()) == 1
