"""world.py: a compositional task world. Programs are chains of 1-5 typed primitive steps.

    r = random.Random(0)
    program = sample_program(r, 3)                 # a type-checked, non-degenerate 3-step chain
    spec = render(program, r)                      # name, args, docstring, solution, test cases, difficulty
    task = make_task("test", seed, index)          # a tasks.Task (tasks.generate_tasks mixes these in)
    python -m data.world --example --seed 13          # print one 3-step task with its solution
    python -m data.tasks stats                     # distinct function identities in 100,000 train tasks

Why: 8 families of fixed templates let a small model memorise template -> body. Here the space of
programs is combinatorial (DeepCoder, Balog et al. 2017: a typed DSL of ~40 list/int primitives), and
novelty can be made by construction as in the compositional-generalisation benchmarks (SCAN, COGS):
held-out combinations of seen parts, and longer programs than train has.

A primitive is one readable Python statement (or a short loop) that reads `{v}` and writes `result`;
the reference solution is those statements one after another, never a call into an interpreter.
The same text, compiled once per primitive, is what runs to produce the examples and hidden tests, so
the docstring, the solution and the outputs cannot drift apart. Stdlib only.
"""
import builtins
import dataclasses
import functools
import hashlib
import itertools
import json
import keyword
import math
import random
import re

from data import families
from data.families import LETTERS, PAIRS, VOCAB, R   # the template families' inputs and ranges

INT, STR, BOOL, INTS, WORDS, DICT = "int", "str", "bool", "list[int]", "list[str]", "dict[str,int]"
ARG_NAMES = {INT: ("n", "num", "value", "number"), STR: ("s", "text", "line", "phrase"),
             INTS: ("nums", "values", "numbers", "items", "data"), WORDS: ("words", "names", "tokens"),
             DICT: ("scores", "table", "stock", "ages")}
_SEPS = {" ": "space", ",": "comma", "-": "dash", "": "nothing", "+": "plus"}


@dataclasses.dataclass(frozen=True)
class Prim:
    name: str            # short name; {c} slots are filled with the constant (function names are built from it)
    src: str             # input type
    dst: str             # output type
    weight: int          # 1 easy (one expression) .. 3 hard (a loop with state); drives the task difficulty
    phrase: str          # the job in words, for the docstring
    template: str        # Python statements reading {v} and writing `result`
    consts: tuple = ()   # ((slot, choices), ...)
    fn: object = None    # the template compiled once: fn(value, *constants) -> result
    op: str = ""         # the template with local names blanked: primitives with one op have one function identity


# Local names of the templates. Function identity (tasks.function_identity) renames locals, so two
# templates that differ only in them (sorted(nums) / sorted(words)) are one function: the split
# works on ops, never on primitive names, or a function could land in train and test at once.
_LOCAL_NAMES = re.compile(r"(?<![.\w{])(x|w|ch|a|b|k|key|count|total|totals|seen|best|product|groups|counts)\b")


PRIMS = {}

def _p(name, src, dst, weight, phrase, template, **consts):
    """Register a primitive; its template is compiled here, once, into the function that runs it."""
    slots = list(consts)
    code = template.format(v="value", **{s: s for s in slots})
    body = "".join("    " + line + "\n" for line in code.split("\n"))
    ns = {}
    exec(f"def step(value{''.join(', ' + s for s in slots)}):\n{body}    return result\n", ns)
    key = name.split("_{")[0] if "{" in name else name
    assert key not in PRIMS, key
    PRIMS[key] = Prim(name, src, dst, weight, phrase, template, tuple((s, tuple(c)) for s, c in consts.items()),
                      ns["step"], _LOCAL_NAMES.sub("_", template))

