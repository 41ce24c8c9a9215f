"""
gpu-check: one prepared check of the GPU path (docs/gpu.md), < 9 min on one GPU, so that one run on a
lent GPU settles the most: kernels, NCCL, a pretraining and an RL stage with a checkpoint and a resume,
peak memory against the plan (infra/plan.py), grouped_mm against the loop, host syncs, the ratios of
lab/bench.py on the device. Without a GPU it runs the same stages reduced (smoke-sized, CPU, gloo), in
the slow test suite, so it cannot rot.

    python -m lab.gpu_check                  # the last stdout line: one JSON object, every figure
"""
import json
import math
import os
import sys
import tempfile
import time
import warnings
from unittest import mock

import torch

from lab.bench import CPU, ROOT, bench_model, run_script, timed
import env
import sampling
from data.tasks import generate_tasks
from infra import common
from model import GPTConfig, MoE, attend, native_grouped_mm
from sandbox import SandboxPool

COLLECTIVES = """
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from infra import common
rank, _, world, device = common.setup_ddp("auto")
cpu, dev = torch.ones(3, dtype=torch.float64), torch.ones(3, device=device)
dist.all_reduce(cpu); dist.all_reduce(dev)                 # a CPU tensor and a device tensor
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank}); dist.barrier()
print(json.dumps({"backend": str(dist.get_backend()), "cpu_sum": cpu.tolist(), "dev_sum": dev.tolist(),
                  "mean": common.all_reduce_mean(2.0), "objects": len(objs)}))
common.cleanup_ddp()
"""

# A trainer as gpu-check runs it: `python probe.py ROOT RECORD SCRIPT ARGS...` runs SCRIPT ARGS as
# `python SCRIPT ARGS` would, output unchanged, and at exit writes to RECORD.RANK.json what only the
# trainer's own process can measure: its peak GPU memory (torch.cuda.max_memory_allocated, and
# reserved; None on CPU) and the seconds it spent preparing data (tasks.heldout_index and
# corpus.prepare, as train_pretrain.prepared_data calls them; None when it reused prepared data).
PROBE = """
import atexit, json, os, runpy, sys, time
root, record, script = sys.argv[1:4]
sys.path.insert(0, root)
sys.argv = [os.path.join(root, script)] + sys.argv[4:]
import torch
from data import corpus, tasks
from sandbox import SandboxPool
spent, depth = [None], [0]


def timed(f):
    def wrapper(*args, **kw):
        depth[0] += 1
        t = time.perf_counter()
        try:
            return f(*args, **kw)
        finally:
            depth[0] -= 1
            if not depth[0]:
                spent[0] = (spent[0] or 0.0) + time.perf_counter() - t
    return wrapper


corpus.prepare, tasks.heldout_index = timed(corpus.prepare), timed(tasks.heldout_index)


@atexit.register
def write():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with open(f"{record}.{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump({"prep_s": spent[0], "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                   "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None}, f)


runpy.run_path(sys.argv[0], run_name="__main__")
"""

MEM_SLACK = 1.1          # a measured peak may exceed the plan by 10%: the plan refuses above 90% of the device
LOGP_MISMATCH_MAX = 0.1  # mean |decode - training| log-prob per token (nats) the RL stage accepts


def rel_err(got, want):
    """Largest absolute difference relative to the largest magnitude of `want` (0 where both are 0)."""
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item() if want.numel() else 0.0


# aten ops that read a tensor's data on the host: on CUDA each waits for the queue (a sync). .item(),
# bool(), int(), float() and use as an index all end in _local_scalar_dense; a boolean-mask index and
# masked_scatter size their output from the mask; bincount reads the max; unique and nonzero their count.
HOST_READING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "bincount",
                    "_unique2", "unique_dim", "unique_consecutive", "equal", "is_nonzero"}


