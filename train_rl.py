"""
Phase two of the Composer 2 recipe (arXiv 2603.24477): group-relative policy-gradient RL against
sandboxed unit-test tasks, in the very harness eval.py measures with (env.render_prompt ->
eval.sample_completions -> env.extract_completion -> env.SandboxPool).

    python train_rl.py --preset smoke --init-from runs/pt-smoke/ckpt.pt --out-dir runs/rl-smoke   # < 1 min
    python train_rl.py --init-from runs/cpu/pretrain/ckpt.pt --out-dir runs/cpu/rl                  # cpu, ~14 min
    python train_rl.py --preset gpu --init-from runs/gpu/pretrain/ckpt.pt --out-dir runs/gpu/rl
    python -m torch.distributed.run --nproc_per_node 8 train_rl.py --preset gpu --init-from CKPT --out-dir DIR
    python train_rl.py --init-from CKPT --out-dir DIR --resume      # continue DIR/ckpt.pt exactly
  ablations (one flag each): --adv-std (GRPO advantages), --loss-norm token (DAPO) | sequence (GRPO),
    --no-router-replay, --kl-coef 0.01, --fractional, --len-penalty 0.02, --no-dynamic-sampling,
    --ppo-epochs 2, --eps-high 0.2 (no clip-higher)

One step: take the next --batch-tasks tasks of the train split (a fixed stream, never revisited:
single epoch), sample --group-size completions each, score them in the sandbox, advantage =
reward - group mean (Dr. GRPO), one PPO-clipped policy-gradient update with router replay.
Artefacts in --out-dir: ckpt.pt (model, tokenizer, optimizer, step, task-stream position, RNG,
args), metrics.jsonl (one line per step, plus eval lines). The last stdout line is a JSON summary.
"""
import argparse
import math
import os
import time
from collections import Counter

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, so the sandbox workers
# (other processes, same cores) get the CPU while generation waits (see eval.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import common
import env
from tasks import canary_tasks, generate_tasks, parse_difficulties
import eval as evaluation

# Presets: defaults only, any flag wins. cpu: calibrated on 2 cores from the cpu pretraining
# checkpoint, scored by held-out pass@1 at the rollout temperature (1.0) on 256 test tasks x 8 (see
# the README). 16 tasks x 8 samples and LR 2e-4, constant, as the trial suggested (small);
# DAPO's dynamic sampling on: without it about half the groups are all-pass or all-fail and carry
# no gradient (+14.4 points after 240 steps / 12 min without, +16.5 after 172 steps / 14 min with;
# LR 3e-4: +14.1 without (cosine), +15.2 with). Stopped by the clock (--max-minutes): a run fits in 15 min.
# gen_batch = the whole batch: on 2 cores, sandboxing part of a batch while generating the next
# only slows generation (`python bench.py rl`); on more cores, smaller --gen-batch overlaps them.
PRESETS = {
    "smoke": dict(steps=2, batch_tasks=2, group_size=4, max_new_tokens=24, temperature=1.0, lr=1e-4,
                  warmup_steps=0, micro_batch=8, gen_batch=64, eval_every=0, eval_tasks=4, eval_n=8,
                  eval_temperature=1.0, ckpt_every=0, canary_every=2, difficulties="", eval_difficulties="",
                  dynamic_sampling=False),
    "cpu": dict(steps=400, max_minutes=13.5, batch_tasks=16, group_size=8, max_new_tokens=96, temperature=1.0,
                lr=2e-4, warmup_steps=5, micro_batch=32, gen_batch=128, eval_every=60, eval_tasks=256, eval_n=8,
                eval_temperature=1.0, ckpt_every=20, canary_every=10, difficulties="", eval_difficulties="",
                dynamic_sampling=True, sandbox_timeout=1.0),
    "gpu": dict(steps=400, batch_tasks=64, group_size=16, max_new_tokens=256, temperature=1.0, lr=5e-5,
                warmup_steps=10, micro_batch=64, gen_batch=512, eval_every=50, eval_tasks=500, eval_n=16,
                eval_temperature=1.0, ckpt_every=50, canary_every=10, difficulties="", eval_difficulties="",
                dynamic_sampling=True),
}


# ---------------------------------------------------------------------------------------------
# The algorithm, as small pure functions (tests/test_rl.py checks each on hand-made numbers)