# --- the library: ints -------------------------------------------------------------------------
_p("add_{c}", INT, INT, 1, "add {c}", "result = {v} + {c}", c=R(1, 50))
_p("minus_{c}", INT, INT, 1, "subtract {c}", "result = {v} - {c}", c=R(1, 50))
_p("times_{c}", INT, INT, 1, "multiply by {c}", "result = {v} * {c}", c=R(2, 12))
_p("div_{c}", INT, INT, 2, "divide by {c}, rounding down", "result = {v} // {c}", c=R(2, 9))
_p("mod_{c}", INT, INT, 2, "take the remainder after dividing by {c}", "result = {v} % {c}", c=R(2, 12))
_p("abs", INT, INT, 1, "take the absolute value", "result = abs({v})")
_p("square", INT, INT, 1, "square the number", "result = {v} * {v}")
_p("cap_{c}", INT, INT, 2, "replace it by {c} if it is larger than {c}", "result = min({v}, {c})", c=R(0, 40))
_p("floor_{c}", INT, INT, 2, "replace it by {c} if it is smaller than {c}", "result = max({v}, {c})", c=R(-5, 30))
_p("digit_sum", INT, INT, 3, "replace the number by the sum of its digits (ignoring the sign)",
   "total = 0\nfor ch in str(abs({v})):\n    total += int(ch)\nresult = total")
_p("digits", INT, INTS, 2, "make the list of its digits (ignoring the sign)",
   "result = [int(ch) for ch in str(abs({v}))]")
_p("to_text", INT, STR, 1, "write the number as a string", "result = str({v})")
_p("above_{c}", INT, BOOL, 1, "check whether it is greater than {c}", "result = {v} > {c}", c=R(-5, 40))
_p("divisible_{c}", INT, BOOL, 1, "check whether it is divisible by {c}", "result = {v} % {c} == 0", c=R(2, 9))
_p("label_{a}_{b}_{c}", INT, STR, 2, "give {a} if it is greater than {c}, otherwise {b}",
   "if {v} > {c}:\n    result = {a}\nelse:\n    result = {b}",
   c=R(0, 30), a=[a for a, _ in PAIRS], b=[b for _, b in PAIRS])
# --- lists of ints -----------------------------------------------------------------------------
_p("add_each_{c}", INTS, INTS, 1, "add {c} to every number", "result = [x + {c} for x in {v}]", c=R(1, 30))
_p("times_each_{c}", INTS, INTS, 1, "multiply every number by {c}", "result = [x * {c} for x in {v}]", c=R(2, 9))
_p("mod_each_{c}", INTS, INTS, 2, "replace every number by its remainder after dividing by {c}",
   "result = [x % {c} for x in {v}]", c=R(2, 10))
_p("squares", INTS, INTS, 1, "square every number", "result = [x * x for x in {v}]")
_p("abs_each", INTS, INTS, 1, "replace every number by its absolute value", "result = [abs(x) for x in {v}]")
_p("cap_each_{c}", INTS, INTS, 2, "replace every number larger than {c} by {c}",
   "result = [min(x, {c}) for x in {v}]", c=R(0, 25))
_p("keep_above_{c}", INTS, INTS, 2, "keep only the numbers greater than {c}", "result = [x for x in {v} if x > {c}]",
   c=R(-5, 25))
_p("keep_below_{c}", INTS, INTS, 2, "keep only the numbers less than {c}", "result = [x for x in {v} if x < {c}]",
   c=R(-5, 25))
_p("keep_even", INTS, INTS, 1, "keep only the even numbers", "result = [x for x in {v} if x % 2 == 0]")
_p("keep_odd", INTS, INTS, 1, "keep only the odd numbers", "result = [x for x in {v} if x % 2 == 1]")
_p("keep_multiples_{c}", INTS, INTS, 2, "keep only the multiples of {c}", "result = [x for x in {v} if x % {c} == 0]",
   c=R(3, 7))
_p("sort", INTS, INTS, 1, "sort the numbers from smallest to largest", "result = sorted({v})")
_p("sort_desc", INTS, INTS, 1, "sort the numbers from largest to smallest", "result = sorted({v}, reverse=True)")
_p("sort_by_last_digit", INTS, INTS, 2, "sort the numbers by their last digit, keeping the order of ties",
   "result = sorted({v}, key=lambda x: abs(x) % 10)")
