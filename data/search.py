"""search.py: a model-free search on the agent's repository tasks, eval.py --agent's `search` baseline
(issue 62): the agent's tools, step limit, tasks and judge, and only what the agent sees (the issue, then
each tool's answer). It draws nothing: a task gives the same episode every time.

    eps = episodes(tasks, env.Tools(), pool)     # an env.Episode per task, judged by env.hidden_run

The policy greps the failing call's def and reads its module and the modules it imports, while a call
there disagrees with its docstring. Its candidate edits undo the world's faults (data/repos._mutants) at
each site: an operator flipped back, a constant +1, -1 or -2, a call's first two arguments swapped, a
`not` dropped, another helper called. Cues in the text rank them (_candidates); each is tested alone, kept
if more tests pass (or it is cued and passes as many), undone if not. A task of deleted helpers (its
symptom raises NotImplementedError) goes to restart, the long tasks' teacher too.
"""
import builtins
import re

import env
from data import world

FLIP = {">": "<", "<": ">", "==": "!=", "+": "-", "-": "+", "*": "+", "//": "%", "%": "//"}   # repos' mutations
UNFLIP = {}                   # an operator -> the ones a mutation turns into it
for _a, _b in FLIP.items():
    UNFLIP.setdefault(_b, []).append(_a)
# the words of a phrase that name an operator: a cue that the operator is right, or was flipped
OP_WORDS = {">": ("greater", "larger", "largest", "longer", "more than"), "<": ("less", "smaller"),
            "+": ("add", "sum", "append", "count", "total"), "-": ("subtract", "difference"),
            "*": ("multiply", "square", "product", "twice"), "//": ("divide",),
            "%": ("remainder", "divisible", "multiple", "even", "odd", "digit")}


def definition(text, name, drop_doc=True):
    """Function `name`'s whole `def` in a module's text, read line by line (an observation may be cut
    in the middle: no parse), its docstring dropped (what an edit writes); StopIteration if absent."""
    block = next(re.finditer(rf"^def {name}\(.*(?:\n(?:[ \t].*)?)*", text, re.M))[0].split("\n")   # + indented
    if drop_doc and len(block) > 1 and block[1].strip().startswith('"""'):
        one = block[1].strip()
        close = 1 if len(one) > 3 and one.endswith('"""') else \
            next((k for k in range(2, len(block)) if block[k].strip().endswith('"""')), len(block) - 1)
        block = block[:1] + block[close + 1:]
    return "\n".join(block).rstrip("\n") + "\n"


def _parts(src):
    """A def's parameters, its docstring's first line (lower case, no final period), where its body starts."""
    params = re.match(r"def \w+\((.*?)\):", src).group(1).split(", ")
    doc = re.search(r'"""(.*?)(\n|""")', src)
    start = src.find('"""', doc.start(2)) + 3 if doc else src.find("\n") + 1
    return params, doc.group(1).strip().rstrip(".").lower() if doc else "", start


def _template(src, value=None, label=None):
    """The body a deleted helper's docstring names: the template of the primitive whose phrase it is, its
    slots the helper's parameters, or for a config note ("N: the value set in F"; `label`, where a
    summary's line names it in its place), `value` (the number F holds). None: no phrase matches."""
    params, phrase, _ = _parts(src)
    note = re.search(r" \((\w+): the value set in [\w/.]+\)$", phrase)
    label, phrase = (note[1], phrase[:note.start()]) if note else (label, phrase)
    for p in world.PRIMS.values():
        slots = [s for s, _ in p.consts]
        named = {"c": label} if label else dict(zip(slots, params[1:]))
        if (slots == ["c"] if label else len(slots) == len(params) - 1) and p.phrase.format(**named).lower() == phrase:
            code = p.template.format(v=params[0], **({"c": value} if label else named)) + "\nreturn result"
            return "".join("    " + line + "\n" for line in code.split("\n"))


def _calls(src):
    """An entry point's or wrapper's chain calls: (callee, arguments, the callee's span, the arguments')."""
    at = _parts(src)[2]
    return [(m[1], m[2].split(", "), (at + m.start(1), at + m.end(1)), (at + m.start(2), at + m.end(2)))
            for m in re.finditer(r"^    result = (\w+)\((.*)\)$", src[at:], re.M)
            if m[1] not in dir(builtins)]


def _cue(src, defs):
    """How far a caller's calls agree with its docstring: per call, its helper's phrase with the call's
    arguments in its parameters' places is in the docstring; its first argument is a name (the data)."""
    n = 0
    for callee, args, _, _ in _calls(src):
        n += re.fullmatch(r"[a-z_]\w*", args[0]) is not None
        params, phrase, _ = _parts(defs[callee][1]) if callee in defs else ([], "", 0)
        if len(params) == len(args):
            put = dict(zip(params[1:], args[1:]))
            said = re.sub(r"\w+", lambda m: put.get(m[0], m[0]), phrase).lower()
            n += re.search(rf"(?<!\w){re.escape(said)}(?!\w)", src.lower()) is not None    # not 2 in 22
    return n


