"""Tests for model.py (CPU, tiny configs, seconds each): timeout 300 python -m pytest tests/test_model.py -q -x"""
import math
import os
import sys
from dataclasses import asdict

import pytest
import torch
import torch._dynamo.utils

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sampling  # noqa: E402
import model as M  # noqa: E402
from model import GPT, MLP, MoE, GPTConfig, extend_context  # noqa: E402

TINY = dict(vocab_size=61, seq_len=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
            n_expert=6, top_k=2, n_shared_expert=1, expert_hidden=16, n_dense_layers=1)


def tiny(**kw):
    torch.manual_seed(kw.pop("seed", 0))
    return GPT(GPTConfig(**{**TINY, **kw})).eval()


@pytest.fixture(autouse=True)
def _reset_dispatch():
    yield
    MoE.dispatch = "auto"


def greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits, _ = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("n_expert", [6, 1])
def test_causality(n_expert):
    model = tiny(n_expert=n_expert)
    idx = torch.randint(0, 61, (2, 20))
    idx2 = idx.clone()
    idx2[:, 12:] = torch.randint(0, 61, (2, 8))
    a, _ = model(idx)
    b, _ = model(idx2)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("n_expert", [6, 1])
def test_kv_cache_greedy_equals_full_forward(n_expert):
    model = tiny(n_expert=n_expert)
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8], [4, 4, 2, 7, 1], [5, 3, 9]]   # incl. a duplicate
    outs = sampling.reference(model, prompts, max_new_tokens=12, temperature=0)
    for p, o in zip(prompts, outs):
        assert o["tokens"] == greedy_by_full_forward(model, p, 12)
        logits, _ = model(torch.tensor([p + o["tokens"][:-1]]))
        lp = logits[0, len(p) - 1:].log_softmax(-1).gather(-1, torch.tensor(o["tokens"])[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(o["logprobs"]), lp, rtol=0, atol=1e-4)


def test_stop_ids_retire_rows():
    """sampling.retiring: rows leave the batch at their first stop id, with the tokens and routes
    of a run without stops cut there."""
    model = tiny()
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8], [4, 4, 2, 7, 1], [2, 2]]
    full = sampling.reference(model, prompts, max_new_tokens=12, temperature=0, return_routes=True)
    stop = {full[0]["tokens"][2], full[3]["tokens"][5]}
    batch_sizes = []                                     # rows fed to the LM head at each forward
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: batch_sizes.append(args[0].size(0)))
    cut = sampling.retiring(model, prompts, max_new_tokens=12, temperature=0, stop_ids=stop, return_routes=True)
    hook.remove()
    assert batch_sizes[1] == 5 and batch_sizes[-1] < 5   # finished rows left the batch
    for f, c, p in zip(full, cut, prompts):
        n = next((i + 1 for i, t in enumerate(f["tokens"]) if t in stop), 12)
        assert c["tokens"] == f["tokens"][:n]               # rows retire at their first stop id
        assert c["routes"].shape == (2, len(p) + n - 1, 2)
        assert torch.equal(c["routes"], f["routes"][:, :len(p) + n - 1])
    assert len(cut[0]["tokens"]) == 3


def test_grouped_dispatch_equals_loop_reference():
    torch.manual_seed(0)
    cfg = GPTConfig(**{**TINY, "n_expert": 6, "top_k": 2})
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.bias[4:] = -10.0      # experts 4 and 5 can never be chosen: they receive no tokens
    x = torch.randn(3, 7, 32)
    results = {}
    modes = ["sorted", "dense"] + (["grouped"] if M.HAS_GROUPED_MM else [])
    for mode in modes:
        MoE.dispatch = mode
        moe.zero_grad()
        xi = x.clone().requires_grad_()
        y, _ = moe(xi)
        (y * torch.linspace(-1, 1, 32)).sum().backward()
        results[mode] = [y.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters()]
        counts = moe.stats["counts"]
    assert counts[4] == 0 and counts[5] == 0 and counts[:4].sum() == 3 * 7 * 2
    for mode in modes[1:]:
        for a, b in zip(results["sorted"], results[mode]):   # dense sums E products per token: other rounding
            torch.testing.assert_close(b, a, rtol=1e-5, atol=5e-6 if mode == "dense" else 1e-6)
    assert results["sorted"][3][4:].abs().sum() == 0     # w1 grads of the idle experts are exactly zero


