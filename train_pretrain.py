"""
Phase one of the Composer 2 recipe (arXiv 2603.24477): (continued) pretraining of the small MoE
GPT on a code-dominated data mix. The report's finding to honour: lower pretraining loss turned
into better RL, so this stage must be efficient and its loss trustworthy.

    python train_pretrain.py --preset smoke --out-dir runs/pt-smoke          # seconds on 2 cores
    python train_pretrain.py --preset cpu                                     # ~9-21 min on 2 cores
    OMP_NUM_THREADS=1 python train_pretrain.py --preset cpu     # when other processes share the cores
    python train_pretrain.py --preset gpu                     # one GPU; add --dry-run for its time estimate
    python -m torch.distributed.run --nproc_per_node 8 train_pretrain.py --preset gpu   # one node
    python -m torch.distributed.run --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \
        --nproc_per_node 8 train_pretrain.py --preset gpu                     # (node-rank 1 on the other)
    # your code (a directory of *.py, or JSONL with a "text" field) mixed with the built-in sources:
    python train_pretrain.py --data code=~/src/repo --data web=docs.jsonl \
        --mix stdlib=0.3,tasks=0.4,code=0.2,web=0.1
    python train_pretrain.py --init-from runs/a/ckpt.pt --mix tasks=1 --out-dir runs/b   # continued pretrain
    python train_pretrain.py --init-from runs/b/ckpt.pt --seq-len 1024 --max-steps 200 --out-dir runs/long
    python train_pretrain.py --preset cpu --out-dir runs/b --resume     # continue exactly where it stopped

Reads top to bottom: presets/args, setup, data (corpus.py: sources -> held-out filter -> split ->
tokenizer -> token cache), model, optimizer, training loop, summary. --out-dir gets ckpt.pt (model, tokenizer,
optimizer, step, RNG, data position, args), tokenizer.json, metrics.jsonl and cache/ (token caches,
unless --cache-dir). The last stdout line is a JSON summary.
"""
import argparse
import dataclasses
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import hf
from infra import common, plan
from data import corpus
import sampling
import env
from data import repair
from data import repos
from data import tasks
from model import GPT, GPTConfig, MoE, add_tokens, autocast, extend_context
from tokenizer import Tokenizer

# Presets. A name with a flag is a default that the flag overrides; the others (n_head, n_kv_head,
# vocab_size, tok_train_mb, val_tokens, log_every, sample_every, sample_tokens) are settings of the
# preset alone: edit PRESETS to change them (common.parse_args). MoE everywhere (the recipe's model);
# aux-loss-free balancing as in DeepSeek-V3 / Kimi K2, the recipe's base family (it also keeps the loss
# of 1 and of N data-parallel processes identical: no balancing term computed from partial batch counts).
# The mix is task-heavy: the solved env tasks are the targeted coding data that RL later trains on.
ARCH = ("n_layer", "n_embd", "n_head", "n_kv_head", "n_expert", "top_k", "n_shared_expert",
        "expert_hidden", "balance")