def _candidates(name, src, defs):
    """(score, span, replacement): each mutation the world makes at a site of this function, undone. The
    score is the cue: 2, a `not` or `!=` (no template has one); +1 or -1, an operator that the phrase names
    or whose replaced one it names; 2 per call that its caller's docstring states once it is made."""
    calls, (_, phrase, at) = _calls(src), _parts(src)
    if not calls:             # a helper: its body's `not`s and operators
        said = lambda op: any(w in phrase for w in OP_WORDS.get(op, ()))
        nots = [(2, (at + m.start(1), at + m.end(1)), "") for m in re.finditer(r" if (not )", src[at:])]
        ops = re.finditer(r" (!=|>|<|\+|-|\*|//|%) ", src[at:])
        return nots + [(2 if m[1] == "!=" else said(op) - said(m[1]), (at + m.start(1), at + m.end(1)), op)
                       for m in ops for op in UNFLIP.get(m[1], ())]
    edits = []
    for callee, args, where, span in calls:
        edits += [(span, ", ".join(args[1::-1] + args[2:]))] if len(args) > 1 else []
        edits += [(span, ", ".join(args[:k] + [str(int(a) + d)] + args[k + 1:]))
                  for k, a in enumerate(args) if k and re.fullmatch(r"-?\d+", a) for d in (1, -1, -2)]
        edits += [(where, g) for g in defs
                  if g not in (callee, name) and len(_parts(defs[g][1])[0]) == len(args)]
    base = _cue(src, defs)
    return [(2 * (_cue(src[:s] + r + src[e:], defs) - base), (s, e), r) for (s, e), r in edits]


def search(prompt, budget=12):
    """The search's episode on the task whose prompt (env.Tools.prompt: the issue and the file names) is
    `prompt`, in at most `budget` actions, submit included: yields (action, payload), is sent each observation."""
    left, seen, defs, kept = budget - 1, {}, {}, {}     # kept: function -> [(span, replacement)] that stay

    def act(name, payload=""):
        nonlocal left
        left -= 1
        return (yield name, payload)

    def know(path, text):
        seen[path] = text
        for f in re.findall(r"^def (\w+)\(.*\):$", text, re.M):   # a def line the cap cut is no def
            defs.setdefault(f, (path, definition(text, f, drop_doc=False)))

    def read(path):
        if path not in seen and left > 2:
            know(path, (yield from act("read", path)))

    inlined = re.split(r"^# file: (\S+)\n", prompt, flags=re.M)     # eval's oracle format: files inlined
    for path, text in zip(inlined[1::2], inlined[2::2]):
        know(path, text)

    def chain(names):         # the functions the entry point calls, through wrappers
        for f in names:
            names += [c for c, *_ in _calls(defs[f][1]) if c not in names] if f in defs else []
        return names

    def edit(f, extra=None):
        src = defs[f][1]
        for (s, e), r in sorted(kept.get(f, []) + ([extra] if extra else []), reverse=True):
            src = src[:s] + r + src[e:]
        yield from act("edit", f"{defs[f][0]}\n{definition(src, f)}")     # short: no docstring to copy

    def test():
        m = re.match(r"(\d+) passed, (\d+) failed", (yield from act("test")))
        return (int(m[1]), m[2] == "0") if m else (-1, False)

    if "raises NotImplementedError" in prompt:        # a deleted helper: the stubs' teacher (restart)
        return (yield from restart(prompt, budget))
    entry = re.search(r"`(\w+)\(", prompt)
    entry = entry[1] if entry else ""
    hits = yield from act("grep", f"def {entry}(")
    queue = list(dict.fromkeys(re.findall(r"^([\w/.]+\.py):\d+: ", hits, re.M)))
    while queue and not all(f in defs and _cue(defs[f][1], defs) == 2 * len(_calls(defs[f][1]))
                            for f in chain([entry])):
        path = queue.pop(0)
        yield from read(path)
        queue += [m + ".py" for m in re.findall(r"^from (\w+) import \*", seen.get(path, ""), re.M)
                  if m + ".py" not in seen and m + ".py" not in queue]
    cands = [(score, f, span, r) for f in dict.fromkeys(chain([entry]) + list(defs)) if f in defs   # the chain
             for score, span, r in _candidates(f, defs[f][1], defs)]           # first, then what a fix may call
    cands.sort(key=lambda c: -c[0])                  # stable: the chain's order within a score
    best, good, dirty = 0, False, None               # good: what is kept passes the visible tests
    # one at a time; once the tests pass, only cued ones (the visible tests may miss a second fault)
    for score, f, (s, e), r in cands:
        if (good and score <= 0) or any(s < e2 and s2 < e for (s2, e2), _ in kept.get(f, [])):
            continue
        undo = dirty is not None and dirty != f
        if left < 2 + undo + good:                   # room to undo it, should it break what passes
            break
        if undo:              # back to what was kept there
            yield from edit(dirty)
        yield from edit(f, ((s, e), r))
        passed, ok = yield from test()
        dirty = None
        if passed > best or (passed == best and score > 0):     # it helps, or it is cued and does no harm
            kept.setdefault(f, []).append(((s, e), r))
            best, good = passed, ok
        else:
            dirty = f
    if dirty and good:
        yield from edit(dirty)
    yield "submit", ""


