"""The repository world's rewards without a fix (issue 60, items 1-3). On held-out seeds (11, 29, 23) and
train seed 0, no trivial body earns a reward and the visible tests reject each one:
  - a table of the visible cases (each visible call answered with its expected value), whatever it gives
    elsewhere: a constant (any visible output or other), its input, the buggy repository's answer, a
    half-fixed repository's (two bugs), a repository whose function to fix returns its input;
  - the entry point returning its input, a constant; the buggy repository as given; a two-bug task with
    one bug fixed; the function to fix returning its input (the deleted helper "done" by giving its data
    back, a buggy helper or call site bypassed).
And a settings number is not found faster by trying the values of its range (edit, test, each) than by
reading the settings module. The generated files run in-process (repos.load: our own text plus a one-line
body); nothing here is the agent's code."""
import ast
import functools
import random
import re

import pytest

import env
from data import repos, search, world

# one seed in the fast suite, the others (each a few seconds a test) in the slow one
SEEDS = (("test", 11), *(pytest.param(*s, marks=pytest.mark.slow) for s in (("test", 29), ("test", 23), ("train", 0))))
MAX_ACTIONS = 12        # env.Tools' step limit: a guess is an edit and a test, and the episode ends on submit


def tasks_of(split, seed, n_per_kind, kinds=repos.KINDS):
    return repos.generate_repo_tasks(split, n_per_kind * len(kinds), seed, kinds=kinds)


def outputs(t, files):
    return repos.outputs_of(files, t.module, t.entry_point, t.inputs)


def passes(got, want):
    return all(repos.same(g, o) for g, o in zip(got, want))


def identity_files(t, path, f):
    """The fixed repository with function f's body `return <its first parameter>`."""
    files = {**t.files, **t.fixed}
    params = re.search(rf"^def {f}\((.*)\):$", files[path], re.M).group(1)
    body = f"def {f}({params}):\n    return {params.split(', ')[0]}\n"
    return {**files, path: env.replace_function(files[path], body, path)[0]}


def trivial_bodies(t):
    """name -> the entry point's value on each hidden input, for every trivial body that is a whole
    repository: the buggy one, each half fix, each function to fix giving its input back; and the
    entry point giving its input back."""
    out = {"buggy": outputs(t, t.files), "entry returns its input": [a[0] for a in t.inputs]}
    if t.kind == "two_bugs":
        for p, f in t.targets:
            out[f"only {f} fixed"] = outputs(t, {**t.files, p: t.fixed[p]})
    for p, f in t.targets:
        out[f"{f} returns its input"] = outputs(t, identity_files(t, p, f))
    return out


def leaks(t):
    """The trivial bodies that earn a reward on task t ("... passes the hidden tests"), and those its
    visible tests do not reject ("... passes the visible tests")."""
    vis = {repr(a) for a, _ in repos.visible_cases(t)}
    shown = [repr(a) in vis for a in t.inputs]
    assert sum(shown) == len(vis) >= 2, t.task_id
    unseen = [o for o, s in zip(t.outputs, shown) if not s]
    found = []
    if all(repos.same(o, unseen[0]) for o in unseen):
        found.append("a table with a constant default passes the hidden tests")
    if all(repos.same(o, t.outputs[0]) for o, s in zip(t.outputs, shown) if s):
        found.append("a constant passes the visible tests")
    for name, got in trivial_bodies(t).items():
        if passes(got, t.outputs):
            found.append(f"{name} passes the hidden tests")
        table = [o if s else g for o, g, s in zip(t.outputs, got, shown)]
        if passes(table, t.outputs):
            found.append(f"a table with default '{name}' passes the hidden tests")
        if all(repos.same(g, o) for g, o, s in zip(got, t.outputs, shown) if s):
            found.append(f"{name} passes the visible tests")
    return found


@functools.lru_cache(maxsize=None)
def all_leaks(split, seed, n_per_kind):
    return {t.task_id: leaks(t) for t in tasks_of(split, seed, n_per_kind, repos.KINDS + ("long",))}


def leak_report(split, seed, n_per_kind, tests):
    """task id -> what passes `tests` ("hidden", "visible") on n_per_kind tasks of each kind (long too)."""
    found = all_leaks(split, seed, n_per_kind).items()
    return {k: passing for k, v in found if (passing := [x for x in v if x.endswith(f"the {tests} tests")])}


