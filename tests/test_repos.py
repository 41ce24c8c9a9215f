"""Tests for data/repos.py: the repository world. The fault is real (a visible test fails, the fix passes
every hidden case, two_bugs need both fixes), its place varies (no fixed plan finds it), the hidden tests
tell the program from a table of the visible cases, a settings number is stated only in its settings
module, and the teacher's episodes are what the harness gives and end with a passing repository. The
generated files run in-process (repos.load: they are our own text); the agent's runs go to the sandbox."""
import collections
import json
import os
import re
import subprocess
import sys

import pytest

import env
from data import repos
from data.tasks import parse_difficulties
from sandbox import SandboxPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def test_tasks():
    return repos.generate_repo_tasks("test", 120, seed=11, difficulties=parse_difficulties("1-2"))


@pytest.fixture(scope="module")
def train_tasks():
    return repos.generate_repo_tasks("train", 60, seed=3, long_share=0.25)


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, timeout_s=2.0) as p:
        yield p


def run_entry(task, files, inputs):
    return repos.outputs_of(files, task.module, task.entry_point, inputs)


def test_generation_is_deterministic_and_seeded():
    a = repos.generate_repo_tasks("test", 8, seed=5)
    assert a == repos.generate_repo_tasks("test", 8, seed=5)
    assert repos.generate_repo_tasks("test", 4, seed=5, start=4) == a[4:]
    assert a != repos.generate_repo_tasks("test", 8, seed=6)


def test_kinds_slices_and_every_mutation(test_tasks, train_tasks):
    assert collections.Counter(t.kind for t in test_tasks) == {k: 30 for k in repos.KINDS}
    assert {t.slice for t in test_tasks} == {"near", "novel"} and {t.slice for t in train_tasks} == {""}
    assert {m for t in test_tasks for m in t.mutations} == set(repos.MUTATIONS)
    assert "long" in {t.kind for t in train_tasks}
    for t in test_tasks + train_tasks:
        assert 3 <= len(t.files) <= 8 and t.test_file in t.files and f"{t.module}.py" in t.files
        assert len(t.targets) == {"two_bugs": 2, "long": 2}.get(t.kind, 1)
        assert set(t.fixed) == {p for p, _ in t.targets} and set(t.roles) == set(t.files)


def test_the_fault_is_real_and_the_fix_passes(test_tasks, train_tasks):
    """The broken repository fails a visible test (the issue's symptom) and the fixed one passes every
    hidden case; with two bugs each fix alone still fails a hidden case; doing nothing with a deleted
    helper (giving its input back) fails one too."""
    for t in test_tasks + train_tasks:
        fixed = {**t.files, **t.fixed}
        assert all(repos.same(g, o) for g, o in zip(run_entry(t, fixed, t.inputs), t.outputs)), t.task_id
        assert not all(repos.same(g, o) for g, o in zip(run_entry(t, t.files, t.inputs), t.outputs))
        if t.kind == "two_bugs":
            for path in t.fixed:
                half = {**t.files, path: t.fixed[path]}
                assert not all(repos.same(g, o) for g, o in zip(run_entry(t, half, t.inputs), t.outputs))
        call = t.issue.split("`")[1]
        named = lambda word: re.search(rf"\b{word}\b", t.issue) is not None
        assert t.entry_point in call and not any(named(f) for _, f in t.targets if f != t.entry_point)
        assert not any(p in t.issue for p, _ in t.targets)         # a symptom, never the fault's place


def test_the_place_of_the_fault_varies(test_tasks):
    """No file name and no function holds most faults: a plan that names a place fails most tasks."""
    paths = collections.Counter(p for t in test_tasks for p, _ in t.targets)
    names = collections.Counter(f for t in test_tasks for _, f in t.targets)
    assert paths.most_common(1)[0][1] <= 0.15 * len(test_tasks)
    assert names.most_common(1)[0][1] <= 0.15 * len(test_tasks)
    roles = collections.Counter(t.roles[p] for t in test_tasks for p, _ in t.targets)
    assert roles["target"] == sum(len(t.targets) for t in test_tasks)
    assert len({tuple(sorted(t.files)) for t in test_tasks}) > 0.8 * len(test_tasks)   # layouts differ


def test_no_fixed_plan_solves_more_than_15_percent(test_tasks):
    """The plans we can think of, each a fixed action sequence for every task, with perfect edits: the
    edit writes the fix's function into the file the plan names. A plan can only name files it has
    not seen; for each file name of the vocabulary (helper and entry modules), one at a time, the share
    of tasks that editing it would solve; then the plans that follow a structure (below)."""
    def solved(t, names):
        hit = [(p, f) for p, f in t.targets if p in names]
        return len(hit) == len(t.targets)
    for names in ([m + ".py"] for m in repos.HELPER_MODULES + repos.ENTRY_MODULES):
        assert sum(solved(t, names) for t in test_tasks) <= 0.15 * len(test_tasks), names
    # edit the entry module, wherever it is (a plan that reads the test file's import): call-site bugs only
    entry = sum(all(p == f"{t.module}.py" for p, _ in t.targets) for t in test_tasks)
    assert entry <= 0.15 * len(test_tasks)


