"""
Generation: everything that samples from the model (model.py is the architecture alone).

    outs = engine.generate(model, prompts, max_new_tokens=96, temperature=1.0, stop_ids=[eot])

  - generate: the reference. Plain eager PyTorch, one batch, one trunk call per new token, read top
    to bottom (its parts: KVCache, prefill, sample).
  - generate_streams: what RL rollouts, eval, the episodes and pretraining's sample call. The same
    generate, faster on a CPU, each row sampled from the same distribution (float rounding of the
    thread count and of the compiled step apart): one torch thread per call and two decode streams
    side by side (cpu_threads, STREAMS); optionally each decode step through torch.compile
    (COMPILE, compiled_trunk: train_rl.py / eval.py --compile-decode).
  - generate_speculative: speculative sampling, the model's MTP modules (train_mtp.py) drafting
    tokens that one trunk forward checks: several tokens per forward, exactly generate's
    distribution (greedy: its tokens). generate_streams takes it where SPECULATIVE is set and the
    model has MTP modules (agent.py, the interactive command).
Then the episodes built on them: sample_completions, run_episodes (train_rl.py, eval.py, agent.py).
Measured in bench.py (generation, compiled, speculative); the figures are in docs/benchmarks.md and
docs/speculative.md.
"""
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from tqdm import tqdm

import env
from infra import common
from model import GPT

# Settings of the speed paths, process-wide (like MoE.dispatch: they change speed, and float rounding
# only: log-probs move by ~1e-6 when the thread count splits reductions differently).
THREADS = 1      # torch threads per decode stream on CPU (0: leave torch's setting); see cpu_threads
STREAMS = 2      # decode streams (Python threads) on CPU: this machine's 2 cores
# Decode steps through torch.compile(trunk) (compiled_trunk). Off by default: compiling (and
# recompiling for new shapes) takes minutes on 2 cores; --compile-decode turns it on.
COMPILE = False
_COMPILED = {}   # "trunk": GPT.trunk under torch.compile, one for every model (False: compiling failed)
# generate_streams decodes with generate_speculative where the model has MTP modules (agent.py sets it;
# calls that want routes still take generate: the drafts' routes are not recorded).
SPECULATIVE = False
# Host reads in the decode loop. On a GPU every read of a device value (.item(), bool(.any()), a
# shape that depends on data) waits for the queued kernels, so a loop that reads once per token runs
# at the speed of its round trips, not of the GPU. SYNC_FREE decodes without them: finished rows
# are a device mask that generate reads every DONE_EVERY tokens (to stop, or to retire rows), sampling
# never asks the host, and the MoE sizes its expert groups on the device (model.MoE.experts). None:
# on GPU only. On CPU a read is free and retiring finished rows at once saves compute, so CPU decoding
# reads every token, as it always did (same samples: the rows a step draws for depend on retiring).
SYNC_FREE = None
DONE_EVERY = 16


def sync_free(device):
    return device.type != "cpu" if SYNC_FREE is None else SYNC_FREE


# ----------------------------------------------------------------------------------------------
# The reference: generate

