"""
Open weights in, open weights out: a Hugging Face model directory (config.json, *.safetensors,
tokenizer.json) read as this project's GPT and Tokenizer, and a checkpoint written back as one.

    python hf.py export runs/rl/ckpt.pt --out-dir out/my-model   # config.json, *.safetensors, tokenizer.json
    python hf.py check out/my-model                      # our forward vs transformers' (test-only package)
    python train_pretrain.py --init-from ~/models/granite-3.0-1b-a400m-base ...   # any --init-from / --ckpt

As every script, each command ends with one JSON line on stdout (export: what it wrote; check: its
figures), and bad input (no such checkpoint or directory, a malformed config.json, an architecture or
option this file does not read) is one `error: ...` line and exit code 2. No --preset: hf.py trains
nothing and has no run settings for a preset to set. export writes into --out-dir; check writes
nothing (its exit code is 1 when the model is not exact).

Architectures: Qwen3 (dense), Qwen3-MoE, GraniteMoe and OLMoE (tested on tiny random models of each).
Everything Hugging Face is in this file, and it needs no Hugging Face package: safetensors is read and
written by the ~40 lines below, config.json and tokenizer.json are JSON. transformers, tokenizers and
safetensors are test-only (tests/test_hf.py and `check` compare against them).

Conventions that differ are converted here, never in model.py:
- RoPE: transformers rotates (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), model.py by the opposite
  angle. Negating the second half of every q and k head (rows of q_proj and k_proj) turns one into the
  other: q.k is unchanged by a sign flip applied to both, and the flips commute with RMSNorm.
- Experts: per-expert gate/up/down matrices (Qwen3-MoE, OLMoE) or Granite's (E, 2H, D) input_linear
  are stacked into model.py's (E, D, 2H) w1 and (E, H, D) w2; q, k, v into one qkv; gate, up into w1.
- Granite's multipliers and every other difference are GPTConfig options, off by default.
- The tokenizer: tokenizer.json's byte-level BPE becomes a tiktoken.Encoding (HFTokenizer below):
  tokens through the GPT-2 byte-to-unicode map, ranks = ids (checked to follow the merges' order),
  the pre-tokenizer as one regex. Special tokens are added by id only, as tokenizer.py does.
What is tested (parity with transformers on random weights) and what is not: docs/gpu.md.
"""
import importlib.util
import json
import mmap
import os
import sys
import time
from dataclasses import asdict

import torch

from infra.cli import ArgumentParser, die
from infra import common
from infra.common import print_summary
from model import GPT, GPTConfig
from tokenizer import load_tokenizer, tokenizer_json

ARCHS = ("qwen3", "qwen3_moe", "granitemoe", "olmoe")
CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "granitemoe": "GraniteMoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


# ----------------------------------------------------------------------------------------------
# safetensors: 8 bytes (little-endian u64) of header length, a JSON header {name: {dtype, shape,
# data_offsets: [begin, end) into the data}, "__metadata__": {...}}, then the raw little-endian data.

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_safetensors(path):
    """{name: tensor} of one .safetensors file, memory-mapped (pages are read when a tensor is used)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # copy-on-write: a writable buffer
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, (a, b) = DTYPES[info["dtype"]], info["data_offsets"]
        flat = torch.frombuffer(data, dtype=dtype, count=(b - a) // dtype.itemsize, offset=8 + n + a) \
            if b > a else torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(info["shape"])
    return out


def write_safetensors(path, tensors):
    """Writes {name: tensor} as one .safetensors file (the header padded to 8 bytes, as the library does)."""
    names = {v: k for k, v in DTYPES.items()}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def read_weights(path):
    """Every tensor of a model directory: model.safetensors, or the shards its index lists."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path}")
    out = {}
    for name in files:
        out.update(read_safetensors(os.path.join(path, name)))
    return out


# ----------------------------------------------------------------------------------------------
# config.json <-> GPTConfig