_p("reverse", INTS, INTS, 1, "reverse the list", "result = {v}[::-1]")
_p("first_{c}", INTS, INTS, 1, "keep the first {c} numbers", "result = {v}[:{c}]", c=R(1, 6))
_p("drop_{c}", INTS, INTS, 1, "drop the first {c} numbers", "result = {v}[{c}:]", c=R(1, 4))
_p("every_other", INTS, INTS, 2, "keep every second number, starting with the first", "result = {v}[::2]")
_p("running_total",
   INTS, INTS, 3, "replace the list by its running totals (item i is the sum of the first i + 1 numbers)",
   "totals = []\ntotal = 0\nfor x in {v}:\n    total += x\n    totals.append(total)\nresult = totals")
_p("dedupe", INTS, INTS, 3, "remove repeated numbers, keeping the first occurrence of each",
   "seen = []\nfor x in {v}:\n    if x not in seen:\n        seen.append(x)\nresult = seen")
_p("differences", INTS, INTS, 3, "replace the list by the differences between each number and the one before it",
   "result = [b - a for a, b in zip({v}, {v}[1:])]")
_p("sum", INTS, INT, 1, "take the sum of the numbers", "result = sum({v})")
_p("count_numbers", INTS, INT, 1, "count the numbers", "result = len({v})")
_p("max", INTS, INT, 1, "take the largest number (0 for an empty list)", "result = max({v}, default=0)")
_p("min", INTS, INT, 1, "take the smallest number (0 for an empty list)", "result = min({v}, default=0)")
_p("count_above_{c}", INTS, INT, 2, "count the numbers greater than {c}", "result = len([x for x in {v} if x > {c}])",
   c=R(-5, 25))
_p("product", INTS, INT, 2, "take the product of the numbers (1 for an empty list)",
   "product = 1\nfor x in {v}:\n    product *= x\nresult = product")
_p("any_above_{c}", INTS, BOOL, 2, "check whether any number is greater than {c}",
   "result = any(x > {c} for x in {v})", c=R(0, 30))
_p("join_{c}", INTS, STR, 2, "write the numbers as one string, separated by {c}",
   "result = {c}.join(str(x) for x in {v})", c=list(_SEPS))
# --- strings -----------------------------------------------------------------------------------
_p("upper", STR, STR, 1, "convert it to upper case", "result = {v}.upper()")
_p("lower", STR, STR, 1, "convert it to lower case", "result = {v}.lower()")
_p("reverse_text", STR, STR, 1, "reverse the string", "result = {v}[::-1]")
_p("remove_{c}", STR, STR, 1, "remove every {c}", "result = {v}.replace({c}, '')", c=list(LETTERS + " "))
_p("swap_{c}_{d}", STR, STR, 2, "replace every {c} by {d}", "result = {v}.replace({c}, {d})",
   c=list(LETTERS), d=list("xyz-_"))
_p("head_{c}", STR, STR, 1, "keep the first {c} characters", "result = {v}[:{c}]", c=R(1, 8))
_p("tail_{c}", STR, STR, 1, "keep the last {c} characters", "result = {v}[-{c}:]", c=R(1, 8))
_p("suffix_{c}", STR, STR, 1, "append {c}", "result = {v} + {c}", c=["ing", "ed", "er", "ly", "s", "!", "?", "."])
_p("capitalize_words", STR, STR, 2, "capitalize the first letter of every word",
   "result = ' '.join(w.capitalize() for w in {v}.split())")
