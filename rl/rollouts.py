"""
The sampling half of an RL step, and what a step records. What train_rl.sample_round calls in each
sampling round, in this order

    tasks = rollouts.draw_tasks(ctx, need, stats)                   # the train stream's next tasks
    samples, results = ctx.rollout(ctx, tasks, seed, stats)         # sample, with sandbox verdicts
    correct, reward = rollouts.rewards(ctx, scored, stats)          # reward
    adv, keep = group_advantages(reward, groups, ...)               # advantage (rl/algo.py)
    rollouts.tally_samples(tasks, samples, results, scored, keep, stats)
    groups = rollouts.signal_groups(scored, adv, keep)              # the groups to train on

ctx.rollout is one of the four rollout functions below, chosen once by train_rl.setup. Each takes
(ctx, tasks, seed, stats) and returns (samples, results): the samples to train on, each
labelled with its "group", and the sandbox verdicts that reward them; seed (a Seed) names the
random stream (rng).
  single_turn    G completions per task (one-turn episodes of env.run_episodes)
  episodes       --turns N: G episodes per task, one sample = one episode (env.run_episodes)
  repair_groups  --repair-groups: single_turn, plus G repairs of one failed attempt per task
  tool_episodes  --agent: G episodes per repository task, worked through tools (env.Tools)
Every function takes train_rl.setup's namespace `ctx` (args, model, tokenizer, sandbox pool, task
stream, resumable state; a tool may pass just the fields a function reads, as
lab/experiments/prefilter_check.py does) and, where it records anything, a step's `stats`
(new_stats, at the end: every statistic a step sums, the metrics.jsonl line, the run's summary).
"""
import time
from collections import Counter, namedtuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from infra import common
import env
from model import autocast
from sandbox import OUTCOMES
from rl.algo import (Sequence, collate, kl_k1, length_cost, length_units, mixed_group_odds, n_generated,
                     segments, token_logprobs, tool_calls)
from data.repos import generate_repo_tasks
from data.tasks import generate_tasks


# ---------------------------------------------------------------------------------------------
# A round of the step: its tasks, rewards, statistics and groups

def draw_tasks(ctx, need, stats):
    """The tasks of one sampling round when `need` of this rank's groups are missing: `need` tasks,
    or with --dynamic-sampling the rank's whole share of the batch (a refill of a few tasks would
    generate slowly; the groups left over wait in the queue)."""
    args = ctx.args
    n = max(need, ctx.per_rank) if args.dynamic_sampling else need
    return prefilter(ctx, next_tasks(ctx, n * args.prefilter), n, stats)   # --prefilter K: the likeliest n


def rewards(ctx, scored, stats):
    """The reward of each scored (sample, result): correctness (the sandbox's verdict: 1 if every
    hidden test passes, or the fraction passed with --fractional), minus Composer 2's length cost of
    every token the model wrote (--len-penalty), minus the k1 KL to the reference folded into the
    reward (--kl-coef). Returns (correctness, shaped reward), float64 tensors."""
    args = ctx.args
    # the pass rate, reward and KL recorded are of first attempts
    first = torch.tensor([not s.repair for s, _ in scored], dtype=torch.bool)
    correct = torch.tensor([float(r.reward) for _, r in scored], dtype=torch.float64)
    reward = correct.clone()
    if args.len_penalty:
        # every token the model wrote in the episode, each tool call and each further turn counted as
        # that many tokens more (Composer 2's weighted count): solving in fewer, shorter turns earns more
        units = [length_units(s, args.len_call_tokens, args.len_turn_tokens) for s, _ in scored]
        reward -= args.len_penalty * length_cost(units, args.len_k, args.len_q)
    if ctx.ref is not None and scored:
        kl = ref_kl(ctx, [s for s, _ in scored])
        stats["kl_ref_sum"] += kl[first].sum().item()
        reward -= args.kl_coef * kl
    stats["passes"] += sum(r.passed for (_, r), f in zip(scored, first.tolist()) if f)
    stats["n_scored"] += int(first.sum())
    stats["reward_sum"] += reward[first].sum().item()
    return correct, reward


