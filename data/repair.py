"""repair.py: repair transcripts for the pretraining corpus, so the base model has seen feedback.

A multi-turn episode (env.render_episode) is: prompt, a body, "# Test failed: ..." and the def
line again, a new body. The base model never saw that shape, so RL would have to discover it from
scratch; Composer 2 trains in the harness the model is deployed in, and this puts the harness's
feedback into pretraining. A transcript is a train task's prompt, a plausible wrong body (a mutant
of the reference, as in mutation testing), the feedback the sandbox really gave on the docstring's
examples, and the reference body.

    python -m data.repair --n 2000 --show 2     # transcripts of 2,000 train tasks: counts, outcomes, time

Stdlib + env + tasks only (no torch): task_docs / tasks_source build the pretraining "tasks" source with it.
"""
import ast
import builtins
import collections
import copy
import dataclasses
import itertools
import json
import random
import time

from contextlib import nullcontext, suppress

import env
from sandbox import SandboxPool
from data import tasks
from data import world
from infra.cli import ArgumentParser   # argparse errors: one line `error: ...`, exit code 2

# ----------------------------------------------------------------------------- mutants
# Each rewrite takes an AST node and returns its wrong twin, or None where it does not apply. They
# are the classic mutation operators (mutation testing, e.g. mutmut / PIT): the small slips a
# programmer makes, not random noise, so the fix after the feedback is a small, learnable edit.

_BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mod, ast.Mod: ast.FloorDiv}
_CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In}


def _int(v):
    """An int literal as the parser builds it: -1 is USub(1)."""
    return ast.Constant(v) if v >= 0 else ast.UnaryOp(ast.USub(), ast.Constant(-v))


def _plus(e, d):
    """e + d, folded when e is an int literal."""
    if isinstance(e, ast.Constant) and type(e.value) is int:
        return _int(e.value + d)
    return ast.BinOp(e, ast.Add() if d > 0 else ast.Sub(), ast.Constant(abs(d)))


def _operator(n):        # a + b -> a - b, a * b -> a + b, a // b -> a % b, total += x -> total -= x
    if isinstance(n, (ast.BinOp, ast.AugAssign)) and type(n.op) in _BINOPS:
        new = copy.copy(n)                         # shallow: the operands stay, the operator changes
        new.op = _BINOPS[type(n.op)]()
        return new


def _comparison(n):      # < -> <=, == -> !=, in -> not in (the first operator of a chain)
    if isinstance(n, ast.Compare) and type(n.ops[0]) in _CMPOPS:
        return ast.Compare(n.left, [_CMPOPS[type(n.ops[0])]()] + n.ops[1:], n.comparators)


def _off_by_one(d):      # an int literal c -> c + d
    def rewrite(n):
        if isinstance(n, ast.Constant) and type(n.value) is int:
            if getattr(n, "negated", False):       # the digits of -c: -c + d is -(c - d); never -0
                return ast.Constant(n.value - d) if n.value - d > 0 else None
            return _int(n.value + d)
    return rewrite


def _branch(n):          # if/else bodies swapped; a lone `if` gets the negated condition
    if isinstance(n, ast.IfExp):
        return ast.IfExp(n.test, n.orelse, n.body)
    if isinstance(n, ast.If):
        return ast.If(n.test, n.orelse, n.body) if n.orelse else ast.If(ast.UnaryOp(ast.Not(), n.test), n.body, [])


def _min_max(n):         # min <-> max
    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in ("min", "max"):
        return ast.Name("max" if n.id == "min" else "min", n.ctx)


def _sort_order(n):      # sorted(xs) <-> sorted(xs, reverse=True), and list.sort()
    f = n.func if isinstance(n, ast.Call) else None
    if (isinstance(f, ast.Name) and f.id == "sorted") or (isinstance(f, ast.Attribute) and f.attr == "sort"):
        rev = next((k.value for k in n.keywords if k.arg == "reverse"), None)
        keep = [k for k in n.keywords if k.arg != "reverse"]
        if isinstance(rev, ast.Constant) and rev.value is True:
            return ast.Call(f, n.args, keep)
        flipped = ast.Constant(True) if rev is None else ast.UnaryOp(ast.Not(), rev)
        return ast.Call(f, n.args, keep + [ast.keyword("reverse", flipped)])


