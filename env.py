"""env.py: the environment of RL and eval: the prompt harness, and a sandbox that runs model code.

One module shared by train_rl.py and eval.py, so the model is trained in the same harness it is
evaluated in (Composer 2 report, "harness parity"). Two parts:
  1. Harness: render_prompt -> model writes the function BODY -> extract_completion -> build_program;
     for multi-step episodes the visible examples, the feedback after a failed one, and the context
     (render_episode). The tasks themselves live in data/tasks.py; sampling in infra/engine.py.
  2. Sandbox: `SandboxPool`, warm workers (infra/sandbox_worker.py) that run each candidate in a
     fresh, locked-down child forked from a pristine zygote; the judge of I/O tasks is THIS process,
     the judge of assert tests a separate process; what came back becomes a Result, the reward.

    with env.SandboxPool(timeout_s=2.0) as pool:
        results = pool.run_batch(tasks, completions)      # [Result(reward, passed, outcome, ...)]
    python -m data.tasks check --split test --n 200       # reference solutions through the sandbox
No torch here: the sandbox workers must stay small and the trainer must not import them.
"""
import ast
import collections
import concurrent.futures
import dataclasses
import io
import json
import math
import os
import queue
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import tokenize
import warnings

from infra.cli import die
from infra.sandbox_worker import BadValue, encode, remove_tree, unpack

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

def corpus_text(task) -> str:
    """A solved task for the pretraining corpus (the caller appends end-of-text)."""
    if task.solution is None:
        raise ValueError(f"task {task.task_id} has no solution")
    return render_prompt(task) + task.solution

# ----------------------------------------------------------------------------- episodes (multi-turn)
# The agentic loop in miniature (Composer 2 trains "in the same harness" the deployed model works in):
# write the body, run the docstring's examples (the only tests the model can see), read what failed,
# write the body again. The hidden tests decide the reward and never appear in feedback.

