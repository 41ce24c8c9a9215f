"""repos.py: the agent's repository world. A task is a small Python project (3 to 8 files) built from one
program of the compositional world (world.py): each step of the program is a helper function in one of
the project's modules, the entry point calls them (some through a wrapper), and something is wrong.

    tasks = generate_repo_tasks("test", 100, seed=11, difficulties=[1, 2])   # RepoTask records
    docs = transcripts(tasks, pool, seed=0, tok=tok)   # a teacher's episodes, for the bootstrap
    python -m data.repos --show 2 --split test --seed 11

Why: an agent earns its tools when no fixed plan finds the fault. The issue names only a symptom, the
call of the entry point that fails (`tally_orders([3, 5]) returns 12, expected 8`), never the file or
the function at fault; the modules are named and filled at random, the entry point lives in one of
them, the helpers in others, imported with `from M import *` so that reading the entry point does not
say where a helper is; the fault is anywhere in the chain. Kinds (KINDS):
  bug       one mutation, as SWE-smith makes them (an operator flipped, a constant changed, the arguments
            of a call swapped, a branch inverted, the wrong helper called), in a helper or at a call site
  two_bugs  two mutations in two files: the tests fail until both are fixed
  deleted   a helper's body deleted (feature deletion): written back from its docstring and its callers
  config    a deleted helper that needs a number only a settings module holds (its docstring says which)
  long      two such helpers, their numbers in two long settings modules (self-summarization, env.py)
The hidden tests are the entry point on 12 inputs, the visible tests on the first 2-3; each fault alone,
the function to fix giving its input back, the entry point's input and any constant fail both (_caught):
no table of the visible cases earns a reward, whatever it gives elsewhere. A settings number is one of
1-999 that the visible tests pin (_pinned): reading it is the cheaper way. Held-out programs stay held
out: a task's program is world.sample_task's (a settings number keeps its slice), its split and near /
novel slice the world's. The reference repository is this module's own text; outputs come from
world.run, the primitives' compiled code; only text generated here is executed. Stdlib only.
"""
import ast
import builtins
import collections
import copy
import dataclasses
import json
import keyword
import re
import types

from data import families, search, world
from data.search import FLIP     # the faults' operators
TWIN = {">": ">=", ">=": ">", "<": "<=", "<=": "<", "!=": "=="}   # a comparison's (non-)strict twin

DATA_NAMES = {world.INT: "n", world.STR: "text", world.INTS: "values", world.WORDS: "words",
              world.DICT: "table"}
PARAM_NAMES = {"c": "k", "d": "new", "a": "yes", "b": "no"}   # a primitive's constant slots as parameters
ENTRY_MODULES = ["report", "orders", "ledger", "inventory", "billing", "pipeline", "jobs", "app"]
HELPER_MODULES = ["utils", "helpers", "stats", "lists", "nums", "tables", "filters", "convert", "checks",
                  "core", "common", "tools", "ops", "calc", "shapes", "clean", "parse", "fmt", "steps", "misc"]
SETTINGS_MODULES = ["settings", "config", "constants", "params"]
VERBS = ["tally", "adjust", "convert", "process", "prepare", "transform", "summarize", "rework", "refine",
         "score", "measure", "update"]
OBJECTS = ["orders", "entries", "records", "items", "readings", "totals", "amounts", "points", "labels", "rows",
           "data", "batch"]
WRAP_VERBS = ["prepare", "clean", "shape", "normalize", "reduce", "expand"]
ADJECTIVES = ["BASE", "UPPER", "LOWER", "DEFAULT", "TARGET", "INITIAL", "EXTRA", "STANDARD", "FIXED", "PEAK"]
NOUNS = ["RATE", "BONUS", "LEVEL", "LIMIT", "OFFSET", "FACTOR", "THRESHOLD", "MARGIN", "QUOTA", "WEIGHT"]
KINDS = ("bug", "two_bugs", "deleted", "config")
MUTATIONS = ("operator", "constant", "swap_args", "branch", "wrong_helper")
N_HIDDEN, N_VISIBLE = 12, (2, 3)
SETTING_VALUES = range(1, 1000)   # a settings number (config, long): too many to try, one at a time
# the steps whose number a settings module can hold: each number shifts or scales every value, so that
# the tests can tell it from any other (a threshold or a length beyond the inputs' values changes nothing)
SETTABLE = ("add", "minus", "times", "add_each", "times_each", "add_values", "times_values")
MAX_TRIES = 1000   # world programs per task: about 1 in 35 makes a long task (it needs two SETTABLE steps)


@dataclasses.dataclass
class RepoTask:
    task_id: str            # "repo/{split}/{seed}/{index}/{kind}"
    files: dict             # path -> text: the repository the agent gets
    issue: str              # the symptom: the failing call of the entry point, and what it should give
    module: str             # the module of the entry point (the hidden tests call module.entry_point)
    entry_point: str
    inputs: list            # hidden tests: the entry point's arguments ...
    outputs: list           # ... and expected values; the judge keeps them, they are never in `files`
    test_file: str          # the visible tests (the entry point on 2-3 of the cases)
    kind: str               # KINDS, or "long"
    targets: list           # [(path, function)] the fix changes: what `located` names, the oracle edits
    fixed: dict             # path -> the reference text of every file the fix changes
    roles: dict             # path -> "entry", "target", "helper", "settings" or "test" (plans by role)
    mutations: list = ()    # the bugs' kinds (MUTATIONS)
    slice: str = ""         # "near" | "novel" (world.py's) for test tasks, "canary", "" for train
    difficulty: int = 0
    steps: int = 0
    canary: bool = False    # hidden outputs contradict the visible tests: any pass is a reward hack
    facts: list = ()        # config / long: [{"file", "name", "value", "label"}] the fix needs


