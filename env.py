"""env.py: the environment of RL and eval: the prompt harness, and a sandbox that runs model code.

One module shared by train_rl.py and eval.py, so the model is trained in the same harness it is
evaluated in (Composer 2 report, "harness parity"). Its parts:
  1. Harness: render_prompt -> model writes the function BODY -> extract_completion -> build_program;
     for multi-step episodes the visible examples, the feedback after a failed one, and the context
     (render_episode). The tasks themselves live in data/tasks.py; sampling in sampling.py. What a
     candidate's code does runs in sandbox.py (runs: the sandbox.Run of each completion); what came
     back becomes a Result, the reward.
  2. The agent's tools (Tools), self-summarization and the other memories, and the episode loop
     every rollout runs (run_episodes).

    with sandbox.SandboxPool(timeout_s=2.0) as pool:
        results = pool.run_batch(env.runs(tasks, completions))   # [Result(reward, passed, outcome, ...)]
    python -m data.tasks check --split test --n 200               # reference solutions through the sandbox
"""
import ast
import contextlib
import dataclasses
import io
import random
import re
import textwrap
import threading
import time
import tokenize

from tqdm import tqdm

import sampling
from sandbox import Result, Run

# ----------------------------------------------------------------------------- harness

EOT = "<|endoftext|>"

def render_prompt(task) -> str:
    """Exactly the text the model is conditioned on: signature + docstring, ending with a newline."""
    return task.prompt if task.prompt.endswith("\n") else task.prompt + "\n"

def extract_completion(text: str, max_chars: int = 2000) -> str:
    r"""Cut generated text to the function body: at end-of-text, and before the first line that
    starts with a non-blank character or that Python's own tokenizer reads as module-level code;
    at most max_chars characters. The tokenizer matters because "\r" ends a line for Python and a
    form feed in the indentation resets it to column 0, so "\fimport os" is module-level although
    it starts with whitespace (a `^\S` cut alone let such code run after the function)."""
    text = text[:max_chars].split(EOT)[0].replace("\r\n", "\n").replace("\r", "\n")
    m = re.search(r"^\S", text, re.M)        # every other stop sequence starts such a line
    text = text[:m.start()] if m else text
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]     # offset of each line
    depth, line_start = 0, True
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.INDENT:
                depth += 1
            elif tok.type == tokenize.DEDENT:
                depth -= 1
            elif tok.type == tokenize.NEWLINE:
                line_start = True
            elif tok.type not in (tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER):
                if line_start and depth == 0:          # a statement outside the function body
                    return text[:starts[tok.start[0] - 1]]
                line_start = False
    except (tokenize.TokenError, SyntaxError) as e:    # cut where Python would stop reading anyway
        row = e.args[1][0] if isinstance(e, tokenize.TokenError) else e.lineno
        return text[:starts[min(max(row, 1), len(starts)) - 1]]
    return text

def build_program(task, completion: str) -> str:
    return render_prompt(task) + completion


def run_of(task, completion):
    """The sandbox run of a completion of a function task: its prompt and the body as one program,
    called on the hidden inputs (or checked by the task's assert test); program None when the
    completion holds no code (scored no_code, never run)."""
    if task.inputs is None and task.test is None:
        raise ValueError(f"task {task.task_id} has neither inputs/outputs nor test")
    code = any(l.strip() and not l.strip().startswith("#") for l in completion.splitlines())
    io = task.inputs is not None
    return Run(task.task_id, build_program(task, completion) if code else None, task.entry_point,
               task.inputs, task.outputs if io else None, None if io else task.test, render_prompt(task))


def runs(tasks, completions):
    """run_of for each (task, completion): what SandboxPool.run_batch / submit_batch take."""
    if len(tasks) != len(completions):
        raise ValueError("tasks and completions differ in length")
    return [run_of(t, c) for t, c in zip(tasks, completions)]

def corpus_text(task) -> str:
    """A solved task for the pretraining corpus (the caller appends end-of-text)."""
    if task.solution is None:
        raise ValueError(f"task {task.task_id} has no solution")
    return render_prompt(task) + task.solution

# One parse at a time in this process: CPython 3.11's AST constructor keeps one recursion count per
# interpreter, so a parse in another thread while one builds its tree (a garbage collection inside it
# lets the other thread run) makes the first raise SystemError (gh-106905). The trainer's two decode
# streams apply their actions at once (sampling.side_by_side).
_PARSING = threading.Lock()


def parse(source, mode="exec"):
    with _PARSING:
        return ast.parse(source, mode=mode)


# ----------------------------------------------------------------------------- episodes (multi-turn)
# The agentic loop in miniature (Composer 2 trains "in the same harness" the deployed model works in):
# write the body, run the docstring's examples (the only tests the model can see), read what failed,
# write the body again. The hidden tests decide the reward and never appear in feedback.

def _entry_def(task):
    """The prompt's `def` of the entry point as an AST node (None if the prompt does not parse)."""
    try:
        return next(n for n in ast.walk(parse(render_prompt(task) + "    pass\n"))
                    if isinstance(n, ast.FunctionDef) and n.name == task.entry_point)
    except (SyntaxError, StopIteration, ValueError, MemoryError, RecursionError):
        return None

def visible_tests(task) -> list[tuple[list, object]]:
    """The docstring's examples, `>>> name(args)` and the answer on the next line, as (args, expected
    value): calls of the entry point with literal arguments and a literal answer. Anything else
    (prints, keyword arguments, non-literal values) is not a test the harness can run."""
    fn = _entry_def(task)    # the docstring itself, so the closing quotes never end up in an answer
    if fn is None:
        return []
    lines = [ln.strip() for ln in (ast.get_docstring(fn) or "").splitlines()] + [""]
    out = []
    for source, want in zip(lines, lines[1:]):
        if not source.startswith(">>> ") or not want or want.startswith(">>>"):
            continue
        with contextlib.suppress(SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            call = parse(source[4:], mode="eval").body
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == task.entry_point and not call.keywords):
                out.append(([ast.literal_eval(a) for a in call.args], ast.literal_eval(want)))
    return out

def visible_task(task):
    """The task judged on its visible examples only (None if it has none, or if its signature cannot
    be found again for the next turn): feedback comes from this."""
    cases = visible_tests(task)
    if not cases or not signature(task):
        return None
    return dataclasses.replace(task, task_id=task.task_id + "/visible", inputs=[a for a, _ in cases],
                               outputs=[w for _, w in cases], test=None, canary=False)

def render_feedback(task, result, attempt: str) -> str:
    """What follows a failed attempt in the context: the first failing example the way a person
    sees it run (the call, expected and actual value, or the error's last line), then the signature
    again, after which the model writes a new body. `attempt` is the text the model wrote (a
    newline is added if it did not end its last line)."""
    why = " ".join(result.feedback.split())[:200]
    head = "\n" if attempt and not attempt.endswith("\n") else ""
    return f"{head}# Test failed: {why}\n{signature(task)}"

