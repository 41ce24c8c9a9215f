"""
Models made from other models, for continued pretraining (train_pretrain.py --upcycle, --seq-len):

    moe = upcycle(dense_model, n_expert=8, top_k=2)   # sparse upcycling: step-0 outputs == dense
    longer, theta = extend_context(model, 1024)      # same weights, RoPE base raised for 1024 tokens
    wider = add_tokens(model, tok.with_tools().vocab_size)   # rows for the agent's tool tokens
"""
from dataclasses import replace

import torch

from model import GPT


# ----------------------------------------------------------------------------------------------
# Sparse upcycling (Komatsuzaki et al. 2023): a dense checkpoint -> an MoE that starts where it left off

@torch.no_grad()
def upcycle(dense: GPT, n_expert: int, top_k: int, n_shared_expert: int = 1, noise: float = 0.0,
            **overrides) -> GPT:
    """Every expert (routed and shared) becomes a copy of the dense layer's MLP (expert_hidden =
    the dense MLP width), attention/embeddings/dense layers are copied. The routed gates are
    renormalised to sum to 1, so identical experts give sum_k g_k MLP(x) = MLP(x) for ANY router;
    the shared block holds n_shared_expert copies and always fires, so we scale every output
    projection by 1 / (n_shared_expert + 1): shared + routed = dense exactly (to float rounding).
    All experts receive gradients from step 0 and diverge because the router sends them different
    tokens; `noise` (relative, off by default) breaks the symmetry faster at the cost of exactness.
    overrides: any other GPTConfig field (balance, aux_loss_coef, n_dense_layers, ...)."""
    dc = dense.config
    if dc.n_expert != 1:
        raise ValueError("upcycle expects a dense model (n_expert=1)")
    H = dc.mlp_hidden
    cfg = replace(dc, n_expert=n_expert, top_k=top_k, n_shared_expert=n_shared_expert,
                  expert_hidden=H, dense_hidden=H, **overrides)
    moe = GPT(cfg).to(dense.lm_head.weight.device)
    sd, msd = dense.state_dict(), moe.state_dict()
    moe.load_state_dict({k: sd[k] if k in sd and sd[k].shape == v.shape else v for k, v in msd.items()})
    scale = 1.0 / (n_shared_expert + 1)
    for block, dblock in zip(moe.blocks, dense.blocks):
        if not block.is_moe:
            continue
        w1, w2 = dblock.mlp.w1.weight, dblock.mlp.w2.weight       # (2H, D), (D, H)
        m = block.mlp
        m.w1.copy_(w1.T.expand_as(m.w1))
        m.w2.copy_(scale * w2.T.expand_as(m.w2))
        if noise:
            m.w1.mul_(1 + noise * torch.randn_like(m.w1))
            m.w2.mul_(1 + noise * torch.randn_like(m.w2))
        if m.shared is not None:
            g, u = w1.chunk(2, 0)
            m.shared.w1.weight.copy_(torch.cat([g] * n_shared_expert + [u] * n_shared_expert))
            m.shared.w2.weight.copy_(scale * torch.cat([w2] * n_shared_expert, dim=1))
    return moe


# ----------------------------------------------------------------------------------------------
# Context extension

def extend_context(model: GPT, seq_len: int) -> tuple[GPT, float]:
    """The model for a longer context, NTK-aware RoPE scaling (bloc97 2023; Code Llama raises the base
    for the same reason): base * s^(d/(d-2)), s = new/old length, d = head dim, stretches the lowest
    frequency exactly s times so the longest wavelengths span the new length, while the highest
    frequencies (local word order) barely move. A short phase at the new length adapts. Returns
    (the new model, its rope_theta)."""
    cfg = model.config
    d = cfg.n_embd // cfg.n_head
    theta = cfg.rope_theta * (seq_len / cfg.seq_len) ** (d / (d - 2))
    longer = GPT(replace(cfg, seq_len=seq_len, rope_theta=theta))
    longer.load_state_dict(model.state_dict())   # RoPE is computed on the fly: same weights
    return longer, theta


# ----------------------------------------------------------------------------------------------
# New tokens

@torch.no_grad()
def add_tokens(model: GPT, vocab_size: int) -> GPT:
    """The model with a vocabulary of `vocab_size` (>= its own): every old weight copied, and each new
    token's embedding and LM-head row set to the mean of the old ones (Hewitt 2021, "Initializing New
    Word Embeddings for Pretrained Language Models": the mean keeps the new tokens' logits near the
    average, where random rows could make them dominate or vanish). Every old token's logits and
    every forward on old tokens are unchanged; the new rows are learnt in continued pretraining."""
    old = model.config.vocab_size
    if vocab_size < old:
        raise ValueError(f"add_tokens: {vocab_size} < the model's vocabulary {old}")
    wider = GPT(replace(model.config, vocab_size=vocab_size)).to(model.lm_head.weight.device)
    sd = model.state_dict()
    for name in ("wte.weight", "lm_head.weight"):
        w = sd[name]
        sd[name] = torch.cat([w, w.mean(0, keepdim=True).expand(vocab_size - old, -1)])
    wider.load_state_dict(sd)
    return wider