def test_grouped_mm_backward_from_sum():
    if not M.HAS_GROUPED_MM:
        pytest.skip("no grouped_mm")
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 8, 4, requires_grad=True)
    M.expert_matmul(x, w, torch.tensor([3, 0, 7]), grouped=True).sum().backward()   # zero-stride grad
    assert x.grad is not None and w.grad[1].abs().sum() == 0


def test_single_expert_equals_dense_mlp():
    torch.manual_seed(0)
    cfg = GPTConfig(**{**TINY, "n_expert": 1, "top_k": 1, "n_shared_expert": 0})
    moe, mlp = MoE(cfg), MLP(32, 16)
    with torch.no_grad():
        moe.w1.copy_(mlp.w1.weight.T[None])
        moe.w2.copy_(mlp.w2.weight.T[None])
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(moe(x)[0], mlp(x), rtol=1e-5, atol=1e-6)
    # and n_expert=1 in the config builds a plain dense GPT: no router, loss == CE, equal active width
    dense = tiny(n_expert=1)
    assert dense.n_moe_layers == 0 and not any("router" in n for n, _ in dense.named_parameters())
    assert dense.blocks[-1].mlp.w2.in_features == (TINY["top_k"] + TINY["n_shared_expert"]) * 16
    idx = torch.randint(0, 61, (2, 9))
    logits, loss = dense(idx, idx)
    assert torch.equal(loss, torch.nn.functional.cross_entropy(logits.view(-1, 61), idx.view(-1)))


def test_balance_loss_is_one_under_uniform_routing():
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY, balance="aux")
    moe = MoE(cfg)
    torch.nn.init.zeros_(moe.router.weight)              # uniform router probabilities
    N = 12                                               # 12 tokens * 2 slots = 4 per expert
    route = torch.arange(N * 2).remainder(6).view(1, N, 2)
    moe(torch.randn(1, N, 32), route)
    assert moe.stats["lb"].item() == pytest.approx(1.0, abs=1e-6)
    assert moe.stats["z"].item() == pytest.approx(math.log(6) ** 2, rel=1e-5)
    assert float(moe.aux.detach()) == pytest.approx(0.01 * 1.0 + 1e-3 * math.log(6) ** 2, rel=1e-5)


def test_global_batch_load_counts():
    model = tiny().train()
    inputs = {}
    for m in model.moe_layers():
        m.register_forward_hook(lambda mod, args, out: inputs.__setitem__(mod, args[0].detach()))
    a, b = torch.randint(0, 61, (2, 2, 10))
    model(a, a)
    c1 = [m.stats["counts"].clone() for m in model.moe_layers()]
    model(b, b)
    for m, c in zip(model.moe_layers(), c1):
        assert torch.equal(m.load, c + m.stats["counts"])     # loads of BOTH micro-batches
        f = (m.load / m.load.sum()).float()
        P = (inputs[m].reshape(-1, 32) @ m.router.weight.T).softmax(-1).mean(0)   # this micro-batch
        torch.testing.assert_close(m.stats["lb"], 6 * (f * P).sum())
    model.after_optimizer_step()
    assert all(m.load is None for m in model.moe_layers())
    with torch.no_grad():                               # no counting outside training forwards
        model(a, a)
    model.eval()
    model(a, a)
    assert all(m.load is None for m in model.moe_layers())


def test_bias_update_moves_load_toward_balance():
    model = tiny(balance="bias").train()
    with torch.no_grad():                              # make the routers strongly prefer some experts
        for m in model.moe_layers():
            m.router.weight.mul_(40)
    idx = torch.randint(0, 61, (4, 16))

    def imbalance():
        with torch.no_grad():
            model.eval()
            model(idx)
            model.train()
        return model.moe_metrics()["moe/max_mean_load"]

    before = imbalance()
    model(idx, idx)
    layer = model.moe_layers()[0]
    load = layer.load.clone()
    model.after_optimizer_step()
    assert torch.all(layer.bias[load > load.mean()] < 0) and torch.all(layer.bias[load < load.mean()] > 0)
    model.config.bias_rate = 0.05
    for _ in range(60):
        model(idx, idx)
        model.after_optimizer_step()
    after = imbalance()
    assert after < before and after < 1.5, (before, after)
    # the bias changes the choice, never the gate values: replaying the same experts gives same outputs
    model.eval()
    routes = torch.stack([c.view(4, 16, 2) for c in model.trunk(idx, torch.arange(16)[None])[1]])
    ref, _ = model(idx, routes=routes)
    for m in model.moe_layers():
        m.bias.zero_()
    out, _ = model(idx, routes=routes)
    assert torch.equal(ref, out)