def count_host_syncs(fn, device):
    """(fn(), the host synchronisations it made). On CUDA the warnings of
    torch.cuda.set_sync_debug_mode("warn"): every .item(), device-to-host copy, blocking host-to-device
    copy and shape read from the data. On CPU, where nothing waits, the operations that would: the aten
    ops of HOST_READING_OPS, an index or index_put by a boolean mask, repeat_interleave without its
    output size (seen by a TorchDispatchMode, so inside aten too), and .tolist() (patched: no aten op)."""
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                r = fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return r, sum("synchroniz" in str(w.message) for w in seen)
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, kwargs = func.overloadpacket.__name__, kwargs or {}
            masks = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
            if name in HOST_READING_OPS or any(isinstance(m, torch.Tensor) and m.dtype == torch.bool
                                               for m in masks) or \
                    (name == "repeat_interleave" and kwargs.get("output_size") is None):
                seen.append(name)
            return func(*args, **kwargs)
    own, tolist = torch.Tensor.__dict__.get("tolist"), torch.Tensor.tolist   # own: None where inherited
    torch.Tensor.tolist = lambda self: seen.append("tolist") or tolist(self)
    try:
        with Reads():
            r = fn()
    finally:
        if own is None:
            del torch.Tensor.tolist
        else:
            torch.Tensor.tolist = own
    return r, len(seen)


def gpu_check_kernels(cuda):
    """The device, bf16, which fused attention backends run a causal bf16 SDPA here, whether a causal
    grouped-query one (every training forward) runs on one and agrees with the math backend in values
    and gradients, and whether a masked grouped-query one (packed RL rows) runs without the math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "bf16": bool(cuda and torch.cuda.is_bf16_supported()), "grouped_mm": hasattr(torch.nn.functional, "grouped_mm")}
    if cuda:   # grouped_mm's own kernel (else MoE.experts avoids its host-syncing fallback)
        out["grouped_mm_native"] = native_grouped_mm(torch.cuda.current_device())
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    q = torch.randn(4, 12, 512, 64, device=dev, dtype=dt)
    fused = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
             ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    for name, backend in fused + [("math", SDPBackend.MATH)]:
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out[f"sdpa_{name}"] = True
        except RuntimeError:
            out[f"sdpa_{name}"] = False
    # a causal grouped-query call as every training forward makes it (Attention: no mask, so model.attend
    # passes is_causal with enable_gqa), forward and backward on each fused backend alone, against the
    # math backend in fp32
    kv, w = q[:, :4], torch.randn_like(q)

    def causal_gqa(backend, dtype):
        qq, kk = (t.detach().to(dtype).requires_grad_() for t in (q, kv))
        with sdpa_kernel([backend]):
            y = attend(qq, kk, kk, None, True, False)
            (y.float() * w.float()).sum().backward()
        return y, qq.grad, kk.grad
    want, tol = causal_gqa(SDPBackend.MATH, torch.float32), 5e-2 if cuda else 1e-4
    for name, backend in fused:
        try:
            out[f"sdpa_causal_gqa_{name}"] = all(rel_err(a, b) < tol for a, b in zip(causal_gqa(backend, dt), want))
        except RuntimeError:
            out[f"sdpa_causal_gqa_{name}"] = False
    out["sdpa_causal_gqa_fused"] = any(out[f"sdpa_causal_gqa_{name}"] for name, _ in fused)
    # a masked grouped-query call as packed RL rows make it (rl/algo.block_mask), through model.attend
    # as Attention takes it: on CUDA it must run without the math backend
    mask = torch.ones(512, 512, dtype=torch.bool, device=dev).tril().expand(4, 1, 512, 512)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            attend(q, kv, kv, mask, False, cuda)
        out["sdpa_masked_gqa_fused"] = True
    except RuntimeError:
        out["sdpa_masked_gqa_fused"] = False
    # and a padded decode step (one query token, its heads folded into the query length; on CUDA
    # without the math backend): the same values as the math backend's enable_gqa call, whose
    # output layout differs from the memory-efficient kernel's
    step, row = q[:, :, -1:], mask[:, :, -1:]
    with sdpa_kernel([SDPBackend.MATH]):
        want = attend(step, kv, kv, row, False, False)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] if cuda
                         else [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION]):
            got = attend(step, kv, kv, row, False, True)
        out["sdpa_masked_decode_fused"] = bool(torch.allclose(got.float(), want.float(), atol=2e-2))
    except RuntimeError:
        out["sdpa_masked_decode_fused"] = False
    out["ok"] = out["sdpa_math"] and out["sdpa_masked_decode_fused"] and (
        not cuda or (out["bf16"] and (out["sdpa_flash"] or out["sdpa_efficient"]) and out["sdpa_masked_gqa_fused"]
                     and out["sdpa_causal_gqa_fused"]))
    return out


def grouped_vs_loop(device, dtype, E=8, D=64, H=64, N=192, k=2, seed=0):
    """One MoE layer's grouped_mm dispatch (MoE.experts with grouped=True, dispatch "grouped") against
    the sorted dispatch, one matmul per expert (the reading path): its output and the gradients of the input, both expert
    weights (expert by expert) and the router, on routes forced (router replay) so that expert E-1
    gets no token and E-2 exactly one; pytorch#172439 reports wrong gradients for an empty group on
    B200. bf16: under autocast, as training runs. Returns matches (every difference within float
    rounding, everything finite, and the empty expert's weight gradients exactly 0), max_rel_err, empty_grad."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(GPTConfig(vocab_size=256, n_embd=D, n_head=4, n_kv_head=2, n_expert=E, top_k=k,
                        n_shared_expert=0, expert_hidden=H))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-2] ** 0.5)
    moe.to(device)
    x, r = (torch.randn(N, D, generator=g).to(device) for _ in range(2))
    # skewed loads over experts 0..E-3, then token 0's second choice moved to E-2: E-1 gets nothing
    routes = torch.multinomial(torch.linspace(1, 4, E - 2).expand(N, -1), k, generator=g)
    routes[0, 1] = E - 2
    routes = routes.to(device)

    def run(path):
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with mock.patch.object(MoE, "dispatch", path), \
                torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y, _ = moe(xi, route=routes, track=False)
        (y.float() * r).sum().backward()
        return [y.detach(), xi.grad, moe.router.weight.grad, moe.w1.grad, moe.w2.grad]
    got, want = run("grouped"), run("sorted")
    errs = [rel_err(a, b) for a, b in zip(got[:3], want[:3])]
    errs += [rel_err(a[e], b[e]) for a, b in zip(got[3:], want[3:]) for e in range(E - 1)]
    empty = max(got[3][E - 1].abs().max().item(), got[4][E - 1].abs().max().item())
    finite = all(bool(torch.isfinite(t).all()) for t in got)
    worst = max(errs) if finite else float("inf")
    return {"matches": finite and worst < (3e-2 if dtype == torch.bfloat16 else 1e-4) and empty == 0,
            "max_rel_err": worst, "empty_grad": empty}