@pytest.mark.parametrize("split,seed", SEEDS)
def test_no_table_or_trivial_body_earns_a_reward(split, seed):
    """A fixed sample: 20 tasks of each kind (long included) per seed."""
    assert leak_report(split, seed, 20, "hidden") == {}


@pytest.mark.parametrize("split,seed", SEEDS)
def test_the_visible_tests_reject_every_trivial_body(split, seed):
    assert leak_report(split, seed, 20, "visible") == {}


@pytest.mark.slow
@pytest.mark.parametrize("split,seed", SEEDS)
@pytest.mark.parametrize("tests", ["hidden", "visible"])
def test_no_trivial_body_passes_200_tasks_per_kind(split, seed, tests):
    assert leak_report(split, seed, 200, tests) == {}


# ----------------------------------------------------------------------------- guessing a settings number

def guess_search(t, values):
    """A search that never reads the settings module: it knows the function to fix and its template,
    writes it with each value of `values` in turn, and runs the visible tests after each (two actions),
    until they pass; then submits. Returns (actions it took, whether the hidden tests pass), or None
    when no value passes the visible tests."""
    (path, f), = t.targets
    fact, = t.facts
    reference = search.definition(t.fixed[path], f)
    vis = [repr(a) for a, _ in repos.visible_cases(t)]
    shown = [repr(a) in vis for a in t.inputs]
    for k, v in enumerate(values, 1):
        body = re.sub(rf"(?<![\w.]){re.escape(repr(fact['value']))}(?![\w.])", repr(v), reference)
        got = outputs(t, {**t.files, path: env.replace_function(t.files[path], body, path)[0]})
        if all(repos.same(g, o) for g, o, s in zip(got, t.outputs, shown) if s):
            return 2 * k + 1, passes(got, t.outputs)
    return None


def guesses(t):
    """The values a guess tries, in order: the range of its template's constant (what the world's other
    programs use), then every settings number the world draws from (SETTING_VALUES), smallest first."""
    (_, f), = t.targets
    key = next(k for k in world.PRIMS if repos.helper_name(k) == f)
    small = world.PRIMS[key].consts[0][1]
    return list(small) + [v for v in getattr(repos, "SETTING_VALUES", ()) if v not in small]