def test_padding_is_not_expert_load():
    # A right-padded batch under router replay: the pads carry expert 0 (rl.collate's fill). Only the
    # valid positions count as load, enter the aux terms, and move the aux-free bias.
    model = tiny(balance="bias").train()
    B, T, L = 4, 12, 4                                   # real tokens: the first L of each row
    idx = torch.randint(0, 61, (B, T))
    valid = torch.zeros(B, T, dtype=torch.bool)
    valid[:, :L] = True
    routes = torch.stack([torch.arange(B * T * 2).view(B, T, 2) % 6] * model.n_moe_layers)   # every expert alike
    routes[:, ~valid] = torch.tensor([0, 1])             # pads on experts 0 and 1
    model(idx, idx, routes=routes, valid=valid)
    for m in model.moe_layers():
        real = torch.bincount(routes[0][valid].flatten(), minlength=6).double()
        assert torch.equal(m.load, real), "pads are not load"
        assert m.load.sum().item() == B * L * 2
    model.after_optimizer_step()
    bias = model.moe_layers()[0].bias
    real = torch.bincount(routes[0][valid].flatten(), minlength=6).double()
    assert torch.equal(bias > 0, real < real.mean()) and torch.equal(bias < 0, real > real.mean())
    # the aux terms use the valid positions only: equal to a forward on the real tokens alone
    model = tiny(balance="aux").train()
    model(idx, idx, routes=routes, valid=valid)
    lb_padded = [m.stats["lb"].item() for m in model.moe_layers()]
    z_padded = [m.stats["z"].item() for m in model.moe_layers()]
    for m in model.moe_layers():
        m.load = None
    model(idx[:, :L], idx[:, :L], routes=routes[:, :, :L])
    assert lb_padded == pytest.approx([m.stats["lb"].item() for m in model.moe_layers()], rel=1e-5)
    assert z_padded == pytest.approx([m.stats["z"].item() for m in model.moe_layers()], rel=1e-5)
    # a batch of nothing but padding (a DDP rank's dummy micro-batch) counts nothing
    model(idx, idx, routes=routes, valid=torch.zeros(B, T, dtype=torch.bool))
    assert model.moe_layers()[0].stats["counts"].sum() == 0


def test_router_replay():
    model = tiny()
    g = torch.Generator().manual_seed(1)
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7]]
    outs = sampling.reference(model, prompts, max_new_tokens=10, temperature=1.0, generator=g, return_routes=True)
    seqs = [p + o["tokens"][:-1] for p, o in zip(prompts, outs)]
    T = max(map(len, seqs))
    idx = torch.full((2, T), 60)
    routes = torch.zeros(model.n_moe_layers, 2, T, 2, dtype=torch.long)   # right padding, pad expert 0
    for i, (s, o) in enumerate(zip(seqs, outs)):
        assert o["routes"].shape == (2, len(s), 2)
        idx[i, :len(s)] = torch.tensor(s)
        routes[:, i, :len(s)] = o["routes"]
    for i, s in enumerate(seqs):            # the recorded experts are the ones a full forward picks
        free, _ = model(torch.tensor([s]))
        chosen = torch.stack(model.trunk(torch.tensor([s]), torch.arange(len(s))[None])[1])
        assert torch.equal(chosen, routes[:, i, :len(s)])
        forced, _ = model(torch.tensor([s]), routes=routes[:, i:i + 1, :len(s)])
        assert torch.equal(forced, free)
        padded, _ = model(idx, routes=routes)
        torch.testing.assert_close(padded[i, :len(s)], free[0], rtol=0, atol=1e-5)
    # forcing other experts changes the output, and the router still gets gradients
    model.train()
    other = (routes + 1) % 6
    logits, loss = model(idx, idx, routes=other)
    assert not torch.allclose(logits, padded)
    model.moe_layers()[0].router.weight.grad = None
    loss.backward()
    assert model.moe_layers()[0].router.weight.grad.abs().sum() > 0


