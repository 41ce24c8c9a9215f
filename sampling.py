"""
Generation: everything that samples from the model (model.py is the architecture alone).

    outs = sampling.generate(model, prompts, max_new_tokens=96, temperature=1.0, stop_ids=[eot])

The reading path is `reference`: a KV cache, batched prompts, stop tokens, log-probs and routes (for
router replay), pasts for multi-turn episodes; and its parts KVCache, prefill, sample. The speed paths
live beside it, each tested equal to it (tests/test_generate.py), and are chosen in one place,
`generate`, which everything that samples calls (env.run_episodes, eval.py, agent.py, pretraining's
samples): finished rows retired from the batch (`retiring`), sync-free decoding on a GPU, two decode
streams on a CPU, a fused decode step (`fused_step`, on a CPU), and speculative decoding with the MTP
modules (speculative.py, where SPECULATIVE is set). Episodes have a speed path of their own, continuous
batching (`Rows`, a cache whose rows have lengths of their own; env.episodes_continuous), chosen by
`continuous`; in both episode loops each row draws from a random stream of its own (`Streams`).
Measured in lab/bench.py (generation, step, speculative, episodes); the figures are in
docs/benchmarks.md and docs/speculative.md.
"""
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from model import autocast

# The dtype of recorded routes (expert ids): one byte a route; model.GPTConfig refuses more experts.
ROUTE_DTYPE = torch.uint8


# ----------------------------------------------------------------------------------------------
# The reference

@torch.no_grad()
def reference(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
              generator=None, return_routes=False, past=None, return_past=False) -> list[dict]:
    """Sample a continuation of every prompt, all rows in one batch, with a KV cache. prompts: lists
    of token ids of any lengths, or a (B, T) integer tensor (as nanoGPT's generate takes).

    One prefill reads the left-padded prompts (identical prompts once); then each step samples one
    token per row, feeds it, and every row writes the same cache column. A row is done at a stop id
    or after max_new_tokens; a done row decodes on until all are (its extra tokens are cut off).
    past (one per prompt, an earlier call's return_past): the row continues from those keys/values,
    and only the new tokens are read: a multi-turn episode never re-reads its history.

    Returns per prompt {"tokens", "logprobs"[, "routes"][, "past"]}: logprobs under softmax(logits / T)
    before top-k / top-p (T = 0: greedy); routes (n_moe_layers, fed, top_k): the experts of every
    token this call fed (prompt + tokens[:-1]), for router replay; past: those tokens' keys/values
    after the row's own past."""
    prompts = as_prompt_lists(prompts)
    nl, k = model.n_moe_layers, model.config.top_k
    if not anything_to_generate(prompts, past, max_new_tokens):
        return [{"tokens": [], "logprobs": [], **({"routes": torch.zeros(nl, 0, k, dtype=ROUTE_DTYPE)}
                                                   if return_routes else {})} for _ in prompts]
    b = prefill(model, prompts, past, max_new_tokens, model.config.n_layer)
    cache, B, padded = b.cache, len(prompts), not bool(b.valid.all())
    cache.select(b.rows)                        # one cache row per prompt (duplicates fanned out)
    valid, pos = b.valid[b.rows], (b.n_past + b.lens)[b.rows]
    logits = model.lm_head(b.h[:, -1]).float()[b.rows]
    routes = [torch.stack([c.view(len(b.lens), b.L, k) for c in b.chosen])[:, b.rows]] if nl else []
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=logits.device)
    n_out = torch.full((B,), max_new_tokens, device=logits.device)      # each row's length
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        token, lp = sample(logits, temperature, top_k, top_p, generator)
        tokens.append(token)
        logprobs.append(lp)
        hit = torch.isin(token, stop) & ~done
        n_out, done = torch.where(hit, t + 1, n_out), done | hit
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        mask = valid[:, None, None, :cache.pos + 1] if padded else None     # left pads are never seen
        h, chosen = model.trunk(token[:, None], pos[:, None], cache, mask)
        cache.pos, pos = cache.pos + 1, pos + 1
        logits = model.lm_head(h[:, -1]).float()
        routes += [torch.stack([c.view(B, 1, k) for c in chosen])] if nl else []
    pasts = [cache.take(r, valid[r, :cache.pos].nonzero().squeeze(1)[:int(b.n_past[b.which[r]])
                                                                      + len(p) + n - 1])
             for r, (p, n) in enumerate(zip(prompts, n_out.tolist()))] if return_past else None
    if return_routes:
        routes = torch.cat(routes, 2) if nl else torch.zeros(0, B, b.L + len(tokens) - 1, k, dtype=torch.long)
    return outputs(torch.stack(tokens, 1), torch.stack(logprobs, 1), n_out, pasts,
                   routes if return_routes else None, prompts, b.L)