def restart(context, budget):
    """The teacher of tasks of deleted helpers (the search's; a long task's, issue 63), a generator like
    search, built from a context's text alone and, on a long task, again from each next one (repos
    transcripts: after a summary, the prompt, the actions left (env.LEFT) and the summary; after mask's or
    window's rebuild, what it shows): it never acts on what its context no longer holds. Each action
    follows from the context so far (_next); budget: the actions left, where the context does not say."""
    left = next((int(m[1]) for m in re.finditer(r"^actions left: (\d+)$", context, re.M)), budget)
    while left > 1:                                    # the last action left: a submit
        name, payload = _next(context)
        context += f"<|{name}|>{payload}<|end|><|obs|>{(yield name, payload)}<|/obs|>"
        left -= 1
    yield "submit", ""


def _next(context):
    """The next action on a task of deleted helpers, read off its context's text (the summary's lines, the
    reads shown: stubs, notes, numbers; the edits, the last grep and test): grep the stubs, read their
    modules, then each number's, write each helper's template, grep again, test, submit."""
    shown = lambda action: [m for m in re.finditer(rf"<\|{action}\|>(.*?)<\|end\|><\|obs\|>(.*?)<\|/obs\|>", context,
                                                   re.S) if m[2] != env.MASKED and not m[2].startswith("error")]
    reads = {m[1]: m[2] for m in shown("read")}
    summary = "".join(re.findall(r"<\|summary\|>(.*?)<\|end\|>", context, re.S)[-1:])
    facts = re.findall(r"^(N\d*) = (-?\d+) \(([\w/.]+)\)$", summary, re.M)
    where = dict(re.findall(r"^(N\d*) in ([\w/.]+)$", summary, re.M)) | {k: p for k, _, p in facts}
    todo = {f: (p, f'def {sig}:\n    """{doc}"""\n', re.search(r"\b(N\d*)\b", doc))
            for f, p, sig, doc in re.findall(r"^fix (\w+) in ([\w/.]+): (\w+\(.*?\)) (.*)$", summary, re.M)}
    for path, text in reads.items():          # the stubs a read shows, the modules their notes name
        where |= dict(re.findall(r"\((N\d*): the value set in ([\w/.]+)\)", text))
        todo |= {f: (path, src, re.search(r"\((N\d*): the value set in", src)) for f in re.findall(
            r"^def (\w+)\(", text, re.M) if "    raise NotImplementedError\n" in (src := definition(text, f, False))}
    # each settings module's one number: a read shown, or a note of it, which mask and window keep longer:
    # a grep of its line (`config.py:7: RATE = 3`; under mask, the grep `RATE = 3` right after the read)
    lines = {p: m for p, text in reads.items() if (m := re.search(r"^[A-Z][A-Z0-9_]* = (-?\d+)$", text, re.M))}
    numbers = {p: int(m[1]) for p, m in lines.items()} | {p: int(v) for p, v in re.findall(
        r"<\|read\|>([\w/.]+)<\|end\|><\|obs\|>[^<]*<\|/obs\|><\|grep\|>[A-Z][A-Z0-9_]* = (-?\d+)<\|end\|>", context)}
    numbers |= {p: int(v) for m in shown("grep") for p, v in
                re.findall(r"^([\w/.]+\.py):\d+: [A-Z][A-Z0-9_]* = (-?\d+)$", m[2], re.M)}
    values = {k: int(v) for k, v, _ in facts} | {k: numbers[p] for k, p in where.items() if p in numbers}
    edits = list(re.finditer(r"<\|edit\|>([\w/.]+)\ndef (\w+)\(", context))
    fixed = set(re.findall(r"^fixed (\w+) in", summary, re.M)) | {m[2] for m in edits}
    todo = {f: (p, src, label and label[1]) for f, (p, src, label) in todo.items() if f not in fixed}
    for f, (path, src, label) in todo.items():     # its template, with its number if it names one
        body = _template(src, values.get(label), label) if label in values or not label else None
        if body:
            return "edit", path + "\n" + src.partition("\n")[0] + "\n" + body    # its docstring dropped
    for path, m in lines.items():              # a number whose use no stub or summary line shown says
        if path not in where.values() and f"<|grep|>{m[0]}<|end|>" not in context:
            return "grep", m[0]
    for f, (path, src, label) in todo.items():
        if where.get(label) not in (None, *reads):
            return "read", where[label]
    greps = [m for m in shown("grep") if m[1] == "raise NotImplementedError"]
    for path in re.findall(r"^([\w/.]+\.py):\d+: ", greps[-1][2] if greps else "", re.M):   # a stub's module
        if path not in reads and path not in {p for p, *_ in todo.values()} and \
                not any(m[1] == path and m.start() > greps[-1].start() for m in edits):
            return "read", path
    last = max([m.start() for m in edits], default=-1)
    if not greps or greps[-1].start() < last:           # the stubs left, since the last edit
        return "grep", "raise NotImplementedError"
    return ("test", "") if not any(m.start() > last for m in shown("test")) else ("submit", "")