def _entry_def(task):
    """The prompt's `def` of the entry point as an AST node (None if the prompt does not parse)."""
    try:
        return next(n for n in ast.walk(ast.parse(render_prompt(task) + "    pass\n"))
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
        try:
            call = ast.parse(source[4:], mode="eval").body
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == task.entry_point and not call.keywords):
                out.append(([ast.literal_eval(a) for a in call.args], ast.literal_eval(want)))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            continue
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
    the model wrote and the feedback that followed it ("" for the last). The sampler (infra/engine.py)
    feeds the same text as tokens; the pretraining repair transcripts are rendered by this too."""
    return render_prompt(task) + "".join(text + feedback for text, feedback in turns)

class Feedback:
    """The tool set of --turns T episodes (engine.run_episodes runs it), and of single-turn sampling (T =
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

    def start(self, task):
        return {"pending": []}

    def feed_ids(self, tok, text):
        return tok.encode(text)

    def fit(self, tok, task, e, x, feed, used, prompt, seq_len, max_new_tokens):
        return keep_context(e, feed, used, seq_len - max_new_tokens)

    def step(self, tok, pool, items, more):
        codes = [x["completion"] for _, _, x in items]
        hidden = pool.submit_batch([t for t, _, _ in items], codes, self.fractional)   # every attempt judged
        visible = {id(t): visible_task(t) for t, _, _ in items} if more else {}   # a task's G rows share it
        check = [(k, v) for k, (t, _, _) in enumerate(items) if (v := visible.get(id(t))) is not None]
        runs = pool.run_batch([v for _, v in check], [codes[k] for k, _ in check]) if check else []
        seen = dict(zip([k for k, _ in check], runs))
        out = []
        for k, (task, e, x) in enumerate(items):
            e["pending"].append((hidden, k))
            v = seen.get(k)
            x["visible_passed"] = None if v is None else v.passed       # None: not run (last turn)
            if v is not None and v.outcome == "sandbox_error":         # the harness failed, not the model:
                e["lost"] = v                                           # the episode is not scored
            out.append(None if v is None or v.passed or v.outcome == "sandbox_error"
                       else render_feedback(task, v, x["text"]))
        return out

    def finish(self, pool, items):
        t0 = time.time()
        for _, e in items:
            e["results"] = [batch.result()[k] for batch, k in e.pop("pending")]
            e["result"] = e.pop("lost", e["results"][-1])
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

ACTIONS = ("ls", "read", "edit", "test", "submit")     # each opened by its token <|name|>, closed by <|end|>
OBS_CHARS = 1500          # an observation's cap: its head and tail are kept (a file, a test run's output)
MAX_FILE_CHARS = 20_000   # an edit that would make a file longer is refused


def cap(text, n=OBS_CHARS):
    """At most about n characters: the head and the tail, and how much was cut between them."""
    if len(text) <= n:
        return text
    cut = len(text) - n
    return text[:n // 2] + f"\n... ({cut} characters cut) ...\n" + text[-(n - n // 2):]


def render_issue(task, files=()) -> str:
    """The text an episode starts from: the issue, then (the oracle's prompt) the named files in full,
    each after a `# file: PATH` line. The model's first action follows."""
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
    replaced by it; ValueError with a one-line message if the definition is not one function, names
    none of the file's, or the result does not parse. Line ends become "\n" (ast's line numbers count
    only \n, \r\n and \r: str.splitlines would also split at a form feed or U+2028 and splice the
    wrong lines)."""
    definition = textwrap.dedent(definition.replace("\r\n", "\n").replace("\r", "\n")).strip("\n") + "\n"
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    try:
        new = ast.parse(definition).body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"error: the definition does not parse: {getattr(e, 'msg', type(e).__name__)}{line}")
    if len(new) != 1 or not isinstance(new[0], ast.FunctionDef):
        raise ValueError("error: an edit is the path on its first line, then one whole `def` of a function")
    name = new[0].name
    try:
        old = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
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
        ast.parse(out)
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
    if any(t >= tok.eot_id for t in body):
        raise ValueError("error: one action per turn, and no special token inside it")
    return names[tokens[0]], tok.decode(body)


# A run of repository code in the sandbox: the program builds the repository's modules in memory (the
# child is chrooted into an empty directory and cannot import from disk), from the files as string
# literals, so no file's text can break out of them; `entry` is then called on each input.
RepoRun = collections.namedtuple("RepoRun", "task_id program entry_point inputs outputs")

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
    """The visible tests of the agent's copy as a RepoRun (each test_* function of its test file, one
    call each), or a one-line error (ValueError) when the file holds none."""
    try:
        names = [n.name for n in ast.parse(repo[task.test_file]).body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        names = []
    if not names:
        raise ValueError(f"error: {task.test_file} holds no test function")
    module = task.test_file.removesuffix(".py")
    call = f"import {module} as _tests\ndef run_test(name):\n    getattr(_tests, name)()"
    program = repo_program(repo, call)
    return RepoRun(task.task_id + "/visible", program, "run_test", [[n] for n in names], [None] * len(names))


def hidden_run(task, repo):
    """The judge: the task's hidden tests (held by the task, never in any file) on the agent's modules,
    without its test file. A project with no hidden tests (agent.py --repo) is judged by its own test
    file as it was before the episode, whatever the agent did to its copy."""
    if task.inputs is None:
        return visible_run(task, {**repo, task.test_file: task.files[task.test_file]})
    files = {p: t for p, t in repo.items() if p != task.test_file}
    program = repo_program(files, f"from {task.module} import {task.entry_point} as _judged")
    return RepoRun(task.task_id, program, "_judged", task.inputs, task.outputs)


def action_ids(tok, name, payload):
    """An action's ids as the model writes them: <|name|>, the raw payload, <|end|> (parse_action)."""
    return [tok.tool_ids[f"<|{name}|>"]] + tok.encode(payload) + [tok.tool_ids["<|end|>"]]


def action_segments(name, payload):
    """An action as a transcript's pieces (text, context?, special?): what parse_action reads."""
    return [(f"<|{name}|>", False, True), (payload, False, False), ("<|end|>", False, True)]


def observation_segments(text):
    """An observation as a transcript's pieces: Tools.feed_ids's tokens, context only."""
    return [("<|obs|>", True, True), (text, True, False), ("<|/obs|>", True, True)]


def test_report(result):
    """A visible test run as the agent reads it."""
    if result.outcome == "sandbox_error":
        return "error: the test run failed in the harness; run the tests again"
    head = f"{result.n_passed} passed, {result.n_tests - result.n_passed} failed"
    return head if result.passed else f"{head}\n{result.feedback}"


