"""
Multi-token prediction by self-distillation: a short stage after pretraining that gives a checkpoint
DeepSeek-V3's MTP modules (model.py: MTP), which then draft tokens for speculative decoding
(speculative.py: generate; the interactive command, agent.py, uses it).

    python train_mtp.py --preset cpu --init-from runs/cpu/pretrain/ckpt.pt --out-dir runs/cpu/mtp
    python train_mtp.py --init-from CKPT --n-mtp 2 --train-trunk     # depth 2, the trunk trained too
    python -m lab.bench speculative --ckpt runs/cpu/mtp/ckpt.pt           # what it buys

The loss: level m's logits at slot j and the main head's both predict token j+1, the level from the
trunk's state m tokens earlier, so the level learns the main head's distribution there,
KL(main || level m) with the teacher detached. Self-distillation rather than the data's next tokens:
speculative sampling keeps a draft as often as the drafter agrees with the model, not with the data.
The trunk, embedding and head stay frozen by default, so the checkpoint samples exactly what its
parent does; --train-trunk trains everything, with the language-model loss added so that the trunk
keeps predicting the data (DeepSeek-V3 trains its MTP modules with the model this way). The data is
the pretraining mix, read from the token caches the pretraining run left (--cache-dir, default its
run directory's cache/). The last stdout line is JSON: the checkpoint (ckpt) and each level's top-1
agreement with the main head on the held-out split (corpus.mtp_agreement; the mean over the sources).
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import hf
from infra import common
from data import corpus
from tokenizer import Tokenizer
from model import GPT, autocast

PRESETS = {
    "smoke": dict(n_mtp=1, steps=20, micro_batch=8, seq_len=128, lr=3e-3, warmup_steps=4, val_tokens=4096,
                  log_every=5),
    "cpu": dict(n_mtp=1, steps=150, micro_batch=8, seq_len=256, lr=3e-3, warmup_steps=10, val_tokens=32768,
                log_every=10),
    "gpu": dict(n_mtp=1, steps=2000, micro_batch=32, seq_len=1024, lr=1e-3, warmup_steps=100,
                val_tokens=262144, log_every=50),
}


def distill(model, x, y=None):
    """x (B, T) -> (loss, each level's top-1 agreement with the main head). The loss sums over levels
    the mean KL(main || level m) over the slots j >= m (before them a level reads zeros). y: the next
    tokens, given when the trunk trains too: its cross-entropy and MoE balancing loss are added."""
    pos = torch.arange(x.size(1), device=x.device)[None]
    with torch.set_grad_enabled(y is not None and torch.is_grad_enabled()):
        h, _ = model.trunk(x, pos)
        main = model.lm_head(h).float()
    teacher = main.detach().log_softmax(-1)
    loss, agree = 0.0, []
    for m, logits in enumerate(model.mtp_logits(h, x, pos), 1):
        q, p = logits.float().log_softmax(-1)[:, m:], teacher[:, m:]
        loss = loss + F.kl_div(q, p, log_target=True, reduction="sum") / p[..., 0].numel()
        agree.append((q.argmax(-1) == p.argmax(-1)).float().mean())
    if y is not None:
        loss = loss + F.cross_entropy(main.view(-1, main.size(-1)), y.reshape(-1), ignore_index=-1)
        loss = loss + sum(m.aux for m in model.moe_layers())
    return loss, torch.stack(agree)


def pretraining_data(args, ckpt):
    """The token caches of the run that pretrained the checkpoint (its manifest with the same
    tokenizer) and the mix to draw from: --mix, else the parent's own."""
    # --cache-dir, else the cache/ beside the checkpoint, or beside its parent's (an MTP checkpoint's)
    dirs = [args.cache_dir] if args.cache_dir else [os.path.join(os.path.dirname(os.path.abspath(c)), "cache")
                                                    for c in (args.init_from, ckpt.get("parent")) if c]
    cache_dir, want = " or ".join(dirs), Tokenizer.from_dict(ckpt["tokenizer"]).fingerprint()
    for path in sorted(p for d in dirs for p in glob.glob(os.path.join(d, "prepared-*.json"))):
        with open(path) as f:
            prep = json.load(f)
        if (Tokenizer.from_dict(prep["tokenizer"]).fingerprint() == want
                and all(map(os.path.isfile, prep["paths"].values()))):
            break
    else:
        common.die(f"no prepared pretraining data for this checkpoint's tokenizer in {cache_dir}: "
                   "pass --cache-dir (the cache directory of the train_pretrain.py run that made "
                   "--init-from)")
    arrays = corpus.open_caches(prep)
    spec = (args.mix or ckpt.get("args", {}).get("mix")
            or ",".join(f"{k.split('/')[0]}=1" for k in prep["paths"]))
    sources = sorted(k.split("/")[0] for k in arrays if k.endswith("/train"))   # what the caches hold
    mix = {name: w for name, w in corpus.parse_mix(spec, sources).items()
           if w > 0 and len(arrays[f"{name}/train"]) > args.seq_len}
    if not mix:
        common.die(f"--mix {spec!r}: no source with weight > 0 and more than --seq-len tokens")
    return arrays, mix


def model_with_mtp(init, n_mtp):
    """The checkpoint's model with n_mtp MTP modules: the trunk's weights (and any MTP modules the
    checkpoint has, up to n_mtp), new modules initialised as GPT initialises them."""
    if init.config.n_mtp == n_mtp:
        return init
    model = GPT(dataclasses.replace(init.config, n_mtp=n_mtp))
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in init.state_dict().items() if k in own}, strict=False)
    return model


