"""
A small Mixture-of-Experts GPT, one file, read top to bottom.

    config = GPTConfig(n_expert=8, top_k=2)        # MoE (n_expert=1: the dense model of equal active size)
    model = GPT(config)
    logits, loss = model(idx, targets)             # loss = cross-entropy + MoE auxiliary terms
    outs = sampling.reference(model, [[1, 2, 3], [4, 5]], 32, temperature=0.8)   # sampling: sampling.py

Architecture (nanoGPT / nanochat lineage): token embedding -> n_layer pre-norm blocks of
(causal GQA attention with RoPE and QK-norm) + (dense SwiGLU MLP in the first n_dense_layers,
a routed SwiGLU MoE with shared experts after) -> RMSNorm -> untied LM head; optionally (n_mtp > 0)
multi-token-prediction modules after the trunk (DeepSeek-V3), which draft tokens for speculative decoding.
Embeddings are UNTIED (as in nanochat / Llama): the input table and the output head want different
scales at this size, and untying costs nothing in active compute.
GPTConfig's last options (a head width of its own, q/k norm across the width or none, tied embeddings,
Granite's multipliers, ...) are what open-weights models need (hf.py loads them); all are off by default.
"""
import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


@functools.lru_cache(maxsize=None)
def native_grouped_mm(cuda_index):
    """Whether grouped_mm has a kernel of its own on this GPU: sm90 and sm100 (Hopper, Blackwell).
    Elsewhere torch runs a fallback that copies the offsets to the host (aten's GroupedBlas.cpp),
    a sync per call: two per MoE layer and decode step."""
    return torch.cuda.get_device_capability(cuda_index)[0] in (9, 10)