def tally_samples(tasks, samples, results, scored, keep, stats):
    """A round's statistics: reward-hack patterns in everything the model wrote; outcomes, lengths
    and turns of the first attempts (a repair's are not a sample of the policy's first try); the
    groups of the scored samples and those with signal (keep), overall and per difficulty level
    (which levels of the train mix carry the signal)."""
    for s, r in zip(samples, results):
        for t in s.turns:
            for k, v in env.hack_counts(t.completion).items():
                stats[f"hack/{k}"] += v
        if s.repair:
            continue
        stats[f"outcome/{r.outcome}"] += 1
        stats["len_sum"] += n_generated(s)
        stats["len_n"] += 1
        stats["len_max"] = max(stats["len_max"], n_generated(s))
        stats["turns_sum"] += len(s.turns)
        if s.actions:                         # --agent: the tool calls, and the malformed actions
            stats["tool_calls_sum"] += tool_calls(s.actions)
            stats["format_errors_sum"] += len(s.actions) - tool_calls(s.actions)
    level = {s.group: tasks[s.task_idx].difficulty for s, _ in scored}
    signal = {s.group for (s, _), k in zip(scored, keep.tolist()) if k}
    stats["groups"] += len(level)
    stats["zero_var_groups"] += len(level) - len(signal)
    for g, d in level.items():
        stats[f"groups/d{d}"] += 1
        stats[f"signal/d{d}"] += g in signal


def signal_groups(scored, adv, keep):
    """The groups worth training on (keep), in task order (a task's repairs after it): each a list of
    its training Sequences (rl.algo.segments) with their advantage, reduced to what training reads
    (queued groups go into the checkpoint)."""
    groups = {}
    for (e, _), a, k in zip(scored, adv.tolist(), keep.tolist()):
        if not k:
            continue
        for seg in segments(e):     # an episode carried by summaries: a sequence per segment, one advantage
            seg.turns = [env.Turn(t.prompt_ids, t.tokens, t.logprobs, routes=t.routes) for t in seg.turns]
            seg.adv = a
            groups.setdefault((e.task_idx, e.repair, e.group), []).append(seg)
    return [groups[g] for g in sorted(groups)]


# ---------------------------------------------------------------------------------------------
# Rollout functions: (ctx, tasks, seed, stats) -> (samples, sandbox results)

def single_turn(ctx, tasks, seed, stats):
    """G completions per task: one-turn episodes of the shared loop (env.run_episodes with
    env.Feedback(1): env's prompt, generation, the cut body, the hidden tests, as eval.py samples),
    gen_batch rows (a FIXED setting) per generate() call, each batch judged in the sandbox while the
    next one is generated (no overlap when one call holds the whole round, as in the cpu preset)."""
    t0, tools = time.time(), env.Feedback(1, ctx.args.fractional)
    eps = env.run_episodes(ctx.model, ctx.tok, tasks, tools=tools, pool=ctx.pool, generator=rng(ctx, seed),
                           **sampling_kw(ctx))
    for e in eps:
        e.group = e.task_idx                  # a task's G samples are its group
    stats["gen_s"] += time.time() - t0 - tools.wait_s
    stats["sandbox_s"] += tools.wait_s
    return eps, [e.result for e in eps]


def episodes(ctx, tasks, seed, stats):
    """--turns N: G episodes per task (env.run_episodes: an attempt, the feedback of a failed
    visible example, another attempt, up to N). One sample = one episode, rewarded by its last
    attempt's hidden tests; the loss covers every turn the model wrote (rl.algo.flatten)."""
    t0, tools = time.time(), env.Feedback(ctx.args.turns, ctx.args.fractional)
    eps = env.run_episodes(ctx.model, ctx.tok, tasks, tools=tools, pool=ctx.pool, generator=rng(ctx, seed),
                              **sampling_kw(ctx))
    stats["gen_s"] += time.time() - t0     # episodes sandbox between turns: counted as generation
    for e in eps:
        e.group = e.task_idx                  # a task's G episodes are its group
    return eps, [e.result for e in eps]