def outputs(tokens, logprobs, n_out, pasts, routes, prompts, L):
    """generate's per-prompt dicts from its (rows, steps) tensors, each row cut at its n_out. Each
    row's routes are a compact tensor of their own (route_dtype), never a view of the call's: a
    view pickles its whole storage (RL's queue of groups travels between ranks by pickle)."""
    out = [{"tokens": tk[:n], "logprobs": lq[:n]}
           for tk, lq, n in zip(tokens.tolist(), logprobs.tolist(), n_out.tolist())]
    if routes is not None:
        routes = routes.to("cpu", ROUTE_DTYPE)
        for b, o in enumerate(out):   # the prompt's own columns (its left pads excluded) + tokens[:-1]
            o["routes"] = routes[:, b, L - len(prompts[b]):L + len(o["tokens"]) - 1].clone()
    if pasts is not None:
        for o, p in zip(out, pasts):
            o["past"] = p
    return out


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
                self.k[i][b, :, end - p.size(3):end], self.v[i][b, :, end - p.size(3):end] = p[i, 0], p[i, 1]
        self.pos = end

    def take(self, row, cols):   # one row's keys/values at the given columns, for fill()
        return torch.stack([torch.stack([k[row][:, cols], v[row][:, cols]])
                            for k, v in zip(self.k, self.v)])


def as_prompt_lists(prompts):
    """generate()'s prompts -> a list of lists of ints: accepts lists/tuples of ids (or 1-D tensors),
    or a (B, T) integer tensor."""
    if torch.is_tensor(prompts):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise ValueError(f"generate: prompts must be a (B, T) integer tensor or a list of token-id "
                             f"lists, got a {prompts.dtype} tensor of shape {tuple(prompts.shape)}")
        return prompts.tolist()
    try:
        return [p.tolist() if torch.is_tensor(p) else [int(t) for t in p] for p in prompts]
    except (TypeError, ValueError):
        raise ValueError("generate: prompts must be a (B, T) integer tensor "
                         "or a list of token-id lists") from None


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
    if A:
        cache.fill([past[first[w]].to(dev) for w in range(len(uniq))], A)
    # causal AND key is a real token; a pad query attends to itself (no empty rows -> no NaN)
    mask = attention_mask(valid, A, L) if not bool(valid.all()) or A else None
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


def draw(probs, generator=None, no_sync=False):
    """One token per row of probs (B, V), which need not sum to 1. Inverse-CDF sampling: one uniform
    per row and a binary search (right=True never lands on a zero-probability token).
    torch.multinomial draws V exponentials per row: it was the single biggest cost of CPU generation."""
    cdf = probs.cumsum(-1)
    if isinstance(generator, Streams):      # a random stream per row (the episode loops)
        u = generator.uniform()
    else:
        u = torch.rand(probs.size(0), 1, generator=generator,
                       device=generator.device if generator else probs.device)
    token = torch.searchsorted(cdf, u.to(probs.device) * cdf[:, -1:], right=True).squeeze(-1)
    over = token >= probs.size(-1)     # float rounding at the very top of the cdf: rare
    if no_sync or over.any():   # no_sync: no host read (a GPU speed path); on CPU the check is cheaper
        token = torch.where(over, probs.argmax(-1), token)
    return token


def sample(logits, temperature, top_k, top_p, generator=None, no_sync=False):
    """logits (B, V) fp32 -> (token, logprob of that token under softmax(logits / T), pre-filtering).
    no_sync: never read the device from the host (sync-free decoding)."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    logp, probs = distribution(logits, temperature, top_k, top_p)
    token = draw(probs, generator, no_sync)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class Streams:
    """A random stream per row, where a torch.Generator is one stream for the batch: row r's u-th number
    is SplitMix64's (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number generators"): a
    hash of seeds[r] + u * gamma, computed for all rows at once. A row's draws then depend on neither
    the rows beside it nor the tokens it drew past its end: the episode loops (env.py) give each row
    its stream, continued turn after turn (drawn: the tokens it kept), and the turn-by-turn loop and
    the continuous one sample the same tokens (tests/test_episodes.py). draw() takes one wherever it
    takes a generator; a Streams indexed by rows is theirs (retiring's retired rows, a decode
    stream's share). seeds, drawn: ints or (rows,) int64 tensors, which draw() moves on by one."""
    GAMMA, M1, M2 = -0x61C8864680B583EB, -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15   # as int64

    def __init__(self, seeds, drawn=None):
        self.seeds = torch.as_tensor(seeds, dtype=torch.long)
        drawn = torch.zeros_like(self.seeds) if drawn is None else torch.as_tensor(drawn, dtype=torch.long)
        self.drawn = drawn.to(self.seeds.device, copy=True)
        self.device = self.seeds.device

    def __getitem__(self, rows):
        return Streams(self.seeds[rows], self.drawn[rows])

    def to(self, device):
        return Streams(self.seeds.to(device), self.drawn.to(device))

    def uniform(self):
        """(rows, 1) float32 uniforms in [0, 1), 24 bits each: every row's next number. int64 products
        wrap as uint64's do; >> is arithmetic, so each shift masks its sign bits off."""
        self.drawn += 1
        z = self.seeds + self.drawn * self.GAMMA
        z = (z ^ ((z >> 30) & (1 << 34) - 1)) * self.M1
        z = (z ^ ((z >> 27) & (1 << 37) - 1)) * self.M2
        z = z ^ ((z >> 31) & (1 << 33) - 1)
        return (((z >> 40) & (1 << 24) - 1).float() / (1 << 24))[:, None]


def row_seeds(n, generator=None):
    """n seeds for Streams, drawn from generator (None: torch's global one), as ints."""
    device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2 ** 62, (n,), generator=generator, device=device).tolist()


