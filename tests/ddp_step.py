"""train_rl.rl_step on groups given in advance, as a process of its own (torchrun for several ranks):
the DDP tests compare one process with two on the very same groups, so that what differs is only how
the step's gradient is split and summed over ranks, never what was sampled.

    python tests/ddp_step.py GROUPS.pkl STEPS '{"moe_aux_scale": 100}' --preset smoke --init-from CKPT ...

GROUPS.pkl holds a list of groups (lists of rl.algo.Sequence, advantages set); rank r trains groups
r, r + W, ... (its share of each step's --batch-tasks, from the queue: nothing is sampled). One JSON line
per step: loss, grad_norm, trained_seqs and the last epoch's clip fraction."""
import json
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import common  # noqa: E402
from rl.rollouts import reduce_stats  # noqa: E402
import train_rl  # noqa: E402

if __name__ == "__main__":
    path, steps, fixed, argv = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
    args = common.parse_args(train_rl.p, train_rl.PRESETS, argv)
    vars(args).update(fixed)
    ctx = train_rl.setup(args)
    with open(path, "rb") as f:
        groups = pickle.load(f)[ctx.rank::ctx.world]
    ctx.rollout = lambda *a: ([], [])       # a rank whose share runs out samples nothing, and trains nothing
    for step in range(steps):
        ctx.state["queue"], groups = groups[:ctx.per_rank], groups[ctx.per_rank:]
        stats = train_rl.rl_step(ctx, step)
        s, last = reduce_stats(ctx, stats), args.ppo_epochs - 1      # sums over ranks
        if ctx.master:
            print(json.dumps({"loss": s["loss_e0"], "grad_norm": stats["grad_norm"],
                              "trained_seqs": stats["trained_seqs"],
                              "clip_last": s[f"clip_e{last}"] / max(s[f"tokens_e{last}"], 1)}), flush=True)
    ctx.pool.close()
    common.cleanup_ddp()