@dataclass
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2              # grouped-query attention: n_head / n_kv_head query heads share a KV head
    n_embd: int = 128
    n_expert: int = 8               # 1 -> an ordinary dense model (no router, no aux loss)
    top_k: int = 2
    n_shared_expert: int = 1        # always-on experts (DeepSeekMoE); they learn what every token needs
    expert_hidden: int = 128
    n_dense_layers: int = 1         # first layers dense, as DeepSeek-V3 / Kimi K2 do
                                    # (early routing is unstable)
    dense_hidden: int = 0           # 0 -> (top_k + n_shared_expert) * expert_hidden, i.e. equal ACTIVE size
    rope_theta: float = 10000.0
    balance: str = "bias"           # "bias" (DeepSeek-V3 aux-free, the presets')
                                    # | "aux" (Switch LB + z-loss) | "none"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    bias_rate: float = 1e-3
    n_mtp: int = 0                  # multi-token-prediction depth (MTP modules; 0: none, as old checkpoints)
    # What open-weights models need (hf.py reads them from a config.json); each off by default, so the
    # presets and every checkpoint written before them build the same model.
    head_dim: int = 0               # 0: n_embd // n_head (Qwen3 sets its own, e.g. 128 at width 1024)
    qk_norm: str = "head"           # "head": per head (Qwen3, ours) | "width": across the heads (OLMoE)
                                    # | "none" (Granite)
    rms_eps: float = 0.0            # RMSNorm epsilon; 0: torch's default (the dtype's machine epsilon)
    norm_topk_prob: bool = True     # renormalise the chosen experts' gates to sum to 1 (False: OLMoE)
    tie_embeddings: bool = False    # LM head = input embedding (Qwen3 0.6B-4B, Granite)
    embedding_multiplier: float = 1.0   # Granite's four multipliers (muP-style): embeddings times this,
    residual_multiplier: float = 1.0    # each branch's output times this before the residual add,
    attention_multiplier: float = 0.0   # the attention softmax scale (0: 1/sqrt(head dim)),
    logits_scaling: float = 1.0         # and the logits divided by this

    def __post_init__(self):
        for ok, msg in [((self.head_dim or self.n_embd % self.n_head == 0)
                         and self.n_head % self.n_kv_head == 0 and self.head_width % 2 == 0,
                         "n_embd/n_head (or head_dim) must be an even head dim, "
                         "n_head a multiple of n_kv_head"),
                        (self.qk_norm in ("head", "width", "none"), "qk_norm must be head, width or none"),
                        (self.n_expert == 1 or 1 <= self.top_k <= self.n_expert,
                         "need 1 <= top_k <= n_expert"),
                        (0 <= self.n_dense_layers <= self.n_layer, "need 0 <= n_dense_layers <= n_layer"),
                        (self.balance in ("aux", "bias", "none"), "balance must be aux, bias or none"),
                        (self.n_mtp >= 0, "n_mtp must be >= 0"),
                        (self.n_expert <= 256, "at most 256 experts (routes are recorded as one byte)")]:
            if not ok:
                raise ValueError(f"GPTConfig: {msg}")
        # F.grouped_mm (the MoE's GPU dispatch) in bf16 needs 16-byte aligned rows: widths that are
        # multiples of 8. Others pass every fp32 CPU test and crash on a GPU, so they are refused here.
        for name in ("n_embd", "expert_hidden") if self.n_expert > 1 else ():
            width = getattr(self, name)
            if width % 8:
                raise ValueError(f"GPTConfig: {name} {width} is not a multiple of 8, which the MoE's grouped "
                                 f"matmul needs on a GPU: use {name} {-(-width // 8) * 8} "
                                 f"(--{name.replace('_', '-')})")

    @property
    def head_width(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def mlp_hidden(self) -> int:
        # With n_expert=1 every layer is dense with this width, so flipping n_expert 8 -> 1 (and nothing
        # else) gives the dense model with the same active parameters per token: a one-flag ablation.
        return self.dense_hidden or (self.top_k + self.n_shared_expert) * self.expert_hidden


# ----------------------------------------------------------------------------------------------
# Attention: causal, RoPE, QK-norm, grouped-query, F.scaled_dot_product_attention

def rope_cos_sin(pos, head_dim, theta):
    """pos: (B or 1, T) integer positions -> cos, sin of shape (B or 1, 1, T, head_dim/2).
    Computed on the fly (cheap) so every row can have its own positions (left-padded batches)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    f = pos[..., None].float() * inv_freq
    return f.cos()[:, None], f.sin()[:, None]


def apply_rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)


def rms_norm(width, cfg):
    """nn.RMSNorm with the config's epsilon (rms_eps 0: torch's default, as every preset)."""
    return nn.RMSNorm(width, eps=cfg.rms_eps or None)


class Attention(nn.Module):
    # "auto" | "native" | "matched": how grouped-query heads meet a mask (see attend). auto: matched
    # on CUDA when a mask is given. Like MoE.dispatch, a class attribute that changes speed only.
    gqa = "auto"

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.n_head, self.n_kv_head = layer_idx, cfg.n_head, cfg.n_kv_head
        self.head_dim, self.qk_norm = cfg.head_width, cfg.qk_norm
        self.scale = cfg.attention_multiplier or None      # None: SDPA's 1/sqrt(head_dim)
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        # QK-norm (OLMo 2, Gemma 3): normalising q and k per head bounds the attention logits, which
        # removes the loss spikes that come from logit growth; cheap and helps at any scale. OLMoE
        # normalises q and k across all heads at once ("width"); Granite has none.
        if cfg.qk_norm != "none":
            wq, wk = (self.head_dim, self.head_dim) if cfg.qk_norm == "head" else \
                (cfg.n_head * self.head_dim, cfg.n_kv_head * self.head_dim)
            self.q_norm, self.k_norm = rms_norm(wq, cfg), rms_norm(wk, cfg)

    def forward(self, x, cos, sin, cache=None, mask=None):
        """cache: keys/values of earlier tokens (generation; sampling.KVCache): update() stores this
        call's and returns all of them. mask: bool (B, 1, T, keys), True = may attend."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                     self.n_kv_head * self.head_dim], dim=-1)
        if self.qk_norm == "width":
            q, k = self.q_norm(q.float()), self.k_norm(k.float())
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q.float()), self.k_norm(k.float())
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        # mask=None: plain causal (training, or a prefill without padding); one new token without
        # padding attends to the whole cache, so no mask at all. (T > 1 is tested first: for T = 1 the
        # comparison of T with the cache length, a symbolic bool under torch.compile, never runs.)
        causal = mask is None and T > 1 and T == k.size(2)
        matched = self.gqa == "matched" or (self.gqa == "auto" and q.is_cuda and mask is not None)
        y = attend(q, k, v, mask, causal, matched, self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def attend(q, k, v, mask, causal, matched, scale=None):
    """F.scaled_dot_product_attention, grouped-query: q (B, H, T, D), k and v (B, H_kv, S, D).
    matched=False: enable_gqa. With a mask on CUDA that falls to the math backend (flash takes no
    mask, memory-efficient attention no enable_gqa), which writes out (B, H, T, S) scores: packed RL
    rows (rl/algo.block_mask) and left-padded decoding. matched=True brings the heads to one count
    first, so that memory-efficient attention takes the call: one query token (a decode step) folds
    its H / H_kv query heads into the query length, one mask row serving all of them, at no copy;
    longer queries repeat each key/value head for its query heads. scale: the softmax's, None = 1/sqrt(D)."""
    if not matched or q.size(1) == k.size(1):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True,
                                              scale=scale)
    B, H, T, D = q.shape
    G = H // k.size(1)
    if T == 1:
        # reshape, not view: CUDA's memory-efficient kernel returns (B, H_kv, G, D) laid out as
        # (B, G, H_kv, D) (torch's meta registration for it says so); CPU's happens to be contiguous
        y = F.scaled_dot_product_attention(q.reshape(B, -1, G, D), k, v, attn_mask=mask, scale=scale)
        return y.reshape(B, H, 1, D)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


