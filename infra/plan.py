"""
The plan of a run, before it runs (--dry-run of train_pretrain.py and train_rl.py): tokens per step,
the micro-batch that fits, memory per process, minutes, from the model's configuration and a device's
datasheet; and the device figures training's MFU divides by. An impossible configuration is refused
with one line that names the fix. lab/gpu_check.py measures the plan against a real GPU.
"""
import json
import os
import sys

import torch

from infra.cli import die
from infra.common import print_summary

# ---------------------------------------------------------------------------------------------
# Devices and the plan (--dry-run). Peaks are the datasheets' dense bf16 tensor-core FLOP/s (no
# sparsity), memory in GB; looked up by the longest name that occurs in torch's device name.

DEVICES = {"H100": (989e12, 80), "H100 PCIe": (756e12, 80), "H100 NVL": (835e12, 94), "H800": (989e12, 80),
           "H200": (989e12, 141), "GH200": (989e12, 96), "B200": (2250e12, 180), "A100": (312e12, 80),
           "A800": (312e12, 80), "L40S": (362e12, 48), "L4": (121e12, 24), "A10": (125e12, 24),
           "RTX 4090": (165e12, 24), "RTX A6000": (155e12, 48)}


def device_spec(name):
    """(name as found in DEVICES, peak bf16 FLOP/s, memory GB) for a device name such as
    torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3"); None when it is not in the table."""
    hits = [k for k in DEVICES if k.lower() in name.lower()]
    if not hits:
        return None
    key = max(hits, key=len)
    return key, *DEVICES[key]


def fit_micro_batch(batch_tokens, seq_len, world, micro_batch, typed):
    """(micro_batch, grad_accum) with micro_batch * seq_len * world * grad_accum = batch_tokens. The
    global batch is the run's definition and stays; a preset's micro-batch (a memory knob) shrinks to
    the largest that divides this process's rows. A typed one that cannot fit dies naming the fix."""
    rows, rem = divmod(batch_tokens, seq_len * world)
    if rem or not rows:
        step = seq_len * world
        die(f"--batch-tokens {batch_tokens} is not a positive multiple of seq-len * processes = "
            f"{seq_len} * {world}: use --batch-tokens {max(1, round(batch_tokens / step)) * step}")
    fit = max(d for d in range(1, min(rows, micro_batch) + 1) if rows % d == 0)
    if typed and fit != micro_batch:
        die(f"--micro-batch {micro_batch} does not divide the {rows} sequences per process of --batch-tokens "
            f"{batch_tokens} over {world} processes: use --micro-batch {fit}")
    return fit, rows // fit


def tasks_per_rank(batch_tasks, world):
    """train_rl.py's --batch-tasks split over the processes; a one-line error naming the fix when
    they do not divide it."""
    if batch_tasks % world:
        die(f"--batch-tasks {batch_tasks} is not a multiple of the {world} processes: use --batch-tasks "
            f"{max(1, round(batch_tasks / world)) * world}")
    return batch_tasks // world


def add_plan_args(parser):
    """--dry-run and what the plan is for; each script calls this once."""
    parser.add_argument("--dry-run", action="store_true", help="print the plan (batch, memory, time) for "
                        "--world-size processes on --plan-device, then exit without training")
    parser.add_argument("--world-size", type=int, default=0, help="processes of the plan (default: "
                        "torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--plan-device", default="", help="device type of the plan, a name in plan.DEVICES "
                        "(default: the visible GPU, else H100)")


# The utilisation the plan assumes for training matmuls, as a fraction of the dense bf16 peak (decoding:
# a tenth of it, being memory-bound). An assumption, not a measurement: every plan states it (assumed_mfu).
PLAN_MFU = 0.3


def plan_device(args):
    name = args.plan_device or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100")
    spec = device_spec(name)
    if spec is None:
        die(f"--plan-device {name!r} is not in plan.DEVICES ({', '.join(DEVICES)}): name one of them")
    return spec


def model_plan(cfg):
    """(params_total, params_active, training FLOPs per token) of a GPTConfig, built on the meta device
    (no memory, no time)."""
    from model import GPT   # here, so that common.py stays importable on its own
    with torch.device("meta"):
        m = GPT(cfg)
    return (*m.num_params(), m.estimate_flops_per_token())