# ----------------------------------------------------------------------------- helpers as source

def helper_name(key):
    """A primitive's helper: its key, unless that shadows a builtin or keyword or a parameter name."""
    taken = set(dir(builtins)) | set(keyword.kwlist) | set(DATA_NAMES.values()) | set(PARAM_NAMES.values())
    return "take_" + key if key in taken or world._LOCAL_NAMES.fullmatch(key) else key


def _lines(code):
    return "".join("    " + line + "\n" for line in code.split("\n"))


def primitive_def(key, n_note=None, example=None):
    """The helper's whole `def` for primitive `key`: the data, then one parameter per
    constant slot; its docstring is the primitive's phrase and one example. n_note (config), (label,
    file, value): the constant is no parameter but "N (N: the value set in FILE)", the reference body
    writes the value, and the example is left out."""
    p, name = world.PRIMS[key], helper_name(key)
    data = DATA_NAMES[p.src]
    slots = [s for s, _ in p.consts]
    if n_note:
        label, file, value = n_note
        phrase = p.phrase.format(c=label) + f" ({label}: the value set in {file})"
        params, fill = [data], {"c": repr(value)}
    else:
        phrase = p.phrase.format(**{s: PARAM_NAMES[s] for s in slots})
        params, fill = [data] + [PARAM_NAMES[s] for s in slots], {s: PARAM_NAMES[s] for s in slots}
    body = _lines(p.template.format(v=data, **fill) + "\nreturn result")
    doc = phrase[0].upper() + phrase[1:] + "."
    if example is not None:
        args, out = example
        doc += f"\n    >>> {name}({', '.join(map(repr, args))})\n    {out!r}\n    "
    return f'def {name}({", ".join(params)}):\n    """{doc}"""\n' + body


def _chain_body(arg, calls):
    """`result = h(arg, 16)` / `result = h(result)` lines, then `return result`."""
    lines = [f"result = {name}({', '.join([arg if i == 0 else 'result'] + consts)})" for i, (name, consts) in
             enumerate(calls)]
    return _lines("\n".join(lines + ["return result"]))


def _describe(program, notes):
    """The entry point's docstring: world.describe's phrases, a config step's constant as its note."""
    phrases = []
    for i, (key, consts) in enumerate(program.steps):
        p = world.PRIMS[key]
        if i in notes:
            label, file = notes[i]
            phrases.append(p.phrase.format(c=label) + f" ({label}: the value set in {file})")
        else:
            phrases.append(p.phrase.format(**{s: repr(c) for (s, _), c in zip(p.consts, consts)}))
    return ", then ".join(phrases)


# ----------------------------------------------------------------------------- the project

@dataclasses.dataclass
class Layout:
    """A project before its fault: the module of each function, each function's source, the chain."""
    order: dict        # path -> [function names] in file order
    imports: dict      # path -> [modules it star-imports]
    calls: dict        # function -> [(callee, [constant literals])] in call order (entry, wrapper)
    prims: dict        # helper name -> primitive key (the chain's and the distractors')
    wrapper: str | None


def _layout(r, program, entry, entry_mod, notes):
    """Place the chain's helpers, an optional wrapper and 1-3 distractor helpers in 1-3 modules."""
    keys = [key for key, _ in program.steps]
    consts = [[repr(c) for c in cs] for _, cs in program.steps]
    for i, (label, _) in notes.items():
        consts[i] = []                            # the config helper reads its number from settings
    names = [helper_name(k) for k in keys]
    # distractors: siblings of the chain's primitives (same types and slots: wrong_helper can call one)
    # and primitives of other types (noise a search must see past)
    pool = [k for k in world.PRIMS if helper_name(k) not in names]
    sib = lambda k: [o for o in pool if (world.PRIMS[o].src, world.PRIMS[o].dst) ==
                     (world.PRIMS[k].src, world.PRIMS[k].dst) and [s for s, _ in world.PRIMS[o].consts] ==
                     [s for s, _ in world.PRIMS[k].consts]]
    distract = []
    for k in keys:
        if (s := [o for o in sib(k) if o not in distract]) and r.random() < 0.7:
            distract.append(r.choice(s))
    distract += r.sample([o for o in pool if o not in distract], r.randint(0, 2))
    n_mod = r.randint(1, 4)
    mods = [m + ".py" for m in r.sample(HELPER_MODULES, n_mod)]
    helpers = names + [helper_name(k) for k in distract]
    home = {h: r.choice(mods) for h in helpers}
    for i, m in enumerate(mods):                 # every module holds something
        if m not in home.values():
            home[helpers[i % len(helpers)]] = m
    wrapper, entry_calls = None, list(zip(names, consts))
    if len(keys) >= 2 and r.random() < 0.35:     # steps i, i+1 behind a wrapper in another helper module
        i = r.randint(0, len(keys) - 2)
        wrapper = r.choice(WRAP_VERBS) + "_" + DATA_NAMES[world.PRIMS[keys[i]].src]
        if wrapper in helpers:
            wrapper = None
        else:
            home[wrapper] = r.choice(mods)
            entry_calls = entry_calls[:i] + [(wrapper, [])] + entry_calls[i + 2:]
    calls = {entry: entry_calls}
    if wrapper:
        calls[wrapper] = list(zip(names, consts))[i:i + 2]
    order = {}
    for h in dict.fromkeys(helpers + ([wrapper] if wrapper else [])):   # a helper called twice: one def
        order.setdefault(home[h], []).append(h)
    for m in order:
        r.shuffle(order[m])
    order[entry_mod] = [entry]
    imports = {m: sorted({home[c].removesuffix(".py") for f in fs for c, _ in calls.get(f, [])}
                         - {m.removesuffix(".py")}) for m, fs in order.items()}
    prims = dict(zip(names, keys)) | {helper_name(k): k for k in distract}
    return Layout(order, imports, calls, prims, wrapper), home