def _slice_bound(n):     # xs[a:b] -> xs[a + 1:b]; xs[:b] -> xs[:b + 1]
    if isinstance(n, ast.Slice) and (n.lower or n.upper):
        if n.lower:
            return ast.Slice(_plus(n.lower, 1), n.upper, n.step)
        return ast.Slice(None, _plus(n.upper, 1), n.step)


def _rename(free, wrong):  # one use of an argument -> another task's argument name (NameError)
    def rewrite(n):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in free:
            return ast.Name(wrong, n.ctx)
    return rewrite


# The names the RL models write for an argument they misremember: the world's argument names
# (world.ARG_NAMES; most tasks are world's). Each body gets one it does not use, drawn by its rng.
WRONG_NAMES = sorted({n for ns in world.ARG_NAMES.values() for n in ns})


def _free_names(tree):
    """Names the body (`def _f(): ...`) reads but never binds and that are no builtins: its arguments."""
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - tasks.local_names(tree.body[0]) - set(dir(builtins))


REWRITES = {"operator": _operator, "comparison": _comparison, "plus_one": _off_by_one(1),
            "minus_one": _off_by_one(-1), "branch": _branch, "min_max": _min_max,
            "sort_order": _sort_order, "slice_bound": _slice_bound}


class _Mutate(ast.NodeTransformer):
    """Replaces the `target`-th node (in visiting order) that `rewrite` applies to; counts them all."""

    def __init__(self, rewrite, target):
        self.rewrite, self.target, self.sites, self.hit = rewrite, target, 0, None

    def visit(self, node):
        new = self.rewrite(node)
        if new is not None:
            self.sites += 1
            if self.sites - 1 == self.target:
                self.hit = (node, new)
                return new
        return self.generic_visit(node)


def _parse(source):
    tree = ast.parse(source)
    for n in ast.walk(tree):     # -3 parses as USub(3): off-by-one moves the value, not the digits
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant):
            n.operand.negated = True
    return tree


_HEAD = "def _f():\n"     # a function BODY is parsed and mutated as the body of this function


def _as_function(body):
    return _HEAD + body if body.endswith("\n") else _HEAD + body + "\n"


def _mutant(source, rewrite, target):
    """`source` with the target-th site of `rewrite` changed. Only the new node's text is spliced in
    where the old node stood, so the rest keeps its exact text (ast.unparse would restyle the whole
    body, and the fix would then differ from the wrong attempt in more than the bug); the splice
    counts only if it parses back to the mutated tree (in parentheses if precedence demands)."""
    m = _Mutate(rewrite, target)
    tree = m.visit(_parse(source))
    old, new = m.hit
    data = source.encode()       # AST offsets count UTF-8 bytes
    starts = list(itertools.accumulate(len(ln) for ln in data.splitlines(keepends=True)))
    begin = ([0] + starts)[old.lineno - 1] + old.col_offset
    end = ([0] + starts)[old.end_lineno - 1] + old.end_col_offset
    text = ast.unparse(new).replace("\n", "\n" + " " * old.col_offset)   # a block keeps its indentation
    for piece in (text, f"({text})"):
        out = (data[:begin] + piece.encode() + data[end:]).decode()
        with suppress(SyntaxError):
            if ast.dump(ast.parse(out)) == ast.dump(tree):
                return out
    return None


