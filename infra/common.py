"""
Small helpers shared by train_pretrain.py, train_rl.py and eval.py.

Why a module at all: all three scripts parse presets the same way, write checkpoints the same way
(atomically, with the tokenizer embedded so a checkpoint is self-contained), set up DDP the same
way and end with the same one-line JSON summary. Keeping that here means one definition of each,
while every script still reads top to bottom.
"""
import argparse
import json
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist

# Flush denormals to zero on CPU: tiny early-training values (router logits, optimizer state) in
# the denormal range made the first CPU steps ~100x slower (measured in train_pretrain.py: 430 vs
# 40k tokens/s, identical losses). Every script imports this module, so it is set once here.
torch.set_flush_denormal(True)


# Bad input: one line `error: ...` and exit code 2, from a script's own checks (die) and from argparse's
# (ArgumentParser, which every script's parser is). They live in infra/cli.py, a module without torch.
from infra.cli import ArgumentParser, die  # noqa: E402,F401  (common.die, common.ArgumentParser)


# ---------------------------------------------------------------------------------------------
# Presets. Each script has PRESETS = {"smoke": {...}, "cpu": {...}, "gpu": {...}}: values become
# the argparse defaults, so any flag given on the command line wins over the preset.

def parse_args(parser, presets, argv=None):
    """Adds the options every script shares (--preset, --out-dir, --seed, --device; once: main()
    may run several times in one process, as in tests), makes the chosen preset's values the
    defaults (or fixed settings, for names with no flag) and parses. Only argparse's public API."""
    if "preset" not in vars(parser.parse_known_args([])[0]):
        parser.add_argument("--preset", choices=sorted(presets),
                            help="named defaults (smoke: tests, cpu: 2-core CPU, gpu: one GPU); "
                                 "default: gpu if CUDA is visible else cpu; flags override; "
                                 "--preset P --help shows P's values as the defaults")
        parser.add_argument("--out-dir", default=None, help="run directory for every artefact")
        parser.add_argument("--seed", type=int, default=0, help="random seed")
        parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    # Read --preset first with a parser that has no --help, so that `--help` (handled by the full
    # parse below) prints the chosen preset's values as the defaults rather than None.
    pre = ArgumentParser(prog=parser.prog, add_help=False)
    pre.add_argument("--preset", choices=sorted(presets))
    preset = pre.parse_known_args(argv)[0].preset or ("gpu" if torch.cuda.is_available() else "cpu")
    flags = set(vars(parser.parse_known_args([])[0]))
    fixed = {k for p in presets.values() for k in p} - flags
    assert all(fixed <= set(p) for p in presets.values()), f"every preset must set {sorted(fixed)}"
    parser.set_defaults(**{k: v for k, v in presets[preset].items() if k in flags})
    args = parser.parse_args(argv)
    # A preset's names without a flag are settings of the preset alone (the trainers keep their flags
    # to run settings and the ablations the README lists): edit PRESETS to change them.
    for k, v in presets[preset].items():
        if k not in flags:
            setattr(args, k, v)
    args.preset = preset
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", f"{parser.prog.removesuffix('.py')}-{preset}")
    return args


def typed_options(parser, argv):
    """The options typed on the command line, as dests (the rest came from a preset or a default):
    argv parsed again into a namespace that holds a fresh marker per option; argparse replaces the
    marker of every option it sees and leaves the others alone."""
    marks = {k: [] for k in vars(parser.parse_args(argv))}
    typed = vars(parser.parse_args(argv, argparse.Namespace(**marks)))
    return {k for k, v in typed.items() if v is not marks.get(k)}


def pick_device(name="auto"):
    """A torch.device; CUDA always with its index (cuda:0, not cuda), so device comparisons hold."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        die(f"--device {name} but no CUDA device is visible")
    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def autocast(device):
    """bf16 autocast on CUDA (the router stays fp32 inside model.py); plain fp32 on CPU, where
    bf16 matmuls are slower than fp32 on most CPUs and would only add noise to tests."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


# ---------------------------------------------------------------------------------------------
# DDP. torchrun sets RANK / LOCAL_RANK / WORLD_SIZE; without them we are a single process.

