"""
agent.py: the interactive command, in the harness the model was trained in (env.py run_episodes, as
train_rl.py and eval.py run it). Two tool sets:

--repo DIR: the agent (env.Tools) on a copy of a small Python project, one action per turn (ls, read,
grep, run an expression, edit a function, run the tests, submit), each printed with its observation; a
long episode goes on past its context through its memory (--memory: summaries the model writes, old
observations masked, or a sliding window). The tests are the top-level test_* functions of its first
top-level test_*.py file. They run first, and the model reads the first failure as training's issues
state it (or --issue); the verdict is that file, as it was, run on the final copy. The project is
written only with --apply; the final copy goes to --out-dir/repo. What it promises: docs/sandbox.md.
    python agent.py --ckpt runs/agent-cpu/rl/ckpt.pt --repo my_project   # after AGENT=1 bash run.sh
    python agent.py --ckpt CKPT --repo my_project --issue "sum_prices in shop.py is off by one" --apply

Without --repo: the feedback episodes (env.Feedback). The model writes a function body, the harness
runs the docstring's examples (the tests the model can see) in the sandbox, and if one fails the model
reads what failed and writes the body again, up to --turns attempts: Composer 2's agentic loop in
miniature. The last attempt is judged on the hidden tests. E.g. after `TURNS=3 OUT=runs/turns bash
run.sh` (a base model that has seen feedback, a context for 3 turns):
    python agent.py --ckpt runs/turns/rl/ckpt.pt                      # held-out task 0 (train_rl's cpu set)
    python agent.py --ckpt CKPT --task 5 --difficulties 3 --turns 2   # task 5 of the level-3 held-out tasks
    python agent.py --ckpt CKPT --prompt-file my_function.py          # your signature + docstring
  A prompt of your own is a `def` line and a docstring with `>>> name(args)` examples, each followed
  by the expected value on the next line; those examples are its only tests.
The last stdout line is a JSON summary. --out-dir (default runs/agent-PRESET) keeps transcript.txt, the
text printed above it, and without --repo summary.json, the summary with the prompt and every attempt.
"""
import argparse
import ast
import contextlib
import dataclasses
import io
import json
import os
import re
import stat
import sys
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see eval.py
import torch

import hf
from infra import common
import sampling
import speculative
import env
from sandbox import Run, SandboxPool
from data import repos
from data.tasks import Task, generate_tasks, parse_difficulties

PRESETS = {
    "smoke": dict(turns=2, max_new_tokens=24, temperature=0.8),
    "cpu": dict(turns=3, max_new_tokens=96, temperature=0.8),
    "gpu": dict(turns=3, max_new_tokens=256, temperature=0.8),
}


# ---------------------------------------------------------------------------------------------
# The command: one episode, printed turn by turn

def user_task(text):
    """A Task from a signature + docstring typed by a user: its `>>>` examples are its tests."""
    text = text if text.endswith("\n") else text + "\n"
    defs = [ln.split("def ", 1)[1].split("(")[0].strip() for ln in text.splitlines()
            if ln.lstrip().startswith("def ")]
    if not defs:
        raise ValueError("the prompt has no `def name(...):` line")
    task = Task("user/0", text, defs[-1])
    cases = env.visible_tests(task)
    if not cases:
        raise ValueError(f"the docstring of {defs[-1]} has no `>>> {defs[-1]}(...)` example with its answer "
                         f"on the next line: nothing to test against")
    task.inputs, task.outputs = [a for a, _ in cases], [w for _, w in cases]
    return task


MAX_FILES = 50     # a small project (and files of at most env.MAX_FILE_CHARS): larger ones are refused
MAX_DEPTH = 32     # and one deeper than this (os.walk recurses once per level)