def test_extend_context_keeps_weights_and_stretches_the_rope_base():
    model = tiny()
    longer, theta = extend_context(model, 4 * model.config.seq_len)
    d = model.config.n_embd // model.config.n_head
    assert theta == pytest.approx(model.config.rope_theta * 4 ** (d / (d - 2)))
    assert (longer.config.seq_len, longer.config.rope_theta) == (4 * model.config.seq_len, theta)
    for (k, a), (k2, b) in zip(model.state_dict().items(), longer.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    idx = torch.randint(0, 61, (1, 3 * model.config.seq_len))
    assert torch.isfinite(longer.eval()(idx)[0]).all()      # a context the old model could not take


@pytest.mark.parametrize("dispatch", ["auto", "sorted", "grouped"])
def test_bf16_autocast_forward_backward(dispatch):
    if dispatch == "grouped" and not M.HAS_GROUPED_MM:
        pytest.skip("no grouped_mm")
    MoE.dispatch = dispatch
    model = tiny().train()
    idx = torch.randint(0, 61, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    router = model.moe_layers()[0].router.weight
    assert router.grad is not None and torch.isfinite(router.grad).all() and router.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = sampling.reference(model, [[1, 2, 3], [4]], max_new_tokens=4, temperature=0)
    assert [len(o["tokens"]) for o in outs] == [4, 4]


def test_save_load_round_trip(tmp_path):
    model = tiny(balance="bias").train()
    idx = torch.randint(0, 61, (2, 10))
    model(idx, idx)
    model.after_optimizer_step()                         # a non-zero router bias must survive
    assert any(m.bias.abs().sum() > 0 for m in model.moe_layers())
    torch.save({"model_config": asdict(model.config), "model": model.state_dict()}, tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    clone = GPT(GPTConfig(**ck["model_config"]))
    clone.load_state_dict(ck["model"])
    model.eval(), clone.eval()
    assert torch.equal(model(idx)[0], clone(idx)[0])
    assert sampling.reference(model, [[1, 2]], 5, temperature=0) == sampling.reference(clone, [[1, 2]], 5, temperature=0)


def test_sampling_filters_and_logprobs():
    model = tiny()
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 3, 9], [1, 2]] * 3
    outs = sampling.reference(model, prompts, max_new_tokens=8, temperature=0.7, top_k=5, top_p=0.9, generator=g)
    for p, o in zip(prompts, outs):
        logits, _ = model(torch.tensor([p + o["tokens"][:-1]]))
        lp = (logits[0, len(p) - 1:] / 0.7).log_softmax(-1)
        toks = torch.tensor(o["tokens"])
        assert (lp.topk(5, -1).indices == toks[:, None]).any(-1).all()       # inside the top-5
        torch.testing.assert_close(torch.tensor(o["logprobs"]), lp.gather(-1, toks[:, None]).squeeze(1),
                                   rtol=0, atol=1e-4)                    # log-probs BEFORE filtering
    assert sampling.sample(torch.tensor([[0.0, 5.0, 4.9, -9.0]]), 1.0, 0, 0.5)[0].item() == 1   # top-p keeps >= 1


def test_param_counts_flops_and_step0_loss():
    moe, dense = tiny(balance="aux"), tiny(n_expert=1)   # aux: the loss holds the balancing term
    (mt, ma), (dt, da) = moe.num_params(), dense.num_params()
    router = 2 * 32 * 6                                  # 2 MoE layers, D x E router each
    assert ma == da + router and mt == ma + 2 * (6 - 2) * 3 * 32 * 16 and dt == da
    assert moe.estimate_flops_per_token() == 6 * (ma - 61 * 32) + 12 * 3 * 32 * (64 + 1) / 2   # causal
    idx = torch.randint(0, 61, (8, 32))
    lm, ld = moe(idx, idx)[1], dense(idx, idx)[1]
    ce_moe = moe.moe_metrics()["ce_loss"]
    assert abs(ce_moe - math.log(61)) < 0.05 and abs(ld.item() - math.log(61)) < 0.05   # same start
    assert lm.item() == pytest.approx(ce_moe + moe.aux_loss.item(), rel=1e-6) and moe.aux_loss.item() > 0
    assert float(dense.aux_loss) == 0.0
    metrics = moe.moe_metrics()
    for key in ["moe/l0/tokens_e0", "moe/l1/max_mean_load", "moe/router_entropy", "moe/lb_loss",
                "moe/z_loss", "moe/bias_min", "moe/bias_max"]:
        assert isinstance(metrics[key], float)


def _ddp_worker(rank, world, tmp):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    res = {}
    for balance in ["aux", "bias"]:
        model = tiny(balance=balance).train()
        inputs = {}
        layer = model.moe_layers()[0]
        layer.register_forward_hook(lambda mod, args, out: inputs.__setitem__("x", args[0].detach()))
        torch.manual_seed(100 + rank)                    # every rank sees different data
        idx = torch.randint(0, 61, (2, 10))
        model(idx, idx)
        res[balance] = dict(counts=layer.stats["counts"], lb=layer.stats["lb"],
                            P=(inputs["x"].reshape(-1, 32) @ layer.router.weight.T).softmax(-1).mean(0))
        model.after_optimizer_step()
        res[balance]["bias"] = layer.bias.clone()
    torch.save(res, f"{tmp}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow   # DDP: two processes
def test_ddp_global_loads_and_bias_all_reduced(tmp_path):
    torch.multiprocessing.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    r = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2)]
    total = r[0]["aux"]["counts"] + r[1]["aux"]["counts"]
    assert not torch.equal(r[0]["aux"]["counts"], r[1]["aux"]["counts"])
    for i in range(2):                                   # f_i counted over both ranks, P_i local
        f = (total / total.sum()).float()
        torch.testing.assert_close(r[i]["aux"]["lb"], 6 * (f * r[i]["aux"]["P"]).sum())
    load = r[0]["bias"]["counts"] + r[1]["bias"]["counts"]
    expected = 1e-3 * torch.sign(load.mean() - load).float()
    assert torch.equal(r[0]["bias"]["bias"], r[1]["bias"]["bias"])
    torch.testing.assert_close(r[0]["bias"]["bias"], expected)