PRESETS = {
    "smoke": dict(vocab_size=512, tok_train_mb=0.2, source_mb=0.3, tasks_n=600, repair_frac=0.0, agent_n=0,
                  holdout_n=200, mix="stdlib=0.5,tasks=0.5", n_layer=2, n_embd=64, n_head=4, n_kv_head=2,
                  n_expert=4, top_k=2, n_shared_expert=1, expert_hidden=64, balance="bias",
                  seq_len=128, micro_batch=8, batch_tokens=2048, max_steps=16, warmup_steps=4, lr=3e-3,
                  log_every=4, eval_every=8, val_tokens=2048, sample_every=8, sample_tokens=24, ckpt_every=8),
    # cpu: 4.9M tokens on 2 cores. Sized for the RL after it, not for its own loss: a longer pretraining
    # left RL more to build on (Finding 1; docs/results.md).
    "cpu": dict(vocab_size=4096, tok_train_mb=2.0, source_mb=6.0, tasks_n=30000, repair_frac=0.0, agent_n=0,
                holdout_n=1000, mix="stdlib=0.35,tasks=0.65", n_layer=4, n_embd=128, n_head=4, n_kv_head=2,
                n_expert=8, top_k=2, n_shared_expert=1, expert_hidden=128, balance="bias",
                seq_len=256, micro_batch=16, batch_tokens=4096, max_steps=1200, warmup_steps=50, lr=3e-3,
                log_every=10, eval_every=300, val_tokens=32768, sample_every=300, sample_tokens=96,
                ckpt_every=300),
    # gpu: ~74M active / 256M total, ~650M tokens (`--dry-run` gives the plan and its time estimate).
    # The built-in corpus is small (stdlib ~3.5M tokens, repeated), so the generated tasks carry most
    # of it; add --data for real code.
    "gpu": dict(vocab_size=8192, tok_train_mb=20.0, source_mb=0.0, tasks_n=1_000_000, repair_frac=0.0,
                agent_n=0, holdout_n=1000, mix="stdlib=0.3,tasks=0.7", n_layer=12, n_embd=768, n_head=12,
                n_kv_head=4, n_expert=16, top_k=2, n_shared_expert=1, expert_hidden=512, balance="bias",
                seq_len=1024, micro_batch=32, batch_tokens=131072, max_steps=5000, warmup_steps=200,
                lr=1e-3, log_every=20, eval_every=500, val_tokens=262144, sample_every=1000,
                sample_tokens=160, ckpt_every=500),
}
# Fixed settings, the same in every preset (the flags keep to run settings and the ablations that
# README.md and docs/recipe.md list).
DATA_EXT = ".py"      # the files read from a --data directory: Python, the language of the env tasks
TEXT_FIELD = "text"   # the document field of a --data JSONL file, the usual name in code datasets
MAX_FILE_KB = 1024    # larger files / documents are skipped (and counted): generated code or data
VAL_FRAC = 0.02       # documents held out for validation, by content hash (corpus.heldout_code_texts: 0.02)
N_DENSE_LAYERS = 1    # leading blocks with a dense MLP: Kimi K2's one (DeepSeek-V3 has three)
MIN_LR_FRAC = 0.0     # WSD decays the LR to 0 ...
DECAY_FRAC = 0.2      # ... over the last 20% of the steps (Hägele et al. 2024: this cooldown matches cosine)
WEIGHT_DECAY = 0.1    # AdamW decay of matmul weights, as nanoGPT and OLMo
GRAD_CLIP = 1.0       # global gradient-norm clip, as nanoGPT and OLMo
COMPILE = False       # torch.compile the training model: eager, as every preset ran (never timed here)
PREP_WAIT_MIN = 120   # minutes the other ranks wait for rank 0's prepared data (gpu preset: 15-30 min)

