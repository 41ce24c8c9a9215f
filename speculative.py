"""
Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with the model's multi-token-prediction
modules (DeepSeek-V3) as the drafter: sampling.reference's distribution, several tokens per trunk
forward. A speed path, chosen by sampling.generate where sampling.SPECULATIVE is set and the model
has MTP modules (agent.py); train_mtp.py trains the drafter; lab/bench.py speculative and
docs/speculative.md measure it.
"""
import torch

import sampling


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
             generator=None, past=None, return_past=False, stats=None) -> list[dict]:
    """sampling.reference's samples, several tokens per trunk forward. Each step, the n_mtp MTP levels
    draft n_mtp tokens (draft), one trunk forward scores the last token and every draft, and accept
    keeps or replaces the drafts by the rule of speculative sampling: every token has exactly
    generate's distribution, softmax(logits / T) after top-k / top-p, whatever the drafter proposes;
    at T = 0, generate's tokens. All rows move by the same count per step (see accept), so the batch
    keeps generate's left-padded layout and one cache pointer; a rejection is rolled back by setting
    that pointer after the accepted tokens (the rejected columns are written again by the next step).
    Same prompts, stop ids, pasts (whose keys/values include the MTP layers'), retiring of finished
    rows and outputs as generate, without routes. stats: a list that receives this call's counts (see
    count; lab/bench.py reports them), one append, so threads may share it."""
    prompts = sampling.as_prompt_lists(prompts)
    D = model.config.n_mtp
    if not D:
        raise ValueError("speculative.generate: the model has no MTP modules (n_mtp = 0)")
    if not sampling.anything_to_generate(prompts, past, max_new_tokens):
        return [{"tokens": [], "logprobs": []} for _ in prompts]
    # room after the prompt: the new tokens, then a step's drafts and the MTP levels' look-ahead
    b = sampling.prefill(model, prompts, past, max_new_tokens + 2 * D + 1, model.config.n_layer + D)
    cache, rows, A, L, B = b.cache, b.rows, b.A, b.L, len(prompts)
    logits = model.lm_head(b.h[:, -1]).float()[rows]
    cache.select(rows)
    valid, pos = b.valid[rows], (b.n_past + b.lens)[rows]
    dev, ahead = pos.device, torch.arange(2 * D + 1, device=pos.device)
    new, lp = (x[:, None] for x in sampling.sample(logits, temperature, top_k, top_p, generator))
    # the MTP levels read the prompt and the first token; pads read as zeros (training's "before the start")
    real = valid[:, A:A + L + D]
    h = b.h[rows].masked_fill(~real[:, :L, None], 0)
    drafts, q, carry = draft(model, cache, A, [h.new_zeros(B, 1, h.size(-1))] * D, h,
                             torch.cat([b.idx[rows], new], 1),
                             torch.cat([b.pos[rows], pos[:, None] + ahead[:D]], 1), valid,
                             temperature, top_k, top_p, generator, real)
    cache.pos = A + L
    counts = count(None, D, 1) if stats is not None else None
    width = max_new_tokens + D + 1          # a step may pass max_new_tokens; n_out cuts it
    tokens = torch.zeros(B, width, dtype=torch.long, device=dev)
    logprobs = torch.zeros(B, width, device=dev)
    n_out = torch.full((B,), max_new_tokens, device=dev)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
    alive = torch.arange(B, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    pasts, t = [None] * B, 0
    def save_past(j):   # as in sampling.retiring
        r = int(alive[j])
        n = int(b.n_past[b.which[r]]) + len(prompts[r]) + int(n_out[r]) - 1
        pasts[r] = cache.take(j, valid[j, :cache.pos].nonzero().squeeze(1)[:n])
    while True:
        s = new.size(1)
        tokens[alive, t:t + s], logprobs[alive, t:t + s] = new, lp
        hit = torch.isin(new, stop)
        first = torch.where(hit.any(1), t + 1 + hit.int().argmax(1), n_out[alive])
        n_out[alive] = torch.where(done, n_out[alive], torch.minimum(first, n_out[alive]))
        done |= hit.any(1) | (t + s >= max_new_tokens)
        t += s
        n_done = int(done.sum())
        if n_done == len(alive):
            break
        if 8 * n_done >= len(alive):   # retire finished rows
            unfinished = ~done
            new, drafts, valid, pos, alive, done, *carry = sampling.retire(
                done, cache, save_past if return_past else None, new, drafts, valid, pos, alive, done, *carry)
            q = q[unfinished.nonzero().squeeze(1)] if q is not None else None
        # one trunk forward checks the drafts: the last token, then the drafts, from the pointer on
        at, x = cache.pos, torch.cat([new[:, -1:], drafts], 1)
        h, _ = model.trunk(x, pos[:, None] + ahead[:D + 1], cache, sampling.attention_mask(valid, at, D + 1))
        new, lp, run = accept(model.lm_head(h).float(), drafts, q, temperature, top_k, top_p, generator,
                              ~done)
        s = new.size(1)
        if counts is not None:
            count(counts, D, s, run[~done])
        drafts, q, carry = draft(model, cache, at, carry, h[:, :s], torch.cat([x[:, :1], new], 1),
                                 pos[:, None] + ahead[:s + D], valid, temperature, top_k, top_p, generator)
        cache.pos, pos = at + s, pos + s   # the rollback: columns of rejected drafts are written again
    if return_past:
        for j in range(len(alive)):
            save_past(j)
    if stats is not None:
        stats.append(counts)
    return sampling.outputs(tokens, logprobs, n_out, pasts if return_past else None, None, prompts, L)


def draft(model, cache, at, carry, h, tokens, pos, valid, temperature, top_k, top_p, generator, real=None):
    """The MTP levels catch up with the newly committed tokens, then draft the next n_mtp. h (B, s, D):
    the trunk's output at the s new slots (cache columns at..at+s-1); tokens (B, s + 1): the tokens fed
    at those slots and the one committed after them; carry: each level's output at the slot before
    `at` (level 0: the trunk; zeros at the start); pos (B, s + n_mtp): the slots' positions; real:
    False at pads (the prefill), whose outputs read as zeros. Level m (1..n_mtp) reads level m-1 one
    slot back and the token at each of s + m slots from `at`: the committed ones, then the m - 1
    drafts so far; its last slot drafts the next token. Its keys/values go to the cache's MTP layers
    from column `at` (the caller moves the pointer past the committed slots only). Returns the drafts
    (B, n_mtp), their distributions (B, n_mtp, V; None when greedy) and the new carry."""
    s, D = h.size(1), len(model.mtp)
    cos, sin = model.rope(pos)
    mask = sampling.attention_mask(valid, at, s + D)
    prev, fed, carry_out, drafts, qs = torch.cat([carry[0], h], 1), tokens, [h[:, -1:]], [], []
    for m, mod in enumerate(model.mtp):
        n = s + 1 + m
        cache.pos = at
        out = mod(prev, model.wte(fed), cos[:, :, :n], sin[:, :, :n], cache, mask[:, :, :n, :at + n])
        if real is not None:
            out = out.masked_fill(~real[:, :n, None], 0)
        logits = model.lm_head(mod.norm(out[:, -1])).float()
        q = None if temperature == 0 else sampling.distribution(logits, temperature, top_k, top_p)[1]
        drafts.append(logits.argmax(-1) if q is None else sampling.draw(q, generator))
        qs.append(q)
        if m + 1 < D:
            carry_out.append(out[:, s - 1:s])
            prev, fed = torch.cat([carry[m + 1], out], 1), torch.cat([fed, drafts[-1][:, None]], 1)
    return torch.stack(drafts, 1), None if temperature == 0 else torch.stack(qs, 1), carry_out


def accept(logits, drafts, q, temperature, top_k, top_p, generator, live):
    """The rule of Leviathan et al. 2023 and Chen et al. 2023. logits (B, D + 1, V): the model's at the
    last committed token and at each draft; drafts (B, D), drawn from q (B, D, V). Draft j is kept
    with probability min(1, p_j(d) / q_j(d)); the first one rejected is replaced by a draw from
    max(0, p_j - q_j) normalised; after D kept drafts a bonus token comes from p_D. Each token then
    has distribution p exactly (greedy: a draft is kept where it is p's argmax, and the replacement
    is the argmax). The batch moves by the fewest drafts any live row kept, a, plus one: a row that
    kept more takes its kept draft a + 1 there, also a token of its exact distribution, as the
    replacement is. Returns the tokens (B, a + 1), their log-probs under softmax(logits / T) (as
    generate reports them) and each row's own count of kept drafts."""
    B, T, V = logits.shape
    if temperature == 0:
        logp, best = logits.log_softmax(-1), logits.argmax(-1)
        kept = drafts == best[:, :-1]
    else:
        logp, p = (x.view(B, T, V)
                   for x in sampling.distribution(logits.view(B * T, V), temperature, top_k, top_p))
        u = torch.rand(B, T - 1, generator=generator, device=generator.device if generator else logits.device)
        pick = drafts[..., None]
        kept = u.to(logits.device) < keep_probability(p[:, :-1].gather(-1, pick)[..., 0],
                                                      q.gather(-1, pick)[..., 0])
    run = kept.int().cumprod(1).sum(1)
    a = int(run[live].min())
    if temperature == 0:
        fix = best[:, a]
    else:
        fix = sampling.draw(p[:, a] if a == T - 1 else (p[:, a] - q[:, a]).clamp_min(0), generator)
    last = torch.where(run > a, drafts[:, a], fix) if a < T - 1 else fix
    tokens = torch.cat([drafts[:, :a], last[:, None]], 1)
    return tokens, logp[:, :a + 1].gather(-1, tokens[..., None])[..., 0], run


def keep_probability(p, q):
    """The chance of keeping a draft that the drafter proposed with probability q and the model gives
    probability p: min(1, p / q) (q > 0: the draft was drawn from it)."""
    return (p / q).clamp(max=1.0)


def count(counts, D, advanced, run=None):
    """Adds one trunk forward to a call's counts (None: new counts): forwards, the tokens they moved the
    rows by (advanced), and per draft position j the live rows whose drafts before j were all kept
    (reached) and those that kept draft j too (kept; kept / reached is the acceptance at position j)."""
    counts = counts if counts is not None else {"forwards": 0, "advanced": 0, "reached": [0] * D,
                                                "kept": [0] * D}
    counts["forwards"] += 1
    counts["advanced"] += advanced
    if run is not None:
        for j in range(D):
            counts["reached"][j] += int((run >= j).sum())
            counts["kept"][j] += int((run > j).sum())
    return counts