def test_generate_takes_a_tensor_of_prompts():
    model = tiny()
    idx = torch.tensor([[5, 3, 9, 1], [1, 2, 3, 4]])
    g = torch.Generator()
    a = sampling.reference(model, idx, 6, temperature=1.0, generator=g.manual_seed(3), return_routes=True)
    b = sampling.reference(model, idx.tolist(), 6, temperature=1.0, generator=g.manual_seed(3), return_routes=True)
    assert [o["tokens"] for o in a] == [o["tokens"] for o in b] and len(a[1]["tokens"]) == 6
    assert all(torch.equal(x["routes"], y["routes"]) for x, y in zip(a, b))
    for bad in (idx[0], idx.float(), [[1, "a"]], 7):
        with pytest.raises(ValueError, match="prompts must be a .B, T. integer tensor or a list of token-id lists"):
            sampling.reference(model, bad, 2)


def test_decode_threads_changes_speed_not_samples(monkeypatch):
    model = tiny()
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8]] * 4
    threads = torch.get_num_threads()
    outs = []
    for n in (0, 1):
        monkeypatch.setattr(sampling, "THREADS", n)
        outs.append(sampling.generate(model, prompts, 10, temperature=1.0,
                                            generator=torch.Generator().manual_seed(0)))
        assert torch.get_num_threads() == threads        # restored after generation
    for a, b in zip(*outs):
        assert a["tokens"] == b["tokens"]
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=0, atol=1e-5)