def dist_env():
    """(rank, local_rank, world_size) as torchrun set them, without starting the process group:
    what a rank may do before it (prepare data, check arguments) depends on them."""
    return tuple(int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))


def setup_ddp(device_name="auto"):
    """Returns (rank, local_rank, world_size, device). On GPUs one group with two backends,
    "cpu:gloo,cuda:nccl": each collective takes the backend of its tensor's device, so the
    statistics the scripts sum as CPU tensors (metrics, stop flags, counts) go through gloo and the
    gradients through NCCL; NCCL alone fails on the first CPU tensor. gloo alone on CPU."""
    if "RANK" not in os.environ:
        return 0, 0, 1, pick_device(device_name)
    rank, local_rank, world = dist_env()
    use_cuda = torch.cuda.is_available() and device_name != "cpu"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo")
    return rank, local_rank, world, device


def cleanup_ddp():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean(x):
    """Mean of a float (or tensor) over ranks; identity without DDP. A CPU tensor: gloo under the
    two-backend group of setup_ddp."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return t.item() if t.ndim == 0 else t


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


def peak_flops(device, override=0.0):
    """Peak FLOP/s of one process's device for MFU: --peak-flops if given; on CUDA the table's
    figure for this device (a one-line error names the flag when it is not in the table); on CPU
    None (the caller measures what a matmul reaches)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    spec = device_spec(name)
    if spec is None:
        die(f"no bf16 peak known for {name!r}: give --peak-flops (its dense bf16 FLOP/s) for MFU")
    return spec[1]


def fit_micro_batch(batch_tokens, seq_len, world, micro_batch, typed):
    """(micro_batch, grad_accum) with micro_batch * seq_len * world * grad_accum = batch_tokens. The
    global batch is the run's definition and stays; a preset's micro-batch (a memory knob) shrinks to
    the largest that divides this process's rows. A typed one that cannot fit dies naming the fix."""
    rows, rem = divmod(batch_tokens, seq_len * world)
    if rem or not rows:
        step = seq_len * world
        die(f"--batch-tokens {batch_tokens} is not a positive multiple of seq-len * processes = {seq_len} * {world}: "
            f"use --batch-tokens {max(1, round(batch_tokens / step)) * step}")
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
    parser.add_argument("--plan-device", default="", help="device type of the plan, a name in common.DEVICES "
                        "(default: the visible GPU, else H100)")


# The utilisation the plan assumes for training matmuls, as a fraction of the dense bf16 peak (decoding:
# a tenth of it, being memory-bound). An assumption, not a measurement: every plan states it (assumed_mfu).
PLAN_MFU = 0.3


def plan_device(args):
    name = args.plan_device or (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "H100")
    spec = device_spec(name)
    if spec is None:
        die(f"--plan-device {name!r} is not in common.DEVICES ({', '.join(DEVICES)}): name one of them")
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
    slope = lambda n: (saved_bytes(replace(cfg, n_layer=n), 32) - saved_bytes(replace(cfg, n_layer=n), 16)) / 16
    base = slope(first)
    return base + (cfg.n_layer - first) * (slope(first + 1) - base if cfg.n_layer > first else 0)


def memory_gb(cfg, params_total, rows, seq_len, extra_bytes=0):
    """Estimated peak GPU memory of training: fp32 weights, grads and AdamW moments (16 B/param) and
    the bf16 weight copies autocast keeps (2 B/param); the saved activations of one micro-batch,
    measured (activation_bytes_per_token); the fp32 gradient of its logits; `extra_bytes` (a KV
    cache, a reference model) and ~1.5 GB of CUDA context."""
    act = rows * seq_len * (activation_bytes_per_token(cfg) + 4 * cfg.vocab_size)
    return (18 * params_total + act + extra_bytes) / 1e9 + 1.5


