"""repair.py: mutants of reference bodies, repair transcripts checked in the real sandbox, and the
transcripts in the smoke pretraining corpus."""
import ast
import dataclasses
import random
import re

import numpy as np
import pytest

import env
from sandbox import SandboxPool
from data import repair
from data.tasks import generate_tasks
from test_pretrain import run, train_text
from tokenizer import Tokenizer

BODY = """\
    total = 0
    for x in xs[1:]:
        if x < lo:
            total += x * 2
        else:
            total -= min(x, -1)
    words = ' '.join(w for w in sorted(names))
    return total - a * b if words == '' else len(words) // 3
"""


def parses(body):
    return ast.parse("def f(xs, lo, names, a, b):\n" + body) is not None


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, timeout_s=1.0) as p:
        yield p


@pytest.fixture(scope="module")
def train():
    return generate_tasks("train", 60, seed=0)


def test_every_kind_of_mutant_and_the_rest_keeps_its_text():
    ms = repair.mutants(BODY, random.Random(0))
    lines = BODY.splitlines()
    for old, new in [("total += x * 2", "total -= x * 2"), ("total += x * 2", "total += x + 2"),
                     ("if x < lo:", "if x <= lo:"), ("xs[1:]", "xs[2:]"), ("xs[1:]", "xs[0:]"),
                     ("min(x, -1)", "max(x, -1)"), ("min(x, -1)", "min(x, -2)"),
                     ("sorted(names)", "sorted(names, reverse=True)"), ("len(words) // 3", "len(words) % 3"),
                     ("total - a * b", "total - (a + b)")]:      # precedence: a parenthesis, not total - a + b
        want = BODY.replace(old, new, 1)
        assert want in ms, (old, new)
    # "name": one use of an argument spelt as another task's argument (a NameError in the sandbox)
    renamed = [m for m in ms if any(re.search(rf"\b{n}\b", m) and not re.search(rf"\b{n}\b", BODY)
                                    for n in repair.WRONG_NAMES)]
    assert renamed and all(sum(a != b for a, b in zip(lines, m.splitlines())) == 1 for m in renamed)
    for m in renamed:                           # spelt back, the wrong name is one of the arguments
        w = next(n for n in repair.WRONG_NAMES if re.search(rf"\b{n}\b", m) and not re.search(rf"\b{n}\b", BODY))
        assert any(re.sub(rf"\b{w}\b", a, m) == BODY for a in ("xs", "lo", "names", "a", "b"))
    swapped = [m for m in ms if "if x < lo:\n            total -= min(x, -1)\n        else:\n" in m]
    assert len(swapped) == 1
    for m in ms:
        assert parses(m) and m != BODY
        changed = [a for a, b in zip(lines, m.splitlines()) if a != b]
        # one rewrite: the generator argument keeps its text (ast.unparse would write join((w for ...)))
        assert len(changed) <= 2 or m is swapped[0], m
        assert "' '.join(w for w in sorted(" in m
    assert "-0" not in "".join(ms)                       # -1 - 1 is -2, -1 + 1 is not written as -0


def test_mutants_of_reference_solutions_are_valid_distinct_and_deterministic(train):
    kinds_seen = 0
    for t in train:
        ms = repair.mutants(t.solution, random.Random(t.task_id))
        assert ms == repair.mutants(t.solution, random.Random(t.task_id))
        assert len(set(ms)) == len(ms) and t.solution not in ms
        for m in ms:
            ast.parse(env.render_prompt(t) + m)
        kinds_seen += len(ms) > 0
    assert kinds_seen >= 55                     # nearly every reference has something to break
    orders = {tuple(repair.mutants(train[0].solution, random.Random(s))) for s in range(5)}
    assert len(orders) > 1                      # the rng decides the order