_p("twice", STR, STR, 1, "repeat it twice", "result = {v} * 2")
_p("split", STR, WORDS, 1, "split it into words at whitespace", "result = {v}.split()")
_p("chars", STR, WORDS, 1, "split it into its characters", "result = list({v})")
_p("length", STR, INT, 1, "count its characters", "result = len({v})")
_p("count_char_{c}", STR, INT, 1, "count how many times {c} occurs", "result = {v}.count({c})", c=list(LETTERS))
_p("vowels", STR, INT, 3, "count the vowels (a, e, i, o, u, either case)",
   "count = 0\nfor ch in {v}:\n    if ch.lower() in 'aeiou':\n        count += 1\nresult = count")
_p("longer_than_{c}", STR, BOOL, 1, "check whether it has more than {c} characters", "result = len({v}) > {c}",
   c=R(2, 12))
# --- lists of words ----------------------------------------------------------------------------
_p("sort_words", WORDS, WORDS, 1, "sort the words alphabetically", "result = sorted({v})")
_p("sort_by_length", WORDS, WORDS, 2, "sort the words by length, keeping the order of ties",
   "result = sorted({v}, key=len)")
_p("longer_{c}", WORDS, WORDS, 2, "keep only the words longer than {c} characters",
   "result = [w for w in {v} if len(w) > {c}]", c=R(1, 5))
_p("starting_{c}", WORDS, WORDS, 2, "keep only the words that start with {c}",
   "result = [w for w in {v} if w.startswith({c})]", c=list("abcdefprst"))
_p("upper_each", WORDS, WORDS, 1, "convert every word to upper case", "result = [w.upper() for w in {v}]")
_p("reverse_words", WORDS, WORDS, 1, "reverse the order of the words", "result = {v}[::-1]")
_p("first_words_{c}", WORDS, WORDS, 1, "keep the first {c} words", "result = {v}[:{c}]", c=R(1, 5))
_p("unique_words", WORDS, WORDS, 3, "remove repeated words, keeping the first occurrence of each",
   "seen = []\nfor w in {v}:\n    if w not in seen:\n        seen.append(w)\nresult = seen")
_p("join_words_{c}", WORDS, STR, 1, "join the words with {c} between them", "result = {c}.join({v})", c=list(_SEPS))
_p("initials", WORDS, STR, 2, "join the first letters of the words", "result = ''.join(w[:1] for w in {v})")
_p("lengths", WORDS, INTS, 1, "replace every word by its length", "result = [len(w) for w in {v}]")
_p("count_words", WORDS, INT, 1, "count the words", "result = len({v})")
_p("word_counts", WORDS, DICT, 3, "count how many times each word occurs, in a dictionary",
   "counts = {{}}\nfor w in {v}:\n    counts[w] = counts.get(w, 0) + 1\nresult = counts")
_p("by_first_letter", WORDS, DICT, 3, "count the words by their first letter, in a dictionary",
   "groups = {{}}\nfor w in {v}:\n    groups[w[:1]] = groups.get(w[:1], 0) + 1\nresult = groups")
_p("word_lengths", WORDS, DICT, 2, "map every word to its length, in a dictionary",
   "result = {{w: len(w) for w in {v}}}")
# --- dictionaries (str -> int) -----------------------------------------------------------------
_p("add_values_{c}", DICT, DICT, 1, "add {c} to every value",
   "result = {{key: count + {c} for key, count in {v}.items()}}", c=R(1, 20))
_p("keep_values_above_{c}", DICT, DICT, 2, "keep only the entries whose value is greater than {c}",
   "result = {{key: count for key, count in {v}.items() if count > {c}}}", c=R(0, 15))
_p("times_values_{c}", DICT, DICT, 1, "multiply every value by {c}",
   "result = {{key: count * {c} for key, count in {v}.items()}}", c=R(2, 9))
_p("keep_values_below_{c}", DICT, DICT, 2, "keep only the entries whose value is less than {c}",
   "result = {{key: count for key, count in {v}.items() if count < {c}}}", c=R(1, 20))
_p("keys_above_{c}", DICT, WORDS, 2, "take the keys whose value is greater than {c}, in sorted order",
   "result = sorted(key for key in {v} if {v}[key] > {c})", c=R(0, 15))