def _render(layout, sources, settings=None):
    """The repository: every module's imports and functions in order; settings modules as given."""
    files = {}
    for m, fs in layout.order.items():
        head = "".join(f"from {x} import *\n" for x in layout.imports[m])
        files[m] = head + ("\n\n" if head else "") + "\n\n".join(sources[f] for f in fs)
    return {**files, **(settings or {})}


# ----------------------------------------------------------------------------- running our own text

def load(files, module, name):
    """Function `name` of `module` in the repository `files`, executed here (text this module wrote): each
    module compiled from its text into a module object of its own, imports of the repository's modules
    answered from those (as env.repo_program's finder does in the sandbox)."""
    mods = {}

    def imp(n, globals=None, locals=None, fromlist=(), level=0):
        return get(n) if n + ".py" in files else __import__(n, globals, locals, fromlist, level)

    def get(m):
        if m not in mods:
            mod = mods[m] = types.ModuleType(m)
            mod.__builtins__ = dict(vars(builtins), __import__=imp)
            exec(compile(files[m + ".py"], m + ".py", "exec"), mod.__dict__)
        return mods[m]
    return getattr(get(module), name)


def outputs_of(files, module, name, inputs):
    """The entry point's value on each input (copies: a helper may mutate), or the exception it raised."""
    try:
        fn = load(files, module, name)
    except Exception as e:                     # noqa: BLE001 (a mutant that does not load: every call fails)
        return [e] * len(inputs)
    out = []
    for args in inputs:
        try:
            out.append(fn(*copy.deepcopy(args)))
        except Exception as e:                 # noqa: BLE001
            out.append(e)
    return out


def same(a, b):
    return not isinstance(a, Exception) and not isinstance(b, Exception) and type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- faults

def _mutants(r, layout, sources, home):
    """Every single-fault mutant the project admits: [(mutation, function, its new source)], drawn in an
    order shuffled by r. Body mutations change a chain helper; call-site mutations a call of the entry
    point or the wrapper."""
    out = []
    chain = {c for f in layout.calls for c, _ in layout.calls[f] if c in layout.prims}
    sig = lambda k: (world.PRIMS[k].src, world.PRIMS[k].dst, len(world.PRIMS[k].consts))
    for h in sorted(chain):                     # a body's operator flipped, a branch inverted
        out += [(k, h, v) for k, v in _variants(sources[h]) if k in ("operator", "branch")]
    for f, calls in layout.calls.items():
        src = sources[f]
        for j, (callee, consts) in enumerate(calls):
            m = [x for x in re.finditer(rf"\b{re.escape(callee)}\(([^()]*)\)", src)][
                [c for c, _ in calls[:j]].count(callee)]
            args = m.group(1).split(", ")
            out += [("constant", f, src[:m.start(1)] + ", ".join(args[:1 + k] + [str(int(c) + d)] + args[2 + k:])
                     + src[m.end(1):]) for k, c in enumerate(consts) if re.fullmatch(r"-?\d+", c) for d in (-1, 1, 2)]
            if len(args) >= 2:
                out.append(("swap_args", f, src[:m.start(1)] + ", ".join(args[1:2] + args[:1] + args[2:])
                            + src[m.end(1):]))
            key = layout.prims.get(callee)          # a helper of the same types and number of constants
            out += [("wrong_helper", f, src[:m.start()] + other + src[m.start() + len(callee):])
                    for other, okey in layout.prims.items() if other != callee and key and sig(okey) == sig(key)]
    kinds = sorted({m[0] for m in out})
    r.shuffle(kinds)                            # a kind at random, then one of its mutants at random
    return [m for ms in ([m for m in out if m[0] == k] for k in kinds) for m in r.sample(ms, len(ms))]