def mutants(solution: str, rng) -> list[str]:
    """Distinct wrong versions of a function BODY (4-space indented lines, a Task's `solution`),
    each one rewrite away from it. Order: one of each kind in turn (kinds and sites shuffled by
    `rng`), so the first few cover several kinds rather than the most common one (literals). The
    kinds: REWRITES, and "name": one use of an argument spelled as another task's argument (a name
    the body does not use): after wrong answers, the RL models' most common failure (a NameError)."""
    source = _as_function(solution)
    tree = _parse(source)
    used = {x.id for x in ast.walk(tree) if isinstance(x, ast.Name)} | tasks.local_names(tree.body[0])
    unused = [n for n in WRONG_NAMES if n not in used]
    kinds = list(REWRITES.values()) + ([_rename(_free_names(tree), rng.choice(unused))] if unused else [])
    by_kind = []
    for rewrite in kinds:
        counter = _Mutate(rewrite, -1)
        counter.visit(_parse(source))
        found = {_mutant(source, rewrite, i) for i in range(counter.sites)} - {None, source}
        by_kind.append(sorted(found))
        rng.shuffle(by_kind[-1])
    rng.shuffle(by_kind)
    in_turn = itertools.chain(*itertools.zip_longest(*by_kind))
    return list(dict.fromkeys(m[len(_HEAD):] for m in in_turn if m is not None))   # two kinds, one text: xs[2:]


# ----------------------------------------------------------------------------- transcripts

