"""
The algorithm of train_rl.py (the RL phase of the Composer 2 recipe, arXiv 2603.24477), as small
pure functions: tensors and sample dicts in, tensors out; no arguments object, no sandbox, no ranks.
tests/test_rl.py checks each on hand-made numbers. One step of train_rl.py, in these functions:

    r = correct - W * length_cost(n_generated(s), k, q) - kl_coef * kl_k1(old, ref, mask)   # reward
    adv, has_signal = group_advantages(r, groups, signal_from=correct)   # advantage: r - group mean
    idx, tgt, old, routes, valid = collate(samples, pad_id, n_moe_layers, top_k, True)    # loss:
    logp, entropy = token_logprobs(model, idx, tgt, routes, temperature, valid)   # router replay
    tok_loss, clipped = ppo_token_loss(logp, old, adv)              # PPO clip, DAPO's clip-higher
    loss = (token_weights(mask, "constant", max_new_tokens, n_seqs, n_tokens) * tok_loss).sum()

Rewards: length_cost, kl_k1. Advantages: group_stats, group_advantages. Loss: ppo_token_loss,
token_weights (each docstring cites its source). Batches: Sequence and segments, flatten and collate
(an episode -> padded tensors; feedback is fed, never a target), pack_groups (each single-turn group's
prompt fed once), micro_batches and batch_tensors (a step's groups -> the training forwards),
token_logprobs (the one that runs the model). Task choice: mixed_group_odds (--prefilter). Held-out
eval: pass_sums and pass_at_k.
"""
import dataclasses
import math
from collections import namedtuple

import torch
import torch.nn.functional as F


def length_cost(x, k, q):
    """Composer 2's length penalty C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)): increasing and, for
    q > 0, concave (each extra token costs less than the last), so long answers to hard tasks are
    not crushed while padding easy ones still costs. q -> 1 gives log(1 + k x) / k; q = 0 is linear."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if abs(1 - q) < 1e-9:
        return torch.log1p(k * x) / k
    return ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))


def group_stats(r, g):
    """Per-group size, mean and unbiased variance (as TRL) of values r (N,) with group ids g (N,)."""
    n = torch.bincount(g).double()
    mean = torch.zeros_like(n).index_add_(0, g, r) / n.clamp_min(1)
    var = torch.zeros_like(n).index_add_(0, g, (r - mean[g]) ** 2) / (n - 1).clamp_min(1)
    return n, mean, var


def group_advantages(rewards, groups, std=False, eps=1e-6, signal_from=None):
    """rewards (N,), groups (N,) group ids (a task's samples; sizes may differ after dropped
    samples) -> (advantages (N,), has_signal (N,) bool).
    Dr. GRPO (Liu et al. 2025) and Composer 2: A = r - mean(group). Dividing by the group's std
    (GRPO, Shao et al. 2024; std=True) over-weights groups whose rewards barely differ (nearly all
    right or all wrong). A group whose rewards are all equal has A = 0: no signal, skipped.
    signal_from (N,): the rewards whose spread decides has_signal instead (DAPO's dynamic sampling
    filters on accuracy, the correctness reward, not on the length- or KL-shaped one)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    g = torch.as_tensor(groups, dtype=torch.long)
    n, mean, var = group_stats(r, g)
    adv = r - mean[g]
    if std:
        adv = adv / (var.sqrt()[g] + eps)
    if signal_from is not None:
        var = group_stats(torch.as_tensor(signal_from, dtype=torch.float64), g)[2]
    return adv, (var[g] > 1e-12) & (n[g] > 1)