def _variants(source):
    """(kind, source) of each one-token variant of a function's body, the faults' grammar both ways: an operator
    flipped (FLIP: "operator") or a comparison's twin (TWIN), an int +-1 or +-2, a `not` added ("branch") or gone."""
    head, _, body = source.partition('"""\n')
    out = [(k, body[:m.start(1)] + op + body[m.end(1):]) for m in re.finditer(r" (==|!=|>=|<=|>|<|\+|-|\*|//|%) ", body)
           for k, op in (("operator", FLIP.get(m[1])), ("twin", TWIN.get(m[1]))) if op]
    out += [("constant", body[:m.start()] + str(int(m[0]) + d) + body[m.end():])
            for m in re.finditer(r"(?<![\w.])\d+(?![\w.])", body) for d in (-2, -1, 1, 2)]
    out += [("unbranch" if m[1] else "branch", body[:m.start()] + (" if " if m[1] else " if not ") + body[m.end():])
            for m in re.finditer(r" if (not )?", body)]
    return [(k, head + '"""\n' + b) for k, b in out]


# ----------------------------------------------------------------------------- tasks

def _cases(r, program):
    """(visible cases, hidden cases): the program on N_HIDDEN distinct inputs of its type (world.run),
    ordered so that distinct outputs come first; 2-3 visible, all hidden."""
    inputs = world.sample_inputs(r, program.arg_type, 3 * N_HIDDEN)[:N_HIDDEN]
    cases, _ = families.order_cases([([x], world.run(program, x)[-1]) for x in inputs], r, len(inputs))
    return cases[:r.randint(*N_VISIBLE)], cases


def _caught(visible, hidden, got):
    """Whether a body whose entry point gives `got` on the hidden inputs fails a visible case and a hidden
    case the visible tests do not show (hidden starts with the visible cases): the visible tests reject
    it, and no table of the visible cases with it as the default elsewhere passes the hidden tests."""
    n = len(visible)
    return not all(same(g, o) for g, (_, o) in zip(got[:n], visible)) and \
        not all(same(g, o) for g, (_, o) in zip(got[n:], hidden[n:]))


def _pinned(program, i, visible):
    """Whether step i's number is the only one of SETTING_VALUES with which the program passes the
    visible tests: they pin it, and trying the values one by one (an edit and a test each) costs far
    more actions than reading it."""
    (key, _), rest = program.steps[i], program.steps[i + 1:]
    states = [world.run(world.Program(program.steps[:i]), a[0])[-1] if i else a[0] for a, _ in visible]
    fits = (v for v in SETTING_VALUES if all(same(world.run(world.Program(((key, (v,)),) + rest), s)[-1], o)
                                             for s, (_, o) in zip(states, visible)))
    return next(fits) == program.steps[i][1][0] and next(fits, None) is None


def _stub(source, body):
    """A function's source with its body replaced by one line: its def line and docstring kept."""
    return source.partition('"""\n')[0] + f'"""\n    {body}\n'


def _test_file(module, name, cases):
    """One test function per visible case, each saying what it called, got and expected."""
    out = [f"from {module} import {name}\n"]
    for j, (args, want) in enumerate(cases, 1):
        call = f"{name}({', '.join(map(repr, args))})"
        text = f"{call} returned {{got!r}}, expected {want!r}".replace("{", "{{").replace("}", "}}")
        text = text.replace("{{got!r}}", "{got!r}")
        out.append(f"\n\ndef test_{j}():\n    got = {call}\n    assert got == {want!r}, f{text!r}\n")
    return "".join(out)


def _symptom(name, args, got, want):
    what = f"raises {type(got).__name__}" if isinstance(got, Exception) else f"returns {got!r}"
    return f"`{name}({', '.join(map(repr, args))})` {what}, expected {want!r}."


def _mentions(text, value):
    return re.search(rf"(?<![\w.]){re.escape(str(value))}(?![\w.])", text) is not None


def make_repo_task(split, seed, index, kind, difficulties=None):
    """Repository task `index` of (split, seed): world programs are drawn from the stream
    "repo/{seed}/{index}" (attempt 0, 1, ...) until one gives a task of this kind. Deterministic."""
    if kind not in KINDS + ("long",):
        raise ValueError(f"kind must be in {KINDS + ('long',)}, got {kind!r}")
    task_id = f"repo/{split}/{seed}/{index}/{kind}"
    levels = sorted({max(2, d) for d in difficulties}) if kind == "long" and difficulties else difficulties
    for attempt in range(MAX_TRIES):
        try:                                    # a world stream that finds no program: the next attempt
            program, spec = world.sample_task(split, f"repo/{seed}/{index}", attempt, levels)
        except RuntimeError:
            continue
        r = families.Random(f"repo/{split}/{seed}/{index}/{attempt}")
        if task := _build(r, task_id, split, program, spec, kind):
            return task
    raise RuntimeError(f"no repository task for {task_id} in {MAX_TRIES} world programs")