# ----------------------------------------------------------------------------------------------
# Feed-forward: a dense SwiGLU MLP, and a routed Mixture of SwiGLU experts

class MLP(nn.Module):
    def __init__(self, n_embd, hidden):
        super().__init__()
        self.w1 = nn.Linear(n_embd, 2 * hidden, bias=False)   # gate and up projections fused: one matmul
        self.w2 = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        a, b = self.w1(x).chunk(2, -1)
        return self.w2(F.silu(a) * b)   # SwiGLU (Shazeer 2020)


def expert_matmul(x, w, counts, grouped):
    """x: (sum(counts), K) rows sorted by expert; w: (E, K, N) -> (sum(counts), N), the rows of group
    e multiplied by w[e]. grouped=True: one grouped GEMM call (as torchtitan), no host sync; else one
    matmul per expert over contiguous slices: the fallback for torch without grouped_mm or fp32 CUDA.
    On CPU the two train at the same speed and grouped is faster for small decode batches."""
    if grouped:
        y = F.grouped_mm(x, w, offs=counts.cumsum(0).to(torch.int32))
        if y.requires_grad:   # grouped_mm's backward rejects zero-stride grads (e.g. from .sum())
            y.register_hook(lambda g: g.contiguous())
        return y
    return torch.cat([xe @ w[e] for e, xe in enumerate(x.split(counts.tolist()))])