p = common.ArgumentParser(prog="train_pretrain.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
a = p.add_argument
a("--data", action="append", default=[], metavar="[NAME=]PATH", help="extra source: a directory (its "
  "*.py files) or a .jsonl file (a \"text\" field per line); repeatable; NAME: data, data2, ...; weight it "
  "in --mix")
a("--mix", help="source weights NAME=W,... (normalised; 0 drops a source); built in: stdlib (this "
  "interpreter's Python stdlib), tasks (solved env train-split tasks), agent (a teacher's tool-use "
  "transcripts of repository tasks, --agent-n; needs --init-from: its tokenizer gets the tool tokens)")
a("--tasks-n", type=int, help="solved env train-split tasks in the tasks source")
a("--task-difficulties", default="", help="difficulty levels of those tasks, as train_rl.py's --difficulties "
  "(e.g. 1-5: every level equally often); empty = the task world's own mix, mostly 3-4 step programs")
a("--repair-frac", type=float, help="fraction of those tasks that also get a repair transcript (repair.py: a "
  "wrong body, the sandbox's feedback, the fix); 0 = none")
a("--agent-n", type=int, help="train repository tasks in the agent source (data/repos.py transcripts)")
a("--source-mb", type=float, help="cap per source in MB (deterministic subsample by path/line hash; 0 = all)")
a("--holdout-n", type=int, help="env test-split tasks (seed 0, as eval.py uses) whose functions and prompts "
  "never reach training; HumanEval's and the canaries' are always excluded")
a("--cache-dir", help="token/tokenizer cache, default OUT_DIR/cache; share it between runs")
# architecture (ignored with --init-from / --resume, which use the checkpoint's)
for flag, text in [("n-layer", "transformer blocks"), ("n-embd", "model width"),
                   ("top-k", "experts per token"),
                   ("n-expert", "routed experts per MoE layer (the dense ablation at the MoE's active "
                                "size, as lab/experiments/dense_vs_moe.sh: --n-expert 1 --top-k 1 "
                                "--n-shared-expert 0 --expert-hidden (top_k + n_shared_expert) x "
                                "expert_hidden, 384 on cpu)"),
                   ("n-shared-expert", "always-on shared experts"),
                   ("expert-hidden", "hidden width of an expert")]:
    a(f"--{flag}", type=int, help=text)
a("--balance", choices=["aux", "bias", "none"], help="MoE balancing: Switch aux loss + z-loss, DeepSeek-V3 "
  "aux-loss-free bias, none")
a("--seq-len", type=int, help="training context; with --init-from: default the checkpoint's, longer = "
  "context extension (NTK-aware RoPE base scaling)")
a("--init-from", help="checkpoint to continue pretraining from (weights + tokenizer; fresh optimizer, LR "
  "re-warmup)")
a("--resume", action="store_true", help="continue exactly from OUT_DIR/ckpt.pt (optimizer, step, data "
  "position, RNG): rerun the same command plus --resume")
a("--lr", type=float, help="peak learning rate (AdamW)")
a("--warmup-steps", type=int, help="linear warmup steps")
a("--batch-tokens", type=int, help="global batch in tokens, the same whatever the number of processes")
a("--micro-batch", type=int, help="sequences per forward pass per process (gradient accumulation fills the "
  "rest)")
a("--max-steps", type=int, help="optimizer steps (the LR schedule spans them)")
a("--stop-at-step", type=int, default=0, help="stop and checkpoint after this step, schedule unchanged "
  "(a time slot; --resume continues); 0 = off")
a("--eval-every", type=int, help="steps between validation loss / bits-per-byte (and at the end)")
a("--ckpt-every", type=int, help="steps between checkpoints (and at the end)")
plan.add_plan_args(p)
argv = sys.argv[1:]
args = common.parse_args(p, PRESETS, argv)
# flags typed on the command line (the preset fills the rest): these win over a checkpoint's values
given = common.typed_options(p, argv)

# ---------------------------------------------------------------------------------------------
# Setup. Bad arguments die on every rank before any collective, so nothing hangs; the process
# group itself starts after the data is prepared (below), so no rank waits in a collective for it.

rank, local_rank, world = common.dist_env()
if args.dry_run:
    world = args.world_size or world
master = rank == 0
if not args.dry_run:
    os.makedirs(args.out_dir, exist_ok=True)
cache_dir = args.cache_dir or os.path.join(args.out_dir, "cache")
ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
torch.manual_seed(args.seed)
t_start = time.time()

# A checkpoint to start from brings its tokenizer, architecture and (unless --seq-len is given)
# context length; --resume also brings the run's own arguments, so a changed preset cannot alter
# a run midway (flags typed now still win). load_checkpoint dies with one line on a bad file.
resume = ckpt_path if args.resume and os.path.isfile(ckpt_path) else None
if args.resume and not resume and not args.init_from:
    common.die(f"--resume: no checkpoint at {ckpt_path} (and no --init-from to start from)")
if master and not resume and not args.dry_run:
    common.reset_metrics(metrics_path)
init = ckpt = tok = None
if resume or args.init_from:   # a model directory's --dry-run reads its config.json alone (device meta)
    meta = args.dry_run and not resume and os.path.isdir(args.init_from)
    init, tok, ckpt = hf.load_checkpoint(resume or args.init_from, device="meta" if meta else "cpu")
    if resume:
        keep = given | {"resume", "stop_at_step", "dry_run", "world_size", "plan_device"}   # run control
        vars(args).update({k: v for k, v in ckpt["args"].items() if k not in keep})
    if "seq_len" not in given and not resume:
        args.seq_len = init.config.seq_len
# corpus.py reads its settings from args, and the data's key (PREP_ARGS) is made from there too
args.data_ext, args.text_field, args.max_file_kb, args.val_frac = DATA_EXT, TEXT_FIELD, MAX_FILE_KB, VAL_FRAC
try:
    tasks.parse_difficulties(args.task_difficulties)
except ValueError as e:
    common.die(f"--task-difficulties: {e}")
if not 0 <= args.repair_frac <= 1:
    common.die(f"--repair-frac must be between 0 and 1, got {args.repair_frac}")
if not args.source_mb >= 0:
    common.die(f"--source-mb must be >= 0 (0 = no cap), got {args.source_mb}")
if init is None:   # a bad architecture is refused now, before any data is prepared
    try:
        scratch = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, n_dense_layers=N_DENSE_LAYERS,
                            **{k: getattr(args, k) for k in ARCH})
    except ValueError as e:
        common.die(str(e))
