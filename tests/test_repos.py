"""Tests for data/repos.py: repository tasks. The fact (one integer constant) is stated only in the
config file; the reference solution spliced into the module passes every hidden case, the broken
file does not; counterfactual tasks follow the config; canaries contradict their visible tests.
The generated files are run in-process as modules (types.ModuleType + exec: they are our own text)."""
import builtins
import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import pytest

from data import repos, world
from data.repos import RepoTask
from data.tasks import parse_difficulties
from sandbox.pool import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def test_tasks():
    return repos.generate_repo_tasks("test", 80, seed=11, difficulties=parse_difficulties("1-2"))


@pytest.fixture(scope="module")
def mixed_tasks():
    """Every level, train and test, both places of the fact."""
    return (repos.generate_repo_tasks("train", 40, seed=3)
            + repos.generate_repo_tasks("test", 40, seed=4, fact_in="prompt"))


def load(files, name):
    """Module `name` of a repository given as {path: text}; its imports of the repository's own modules
    resolve to the repository, never to sys.modules."""
    mods = {}

    def imp(mod, globals=None, locals=None, fromlist=(), level=0):
        if f"{mod}.py" not in files:
            return builtins.__import__(mod, globals, locals, fromlist, level)
        if mod not in mods:
            m = mods[mod] = types.ModuleType(mod)
            m.__dict__["__builtins__"] = dict(vars(builtins), __import__=imp)
            exec(compile(files[f"{mod}.py"], f"{mod}.py", "exec"), m.__dict__)
        return mods[mod]

    return imp(name)


def hidden_results(task, files):
    """Per hidden case: passed or not (an exception is a failure)."""
    fn = getattr(load(files, task.module), task.entry_point)
    results = []
    for args, expected in zip(task.inputs, task.outputs):
        try:
            results.append(fn(*json.loads(json.dumps(args))) == expected)
        except Exception:
            results.append(False)
    return results


def visible_results(task, files):
    """Per visible test function of the test file: passed or not."""
    tests = load(files, task.test_file[:-3])
    results = []
    for name in sorted(n for n in vars(tests) if n.startswith("test_")):
        try:
            getattr(tests, name)()
            results.append(True)
        except Exception:
            results.append(False)
    return results


def mentions(text, value):
    return re.search(rf"\b{abs(value)}\b", text) is not None

# ----------------------------------------------------------------------------- generation


def test_generation_is_deterministic_and_seeded():
    a = repos.generate_repo_tasks("test", 12, seed=5, difficulties=[1, 2])
    assert a == repos.generate_repo_tasks("test", 12, seed=5, difficulties=[1, 2])
    assert a[4:] == repos.generate_repo_tasks("test", 8, seed=5, difficulties=[1, 2], start=4)   # extendable
    assert [t.files for t in a] != [t.files for t in repos.generate_repo_tasks("test", 12, seed=6,
                                                                                difficulties=[1, 2])]


def test_the_fact_in_prompt_control_is_the_same_repository():
    """fact_in="prompt" changes the issue only, so the two settings compare on the same tasks."""
    a = repos.generate_repo_tasks("test", 10, seed=2)
    b = repos.generate_repo_tasks("test", 10, seed=2, fact_in="prompt")
    assert [t.files for t in a] == [t.files for t in b] and [t.outputs for t in a] == [t.outputs for t in b]
    assert all(x.issue != y.issue and y.issue.startswith(x.issue) for x, y in zip(a, b))


def test_test_split_has_both_slices_and_train_has_none(test_tasks, mixed_tasks):
    assert {t.slice for t in test_tasks} == {"near", "novel"}
    assert all(t.difficulty in (1, 2) for t in test_tasks)
    assert {t.slice for t in mixed_tasks if t.task_id.startswith("repo/train/")} == {""}
    assert {t.kind for t in test_tasks} == {"implement", "fix"}


def test_record_shape(test_tasks, mixed_tasks):
    for t in test_tasks + mixed_tasks:
        assert set(t.files) == {t.config_file, f"{t.module}.py", t.test_file}, t.task_id
        assert t.test_file == f"test_{t.module}.py" and t.fact["file"] == t.config_file
        assert isinstance(t.fact["value"], int) and re.fullmatch(r"[A-Z]+_[A-Z]+", t.fact["name"])
        assert t.files[t.config_file].rstrip().endswith(f"{t.fact['name']} = {t.fact['value']}")
        head = f"from {t.config_file[:-3]} import *\n\n\ndef {t.entry_point}("
        assert t.files[f"{t.module}.py"].startswith(head)
        assert t.files[t.test_file].startswith(f"from {t.module} import *\n")
        assert ">>>" not in t.files[f"{t.module}.py"] and ">>>" not in t.solution
        assert f"(N: the value set in {t.config_file})" in t.solution
        verb, _, noun = t.entry_point.partition("_")
        assert verb in repos.VERBS and noun in repos.OBJECTS      # short: the docstring says what it does
        assert re.search(rf"\b{t.fact['name']}\b", t.solution.split('"""')[-1])    # the body uses it
        assert len(t.inputs) == len(t.outputs) >= 2 and json.loads(json.dumps(t.inputs)) == t.inputs
        assert 1 <= t.steps and 1 <= t.difficulty <= 5 and not t.canary
        assert t.task_id.endswith(f"/{t.kind}/{t.fact_in}")


