"""
decode.py: the speed paths around GPT.generate. model.py's generate is the reference: plain eager
PyTorch, one batch, one trunk call per decode step, read top to bottom. What RL rollouts, eval, the
episodes and pretraining's sample call is generate_streams here, which runs that same generate
faster on a CPU, each row sampled from the same distribution (the float rounding of the thread count
and of the compiled step apart):

    outs = decode.generate_streams(model, prompts, max_new_tokens=96, temperature=1.0, stop_ids=[eot])

  - one torch thread per generate call, prefill included (cpu_threads), and two decode streams
    side by side (STREAMS);
  - optionally (COMPILE, train_rl.py / eval.py --compile-decode) each decode step through
    torch.compile (compiled_trunk).
Measured in bench.py (`python bench.py generation`, `python bench.py compiled`); history in the
README's notes.
"""
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from model import GPT, as_prompt_lists

# Settings of the speed paths, process-wide (like MoE.dispatch: they change speed, and float rounding
# only: log-probs move by ~1e-6 when the thread count splits reductions differently).
THREADS = 1      # torch threads per decode stream on CPU (0: leave torch's setting); see cpu_threads
STREAMS = 2      # decode streams (Python threads) on CPU: this machine's 2 cores
# Decode steps through torch.compile(trunk) (compiled_trunk). Off by default: compiling (and
# recompiling for new shapes) takes minutes on 2 cores; --compile-decode turns it on.
COMPILE = False
_COMPILED = {}   # "trunk": GPT.trunk under torch.compile, one for every model (False: compiling failed)


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
    and the cache grows by a column a step), for GPT.generate's `trunk`. A CPU decode step is a few
    hundred small ops whose dispatch costs more than their arithmetic; the compiler fuses them into a
    few dozen kernels, and the MoE layers run every expert densely (MoE.experts_dense) instead of
    sorting tokens. The unbound GPT.trunk is compiled once, with the model as an argument: the
    weights are graph inputs (an optimizer step needs no recompile) and nothing cached refers to a
    model (a compiled bound method would keep its model alive). Where compiling fails (e.g. no C++
    compiler) it warns once and every later call, of any model, runs the eager trunk."""
    if "trunk" not in _COMPILED:
        _COMPILED["trunk"] = torch.compile(GPT.trunk, dynamic=True)

    def trunk(idx, pos, cache=None, mask=None, chosen=None):
        if _COMPILED["trunk"]:
            n = len(chosen) if chosen is not None else 0
            try:
                return _COMPILED["trunk"](model, idx, pos, cache, mask, chosen=chosen)
            except Exception as e:
                # The failed call wrote at most this step's cache column, which the eager call writes
                # again (trunk moves cache.pos only at its end), and maybe some routes.
                warnings.warn(f"--compile-decode: torch.compile failed, decoding eagerly ({type(e).__name__}: {e})"[:300])
                _COMPILED["trunk"] = False
                if chosen is not None:
                    del chosen[n:]
        return model.trunk(idx, pos, cache, mask, chosen=chosen)
    return trunk


def generate_streams(model, prompts, max_new_tokens, streams=None, generator=None, past=None, **kw):
    """model.generate over `streams` Python threads (default STREAMS on CPU, 1 on GPU), each on a
    contiguous share of the rows with a random stream of its own and THREADS torch threads. A CPU
    decode step is a few hundred small ops: too small to split across OpenMP threads (a thread woken
    for each op costs more than it gives), but each op releases the GIL, so two independent batches
    decode side by side (bench.py generation). Rows of one prompt stay in one share (its prefill is
    shared). The samples depend on the number of streams, as they depend on the batch; each row's
    distribution does not. Same arguments and outputs as GPT.generate. One stream (plain generate
    with the caller's generator) on GPU and under 16 rows per stream."""
    prompts = as_prompt_lists(prompts)
    n, cpu = len(prompts), next(model.parameters()).device.type == "cpu"
    kw.setdefault("trunk", compiled_trunk(model) if COMPILE else None)
    streams = max(1, min(STREAMS if streams is None else streams, n // 16))
    if not cpu or THREADS != 1:
        streams = 1   # a GPU: one batch fills it; THREADS other than 1: the streams would oversubscribe the cores
    starts = [0] + [b for b in range(1, n) if past is not None or prompts[b] != prompts[b - 1]]
    # shares start at a prompt's first row (any row, with pasts), the one nearest to i * n / streams
    bounds = sorted({min(starts, key=lambda b: abs(b - i * n // streams)) for i in range(streams)}) + [n]
    if len(bounds) <= 2 or max_new_tokens <= 0:
        with cpu_threads(THREADS if cpu else 0):
            return model.generate(prompts, max_new_tokens, generator=generator, past=past, **kw)
    seeds = torch.randint(0, 2 ** 62, (len(bounds) - 1,), generator=generator).tolist()

    def share(i):
        a, b = bounds[i], bounds[i + 1]
        g = torch.Generator().manual_seed(seeds[i])
        return model.generate(prompts[a:b], max_new_tokens, generator=g, past=past[a:b] if past else None, **kw)
    with cpu_threads(1), ThreadPoolExecutor(len(bounds) - 1) as pool:
        return [o for part in pool.map(share, range(len(bounds) - 1)) for o in part]