user_data, mix = corpus.parse_sources(args.data, args.mix)
if "agent" in mix:   # the agent's bootstrap (data/repos.py transcripts): a base model learns the tools
    if tok is None:
        common.die("--mix agent=...: the agent transcripts need --init-from (a base model whose tokenizer "
                   "gets the tool tokens)")
    if args.agent_n < 1:
        common.die("--mix agent=...: give --agent-n N (repository tasks to write transcripts of)")
    tok = tok if tok.tools else tok.with_tools()   # the tool tokens after every old id (model.add_tokens)

T = args.seq_len
mbs, accum = plan.fit_micro_batch(args.batch_tokens, T, world, args.micro_batch, "micro_batch" in given)


def dry_run():
    """--dry-run: the plan for --world-size processes on --plan-device (common.py), then exit. Its
    est_prep_min, rank 0's data preparation (once; a later run reuses it), is timed here on a sample
    of 200 tasks and 0.5 MB per source and scaled to the preset's sizes (corpus.prep_minutes; how, in
    est_prep_basis): on this machine's CPU, not the GPU host's."""
    cfg = init.config if init is not None else scratch     # from scratch: the configuration checked above
    name, peak, mem = plan.plan_device(args)
    n_total, n_active, flops_per_token = plan.model_plan(cfg)
    tokens = args.batch_tokens * args.max_steps
    p = {
        "script": "train_pretrain.py", "preset": args.preset, "world_size": world, "device_type": name,
        "tokens_per_step": args.batch_tokens, "micro_batch": mbs, "grad_accum": accum, "seq_len": T,
        "steps": args.max_steps, "tokens": tokens, "params_total": n_total, "params_active": n_active,
        "flops_per_token": flops_per_token, "peak_flops": peak, "assumed_mfu": plan.PLAN_MFU,
        "est_gpu_mem_gb": round(plan.memory_gb(cfg, n_total, mbs, T), 1),
        "est_run_min": round(flops_per_token * tokens / (world * peak * plan.PLAN_MFU) / 60, 1)}
    plan.check_memory(p, mem)       # a plan that cannot fit is refused before the prep is timed (seconds)
    prep_min, prep_basis = corpus.prep_minutes(args, mix, user_data, tok)
    plan.finish_plan({**p, "est_prep_min": round(prep_min, 2), "est_prep_basis": prep_basis,
                      "model_config": dataclasses.asdict(cfg)}, mem)


if args.dry_run:
    dry_run()


# ---------------------------------------------------------------------------------------------
# Data (corpus.py): sources -> dedupe -> held-out filter -> split -> tokenizer -> token caches.

# What the prepared data depends on: these settings, --init-from's tokenizer (a resumed run's own was
# trained from this data), the --data files as they are now, this interpreter (the stdlib source) and
# the code that makes the data.
PREP_ARGS = ("data_ext", "text_field", "tasks_n", "task_difficulties", "repair_frac", "agent_n", "source_mb",
             "max_file_kb", "val_frac", "holdout_n", "vocab_size", "tok_train_mb", "seed")