def test_sampled_distribution_matches_full_forward():
    """8000 samples of one prompt (prefilled once, its cache row fanned out to 8000 rows, retired in
    bulk): the first token's empirical distribution is the full forward pass's softmax(logits / T),
    and the second token's, given the most frequent first token, too. The LM head is scaled up so
    the distribution is peaked: a wrong temperature (1.0 instead of 0.8) is off by ~0.12 in TV."""
    model = tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    p, n, temp = [5, 3, 9, 1], 8000, 0.8
    outs = sampling.reference(model, [p] * n, 2, temperature=temp, stop_ids=[7], generator=torch.Generator().manual_seed(0))
    first = torch.tensor([o["tokens"][0] for o in outs])
    t = int(torch.bincount(first).argmax())
    second = torch.tensor([o["tokens"][1] for o in outs if o["tokens"][0] == t and len(o["tokens"]) == 2])
    for prefix, drawn in (([], first), ([t], second)):
        logits, _ = model(torch.tensor([p + prefix]))
        probs = (logits[0, -1] / temp).softmax(-1)
        freq = torch.bincount(drawn, minlength=probs.numel()) / len(drawn)
        assert len(drawn) > 2000 and 0.5 * (freq - probs).abs().sum() < 0.04   # total variation, ~0.01 by chance


def test_generate_continues_a_past_like_the_full_prompt():
    """Multi-turn: a second call given each row's past (return_past) and only the new tokens samples
    exactly what one call on the whole context would (greedy), with the same log-probs and routes,
    for rows that stopped at different steps (retired with their past kept) and ones that ran out."""
    model = tiny()
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [6, 7, 8]] * 3   # 12 rows: a finished row
    first = sampling.reference(model, prompts, 6, temperature=1.0, stop_ids=[5, 17, 23, 40], generator=g,   # lingers
                           return_past=True)                    # until 1/8 are done, writing junk
    assert {len(o["tokens"]) for o in first} != {6}            # some rows stopped early
    feeds = [[30, 31], [32, 33, 34, 35], [36], [37, 38, 39]] * 3
    cont = sampling.reference(model, feeds, 5, temperature=0, past=[o["past"] for o in first], return_routes=True)
    for p, o, f, c in zip(prompts, first, feeds, cont):
        assert o["past"].size(3) == len(p) + len(o["tokens"]) - 1
        whole = p + o["tokens"][:-1] + f
        ref = sampling.reference(model, [whole], 5, temperature=0, return_routes=True)[0]
        assert c["tokens"] == ref["tokens"] == greedy_by_full_forward(model, whole, 5)
        assert torch.allclose(torch.tensor(c["logprobs"]), torch.tensor(ref["logprobs"]), atol=1e-5)
        assert torch.equal(c["routes"], ref["routes"][:, -c["routes"].size(1):])
    # a third turn continues the second's past the same way
    again = sampling.reference(model, [[41, 42]] * len(prompts), 4, temperature=0,
                           past=[sampling.reference(model, f, 5, temperature=0, past=[o["past"]], return_past=True)[0]["past"]
                                 for f, o in zip(([f] for f in feeds), first)])
    for p, o, f, c, a in zip(prompts, first, feeds, cont, again):
        whole = p + o["tokens"][:-1] + f + c["tokens"][:-1] + [41, 42]
        assert a["tokens"] == greedy_by_full_forward(model, whole, 4)


def host_reads(monkeypatch):
    """Counts the reads of tensor values into Python (each one a wait for the device on a GPU):
    .item(), .tolist(), bool(), int(), float(), use as an index, .nonzero() (its shape is the
    data), torch.bincount (it reads its input's max). A list that grows by one name per read."""
    seen = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        def counted(self, *a, _f=getattr(torch.Tensor, name), _n=name, **kw):
            seen.append(_n)
            return _f(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)
    monkeypatch.setattr(torch, "bincount", lambda *a, _f=torch.bincount, **kw: seen.append("bincount") or _f(*a, **kw))
    return seen