def read_project(root, skip=None):
    """({relative path: text} of the project's .py files, its test file), or a one-line error
    (ValueError). Links, hidden files and directories, __pycache__, the directory `skip` (the out-dir)
    and anything that is not a regular file (a FIFO named x.py would block the read forever) are
    skipped; refused: a file that is not UTF-8, a name that is not printable UTF-8, and one module twice
    in a directory (shop.py and a package shop/: Python imports the package, the harness could take the
    file). Line ends are kept as they are (newline="")."""
    if not os.path.isdir(root):
        raise ValueError(f"--repo: no directory {root!r}")
    files = {}
    for here, dirs, names in os.walk(root):
        rel = lambda name: os.path.relpath(os.path.join(here, name), root).replace(os.sep, "/")
        if rel(".").count("/") >= MAX_DEPTH:
            raise ValueError(f"--repo {root}: deeper than {MAX_DEPTH} directories: not a small project")
        package = lambda d: any(os.path.isfile(os.path.join(here, d, f"__init__.{e}")) for e in ("py", "pyc"))
        mods = [n.split(".")[0] for n in names if n.endswith((".py", ".pyc", ".so", ".pyd"))] + \
            [d for d in dirs if package(d)]
        if twice := sorted({m for m in mods if m and mods.count(m) > 1}):
            raise ValueError(f"--repo: {rel(twice[0])!a} is two modules (a file and a package, or a compiled "
                             f"one): Python imports one, the harness could import the other; rename one")
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                         and not os.path.islink(os.path.join(here, d))
                         and os.path.realpath(os.path.join(here, d)) != skip)
        for name in sorted(names):
            path = os.path.join(here, name)
            if name.endswith(".py") and not name.startswith(".") and stat.S_ISREG(os.lstat(path).st_mode):
                if not rel(name).isprintable():        # a name that is not UTF-8 holds a surrogate
                    raise ValueError(f"--repo: {rel(name)!a}: a file name that is not printable UTF-8")
                try:
                    with open(path, encoding="utf-8", newline="") as f:
                        files[rel(name)] = f.read(env.MAX_FILE_CHARS + 1)
                except UnicodeDecodeError:
                    raise ValueError(f"--repo: {rel(name)} is not UTF-8 text") from None
                if len(files[rel(name)]) > env.MAX_FILE_CHARS or len(files) > MAX_FILES:
                    raise ValueError(f"--repo: {rel(name)}: the agent works small projects (at most "
                                     f"{MAX_FILES} files of {env.MAX_FILE_CHARS} characters)")
    tests = [p for p in files if p.startswith("test_") and p[:-3].isidentifier()]    # top level, importable
    if not tests:
        raise ValueError(f"--repo {root}: no test_*.py file at its top level to run (its name a module's)")
    if not test_checks(files[tests[0]]):    # its top-level test_* functions run (no unittest classes)
        raise ValueError(f"--repo: {tests[0]} has no top-level test_* function to run")
    if why := pytest_differs(root, files, tests[0]):
        raise ValueError(f"--repo: {why}: the harness runs the top-level test_* functions of {tests[0]} "
                         f"alone, on UTF-8 sources and this interpreter's standard library; pytest would not")
    return files, tests[0]


def pytest_differs(root, files, test_file):
    """What pytest would run or import that the harness would not, or None: refused, so that the harness
    fails at most where pytest passes, never passes where pytest fails. Pytest settings, another test
    file or a conftest.py, a test class or a test bound other than by `def` (assigned, imported), a
    module that shadows the standard library (the sandbox preloads it), a coding cookie not UTF-8."""
    for name in ("pytest.ini", "pyproject.toml", "setup.cfg", "tox.ini"):
        path = os.path.join(root, name)
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            if re.search(r"^\[(tool[.:])?pytest", f.read(), re.M):
                return name
    for p, text in files.items():
        head = "\n".join(text.split("\n")[:2])
        if p != test_file and re.fullmatch(r"(.*/)?(test_\w*|\w*_test|conftest)\.py", p) or \
                "/" not in p and p[:-3] in sys.stdlib_module_names or \
                re.search(r"^#.*coding[:=]\s*(?!utf-?8\b)[-\w.]+", head, re.M | re.I):
            return p
    for n in ast.parse(files[test_file]).body:      # what the module binds at its top level, but defs
        bound = [n.name] if isinstance(n, ast.ClassDef) else \
            [a.asname or a.name for a in n.names] if isinstance(n, (ast.Import, ast.ImportFrom)) else \
            [t.id for t in getattr(n, "targets", [getattr(n, "target", None)]) if isinstance(t, ast.Name)]
        if any(b.startswith(("Test", "test")) for b in bound):
            return f"{test_file}: {bound[0]}"
    return None