def tool_episodes(ctx, tasks, seed, stats):
    """--agent: G episodes per repository task (data/repos.py) in the agent's harness, env.Tools: one
    action per turn (ls, read, grep, run, edit, test, submit) on the episode's own copy of the repository, the
    observation fed back, up to the step limit (env.run_episodes, as eval.py and agent.py run it).
    One sample = one episode, rewarded by the hidden tests' verdict on its final repository; the loss
    covers every token the model wrote in every turn, none of the observations (rl.algo.flatten).
    Long tasks (a share of the stream, --long-share) run in env.long_tools(--memory): when
    the context passes its threshold the model summarises and goes on from a fresh context (or the
    harness rebuilds it: mask, window); each segment trains as a sequence of its own with the
    episode's advantage (rl.algo.segments)."""
    t0, eps = time.time(), []
    long = {i for i, t in enumerate(tasks) if t.kind == "long"}
    memory = ctx.state["long_memory"] = long_memory(ctx, seed.step)
    for tools, idx, part in ((env.Tools(), [i for i in range(len(tasks)) if i not in long], "rollout"),
                             (env.long_tools(memory), sorted(long), "long")):
        if idx:
            run = env.run_episodes(ctx.model, ctx.tok, [tasks[i] for i in idx], tools=tools, pool=ctx.pool,
                                      generator=rng(ctx, seed._replace(part=part)), **sampling_kw(ctx))
            for e in run:
                e.task_idx = idx[e.task_idx]
            eps += run
    stats["gen_s"] += time.time() - t0     # the tools' test runs happen between turns: counted as generation
    eps.sort(key=lambda e: e.task_idx)
    for e in eps:
        e.group = e.task_idx                  # a task's G episodes are its group
        if e.task_idx in long:
            long_stats(tasks[e.task_idx], e, stats)
    return eps, [e.result for e in eps]


def long_memory(ctx, step):
    """The long tasks' memory at this step. --memory oracle: the harness writes the summary (the state
    the actions reached, env.summary_text) in the run's first half, by its clock (else its steps), then
    the model its own: RL first meets summaries from which an episode can earn a reward, then learns to
    write them (ReSum's order: a summary tool first, then the agent trained on it; arXiv 2509.13313)."""
    a = ctx.args
    if a.memory != "oracle":
        return a.memory
    half = time.time() - ctx.t_start < 30 * a.max_minutes if a.max_minutes > 0 else step < a.steps / 2
    return "oracle" if half else "summary"


def long_stats(task, e, stats):
    """A long episode's memory statistics: its summaries, its rebuilt contexts, the facts it kept, and
    whether it ran past the summary cap (env.Tools.finish scores it a failure)."""
    stats["long_n"] += 1
    stats["long_passes"] += e.result.passed
    stats["summaries_sum"] += len(e.summaries)
    stats["summary_tokens_sum"] += sum(map(len, e.summaries))
    read, kept = env.fact_retention(task, e)
    stats["facts_read"] += read
    stats["facts_kept"] += kept
    stats["rebuilds_sum"] += e.state.get("rebuilds", 0)
    stats["over_cap"] += e.end == "summary_cap"


def repair_groups(ctx, tasks, seed, stats):
    """--repair-groups: the self-repair tree of Olausson et al. 2023 ("Is Self-Repair a Silver Bullet
    for Code Generation?": n_p first attempts, n_fr repairs of each failed one) inside the RL batch.
    single_turn's G first attempts per task, then G repairs of one failed attempt (sample_repairs),
    marked "repair": the repairs read the same failure, so their own group ranks repairs of one
    failure against each other."""
    samples, results = single_turn(ctx, tasks, seed, stats)
    repairs, verdicts = sample_repairs(ctx, tasks, samples, results, seed, stats)
    return samples + repairs, results + verdicts


def sample_repairs(ctx, tasks, samples, results, seed, stats):
    """G repairs of each root (repair_roots), sampled from the second turn's context
    (env.repair_prompt: the prompt, the failed attempt, its feedback). Only tasks that a first
    attempt solved are branched: there the policy can write a passing program, so a group of
    repairs can be mixed (one that all fail carries no signal, and its sampling is spent). A repair
    that resubmits its root's code unchanged is marked "repeat" (the "no edit" collapse SCoRe
    describes, Kumar et al. 2024; logged as repair_repeat_rate). Returns (repairs, their hidden-test
    results)."""
    t0, tools = time.time(), env.Feedback(1, ctx.args.fractional)
    roots = repair_roots(ctx, tasks, samples, results)     # its visible-example runs count as generation
    parents = sorted(roots)
    eps = env.run_episodes(ctx.model, ctx.tok, [tasks[i] for i in parents], tools=tools, pool=ctx.pool,
                              generator=rng(ctx, seed._replace(part="repair")),
                              prompts=[roots[i][0] for i in parents], **sampling_kw(ctx))
    repairs, out = eps, [e.result for e in eps]
    for s in repairs:   # the G repairs of one failure are a group of their own, after the first attempts'
        s.task_idx, s.repair = parents[s.task_idx], True
        s.group = len(tasks) + s.task_idx
        s.repeat = env.resubmits(s.turns[0], roots[s.task_idx][1].turns[0])
    stats["gen_s"] += time.time() - t0 - tools.wait_s
    stats["sandbox_s"] += tools.wait_s
    stats["repair_roots"] += len(parents)
    stats["repair_n"] += len(out)
    stats["repair_passes"] += sum(r.passed for r in out)
    stats["repair_repeats"] += sum(s.repeat for s in repairs)
    return repairs, out