def prep_minutes(args, mix, user_data, tok=None, n_tasks=200, sample_mb=0.5):
    """(minutes, how they were estimated) of train_pretrain.py's data preparation (corpus.prepare on
    rank 0, one core, once per data definition) on THIS machine's CPU: timed on a sample here and
    scaled linearly. Generating and rendering `n_tasks` env tasks, times --tasks-n (all are generated,
    whatever --source-mb); hashing, the leak filter and tokenizing those and the first `sample_mb` MB
    of every other source, times each source's size (capped at --source-mb); training the tokenizer
    at --vocab-size on the sample, times the --tok-train-mb it trains on (none when `tok`, e.g.
    --init-from's, is given); the held-out index, as it is. Repair and agent transcripts (--repair-frac,
    --agent-n: sandbox runs) are not counted. About 2 s; `bench.py gpu-check` reports the measured time
    beside it."""
    import math
    import time
    from collections import Counter
    import numpy as np
    import env
    from data import corpus, tasks, tokenizer
    clock = time.perf_counter
    t = clock()
    index = tasks.heldout_index(args.holdout_n)
    fixed_s, t = clock() - t, clock()
    levels = tasks.parse_difficulties(args.task_difficulties)
    task_texts = [env.corpus_text(x) for x in tasks.generate_tasks("train", n_tasks, seed=args.seed, difficulties=levels)]
    gen_s, task_bytes = (clock() - t) / n_tasks, sum(map(len, task_texts)) / n_tasks
    samples, sizes = {}, {}
    for name in mix:
        if name == "agent":
            samples[name], sizes[name] = [], 0
            continue
        if name == "tasks":
            kept = min(args.tasks_n, math.ceil(args.source_mb * 1e6 / task_bytes)) if args.source_mb else args.tasks_n
            samples[name], sizes[name] = task_texts, kept * task_bytes
            continue
        docs = corpus.load_source(name, user_data.get(name), Counter(), args)     # capped at --source-mb
        samples[name] = list(corpus.capped(docs, sample_mb))
        if name in user_data:    # a --data source by its files' sizes (reading it all could take long)
            path, exts = user_data[name], {"." + e.strip().lstrip(".") for e in args.data_ext.split(",")}
            size = os.path.getsize(path) if os.path.isfile(path) else sum(
                os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs
                if os.path.splitext(f)[1] in exts)
            sizes[name] = min(size, args.source_mb * 1e6) if args.source_mb else size
        else:                    # the stdlib: the rest of it read (~11 MB, a fraction of a second)
            sizes[name] = sum(map(len, samples[name])) + sum(map(len, docs))
    sample = [d for s in samples.values() for d in s]
    tok_s = tok_bytes = 0.0
    if tok is None:
        t = clock()
        tok = tokenizer.train_tokenizer(sample, args.vocab_size)
        tok_s = (clock() - t) / sum(map(len, sample))
        tok_bytes = sum(min(sizes[n], args.tok_train_mb * 1e6 * mix[n] / sum(mix.values())) for n in mix)

    def per_byte(docs):          # what prepare does to a document once read: hash, leak filter, tokens
        t = clock()
        for d in docs:
            corpus.doc_hash(d)
            tasks.is_heldout(d, index)
        for ids in tok.encode_batch(docs):
            np.asarray(ids + [tok.eot_id], dtype=np.uint16)
        return (clock() - t) / max(1, sum(map(len, docs)))
    total_s = (fixed_s + args.tasks_n * gen_s + tok_bytes * tok_s
               + sum(sizes[n] * per_byte(samples[n]) for n in mix))
    basis = (f"timed on this machine's CPU on {n_tasks} tasks and {sample_mb} MB per source, scaled to "
             f"{args.tasks_n} tasks, {sum(sizes.values()) / 1e6:.0f} MB of text, "
             f"{tok_bytes / 1e6:.0f} MB of tokenizer training; repair transcripts not counted")
    return total_s / 60, basis


def finish_plan(plan, mem_gb_device):
    """Prints the plan (stderr lines, then the JSON line on stdout) and exits; refuses with one line
    when the estimated memory does not fit the device."""
    if plan["est_gpu_mem_gb"] > 0.9 * mem_gb_device:
        die(f"plan: ~{plan['est_gpu_mem_gb']:.0f} GB per process exceeds the {plan['device_type']}'s "
            f"{mem_gb_device} GB: use a smaller --micro-batch (now {plan['micro_batch']})")
    for k, v in plan.items():
        print(f"plan  {k:>18}: {v}", file=sys.stderr)
    print("plan  (est_* are estimates: a FLOP count at the assumed utilisation, not a measurement"
          + ("; est_prep_min: a timed sample, scaled (est_prep_basis)" if "est_prep_min" in plan else "") + ")",
          file=sys.stderr)
    print_summary(plan)
    sys.exit(0)


