"""
agent.py: the interactive command, in the harness the model was trained in (env.py
run_episodes, as train_rl.py and eval.py run it). Two tool sets:

--repo DIR: the agent (env.Tools). The model works a copy of a small Python project through tools,
one action per turn (ls, read, grep, run an expression, edit a function, run the tests, submit), and
this prints every action
and observation; a long episode goes on past its context through its memory (--memory: summaries the
model writes, old observations masked, or a sliding window). The
tests are the top-level test_* functions of its first test_*.py file (at the directory's top level);
the verdict is that file, as it was, run on the final copy. The directory itself is never written
unless --apply is given; the final copy goes to --out-dir/repo.
    python agent.py --ckpt runs/cpu/rl/ckpt.pt --repo my_project        # after AGENT=1 bash run.sh
    python agent.py --ckpt CKPT --repo my_project --issue "sum_prices in shop.py is off by one" --apply

Without --repo: the feedback episodes (env.Feedback). The model writes a function body, the harness
runs the docstring's examples (the tests the model can see) in the sandbox, and if one fails the model
reads what failed and writes the body again, up to --turns attempts: Composer 2's agentic loop in
miniature. The last attempt is judged on the hidden tests; the context of an episode is
env.render_episode's text at every turn.

Watch a model work through a task, turn by turn (this is the harness of the deployed model), e.g.
after `TURNS=3 OUT=runs/turns bash run.sh` (a base model that has seen feedback, a context for 3 turns):
    python agent.py --ckpt runs/turns/rl/ckpt.pt                      # held-out task 0 (train_rl's cpu set)
    python agent.py --ckpt CKPT --task 5 --difficulties 3 --turns 2   # task 5 of the level-3 held-out tasks
    python agent.py --ckpt CKPT --prompt-file my_function.py          # your signature + docstring
  A prompt of your own is a `def` line and a docstring with `>>> name(args)` examples, each followed
  by the expected value on the next line; those examples are its only tests.
The last stdout line is a JSON summary (passed, turns used, outcome of each attempt, whether it decoded
speculatively). --out-dir (default runs/agent-PRESET) keeps transcript.txt, the text printed above it,
and summary.json, the summary with the prompt and every attempt's body.
"""
import argparse
import ast
import dataclasses
import json
import os
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


def read_project(root):
    """({relative path: text} of the project's .py files, its test file), or a one-line error
    (ValueError). Links, hidden files and directories and __pycache__ are skipped, and so is anything
    that is not a regular file (a FIFO named x.py would block the read forever); a file that is not
    UTF-8 is refused; line ends are kept as they are (newline="")."""
    if not os.path.isdir(root):
        raise ValueError(f"--repo: no directory {root!r}")
    files = {}
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__"
                         and not os.path.islink(os.path.join(here, d)))
        for name in sorted(names):
            path = os.path.join(here, name)
            if name.endswith(".py") and not name.startswith(".") and stat.S_ISREG(os.lstat(path).st_mode):
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                try:
                    with open(path, encoding="utf-8", newline="") as f:
                        files[rel] = f.read(env.MAX_FILE_CHARS + 1)
                except UnicodeDecodeError:
                    raise ValueError(f"--repo: {rel} is not UTF-8 text") from None
                if len(files[rel]) > env.MAX_FILE_CHARS or len(files) > MAX_FILES:
                    raise ValueError(f"--repo: {rel}: the agent works small projects (at most {MAX_FILES} "
                                     f"files of {env.MAX_FILE_CHARS} characters)")
    tests = [p for p in files if p.startswith("test_") and "/" not in p]     # at the top level
    if not tests:
        raise ValueError(f"--repo {root}: no test_*.py file at its top level to run")
    try:      # its top-level test_* functions are what runs (no unittest classes, no pytest fixtures)
        env.visible_run(SimpleNamespace(task_id="user/repo", test_file=tests[0]), files)
    except ValueError:
        raise ValueError(f"--repo: {tests[0]} has no top-level test_* function to run") from None
    return files, tests[0]


def project_task(files, test_file, issue):
    """The project as a repository task (the fields of data/repos.py's that env.Tools reads). It has no
    hidden tests (inputs None): the judge runs its own test file, as it was, on the final copy."""
    return SimpleNamespace(task_id="user/repo", files=files, issue=issue, test_file=test_file, inputs=None)