def autocast(device):
    """bf16 autocast on CUDA (the router stays fp32 inside model.py); plain fp32 on CPU, where
    bf16 matmuls are slower than fp32 on most CPUs and would only add noise to tests."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def compute_dtype(x):
    """The dtype the experts compute in: autocast's (bf16 in training and GPU decoding), else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class MoE(nn.Module):
    # How the routed experts run: "auto" | "sorted" | "grouped" | "dense". The reading path is experts
    # (sorted: one matmul per expert); the speed paths sit below it (experts_dense, grouped_mm in
    # expert_matmul); path() chooses, in one place. A class attribute, not config: it changes speed,
    # never results beyond float rounding (tests/test_model.py flips it).
    dispatch = "auto"
    # CUDA no-grad batches up to this many tokens go dense rather than sorted (E/k x FLOPs, no sync)
    DENSE_ROWS = 1024

    def __init__(self, cfg):
        super().__init__()
        E, D, H = cfg.n_expert, cfg.n_embd, cfg.expert_hidden
        self.E, self.k, self.cfg = E, cfg.top_k, cfg
        self.router = nn.Linear(D, E, bias=False)
        # Stacked expert weights (E, ...): one parameter per matrix, so every expert gets a gradient
        # (zero if it got no tokens) and DDP needs no find_unused_parameters.
        self.w1 = nn.Parameter(torch.empty(E, D, 2 * H))
        self.w2 = nn.Parameter(torch.empty(E, H, D))
        self.shared = MLP(D, cfg.n_shared_expert * H) if cfg.n_shared_expert else None
        # DeepSeek-V3 aux-loss-free balancing: a per-expert bias that only changes WHICH experts are
        # chosen, never the gate values. fp32, a buffer (not trained by the optimizer, but checkpointed).
        self.register_buffer("bias", torch.zeros(E))
        # Expert loads summed over the micro-batches of the current optimizer step. A plain attribute,
        # not a buffer: DDP (broadcast_buffers=True) would overwrite every rank's counts with rank 0's.
        self.load, self.aux, self.stats = None, 0.0, {}

    def forward(self, x, route=None, valid=None, track=True):
        """x (B, T, D) -> the output (B, T, D) and the experts chosen for each token (B*T, top_k), which
        sampling records for router replay. route: experts to force instead (router replay).
        valid (B, T) bool: the real tokens. Padding still flows through the experts (shapes stay
        static) but is neither counted as load nor part of the balancing terms: right-padding routed
        to expert 0 would otherwise make expert 0 look overloaded and push its bias down.
        track=False skips the balancing terms (generation: nobody reads them)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topi, gates, logits, probs = self.route(x, route)
        path = self.path(x)      # the sorted dispatch, or a speed path (below)
        y = self.experts_dense(x.to(compute_dtype(x)), topi, gates) if path == "dense" else \
            self.experts(x, topi, gates, grouped=path == "grouped")
        if self.shared is not None:
            y = y + self.shared(x)
        if track:
            self.balance_terms(logits, probs, topi, None if valid is None else valid.reshape(-1).to(x.device))
        return y.view(shape), topi.detach()

    def route(self, x, route=None):
        """x (N, D) -> the experts of each token (N, top_k), their gates, the router's logits and probs."""
        # Router in fp32 even under bf16 autocast (Switch, OLMoE): the softmax over experts and the
        # top-k choice are sensitive to rounding, and a flipped choice changes the whole expert output.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(-1)
        if route is None:
            topi = (probs + self.bias.float()).topk(self.k, dim=-1).indices
        else:   # router replay (Composer 2): force the experts that produced the sample ...
            topi = route.reshape(-1, self.k).to(x.device, torch.long)
        # ... while the gates still come from this router, so it keeps receiving gradients.
        gates = probs.gather(-1, topi)
        # Renormalise over the chosen k (Mixtral, Qwen3-MoE). With top_k=1 the gate is then 1 and the router
        # learns from the balancing terms only; use top_k >= 2. OLMoE keeps the raw probabilities.
        if self.cfg.norm_topk_prob:
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(1e-20)
        return topi, gates, logits, probs

    def experts(self, x, topi, gates, grouped=False):
        """Dropless dispatch (MegaBlocks, torchtitan): sort the N*k (token, slot) pairs by expert, run
        each expert on its contiguous slice, un-sort with a gather and sum over k. No capacity, no
        dropped tokens, no atomics in the forward combine. grouped: all experts in one grouped GEMM
        (a speed path, expert_matmul) instead of a matmul per expert."""
        N, k = topi.shape
        dt = compute_dtype(x)                   # the experts in bf16 under autocast
        experts_sorted, order = topi.flatten().sort(stable=True)
        # tokens per expert from the sorted expert ids, on the device: torch.bincount reads its input's
        # max on the host, a GPU sync per layer and decode step; grouped_mm takes these as device offsets
        counts = torch.searchsorted(experts_sorted, torch.arange(self.E + 1, device=x.device)).diff()
        a, b = expert_matmul(x[order // k].to(dt), self.w1.to(dt), counts, grouped).chunk(2, -1)
        out = expert_matmul(F.silu(a) * b, self.w2.to(dt), counts, grouped)
        out = out * gates.flatten()[order, None].to(dt)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse].view(N, k, -1).sum(1)

    # --- the speed paths, and the choice between them ---

    def path(self, x):
        """Which dispatch runs, chosen here only. auto: a grouped GEMM on CPU, and in bf16 on a GPU
        with grouped_mm's own kernel (native_grouped_mm); dense under torch.compile on CPU (the sort
        and grouped_mm are data-dependent) and on CUDA for a small no-grad batch that would otherwise
        take sorted (a decode step in fp32, or on a GPU without the kernel), since sorted reads the
        group sizes on the host, a sync per layer and token; sorted elsewhere. (A CPU decode step of
        a few rows runs every expert in sampling.fused_step.)"""
        if self.dispatch != "auto":
            return self.dispatch
        if torch.compiler.is_compiling() and not x.is_cuda:
            return "dense"
        if HAS_GROUPED_MM and (not x.is_cuda or (compute_dtype(x) == torch.bfloat16
                                                 and native_grouped_mm(x.device.index))):
            return "grouped"
        if x.is_cuda and not torch.is_grad_enabled() and x.size(0) <= self.DENSE_ROWS:
            return "dense"
        return "sorted"

    def experts_dense(self, x, topi, gates):
        """Every expert on every token, weighed by the gates (zero off the top-k): E/k times the
        FLOPs, but a fixed handful of ops with static shapes and no host read (path())."""
        w = torch.zeros(x.size(0), self.E, dtype=x.dtype, device=x.device)
        w = w.scatter_add(1, topi, gates.to(x.dtype))
        a, b = torch.matmul(x, self.w1.to(x.dtype)).chunk(2, -1)                 # (E, N, H) each
        return torch.matmul(F.silu(a) * b * w.T[:, :, None], self.w2.to(x.dtype)).sum(0)

    def balance_terms(self, logits, probs, topi, valid=None):
        """Expert loads and the balancing terms of one forward's N tokens; valid (N,) bool: the real
        ones. Padding weighs zero, as a weight rather than a boolean index, and loads are an
        index_add rather than a bincount: static shapes, so no host read and no graph break."""
        E = self.E
        w = torch.ones(len(topi), device=topi.device) if valid is None else valid.to(probs.dtype)
        counts = torch.zeros(E, dtype=torch.float64, device=topi.device).index_add_(
            0, topi.flatten(), w.double().repeat_interleave(self.k))
        n = w.sum().clamp_min(1)
        f = counts
        if self.training and torch.is_grad_enabled():
            # Global-batch load balancing (Qiu et al. 2025, Qwen): count expert loads over every
            # micro-batch of this optimizer step and every data-parallel rank, not per micro-batch;
            # a micro-batch of a few sequences is legitimately unbalanced (one topic, one language)
            # and penalising that hurts expert specialisation. We keep running counts, reset in
            # after_optimizer_step(); at the last micro-batch they ARE the global-batch loads.
            # The collective only runs in training forwards with grad, which every rank runs in
            # lockstep (never under no_grad / eval / generation). Counts are detached: f carries
            # no gradient in the Switch loss anyway. (Activation checkpointing would double-count.)
            self.load = counts if self.load is None else self.load + counts
            f = self.load.clone()
            if self.cfg.balance == "aux" and dist.is_available() and dist.is_initialized():
                dist.all_reduce(f)
        f = (f / f.sum().clamp_min(1)).float()
        P = (probs * w[:, None]).sum(0) / n       # no real token (a dummy row): P = 0
        # Switch Transformer LB loss: E * sum_i f_i P_i, equal to 1 under perfectly uniform routing.
        lb = E * (f * P).sum()
        # Router z-loss (ST-MoE, Zoph et al. 2022): keeps router logits small, so the fp32 softmax
        # stays well conditioned and bf16 rounding of its inputs cannot flip choices.
        z = (torch.logsumexp(logits, -1).square() * w).sum() / n
        self.aux = (self.cfg.aux_loss_coef * lb + self.cfg.z_loss_coef * z
                    if self.cfg.balance == "aux" else 0.0)
        with torch.no_grad():
            entropy = -((probs * probs.clamp_min(1e-20).log()).sum(-1) * w).sum() / n
        self.stats = dict(counts=counts.detach(), lb=lb.detach(), z=z.detach(), entropy=entropy)


class Block(nn.Module):
    def __init__(self, cfg, i, dense=False):
        super().__init__()
        self.is_moe = not dense and cfg.n_expert > 1 and i >= cfg.n_dense_layers
        self.norm1, self.norm2 = rms_norm(cfg.n_embd, cfg), rms_norm(cfg.n_embd, cfg)
        self.attn = Attention(cfg, i)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.n_embd, cfg.mlp_hidden)
        self.mult = cfg.residual_multiplier

    def branch(self, y):
        """A branch's output as it joins the residual stream: Granite scales it, every other model not."""
        return y if self.mult == 1 else self.mult * y

    def forward(self, x, cos, sin, cache=None, mask=None, route=None, valid=None):
        """-> the new residual stream, and the experts its MoE chose (None in a dense block)."""
        x = x + self.branch(self.attn(self.norm1(x), cos, sin, cache, mask))
        h = self.norm2(x)
        if not self.is_moe:
            return x + self.branch(self.mlp(h)), None
        y, topi = self.mlp(h, route, valid, track=cache is None)
        return x + self.branch(y), topi