def repair_roots(ctx, tasks, samples, results):
    """{task index: (the context its repairs are sampled from, the failed attempt)} for
    sample_repairs: in each task that a first attempt solved, the first attempt that fails its hidden
    tests and a visible example, if another turn after it fits the context."""
    solved = {s.task_idx for s, r in zip(samples, results) if r.passed}
    visible = {i: env.visible_task(tasks[i]) for i in solved}     # parsed once per task, not per sample
    cands = [s for s, r in zip(samples, results) if visible.get(s.task_idx) is not None and not r.passed
             and r.outcome != "sandbox_error"]
    seen = ctx.pool.run_batch(env.runs([visible[s.task_idx] for s in cands],
                                       [s.turns[0].completion for s in cands]))
    roots = {}
    for s, v in zip(cands, seen):
        i = s.task_idx
        if i in roots or v.passed or v.outcome == "sandbox_error":
            continue
        ids = env.repair_prompt(ctx.tok, tasks[i], s.turns[0], v)
        if len(ids) + ctx.args.max_new_tokens <= ctx.model.config.seq_len:
            roots[i] = ids, s
    return roots


def sampling_kw(ctx):
    """The sampler's arguments, the same for first attempts, episodes and repairs."""
    a = ctx.args
    return dict(n=a.group_size, temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                batch_size=a.gen_batch, return_routes=ctx.replay)


# The sampler's random streams: one per (run, step, sampling round, rank, part), each part a prime
# apart, so that no two streams of a run draw the same numbers.
Seed = namedtuple("Seed", "step round rank part", defaults=(0, 0, 0, "rollout"))
RUN, STEP, ROUND = 1_000_003, 7919, 104_729
PART = {"rollout": 0, "canary": 3, "repair": 15_485_863,   # the canary's group, the repairs of a failure
        "long": 32_452_843}                                 # --agent's long tasks


def rng(ctx, seed):
    """The generator of stream `seed` (a Seed) under --seed."""
    x = STEP * seed.step + ROUND * seed.round + seed.rank + PART[seed.part]
    return torch.Generator(device=ctx.device).manual_seed((ctx.args.seed * RUN + x) % 2**62)


# ---------------------------------------------------------------------------------------------
# Which tasks: the train stream and the prefilter

def next_tasks(ctx, n):
    """This rank's next n tasks of the train stream, never revisited (single epoch). Rank r takes
    items r, r + W, r + 2W, ...: the union over ranks of the first B/W each is the first B items,
    the same global batch as one process."""
    pos = ctx.state["stream_pos"]
    keys = [ctx.rank + ctx.world * j for j in range(pos, pos + n)]
    make = agent_stream(ctx.args) if ctx.args.agent else generate_tasks
    while keys and keys[-1] >= len(ctx.stream):           # task i depends on (seed, i) alone
        ctx.stream += make("train", len(ctx.stream), seed=ctx.args.task_seed, difficulties=ctx.levels,
                           start=len(ctx.stream))
    ctx.state["stream_pos"] = pos + n
    return [ctx.stream[k] for k in keys]


def agent_stream(args):
    """--agent's task generator: repository tasks, --long-share of them long."""
    return lambda *a, **kw: generate_repo_tasks(*a, **kw, long_share=args.long_share)