# Self-summarization (Composer 2): a long episode is a chain of generations joined by summaries the
# model writes itself. When an episode's context passes a threshold (summary_at, drawn per task), the
# harness feeds the request <|summary|> after the observation; the model writes a summary of at most
# SUMMARY_TOKENS, closed by <|end|>, and the episode goes on from a fresh context: the issue and every
# summary so far (the model's own sampled ids, fed). The reward at the chain's end reaches every
# segment (rl.algo.segments), so RL reinforces summaries that keep what the rest of the episode needs.
SUMMARY_TOKENS = 64       # a summary's cap
SUMMARY_MIN = 16          # fewer tokens left in the window: the request comes without the observation
# The long tasks' (data/repos.py) context window, and (summary_at) its threshold at 45-55% of it,
# 288-352 tokens. With the cpu tokenizer the issue is 76-99 tokens and a settings file's read (the action
# and the observation) 139-191: the issue and both reads (377 and up on train, test seeds 11 and 23)
# pass every threshold, so a sliding window never holds both files (eval.py measures it per run:
# window/memory_free, the share of tasks where it could) and an episode asks for its summary by the
# second read at the latest; the threshold, a read and the summary's room fit the window (352 + 191 +
# 17 < 640), so the request comes with its observation. The model's own context (1024 on the cpu preset)
# holds a whole episode, which eval.py's full-context oracle runs in.
LONG_WINDOW = 640
LONG_ACTIONS = 10         # a long task's step limit: two reads more than a short one's, and room to reread


def fact_retention(task, e):
    """(needed facts read before a summary, those of them it keeps): for each summary of episode e,
    every fact of task.facts whose file the episode read before it, and whether one line of its text
    states both the fact's label (N1) and its value, as a whole number (what a later edit must write)."""
    read, actions, n, kept = set(), iter(e["actions"]), 0, 0
    for t in e["turns"]:
        if t.get("summary"):
            seen = [f for f in task.facts if f["file"] in read]
            n, kept = n + len(seen), kept + sum(_states(t["text"], f) for f in seen)
            continue
        a = next(actions)
        if a["action"] == "read" and not a["error"]:
            read.add(a["path"])
    return n, kept


def _states(text, fact):
    """Whether a line of text gives fact's label its value: the label, then within a few characters
    the value as a whole number, sign included ('N1 = 16' and 'N1: -3'; not 'N1 = 160', 'N1 = -16' for
    16, nor 'N1 = 7, N2 = 16')."""
    value = re.escape(str(fact["value"]))
    return re.search(rf"\b{fact['label']}\b[^\d\n-]{{0,6}}(?<![\d-]){value}(?![\d.])", text) is not None


def long_tools(memory="summary"):
    """The harness of long tasks: memory "summary" (the agent, RL's and eval's), "window" (eval's
    sliding window) in LONG_WINDOW tokens, or None (the full-context oracle: the model's whole context)."""
    return Tools(max_actions=LONG_ACTIONS, memory=memory, window=LONG_WINDOW if memory else None)


def summary_at(task, window):
    """The context length (tokens) past which an episode of `task` summarises, or drops turns: between
    45% and 55% of the window, drawn from the task's id, so every episode of a group shares it."""
    return int(window * random.Random(f"summary/{task.task_id}").uniform(0.45, 0.55))


def memory_free(tok, task, window=LONG_WINDOW):
    """Whether the issue and a read of every file of task.facts fit under the task's threshold: a long
    task a sliding window could solve without a memory (none should be; eval.py counts them)."""
    reads = sum(len(action_ids(tok, "read", f["file"])) + len(Tools().feed_ids(tok, task.files[f["file"]]))
                for f in task.facts)
    return len(tok.encode(render_issue(task))) + reads <= summary_at(task, window)


def keep_context(e, feed, used, room):
    """The plain context policy: the observation joins the context while room (the tokens before the
    next turn's generation budget) is left, else the episode ends ("context")."""
    if used + len(feed) <= room:
        return feed, False, None
    e["end"] = "context"
    return None


