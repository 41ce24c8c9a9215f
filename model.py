"""
A small Mixture-of-Experts GPT, one file, read top to bottom.

    config = GPTConfig(n_expert=8, top_k=2)        # MoE (n_expert=1: the dense model of equal active size)
    model = GPT(config)
    logits, loss = model(idx, targets)             # loss = cross-entropy + MoE auxiliary terms
    outs = model.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, temperature=0.8, return_routes=True)

Architecture (nanoGPT / nanochat lineage): token embedding -> n_layer pre-norm blocks of
(causal GQA attention with RoPE and QK-norm) + (dense SwiGLU MLP in the first n_dense_layers,
a routed SwiGLU MoE with shared experts after) -> RMSNorm -> untied LM head.
Embeddings are UNTIED (as in nanochat / Llama): the input table and the output head want different
scales at this size, and untying costs nothing in active compute.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


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
    n_dense_layers: int = 1         # first layers dense, as DeepSeek-V3 / Kimi K2 do (early routing is unstable)
    dense_hidden: int = 0           # 0 -> (top_k + n_shared_expert) * expert_hidden, i.e. equal ACTIVE size
    rope_theta: float = 10000.0
    balance: str = "aux"            # "aux" (Switch LB loss + z-loss) | "bias" (DeepSeek-V3 aux-free) | "none"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 1e-3
    bias_rate: float = 1e-3

    def __post_init__(self):
        for ok, msg in [(self.n_embd % self.n_head == 0 and self.n_head % self.n_kv_head == 0
                         and (self.n_embd // self.n_head) % 2 == 0, "n_embd/n_head must be an even head dim, "
                         "n_head a multiple of n_kv_head"),
                        (self.n_expert == 1 or 1 <= self.top_k <= self.n_expert, "need 1 <= top_k <= n_expert"),
                        (0 <= self.n_dense_layers <= self.n_layer, "need 0 <= n_dense_layers <= n_layer"),
                        (self.balance in ("aux", "bias", "none"), "balance must be aux, bias or none")]:
            if not ok:
                raise ValueError(f"GPTConfig: {msg}")

    @property
    def mlp_hidden(self) -> int:
        # With n_expert=1 every layer is dense with this width, so flipping n_expert 8 -> 1 (and nothing
        # else) gives the dense model with the same active parameters per token: a one-flag ablation.
        return self.dense_hidden or (self.top_k + self.n_shared_expert) * self.expert_hidden


# ----------------------------------------------------------------------------------------------
# Attention: causal, RoPE, QK-norm, grouped-query, F.scaled_dot_product_attention

def rope_cos_sin(pos, head_dim, theta):
    """pos: (B or 1, T) integer positions -> cos, sin of shape (B or 1, 1, T, head_dim/2).
    Computed on the fly (cheap) so every row can have its own positions (left-padded generation)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim)
    f = pos[..., None].float() * inv_freq
    return f.cos()[:, None], f.sin()[:, None]


def apply_rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, -1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)