# Settings of the speed paths, process-wide (like MoE.dispatch: they change speed, and float rounding
# only: log-probs move by ~1e-6 when the thread count splits reductions differently).
THREADS = 1      # torch threads per decode stream on CPU (0: leave torch's setting); see cpu_threads
STREAMS = 2      # decode streams (Python threads) on CPU: this machine's 2 cores
# Decode steps through fused_step on a CPU (decoder); False: the reference's trunk and LM head.
FUSED = True
# A fused decode step of up to DENSE_ROWS rows runs every expert, one matmul each way (fused_step).
DENSE_ROWS = 8
# SPECULATIVE: the drafting sampler generate uses where the model has MTP modules (agent.py sets it to
# speculative.generate; None: off). Calls that want routes still take retiring: the drafts' routes
# are not recorded.
SPECULATIVE = None
# Host reads in the decode loop. On a GPU every read of a device value (.item(), bool(.any()), a
# shape that depends on data) waits for the queued kernels, so a loop that reads once per token runs
# at the speed of its round trips, not of the GPU. SYNC_FREE decodes without them: finished rows
# are a device mask that retiring reads every DONE_EVERY tokens (to stop, or to retire
# rows), sampling never asks the host, and the MoE sizes its expert groups on the device
# (model.MoE.experts). None: on GPU only. On CPU a read is free and retiring finished rows at once
# saves compute, so CPU decoding reads every token, as it always did (same samples: the rows a step
# draws for depend on retiring).
SYNC_FREE = None
DONE_EVERY = 16
# EPISODES: how env.run_episodes runs its episodes. "continuous": env.episodes_continuous, continuous
# batching over Rows (each row on its own: one whose action ended is fed its observation while the
# others decode, a finished episode's place goes to the round's next); "turns": the reference, turn by
# turn, every row waiting for the turn's longest action and for every observation. The two sample the
# same tokens (row streams, Streams; tests/test_episodes.py). The choice: continuous().
EPISODES = "continuous"


def sync_free(device):
    return device.type != "cpu" if SYNC_FREE is None else SYNC_FREE


# ----------------------------------------------------------------------------------------------
# The one place a path is chosen