def main(argv=None):
    p = common.ArgumentParser(prog="train_mtp.py", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--init-from", help="the pretrained checkpoint (train_pretrain.py), required")
    p.add_argument("--n-mtp", type=int, help="MTP depth: modules, i.e. tokens drafted per step")
    p.add_argument("--train-trunk", action="store_true", help="train the whole model (adds the LM loss), "
                   "not only the MTP modules; the checkpoint then samples differently from its parent")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, help="sequences per step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (at most the checkpoint's context)")
    p.add_argument("--lr", type=float,
                   help="peak learning rate (AdamW), linear warmup then cosine decay to 0")
    p.add_argument("--warmup-steps", type=int, help="linear warmup steps")
    p.add_argument("--mix", default="",
                   help="source weights NAME=W,... (empty: the parent's pretraining mix)")
    p.add_argument("--cache-dir", help="train_pretrain.py's token caches "
                   "(none: cache/ beside INIT_FROM or beside its parent)")
    p.add_argument("--val-tokens", type=int, help="held-out tokens per source for the final agreement")
    p.add_argument("--log-every", type=int, help="steps between log lines")
    args = common.parse_args(p, PRESETS, argv)
    if common.dist_env()[2] > 1:   # one short stage (minutes on a CPU): no process group, so refuse
        common.die(f"train_mtp.py runs in one process (torchrun started {common.dist_env()[2]}): run it "
                   "with plain python, on one GPU")
    if not args.init_from:
        common.die("--init-from CKPT is required (a train_pretrain.py checkpoint)")
    if args.n_mtp < 1 or args.steps < 1 or args.micro_batch < 1 or args.seq_len < 2 or not args.lr > 0:
        common.die("--n-mtp, --steps, --micro-batch must be >= 1, --seq-len >= 2, --lr > 0")
    t_start, device = time.time(), common.pick_device(args.device)
    torch.manual_seed(args.seed)
    init, tok, ckpt = hf.load_checkpoint(args.init_from, device="cpu")
    args.seq_len = min(args.seq_len, init.config.seq_len)
    arrays, mix = pretraining_data(args, ckpt)
    args.mix = ",".join(f"{k}={w:g}" for k, w in mix.items())   # kept in the checkpoint: a later run reads it
    model = model_with_mtp(init, args.n_mtp).to(device)
    for name, q in model.named_parameters():   # frozen: only the MTP modules learn
        q.requires_grad_(args.train_trunk or name.startswith("mtp."))
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    os.makedirs(args.out_dir, exist_ok=True)
    metrics = os.path.join(args.out_dir, "metrics.jsonl")
    common.reset_metrics(metrics)
    names, T = list(mix), args.seq_len
    weights = np.array([mix[n] for n in names]) / sum(mix.values())
    model.train(args.train_trunk)   # frozen: eval mode, the MoE layers count no load
    for step in range(args.steps):
        rng = np.random.default_rng([args.seed, 3, step])   # a stream of its own, not pretraining's batches
        src = rng.choice(len(names), size=args.micro_batch, p=weights)
        rows = []
        for s in src:
            arr = arrays[f"{names[s]}/train"]
            i = int(rng.integers(0, len(arr) - T - 1))
            rows.append(np.asarray(arr[i:i + T + 1], dtype=np.int64))
        xy = torch.from_numpy(np.stack(rows)).to(device)
        x, y = corpus.inputs_targets(xy, tok.vocab_size)
        lr = (args.lr * min(1.0, (step + 1) / args.warmup_steps)
              * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        with autocast(device):
            loss, agree = distill(model, x, y if args.train_trunk else None)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if args.train_trunk:
            model.after_optimizer_step()
        if step % args.log_every == 0 or step == args.steps - 1:
            rec = {"step": step, "loss": loss.item(), "lr": lr, "top1_agreement": agree.tolist(),
                   "elapsed_s": time.time() - t_start}
            common.log_metrics(metrics, rec)
            print(json.dumps(rec), file=sys.stderr, flush=True)
    held = [corpus.mtp_agreement(model, tok,
                                 [(np.asarray(arrays[f"{n}/val"][:args.val_tokens], dtype=np.int64)
                                   % tok.vocab_size).tolist()], args.val_tokens)
            for n in names if len(arrays[f"{n}/val"])]
    held = [sum(a) / len(held) for a in zip(*held)] if held else None   # the mean over the sources
    path = os.path.join(args.out_dir, "ckpt.pt")
    common.save_checkpoint(path, model, tok, args=vars(args), parent=args.init_from)
    common.print_summary({"ckpt": path, "n_mtp": args.n_mtp, "mtp_params": model.mtp_params(),
                          "train_trunk": args.train_trunk, "steps": args.steps, "final_loss": loss.item(),
                          "mtp_top1_agreement": held, "time_s": time.time() - t_start})


if __name__ == "__main__":
    main()