class Tools:
    """The repository agent's tool set (engine.run_episodes runs it): ls, read, edit, test, submit on
    the episode's own copy of the task's files. actions: the ones allowed (the no-tools and oracle
    baselines allow edit and submit only); inline: files written into the prompt (the oracle: all);
    max_actions, max_errors: an episode ends at either (a step limit, a limit on format errors).
    memory: how an episode goes on when its context passes the threshold of its window of tokens
    (summary_at): None, it goes on until the model's context is full, then ends; "summary", the
    summary turn, at most max_summaries times (then it ends: "summary_cap"); "window", the oldest
    turns are dropped (eval's sliding-window baseline)."""
    stop_tokens = ("<|end|>",)

    def __init__(self, actions=ACTIONS, max_actions=8, max_errors=2, inline=False, memory=None, window=None,
                 max_summaries=3):
        if memory not in (None, "summary", "window") or (memory and not window):
            raise ValueError(f"memory must be None, 'summary' or 'window' (with a window), got {memory!r}")
        self.actions, self.max_actions, self.max_errors = actions, max_actions, max_errors
        self.inline = inline
        self.memory, self.window = memory, window
        self.max_summaries = max_summaries if memory == "summary" else 0
        self.max_turns = max_actions + self.max_summaries          # a summary turn is not an action

    def prompt(self, task):
        return render_issue(task, sorted(task.files) if self.inline else ())

    def start(self, task):
        return {"repo": dict(task.files), "actions": [], "errors": 0, "end": "step_limit", "summaries": [],
                "stream": []}

    def feed_ids(self, tok, text):
        return [tok.tool_ids["<|obs|>"]] + tok.encode(text) + [tok.tool_ids["<|/obs|>"]]

    def fit(self, tok, task, e, x, feed, used, prompt, seq_len, max_new_tokens):
        """What the episode's next turn feeds after turn x: (ids, fresh: they start a new context, no
        past; the most tokens that turn may keep, None: max_new_tokens), or None when it ends (e["end"]
        says why). feed: the observation's ids (engine.next_feed); used: the ids in the row's context
        now; prompt: the task's prompt ids."""
        if not self.memory:
            return keep_context(e, feed, used, seq_len - max_new_tokens)
        if self.memory == "window":
            e["stream"].append(x["tokens"][:-1] + feed)              # every id after the prompt, in order
        if x.get("summary"):          # a fresh context: the issue and every summary, as the model wrote them
            return prompt + [i for s in e["summaries"] for i in [tok.tool_ids["<|summary|>"]] + s], True, None
        window = min(self.window, seq_len)
        at = summary_at(task, window)
        if used + len(feed) <= at:
            return feed, False, None
        if self.memory == "window":   # the latest turns that fit under the threshold, after the prompt
            kept, n = [], len(prompt)
            for piece in reversed(e["stream"]):
                if n + len(piece) > at:
                    break
                kept, n = piece + kept, n + len(piece)
            return prompt + kept, True, None
        if len(e["summaries"]) >= self.max_summaries:
            e["end"] = "summary_cap"
            return None
        # the request after the observation; where that would leave the summary fewer than SUMMARY_MIN
        # tokens of the window, after the action alone (the observation is dropped)
        if used + len(feed) + 1 + SUMMARY_MIN > window:
            feed, e["blind"] = feed[:0 if x["stopped"] else 1], e.get("blind", 0) + 1
        e["summarizing"] = True
        limit = max(1, min(SUMMARY_TOKENS, window - used - len(feed) - 1))
        return feed + [tok.tool_ids["<|summary|>"]], False, limit

    def step(self, tok, pool, items, more):
        """items: (task, episode, sample) of the turn's live rows. Each action is applied to its own
        episode's repository; the turn's test runs go to the sandbox in one batch. A malformed action
        (parse_action) is a format error; a tool's own error (a missing file, an edit that does not
        parse) is an observation like any other. Returns each row's observation (None: it is over)."""
        obs, runs = [], []
        for i, (task, e, x) in enumerate(items):
            if e.pop("summarizing", False):      # the summary turn: not an action, the episode goes on
                x["summary"] = True
                e["summaries"].append(x["tokens"])
                obs.append("" if more else None)
                continue
            act = {"action": None, "path": None, "error": None}
            try:
                act["action"], payload = parse_action(tok, x["tokens"])
            except ValueError as err:
                e["errors"] += 1
                act["error"], text = "format", str(err)
            else:
                try:
                    if act["action"] not in self.actions:
                        raise ValueError(f"error: <|{act['action']}|> is not available here")
                    text, run = self.apply(task, e, act["action"], payload, act)
                    runs += [(i, run)] if run else []
                except ValueError as err:
                    act["error"], text = "tool", str(err)
            e["actions"].append(act)
            if act["action"] == "submit" and not act["error"]:
                e["end"], text = "submit", None
            elif e["errors"] >= self.max_errors:
                e["end"], text = "format_errors", None
            elif not more or len(e["actions"]) >= self.max_actions:
                text = None                                  # the step limit: e["end"] stays "step_limit"
            obs.append(text)
        runs = [(i, run) for i, run in runs if obs[i] is not None]
        for (i, _), r in zip(runs, pool.run_batch([run for _, run in runs], [""] * len(runs))):
            obs[i] = test_report(r)
        return obs

    def apply(self, task, e, name, payload, act):
        """One action on e["repo"]: (its observation, the sandbox run that makes it, or None); a test
        run's observation is its test_report, filled in after the turn's batch."""
        repo = e["repo"]
        if name == "ls":
            return "\n".join(sorted(repo)), None
        if name == "read":
            act["path"] = check_path(repo, payload)
            return cap(repo[act["path"]]), None
        if name == "edit":
            path, _, definition = payload.partition("\n")
            act["path"] = check_path(repo, path)
            repo[act["path"]], act["function"] = replace_function(repo[act["path"]], definition, act["path"])
            return f"replaced {act['function']} in {act['path']}", None
        if name == "test":
            return "", visible_run(task, repo)
        return "", None                               # submit: the episode is over

    def finish(self, pool, items):
        """The judge's verdict on each episode's final repository: its "result"."""
        results = pool.run_batch([hidden_run(t, e["repo"]) for t, e in items], [""] * len(items))
        for (_, e), r in zip(items, results):
            e["result"] = r


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