def prefilter(ctx, tasks, n, stats):
    """Online difficulty filtering (--prefilter K): train tasks never repeat, so a task's own pass
    rate is unknown until its group is sampled; predict it instead. One teacher-forced forward pass
    gives q, the policy's probability of each candidate's reference solution, and the n candidates
    with the highest mixed_group_odds(log q, G) are kept (in stream order). A dropped task is not
    revisited."""
    if len(tasks) <= n:
        return tasks
    t0, tok = time.time(), ctx.tok
    prompts, _ = env.encode_prompts(ctx.model, tok, tasks, ctx.args.max_new_tokens)
    bodies = [(tok.encode(t.solution or "") + [tok.eot_id])[:ctx.args.max_new_tokens] for t in tasks]
    refs = [Sequence([env.Turn(p, b, [0.0] * len(b))]) for p, b in zip(prompts, bodies)]
    was_training = ctx.model.training
    ctx.model.eval()
    logq = torch.cat([lp.sum(-1).double().cpu() for _, _, lp in teacher_forced(ctx, ctx.model, refs)])
    ctx.model.train(was_training)
    odds = mixed_group_odds(logq, ctx.args.group_size)
    likeliest = sorted(odds.topk(n).indices.tolist())
    stats["prefilter_s"] += time.time() - t0
    stats["prefilter_n"] += n                      # predicted odds of the kept tasks against all candidates
    stats["prefilter_kept"] += odds[likeliest].sum().item()
    stats["prefilter_all"] += odds.mean().item() * n
    return [tasks[i] for i in likeliest]


# ---------------------------------------------------------------------------------------------
# The no-grad scoring pass: the KL reference and the prefilter

def teacher_forced(ctx, model, samples):
    """Per micro-batch of samples, without gradients: (targets, the sampler's log-probs, `model`'s
    log-probs of the same tokens)."""
    dev = ctx.device
    with torch.no_grad():
        for i in range(0, len(samples), ctx.args.micro_batch):
            idx, tgt, old, _, valid = collate(samples[i:i + ctx.args.micro_batch], ctx.tok.pad_id, 0, 1,
                                              False)
            with autocast(dev):
                lp, _ = token_logprobs(model, idx.to(dev), tgt.to(dev), None, ctx.args.temperature,
                                       valid.to(dev))
            yield tgt.to(dev), old.to(dev), lp


def ref_kl(ctx, samples):
    """k1 KL of each sample to the reference model (ctx.ref, frozen), from the sampler's own log-probs;
    an episode carried by summaries sums its segments'."""
    parts = [(i, seg) for i, s in enumerate(samples) for seg in segments(s)]
    kl = torch.cat([kl_k1(old, ref_lp, (tgt >= 0).float()).double().cpu()
                    for tgt, old, ref_lp in teacher_forced(ctx, ctx.ref, [seg for _, seg in parts])])
    episode = torch.tensor([i for i, _ in parts])
    return torch.zeros(len(samples), dtype=torch.float64).index_add_(0, episode, kl)


# ---------------------------------------------------------------------------------------------
# What a run records: the statistics each step sums (new_stats) and reduces over ranks, the step's
# metrics.jsonl line with the progress bar and the reward-hack warning (record), and the final JSON
# summary (summarize_run). The held-out eval itself is train_rl.held_out (it runs eval.py's harness;
# this module stays below eval.py in the imports).

class Stats(Counter):
    """One step's statistics on this rank, every key declared by new_stats (and documented there). A
    key new_stats does not declare raises: a misspelt key never starts a counter of its own."""
    def __missing__(self, key):
        raise KeyError(f"{key!r} is not a statistic of rl.rollouts.new_stats")


ONCE = ("lr", "trained_seqs", "grad_norm", "len_max", "moe")   # set once a step, never summed over ranks