DATA_CODE = ("data/corpus.py", "data/tasks.py", "data/world.py", "data/families.py", "data/repair.py",
             "data/repos.py", "data/search.py", "tokenizer.py",
             "env.py", "sandbox.py")   # env, sandbox: the harness observed


def prepared_data():
    """Rank 0 prepares the data once per definition (the 1M-task gpu preset: 15-30 min on one core)
    and writes a manifest; a later run, --resume, or another rank reads it. The other ranks wait for
    that file, not in a collective (whose timeout would end the run). Several nodes: the cache
    directory must be on a filesystem they all see at the same path."""
    paths = []
    for path in user_data.values():
        paths += ([path] if os.path.isfile(path)
                  else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs])
    files = sorted((f, os.path.getsize(f), os.path.getmtime(f)) for f in paths)
    here = os.path.dirname(os.path.abspath(__file__))
    code = [open(os.path.join(here, path)).read() for path in DATA_CODE]
    key = corpus.doc_hash(json.dumps([{k: getattr(args, k) for k in PREP_ARGS}, mix, user_data, files,
                                      sys.version, tok.fingerprint() if args.init_from else None, code]))[:16]
    manifest = os.path.join(cache_dir, f"prepared-{key}.json")

    def ready():
        if not os.path.isfile(manifest):
            return False
        with open(manifest) as f:
            return all(map(os.path.isfile, json.load(f)["paths"].values()))
    if master and ready():
        print(f"data: prepared before, reused: {manifest}", file=sys.stderr)
    elif master:   # the leak filter, and the "tasks" source: solved train tasks (+ repairs)
        index = tasks.heldout_index(args.holdout_n)
        prep = corpus.prepare(args, mix, user_data, tok, cache_dir, lambda d: tasks.is_heldout(d, index),
                              {"tasks": lambda: repair.tasks_source(args),
                               "agent": lambda: repos.agent_source(args, tok)})
        with common.atomic_open(manifest) as f:
            json.dump(prep, f)
    deadline = time.time() + 60 * PREP_WAIT_MIN
    while not ready():
        if time.time() > deadline:
            common.die(f"rank {rank}: no prepared data at {manifest} after {PREP_WAIT_MIN} minutes: on "
                       "several nodes, --out-dir (or --cache-dir) must be on a filesystem every node sees")
        time.sleep(2)
    with open(manifest) as f:
        return json.load(f)


prep = prepared_data()
rank, local_rank, world, device = common.setup_ddp(args.device)
ddp = world > 1
tok = Tokenizer.from_dict(prep["tokenizer"])
if master:
    tok.save(os.path.join(args.out_dir, "tokenizer.json"))
arrays = corpus.open_caches(prep)
names = list(mix)
for name in names:
    if len(arrays[f"{name}/train"]) <= T:
        common.die(f"source {name!r} has only {len(arrays[name + '/train'])} training tokens; need more than "
                   f"--seq-len {T}")
weights = np.array([mix[n] for n in names]) / sum(mix.values())
lens = np.array([len(arrays[f"{n}/train"]) for n in names])


def get_batch(step):
    """This rank's rows of the global batch of `step`: (accum * micro_batch, T + 1) tokens. The
    global batch is a function of (seed, step) alone (counter-based RNG): the data position in a
    checkpoint is just the step, resume is exact, and any number of processes sees the same
    global batch (rank r takes slots r, r + world, ...), so DDP losses equal single-process ones.
    Rows are windows of the packed token stream: no padding, so every position is rightly counted
    as MoE expert load (right-padded batches, as in RL, pass model.py's `valid` mask instead)."""
    rng = np.random.default_rng([args.seed, 1, step])
    n = accum * mbs * world
    src = rng.choice(len(names), size=n, p=weights)
    starts = (rng.random(n) * (lens[src] - T)).astype(np.int64)
    rows = [(m * world + rank) * mbs + j for m in range(accum) for j in range(mbs)]
    xy = np.stack([arrays[f"{names[src[i]]}/train"][starts[i]:starts[i] + T + 1] for i in rows])
    xy = xy.astype(np.int64)
    return torch.from_numpy(xy).to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------
# Model: from scratch, from --init-from (optionally context-extended), or resumed.