_p("value_of_{c}", DICT, INT, 1, "take the value stored under {c} (0 if it is not a key)", "result = {v}.get({c}, 0)",
   c=VOCAB)
_p("sorted_keys", DICT, WORDS, 1, "take the keys in sorted order", "result = sorted({v})")
_p("values", DICT, INTS, 1, "take the values in key order", "result = [{v}[k] for k in sorted({v})]")
_p("sum_values", DICT, INT, 1, "take the sum of the values", "result = sum({v}.values())")
_p("count_keys", DICT, INT, 1, "count the keys", "result = len({v})")
_p("key_of_max", DICT, STR, 3, "take the key with the largest value (the first such key on a tie, '' if empty)",
   "best = ''\nfor k in {v}:\n    if best == '' or {v}[k] > {v}[best]:\n        best = k\nresult = best")
assert len(PRIMS) >= 40

# --- inputs ------------------------------------------------------------------------------------
def _word(r):
    w = r.choice(VOCAB) if r.random() < 0.6 else "".join(r.choice(LETTERS) for _ in range(r.randint(1, 6)))
    return w.capitalize() if r.random() < 0.25 else w      # some capitals, so lower() has work to do

def sample_input(r, typ):
    if typ == INT:
        return r.randint(-20, 60) if r.random() < 0.7 else r.randint(100, 9999)
    if typ == STR:
        return " ".join(_word(r) for _ in range(r.choice((1, 1, 2, 3, 4))))
    if typ == INTS:
        return [r.randint(-9, 30) for _ in range(r.randint(0, 8))]
    if typ == WORDS:
        return [_word(r).lower() for _ in range(r.randint(0, 6))]
    if typ == DICT:
        return {r.choice(VOCAB): r.randint(0, 20) for _ in range(r.randint(0, 7))}
    raise ValueError(f"no inputs of type {typ}")

def sample_inputs(r, typ, n):
    """Up to n distinct inputs."""
    pool = {}
    for _ in range(3 * n):
        x = sample_input(r, typ)
        pool.setdefault(repr(x), x)
        if len(pool) == n:
            break
    return list(pool.values())

# --- programs ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Program:
    steps: tuple         # ((primitive key, (constant, ...)), ...)

    @property
    def sequence(self): return tuple(key for key, _ in self.steps)

    @property
    def arg_type(self): return PRIMS[self.steps[0][0]].src

    @property
    def ops(self): return tuple(PRIMS[key].op for key in self.sequence)

def run(program, value):
    """The value after every step (the trace), by the compiled templates."""
    trace = []
    for key, consts in program.steps:
        value = PRIMS[key].fn(value, *consts)
        trace.append(value)
    return trace

def difficulty(program):
    """The number of steps, +1 when the steps are harder than one-expression jobs (weights sum >= n + 2)."""
    n = len(program.steps)
    return min(5, n + (sum(PRIMS[key].weight for key in program.sequence) - n >= 2))

def composition_key(program):
    """What the novel slice is made of: the primitive sequence and its adjacent pairs."""
    seq = program.sequence
    return seq, tuple(zip(seq, seq[1:]))

_MERGE = {frozenset(("add", "minus"))}   # adjacent steps that fold into one (add 3, subtract 5 = subtract 2)

@functools.cache
def _next_prims(typ, last, more):
    """(primitives that may follow `last` on a value of type `typ`, their sampling weights); more=True:
    the chain must go on. Weight = sqrt(number of constant choices): a primitive with many constants
    makes many distinct programs, so drawing it more often keeps repeats rare in a big train set."""
    keys = [key for key, p in PRIMS.items() if p.src == typ and key != last and frozenset((key, last)) not in _MERGE
            and not (more and p.dst == BOOL)]
    return keys, [_space([key]) ** 0.5 for key in keys]

_START_TYPES = (INT, STR, INTS, WORDS, DICT)
_START_WEIGHTS = [sum(p.src == typ for p in PRIMS.values()) for typ in _START_TYPES]   # more ways to start, more often