def project_task(files, test_file, issue):
    """The project as a repository task (the fields of data/repos.py's that env.Tools reads). It has no
    hidden tests (inputs None): the judge runs its own test file, as it was, on the final copy."""
    return SimpleNamespace(task_id="user/repo", files=files, issue=issue, test_file=test_file, inputs=None)


def show_tools(tok, task, tools, episode, verdict, out):
    """An agent episode as the model saw it: the prompt, then each action and its observation (to out)."""
    print(tools.prompt(task), end="", file=out)
    for t, x in enumerate(episode.turns, 1):
        action = tok.decode(x.tokens)
        if x.summary:     # the context passed its threshold: a summary, then a fresh context
            print(f"--- turn {t}, a summary (then a fresh context: the issue, the files, the actions left "
                  f"and this summary):\n{action}", file=out)
            continue
        if t > 1 and x.segment > episode.turns[t - 2].segment and not episode.turns[t - 2].summary:
            masked = ", old observations masked" if tools.memory == "mask" else ""
            print(f"--- the context passed its threshold: rebuilt ({tools.memory}: the issue, the files, the "
                  f"actions left and the latest turns{masked})", file=out)
        print(f"--- turn {t}: {action}", file=out)
        if x.feedback:
            print(x.feedback if x.feedback.endswith("\n") else x.feedback + "\n", end="", file=out)
    print(f"--- episode over ({episode.end}); the project's tests on the final copy: "
          f"{'PASS' if verdict.passed else 'FAIL'} ({env.test_report(verdict).splitlines()[0]})", file=out)