if init is None:
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=T, n_dense_layers=N_DENSE_LAYERS,
                          **{k: getattr(args, k) for k in ARCH}))
else:
    model = init
    if model.config.n_mtp and not resume:
        # MTP modules serve decoding and are trained afterwards (train_mtp.py); pretraining's forward
        # never uses them, and DDP refuses parameters that get no gradient
        model.mtp, model.config.n_mtp = nn.ModuleList(), 0
        if master:
            print("--init-from: its MTP modules are dropped (train_mtp.py adds them after pretraining)",
                  file=sys.stderr)
    if T > model.config.seq_len and not resume:   # context extension (model.extend_context)
        old = model.config
        model, theta = extend_context(model, T)
        if master:
            print(f"context extension {old.seq_len} -> {T}: rope_theta {old.rope_theta:g} -> {theta:g}",
                  file=sys.stderr)
if tok.vocab_size > model.config.vocab_size and tok.tools and init is not None and not resume:
    model = add_tokens(model, tok.vocab_size)      # the tool tokens' rows (model.add_tokens), before any step
if tok.vocab_size > model.config.vocab_size:
    common.die(f"tokenizer has {tok.vocab_size} tokens but the model only {model.config.vocab_size}")
raw = model.to(device)
if COMPILE:
    if device.type == "cpu":   # F.grouped_mm's compile-time kernel is bf16-only: per-expert matmuls instead
        MoE.dispatch = "sorted"
    model = torch.compile(model)
if ddp:
    model = nn.parallel.DistributedDataParallel(model,
                                                device_ids=[local_rank] if device.type == "cuda" else None)
n_total, n_active = raw.num_params()

# AdamW. Weight decay only on matmul weights (ndim >= 2, stacked experts included): norm gains are
# scales whose pull to 0 fights the normalisation, and decoupled decay would shrink the embedding
# rows of rare tokens every step even without a gradient (nanoGPT, OLMo do the same).
emb = {id(m.weight) for m in raw.modules() if isinstance(m, nn.Embedding)}
params = [q for q in raw.parameters() if q.requires_grad]
decay = [q for q in params if q.ndim >= 2 and id(q) not in emb]
no_decay = [q for q in params if q.ndim < 2 or id(q) in emb]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                              eps=1e-8, fused=device.type == "cuda")
start_step = 0
if resume:
    optimizer.load_state_dict(ckpt["optimizer"])
    start_step = ckpt["step"]
    common.set_rng_state(ckpt["rng"])


def lr_at(step):
    """Warmup-Stable-Decay (MiniCPM, Hu et al. 2024; Hägele et al. 2024): linear warmup, a plateau,
    linear decay over the last DECAY_FRAC. The plateau does not depend on the run length (unlike
    cosine), so a stable-phase checkpoint can be continued or decayed later; --init-from warms up
    again because its fresh optimizer has no moment estimates yet."""
    decay_start = int(args.max_steps * (1 - DECAY_FRAC))
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if step < decay_start:
        return args.lr
    frac = (args.max_steps - step) / max(1, args.max_steps - decay_start)
    return args.lr * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * frac)


token_bytes = corpus.token_bytes(tok, device)     # for bits-per-byte (corpus.py)


@torch.no_grad()
def evaluate():
    """Validation CE (nats/token) and bits-per-byte per source and pooled, on fixed windows of the
    first val_tokens (a preset setting) of each source's validation stream. Every rank evaluates the
    same windows (they are few): no collective needed, and no-grad forwards never touch the MoE load
    counters."""
    raw.eval()
    out, tot = {}, np.zeros(4)
    for name in names:
        arr = arrays[f"{name}/val"]
        n = min(len(arr) - 1, args.val_tokens) // T
        if n <= 0:
            continue
        window = torch.from_numpy(np.asarray(arr[:n * T + 1], dtype=np.int64)).to(device)
        xs, ys = corpus.inputs_targets(window, tok.vocab_size)
        xs, ys = xs.view(n, T), ys.view(n, T)
        s = np.zeros(4)   # nats (all targets), targets, nats (targets with bytes), bytes
        for i in range(0, n, mbs):
            with autocast(device):
                logits, _ = raw(xs[i:i + mbs])
            y = ys[i:i + mbs].reshape(-1)
            keep = y >= 0
            nll = F.cross_entropy(logits.float().view(-1, logits.size(-1))[keep], y[keep], reduction="none")
            s += [nll.sum().item(), nll.numel(), *corpus.nats_and_bytes_of(nll, y[keep], token_bytes)]
        out[f"val/{name}/loss"], out[f"val/{name}/bpb"] = s[0] / s[1], corpus.to_bits_per_byte(s[2], s[3])
        tot += s
    raw.train()
    if tot[1]:
        out["val_loss"], out["val_bpb"] = tot[0] / tot[1], corpus.to_bits_per_byte(tot[2], tot[3])
    return out