def sample_sequence(r, n_steps, start=None):
    seq, typ = [], start or r.choices(_START_TYPES, _START_WEIGHTS)[0]
    for i in range(n_steps):
        keys, weights = _next_prims(typ, seq[-1] if seq else None, i < n_steps - 1)
        if not keys:
            return None
        seq.append(r.choices(keys, weights)[0])
        typ = PRIMS[seq[-1]].dst
    return tuple(seq)

def _too_big(value):
    return abs(value) > 10 ** 9 if isinstance(value, int) else len(value) > 60

def degenerate(program, inputs):
    """Why the program is not worth a task on these inputs, or None. Rejected: an error or a huge
    value; a (nearly) constant output; any run of steps (one step included) that changes nothing on
    every input, e.g. the whole program, sort on a sorted list, reverse + reverse; a step whose removal
    leaves every output unchanged (sort before sort_desc, upper before lower, keep > 3 before keep > 5).
    Steps run one at a time so that most rejections come early."""
    steps = program.steps
    traces = [[x] for x in inputs]
    for j, (key, consts) in enumerate(steps):
        fn = PRIMS[key].fn
        try:
            for t in traces:
                t.append(fn(t[-1], *consts))
        except Exception as e:                               # a template bug: the tests catch these
            return f"error {e!r}"
        if any(_too_big(t[-1]) for t in traces):
            return "huge value"
        for i in range(j + 1):
            if PRIMS[steps[i][0]].src == PRIMS[key].dst and all(t[i] == t[j + 1] for t in traces):
                return f"steps {i + 1}-{j + 1} change nothing"
    outs = [repr(t[-1]) for t in traces]
    if max(map(outs.count, set(outs))) > 0.75 * len(outs):      # one answer nearly always right
        return "(nearly) constant output"
    for i, (key, _) in enumerate(steps):
        if PRIMS[key].src == PRIMS[key].dst:
            rest = Program(steps[i + 1:])
            if all((run(rest, t[i])[-1] if rest.steps else t[i]) == t[-1] for t in traces):
                return f"step {i + 1} is redundant"
    return None

def _pool(r, pools, typ, n=20):
    """The inputs of one type that a task's probes and test cases share (sampled once per task: speed)."""
    if typ not in pools:
        pools[typ] = sample_inputs(r, typ, n)
    return pools[typ]

def sample_program(r, n_steps, allow=None, start=None, pools=None, tries=200):
    """A type-checked chain of n_steps primitives with random constants, not degenerate on sampled
    inputs. allow(sequence) -> bool filters sequences before any constant is drawn (the split)."""
    pools = {} if pools is None else pools
    for _ in range(tries):
        seq = sample_sequence(r, n_steps, start)
        if seq is None or (allow and not allow(seq)):
            continue
        program = Program(tuple((key, tuple(r.choice(c) for _, c in PRIMS[key].consts)) for key in seq))
        if degenerate(program, _pool(r, pools, program.arg_type)) is None:
            return program
    raise RuntimeError(f"no {n_steps}-step program after {tries} tries")

# --- the split: novelty by construction (SCAN / COGS style held-out compositions) ------------------
# A fixed, hash-chosen share of the type-compatible adjacent pairs and of the whole step sequences
# never occurs in train; test tasks that contain one, or have 5 steps (train has at most 4), are the
# `novel` slice. Every other test task is `near`: a train step sequence with constants that sequence
# never has in train, so its function is new but its shape is not.
HELD_PAIR_PCT, HELD_SEQUENCE_PCT, NEAR_PCT, TRAIN_MAX_STEPS = 10, 5, 20, 4

def _bucket(*parts): return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16) % 100

HELD_PAIRS = {(a, b) for a in PRIMS for b in PRIMS
              if PRIMS[a].dst == PRIMS[b].src and _bucket("pair", PRIMS[a].op, PRIMS[b].op) < HELD_PAIR_PCT}