def gpt_config(c):
    """A config.json's dict -> GPTConfig. Anything model.py would compute differently (attention bias,
    sliding windows, scaled RoPE, other activations, OLMoE's clip_qkv) is refused with a ValueError."""
    arch = c.get("model_type")
    if arch not in ARCHS:
        raise ValueError(f"model_type {arch!r}: hf.py reads {', '.join(ARCHS)}")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    layer_types = set(c.get("layer_types") or ["full_attention"])
    for bad, what in [(c.get("attention_bias", False), "attention_bias"),
                      (c.get("use_sliding_window"), "use_sliding_window"),
                      (layer_types != {"full_attention"}, f"layer_types {layer_types}"),
                      (rope.get("rope_type", rope.get("type", "default")) != "default", f"rope {rope}"),
                      (c.get("hidden_act", "silu") != "silu", f"hidden_act {c.get('hidden_act')}"),
                      (c.get("clip_qkv") is not None, "clip_qkv"),
                      (c.get("decoder_sparse_step", 1) != 1, "decoder_sparse_step")]:
        if bad:
            raise ValueError(f"{arch}: {what} is not supported")
    D, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or (128 if arch == "qwen3" else D // heads)   # transformers' defaults
    common = dict(vocab_size=c["vocab_size"], seq_len=c.get("max_position_embeddings", 4096),
                  n_layer=c["num_hidden_layers"], n_head=heads,
                  n_kv_head=c.get("num_key_value_heads") or heads,
                  n_embd=D, head_dim=0 if head_dim * heads == D else head_dim,
                  rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                  rms_eps=float(c.get("rms_norm_eps", 1e-5 if arch == "olmoe" else 1e-6)),
                  tie_embeddings=bool(c.get("tie_word_embeddings", False)), n_shared_expert=0,
                  # aux-loss-free balancing moves a routing bias the architecture does not have: an exported
                  # model would route differently. Nothing balances by default (as transformers' training).
                  balance="none")
    if arch == "qwen3":
        return GPTConfig(**common, n_expert=1, top_k=1, n_dense_layers=0, dense_hidden=c["intermediate_size"])
    moe = dict(n_expert=c.get("num_experts", c.get("num_local_experts")), top_k=c["num_experts_per_tok"])
    if arch == "qwen3_moe":
        dense = sorted(c.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise ValueError(f"qwen3_moe: mlp_only_layers {dense} are not the first layers")
        return GPTConfig(**common, **moe, expert_hidden=c["moe_intermediate_size"], n_dense_layers=len(dense),
                         dense_hidden=c["intermediate_size"],
                         norm_topk_prob=bool(c.get("norm_topk_prob", False)))
    if arch == "olmoe":
        return GPTConfig(**common, **moe, expert_hidden=c["intermediate_size"], n_dense_layers=0,
                         qk_norm="width", norm_topk_prob=bool(c.get("norm_topk_prob", False)))
    # granitemoe: softmax over the top-k logits = renormalised top-k probabilities; no q/k norm
    return GPTConfig(**common, **moe, expert_hidden=c["intermediate_size"], n_dense_layers=0, qk_norm="none",
                     embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
                     residual_multiplier=float(c.get("residual_multiplier", 1.0)),
                     attention_multiplier=float(c.get("attention_multiplier", 1.0)),
                     logits_scaling=float(c.get("logits_scaling", 1.0)))


def architecture(cfg):
    """The transformers architecture that computes exactly what model.py does with `cfg`, or a
    ValueError that says why there is none."""
    if cfg.n_expert > 1 and cfg.n_shared_expert:
        raise ValueError("shared experts: qwen3_moe, granitemoe and olmoe have none (train with "
                         "--n-shared-expert 0 to export)")
    granite = (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) != (1.0, 1.0, 1.0) \
        or cfg.attention_multiplier != 0
    if cfg.qk_norm == "none":
        arch = "granitemoe"
        ok = cfg.n_expert > 1 and cfg.n_dense_layers == 0 and cfg.norm_topk_prob and not cfg.head_dim
    elif cfg.qk_norm == "width":
        arch = "olmoe"
        ok = cfg.n_expert > 1 and cfg.n_dense_layers == 0 and not granite and not cfg.head_dim
    else:
        arch = "qwen3" if cfg.n_expert == 1 else "qwen3_moe"
        ok = not granite
    if not ok:
        raise ValueError(f"no transformers architecture has this combination (closest: {arch}): "
                         f"{ {k: v for k, v in asdict(cfg).items() if v != getattr(GPTConfig, k, v)} }")
    return arch


def hf_config(cfg, tok):
    """GPTConfig -> config.json's dict for architecture(cfg)."""
    arch = architecture(cfg)
    c = {"architectures": [CLASSES[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
         "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.head_width, "hidden_act": "silu",
         "max_position_embeddings": cfg.seq_len,
         "rms_norm_eps": cfg.rms_eps or torch.finfo(torch.float32).eps,    # nn.RMSNorm's default in fp32
         "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
         "rope_theta": cfg.rope_theta,
         "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
         "eos_token_id": tok.eot_id, "pad_token_id": tok.pad_id, "bos_token_id": None, "use_cache": True,
         "initializer_range": 0.02, "dtype": "float32"}
    if arch == "qwen3":
        return {**c, "intermediate_size": cfg.mlp_hidden, "use_sliding_window": False}
    moe = {"num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob,
           "output_router_logits": False}
    if arch == "qwen3_moe":
        return {**c, **moe, "num_experts": cfg.n_expert, "moe_intermediate_size": cfg.expert_hidden,
                "intermediate_size": cfg.mlp_hidden, "decoder_sparse_step": 1,
                "mlp_only_layers": list(range(cfg.n_dense_layers)), "use_sliding_window": False}
    if arch == "olmoe":
        return {**c, **moe, "num_experts": cfg.n_expert, "intermediate_size": cfg.expert_hidden,
                "clip_qkv": None}
    return {**c, **moe, "num_local_experts": cfg.n_expert, "intermediate_size": cfg.expert_hidden,
            "embedding_multiplier": cfg.embedding_multiplier, "residual_multiplier": cfg.residual_multiplier,
            "attention_multiplier": cfg.attention_multiplier or cfg.head_width ** -0.5,
            "logits_scaling": cfg.logits_scaling}


# ----------------------------------------------------------------------------------------------
# Weights: transformers' names and layouts <-> model.py's

def rope_flip(w, head_dim):
    """Rows of q_proj or k_proj (n_heads * head_dim, D) with the second half of every head negated:
    the RoPE convention of transformers <-> model.py's (see the top). Its own inverse."""
    w = w.reshape(-1, 2, head_dim // 2, w.size(-1)).clone()
    w[:, 1] = -w[:, 1]
    return w.reshape(-1, w.size(-1))


def layer_names(arch, i):
    """The transformers names of layer i's parts (the Hub's on-disk format)."""
    p = f"model.layers.{i}."
    moe = p + ("block_sparse_moe." if arch == "granitemoe" else "mlp.")
    router = moe + ("router.layer.weight" if arch == "granitemoe" else "gate.weight")
    return {"p": p, "moe": moe, "router": router}


def from_hf(sd, cfg, arch):
    """transformers' state dict (any float dtype) -> model.py's, in fp32."""
    get = lambda k: sd[k].float()
    hd = cfg.head_width
    out = {"wte.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    out["lm_head.weight"] = out["wte.weight"] if cfg.tie_embeddings else get("lm_head.weight")
    for i in range(cfg.n_layer):
        n = layer_names(arch, i)
        p, b = n["p"], f"blocks.{i}."
        a = p + "self_attn."
        out[b + "attn.qkv.weight"] = torch.cat([rope_flip(get(a + "q_proj.weight"), hd),
                                               rope_flip(get(a + "k_proj.weight"), hd),
                                               get(a + "v_proj.weight")])
        out[b + "attn.proj.weight"] = get(a + "o_proj.weight")
        if cfg.qk_norm != "none":
            out[b + "attn.q_norm.weight"] = get(a + "q_norm.weight")
            out[b + "attn.k_norm.weight"] = get(a + "k_norm.weight")
        out[b + "norm1.weight"] = get(p + "input_layernorm.weight")
        out[b + "norm2.weight"] = get(p + "post_attention_layernorm.weight")
        if cfg.n_expert == 1 or i < cfg.n_dense_layers:
            m = p + "mlp."
            out[b + "mlp.w1.weight"] = torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")])
            out[b + "mlp.w2.weight"] = get(m + "down_proj.weight")
            continue
        e = n["moe"] + "experts."
        if arch == "granitemoe":                     # stacked on disk: (E, 2H, D) and (E, D, H)
            up, down = get(n["moe"] + "input_linear.weight"), get(n["moe"] + "output_linear.weight")
        elif e + "gate_up_proj" in sd:                # transformers 5's in-memory layout, if saved so
            up, down = get(e + "gate_up_proj"), get(e + "down_proj")
        else:                                        # one gate/up/down per expert
            up = torch.stack([torch.cat([get(f"{e}{j}.gate_proj.weight"), get(f"{e}{j}.up_proj.weight")])
                              for j in range(cfg.n_expert)])
            down = torch.stack([get(f"{e}{j}.down_proj.weight") for j in range(cfg.n_expert)])
        out[b + "mlp.w1"], out[b + "mlp.w2"] = up.transpose(1, 2), down.transpose(1, 2)
        out[b + "mlp.router.weight"] = get(n["router"])
        out[b + "mlp.bias"] = torch.zeros(cfg.n_expert)
    return out


def to_hf(model, arch, dtype):
    """model.py's GPT -> transformers' state dict in the Hub's on-disk format (what from_hf reads)."""
    cfg, sd = model.config, model.state_dict()
    put = lambda t: t.detach().to(dtype).contiguous()
    hd, H = cfg.head_width, cfg.expert_hidden
    out = {"model.embed_tokens.weight": put(sd["wte.weight"]), "model.norm.weight": put(sd["norm.weight"])}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = put(sd["lm_head.weight"])
    for i, block in enumerate(model.blocks):
        n, b = layer_names(arch, i), f"blocks.{i}."
        p, a = n["p"], n["p"] + "self_attn."
        q, k, v = sd[b + "attn.qkv.weight"].split([cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd])
        out.update({a + "q_proj.weight": put(rope_flip(q, hd)), a + "k_proj.weight": put(rope_flip(k, hd)),
                    a + "v_proj.weight": put(v), a + "o_proj.weight": put(sd[b + "attn.proj.weight"]),
                    p + "input_layernorm.weight": put(sd[b + "norm1.weight"]),
                    p + "post_attention_layernorm.weight": put(sd[b + "norm2.weight"])})
        if cfg.qk_norm != "none":
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = put(sd[b + "attn.q_norm.weight"]), \
                put(sd[b + "attn.k_norm.weight"])
        if not block.is_moe:
            gate, up = sd[b + "mlp.w1.weight"].chunk(2)
            out.update({p + "mlp.gate_proj.weight": put(gate), p + "mlp.up_proj.weight": put(up),
                        p + "mlp.down_proj.weight": put(sd[b + "mlp.w2.weight"])})
            continue
        w1, w2 = sd[b + "mlp.w1"].transpose(1, 2), sd[b + "mlp.w2"].transpose(1, 2)   # (E, 2H, D), (E, D, H)
        out[n["router"]] = put(sd[b + "mlp.router.weight"])
        if arch == "granitemoe":
            out[n["moe"] + "input_linear.weight"], out[n["moe"] + "output_linear.weight"] = put(w1), put(w2)
            continue
        for j in range(cfg.n_expert):
            e = f"{n['moe']}experts.{j}."
            out.update({e + "gate_proj.weight": put(w1[j, :H]), e + "up_proj.weight": put(w1[j, H:]),
                        e + "down_proj.weight": put(w2[j])})
    return out


# ----------------------------------------------------------------------------------------------
# A model directory in (load_checkpoint: what the scripts load with), a checkpoint out

def read_config(path):
    """(GPTConfig, config.json's dict) of a model directory; ValueError when it cannot be read, lacks a
    field or holds a value model.py refuses."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"no readable config.json in {path}: {e}") from None
    if not isinstance(c, dict):
        raise ValueError(f"{path}/config.json is not a JSON object")
    try:
        return gpt_config(c), c
    except KeyError as e:
        raise ValueError(f"{path}/config.json has no {e.args[0]!r}") from None
    except TypeError as e:       # a field of the wrong type (a string for a number, ...)
        raise ValueError(f"{path}/config.json: {e}") from None


def load(path, device="cpu"):
    """A Hugging Face model directory -> (GPT in fp32, HFTokenizer, checkpoint dict), as
    common.load_checkpoint returns them. device "meta": the config alone (a --dry-run's plan), no weights
    read, and the tokenizer only if tokenizer.json is there (else None)."""
    cfg, c = read_config(path)
    eos = c.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    tok_path = os.path.join(path, "tokenizer.json")
    tok = None if device == "meta" and not os.path.isfile(tok_path) else \
        load_tokenizer(tok_path, eos, c.get("pad_token_id"))
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer.json has {tok.vocab_size} ids but the model {cfg.vocab_size} rows")
    if device == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
        model.load_state_dict(from_hf(read_weights(path), cfg, c["model_type"]))
        model = model.to(device)
    ckpt = {"model_config": asdict(cfg), "tokenizer": tok.to_dict() if tok else None, "kind": "hf",
            "hf": {"dir": os.path.abspath(path), "model_type": c["model_type"]}}
    return model, tok, ckpt


# What a bad model directory raises while it is read (RuntimeError: a tensor of the wrong shape)
LOAD_ERRORS = (ValueError, KeyError, OSError, RuntimeError)


def one_line(e):
    """An exception as one line of an error message: its type and the first line of its text."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def load_checkpoint(path, device="cpu"):
    """What the scripts load a model with: a Hugging Face model directory (load; device "meta": its config
    alone, for a --dry-run's plan), else this project's checkpoint (common.load_checkpoint). Any problem
    is a one-line error."""
    if not (path and os.path.isdir(path)):
        return common.load_checkpoint(path, device)
    try:
        return load(path, device)
    except LOAD_ERRORS as e:
        die(f"cannot load model directory {path!r}: {one_line(e)}")


def export(model, tok, out_dir, dtype=torch.float32):
    """Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json of `model` to
    out_dir; returns what was written. MTP modules are left out (none of these architectures has them)."""
    arch = architecture(model.config)
    for i, m in enumerate(model.moe_layers()):
        if m.bias.abs().max() > 0:
            raise ValueError(f"MoE layer {i} has a nonzero routing bias (--balance bias): {arch} routes "
                             "without one, so the exported model would choose other experts")
    os.makedirs(out_dir, exist_ok=True)
    config = {**hf_config(model.config, tok), "dtype": str(dtype).removeprefix("torch.")}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), to_hf(model, arch, dtype))
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(tok), f, ensure_ascii=False)
    # eos, pad by name if special; an ordinary token (transformers' default eos id 2): config.json's id alone
    name = {i: t for t, i in tok.specials.items()}
    names = {k: name[i] for k, i in (("eos_token", tok.eot_id), ("pad_token", tok.pad_id)) if i in name}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **names,
                   "model_max_length": model.config.seq_len}, f, indent=2)
    return {"out_dir": out_dir, "model_type": arch, "dtype": config["dtype"],
            "dropped_mtp": model.config.n_mtp}


# ----------------------------------------------------------------------------------------------
# check: this project's forward against transformers' (transformers installed)

SAMPLE_TEXT = ("def mean(xs):\n    \"\"\"The mean of xs.\"\"\"\n    return sum(xs) / len(xs)\n\n"
               "Prose, unicode: naïve café, 東京 2024, ½ ² ٣, emoji 🙂.\n\tTabs  and   spaces \r\n")


@torch.no_grad()
def compare(path, seed=0, n_tokens=32, length=16, batch=2):
    """Our forward and transformers' on the same random ids, in fp32: the largest logit difference,
    whether greedy decoding (ours: sampling.reference with its KV cache; theirs: full forwards) gives the
    same n_tokens, and whether every token is routed to the same experts; with tokenizer.json, whether
    the tokenizers library gives our ids on a sample of code, prose and unicode."""
    from transformers import AutoModelForCausalLM     # test-only dependency: imported here

    import sampling
    ours, tok, ckpt = load(path)
    ours.eval()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    V = min(ours.config.vocab_size, tok.vocab_size)
    idx = torch.randint(0, V, (batch, length), generator=g)
    out = theirs(idx, output_router_logits=ours.n_moe_layers > 0)
    logits = ours(idx)[0]
    diff = (logits - out.logits).abs().max().item()
    k = ours.config.top_k
    mine = [c.sort(-1).values for c in ours.trunk(idx, torch.arange(length)[None])[1]]
    theirs_experts = [r.reshape(-1, r.size(-1)).topk(k, -1).indices.sort(-1).values
                      for r in (out.router_logits if ours.n_moe_layers else [])]
    same_experts = len(mine) == len(theirs_experts) and \
        all(torch.equal(a, b) for a, b in zip(mine, theirs_experts))
    gen = sampling.reference(ours, idx.tolist(), n_tokens, temperature=0)
    seq = idx
    for _ in range(n_tokens):
        seq = torch.cat([seq, theirs(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    same_greedy = [g["tokens"] for g in gen] == seq[:, length:].tolist()
    report = {"dir": path, "model_type": ckpt["hf"]["model_type"], "max_abs_logit_diff": diff,
              "same_greedy": same_greedy, "greedy_tokens": n_tokens,
              "same_experts": same_experts if ours.n_moe_layers else None, "moe_layers": ours.n_moe_layers}
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer as HFLibTokenizer
        lib = HFLibTokenizer.from_file(os.path.join(path, "tokenizer.json"))
        lib.encode_special_tokens = True     # special-token text is text, as in our encode
        report["same_token_ids"] = lib.encode(SAMPLE_TEXT, add_special_tokens=False).ids == \
            tok.encode(SAMPLE_TEXT)
    report["exact"] = diff <= 1e-4 and same_greedy and same_experts is not False and \
        report.get("same_token_ids", True)
    return report


def main(argv=None):
    ap = ArgumentParser(prog="hf.py", description="Hugging Face model directories: export a checkpoint as "
                        "one, check one against transformers. No --preset: nothing here trains.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="CKPT (a checkpoint or a model directory) -> DIR, which transformers "
                        "loads: python hf.py export CKPT DIR (or --out-dir DIR, as every script takes it)")
    ex.add_argument("ckpt")
    ex.add_argument("dir", nargs="?", help="the model directory to write")
    ex.add_argument("--out-dir", help="the same, as a flag")
    ex.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights' dtype (float32: exactly the checkpoint's)")
    ch = sub.add_parser("check", help="our forward vs transformers' on random ids (needs transformers)")
    ch.add_argument("dir")
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.cmd == "export":
        if not (args.dir or args.out_dir) or args.dir and args.out_dir and args.dir != args.out_dir:
            die("export: give the directory to write once: CKPT DIR, or --out-dir DIR")
        args.out_dir = args.out_dir or args.dir
        if os.path.isdir(args.ckpt) and os.path.isdir(args.out_dir) and \
                os.path.samefile(args.ckpt, args.out_dir):
            die(f"export: --out-dir {args.out_dir!r} is the model directory read: choose another")
        model, tok, _ = load_checkpoint(args.ckpt)
        try:
            report = export(model, tok, args.out_dir, getattr(torch, args.dtype))
        except ValueError as e:
            die(f"export {args.ckpt}: {e}")
        print_summary({**report, "ckpt": args.ckpt, "wall_s": round(time.time() - t0, 1)})
        return
    if not os.path.isdir(args.dir):
        die(f"check: no model directory at {args.dir!r}")
    if args.tokens < 1:
        die(f"check: --tokens must be >= 1, got {args.tokens}")
    try:
        read_config(args.dir)       # a bad config.json is refused before transformers is needed
    except ValueError as e:
        die(f"check {args.dir}: {e}")
    if importlib.util.find_spec("transformers") is None:
        die("check needs transformers (pip install transformers; a test-only dependency)")
    try:
        report = compare(args.dir, args.seed, args.tokens)
    except LOAD_ERRORS as e:
        die(f"check {args.dir}: {one_line(e)}")
    print_summary({**report, "wall_s": round(time.time() - t0, 1)})
    sys.exit(0 if report["exact"] else 1)


if __name__ == "__main__":
    main()