def gpu_check_grouped_mm(device):
    """grouped_vs_loop where training runs it: bf16 at the gpu preset's MoE sizes (16 experts, width
    768, experts 512 wide, 4096 tokens) on a GPU; on CPU fp32 (what CPU training runs) and bf16."""
    cuda = device.type == "cuda"
    runs = ({"bf16": grouped_vs_loop(device, torch.bfloat16, E=16, D=768, H=512, N=4096)} if cuda else
            {"fp32": grouped_vs_loop(device, torch.float32), "bf16": grouped_vs_loop(device, torch.bfloat16)})
    ok = all(r["matches"] for r in runs.values())
    return {"grouped_mm_matches_loop": ok, "ok": ok,
            **{f"grouped_mm_{dt}_{k}": v for dt, r in runs.items() for k, v in r.items() if k != "matches"}}


def host_syncs_per_token(model, prompts, device, n_new=33, fp32=False):
    """GPU synchronisations per decode step of sampling.generate (count_host_syncs): n_new tokens against
    one, no stop id; sampling.SYNC_FREE reads every DONE_EVERY tokens. fp32: sampling.retiring outside
    autocast instead (the MoE's dense no-grad path, MoE.DENSE_ROWS)."""
    decode = sampling.retiring if fp32 else sampling.generate
    counts = [count_host_syncs(lambda: decode(model, prompts, n, temperature=1.0,
                                              generator=torch.Generator(device).manual_seed(0)), device)[1]
              for n in (1, n_new)]
    return (counts[1] - counts[0]) / (n_new - 1)