def episodes(tasks, tools, pool, policy=search):
    """Each task's episode of `policy` through `tools` (env.Tools: the agent's actions and step limit),
    stepped together (drive), judged as the agent's (tools.finish: no submit within the limit fails)."""
    eps = [{"task": t, "tools": tools, "e": env.Episode(i), "policy": policy(tools.prompt(t), tools.max_actions)}
           for i, t in enumerate(tasks)]
    drive(eps, pool)
    tools.finish(pool, [(ep["task"], ep["e"]) for ep in eps])
    return [ep["e"] for ep in eps]


def drive(eps, pool, observe=lambda ep, name, payload, obs: True):
    """Episodes stepped together, a step's sandbox runs to `pool` in one batch: dicts of a task, tools
    (env.Tools), e (env.Episode) and policy (a generator sent each observation, ep["obs"]), whose actions
    are taken as env.Tools.step takes a model's (a refused one is an observation, each counts, every
    observation is capped, a submit or the step limit ends it). observe(ep, name, payload, obs) sees each
    action and its observation (None: the episode is over) and may end it (False)."""
    for ep in eps:
        ep["tools"].start(ep["task"], ep["e"])
    live = list(eps)
    while live:
        step = []
        for ep in live:
            (t, tools, e), (name, payload) = (ep["task"], ep["tools"], ep["e"]), ep["policy"].send(ep.get("obs"))
            act = env.Action(name)
            e.actions.append(act)
            try:
                if name not in tools.actions:
                    raise ValueError(f"error: <|{name}|> is not available here")
                obs, run = tools.apply(t, e, name, payload, act)
            except ValueError as err:
                act.error, obs, run = "tool", str(err), None
            e.end = "submit" if name == "submit" and not act.error else e.end
            over = e.end == "submit" or len(e.actions) >= tools.max_actions
            step.append((ep, name, payload, None if over else obs, None if over else run))
        results = iter(pool.run_batch([s[4] for s in step if s[4]]))
        live = []
        for ep, name, payload, obs, run in step:
            if run:
                r = next(results)
                obs = env.test_report(r, [n for n, in run.inputs]) if name == "test" else env.run_report(r)
            ep["obs"] = None if obs is None else env.cap(obs)
            if observe(ep, name, payload, ep["obs"]) and obs is not None:
                live.append(ep)


def unpredictable(segments):
    """(actions with a payload, those naming what their context does not hold) in a transcript's segments (repos
    Transcript: text, fed?, special?): the context of an action is every segment before it (the issue or a
    fresh context, the observations, the model's own earlier actions). An action names a path (x.py), a
    function (a name called or defined) and integers; each must stand in that context. A teacher whose
    actions all pass sees only what its student sees (the oracle across a summary did not)."""
    n = bad = 0
    for i, (text, fed, special) in enumerate(segments):
        if special or fed or i == 0 or not segments[i - 1][2] or segments[i - 1][0] == "<|summary|>":
            continue
        n += 1
        context = "".join(s for s, _, _ in segments[:i])
        # a path by its module's name (`from lists import *` names lists.py); one-digit numbers and 10 (the
        # base that "the last digit" means: `x % 10`) are free
        names = re.findall(r"([\w/]+)\.py|(?<![\w.])(\w+)\(|(?<![\w.])(\d\d+)(?![\w.])", text)
        bad += any(not re.search(rf"(?<!\w){re.escape(w.replace('/', '.'))}(?!\w)", context)
                   for w in filter(None, sum(names, ())) if w not in dir(builtins) and w != "10")
    return n, bad
