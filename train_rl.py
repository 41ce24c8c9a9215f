"""
Phase two of the Composer 2 recipe (arXiv 2603.24477): group-relative policy-gradient RL against
sandboxed unit-test tasks, in the very harness eval.py measures with (env.run_episodes: env.render_prompt
-> generation -> env.extract_completion -> SandboxPool; --agent: repositories worked through tools).

    python train_rl.py --preset smoke --init-from runs/pt-smoke/ckpt.pt --out-dir runs/rl-smoke   # seconds
    python train_rl.py --init-from runs/cpu/pretrain/ckpt.pt --out-dir runs/cpu/rl             # cpu, ~14 min
    python train_rl.py --preset gpu --init-from runs/gpu/pretrain/ckpt.pt --out-dir runs/gpu/rl
    python -m torch.distributed.run --nproc_per_node 8 train_rl.py --preset gpu --init-from CKPT --out-dir DIR
    python train_rl.py --init-from CKPT --out-dir DIR --resume      # continue DIR/ckpt.pt exactly
  ablations (one flag each): --adv-std (GRPO advantages), --loss-norm token (DAPO) | sequence (GRPO),
    --no-router-replay, --kl-coef 0.01, --fractional, --len-penalty 0.02, --no-dynamic-sampling,
    --ppo-epochs 2, --eps-high 0.2 (no clip-higher), --no-pack-prompts (each prompt fed per sample)
  feedback (docs/episodes.md): --turns 3 (episodes),
    --repair-groups (single-turn groups + repairs of a failure)

One step is rl_step(ctx, step), in this order:
  sample     ctx.rollout, the rollout function setup chose (rl/rollouts.py single_turn, episodes,
             repair_groups or tool_episodes): G rollouts for each of the train stream's next tasks
             (rollouts.draw_tasks; never revisited: one epoch), scored in SandboxPool
  reward     rollouts.rewards: correctness, minus the length cost and the k1 KL when they are on
  advantage  rl/algo.py group_advantages: reward - group mean (Dr. GRPO); groups whose correctness
             does not vary are replaced by fresh tasks, sampled in another round (DAPO's dynamic
             sampling; rollouts.signal_groups keeps the others)
  loss       micro_batch_loss over the micro-batches (training_batches): token_logprobs with router
             replay -> ppo_token_loss x token_weights, backward
  step       optimizer.step(), then model.after_optimizer_step() (the MoE's aux-free routing bias)
main() loops it, then scores a canary task (score_canary), records the step (rl/rollouts.py record),
evaluates on held-out tasks (held_out) and checkpoints. Artefacts in --out-dir: ckpt.pt (model,
tokenizer, optimizer, the sampler's state, RNG, args), metrics.jsonl (one line per step, plus eval
lines). The last stdout line is a JSON summary. rl/algo.py holds the algorithm as pure functions,
rl/rollouts.py the sampling half of the step and what a run records.
"""
import argparse
import os
import time
from collections import Counter, namedtuple
from types import SimpleNamespace

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, so the sandbox workers
# (other processes, same cores) get the CPU while generation waits (see eval.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.distributed as dist
from tqdm import tqdm

import hf
from infra import common, plan
import env
from model import autocast
from sandbox import SandboxPool
from rl.algo import (Sequence, batch_tensors, group_advantages, micro_batches, pass_sums, ppo_token_loss,
                     token_logprobs, token_weights)
import eval as evaluation
from rl.rollouts import new_stats, record, summarize_run
from rl import rollouts
from data.repos import canary_repo_tasks, generate_repo_tasks
from data.tasks import canary_tasks, generate_tasks, parse_difficulties