def rl_plan(args, world):
    """train_rl.py --dry-run: the plan of an RL run (then exit). The model is --init-from's, else the
    one train_pretrain.py's preset of the same name would build. Assumed, and stated in the plan: a
    prompt of PROMPT_TOKENS, every completion at --max-new-tokens, two sampling rounds per step with
    --dynamic-sampling, decoding at a tenth of PLAN_MFU (each token reads every weight), no time
    for the sandbox (it runs beside generation on the CPU cores)."""
    from model import GPTConfig
    tasks_per_rank(args.batch_tasks, world)
    if args.init_from and os.path.isfile(args.init_from):
        cfg = GPTConfig(**torch.load(args.init_from, map_location="cpu", mmap=True, weights_only=False)["model_config"])
    else:
        import subprocess
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_pretrain.py")
        out = subprocess.run([sys.executable, script, "--preset", args.preset, "--dry-run"], capture_output=True,
                             text=True)
        if out.returncode:
            die(f"plan: train_pretrain.py --preset {args.preset} --dry-run failed: {out.stderr.strip()[-300:]}")
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
    head_dim = cfg.n_embd // cfg.n_head
    kv = args.gen_batch * seq * cfg.n_layer * 2 * cfg.n_kv_head * head_dim * 2
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


# ---------------------------------------------------------------------------------------------
# Checkpoints: written to a temp file in the same directory, fsynced, then renamed over the
# target, so a crash mid-write never leaves a truncated checkpoint where a good one was.

@contextmanager
def atomic_open(path, mode="w"):
    """open() for writing, atomically: the file appears under `path` complete (flushed, fsynced,
    renamed over any old one) or not at all. Checkpoints, token caches, JSONL outputs."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_save(obj, path):
    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


def save_checkpoint(path, model, tokenizer, **extra):
    """model_config + weights + the tokenizer itself (a few hundred KB of JSON), so eval and RL
    need nothing but this one file. `extra`: optimizer, step, rng, data position, args, ..."""
    model = getattr(model, "module", model)          # unwrap DDP
    model = getattr(model, "_orig_mod", model)       # unwrap torch.compile
    atomic_save({"model_config": asdict(model.config), "model": model.state_dict(),
                 "tokenizer": tokenizer.to_dict(), **extra}, path)


def load_checkpoint(path, device="cpu"):
    """Returns (model, tokenizer, checkpoint dict). Any problem is a one-line error."""
    if not path or not os.path.isfile(path):
        die(f"no checkpoint at {path!r}")
    from model import GPT, GPTConfig  # imported here so common.py stays importable on its own
    from data.tokenizer import Tokenizer
    try:
        # on the CPU: the model moves below, the optimizer state follows its parameters when loaded,
        # and RNG states must stay CPU tensors (set_rng_state)
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        cfg = GPTConfig(**ckpt["model_config"])
        model = GPT(cfg)
        model.load_state_dict(ckpt["model"])
        tok = Tokenizer.from_dict(ckpt["tokenizer"])
    except Exception as e:  # truncated file, wrong format, missing keys, shape mismatch ...
        die(f"cannot load checkpoint {path!r}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if tok.vocab_size > cfg.vocab_size:
        die(f"checkpoint {path!r}: tokenizer has {tok.vocab_size} tokens but the model only {cfg.vocab_size}")
    return model.to(device), tok, ckpt


def rng_state():
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    """Restores rng_state(). CPU ByteTensors whatever the checkpoint was mapped to; the CUDA states of
    the GPUs this process sees (a run saved on 8 may resume on 1)."""
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s.cpu(), i)


# ---------------------------------------------------------------------------------------------
# Logging

def reset_metrics(path):
    """A fresh run (not --resume) into a used run directory replaces its ckpt.pt, so it starts a new
    metrics.jsonl too: one run's log never mixes with another's."""
    if os.path.exists(path):
        os.remove(path)


def log_metrics(path, record):
    """Append one JSON line (metrics.jsonl in the run directory)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def print_summary(d):
    """The last stdout line of every script: one JSON object that tests and tools parse."""
    print(json.dumps(d), flush=True)
