"""
Generation: everything that samples from the model (model.py is the architecture alone).

    outs = engine.generate(model, prompts, max_new_tokens=96, temperature=1.0, stop_ids=[eot])

The reading path is this file: generate, the reference sampler (a KV cache, batched prompts, stop
tokens, log-probs and routes, pasts for multi-turn), and its parts: KVCache, prefill, sample. The
speed paths live beside it in infra/fast.py, tested equal to it (tests/test_generate.py), and are
chosen in one place, fast.generate, which everything that samples calls: finished rows retired
from the batch, sync-free decoding on a GPU, two decode streams on a CPU, a compiled decode step,
and speculative decoding with the MTP modules (infra/speculative.py).
Then the episodes built on it: run_episodes, the one loop of every rollout (train_rl.py, eval.py,
agent.py), one turn or many, with a tool set of env.py's. Measured in bench.py (generation, compiled,
speculative, episodes); the figures are in docs/benchmarks.md and docs/speculative.md.
"""
from types import SimpleNamespace

import torch
from tqdm import tqdm

import env
from infra import fast

# The dtype of recorded routes (expert ids): one byte a route; model.GPTConfig refuses more experts.
ROUTE_DTYPE = torch.uint8


# ----------------------------------------------------------------------------------------------
# The reference: generate

@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(), generator=None,
             return_routes=False, past=None, return_past=False) -> list[dict]:
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
            for i in range(min(n_layer, len(self.k))):
                cols = slice(end - p.size(3), end)
                self.k[i][b, :, cols], self.v[i][b, :, cols] = p[i, 0], p[i, 1]
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
    mask = None
    if A:
        cache.fill([past[first[w]].to(dev) for w in range(len(uniq))], A)
    # causal AND key is a real token; a pad query attends to itself (no empty rows -> no NaN)
    if not bool(valid.all()) or A:
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
    u = torch.rand(probs.size(0), 1, generator=generator,
                   device=generator.device if generator else probs.device)
    token = torch.searchsorted(cdf, u.to(probs.device) * cdf[:, -1:], right=True).squeeze(-1)
    over = token >= probs.size(-1)     # float rounding at the very top of the cdf: rare
    if no_sync or over.any():   # no_sync: no host read (a GPU speed path); on CPU the check is cheaper
        token = torch.where(over, probs.argmax(-1), token)
    return token