def saved_bytes(cfg, tokens):
    """Bytes autograd keeps for the backward of one training forward (model + loss) of `tokens`
    tokens, under bf16 autocast on the CPU: every saved tensor that is not a parameter, counted once
    per storage (saved-tensor hooks)."""
    from dataclasses import replace
    from model import GPT
    torch.manual_seed(0)
    model, seen = GPT(replace(cfg, seq_len=max(cfg.seq_len, tokens))).train(), {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randint(0, cfg.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, x)
    return sum(seen.values())


def activation_bytes_per_token(cfg):
    """Saved-for-backward bytes per token of training, measured on the real model rather than taken
    from a formula: Korthikanti et al.'s (2022) ~34 * n_embd bytes per layer missed the fp32 residual
    stream and norms, the fp32 QK-norm and RoPE intermediates and the MoE's gather / scale / unsort
    copies, and came out about 2x too low. The slope between 16 and 32 tokens (the bf16 weight copies
    autocast saves do not grow with tokens; attention saves O(T), so the slope holds at any length)
    at the depth of the dense layers plus one MoE layer and plus two, extrapolated to n_layer.
    A few seconds on a CPU; tests/test_gpu_path.py holds it against the whole model."""
    from dataclasses import replace
    first = min(cfg.n_layer, cfg.n_dense_layers + 1)
    def slope(n):
        return (saved_bytes(replace(cfg, n_layer=n), 32) - saved_bytes(replace(cfg, n_layer=n), 16)) / 16
    base = slope(first)
    return base + (cfg.n_layer - first) * (slope(first + 1) - base if cfg.n_layer > first else 0)


def memory_gb(cfg, params_total, rows, seq_len, extra_bytes=0):
    """Estimated peak GPU memory of training: fp32 weights, grads and AdamW moments (16 B/param) and
    the bf16 weight copies autocast keeps (2 B/param); the saved activations of one micro-batch,
    measured (activation_bytes_per_token); the fp32 gradient of its logits; `extra_bytes` (a KV
    cache, a reference model) and ~1.5 GB of CUDA context."""
    act = rows * seq_len * (activation_bytes_per_token(cfg) + 4 * cfg.vocab_size)
    return (18 * params_total + act + extra_bytes) / 1e9 + 1.5


def check_memory(plan, mem_gb_device):
    """Refuses with one line when the plan's estimated memory does not fit the device."""
    if plan["est_gpu_mem_gb"] > 0.9 * mem_gb_device:
        die(f"plan: ~{plan['est_gpu_mem_gb']:.0f} GB per process exceeds the {plan['device_type']}'s "
            f"{mem_gb_device} GB: use a smaller --micro-batch (now {plan['micro_batch']})")


def finish_plan(plan, mem_gb_device):
    """Prints the plan (stderr lines, then the JSON line on stdout) and exits; refuses with one line
    when the estimated memory does not fit the device."""
    check_memory(plan, mem_gb_device)
    for k, v in plan.items():
        print(f"plan  {k:>18}: {v}", file=sys.stderr)
    prep = "; est_prep_min: a timed sample, scaled (est_prep_basis)" if "est_prep_min" in plan else ""
    print(f"plan  (est_* are estimates: a FLOP count at the assumed utilisation, not a measurement{prep})",
          file=sys.stderr)
    print_summary(plan)
    sys.exit(0)


def rl_plan(args, world, cfg=None):
    """train_rl.py --dry-run: the plan of an RL run (then exit). The model is --init-from's, else the
    one train_pretrain.py's preset of the same name would build (cfg: a model directory's, read by the
    caller: hf.load_checkpoint). Assumed, and stated in the plan: a
    prompt of PROMPT_TOKENS, every completion at --max-new-tokens, two sampling rounds per step with
    --dynamic-sampling, decoding at a tenth of PLAN_MFU (each token reads every weight), no time
    for the sandbox (it runs beside generation on the CPU cores)."""
    from model import GPTConfig
    tasks_per_rank(args.batch_tasks, world)
    if cfg is None and args.init_from and os.path.isfile(args.init_from):
        ck = torch.load(args.init_from, map_location="cpu", mmap=True, weights_only=False)
        cfg = GPTConfig(**ck["model_config"])
    elif cfg is None:
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        argv = [sys.executable, os.path.join(root, "train_pretrain.py"), "--preset", args.preset, "--dry-run"]
        out = subprocess.run(argv, capture_output=True, text=True)
        if out.returncode:
            die(f"plan: train_pretrain.py --preset {args.preset} --dry-run failed: "
                f"{out.stderr.strip()[-300:]}")
        cfg = GPTConfig(**json.loads(out.stdout.splitlines()[-1])["model_config"])
    name, peak, mem = plan_device(args)
    n_total, n_active, fpt = model_plan(cfg)
    seq = PROMPT_TOKENS + args.max_new_tokens
    rows = args.batch_tasks * args.group_size // world                 # sequences per process and step
    micro = min(args.micro_batch, rows)
    rounds = 2 if args.dynamic_sampling else 1
    fast, slow = world * peak * PLAN_MFU, world * peak * PLAN_MFU / 10
    step_s = (rounds * world * rows * seq * fpt / 3 / slow                        # generation
              + args.ppo_epochs * world * rows * seq * fpt / fast                  # PPO epochs (fwd + bwd)
              + (world * rows * seq * fpt / 3 / fast if args.kl_coef else 0)     # reference model
              + (args.prefilter * args.batch_tasks * seq * fpt / 3 / fast if args.prefilter > 1 else 0))
    evals = (args.steps // args.eval_every if args.eval_every else 0) + 2
    eval_s = evals * args.eval_tasks * args.eval_n * seq * fpt / 3 / slow
    run_min = (args.steps * step_s + eval_s) / 60
    kv = args.gen_batch * seq * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_width * 2
    ref = 2 * n_total if args.kl_coef else 0
    finish_plan({
        "script": "train_rl.py", "preset": args.preset, "world_size": world, "device_type": name,
        "tokens_per_step": args.batch_tasks * args.group_size * seq, "micro_batch": micro,
        "grad_accum": -(-rows // micro) * args.ppo_epochs, "steps": args.steps, "params_total": n_total,
        "params_active": n_active, "flops_per_token": fpt, "peak_flops": peak, "assumed_mfu": PLAN_MFU,
        "assumed_decode_mfu": PLAN_MFU / 10, "assumed_prompt_tokens": PROMPT_TOKENS,
        "assumed_rounds": rounds, "est_gpu_mem_gb": round(memory_gb(cfg, n_total, micro, seq, kv + ref), 1),
        "est_run_min": round(min(run_min, args.max_minutes) if args.max_minutes else run_min, 1),
        "est_run_min_uncapped": round(run_min, 1), "max_minutes": args.max_minutes}, mem)


PROMPT_TOKENS = 200   # an env prompt (docstring, signature, examples) is ~100-250 tokens