def gpu_check_generate(ckpt, device):
    """Sampling throughput of the checkpoint just trained: 64 rows x 128 new tokens (8 x 16 reduced),
    and on a GPU the host synchronisations per generated token (goal: under one, issue 38).
    sampling.generate decodes under bf16 autocast on a GPU, as training runs."""
    cuda = device.type == "cuda"
    model, tok, _ = common.load_checkpoint(ckpt, device=device)
    model.eval()
    rows, n_new = (64, 128) if cuda else (8, 16)
    prompts = [tok.encode(env.render_prompt(t)) for t in generate_tasks("test", rows, seed=0)]
    gen = torch.Generator(device=device).manual_seed(0)
    sampling.generate(model, prompts[:2], 4, temperature=1.0, generator=gen)   # warm-up
    outs, dt = timed(lambda: sampling.generate(model, prompts, n_new, temperature=1.0, generator=gen), device)
    n = sum(len(o["tokens"]) for o in outs)
    syncs = host_syncs_per_token(model, prompts, device) if cuda else None
    syncs32 = host_syncs_per_token(model, prompts, device, fp32=True) if cuda else None
    return {"rows": rows, "new_tokens": n, "tokens_per_s": n / dt, "host_syncs_per_token": syncs,
            "host_syncs_per_token_fp32": syncs32, "ok": n > 0 and (syncs is None or (syncs < 1 and syncs32 < 1))}


def gpu_check_episodes(ckpt, device):
    """Multi-turn episodes (issue 55) on the checkpoint just trained, by the turn-by-turn loop
    (sampling.EPISODES = "turns", the reference) and by continuous batching (the default), side by
    side in one run: Feedback(3) episodes of function tasks (its tokenizer has no tool tokens), 16
    tasks x 8 episodes of up to 128 new tokens a turn (4 x 4 of 16 reduced), each loop timed after a
    warm-up; tokens/s of each, their ratio, and the share of episodes whose tokens agree (the loops
    sample alike, but bf16 rounds a row differently beside other rows, and one flipped draw changes
    the rest of its episode). The host reads which rows ended at every token of the continuous loop."""
    cuda = device.type == "cuda"
    model, tok, _ = common.load_checkpoint(ckpt, device=device)
    model.eval()
    tasks, n, new = (generate_tasks("test", 16, seed=2), 8, 128) if cuda else \
        (generate_tasks("test", 4, seed=2), 4, 16)
    out, rate = {}, {}
    with SandboxPool(workers=2 if not cuda else None, timeout_s=1.0) as pool:
        for loop in ("turns", "continuous", "turns", "continuous"):     # the first two warm up
            with mock.patch.object(sampling, "EPISODES", loop):
                run = lambda: env.run_episodes(model, tok, tasks, n, env.Feedback(3), pool, 1.0, new,  # noqa: E731
                                               batch_size=128, return_routes=True,
                                               generator=torch.Generator(device).manual_seed(0))
                eps, dt = timed(run, device)
            out[loop], rate[loop] = eps, sum(len(t.tokens) for e in eps for t in e.turns) / dt
    same = sum([t.tokens for t in a.turns] == [t.tokens for t in b.turns]
               for a, b in zip(out["turns"], out["continuous"])) / len(out["turns"])
    return {"episodes_turns_tok_s": rate["turns"], "episodes_continuous_tok_s": rate["continuous"],
            "episodes_continuous_vs_turns": rate["continuous"] / rate["turns"], "episodes_same_tokens": same,
            "rows": len(out["turns"]), "ok": rate["turns"] > 0 and rate["continuous"] > 0}