class KVCache:
    """Preallocated per-layer keys/values, (B, n_kv_head, max_len, head_dim); all rows share the
    pointer `pos`, the next column to write, because prompts are left-padded (see generate). The model
    writes through update() at pos; the caller moves pos after each forward (speculative decoding
    moves it past the accepted tokens only: a rejected draft's columns are written again)."""

    def __init__(self, n_layer, max_len):
        self.k, self.v, self.max_len, self.pos = [None] * n_layer, [None] * n_layer, max_len, 0

    def update(self, i, k, v):
        if self.k[i] is None:
            B, H, _, D = k.shape
            self.k[i] = k.new_zeros(B, H, self.max_len, D)
            self.v[i] = v.new_zeros(B, H, self.max_len, D)
        t = self.pos + k.size(2)
        self.k[i][:, :, self.pos:t] = k
        self.v[i][:, :, self.pos:t] = v
        return self.k[i][:, :, :t], self.v[i][:, :, :t]

    def select(self, rows):   # keep / duplicate batch rows (retire finished rows, fan out shared prompts)
        self.k = [t if t is None else t.index_select(0, rows) for t in self.k]
        self.v = [t if t is None else t.index_select(0, rows) for t in self.v]

    def fill(self, past, end):
        """Start from rows' earlier keys/values (past[b]: (layers, 2, n_kv_head, n_b, head_dim), as
        take() returns them), row b's right-aligned to end at column `end` (left of it: masked pads).
        Layers the past lacks (MTP layers, after a call without them) start from zeros."""
        n_layer, _, H, _, D = past[0].shape
        for i in range(min(n_layer, len(self.k))):
            self.k[i] = past[0].new_zeros(len(past), H, self.max_len, D)
            self.v[i] = past[0].new_zeros(len(past), H, self.max_len, D)
        for b, p in enumerate(past):
            for i in range(min(n_layer, len(self.k))):
                self.k[i][b, :, end - p.size(3):end], self.v[i][b, :, end - p.size(3):end] = p[i, 0], p[i, 1]
        self.pos = end

    def take(self, row, cols):   # one row's keys/values at the given columns, for fill()
        return torch.stack([torch.stack([k[row][:, cols], v[row][:, cols]]) for k, v in zip(self.k, self.v)])


def as_prompt_lists(prompts):
    """generate()'s prompts -> a list of lists of ints: accepts lists/tuples of ids (or 1-D tensors),
    or a (B, T) integer tensor."""
    if torch.is_tensor(prompts):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise ValueError(f"generate: prompts must be a (B, T) integer tensor or a list of token-id lists, "
                             f"got a {prompts.dtype} tensor of shape {tuple(prompts.shape)}")
        return prompts.tolist()
    try:
        return [p.tolist() if torch.is_tensor(p) else [int(t) for t in p] for p in prompts]
    except (TypeError, ValueError):
        raise ValueError("generate: prompts must be a (B, T) integer tensor or a list of token-id lists") from None


def anything_to_generate(prompts, past, max_new_tokens):
    """False when there is nothing to generate; raises on bad input."""
    if past is not None and len(past) != len(prompts):
        raise ValueError(f"generate: {len(past)} pasts for {len(prompts)} prompts")
    if not prompts or max_new_tokens <= 0:
        return False
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt")
    return True


def prefill(model, prompts, past, room, n_layers):
    """A generate call's first forward. The distinct prompts (a row with a past of its own is never
    merged with another) are LEFT-padded into one batch, so that every row's last prompt token sits in
    the same column; each continues from its past (right-aligned before the prompt, pads between),
    and the trunk reads them all once. Pads are masked out of attention, and RoPE positions count
    from each row's first real token, so a row sees exactly what it would see alone. Returns h (U, L,
    D): the trunk's output; chosen: its experts; cache: n_layers layers, `room` free columns after the
    prompt, pos at the first; valid (U, columns): False at pads; rows: the distinct prompt of each
    row; lens, n_past (U,); A, L: the past's and the prompt's padded widths; idx, pos: what was fed."""
    dev = model.lm_head.weight.device
    uniq = {}
    which = [uniq.setdefault(i if past is not None else tuple(p), len(uniq)) for i, p in enumerate(prompts)]
    first = {w: b for b, w in reversed(list(enumerate(which)))}
    lens_h = [len(prompts[first[w]]) for w in range(len(uniq))]      # on the host: no device reads
    past_h = [past[first[w]].size(3) if past is not None else 0 for w in range(len(uniq))]
    lens, n_past = torch.tensor(lens_h, device=dev), torch.tensor(past_h, device=dev)
    A, L = max(past_h), max(lens_h)     # cache columns: [pads, past] [pads, prompt] [new tokens]
    col = torch.arange(A + L, device=dev)[None]
    start = (A + L - lens)[:, None]
    idx = torch.zeros(len(uniq), L, dtype=torch.long, device=dev)   # pad id 0: masked, never seen
    for w in range(len(uniq)):
        idx[w, L - lens_h[w]:] = torch.tensor(prompts[first[w]], device=dev)
    valid = torch.ones(len(uniq), A + L + room, dtype=torch.bool, device=dev)
    valid[:, :A + L] = (col >= start) | ((col >= A - n_past[:, None]) & (col < A))
    cache = KVCache(n_layers, A + L + room)
    mask = None
    if A:
        cache.fill([past[first[w]].to(dev) for w in range(len(uniq))], A)
    if not bool(valid.all()) or A:   # causal AND key is a real token; a pad query attends to itself (no empty rows -> no NaN)
        mask = attention_mask(valid, A, L)
    pos = (col[:, A:] - start).clamp_min(0) + n_past[:, None]
    h, chosen = model.trunk(idx, pos, cache, mask)
    cache.pos += L
    return SimpleNamespace(h=h, chosen=chosen, cache=cache, valid=valid, rows=torch.tensor(which, device=dev),
                           which=which, lens=lens, n_past=n_past, A=A, L=L, idx=idx, pos=pos)