class KVCache:
    """Preallocated per-layer keys/values, (B, n_kv_head, max_len, head_dim); all rows share `pos`
    because prompts are left-padded (see GPT.generate)."""

    def __init__(self, n_layer, max_len):
        self.k, self.v, self.max_len, self.pos = [None] * n_layer, [None] * n_layer, max_len, 0

    def update(self, i, k, v):
        if self.k[i] is None:
            B, H, _, D = k.shape
            self.k[i] = k.new_zeros(B, H, self.max_len, D)
            self.v[i] = v.new_zeros(B, H, self.max_len, D)
        t = self.pos + k.size(2)
        self.k[i][:, :, self.pos:t] = k
        self.v[i][:, :, self.pos:t] = v
        return self.k[i][:, :, :t], self.v[i][:, :, :t]

    def select(self, rows):   # keep / duplicate batch rows (retire finished rows, fan out shared prompts)
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]

    def fill(self, past, end):
        """Start from rows' earlier keys/values (past[b]: (n_layer, 2, n_kv_head, n_b, head_dim), as
        take() returns them), row b's right-aligned to end at column `end` (left of it: masked pads)."""
        n_layer, _, H, _, D = past[0].shape
        for i in range(n_layer):
            self.k[i] = past[0].new_zeros(len(past), H, self.max_len, D)
            self.v[i] = past[0].new_zeros(len(past), H, self.max_len, D)
        for b, p in enumerate(past):
            for i in range(n_layer):
                self.k[i][b, :, end - p.size(3):end], self.v[i][b, :, end - p.size(3):end] = p[i, 0], p[i, 1]
        self.pos = end

    def take(self, row, cols):   # one row's keys/values at the given columns, for fill()
        return torch.stack([torch.stack([k[row][:, cols], v[row][:, cols]]) for k, v in zip(self.k, self.v)])


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.n_head, self.n_kv_head = layer_idx, cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)
        # QK-norm (OLMo 2, Gemma 3): normalising q and k per head bounds the attention logits, which
        # removes the loss spikes that come from logit growth; cheap and helps at any scale.
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)

    def forward(self, x, cos, sin, cache=None, mask=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                     self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = apply_rope(self.q_norm(q.float()), cos, sin).to(v.dtype)
        k = apply_rope(self.k_norm(k.float()), cos, sin).to(v.dtype)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        # mask=None: plain causal (training, or a prefill without padding); a decode step of one token
        # without padding attends to the whole cache, so no mask at all. (T > 1 first: a compiled
        # decode step, T = 1, then never compares T with the cache length, a symbolic bool that
        # SDPA's is_causal cannot take.)
        causal = mask is None and T > 1 and T == k.size(2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


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


class MoE(nn.Module):
    # "auto" | "grouped" | "sorted" | "dense" | "loop". auto: grouped GEMM where supported (CPU, bf16
    # CUDA), else sorted slices; dense under torch.compile on CPU. A class attribute, not config: it
    # changes speed, never results beyond float rounding (tests flip it).
    dispatch = "auto"

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
        self.load, self.aux, self.stats, self.topi = None, 0.0, {}, None

    def forward(self, x, route=None, track=True, valid=None, chosen=None):
        """valid (B, T) bool: the real tokens. Padding still flows through the experts (shapes stay
        static) but is neither counted as load nor part of the balancing terms: right-padding routed
        to expert 0 would otherwise make expert 0 look overloaded and push its bias down. chosen: a
        list this call's experts are appended to (generate reads them there, not from self.topi,
        so that generate calls may run side by side in threads: decode.generate_streams)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
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
        # Renormalise over the chosen k (OLMoE, Mixtral). With top_k=1 the gate is then 1 and the router
        # learns from the balancing terms only; use top_k >= 2.
        gates = gates / gates.sum(-1, keepdim=True).clamp_min(1e-20)
        y = self.experts_loop(x, topi, gates) if self.dispatch == "loop" else self.experts(x, topi, gates)
        if self.shared is not None:
            y = y + self.shared(x)
        self.topi = topi.detach()   # for tests and tools that look after a forward
        if chosen is not None:   # this call's own experts (self.topi may be another thread's by now)
            chosen.append(topi.detach())
        if track:   # generation skips the balancing stats: nobody reads them, and for a one-token
            if valid is not None:                     # decode step they cost ~40% of the layer
                keep = valid.reshape(-1).to(x.device)
                logits, probs, topi = logits[keep], probs[keep], topi[keep]
            self.balance_terms(logits, probs, topi)
        return y.view(shape)

    def experts(self, x, topi, gates):
        """Dropless dispatch (MegaBlocks, torchtitan): sort the N*k (token, slot) pairs by expert, run
        each expert on its contiguous slice, un-sort with a gather and sum over k. No capacity, no
        dropped tokens, no atomics in the forward combine."""
        if self.dispatch == "dense" or (self.dispatch == "auto" and torch.compiler.is_compiling() and not x.is_cuda):
            return self.experts_dense(x, topi, gates)
        N, k = topi.shape
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype   # experts in bf16
        grouped = self.dispatch == "grouped" or (self.dispatch == "auto" and HAS_GROUPED_MM
                                                 and (not x.is_cuda or dt == torch.bfloat16))
        flat = topi.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        a, b = expert_matmul(x[order // k].to(dt), self.w1.to(dt), counts, grouped).chunk(2, -1)
        out = expert_matmul(F.silu(a) * b, self.w2.to(dt), counts, grouped)
        out = out * gates.flatten()[order, None].to(dt)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return out[inverse].view(N, k, -1).sum(1)

    def experts_dense(self, x, topi, gates):
        """Every expert on every token, weighed by the gates (zero off the top-k): E/k times the
        FLOPs, but a fixed handful of ops with static shapes. What a compiled CPU decode step runs
        (decode.compiled_trunk): the sort, the bincount and grouped_mm (bf16-only under compile) are
        data-dependent; at a few dozen rows the step's cost is ops, not FLOPs. dispatch "auto" takes
        it for anything compiled on CPU (a compiled CPU training step would pay the FLOPs too)."""
        w = torch.zeros(x.size(0), self.E, dtype=x.dtype, device=x.device).scatter_add(1, topi, gates.to(x.dtype))
        a, b = torch.matmul(x, self.w1.to(x.dtype)).chunk(2, -1)                 # (E, N, H) each
        return torch.matmul(F.silu(a) * b * w.T[:, :, None], self.w2.to(x.dtype)).sum(0)

    def experts_loop(self, x, topi, gates):
        """Reference path: the textbook loop over experts (slow, obviously correct)."""
        y = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = (topi == e).nonzero(as_tuple=True)
            a, b = (x[tok] @ self.w1[e]).chunk(2, -1)
            y = y.index_add(0, tok, ((F.silu(a) * b) @ self.w2[e] * gates[tok, slot, None]).to(y.dtype))
        return y

    def balance_terms(self, logits, probs, topi):
        E = self.E
        counts = torch.bincount(topi.flatten(), minlength=E).double()
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
        P = probs.mean(0) if len(probs) else probs.sum(0)     # no real token (a dummy row): P = 0
        # Switch Transformer LB loss: E * sum_i f_i P_i, equal to 1 under perfectly uniform routing.
        lb = E * (f * P).sum()
        # Router z-loss (ST-MoE, Zoph et al. 2022): keeps router logits small, so the fp32 softmax
        # stays well conditioned and bf16 rounding of its inputs cannot flip choices.
        z = torch.logsumexp(logits, -1).square().sum() / max(len(logits), 1)
        self.aux = self.cfg.aux_loss_coef * lb + self.cfg.z_loss_coef * z if self.cfg.balance == "aux" else 0.0
        with torch.no_grad():
            entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1).sum() / max(len(probs), 1)
        self.stats = dict(counts=counts.detach(), lb=lb.detach(), z=z.detach(), entropy=entropy)


class Block(nn.Module):
    def __init__(self, cfg, i):
        super().__init__()
        self.is_moe = cfg.n_expert > 1 and i >= cfg.n_dense_layers
        self.norm1, self.norm2 = nn.RMSNorm(cfg.n_embd), nn.RMSNorm(cfg.n_embd)
        self.attn = Attention(cfg, i)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.n_embd, cfg.mlp_hidden)

    def forward(self, x, cos, sin, cache=None, mask=None, route=None, valid=None, chosen=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache, mask)
        h = self.norm2(x)
        if not self.is_moe:
            return x + self.mlp(h)
        return x + self.mlp(h, route, track=cache is None, valid=valid, chosen=chosen)


# ----------------------------------------------------------------------------------------------
# The model

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)   # untied, see top
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
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith(("proj.weight", "w2.weight", ".w2")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def moe_layers(self):
        return [b.mlp for b in self.blocks if b.is_moe]

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers())

    def trunk(self, idx, pos, cache=None, mask=None, routes=None, valid=None, chosen=None):
        """Token ids (B, T) at positions pos (B or 1, T) -> final normalised hidden states (B, T, D).
        valid (B, T) bool: real tokens, the only ones the MoE balancing statistics count (None = all).
        chosen: a list that receives each MoE layer's experts (B*T, top_k), as MoE.forward says."""
        cos, sin = rope_cos_sin(pos, self.config.n_embd // self.config.n_head, self.config.rope_theta)
        x, routes = self.wte(idx), iter(routes if routes is not None else [])
        for block in self.blocks:
            x = block(x, cos, sin, cache, mask, next(routes, None) if block.is_moe else None, valid, chosen)
        if cache is not None:
            cache.pos += idx.size(1)
        return self.norm(x)

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
        logits = self.lm_head(self.trunk(idx, pos, routes=routes, valid=valid))
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
            loads = torch.stack([m.load if m.load is not None else torch.zeros_like(m.bias, dtype=torch.float64)
                                 for m in layers])
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(loads)
            for m, load in zip(layers, loads):
                m.bias += self.config.bias_rate * torch.sign(load.mean() - load).float()
        for m in layers:
            m.load = None

    def num_params(self) -> tuple[int, int]:
        """(total, active per token): the routed experts a token does not visit are inactive."""
        total = sum(p.numel() for p in self.parameters())
        inactive = sum((m.E - m.k) * (m.w1[0].numel() + m.w2[0].numel()) for m in self.moe_layers())
        return total, total - inactive

    def estimate_flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B, as nanoGPT): 6 * active matmul params (the
        embedding lookup is not a matmul) + attention 12 * n_layer * n_head * head_dim * seq_len."""
        c = self.config
        active = self.num_params()[1] - self.wte.weight.numel()
        return 6 * active + 12 * c.n_layer * c.n_embd * c.seq_len

    # ------------------------------------------------------------------------------------------
    # Generation with a batched KV cache

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, stop_ids=(),
                 generator=None, return_routes=False, past=None, return_past=False, trunk=None) -> list[dict]:
        """Sample a continuation for each prompt, all in one batch. prompts: lists of token ids (any
        lengths), or a (B, T) integer tensor of B prompts (as nanoGPT's generate takes).

        Prompts are LEFT-padded: every row's last prompt token sits in the same column, so after one
        prefill each decode step feeds exactly one token per row and all rows share one cache
        pointer. Pads are masked out of attention, and RoPE positions count from each row's first
        real token, so a row sees exactly what it would see alone. Identical prompts (n samples per
        task for pass@k) are prefilled once and their cache rows duplicated. Finished rows (stop id
        or max_new_tokens) are dropped from the batch and the cache (in bulk, once >= 1/8 of the
        rows are done, to amortise the copy), so they stop costing compute. Per-step bookkeeping is
        a few tensor ops into preallocated (rows, max_new_tokens) buffers, with no Python loop over
        rows, so its cost does not grow with the batch.

        Multi-turn episodes (agent.py) continue rows instead of re-reading them: return_past=True
        adds "past" to each output, the keys/values of every token the row fed (its past, prompt and
        tokens[:-1]); given back as `past` (one per prompt) with the next turn's tokens as prompts,
        each row's cache starts from its past (right-aligned before the prompt, pads between are
        masked) and only the new tokens are prefilled.

        Returns per prompt {"tokens", "logprobs"[, "routes"][, "past"]}: logprobs under
        softmax(logits / T) before top-k/top-p (T = 0: greedy, plain softmax); routes (n_moe_layers,
        L - 1, top_k) are the experts of every token this call fed (prompt + tokens[:-1]), for router
        replay. trunk: the function each decode step calls instead of self.trunk, same arguments and
        result (decode.compiled_trunk: a speed path; the prefill always runs self.trunk)."""
        prompts = as_prompt_lists(prompts)
        dev, nl, k = self.lm_head.weight.device, self.n_moe_layers, self.config.top_k
        if past is not None and len(past) != len(prompts):
            raise ValueError(f"generate: {len(past)} pasts for {len(prompts)} prompts")
        if not prompts or max_new_tokens <= 0:
            return [{"tokens": [], "logprobs": [], **({"routes": torch.zeros(nl, 0, k, dtype=torch.long)}
                                                       if return_routes else {})} for _ in prompts]
        if min(len(p) for p in prompts) == 0:
            raise ValueError("empty prompt")
        uniq = {}   # a row with a past of its own is never merged with another
        which = [uniq.setdefault(i if past is not None else tuple(p), len(uniq)) for i, p in enumerate(prompts)]
        first = {w: b for b, w in reversed(list(enumerate(which)))}
        lens = torch.tensor([len(prompts[first[w]]) for w in range(len(uniq))], device=dev)
        n_past = torch.tensor([past[first[w]].size(3) if past is not None else 0 for w in range(len(uniq))], device=dev)
        A, L = int(n_past.max()), int(lens.max())     # cache columns: [pads, past] [pads, prompt] [new tokens]
        col = torch.arange(A + L, device=dev)[None]
        start = (A + L - lens)[:, None]
        idx = torch.zeros(len(uniq), L, dtype=torch.long, device=dev)   # pad id 0: masked, never seen
        for w in range(len(uniq)):
            idx[w, L - lens[w]:] = torch.tensor(prompts[first[w]], device=dev)
        valid = torch.ones(len(uniq), A + L + max_new_tokens, dtype=torch.bool, device=dev)
        valid[:, :A + L] = (col >= start) | ((col >= A - n_past[:, None]) & (col < A))
        padded = not bool(valid.all())
        cache = KVCache(self.config.n_layer, A + L + max_new_tokens)
        mask = None
        if A:
            cache.fill([past[first[w]].to(dev) for w in range(len(uniq))], A)
        if padded or A:   # causal AND key is a real token; a pad query attends to itself (no empty rows -> no NaN)
            q = col[:, A:].T
            mask = (col <= q) & valid[:, None, None, :A + L] | (col == q)
        pos = (col[:, A:] - start).clamp_min(0) + n_past[:, None]
        chosen = []
        logits = self.lm_head(self.trunk(idx, pos, cache, mask, chosen=chosen)[:, -1]).float()
        rows = torch.tensor(which, device=dev)
        cache.select(rows)
        logits, valid, pos = logits[rows], valid[rows], (n_past + lens)[rows]
        # Outputs by original row: token t of row b in column t; routes of the token in cache column c
        # (left-padded prompt, then generated tokens) in column c - A. Rows that finished but were not
        # yet retired keep writing junk past their end; n_out cuts it off.
        B = len(prompts)
        tokens = torch.zeros(B, max_new_tokens, dtype=torch.long, device=dev)
        logprobs = torch.zeros(B, max_new_tokens, device=dev)
        n_out = torch.full((B,), max_new_tokens, device=dev)
        routes = torch.zeros(nl, B, L + max_new_tokens - 1, k, dtype=torch.long, device=dev) if return_routes else None
        if return_routes and nl:
            routes[:, :, :L] = torch.stack([c.view(len(uniq), L, k) for c in chosen])[:, rows]
        stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=dev)
        alive = torch.arange(B, device=dev)                 # original row id of each batch row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        pasts = [None] * B
        def keep_past(j):   # row j of the batch: its past + prompt + tokens[:-1] (not the junk after its end)
            b = int(alive[j])
            n = int(n_past[which[b]]) + len(prompts[b]) + int(n_out[b]) - 1
            pasts[b] = cache.take(j, valid[j, :cache.pos].nonzero().squeeze(1)[:n])
        trunk = trunk or self.trunk
        for t in range(max_new_tokens):
            tok, lp = sample(logits, temperature, top_k, top_p, generator)
            tokens[alive, t], logprobs[alive, t] = tok, lp
            hit = torch.isin(tok, stop) & ~done
            n_out[alive] = torch.where(hit, t + 1, n_out[alive])
            done |= hit
            n_done = int(done.sum())
            if n_done == len(alive) or t == max_new_tokens - 1:
                break
            if 8 * n_done >= len(alive):   # retire finished rows
                if return_past:
                    for j in done.nonzero().squeeze(1).tolist():
                        keep_past(j)
                keep = (~done).nonzero().squeeze(1)
                cache.select(keep)
                tok, valid, pos, alive, done = tok[keep], valid[keep], pos[keep], alive[keep], done[keep]
            mask = valid[:, None, None, :cache.pos + 1] if padded else None
            chosen = []
            h = trunk(tok[:, None], pos[:, None], cache, mask, chosen=chosen)
            logits = self.lm_head(h[:, -1]).float()
            pos += 1
            if return_routes and nl:
                routes[:, alive, L + t] = torch.stack([c.view(len(alive), k) for c in chosen])
        if return_past:
            for j in range(len(alive)):
                keep_past(j)
        out = [{"tokens": tk[:n], "logprobs": lq[:n]}
               for tk, lq, n in zip(tokens.tolist(), logprobs.tolist(), n_out.tolist())]
        if return_routes:
            routes = routes.cpu()
            for b, o in enumerate(out):   # the prompt's own columns (its left pads excluded) + tokens[:-1]
                o["routes"] = routes[:, b, L - len(prompts[b]):L + len(o["tokens"]) - 1]
        if return_past:
            for o, p in zip(out, pasts):
                o["past"] = p
        return out


def as_prompt_lists(prompts):
    """generate()'s prompts -> a list of lists of ints: accepts lists/tuples of ids (or 1-D tensors),
    or a (B, T) integer tensor."""
    if torch.is_tensor(prompts):
        if prompts.dim() != 2 or prompts.is_floating_point():
            raise ValueError(f"generate: prompts must be a (B, T) integer tensor or a list of token-id lists, "
                             f"got a {prompts.dtype} tensor of shape {tuple(prompts.shape)}")
        return prompts.tolist()
    try:
        return [p.tolist() if torch.is_tensor(p) else [int(t) for t in p] for p in prompts]
    except (TypeError, ValueError):
        raise ValueError("generate: prompts must be a (B, T) integer tensor or a list of token-id lists") from None


def sample(logits, temperature, top_k, top_p, generator=None):
    """logits (B, V) fp32 -> (token, logprob of that token under softmax(logits / T), pre-filtering)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, logits.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
    logp = (logits / temperature).log_softmax(-1)
    filt = logp
    if top_k and top_k < logp.size(-1):
        kth = filt.topk(top_k, dim=-1).values[:, -1:]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if top_p < 1.0:   # nucleus (Holtzman et al. 2020): smallest set of tokens with mass >= top_p
        sp, si = filt.sort(-1, descending=True)
        p = sp.softmax(-1)
        drop = p.cumsum(-1) - p >= top_p                  # mass before this token already >= top_p
        filt = filt.scatter(-1, si, sp.masked_fill(drop, float("-inf")))
    # Inverse-CDF sampling: one uniform per row and a binary search (right=True never lands on a
    # zero-probability token). torch.multinomial draws V exponentials per row: it was the single
    # biggest cost of CPU generation.
    probs = logp.exp() if filt is logp else filt.softmax(-1)
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.size(0), 1, generator=generator, device=generator.device if generator else probs.device)
    tok = torch.searchsorted(cdf, u.to(probs.device) * cdf[:, -1:], right=True).squeeze(-1)
    if (tok >= probs.size(-1)).any():   # float rounding at the very top of the cdf
        tok = torch.where(tok >= probs.size(-1), probs.argmax(-1), tok)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