# ----------------------------------------------------------------------------------------------
# Multi-token prediction (DeepSeek-V3, section 2.2): a module that predicts one token further

class MTP(nn.Module):
    """MTP module m (1..n_mtp). At slot j it combines the previous level's output at slot j-1 (level 0:
    the trunk) with the embedding of the token at slot j, through a projection and one transformer
    block; the shared LM head turns it into a prediction of the token at j+1. Level m thus predicts
    the next token from the trunk's state m tokens back plus the m tokens since: token t+m+1 from
    position t, as in DeepSeek-V3 (embedding and output head shared with the model). Its block is
    dense (the drafts should be cheap) and its layer index follows the trunk's (its own cache slot).
    Trained after pretraining by self-distillation (train_mtp.py); it drafts tokens for speculative
    decoding (sampling.py), where only their speed, never the output, depends on it."""

    def __init__(self, cfg, m):
        super().__init__()
        self.norm_h, self.norm_e = rms_norm(cfg.n_embd, cfg), rms_norm(cfg.n_embd, cfg)
        self.norm = rms_norm(cfg.n_embd, cfg)
        self.combine = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)
        self.block = Block(cfg, cfg.n_layer + m - 1, dense=True)

    def forward(self, h_prev, emb, cos, sin, cache=None, mask=None):
        """h_prev (B, T, D): the previous level's output one slot back; emb: this slot's token
        embedding -> this level's output (B, T, D), the input of the next level; logits: lm_head(norm(.))."""
        x = self.combine(torch.cat([self.norm_h(h_prev), self.norm_e(emb)], -1))
        return self.block(x, cos, sin, cache, mask)[0]