def held_out_sequence(seq):
    return len(seq) >= 2 and _bucket("sequence", tuple(PRIMS[key].op for key in seq)) < HELD_SEQUENCE_PCT

def is_novel(seq):
    """Whether a primitive sequence belongs to the novel slice: a held-out pair or sequence, or 5 steps."""
    return len(seq) > TRAIN_MAX_STEPS or held_out_sequence(seq) or any(p in HELD_PAIRS for p in zip(seq, seq[1:]))

def slice_of(program):
    """'train', 'near' or 'novel'. A program without constants cannot be near (its sequence would
    then never be seen in train): it is train unless novel."""
    if is_novel(program.sequence):
        return "novel"
    if all(not consts for _, consts in program.steps):
        return "train"
    return "near" if _bucket("near", program.ops, [c for _, c in program.steps]) < NEAR_PCT else "train"

def _space(seq): return math.prod(len(c) for key in seq for _, c in PRIMS[key].consts)

def _has_constants(seq):
    """A train program of 3+ steps has constants with at least 12 settings: a sequence with fewer
    functions would repeat in a big train set (and one without constants could never have a near twin)."""
    return len(seq) < 3 or _space(seq) >= 12

# tasks.py's `compose` family writes 2-3 step chains of some of these very statements; those functions
# are its own (its split may hold them out), so the world never makes them: one function, one owner.
_COMPOSE_STEPS = {"result = " + expr.format(v="{v}", **dict(zip(params, values)))
                  for _, _, expr, params in families.STR_STEPS + families.LIST_STEPS
                  for values in itertools.product(*params.values())}

def owned_by_compose(program):
    codes = [step_code(key, consts, "{v}") for key, consts in program.steps]
    return 2 <= len(codes) <= 3 and all(code in _COMPOSE_STEPS for code in codes)

# Steps per program: mostly 3-4, where the space of programs is large (1-step programs are few and
# would repeat); the novel slice adds 5-step programs.
_STEPS = {"train": {1: 0.5, 2: 3.5, 3: 26, 4: 70}, "near": {1: 0.5, 2: 3.5, 3: 26, 4: 70},
          "novel": {2: 15, 3: 30, 4: 30, 5: 25}}

def _steps_for(level, slice_):
    """Step counts that can have this difficulty (difficulty() is n or n + 1)."""
    return [n for n in _STEPS[slice_] if n in (level, level - 1)]

def sample_split_program(r, slice_, difficulties=None, pools=None, tries=200):
    """A program of the given slice ('train', 'near', 'novel'), optionally of one of these difficulties."""
    pools = {} if pools is None else pools
    allow = is_novel if slice_ == "novel" else (lambda seq: not is_novel(seq) and _has_constants(seq))
    for _ in range(tries):
        if difficulties:
            level = r.choice(sorted(difficulties))
            counts = _steps_for(level, slice_)
            if not counts:
                continue
            n = r.choice(counts)
        else:
            level, n = None, r.choices(list(_STEPS[slice_]), weights=list(_STEPS[slice_].values()))[0]
        program = sample_program(r, n, allow, pools=pools)
        if owned_by_compose(program):
            continue
        if slice_of(program) == slice_ and (level is None or difficulty(program) == level):
            return program
    raise RuntimeError(f"no {slice_} program with difficulties {difficulties}")

# --- rendering: what tasks.py needs ---------------------------------------------------------------
_SLUGS = {**_SEPS, "_": "underscore", "!": "bang", "?": "question", ".": "dot"}

def _slug(value):
    if isinstance(value, int):
        return str(value).replace("-", "minus")
    return _SLUGS.get(value, value)

def step_code(key, consts, var):
    p = PRIMS[key]
    return p.template.format(v=var, **{slot: repr(c) for (slot, _), c in zip(p.consts, consts)})