def ppo_token_loss(logp, old_logp, adv, eps_low=0.2, eps_high=0.28):
    """Per-token clipped surrogate to MINIMISE, -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)
    with ratio = pi / pi_old (PPO; GRPO uses it per token). eps_high > eps_low is DAPO's clip-higher
    (Yu et al. 2025): a rare token with A > 0 may grow further before the clip stops it, which
    keeps entropy from collapsing. Returns (loss (B, T), clipped (B, T) bool: the clip binds, the
    token's gradient is zero). adv: (B,) or (B, T). Single epoch on-policy, the sampler's log-probs
    are the trainer's: ratio = 1 (up to float rounding) and the clip is inert; it binds only from the
    second --ppo-epochs on, on queued groups, or with a sampler that differs from the trainer."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def token_weights(mask, norm, max_new_tokens, n_seqs, n_tokens, seq_tokens=None):
    """Weights w such that loss = sum(w * per-token loss). mask (B, T) float (completion tokens).
    n_seqs / n_tokens: GLOBAL counts (all ranks, all micro-batches), so the gradient is the same
    whatever the split across ranks and micro-batches.
      constant (Dr. GRPO): sum over tokens / (n_seqs * max_new_tokens): no length normalisation,
                           so long wrong answers are not penalised less per token than short ones;
      token    (DAPO):     sum over tokens / all tokens in the batch;
      sequence (GRPO):     mean over each sequence's tokens, then mean over sequences.
    seq_tokens (B,): the tokens of the episode each row belongs to (segments: a segment of a chain is
    normalised over its whole episode, so splitting does not change a token's weight); default: the
    row's own. n_seqs then counts episodes (the segments' shares)."""
    if norm == "constant":
        return mask / (n_seqs * max_new_tokens)
    if norm == "token":
        return mask / max(n_tokens, 1)
    if norm == "sequence":
        per_seq = mask.sum(1) if seq_tokens is None else seq_tokens.to(mask.dtype)
        return mask / (per_seq.clamp_min(1)[:, None] * n_seqs)
    raise ValueError(f"unknown loss norm {norm!r}")


def kl_k1(logp, ref_logp, mask):
    """k1 estimator of KL(pi || pi_ref) per sequence: sum over tokens of log pi - log pi_ref, on
    tokens sampled from pi. Composer 2 picks k1 over k3 (whose variance explodes as the policies
    drift apart) and, as here, folds it into the reward: r <- r - kl_coef * k1."""
    return ((logp - ref_logp) * mask).sum(-1)


@dataclasses.dataclass
class Sequence:
    """One training sequence: an episode (env.Episode), or a segment of one carried by summaries
    (segments), reduced to what training reads: its turns (env.Turn's prompt_ids, tokens, logprobs,
    routes), the advantage of its episode, the tokens its whole episode wrote (token_weights'
    per-sequence normaliser) and its share of its episode (1 / segments: the sequences a step counts
    are episodes)."""
    turns: list
    adv: float = 0.0
    episode_tokens: int = 0
    share: float = 1.0


def n_generated(s):
    """The tokens the model wrote in an episode or a Sequence (every turn's)."""
    return sum(len(t.tokens) for t in s.turns)


def tool_calls(actions):
    """The tool calls among a tool episode's actions (env.Tools): every action but a malformed one."""
    return sum(a.error != "format" for a in actions)


def length_units(e, call_tokens, turn_tokens):
    """The length the length cost counts: every generated token; a tool episode (--agent, with
    actions) adds call_tokens per tool call (malformed actions excepted) and turn_tokens per turn
    after the first (Composer 2: a weighted count of tokens, tool calls and turns). A sample or a
    --turns episode counts its tokens alone."""
    if not e.actions:
        return n_generated(e)
    return n_generated(e) + call_tokens * tool_calls(e.actions) + turn_tokens * (len(e.turns) - 1)


def segments(e):
    """An episode -> its training Sequences. One, unless it is a tool episode carried by a memory
    (env.Tools, a long task): then one per segment, the turns from one fresh context to the next (the
    first turn's prompt_ids are that context, fed: the prompt and the latest summary, or what mask or
    window rebuilt; a summary that ends a segment is its last turn, a target). Every segment gets the
    episode's advantage, is normalised over the tokens of the whole episode (episode_tokens), and counts
    as 1 / segments of a sequence (share)."""
    parts = {}
    for t in e.turns:
        parts.setdefault(t.segment, []).append(t)
    return [Sequence(p, episode_tokens=n_generated(e), share=1 / len(parts)) for p in parts.values()]


def flatten(s):
    """An episode or a Sequence -> (ids fed to the model: per turn its prompt/feedback + tokens[:-1],
    the column whose prediction is each generated token, the generated tokens, their logprobs).
    Feedback tokens are fed, never targets: the loss covers only what the model wrote, in every turn."""
    ids, cols, tokens, lps = [], [], [], []
    for t in s.turns:
        start = len(ids) + len(t.prompt_ids) - 1
        ids += t.prompt_ids + t.tokens[:-1]
        cols += range(start, start + len(t.tokens))
        tokens += t.tokens
        lps += t.logprobs
    return ids, cols, tokens, lps


def collate(samples, pad_id, n_moe_layers, top_k, with_routes):
    """Episodes or Sequences -> idx (B, T), targets (B, T) with -1 on prompt, feedback and padding (the
    loss mask: generated tokens only), old logprobs (B, T), routes (n_moe_layers, B, T, top_k) or None,
    valid (B, T) bool (real tokens, not padding: the MoE counts only those as expert load). idx =
    flatten()'s ids, right-padded."""
    flat = [flatten(s) for s in samples]
    B, T = len(samples), max(len(f[0]) for f in flat)
    idx = torch.full((B, T), pad_id, dtype=torch.long)
    tgt = torch.full((B, T), -1, dtype=torch.long)
    old = torch.zeros(B, T)
    valid = torch.zeros(B, T, dtype=torch.bool)
    routes = torch.zeros(n_moe_layers, B, T, top_k, dtype=torch.long) if with_routes else None
    for i, (s, (ids, cols, tokens, lps)) in enumerate(zip(samples, flat)):
        idx[i, :len(ids)] = torch.tensor(ids)
        tgt[i, cols] = torch.tensor(tokens)
        old[i, cols] = torch.tensor(lps)
        valid[i, :len(ids)] = True
        if with_routes:   # padding keeps expert 0: it is computed but, not being valid, never counted
            routes[:, i, :len(ids)] = torch.cat([t.routes for t in s.turns], 1)
    return idx, tgt, old, routes, valid


def group_rows(samples):
    """Indices of the samples that share a prompt (a group, single-turn), one list per prompt."""
    rows = {}
    for i, s in enumerate(samples):
        rows.setdefault(tuple(s.turns[0].prompt_ids), []).append(i)
    return list(rows.values())


def packed_len(samples):
    """Positions pack_groups feeds for these samples: each prompt once, each sample's tokens[:-1]."""
    return sum(len(samples[r[0]].turns[0].prompt_ids) for r in group_rows(samples)) + \
        sum(len(s.turns[0].tokens) - 1 for s in samples)


def pack_groups(samples, pad_id, n_moe_layers, top_k, with_routes):
    """collate() for single-turn groups without feeding a prompt G times (the G samples of a group
    share it): one row per prompt, the prompt once, then each sample's tokens.
    A block mask lets a sample's tokens see the prompt and that sample's earlier tokens only, and
    each sample's positions restart where the prompt ends, so every token gets the logits of
    collate's layout (float rounding apart; the same gradients). The prompt's last position
    predicts every sample's first token. The MoE counts each prompt token once as expert load.
    Returns idx, tgt, old, routes, valid as collate does, except that tgt and old are (B, N), one
    row per sample (N = most tokens), and a layout for token_logprobs: pos, seg (R, T: which part
    of the row a position belongs to; block_mask makes the mask of it), src."""
    rows, samples = group_rows(samples), [s.turns[0] for s in samples]   # single-turn: one turn each
    T = max(len(samples[r[0]].prompt_ids) + sum(len(samples[i].tokens) - 1 for i in r) for r in rows)
    R, N = len(rows), max(len(s.tokens) for s in samples)
    idx = torch.full((R, T), pad_id, dtype=torch.long)
    pos = torch.zeros(R, T, dtype=torch.long)
    seg = torch.full((R, T), -1, dtype=torch.long)      # 0: the prompt, j + 1: sample j's tokens, -1: padding
    src = torch.zeros(len(samples), N, dtype=torch.long)
    tgt = torch.full((len(samples), N), -1, dtype=torch.long)
    old = torch.zeros(len(samples), N)
    routes = torch.zeros(n_moe_layers, R, T, top_k, dtype=torch.long) if with_routes else None
    for r, members in enumerate(rows):
        prompt = samples[members[0]].prompt_ids
        L = len(prompt)
        idx[r, :L], pos[r, :L], seg[r, :L] = torch.tensor(prompt), torch.arange(L), 0
        if with_routes:
            routes[:, r, :L] = samples[members[0]].routes[:, :L]
        at = L
        for j, i in enumerate(members):
            s, n = samples[i], len(samples[i].tokens)
            fed = slice(at, at + n - 1)
            idx[r, fed], pos[r, fed], seg[r, fed] = torch.tensor(s.tokens[:-1], dtype=torch.long), \
                torch.arange(L, L + n - 1), j + 1
            src[i, :n] = r * T + torch.tensor([L - 1] + list(range(at, at + n - 1)))
            tgt[i, :n], old[i, :n] = torch.tensor(s.tokens), torch.tensor(s.logprobs)
            if with_routes:
                routes[:, r, fed] = s.routes[:, L:L + n - 1]
            at += n - 1
    return idx, tgt, old, routes, seg >= 0, {"pos": pos, "seg": seg, "src": src}


def block_mask(seg):
    """pack_groups' attention mask (R, 1, T, T) from its seg (R, T): causal, and a position sees the
    prompt (seg 0) and its own sample's tokens only. Built where the forward runs, one micro-batch
    at a time: a (T, T) mask per row is the largest tensor of a packed step."""
    T = seg.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()
    return (causal & ((seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])))[:, None]


