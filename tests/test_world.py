"""Tests for world.py: the typed primitive library, program sampling and rejection, rendering, the
near / novel split, difficulty, and the size of the world (distinct functions)."""
import copy
import itertools
import json
import random

import pytest

import env
from sandbox import SandboxPool
from data import tasks
from data import world
from data.world import DICT, INT, INTS, STR, WORDS, Program, PRIMS


def programs(slice_, n, seed=0, difficulties=None):
    r = random.Random(f"{slice_}/{seed}")
    return [world.sample_split_program(r, slice_, difficulties) for _ in range(n)]

def run_solution(spec, x):
    ns = {}
    exec(f"def {spec['name']}({spec['args'][0]}):\n{spec['solution']}", ns)
    return ns[spec["name"]](x)

# ----------------------------------------------------------------------------- the library

def test_library_is_typed_and_complete():
    assert len(PRIMS) >= 40
    for key, p in PRIMS.items():
        assert p.src in (INT, STR, INTS, WORDS, DICT) and p.dst in (INT, STR, INTS, WORDS, DICT, world.BOOL), key
        assert 1 <= p.weight <= 3 and p.phrase and "result = " in p.template and "{v}" in p.template, key
        for slot, choices in p.consts:       # every constant is stated in the docstring and named in the function
            assert "{%s}" % slot in p.phrase and "{%s}" % slot in p.name and len(choices) >= 2, key
    for typ in (INT, STR, INTS, WORDS, DICT):
        assert sum(p.src == typ for p in PRIMS.values()) >= 5, typ

def test_primitives_match_their_phrases():
    """Spot checks of the semantics the docstring promises."""
    run1 = lambda key, x, *c: PRIMS[key].fn(x, *c)
    assert run1("keep_above", [5, 1, 9, 3], 3) == [5, 9]
    assert run1("running_total", [1, 2, 3]) == [1, 3, 6]
    assert run1("sort_by_last_digit", [21, 13, 11, 5]) == [21, 11, 13, 5]
    assert run1("word_counts", ["a", "b", "a"]) == {"a": 2, "b": 1}
    assert run1("by_first_letter", ["apple", "ant", "bee"]) == {"a": 2, "b": 1}
    assert run1("key_of_max", {"x": 1, "y": 3, "z": 3}) == "y"
    assert run1("label", 12, 10, "big", "small") == "big" and run1("label", 3, 10, "big", "small") == "small"
    assert run1("digit_sum", -409) == 13 and run1("differences", [1, 4, 2]) == [3, -2]

# ----------------------------------------------------------------------------- rejection

@pytest.mark.parametrize("steps,why", [
    ((("reverse", ()), ("reverse", ())), "change nothing"),                 # cancel
    ((("upper", ()), ("lower", ())), "redundant"),                          # upper is wasted work before lower
    ((("sort", ()), ("sort_desc", ())), "redundant"),
    ((("keep_above", (3,)), ("keep_above", (5,))), "redundant"),
    ((("add_each", (2,)), ("add_each", (-2,))), "change nothing"),
    ((("sort", ()), ("sum", ())), "redundant"),                              # sum ignores the order
    ((("abs_each", ()), ("keep_above", (100,)), ("count_numbers", ())), "constant"),
    ((("add", (3,)), ("minus", (3,))), "change nothing"),
])
def test_degenerate_programs_are_rejected(steps, why):
    program = Program(steps)
    inputs = world.sample_inputs(random.Random(0), program.arg_type, 24)
    reason = world.degenerate(program, inputs)
    assert reason and why in reason, reason

def test_sensible_programs_are_kept():
    for steps in [(("keep_above", (3,)), ("sort", ()), ("first", (2,))), (("split", ()), ("sort_words", ())),
                  (("word_counts", ()), ("sum_values", ())), (("times_each", (3,)), ("running_total", ()))]:
        program = Program(steps)
        assert world.degenerate(program, world.sample_inputs(random.Random(1), program.arg_type, 24)) is None, steps

def test_sampled_programs_are_typed_and_never_degenerate():
    r = random.Random(5)
    for n in range(1, 6):
        for _ in range(40):
            pools = {}
            program = world.sample_program(r, n, pools=pools)
            seq = program.sequence
            assert len(seq) == n
            assert all(PRIMS[a].dst == PRIMS[b].src for a, b in zip(seq, seq[1:]))
            assert world.BOOL not in [PRIMS[k].dst for k in seq[:-1]]
            assert world.degenerate(program, pools[program.arg_type]) is None       # on the inputs it was probed with