@pytest.mark.parametrize("dispatch", ["auto", "grouped", "dense"])
def test_sync_free_decode_reads_the_host_every_few_tokens(monkeypatch, dispatch):
    """sampling.SYNC_FREE (GPU decoding, forced here on CPU): the decode loop reads nothing from the
    device per token, only the finished rows every DONE_EVERY tokens: 48 more tokens add 3 looks, at
    most 2 reads each (their count; the rows to keep, where rows retire), for any MoE dispatch that
    keeps group sizes on the device. The CPU loop reads every token (the check that the count sees
    them), and MoE 'sorted' reads the group sizes. Through the reference's decode step, as on a GPU
    (the fused step is the CPU's: sampling.decoder)."""
    MoE.dispatch = dispatch
    monkeypatch.setattr(sampling, "DONE_EVERY", 16)
    monkeypatch.setattr(sampling, "FUSED", False)
    model, prompts = tiny(), [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8]] * 3      # padded: a masked decode step
    extra = {}
    for free in (True, False):
        monkeypatch.setattr(sampling, "SYNC_FREE", free)
        counts = []
        for n in (17, 65):
            with monkeypatch.context() as m:
                seen = host_reads(m)
                sampling.retiring(model, prompts, n, temperature=1.0, stop_ids=[60], return_routes=True,
                                generator=torch.Generator().manual_seed(0))
            counts.append(len(seen))
        extra[free] = counts[1] - counts[0]
    assert extra[True] <= 6 and extra[False] >= 48, extra
    if dispatch == "auto":
        monkeypatch.setattr(sampling, "SYNC_FREE", True)
        MoE.dispatch = "sorted"
        with monkeypatch.context() as m:
            seen = host_reads(m)
            sampling.retiring(model, prompts, 8, temperature=1.0)
        assert seen.count("tolist") >= 7 * model.n_moe_layers


def test_sync_free_decode_samples_what_generate_does(monkeypatch):
    """SYNC_FREE changes when finished rows are seen, not what rows sample: greedy, rows that stop at
    different steps get the same tokens, routes and pasts, log-probs within float rounding (they
    retire later, in other batches); sampled without a stop (no row retires either way), the same
    tokens; and a CPU generator for a model elsewhere is turned into one on the model's device."""
    model = tiny()
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [6, 7, 8]] * 3
    runs = {}
    for free in (False, True):
        monkeypatch.setattr(sampling, "SYNC_FREE", free)
        monkeypatch.setattr(sampling, "DONE_EVERY", 4)
        runs[free] = (sampling.retiring(model, prompts, 11, temperature=0, stop_ids=[5, 46, 34], return_routes=True,
                                      return_past=True),
                      sampling.generate(model, prompts * 2, 9, temperature=1.0, top_p=0.9, return_routes=True,
                                              generator=torch.Generator().manual_seed(4)))
    assert {len(o["tokens"]) for o in runs[False][0]} == {2, 4, 6}      # rows stopped at several steps
    for a, b in zip(runs[False][0], runs[True][0]):
        assert a["tokens"] == b["tokens"] and torch.equal(a["routes"], b["routes"])
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=0, atol=1e-5)
        torch.testing.assert_close(a["past"], b["past"], rtol=0, atol=1e-5)
    for a, b in zip(runs[False][1], runs[True][1]):
        assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"] and torch.equal(a["routes"], b["routes"])
    made = []
    real = torch.Generator

    class Elsewhere:   # a generator on another device than the model's
        device = torch.device("meta")

        def __init__(self, *a):
            pass
    monkeypatch.setattr(torch, "randint", lambda *a, generator=None, **kw: torch.tensor([5]))
    monkeypatch.setattr(torch, "Generator", lambda dev: made.append(dev) or real(dev))
    out = sampling.retiring(model, prompts[:2], 3, temperature=1.0, generator=Elsewhere())
    assert made == [torch.device("cpu")] and len(out[0]["tokens"]) == 3


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 2), (8, 2), (4, 1)])
def test_matched_heads_attention_equals_enable_gqa(n_head, n_kv_head):
    """Attention.gqa 'matched' (CUDA with a mask: the key/value heads brought to the query heads'
    count, so that a fused SDPA backend takes the masked call) computes what enable_gqa does: packed
    RL rows (rl/algo.block_mask, T > 1), and left-padded decoding (one query token, heads folded)."""
    from rl.algo import token_logprobs
    model = tiny(n_head=n_head, n_kv_head=n_kv_head)
    idx = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(0))
    seg = torch.tensor([[0] * 8 + [1] * 10 + [2] * 12, [0] * 12 + [1] * 9 + [-1] * 9])
    pos = torch.cat([torch.arange(8), torch.arange(8, 18), torch.arange(8, 20)])[None].repeat(2, 1)
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8]] * 2
    out = {}
    try:
        for mode in ("native", "matched"):
            M.Attention.gqa = mode
            with torch.no_grad():
                lp, _ = token_logprobs(model, idx, idx, None, 1.0, pos=pos, seg=seg)
            out[mode] = lp, sampling.reference(model, prompts, 8, temperature=0, return_routes=True)
    finally:
        M.Attention.gqa = "auto"
    torch.testing.assert_close(out["native"][0], out["matched"][0], rtol=0, atol=1e-5)
    for a, b in zip(out["native"][1], out["matched"][1]):
        assert a["tokens"] == b["tokens"] and torch.equal(a["routes"], b["routes"])
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_decoding_waits_for_the_device_every_few_tokens_and_masked_attention_is_fused():
    """On a GPU, in bf16 autocast (as sampling.generate decodes) and in fp32 (MoE.DENSE_ROWS): 48 more
    tokens of a padded batch cost at most 3 more synchronisations (torch.cuda.set_sync_debug_mode
    counts them), and a masked GQA attention (packed RL rows, a padded decode step) runs with the
    math backend turned off."""
    import warnings
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = tiny().cuda()
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6, 7], [8]] * 8
    for bf16 in (True, False):
        counts = []
        for n in (17, 65):
            g = torch.Generator("cuda").manual_seed(0)
            with warnings.catch_warnings(record=True) as seen, torch.autocast("cuda", torch.bfloat16, enabled=bf16):
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    sampling.retiring(model, prompts, n, temperature=1.0, stop_ids=[60], generator=g, return_routes=True)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(w.message) for w in seen))
        assert counts[1] - counts[0] <= 3, (bf16, counts)
    x = torch.randn(3, 40, 32, device="cuda", dtype=torch.bfloat16)
    seg = torch.tensor([[0] * 10 + [1] * 15 + [2] * 15] * 3, device="cuda")
    from rl.algo import block_mask
    cos, sin = model.rope(torch.arange(40, device="cuda")[None])
    attn = model.blocks[0].attn.to(torch.bfloat16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), torch.no_grad():
        attn(x, cos, sin, mask=block_mask(seg))
        cache = sampling.KVCache(model.config.n_layer, 41)
        attn(x, cos, sin, cache, block_mask(seg))
        cache.pos = 40
        attn(x[:, :1], cos[:, :, :1], sin[:, :, :1], cache, (torch.arange(41, device="cuda") > 2).expand(3, 1, 1, 41))