def show_tools(tok, task, tools, episode, verdict, out=None):
    """An agent episode as the model saw it: the prompt, then each action and its observation (to out,
    default: sys.stdout as it is at the call)."""
    out = out or sys.stdout
    print(tools.prompt(task), end="", file=out)
    for t, x in enumerate(episode.turns, 1):
        action = tok.decode(x.tokens)
        if x.summary:     # the context passed its threshold: a summary, then a fresh context
            print(f"--- turn {t}, a summary (then a fresh context: the issue and the summaries):\n{action}",
                  file=out)
            continue
        if t > 1 and x.segment > episode.turns[t - 2].segment and not episode.turns[t - 2].summary:
            print(f"--- the context passed its threshold: rebuilt ({tools.memory}: the issue and the latest "
                  f"turns{', old observations masked' if tools.memory == 'mask' else ''})", file=out)
        print(f"--- turn {t}: {action}", file=out)
        if x.feedback:
            print(x.feedback if x.feedback.endswith("\n") else x.feedback + "\n", end="", file=out)
    print(f"--- episode over ({episode.end}); the project's tests on the final copy: "
          f"{'PASS' if verdict.passed else 'FAIL'} ({env.test_report(verdict).splitlines()[0]})", file=out)


def strict_cases(test_text):
    """The test file's checks as cases a judge outside the candidate's process compares on plain data:
    [(module, function, args, expected)], when every top-level test_* function is `assert f(...) == X`
    or `got = f(...)` then `assert got == X` (a message allowed), f imported by name from a module of
    the project and every argument and X a literal; else None (the tests then run in the candidate's
    process, where an object whose __eq__ is always true passes: that verdict cannot be trusted)."""
    try:
        tree = ast.parse(test_text)
    except (SyntaxError, ValueError):
        return None
    names = {a.asname or a.name: (n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom)
             and n.level == 0 for a in n.names}
    cases = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")):
        body, call = fn.body, None
        if len(body) == 2 and isinstance(body[0], ast.Assign) and isinstance(body[1], ast.Assert) and \
                isinstance(body[1].test, ast.Compare) and isinstance(body[1].test.left, ast.Name) and \
                [t.id for t in body[0].targets if isinstance(t, ast.Name)] == [body[1].test.left.id]:
            call, test = body[0].value, body[1].test
        elif len(body) == 1 and isinstance(body[0], ast.Assert) and isinstance(body[0].test, ast.Compare):
            call, test = body[0].test.left, body[0].test
        if call is None or not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or \
                call.func.id not in names or call.keywords or [type(o) for o in test.ops] != [ast.Eq]:
            return None
        try:
            args, want = [ast.literal_eval(a) for a in call.args], ast.literal_eval(test.comparators[0])
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        cases.append((*names[call.func.id], args, want))
    return cases or None


def project_verdict(pool, task, repo):
    """(passed, trusted): the project's own tests, as they were, on the final copy: compared here on
    plain data where the test file allows it (strict_cases), else run in the candidate's process."""
    cases = strict_cases(task.files[task.test_file])
    if cases is None:
        return pool.run_batch([env.hidden_run(task, repo)])[0].passed, False
    files = {p: t for p, t in repo.items() if p != task.test_file}
    by_fn = {}
    for module, name, args, want in cases:
        by_fn.setdefault((module, name), []).append((args, want))
    runs = [Run(f"user/{m}.{f}", env.repo_program(files, f"from {m} import {f} as _judged"), "_judged",
                [a for a, _ in cs], [w for _, w in cs]) for (m, f), cs in by_fn.items()]
    return all(r.passed for r in pool.run_batch(runs)), True