def attention_mask(valid, at, T):
    """(B, 1, T, at + T) bool: queries in columns at..at+T-1 see the real keys up to their own column
    (a pad query sees itself: no empty row, no NaN)."""
    col = torch.arange(at + T, device=valid.device)
    q = at + torch.arange(T, device=valid.device)[:, None]
    return (col <= q) & valid[:, None, None, :at + T] | (col == q)


def retire(done, cache, keep_past, *rows):
    """Drop the finished rows from the batch and the cache, so they stop costing compute (in bulk, once
    enough are done, to amortise the copy): keep_past(j) saves row j's keys/values first (multi-turn
    pasts; None: not kept). Returns each of `rows` (tensors, batch first) without the finished rows."""
    if keep_past is not None:
        for j in done.nonzero().squeeze(1).tolist():
            keep_past(j)
    keep = (~done).nonzero().squeeze(1)
    cache.select(keep)
    return [x[keep] for x in rows]


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
             generator=None, return_routes=False, past=None, return_past=False, trunk=None) -> list[dict]:
    """Sample a continuation for each prompt, all in one batch. prompts: lists of token ids (any
    lengths), or a (B, T) integer tensor of B prompts (as nanoGPT's generate takes).

    One prefill (left-padded prompts, see prefill), then each decode step feeds exactly one token per
    row and all rows share one cache pointer. Identical prompts (n samples per task for pass@k) are
    prefilled once and their cache rows duplicated. Finished rows (stop id or max_new_tokens) are
    dropped from the batch and the cache (in bulk, once >= 1/8 of the rows are done, to amortise the
    copy), so they stop costing compute. Per-step bookkeeping is a few tensor ops into preallocated
    (rows, max_new_tokens) buffers, with no Python loop over rows, so its cost does not grow with the
    batch. On GPU (SYNC_FREE) the loop never waits for the device: finished rows are a device mask
    read every DONE_EVERY tokens (stop, retire); rows done in between run on, their junk cut off.

    Multi-turn episodes (agent.py) continue rows instead of re-reading them: return_past=True adds
    "past" to each output, the keys/values of every token the row fed (its past, prompt and
    tokens[:-1]); given back as `past` (one per prompt) with the next turn's tokens as prompts, each
    row's cache starts from its past and only the new tokens are prefilled.

    Returns per prompt {"tokens", "logprobs"[, "routes"][, "past"]}: logprobs under
    softmax(logits / T) before top-k/top-p (T = 0: greedy, plain softmax); routes (n_moe_layers,
    L - 1, top_k) are the experts of every token this call fed (prompt + tokens[:-1]), for router
    replay. trunk: the function each decode step calls instead of model.trunk, same arguments and
    result (compiled_trunk: a speed path; the prefill always runs model.trunk)."""
    prompts = as_prompt_lists(prompts)
    nl, k = model.n_moe_layers, model.config.top_k
    if not anything_to_generate(prompts, past, max_new_tokens):
        return [{"tokens": [], "logprobs": [], **({"routes": torch.zeros(nl, 0, k, dtype=torch.long)}
                                                   if return_routes else {})} for _ in prompts]
    b = prefill(model, prompts, past, max_new_tokens, model.config.n_layer)
    cache, rows, L, U = b.cache, b.rows, b.L, len(b.lens)
    logits = model.lm_head(b.h[:, -1]).float()
    cache.select(rows)
    logits, valid, pos = logits[rows], b.valid[rows], (b.n_past + b.lens)[rows]
    padded = not bool(b.valid.all())
    # Outputs by original row: token t of row b in column t; routes of the token in cache column c
    # (left-padded prompt, then generated tokens) in column c - A. Rows that finished but were not
    # yet retired keep writing junk past their end; n_out cuts it off.
    B, dev = len(prompts), logits.device
    every = DONE_EVERY if sync_free(dev) else 1     # read the finished rows every `every` tokens
    # A CPU generator for a GPU model would copy each draw in: replaced by one on the device, seeded
    # from it. Compared by type: torch.Generator("cuda") reports device "cuda", the logits "cuda:0".
    if generator is not None and generator.device.type != dev.type:
        generator = torch.Generator(dev).manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator)))
    tokens = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
    logprobs = torch.zeros(B, max_new_tokens, device=dev)
    n_out = torch.full((B,), max_new_tokens, device=dev)
    routes = torch.zeros(nl, B, L + max_new_tokens - 1, k, dtype=torch.long, device=dev) if return_routes else None
    if return_routes and nl:
        routes[:, :, :L] = torch.stack([c.view(U, L, k) for c in b.chosen])[:, rows]
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
    alive = torch.arange(B, device=dev)                 # original row id of each batch row
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    pasts = [None] * B
    def keep_past(j):   # row j of the batch: its past + prompt + tokens[:-1] (not the junk after its end)
        r = int(alive[j])
        n = int(b.n_past[b.which[r]]) + len(prompts[r]) + int(n_out[r]) - 1
        pasts[r] = cache.take(j, valid[j, :cache.pos].nonzero().squeeze(1)[:n])
    trunk = trunk or model.trunk
    for t in range(max_new_tokens):
        tok, lp = sample(logits, temperature, top_k, top_p, generator)
        tokens[alive, t], logprobs[alive, t] = tok, lp
        hit = (tok[:, None] == stop).any(-1) & ~done
        n_out[alive] = torch.where(hit, t + 1, n_out[alive])
        done |= hit
        if t == max_new_tokens - 1:
            break
        n_done = int(done.sum()) if (t + 1) % every == 0 else 0
        if n_done == len(alive):
            break
        if n_done and 8 * n_done >= len(alive):   # retire finished rows
            tok, valid, pos, alive, done = retire(done, cache, keep_past if return_past else None,
                                                  tok, valid, pos, alive, done)
        mask = valid[:, None, None, :cache.pos + 1] if padded else None
        h, chosen = trunk(tok[:, None], pos[:, None], cache, mask)
        cache.pos += 1
        logits = model.lm_head(h[:, -1]).float()
        pos += 1
        if return_routes and nl:
            routes[:, alive, L + t] = torch.stack([c.view(len(alive), k) for c in chosen])
    if return_past:
        for j in range(len(alive)):
            keep_past(j)
    return outputs(tokens, logprobs, n_out, pasts if return_past else None, routes, prompts, L)


