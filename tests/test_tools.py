"""The agent's tools (env.py: Tools, parse_action, check_path, replace_function, visible_run,
hidden_run) and the one episode loop running them (sampling.py run_episodes), including hostile
tool calls: paths outside the repository, edits of the tests, huge outputs, malformed actions.
python -m pytest tests/test_tools.py -q"""
from types import SimpleNamespace

import pytest
import torch

import env
from tokenizer import TOOL_TOKENS, Tokenizer, train_tokenizer
from model import GPT, GPTConfig
from rl.algo import collate, flatten
from model import add_tokens

CONFIG = '"""Settings."""\n\nBASE_RATE = 7\n'
MODULE = ('from config import *\n\n\ndef add_rate(n):\n    """Take n, add N (N: the value set in config.py), '
          'and return the result."""\n    raise NotImplementedError\n')
TESTS = ('from report import *\n\n\ndef test_1():\n    got = add_rate(3)\n'
         '    assert got == 10, f"add_rate(3) returned {got!r}, expected 10"\n\n\n'
         'def test_2():\n    got = add_rate(-1)\n    assert got == 6, f"add_rate(-1) returned {got!r}, expected 6"\n')
GOOD = "def add_rate(n):\n    return n + BASE_RATE\n"


def repo_task(**kw):
    """A hand-made repository task with RepoTask's fields (data/repos.py generates them)."""
    return SimpleNamespace(**{
        "task_id": "repo/hand/0", "files": {"config.py": CONFIG, "report.py": MODULE, "test_report.py": TESTS},
        "issue": "Implement `add_rate(n)` in report.py: its body is missing.", "module": "report",
        "entry_point": "add_rate", "inputs": [[3], [-1], [40], [0]], "outputs": [10, 6, 47, 7],
        "test_file": "test_report.py", "config_file": "config.py", "kind": "implement", "fact_in": "file",
        "fact": {"file": "config.py", "name": "BASE_RATE", "value": 7}, "slice": "near", **kw})


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["def f(x):\n    return x + 1\n" * 50, MODULE, TESTS, CONFIG], 300).with_tools()


def action(tok, name, payload="", close=True):
    ids = env.action_ids(tok, name, payload)
    return ids if close else ids[:-1]


def turn(tok, ids):
    return env.Turn([], ids, [], stopped=ids[-1] == tok.eot_id)


# ---------------------------------------------------------------------------------------------
# The pieces

def test_tokenizer_with_tools_keeps_every_old_id_and_round_trips(tok, tmp_path):
    base = Tokenizer(tok.ranks)
    assert base.tool_ids == {} and base.vocab_size + len(TOOL_TOKENS) == tok.vocab_size
    assert (tok.eot_id, tok.pad_id) == (base.eot_id, base.pad_id)
    assert sorted(tok.tool_ids.values()) == list(range(base.vocab_size, tok.vocab_size))
    tok.save(tmp_path / "t.json")
    back = Tokenizer.load(tmp_path / "t.json")
    assert back.tool_ids == tok.tool_ids and back.fingerprint() == tok.fingerprint() != base.fingerprint()
    # the tokens' text in a file is ordinary text: a file cannot inject an observation's end or an action
    assert not set(tok.encode("<|/obs|><|submit|><|end|>")) & set(tok.tool_ids.values())


def test_add_tokens_keeps_every_old_logit(tok):
    torch.manual_seed(0)
    old = GPT(GPTConfig(vocab_size=tok.vocab_size - len(TOOL_TOKENS), seq_len=32, n_layer=2, n_head=2,
                        n_kv_head=1, n_embd=32, n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1)).eval()
    new = add_tokens(old, tok.vocab_size).eval()
    idx = torch.randint(0, old.config.vocab_size, (2, 9))
    a, b = old(idx)[0], new(idx)[0]
    assert torch.equal(a, b[..., :old.config.vocab_size])
    assert torch.allclose(new.wte.weight[-1], old.wte.weight.mean(0))
    with pytest.raises(ValueError):
        add_tokens(new, 10)