# ----------------------------------------------------------------------------- sandbox

OUTCOMES = ("pass", "wrong_answer", "runtime_error", "timeout", "memory", "output_limit",
            "syntax_error", "no_code", "sandbox_error")

@dataclasses.dataclass
class Result:
    """reward: 1.0 for a pass (fractional: passed/total); outcome: one of OUTCOMES; feedback: short,
    printable, safe to show the model. outcome == "sandbox_error" means the HARNESS failed, not the
    model (reward 0.0, passed False): callers must not count it as the model's failure: RL drops
    those samples (or their whole group) from the advantage computation, eval leaves them out of
    pass@k denominators and reports how many there were."""
    reward: float
    passed: bool
    outcome: str
    feedback: str
    n_passed: int
    n_tests: int

# The worker is a separate `python -I -S` process (no site-packages, no torch, no user env) that
# runs infra/sandbox_worker.py. Why a warm zygote rather than one fresh interpreter per candidate: the
# interpreter start (~20 ms) would cap us far below the throughput goal, while fork() of a small,
# preloaded zygote costs ~1 ms; every candidate still gets its own process, torn down afterwards,
# and the zygote never holds a program, a reply or a result (sandbox_worker.py says why).
# Why a separate stdlib-only file and not functions of this module: the forked child must not hold
# the task generator (it could regenerate reference answers), nor anything of the trainer.
_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "infra", "sandbox_worker.py")

# The children cannot import from disk (chroot), so they get what the zygote imported: the stdlib
# an honest solution plausibly uses. Importing threading/queue works; starting a thread does not.
_PRELOAD = ("math cmath re string collections collections.abc itertools functools operator heapq bisect "
            "typing copy random fractions decimal statistics datetime hashlib array struct unicodedata "
            "textwrap enum dataclasses numbers abc base64 binascii zlib calendar queue graphlib secrets "
            "threading json io time types contextlib weakref pprint shlex difflib shutil").split()
_CHILD_KINDS = ("wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "syntax_error")
_warned = False

def _printable(s, n=300):
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(s)[:n])[:n]

def _same(e, g):
    """Compare an expected value with a returned one (exact builtin data from the codec): bool is
    not a number, ints compare exactly (3.0 is 3, 479001690.0 is not 479001600), tolerance only
    where the expected value is a float; a tuple answers a list (JSON has no tuples)."""
    te, tg = type(e), type(g)
    if te is bool or tg is bool:
        return te is tg and e == g
    if te is int:
        return tg in (int, float) and g == e
    if te is float:
        return tg in (int, float) and (e == g or math.isclose(e, g, rel_tol=1e-6, abs_tol=1e-9))
    if te in (list, tuple):
        return tg in (list, tuple) and len(e) == len(g) and all(map(_same, e, g))
    if te is dict:
        return tg is dict and e.keys() == g.keys() and all(_same(e[k], g[k]) for k in e)
    if te in (set, frozenset):
        return tg in (set, frozenset) and e == g
    return te is tg and e == g

def _death(code):
    if code == -signal.SIGXCPU:
        return "timeout", "CPU time limit exceeded"
    if code == -signal.SIGXFSZ:
        return "output_limit", "file size limit exceeded"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "a signal"
        return "runtime_error", f"process killed by {name}"
    return "runtime_error", f"process exited (code {code}) before the tests finished"

def _messages(text):
    """Lines of JSON lists that start with a str; anything else (the program may write over its
    own result channel) is skipped, never an error."""
    out = []
    for line in (text or "").split("\n"):
        try:
            m = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(m) is list and m and type(m[0]) is str:
            out.append(m)
    return out

