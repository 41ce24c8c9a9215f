"""Held-out means never seen: proofs by test, not by construction (issue 11).

1. No function identity (tasks.function_identity: the canonical AST, whatever the names) is in both
   the train split (50,000 tasks) and the test split (several seeds); HumanEval and canary
   functions are in neither.
2. Each test task's slice is what it says: `novel` templates never occur in train, `near` ones do.
3. No document of the pretraining corpus (tasks and stdlib sources, as train_pretrain.py builds it)
   holds a held-out function (env test, canaries, HumanEval), and twins under other names are dropped.

    timeout 600 python -m pytest -q tests/test_leakage.py
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from data import families
from data import tasks
from tokenizer import Tokenizer

pytestmark = pytest.mark.slow   # the slow suite: python -m pytest -q -m slow tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_TRAIN = 50_000
TEST_SEEDS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def train():
    return tasks.generate_tasks("train", N_TRAIN, seed=0)


@pytest.fixture(scope="module")
def template_train():
    """Train tasks of the template families only: the world (world.py) is most of the mix, and its
    slices are checked in tests/test_world.py."""
    return tasks.generate_tasks("train", N_TRAIN, seed=0, families=sorted(set(tasks.FAMILIES) - {"world"}))


@pytest.fixture(scope="module")
def test_sets():
    return {seed: tasks.generate_tasks("test", 1000, seed=seed) for seed in TEST_SEEDS}


def heldout_extras():
    return tasks.canary_tasks() + tasks.load_humaneval()


def test_function_identity_ignores_names_docstrings_and_annotations():
    same = ["def f(xs):\n    '''Doc.'''\n    total = 0\n    for x in xs:\n        total += x\n    return total\n",
            "def g(numbers: list) -> int:\n    acc = 0\n    for n in numbers:\n        acc += n\n    return acc\n"]
    ident = [tasks.function_identity(tasks.Task("t", s.split("\n")[0] + "\n", s[4], solution=s.split("\n", 1)[1]))
             for s in same]
    assert ident[0] == ident[1]
    assert tasks.function_identity("    return sorted(table)\n", ["table"]) == \
        tasks.function_identity("return sorted(counts)", ["counts"])
    for other in ["return sorted(table, reverse=True)", "return sorted(table)[1:]", "return list(table)",
                  "return table.sort()", "return sorted(table) + [1]", "return sorted(table) + [1.0]"]:
        assert tasks.function_identity(other, ["table"]) != tasks.function_identity("return sorted(table)", ["table"])
    # argument order matters, builtins and globals are kept, locals are renamed
    assert tasks.function_identity("return a - b", ["a", "b"]) != tasks.function_identity("return b - a", ["a", "b"])
    assert tasks.function_identity("return len(a)", ["a"]) != tasks.function_identity("return abs(a)", ["a"])
    assert tasks.function_identity("y = a\nreturn y", ["a"]) == tasks.function_identity("z = b\nreturn z", ["b"])
    with pytest.raises(ValueError, match="does not parse"):
        tasks.function_identity("return (", ["a"])
    with pytest.raises(ValueError, match="no solution"):
        tasks.function_identity(tasks.Task("x", "def f():\n", "f", test="pass"))
    # every function of a module: methods and nested ones too; not Python -> nothing
    src = "class A:\n    def m(self, t):\n        return sorted(t)\n\ndef h(q):\n    def inner(u):\n        return u\n"
    assert tasks.function_identity("return sorted(x)", ["self", "x"]) in tasks.function_identities(src)
    assert len(tasks.function_identities(src)) == 3 and tasks.function_identities("not python (") == set()


def test_novel_templates_share_no_structure_with_train_templates():
    # A novel template exists only in test; if its body equalled a train template's body (constants
    # aside: reverse-then-first-c of a string and reverse-then-head-c of a list are one function),
    # the same function would be trained under the other name. Compared symbolically (each constant
    # becomes a placeholder, numbered by first use), so it holds for every constant, not a sample.
    def structure(v):
        consts = [k for key in v.params for k in key.split(",")]
        order = list(dict.fromkeys(m for m in re.findall(r"\{(\w+)\}", v.body) if m in consts))
        body = v.body.format(**{k: f"K{i}" for i, k in enumerate(order)}, **{s: s for s in v.sig})
        return tasks.function_identity(body, list(v.sig))
    novel = {structure(v): v.name for v in families.VARIANTS if v.novel}
    trained = {structure(v): v.name for v in families.VARIANTS if not v.novel}
    assert len(novel) > 50
    assert not {novel[k]: trained[k] for k in novel.keys() & trained.keys()}


def test_no_function_in_both_splits(train, test_sets):
    train_ids = {}
    for t in train:
        train_ids.setdefault(tasks.function_identity(t), t)
    for seed, test in test_sets.items():
        shared = [(t.task_id, t.entry_point, train_ids[i].entry_point)
                  for t in test for i in [tasks.function_identity(t)] if i in train_ids]
        assert not shared, f"seed {seed}: {len(shared)} test tasks are train functions, e.g. {shared[:5]}"
    extras = [(t.task_id, train_ids[i].entry_point) for t in heldout_extras()
              for i in [tasks.function_identity(t)] if i in train_ids]
    assert not extras, f"HumanEval / canary functions in train: {extras}"
    test_ids = {tasks.function_identity(t) for test in test_sets.values() for t in test}
    assert not test_ids & {tasks.function_identity(t) for t in heldout_extras()}
    assert len(train_ids) > 3000 and len(test_ids) > 1000      # a world big enough to mean something


def _template_regex(v):
    """A regex matching exactly the entry points a variant can produce (its constants' values)."""
    choices = {}
    for k, values in v.params.items():
        parts = k.split(",")
        for i, part in enumerate(parts):
            choices[part] = [x[i] if len(parts) > 1 else x for x in values]
    fill = lambda m: "(?:" + "|".join(re.escape(str(c)) for c in choices[m.group(1)]) + ")"
    return re.sub(r"\\\{(\w+)\\\}", fill, re.escape(v.name))


def _templates(family_tasks, family):
    """{task_id: variant name} through one regex per family (named groups say which template matched)."""
    variants = [v for v in families.VARIANTS if v.family == family]
    rx = re.compile("|".join(f"(?P<v{i}>{_template_regex(v)})" for i, v in enumerate(variants)))
    out = {}
    for t in family_tasks:
        m = rx.fullmatch(t.entry_point)
        assert m, (t.task_id, t.entry_point)
        out[t.task_id] = variants[int(m.lastgroup[1:])]
    return out


def test_slices_mean_what_they_say(train, template_train, test_sets):
    test = [t for ts in test_sets.values() for t in ts]
    assert {t.slice for t in train} == {""}
    counts = {s: sum(t.slice == s for t in test) for s in ("near", "novel")}
    assert sum(counts.values()) == len(test) and min(counts.values()) > 0.2 * len(test), counts
    near_seen = []
    for family in set(tasks.FAMILIES) - {"world"}:
        seen = {v.name for v in _templates([t for t in template_train if t.family == family], family).values()}
        fam_test = {t.task_id: t for t in test if t.family == family}
        for t_id, v in _templates(fam_test.values(), family).items():
            if fam_test[t_id].slice == "novel":   # the template (compose: the step combination) never in train
                assert v.novel and v.name not in seen, (t_id, v.name)
            else:                                 # a template of the train split (constants: split test)
                assert not v.novel, (t_id, v.name)
                near_seen.append(v.name in seen)
    # ... and one that 50,000 train tasks show (a few of the ~1,500 three-step compositions they miss)
    assert sum(near_seen) >= 0.97 * len(near_seen), (sum(near_seen), len(near_seen))
    assert {t.family for t in test if t.slice == "novel"} >= {"compose", "strings", "lists", "algorithms"}


def test_pretraining_corpus_holds_no_heldout_function(tmp_path):
    """train_pretrain.py's real corpus (tasks + stdlib, plus a --data source of renamed twins of
    held-out functions): every document of every cache is parsed and checked by identity."""
    held = tasks.generate_tasks("test", 1000, seed=0) + heldout_extras()
    held_ids = {tasks.function_identity(t): t.task_id for t in held}
    near = next(t for t in held if t.slice == "near")
    twins = tmp_path / "twins"
    twins.mkdir()
    args = ", ".join(f"arg{i}" for i in range(near.prompt.split("\n")[0].count(",") + 1))
    body = near.solution
    for i, old in enumerate(re.match(r"def \w+\((.*)\):", near.prompt).group(1).split(", ")):
        body = re.sub(rf"\b{old}\b", f"arg{i}", body)
    (twins / "near_twin.py").write_text(f"def renamed({args}):\n    '''Another docstring.'''\n{body}")
    (twins / "humaneval_twin.py").write_text("import os\n\n\ndef plus(p, q):\n    return p + q\n")  # HumanEval/53
    (twins / "canary_twin.py").write_text("def inc(v):\n    return v + 1\n")                         # canary/0
    (twins / "fine.py").write_text("def keep(v):\n    return v + 100003\n" * 3)
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train_pretrain.py"), "--preset", "smoke", "--out-dir", str(out),
           "--tasks-n", "20000", "--source-mb", "3", "--holdout-n", "1000", "--data", f"twins={twins}",
           "--mix", "stdlib=0.4,tasks=0.5,twins=0.1", "--max-steps", "1", "--eval-every", "1",
           "--seq-len", "16", "--micro-batch", "8", "--batch-tokens", "128", "--repair-frac", "0.25"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["data"]["twins"]["skipped"].get("heldout") == 3, s["data"]
    # --source-mb 3 caps each source: ~5,000 tasks (world.py's programs are longer than the templates)
    assert s["data"]["stdlib"]["docs"] > 100 and s["data"]["tasks"]["docs"] > 4000, s["data"]
    tok = Tokenizer.load(out / "tokenizer.json")
    n_docs, leaks = 0, []
    for name, path in s["caches"].items():            # train and val documents of every source
        ids = np.fromfile(path, dtype=np.uint16) % tok.vocab_size   # context-only ids carry + vocab_size
        cuts = np.flatnonzero(ids == tok.eot_id)
        for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts):
            doc = tok.decode(ids[a + 1:b].tolist())
            n_docs += 1
            leaks += [(name, held_ids[i]) for i in tasks.function_identities(doc) if i in held_ids]
    assert n_docs > 5000 and not leaks, leaks[:10]