# Presets: defaults, any flag wins. smoke: seconds, for tests. cpu: 2 cores, stopped by --max-minutes;
# why its train mix, held-out levels and prefilter: docs/results.md (RL: the cpu preset), docs/notes.md.
# Its gen_batch = B x G: one generate() call per round, so sandboxing never overlaps generation (on 2
# cores the overlap only slowed generation: docs/benchmarks.md, `python -m lab.bench rl`).
# FIXED: settings with no flag (the flags are run settings and the README's ablations), the same in
# every preset unless a preset sets its own; a test or tool sets them through main(argv, **settings).
FIXED = dict(
    warmup_steps=5, ckpt_every=20,              # LR warmup steps; steps between checkpoints (0: end only)
    sandbox_workers=None, sandbox_timeout=2.0,  # None: this machine's cores / local ranks; seconds a run
    eps_low=0.2,                                # PPO clip below (--eps-high: DAPO's clip-higher above)
    len_k=0.01, len_q=0.5,                      # k, q of the length cost C(x) (--len-penalty W turns it on)
    len_call_tokens=20, len_turn_tokens=10,     # x = tokens + 20 per tool call + 10 per further turn
    ds_max_tries=3,                             # extra rounds a step samples with --dynamic-sampling
    weight_decay=0.0, grad_clip=1.0,            # AdamW; the global gradient-norm clip (0 = off)
    moe_aux_scale=0.0,   # x the MoE aux loss (balance=aux models): 0, as router replay fixes the experts
    eval_n=8, eval_k=8, eval_seed=0, eval_difficulties="",   # held-out samples per task, pass@k, seed 0 to
    # tune on (eval.py reports on another), levels
    canary_every=10,     # every N steps a canary group is sampled and scored (a pass: a reward hack); 0 = off
    gen_batch=128,       # rows per generate() call (the sandbox scores a batch while the next one is
                         # generated; no overlap when one call holds a round, as in the cpu preset)
    eval_every=100,      # steps between held-out evals (also at start and end; 0 = only those)
)
PRESETS = {
    "smoke": dict(FIXED, steps=2, batch_tasks=2, group_size=4, max_new_tokens=24, temperature=1.0, lr=1e-4,
                  warmup_steps=0, micro_batch=8, gen_batch=64, eval_every=0, eval_tasks=4, ckpt_every=0,
                  canary_every=2, difficulties="", dynamic_sampling=False),
    "cpu": dict(FIXED, steps=400, max_minutes=13.5, batch_tasks=16, group_size=8, max_new_tokens=96,
                temperature=1.0, lr=3e-4, micro_batch=32, gen_batch=128, eval_every=100, eval_tasks=560,
                canary_every=10, difficulties="1,2-3,2-3", eval_difficulties="1-2", dynamic_sampling=True,
                prefilter=3, sandbox_timeout=1.0),
    "gpu": dict(FIXED, steps=400, batch_tasks=64, group_size=16, max_new_tokens=256, temperature=1.0, lr=5e-5,
                warmup_steps=10, micro_batch=64, gen_batch=512, eval_every=50, eval_tasks=500, eval_n=16,
                ckpt_every=50, canary_every=10, difficulties="1,2-3,2-3,4", eval_difficulties="1-3",
                dynamic_sampling=True, prefilter=3, max_minutes=60),   # docs/gpu.md: why
}


# ---------------------------------------------------------------------------------------------
# Arguments: run settings, and the ablations of the README's table

p = common.ArgumentParser(prog="train_rl.py", description=__doc__.split("\n\n")[0],
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
g = p.add_argument_group("run")
g.add_argument("--init-from", default=None, help="checkpoint to start from (train_pretrain.py's ckpt.pt)")
g.add_argument("--resume", action="store_true", help="continue exactly from OUT_DIR/ckpt.pt")
g.add_argument("--steps", type=int, help="RL steps (one batch of tasks each)")
g.add_argument("--max-minutes", type=float, default=0.0,
               help="stop (eval, checkpoint) after this wall time; 0 = off")
g = p.add_argument_group("rollouts")
g.add_argument("--batch-tasks", type=int, help="tasks per step, GLOBAL (split across ranks)")
g.add_argument("--group-size", type=int, help="completions per task (fixed group size, G)")
g.add_argument("--temperature", type=float,
               help="sampling temperature of the rollouts and the held-out evals")
g.add_argument("--max-new-tokens", type=int,
               help="generation budget per completion (also Dr. GRPO's constant)")
g.add_argument("--difficulties",
               help="train-task difficulty levels, e.g. 1-3 or 1,2 (empty = all); a level listed twice "
                    "is drawn twice as often, e.g. 1,2-3,2-3 (the odds of one draw: a rejected program "
                    "draws its level anew, so levels rejected more often are rarer among the tasks)")
g.add_argument("--turns", type=int, default=1,
               help="attempts per episode: after a failed visible example the model reads the feedback "
                    "and tries again (agent.py); 1 = single-shot")
g.add_argument("--repair-groups", action="store_true",
               help="also sample G repairs of one failed attempt per task (its feedback in the context) "
                    "as a group of their own: the self-repair tree of Olausson et al. 2023 "
                    "(rollouts.repair_groups); --turns 1 only")
g.add_argument("--agent", action="store_true",
               help="the agent: repository tasks (data/repos.py) worked through tools, G episodes a group, "
                    "rewarded by the hidden tests on the final repository (needs a checkpoint with tool "
                    "tokens: train_pretrain.py --mix ...,agent=W); --prefilter is for function tasks only; "
                    "an in-run eval of N tasks runs N x eval_n episodes (run.sh passes --eval-tasks 0 and "
                    "measures with eval.py --agent)")
g.add_argument("--memory", choices=["summary", "mask", "window", "oracle"], default="summary",
               help="--agent's long tasks, past the context threshold: the model writes a summary and goes "
                    "on from it; old observations masked; or a sliding window (env.Tools.rebuild); oracle: "
                    "the harness writes the summary in the run's first half, then the model (ReSum's order)")
g.add_argument("--long-share", type=float, default=0.3,
               help="--agent: the share of long tasks (self-summarization) in the train stream")
g.add_argument("--task-seed", type=int, default=1, help="seed of the train-task stream")
g = p.add_argument_group("reward")
g.add_argument("--fractional", action="store_true",
               help="reward = fraction of tests passed (default: 1 if all pass)")
g.add_argument("--len-penalty", type=float, default=0.0,
               help="W: reward -= W * C(completion tokens), Composer 2's concave length cost "
                    "(k, q: train_rl.FIXED)")
g.add_argument("--kl-coef", type=float, default=0.0,
               help="k1 KL to the initial model folded into the reward (0: no reference model is built)")
g = p.add_argument_group("advantage and loss")
g.add_argument("--adv-std", action="store_true",
               help="divide advantages by the group std (GRPO; default Dr. GRPO)")
g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction,
               help="replace groups whose correctness does not vary (all pass / all fail) with fresh tasks "
                    "(DAPO); each round samples the rank's whole share of --batch-tasks, surplus groups "
                    "wait one step in a queue")