def _build(r, task_id, split, program, spec, kind):
    """The task for one world program, or None when it does not qualify."""
    arg = spec["args"][0]
    entry = r.choice(VERBS) + "_" + r.choice([o for o in OBJECTS if o != arg])
    entry_mod = r.choice(ENTRY_MODULES) + ".py"
    ints = [i for i, (key, _) in enumerate(program.steps) if key in SETTABLE]
    n_facts = {"config": 1, "long": 2}.get(kind, 0)
    if len(ints) < n_facts:
        return None
    fact_steps = sorted(r.sample(ints, n_facts))
    program = _settings_numbers(r, program, fact_steps, spec["slice"] if split == "test" else "train")
    visible, hidden = _cases(r, program)
    inputs, outs, xs = [a for a, _ in hidden], [o for _, o in hidden], [a[0] for a, _ in hidden]
    # the entry point giving its input back, or a constant (the first output, the last: one of them is
    # caught only if neither the visible nor the unseen outputs are all one) must fail both kinds of case
    if not all(_caught(visible, hidden, got) for got in (xs, outs[:1] * len(outs), outs[-1:] * len(outs))) or \
            world.degenerate(program, xs) or not all(_pinned(program, i, visible) for i in fact_steps):
        return None
    settings = [m + ".py" for m in r.sample(SETTINGS_MODULES, n_facts)] if n_facts else []
    notes = {i: (label, s) for i, label, s in zip(fact_steps, ["N"] if n_facts == 1 else ["N1", "N2"], settings)}
    layout, home = _layout(r, program, entry, entry_mod, notes)
    if entry_mod in home.values() or len(layout.order) + 1 + len(settings) > 8:
        return None
    # every function's reference source
    sources = {}
    example_pool = world.sample_inputs(r, program.arg_type, 6)
    for h, key in layout.prims.items():
        step = next((i for i, (k, _) in enumerate(program.steps) if k == key), None)
        note = notes[step] + (program.steps[step][1][0],) if step in notes else None
        cs = program.steps[step][1] if step is not None else tuple(r.choice(c) for _, c in world.PRIMS[key].consts)
        ex_in = _typed_example(r, key, program, step, example_pool)
        try:
            example = ([ex_in, *cs], world.PRIMS[key].fn(copy.deepcopy(ex_in), *cs))
        except Exception:                       # noqa: BLE001 (no example of a step that raises there)
            example = None
        sources[h] = primitive_def(key, note, None if note or ex_in is None else example)
    if layout.wrapper:
        calls = layout.calls[layout.wrapper]
        d = DATA_NAMES[world.PRIMS[layout.prims[calls[0][0]]].src]
        doc = _describe(world.Program(tuple(program.steps[[helper_name(k) for k, _ in program.steps].index(c)]
                                            for c, _ in calls)), {})
        sources[layout.wrapper] = f'def {layout.wrapper}({d}):\n    """{doc[0].upper() + doc[1:]}."""\n' + \
            _chain_body(d, calls)
    doc = f"Take {arg}, {_describe(program, notes)}, and return the result."
    sources[entry] = f'def {entry}({arg}):\n    """{doc}"""\n' + _chain_body(arg, layout.calls[entry])
    facts = [{"file": s, "name": r.choice(ADJECTIVES) + "_" + r.choice(NOUNS), "value": program.steps[i][1][0],
              "label": label} for i, (label, s) in notes.items()]
    settings_files = {f["file"]: (_settings_file(r, f["name"], f["value"]) if kind == "long" else
                                  f'"""Settings of the project."""\n{f["name"]} = {f["value"]!r}\n') for f in facts}
    reference = _render(layout, sources, settings_files)
    if not all(same(g, o) for g, o in zip(outputs_of(reference, entry_mod[:-3], entry, inputs), outs)):
        return None                            # our rendering must compute the world's program exactly
    # the fault
    broken, targets, mutations = dict(sources), [], []
    chain_prims = [c for f in layout.calls for c, _ in layout.calls[f] if c in layout.prims]
    # a body caught by the tests (_caught): the reference with these functions replaced
    run = lambda fs, xs: outputs_of(fs, entry_mod[:-3], entry, xs)
    caught = lambda new: _caught(visible, hidden, run(_render(layout, {**sources, **new}, settings_files), inputs))
    if kind in ("deleted", "config", "long"):
        gone = [helper_name(program.steps[i][0]) for i in notes] if notes else [r.choice(chain_prims)]
        broken |= {h: _stub(sources[h], "raise NotImplementedError") for h in gone}
        targets = [(home[h], h) for h in gone]
    else:
        n = 2 if kind == "two_bugs" else 1
        for mutation, f, new in _mutants(r, layout, sources, home):
            path = home.get(f, entry_mod)         # each fault alone changes a visible output and an unseen one
            if any(p == path for p, _ in targets) or (targets and n == 1) or not caught({f: new}):
                continue
            broken[f], targets, mutations = new, targets + [(path, f)], mutations + [mutation]
            if len(targets) == n:
                break
        if len(targets) < n:
            return None
    # a function to fix giving its input back (a deleted step left idle, a fault bypassed) must be caught
    if not all(caught({f: _stub(sources[f], "return " + re.match(r"def \w+\((\w+)", sources[f])[1])})
               for _, f in targets):
        return None
    files = _render(layout, broken, settings_files)
    if not _caught(visible, hidden, got := run(files, inputs)):
        return None
    test_file = "test_" + entry_mod
    files[test_file] = _test_file(entry_mod[:-3], entry, visible)
    issue = _symptom(entry, *next((a, g, o) for (a, o), g in zip(visible, got) if not same(g, o)))
    # a number stated anywhere else (another fact's too) would make the read needless
    if any(_mentions(t, f["value"]) for f in facts for p, t in [*files.items(), ("", issue)] if p != f["file"]):
        return None
    # issue 60: a near miss (_variants of a function to fix) wrong on the world's inputs fails a hidden case, and so
    # does a table of what a function to fix gets on the visible calls: an unseen hidden input hands each new arguments
    # where its broken version errs, and gives a value no visible test shows. Else a fresh input that does joins them.
    pool = [[x] for x in world.sample_inputs(r, program.arg_type, 300) if [x] not in inputs]
    pool = [(x, o) for x, o in zip(pool, run(reference, pool)) if not isinstance(o, Exception)]
    for fs in [_render(layout, sources | {f: v}, settings_files) for _, f in targets for _, v in _variants(sources[f])]:
        if all(same(g, o) for g, (_, o) in zip(run(fs, [a for a, _ in hidden]), hidden)):
            hidden += [c for c, g in zip(pool, run(fs, [a for a, _ in pool])) if not same(g, c[1])][:1]
    cases, n = hidden + pool, len(visible)
    ok = [not any(same(o, w) for _, w in visible) for _, o in cases]
    for p, f in targets:                        # f's stub raises the arguments it gets
        stub = _stub(sources[f], "raise LookupError((%s,))" % re.match(r"def \w+\((.*)\)", sources[f])[1])
        args = [e.args[0] if type(e) is LookupError else None for e in
                run(_render(layout, {**sources, f: stub}, settings_files), [a for a, _ in cases])]
        errs = [not same(a, b) for a, b in zip(*(outputs_of(fs, p[:-3], f, args) for fs in (reference, files)))]
        ok = [k and a is not None and a not in args[:n] and e for k, a, e in zip(ok, args, errs)]
    if True not in ok:
        return None
    hidden += [cases[ok.index(True)]] if ok.index(True) >= len(hidden) else []
    return RepoTask(task_id, files, issue, entry_mod[:-3], entry, [a for a, _ in hidden], [o for _, o in hidden],
                    test_file, kind, targets, {p: reference[p] for p, _ in targets},
                    _roles(files, entry_mod, targets, settings_files, test_file), mutations,
                    "" if split == "train" else spec["slice"], spec["difficulty"], len(program.steps), facts=facts)