def test_hidden_tests_tell_the_program_from_a_table(test_tasks):
    """A function that answers each visible case and the commonest visible answer elsewhere (the red
    team's table) fails a hidden case of every task."""
    for t in test_tasks:
        vis = repos.visible_cases(t)
        known = {repr(a): o for a, o in vis}
        common = collections.Counter(repr(o) for _, o in vis).most_common(1)[0][0]
        guess = next(o for _, o in vis if repr(o) == common)
        assert any(repr(known.get(repr(a), guess)) != repr(o) for a, o in zip(t.inputs, t.outputs)), t.task_id


def test_a_settings_number_is_stated_only_in_its_module(test_tasks, train_tasks):
    for t in test_tasks + train_tasks:
        for f in t.facts:
            assert f"{f['name']} = {f['value']!r}" in t.files[f["file"]]
            others = [text for p, text in t.files.items() if p != f["file"]] + [t.issue]
            assert not any(repos._mentions(text, f["value"]) for text in others), t.task_id
            assert f"set in {f['file']}" in t.files[t.targets[0][0]] or t.kind == "long"


def test_a_helper_the_chain_calls_twice_is_defined_once():
    """Its def was written once per call (tasks of levels 3-5 call a helper twice): a module that
    defines a function twice reads longer than the observation cap, and a stub after it was cut off."""
    tasks = repos.generate_repo_tasks("train", 200, seed=0)
    calls = lambda t: [re.findall(r"^    result = (\w+)\(", x, re.M)
                       for p, x in t.files.items() if "test_" not in p]
    assert sum(any(len(c) > len(set(c)) for c in calls(t)) for t in tasks) >= 10
    for t in tasks:
        for x in t.files.values():
            names = re.findall(r"^def (\w+)\(", x, re.M)
            assert len(names) == len(set(names)), t.task_id


def test_canaries_contradict_their_visible_tests():
    for t in repos.canary_repo_tasks(3):
        assert t.canary and t.slice == "canary"
        fixed = {**t.files, **t.fixed}
        for files in (fixed, t.files):            # neither the fix nor the untouched repository passes
            assert not all(repos.same(g, o) for g, o in zip(run_entry(t, files, t.inputs), t.outputs))


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        repos.make_repo_task("test", 0, 0, "rewrite")
    with pytest.raises(ValueError):
        repos.generate_repo_tasks("test", 1, kinds=("bug", "golf"))
    with pytest.raises(ValueError):
        repos.generate_repo_tasks("dev", 1)


def test_command_line():
    out = subprocess.run([sys.executable, "-m", "data.repos", "--show", "1", "--n", "8", "--split", "test",
                          "--seed", "11"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().split("\n")[-1])
    assert counts["n"] == 8 and sum(counts["kind"].values()) == 8 and "# file: " in out.stdout


# ---------------------------------------------------------------------------------------------
# The teacher's episodes (the bootstrap): the harness's own text, actions as targets, the rest context

def test_the_teachers_episodes_are_the_harnesss_and_pass(train_tasks, pool):
    """Each short transcript, replayed action by action through env.Tools (the RL harness), gets the very
    observations it holds and ends on submit with a repository the judge passes, unless the teacher ran
    out of actions (a two-bug task in 6 files can need more); the plans differ from task to task (its
    choices follow what it read), and it greps, reads, edits and tests."""
    import tokenizer
    short = [t for t in train_tasks if t.kind != "long"]
    docs = repos.transcripts(short, pool, seed=0)
    tok = tokenizer.train_tokenizer(list(docs), 400).with_tools()
    plans, used, passed = set(), collections.Counter(), 0
    for t, doc in zip(short, docs):
        segs = list(doc.segments)
        inline = "# file: " in segs[0][0]
        tools = env.Tools(inline=inline)
        assert segs[0] == (tools.prompt(t), True, False)
        e, k, names = env.Episode(0), 1, []
        tools.start(t, e)
        while k < len(segs):
            name, payload = segs[k][0], segs[k + 1][0] if segs[k + 1][0] != "<|end|>" else ""
            k += 3 if payload else 2
            ids = [tok.tool_ids[name]] + tok.encode(payload) + [tok.tool_ids["<|end|>"]]
            obs = tools.step(tok, pool, [(t, e, env.Turn([], ids, []))], True)[0]
            names.append(name[2:-2])
            if obs is None:
                break
            assert segs[k:k + 3] == env.observation_segments(obs), (t.task_id, name)
            k += 3
        assert k == len(segs) and names[-1] == "submit" and e.end == "submit"
        tools.finish(pool, [(t, e)])
        assert e.result.passed or len(e.actions) >= tools.max_actions - 3, t.task_id
        passed += e.result.passed
        plans.add(" ".join(a.name + (":" + t.roles[a.path] if a.path else "") for a in e.actions))
        used.update(names)
    assert passed >= 0.9 * len(short) and len(plans) >= len(short) // 4
    assert min(used[a] for a in ("grep", "read", "edit", "test")) > 0