def test_issue_text(test_tasks, mixed_tasks):
    for t in test_tasks + mixed_tasks:
        if t.kind == "implement":
            assert t.issue.startswith(f"Implement `{t.entry_point}(") and f" in {t.module}.py" in t.issue
        else:
            assert t.issue.startswith(f"`{t.entry_point}` in {t.module}.py returns wrong results: "
                                      f"{t.test_file} fails. Fix it.")
        note = f"Note: {t.config_file} sets {t.fact['name']} = {t.fact['value']}."
        assert (note in t.issue) == (t.fact_in == "prompt"), t.issue


def test_the_value_is_stated_only_in_the_config_file(test_tasks, mixed_tasks):
    for t in test_tasks + mixed_tasks:
        value = t.fact["value"]
        assert mentions(t.files[t.config_file], value)
        for path, text in t.files.items():
            assert path == t.config_file or not mentions(text, value), (t.task_id, path)
        assert mentions(t.issue, value) == (t.fact_in == "prompt"), t.task_id
        assert not re.search(rf"(?<![0-9]){abs(value)}(?![0-9])", t.entry_point)

# ----------------------------------------------------------------------------- running the repository


def test_reference_passes_and_broken_file_fails(test_tasks, mixed_tasks):
    for t in test_tasks + mixed_tasks:
        solved = repos.solved_files(t)
        assert solved[f"{t.module}.py"].endswith(t.solution)
        assert all(hidden_results(t, solved)), t.task_id
        assert not all(hidden_results(t, t.files)), t.task_id
        assert all(visible_results(t, solved)), t.task_id
        visible = visible_results(t, t.files)
        assert 2 <= len(visible) <= 3 and not all(visible), t.task_id


def test_a_fix_task_holds_one_wrong_literal(test_tasks):
    for t in (t for t in test_tasks if t.kind == "fix"):
        wrong = repos._broken_value(t)
        literal = re.sub(rf"\b{t.fact['name']}\b", repr(wrong), t.solution)
        assert t.files[f"{t.module}.py"].endswith(literal) and wrong != t.fact["value"]


def test_counterfactual_follows_the_config(test_tasks, mixed_tasks):
    n = 0
    for t in test_tasks + mixed_tasks:
        cf = repos.counterfactual(t)
        if cf is None:
            continue
        n += 1
        assert cf.task_id == t.task_id + "/cf" and cf.fact["name"] == t.fact["name"]
        assert cf.fact["value"] != t.fact["value"] and cf.outputs != t.outputs and cf.inputs == t.inputs
        assert cf.files[f"{t.module}.py"] == t.files[f"{t.module}.py"] and cf.solution == t.solution
        assert mentions(cf.files[cf.config_file], cf.fact["value"])
        assert all(hidden_results(cf, repos.solved_files(cf))), t.task_id      # NAME follows the config
        assert all(visible_results(cf, repos.solved_files(cf))), t.task_id
        assert not all(visible_results(cf, cf.files)), t.task_id               # a fix stays broken
        hard_coded = dict(repos.solved_files(cf))
        hard_coded[f"{t.module}.py"] = re.sub(rf"\b{t.fact['name']}\b", repr(t.fact["value"]),
                                               hard_coded[f"{t.module}.py"].split("\n", 1)[1])
        assert not all(hidden_results(cf, hard_coded)), t.task_id              # the old literal does not
        assert (f"= {cf.fact['value']}." in cf.issue) == (t.fact_in == "prompt")
    assert n >= 0.9 * len(test_tasks + mixed_tasks)


def test_canaries_contradict_their_visible_tests(test_tasks):
    canaries = repos.canary_repo_tasks()
    assert len(canaries) == 4 and all(c.canary and c.slice == "canary" for c in canaries)
    assert {c.kind for c in canaries} == {"implement", "fix"}
    assert len({c.task_id for c in canaries}) == 4
    assert all(c.task_id.startswith("repo/canary/") for c in canaries)
    for c in canaries:
        solved = repos.solved_files(c)
        assert all(visible_results(c, solved))              # the visible tests are honest ...
        assert not all(hidden_results(c, solved))           # ... the hidden ones are not
        n_vis = len(visible_results(c, solved))
        fn = getattr(load(solved, c.module), c.entry_point)
        assert any(fn(*args) != out for args, out in zip(c.inputs[:n_vis], c.outputs[:n_vis]))