g.add_argument("--prefilter", type=int, default=1,
               help="online difficulty filtering: draw K x the tasks a round needs and keep the 1/K "
                    "likeliest to give a mixed group (predicted from the policy's probability of the "
                    "reference solution); 1 = off")
g.add_argument("--eps-high", type=float, default=0.28,
               help="PPO clip above: ratio <= 1 + eps_high (clip-higher, DAPO; 0.2: symmetric); only binds "
                    "with --ppo-epochs > 1 or queued groups")
g.add_argument("--loss-norm", choices=["constant", "token", "sequence"], default="constant",
               help="constant: Dr. GRPO; token: DAPO; sequence: GRPO")
g.add_argument("--ppo-epochs", type=int, default=1,
               help="optimizer steps per batch (1 = on-policy, single epoch)")
g.add_argument("--micro-batch", type=int, help="sequences per training forward (memory)")
g.add_argument("--pack-prompts", action=argparse.BooleanOptionalAction, default=True,
               help="training forward feeds each group's prompt once, not once per sample "
                    "(rl/algo.py pack_groups: the same logits and gradients, float rounding apart); "
                    "single-turn only")
g.add_argument("--router-replay", action=argparse.BooleanOptionalAction, default=True,
               help="train on the experts the sampler used, recorded at generation (Composer 2's router "
                    "replay; --no-router-replay: on the router's own choices)")
g.add_argument("--lr", type=float, help="peak learning rate (AdamW, constant after the warmup)")
g = p.add_argument_group("evaluation")
g.add_argument("--eval-tasks", type=int,
               help="held-out env test-split tasks (0: no held-out eval, as run.sh's episode stage, "
                    "which its eval stage measures)")
plan.add_plan_args(p)   # --dry-run, --world-size, --plan-device


# ---------------------------------------------------------------------------------------------
# The loop: one RL step, the canary, the record, then held-out evals, checkpoints and the clock

def main(argv=None, **settings):
    """Parses argv (flags over the preset); settings fix values of train_rl.FIXED (tests, tools)."""
    args = common.parse_args(p, PRESETS, argv)
    if set(settings) - set(FIXED):
        raise TypeError(f"train_rl.main: {sorted(set(settings) - set(FIXED))} "
                        "are not settings of train_rl.FIXED")
    vars(args).update(settings)
    if args.dry_run:                    # the plan (batch, memory, time), then exit
        directory = args.init_from and os.path.isdir(args.init_from)     # a Hugging Face model's config
        plan.rl_plan(args, args.world_size or common.dist_env()[2],
                     hf.load_checkpoint(args.init_from, "meta")[0].config if directory else None)
    ctx = setup(args)
    state = ctx.state                   # everything a checkpoint holds besides weights and optimizer
    if "before" not in state["evals"]:
        state["evals"]["before"] = held_out(ctx, "before", state["step"])
    pbar = tqdm(range(state["step"], args.steps), disable=not ctx.master, initial=state["step"],
                total=args.steps, desc="rl", dynamic_ncols=True)
    for step in pbar:
        stats = rl_step(ctx, step)          # sample -> reward -> advantage -> loss -> step
        score_canary(ctx, step, stats)      # the reward-hack probe, scored after, never trained on
        record(ctx, step, stats, pbar)
        state["step"] = done = step + 1
        stop = time_is_up(ctx)
        last = done == args.steps or stop
        if args.eval_every and done % args.eval_every == 0 and not last:
            state["evals"][f"step{done}"] = held_out(ctx, f"step{done}", done)
        if args.ckpt_every and done % args.ckpt_every == 0 and not last:
            save(ctx)
        if stop:
            if ctx.master:
                tqdm.write(f"--max-minutes {args.max_minutes} reached after step {done}")
            break
    pbar.close()
    state["evals"]["after"] = held_out(ctx, "after", state["step"])
    save(ctx)
    ctx.pool.close()
    summary = summarize_run(ctx)
    common.cleanup_ddp()
    if ctx.master:
        common.print_summary(summary)
    return summary