def length_cost(x, k, q):
    """Composer 2's length penalty C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)): increasing and, for
    q > 0, concave (each extra token costs less than the last), so long answers to hard tasks are
    not crushed while padding easy ones still costs. q -> 1 gives log(1 + k x) / k; q = 0 is linear."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if abs(1 - q) < 1e-9:
        return torch.log1p(k * x) / k
    return ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))


def group_advantages(rewards, groups, std=False, eps=1e-6):
    """rewards (N,), groups (N,) group ids (a task's samples; sizes may differ after dropped
    samples) -> (advantages (N,), has_signal (N,) bool).
    Dr. GRPO (Liu et al. 2025) and Composer 2: A = r - mean(group). Dividing by the group's std
    (GRPO, Shao et al. 2024; std=True) over-weights groups whose rewards barely differ (nearly all
    right or all wrong). A group whose rewards are all equal has A = 0: no signal, skipped."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    g = torch.as_tensor(groups, dtype=torch.long)
    n = torch.bincount(g).double()
    mean = torch.zeros_like(n).index_add_(0, g, r) / n.clamp_min(1)
    var = torch.zeros_like(n).index_add_(0, g, (r - mean[g]) ** 2) / (n - 1).clamp_min(1)   # unbiased, as TRL
    adv = r - mean[g]
    if std:
        adv = adv / (var.sqrt()[g] + eps)
    return adv, (var[g] > 1e-12) & (n[g] > 1)


def ppo_token_loss(logp, old_logp, adv, eps_low=0.2, eps_high=0.28):
    """Per-token clipped surrogate to MINIMISE, -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)
    with ratio = pi / pi_old (PPO; GRPO uses it per token). eps_high > eps_low is DAPO's clip-higher
    (Yu et al. 2025): a rare token with A > 0 may grow further before the clip stops it, which
    keeps entropy from collapsing. Returns (loss (B, T), clipped (B, T) bool: the clip binds, the
    token's gradient is zero). adv: (B,) or (B, T). Single epoch on-policy: ratio = 1, no clipping."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def token_weights(mask, norm, max_new_tokens, n_seqs, n_tokens):
    """Weights w such that loss = sum(w * per-token loss). mask (B, T) float (completion tokens).
    n_seqs / n_tokens: GLOBAL counts (all ranks, all micro-batches), so the gradient is the same
    whatever the split across ranks and micro-batches.
      constant (Dr. GRPO): sum over tokens / (n_seqs * max_new_tokens): no length normalisation,
                           so long wrong answers are not penalised less per token than short ones;
      token    (DAPO):     sum over tokens / all tokens in the batch;
      sequence (GRPO):     mean over each sequence's tokens, then mean over sequences."""
    if norm == "constant":
        return mask / (n_seqs * max_new_tokens)
    if norm == "token":
        return mask / max(n_tokens, 1)
    if norm == "sequence":
        return mask / (mask.sum(1, keepdim=True).clamp_min(1) * n_seqs)
    raise ValueError(f"unknown loss norm {norm!r}")


def kl_k1(logp, ref_logp, mask):
    """k1 estimator of KL(pi || pi_ref) per sequence: sum over tokens of log pi - log pi_ref, on
    tokens sampled from pi. Composer 2 picks k1 over k3 (whose variance explodes as the policies
    drift apart) and, as here, folds it into the reward: r <- r - kl_coef * k1."""
    return ((logp - ref_logp) * mask).sum(-1)


def collate(samples, pad_id, n_moe_layers, top_k, with_routes):
    """Sample dicts (eval.sample_completions) -> idx (B, T), targets (B, T) with -1 on prompt and
    padding (the loss mask: completion tokens only), old logprobs (B, T), routes
    (n_moe_layers, B, T, top_k) or None. idx = prompt + tokens[:-1], right-padded (SPEC.md)."""
    seqs = [s["prompt_ids"] + s["tokens"] for s in samples]
    B, T = len(samples), max(len(x) for x in seqs) - 1
    idx = torch.full((B, T), pad_id, dtype=torch.long)
    tgt = torch.full((B, T), -1, dtype=torch.long)
    old = torch.zeros(B, T)
    routes = torch.zeros(n_moe_layers, B, T, top_k, dtype=torch.long) if with_routes else None
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        L, P = len(seq) - 1, len(s["prompt_ids"])
        idx[i, :L] = torch.tensor(seq[:-1])
        tgt[i, P - 1:L] = torch.tensor(s["tokens"])
        old[i, P - 1:L] = torch.tensor(s["logprobs"])
        if with_routes:
            routes[:, i, :L] = s["routes"]
    return idx, tgt, old, routes


def token_logprobs(model, idx, tgt, routes, temperature):
    """log pi(token) of every target (tgt >= 0; 0 elsewhere) under softmax(logits / T), the
    distribution generation sampled from (model.generate's logprobs; T = 0 is greedy: plain
    softmax), and the policy's entropy there. Only completion positions go through the LM head and
    the softmax: prompts are most of the tokens, and this halves the cost of a training step on CPU."""
    h = model.trunk(idx, torch.arange(idx.size(1), device=idx.device)[None], routes=routes)
    m = tgt >= 0
    logp_all = F.log_softmax(model.lm_head(h[m]).float() / (temperature or 1.0), -1)
    picked = logp_all.gather(-1, tgt[m][:, None]).squeeze(-1)
    logp = torch.zeros(tgt.shape, device=idx.device).masked_scatter(m, picked)
    with torch.no_grad():
        entropy = torch.zeros(tgt.shape, device=idx.device).masked_scatter(m, -(logp_all.exp() * logp_all).sum(-1))
    return logp, entropy


