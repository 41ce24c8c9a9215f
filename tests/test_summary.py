"""Self-summarization: the long tasks, the summary turn in the episode loop, and its training (each
segment a sequence of its own, with the episode's advantage and the episode's normaliser)."""
import dataclasses
import re

import pytest
import torch

import env
from sandbox import Result
import rl.algo as rl
from data.repos import generate_repo_tasks, transcripts
from env import summary_text
from tokenizer import train_tokenizer
from model import GPT, GPTConfig
from rl import rollouts
import train_rl


@pytest.fixture(scope="module")
def long_tasks():
    return generate_repo_tasks("test", 6, seed=3, difficulties=[1, 2], kinds=("long",))


@pytest.fixture(scope="module")
def tok(long_tasks):
    texts = [text for t in long_tasks for text in t.files.values()] + [t.issue for t in long_tasks]
    return train_tokenizer(texts * 4, 400).with_tools()


# ---------------------------------------------------------------------------------------------
# Long tasks

def test_long_tasks_need_two_values_each_stated_only_in_its_own_file(long_tasks, pool):
    for t in long_tasks:
        assert len(t.facts) == 2 and len({f["file"] for f in t.facts}) == 2 and t.kind == "long"
        for f, label, (path, fn) in zip(t.facts, ("N1", "N2"), t.targets):
            assert f"({label}: the value set in {f['file']})" in t.files[path]   # its docstring says where
            assert f["name"] not in t.issue and f"{f['name']} = {f['value']}\n" in t.files[f["file"]]
            others = [text for path, text in t.files.items() if path != f["file"]]
            assert not any(f["name"] in text for text in others)                # the name: only in its file
            assert sum(c.isdigit() for c in t.files[f["file"]]) == len(str(abs(f["value"])))   # one number
            assert f["label"] == label and re.search(rf"(?<![\w-]){f['value']!r}\b", t.fixed[path])   # a literal
    # the reference passes the hidden tests, the broken repository does not
    ok = pool.run_batch([env.hidden_run(t, {**t.files, **t.fixed}) for t in long_tasks])
    bad = pool.run_batch([env.hidden_run(t, t.files) for t in long_tasks])
    assert all(r.passed for r in ok) and not any(r.passed for r in bad)
    assert {t.slice for t in generate_repo_tasks("test", 20, seed=3, kinds=("long",))} == {"near", "novel"}