# ---------------------------------------------------------------------------------------------
# One RL step

def rl_step(ctx, step):
    """One optimizer step of group-relative RL, sample -> reward -> advantage -> loss -> step (Dr.
    GRPO advantages, DAPO's dynamic sampling and clip-higher, router replay). Returns the step's
    statistics (rl/rollouts.py new_stats). Every rank takes part, with or without groups of its own."""
    args, model, optimizer = ctx.args, ctx.model, ctx.optimizer
    stats = new_stats(args)
    # sample -> reward -> advantage, in rounds, until this rank has its share of groups with signal
    groups = groups_with_signal(ctx, step, stats)

    t0 = time.time()
    batches, advs, counts = training_batches(ctx, groups)     # micro-batches; counts over all ranks
    stats["lr"], stats["trained_seqs"] = lr_at(step, args), counts.n_seqs
    for pg in optimizer.param_groups:
        pg["lr"] = stats["lr"]
    model.train()
    for epoch in range(args.ppo_epochs if counts.n_seqs else 0):   # 1 = on-policy: the ratio is 1
        optimizer.zero_grad(set_to_none=True)
        # loss: forward + backward per micro-batch, the gradients summed; every rank runs as many
        # forwards (padding_batch where it has fewer micro-batches than another)
        for i in range(counts.n_forwards):
            if i < len(batches):
                micro_batch_loss(ctx, batches[i], advs[i], counts, stats, epoch)
            else:
                micro_batch_loss(ctx, padding_batch(ctx), [0.0], counts, stats, epoch)
        if ctx.ddp:
            all_reduce_grads(ctx.params)
        # step: clip the global gradient norm, AdamW, then the MoE's aux-free bias from the replayed loads
        gnorm = torch.nn.utils.clip_grad_norm_(ctx.params,
                                               args.grad_clip if args.grad_clip > 0 else float("inf"))
        stats["grad_norm"] += gnorm.item() / args.ppo_epochs
        optimizer.step()
        model.after_optimizer_step()
    stats["moe"] = model.moe_metrics() if model.n_moe_layers and counts.n_seqs else {}
    stats["train_s"] += time.time() - t0
    return on_host(stats)


def on_host(stats):
    """The step's statistics with the sums the micro-batches kept on the device read, in one go."""
    keys = [k for k, v in stats.items() if torch.is_tensor(v)]
    for k, v in zip(keys, torch.stack([stats[k].double() for k in keys]).tolist() if keys else []):
        stats[k] = v
    return stats


def groups_with_signal(ctx, step, stats):
    """This rank's --batch-tasks / W groups for one step, each a group whose correctness varies: first
    the groups the last step left over (sampled before its update, the PPO ratio corrects for that;
    trained on once, else dropped), then rounds of fresh tasks (sample_round). With DAPO's dynamic
    sampling (Yu et al. 2025) up to ds_max_tries more rounds replace the groups without signal; the
    surplus of the last round waits in the queue for the next step."""
    groups, ctx.state["queue"] = ctx.state["queue"][:ctx.per_rank], []
    stats["queued_groups"] += len(groups)
    for n in range(1 + (ctx.args.ds_max_tries if ctx.args.dynamic_sampling else 0)):
        need = ctx.per_rank - len(groups)
        if need <= 0:
            break
        fresh = sample_round(ctx, need, rollouts.Seed(step, round=n, rank=ctx.rank), stats)
        groups += fresh[:need]
        ctx.state["queue"] = fresh[need:ctx.per_rank + need]     # the surplus (repair groups: two a task)
        stats["rounds"] += 1
    return groups