def test_checks(test_text):
    """{test function: its check or None}: (module, f, args, X) where the test is `assert f(...) == X`
    or `got = f(...)` then `assert got == X` (a message allowed), f imported by name from a module (f as
    the test calls it), every argument and X a literal."""
    try:
        tree = ast.parse(test_text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return {}
    names = {a.asname or a.name: n.module for n in tree.body if isinstance(n, ast.ImportFrom)
             for a in n.names}
    checks = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")):
        body, call, checks[fn.name] = fn.body, None, None
        if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Assert) and \
                isinstance(body[1].test, ast.Compare) and isinstance(body[1].test.left, ast.Name) and \
                [t.id for t in body[0].targets if isinstance(t, ast.Name)] == [body[1].test.left.id]:
            call, test = body[0].value, body[1].test
        elif len(body) == 1 and isinstance(body[0], ast.Assert) and isinstance(body[0].test, ast.Compare):
            call, test = body[0].test.left, body[0].test
        if call is None or not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or \
                call.func.id not in names or call.keywords or [type(o) for o in test.ops] != [ast.Eq]:
            continue
        with contextlib.suppress(ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            checks[fn.name] = (names[call.func.id], call.func.id, [ast.literal_eval(a) for a in call.args],
                               ast.literal_eval(test.comparators[0]))
    return checks


# A check's call, in the sandbox, in the test module as it loaded (its module-level code, `shop.TAX = 0`,
# has run): the value crosses as plain data, a 1-tuple (a raised exception: its type's name, in a list),
# and is compared here as the test compares it, so code whose result overrides == gets nothing.
_CHECK = """
import {module} as _tests
def _judged(name, *args):
    try:
        return (getattr(_tests, name)(*args),)
    except Exception as e:
        return [type(e).__name__]
"""


def run_tests(pool, task, repo):
    """The test file, as it was, on repo in the sandbox: its Result, its tests' names, its checks
    (test_checks) and {test: what its check's call gave (_CHECK), where it came back}."""
    checks = {n: c for n, c in test_checks(task.files[task.test_file]).items() if c}
    run = env.hidden_run(task, repo)
    program = env.repo_program({**repo, task.test_file: task.files[task.test_file]},
                               _CHECK.format(module=task.test_file.removesuffix(".py")))
    calls = Run("user/checks", program, "_judged", [[f, *a] for _, f, a, _ in checks.values()],
                [None] * len(checks))
    result, *got = pool.run_batch([run] + [calls] * bool(checks))
    return result, [n for n, in run.inputs], checks, dict(zip(checks, got[0].values if got else ()))


def project_verdict(pool, task, repo):
    """(passed, trusted) on the final copy: its test file, as it was, passes in the sandbox, and every
    check gave, on plain data here, what it expects (== as the test compares: a tuple is not a list, 0.1
    + 0.2 is not 0.3). Trusted where every test is a check (test_checks): a test that is not one is
    judged in the candidate's process only, where an object whose __eq__ is always true passes."""
    result, _, checks, got = run_tests(pool, task, repo)
    exact = all(type(got.get(n)) is tuple and len(got[n]) == 1 and got[n][0] == c[3]   # a forged () too
                for n, c in checks.items())
    every = test_checks(task.files[task.test_file]).values()
    return result.passed and exact, bool(every) and None not in every


def project_issue(pool, task):
    """The issue in training's words (data/repos.py's symptom), from the project's tests run on it: the
    first failing test's call, what it returns (or raises) and what it should; a test that is not a
    check gives what the `test` action reports. ValueError: no test fails."""
    result, names, checks, got = run_tests(pool, task, task.files)
    if result.passed:
        raise ValueError(f"--repo: every test in {task.test_file} passes; say what to change with --issue")
    first = next((n for n, v in zip(names, result.values) if isinstance(v, str)), None)
    (_, f, args, want), value = checks.get(first, (None,) * 4), got.get(first)
    if type(value) in (list, tuple) and len(value) != 1:      # forged by the project's code: no symptom
        value = None
    if type(value) is list or type(value) is tuple and value[0] != want:
        value = value[0] if type(value) is tuple else type(str(value[0]), (Exception,), {})()   # a raise
        return env.cap(repos._symptom(f, args, value, want))
    return f"A test in {task.test_file} fails:\n{env.test_report(result, names)}"


def open_dir(path, root):
    """A descriptor of the directory `path`, made where missing, opened a component at a time: at and
    below the directory `root` no link is followed (OSError), so a link planted in a project cannot send
    a write elsewhere; links above it are the user's own (a mounted disk, macOS's /tmp)."""
    top, fd, inside = os.stat(root), os.open("/", os.O_RDONLY | os.O_DIRECTORY), False
    for part in filter(None, os.path.abspath(path).split(os.sep)):
        inside = inside or os.path.samestat(os.fstat(fd), top)
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, dir_fd=fd)
        new = os.open(part, os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if inside else 0), dir_fd=fd)
        os.close(fd)
        fd = new
    return fd


def write_files(texts):
    """{path: (text, root)}, never written through a link at or below its root: every text is encoded and
    every directory opened first (open_dir), so one refused leaves nothing half written; each file is new
    (O_EXCL | O_NOFOLLOW, a random name) and then renamed over its path (a rename replaces a link, not
    what it points to)."""
    for text, _ in texts.values():
        text.encode("utf-8")           # UnicodeEncodeError (a ValueError) before anything is written
    fds = [open_dir(os.path.dirname(os.path.abspath(p)), root) for p, (_, root) in texts.items()]
    for fd, (path, (text, _)) in zip(fds, texts.items()):
        name, tmp = os.path.basename(path), f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=fd),
                      "w", encoding="utf-8", newline="") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            with contextlib.suppress(FileNotFoundError):      # renamed already, unless the write failed
                os.unlink(tmp, dir_fd=fd)
            os.close(fd)