@pytest.mark.parametrize("split,seed", SEEDS)
def test_trying_each_value_does_not_find_a_settings_number_within_the_step_limit(split, seed):
    """30 config tasks per seed: the guesses that fit in the step limit (5: an edit and a test each, then
    the submit) never pass the visible tests; reading the settings module (one action) is the cheaper way."""
    assert set(repos.SETTABLE) <= set(world.PRIMS)     # a renamed primitive would end config tasks
    tasks = tasks_of(split, seed, 30, kinds=("config",))
    assert [t.task_id for t in tasks if guess_search(t, guesses(t)[:(MAX_ACTIONS - 1) // 2])] == []


@pytest.mark.slow
@pytest.mark.parametrize("split,seed", SEEDS)
def test_the_visible_tests_pin_a_settings_number(split, seed):
    """Every guess of the range tried until the visible tests pass: the value found passes the hidden tests
    too (the visible tests pin it, so the task is fair), and only after more actions than an episode has."""
    for t in tasks_of(split, seed, 50, kinds=("config",)):
        actions, passed = guess_search(t, guesses(t))
        assert passed and actions > MAX_ACTIONS, t.task_id


def guessed(split, seed, n):
    """(config tasks, solved by the search within MAX_ACTIONS, solved by it with no limit, the median
    actions it took where it solved one): the figures of issue 60's item 3."""
    tasks = tasks_of(split, seed, n, kinds=("config",))
    runs = [guess_search(t, guesses(t)) for t in tasks]
    took = sorted(g[0] for g in runs if g and g[1])
    return (len(tasks), sum(bool(g and g[1] and g[0] <= MAX_ACTIONS) for g in runs), len(took),
            took[len(took) // 2] if took else None)


# ----------------------------------------------------------------------------- near misses and tables
# Issue 60's red-team rerun: tasks (split, seed, index, kind) on which, before the fix, a one-token variant of
# a function to fix passed every hidden case while wrong on fresh inputs (NEAR), or a table of what a
# function to fix receives on the visible calls, or of the buggy entry point's visible outputs, did (TABLE).
NEAR = [("test", 11, 10, "bug"), ("test", 11, 16, "two_bugs"), ("test", 11, 90, "bug"),
        ("test", 11, 116, "two_bugs"), ("test", 11, 135, "bug"), ("test", 11, 126, "two_bugs")]
TABLE = [("test", 11, 82, "deleted"), ("test", 11, 175, "bug"), ("test", 29, 80, "bug"),
         ("train", 0, 155, "bug"), ("train", 0, 30, "bug"), ("test", 11, 10, "bug")]
TWIN = {">": ">=", ">=": ">", "<": "<=", "<=": "<", "!=": "=="}


def one_token_variants(body):
    """The faults' grammar applied to a body, each way: an operator flipped or a comparison's twin, an
    integer constant +-1 or +-2, a `not` added or dropped."""
    for m in re.finditer(r" (==|!=|>=|<=|>|<|\+|-|\*|//|%) ", body):
        for op in {repos.FLIP.get(m[1]), TWIN.get(m[1])} - {None}:
            yield body[:m.start(1)] + op + body[m.end(1):]
    for m in re.finditer(r"(?<![\w.])\d+(?![\w.])", body):
        for d in (-2, -1, 1, 2):
            yield body[:m.start()] + str(int(m[0]) + d) + body[m.end():]
    for m in re.finditer(r" if (not )?", body):
        yield body[:m.start()] + (" if " if m[1] else " if not ") + body[m.end():]


def fresh(t, n=300):
    """n inputs of the task's type from the world's distribution (a stream of their own)."""
    x = t.inputs[0][0]
    typ = {int: world.INT, str: world.STR, dict: world.DICT}.get(type(x)) or \
        (world.WORDS if any(type(v) is str for a in t.inputs for v in a[0]) else world.INTS)
    return [[x] for x in world.sample_inputs(random.Random(f"fresh/{t.task_id}"), typ, n)]


@pytest.mark.parametrize("split,seed,index,kind", NEAR)
def test_a_near_miss_fix_that_is_wrong_fails_a_hidden_case(split, seed, index, kind):
    t = repos.make_repo_task(split, seed, index, kind)
    ref, xs = {**t.files, **t.fixed}, fresh(t)
    want = repos.outputs_of(ref, t.module, t.entry_point, xs)
    for path, f in t.targets:
        src = search.definition(ref[path], f)
        head, body = src.split("\n", 1)
        for v in one_token_variants(body):
            files = {**ref, path: env.replace_function(ref[path], head + "\n" + v, path)[0]}
            if passes(outputs(t, files), t.outputs):       # then it is right on the world's inputs too
                got = repos.outputs_of(files, t.module, t.entry_point, xs)
                assert all(repos.same(g, o) or isinstance(o, Exception) for g, o in zip(got, want)), (t.task_id, v)


def first_args(t, files, path, f):
    """The arguments f receives first on each hidden input (its def replaced by one raising them)."""
    params = re.search(rf"^def {f}\((.*)\):$", files[path], re.M).group(1)
    body = f"def {f}({params}):\n    raise LookupError(({params},))\n"
    got = outputs(t, {**files, path: env.replace_function(files[path], body, path)[0]})
    return [repr(g.args[0]) if type(g) is LookupError else None for g in got]


@pytest.mark.parametrize("split,seed,index,kind", TABLE)
def test_no_table_of_the_visible_calls_passes(split, seed, index, kind):
    """A function to fix answering the values it receives on the visible calls from a table (the reference's
    answers there), its broken body elsewhere; and the buggy entry point's visible outputs remapped to the
    expected ones: neither passes the hidden tests."""
    t = repos.make_repo_task(split, seed, index, kind)
    ref, n = {**t.files, **t.fixed}, len(repos.visible_cases(t))
    for path, f in t.targets:
        args = first_args(t, ref, path, f)
        table = {a: o for a, o in zip(args[:n], repos.outputs_of(ref, path[:-3], f, [ast.literal_eval(a) for a in args[:n]]))}
        params = re.search(rf"^def {f}\((.*)\):$", ref[path], re.M).group(1)
        buggy = search.definition(t.files[path], f).replace(f"def {f}(", f"def _{f}_broken(", 1)
        body = (f"def {f}({params}):\n    k = repr(({params},))\n    return {table!r}[k] if k in {table!r} else "
                f"_{f}_broken({params})\n")
        files = {**t.files, path: env.replace_function(t.files[path], body, path)[0] + "\n\n" + buggy}
        assert not passes(outputs(t, files), t.outputs), (t.task_id, f)
    remap = {repr(g): o for g, (_, o) in zip(outputs(t, t.files), repos.visible_cases(t))}
    assert not passes([remap.get(repr(g), g) for g in outputs(t, t.files)], t.outputs), t.task_id