# ---------------------------------------------------------------------------------------------
# Arguments

p = argparse.ArgumentParser(prog="train_rl.py", description=__doc__.split("\n\n")[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
g = p.add_argument_group("run")
g.add_argument("--init-from", default=None, help="checkpoint to start from (train_pretrain.py's ckpt.pt)")
g.add_argument("--resume", action="store_true", help="continue exactly from OUT_DIR/ckpt.pt")
g.add_argument("--steps", type=int, help="optimizer steps (one batch of tasks each, per PPO epoch)")
g.add_argument("--max-minutes", type=float, default=0.0, help="stop (eval, checkpoint) after this wall time; 0 = off")
g = p.add_argument_group("rollouts")
g.add_argument("--batch-tasks", type=int, help="tasks per step, GLOBAL (split across ranks)")
g.add_argument("--group-size", type=int, help="completions per task (fixed group size, G)")
g.add_argument("--temperature", type=float, help="sampling temperature of the rollouts")
g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of the rollouts (1 = off; <1 biases the ratio)")
g.add_argument("--max-new-tokens", type=int, help="generation budget per completion (also Dr. GRPO's constant)")
g.add_argument("--gen-batch", type=int, help="rows per generate() call; the sandbox scores a batch while the next is generated")
g.add_argument("--sample-seeding", choices=["batch", "task"], default="batch",
               help="batch: one RNG per step and rank (fast, batched); task: one generate call and RNG per task "
                    "(seed, stream index), so samples do not depend on the rank layout (DDP test)")
g.add_argument("--difficulties", help="train-task difficulty levels, e.g. 1-3 or 1,2 (empty = all)")
g.add_argument("--task-seed", type=int, default=1, help="seed of the train-task stream")
g = p.add_argument_group("reward")
g.add_argument("--fractional", action="store_true", help="reward = fraction of tests passed (default: 1 if all pass)")
g.add_argument("--len-penalty", type=float, default=0.0, help="W: reward -= W * C(completion tokens)")
g.add_argument("--len-k", type=float, default=0.01, help="k of C(x) = ((1+kx)^(1-q) - 1) / (k(1-q))")
g.add_argument("--len-q", type=float, default=0.5, help="q of C(x) (0 linear, 1 logarithmic)")
g.add_argument("--kl-coef", type=float, default=0.0, help="k1 KL to the initial model folded into the reward "
                                                          "(0: no reference model is built)")
g.add_argument("--canary-every", type=int, help="mix a canary task (any pass = reward hack) into the batch "
                                                "every N steps; scored and logged, never trained on; 0 = off")
g.add_argument("--sandbox-workers", type=int, default=None, help="sandbox processes (default: env's, by cores)")
g.add_argument("--sandbox-timeout", type=float, default=2.0, help="seconds per program")
g = p.add_argument_group("advantage and loss")
g.add_argument("--adv-std", action="store_true", help="divide advantages by the group std (GRPO; default Dr. GRPO)")
g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction,
               help="refill zero-variance groups with fresh tasks (DAPO)")
g.add_argument("--ds-max-tries", type=int, default=3, help="extra sampling rounds per step for --dynamic-sampling")
g.add_argument("--eps-low", type=float, default=0.2, help="PPO clip below: ratio >= 1 - eps_low")
g.add_argument("--eps-high", type=float, default=0.28, help="PPO clip above: ratio <= 1 + eps_high (clip-higher, DAPO)")
g.add_argument("--loss-norm", choices=["constant", "token", "sequence"], default="constant",
               help="constant: Dr. GRPO; token: DAPO; sequence: GRPO")
g.add_argument("--ppo-epochs", type=int, default=1, help="optimizer steps per batch (1 = on-policy, single epoch)")
g.add_argument("--micro-batch", type=int, help="sequences per training forward (memory)")
g.add_argument("--no-router-replay", dest="router_replay", action="store_false",
               help="train on the router's own choices instead of the experts recorded at generation")
g.add_argument("--moe-aux-scale", type=float, default=0.0, help="x the model's own MoE aux-loss coefficients "
                                                                "(balance=aux models); 0 = pure policy gradient")
g = p.add_argument_group("optimiser")
g.add_argument("--lr", type=float, help="peak learning rate (AdamW)")
g.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant", help="after the warmup")
g.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of --lr")
g.add_argument("--warmup-steps", type=int, help="linear LR warmup")
g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
g = p.add_argument_group("evaluation and checkpoints")
g.add_argument("--eval-every", type=int, help="steps between held-out evals (also at start and end; 0 = only those)")
g.add_argument("--eval-tasks", type=int, help="held-out env test-split tasks")
g.add_argument("--eval-n", type=int, help="samples per held-out task (pass@1 = mean over them)")
g.add_argument("--eval-k", type=int, default=8, help="the k of the reported pass@k")
g.add_argument("--eval-temperature", type=float, help="sampling temperature of the held-out eval")
g.add_argument("--eval-difficulties", help="held-out difficulty levels, e.g. 1-3 (empty = all)")
g.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out tasks and their sampling")
g.add_argument("--no-eval", action="store_true", help="skip every held-out eval (tests)")
g.add_argument("--ckpt-every", type=int, help="steps between checkpoints (and at the end; 0 = end only)")


def main(argv=None):
    args = common.parse_args(p, PRESETS, argv)
    t_start = time.time()

    # -----------------------------------------------------------------------------------------
    # Setup. Argument errors die on every rank before any collective, so nothing hangs.
    rank, _, world, device = common.setup_ddp(args.device)
    ddp, master = world > 1, rank == 0
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    if args.batch_tasks % world:
        common.die(f"--batch-tasks {args.batch_tasks} must be a multiple of the world size {world}")
    if args.group_size < 2:
        common.die("--group-size must be >= 2 (advantages are relative to the group)")
    if args.eval_n < args.eval_k and not args.no_eval:
        common.die(f"--eval-n {args.eval_n} < --eval-k {args.eval_k}: pass@k needs n >= k samples per task")
    if args.resume and not os.path.isfile(ckpt_path):
        common.die(f"--resume: no checkpoint at {ckpt_path!r}")
    if not args.resume and not args.init_from:
        common.die("--init-from CKPT is required (a train_pretrain.py checkpoint)")
    if args.init_from and not os.path.isfile(args.init_from):
        common.die(f"--init-from: no checkpoint at {args.init_from!r}")
    def levels_of(flag, value):                  # the error names the flag that was wrong
        try:
            return parse_difficulties(value or "")
        except ValueError as e:
            common.die(f"{flag}: {e}")
    levels = levels_of("--difficulties", args.difficulties)
    eval_levels = levels_of("--eval-difficulties", args.eval_difficulties)
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        if not args.resume:
            common.reset_metrics(metrics_path)

    model, tok, state = common.load_checkpoint(ckpt_path if args.resume else args.init_from, device)
    if not args.resume:
        state = {}
    cfg = model.config
    # The checkpoint's tokenizer must fit the model (common.load_checkpoint checks the size); its
    # special ids are what generation stops on and collate pads with.
    if max(tok.eot_id, tok.pad_id) >= cfg.vocab_size:
        common.die(f"tokenizer special ids ({tok.eot_id}, {tok.pad_id}) outside the model's vocabulary {cfg.vocab_size}")
    replay = args.router_replay and model.n_moe_layers > 0

    # Tasks: a deterministic stream of train tasks. Rank r takes stream items r, r + W, r + 2W, ...
    # so the union over ranks of the first B/W items each is the first B items: the same global
    # batch as one process. Enough for every step plus dynamic-sampling refills; never reused.
    per_rank = args.batch_tasks // world
    n_stream = min(4096, args.batch_tasks * max(1, args.steps))     # extended on demand (ds refills, resume)
    try:
        stream = generate_tasks("train", n_stream, seed=args.task_seed, difficulties=levels)
        test_tasks = [] if args.no_eval else generate_tasks("test", args.eval_tasks, seed=args.eval_seed,
                                                                difficulties=eval_levels)
    except Exception as e:          # e.g. a difficulty level the generator does not have
        common.die(f"cannot generate tasks: {type(e).__name__}: {e}")
    if not stream:
        common.die(f"empty train task set (--difficulties {args.difficulties!r})")
    if not args.no_eval and not test_tasks:
        common.die(f"empty held-out task set (--eval-difficulties {args.eval_difficulties!r}, --eval-tasks {args.eval_tasks})")
    canaries = canary_tasks() if args.canary_every else []
    stream_pos = state.get("stream_pos", [0] * world)     # next item index of each rank's substream
    if len(stream_pos) != world:
        common.die(f"--resume: checkpoint was written with {len(stream_pos)} ranks, now {world}")

    # Reference model for the k1 KL: the starting checkpoint, frozen. Only built when used.
    ref = None
    if args.kl_coef > 0:
        ref, _, _ = common.load_checkpoint(state.get("init_from", args.init_from), device)
        ref.eval().requires_grad_(False)

    # AdamW. betas (0.9, 0.95) as in most LLM RL stacks (verl, OpenRLHF); no weight decay by default:
    # a few hundred on-policy steps should move the policy, not shrink it.
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        common.set_rng_state(state["rng"])
    start_step = state.get("step", 0)

    def lr_at(step):
        lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup_steps))
        if args.lr_schedule == "cosine":
            prog = min(1.0, step / max(1, args.steps - 1))
            lr *= args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog))
        return lr

    pool = env.SandboxPool(workers=args.sandbox_workers, timeout_s=args.sandbox_timeout)

    def held_out(tag, at):
        """pass@1 / pass@k through eval.evaluate_tasks on fixed test tasks with a fixed seed; each
        rank scores its slice, results averaged weighted by tasks (pass@k are means over tasks)."""
        if args.no_eval:
            return {}
        t0 = time.time()
        mine = test_tasks[rank::world]
        r = evaluation.evaluate_tasks(model, tok, mine, pool, args.eval_n, ks=(1, args.eval_k),
                                      temperature=args.eval_temperature, max_new_tokens=args.max_new_tokens,
                                      batch_size=args.gen_batch, seed=args.eval_seed + rank)
        keys = ("pass@1", f"pass@{args.eval_k}", "mean_len")
        v = torch.tensor([r.get(k, 0.0) * len(mine) for k in keys] + [len(mine)], dtype=torch.float64)
        if ddp:
            dist.all_reduce(v)
        out = {k: (v[i] / v[-1]).item() for i, k in enumerate(keys)}
        out["eval_s"] = time.time() - t0
        if master:
            common.log_metrics(metrics_path, {"eval": tag, "step": at, **out})
            tqdm.write(f"eval [{tag}] step {at}: pass@1 {out['pass@1']:.3f}  pass@{args.eval_k} "
                       f"{out[f'pass@{args.eval_k}']:.3f}  ({out['eval_s']:.0f} s)")
        return out

    def rollout(tasks, keys, step, attempt):
        """G completions per task via eval.sample_completions (the shared harness), each generated
        batch submitted to the sandbox pool while the next one is generated. Returns samples,
        results, generation seconds, seconds waited on the sandbox after generation."""
        futures, t0 = [], time.time()
        submit = lambda b: futures.append(pool.submit_batch([tasks[s["task_idx"]] for s in b],
                                                            [s["completion"] for s in b], fractional=args.fractional))
        kw = dict(n=args.group_size, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                  top_p=args.top_p, batch_size=args.gen_batch, return_routes=replay)
        if args.sample_seeding == "task":      # one RNG per (seed, stream index): rank-layout invariant
            samples = []
            for i, (t, key) in enumerate(zip(tasks, keys)):
                gen = torch.Generator(device=device).manual_seed((args.seed * 1_000_003 + key) % 2**62)
                part = evaluation.sample_completions(model, tok, [t], generator=gen, **kw)
                for s in part:
                    s["task_idx"] = i
                submit(part)
                samples += part
        else:
            gen = torch.Generator(device=device).manual_seed((args.seed * 1_000_003 + 7919 * step + 104_729 * attempt + rank) % 2**62)
            samples = evaluation.sample_completions(model, tok, tasks, generator=gen, on_batch=submit, **kw)
        t1 = time.time()
        results = [r for f in futures for r in f.result()]
        return samples, results, t1 - t0, time.time() - t1

    # -----------------------------------------------------------------------------------------
    # Training loop
    step = start_step
    totals = Counter(state.get("totals", {}))          # wall-time split, over the whole run
    evals = state.get("evals", {})
    if "before" not in evals:
        t0 = time.time()
        evals["before"] = held_out("before", start_step)
        totals["eval_s"] += time.time() - t0
    hack_hist = []
    pbar = tqdm(range(start_step, args.steps), disable=not master, initial=start_step, total=args.steps,
                desc="rl", dynamic_ncols=True)
    for step in pbar:
        # --- rollouts (+ dynamic-sampling refills) and rewards ---------------------------------
        kept, stats = [], Counter()                    # kept: (samples, advantages) of groups with signal
        lengths, hacks = [], Counter()
        for attempt in range(1 + (args.ds_max_tries if args.dynamic_sampling else 0)):
            need = per_rank - len(kept)
            keys = [rank + world * j for j in range(stream_pos[rank], stream_pos[rank] + need)]
            while keys and keys[-1] >= len(stream):      # generate_tasks is a prefix-stable stream
                stream += generate_tasks("train", 2 * len(stream), seed=args.task_seed,
                                             difficulties=levels)[len(stream):]
            stream_pos[rank] += need
            tasks = [stream[k] for k in keys]
            with_canary = master and attempt == 0 and canaries and step % args.canary_every == 0
            if with_canary:
                tasks.append(canaries[(step // args.canary_every) % len(canaries)])
                keys.append(-1 - step)
            samples, results, t_gen, t_box = rollout(tasks, keys, step, attempt)
            stats["gen_s"] += t_gen
            stats["sandbox_s"] += t_box
            if with_canary:
                cs = [(s, r) for s, r in zip(samples, results) if s["task_idx"] == len(tasks) - 1]
                stats["canary_passes"] += sum(r.passed for _, r in cs)
                stats["canary_samples"] += len(cs)
            for s, r in zip(samples, results):
                stats[f"outcome/{r.outcome}"] += 1
                lengths.append(len(s["tokens"]))
                hacks.update({k: v for k, v in env.hack_counts(s["completion"]).items() if v})
            # sandbox_error = the sandbox failed, not the model (env.py): drop those samples.
            scored = [(s, r) for s, r in zip(samples, results) if r.outcome != "sandbox_error"
                      and not (with_canary and s["task_idx"] == len(tasks) - 1)]
            if not scored:
                continue
            rewards = torch.tensor([float(r.reward) for _, r in scored], dtype=torch.float64)
            stats["passes"] += sum(r.passed for _, r in scored)
            stats["n_scored"] += len(scored)
            if args.len_penalty:
                rewards -= args.len_penalty * length_cost([len(s["tokens"]) for s, _ in scored], args.len_k, args.len_q)
            if ref is not None:                       # k1 KL to the reference, folded into the reward
                kls = []
                with torch.no_grad():
                    for i in range(0, len(scored), args.micro_batch):
                        mb = [s for s, _ in scored[i:i + args.micro_batch]]
                        idx, tgt, old, _ = collate(mb, tok.pad_id, 0, 1, False)
                        with common.autocast(device):
                            ref_lp, _ = token_logprobs(ref, idx.to(device), tgt.to(device), None, args.temperature)
                        kls.append(kl_k1(old.to(device), ref_lp, (tgt >= 0).to(device).float()).double().cpu())
                kl = torch.cat(kls)
                stats["kl_ref_sum"] += kl.sum().item()
                rewards -= args.kl_coef * kl
            stats["reward_sum"] += rewards.sum().item()
            adv, signal = group_advantages(rewards, [s["task_idx"] for s, _ in scored], std=args.adv_std)
            n_groups = len({s["task_idx"] for s, _ in scored})
            good = sorted({s["task_idx"] for (s, _), ok in zip(scored, signal.tolist()) if ok})
            stats["groups"] += n_groups
            stats["zero_var_groups"] += n_groups - len(good)
            for t in good[:per_rank - len(kept)]:
                kept.append([(s, a) for (s, _), a in zip(scored, adv.tolist()) if s["task_idx"] == t])
            if len(kept) >= per_rank:
                break
        stats["rounds"] += attempt + 1

        # --- policy-gradient update with router replay ------------------------------------------
        t_train = time.time()
        # sorted by length, so a micro-batch pads little (the summed gradient does not care about order)
        train = sorted((sa for grp in kept for sa in grp), key=lambda sa: len(sa[0]["prompt_ids"]) + len(sa[0]["tokens"]))
        counts = torch.tensor([len(train), sum(len(s["tokens"]) for s, _ in train), 0], dtype=torch.float64)
        counts[2] = -(-len(train) // args.micro_batch)            # micro-batches of this rank
        if ddp:
            dist.all_reduce(counts[:2])
            n_mb = torch.tensor(counts[2].item())
            dist.all_reduce(n_mb, op=dist.ReduceOp.MAX)
            counts[2] = n_mb
        n_seqs, n_tokens, n_mb = counts[0].item(), counts[1].item(), int(counts[2].item())
        # Dr. GRPO's constant: the sequences the step SAMPLED (B * G, fixed), times the generation budget.
        n_const = args.batch_tasks * args.group_size
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        model.train()
        for epoch in range(args.ppo_epochs if n_seqs else 0):
            optimizer.zero_grad(set_to_none=True)
            # Every rank runs the same number of training forwards: with balance="aux" the MoE
            # all-reduces expert loads inside each one. A rank short of samples pads with a copy
            # of a sample at weight zero (or, with none at all, an empty-looking one-token row).
            for i in range(n_mb):
                mb = train[i * args.micro_batch:(i + 1) * args.micro_batch]
                dummy = not mb
                if dummy:
                    mb = train[:1] or [({"prompt_ids": [tok.eot_id], "tokens": [tok.eot_id], "logprobs": [0.0],
                                          "routes": torch.zeros(model.n_moe_layers, 1, cfg.top_k, dtype=torch.long)}, 0.0)]
                idx, tgt, old, routes = collate([s for s, _ in mb], tok.pad_id, model.n_moe_layers, cfg.top_k, replay)
                idx, tgt, old = idx.to(device), tgt.to(device), old.to(device)
                adv = torch.tensor([a for _, a in mb], dtype=torch.float32, device=device)
                mask = (tgt >= 0).float()
                with common.autocast(device):
                    logp, entropy = token_logprobs(model, idx, tgt, routes.to(device) if replay else None,
                                                   args.temperature)
                tok_loss, clipped = ppo_token_loss(logp, old, adv, args.eps_low, args.eps_high)
                w = token_weights(mask, args.loss_norm, args.max_new_tokens, n_const if args.loss_norm == "constant"
                                  else n_seqs, n_tokens) * (0.0 if dummy else 1.0)
                loss = (tok_loss * w).sum()
                # MoE aux loss: off by default. Under router replay the experts are fixed by generation,
                # so the balancing loss could only push gate values toward uniform: a gradient unrelated
                # to reward, competing with the policy gradient. Balance is kept by the aux-free bias
                # (the pretraining presets use balance="bias"), updated from the replayed loads, and
                # watched in the logs (moe/max_mean_load). --moe-aux-scale 1 restores the aux loss.
                if args.moe_aux_scale and cfg.balance == "aux":
                    loss = loss + args.moe_aux_scale * sum(m.aux for m in model.moe_layers()) / n_mb
                loss.backward()
                if dummy:
                    continue
                with torch.no_grad():
                    ntok = mask.sum().item()
                    stats[f"loss_e{epoch}"] += (tok_loss * w).sum().item()
                    stats[f"tokens_e{epoch}"] += ntok
                    stats[f"clip_e{epoch}"] += (clipped.float() * mask).sum().item()
                    stats[f"entropy_e{epoch}"] += (entropy * mask).sum().item()
                    stats[f"kl_old_e{epoch}"] += ((old - logp) * mask).sum().item()    # k1 vs the sampling policy
                    stats[f"mismatch_e{epoch}"] += ((old - logp).abs() * mask).sum().item()  # what replay removes
            # Gradients SUMMED over ranks: each rank's loss already carries the global denominators.
            # (No DDP wrapper: ranks may run different sample counts; one flat all-reduce suffices.)
            if ddp:
                grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
                flat = torch.cat([x.flatten() for x in grads])
                dist.all_reduce(flat)
                for q, x in zip(params, flat.split([q.numel() for q in params])):
                    q.grad = x.view_as(q)
            gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
            stats["grad_norm"] += gnorm.item() / args.ppo_epochs
            optimizer.step()
            model.after_optimizer_step()     # aux-free bias update from the (replayed) global-batch loads
        moe = model.moe_metrics() if model.n_moe_layers and n_seqs else {}
        stats["train_s"] += time.time() - t_train

        # --- metrics: sums reduced over ranks, then ratios ---------------------------------------
        # every rank must reduce the same keys, in the same order
        for k in [f"outcome/{o}" for o in env.OUTCOMES] + ["canary_passes", "canary_samples", "kl_ref_sum", "loss_e0",
                  "tokens_e0", "clip_e0", "entropy_e0", "kl_old_e0", "mismatch_e0", "grad_norm", "reward_sum", "passes", "n_scored"]:
            stats[k] += 0
        stats.update({f"hack/{k}": hacks[k] for k in env.HACK_PATTERNS})
        stats["len_sum"], stats["len_n"] = sum(lengths), len(lengths)
        names = sorted(stats)
        v = torch.tensor([float(stats[k]) for k in names], dtype=torch.float64)
        len_max = torch.tensor(float(max(lengths, default=0)))
        if ddp:
            dist.all_reduce(v)
            dist.all_reduce(len_max, op=dist.ReduceOp.MAX)
        s = dict(zip(names, v.tolist()))
        last = args.ppo_epochs - 1
        ntok, nsc = max(s["tokens_e0"], 1), max(s["n_scored"], 1)
        rec = {"step": step + 1, "lr": lr, "loss": s["loss_e0"],
               "reward": s["reward_sum"] / nsc, "pass_rate": s["passes"] / nsc,
               "zero_var_frac": s["zero_var_groups"] / max(s["groups"], 1), "trained_seqs": n_seqs,
               "len_mean": s["len_sum"] / max(s["len_n"], 1), "len_max": len_max.item(),
               "entropy": s["entropy_e0"] / ntok, "kl_old": s["kl_old_e0"] / ntok,
               "logp_mismatch": s["mismatch_e0"] / ntok,
               "clip_frac": s["clip_e0"] / ntok, "grad_norm": s["grad_norm"] / world,
               "canary_passes": s["canary_passes"], "canary_samples": s["canary_samples"],
               "gen_s": s["gen_s"] / world, "sandbox_s": s["sandbox_s"] / world, "train_s": s["train_s"] / world,
               "rounds": s["rounds"] / world}
        if args.ppo_epochs > 1 and f"tokens_e{last}" in s:
            rec.update(kl_old_last=s[f"kl_old_e{last}"] / max(s[f"tokens_e{last}"], 1),
                       clip_frac_last=s[f"clip_e{last}"] / max(s[f"tokens_e{last}"], 1))
        if ref is not None:
            rec["kl_ref"] = s["kl_ref_sum"] / nsc
        rec.update({k: int(x) for k, x in s.items() if k.startswith(("outcome/", "hack/"))})
        rec.update({k: x for k, x in moe.items() if not k.startswith("moe/l") or "tokens_e" not in k})
        for k in ("gen_s", "sandbox_s", "train_s"):
            totals[k] += rec[k]
        # Reward-hack monitoring: any canary pass, or suspicious constructs per completion at more
        # than twice the run's early rate, prints a warning (the metrics keep the counts).
        hack_hist.append(sum(x for k, x in rec.items() if k.startswith("hack/")) / max(s["len_n"], 1))
        base = sum(hack_hist[:5]) / len(hack_hist[:5])
        if master and (rec["canary_passes"] > 0 or (len(hack_hist) > 5 and hack_hist[-1] > max(2 * base, 0.05))):
            tqdm.write(f"warning: possible reward hacking at step {step + 1}: canary passes "
                       f"{int(rec['canary_passes'])}, suspicious constructs/completion {hack_hist[-1]:.3f} "
                       f"(early {base:.3f}); see hack/* in {metrics_path}")
        if master:
            common.log_metrics(metrics_path, rec)
            pbar.set_postfix_str(f"reward {rec['reward']:.3f} pass {rec['pass_rate']:.3f} zv {rec['zero_var_frac']:.2f} "
                                 f"len {rec['len_mean']:.0f} ent {rec['entropy']:.2f} gen/box/train "
                                 f"{rec['gen_s']:.1f}/{rec['sandbox_s']:.1f}/{rec['train_s']:.1f}s")

        # --- periodic eval and checkpoint; a time limit stops all ranks at the same step ---------
        done = step + 1
        stop = torch.tensor(float(args.max_minutes > 0 and time.time() - t_start > 60 * args.max_minutes))
        if ddp:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        last_step = done == args.steps or stop.item() > 0
        if args.eval_every and done % args.eval_every == 0 and not last_step:
            t0 = time.time()
            evals[f"step{done}"] = held_out(f"step{done}", done)
            totals["eval_s"] += time.time() - t0
        if args.ckpt_every and done % args.ckpt_every == 0 and not last_step:
            save(model, tok, optimizer, done, stream_pos, totals, evals, args, ckpt_path, master, ddp, world)
        if stop.item() > 0:
            if master:
                tqdm.write(f"--max-minutes {args.max_minutes} reached after step {done}")
            break
    pbar.close()
    done = step + 1 if args.steps > start_step else start_step
    t0 = time.time()
    evals["after"] = held_out("after", done)
    totals["eval_s"] += time.time() - t0
    save(model, tok, optimizer, done, stream_pos, totals, evals, args, ckpt_path, master, ddp, world)
    pool.close()
    k = args.eval_k
    summary = {"pass@1_before": evals["before"].get("pass@1"), "pass@1_after": evals["after"].get("pass@1"),
               f"pass@{k}_before": evals["before"].get(f"pass@{k}"), f"pass@{k}_after": evals["after"].get(f"pass@{k}"),
               "steps": done, "wall_s": round(time.time() - t_start, 1),
               "time_split": {x: round(y, 1) for x, y in totals.items()},
               "curve": {tag: round(e.get("pass@1", float("nan")), 4) for tag, e in evals.items()},
               "ckpt": ckpt_path, "out_dir": args.out_dir, "metrics": metrics_path}
    common.cleanup_ddp()
    if master:
        common.print_summary(summary)
    return summary


def save(model, tok, optimizer, done, stream_pos, totals, evals, args, path, master, ddp, world):
    """Atomic checkpoint (common.save_checkpoint) with everything --resume needs. Each rank's
    position in the task stream is gathered, so the stream continues exactly where it stopped."""
    pos = torch.zeros(world, dtype=torch.long)
    rank = dist.get_rank() if ddp else 0
    pos[rank] = stream_pos[rank]
    if ddp:
        dist.all_reduce(pos)
    if master:
        common.save_checkpoint(path, model, tok, optimizer=optimizer.state_dict(), step=done,
                               stream_pos=pos.tolist(), rng=common.rng_state(), args=vars(args),
                               init_from=args.init_from, totals=dict(totals), evals=evals, kind="rl")
    if ddp:
        dist.barrier()


if __name__ == "__main__":
    main()