def micro_batches(groups, size, pack):
    """A step's groups -> lists of samples, one list per training forward. pack: whole groups, up to
    `size` samples (at least one group) each; else single samples, `size` each. Sorted by length so
    that a micro-batch pads little (the summed gradient does not care about the order)."""
    if not pack:
        train = sorted((s for group in groups for s in group), key=lambda s: len(flatten(s)[0]))
        return [train[i:i + size] for i in range(0, len(train), size)]
    out = []
    for group in sorted(groups, key=packed_len):
        if out and len(out[-1]) + len(group) <= size:
            out[-1] += group
        else:
            out.append(list(group))
    return out


# One training forward's tensors (batch_tensors): collate's or pack_groups', the layout for
# token_logprobs (pack_groups' pos, seg and src, and for both the targets' flat indices `at`), the
# sequences it counts (segments' shares) and each row's episode tokens (token_weights' seq_tokens).
Batch = namedtuple("Batch", "idx tgt old routes valid layout seqs seq_tokens", defaults=(0.0, None))


def batch_tensors(samples, pad_id, n_moe_layers, top_k, with_routes, pack):
    """The one place the layout is chosen: pack_groups (pack) or collate. Returns a Batch; either way
    tgt and old hold one row per sample, so (tgt >= 0).sum() counts the generated tokens and
    valid.sum() the positions fed. layout["at"]: where the targets sit in tgt.flatten(), found here on
    the host so that the training forward reads nothing back from the GPU (a boolean mask's count would)."""
    if pack:
        batch = Batch(*pack_groups(samples, pad_id, n_moe_layers, top_k, with_routes))
    else:
        batch = Batch(*collate(samples, pad_id, n_moe_layers, top_k, with_routes), {})
    batch.layout["at"] = (batch.tgt >= 0).flatten().nonzero().squeeze(1)
    return batch._replace(seqs=sum(s.share for s in samples), seq_tokens=torch.tensor(
        [s.episode_tokens for s in samples], dtype=torch.float32))


