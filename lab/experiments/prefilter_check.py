"""lab/experiments/prefilter_check.py: does train_rl.py's --prefilter predict which groups carry signal?

    python -m lab.experiments.prefilter_check --ckpt runs/cpu/pretrain/ckpt.pt             # ~1.5 min on 2 cores
    python -m lab.experiments.prefilter_check --ckpt runs/cpu/rl/ckpt.pt --n-tasks 768 --k 4

Draws --n-tasks train tasks of the --difficulties mix, lets rollouts.prefilter keep 1/K of them (the tasks
whose reference solution's probability under the model predicts a mixed group), then samples --group-size
completions for EVERY task and scores them in the sandbox: the share of mixed groups (some pass, some fail),
all-pass groups and the pass rate among the kept and the dropped tasks. Ends with one JSON line.
"""
import json
import os
import sys
from collections import Counter
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from infra import common  # noqa: E402
import env  # noqa: E402
from sandbox import SandboxPool  # noqa: E402
from rl import rollouts  # noqa: E402
from data.tasks import generate_tasks, parse_difficulties  # noqa: E402

p = common.ArgumentParser(prog="prefilter_check.py", description=__doc__.split("\n\n")[0])
p.add_argument("--ckpt", required=True, help="a train_pretrain.py or train_rl.py checkpoint")
p.add_argument("--n-tasks", type=int, default=384, help="candidate train tasks")
p.add_argument("--k", type=int, default=3, help="--prefilter K: keep 1/K of the candidates")
p.add_argument("--difficulties", default="1,2-3,2-3", help="train-task levels (the cpu preset's mix)")
p.add_argument("--task-seed", type=int, default=99, help="seed of the train tasks (not the RL runs' stream)")
p.add_argument("--group-size", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=96)
p.add_argument("--temperature", type=float, default=1.0)


def group_table(tasks, passes, g, chosen):
    idx = [i for i, t in enumerate(tasks) if chosen(i)]
    n = max(len(idx), 1)
    return {"tasks": len(idx), "mixed": sum(0 < passes[i] < g for i in idx) / n,
            "all_pass": sum(passes[i] == g for i in idx) / n, "pass_rate": sum(passes[i] for i in idx) / (g * n),
            "levels": {str(k): v for k, v in sorted(Counter(tasks[i].difficulty for i in idx).items())}}


def main(argv=None):
    args = p.parse_args(argv)
    if args.k < 2 or args.n_tasks < args.k:
        common.die("--k must be >= 2 and --n-tasks >= --k")
    model, tok, _ = common.load_checkpoint(args.ckpt, "cpu")
    tasks = generate_tasks("train", args.n_tasks, seed=args.task_seed, difficulties=parse_difficulties(args.difficulties))
    rl_args = SimpleNamespace(max_new_tokens=args.max_new_tokens, micro_batch=32, temperature=args.temperature,
                              group_size=args.group_size)
    ctx = SimpleNamespace(model=model, tok=tok, args=rl_args, device=torch.device("cpu"))
    kept = {t.task_id for t in rollouts.prefilter(ctx, tasks, len(tasks) // args.k, Counter())}
    with SandboxPool(timeout_s=1.0) as pool:    # one-turn episodes of the loop RL samples in
        eps = env.run_episodes(model, tok, tasks, args.group_size, env.Feedback(1), pool,
                                  args.temperature, args.max_new_tokens, batch_size=128,
                                  generator=torch.Generator().manual_seed(0))
    passes = Counter()
    for e in eps:
        passes[e.task_idx] += e.result.passed
    summary = {"ckpt": args.ckpt, "k": args.k, "kept": group_table(tasks, passes, args.group_size, lambda i: tasks[i].task_id in kept),
               "dropped": group_table(tasks, passes, args.group_size, lambda i: tasks[i].task_id not in kept),
               "all": group_table(tasks, passes, args.group_size, lambda i: True)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