def test_no_long_task_fits_the_window_and_a_whole_episode_needs_far_more(tok, long_tasks, pool):
    # the issue and both settings reads pass the window less a turn's generation: no memory holds both
    # numbers at once; the oracle policy's whole episode needs >= 1.5x the window (eval.py's figure)
    from eval import full_context_tokens
    for t in long_tasks:
        reads = sum(len(env.action_ids(tok, "read", f["file"])) + len(env.Tools().feed_ids(tok, t.files[f["file"]]))
                    for f in t.facts)
        assert len(tok.encode(env.render_issue(t))) + reads > env.LONG_WINDOW - 96
    need = sorted(full_context_tokens(long_tasks, pool, tok))
    assert need[len(need) // 2] >= 1.5 * env.LONG_WINDOW
    task = dataclasses.replace(long_tasks[0], facts=[{"file": "a.py", "label": "N1", "value": -7}])
    kept = lambda text: env.fact_retention(task, env.Episode(0, [env.Turn([], [], []), env.Turn(
        [], [], [], text, summary=True)], actions=[env.Action("read", "a.py")]))
    assert kept("N1 = -7") == kept("N1: -7 (a.py)") == (1, 1) and kept("N1 = 7") == kept("N1 = -70") == (1, 0)


def test_the_agent_stream_keeps_each_index_whatever_its_start():
    a = generate_repo_tasks("train", 6, seed=1, difficulties=[1, 2], long_share=0.5)
    b = generate_repo_tasks("train", 3, seed=1, difficulties=[1, 2], start=3, long_share=0.5)
    assert [t.task_id for t in a[3:]] == [t.task_id for t in b]
    assert [t.kind == "long" for t in a] == [False, True] * 3
    assert not any(t.kind == "long" for t in generate_repo_tasks("train", 3, seed=1, long_share=0.0))


def test_the_agent_streams_kinds_come_in_turn_and_long_tasks_keep_their_indices(capsys):
    """--long-share 0: the kinds in turn (one listed twice comes twice as often); a long share takes fixed
    indices; a share outside [0, 1] is a ValueError, and through train_rl.py a one-line error."""
    kinds = ("bug", "two_bugs", "bug", "config")
    tasks = generate_repo_tasks("train", 40, seed=1, difficulties=[1, 2], long_share=0.0, kinds=kinds)
    assert [t.kind for t in tasks] == list(kinds) * 10
    mixed = generate_repo_tasks("train", 40, seed=1, difficulties=[1, 2], long_share=0.3, kinds=kinds)
    assert sum(t.kind == "long" for t in mixed) == 12
    assert all(m.kind in ("long", t.kind) for m, t in zip(mixed, tasks))
    for bad in (dict(long_share=1.5), dict(kinds=()), dict(kinds=("bug", "golf"))):
        with pytest.raises(ValueError, match="long_share must be in"):
            generate_repo_tasks("train", 1, **bad)
    with pytest.raises(SystemExit) as e:
        train_rl.main(["--preset", "smoke", "--device", "cpu", "--agent", "--init-from", __file__,
                       "--long-share", "-1"])
    assert e.value.code == 2 and "--long-share must be in [0, 1], got -1.0" in capsys.readouterr().err


def test_bootstrap_transcripts_summarise_where_the_harness_asks_then_restart_fresh(long_tasks, pool, tok):
    with pytest.raises(ValueError, match="need tok"):
        transcripts(long_tasks, pool, seed=0)
    docs = transcripts(long_tasks, pool, seed=0, tok=tok)
    assert len(docs) > len(long_tasks)            # a summarised episode is a document per segment
    taken = lambda d: [s[0] for s in d.segments if s[2] and not s[1] and s[0] not in ("<|end|>", "<|summary|>")]
    ends, n, fixed = 0, {}, 0
    for d in docs:
        t = next(t for t in long_tasks if d.startswith(env.render_issue(t)))
        e, k = d.episode, n.get(id(d.episode), 0)
        n[id(e)] = k + len(taken(d))               # the episode's actions up to this document's end
        assert d.segments[0] == (env.long_tools().prompt(t), True, False)    # the issue and the file list
        if k:                                      # a fresh context: the actions left, then one state
            assert d.segments[1] == (env.LEFT.format(env.LONG_ACTIONS - k), True, False)
            assert all(s[1] for s in d.segments if s[0] == "<|summary|>")     # the request: never a target
        if d.segments[-3][0] != "<|summary|>":
            continue
        ends += 1
        request, text, end = d.segments[-3:]
        assert request == ("<|summary|>", True, True) and end == ("<|end|>", False, True) and not text[1]
        # the state every action so far reached (an action whose observation was dropped for want of
        # room: not yet), as the harness's own summary (eval's oracle_summary) writes it
        blind = d.segments[-4][0] == "<|end|>"
        assert text[0] == summary_text(t, e.actions[:n[id(e)] - blind])
        fixed += "fixed " in text[0]
        nxt = docs[docs.index(d) + 1]              # the next segment starts from this summary alone
        assert nxt.segments[2:5] == [("<|summary|>", True, True), (text[0], True, False), ("<|end|>", True, True)]
        assert nxt.segments[5][0] != "<|summary|>"
    assert ends and fixed                          # the teacher's edits are in its summaries (issue 63)
    # each summary falls where the harness asks for one: the context passes the task's threshold at the
    # observation before it, and at no earlier observation of its segment (ids counted as encode_doc does)
    asked = 0
    for d in [d for d in docs if "<|summary|>" in d]:          # the rest: episodes that never pass it
        t = next(t for t in long_tasks if d.startswith(env.render_issue(t)))
        n, at = 0, env.summary_at(t, env.LONG_WINDOW)
        for k, (piece, _, special) in enumerate(d.segments):
            n += 1 if special else len(tok.encode(piece))
            if piece == "<|/obs|>":
                if k + 1 == len(d.segments):       # the summary cap ended the episode here
                    break
                follows = d.segments[k + 1][0] == "<|summary|>"
                assert (n > at) == follows
                asked += follows
    assert asked


def test_the_bootstrap_s_summaries_say_what_the_teacher_fixed(long_tasks, pool, tok):
    """Issue 63's bug: transcripts() never recorded the teacher's actions in its episode, so the bootstrap's
    summaries never said `fixed f in p` (0 of 211), while eval's oracle summary does after each edit: every
    function to fix that the teacher edited before a summary (read off the transcript's own text) is
    `fixed` there, and no other."""
    docs, n = transcripts(long_tasks, pool, seed=0, tok=tok), 0
    for t in long_tasks:
        edited = set()
        for d in [d for d in docs if d.startswith(env.render_issue(t))]:      # its segments, in order
            edited |= {(p, f) for p, f in re.findall(r"<\|edit\|>([\w/.]+)\ndef (\w+)\(", d)}
            if d.segments[-3][0] == "<|summary|>":
                said = {(p, f) for f, p in re.findall(r"^fixed (\w+) in ([\w/.]+)$", d.segments[-2][0], re.M)}
                assert said == {(p, f) for p, f in t.targets if (p, f) in edited}, t.task_id
                n += len(said)
    assert n


def test_a_summary_is_a_state_to_restart_from():
    """summary_text, worked: each number read and where it lives, each one a file read places, each
    function to fix with its signature and docstring line once its module was read, what was edited."""
    t = generate_repo_tasks("test", 1, seed=11, difficulties=[1, 2], kinds=("long",))[0]
    (p1, f1), (p2, f2) = t.targets
    n1, n2 = t.facts
    read = lambda *paths: [env.Action("read", p) for p in paths]
    assert summary_text(t, []) == "nothing read yet"
    assert summary_text(t, [env.Action("read", "x.py", error="tool")]) == "nothing read yet"
    assert summary_text(t, read(n2["file"])) == f"N2 = {n2['value']} ({n2['file']})"
    doc = re.search(rf'^def ({f1}\(\w+\)):\n    """(.*) \(N1: the value set in {n1["file"]}\)\."""$', t.files[p1], re.M)
    assert summary_text(t, read(p1)) == f"N1 in {n1['file']}\nfix {f1} in {p1}: {doc[1]} {doc[2]}."
    edit = env.Action("edit", p1, f1)
    assert summary_text(t, read(p1, n1["file"]) + [edit] + read(t.module + ".py")).split("\n") == \
        [f"N1 = {n1['value']} ({n1['file']})", f"N2 in {n2['file']}", f"fixed {f1} in {p1}"] + \
        ([f"fix {f2} in {p2}: " + summary_text(t, read(p2)).split(": ", 1)[1]] if p2 == p1 else [])
    assert summary_text(t, [edit, dataclasses.replace(edit, path=p2, function=f2)]) == \
        f"fixed {f1} in {p1}\nfixed {f2} in {p2}"
    f = n2
    kept = env.Episode(0, [env.Turn([], [], []), env.Turn([], [], [], f"N2 = {f['value']}", summary=True)],
                       actions=[env.Action("read", f["file"])])
    assert env.fact_retention(t, kept) == (1, 1)
    kept.turns[1].text = f"N1 = {f['value']}"
    assert env.fact_retention(t, kept) == (1, 0)


# ---------------------------------------------------------------------------------------------
# The summary turn in the loop

def loud_model(tok, seq_len=1024):
    """A random model whose tool rows are loud, so that it reads, writes and closes actions."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=seq_len, n_layer=2, n_head=2, n_kv_head=1,
                          n_embd=32, n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1))
    with torch.no_grad():
        model.wte.weight[:, 0] = 30.0
        loud = (("<|ls|>", 0.9), ("<|read|>", 1.3), ("<|test|>", 0.8), ("<|submit|>", 0.4), ("<|end|>", 1.2))
        for name, w in loud:
            model.lm_head.weight[tok.tool_ids[name], 0] = w
    return model


def test_summary_episodes_are_chains_of_segments_of_exactly_the_sampled_tokens(tok, pool, long_tasks):
    """Each segment starts from the issue and the summaries so far, as the model's own sampled ids; the
    request is fed after the observation; a summary is the model's tokens, capped; the tokens the
    trainer scores (segments -> collate) are exactly those sampled, with their log-probs and routes."""
    model, tasks = loud_model(tok), long_tasks[:3]
    tools = env.Tools(max_actions=8, max_errors=6, memory="summary", window=320, max_summaries=2)
    eps = env.run_episodes(model, tok, tasks, 4, tools, pool, temperature=1.0, max_new_tokens=24,
                              batch_size=12, generator=torch.Generator().manual_seed(2), return_routes=True)
    request, n_summaries = tok.tool_ids["<|summary|>"], 0
    for e in eps:
        t, prompt = tasks[e.task_idx], tok.encode(tools.prompt(tasks[e.task_idx]))
        summaries = [x for x in e.turns if x.summary]
        n_summaries += len(summaries)
        fed = [env.summary_ids(tok, x.tokens, env.Episode(0)) for x in summaries]   # specials cut off
        assert fed == e.summaries and len(summaries) <= 2
        for a, b in zip(e.turns, e.turns[1:]):
            if b.summary:             # the request: after the observation, or after the action alone
                assert b.prompt_ids[-1] == request and b.segment == a.segment
                assert len(b.tokens) <= env.SUMMARY_TOKENS
            if a.summary:             # a fresh context: the actions left and the latest summary, as sampled
                before = e.turns[:e.turns.index(b)]
                left = tok.encode(env.LEFT.format(8 - sum(not x.summary for x in before)))
                assert b.prompt_ids == prompt + left + [request] + e.summaries[sum(x.summary for x in before) - 1]
                assert b.segment == a.segment + 1
        segs = rl.segments(e)
        assert len(segs) == e.turns[-1].segment + 1
        assert [x for s in segs for x in s.turns] == e.turns
        for s in segs:
            ids, cols, tokens, lps = rl.flatten(s)
            assert s.turns[0].prompt_ids[:len(prompt)] == prompt and len(ids) <= 320 + 24
            _, tgt, old, routes, _ = rl.collate([s], tok.pad_id, model.n_moe_layers, 2, True)
            assert tgt[tgt >= 0].tolist() == tokens and old[tgt >= 0].tolist() == pytest.approx(lps)
            assert sum(x.routes.size(1) for x in s.turns) == len(ids)   # router replay: every segment
        assert sum(len(rl.flatten(s)[2]) for s in segs) == rl.n_generated(e)
        read, kept = env.fact_retention(t, e)
        assert 0 <= kept <= read
        # nothing else of the episode: a fresh context is the issue and the summaries, so no observation's
        # ids are kept beside the turns (mask's and window's rebuild keep them: the next test)
        assert e.state["stream"] == [] and e.turns[0].feedback
    assert n_summaries >= 3 and any(e.end == "summary_cap" for e in eps)


@pytest.mark.parametrize("memory", ["window", "mask"])
def test_the_threshold_is_the_same_for_a_group_and_window_and_mask_rebuild_within_the_budget(tok, pool, long_tasks,
                                                                                             memory):
    """Past the task's threshold the context is rebuilt: the issue, then the latest turns that fit in the
    window less the next turn's generation (the budget the summary turn has too). window keeps them
    whole; mask keeps every action and drops each observation but the last for a placeholder."""
    at = {env.summary_at(t, 640) for t in long_tasks}
    assert len(at) > 1 and all(288 <= a <= 352 for a in at)       # drawn per task, in [0.45, 0.55] x window
    assert env.summary_at(long_tasks[0], 640) == env.summary_at(long_tasks[0], 640)
    model, tasks = loud_model(tok), long_tasks[:2]
    tools = env.Tools(max_actions=8, max_errors=6, memory=memory, window=400)
    eps = env.run_episodes(model, tok, tasks, 3, tools, pool, temperature=1.0, max_new_tokens=24,
                           batch_size=6, generator=torch.Generator().manual_seed(3))
    dropped, masked = 0, tools.feed_ids(tok, env.MASKED)
    for e in eps:
        prompt = tok.encode(tools.prompt(tasks[e.task_idx]))
        for a, b in zip(e.turns, e.turns[1:]):
            if b.segment > a.segment:          # a rebuilt context: the prompt, the actions left, the latest turns
                dropped += 1
                n = e.turns.index(b)           # the turns before b, as fed (action, observation)
                head = prompt + tok.encode(env.LEFT.format(8 - n))
                kept = b.prompt_ids[len(head):]
                assert b.prompt_ids[:len(head)] == head and len(b.prompt_ids) <= 400 - 24
                pieces = [act + (masked if memory == "mask" and i < n - 1 else obs)
                          for i, (act, obs) in enumerate(e.state["stream"][:n])]
                upto = [i for piece in pieces for i in piece]
                assert upto[len(upto) - len(kept):] == kept
        assert not e.summaries and len(e.state["stream"]) == len(e.turns) - 1     # each turn but the last
        assert e.state["rebuilds"] == sum(b.segment > a.segment for a, b in zip(e.turns, e.turns[1:]))
        segs = rl.segments(e)           # each context trains as a sequence: exactly the sampled tokens
        assert [x for s in segs for x in s.turns] == e.turns
        for s in segs:
            _, _, tokens, lps = rl.flatten(s)
            _, tgt, old, _, _ = rl.collate([s], tok.pad_id, model.n_moe_layers, 2, False)
            assert tgt[tgt >= 0].tolist() == tokens and old[tgt >= 0].tolist() == pytest.approx(lps)
        assert sum(len(rl.flatten(s)[2]) for s in segs) == rl.n_generated(e)
    assert dropped


# ---------------------------------------------------------------------------------------------
# Training: segments, the shared advantage, the normalisation (worked numbers)

def episode(segs):
    """An episode of turns with the given segment ids and token counts: [(segment, n tokens)]."""
    turns = [env.Turn([1, 2], [10 + k] * n, [-0.5] * n, segment=s) for k, (s, n) in enumerate(segs)]
    return env.Episode(0, turns, group=0)


def test_segments_split_at_fresh_contexts_and_carry_the_episode_tokens():
    e = episode([(0, 2), (0, 1), (1, 2)])                 # 5 tokens: 3 in the first segment, 2 in the second
    a, b = rl.segments(e)
    assert [t.tokens for t in a.turns] == [[10, 10], [11]]
    assert [t.tokens for t in b.turns] == [[12, 12]]
    assert a.episode_tokens == b.episode_tokens == 5 and a.share == b.share == 0.5
    whole = episode([(0, 2), (0, 3)])                      # no summary: one sequence, the episode's turns
    assert rl.segments(whole) == [rl.Sequence(whole.turns, episode_tokens=5, share=1.0)]


def test_every_segment_gets_the_episode_advantage():
    e1, e2 = episode([(0, 2), (1, 1)]), episode([(0, 3)])       # a group of two episodes, rewards 1 and 0
    scored = [(e1, Result(1.0, True, "pass", "", 1, 1)),
              (e2, Result(0.0, False, "wrong_answer", "", 0, 1))]
    adv, keep = rl.group_advantages(torch.tensor([1.0, 0.0]), [0, 0])
    groups = rollouts.signal_groups(scored, adv, keep)
    assert len(groups) == 1 and [s.adv for s in groups[0]] == [0.5, 0.5, -0.5]
    assert [s.share for s in groups[0]] == [0.5, 0.5, 1.0]


def test_the_loss_is_normalised_over_the_whole_episode():
    """An episode of 3 + 2 tokens split into two sequences: under the sequence norm each token weighs
    1 / (5 tokens x 1 episode) = 0.2, as unsplit (a segment normalised alone would weigh 1/3 and 1/2);
    the constant and token norms never look at the split."""
    e = episode([(0, 2), (0, 1), (1, 2)])
    segs = rl.segments(e)
    b = rl.batch_tensors(segs, 0, 0, 1, False, False)
    mask = (b.tgt >= 0).float()
    assert b.seqs == 1.0 and b.seq_tokens.tolist() == [5.0, 5.0]
    w = rl.token_weights(mask, "sequence", 4, b.seqs, 5, b.seq_tokens)
    assert w[mask > 0].tolist() == pytest.approx([0.2] * 5) and w.sum().item() == pytest.approx(1.0)
    whole = rl.batch_tensors([rl.Sequence(e.turns[:2], episode_tokens=3)], 0, 0, 1, False, False)   # unsplit
    assert rl.token_weights((whole.tgt >= 0).float(), "sequence", 4, 1, 3, whole.seq_tokens).sum() == \
        pytest.approx(1.0)
    naive = rl.token_weights(mask, "sequence", 4, 2, 5)         # segments as if episodes: 1/6 and 1/4
    assert naive[mask > 0].tolist() == pytest.approx([1 / 6] * 3 + [1 / 4] * 2)
    assert rl.token_weights(mask, "constant", 4, 8, 5)[mask > 0].tolist() == pytest.approx([1 / 32] * 5)
    assert rl.token_weights(mask, "token", 4, 8, 10)[mask > 0].tolist() == pytest.approx([0.1] * 5)


def test_long_stats_count_summaries_and_kept_facts_and_an_episode_without_a_submit_fails():
    from collections import Counter
    from types import SimpleNamespace
    t = SimpleNamespace(facts=[{"file": "a.py", "name": "A", "value": 1, "label": "N1"},
                               {"file": "b.py", "name": "B", "value": 2, "label": "N2"}])
    turns = [env.Turn([], [1], []), env.Turn([], [5, 6], [], "N1 = 1 (a.py)", summary=True),
             env.Turn([], [7], [], "nothing", summary=True)]
    e = env.Episode(0, turns, Result(1.0, True, "pass", "", 1, 1), summaries=[[5, 6], [7]], end="summary_cap",
                    actions=[env.Action("read", "a.py")],
                    state={"rebuilds": 0})
    stats = Counter()
    rollouts.long_stats(t, e, stats)
    assert stats["over_cap"] == 1 and stats["summaries_sum"] == 2 and stats["summary_tokens_sum"] == 3
    assert (stats["facts_read"], stats["facts_kept"]) == (2, 1)    # a.py read before both; kept in one
    # the judge passes its repository, but an episode that ended without a submit fails
    passing = SimpleNamespace(run_batch=lambda runs: [Result(1.0, True, "pass", "", 1, 1)] * len(runs))
    items = [(SimpleNamespace(hidden=None), dataclasses.replace(e, end=end, repo={}))
             for end in ("summary_cap", "step_limit", "format_errors", "context", "submit")]
    import unittest.mock
    with unittest.mock.patch.object(env, "hidden_run", lambda t, repo: None):
        env.Tools().finish(passing, items)
    assert [(x.result.passed, x.result.outcome) for _, x in items] == \
        [(False, "over_cap"), (False, "step_limit"), (False, "format_errors"), (False, "context"), (True, "pass")]

def test_the_oracle_summary_is_the_harness_s_own_and_names_only_what_was_read(tok, pool, long_tasks):
    """eval.py's oracle_summary: past the threshold the harness, not the model, writes the summary (no
    summary turn is sampled): the facts of the settings files read so far and where the fix goes."""
    model, tasks = loud_model(tok), long_tasks[:2]
    tools = env.Tools(max_actions=8, max_errors=6, memory="oracle", window=400)
    eps = env.run_episodes(model, tok, tasks, 3, tools, pool, temperature=1.0, max_new_tokens=24,
                           batch_size=6, generator=torch.Generator().manual_seed(4))
    n = 0
    for e in eps:
        t = tasks[e.task_idx]
        assert not any(x.summary for x in e.turns) and len(e.turns) == len(e.actions)   # one action a turn
        fresh = [k for k in range(1, len(e.turns)) if e.turns[k].segment > e.turns[k - 1].segment]
        assert len(fresh) == len(e.summaries)
        for k, s in zip(fresh, e.summaries):      # written from the actions before the fresh context
            assert s == tok.encode(summary_text(t, e.actions[:k])) + [tok.tool_ids["<|end|>"]]
            n += 1
    assert n


def test_rl_memory_oracle_trains_under_the_harness_s_summary_first_then_the_model_s(tok, pool, long_tasks):
    """train_rl.py --memory oracle: long tasks under the harness's summary in the run's first half (by its
    clock, else by its steps), then under the model's own; the harness's summary is fed, never a target."""
    import time
    from types import SimpleNamespace
    at = lambda memory, minutes, ago, step=0: rollouts.long_memory(SimpleNamespace(
        args=SimpleNamespace(memory=memory, max_minutes=minutes, steps=10), t_start=time.time() - 60 * ago), step)
    assert [at("oracle", 10, 4.9), at("oracle", 10, 5.1), at("window", 10, 1)] == ["oracle", "summary", "window"]
    assert [at("oracle", 0, 99, 4), at("oracle", 0, 0, 5)] == ["oracle", "summary"]
    tools = env.long_tools(at("oracle", 10, 0))
    tools.max_errors, tools.window = 6, 400
    eps = env.run_episodes(loud_model(tok), tok, long_tasks[:2], 2, tools, pool, temperature=1.0,
                           max_new_tokens=24, batch_size=4, generator=torch.Generator().manual_seed(4))
    for e in eps:
        segs = rl.segments(e)
        assert len(segs) == len(e.summaries) + 1 and sum(len(rl.flatten(s)[2]) for s in segs) == \
            sum(len(x.tokens) for x in e.turns)             # the targets: the sampled tokens alone
        for s, summary in zip(segs[1:], e.summaries):       # each later segment starts from the summary, fed
            assert s.turns[0].prompt_ids[-len(summary):] == summary
    assert any(e.summaries for e in eps)


def test_eval_counts_the_summaries_that_name_a_file_the_repository_lacks(tok, pool, long_tasks):
    """eval.py's summary/bad_paths: the share of the model's own summaries that name a path the task's
    repository does not hold (issue 63: 86 of 96 did). Each summary is rewritten to name a file of
    the repository, then one of none, in turn."""
    import unittest.mock
    from eval import evaluate_agent
    model, tasks, real = loud_model(tok), long_tasks[:2], env.run_episodes
    tools = env.Tools(max_actions=8, max_errors=6, memory="summary", window=320, max_summaries=2)

    def naming(*args, **kw):
        eps = real(*args, **kw)
        for e in eps:
            for j, x in enumerate(x for x in e.turns if x.summary):
                x.text = f"N1 = 3 ({'nowhere.py' if j % 2 else sorted(tasks[e.task_idx].files)[0]})"
        naming.said = [j % 2 for e in eps for j, _ in enumerate(x for x in e.turns if x.summary)]
        return eps
    with unittest.mock.patch.object(env, "run_episodes", naming):
        out = evaluate_agent(model, tok, tasks, pool, 3, tools, temperature=1.0, max_new_tokens=24)
    assert 0 < sum(naming.said) < len(naming.said) and out["bad_paths"] == sum(naming.said) / len(naming.said)