# ----------------------------------------------------------------------------- rendering

def test_rendered_solution_is_readable_python_that_gives_the_outputs():
    r = random.Random(3)
    for slice_ in ("train", "near", "novel"):
        for _ in range(60):
            pools = {}                                  # rendered on the inputs it was probed with, as make_task does
            program = world.sample_split_program(r, slice_, pools=pools)
            spec = world.render(program, r, pools)
            assert "world" not in spec["solution"] and "PRIMS" not in spec["solution"]   # no DSL interpreter
            assert spec["solution"].count("result = ") >= len(program.steps)
            assert spec["solution"].rstrip().endswith("return result")
            assert spec["prompt"].startswith(f"def {spec['name']}({spec['args'][0]}):") and spec["name"].isidentifier()
            assert spec["prompt"].count(">>> ") == spec["n_examples"] and len(spec["inputs"]) >= spec["n_examples"] + 5
            for (x,), out in zip(spec["inputs"], spec["outputs"]):
                before = copy.deepcopy(x)
                assert run_solution(spec, x) == out and x == before                  # no input mutated
                assert json.loads(json.dumps(out)) == out                             # JSON-stable
            assert len({json.dumps(o, sort_keys=True) for o in spec["outputs"]}) >= 2

def test_solution_does_not_depend_on_the_argument_name():
    r = random.Random(4)
    for program in programs("train", 40, seed=4):
        spec = world.render(program, r)
        for arg in world.ARG_NAMES[program.arg_type]:
            ns = {}
            exec(f"def f({arg}):\n{world.solution_of(program, arg)}", ns)
            assert [ns["f"](copy.deepcopy(x)) for (x,) in spec["inputs"]] == spec["outputs"], (program, arg)

def test_difficulty_follows_steps_and_filters():
    assert world.difficulty(Program((("sort", ()),))) == 1
    assert world.difficulty(Program((("running_total", ()),))) == 2                 # a hard step counts more
    assert world.difficulty(Program((("sort", ()), ("reverse", ()), ("sum", ())))) == 3
    for level in (1, 3, 5):
        for slice_ in ("train", "novel"):
            if level == 1 and slice_ == "novel":
                continue                                                            # novel programs have >= 2 steps
            assert {world.difficulty(p) for p in programs(slice_, 20, level, [level])} == {level}
    mean = {n: [] for n in range(1, 5)}
    for p in programs("train", 400, seed=7):
        mean[len(p.steps)].append(world.difficulty(p))
    avg = [sum(v) / len(v) for v in mean.values()]
    assert avg == sorted(avg), avg

# ----------------------------------------------------------------------------- the split

def test_train_never_holds_a_novel_composition():
    train = programs("train", 1500, seed=1)
    for p in train:
        assert len(p.steps) <= world.TRAIN_MAX_STEPS and world.slice_of(p) == "train"
        assert not set(zip(p.sequence, p.sequence[1:])) & world.HELD_PAIRS
        assert not world.held_out_sequence(p.sequence)
    for p in programs("novel", 300, seed=1):
        seq = p.sequence
        assert len(seq) == 5 or set(zip(seq, seq[1:])) & world.HELD_PAIRS or world.held_out_sequence(seq)

def test_every_primitive_of_a_novel_task_is_seen_in_train():
    seen = {key for p in programs("train", 3000, seed=2) for key in p.sequence}
    novel = {key for p in programs("novel", 400, seed=2) for key in p.sequence}
    assert novel <= seen, novel - seen
    assert len(seen) == len(PRIMS)                     # the whole library is taught

def test_near_tasks_have_a_train_sequence_with_other_constants():
    for p in programs("near", 150, seed=3):
        assert not world.is_novel(p.sequence) and any(c for _, c in p.steps)
        choices = [list(itertools.product(*(c for _, c in PRIMS[k].consts))) for k in p.sequence]
        r = random.Random(0)
        others = (Program(tuple(zip(p.sequence, (r.choice(c) for c in choices)))) for _ in range(200))
        assert any(world.slice_of(q) == "train" for q in others), p