# ----------------------------------------------------------------------------------------------
# The model

class Head(nn.Linear):
    """The LM head, a bias-free linear layer whose logits are divided by logits_scaling (Granite's
    multiplier; 1 everywhere else, and then nothing is divided). Every caller of lm_head gets it."""

    def __init__(self, n_embd, vocab_size, logits_scaling=1.0):
        super().__init__(n_embd, vocab_size, bias=False)
        self.logits_scaling = logits_scaling

    def forward(self, h):
        y = super().forward(h)
        return y if self.logits_scaling == 1 else y / self.logits_scaling


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = rms_norm(config.n_embd, config)
        self.lm_head = Head(config.n_embd, config.vocab_size, config.logits_scaling)   # untied, see top
        if config.tie_embeddings:      # open models that tie them (hf.py): one matrix, both uses
            self.lm_head.weight = self.wte.weight
        self.mtp = nn.ModuleList(MTP(config, m) for m in range(1, config.n_mtp + 1))
        self.last_ce, self.aux_loss = None, 0.0
        # Init (GPT-2 / nanoGPT): N(0, 0.02) everywhere, output projections of each residual branch
        # scaled by 1/sqrt(2*n_layer) so the residual stream does not grow with depth. At init the
        # branches are then small next to the embedding, and the logits come from
        # lm_head(norm(x)) whose scale does not depend on the MLP width or on routing: a dense model
        # and an MoE model of equal active size start at the same loss (~ln V) and, with the router
        # also N(0, 0.02) (near-uniform softmax, random but untied top-k, so loads start balanced),
        # take comparable first steps. A zero router would tie all scores and send every token to
        # the same k experts.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual_out = name.endswith(("proj.weight", "w2.weight", ".w2"))
                std = 0.02 / math.sqrt(2 * config.n_layer) if residual_out else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def moe_layers(self):
        return [b.mlp for b in self.blocks if b.is_moe]

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers())

    def rope(self, pos):
        return rope_cos_sin(pos, self.config.head_width, self.config.rope_theta)

    def trunk(self, idx, pos, cache=None, mask=None, routes=None, valid=None):
        """Token ids (B, T) at positions pos (B or 1, T) -> final normalised hidden states (B, T, D), and
        the experts each MoE layer chose, a list of (B*T, top_k): sampling records them for router
        replay (Composer 2), and `routes` (n_moe_layers, B, T, top_k) forces them in training.
        valid (B, T) bool: real tokens, the only ones the MoE balancing statistics count (None = all).
        cache, mask: as Attention takes them (generation, sampling.py)."""
        cos, sin = self.rope(pos)
        x, replay, chosen = self.wte(idx), iter(routes if routes is not None else []), []
        if self.config.embedding_multiplier != 1:     # Granite's (the MTP modules' RMSNorm undoes it)
            x = x * self.config.embedding_multiplier
        for block in self.blocks:
            x, topi = block(x, cos, sin, cache, mask, next(replay, None) if block.is_moe else None, valid)
            if topi is not None:
                chosen.append(topi)
        return self.norm(x), chosen

    def mtp_logits(self, h, idx, pos):
        """The MTP modules over a whole sequence (training, evaluation): h (B, T, D) the trunk's output
        for idx (B, T) -> one (B, T, V) logits per level; level m's logits at slot j predict the token
        at j+1 (as the main head's do) from the trunk's state at j-m. Before the first slot a level
        reads zeros (generation's prefill does the same)."""
        cos, sin = self.rope(pos)
        emb, out = self.wte(idx), []
        for mod in self.mtp:
            h = mod(F.pad(h, (0, 0, 1, 0))[:, :-1], emb, cos, sin)
            out.append(self.lm_head(mod.norm(h)))
        return out

    def forward(self, idx, targets=None, routes=None, valid=None):
        """idx (B, T) -> logits (B, T, V) and, with targets (-1 = ignore), the loss:
        mean cross-entropy + self.aux_loss, the sum over MoE layers of the balancing terms (0 unless
        balance == "aux"; a loss built from the logits, as in RL, should add self.aux_loss itself).
        routes (n_moe_layers, B, T, top_k): experts to replay (router replay); valid (B, T) bool: real
        tokens, the only ones counted as expert load (right-padded batches pass it; None = all)."""
        B, T = idx.shape
        if routes is not None and tuple(routes.shape) != (self.n_moe_layers, B, T, self.config.top_k):
            raise ValueError(f"routes must be (n_moe_layers, B, T, top_k), got {tuple(routes.shape)}")
        pos = torch.arange(T, device=idx.device)[None]
        logits = self.lm_head(self.trunk(idx, pos, routes=routes, valid=valid)[0])
        self.aux_loss = sum(m.aux for m in self.moe_layers())
        if targets is None:
            return logits, None
        ce = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        self.last_ce = ce.detach()
        return logits, ce + self.aux_loss

    @torch.no_grad()
    def moe_metrics(self) -> dict:
        """Flat float metrics of the last forward: per layer tokens per expert, max/mean load, router
        entropy (nats, max ln E), raw LB loss (1.0 = balanced) and z-loss, bias range; plus summaries
        over layers and the last cross-entropy (loss minus the aux terms)."""
        m, rows = {}, []
        names = ["max_mean_load", "router_entropy", "lb_loss", "z_loss", "bias_min", "bias_max"]
        for i, layer in enumerate(self.moe_layers()):
            s, c = layer.stats, layer.stats.get("counts")
            if c is None:
                continue
            c = c.float()
            rows.append(torch.stack([c.max() / c.mean().clamp_min(1e-9), s["entropy"], s["lb"], s["z"],
                                     layer.bias.min(), layer.bias.max()]).tolist())
            m.update({f"moe/l{i}/tokens_e{e}": v for e, v in enumerate(c.tolist())})
            m.update({f"moe/l{i}/{n}": v for n, v in zip(names, rows[-1])})
        if rows:
            c = list(zip(*rows))
            m.update({"moe/max_mean_load": max(c[0]), "moe/router_entropy": sum(c[1]) / len(rows),
                      "moe/lb_loss": sum(c[2]), "moe/z_loss": sum(c[3]), "moe/bias_min": min(c[4]),
                      "moe/bias_max": max(c[5])})
        if self.last_ce is not None:
            m["ce_loss"] = self.last_ce.item()
        return m

    @torch.no_grad()
    def after_optimizer_step(self):
        """Call once per optimizer step, on every rank. DeepSeek-V3 aux-free update
        bias += rate * sign(mean load - load), loads all-reduced so every rank keeps the same bias;
        then reset the global-batch load counters."""
        layers = self.moe_layers()
        if not layers:
            return
        if self.config.balance == "bias":
            loads = torch.stack([m.load if m.load is not None
                                 else torch.zeros_like(m.bias, dtype=torch.float64) for m in layers])
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(loads)
            for m, load in zip(layers, loads):
                m.bias += self.config.bias_rate * torch.sign(load.mean() - load).float()
        for m in layers:
            m.load = None

    def num_params(self) -> tuple[int, int]:
        """(total, active per token): the routed experts a token does not visit are inactive. The MTP
        modules are not counted (they serve decoding, not the model): mtp_params() counts them."""
        total = sum(p.numel() for p in self.parameters()) - self.mtp_params()
        inactive = sum((m.E - m.k) * (m.w1[0].numel() + m.w2[0].numel()) for m in self.moe_layers())
        return total, total - inactive

    def mtp_params(self) -> int:
        return sum(p.numel() for p in self.mtp.parameters())

    def estimate_flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B, as nanoGPT): 6 * active matmul params (the
        embedding lookup is not a matmul) + attention, causal: a query at position t meets t + 1 keys,
        (seq_len + 1) / 2 on average, so 12 * n_layer * n_head * head_dim * (seq_len + 1) / 2 (as
        nanochat counts it; PaLM's full seq_len counts the masked half too). MFU divides by this."""
        c = self.config
        active = self.num_params()[1] - (0 if c.tie_embeddings else self.wte.weight.numel())  # tied: the head
        return 6 * active + 6 * c.n_layer * c.n_head * c.head_width * (c.seq_len + 1)


# ----------------------------------------------------------------------------------------------
# Models made from other models, for continued pretraining (train_pretrain.py): context extension

def extend_context(model: GPT, seq_len: int) -> tuple[GPT, float]:
    """The model for a longer context, NTK-aware RoPE scaling (bloc97 2023; Code Llama raises the base
    for the same reason): base * s^(d/(d-2)), s = new/old length, d = head dim, stretches the lowest
    frequency exactly s times so the longest wavelengths span the new length, while the highest
    frequencies (local word order) barely move. A short phase at the new length adapts. Returns
    (the new model, its rope_theta)."""
    cfg = model.config
    d = cfg.head_width
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
