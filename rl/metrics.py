"""
What an RL run (train_rl.py) records: the statistics each step sums (new_stats) and reduces over
ranks, the step's metrics.jsonl line with the progress bar and the reward-hack warning (record),
and the final JSON summary (summarize_run). The held-out eval itself is train_rl.held_out (it runs
eval.py's harness; this module stays below eval.py in the imports).

Every function but new_stats (which takes the arguments) takes train_rl.setup's namespace `ctx`
(args, rank / world / ddp / master, model, tokenizer, sandbox pool, held-out tasks, paths, start
time and the resumable `state`).
"""
import time
from collections import Counter

import torch
import torch.distributed as dist
from tqdm import tqdm

from infra import common
import env
from sandbox.pool import OUTCOMES


class Stats(Counter):
    """One step's statistics on this rank, every key declared by new_stats (and documented there). A
    key new_stats does not declare raises: a misspelt key never starts a counter of its own."""
    def __missing__(self, key):
        raise KeyError(f"{key!r} is not a statistic of rl.metrics.new_stats")


ONCE = ("lr", "trained_seqs", "grad_norm", "len_max", "moe")   # set once a step, never summed over ranks


def new_stats(args):
    """Every statistic a step keeps, at 0: each rank reduces the same keys in the same order, even a
    rank whose samples were all sandbox errors or that had no group to train on. Summed over the
    step's rounds and over ranks (reduce_stats):
      outcome/O, hack/P      first attempts' outcomes (over_cap: --over-cap fail); suspicious constructs
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
      long_n, long_passes, summaries_sum, summary_tokens_sum, over_cap, facts_read, facts_kept
                             --agent's long tasks: the summaries, their cap, the facts they keep
    Set once (ONCE): lr, trained_seqs, grad_norm, len_max (the max over ranks), moe (the router's
    figures, model.moe_metrics)."""
    keys = [f"outcome/{o}" for o in OUTCOMES + ("over_cap",)] + [f"hack/{k}" for k in env.HACK_PATTERNS]
    keys += [f"{k}_e{e}" for e in range(args.ppo_epochs)
             for k in ("loss", "tokens", "clip", "entropy", "kl_old", "mismatch")]
    keys += ["passes", "n_scored", "reward_sum", "kl_ref_sum", "groups", "zero_var_groups", "rounds",
             "queued_groups", "len_sum", "len_n", "turns_sum", "canary_passes", "canary_samples", "gen_s",
             "sandbox_s", "train_s", "prefilter_s", "prefilter_n", "prefilter_kept",
             "prefilter_all", "repair_roots", "repair_n", "repair_passes", "repair_repeats", "tool_calls_sum",
             "format_errors_sum", "long_n", "long_passes", "summaries_sum", "summary_tokens_sum", "over_cap",
             "facts_read", "facts_kept"]
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
                   long_pass_rate=per("long_passes", "long_n"),
                   summaries_per_episode=per("summaries_sum", "long_n"),
                   summary_len=per("summary_tokens_sum", "summaries_sum"), over_cap=per("over_cap", "long_n"),
                   fact_retention=per("facts_kept", "facts_read"))
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
    out = {}
    for metric in ("pass@1", f"pass@{k}"):
        for sl in ("", "_near", "_novel"):
            for when in ("before", "after"):
                out[f"{metric}{sl}_{when}"] = evals.get(when, {}).get(metric + sl)
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