def gpu_check_train_syncs(ckpt, device, preset):
    """Host synchronisations of one RL training micro-batch, train_rl.micro_batch_loss as a step calls
    it (its batch on the host; forward under bf16 autocast on a GPU with router replay, packed prompts
    and the valid mask; the PPO loss; backward), counted as the generate stage counts them per decode
    token (count_host_syncs): 2 tasks x 8 samples of up to 64 tokens from the checkpoint just trained,
    one micro-batch after a warm-up one. Each sync stalls the GPU's queue (issue 44, item 7)."""
    from types import SimpleNamespace
    import train_rl
    from rl.algo import batch_tensors, segments
    model, tok, _ = common.load_checkpoint(ckpt, device=device)
    args = common.parse_args(train_rl.p, train_rl.PRESETS, ["--preset", preset])
    with SandboxPool(workers=1) as pool:
        eps = env.run_episodes(model, tok, generate_tasks("train", 2, seed=0), 8, env.Feedback(1), pool,
                                  temperature=1.0, max_new_tokens=64, return_routes=True,
                                  generator=torch.Generator(device).manual_seed(0))
    samples = [s for e in eps for s in segments(e)]
    batch = batch_tensors(samples, tok.pad_id, model.n_moe_layers, model.config.top_k, True, True)
    counts = train_rl.Counts(len(samples), float((batch.tgt >= 0).sum()), float(batch.valid.sum()), 1)
    ctx = SimpleNamespace(args=args, model=model.train(), device=device, replay=True)
    stats, adv = train_rl.new_stats(args), [(-1.0) ** i for i in range(len(samples))]
    step = lambda: train_rl.micro_batch_loss(ctx, batch, adv, counts, stats, 0)   # noqa: E731
    step()                                                                          # warm-up
    _, syncs = count_host_syncs(step, device)
    return {"train_host_syncs": syncs, "train_rows": int(batch.idx.size(0)), "train_positions": int(counts.n_positions),
            "ok": isinstance(syncs, int)}


def gpu_check_ratios(device):
    """lab/bench.py's model part (bench_model --quick: MoE vs dense training, KV cache vs recompute,
    batched vs one prompt at a time) on the GPU; reduced (smoke sizes, seconds) on CPU. ok: every
    ratio measured, a positive finite number (the goals are for lab/bench.py itself, on full sizes)."""
    r = bench_model(True, device, reduced=device.type != "cuda")
    ratios = [r[k] for k in ("moe_vs_dense_train", "kv_cache_speedup", "batched_generation_speedup")]
    return dict(r, ok=all(math.isfinite(v) and v > 0 for v in ratios))


def probed(probe, argv, timeout=600):
    """run_script of a trainer through PROBE: its summary, with rank 0's prep_s and peak memory."""
    record = os.path.join(os.path.dirname(probe), os.path.basename(argv[0]).removesuffix(".py"))
    r = run_script([probe, ROOT, record] + argv, timeout)
    with open(f"{record}.0.json") as f:
        return {**r, **json.load(f)}


def fits(peak, plan_gb):
    """The measured peak against the plan's estimate (None: not measured, on CPU)."""
    return peak is None or peak <= MEM_SLACK * plan_gb


def gpu_check_pretrain(probe, argv):
    """train_pretrain.py's run, its peak GPU memory against the plan of `--dry-run` with the same
    flags (est_gpu_mem_gb), and its data preparation time against the plan's est_prep_min."""
    r = probed(probe, argv)
    plan = run_script(argv + ["--dry-run"], 300)
    r.update(plan_mem_gb=plan["est_gpu_mem_gb"], plan_prep_s=round(60 * plan["est_prep_min"], 1))
    return dict(r, ok=fits(r["peak_mem_gb"], r["plan_mem_gb"]))


def gpu_check_rl(probe, argv):
    """train_rl.py's 2 steps; ok only if they trained on some sequences (rl_trained_seqs, summed
    from its metrics.jsonl: a step with no spread in any group runs no backward at all), the decode vs
    training log-prob mismatch it logs (logp_mismatch, mean per token; the worst step) is finite and
    under LOGP_MISMATCH_MAX, and its peak memory is within the plan of `--dry-run` with the same flags."""
    r = probed(probe, argv)
    with open(r["metrics"]) as f:
        rows = [row for row in map(json.loads, f) if "eval" not in row]
    trained = sum(row.get("trained_seqs", 0) for row in rows)
    mismatch = max((row["logp_mismatch"] for row in rows if row.get("trained_seqs")), default=None)
    plan = run_script(argv + ["--dry-run"], 300)
    r.update(rl_trained_seqs=trained, logprob_mismatch=mismatch, plan_mem_gb=plan["est_gpu_mem_gb"])
    return dict(r, ok=trained > 0 and mismatch is not None and math.isfinite(mismatch) and mismatch < LOGP_MISMATCH_MAX
                and fits(r["peak_mem_gb"], r["plan_mem_gb"]))