sample_task = tasks.generate_tasks("test", 1, seed=args.seed)[0]


def sample_text(step):
    """A short completion of a held-out env prompt, to watch the model learn to write code."""
    gen = torch.Generator(device=device).manual_seed(args.seed + step)   # not the training RNG
    raw.eval()
    out = sampling.generate(raw, [tok.encode(env.render_prompt(sample_task))], args.sample_tokens,
                                  temperature=0.8, stop_ids=(tok.eot_id,), generator=gen)[0]
    raw.train()
    return env.extract_completion(tok.decode(out["tokens"]))


# ---------------------------------------------------------------------------------------------
# Training loop

# MFU's peak: on CUDA the dense bf16 peak of this device (plan.DEVICES). On CPU a datasheet peak
# means little on a shared VM, so MFU is against what a 1024^3 fp32 matmul reaches here with this
# process's threads (the fastest of 20, so a neighbour's load does not lower it); a GPU missing from
# the table is measured the same way, with a 4096^3 bf16 matmul.
cuda = device.type == "cuda"
spec = plan.device_spec(torch.cuda.get_device_name(device)) if cuda else None
peak = spec[1] if spec else None
if peak is None:
    size, dtype = (4096, torch.bfloat16) if cuda else (1024, torch.float32)
    x, best = torch.randn(size, size, dtype=dtype).to(device), float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        x @ x
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    peak = 2 * size ** 3 / best
peak *= world
flops_per_token = raw.estimate_flops_per_token()
tokens_per_step = accum * mbs * T * world
if master:
    print(f"model: {n_total / 1e6:.2f}M params, {n_active / 1e6:.2f}M active | {world} proc x {accum} accum "
          f"x {mbs} seq x {T} = {tokens_per_step} tokens/step | mix: "
          + ", ".join(f"{n} {w:.2f} ({lens[i] / 1e6:.2f}M tok)"
                      for i, (n, w) in enumerate(zip(names, weights))),
          file=sys.stderr)
    print(f"mfu: {flops_per_token / 1e6:.1f} MFLOP per token (6 x active matmul params + causal attention: "
          f"model.estimate_flops_per_token) over a peak of {peak / 1e12:.1f} TFLOP/s", file=sys.stderr)


def train_step(step):
    """One optimizer step on the global batch of `step`: the micro-batches' gradients accumulated (DDP
    all-reduces them once, at the last), the global norm clipped, AdamW, then the MoE's aux-loss-free
    bias moved by the step's expert loads. A non-finite loss or gradient stops the run before the
    update, on every rank. Returns (mean loss, gradient norm, learning rate)."""
    lr = lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    xy = get_batch(step)
    loss_sum = torch.zeros((), device=device)
    for m in range(accum):
        x, y = corpus.inputs_targets(xy[m * mbs:(m + 1) * mbs], tok.vocab_size)
        with model.no_sync() if ddp and m < accum - 1 else nullcontext():   # all-reduce once per step
            with autocast(device):
                _, loss = model(x, y)       # cross-entropy + the MoE balancing terms
            (loss / accum).backward()
        loss_sum += loss.detach()
    gnorm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP or float("inf")).item()
    loss_val = common.all_reduce_mean(loss_sum.item() / accum)
    if not (math.isfinite(loss_val) and math.isfinite(gnorm)):   # same values on every rank: all stop
        stop_non_finite(step, loss_val, gnorm, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    raw.after_optimizer_step()       # aux-free bias update + reset of the global-batch load counters
    return loss_val, gnorm, lr


def stop_non_finite(step, loss_val, gnorm, lr):
    good = (torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=False)["step"]
            if os.path.isfile(ckpt_path) else None)
    bar.close()                      # the progress bar's line ends before the error's
    common.cleanup_ddp()
    common.die(f"non-finite loss {loss_val} (grad norm {gnorm}) at step {step + 1}, lr {lr:.3g}: stopped "
               "before applying it; last good checkpoint: "
               + (f"{ckpt_path} (step {good})" if good else "none")
               + "; try a lower --lr, or --resume from it")