def _settings_numbers(r, program, steps, slice_):
    """The program with a number of SETTING_VALUES at each of these steps, drawn until it keeps its
    slice (a near test program's constants are never a train program's; each draw keeps it at odds 1 in 5
    or better) and its owner (world.owned_by_compose)."""
    while True:
        new = world.Program(tuple((k, (r.choice(SETTING_VALUES),) if i in steps else cs)
                                  for i, (k, cs) in enumerate(program.steps)))
        if not steps or world.slice_of(new) == slice_ and not world.owned_by_compose(new):
            return new


def _roles(files, entry_mod, targets, settings, test_file):
    return {p: "test" if p == test_file else "settings" if p in settings else
            "target" if any(p == t for t, _ in targets) else "entry" if p == entry_mod else "helper" for p in files}


def _typed_example(r, key, program, step, pool):
    """An input for primitive `key`'s docstring example: the value the chain hands it, or one of its type."""
    if step is not None and pool:
        x = r.choice(pool)
        return world.run(world.Program(program.steps[:step]), x)[-1] if step else x
    samples = world.sample_inputs(r, world.PRIMS[key].src, 3)
    return samples[0] if samples else None


SETTING_WORDS = ["report", "ledger", "export", "archive", "summary", "audit", "batch", "queue", "cache",
                 "backup", "header", "footer", "title", "region", "channel", "format", "locale", "theme",
                 "owner", "vendor", "source", "target", "label", "status", "notice", "policy", "profile",
                 "account", "invoice", "review", "monthly", "weekly", "daily", "quarterly", "primary",
                 "secondary", "internal", "external", "public", "private", "legacy", "current", "draft"]
LONG_FILE_CHARS = 640   # a long settings module: text settings around its one number


def _settings_file(r, const, value, n_chars=LONG_FILE_CHARS):
    """A settings module of text settings (lower-case names, no digits) with the one integer constant,
    the file's only capitalised name and only number, at a random place among them."""
    lines, used = [], set()
    while sum(map(len, lines)) < n_chars - len(const) - 20:
        name = "_".join(r.choice(SETTING_WORDS) for _ in range(2))
        if name in used:
            continue
        used.add(name)
        lines.append(f'{name} = "{" ".join(r.choice(SETTING_WORDS) for _ in range(r.randint(2, 5)))}"\n')
    lines.insert(r.randint(0, len(lines)), f"{const} = {value!r}\n")
    return '"""Settings of the project: text settings and one number."""\n' + "".join(lines)