def sample(logits, temperature, top_k, top_p, generator=None, no_sync=False):
    """logits (B, V) fp32 -> (token, logprob of that token under softmax(logits / T), pre-filtering).
    no_sync: never read the device from the host (infra/fast.py's sync-free decoding)."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
    logp, probs = distribution(logits, temperature, top_k, top_p)
    token = draw(probs, generator, no_sync)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------------------------
# Samples and episodes: what RL, eval and the interactive command draw

def run_episodes(model, tok, tasks, n, tools, pool, temperature, max_new_tokens, top_p=1.0, top_k=0,
                 batch_size=64, generator=None, return_routes=False, progress=False, prompts=None):
    """THE episode loop: RL, eval and agent.py run every rollout through it, one turn or many. n
    episodes per task, rows task by task (the n episodes of task i are contiguous, the group RL
    needs), batch_size rows at a time through all their turns. `tools` is the episode's tool set
    (env.py): env.Feedback(1), a single completion (the function tasks' single-turn sampling);
    env.Feedback(T), the docstring's examples after each attempt (--turns T); env.Tools, a repository
    worked through actions (the agent). The tool set writes the prompt, answers each turn (step: an
    observation, or None when the episode is over) and judges the ends (finish, once all is sampled:
    the sandbox runs in the background while the next batch generates).
    prompts: token ids per task to continue instead of the tool set's prompt (a repair's context).

    Each further turn continues the row's KV cache (generate's past): the turn's last token (unless it
    was end-of-text) and the observation are fed on top of it, nothing is re-read, nothing is
    re-tokenised. An episode also ends when another turn would not fit the context. Returns per
    episode {"task_idx", "turns": one sample per turn (as_sample's dict, prompt_ids = the ids fed that
    turn, plus "feedback": the observation fed after it, "" for the last), "result": the judge's
    Result, and what the tool set keeps (Feedback: "results" per attempt; Tools: "repo", "actions",
    "end")}. The tokens a trainer scores are exactly those sampled: rl.algo.flatten joins each turn's
    prompt_ids and tokens back into this stream."""
    if prompts is None:
        prompts, truncated = encode_prompts(model, tok, tasks, max_new_tokens, tools.prompt)
    elif len(prompts) != len(tasks):
        raise ValueError(f"{len(prompts)} prompts for {len(tasks)} tasks")
    else:
        truncated = [False] * len(prompts)
    stop = [tok.eot_id] + [tok.tool_ids[t] for t in tools.stop_tokens]
    rows = [i for i in range(len(tasks)) for _ in range(n)]
    episodes, was_training = [], model.training
    model.eval()
    try:
        for s in tqdm(range(0, len(rows), batch_size), desc="episodes", disable=not progress, leave=False):
            chunk = rows[s:s + batch_size]
            eps = [{"task_idx": i, "turns": [], "segment": 0, **tools.start(tasks[i])} for i in chunk]
            feeds, pasts, limits = {j: prompts[i] for j, i in enumerate(chunk)}, {}, {}   # row j's next turn
            for turn in range(tools.max_turns):
                live, more = sorted(feeds), turn < tools.max_turns - 1
                if not live:
                    break
                gens = fast.generate(model, [feeds[j] for j in live], max_new_tokens,   # autocast inside
                                     temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop,
                                     generator=generator, return_routes=return_routes, return_past=more,
                                     past=[pasts[j] for j in live] if turn else None)
                samples = [as_sample(tok, cut(g, limits.get(j), len(feeds[j])), chunk[j], feeds[j],
                                     turn == 0 and truncated[chunk[j]]) for j, g in zip(live, gens)]
                old = {j: x.pop("past", None) for j, x in zip(live, samples)}
                feeds, pasts, limits = {}, {}, {}
                items = [(tasks[x["task_idx"]], eps[j], x) for j, x in zip(live, samples)]
                said = tools.step(tok, pool, items, more)     # the observations: what the tools answered
                for j, x, text in zip(live, samples, said):
                    eps[j]["turns"].append(x)
                    x["feedback"], x["segment"] = "", eps[j]["segment"]
                    if text is None:
                        continue
                    i = x["task_idx"]     # the tool set says what the next turn feeds (a fresh context?)
                    nxt = tools.fit(tok, tasks[i], eps[j], x, next_feed(tok, tools, x, text), old[j].size(3),
                                    prompts[i], model.config.seq_len, max_new_tokens)
                    if nxt is not None:
                        feeds[j], fresh, limits[j] = nxt
                        x["feedback"], pasts[j] = text, old[j][:, :, :, :0] if fresh else old[j]
                        eps[j]["segment"] += fresh
            episodes += eps
    finally:
        model.train(was_training)
    tools.finish(pool, [(tasks[e["task_idx"]], e) for e in episodes])   # the verdicts, once all is sampled
    return episodes


def cut(g, limit, n_fed):
    """A generate() output kept to its first `limit` tokens (a summary's cap, env.Tools.fit): the same
    as if generation had stopped there (the tokens after it are never seen); its routes are those of
    the n_fed ids fed and the kept tokens but the last. None, or a shorter output: unchanged."""
    if limit is None or len(g["tokens"]) <= limit:
        return g
    out = {**g, "tokens": g["tokens"][:limit], "logprobs": g["logprobs"][:limit]}
    if "routes" in g:
        out["routes"] = g["routes"][:, :n_fed + limit - 1].clone()
    if "past" in g:                  # nothing continues a summary's cache (a fresh context follows)
        out["past"] = g["past"][:, :, :, :0]
    return out


def next_feed(tok, tools, turn, text):
    """The ids the next turn feeds on top of `turn`'s cache, which holds its prompt_ids + tokens[:-1]:
    its last token, unless that was end-of-text (a turn cut by max_new_tokens, or one that ended on
    <|end|>, feeds it now), then the observation as the tool set writes it."""
    return ([] if turn["stopped"] else turn["tokens"][-1:]) + tools.feed_ids(tok, text)


def encode_prompts(model, tok, tasks, max_new_tokens, render=env.render_prompt):
    """Each task's prompt as token ids, and whether it was cut. A prompt longer than the context minus
    the generation budget keeps its END (the signature and docstring to continue sit at the end;
    HumanEval's imports and helpers come first), but never less than half the context: past seq_len,
    RoPE positions the model never trained on cost less than a prompt cut to nothing. Rare with the
    env tasks; flagged per sample."""
    max_prompt = max(model.config.seq_len - max_new_tokens, model.config.seq_len // 2)
    full = [tok.encode(render(t)) for t in tasks]
    return [p[-max_prompt:] for p in full], [len(p) > max_prompt for p in full]


def as_sample(tok, g, task_idx, prompt_ids, prompt_truncated=False):
    """One generate() output -> a turn's sample dict: task_idx, prompt_ids (the ids fed before it),
    tokens (generated, incl. the stop token if hit), logprobs, text (decoded, without special tokens),
    completion (text cut by env.extract_completion: what runs), stopped (ended on end-of-text, not on
    a tool's stop token or max_new_tokens), prompt_truncated (encode_prompts), and routes / past when
    generate returned them."""
    tokens = list(g["tokens"])
    # ids past the BPE ranks (pad; a model vocab padded beyond the tokenizer's) have no text: they
    # are dropped from the decoded text, not an error
    text = tok.decode([t for t in tokens if t < tok.eot_id])
    d = {"task_idx": task_idx, "prompt_ids": prompt_ids, "tokens": tokens, "logprobs": list(g["logprobs"]),
         "text": text, "completion": env.extract_completion(text),
         "stopped": bool(tokens) and tokens[-1] == tok.eot_id, "prompt_truncated": prompt_truncated}
    for key in ("routes", "past"):
        if key in g:
            d[key] = g[key]
    return d


def repair_prompt(tok, task, attempt, seen):
    """Every id the second turn after a failed first `attempt` reads: what run_episodes' cache holds
    then, as one prompt (train_rl.py --repair-groups samples G repairs from it)."""
    text = env.render_feedback(task, seen, attempt["text"])
    return attempt["prompt_ids"] + attempt["tokens"][:-1] + next_feed(tok, env.Feedback(2), attempt, text)


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