def run_repo(args, model, tok, gen):
    """--repo: one agent episode on a copy of the project, printed; its final copy kept, or applied. The
    project, its tests' first failure (the issue) and the out-dir are checked before the episode."""
    if not tok.tools:
        common.die(f"{args.ckpt}: no tool tokens; --repo needs an agent checkpoint (AGENT=1 bash run.sh)")
    with SandboxPool(workers=1) as pool:
        try:
            task = project_task(*read_project(args.repo, os.path.realpath(args.out_dir)), args.issue)
            task.issue = args.issue or project_issue(pool, task)
            os.close(open_dir(args.out_dir, args.repo))
            copy, project = os.path.realpath(os.path.join(args.out_dir, "repo")), os.path.realpath(args.repo)
            if os.path.commonpath([copy, project]) == copy:
                raise ValueError(f"--out-dir {args.out_dir}: its repo/ would hold the project itself")
        except (OSError, ValueError) as e:
            common.die(str(e) if isinstance(e, ValueError) else f"{e} (no link in the project is followed)")
        # the memory carries an episode past the context: past the threshold of the model's whole context
        # (env.summary_at) it summarises, masks old observations or slides (--memory: the one RL trained)
        tools = env.Tools(max_actions=env.LONG_ACTIONS, memory=args.memory, window=model.config.seq_len)
        ep = env.run_episodes(model, tok, [task], 1, tools, pool, args.temperature, args.max_new_tokens,
                              generator=gen)[0]
        passed, trusted = project_verdict(pool, task, ep.repo)
    verdict = ep.result if passed == ep.result.passed else \
        dataclasses.replace(ep.result, passed=passed, outcome="pass" if passed else "wrong_answer")
    show_tools(tok, task, tools, ep, verdict, out := io.StringIO())
    shown = out.getvalue().encode("utf-8", "backslashreplace").decode()   # an --issue's undecodable bytes
    print(shown, end="")
    changed = sorted(p for p in task.files if ep.repo[p] != task.files[p])
    try:   # the copy and transcript (no link below the out-dir); the user's own files only with --apply
        write_files({**{os.path.join(args.out_dir, "repo", p): (ep.repo[p], args.out_dir) for p in changed},
                     **{os.path.join(args.repo, p): (ep.repo[p], args.repo) for p in changed if args.apply},
                     os.path.join(args.out_dir, "transcript.txt"): (shown, args.out_dir)})
    except (OSError, ValueError) as e:
        common.die(f"{e} (nothing is written through a link, nor half written)")
    if not trusted:
        print("note: not all your tests are `assert f(...) == literal`; the others ran in the candidate's "
              "process, where code whose result overrides == could pass: the verdict cannot be trusted",
              file=sys.stderr)
    common.print_summary({"repo": args.repo, "passed": passed, "verdict_trusted": trusted,
                          "turns": len(ep.turns), "end": ep.end, "actions": [a.name for a in ep.actions],
                          "changed": changed, "applied": bool(args.apply and changed),
                          "out_dir": args.out_dir, "ckpt": args.ckpt})


def show(task, episode, out):
    """A feedback episode: the prompt, then each attempt with its verdicts (to out)."""
    print(env.render_prompt(task), end="", file=out)
    for t, (x, r) in enumerate(zip(episode.turns, episode.results), 1):
        seen = {None: "", True: ", visible examples: pass",
                False: ", visible examples: fail"}[x.visible_passed]
        print(f"# --- attempt {t} (hidden tests: {r.outcome}{seen}) ---", file=out)
        print(x.text if x.text.endswith("\n") else x.text + "\n", end="", file=out)
        if x.feedback:
            print(f"# --- feedback (visible examples) ---\n{x.feedback}", end="", file=out)
    r = episode.result
    print(f"# --- verdict after {len(episode.turns)} attempt(s): {'PASS' if r.passed else 'FAIL'} "
          f"({r.outcome}: {r.feedback}) ---", file=out)