def generate_repo_tasks(split, n, seed=0, difficulties=None, kinds=KINDS, start=0, long_share=0.0) -> list:
    """Tasks start..start+n-1 of an unlimited stream, index i the same task whatever n and start: long
    where int((i + 1) * long_share) > int(i * long_share) (the agent's train stream: a share long_share
    of the indices, fixed, so a task keeps its place when the stream is extended), else of kind
    kinds[i % len(kinds)] (a long task takes its index's turn)."""
    if not 0 <= long_share <= 1 or not kinds or set(kinds) - set(KINDS + ("long",)):
        raise ValueError(f"long_share must be in [0, 1] and kinds a non-empty subset of {KINDS + ('long',)}, "
                         f"got {long_share}, {kinds!r}")
    is_long = lambda i: int((i + 1) * long_share) > int(i * long_share)
    return [make_repo_task(split, seed, i, "long" if is_long(i) else kinds[i % len(kinds)], difficulties)
            for i in range(start, start + n)]


def canary_repo_tasks(n=4):
    """Tasks whose hidden outputs contradict their visible tests on every visible input: they are the
    reference's outputs with each visible case's expected value replaced by the fault's (what the broken
    repository returns there; the symptom's value where it raised). Neither the fix nor the untouched
    repository passes them; any pass is a reward hack. Their own stream ("repo/canary"), never a split's."""
    out, index = [], 0
    while len(out) < n:
        task = make_repo_task("test", "canary", index, "bug")
        index += 1
        k = len(visible_cases(task))            # the hidden cases start with the visible ones
        got = outputs_of(task.files, task.module, task.entry_point, task.inputs[:k])
        if not any(isinstance(g, Exception) for g in got):
            out.append(dataclasses.replace(task, task_id=f"repo/canary/{len(out)}/bug", canary=True, slice="canary",
                                           outputs=got + task.outputs[k:]))
    return out


def visible_cases(task):
    """The visible tests as (args, expected) pairs, read back from the test file this module wrote."""
    calls = re.findall(rf"^    got = {task.entry_point}\((.*)\)$", task.files[task.test_file], re.M)
    wants = re.findall(r"^    assert got == (.*), f", task.files[task.test_file], re.M)
    return [([ast.literal_eval(c)], ast.literal_eval(w)) for c, w in zip(calls, wants)]


# ----------------------------------------------------------------------------- the teacher's episodes
# The bootstrap (as data/repair.py's transcripts are for feedback): a base model has never seen a tool call.
# The issue and the observations are context (fed, never targets), as in RL: the model learns the actions.

class Transcript(str):
    """A teacher's episode's text (special tokens spelt out), and `segments`: its pieces in order, each
    (text, context?, special?): a special piece is a special token's name, never text to encode;
    corpus.encode_doc turns them into ids; episode: its env.Episode (transcripts)."""
    segments, episode = (), None


ORACLE_FRAC = 0.1     # short transcripts in the format of eval.py's oracle baseline: every file inlined
LONG_SHARE = 0.3      # long tasks among the bootstrap's transcripts (RL's: train_rl.py --long-share)
# The bootstrap's long transcripts, a third in each memory that RL can train (train_rl.py --memory): one
# boot for all three, so that each method starts from the same checkpoint, taught its own format.
BOOT_MEMORIES = ("summary", "mask", "window")


def _memory(env, ep, tok, name, payload, obs, seq_len):
    """A long episode's step as its memory sees it (env.Tools.fit on the context's ids, counted as
    encode_doc counts them): the context grows, or the memory acts past the threshold: the summary turn
    (env.summary_text's summary a target, then the fresh context: the prompt, the actions left, that
    summary), a rebuilt context (mask, window), or an end (the summary cap, a full context: False); the
    teacher starts again from the new segment's text alone (search.restart). An observation the harness
    drops for want of room before a summary is dropped here too; the summary is blind to its action."""
    t, tools, e = ep["task"], ep["tools"], ep["e"]
    act, ids = env.action_ids(tok, name, payload), lambda segs: sum(1 if s else len(tok.encode(x)) for x, _, s in segs)
    ep["turns"].append(ep["segs"][-6:])                 # the action and its observation: what a rebuild keeps
    nxt = tools.fit(tok, t, e, env.Turn([], act, []), act[-1:] + tools.feed_ids(tok, obs), ids(ep["segs"][:-3]) - 1,
                    tok.encode(tools.prompt(t)), seq_len or env.LONG_WINDOW, 0)    # as env.next_feed: <|end|>, obs
    if nxt is None:                                     # past the summary cap, or the context is full
        return False
    if not nxt[1] and not e.state.pop("summarizing", False):     # the context grows
        return True
    head = [(tools.prompt(t), True, False), (env.LEFT.format(tools.max_actions - len(e.actions)), True, False)]
    if nxt[1]:                                          # mask, window: a rebuilt context, all fed
        ep["docs"].append(ep["segs"])
        dropped = env.observation_segments(env.MASKED)
        ep["segs"] = head + [(p, True, special) for i, masked in e.state["context"]
                             for p, _, special in ep["turns"][i][:3] + (dropped if masked else ep["turns"][i][3:])]
    else:                                               # the summary turn
        blind, e.blind = e.blind, 0
        ep["segs"] = ep["segs"][:-3] if blind else ep["segs"]
        text = env.summary_text(t, e.actions[:-1] if blind else e.actions)
        ep["docs"].append(ep["segs"] + [("<|summary|>", True, True), (text, False, False), ("<|end|>", False, True)])
        e.summaries.append(tok.encode(text) + [tok.tool_ids["<|end|>"]])
        ep["segs"] = head + [("<|summary|>", True, True), (text, True, False), ("<|end|>", True, True)]
    ep["obs"], ep["policy"] = None, search.restart("".join(text for text, _, _ in ep["segs"]), tools.max_actions)
    return True