def token_logprobs(model, idx, tgt, routes, temperature, valid=None, pos=None, seg=None, src=None, at=None):
    """log pi(token) of every target (tgt >= 0; 0 elsewhere) under softmax(logits / T), the
    distribution generation sampled from (sampling.reference's logprobs; T = 0 is greedy: plain
    softmax), and the policy's entropy there. Only the positions that predict a target go through
    the LM head and the softmax: no other position's logits enter the loss.
    valid (B, T) bool: the real tokens (collate's), the only ones counted as MoE expert load.
    pos, seg, src: pack_groups' layout (positions, segments for block_mask, the flat position that
    predicts each target); None: collate's (one sample per row, causal, a target's column predicts it).
    at: the targets' indices in tgt.flatten() (batch_tensors finds them on the host); None: found here."""
    pos = torch.arange(idx.size(1), device=idx.device)[None] if pos is None else pos
    mask = None if seg is None else block_mask(seg)
    h, _ = model.trunk(idx, pos, mask=mask, routes=routes, valid=valid)
    at = (tgt >= 0).flatten().nonzero().squeeze(1) if at is None else at
    rows = at if src is None else src.flatten()[at]   # the flat position whose output predicts each target
    logp_all = F.log_softmax(model.lm_head(h.flatten(0, 1)[rows]).float() / (temperature or 1.0), -1)
    picked = logp_all.gather(-1, tgt.flatten()[at][:, None]).squeeze(-1)
    logp = torch.zeros(tgt.numel(), device=idx.device).index_put((at,), picked).view(tgt.shape)
    with torch.no_grad():
        entropy = torch.zeros(tgt.numel(), device=idx.device).index_put(
            (at,), -(logp_all.exp() * logp_all).sum(-1)).view(tgt.shape)
    return logp, entropy


def mixed_group_odds(logq, g):
    """The probability that a group of g samples both passes and fails, if each sample passes with
    probability q = exp(logq): 1 - q^g - (1 - q)^g. Online difficulty filtering (--prefilter) ranks
    fresh tasks by it, with q the policy's probability of the reference solution (a lower bound of
    the pass rate: other bodies pass too), before anything is sampled; 0 at q = 0 and at q = 1."""
    q = torch.as_tensor(logq, dtype=torch.float64).exp().clamp(0, 1)
    return 1 - q ** g - (1 - q) ** g


def pass_sums(per_task, ks):
    """per_task: [(slice, valid samples n, correct c)] -> {"pass@k" and "pass@k_<slice>": (sum over
    the tasks with n >= k of the unbiased pass@k, number of those tasks)}. Sums, not means, so that
    ranks (and slices) combine weighted by the tasks they actually scored; a task with fewer than k
    valid samples (sandbox errors) is left out of pass@k, not counted as a failure."""
    out = {}
    for k in ks:
        for sl, n, c in per_task:
            if n < k:
                continue
            for name in [f"pass@{k}"] + ([f"pass@{k}_{sl}"] if sl else []):
                acc = out.setdefault(name, [0.0, 0])
                acc[0] += pass_at_k(n, c, k)
                acc[1] += 1
    return out


def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
    the chance that at least one of k samples, drawn without replacement from n of which c are
    correct, passes: 1 - C(n-c, k) / C(n, k), written as a product so large n cannot overflow.
    Averaging it over tasks beats the naive 1-(1-c/n)^k, which is biased low."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:          # every draw of k must contain a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