def gpu_check_ddp(out_dir, cuda, pre, rl):
    """Two ranks under torchrun (nccl with gloo beside it on 2 GPUs; gloo on CPU, reduced): 8 DDP
    pretraining steps with gradient accumulation on the pretrain stage's prepared data, then 2 RL
    steps from the pretrain stage's checkpoint that train (gradients all-reduced) and checkpoint
    (every rank's queue gathered), then --resume for a third step with dynamic sampling, checkpointed
    again. Skipped (ddp_ranks 0) where fewer than 2 GPUs are visible."""
    if cuda and torch.cuda.device_count() < 2:
        return {"ddp_ranks": 0, "ok": True}
    ddp = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cache, d = os.path.join(out_dir, "pretrain", "cache"), os.path.join(out_dir, "ddp")
    p = run_script(ddp + pre + ["--out-dir", os.path.join(d, "pretrain"), "--cache-dir", cache, "--max-steps", "8",
                                "--eval-every", "8", "--ckpt-every", "8", "--micro-batch", "8" if cuda else "4"]
                   + (["--batch-tokens", "32768"] if cuda else []), 600)
    base = rl + ["--out-dir", os.path.join(d, "rl"), "--max-new-tokens", "128"] + (
        ["--batch-tasks", "4", "--group-size", "8"] if cuda else [])
    first = run_script(ddp + base + ["--steps", "2", "--no-dynamic-sampling"], 600)
    resumed = run_script(ddp + base + ["--steps", "3", "--dynamic-sampling", "--resume"], 600)
    with open(resumed["metrics"]) as f:
        rows = [row for row in map(json.loads, f) if "eval" not in row]
    ck = torch.load(resumed["ckpt"], map_location="cpu", mmap=True, weights_only=False)
    return {"ddp_ranks": 2, "ddp_pretrain_steps": p["steps"], "ddp_pretrain_loss": p["train_loss"],
            "ddp_rl_steps": [row["step"] for row in rows], "ddp_rl_trained_seqs": sum(r["trained_seqs"] for r in rows),
            "ddp_rl_rounds_step3": rows[-1]["rounds"], "ddp_rl_ckpt_mb": round(os.path.getsize(resumed["ckpt"]) / 1e6, 1),
            "ok": (p["steps"] == 8 and math.isfinite(p["train_loss"]) and first["steps"] == 2 and resumed["steps"] == 3
                   and [row["step"] for row in rows] == [1, 2, 3] and sum(r["trained_seqs"] for r in rows) > 0
                   and ck["step"] == 3 and len(ck["stream_pos"]) == 2)}