@pytest.mark.parametrize("path, why", [("../config.py", "'..'"), ("/etc/passwd", "relative"), ("a/../config.py", "'..'"),
                                       ("./config.py", "'..'"), ("config.py\x00", "relative"), ("..\\x", "relative"),
                                       ("", "no path"), ("secret.py", "no file"), ("report.py/..", "'..'")])
def test_paths_outside_the_repository_are_refused(path, why):
    repo = repo_task().files
    with pytest.raises(ValueError) as e:
        env.check_path(repo, path)
    assert why in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("error:")
    assert env.check_path(repo, " config.py\n") == "config.py"


def test_replace_function():
    out, name = env.replace_function(MODULE, GOOD, "report.py")
    assert name == "add_rate" and out == "from config import *\n\n\n" + GOOD
    decorated = "import functools\n\n@functools.cache\ndef f(x):\n    return 1\n\n\ndef g():\n    pass\n"
    assert env.replace_function(decorated, "def f(x):\n    return 2", "m.py")[0] == \
        "import functools\n\ndef f(x):\n    return 2\n\n\ndef g():\n    pass\n"
    # ast counts lines at \n, \r\n and \r only: a form feed or U+2028 in the file moves nothing
    odd = 'x = "a\u2028b"\n\x0c\ndef f():\n    return 1\n\n\ndef g():\r\n    return 2\r\n'
    assert env.replace_function(odd, "def f():\n    return 3\n", "m.py")[0] == \
        'x = "a\u2028b"\n\x0c\ndef f():\n    return 3\n\n\ndef g():\n    return 2\n'
    for bad, why in [("def add_rate(n:\n    return 1", "does not parse"), ("x = 1", "one whole `def`"),
                     ("def f():\n    pass\ndef g():\n    pass", "one whole `def`"),
                     ("def other(n):\n    return 1", "no function 'other'"), ("class add_rate: pass", "one whole"),
                     ("def add_rate(n):\n    return 1\n" + "#" * env.MAX_FILE_CHARS, "longer than"),
                         ("def add_rate(n):\n    return 1\n" + "#" * (env.MAX_FILE_CHARS - 40), "exceed")]:
        with pytest.raises(ValueError) as e:
            env.replace_function(MODULE, bad, "report.py")
        assert why in str(e.value) and "\n" not in str(e.value)


def test_parse_action(tok):
    assert env.parse_action(tok, action(tok, "read", "config.py")) == ("read", "config.py")
    assert env.parse_action(tok, action(tok, "edit", "report.py\n" + GOOD)) == ("edit", "report.py\n" + GOOD)
    for ids, why in [(tok.encode("read config.py"), "starts with"), (action(tok, "read", "x", close=False), "not closed"),
                     (action(tok, "ls")[:-1] + [tok.eot_id], "not closed"), ([], "starts with"),
                     (action(tok, "read", "a") [:-1] + action(tok, "ls"), "one action per turn"),
                     ([tok.tool_ids["<|obs|>"]] + tok.encode("x") + [tok.tool_ids["<|end|>"]], "starts with")]:
        with pytest.raises(ValueError) as e:
            env.parse_action(tok, ids)
        assert why in str(e.value)


def test_cap_keeps_head_and_tail():
    text = "".join(f"line {i}\n" for i in range(2000))
    out = env.cap(text, 200)
    assert out.startswith("line 0\n") and out.endswith("line 1999\n") and len(out) <= 200 and "cut" in out
    assert env.cap("short") == "short"


# ---------------------------------------------------------------------------------------------
# The sandbox: visible tests on the agent's copy, the judge on hidden tests it alone holds

