"""
agent.py: multi-step episodes, the agentic coding loop of Composer 2 in miniature. The model writes
a function body, the harness runs the docstring's examples (the tests the model can see) in the
sandbox, and if one fails the model reads what failed and writes the body again, up to --turns
attempts. The last attempt is judged on the hidden tests. Training (train_rl.py --turns), eval
(eval.py --turns) and this command run the same episodes (run_episodes); the context of an episode
is env.render_episode's text at every turn. The sampling helpers eval.sample_completions shares with
the episodes live here too: encode_prompts and as_sample (decoding itself: decode.generate_streams).

Watch a model work through a task, turn by turn (this is the harness of the deployed model), e.g.
after `TURNS=3 OUT=runs/turns bash run.sh` (a base model that has seen feedback, a context for 3 turns):
    python agent.py --ckpt runs/turns/rl/ckpt.pt                      # held-out task 0 (train_rl's cpu set)
    python agent.py --ckpt CKPT --task 5 --difficulties 3 --turns 2   # task 5 of the level-3 held-out tasks
    python agent.py --ckpt CKPT --prompt-file my_function.py          # your signature + docstring
  A prompt of your own is a `def` line and a docstring with `>>> name(args)` examples, each followed
  by the expected value on the next line; those examples are its only tests.
The last stdout line is a JSON summary (passed, turns used, outcome of each attempt).
"""
import argparse
import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see eval.py
import torch
from tqdm import tqdm

import common
import decode
import env
from tasks import Task, generate_tasks, parse_difficulties

PRESETS = {
    "smoke": dict(turns=2, max_new_tokens=24, temperature=0.8),
    "cpu": dict(turns=3, max_new_tokens=96, temperature=0.8),
    "gpu": dict(turns=3, max_new_tokens=256, temperature=0.8),
}


# ---------------------------------------------------------------------------------------------
# Episodes: THE one place that runs the multi-turn loop

def run_episodes(model, tok, tasks, n, turns, pool, temperature, max_new_tokens, top_p=1.0, top_k=0,
                 batch_size=64, generator=None, return_routes=False, fractional=False, progress=False):
    """n episodes per task of up to `turns` attempts, rows task by task (the n episodes of task i
    are contiguous, the group RL needs), batch_size rows at a time through all their turns.

    An episode ends when its attempt passes the visible examples, when the turn budget is spent,
    when the task has no visible examples, or when another turn would not fit the context. Each
    further turn continues the row's KV cache (model.generate's past): the feedback is appended,
    nothing is re-read. The hidden tests judge every attempt (for the self-repair curve); the
    reward is the verdict on the last one. Returns per episode {"task_idx", "turns": one sample per
    attempt (as_sample's dict, prompt_ids = the tokens fed that turn, plus "feedback": the
    text appended after it, "" for the last, and "visible_passed": the verdict of the docstring's
    examples, None where they were not run), "results": the hidden-test Result of each attempt,
    "result": the last one, or the sandbox_error of a visible-example run that failed}."""
    device = next(model.parameters()).device
    prompts, truncated = encode_prompts(model, tok, tasks, max_new_tokens)
    visible = [env.visible_task(t) for t in tasks]
    rows = [i for i in range(len(tasks)) for _ in range(n)]
    episodes, was_training = [], model.training
    model.eval()
    try:
        for s in tqdm(range(0, len(rows), batch_size), desc="episodes", disable=not progress, leave=False):
            chunk = rows[s:s + batch_size]
            eps = [{"task_idx": i, "turns": [], "results": []} for i in chunk]
            feeds, pasts = {j: prompts[i] for j, i in enumerate(chunk)}, {}   # what row j feeds next
            for turn in range(turns):
                live, more = sorted(feeds), turn < turns - 1
                if not live:
                    break
                with common.autocast(device):
                    gens = decode.generate_streams(model, [feeds[j] for j in live], max_new_tokens,
                                                   temperature=temperature, top_k=top_k, top_p=top_p,
                                                   stop_ids=[tok.eot_id], generator=generator,
                                                   return_routes=return_routes, return_past=more,
                                                   past=[pasts[j] for j in live] if turn else None)
                samples = [as_sample(tok, g, chunk[j], feeds[j], turn == 0 and truncated[chunk[j]])
                           for j, g in zip(live, gens)]
                hidden = pool.submit_batch([tasks[x["task_idx"]] for x in samples],
                                           [x["completion"] for x in samples], fractional)
                check = [(j, x) for j, x in zip(live, samples) if more and visible[x["task_idx"]] is not None]
                seen = pool.run_batch([visible[x["task_idx"]] for _, x in check], [x["completion"] for _, x in check])
                seen = {j: r for (j, _), r in zip(check, seen)}
                old, feeds, pasts = {j: x.pop("past", None) for j, x in zip(live, samples)}, {}, {}
                for j, x, r in zip(live, samples, hidden.result()):
                    eps[j]["turns"].append(x)
                    eps[j]["results"].append(r)
                    x["feedback"] = ""
                    v = seen.get(j)
                    x["visible_passed"] = None if v is None else v.passed   # None: not run (last turn)
                    if v is not None and v.outcome == "sandbox_error":   # the harness failed, not the model:
                        eps[j]["lost"] = v                                # the episode is not scored
                    if v is None or v.passed or v.outcome == "sandbox_error":
                        continue
                    fb, feed = feedback_feed(tok, tasks[x["task_idx"]], x, v)
                    if old[j].size(3) + len(feed) + max_new_tokens <= model.config.seq_len:
                        x["feedback"], feeds[j], pasts[j] = fb, feed, old[j]
            for e in eps:
                e["result"] = e.pop("lost", e["results"][-1])
            episodes += eps
    finally:
        model.train(was_training)
    return episodes