def new_stats(args):
    """Every statistic a step keeps, at 0: each rank reduces the same keys in the same order, even a
    rank whose samples were all sandbox errors or that had no group to train on. Summed over the
    step's rounds and over ranks (reduce_stats):
      outcome/O, hack/P      first attempts' sandbox outcomes; suspicious constructs in all the model wrote
      K_eE                   per PPO epoch E: loss, tokens, clip, entropy, kl_old, mismatch over the
                             trained tokens (micro_batch_loss)
      passes, n_scored, reward_sum, kl_ref_sum   first attempts (rollouts.rewards)
      groups, zero_var_groups, groups/dL, signal/dL   scored groups, and those with signal, per level
      rounds, queued_groups  sampling rounds; groups trained from the queue
      len_sum, len_n, turns_sum, tool_calls_sum, format_errors_sum   what first attempts wrote
      canary_passes, canary_samples   the reward-hack probe (train_rl.score_canary)
      gen_s, sandbox_s, train_s, prefilter_s   seconds (means over ranks)
      prefilter_n, prefilter_kept, prefilter_all   --prefilter's predicted odds
      repair_roots, repair_n, repair_passes, repair_repeats   --repair-groups
      long_n, long_passes, summaries_sum, summary_tokens_sum, over_cap, facts_read, facts_kept, rebuilds_sum
                             --agent's long tasks: the summaries, their cap, the facts they keep; the
                             contexts --memory mask or window rebuilt
    Set once (ONCE): lr, trained_seqs, grad_norm, len_max (the max over ranks), moe (the router's
    figures, model.moe_metrics)."""
    keys = [f"outcome/{o}" for o in OUTCOMES + env.UNFINISHED]
    keys += [f"hack/{k}" for k in env.HACK_PATTERNS]
    keys += [f"{k}_e{e}" for e in range(args.ppo_epochs)
             for k in ("loss", "tokens", "clip", "entropy", "kl_old", "mismatch")]
    keys += ["passes", "n_scored", "reward_sum", "kl_ref_sum", "groups", "zero_var_groups", "rounds",
             "queued_groups", "len_sum", "len_n", "turns_sum", "canary_passes", "canary_samples", "gen_s",
             "sandbox_s", "train_s", "prefilter_s", "prefilter_n", "prefilter_kept",
             "prefilter_all", "repair_roots", "repair_n", "repair_passes", "repair_repeats", "tool_calls_sum",
             "format_errors_sum", "long_n", "long_passes", "summaries_sum", "summary_tokens_sum", "over_cap",
             "facts_read", "facts_kept", "rebuilds_sum"]
    keys += [f"{k}/d{d}" for k in ("groups", "signal") for d in range(1, 6)]
    return Stats({**dict.fromkeys(keys + list(ONCE), 0), "moe": {}})


def reduce_stats(ctx, stats):
    """Sums over ranks of the summable statistics (time and rounds become means over ranks)."""
    names = sorted(k for k in new_stats(ctx.args) if k not in ONCE)
    v = torch.tensor([float(stats[k]) for k in names], dtype=torch.float64)
    len_max = torch.tensor(float(stats["len_max"]))
    if ctx.ddp:
        dist.all_reduce(v)
        dist.all_reduce(len_max, op=dist.ReduceOp.MAX)
    s = dict(zip(names, v.tolist()))
    for k in ("gen_s", "sandbox_s", "train_s", "prefilter_s", "rounds", "queued_groups"):
        s[k] /= ctx.world
    s["len_max"] = len_max.item()
    return s