def test_visible_and_hidden_runs(pool):
    t = repo_task()
    fixed = dict(t.files, **{"report.py": env.replace_function(MODULE, GOOD)[0]})
    wrong = dict(t.files, **{"report.py": env.replace_function(MODULE, "def add_rate(n):\n    return n + 8")[0]})
    runs = [env.visible_run(t, r) for r in (t.files, fixed, wrong)]
    vis = pool.run_batch(runs)
    names = [n for n, in runs[0].inputs]
    assert [r.passed for r in vis] == [False, True, False]
    assert env.test_report(vis[1], names) == "2 passed, 0 failed"
    assert env.test_report(vis[2], names) == ("0 passed, 2 failed\ntest_1: add_rate(3) returned 11, expected 10\n"
                                              "test_2: add_rate(-1) returned 7, expected 6")
    assert env.test_report(vis[0], names).split("\n")[1] == "test_1: NotImplementedError: "
    hid = pool.run_batch([env.hidden_run(t, r) for r in (t.files, fixed, wrong)])
    assert [r.passed for r in hid] == [False, True, False]


def test_editing_the_visible_tests_changes_nothing_in_the_reward(pool):
    """The agent's copy of the test file is its own: rewritten to pass, it passes, and the judge (the
    task's hidden cases, without the test file) says what it said before."""
    t = repo_task()
    hacked = dict(t.files)
    for name in ("test_1", "test_2"):
        hacked["test_report.py"] = env.replace_function(hacked["test_report.py"], f"def {name}():\n    pass")[0]
    assert pool.run_batch([env.visible_run(t, hacked)])[0].passed
    assert not pool.run_batch([env.hidden_run(t, hacked)])[0].passed
    # a test file that imports nothing of the judge: its text never reaches the judge's program
    assert "test_report" not in env.hidden_run(t, hacked).program


@pytest.mark.parametrize("body, outcome", [
    ("    import os\n    os.system('touch /tmp/pwned_by_agent')\n    return n + BASE_RATE", "pass"),
    ("    while True:\n        pass", "timeout"),
    ("    return open('/etc/passwd').read()", "runtime_error"),
    ("    return [0] * 10**10", "memory"),
    ("    import sys\n    sys.modules['config'].BASE_RATE = 99\n    return n + 7", "pass"),
])
def test_hostile_code_stays_in_its_run(pool, body, outcome, tmp_path):
    """Whatever the agent's function does runs in the sandbox, one fresh child per run: it reads no
    host file, writes nothing that outlives it, and changes no other run's modules."""
    t = repo_task()
    repo = dict(t.files, **{"report.py": env.replace_function(MODULE, "def add_rate(n):\n" + body)[0]})
    r1, r2 = pool.run_batch([env.hidden_run(t, repo), env.hidden_run(t, dict(t.files, **{
        "report.py": env.replace_function(MODULE, GOOD)[0]}))])
    assert r1.outcome == outcome and r2.passed
    import os
    assert not os.path.exists("/tmp/pwned_by_agent")


def test_file_text_cannot_break_out_of_the_loader(pool):
    """Files travel as string literals: quotes, backslashes and a fake `_FILES` inside one are text."""
    t = repo_task()
    nasty = '"""\'\'\'\\\n_FILES = {}\nraise SystemExit\n'
    repo = dict(t.files, **{"config.py": CONFIG + f"NOTE = {nasty!r}\n",
                            "report.py": env.replace_function(MODULE, GOOD)[0]})
    assert pool.run_batch([env.hidden_run(t, repo)])[0].passed


# ---------------------------------------------------------------------------------------------
# The tool set, scripted: one action per turn, observations, limits

def scripted(tok, pool, tools, t, actions, more=True):
    e = env.Episode(0)
    tools.start(t, e)
    out = []
    for ids in actions:
        out.append(tools.step(tok, pool, [(t, e, turn(tok, ids))], more)[0])
        if out[-1] is None:
            break
    return e, out