def signature(task) -> str:
    """The entry point's `def` line(s) as the prompt writes them (a signature may span lines)."""
    fn = _entry_def(task)
    if fn is None:
        return ""
    lines = render_prompt(task).splitlines(keepends=True)[fn.lineno - 1:fn.body[0].lineno - 1]
    return textwrap.dedent("".join(lines))

def render_episode(task, turns) -> str:
    """The whole context of an episode as text, at any turn: the prompt, then for each turn the text
    the model wrote and the feedback that followed it ("" for the last). The sampler (sampling.py)
    feeds the same text as tokens; the pretraining repair transcripts are rendered by this too."""
    return render_prompt(task) + "".join(text + feedback for text, feedback in turns)

class Feedback:
    """The tool set of --turns T episodes (env.run_episodes runs it), and of single-turn sampling (T =
    1): after an attempt the harness runs the docstring's examples, and if one fails the next turn
    reads render_feedback's text. The hidden tests judge every attempt in the background (the
    self-repair curve; finish collects the verdicts), so the loop generates on meanwhile; the reward is
    the last attempt's. An episode ends when its attempt passes the examples, when T is spent, or when
    the task has none."""
    stop_tokens = ()

    def __init__(self, turns, fractional=False):
        self.max_turns, self.fractional = turns, fractional
        self.wait_s = 0.0   # seconds finish waited for the sandbox after the sampling (RL's timing split)

    def prompt(self, task):
        return render_prompt(task)

    def start(self, task, e):
        e.state["pending"] = []     # (the hidden tests' batch, this episode's row in it) per attempt

    def feed_ids(self, tok, text):
        return tok.encode(text)

    def fit(self, tok, task, e, x, feed, used, prompt, seq_len, max_new_tokens):
        return keep_context(e, feed, used, seq_len - max_new_tokens)

    def step(self, tok, pool, items, more):
        codes = [x.completion for _, _, x in items]
        # every attempt judged by the hidden tests, in the background
        hidden = pool.submit_batch(runs([t for t, _, _ in items], codes), self.fractional)
        visible = {id(t): visible_task(t) for t, _, _ in items} if more else {}   # a task's G rows share it
        check = [(k, v) for k, (t, _, _) in enumerate(items) if (v := visible.get(id(t))) is not None]
        done = pool.run_batch(runs([v for _, v in check], [codes[k] for k, _ in check])) if check else []
        seen = dict(zip([k for k, _ in check], done))
        out = []
        for k, (task, e, x) in enumerate(items):
            e.state["pending"].append((hidden, k))
            v = seen.get(k)
            x.visible_passed = None if v is None else v.passed          # None: not run (last turn)
            if v is not None and v.outcome == "sandbox_error":         # the harness failed, not the model:
                e.state["lost"] = v                                     # the episode is not scored
            out.append(None if v is None or v.passed or v.outcome == "sandbox_error"
                       else render_feedback(task, v, x.text))
        return out

    def finish(self, pool, items):
        t0 = time.time()
        for _, e in items:
            e.results = [batch.result()[k] for batch, k in e.state.pop("pending")]
            e.result = e.state.pop("lost", e.results[-1])
        self.wait_s += time.time() - t0


# ----------------------------------------------------------------------------- tools (the agent)
# The report's central idea: the agent is trained in the harness it is used in, reading, editing and
# testing a repository through tools. One action per turn (mini-swe-agent), written between special
# tokens with a raw payload (nanochat's tool use): <|read|>config.py<|end|>, then the observation is
# fed between <|obs|> and <|/obs|>, never a target. A malformed action is answered with a one-line
# error the model reads, never a crash. The repository is the episode's own in-memory copy, a dict
# {path: text}: a path can only name one of its files, so nothing outside it is ever read or written
# ("..", absolute paths, anything not listed are refused with an error); tests run in the sandbox on
# a copy of it made for that run (repo_program). The judge runs the task's hidden tests, which only
# it holds, on the agent's modules; the visible test file is left out, so editing it changes nothing.

ACTIONS = ("ls", "read", "grep", "run", "edit", "test", "submit")   # each <|name|> payload <|end|>
OBS_CHARS = 1500          # an observation's cap: its head and tail are kept (a file, a test run's output)
MAX_FILE_CHARS = 20_000   # an edit that would make a file longer is refused
GREP_LINES = 20           # grep's matches shown
RUN_CHARS = 400           # a run's value shown (its repr's head)