@functools.cache
def body_lines():
    """Every line a world solution can hold (stripped): each primitive's code with every constant
    setting on every argument name and on `result`, and `return result`."""
    names, lines = {n for ns in ARG_NAMES.values() for n in ns} | {"result"}, {"return result"}
    for key, p in PRIMS.items():
        for consts in itertools.product(*(c for _, c in p.consts)):
            for v in names:
                lines.update(ln.strip() for ln in step_code(key, consts, v).split("\n"))
    return lines

def describe(program, arg):
    """The function name and the docstring's first line."""
    names, phrases = [], []
    for key, consts in program.steps:
        p = PRIMS[key]
        names.append(p.name.format(**{slot: _slug(c) for (slot, _), c in zip(p.consts, consts)}))
        phrases.append(p.phrase.format(**{slot: repr(c) for (slot, _), c in zip(p.consts, consts)}))
    doc = f"Take {arg}, " + ", then ".join(phrases) + ", and return the result."
    name = "_".join(names)
    # `def sum(nums): result = sum(nums)` would call itself: never shadow a builtin or use a keyword
    return ("compute_" + name if hasattr(builtins, name) or keyword.iskeyword(name) else name), doc

def solution_of(program, arg):
    """The reference body: one readable statement (or loop) per step, then `return result`."""
    code = [step_code(key, consts, arg if i == 0 else "result") for i, (key, consts) in enumerate(program.steps)]
    return "".join("    " + line + "\n" for line in "\n".join(code + ["return result"]).split("\n"))

def render(program, r, pools=None, n_hidden=6):
    """Everything a task needs: name, args, docstring, solution, prompt with 1-3 examples, inputs and
    outputs (examples first), difficulty and composition key. Cases are ordered by
    families.order_cases, as the templates' are."""
    arg = r.choice(ARG_NAMES[program.arg_type])
    name, doc = describe(program, arg)
    cases = [([x], run(program, x)[-1]) for x in _pool(r, {} if pools is None else pools, program.arg_type)]
    cases, n_ex = families.order_cases(cases, r, n_hidden)
    prompt = families.render_doc_prompt(name, [arg], doc, cases[:n_ex])
    return {"name": name, "args": [arg], "doc": doc, "prompt": prompt, "solution": solution_of(program, arg),
            "inputs": [args for args, _ in cases], "outputs": [out for _, out in cases], "n_examples": n_ex,
            "difficulty": difficulty(program), "slice": slice_of(program), "key": composition_key(program)}

# --- tasks ---------------------------------------------------------------------------------------
def sample_task(split, seed, index, difficulties=None):
    """(program, rendered task) for one index, deterministic from (split, seed, index). A test index
    is near or novel with equal odds."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    r = families.Random(f"world/{split}/{seed}/{index}")      # str seeds are hashed with sha512: stable
    novel_ok = not difficulties or max(difficulties) >= 2           # a novel program has 2+ steps
    slice_ = "train" if split == "train" else r.choice(("near", "novel") if novel_ok else ("near",))
    pools = {}
    program = sample_split_program(r, slice_, difficulties, pools)
    return program, render(program, r, pools)

# --- command line --------------------------------------------------------------------------------
def _example(seed):
    r = random.Random(seed)
    program = sample_split_program(r, "train", [3])
    while len(program.steps) != 3:
        program = sample_split_program(r, "train", [3])
    spec = render(program, r)
    print(spec["prompt"] + spec["solution"], end="")
    print(f"# difficulty {spec['difficulty']}, slice {spec['slice']}, steps {' -> '.join(spec['key'][0])}")

if __name__ == "__main__":
    from infra.cli import ArgumentParser   # argparse errors: one line `error: ...`, exit code 2
    ap = ArgumentParser(prog="python -m data.world", description=__doc__.split("\n")[0])
    ap.add_argument("--example", action="store_true", help="print one 3-step train task and its solution")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.example:
        _example(args.seed)
    print(json.dumps({"n_primitives": len(PRIMS), "held_out_pairs": len(HELD_PAIRS)}))