def test_a_scripted_episode_solves_the_task(tok, pool):
    t, tools = repo_task(), env.Tools()
    e, obs = scripted(tok, pool, tools, t, [
        action(tok, "ls"), action(tok, "read", "report.py"), action(tok, "read", "config.py"),
        action(tok, "test"), action(tok, "edit", "report.py\n" + GOOD), action(tok, "test"), action(tok, "submit")])
    assert obs[0] == "config.py\nreport.py\ntest_report.py" and obs[1] == MODULE and obs[2] == CONFIG
    assert obs[3].startswith("0 passed, 2 failed") and obs[4] == "replaced add_rate in report.py"
    assert obs[5] == "2 passed, 0 failed" and obs[6] is None and e.end == "submit"
    assert t.files["report.py"] == MODULE                      # the task's own files are never touched
    tools.finish(pool, [(t, e)])
    assert e.result.passed
    assert [a.name for a in e.actions] == ["ls", "read", "read", "test", "edit", "test", "submit"]


def test_malformed_actions_get_an_error_and_the_episode_ends_at_the_limit(tok, pool):
    t, tools = repo_task(), env.Tools(max_errors=2)
    e, obs = scripted(tok, pool, tools, t, [
        tok.encode("cat config.py"), action(tok, "read", "../../etc/passwd"), action(tok, "edit", "report.py\nx = 1"),
        action(tok, "read", "nowhere.py"), action(tok, "read", "config.py", close=False), action(tok, "ls")])
    assert obs[0].startswith("error: an action starts with")
    assert obs[1].startswith("error:") and "'..'" in obs[1] and obs[2].startswith("error: an edit is")
    assert obs[3].startswith("error: no file") and obs[4] is None and e.end == "format_errors"
    assert [a.error for a in e.actions] == ["format", "tool", "tool", "tool", "format"]
    assert all(o is None or "\n" not in o for o in obs)


def test_huge_outputs_are_capped(tok, pool):
    t = repo_task()
    t.files = dict(t.files, **{"config.py": CONFIG + "".join(f"# filler line {i}\n" for i in range(3000))})
    loud = ("def test_1():\n    print('x' * 10**6)\n    assert False, 'y' * 10**5\n")
    t.files["test_report.py"] = TESTS + "\n\n" + loud.replace("test_1", "test_3")
    e, obs = scripted(tok, pool, env.Tools(), t, [action(tok, "read", "config.py"), action(tok, "test")])
    assert len(obs[0]) < env.OBS_CHARS + 100 and "characters cut" in obs[0] and obs[0].endswith("2999\n")
    assert len(obs[1]) < env.OBS_CHARS and obs[1].startswith("0 passed, 3 failed")


def test_a_tool_outside_the_tool_set_is_refused_and_inline_shows_every_file(tok, pool):
    t, tools = repo_task(), env.Tools(actions=("edit", "submit"), max_actions=1)
    e, obs = scripted(tok, pool, tools, t, [action(tok, "read", "config.py")], more=False)
    assert e.actions[0].error == "tool" and obs == [None]
    assert "BASE_RATE" not in tools.prompt(t) and "BASE_RATE = 7" in env.Tools(inline=True).prompt(t)


@pytest.mark.parametrize("memory", (None,) + env.MEMORIES)
def test_every_prompt_is_the_issue_and_the_file_list(memory):
    """Short task or long, under every memory alike, the prompt (which every fresh context starts from)
    is the issue, then the repository's file names: a path the model reads or edits stands in its context
    (issue 63), none of the files' text."""
    t = repo_task()
    tools = env.long_tools(memory) if memory else env.Tools()
    assert tools.prompt(t) == f"# Issue\n{t.issue}\n# Files\nconfig.py report.py test_report.py\n"


# ---------------------------------------------------------------------------------------------
# The loop with the tool set: one token stream per episode, exactly the tokens sampled