def encode_prompts(model, tok, tasks, max_new_tokens):
    """Each task's prompt as token ids, and whether it was cut. A prompt longer than the context minus
    the generation budget keeps its END (the signature and docstring to continue sit at the end;
    HumanEval's imports and helpers come first), but never less than half the context: past seq_len,
    RoPE positions the model never trained on cost less than a prompt cut to nothing. Rare with the
    env tasks; flagged per sample."""
    keep = max(model.config.seq_len - max_new_tokens, model.config.seq_len // 2)
    full = [tok.encode(env.render_prompt(t)) for t in tasks]
    return [p[-keep:] for p in full], [len(p) > keep for p in full]


def as_sample(tok, g, task_idx, prompt_ids, prompt_truncated=False):
    """One generate() output -> the sample dict (see sample_completions)."""
    toks = list(g["tokens"])
    # ids past the BPE ranks (pad; a model vocab padded beyond the tokenizer's) have no text: they
    # are dropped from the decoded text, not an error
    text = tok.decode([t for t in toks if t < tok.eot_id])
    d = {"task_idx": task_idx, "prompt_ids": prompt_ids, "tokens": toks, "logprobs": list(g["logprobs"]),
         "text": text, "completion": env.extract_completion(text), "stopped": bool(toks) and toks[-1] == tok.eot_id,
         "prompt_truncated": prompt_truncated}
    for key in ("routes", "past"):
        if key in g:
            d[key] = g[key]
    return d


def feedback_feed(tok, task, attempt, seen):
    """After a failed attempt (`seen`: its visible-example Result): the feedback text, and the ids a
    next turn feeds on top of the attempt's cache, which holds prompt + tokens[:-1]. A turn cut by
    max_new_tokens feeds its last token now; a turn that ended on end-of-text never feeds that token."""
    fb = env.render_feedback(task, seen, attempt["text"])
    return fb, ([] if attempt["stopped"] else attempt["tokens"][-1:]) + tok.encode(fb)


def repair_prompt(tok, task, attempt, seen):
    """Every id the second turn after a failed first `attempt` reads: what run_episodes' cache holds
    then, as one prompt (train_rl.py --repair-groups samples G repairs from it)."""
    return attempt["prompt_ids"] + attempt["tokens"][:-1] + feedback_feed(tok, task, attempt, seen)[1]


def resubmits(attempt, previous):
    """Does `attempt` resubmit the `previous` attempt's code unchanged (up to trailing whitespace): a
    try that ignored the feedback? eval.py's repeat rate and --repair-groups' "repeat" both count it."""
    return attempt["completion"].rstrip() == previous["completion"].rstrip()


def context_ids(episode):
    """Every token of an episode in order, as the model saw and wrote them (its last token included)."""
    ids = []
    for t in episode["turns"]:
        ids += t["prompt_ids"] + t["tokens"][:-1]
    return ids + episode["turns"][-1]["tokens"][-1:]


# ---------------------------------------------------------------------------------------------
# The command: one episode, printed turn by turn

def user_task(text):
    """A Task from a signature + docstring typed by a user: its `>>>` examples are its tests."""
    text = text if text.endswith("\n") else text + "\n"
    defs = [ln.split("def ", 1)[1].split("(")[0].strip() for ln in text.splitlines() if ln.lstrip().startswith("def ")]
    if not defs:
        raise ValueError("the prompt has no `def name(...):` line")
    task = Task("user/0", text, defs[-1])
    cases = env.visible_tests(task)
    if not cases:
        raise ValueError(f"the docstring of {defs[-1]} has no `>>> {defs[-1]}(...)` example with its answer on the "
                         f"next line: nothing to test against")
    task.inputs, task.outputs = [a for a, _ in cases], [w for _, w in cases]
    return task


def show(task, episode, out=sys.stdout):
    print(env.render_prompt(task), end="", file=out)
    for t, (x, r) in enumerate(zip(episode["turns"], episode["results"]), 1):
        seen = {None: "", True: ", visible examples: pass", False: ", visible examples: fail"}[x.get("visible_passed")]
        print(f"# --- attempt {t} (hidden tests: {r.outcome}{seen}) ---", file=out)
        print(x["text"] if x["text"].endswith("\n") else x["text"] + "\n", end="", file=out)
        if x["feedback"]:
            print(f"# --- feedback (visible examples) ---\n{x['feedback']}", end="", file=out)
    r = episode["result"]
    print(f"# --- verdict after {len(episode['turns'])} attempt(s): {'PASS' if r.passed else 'FAIL'} "
          f"({r.outcome}: {r.feedback}) ---", file=out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="agent.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="model checkpoint (train_pretrain.py or train_rl.py), required")
    p.add_argument("--prompt-file", default=None, help="your signature + docstring with >>> examples ('-' = stdin)")
    p.add_argument("--task", type=int, default=0, help="index of a held-out env task (without --prompt-file)")
    p.add_argument("--task-seed", type=int, default=0, help="held-out task seed")
    p.add_argument("--difficulties", default="1-2", help="held-out task levels, e.g. 1-2")
    p.add_argument("--turns", type=int, help="attempts at most")
    p.add_argument("--max-new-tokens", type=int, help="tokens per attempt")
    p.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
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
    gen = torch.Generator(device=device).manual_seed(args.seed)
    with env.SandboxPool(workers=1) as pool:
        ep = run_episodes(model, tok, [task], 1, args.turns, pool, args.temperature, args.max_new_tokens,
                          generator=gen)[0]
    show(task, ep)
    common.print_summary({"task_id": task.task_id, "passed": ep["result"].passed, "turns": len(ep["turns"]),
                          "outcomes": [r.outcome for r in ep["results"]]})


if __name__ == "__main__":
    main()
