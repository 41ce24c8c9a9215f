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
from contextlib import contextmanager
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
    for k, v in presets[preset].items():     # a name without a flag: a setting of the preset alone
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
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
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
    """Returns (model, tokenizer, checkpoint dict) of this project's checkpoint (a Hugging Face model
    directory too: hf.load_checkpoint). Any problem is a one-line error."""
    if not path or not os.path.isfile(path):
        die(f"no checkpoint at {path!r}")
    from model import GPT, GPTConfig  # imported here so common.py stays importable on its own
    from tokenizer import Tokenizer
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
