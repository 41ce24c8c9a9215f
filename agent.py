"""
agent.py: the interactive command. The model writes a function body, the harness runs the
docstring's examples (the tests the model can see) in the sandbox, and if one fails the model reads
what failed and writes the body again, up to --turns attempts: Composer 2's agentic loop in
miniature. The last attempt is judged on the hidden tests. Training (train_rl.py --turns), eval
(eval.py --turns) and this command run the same episodes (infra/engine.py: run_episodes); the
context of an episode is env.render_episode's text at every turn.

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
import json
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see eval.py
import torch

from infra import common
from infra import engine, fast, speculative
import env
from data.tasks import Task, generate_tasks, parse_difficulties

PRESETS = {
    "smoke": dict(turns=2, max_new_tokens=24, temperature=0.8),
    "cpu": dict(turns=3, max_new_tokens=96, temperature=0.8),
    "gpu": dict(turns=3, max_new_tokens=256, temperature=0.8),
}


# ---------------------------------------------------------------------------------------------
# Episodes: THE one place that runs the multi-turn loop

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


def show(task, episode, out=sys.stdout):
    print(env.render_prompt(task), end="", file=out)
    for t, (x, r) in enumerate(zip(episode["turns"], episode["results"]), 1):
        seen = {None: "", True: ", visible examples: pass",
                False: ", visible examples: fail"}[x.get("visible_passed")]
        print(f"# --- attempt {t} (hidden tests: {r.outcome}{seen}) ---", file=out)
        print(x["text"] if x["text"].endswith("\n") else x["text"] + "\n", end="", file=out)
        if x["feedback"]:
            print(f"# --- feedback (visible examples) ---\n{x['feedback']}", end="", file=out)
    r = episode["result"]
    print(f"# --- verdict after {len(episode['turns'])} attempt(s): {'PASS' if r.passed else 'FAIL'} "
          f"({r.outcome}: {r.feedback}) ---", file=out)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every flag's default, as the other scripts' --help."""


def main(argv=None):
    p = common.ArgumentParser(prog="agent.py", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ckpt", help="model checkpoint (train_pretrain.py, train_mtp.py or train_rl.py; only "
                   "train_mtp.py's has the MTP modules that speculative decoding needs), required")
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
    if not os.path.isfile(args.ckpt):
        common.die(f"no checkpoint at {args.ckpt!r}")
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
    model, tok, _ = common.load_checkpoint(args.ckpt, device)
    # A checkpoint with MTP modules drafts tokens that one forward checks (speculative.generate):
    # exactly the model's samples, several tokens per forward (docs/speculative.md).
    fast.SPECULATIVE = model.config.n_mtp > 0 and not args.no_speculative
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with env.SandboxPool(workers=1) as pool:
        ep = engine.run_episodes(model, tok, [task], 1, env.Feedback(args.turns), pool, args.temperature,
                                 args.max_new_tokens, generator=gen)[0]
    show(task, ep)
    summary = {"task_id": task.task_id, "passed": ep["result"].passed, "turns": len(ep["turns"]),
               "outcomes": [r.outcome for r in ep["results"]], "ckpt": args.ckpt,
               "speculative": model.config.n_mtp > 0 and not args.no_speculative}
    # --out-dir keeps the episode: the transcript as printed, and the summary with every attempt's body
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "transcript.txt"), "w") as f:
        show(task, ep, out=f)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump({**summary, "prompt": env.render_prompt(task),
                   "attempts": [x["text"] for x in ep["turns"]]}, f, indent=1)
    common.print_summary({**summary, "out_dir": args.out_dir})


if __name__ == "__main__":
    main()