def test_widths_that_crash_grouped_mm_on_a_gpu_are_refused():
    """bf16 grouped_mm needs 16-byte aligned rows (the CPU build raises it too, below); an MoE width
    that is not a multiple of 8 passed every fp32 test here and crashed on an H100. GPTConfig refuses
    it with the fix; a dense model (no grouped_mm) may take any width."""
    import torch.nn.functional as F
    x, w, offs = torch.randn(10, 100, dtype=torch.bfloat16), torch.randn(2, 100, 16, dtype=torch.bfloat16), \
        torch.tensor([4, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        F.grouped_mm(x, w, offs=offs)
    for bad, fix in (({"expert_hidden": 100}, "use expert_hidden 104"), ({"n_embd": 36, "n_head": 2}, "use n_embd 40")):
        with pytest.raises(ValueError, match=fix):
            GPTConfig(**{**TINY, **bad})
    GPTConfig(**{**TINY, "n_expert": 1, "expert_hidden": 100})


@pytest.mark.parametrize("with_valid", [False, True])
def test_a_compiled_moe_block_has_no_graph_break(with_valid):
    """torch.compile of a training forward through an MoE block: the expert loads used to come from
    torch.bincount, a dynamic-shape operator (and padding was dropped by a boolean index), which
    broke the graph in every MoE layer. Counted by index_add and weighted by the valid mask, the
    block compiles whole (dispatch auto under the compiler: dense on a CPU)."""
    import torch._dynamo
    model = tiny().train()
    block = model.blocks[1]
    assert block.is_moe
    x = torch.randn(2, 16, 32)
    cos, sin = model.rope(torch.arange(16)[None])
    valid = torch.arange(16)[None].expand(2, 16) < torch.tensor([[16], [11]]) if with_valid else None

    def forward(x):
        return block(x, cos, sin, valid=valid)[0].sum()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    # the loads count the real tokens only: 16 + 11 of them, top_k experts each
    assert block.mlp.stats["counts"].sum().item() == (27 if with_valid else 32) * 2