def record(ctx, step, stats, pbar):
    """One metrics.jsonl line per step (rank 0), the progress bar, and the reward-hack warning."""
    args, s = ctx.args, reduce_stats(ctx, stats)
    ntok, nsc, last = max(s["tokens_e0"], 1), max(s["n_scored"], 1), args.ppo_epochs - 1
    # None where the step sampled nothing (--repair-groups: a step of queued groups alone)
    per = lambda k, n: s[k] / s[n] if s[n] else None
    rec = {"step": step + 1, "lr": stats["lr"], "loss": s["loss_e0"],
           "reward": per("reward_sum", "n_scored"), "pass_rate": per("passes", "n_scored"),
           "zero_var_frac": s["zero_var_groups"] / max(s["groups"], 1),
           "trained_seqs": stats["trained_seqs"], "len_mean": s["len_sum"] / max(s["len_n"], 1),
           "len_max": s["len_max"], "entropy": s["entropy_e0"] / ntok, "kl_old": s["kl_old_e0"] / ntok,
           "logp_mismatch": s["mismatch_e0"] / ntok, "clip_frac": s["clip_e0"] / ntok,
           "grad_norm": stats["grad_norm"], "canary_passes": s["canary_passes"],
           "canary_samples": s["canary_samples"], "gen_s": s["gen_s"], "sandbox_s": s["sandbox_s"],
           "train_s": s["train_s"], "rounds": s["rounds"], "queued_groups": s["queued_groups"],
           "turns_mean": s["turns_sum"] / max(s["len_n"], 1)}
    if args.ppo_epochs > 1:
        rec.update(kl_old_last=s[f"kl_old_e{last}"] / max(s[f"tokens_e{last}"], 1),
                   clip_frac_last=s[f"clip_e{last}"] / max(s[f"tokens_e{last}"], 1))
    if args.prefilter > 1:
        rec.update(prefilter_s=s["prefilter_s"],
                   prefilter_odds_kept=s["prefilter_kept"] / max(s["prefilter_n"], 1),
                   prefilter_odds_all=s["prefilter_all"] / max(s["prefilter_n"], 1))
    if ctx.ref is not None:
        rec["kl_ref"] = s["kl_ref_sum"] / nsc
    if args.agent:           # tool calls and malformed actions per episode; the long tasks' summaries
        rec.update(tool_calls=s["tool_calls_sum"] / max(s["len_n"], 1),
                   format_errors=s["format_errors_sum"] / max(s["len_n"], 1),
                   long_pass_rate=per("long_passes", "long_n"), long_memory=ctx.state.get("long_memory"),
                   summaries_per_episode=per("summaries_sum", "long_n"),
                   summary_len=per("summary_tokens_sum", "summaries_sum"), over_cap=per("over_cap", "long_n"),
                   fact_retention=per("facts_kept", "facts_read"),
                   rebuilds_per_episode=per("rebuilds_sum", "long_n"))
    if args.repair_groups:   # failed attempts branched; the pass and resubmission rates of their repairs
        rec.update(repair_roots=s["repair_roots"], repair_pass_rate=per("repair_passes", "repair_n"),
                   repair_repeat_rate=per("repair_repeats", "repair_n"))
    rec.update({k: int(x) for k, x in s.items()
                if k.startswith(("outcome/", "hack/", "groups/d", "signal/d"))})
    rec.update({k: x for k, x in stats["moe"].items() if not k.startswith("moe/l") or "tokens_e" not in k})
    for k in ("gen_s", "sandbox_s", "train_s"):
        ctx.state["totals"][k] += rec[k]
    # Reward-hack monitoring: any canary pass, or suspicious constructs per completion at more than
    # twice the run's early rate, prints a warning (the metrics keep the counts).
    hist = ctx.state["hack_hist"]
    hist.append(sum(x for k, x in rec.items() if k.startswith("hack/")) / max(s["len_n"], 1))
    base = sum(hist[:5]) / len(hist[:5])
    if ctx.master and (rec["canary_passes"] > 0 or (len(hist) > 5 and hist[-1] > max(2 * base, 0.05))):
        tqdm.write(f"warning: possible reward hacking at step {step + 1}: "
                   f"canary passes {int(rec['canary_passes'])}, "
                   f"suspicious constructs/completion {hist[-1]:.3f} (early {base:.3f}); "
                   f"see hack/* in {ctx.metrics_path}")
    if ctx.master:
        common.log_metrics(ctx.metrics_path, rec)
        head = "queued groups only" if rec["reward"] is None else \
            f"reward {rec['reward']:.3f} pass {rec['pass_rate']:.3f}"
        pbar.set_postfix_str(f"{head} zv {rec['zero_var_frac']:.2f} "
                             f"len {rec['len_mean']:.0f} ent {rec['entropy']:.2f} gen/box/train "
                             f"{rec['gen_s']:.1f}/{rec['sandbox_s']:.1f}/{rec['train_s']:.1f}s")


def summarize_run(ctx):
    """The final JSON line: held-out pass@1 / pass@k before and after, overall and per slice."""
    args, evals, k = ctx.args, ctx.state["evals"], ctx.args.eval_k
    out = {f"{metric}{sl}_{when}": evals.get(when, {}).get(metric + sl) for metric in ("pass@1", f"pass@{k}")
           for sl in ("", "_near", "_novel") for when in ("before", "after")}
    if args.turns > 1:
        for when in ("before", "after"):
            e = evals.get(when, {})
            out[f"pass@1_by_turn_{when}"] = [e.get(f"pass@1_turn{t}") for t in range(1, args.turns + 1)]
    return {**out, "eval_seed": args.eval_seed, "steps": ctx.state["step"],
            "wall_s": round(time.time() - ctx.t_start, 1),
            "time_split": {x: round(y, 1) for x, y in ctx.state["totals"].items()},
            # strict JSON: None, not NaN, for an eval without pass@1
            "curve": {tag: round(e["pass@1"], 4) if "pass@1" in e else None for tag, e in evals.items()},
            "ckpt": ctx.ckpt_path, "out_dir": args.out_dir, "metrics": ctx.metrics_path}