def main(argv=None):
    # --help: the docstring as written, and every flag's default, as the other scripts' --help
    p = common.ArgumentParser(prog="agent.py", description=__doc__, formatter_class=type(
        "Fmt", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--ckpt", help="model checkpoint, required (speculative decoding needs train_mtp.py's)")
    p.add_argument("--repo", default=None, help="the agent on a copy of this project (with a test_*.py file)")
    p.add_argument("--issue", default=None, help="with --repo: the issue text the agent reads first")
    p.add_argument("--apply", action="store_true", help="with --repo: write the changed files back into it")
    p.add_argument("--memory", choices=["summary", "mask", "window"], default="summary",
                   help="with --repo: how an episode goes on past its context (train_rl.py --memory)")
    p.add_argument("--prompt-file", default=None, help="signature + docstring with >>> examples ('-': stdin)")
    p.add_argument("--task", type=int, default=0, help="index of a held-out env task (without --prompt-file)")
    p.add_argument("--task-seed", type=int, default=0, help="held-out task seed")
    p.add_argument("--difficulties", default="1-2", help="held-out task levels, e.g. 1-2")
    p.add_argument("--turns", type=int, help="attempts at most")
    p.add_argument("--max-new-tokens", type=int, help="tokens per attempt")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--no-speculative", action="store_true", help="decode plainly even with MTP modules "
                   "(train_mtp.py); speculative decoding samples the same distribution (docs/speculative.md)")
    args = common.parse_args(p, PRESETS, argv)
    if args.turns < 1 or args.max_new_tokens < 1:
        common.die("--turns and --max-new-tokens must be >= 1")
    if not (args.ckpt and (os.path.isfile(args.ckpt) or os.path.isdir(args.ckpt))):   # a directory: HF's
        common.die(f"--ckpt CKPT is required: no checkpoint at {args.ckpt!r}")
    if args.repo:
        device = common.pick_device(args.device)
        model, tok, _ = hf.load_checkpoint(args.ckpt, device)
        return run_repo(args, model, tok, torch.Generator(device=device).manual_seed(args.seed))
    try:
        if args.prompt_file:
            with (sys.stdin if args.prompt_file == "-" else open(args.prompt_file)) as f:
                task = user_task(f.read())
        else:
            task = generate_tasks("test", args.task + 1, seed=args.task_seed,
                                  difficulties=parse_difficulties(args.difficulties))[args.task]
    except (OSError, ValueError, RuntimeError) as e:
        common.die(str(e))
    device = common.pick_device(args.device)
    model, tok, _ = hf.load_checkpoint(args.ckpt, device)
    # A checkpoint with MTP modules drafts tokens that one forward checks (speculative.generate):
    # exactly the model's samples, several tokens per forward (docs/speculative.md).
    sampling.SPECULATIVE = None if args.no_speculative else speculative.generate
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with SandboxPool(workers=1) as pool:
        ep = env.run_episodes(model, tok, [task], 1, env.Feedback(args.turns), pool, args.temperature,
                                 args.max_new_tokens, generator=gen)[0]
    show(task, ep, out := io.StringIO())
    print(out.getvalue(), end="")
    summary = {"task_id": task.task_id, "passed": ep.result.passed, "turns": len(ep.turns),
               "outcomes": [r.outcome for r in ep.results], "ckpt": args.ckpt,
               "speculative": model.config.n_mtp > 0 and not args.no_speculative}
    # --out-dir keeps the episode: the transcript as printed, and the summary with every attempt's body
    os.makedirs(args.out_dir, exist_ok=True)
    kept = {**summary, "prompt": env.render_prompt(task), "attempts": [x.text for x in ep.turns]}
    write_files({os.path.join(args.out_dir, "transcript.txt"): (out.getvalue(), args.out_dir),
                 os.path.join(args.out_dir, "summary.json"): (json.dumps(kept, indent=1), args.out_dir)})
    common.print_summary({**summary, "out_dir": args.out_dir})


if __name__ == "__main__":
    main()