def _renamed(task, wrong):
    """Does `wrong` differ from the task's reference body only in spelling one argument as a name the
    reference does not use (a "name" mutant)? Compared as syntax trees: spelt back, it is the reference."""
    ref = _parse(_as_function(task.solution))
    names = lambda tree: {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    new = names(_parse(_as_function(wrong))) - names(ref)
    if len(new) != 1:
        return False
    (w,) = new
    for a in _free_names(ref):
        back = _parse(_as_function(wrong))
        for n in ast.walk(back):
            if isinstance(n, ast.Name) and n.id == w:
                n.id = a
        if ast.dump(back) == ast.dump(ref):
            return True
    return False


def _usable(task, wrong):
    """A wrong attempt that cannot be a held-out function: a mutant of a train function can be a test
    one (add_5 -> add_6, x * 5 -> x + 5), and its text must not reach training even as a wrong answer.
    Refused: a template function that split_of sends to test, any function of a held-out template,
    and any body world.py could write (every line one of world.body_lines()): the world splits by
    program, which a mutant's text does not give, so no world function is trusted. Accepted even so:
    a train function with one argument misspelt (_renamed). Under the task's own signature that body
    reads a name nothing binds, and no generated function (template or world) reads an unbound name
    other than a builtin, so it is no task's function (tests/test_repair.py checks 12,000)."""
    if _renamed(task, wrong):
        return True
    if {ln.strip() for ln in wrong.splitlines() if ln.strip()} <= world.body_lines():
        return False
    try:
        identity = tasks.function_identity(dataclasses.replace(task, solution=wrong))
    except ValueError:
        return False
    return tasks.split_of(identity)[0] == "train" and identity not in tasks.novel_identities()


def repairs(tasks, pool, seed=0, frac=0.25, tries=3) -> list[tuple]:
    """(task, wrong body, Result) for about `frac` of the (train) tasks: a mutant that really
    fails the docstring's examples in `pool` (SandboxPool), with what the sandbox said. Each task
    draws from its own RNG (seed, task_id), so whether it gets one, and which, does not depend on the
    other tasks in the list. Tasks without visible examples or without a failing mutant among their
    first `tries` are skipped. All candidates of a round go to the sandbox in one batch."""
    chosen = []                                   # (task, visible task, candidate bodies)
    for t in tasks:
        rng = random.Random(f"repair/{seed}/{t.task_id}")
        if rng.random() >= frac or t.solution is None:
            continue
        visible = env.visible_task(t)
        if visible is not None:
            chosen.append((t, visible, [m for m in mutants(t.solution, rng) if _usable(t, m)][:tries]))
    found = {}
    for k in range(tries):                        # round k: the k-th candidate of the tasks still open
        todo = [(i, c[k]) for i, (_, _, c) in enumerate(chosen) if i not in found and k < len(c)]
        results = pool.run_batch(env.runs([chosen[i][1] for i, _ in todo], [m for _, m in todo]))
        for (i, wrong), r in zip(todo, results):
            if r.outcome not in ("pass", "sandbox_error"):    # only the attempt's own failures
                found[i] = (chosen[i][0], wrong, r)
    return [found[i] for i in sorted(found)]


class Transcript(str):
    """A repair transcript's text, and `context`: the (start, end) characters of the wrong attempt
    and the feedback after it. Pretraining reads them and never trains on them, as RL never trains
    on feedback: the model should learn the fix, not to write a bug after a prompt nor to write
    feedback itself after a body (both happened when it trained on them: docs/notes.md).
    `cuts`: more characters where the harness's token stream joins pieces encoded (or sampled) apart,
    the prompt and the body, an attempt and its feedback; pretraining encodes the pieces apart too
    (corpus.encode_doc). A tokenizer whose pre-tokens can cross a cut (real ones: "\n" + indent)
    would otherwise train on other ids than the harness feeds; this project's own gives the same ids."""
    context = (0, 0)
    cuts = ()


def task_doc(task) -> Transcript:
    """A solved task for the pretraining corpus: env.corpus_text, cut after the prompt."""
    doc = Transcript(env.corpus_text(task))
    doc.cuts = (len(env.render_prompt(task)),)
    return doc


def repair_docs(tasks, pool, seed=0, frac=0.25) -> list[Transcript]:
    """The repair transcripts of `repairs`: prompt, wrong body, feedback, reference body."""
    docs = []
    for t, wrong, r in repairs(tasks, pool, seed, frac):
        feedback = env.render_feedback(t, r, wrong)
        doc = Transcript(env.render_episode(t, [(wrong, feedback), (t.solution, "")]))
        doc.context = (len(env.render_prompt(t)), len(env.render_prompt(t)) + len(wrong) + len(feedback))
        doc.cuts = (doc.context[0] + len(wrong),)
        docs.append(doc)
    return docs


def main(argv=None):
    ap = ArgumentParser(prog="python -m data.repair",
                        description="Repair transcripts of train tasks: counts, outcomes, time.")
    ap.add_argument("--n", type=int, default=2000, help="train tasks")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (also the transcripts' seed)")
    ap.add_argument("--frac", type=float, default=0.25, help="fraction of tasks that get a transcript")
    ap.add_argument("--show", type=int, default=0, help="print this many transcripts")
    a = ap.parse_args(argv)
    todo = tasks.generate_tasks("train", a.n, seed=a.seed)
    t0 = time.time()
    with SandboxPool(timeout_s=1.0) as pool:
        found = repairs(todo, pool, seed=a.seed, frac=a.frac)
    dt = time.time() - t0
    for t, wrong, r in found[:a.show]:
        print(env.render_episode(t, [(wrong, env.render_feedback(t, r, wrong)), (t.solution, "")]) + "-" * 80)
    outcomes = collections.Counter(r.outcome for _, _, r in found)
    print(json.dumps({"n_tasks": a.n, "frac": a.frac, "transcripts": len(found), "seconds": round(dt, 1),
                      "outcomes": dict(outcomes.most_common())}))


if __name__ == "__main__":
    main()


def tasks_source(args):
    """The pretraining "tasks" source (train_pretrain.py's flags --tasks-n, --seed, --task-difficulties,
    --repair-frac): solved train tasks at those levels, each chunk followed by its repair transcripts."""
    levels = tasks.parse_difficulties(args.task_difficulties)
    return task_docs(tasks.generate_tasks("train", args.tasks_n, seed=args.seed, difficulties=levels),
                     args.repair_frac, args.seed)


def task_docs(train, repair_frac=0.0, seed=0, chunk=256):
    """The solved tasks, and after each chunk of them their repair transcripts (repair.py), so the
    --source-mb cap keeps both. Lazy: chunks past the cap never reach the sandbox, and the pool closes
    when the caller drops the generator."""
    with SandboxPool(timeout_s=1.0) if repair_frac > 0 else nullcontext() as pool:
        for i in range(0, len(train), chunk):
            yield from map(task_doc, train[i:i + chunk])
            if pool is not None:
                yield from repair_docs(train[i:i + chunk], pool, seed=seed, frac=repair_frac)