losses, step_times, val = [], [], {}
bar = tqdm(range(start_step, args.max_steps), disable=not master, dynamic_ncols=True, file=sys.stderr,
           initial=start_step, total=args.max_steps)
for step in bar:
    if args.stop_at_step and step >= args.stop_at_step:
        break
    t0 = time.perf_counter()
    loss_val, gnorm, lr = train_step(step)
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_times.append(time.perf_counter() - t0)
    losses.append(loss_val)
    tok_s = tokens_per_step / step_times[-1]
    rec = {"step": step + 1, "loss": loss_val, "lr": lr, "grad_norm": gnorm, "tok_s": tok_s,
           "mfu": flops_per_token * tok_s / peak, "tokens": (step + 1) * tokens_per_step}
    last = step + 1 in (args.max_steps, args.stop_at_step)
    if (step + 1) % args.log_every == 0 or last:
        rec.update(raw.moe_metrics())
    if (step + 1) % args.eval_every == 0 or last:
        val = evaluate()
        rec.update(val)
        if master and val:
            tqdm.write(f"step {step + 1}: val loss {val['val_loss']:.4f}, {val['val_bpb']:.4f} bits/byte",
                       file=sys.stderr)
    if master and args.sample_every and ((step + 1) % args.sample_every == 0 or last):
        rec["sample"] = sample_text(step + 1)
        tqdm.write(f"--- sample, step {step + 1}:\n{env.render_prompt(sample_task)}{rec['sample']}\n---",
                   file=sys.stderr)
    if master:
        common.log_metrics(metrics_path, rec)
        bar.set_postfix(loss=f"{loss_val:.4f}", tok_s=f"{tok_s:.0f}", mfu=f"{100 * rec['mfu']:.1f}%",
                        lr=f"{lr:.2e}")
    if ((step + 1) % args.ckpt_every == 0 or last) and master:   # data position = the step (see get_batch)
        common.save_checkpoint(ckpt_path, raw, tok, optimizer=optimizer.state_dict(), step=step + 1,
                               rng=common.rng_state(), data={"seed": args.seed, "step": step + 1},
                               args=vars(args), init_from=args.init_from, val=val, kind="pretrain")
bar.close()
steps_done = start_step + len(losses)
val = val if losses else evaluate()   # nothing left to train (already at --max-steps): report the checkpoint

# ---------------------------------------------------------------------------------------------
# Summary: the last stdout line, one JSON object.
if master:
    timed = step_times[1:] or step_times   # the first step pays for allocator warmup / compilation
    tps = tokens_per_step * len(timed) / sum(timed) if timed else 0.0
    common.print_summary({
        "train_loss": float(np.mean(losses[-10:])) if losses else None,   # mean of the last 10 steps
        "val_loss": val.get("val_loss"), "val_bpb": val.get("val_bpb"), "tokens_per_s": tps,
        "mfu": flops_per_token * tps / peak, "params_total": n_total, "params_active": n_active,
        "ckpt": ckpt_path, "tokenizer": os.path.join(args.out_dir, "tokenizer.json"), "steps": steps_done,
        "tokens": steps_done * tokens_per_step, "wall_s": time.time() - t_start, "out_dir": args.out_dir,
        "data": prep["info"], "caches": prep["paths"],     # the teacher's actions on what it was shown
        "unpredictable_actions": prep["info"].get("agent", {}).get("unpredictable_actions")})
common.cleanup_ddp()