def test_transcripts_fail_for_real_and_show_only_visible_examples(train, pool):
    found = repair.repairs(train, pool, seed=0, frac=0.5)
    docs = repair.repair_docs(train, pool, seed=0, frac=0.5)
    assert 15 <= len(found) == len(docs) and docs == repair.repair_docs(train, pool, seed=0, frac=0.5)
    results = pool.run_batch(env.runs([env.visible_task(t) for t, _, _ in found], [w for _, w, _ in found]))
    for (t, wrong, r), again, doc in zip(found, results, docs):
        assert r.outcome not in ("pass", "sandbox_error", "no_code") and again.outcome == r.outcome
        assert again.feedback == r.feedback                  # the wrong attempt really fails, the same way
        feedback = f"# Test failed: {' '.join(r.feedback.split())[:200]}\n"
        head, _, fix = doc.partition(feedback)
        assert head == env.render_prompt(t) + wrong and wrong != t.solution
        def_line = fix.splitlines()[0]
        assert def_line.startswith(f"def {t.entry_point}(") and fix == def_line + "\n" + t.solution
        shown = [args for args, _ in env.visible_tests(t)]
        for args in t.inputs:                                # hidden inputs never reach the text
            if args not in shown:
                assert f"{t.entry_point}({', '.join(map(repr, args))})" not in doc
    misspelt = [r for t, w, r in found if repair._renamed(t, w)]    # the "name" kind fails as a NameError
    assert misspelt and all("NameError" in r.feedback for r in misspelt)
    assert repair.repair_docs(train, pool, seed=0, frac=0.0) == []


def test_tasks_without_examples_are_skipped(train, pool):
    bare = [dataclasses.replace(t, prompt=t.prompt.split(">>>")[0].rstrip() + '\n    """\n') for t in train[:10]]
    assert all(env.visible_task(t) is None for t in bare)
    assert repair.repair_docs(bare, pool, frac=1.0) == []
    assert len(repair.repair_docs(train[:10], pool, frac=1.0)) >= 8


@pytest.mark.slow   # a whole smoke pretraining run
def test_smoke_corpus_holds_repair_transcripts(tmp_path):
    """Transcripts are in the corpus, and exactly their wrong attempts and feedback are stored as
    context only (ids + vocab_size: fed, never a target): each such run of ids is a body right after
    a prompt, then the feedback and the def line, then the fix (trained on)."""
    texts = {}
    for frac in ("0.25", "0"):
        out = tmp_path / frac
        s, _ = run(out, tmp_path / "cache", "--repair-frac", frac, "--max-steps", "1")
        tok = Tokenizer.load(out / "tokenizer.json")
        texts[frac] = train_text(s, tok)["tasks/train"]
        ids = np.fromfile(s["caches"]["tasks/train"], dtype=np.uint16).astype(np.int64)
        ctx = ids >= tok.vocab_size
        runs = np.flatnonzero(np.diff(np.concatenate([[0], ctx.astype(np.int8), [0]])))
        spans = list(zip(runs[::2], runs[1::2]))
        assert len(spans) == texts[frac].count("# Test failed:")
        for a, b in spans[:50]:
            before, context, after = (tok.decode((ids[i:j] % tok.vocab_size).tolist()) for i, j in
                                      [(max(a - 8, 0), a), (a, b), (b, b + 4)])
            assert before.endswith('"""\n') and context.startswith("    ") and after.startswith("    ")
            assert context.count("\n# Test failed: ") == 1 and context.rstrip().endswith("):")
    assert texts["0.25"].count("# Test failed:") >= 20 and "# Test failed:" not in texts["0"]


def test_bad_repair_frac_is_one_line_error(tmp_path):
    _, p = run(tmp_path, tmp_path / "cache", "--repair-frac", "1.5", expect=2, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --repair-frac"), p.stderr


@pytest.mark.slow   # a leakage scan over thousands of candidates
def test_no_wrong_attempt_is_a_held_out_function():
    """A mutant of a train function can be a test function (values[2:] -> values[3:], x * 5 -> x + 5);
    none of the wrong attempts repair_docs may use is one, checked against the functions of 12,000
    test tasks (all levels, and levels 1-2 as train_rl.py and eval.py measure)."""
    from data.tasks import function_identity
    held = {function_identity(t) for s in range(2) for lv in (None, [1, 2])
            for t in generate_tasks("test", 3000, seed=s, difficulties=lv)}
    tried = leaked = 0
    for t in generate_tasks("train", 2000, seed=0):
        for m in repair.mutants(t.solution, random.Random(t.task_id))[:6]:
            if repair._usable(t, m):
                tried += 1
                leaked += function_identity(dataclasses.replace(t, solution=m)) in held
    assert tried > 2000 and leaked == 0