def test_ops_merge_primitives_with_the_same_code():
    """sorted(nums) and sorted(words) are one function: one op, one held-out status."""
    assert PRIMS["sort"].op == PRIMS["sort_words"].op != PRIMS["sort_desc"].op
    assert PRIMS["dedupe"].op == PRIMS["unique_words"].op
    for (a, b) in world.HELD_PAIRS:
        for a2, b2 in itertools.product(PRIMS, PRIMS):
            if (PRIMS[a2].op, PRIMS[b2].op) == (PRIMS[a].op, PRIMS[b].op) and PRIMS[a2].dst == PRIMS[b2].src:
                assert (a2, b2) in world.HELD_PAIRS

def test_tasks_are_deterministic_and_bad_split_is_an_error():
    assert tasks.make_task("train", 3, 17) == tasks.make_task("train", 3, 17)
    assert tasks.make_task("test", 3, 17) != tasks.make_task("test", 4, 17)
    with pytest.raises(ValueError, match="split must be"):
        tasks.make_task("dev", 0, 0)

@pytest.mark.slow   # thousands of programs sampled: ~5 s
def test_world_is_large():
    """5,000 train tasks of the mix hold >= 90% distinct function identities (measured: 96.2%);
    `python -m data.tasks stats` measures the 100,000 of the issue's goal: 92,486 (92.5%)."""
    ts = tasks.generate_tasks("train", 5000, seed=0)
    assert len({tasks.function_identity(t) for t in ts}) >= 0.90 * len(ts)

def test_generate_tasks_mixes_world_and_templates():
    ts = tasks.generate_tasks("train", 600, seed=2)
    assert 0.87 <= sum(t.family == "world" for t in ts) / len(ts) <= 0.97 and all(t.slice == "" for t in ts)
    test = tasks.generate_tasks("test", 300, seed=2)
    assert {t.slice for t in test if t.family == "world"} == {"near", "novel"}
    assert {t.family for t in tasks.generate_tasks("test", 30, families=["world"])} == {"world"}
    assert "world" not in {t.family for t in tasks.generate_tasks("train", 60, families=["lists", "strings"])}
    assert {t.difficulty for t in tasks.generate_tasks("train", 40, difficulties=[2], families=["world"])} == {2}
    low = tasks.generate_tasks("test", 40, difficulties=[1], families=["world"])       # no 1-step novel program
    assert {(t.difficulty, t.slice) for t in low} == {(1, "near")}
    assert {t.steps for t in low} == {1} and {t.steps for t in test if t.family != "world"} == {0}
    assert all(t.steps >= 2 for t in test if t.slice == "novel" and t.family == "world")   # novel: 2+ steps

def test_no_function_in_both_splits_and_world_never_makes_a_template_function():
    ident = lambda ts: {tasks.function_identity(t) for t in ts}
    train, test = tasks.generate_tasks("train", 2000, seed=6), tasks.generate_tasks("test", 800, seed=6)
    assert not ident(train) & ident(test)
    world_ids = ident([t for t in train + test if t.family == "world"])
    assert not world_ids & ident([t for t in train + test if t.family != "world"])
    # the compose family writes chains of the same statements: those functions stay its own
    assert world.owned_by_compose(Program((("upper", ()), ("reverse_text", ()))))
    assert not world.owned_by_compose(Program((("upper", ()), ("split", ()))))
    assert not world.owned_by_compose(Program((("upper", ()),)))

def test_world_tasks_solved_in_sandbox():
    ts = [tasks.make_task(split, 1, i) for split in ("train", "test") for i in range(20)]
    with SandboxPool(workers=2, timeout_s=2.0) as pool:
        rs = pool.run_batch(env.runs(ts, [t.solution for t in ts]))
    bad = [(t.task_id, r) for t, r in zip(ts, rs) if not r.passed]
    assert not bad, bad[:3]

def test_every_primitive_alone_renders_a_working_function():
    """A one-step function named after its step: `def sum(nums): result = sum(nums)` would recurse."""
    r = random.Random(8)
    for key, p in PRIMS.items():
        program = Program(((key, tuple(c[0] for _, c in p.consts)),))
        spec = world.render(program, r)
        ns = {}
        exec(spec["prompt"] + spec["solution"], ns)
        assert [ns[spec["name"]](x) for (x,) in spec["inputs"]] == spec["outputs"], key