def sample_round(ctx, need, seed, stats):
    """One sampling round, sample -> reward -> advantage: the rollouts of the train stream's next
    tasks, their rewards, and the groups worth training on with each sample's advantage."""
    args = ctx.args
    tasks = rollouts.draw_tasks(ctx, need, stats)           # the train stream's next tasks
    # sample: G rollouts per task (ctx.rollout: single_turn, episodes, repair_groups or tool_episodes) and
    # sandbox verdicts; a sandbox_error is the sandbox's failure, not the model's: not scored
    samples, results = ctx.rollout(ctx, tasks, seed, stats)
    scored = [(s, r) for s, r in zip(samples, results) if r.outcome != "sandbox_error"]
    # reward: correctness, minus the length cost and the k1 KL when they are on
    correct, reward = rollouts.rewards(ctx, scored, stats)
    # advantage: reward - group mean (Dr. GRPO), over the groups the rollout function labelled. A group
    # is kept if its CORRECTNESS varies (DAPO): a length cost or KL makes almost every shaped reward
    # differ, and all-pass / all-fail groups would train on that noise.
    groups = [s.group for s, _ in scored]
    adv, keep = group_advantages(reward, groups, std=args.adv_std,
                                 signal_from=correct if args.dynamic_sampling else None)
    rollouts.tally_samples(tasks, samples, results, scored, keep, stats)
    return rollouts.signal_groups(scored, adv, keep)


def training_batches(ctx, groups):
    """The step's groups -> (micro-batches as batch_tensors, their samples' advantages, global_counts).
    A micro-batch holds whole groups, each group's prompt fed once when packed (rl/algo.py
    micro_batches, pack_groups)."""
    model = ctx.model
    parts = micro_batches(groups, ctx.args.micro_batch, ctx.pack)
    batches = [batch_tensors(mb, ctx.tok.pad_id, model.n_moe_layers, model.config.top_k, ctx.replay, ctx.pack)
               for mb in parts]
    return batches, [[s.adv for s in mb] for mb in parts], global_counts(ctx, batches)


def micro_batch_loss(ctx, batch, adv, counts, stats, epoch):
    """The loss of one micro-batch, forward + backward: the policy's log-probs of the sampled tokens on
    the experts the sampler chose (token_logprobs with router replay), the PPO-clipped surrogate per
    token (ppo_token_loss), summed with the --loss-norm weights (token_weights). `batch` its
    batch_tensors, `adv` its samples' advantages, `counts` the step's global_counts."""
    args, model, dev = ctx.args, ctx.model, ctx.device
    # non_blocking: copies from the host that do not wait for the GPU's queue (gpu-check counts waits)
    tgt, old, valid = (x.to(dev, non_blocking=True) for x in (batch.tgt, batch.old, batch.valid))
    layout = {k: x.to(dev, non_blocking=True) for k, x in batch.layout.items()}
    adv = torch.tensor(adv, dtype=torch.float32).to(dev, non_blocking=True)
    mask = (tgt >= 0).float()
    with autocast(dev):
        logp, entropy = token_logprobs(model, batch.idx.to(dev, non_blocking=True), tgt,
                                       batch.routes.to(dev, non_blocking=True) if ctx.replay else None,
                                       args.temperature, valid, **layout)
    tok_loss, clipped = ppo_token_loss(logp, old, adv, args.eps_low, args.eps_high)
    # Dr. GRPO's constant: the sequences the step SAMPLED (B x G, fixed), times the generation budget;
    # that stays --max-new-tokens with --turns: a token weighs the same in a one-turn and a three-turn
    # run, so turns are not confounded with a smaller learning rate
    n_seqs = args.batch_tasks * args.group_size if args.loss_norm == "constant" else counts.n_seqs
    w = token_weights(mask, args.loss_norm, args.max_new_tokens, n_seqs, counts.n_tokens,
                      batch.seq_tokens.to(dev, non_blocking=True))   # a segment: its episode's tokens
    loss = (tok_loss * w).sum()
    # MoE aux loss: off by default. Under router replay the experts are fixed by generation, so the
    # balancing loss could only push gate values toward uniform: a gradient unrelated to reward.
    # Balance is kept by the aux-free bias (balance="bias"), updated from the replayed loads.
    # Each micro-batch's term weighs by its share of the GLOBAL positions: gradients are summed over
    # micro-batches and ranks, so the total is one token-weighted mean, whatever the number of ranks.
    if args.moe_aux_scale and model.config.balance == "aux":
        share = batch.valid.sum().item() / max(counts.n_positions, 1)   # the CPU copy: no device read
        loss = loss + args.moe_aux_scale * share * sum(m.aux for m in model.moe_layers())
    loss.backward()
    with torch.no_grad():   # sums kept on the device, read once a step (on_host): no sync per micro-batch
        sums = torch.stack([(tok_loss * w).sum(), mask.sum(), (clipped.float() * mask).sum(),
                            (entropy * mask).sum(),
                            ((old - logp) * mask).sum(),          # k1 vs the sampling policy
                            ((old - logp).abs() * mask).sum()])   # what router replay removes
        for name, x in zip(("loss", "tokens", "clip", "entropy", "kl_old", "mismatch"), sums):
            stats[f"{name}_e{epoch}"] += x