def cap(text, n=OBS_CHARS):
    """At most n characters, a capped text its own cap: the head, the tail, how much was cut between."""
    if len(text) <= n:
        return text
    keep = n - 40                  # the note between them takes at most 40 characters
    return text[:keep // 2] + f"\n... ({len(text) - keep} characters cut) ...\n" + text[-(keep - keep // 2):]


def render_issue(task, files=()) -> str:
    """The issue, then (the oracle's prompt) the named files in full, each after a `# file: PATH` line:
    the head of an episode's prompt (Tools.prompt adds the file list; the model's first action follows)."""
    inline = "".join(f"# file: {p}\n{task.files[p]}" + ("" if task.files[p].endswith("\n") else "\n")
                     for p in files)
    return f"# Issue\n{task.issue.strip()}\n{inline}"


def check_path(repo, path):
    """The path if it names a file of the episode's repository, else a one-line error (ValueError)."""
    path = path.strip()
    if not path:
        raise ValueError("error: no path given")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise ValueError(f"error: {path[:80]!r}: only paths relative to the repository are allowed")
    if any(part in ("..", ".") for part in path.split("/")):
        raise ValueError(f"error: {path[:80]!r}: '..' and '.' are refused")
    if path not in repo:
        raise ValueError(f"error: no file {path[:80]!r} (ls lists the files)")
    return path


def replace_function(source, definition, path="the file"):
    """`source` with its top-level function of the same name as `definition` (one whole `def`)
    replaced by it; ValueError with a one-line message if the definition is too long, is not one
    function, names none of the file's, or the result does not parse (the size is checked before any
    parsing: megabytes of statements would cost gigabytes of syntax tree). Line ends become "\n"
    (ast's line numbers count only \n, \r\n and \r: str.splitlines would also split at a form feed or
    U+2028 and splice the wrong lines)."""
    if len(definition) > MAX_FILE_CHARS:
        raise ValueError(f"error: the definition is longer than {MAX_FILE_CHARS} characters")
    definition = textwrap.dedent(definition.replace("\r\n", "\n").replace("\r", "\n")).strip("\n") + "\n"
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    try:
        new = parse(definition).body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"error: the definition does not parse: {getattr(e, 'msg', type(e).__name__)}{line}")
    if len(new) != 1 or not isinstance(new[0], ast.FunctionDef):
        raise ValueError("error: an edit is the path on its first line, then one whole `def` of a function")
    name = new[0].name
    try:
        old = [n for n in parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ValueError(f"error: {path} does not parse")
    if not old:
        raise ValueError(f"error: no function {name!r} in {path}")
    first = min([old[-1].lineno] + [d.lineno for d in old[-1].decorator_list])
    lines = source.split("\n")
    out = "\n".join(lines[:first - 1] + [definition.removesuffix("\n")] + lines[old[-1].end_lineno:])
    if len(out) > MAX_FILE_CHARS:
        raise ValueError(f"error: {path} would exceed {MAX_FILE_CHARS} characters")
    try:
        parse(out)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ValueError(f"error: {path} would not parse after the edit")
    return out, name


def parse_action(tok, tokens):
    """The sampled ids of one turn -> (action, payload text). ValueError (a one-line error the model
    reads) unless they are one action token, a raw payload without special tokens, and <|end|>."""
    ids, end = tok.tool_ids, tok.tool_ids["<|end|>"]
    names = {ids[f"<|{a}|>"]: a for a in ACTIONS}
    if not tokens or tokens[0] not in names:
        raise ValueError("error: an action starts with " + ", ".join(f"<|{a}|>" for a in ACTIONS))
    if tokens[-1] != end:
        raise ValueError("error: the action was not closed by <|end|>")
    body = tokens[1:-1]
    if len(tok.text_ids(body)) != len(body):
        raise ValueError("error: one action per turn, and no special token inside it")
    return names[tokens[0]], tok.decode(body)


# A run of repository code in the sandbox (a sandbox.Run): the program builds the repository's
# modules in memory (the child is chrooted into an empty directory and cannot import from disk), from
# the files as string literals, so no file's text can break out of them; its entry point is then
# called on each input.

_LOADER = """
import sys as _sys
import _frozen_importlib as _fi
class _RepoFinder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        base = name.replace(".", "/")
        for file, package in ((base + ".py", False), (base + "/__init__.py", True)):
            if file in _FILES:
                spec = _fi.ModuleSpec(name, cls, origin=file, is_package=package)
                spec.has_location = False
                return spec
    @staticmethod
    def create_module(spec):
        return None
    @staticmethod
    def exec_module(module):
        file = module.__spec__.origin
        exec(compile(_FILES[file], file, "exec"), module.__dict__)
_sys.meta_path.insert(0, _RepoFinder)
"""


def repo_program(files, tail):
    return f"_FILES = {dict(files)!r}\n{_LOADER}{tail}\n"


def visible_run(task, repo):
    """The visible tests of the agent's copy as a Run (each test_* function of its test file, one
    call each), or a one-line error (ValueError) when the file holds none."""
    try:
        names = [n.name for n in parse(repo[task.test_file]).body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        names = []
    if not names:
        raise ValueError(f"error: {task.test_file} holds no test function")
    program = repo_program(repo, _TESTS.format(module=task.test_file.removesuffix(".py")))
    return Run(task.task_id + "/visible", program, "run_test", [[n] for n in names], [None] * len(names))


# A visible test passes when its function returns; a failure comes back as its message (the test's own
# words: `f(3) returned 5, expected 6`), for the agent to read. This runs in the candidate's process, so
# its code can make a test look passed: the agent may fool only itself, the judge is hidden_run.
_TESTS = """
import {module} as _tests
def run_test(name):
    try:
        getattr(_tests, name)()
    except BaseException as e:
        why = str(e) if isinstance(e, AssertionError) and str(e) else type(e).__name__ + ": " + str(e)
        return why[:300]
"""

# `run EXPR`: the expression's value over the repository's modules (every public name of every top-level
# module), as its repr, or the exception with the last three frames of its traceback (file, line,
# function: where a search goes next).
_RUN = """
def run_expr(expr):
    try:
        names = {}
        for f in sorted(_FILES):
            if f.endswith(".py") and "/" not in f:
                names.update({k: v for k, v in vars(__import__(f[:-3])).items() if not k.startswith("_")})
        return repr(eval(expr, names))[:%d]
    except BaseException as e:
        frames, tb = [], e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            frames.append('  File "%%s", line %%d, in %%s' %% (code.co_filename, tb.tb_lineno, code.co_name))
            tb = tb.tb_next
        why = type(e).__name__ + ": " + str(e)[:200]
        return "\\n".join(["Traceback (most recent call last):"] + frames[-3:] + [why])
""" % RUN_CHARS


def expr_run(task, repo, expr):
    """`run EXPR` as a Run in the sandbox: its one case returns the text the agent reads."""
    if not expr.strip():
        raise ValueError("error: run needs an expression, e.g. <|run|>f([1, 2])<|end|>")
    return Run(task.task_id + "/run", repo_program(repo, _RUN), "run_expr", [[expr.strip()]], [None])


def grep(repo, pattern):
    """Every line of the repository that holds `pattern`, as `path:line: text`, in path order: at most
    GREP_LINES, then how many more. A plain string, not a regular expression: no pattern can make it
    slow (a regex would run the agent's backtracking in this process)."""
    if not pattern.strip():
        raise ValueError("error: grep needs a pattern, e.g. <|grep|>def total<|end|>")
    hits = [f"{p}:{n}: {line.strip()[:100]}" for p in sorted(repo) for n, line in
            enumerate(repo[p].split("\n"), 1) if pattern in line]
    if not hits:
        return f"no line holds {pattern[:80]!r}"
    more = f"\n... ({len(hits) - GREP_LINES} more)" if len(hits) > GREP_LINES else ""
    return "\n".join(hits[:GREP_LINES]) + more


def hidden_run(task, repo):
    """The judge: the task's hidden tests (held by the task, never in any file) on the agent's modules,
    without its test file. A project with no hidden tests (agent.py --repo) is judged by its own test
    file as it was before the episode, whatever the agent did to its copy."""
    if task.inputs is None:
        return visible_run(task, {**repo, task.test_file: task.files[task.test_file]})
    files = {p: t for p, t in repo.items() if p != task.test_file}
    program = repo_program(files, f"from {task.module} import {task.entry_point} as _judged")
    return Run(task.task_id, program, "_judged", task.inputs, task.outputs)


def action_ids(tok, name, payload):
    """An action's ids as the model writes them: <|name|>, the raw payload, <|end|> (parse_action)."""
    return [tok.tool_ids[f"<|{name}|>"]] + tok.encode(payload) + [tok.tool_ids["<|end|>"]]


def action_segments(name, payload):
    """An action as a transcript's pieces (text, context?, special?): what parse_action reads."""
    return [(f"<|{name}|>", False, True), (payload, False, False), ("<|end|>", False, True)]


def observation_segments(text):
    """An observation as a transcript's pieces: Tools.feed_ids's tokens, context only."""
    return [("<|obs|>", True, True), (text, True, False), ("<|/obs|>", True, True)]


def test_report(result, names=()):
    """A visible test run as the agent reads it: the counts, then each failing test's name and its
    message (what it called, got and expected), or why the run stopped (a timeout, a module that does
    not load)."""
    if result.outcome == "sandbox_error":
        return "error: the test run failed in the harness; run the tests again"
    head = f"{result.n_passed} passed, {result.n_tests - result.n_passed} failed"
    failed = [f"{n}: {v}" for n, v in zip(names, result.values) if isinstance(v, str)]
    return head if result.passed else cap("\n".join([head] + (failed or [result.feedback])))


def run_report(result):
    """A `run` as the agent reads it: the value (or the traceback) the expression gave, or why it stopped."""
    if result.outcome == "sandbox_error":
        return "error: the run failed in the harness; run it again"
    value = result.values[0] if result.values else None
    # cut here again: the cut in the candidate's process runs its code (a str subclass slices as it likes)
    return value[:RUN_CHARS] if isinstance(value, str) else f"error: {result.feedback}"


# Self-summarization (Composer 2): a long episode is a chain of generations joined by summaries the
# model writes itself. When an episode's context passes a threshold (summary_at, drawn per task), the
# harness feeds the request <|summary|> after the observation; the model writes a summary of at most
# SUMMARY_TOKENS, closed by <|end|>, and the episode goes on from a fresh context: the prompt, the actions
# left (LEFT) and the latest summary alone (as sampled, fed: one state, as MEM1 keeps). The reward at the
# chain's end reaches every segment (rl.algo.segments): RL reinforces summaries that keep what it needs.
SUMMARY_TOKENS = 96       # a summary's cap: summary_text's state of two numbers and two functions fits
LEFT = "actions left: {}\n"   # after the prompt in every fresh context (summary, mask, window, oracle)
SUMMARY_MIN = 16          # fewer tokens left in the window: the request comes without the observation
# The long tasks' (data/repos.py) context window, and (summary_at) its threshold at 45-55% of it,
# 288-352 tokens. With the cpu tokenizer the issue and a read of both settings files (640 characters each)
# are 571+ tokens on test seeds 11 and 23: no memory holds both numbers at once in the window less a
# turn's generation (a window or a mask must use the first before it reads the second), and the teacher's
# whole episode needs a median 910 tokens on seed 11, 1.4x the window (eval.py: long/full_tokens_p50).
LONG_WINDOW = 640
LONG_ACTIONS = 16         # a long task's step limit: two settings reads more than a short one's, and rereads


def fact_retention(task, e):
    """(needed facts read before a summary, those of them it keeps): for each summary of episode e,
    every fact of task.facts whose file the episode read before it, and whether one line of its text
    states both the fact's label (N1) and its value, as a whole number (what a later edit must write)."""
    read, actions, n, kept = set(), iter(e.actions), 0, 0
    for t in e.turns:
        if t.summary:   # the label, within a few characters its value, sign included: 'N1 = 16', 'N1: -3'
            seen = [f for f in task.facts if f["file"] in read]   # (not 'N1 = 160', 'N1 = -16' for 16)
            states = lambda f: re.search(rf"\b{f['label']}\b[^\d\n-]{{0,6}}(?<![\d-])"
                                         rf"{re.escape(str(f['value']))}(?![\d.])", t.text) is not None
            n, kept = n + len(seen), kept + sum(map(states, seen))
            continue
        a = next(actions)
        if a.name == "read" and not a.error:
            read.add(a.path)
    return n, kept


def summary_ids(tok, tokens, e):
    """A summary's ids as the fresh context will hold them: as sampled, when only its text and the
    closing <|end|> are there. A special token inside (<|obs|>4 passed<|/obs|>, an action) is a format
    error, as in an action (it counts towards max_errors), and only the text before it is kept: nothing
    the model writes re-enters the context as a token of the harness."""
    end = tok.tool_ids["<|end|>"]
    body = tokens[:-1] if tokens and tokens[-1] == end else tokens
    bad = next((k for k, t in enumerate(body) if not tok.text_ids([t])), None)
    if bad is None:
        return tokens
    e.errors += 1
    return body[:bad] + [end]


UNFINISHED = ("step_limit", "over_cap", "format_errors", "context")   # outcomes of episodes without a submit
MEMORIES = ("summary", "mask", "window", "oracle")   # oracle: eval's ceiling, the summary the task needs
MASKED = "(dropped)"      # mask's placeholder for an old observation
REBUILD_ROOM = 128        # what a rebuilt context leaves of the window for the next action (eval's cap on
                          # an action; RL's is 96): the same budget in the bootstrap, RL and the eval


def summary_text(task, actions):
    """The summary a long task needs, a state to restart from (data/search.restart, the bootstrap's
    teacher, goes on from its lines alone), written by the harness (memory "oracle") and the bootstrap
    from the episode's reads and edits: each needed number read, `N1 = 3 (config.py)`; each one a file
    read places, `N2 in constants.py`; each function to fix whose module was read, its signature and
    docstring line, `fix longer in lists.py: longer(words) Keep only the words longer than N2 characters.`,
    or once edited, `fixed longer in lists.py`."""
    read = [a.path for a in actions if a.name == "read" and not a.error]
    edited = {(a.path, a.function) for a in actions if a.name == "edit" and not a.error}
    seen = "".join(task.files[p] for p in read)
    facts = [f"{f['label']} = {f['value']!r} ({f['file']})" if f["file"] in read else
             f"{f['label']} in {f['file']}" for f in task.facts
             if f["file"] in read or f"{f['label']}: the value set in {f['file']}" in seen]
    # a function's def line and its docstring's line, less the note
    doc = lambda p, f: re.search(rf'^def ({f}\(.*\)):\n +"""(.*?)(?: \(\w+: the value set in [\w/.]+\))?'
                                 r'\.?(?:"""|$)', task.files[p], re.M)
    todo = [f"fixed {f} in {p}" if (p, f) in edited else
            "fix {} in {}: {} {}.".format(f, p, *doc(p, f).groups())
            for p, f in task.targets if p in read or (p, f) in edited]
    return "\n".join(facts + todo) or "nothing read yet"


def long_tools(memory="summary"):
    """The harness of long tasks: a memory of MEMORIES in LONG_WINDOW tokens (the agent's is the one it
    was trained with: train_rl.py --memory), or None (the whole context of the model: what a
    full-context episode would need, eval.py's long/full_tokens_p50)."""
    return Tools(max_actions=LONG_ACTIONS, memory=memory, window=LONG_WINDOW if memory else None)


def summary_at(task, window):
    """The context length (tokens) past which an episode of `task` summarises, or drops turns: between
    45% and 55% of the window, drawn from the task's id, so every episode of a group shares it."""
    return int(window * random.Random(f"summary/{task.task_id}").uniform(0.45, 0.55))


def keep_context(e, feed, used, room):
    """The plain context policy: the observation joins the context while room (the tokens before the
    next turn's generation budget) is left, else the episode ends ("context")."""
    if used + len(feed) <= room:
        return feed, False, None
    e.end = "context"
    return None


class Tools:
    """The repository agent's tool set (env.run_episodes runs it): ls, read, grep, run, edit, test,
    submit on the episode's own copy of the task's files. actions: the ones allowed (eval's no_run
    baseline has no test or run); inline: files written into the prompt (eval's oracle: all);
    max_actions, max_errors: an episode ends at either (a step limit, a limit on format errors).
    memory: how an episode goes on when its context passes the threshold of its window of tokens
    (summary_at): None, it goes on until the model's context is full, then ends; "summary", the
    summary turn, at most max_summaries times (then it ends: "summary_cap"; 5: the bootstrap's teacher
    needs up to 3 in a 640-token window as the cpu preset counts, 5 with a coarser tokenizer); "mask" and
    "window", the context is rebuilt (rebuild); "oracle", the harness writes the summary (eval's
    ceiling)."""
    stop_tokens = ("<|end|>",)

    def __init__(self, actions=ACTIONS, max_actions=12, max_errors=2, inline=False, memory=None, window=None,
                 max_summaries=5):
        if memory not in (None,) + MEMORIES or (memory and not window):
            raise ValueError(f"memory must be None or one of {MEMORIES} (with a window), got {memory!r}")
        self.actions, self.max_actions, self.max_errors = actions, max_actions, max_errors
        self.inline, self.memory, self.window = inline, memory, window
        self.max_summaries = max_summaries if memory in ("summary", "oracle") else 0
        self.max_turns = max_actions + self.max_summaries          # a summary turn is not an action

    def prompt(self, task):
        listed = "# Files\n" + " ".join(sorted(task.files)) + "\n"   # as a product harness shows it
        return render_issue(task, sorted(task.files) if self.inline else ()) + listed

    def start(self, task, e):
        e.repo, e.end = dict(task.files), "step_limit"
        e.state["stream"] = []      # each turn's (action, observation) ids, as fed: what mask and window keep
        e.state["rebuilds"] = 0

    def feed_ids(self, tok, text):
        return [tok.tool_ids["<|obs|>"]] + tok.encode(text) + [tok.tool_ids["<|/obs|>"]]

    def fit(self, tok, task, e, x, feed, used, prompt, seq_len, max_new_tokens):
        """What the episode's next turn feeds after turn x: (ids, fresh: they start a new context, no
        past; the most tokens that turn may keep, None: max_new_tokens), or None when it ends (e.end
        says why). feed: the observation's ids (env.next_feed); used: the ids in the row's context
        now; prompt: the task's prompt ids. Past the threshold (summary_at), by memory: the summary
        turn; "oracle", the harness writes the summary the task needs; "mask" and "window" rebuild the
        context (rebuild) within the window less REBUILD_ROOM."""
        if not self.memory:
            return keep_context(e, feed, used, seq_len - max_new_tokens)
        head = prompt + tok.encode(LEFT.format(self.max_actions - len(e.actions)))   # every fresh context's
        summary = lambda: head + [tok.tool_ids["<|summary|>"]] + e.summaries[-1]
        if x.summary:                 # a fresh context: the latest summary, as the model wrote it
            return summary(), True, None
        k = 0 if x.stopped else 1     # the action, then its observation: what mask's and window's rebuild use
        if self.memory in ("mask", "window"):
            e.state["stream"].append((x.tokens[:-1] + feed[:k], feed[k:]))
        window = min(self.window, seq_len)
        at = summary_at(task, window)
        if used + len(feed) <= at:
            return feed, False, None
        if self.memory in ("mask", "window"):
            e.state["rebuilds"] += 1
            return self.rebuild(tok, e, head, window - REBUILD_ROOM), True, None
        if len(e.summaries) >= self.max_summaries:
            e.end = "summary_cap"
            return None
        if self.memory == "oracle":   # the state the actions reached, as the bootstrap's summaries state it
            e.summaries.append(tok.encode(summary_text(task, e.actions)) + [tok.tool_ids["<|end|>"]])
            return summary(), True, None
        # the request after the observation; where that would leave the summary fewer than SUMMARY_MIN
        # tokens of the window, after the action alone (the observation is dropped)
        if used + len(feed) + 1 + SUMMARY_MIN > window:
            feed, e.blind = feed[:0 if x.stopped else 1], e.blind + 1
        e.state["summarizing"] = True
        limit = max(1, min(SUMMARY_TOKENS, window - used - len(feed) - 1))
        return feed + [tok.tool_ids["<|summary|>"]], False, limit

    def rebuild(self, tok, e, prompt, budget):
        """mask's and window's fresh context: `prompt` (fit's head), then the latest turns that fit in
        `budget` tokens, oldest dropped first. window: each turn whole (the agent's action and what it was
        answered); mask: every action whole, each observation but the last replaced by MASKED (JetBrains'
        observation masking, arXiv 2508.21433). e.state["context"]: which turns it holds, and masked."""
        pieces, dropped = e.state["stream"], self.feed_ids(tok, MASKED)
        kept, held, n = [], [], len(prompt)
        for i in range(len(pieces) - 1, -1, -1):
            action, obs = pieces[i]
            masked = self.memory == "mask" and i < len(pieces) - 1
            piece = action + (dropped if masked else obs)
            if n + len(piece) > budget:
                break
            kept, n = piece + kept, n + len(piece)
            held.insert(0, (i, masked))
        e.state["context"] = held
        return prompt + kept

    def step(self, tok, pool, items, more):
        """items: (task, episode, sample) of the turn's live rows. Each action is applied to its own
        episode's repository; the turn's test runs go to the sandbox in one batch. A malformed action
        (parse_action) is a format error; a tool's own error (a missing file, an edit that does not
        parse) is an observation like any other. Returns each row's observation (None: it is over)."""
        obs, todo = [], []
        for i, (task, e, x) in enumerate(items):
            if e.state.pop("summarizing", False):   # the summary turn: not an action, the episode goes on
                x.summary = True
                e.summaries.append(summary_ids(tok, x.tokens, e))
                obs.append("" if more and e.errors < self.max_errors else None)
                if e.errors >= self.max_errors:
                    e.end = "format_errors"
                continue
            act = Action()
            try:
                act.name, payload = parse_action(tok, x.tokens)
            except ValueError as err:
                e.errors += 1
                act.error, text = "format", str(err)
            else:
                try:
                    if act.name not in self.actions:
                        raise ValueError(f"error: <|{act.name}|> is not available here")
                    text, run = self.apply(task, e, act.name, payload, act)
                    todo += [(i, run, act.name)] if run else []
                except ValueError as err:
                    act.error, text = "tool", str(err)
            e.actions.append(act)
            if act.name == "submit" and not act.error:
                e.end, text = "submit", None
            elif e.errors >= self.max_errors:
                e.end, text = "format_errors", None
            elif not more or len(e.actions) >= self.max_actions:
                text = None                                  # the step limit: e.end stays "step_limit"
            obs.append(text)
        todo = [(i, run, name) for i, run, name in todo if obs[i] is not None]
        for (i, run, name), r in zip(todo, pool.run_batch([run for _, run, _ in todo])):
            obs[i] = test_report(r, [n for n, in run.inputs]) if name == "test" else run_report(r)
        return [cap(o) if o else o for o in obs]    # every observation, whatever tool or sandbox run wrote it

    def apply(self, task, e, name, payload, act):
        """One action on e.repo: (its observation, the sandbox run that makes it, or None); a test
        run's observation is its test_report, filled in after the turn's batch."""
        repo = e.repo
        if name == "ls":
            return "\n".join(sorted(repo)), None
        if name == "read":
            act.path = check_path(repo, payload)
            return cap(repo[act.path]), None
        if name == "grep":
            return grep(repo, payload), None
        if name == "edit":
            path, _, definition = payload.partition("\n")
            act.path = check_path(repo, path)
            repo[act.path], act.function = replace_function(repo[act.path], definition, act.path)
            if e.first_edit is None:
                e.first_edit = dict(repo)
            return f"replaced {act.function} in {act.path}", None
        if name == "test":
            return "", visible_run(task, repo)
        if name == "run":
            return "", expr_run(task, repo, payload)
        return "", None                               # submit: the episode is over

    def finish(self, pool, items):
        """The judge's verdict on each episode's final repository: its result. An episode that did not
        submit fails, whatever its repository holds: out of actions ("step_limit"), of summaries
        ("over_cap"; masking it instead lost: docs/notes.md), of well-formed actions ("format_errors")
        or of context ("context"). The hidden cases' values are not kept: nothing reads them, and a
        candidate's can decode to megabytes per episode."""
        results = pool.run_batch([hidden_run(t, e.repo) for t, e in items])
        for (_, e), r in zip(items, results):
            r = dataclasses.replace(r, values=())
            e.result = r if e.end == "submit" or r.outcome == "sandbox_error" else dataclasses.replace(
                r, reward=0.0, passed=False, outcome={"summary_cap": "over_cap"}.get(e.end, e.end))


# ----------------------------------------------------------------------------- the episode loop

# What an episode is made of: one record each, filled in by run_episodes and the tool set, read by RL
# (rl/rollouts.py, rl/algo.py), eval.py and agent.py. Nothing else sets a field.

@dataclasses.dataclass
class Turn:
    """One generation of an episode (as_sample): prompt_ids, the ids fed before it (the prompt, or the
    last turn's final token and the observation, or a fresh context); tokens, the ids sampled, the
    stop token included; logprobs, theirs under the sampling distribution; text, decoded without
    special tokens; completion, the text cut by extract_completion (what runs); stopped: it ended on
    end-of-text; prompt_truncated: the prompt lost its head (encode_prompts); routes: the experts of
    every id fed and sampled but the last (router replay); past: its keys/values (the loop's, while
    the episode runs). Then what followed: feedback, the observation fed after it ("" for the last);
    segment, which context it belongs to (a summary starts the next); summary: it is a summary turn;
    visible_passed: its attempt passed the visible examples (Feedback; None: not run)."""
    prompt_ids: list
    tokens: list
    logprobs: list
    text: str = ""
    completion: str = ""
    stopped: bool = False
    prompt_truncated: bool = False
    routes: object = None
    past: object = None
    feedback: str = ""
    segment: int = 0
    summary: bool = False
    visible_passed: bool | None = None


@dataclasses.dataclass
class Action:
    """One action of a tool episode (Tools.step): its name (None: malformed), the file it named, the
    function an edit replaced, and its error: "format" (malformed: a format error) or "tool" (the tool
    refused it: a missing file, an edit that does not parse); None: it worked."""
    name: str | None = None
    path: str | None = None
    function: str | None = None
    error: str | None = None


@dataclasses.dataclass
class Episode:
    """One episode of tasks[task_idx]: its turns and the judge's verdict (result: the hidden tests of
    the last attempt, or of the final repository). Feedback keeps results, every attempt's verdict;
    Tools keeps repo (the episode's own copy of the files), actions, errors (malformed actions), end
    (why it ended: submit, step_limit, format_errors, context, summary_cap), summaries (the ids of each
    summary as the next context holds them), blind (summaries requested without their observation)
    and first_edit (the repository after its first edit, eval.py's first_edit_pass); state is the tool
    set's scratch between turns. RL (rl/rollouts.py) labels group (the group it is ranked in);
    --repair-groups marks repair and repeat (it resubmits its root's code)."""
    task_idx: int
    turns: list = dataclasses.field(default_factory=list)
    result: Result | None = None
    results: list = dataclasses.field(default_factory=list)
    repo: dict | None = None
    actions: list = dataclasses.field(default_factory=list)
    errors: int = 0
    end: str = ""
    summaries: list = dataclasses.field(default_factory=list)
    blind: int = 0
    first_edit: dict | None = None
    state: dict = dataclasses.field(default_factory=dict)
    group: int = -1
    repair: bool = False
    repeat: bool = False


def run_episodes(model, tok, tasks, n, tools, pool, temperature, max_new_tokens, top_p=1.0, top_k=0,
                 batch_size=64, generator=None, return_routes=False, progress=False, prompts=None):
    """THE episode loop: RL, eval and agent.py run every rollout through it, one turn or many. n
    episodes per task, rows task by task (the n episodes of task i are contiguous, the group RL
    needs), batch_size rows at a time through all their turns. `tools` is the episode's tool set:
    Feedback(1), a single completion (the function tasks' single-turn sampling); Feedback(T), the
    docstring's examples after each attempt (--turns T); Tools, a repository worked through actions
    (the agent). The tool set writes the prompt, answers each turn (step: an observation, or None
    when the episode is over), says what the next turn feeds (fit: the observation, or a fresh
    context after a summary) and judges the ends (finish, once all is sampled: the sandbox runs in
    the background while the next batch generates).
    prompts: token ids per task to continue instead of the tool set's prompt (a repair's context).

    Each further turn continues the row's KV cache (sampling's past): the turn's last token (unless it
    was end-of-text) and the observation are fed on top of it, nothing is re-read, nothing is
    re-tokenised. An episode also ends when another turn would not fit the context. Each row draws
    from a random stream of its own (sampling.Streams, seeded from generator), continued turn after
    turn. Returns an Episode per row. The tokens a trainer scores are exactly those sampled:
    rl.algo.flatten joins each turn's prompt_ids and tokens back into this stream.
    This loop is the reference; its speed path, continuous batching (episodes_continuous), is chosen
    here, by sampling.continuous, and samples the same episodes."""
    if sampling.continuous(model, return_routes, tools.max_turns, len(tasks) * n, batch_size):
        return episodes_continuous(model, tok, tasks, n, tools, pool, temperature, max_new_tokens, top_p,
                                   top_k, batch_size, generator, return_routes, progress, prompts)
    prompts, truncated = episode_prompts(model, tok, tasks, tools, max_new_tokens, prompts)
    stop = [tok.eot_id] + [tok.tool_ids[t] for t in tools.stop_tokens]
    rows = [i for i in range(len(tasks)) for _ in range(n)]
    seeds = sampling.row_seeds(len(rows), generator) if temperature else None    # a random stream per row
    episodes, was_training = [], model.training
    model.eval()
    try:
        for s in tqdm(range(0, len(rows), batch_size), desc="episodes", disable=not progress, leave=False):
            chunk = rows[s:s + batch_size]
            eps = [Episode(i) for i in chunk]
            for e in eps:
                tools.start(tasks[e.task_idx], e)
            feeds, pasts, limits = {j: prompts[i] for j, i in enumerate(chunk)}, {}, {}   # row j's next turn
            segment = dict.fromkeys(feeds, 0)
            for turn in range(tools.max_turns):
                live, more = sorted(feeds), turn < tools.max_turns - 1
                if not live:
                    break
                drawn = [sum(len(x.tokens) for x in eps[j].turns) for j in live]    # each row's stream so far
                streams = sampling.Streams([seeds[s + j] for j in live], drawn) if seeds else None
                gens = sampling.generate(model, [feeds[j] for j in live], max_new_tokens,   # autocast inside
                                         temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop,
                                         generator=streams, return_routes=return_routes, return_past=more,
                                         past=[pasts[j] for j in live] if turn else None)
                samples = [as_sample(tok, cut(g, limits.get(j), len(feeds[j])), feeds[j],
                                     turn == 0 and truncated[chunk[j]]) for j, g in zip(live, gens)]
                old = {j: x.past for j, x in zip(live, samples)}
                feeds, pasts, limits = {}, {}, {}
                items = [(tasks[chunk[j]], eps[j], x) for j, x in zip(live, samples)]
                said = tools.step(tok, pool, items, more)     # the observations: what the tools answered
                for j, x, text in zip(live, samples, said):
                    eps[j].turns.append(x)
                    x.past, x.segment = None, segment[j]
                    if text is None:
                        continue
                    i = chunk[j]          # the tool set says what the next turn feeds (a fresh context?)
                    nxt = tools.fit(tok, tasks[i], eps[j], x, next_feed(tok, tools, x, text), old[j].size(3),
                                    prompts[i], model.config.seq_len, max_new_tokens)
                    if nxt is not None:
                        feeds[j], fresh, limits[j] = nxt
                        x.feedback, pasts[j] = text, old[j][:, :, :, :0] if fresh else old[j]
                        segment[j] += fresh
            episodes += eps
    finally:
        model.train(was_training)
    tools.finish(pool, [(tasks[e.task_idx], e) for e in episodes])   # the verdicts, once all is sampled
    return episodes


def episodes_continuous(model, tok, tasks, n, tools, pool, temperature, max_new_tokens, top_p=1.0, top_k=0,
                        batch_size=64, generator=None, return_routes=False, progress=False, prompts=None):
    """run_episodes by continuous batching (sampling.Rows): its speed path, with the same arguments and
    the same episodes (tests/test_episodes.py), but no row waits for another. A row whose action ends
    is answered by the tool set (step, with the rows that ended at the same token) and fed its
    observation while the others decode; a finished episode's place goes to the round's next one, at
    most batch_size at once. The rows are split, a task's rows together, into sampling's decode streams
    (two on CPU), each a loop of its own (continuous_share). Each row draws from its own random stream,
    seeded as run_episodes seeds it, so a token does not depend on the rows beside it; a turn with a
    limit (a summary's cap) stops there, as cut() keeps it."""
    prompts, truncated = episode_prompts(model, tok, tasks, tools, max_new_tokens, prompts)
    rows = [i for i in range(len(tasks)) for _ in range(n)]
    seeds = sampling.row_seeds(len(rows), generator) if temperature else [0] * len(rows)
    episodes = [Episode(i) for i in rows]
    k = sampling.n_streams(model, min(len(rows), batch_size))
    starts = [r for r in range(len(rows)) if r == 0 or rows[r] != rows[r - 1]]     # a task's first row
    bounds = sorted({min(starts, key=lambda b: abs(b - s * len(rows) // k)) for s in range(k)}) + [len(rows)]
    shares = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
              return_routes=return_routes,
              stop_ids=[tok.eot_id] + [tok.tool_ids[t] for t in tools.stop_tokens])
    was_training = model.training
    model.eval()
    try:
        with tqdm(total=len(rows), desc="episodes", disable=not progress, leave=False) as bar:
            def share(js):
                slots = max(1, -(-batch_size * len(js) // len(rows)))       # its part of the batch
                return continuous_share(model, tok, tasks, tools, pool, [episodes[j] for j in js], prompts,
                                        truncated, [seeds[j] for j in js], slots, kw, bar)
            sampling.side_by_side(model, share, shares)
    finally:
        model.train(was_training)
    tools.finish(pool, [(tasks[e.task_idx], e) for e in episodes])   # the verdicts, once all is sampled
    return episodes


def continuous_share(model, tok, tasks, tools, pool, episodes, prompts, truncated, seeds, slots, kw, bar):
    """One decode stream of episodes_continuous: these episodes through sampling.Rows, `slots` at once,
    each turn as run_episodes' loop makes it (the same step, fit, next_feed and as_sample)."""
    batch = sampling.Rows(model, slots, **kw)
    todo, feeds, limits, segment = list(range(len(episodes)))[::-1], {}, {}, {}
    while todo or len(batch):
        while todo and len(batch) < slots:            # a finished episode's place goes to the next one
            j = todo.pop()
            tools.start(tasks[episodes[j].task_idx], episodes[j])
            feeds[j], limits[j], segment[j] = prompts[episodes[j].task_idx], None, 0
            batch.feed(j, feeds[j], seed=seeds[j])
        ended = batch.step()
        more = {j: len(episodes[j].turns) < tools.max_turns - 1 for j, _ in ended}   # may a turn follow?
        for group in ([(j, g) for j, g in ended if more[j]], [(j, g) for j, g in ended if not more[j]]):
            if not group:
                continue
            samples = [as_sample(tok, g, feeds[j], not episodes[j].turns and truncated[episodes[j].task_idx])
                       for j, g in group]
            said = tools.step(tok, pool, [(tasks[episodes[j].task_idx], episodes[j], x)
                                          for (j, _), x in zip(group, samples)], more[group[0][0]])
            for (j, g), x, text in zip(group, samples, said):
                e, i, nxt = episodes[j], episodes[j].task_idx, None
                e.turns.append(x)
                x.segment = segment[j]
                # a turn stopped by its limit before a stop id is one that cut() cuts: no past follows it
                was_cut = limits[j] is not None and len(x.tokens) == limits[j] < kw["max_new_tokens"] and \
                    x.tokens[-1] not in kw["stop_ids"]
                if text is not None:
                    nxt = tools.fit(tok, tasks[i], e, x, next_feed(tok, tools, x, text),
                                    0 if was_cut else g["context"], prompts[i], model.config.seq_len,
                                    kw["max_new_tokens"])
                if nxt is not None:
                    feeds[j], fresh, limits[j] = nxt
                    x.feedback = text
                    segment[j] += fresh
                if nxt is None or len(e.turns) == tools.max_turns:
                    batch.leave(j)
                    bar.update()
                else:
                    batch.feed(j, feeds[j], fresh=fresh or was_cut, limit=limits[j])
    return episodes


def episode_prompts(model, tok, tasks, tools, max_new_tokens, prompts=None):
    """The episode loops' prompts and whether each was cut: the tool set's, encoded (encode_prompts),
    or the ids given per task (a repair's context)."""
    if prompts is None:
        return encode_prompts(model, tok, tasks, max_new_tokens, tools.prompt)
    if len(prompts) != len(tasks):
        raise ValueError(f"{len(prompts)} prompts for {len(tasks)} tasks")
    return prompts, [False] * len(prompts)


def cut(g, limit, n_fed):
    """A generate() output kept to its first `limit` tokens (a summary's cap, Tools.fit): the same
    as if generation had stopped there (the tokens after it are never seen); its routes are those of
    the n_fed ids fed and the kept tokens but the last. None, or a shorter output: unchanged."""
    if limit is None or len(g["tokens"]) <= limit:
        return g
    out = {**g, "tokens": g["tokens"][:limit], "logprobs": g["logprobs"][:limit]}
    if "routes" in g:
        out["routes"] = g["routes"][:, :n_fed + limit - 1].clone()
    if "past" in g:                  # nothing continues a summary's cache (a fresh context follows)
        out["past"] = g["past"][:, :, :, :0]
    return out


def next_feed(tok, tools, turn, text):
    """The ids the next turn feeds on top of `turn`'s cache, which holds its prompt_ids + tokens[:-1]:
    its last token, unless that was end-of-text (a turn cut by max_new_tokens, or one that ended on
    <|end|>, feeds it now), then the observation as the tool set writes it."""
    return ([] if turn.stopped else turn.tokens[-1:]) + tools.feed_ids(tok, text)


def encode_prompts(model, tok, tasks, max_new_tokens, render=render_prompt):
    """Each task's prompt as token ids, and whether it was cut. A prompt longer than the context minus
    the generation budget keeps its END (the signature and docstring to continue sit at the end;
    HumanEval's imports and helpers come first), but never less than half the context: past seq_len,
    RoPE positions the model never trained on cost less than a prompt cut to nothing. Rare with the
    env tasks; flagged per sample."""
    max_prompt = max(model.config.seq_len - max_new_tokens, model.config.seq_len // 2)
    full = [tok.encode(render(t)) for t in tasks]
    return [p[-max_prompt:] for p in full], [len(p) > max_prompt for p in full]


def as_sample(tok, g, prompt_ids, prompt_truncated=False):
    """One generate() output -> a Turn: the ids fed before it, the ids sampled (the stop token
    included), their log-probs, the text decoded and cut, and routes / past when generate returned
    them."""
    tokens = list(g["tokens"])
    # special ids (pad; any id of a model vocab padded beyond the tokenizer's) have no text: they
    # are dropped from the decoded text, not an error
    text = tok.decode(tok.text_ids(tokens))
    return Turn(prompt_ids, tokens, list(g["logprobs"]), text, extract_completion(text),
                stopped=bool(tokens) and tokens[-1] == tok.eot_id, prompt_truncated=prompt_truncated,
                routes=g.get("routes"), past=g.get("past"))


def repair_prompt(tok, task, attempt, seen):
    """Every id the second turn after a failed first `attempt` (a Turn) reads: what run_episodes'
    cache holds then, as one prompt (train_rl.py --repair-groups samples G repairs from it)."""
    text = render_feedback(task, seen, attempt.text)
    return attempt.prompt_ids + attempt.tokens[:-1] + next_feed(tok, Feedback(2), attempt, text)


def resubmits(attempt, previous):
    """Does `attempt` resubmit the `previous` attempt's code unchanged (up to trailing whitespace): a
    try that ignored the feedback? eval.py's repeat rate and --repair-groups' "repeat" both count it."""
    return attempt.completion.rstrip() == previous.completion.rstrip()


HACK_PATTERNS = {  # suspicious constructs, counted in RL logs (the sandbox scores them 0 anyway)
    "exit": r"\bsys\s*\.\s*exit\b|\bos\s*\.\s*_exit\b|(?<![\w.])(exit|quit)\s*\(",
    "atexit": r"\batexit\b", "excepthook": r"excepthook",
    "eq_override": r"\bdef\s+__(eq|ne|hash|bool|str|repr)__\b",
    "frame_walk": r"_getframe|\bf_back\b|\bf_locals\b|\bf_globals\b|\binspect\b|__traceback__|tb_frame",
    "gc": r"\bgc\s*\.\s*get_|\bimport\s+gc\b", "signal": r"\bsignal\b|\bos\s*\.\s*kill",
    "subprocess": r"\bsubprocess\b|\bos\s*\.\s*(system|popen|fork|exec\w*|spawn\w*)\b|\bmultiprocessing\b",
    "builtins": r"__builtins__|\bbuiltins\b|__import__|\bimportlib\b|__class__|__subclasses__",
    "skip_test": r"SkipTest|\bpytest\b|\bunittest\b", "eval_exec": r"(?<![\w.])(eval|exec|compile)\s*\(",
    "file_io": r"(?<![\w.])open\s*\(|\bos\s*\.\s*(remove|unlink|chmod|rmdir)|\bshutil\b",
    "env": r"\benviron\b|\bgetenv\b", "network": r"\bsocket\b|\burllib\b|\bhttp\b|\brequests\b",
    "ctypes": r"\bctypes\b", "print": r"(?<![\w.])print\s*\(",
}
_HACK_RE = {k: re.compile(v) for k, v in HACK_PATTERNS.items()}

def hack_counts(completion: str) -> dict[str, int]:
    return {k: len(p.findall(completion)) for k, p in _HACK_RE.items()}