def outputs(tokens, logprobs, n_out, pasts, routes, prompts, L):
    """generate's per-prompt dicts from its (rows, steps) buffers, each cut at its n_out."""
    out = [{"tokens": tk[:n], "logprobs": lq[:n]}
           for tk, lq, n in zip(tokens.tolist(), logprobs.tolist(), n_out.tolist())]
    if routes is not None:
        routes = routes.cpu()
        for b, o in enumerate(out):   # the prompt's own columns (its left pads excluded) + tokens[:-1]
            o["routes"] = routes[:, b, L - len(prompts[b]):L + len(o["tokens"]) - 1]
    if pasts is not None:
        for o, p in zip(out, pasts):
            o["past"] = p
    return out


def distribution(logits, temperature, top_k=0, top_p=1.0):
    """logits (B, V) fp32, T > 0 -> (log softmax(logits / T), the distribution to sample: its probs
    after top-k and top-p filtering)."""
    logp = (logits / temperature).log_softmax(-1)
    filt = logp
    if top_k and top_k < logp.size(-1):
        kth = filt.topk(top_k, dim=-1).values[:, -1:]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if top_p < 1.0:   # nucleus (Holtzman et al. 2020): smallest set of tokens with mass >= top_p
        sp, si = filt.sort(-1, descending=True)
        p = sp.softmax(-1)
        drop = p.cumsum(-1) - p >= top_p                  # mass before this token already >= top_p
        filt = filt.scatter(-1, si, sp.masked_fill(drop, float("-inf")))
    return logp, logp.exp() if filt is logp else filt.softmax(-1)