def padding_batch(ctx):
    """A one-row micro-batch of padding only (collate's layout, no target, no valid position), for a
    rank with fewer micro-batches than another: with balance="aux" the MoE all-reduces expert loads
    inside every training forward, so all ranks must run as many. Its loss and gradients are zero."""
    eot, model = ctx.tok.eot_id, ctx.model
    routes = torch.zeros(model.n_moe_layers, 1, model.config.top_k, dtype=torch.long)
    b = batch_tensors([Sequence([env.Turn([eot], [eot], [0.0], routes=routes)])],
                      ctx.tok.pad_id, model.n_moe_layers, model.config.top_k, ctx.replay, False)
    return b._replace(tgt=torch.full_like(b.tgt, -1), valid=torch.zeros_like(b.valid),
                      layout={"at": torch.zeros(0, dtype=torch.long)})


Counts = namedtuple("Counts", "n_seqs n_tokens n_positions n_forwards")


def global_counts(ctx, batches):
    """Counts(sequences (episodes: a segment counts its share), completion tokens, positions fed,
    micro-batches) of the step's batch_tensors: the first three summed over ranks (the loss
    denominators are global), the last the max over ranks (every rank runs as many forwards)."""
    c = torch.tensor([sum(b.seqs for b in batches), sum((b.tgt >= 0).sum().item() for b in batches),
                      sum(b.valid.sum().item() for b in batches)], dtype=torch.float64)
    n_mb = torch.tensor(len(batches))
    if ctx.ddp:
        dist.all_reduce(c)
        dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
    return Counts(c[0].item(), c[1].item(), c[2].item(), int(n_mb))


def all_reduce_grads(params):
    """Gradients SUMMED over ranks (each rank's loss already carries the global denominators). No DDP
    wrapper: ranks run different sample counts, and one flat all-reduce suffices."""
    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
    flat = torch.cat([x.flatten() for x in grads])
    dist.all_reduce(flat)
    for q, x in zip(params, flat.split([q.numel() for q in params])):
        q.grad = x.view_as(q)


def lr_at(step, args):
    """A linear warmup, then --lr: a few hundred on-policy steps need no decay."""
    return args.lr * min(1.0, (step + 1) / max(1, args.warmup_steps))


# ---------------------------------------------------------------------------------------------
# Around the step: the canary, and the held-out eval (through eval.py, the harness RL trains in)