def gpu_check(out_dir):
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else CPU
    out_dir = os.path.abspath(out_dir or tempfile.mkdtemp(prefix="gpu-check-"))
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "pretrain", "ckpt.pt")
    preset = "gpu" if cuda else "smoke"
    data = ["--tasks-n", "20000", "--source-mb", "4"] if cuda else []
    pre = ["train_pretrain.py", "--preset", preset, "--out-dir", os.path.join(out_dir, "pretrain"), "--max-steps", "30",
           "--eval-every", "30", "--ckpt-every", "30"] + data   # and a sample of text at the last step
    rl = ["train_rl.py", "--preset", preset, "--init-from", ckpt, "--eval-tasks", "0",
          # a 30-step model fails every task: a length penalty gives its groups a spread (room for
          # 128 tokens, so that some samples end early), and both steps train (backward through the
          # MoE kernels and the gradient all-reduce), as in bench_rl
          "--prefilter", "1", "--len-penalty", "0.02"] + (["--max-minutes", "0"] if cuda else [])
    rl1 = rl + ["--out-dir", os.path.join(out_dir, "rl"), "--steps", "2", "--no-dynamic-sampling", "--max-new-tokens",
                "128"] + (["--batch-tasks", "16", "--group-size", "8"] if cuda else [])
    probe = os.path.join(out_dir, "probe.py")
    stages = {"kernels": lambda: gpu_check_kernels(cuda),
              "grouped_mm": lambda: gpu_check_grouped_mm(device),
              "collectives": lambda: dict(run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                                      "1", os.path.join(out_dir, "collectives.py"),
                                                      ROOT], 300), ok=True),
              "pretrain": lambda: gpu_check_pretrain(probe, pre),
              "generate": lambda: gpu_check_generate(ckpt, device),
              "episodes": lambda: gpu_check_episodes(ckpt, device),
              "train_syncs": lambda: gpu_check_train_syncs(ckpt, device, preset),
              "ratios": lambda: gpu_check_ratios(device),
              "rl": lambda: gpu_check_rl(probe, rl1),
              "ddp": lambda: gpu_check_ddp(out_dir, cuda, pre, rl)}
    for name, text in (("collectives.py", COLLECTIVES), ("probe.py", PROBE)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    results = {"reduced": not cuda, "device": torch.cuda.get_device_name() if cuda else "cpu",
               "gpus_visible": torch.cuda.device_count() if cuda else 0}
    keep = ("ok", "s", "error", "backend", "cpu_sum", "dev_sum", "tokens_per_s", "mfu", "train_loss", "val_loss",
            "steps", "rows", "new_tokens", "device", "bf16", "grouped_mm", "grouped_mm_native", "torch",
            "host_syncs_per_token", "host_syncs_per_token_fp32", "moe_vs_dense_train", "kv_cache_speedup",
            "batched_generation_speedup", "logprob_mismatch", "train_host_syncs", "train_rows", "train_positions",
            "prep_s", "peak_mem_gb", "peak_reserved_gb", "plan_mem_gb", "plan_prep_s")
    t_start = time.time()
    for name, fn in stages.items():
        t0 = time.time()
        try:
            r = fn()
        except Exception as e:   # every stage runs and reports, the JSON line says which failed
            r = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-500:]}"}
        r["s"] = round(time.time() - t0, 3)
        results[name] = {k: v for k, v in r.items()
                         if k in keep or k.startswith(("sdpa_", "rl_", "grouped_mm_", "ddp_", "episodes_"))}
        print(f"[{name}] {'ok' if r['ok'] else 'FAILED'} in {r['s']:.1f} s: {results[name]}", file=sys.stderr, flush=True)
    if "collectives" in results and results["collectives"]["ok"]:
        c = results["collectives"]
        c["ok"] = c["cpu_sum"] == [1.0] * 3 and c["dev_sum"] == [1.0] * 3
    # the figures issue 44 asks one run to settle, at the top level (None where a stage failed before them)
    results.update(
        peak_mem_gb={n: results[n].get("peak_mem_gb") for n in ("pretrain", "rl")},   # None on CPU
        plan_mem_gb={n: results[n].get("plan_mem_gb") for n in ("pretrain", "rl")},
        grouped_mm_matches_loop=results["grouped_mm"].get("grouped_mm_matches_loop", False),
        logprob_mismatch=results["rl"].get("logprob_mismatch"),
        train_host_syncs=results["train_syncs"].get("train_host_syncs"),
        prep_s=results["pretrain"].get("prep_s"), plan_prep_s=results["pretrain"].get("plan_prep_s"),
        ddp_ranks=results["ddp"].get("ddp_ranks", 0),
        verdicts={n: results[n]["ok"] for n in stages})
    results["ok"] = all(results["verdicts"].values())
    results["total_s"] = round(time.time() - t_start, 1)
    print(json.dumps(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    from infra.cli import ArgumentParser   # argparse errors: one line `error: ...`, exit code 2
    check = ArgumentParser(prog="python -m lab.gpu_check", description="the GPU path, stage by stage (docs/gpu.md)")
    check.add_argument("--out-dir", default="", help="where the runs go (default: a new temporary directory)")
    sys.exit(gpu_check(check.parse_args().out_dir))