def default_workers():
    """Sandbox workers for this process: the cores it may use, shared among the processes torchrun
    started on this machine (LOCAL_WORLD_SIZE), so 8 ranks do not start 8 times the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

def _kill_uids(uids):
    """SIGKILL every process whose real uid is one of `uids` (a dead worker's candidates and judges:
    their uids are unique to that worker). Where there is no PID namespace to do it, this does."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(l.split()[1]) for l in f if l.startswith("Uid:"))
            if uid in uids:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, StopIteration, ValueError):
            pass

class SandboxPool:
    """Warm workers (one per core, the cores shared among local ranks) that run candidates in fresh,
    limited child processes.

    Per candidate, in a child forked from a pristine zygote (never from a process that held another
    candidate's program, reply or result): new session; RLIMIT_CPU/AS/FSIZE/NOFILE/CORE;
    RLIMIT_NPROC=1 under a per-worker unprivileged uid (no fork, no threads, so nothing can outlive
    the child); chroot into a fresh tmpfs of its own, unmounted as a whole afterwards; stdin
    /dev/null; stdout+stderr into a pipe capped while reading; scrubbed env; per worker a network
    namespace (no network), a PID namespace (nothing outlives a killed worker) and an IPC namespace
    in which no IPC object can be created; and a seccomp filter that refuses socket() and IPC calls
    (the wall that stays where a container forbids namespaces; as root with neither, the pool refuses
    to start). The worker enforces the wall-clock timeout, SIGKILLs the process group and reaps it.
    Without root, only the rlimits, the filter and the process-group kill apply (a warning says so
    once): run untrusted code as root in a VM/container.

    The judge is never in the candidate's process. I/O tasks (the default for training): the child
    only sends back return values as exact builtin data; the expected outputs stay in this process,
    which compares them. Assert tasks (HumanEval): check() runs in a separate judge process (own uid,
    own empty chroot) and calls the candidate over pipes that carry exact builtin data only; the
    candidate never sees the test, its constants or the verdict. Anything a candidate can cause is
    its own outcome; only a failure of the sandbox itself is `sandbox_error`.
    """
    _fallback = False   # tests only: take the no-root path even as root (never with untrusted code)
    _namespaces = True  # tests only: False acts as a container that forbids namespaces (root, no unshare)
    _seccomp = True     # tests only: False acts as a kernel without seccomp

    def __init__(self, workers: int | None = None, timeout_s: float = 2.0, memory_mb: int = 512,
                 output_kb: int = 64, file_mb: int = 4, result_kb: int = 1024):
        self.workers, self.timeout_s = workers or default_workers(), timeout_s
        self.output_kb, self.result_kb, self.memory_mb = output_kb, result_kb, memory_mb
        self._cfg = json.dumps({"timeout": timeout_s, "memory_mb": memory_mb, "file_mb": file_mb,
                                "output_bytes": output_kb << 10, "result_bytes": result_kb << 10,
                                "tmpfs_mb": max(64, 4 * file_mb), "uid_base": 1_000_000,
                                "preload": _PRELOAD, "tmpdir": tempfile.gettempdir(),
                                "fallback": self._fallback, "namespaces": self._namespaces,
                                "seccomp": self._seccomp})
        self._q, self._lock, self._closed = queue.Queue(), threading.Lock(), False
        self._procs = [self._spawn() for _ in range(self.workers)]
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def _spawn(self):
        # Same user as this process (root in CI): the worker sets up namespaces, then re-executes
        # itself as the zygote; the children only fork (never exec), so after chroot and the uid
        # drop they need neither this file nor the interpreter binary.
        p = subprocess.Popen([sys.executable, "-I", "-S", _WORKER_PATH, self._cfg], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                             start_new_session=True)
        p.info = i = self._recv(p, 30)["hello"]
        global _warned
        self.isolation = i
        if i["uid"] is not None and not (i["netns"] and i["ipcns"]) and not i["seccomp"]:
            p.kill()   # a clear one-line error and exit code 2 (infra/cli.py: no torch, env stays light)
            die("sandbox: refusing to run candidates as root with neither namespaces nor seccomp (they would "
                "reach the network and IPC): allow unshare (e.g. docker --cap-add SYS_ADMIN), or run on "
                "Linux x86_64/aarch64 with seccomp, or use a VM")
        # What a container that forbids namespaces (root, no unshare) keeps by other means: the seccomp
        # filter closes network and IPC, _kill_uids does the PID namespace's work, chroot hides the
        # host's files (a private /tmp matters only without it).
        kept = {"netns": i["seccomp"], "ipcns": i["seccomp"], "pidns": i["uid"] is not None,
                "private_tmp": i["chroot"]}
        missing = [k for k in ("uid", "chroot", "nproc", "netns", "pidns", "ipcns", "private_tmp",
                               "tmpfs_per_run")
                   if not i[k] and not kept.get(k)]
        if missing and not _warned:
            _warned = True
            if i["uid"] is None:
                msg = (f"degraded isolation, unavailable: {missing}; candidates may see files"
                       f"{'' if i['seccomp'] else '/network/IPC'} of this user; run as root on Linux")
            else:
                msg = ("namespaces forbidden here: network and IPC closed by seccomp, stray processes killed "
                       "by uid, files hidden by chroot, but a run's files are not size-capped in total "
                       "(no per-run tmpfs); allow unshare (e.g. docker --cap-add SYS_ADMIN) for the full set")
            warnings.warn("sandbox: " + msg, RuntimeWarning)
        return p

    @staticmethod
    def _recv(p, timeout):
        if not select.select([p.stdout], [], [], timeout)[0]:
            raise TimeoutError("sandbox worker did not answer")
        line = p.stdout.readline()
        if not line:
            raise EOFError("sandbox worker died")
        return json.loads(line)

    @property
    def sandbox_uids(self) -> list[int]:
        """The candidates' uids and the judges' (uid + 1)."""
        return [u + d for p in self._procs if (u := p.info.get("uid")) is not None for d in (0, 1)]

    def _serve(self, i):
        while True:
            item = self._q.get()
            if item is None:
                return
            job, done = item
            for attempt in range(2):       # a dead/stuck worker is replaced and the job retried once
                try:
                    p = self._procs[i]
                    p.stdin.write((json.dumps(job) + "\n").encode())
                    p.stdin.flush()
                    rep = self._recv(p, self.timeout_s + 30)
                    break
                except Exception as e:
                    rep = {"error": f"sandbox worker failed: {e!r}"}
                    self._restart(i)
            done(rep)

    def _restart(self, i):                 # never raises: the serving thread must survive
        old = self._procs[i]
        for f in (old.kill, old.wait, old.stdin.close, old.stdout.close):
            try:
                f()
            except Exception:                  # e.g. BrokenPipeError flushing into a dead worker
                pass
        if old.info["uid"] is not None and not old.info["pidns"]:
            _kill_uids((old.info["uid"], old.info["uid"] + 1))   # no PID namespace: by uid instead
        remove_tree(old.info["base"], time.monotonic() + 5)      # a killed worker left its (empty) dir
        for _ in range(3):
            try:
                if not self._closed:
                    self._procs[i] = self._spawn()
                return
            except Exception:
                time.sleep(0.5)

    def _job(self, task, completion):
        if isinstance(task, RepoRun):          # a repository's code (tools): the program is built already
            return {"program": task.program, "entry": task.entry_point,
                    "inputs": [encode((tuple(a), {})) for a in task.inputs], "test": None, "prompt": ""}
        if not any(l.strip() and not l.strip().startswith("#") for l in completion.splitlines()):
            return None
        if task.inputs is None and task.test is None:
            raise ValueError(f"task {task.task_id} has neither inputs/outputs nor test")
        io_task = task.inputs is not None
        return {"program": build_program(task, completion), "entry": task.entry_point,
                "inputs": [encode((tuple(a), {})) for a in task.inputs] if io_task else None,
                "test": None if io_task else task.test, "prompt": render_prompt(task)}

    def _score(self, task, rep, fractional):
        n = len(task.inputs) if task.inputs is not None else 1
        def res(outcome, passed, feedback):
            reward = 1.0 if outcome == "pass" else (passed / n if fractional and outcome != "sandbox_error"
                                                    else 0.0)
            return Result(reward, outcome == "pass", outcome, _printable(feedback), passed, n)
        if "error" in rep:
            return res("sandbox_error", 0, rep["error"])
        for text in rep["setup"]:              # written by our code before any program ran
            if text != "ok\n":
                m = _messages(text)
                why = "sandbox setup did not finish"
                if m and m[0][0] == "setup_error" and len(m[0]) == 2:
                    why = str(m[0][1])
                return res("sandbox_error", 0, why)
        kind = lambda k: k if k in _CHILD_KINDS else "runtime_error"   # never pass/sandbox_error
        limit = (f"output limit exceeded (more than {self.output_kb} KB printed)" if rep["over"] == "output"
                 else f"result data limit exceeded ({self.result_kb} KB)")
        if task.inputs is None:
            return self._score_assert(rep, res, kind, limit)
        msgs = _messages(rep["res"])
        load = next((m for m in msgs if m[0] == "load" and len(m) == 3), None)
        if load:
            return res(kind(load[1]), 0, load[2])
        cases = {}
        for m in msgs:
            if m[0] == "case" and len(m) == 4 and type(m[1]) is int and type(m[2]) is str:
                cases.setdefault(m[1], m)
        passed, first, got = 0, None, {}
        for i, exp in enumerate(task.outputs):
            m = cases.get(i)
            if m is not None and m[2] == "ok":
                try:
                    got[i] = unpack(m[3])
                except (BadValue, TypeError, RecursionError):
                    cases[i] = ["case", i, "bad", "returned malformed data"]
            if i in got and _same(exp, got[i]):
                passed += 1
            elif first is None:
                first = i
        if first is None:
            return res("pass", passed, f"passed {n}/{n} tests")
        if rep["over"]:
            return res("output_limit", passed, limit)
        if rep["timed_out"]:
            return res("timeout", passed, f"timed out after {self.timeout_s} s ({passed}/{n} tests passed)")
        m, exp = cases.get(first), task.outputs[first]
        call = f"{task.entry_point}({', '.join(map(repr, task.inputs[first]))})"
        if m is None:
            outcome, why = _death(rep["exit"])
            return res(outcome, passed, f"{why}; {passed}/{n} tests passed")
        if first in got:
            return res("wrong_answer", passed, f"{call} should return {exp!r}, got {got[first]!r}")
        if m[2] == "bad":
            return res("wrong_answer", passed, f"{call}: {m[3]}")
        return res(kind(m[2]), passed, f"{call} raised {m[3]}")

    def _score_assert(self, rep, res, kind, limit):
        """The judge process wrote one verdict: done, load (the program did not load), fail
        (check() failed; "died" = the candidate stopped mid-test) or nothing (the judge died)."""
        v = next(iter(_messages(rep["verdict"])), None)
        if v == ["done"]:
            return res("pass", 1, "check() passed")
        if rep["over"]:
            return res("output_limit", 0, limit)
        if rep["timed_out"]:
            return res("timeout", 0, f"timed out after {self.timeout_s} s")
        if v is not None and v[0] in ("load", "fail") and len(v) == 3:
            if v[1] != "died":
                return res(kind(v[1]), 0, v[2])
            outcome, why = _death(rep["exit"])
            return res(outcome, 0, why)
        outcome, why = _death(rep["judge_exit"])   # e.g. a returned value too big for the judge's memory
        return res(outcome, 0, f"the judge stopped: {why}")

    def submit_batch(self, tasks, completions, fractional=False) -> concurrent.futures.Future:
        """Non-blocking: returns a Future of list[Result] (same order), so the trainer can keep
        generating while the workers run the tests."""
        if len(tasks) != len(completions):
            raise ValueError("tasks and completions differ in length")
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        fut, results = concurrent.futures.Future(), [None] * len(tasks)
        left = [len(tasks)]
        def finish(i, r):
            results[i] = r
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fut.set_result(results)
        jobs = [(i, t, self._job(t, c)) for i, (t, c) in enumerate(zip(tasks, completions))]
        for i, t, job in jobs:
            if job is None:
                finish(i, Result(0.0, False, "no_code", "the completion contains no code", 0,
                                 len(t.inputs) if t.inputs is not None else 1))
                continue
            def done(rep, i=i, t=t, job=job):
                try:
                    r = self._score(t, rep, fractional)
                except Exception as e:      # a judge bug must not hang the batch
                    r = Result(0.0, False, "sandbox_error", _printable(f"judge failed: {e!r}"), 0, 1)
                finish(i, r)
            self._q.put((job, done))
        if not tasks:
            fut.set_result([])
        return fut

    def run_batch(self, tasks, completions, fractional=False) -> list[Result]:
        return self.submit_batch(tasks, completions, fractional).result()

    def close(self):
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(self.timeout_s + 35)
        while True:                          # jobs queued behind the sentinels: answer, never hang
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1]({"error": "pool closed"})
        for p in self._procs:
            try:
                p.stdin.close()              # EOF: the worker removes its dir and exits
                p.wait(5)
            except Exception:
                p.kill()
                p.wait()
            p.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