def score_canary(ctx, step, stats):
    """Every canary_every steps (a setting) rank 0 samples a group for a canary task (hidden tests contradict
    its docstring: any pass is a reward hack) with the updated policy. Scored, never trained on."""
    args = ctx.args
    if not (ctx.master and ctx.canaries and step % args.canary_every == 0):
        return
    task = ctx.canaries[(step // args.canary_every) % len(ctx.canaries)]
    attempt = rollouts.tool_episodes if args.agent else rollouts.episodes if args.turns > 1 \
        else rollouts.single_turn                                                 # first attempts, no repairs
    _, results = attempt(ctx, [task], rollouts.Seed(step, part="canary"), stats)
    stats["canary_passes"] += sum(r.passed for r in results)
    stats["canary_samples"] += len(results)


def held_out(ctx, tag, at):
    """pass@1 / pass@k on the fixed held-out test tasks, overall and per slice (near / novel):
    through eval.evaluate_tasks, each rank scoring its share; the sums of per-task estimates and the
    counts of tasks scored are reduced, so no rank or unscorable task skews the means."""
    args = ctx.args
    if not args.eval_tasks:
        return {}
    t0 = time.time()
    mine = ctx.test_tasks[ctx.rank::ctx.world]
    kw = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch,
              seed=args.eval_seed + ctx.rank)
    if args.agent:          # the repository tasks, in the tool harness the step samples in
        r = evaluation.evaluate_agent(ctx.model, ctx.tok, mine, ctx.pool, args.eval_n, env.Tools(), **kw)
    else:
        r = evaluation.evaluate_tasks(ctx.model, ctx.tok, mine, ctx.pool, args.eval_n, ks=(1, args.eval_k),
                                      return_records=True, turns=args.turns, **kw)
    scored = [x for x in r["records"] if x["outcome"] != "sandbox_error"]   # not the model's failures
    per_task = {t.task_id: [getattr(t, "slice", ""), 0, 0] for t in mine}
    for rec in scored:
        per_task[rec["task_id"]][1] += 1
        per_task[rec["task_id"]][2] += rec["passed"]
    sums = pass_sums(list(per_task.values()), (1, args.eval_k))
    # the same names in the same order on every rank (a rank may have no task of a slice), so the
    # all-reduce adds like to like
    names = [f"pass@{k}{sl}" for k in (1, args.eval_k) for sl in ("", "_near", "_novel")]
    values = [x for n in names for x in sums.get(n, (0.0, 0))]
    # the self-repair curve: pass@1 after turn t, a mean over scored episodes (as eval.py)
    if args.turns > 1:
        for t in range(1, args.turns + 1):
            names.append(f"pass@1_turn{t}")
            values += [sum(x["passed_by_turn"][min(t, len(x["passed_by_turn"])) - 1] for x in scored),
                       len(scored)]
    v = torch.tensor(values + [sum(x["n_tokens"] for x in r["records"]), len(r["records"])],
                     dtype=torch.float64)
    if ctx.ddp:
        dist.all_reduce(v)
    out = {name: v[2 * i].item() / v[2 * i + 1].item() for i, name in enumerate(names) if v[2 * i + 1] > 0}
    out["mean_len"] = v[-2].item() / max(v[-1].item(), 1)
    out["eval_s"] = time.time() - t0
    ctx.state["totals"]["eval_s"] += out["eval_s"]
    if ctx.master:
        common.log_metrics(ctx.metrics_path, {"eval": tag, "step": at, "eval_seed": args.eval_seed, **out})
        tqdm.write(f"eval [{tag}] step {at}: pass@1 {out.get('pass@1', float('nan')):.3f}  "
                   f"pass@{args.eval_k} {out.get(f'pass@{args.eval_k}', float('nan')):.3f}  "
                   f"({out['eval_s']:.0f} s)")
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints and the clock

def time_is_up(ctx):
    """--max-minutes, decided together: every rank stops after the same step."""
    stop = torch.tensor(float(ctx.args.max_minutes > 0
                              and time.time() - ctx.t_start > 60 * ctx.args.max_minutes))
    if ctx.ddp:
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    return stop.item() > 0


def save(ctx):
    """Atomic checkpoint (common.save_checkpoint) of the model, the optimizer and ctx.state: with
    every rank's task-stream position and queue of surplus groups gathered, --resume continues the
    very same run."""
    st, args = ctx.state, ctx.args
    mine = (st["stream_pos"], st["queue"])
    gathered = [mine] * ctx.world
    if ctx.ddp:
        dist.all_gather_object(gathered, mine)
    if ctx.master:
        common.save_checkpoint(ctx.ckpt_path, ctx.model, ctx.tok, optimizer=ctx.optimizer.state_dict(),
                               step=st["step"], stream_pos=[pos for pos, _ in gathered],
                               queues=[q for _, q in gathered], rng=common.rng_state(), args=vars(args),
                               init_from=args.init_from, totals=dict(st["totals"]), evals=st["evals"],
                               hack_hist=st["hack_hist"], kind="rl")
    if ctx.ddp:
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# Setup. Argument errors die on every rank before any collective, so nothing hangs.

def check_args(args, world):
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    plan.tasks_per_rank(args.batch_tasks, world)
    if args.turns < 1:
        common.die(f"--turns must be >= 1, got {args.turns}")
    if args.repair_groups and args.turns > 1:
        common.die("--repair-groups is for --turns 1 (episodes sample their own repairs)")
    if args.agent and (args.turns > 1 or args.repair_groups):
        common.die("--agent runs its own episodes: no --turns or --repair-groups with it")
    if args.agent and not 0 <= args.long_share <= 1:
        common.die(f"--long-share must be in [0, 1], got {args.long_share}")
    if args.prefilter < 1:
        common.die(f"--prefilter must be >= 1 (1 = off), got {args.prefilter}")
    if args.group_size < 2:
        common.die("--group-size must be >= 2 (advantages are relative to the group)")
    if args.eval_n < args.eval_k and args.eval_tasks:
        common.die(f"eval_n {args.eval_n} < eval_k {args.eval_k}: pass@k needs n >= k samples per task")
    if args.resume and not os.path.isfile(ckpt_path):
        common.die(f"--resume: no checkpoint at {ckpt_path!r}")
    if not args.resume and not args.init_from:
        common.die("--init-from CKPT is required (a train_pretrain.py checkpoint)")
    if args.init_from and not (os.path.isfile(args.init_from) or os.path.isdir(args.init_from)):
        common.die(f"--init-from: no checkpoint at {args.init_from!r} (a file, or a model directory)")


def levels_of(flag, value):
    """A difficulty list; the error names the flag that was wrong."""
    try:
        return parse_difficulties(value or "")
    except ValueError as e:
        common.die(f"{flag}: {e}")


def task_sets(args, levels):
    """The first tasks of the train stream (rl/rollouts.py next_tasks extends it on demand) and the
    held-out test tasks; a difficulty list or count that gives none dies with a one-line error."""
    eval_levels = levels_of("--eval-difficulties", args.eval_difficulties)
    make = rollouts.agent_stream(args) if args.agent else generate_tasks    # repositories, or functions
    try:
        stream = make("train", min(4096 if not args.agent else 256, args.batch_tasks * max(1, args.steps)),
                      seed=args.task_seed, difficulties=levels)
        held = generate_repo_tasks if args.agent else make    # the agent's in-run eval: short tasks
        test_tasks = [] if not args.eval_tasks else held("test", args.eval_tasks, seed=args.eval_seed,
                                                         difficulties=eval_levels)
    except Exception as e:          # e.g. a difficulty level the generator does not have
        common.die(f"cannot generate tasks: {type(e).__name__}: {e}")
    if not stream:
        common.die(f"empty train task set (--difficulties {args.difficulties!r})")
    if args.eval_tasks and not test_tasks:
        common.die(f"empty held-out task set (--eval-difficulties {args.eval_difficulties!r}, "
                   f"--eval-tasks {args.eval_tasks})")
    return stream, test_tasks


def setup(args):
    """Everything the loop needs, in one namespace: model, tokenizer, optimizer, sandbox pool, task
    streams, the frozen reference (for --kl-coef) and the resumable `state`."""
    rank, _, world, device = common.setup_ddp(args.device)
    check_args(args, world)
    levels = levels_of("--difficulties", args.difficulties)
    stream, test_tasks = task_sets(args, levels)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        if not args.resume:
            common.reset_metrics(metrics_path)
    model, tok, ck = hf.load_checkpoint(ckpt_path if args.resume else args.init_from, device)
    ck = ck if args.resume else {}
    if args.agent and not tok.tools:
        common.die(f"--agent: {args.init_from or ckpt_path} has no tool tokens (start from the agent's "
                   "bootstrap: train_pretrain.py --mix ...,agent=W)")
    if args.agent and args.prefilter > 1:     # it ranks by a reference solution's probability: none here
        args.prefilter = 1
    # The tokenizer's special ids are what generation stops on and collate pads with.
    if max(tok.eot_id, tok.pad_id) >= model.config.vocab_size:
        common.die(f"tokenizer special ids ({tok.eot_id}, {tok.pad_id}) outside the model's vocabulary "
                   f"{model.config.vocab_size}")
    positions = ck.get("stream_pos", [0] * world)
    if len(positions) != world:
        common.die(f"--resume: checkpoint was written with {len(positions)} ranks, now {world}")
    state = {"step": ck.get("step", 0), "stream_pos": positions[rank],
             "queue": ck.get("queues", [[]] * world)[rank], "totals": Counter(ck.get("totals", {})),
             "evals": ck.get("evals", {}), "hack_hist": ck.get("hack_hist", [])}
    ref = None          # the starting checkpoint, frozen, for the k1 KL: only built when used
    if args.kl_coef > 0:
        ref, _, _ = hf.load_checkpoint(ck.get("init_from", args.init_from), device)
        ref.eval().requires_grad_(False)
    # AdamW. betas (0.9, 0.95) as in most LLM RL stacks (verl, OpenRLHF); no weight decay by default:
    # a few hundred on-policy steps should move the policy, not shrink it.
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if ck:
        optimizer.load_state_dict(ck["optimizer"])
        common.set_rng_state(ck["rng"])
    # The rollout function, chosen once (rl/rollouts.py): first attempts, multi-turn episodes, first
    # attempts plus repair groups, or tool episodes. The rest of the step is the same for all four.
    rollout = rollouts.tool_episodes if args.agent else rollouts.episodes if args.turns > 1 else \
        rollouts.repair_groups if args.repair_groups else rollouts.single_turn
    return SimpleNamespace(
        args=args, rank=rank, world=world, ddp=world > 1, master=rank == 0, device=device, model=model,
        tok=tok, ref=ref, params=params, optimizer=optimizer, state=state, stream=stream, levels=levels,
        test_tasks=test_tasks,
        canaries=(canary_repo_tasks() if args.agent else canary_tasks()) if args.canary_every else [],
        per_rank=plan.tasks_per_rank(args.batch_tasks, world),
        replay=args.router_replay and model.n_moe_layers > 0,
        pack=args.pack_prompts and args.turns == 1 and not args.agent, rollout=rollout,
        pool=SandboxPool(workers=args.sandbox_workers, timeout_s=args.sandbox_timeout),
        ckpt_path=ckpt_path, metrics_path=metrics_path, t_start=time.time())


if __name__ == "__main__":
    main()