def draw(probs, generator=None):
    """One token per row of probs (B, V), which need not sum to 1. Inverse-CDF sampling: one uniform
    per row and a binary search (right=True never lands on a zero-probability token).
    torch.multinomial draws V exponentials per row: it was the single biggest cost of CPU generation."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.size(0), 1, generator=generator, device=generator.device if generator else probs.device)
    tok = torch.searchsorted(cdf, u.to(probs.device) * cdf[:, -1:], right=True).squeeze(-1)
    over = tok >= probs.size(-1)     # float rounding at the very top of the cdf: rare
    if sync_free(probs.device) or over.any():   # (the argmax costs more than the check on CPU)
        tok = torch.where(over, probs.argmax(-1), tok)
    return tok


def sample(logits, temperature, top_k, top_p, generator=None):
    """logits (B, V) fp32 -> (token, logprob of that token under softmax(logits / T), pre-filtering)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
    logp, probs = distribution(logits, temperature, top_k, top_p)
    tok = draw(probs, generator)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Speculative sampling, the MTP modules drafting

@torch.no_grad()
def generate_speculative(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
                         generator=None, past=None, return_past=False, stats=None) -> list[dict]:
    """generate's samples, several tokens per trunk forward: speculative sampling (Leviathan et al.
    2023; Chen et al. 2023) with the model's n_mtp MTP modules (DeepSeek-V3) as the drafter. Each
    step, the MTP levels draft n_mtp tokens (draft), one trunk forward scores the last token and every
    draft, and accept keeps each draft with probability min(1, p(d) / q(d)), p the model's
    distribution and q the drafter's, resampling the first rejected one from max(0, p - q): every
    token has exactly generate's distribution, softmax(logits / T) after top-k / top-p, whatever the
    drafter proposes; at T = 0, generate's tokens. All rows move by the same count per step (see
    accept), so the batch keeps generate's left-padded layout and one cache pointer; a rejection is
    rolled back by setting that pointer after the accepted tokens (the rejected columns are written
    again by the next step). Same prompts, stop ids, pasts (whose keys/values include the MTP layers'),
    retiring of finished rows and outputs as generate, without routes. stats: a list that receives
    this call's counts (see count; bench.py reports them), one append, so threads may share it."""
    prompts = as_prompt_lists(prompts)
    D = model.config.n_mtp
    if not D:
        raise ValueError("generate_speculative: the model has no MTP modules (n_mtp = 0)")
    if not anything_to_generate(prompts, past, max_new_tokens):
        return [{"tokens": [], "logprobs": []} for _ in prompts]
    # room after the prompt: the new tokens, then a step's drafts and the MTP levels' look-ahead
    b = prefill(model, prompts, past, max_new_tokens + 2 * D + 1, model.config.n_layer + D)
    cache, rows, A, L, B = b.cache, b.rows, b.A, b.L, len(prompts)
    logits = model.lm_head(b.h[:, -1]).float()[rows]
    cache.select(rows)
    valid, pos = b.valid[rows], (b.n_past + b.lens)[rows]
    dev, ahead = pos.device, torch.arange(2 * D + 1, device=pos.device)
    new, lp = (x[:, None] for x in sample(logits, temperature, top_k, top_p, generator))
    # the MTP levels read the prompt and the first token; pads read as zeros (training's "before the start")
    real = valid[:, A:A + L + D]
    h = b.h[rows].masked_fill(~real[:, :L, None], 0)
    drafts, q, carry = draft(model, cache, A, [h.new_zeros(B, 1, h.size(-1))] * D, h, torch.cat([b.idx[rows], new], 1),
                             torch.cat([b.pos[rows], pos[:, None] + ahead[:D]], 1), valid, temperature, top_k, top_p,
                             generator, real)
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
    def keep_past(j):   # as in generate
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
            keep = ~done
            new, drafts, valid, pos, alive, done, *carry = retire(done, cache, keep_past if return_past else None,
                                                                  new, drafts, valid, pos, alive, done, *carry)
            q = q[keep.nonzero().squeeze(1)] if q is not None else None
        # one trunk forward checks the drafts: the last token, then the drafts, from the pointer on
        at, x = cache.pos, torch.cat([new[:, -1:], drafts], 1)
        h, _ = model.trunk(x, pos[:, None] + ahead[:D + 1], cache, attention_mask(valid, at, D + 1))
        new, lp, run = accept(model.lm_head(h).float(), drafts, q, temperature, top_k, top_p, generator, ~done)
        s = new.size(1)
        if counts is not None:
            count(counts, D, s, run[~done])
        drafts, q, carry = draft(model, cache, at, carry, h[:, :s], torch.cat([x[:, :1], new], 1),
                                 pos[:, None] + ahead[:s + D], valid, temperature, top_k, top_p, generator)
        cache.pos, pos = at + s, pos + s   # the rollback: columns of rejected drafts are written again
    if return_past:
        for j in range(len(alive)):
            keep_past(j)
    if stats is not None:
        stats.append(counts)
    return outputs(tokens, logprobs, n_out, pasts if return_past else None, None, prompts, L)


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
    mask = attention_mask(valid, at, s + D)
    prev, toks, carry_out, drafts, qs = torch.cat([carry[0], h], 1), tokens, [h[:, -1:]], [], []
    for m, mod in enumerate(model.mtp):
        n = s + 1 + m
        cache.pos = at
        out = mod(prev, model.wte(toks), cos[:, :, :n], sin[:, :, :n], cache, mask[:, :, :n, :at + n])
        if real is not None:
            out = out.masked_fill(~real[:, :n, None], 0)
        logits = model.lm_head(mod.norm(out[:, -1])).float()
        q = None if temperature == 0 else distribution(logits, temperature, top_k, top_p)[1]
        drafts.append(logits.argmax(-1) if q is None else draw(q, generator))
        qs.append(q)
        if m + 1 < D:
            carry_out.append(out[:, s - 1:s])
            prev, toks = torch.cat([carry[m + 1], out], 1), torch.cat([toks, drafts[-1][:, None]], 1)
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
        logp, p = (x.view(B, T, V) for x in distribution(logits.view(B * T, V), temperature, top_k, top_p))
        u = torch.rand(B, T - 1, generator=generator, device=generator.device if generator else logits.device)
        pick = drafts[..., None]
        kept = u.to(logits.device) < keep_probability(p[:, :-1].gather(-1, pick)[..., 0], q.gather(-1, pick)[..., 0])
    run = kept.int().cumprod(1).sum(1)
    a = int(run[live].min())
    if temperature == 0:
        fix = best[:, a]
    else:
        fix = draw(p[:, a] if a == T - 1 else (p[:, a] - q[:, a]).clamp_min(0), generator)
    last = torch.where(run > a, drafts[:, a], fix) if a < T - 1 else fix
    toks = torch.cat([drafts[:, :a], last[:, None]], 1)
    return toks, logp[:, :a + 1].gather(-1, toks[..., None])[..., 0], run


