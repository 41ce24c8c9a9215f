"""
The speed paths of generation, beside the reference (infra/engine.py generate), each tested equal to
it (tests/test_generate.py) and chosen in one place: generate below, which everything that samples
calls.

  - generate_retiring: finished rows leave the batch and the cache as they finish (in bulk), so they
    stop costing compute; on a GPU sync-free (SYNC_FREE): no host read per token.
  - two decode streams on a CPU (STREAMS, cpu_threads): two batches side by side, one core each.
  - a compiled decode step (COMPILE, compiled_trunk: eval.py --compile-decode).
  - speculative decoding with the model's MTP modules (SPECULATIVE, infra/speculative.py; agent.py).
Measured in bench.py (generation, compiled, speculative): docs/benchmarks.md, docs/speculative.md.
"""
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from infra import common, engine, speculative
from model import GPT

# Settings of the speed paths, process-wide (like MoE.dispatch: they change speed, and float rounding
# only: log-probs move by ~1e-6 when the thread count splits reductions differently).
THREADS = 1      # torch threads per decode stream on CPU (0: leave torch's setting); see cpu_threads
STREAMS = 2      # decode streams (Python threads) on CPU: this machine's 2 cores
# Decode steps through torch.compile(trunk) (compiled_trunk). Off by default: compiling (and
# recompiling for new shapes) takes minutes on 2 cores; eval.py --compile-decode turns it on.
COMPILE = False
_COMPILED = {}   # "trunk": GPT.trunk under torch.compile, one for every model (False: compiling failed)
# generate decodes with speculative.generate where the model has MTP modules (agent.py sets it;
# calls that want routes still take generate_retiring: the drafts' routes are not recorded).
SPECULATIVE = False
# Host reads in the decode loop. On a GPU every read of a device value (.item(), bool(.any()), a
# shape that depends on data) waits for the queued kernels, so a loop that reads once per token runs
# at the speed of its round trips, not of the GPU. SYNC_FREE decodes without them: finished rows
# are a device mask that generate_retiring reads every DONE_EVERY tokens (to stop, or to retire
# rows), sampling never asks the host, and the MoE sizes its expert groups on the device
# (model.MoE.experts). None: on GPU only. On CPU a read is free and retiring finished rows at once
# saves compute, so CPU decoding reads every token, as it always did (same samples: the rows a step
# draws for depend on retiring).
SYNC_FREE = None
DONE_EVERY = 16


def sync_free(device):
    return device.type != "cpu" if SYNC_FREE is None else SYNC_FREE


# ----------------------------------------------------------------------------------------------
# The one place a path is chosen

def generate(model, prompts, max_new_tokens, streams=None, generator=None, past=None, **kw):
    """engine.generate's samples, by the fastest path this machine has: the one place a speed path
    is chosen, and what everything that samples calls (RL rollouts, eval, the episodes, agent.py,
    pretraining's samples). Same arguments and outputs as engine.generate.

    generate_retiring over `streams` Python threads (default STREAMS on CPU, 1 on GPU), each on a
    contiguous share of the rows with a random stream of its own and THREADS torch threads. A CPU
    decode step is a few hundred small ops: too small to split across OpenMP threads (a thread woken
    for each op costs more than it gives), but each op releases the GIL, so two independent batches
    decode side by side (bench.py generation). Rows of one prompt stay in one share (its prefill is
    shared). The samples depend on the number of streams, as they depend on the batch; each row's
    distribution does not. One stream (generate_retiring with the caller's generator) on GPU and
    under 16 rows per stream. With SPECULATIVE set and a model with MTP modules, each share runs
    speculative.generate instead (unless routes are asked for). On GPU under bf16 autocast
    (common.autocast; model.py keeps the router in fp32), as training runs."""
    prompts = engine.as_prompt_lists(prompts)
    n, cpu = len(prompts), next(model.parameters()).device.type == "cpu"
    fn = generate_retiring
    if SPECULATIVE and model.config.n_mtp and not kw.get("return_routes"):
        fn, kw = speculative.generate, {k: v for k, v in kw.items() if k not in ("trunk", "return_routes")}
    else:
        kw.setdefault("trunk", compiled_trunk(model) if COMPILE else None)
    streams = max(1, min(STREAMS if streams is None else streams, n // 16))
    if not cpu or THREADS != 1:
        # a GPU: one batch fills it; THREADS other than 1: the streams would oversubscribe the cores
        streams = 1
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
def generate_retiring(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
                      generator=None, return_routes=False, past=None, return_past=False,
                      trunk=None) -> list[dict]:
    """engine.generate's samples with the finished rows retired: the same arguments and outputs (and
    the same tokens until a row retires: tests/test_generate.py), plus trunk, the function each
    decode step calls instead of model.trunk (compiled_trunk; the prefill always runs model.trunk).

    A finished row (stop id or max_new_tokens) is dropped from the batch and the cache, in bulk once
    >= 1/8 of the rows are done (to amortise the copy), so it stops costing compute; a multi-turn
    row keeps its past first. Per-step bookkeeping is a few tensor ops into preallocated (rows,
    max_new_tokens) buffers, with no Python loop over rows, so its cost does not grow with the
    batch. On GPU (SYNC_FREE) the loop never waits for the device: finished rows are a device mask
    read every DONE_EVERY tokens (stop, retire); rows done in between run on, their junk cut off."""
    prompts = engine.as_prompt_lists(prompts)
    nl, k = model.n_moe_layers, model.config.top_k
    if not engine.anything_to_generate(prompts, past, max_new_tokens):
        return [{"tokens": [], "logprobs": [], **({"routes": torch.zeros(nl, 0, k, dtype=engine.ROUTE_DTYPE)}
                                                   if return_routes else {})} for _ in prompts]
    b = engine.prefill(model, prompts, past, max_new_tokens, model.config.n_layer)
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
    trunk = trunk or model.trunk
    for t in range(max_new_tokens):
        token, lp = engine.sample(logits, temperature, top_k, top_p, generator, sync_free(dev))
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
            token, valid, pos, alive, done = retire(done, cache, save_past if return_past else None,
                                                    token, valid, pos, alive, done)
        mask = valid[:, None, None, :cache.pos + 1] if padded else None
        h, chosen = trunk(token[:, None], pos[:, None], cache, mask)
        cache.pos += 1
        logits = model.lm_head(h[:, -1]).float()
        pos += 1
        if return_routes and nl:
            routes[:, alive, L + t] = torch.stack([c.view(len(alive), k) for c in chosen])
    if return_past:
        for j in range(len(alive)):
            save_past(j)
    return engine.outputs(tokens, logprobs, n_out, pasts if return_past else None, routes, prompts, L)


# ----------------------------------------------------------------------------------------------
# Two decode streams, a compiled decode step

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


def compiled_trunk(model):
    """model.trunk under torch.compile (CPU inductor, dynamic shapes: the rows shrink as they retire
    and the cache grows by a column a step), for generate_retiring's `trunk`. A CPU decode step is a few
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
                # again (generate_retiring moves cache.pos after the call).
                warnings.warn(f"--compile-decode: torch.compile failed, decoding eagerly "
                              f"({type(e).__name__}: {e})"[:300])
                _COMPILED["trunk"] = False
        return model.trunk(idx, pos, cache, mask)
    return trunk