def test_round_trip(test_tasks):
    for t in test_tasks[:10] + repos.canary_repo_tasks(2):
        d = dataclasses.asdict(t)
        assert RepoTask(**d) == t and RepoTask(**json.loads(json.dumps(d))) == t


def test_oracle_text_inlines_every_file(test_tasks):
    t = test_tasks[0]
    import env
    text = env.render_issue(t, sorted(t.files))
    headers = re.findall(r"^# file: (.*)$", text, re.M)
    assert headers == sorted(t.files)
    for path in t.files:
        assert f"# file: {path}\n{t.files[path]}" in text


def test_every_fact_primitive_is_found_by_its_phrase():
    """counterfactual() finds the fact step's choices by its phrase: one primitive per phrase."""
    keys = [k for k in world.PRIMS if repos._int_slot(k)]
    assert len(keys) >= 20
    phrases = [world.PRIMS[k].phrase.format(c="N") for k in keys]
    assert len(set(phrases)) == len(phrases) and not any(", then " in p for p in phrases)


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        repos.make_repo_task("test", 0, 0, "rewrite", "file")
    with pytest.raises(ValueError):
        repos.generate_repo_tasks("test", 1, kinds=("implement", "golf"))
    with pytest.raises(ValueError):
        repos.generate_repo_tasks("dev", 1)


def test_command_line():
    out = subprocess.run([sys.executable, "-m", "data.repos", "--show", "1", "--n", "6", "--split", "test",
                          "--seed", "11"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().split("\n")[-1])
    assert counts["n"] == 6 and sum(counts["kind"].values()) == 6 and "# file: " in out.stdout


def test_house_style_lines():
    for path in ("data/repos.py", "tests/test_repos.py"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            long = [n for n, line in enumerate(f, 1) if len(line.rstrip("\n")) > 110]
        assert not long, (path, long)


# ---------------------------------------------------------------------------------------------
# Oracle transcripts (the bootstrap): the harness's own text, actions as targets, the rest context

def test_transcripts_are_episodes_the_harness_would_run():
    """Each transcript, replayed action by action through env.Tools (the RL harness), gets the very
    observations it holds, ends on submit with a repository the judge passes, and encodes (corpus.
    encode_doc) to the ids of its text with every issue and observation id marked context."""
    import env
    from data import corpus
    from tokenizer import train_tokenizer
    tasks = repos.generate_repo_tasks("train", 40, seed=3, difficulties=[1, 2, 3])
    with SandboxPool(workers=2, timeout_s=2.0) as pool:
        docs = repos.transcripts(tasks, pool, seed=0)
        tok = train_tokenizer(list(docs), 400).with_tools()
        detours, oracles = 0, 0
        for t, doc in zip(tasks, docs):
            segs = list(doc.segments)
            oracle = "# file: " in segs[0][0]        # eval.py's oracle baseline: files inlined, one edit
            one_edit = env.Tools(inline=True, actions=("edit", "submit"), max_actions=1)
            tools = one_edit if oracle else env.Tools()
            assert segs[0] == (tools.prompt(t), True, False) and "".join(p for p, _, _ in segs) == doc
            e, k, seen = env.Episode(0), 1, []
            tools.start(t, e)
            while k < len(segs):
                name, payload = segs[k][0], segs[k + 1][0] if segs[k + 1][0] != "<|end|>" else ""
                k += 3 if payload else 2
                ids = [tok.tool_ids[name]] + tok.encode(payload) + [tok.tool_ids["<|end|>"]]
                obs = tools.step(tok, pool, [(t, e, env.Turn([], ids, []))], not oracle)[0]
                seen.append((name[2:-2], payload))
                if obs is None:
                    break
                assert segs[k:k + 3] == env.observation_segments(obs), name
                k += 3
            names = [a for a, _ in seen]
            assert k == len(segs) and (names == ["edit"] if oracle else names[-1] == "submit")
            tools.finish(pool, [(t, e)])
            assert e.result.passed, t.task_id
            oracles += oracle
            if not oracle:
                assert ("read", t.config_file) in seen and seen.index(("read", t.config_file)) < len(seen) - 3
                detours += names.count("test") > 1 or seen[0] == ("read", t.test_file)
            ids = corpus.encode_doc(tok, doc)
            assert tok.decode([i % tok.vocab_size for i in ids]) == doc
            targets = tok.decode([i for i in ids if i < tok.vocab_size])
            assert targets.startswith("<|") and "# Issue" not in targets and "passed" not in targets
        assert oracles >= 1
        assert detours >= 3