def keep_probability(p, q):
    """The chance of keeping a draft that the drafter proposed with probability q and the model gives
    probability p: min(1, p / q) (q > 0: the draft was drawn from it)."""
    return (p / q).clamp(max=1.0)


def count(counts, D, advanced, run=None):
    """Adds one trunk forward to a call's counts (None: new counts): forwards, the tokens they moved the rows by
    (advanced), and per draft position j the live rows whose drafts before j were all kept (reached)
    and those that kept draft j too (kept; kept / reached is the acceptance at position j)."""
    counts = counts if counts is not None else {"forwards": 0, "advanced": 0, "reached": [0] * D, "kept": [0] * D}
    counts["forwards"] += 1
    counts["advanced"] += advanced
    if run is not None:
        for j in range(D):
            counts["reached"][j] += int((run >= j).sum())
            counts["kept"][j] += int((run > j).sum())
    return counts


# ----------------------------------------------------------------------------------------------
# Speed paths: threads, streams, a compiled decode step

@contextmanager
def cpu_threads(n):
    """Run the block with n torch threads (0: unchanged; the setting is process-wide). A decode step
    is a few hundred small ops; with idle OpenMP threads asleep (OMP_WAIT_POLICY=PASSIVE, set by
    the scripts so that they leave the cores to the sandbox workers) waking a second thread for
    each op costs more than it gives, so decode runs on one thread, and generate_streams puts the
    second core to work on a second batch instead."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compiled_trunk(model):
    """model.trunk under torch.compile (CPU inductor, dynamic shapes: the rows shrink as they retire
    and the cache grows by a column a step), for generate's `trunk`. A CPU decode step is a few
    hundred small ops whose dispatch costs more than their arithmetic; the compiler fuses them into a
    few dozen kernels, and the MoE layers run every expert densely (MoE.experts_dense) instead of
    sorting tokens. The unbound GPT.trunk is compiled once, with the model as an argument: the
    weights are graph inputs (an optimizer step needs no recompile) and nothing cached refers to a
    model (a compiled bound method would keep its model alive). Where compiling fails (e.g. no C++
    compiler) it warns once and every later call, of any model, runs the eager trunk."""
    if "trunk" not in _COMPILED:
        _COMPILED["trunk"] = torch.compile(GPT.trunk, dynamic=True)

    def trunk(idx, pos, cache=None, mask=None):
        if _COMPILED["trunk"]:
            try:
                return _COMPILED["trunk"](model, idx, pos, cache, mask)
            except Exception as e:
                # The failed call wrote at most this step's cache column, which the eager call writes
                # again (generate moves cache.pos after the call).
                warnings.warn(f"--compile-decode: torch.compile failed, decoding eagerly ({type(e).__name__}: {e})"[:300])
                _COMPILED["trunk"] = False
        return model.trunk(idx, pos, cache, mask)
    return trunk


def generate_streams(model, prompts, max_new_tokens, streams=None, generator=None, past=None, **kw):
    """generate over `streams` Python threads (default STREAMS on CPU, 1 on GPU), each on a
    contiguous share of the rows with a random stream of its own and THREADS torch threads. A CPU
    decode step is a few hundred small ops: too small to split across OpenMP threads (a thread woken
    for each op costs more than it gives), but each op releases the GIL, so two independent batches
    decode side by side (bench.py generation). Rows of one prompt stay in one share (its prefill is
    shared). The samples depend on the number of streams, as they depend on the batch; each row's
    distribution does not. Same arguments and outputs as generate. One stream (plain generate
    with the caller's generator) on GPU and under 16 rows per stream. With SPECULATIVE set and a model
    with MTP modules, each share runs generate_speculative instead (unless routes are asked for).
    On GPU under bf16 autocast (common.autocast; model.py keeps the router in fp32), as training runs."""
    prompts = as_prompt_lists(prompts)
    n, cpu = len(prompts), next(model.parameters()).device.type == "cpu"
    fn = generate
    if SPECULATIVE and model.config.n_mtp and not kw.get("return_routes"):
        fn, kw = generate_speculative, {k: v for k, v in kw.items() if k not in ("trunk", "return_routes")}
    else:
        kw.setdefault("trunk", compiled_trunk(model) if COMPILE else None)
    streams = max(1, min(STREAMS if streams is None else streams, n // 16))
    if not cpu or THREADS != 1:
        streams = 1   # a GPU: one batch fills it; THREADS other than 1: the streams would oversubscribe the cores
    starts = [0] + [b for b in range(1, n) if past is not None or prompts[b] != prompts[b - 1]]
    # shares start at a prompt's first row (any row, with pasts), the one nearest to i * n / streams
    bounds = sorted({min(starts, key=lambda b: abs(b - i * n // streams)) for i in range(streams)}) + [n]
    if len(bounds) <= 2 or max_new_tokens <= 0:
        with cpu_threads(THREADS if cpu else 0), common.autocast(next(model.parameters()).device):
            return fn(model, prompts, max_new_tokens, generator=generator, past=past, **kw)
    seeds = torch.randint(0, 2 ** 62, (len(bounds) - 1,), generator=generator).tolist()

    def share(i):   # several streams on CPU only, where common.autocast is a no-op
        a, b = bounds[i], bounds[i + 1]
        g = torch.Generator().manual_seed(seeds[i])
        return fn(model, prompts[a:b], max_new_tokens, generator=g, past=past[a:b] if past else None, **kw)
    with cpu_threads(1), ThreadPoolExecutor(len(bounds) - 1) as pool:
        return [o for part in pool.map(share, range(len(bounds) - 1)) for o in part]


# ----------------------------------------------------------------------------------------------
# Samples and episodes: what RL, eval and the interactive command draw

def sample_completions(model, tok, tasks, n, temperature, max_new_tokens, top_p=1.0, batch_size=64,
                       return_routes=False, generator=None, top_k=0, progress=False, on_batch=None, prompts=None):
    """n samples per task, rows ordered task by task (the n samples of task i are contiguous, the
    group RL needs). Returns len(tasks)*n dicts: task_idx, prompt_ids (what the model was
    conditioned on), tokens (generated, incl. the end-of-text token if hit), logprobs, text
    (decoded, without end-of-text), completion (text cut by env.extract_completion: what runs),
    stopped (ended on end-of-text, not on max_new_tokens), prompt_truncated (encode_prompts), and
    routes when requested.
    on_batch(list_of_dicts) is called after every generated batch (eval starts sandboxing it).
    prompts: token ids per task to continue instead of its rendered prompt (a repair's context)."""
    if prompts is None:
        prompts, truncated = encode_prompts(model, tok, tasks, max_new_tokens)
    elif len(prompts) != len(tasks):
        raise ValueError(f"{len(prompts)} prompts for {len(tasks)} tasks")
    else:
        truncated = [False] * len(prompts)
    rows = [i for i in range(len(tasks)) for _ in range(n)]
    out, was_training = [], model.training
    model.eval()
    try:
        for s in tqdm(range(0, len(rows), batch_size), desc="sampling", disable=not progress,
                      leave=False):
            idx = rows[s:s + batch_size]
            gens = generate_streams(model, [prompts[i] for i in idx], max_new_tokens,       # autocast inside
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    stop_ids=[tok.eot_id], generator=generator, return_routes=return_routes)
            batch = [as_sample(tok, g, i, prompts[i], truncated[i]) for i, g in zip(idx, gens)]
            if on_batch is not None:
                on_batch(batch)
            out += batch
    finally:
        model.train(was_training)
    return out


def run_episodes(model, tok, tasks, n, turns, pool, temperature, max_new_tokens, top_p=1.0, top_k=0,
                 batch_size=64, generator=None, return_routes=False, fractional=False, progress=False):
    """n episodes per task of up to `turns` attempts, rows task by task (the n episodes of task i
    are contiguous, the group RL needs), batch_size rows at a time through all their turns.

    An episode ends when its attempt passes the visible examples, when the turn budget is spent,
    when the task has no visible examples, or when another turn would not fit the context. Each
    further turn continues the row's KV cache (generate's past): the feedback is appended,
    nothing is re-read. The hidden tests judge every attempt (for the self-repair curve); the
    reward is the verdict on the last one. Returns per episode {"task_idx", "turns": one sample per
    attempt (as_sample's dict, prompt_ids = the tokens fed that turn, plus "feedback": the
    text appended after it, "" for the last, and "visible_passed": the verdict of the docstring's
    examples, None where they were not run), "results": the hidden-test Result of each attempt,
    "result": the last one, or the sandbox_error of a visible-example run that failed}."""
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
                gens = generate_streams(model, [feeds[j] for j in live], max_new_tokens,   # autocast inside
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