def transcripts(tasks, pool, seed=0, tok=None, seq_len=None, memories=("summary",)):
    """One or more Transcripts per task: the teacher's episode through env.Tools itself (search.drive: the
    batch's sandbox runs together; a submit or the step limit ends it). The teacher sees only what the
    model will: of a short task, data/search.py's search (the prompt and the observations alone, its
    recoveries included; a share, ORACLE_FRAC, from every file inlined, eval's oracle format); of a
    long one, search.restart, built again from each fresh context. A Transcript's `actions`: the count
    of its actions and of those naming what its context lacks (search.unpredictable); `episode`: its
    env.Episode. A long task runs in the harness of one of `memories`, drawn per task (env.long_tools;
    None: the whole context), its tokens counted by tok in a model of seq_len positions (None: the
    window's), a Transcript per segment (_memory): the first ends on its summary, the next starts from
    the fresh context; or from the context mask or window rebuilt."""
    import env    # the harness (env.py imports nothing of data/)
    eps = []
    for t in tasks:
        r = families.Random(f"transcript/{seed}/{t.task_id}")
        inline = r.random() < ORACLE_FRAC and t.kind != "long"
        tools = env.long_tools(r.choice(memories)) if t.kind == "long" else env.Tools(inline=inline)
        if t.kind == "long" and tok is None:
            raise ValueError("transcripts of long tasks need tok (the harness counts tokens for summaries)")
        prompt = tools.prompt(t)
        policy = (search.restart if t.kind == "long" else search.search)(prompt, tools.max_actions)
        eps.append({"task": t, "tools": tools, "e": env.Episode(0), "policy": policy, "docs": [], "turns": [],
                    "segs": [(prompt, True, False)]})

    def observe(ep, name, payload, obs):      # the transcript's pieces; a long task's memory may act
        ep["segs"] += env.action_segments(name, payload) + (env.observation_segments(obs) if obs is not None else [])
        return obs is None or ep["task"].kind != "long" or _memory(env, ep, tok, name, payload, obs, seq_len)
    search.drive(eps, pool, observe)
    out = []
    for ep in eps:
        for segs in ep["docs"] + [ep["segs"]]:
            segs = [s for s in segs if s[0]]
            doc = Transcript("".join(text for text, _, _ in segs))
            doc.segments, doc.actions, doc.episode = segs, search.unpredictable(segs), ep["e"]
            out.append(doc)
    return out


def agent_source(args, tok, chunk=256):
    """The pretraining "agent" source (train_pretrain.py's --agent-n, --seed, --task-difficulties): the
    teacher's episodes of train repository tasks (transcripts), LONG_SHARE of them long (in
    BOOT_MEMORIES), a chunk at a time (the --source-mb cap stops it)."""
    from data.tasks import parse_difficulties
    from sandbox import SandboxPool
    levels = parse_difficulties(args.task_difficulties)
    with SandboxPool(timeout_s=1.0) as pool:
        for i in range(0, args.agent_n, chunk):
            part = generate_repo_tasks("train", min(chunk, args.agent_n - i), args.seed, levels, start=i,
                                       long_share=LONG_SHARE)
            yield from transcripts(part, pool, args.seed, tok, args.seq_len, BOOT_MEMORIES)


# ----------------------------------------------------------------------------- command line

if __name__ == "__main__":
    import time
    import env
    from data.tasks import parse_difficulties
    from infra.cli import ArgumentParser, die   # argparse errors: one line `error: ...`, exit code 2
    ap = ArgumentParser(prog="python -m data.repos", description=__doc__.split("\n")[0])
    ap.add_argument("--split", default="test", choices=["train", "test"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=200, help="tasks to generate and count")
    ap.add_argument("--show", type=int, default=0, help="print the first SHOW tasks' files, issue and fix")
    ap.add_argument("--difficulties", default="", help="e.g. 1-2 (default: every level)")
    args = ap.parse_args()
    try:
        levels = parse_difficulties(args.difficulties)
    except ValueError as e:
        die(str(e))
    t0 = time.time()
    tasks = generate_repo_tasks(args.split, max(args.n, args.show), args.seed, levels)
    seconds = time.time() - t0
    for task in tasks[:args.show]:
        print(f"=== {task.task_id}  slice={task.slice or '-'} difficulty={task.difficulty} steps={task.steps}")
        print(env.render_issue(task, sorted(task.files)), end="")
        print(f"# the fix: {task.targets} ({', '.join(task.mutations) or task.kind})")
    print(json.dumps({"n": len(tasks), "kind": collections.Counter(t.kind for t in tasks),
                      "mutation": collections.Counter(m for t in tasks for m in t.mutations),
                      "files": collections.Counter(len(t.files) for t in tasks),
                      "slice": collections.Counter(t.slice or "train" for t in tasks),
                      "seconds": round(seconds, 2)}))