def generate(model, prompts, max_new_tokens, streams=None, generator=None, past=None, **kw):
    """reference's samples, by the fastest path this machine has: the one place a speed path
    is chosen, and what everything that samples calls (RL rollouts, eval, the episodes, agent.py,
    pretraining's samples). Same arguments and outputs as reference.

    retiring over `streams` Python threads (default STREAMS on CPU, 1 on GPU), each on a
    contiguous share of the rows with a random stream of its own and THREADS torch threads. A CPU
    decode step is a few hundred small ops: too small to split across OpenMP threads (a thread woken
    for each op costs more than it gives), but each op releases the GIL, so two independent batches
    decode side by side (lab/bench.py generation). Rows of one prompt stay in one share (its prefill is
    shared). The samples depend on the number of streams, as they depend on the batch; each row's
    distribution does not (and with a Streams generator, each row's samples do not either: a share
    takes its rows' streams). One stream (retiring with the caller's generator) on GPU and
    under 16 rows per stream. With SPECULATIVE set and a model with MTP modules, each share runs
    it instead (unless routes are asked for). On GPU under bf16 autocast
    (model.autocast; model.py keeps the router in fp32), as training runs."""
    prompts = as_prompt_lists(prompts)
    n, cpu = len(prompts), next(model.parameters()).device.type == "cpu"
    fn = retiring
    if speculates(model, kw.get("return_routes")):
        fn, kw = SPECULATIVE, {k: v for k, v in kw.items() if k not in ("step", "return_routes")}
        if isinstance(generator, Streams):   # its draws are not per row: one generator, seeded from them
            seed = int(generator.seeds.sum() + generator.drawn.sum()) % 2 ** 62
            generator = torch.Generator().manual_seed(seed)
    else:
        kw.setdefault("step", decoder(model))      # its weights prepared once, for every share
    streams = n_streams(model, n, streams)
    starts = [0] + [b for b in range(1, n) if past is not None or prompts[b] != prompts[b - 1]]
    # shares start at a prompt's first row (any row, with pasts), the one nearest to i * n / streams
    bounds = sorted({min(starts, key=lambda b: abs(b - i * n // streams)) for i in range(streams)}) + [n]
    if len(bounds) <= 2 or max_new_tokens <= 0:
        with cpu_threads(THREADS if cpu else 0), autocast(next(model.parameters()).device):
            return fn(model, prompts, max_new_tokens, generator=generator, past=past, **kw)
    rows = isinstance(generator, Streams)      # a stream per row: each share takes its rows' streams
    seeds = None if rows else torch.randint(0, 2 ** 62, (len(bounds) - 1,), generator=generator).tolist()

    def share(i):   # several streams on CPU only, where autocast is a no-op
        a, b = bounds[i], bounds[i + 1]
        g = generator[a:b] if rows else torch.Generator().manual_seed(seeds[i])
        return fn(model, prompts[a:b], max_new_tokens, generator=g, past=past[a:b] if past else None, **kw)
    return [o for part in side_by_side(model, share, range(len(bounds) - 1)) for o in part]


def side_by_side(model, fn, shares):
    """[fn(share) for share in shares], the shares side by side in decode streams (threads of one torch
    thread each, as generate runs them); one share runs here, with THREADS torch threads on CPU."""
    if len(shares) == 1:
        with cpu_threads(THREADS if next(model.parameters()).device.type == "cpu" else 0):
            return [fn(shares[0])]
    with cpu_threads(1), ThreadPoolExecutor(len(shares)) as pool:
        return list(pool.map(fn, shares))


def continuous(model, return_routes, max_turns, rows, batch_size):
    """Does env.run_episodes take continuous batching (EPISODES), rather than its turn-by-turn loop?
    Not where generate would decode speculatively (the turn loop's speed path), nor for one-turn
    episodes whose rows fit one batch: every row starts at once, so no place is refilled, and the two
    loops decode the same steps (lab/bench.py generation)."""
    return (EPISODES == "continuous" and not speculates(model, return_routes)
            and (max_turns > 1 or rows > batch_size))


def speculates(model, return_routes):
    """Does generate take speculative decoding (SPECULATIVE set, MTP modules, no routes asked for)?"""
    return bool(SPECULATIVE and model.config.n_mtp and not return_routes)


def n_streams(model, n, streams=None):
    """How many decode streams n rows take: STREAMS (or `streams`) on CPU, with at least 16 rows each;
    one on a GPU (one batch fills it), and one where THREADS is not 1 (the streams would oversubscribe
    the cores)."""
    if next(model.parameters()).device.type != "cpu" or THREADS != 1:
        return 1
    return max(1, min(STREAMS if streams is None else streams, n // 16))


# ----------------------------------------------------------------------------------------------
# Retiring finished rows; sync-free on a GPU

def retire(done, cache, save_past, *rows):
    """Drop the finished rows from the batch and the cache, so they stop costing compute (in bulk, once
    enough are done, to amortise the copy): save_past(j) saves row j's keys/values first (multi-turn
    pasts; None: not kept). Returns each of `rows` (tensors, batch first) without the finished rows."""
    if save_past is not None:
        for j in done.nonzero().squeeze(1).tolist():
            save_past(j)
    unfinished = (~done).nonzero().squeeze(1)
    cache.select(unfinished)
    return [x[unfinished] for x in rows]


@torch.no_grad()
def retiring(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
                      generator=None, return_routes=False, past=None, return_past=False,
                      step=None) -> list[dict]:
    """reference's samples with the finished rows retired: the same arguments and outputs (and
    the same tokens until a row retires: tests/test_generate.py), plus step, the decode step
    (decoder(model) where None; the prefill always runs model.trunk).

    A finished row (stop id or max_new_tokens) is dropped from the batch and the cache, in bulk once
    >= 1/8 of the rows are done (to amortise the copy), so it stops costing compute; a multi-turn
    row keeps its past first. Per-step bookkeeping is a few tensor ops into preallocated (rows,
    max_new_tokens) buffers, with no Python loop over rows, so its cost does not grow with the
    batch. On GPU (SYNC_FREE) the loop never waits for the device: finished rows are a device mask
    read every DONE_EVERY tokens (stop, retire); rows done in between run on, their junk cut off."""
    prompts = as_prompt_lists(prompts)
    nl, k = model.n_moe_layers, model.config.top_k
    if not anything_to_generate(prompts, past, max_new_tokens):
        return [{"tokens": [], "logprobs": [], **({"routes": torch.zeros(nl, 0, k, dtype=ROUTE_DTYPE)}
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
    if isinstance(generator, Streams):
        generator = generator.to(dev)
    elif generator is not None and generator.device.type != dev.type:
        generator = torch.Generator(dev).manual_seed(int(torch.randint(2 ** 62, (1,), generator=generator)))
    tokens = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
    logprobs = torch.zeros(B, max_new_tokens, device=dev)
    n_out = torch.full((B,), max_new_tokens, device=dev)
    routes = (torch.zeros(nl, B, L + max_new_tokens - 1, k, dtype=torch.long, device=dev)
              if return_routes else None)
    if return_routes and nl:
        routes[:, :, :L] = torch.stack([c.view(U, L, k) for c in b.chosen])[:, rows]
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
    alive = torch.arange(B, device=dev)                 # original row id of each batch row
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    pasts = [None] * B
    def save_past(j):   # row j of the batch: its past + prompt + tokens[:-1] (not the junk after its end)
        r = int(alive[j])
        n = int(b.n_past[b.which[r]]) + len(prompts[r]) + int(n_out[r]) - 1
        pasts[r] = cache.take(j, valid[j, :cache.pos].nonzero().squeeze(1)[:n])
    step = step or decoder(model)
    for t in range(max_new_tokens):
        token, lp = sample(logits, temperature, top_k, top_p, generator, sync_free(dev))
        tokens[alive, t], logprobs[alive, t] = token, lp
        hit = (token[:, None] == stop).any(-1) & ~done
        n_out[alive] = torch.where(hit, t + 1, n_out[alive])
        done |= hit
        if t == max_new_tokens - 1:
            break
        n_done = int(done.sum()) if (t + 1) % every == 0 else 0
        if n_done == len(alive):
            break
        if n_done and 8 * n_done >= len(alive):   # retire finished rows
            generator = generator[~done] if isinstance(generator, Streams) else generator
            token, valid, pos, alive, done = retire(done, cache, save_past if return_past else None,
                                                    token, valid, pos, alive, done)
        mask = valid[:, None, None, :cache.pos + 1] if padded else None
        logits, chosen = step(token, pos, cache, mask)
        cache.pos += 1
        pos += 1
        if return_routes and nl:
            routes[:, alive, L + t] = torch.stack([c.view(len(alive), k) for c in chosen])
    if return_past:
        for j in range(len(alive)):
            save_past(j)
    return outputs(tokens, logprobs, n_out, pasts if return_past else None, routes, prompts, L)


# ----------------------------------------------------------------------------------------------
# Continuous batching: rows at lengths of their own (env.episodes_continuous keeps their episodes)

class RowCache:
    """Keys/values of rows that each have a length of their own (KVCache's rows share one): row r's
    context fills columns [0, lens[r]) with no pads, so a column is its token's RoPE position. Before a
    forward, at(rows, T) names the rows it feeds (None: all) and has each write T columns from its own
    length on; update() writes them and returns those rows' keys up to the longest; mask() is what
    each query sees (its row's columns up to its own). routes: the experts of each column's token
    (record; router replay), where asked for. Columns grow as the rows need them."""

    def __init__(self, n_layer, n_rows, device, routes=None, cols=256):
        self.k, self.v, self.cols = [None] * n_layer, [None] * n_layer, cols
        self.lens = torch.zeros(n_rows, dtype=torch.long, device=device)
        self.all = torch.arange(n_rows, device=device)
        self.routes = None if routes is None else torch.zeros(routes[0], n_rows, cols, routes[1],
                                                              dtype=ROUTE_DTYPE, device=device)

    def at(self, rows, T):
        """-> (R, T): the column of each fed token, which is its position."""
        self.rows = rows
        lens = self.lens if rows is None else self.lens[rows]
        self.where = lens[:, None] + torch.arange(T, device=lens.device)
        self.end = int(self.where[:, -1].max()) + 1
        if self.end > self.cols:
            self.grow(max(self.end, 2 * self.cols))
        return self.where

    def mask(self):
        return (torch.arange(self.end, device=self.where.device) <= self.where[:, :, None])[:, None]

    def update(self, i, k, v):
        if self.k[i] is None:
            B, H, _, D = k.shape
            self.k[i] = k.new_zeros(len(self.lens), H, self.cols, D)
            self.v[i] = v.new_zeros(len(self.lens), H, self.cols, D)
        r = (self.all if self.rows is None else self.rows)[:, None]
        self.k[i][r, :, self.where] = k.transpose(1, 2)
        self.v[i][r, :, self.where] = v.transpose(1, 2)
        if self.rows is None:
            return self.k[i][:, :, :self.end], self.v[i][:, :, :self.end]
        return self.k[i][self.rows, :, :self.end], self.v[i][self.rows, :, :self.end]

    def record(self, chosen):   # the fed tokens' experts, (R * T, top_k) per MoE layer, at their columns
        if self.routes is not None and chosen:
            R, T = self.where.shape
            r = (self.all if self.rows is None else self.rows)[:, None]
            self.routes[:, r, self.where] = torch.stack(chosen).view(len(chosen), R, T, -1).to(ROUTE_DTYPE)

    def grow(self, cols):
        more = lambda t, dim: None if t is None else torch.cat(                          # noqa: E731
            [t, t.new_zeros(*t.shape[:dim], cols - t.size(dim), *t.shape[dim + 1:])], dim)
        self.k, self.v = [more(t, 2) for t in self.k], [more(t, 2) for t in self.v]
        self.routes, self.cols = more(self.routes, 2), cols

    def copy(self, src, dst):   # rows dst become copies of rows src (identical contexts read once)
        n = int(self.lens[src].max())
        for t in self.k + self.v + ([] if self.routes is None else [self.routes.transpose(0, 1)]):
            if t is not None:
                t[dst, :, :n] = t[src, :, :n]
        self.lens[dst] = self.lens[src]

    def select(self, rows):     # keep these rows only (free places dropped)
        self.k = [t if t is None else t.index_select(0, rows) for t in self.k]
        self.v = [t if t is None else t.index_select(0, rows) for t in self.v]
        self.lens, self.all = self.lens[rows], self.all[:len(rows)]
        self.routes = None if self.routes is None else self.routes.index_select(1, rows)


def padded_runs(lens, overhead=32):
    """Rows sorted by the length of their feed -> runs of them, each read by one right-padded forward
    of (rows x its longest) token slots: the split with the fewest slots, a forward counting
    `overhead` slots more (its fixed cost: about 32 tokens' worth on CPU). Dynamic programming over
    where each run starts."""
    best, start = [0], [0]
    for i in range(1, len(lens) + 1):
        cost, j = min((best[j] + overhead + (i - j) * lens[i - 1], j) for j in range(i))
        best.append(cost)
        start.append(j)
    runs, i = [], len(lens)
    while i:
        runs.append(range(start[i], i))
        i = start[i]
    return runs[::-1]


class Rows:
    """Continuous batching (Orca, Yu et al. OSDI 2022): rows that each run on their own, the model's
    side of the episode loop's speed path (env.episodes_continuous keeps the episodes). A row is fed
    ids (feed: a prompt, an observation, a fresh context), then samples its turn a token a step until a
    stop id, its limit or max_new_tokens; step() returns the rows whose turn ended (reference's
    outputs, and context: the ids in the row's cache), and each then waits, its cache kept, to be fed
    again or to leave; the other rows go on meanwhile. A step: the queued feeds' prefill (those rows
    alone, right-padded; identical fresh contexts read once), a token for every row from its own
    random stream (Streams), then one decode forward of the rows that go on (a waiting or free place
    runs along, its junk written past its end and never read). Rows are named by the caller's ids; a
    new one takes a free place, and free places are dropped in bulk once 1/8 of them are free, as
    retiring drops finished rows. The host reads which rows ended every step (a GPU waits for it)."""

    def __init__(self, model, n_rows, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
                 return_routes=False):
        dev = next(model.parameters()).device
        self.model, self.dev, self.max_new, self.decode = model, dev, max_new_tokens, decoder(model)
        self.draw = (temperature, top_k, top_p)
        self.stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
        self.cache = RowCache(model.config.n_layer, n_rows, dev,
                              (model.n_moe_layers, model.config.top_k) if return_routes else None)
        self.ids, self.place, self.queued, self.start = [None] * n_rows, {}, {}, [0] * n_rows
        self.streams = Streams([0] * n_rows).to(dev)
        self.tokens = torch.zeros(n_rows, max_new_tokens, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(n_rows, max_new_tokens, device=dev)
        self.n = torch.zeros(n_rows, dtype=torch.long, device=dev)      # tokens of the row's turn so far
        self.limit = torch.full((n_rows,), max_new_tokens, device=dev)
        self.logits = torch.zeros(n_rows, model.config.vocab_size, device=dev)
        self.live = torch.zeros(n_rows, dtype=torch.bool, device=dev)

    def __len__(self):
        return len(self.place)

    def feed(self, i, ids, fresh=False, limit=None, seed=None):
        """Row i's next ids: on top of its cache, or (fresh) as a new context; its turn keeps at most
        `limit` tokens (None: max_new_tokens). seed: a new row, its stream's seed (its first feed)."""
        if not ids:
            raise ValueError("empty prompt")       # as generate says
        if seed is not None:
            if None not in self.ids:
                raise ValueError("Rows: no free place (at most n_rows rows at once)")
            p = self.place[i] = self.ids.index(None)
            self.ids[p], self.streams.seeds[p], self.streams.drawn[p], fresh = i, seed, 0, True
            self.live[p] = True
        p = self.place[i]
        self.queued[p] = (list(ids), fresh)
        self.limit[p] = min(limit or self.max_new, self.max_new)

    def leave(self, i):
        p = self.place.pop(i)
        self.ids[p], self.live[p], self.cache.lens[p] = None, False, 0

    @torch.no_grad()
    def step(self):
        """Prefill what is queued, draw a token for every row, feed those of the rows that go on. ->
        [(row id, {"tokens", "logprobs"[, "routes"], "context"})] for each row whose turn ended."""
        with autocast(self.dev):
            free = self.ids.count(None)
            if free and free >= len(self.ids) / 8:
                self.drop_free()
            if self.queued:
                self.prefill()
            if not self.place:
                return []
            token, lp = sample(self.logits, *self.draw, self.streams)
            at = self.n.clamp_max(self.max_new - 1)       # free places count on: kept in bounds
            self.tokens[self.cache.all, at], self.logprobs[self.cache.all, at] = token, lp
            self.n += 1
            end = torch.isin(token, self.stop) | (self.n >= self.limit)
            ended = [p for p in end.nonzero().squeeze(1).tolist() if self.ids[p] is not None]
            outs = self.outputs(ended)
            if len(ended) < len(self.place):
                where = self.cache.at(None, 1)
                self.logits, chosen = self.decode(token, where[:, 0], self.cache, self.cache.mask())
                self.cache.record(chosen)
                self.cache.lens += self.live & ~end
            return outs

    def prefill(self):
        """The queued feeds, each row's from its own length (0: fresh): rows of like lengths in one
        forward (padded_runs); a fresh feed identical to another's is read once and copied (a task's
        G rows share a prompt)."""
        places, first = sorted(self.queued), {}
        for p in places:
            ids, fresh = self.queued[p]
            self.cache.lens[p] = 0 if fresh else self.cache.lens[p]
            self.start[p] = int(self.cache.lens[p])
            first.setdefault(tuple(ids) if fresh else p, p)
        src = sorted(set(first.values()), key=lambda p: len(self.queued[p][0]))
        for run in padded_runs([len(self.queued[p][0]) for p in src]):
            feeds = [self.queued[src[r]][0] for r in run]
            idx = torch.zeros(len(feeds), len(feeds[-1]), dtype=torch.long, device=self.dev)   # right-padded
            for r, f in enumerate(feeds):
                idx[r, :len(f)] = torch.tensor(f, device=self.dev)
            rows = torch.tensor([src[r] for r in run], device=self.dev)
            where = self.cache.at(rows, idx.size(1))
            h, chosen = self.model.trunk(idx, where, self.cache, self.cache.mask())
            self.cache.record(chosen)
            n = torch.tensor([len(f) for f in feeds], device=self.dev)
            self.cache.lens[rows] += n
            self.logits[rows] = self.model.lm_head(h[torch.arange(len(feeds)), n - 1]).float()
        dups = [(first[tuple(self.queued[p][0])], p) for p in places if p not in src]
        if dups:
            s, d = (torch.tensor(x, device=self.dev) for x in zip(*dups))
            self.cache.copy(s, d)
            self.logits[d] = self.logits[s]
        self.n[torch.tensor(places, device=self.dev)] = 0
        self.queued = {}

    def outputs(self, ended):
        if not ended:
            return []
        rows = torch.tensor(ended, device=self.dev)
        n, lens = self.n[rows].tolist(), self.cache.lens[rows].tolist()
        tokens, logprobs = self.tokens[rows].tolist(), self.logprobs[rows].tolist()
        outs = []
        for r, p in enumerate(ended):
            o = {"tokens": tokens[r][:n[r]], "logprobs": logprobs[r][:n[r]], "context": lens[r]}
            if self.cache.routes is not None:   # the turn's fed ids and its tokens but the last
                o["routes"] = self.cache.routes[:, p, self.start[p]:lens[r]].to("cpu").clone()
            outs.append((self.ids[p], o))
        return outs

    def drop_free(self):
        keep = [p for p, i in enumerate(self.ids) if i is not None]
        rows = torch.tensor(keep, dtype=torch.long, device=self.dev)
        self.cache.select(rows)
        self.streams = self.streams[rows]
        self.tokens, self.logprobs, self.n, self.limit, self.logits, self.live = (
            x[rows] for x in (self.tokens, self.logprobs, self.n, self.limit, self.logits, self.live))
        self.ids, self.start = [self.ids[p] for p in keep], [self.start[p] for p in keep]
        self.queued = {keep.index(p): q for p, q in self.queued.items()}
        self.place = {i: p for p, i in enumerate(self.ids)}


# ----------------------------------------------------------------------------------------------
# Two decode streams, the fused decode step

@contextmanager
def cpu_threads(n):
    """Run the block with n torch threads (0: unchanged; the setting is process-wide). A decode step
    is a few hundred small ops; with idle OpenMP threads asleep (OMP_WAIT_POLICY=PASSIVE, set by
    the scripts so that they leave the cores to the sandbox workers) waking a second thread for
    each op costs more than it gives, so decode runs on one thread, and generate puts the
    second core to work on a second batch instead."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def decoder(model):
    """The decode step of retiring and Rows, chosen here: (tokens (B,), their positions (B,), cache,
    mask) -> (logits (B, V) fp32, the experts each MoE layer chose). fused_step for an fp32 model on
    a CPU (FUSED), else the reference's: the trunk, then the LM head."""
    if FUSED and model.lm_head.weight.device.type == "cpu" and model.lm_head.weight.dtype == torch.float32:
        return fused_step(model)

    def step(token, pos, cache, mask):
        h, chosen = model.trunk(token[:, None], pos[:, None], cache, mask)
        return model.lm_head(h[:, -1]).float(), chosen
    return step


@torch.no_grad()
def fused_step(model):
    """model.trunk and the LM head for one token a row, in fewer and larger ops (a step of a few rows
    costs its few hundred ops' dispatch more than their arithmetic): q's and k's norms and RoPE as one
    op each; residual adds inside their matmuls (addmm); a KV head's query heads as the query rows of
    one attention call; and at up to DENSE_ROWS rows all experts, the shared ones too, as one matmul
    each way weighed by the gates (zero off the top-k) instead of a sort, a gather and a matmul per
    expert. The side-by-side weights are copies made here, once per generate call, never a
    checkpoint's layout. The reference's results to float rounding (sums in another order): the
    same tokens and routes, log-probs within 1e-5 (tests/test_generate.py; docs/benchmarks.md)."""
    cfg = model.config
    H, Hk, D, Hx = cfg.n_head, cfg.n_kv_head, cfg.head_width, cfg.expert_hidden
    prep = []
    for blk in model.blocks:
        a, m, w = blk.attn, blk.mlp, {}
        if cfg.qk_norm == "head":
            w["qk"] = torch.cat([a.q_norm.weight.expand(H, D), a.k_norm.weight.expand(Hk, D)])
        if blk.is_moe:   # (width, experts x [gate | up]) and (experts x hidden, width); shared: gate 1
            up, down = [m.w1.permute(1, 0, 2).flatten(1)], [m.w2.flatten(0, 1)]
            if m.shared is not None:
                up.append(m.shared.w1.weight.T.unflatten(1, (2, -1, Hx)).transpose(1, 2).flatten(1))
                down.append(m.shared.w2.weight.T)
            gate = (torch.arange(m.E + cfg.n_shared_expert) >= m.E).float()[None]   # routed 0, shared 1
            w.update(up=torch.cat(up, 1), down=torch.cat(down), gate=gate)
        prep.append(w)

    def step(token, pos, cache, mask):
        B = len(token)
        cos, sin = (t.view(B, 1, -1) for t in model.rope(pos[:, None]))
        x, chosen = model.wte(token) * cfg.embedding_multiplier, []     # Granite's multiplier (1 elsewhere)
        for blk, w in zip(model.blocks, prep):
            a = blk.attn
            qkv = F.linear(blk.norm1(x), a.qkv.weight)
            qk = qkv[:, :(H + Hk) * D].unflatten(1, (H + Hk, D))           # q's heads, then k's
            if "qk" in w:
                qk = F.rms_norm(qk, (D,), eps=cfg.rms_eps or None) * w["qk"]
            elif cfg.qk_norm == "width":
                q, k = a.q_norm(qk[:, :H].flatten(1)), a.k_norm(qk[:, H:].flatten(1))
                qk = torch.cat([q, k], 1).view_as(qk)
            x1, x2 = qk.chunk(2, -1)
            qk = torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)    # apply_rope's arithmetic
            k, v = cache.update(a.layer_idx, qk[:, H:, None], qkv[:, (H + Hk) * D:].view(B, Hk, 1, D))
            y = F.scaled_dot_product_attention(qk[:, :H].reshape(B, Hk, H // Hk, D), k, v, attn_mask=mask,
                                               scale=a.scale)    # a KV head's query heads as its query rows
            x = torch.addmm(x, y.reshape(B, H * D), a.proj.weight.T, alpha=blk.mult)
            h = blk.norm2(x)
            if not blk.is_moe:
                g, u = F.linear(h, blk.mlp.w1.weight).chunk(2, -1)
                x = torch.addmm(x, F.silu(g) * u, blk.mlp.w2.weight.T, alpha=blk.mult)
                continue
            if B > DENSE_ROWS:       # the sparse dispatch (MoE.path)
                y, topi = blk.mlp(h[:, None], track=False)
                x = x + blk.branch(y[:, 0])
            else:
                topi, gates = blk.mlp.route(h)[:2]
                gu = (h @ w["up"]).unflatten(1, (-1, 2, Hx))
                gw = w["gate"].expand(B, -1).scatter(1, topi, gates)
                x = torch.addmm(x, (F.silu(gu[:, :, 0]) * gu[:, :, 1] * gw[:, :, None]).flatten(1), w["down"],
                                alpha=blk.mult)
            chosen.append(topi)
        return model.lm_head(model.norm(x)).float(), chosen
    return step