def run_repo(args, model, tok, gen):
    """--repo: one agent episode on a copy of the project, printed; its final copy kept, or applied."""
    try:
        files, test_file = read_project(args.repo)
    except (OSError, ValueError) as e:
        common.die(str(e))
    if not tok.tools:
        common.die(f"{args.ckpt}: no tool tokens; --repo needs an agent checkpoint (AGENT=1 bash run.sh)")
    issue = args.issue or f"A test in {test_file} fails. Find the bug and fix it."
    task = project_task(files, test_file, issue)
    # the memory carries an episode past the context: past the threshold of the model's whole context
    # (env.summary_at) it summarises, masks old observations or slides (--memory: the one RL trained)
    tools = env.Tools(max_actions=env.LONG_ACTIONS, memory=args.memory, window=model.config.seq_len)
    with SandboxPool(workers=1) as pool:
        ep = env.run_episodes(model, tok, [task], 1, tools, pool, args.temperature, args.max_new_tokens,
                              generator=gen)[0]
        passed, trusted = project_verdict(pool, task, ep.repo)
    verdict = ep.result if passed == ep.result.passed else \
        dataclasses.replace(ep.result, passed=passed, outcome="pass" if passed else "wrong_answer")
    show_tools(tok, task, tools, ep, verdict)
    changed = sorted(p for p in files if ep.repo[p] != files[p])
    for p in changed:
        dest = os.path.join(args.out_dir, "repo", p)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "w", encoding="utf-8", newline="") as f:
            f.write(ep.repo[p])
        if args.apply:                     # only when asked: the user's own files, each replaced atomically
            with common.atomic_open(os.path.join(args.repo, p)) as f:
                f.write(ep.repo[p])
    with open(os.path.join(args.out_dir, "transcript.txt"), "w") as f:
        show_tools(tok, task, tools, ep, verdict, out=f)
    if not trusted:
        print("note: the verdict ran your tests in the candidate's process (they are not all "
              "`assert f(...) == literal`): code whose result overrides == could pass; it cannot be trusted",
              file=sys.stderr)
    common.print_summary({"repo": args.repo, "passed": passed, "verdict_trusted": trusted,
                          "turns": len(ep.turns),
                          "end": ep.end, "actions": [a.name for a in ep.actions],
                          "changed": changed, "applied": bool(args.apply and changed),
                          "out_dir": args.out_dir,
                          "ckpt": args.ckpt})


def show(task, episode, out=None):
    """A feedback episode: the prompt, then each attempt with its verdicts (to out, default: sys.stdout)."""
    out = out or sys.stdout
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default, as the other scripts' --help."""


def main(argv=None):
    p = common.ArgumentParser(prog="agent.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ckpt", help="model checkpoint (train_pretrain.py, train_mtp.py or train_rl.py; only "
                   "train_mtp.py's has the MTP modules that speculative decoding needs), required")
    p.add_argument("--repo", default=None, help="the agent: a project directory (with a test_*.py file) to "
                   "work through tools, on a copy")
    p.add_argument("--issue", default=None, help="with --repo: the issue text the agent reads first")
    p.add_argument("--apply", action="store_true", help="with --repo: write the changed files back into it")
    p.add_argument("--memory", choices=["summary", "mask", "window"], default="summary",
                   help="with --repo: how an episode goes on past its context (train_rl.py --memory)")
    p.add_argument("--prompt-file", default=None,
                   help="your signature + docstring with >>> examples ('-' = stdin)")
    p.add_argument("--task", type=int, default=0, help="index of a held-out env task (without --prompt-file)")
    p.add_argument("--task-seed", type=int, default=0, help="held-out task seed")
    p.add_argument("--difficulties", default="1-2", help="held-out task levels, e.g. 1-2")
    p.add_argument("--turns", type=int, help="attempts at most")
    p.add_argument("--max-new-tokens", type=int, help="tokens per attempt")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--no-speculative", action="store_true", help="decode plainly even if the checkpoint has "
                   "MTP modules (train_mtp.py); speculative decoding samples the same distribution "
                   "(its speed: docs/speculative.md)")
    args = common.parse_args(p, PRESETS, argv)
    if args.turns < 1 or args.max_new_tokens < 1:
        common.die("--turns and --max-new-tokens must be >= 1")
    if not args.ckpt:
        common.die("--ckpt CKPT is required")
    if not (os.path.isfile(args.ckpt) or os.path.isdir(args.ckpt)):   # a directory: a Hugging Face model's
        common.die(f"no checkpoint at {args.ckpt!r}")
    if args.repo:
        device = common.pick_device(args.device)
        model, tok, _ = hf.load_checkpoint(args.ckpt, device)
        os.makedirs(args.out_dir, exist_ok=True)
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
    show(task, ep)
    summary = {"task_id": task.task_id, "passed": ep.result.passed, "turns": len(ep.turns),
               "outcomes": [r.outcome for r in ep.results], "ckpt": args.ckpt,
               "speculative": model.config.n_mtp > 0 and not args.no_speculative}
    # --out-dir keeps the episode: the transcript as printed, and the summary with every attempt's body
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "transcript.txt"), "w") as f:
        show(task, ep, out=f)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump({**summary, "prompt": env.render_prompt(task),
                   "attempts": [x.text for x in ep.turns]}, f, indent=1)
    common.print_summary({**summary, "out_dir": args.out_dir})


if __name__ == "__main__":
    main()
