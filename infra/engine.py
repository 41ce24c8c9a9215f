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
from tqdm import tqdm

import env
from infra import common
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
    device = next(model.parameters()).device
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
            with common.autocast(device):
                gens = generate_streams(model, [prompts[i] for i in idx], max_new_tokens,
                                               temperature=temperature, top_k=top_k, top_p=top_p,
                                               stop_ids=[tok.eot_id], generator=generator,
                                               return_routes=return_routes)
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
    further turn continues the row's KV cache (model.generate's past): the feedback is appended,
    nothing is re-read. The hidden tests judge every attempt (for the self-repair curve); the
    reward is the verdict on the last one. Returns per episode {"task_idx", "turns": one sample per
    attempt (as_sample's dict, prompt_ids = the tokens fed that turn, plus "feedback": the
    text appended after it, "" for the last, and "visible_passed": the verdict of the docstring's
    examples, None where they were not run), "results": the hidden-test Result of each attempt,
    "result": the last one, or the sandbox_error of a visible-example run that failed}."""
    device = next(model.parameters()).device
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
                with common.autocast(device):
                    gens = generate_streams(model, [feeds[j] for j in live], max_new_tokens,
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