def test_tool_episodes_are_one_token_stream_of_sampled_and_fed_tokens(tok, pool):
    """A random model whose tool rows are loud, so that it acts, errs, reads and ends: each episode is
    one stream; decoded, it is the text the harness showed; every fed observation is the tool set's
    ids of the text it answered (never re-tokenised); the tokens flatten scores are the tokens
    sampled, with their log-probs; the KV cache is kept (each turn's prompt_ids are only what is new)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=1024, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1))
    with torch.no_grad():
        model.wte.weight[:, 0] = 30.0          # a constant direction in the residual stream that the tool rows read
        for name, w in (("<|ls|>", 1.3), ("<|read|>", 1.1), ("<|test|>", 1.1), ("<|submit|>", 0.6), ("<|end|>", 1.35)):
            model.lm_head.weight[tok.tool_ids[name], 0] = w
    t = repo_task()
    tools = env.Tools(max_actions=6, max_errors=5)
    eps = env.run_episodes(model, tok, [t, t], 3, tools, pool, temperature=1.0, max_new_tokens=16,
                              batch_size=4, generator=torch.Generator().manual_seed(1), return_routes=True)
    assert [e.task_idx for e in eps] == [0, 0, 0, 1, 1, 1]
    fed = 0
    for e in eps:
        assert e.end in ("submit", "format_errors", "step_limit", "context") and e.result is not None
        first = e.turns[0]
        assert first.prompt_ids == tok.encode(tools.prompt(t))
        for a, b in zip(e.turns, e.turns[1:]):
            assert b.prompt_ids == env.next_feed(tok, tools, a, a.feedback) and a.feedback
            fed += 1
        assert e.turns[-1].feedback == ""
        ids, cols, tokens, lps = flatten(e)
        assert tokens == [x for s in e.turns for x in s.tokens]
        _, tgt, old, routes, _ = collate([e], tok.pad_id, model.n_moe_layers, 2, True)   # the trainer's tensors
        assert tgt[tgt >= 0].tolist() == tokens and old[tgt >= 0].tolist() == pytest.approx(lps)
        assert lps == [x for s in e.turns for x in s.logprobs]
        assert [ids[c + 1] for c in cols[:-1]] == tokens[:-1]            # each column predicts the next sampled id
        assert sum(s.routes.size(1) for s in e.turns) == len(ids)  # router replay covers every turn
        text = tok.decode(ids + e.turns[-1].tokens[-1:])                 # every token, the last included
        want = tools.prompt(t) + "".join(tok.decode(s.tokens) + (f"<|obs|>{s.feedback}<|/obs|>"
                                                                   if s.feedback else "") for s in e.turns)
        assert text == want
        assert len(e.actions) == len(e.turns)
    assert fed >= 3                                                       # observations were fed
    done = [(a.name, a.error) for e in eps for a in e.actions]
    assert {("ls", None), ("test", None), ("read", "tool"), (None, "format")} <= set(done)
    assert any(s.feedback.startswith("0 passed, 2 failed") for e in eps for s in e.turns)


# ---------------------------------------------------------------------------------------------
# agent.py --repo: the same tools on a copy of a user's project

def make_project(root):
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "rates.py").write_text("TAX = 3\n")
    (root / "shop.py").write_text("from pkg.rates import TAX\n\n\ndef total(prices):\n    return sum(prices) + TAX + 1\n")
    (root / "test_shop.py").write_text('from shop import total\n\n\ndef test_total():\n    got = total([1, 2])\n'
                                       '    assert got == 6, f"total([1, 2]) returned {got!r}, expected 6"\n')
    (root / "secret.py").symlink_to("/etc/passwd")                # a link is never read
    return root


def test_a_project_is_judged_by_its_own_tests_as_they_were(tmp_path, tok, pool):
    import agent
    files, test_file = agent.read_project(str(make_project(tmp_path / "p")))
    assert sorted(files) == ["pkg/__init__.py", "pkg/rates.py", "shop.py", "test_shop.py"] and test_file == "test_shop.py"
    t, tools = agent.project_task(files, test_file, "total is off by one"), env.Tools()
    fix = "shop.py\ndef total(prices):\n    return sum(prices) + TAX\n"
    cheat = "test_shop.py\ndef test_total():\n    pass\n"
    for edits, passed in (([], False), ([cheat], False), ([fix], True), ([fix, cheat], True)):
        e, obs = scripted(tok, pool, tools, t, [action(tok, "edit", x) for x in edits] + [action(tok, "submit")])
        tools.finish(pool, [(t, e)])
        assert e.result.passed == passed, edits
    with pytest.raises(ValueError, match="no test_"):
        agent.read_project(str(tmp_path / "p" / "pkg"))
    with pytest.raises(ValueError, match="no directory"):
        agent.read_project(str(tmp_path / "nowhere"))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "test_x.py").write_text("import unittest\n\n\nclass T(unittest.TestCase):\n    def test_a(self):\n"
                                   "        pass\n")
    with pytest.raises(ValueError, match="no top-level test_"):      # refused before any sampling
        agent.read_project(str(odd))
    (odd / "test_x.py").write_text("def test_a():\n    pass\n")
    (odd / "bad.py").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8"):
        agent.read_project(str(odd))


def test_agent_repo_writes_a_copy_and_the_project_only_with_apply(tmp_path, tok, pool, monkeypatch, capsys):
    """agent.py --repo end to end on a checkpoint with tool tokens; the episode is scripted (a fix, a
    test run, submit) so that there is a change to keep: it lands in --out-dir/repo, and in the
    project itself only with --apply."""
    import json
    import agent
    from infra import common
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=256, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=1, top_k=1, n_shared_expert=0, expert_hidden=32))
    ckpt = str(tmp_path / "m.pt")
    common.save_checkpoint(ckpt, model, tok)
    fix = "shop.py\ndef total(prices):\n    return sum(prices) + TAX\n"

    def scripted_episodes(model, tok, tasks, n, tools, pool, *a, **kw):
        t = tasks[0]
        e = env.Episode(0)
        tools.start(t, e)
        for ids in (action(tok, "edit", fix), action(tok, "test"), action(tok, "submit")):
            x = turn(tok, ids)
            x.feedback = tools.step(tok, pool, [(t, e, x)], True)[0] or ""
            e.turns.append(x)
        tools.finish(pool, [(t, e)])
        return [e]
    monkeypatch.setattr(agent.env, "run_episodes", scripted_episodes)
    for apply in (False, True):
        project = make_project(tmp_path / f"p{apply}")
        before = (project / "shop.py").read_text()
        out = tmp_path / f"out{apply}"
        agent.main(["--preset", "smoke", "--ckpt", ckpt, "--repo", str(project), "--out-dir", str(out)]
                   + ["--apply"] * apply)
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["passed"] and summary["changed"] == ["shop.py"] and summary["applied"] == apply
        assert (out / "repo" / "shop.py").read_text() == before.replace(" + TAX + 1", " + TAX")
        assert ((project / "shop.py").read_text() != before) == apply
        assert "2 passed" not in (out / "transcript.txt").read_text() and "1 passed, 0 failed" in \
            (out / "transcript.txt").read_text()


# ---------------------------------------------------------------------------------------------
# grep and run: finding and trying things, on the episode's copy, in the sandbox

def test_grep_finds_lines_and_is_capped():
    t = repo_task()
    assert env.grep(t.files, "def add_rate") == "report.py:4: def add_rate(n):"
    assert env.grep(t.files, "(") and env.grep(t.files, "nowhere at all") == "no line holds 'nowhere at all'"
    with pytest.raises(ValueError, match="grep needs a pattern"):
        env.grep(t.files, "  ")
    # a huge file: a plain string search (no regex can backtrack here), GREP_LINES lines, then a count
    huge = {"big.py": "x = 1\n" * 5000 + "a" * 19_000}
    out = env.grep(huge, "x = 1")
    assert out.count("\n") == env.GREP_LINES and out.endswith(f"... ({5000 - env.GREP_LINES} more)")
    assert env.grep(huge, "(a+)+$") == "no line holds '(a+)+$'"


def test_run_shows_a_value_or_where_it_raised(pool):
    t = repo_task()
    fixed = dict(t.files, **{"report.py": env.replace_function(MODULE, GOOD)[0]})
    runs = [env.expr_run(t, fixed, "add_rate(3)"), env.expr_run(t, t.files, "add_rate(3)"),
            env.expr_run(t, fixed, "BASE_RATE * 2"), env.expr_run(t, fixed, "undefined_name")]
    out = [env.run_report(r) for r in pool.run_batch(runs)]
    assert out[0] == "10" and out[2] == "14"
    assert out[1].splitlines()[-2:] == ['  File "report.py", line 6, in add_rate', "NotImplementedError: "]
    assert out[3].endswith("NameError: name 'undefined_name' is not defined")
    with pytest.raises(ValueError, match="run needs an expression"):
        env.expr_run(t, fixed, " ")


@pytest.mark.parametrize("expr, why", [
    ("[__import__('os').fork() for _ in range(100)]", "Error"),                       # a fork bomb
    ("next(x for x in iter(int, 1) if x)", "timed out"),                               # an infinite loop
    ("__import__('os').system('touch /tmp/pwned_by_run')", ""),                        # import os
    ("open('/tmp/pwned_by_run', 'w').write('x')", "Error"),                             # a write to disk
    ("1 / 0", "ZeroDivisionError: division by zero"),                                   # an exception
    ("'x' * 10**9", ""),                                                                 # a huge value
])
def test_hostile_runs_score_nothing_and_crash_nothing(pool, expr, why):
    """A run is the agent's code in the sandbox: whatever it does comes back as one capped observation,
    no file outside the sandbox changes, and the pool serves the next run."""
    import os
    t = repo_task()
    r = pool.run_batch([env.expr_run(t, t.files, expr)])[0]
    out = env.run_report(r)
    assert why in out and len(out) <= env.RUN_CHARS + 400 and not r.passed
    assert not os.path.exists("/tmp/pwned_by_run")
    assert env.run_report(pool.run_batch([env.expr_run(t, t.files, "1 + 1")])[0]) == "2"


# A value whose repr is a str subclass that slices as it likes: the candidate's own cut, repr(v)[:400],
# gives back the whole 999,000 characters (the attack of issue 60, one 77-token action).
LOUD = ("class _Long(str):\n    def __getitem__(self, k):\n        return str(self) + ''\n\n\n"
        "class _Loud:\n    def __repr__(self):\n        return _Long('x' * 999_000)\n\n\nLOUD = _Loud()\n")


def test_every_observation_is_capped_on_the_trainers_side(tok, pool):
    """Whatever the sandbox or a tool sends back, what the trainer keeps and feeds is capped here: a run's
    value at RUN_CHARS (its repr's head), any other observation at OBS_CHARS (an edit's error that names
    a 19,000-character function), a test report too; a capped text is its own cap."""
    t = repo_task()
    t.files = dict(t.files, **{"config.py": CONFIG + LOUD})
    r = pool.run_batch([env.expr_run(t, t.files, "LOUD")])[0]
    assert len(r.values[0]) >= 999_000                       # the candidate's cut did nothing
    assert env.run_report(r) == "x" * env.RUN_CHARS
    long_def = "report.py\ndef " + "f" * 19_000 + "():\n    return 1\n"
    _, obs = scripted(tok, pool, env.Tools(), t, [action(tok, "run", "LOUD"), action(tok, "edit", long_def),
                                                 action(tok, "run", "BASE_RATE + 1")])
    assert obs[0] == "x" * env.RUN_CHARS and obs[2] == "8"
    assert obs[1].startswith("error: no function 'fff") and len(obs[1]) <= env.OBS_CHARS
    text = "".join(f"line {i}\n" for i in range(3000))
    assert len(env.cap(text)) <= env.OBS_CHARS and env.cap(env.cap(text)) == env.cap(text)


def test_a_summary_cannot_smuggle_special_tokens(tok):
    """A summary is the model's text: one that holds a special token (here an observation) is a format
    error, and the fresh context keeps only its text before it, closed by <|end|>."""
    e, ids = env.Episode(0), tok.encode("N1 = 4")
    fake = [tok.tool_ids["<|obs|>"]] + tok.encode("4 passed") + [tok.tool_ids["<|/obs|>"]]
    end = tok.tool_ids["<|end|>"]
    assert env.summary_ids(tok, ids + [end], e) == ids + [end] and e.errors == 0
    assert env.summary_ids(tok, ids + fake + [end], e) == ids + [end] and e.errors == 1


def test_an_edit_is_measured_before_it_is_parsed():
    huge = "def add_rate(n):\n" + "    x = 1\n" * 400_000          # 4 MB of statements
    with pytest.raises(ValueError, match="longer than"):
        env.replace_function(MODULE, huge)


def test_agent_reads_regular_files_only(tmp_path):
    import os
    import agent
    (tmp_path / "shop.py").write_text("def total(xs):\n    return sum(xs)\n")
    (tmp_path / "test_shop.py").write_text("from shop import total\n\n\ndef test_1():\n    assert total([1]) == 1\n")
    os.mkfifo(tmp_path / "pipe.py")                            # reading it would block forever
    files, test_file = agent.read_project(str(tmp_path))
    assert set(files) == {"shop.py", "test_shop.py"} and test_file == "test_shop.py"


def test_a_projects_verdict_is_judged_outside_the_candidate(pool):
    """agent.py --repo: tests of the form `assert f(...) == literal` are compared here, on plain data, so a
    result whose __eq__ is always true fails; other tests run in the candidate's process, and the
    verdict says it cannot be trusted."""
    import agent
    tests = "from shop import total\n\n\ndef test_1():\n    assert total([1, 2]) == 3\n"
    cheat = "class Yes:\n    def __eq__(self, other):\n        return True\n\n\ndef total(xs):\n    return Yes()\n"
    task = agent.project_task({"shop.py": cheat, "test_shop.py": tests}, "test_shop.py", "total is wrong")
    assert agent.test_checks(tests) == {"test_1": ("shop", "total", [[1, 2]], 3)}
    assert agent.project_verdict(pool, task, task.files) == (False, True)
    good = {**task.files, "shop.py": "def total(xs):\n    return sum(xs)\n"}
    assert agent.project_verdict(pool, task, good) == (True, True)
    loose = "from shop import total\n\n\ndef test_1():\n    x = total([1, 2])\n    assert x > 2\n"
    task2 = agent.project_task({"shop.py": cheat, "test_shop.py": loose}, "test_shop.py", "total is wrong")
    assert agent.test_checks(loose) == {"test_1": None} and agent.project_verdict(pool, task2, good)[1] is False


def test_the_judges_values_are_not_kept_in_the_episode(pool):
    """The red team's rerun: a candidate whose entry point returns a huge value made every episode hold
    the judge's decoded values (7-21 MB each); the verdict keeps none of them."""
    from data.repos import generate_repo_tasks
    t = generate_repo_tasks("test", 1, seed=11, difficulties=[1])[0]
    tools = env.Tools()
    e = env.Episode(0)
    tools.start(t, e)
    huge = f"def {t.entry_point}(*a):\n    return [0] * 100000\n"
    e.repo[t.module + ".py"] = e.repo[t.module + ".py"] + "\n\n" + huge
    e.end = "submit"
    tools.finish(pool, [(t, e)])
    assert e.result.values == () and not e.result.passed and e.result.n_tests == len(t.inputs)
