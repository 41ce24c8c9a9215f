"""lab/bench.py's device-parameterised pieces on the CPU, at tiny sizes (seconds): the GPU path is the
same code with another torch.device, so what runs here is what a GPU runs, bar autocast and the
synchronisations. python -m pytest -q tests/test_bench.py; the slow test runs the real command."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lab import bench, gpu_check
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
RATIOS = ("moe_vs_dense_train", "kv_cache_speedup", "batched_generation_speedup")
MODEL_KEYS = {"dense_train_tok_s", "moe_train_tok_s", "params_dense_total_active", "params_moe_total_active",
              "kv_cache_tok_s", "recompute_tok_s", "kv_cache_recompute_extrapolated", "batched_tok_s",
              "one_prompt_at_a_time_tok_s", *RATIOS}


def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=61, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_expert=4,
                         top_k=2, n_shared_expert=1, expert_hidden=16, n_dense_layers=1)).eval()


def test_reduced_model_ratios_on_cpu():
    """gpu-check's `ratios` stage in its CPU form: bench_model at smoke sizes, every key of lab/bench.py's
    model part, each ratio a positive finite number, and the figures consistent with each other."""
    r = gpu_check.gpu_check_ratios(CPU)
    assert r["ok"] is True
    assert MODEL_KEYS <= set(r)
    for k in RATIOS:
        assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])
    assert r["moe_vs_dense_train"] == pytest.approx(r["moe_train_tok_s"] / r["dense_train_tok_s"])
    assert r["kv_cache_speedup"] == pytest.approx(r["kv_cache_tok_s"] / r["recompute_tok_s"])
    assert r["kv_cache_recompute_extrapolated"] is False   # 32 new tokens: all recomputed, none extrapolated
    assert r["params_moe_total_active"][0] > r["params_moe_total_active"][1]   # experts: total > active


def test_timing_helpers_and_device_name():
    r, s = bench.timed(lambda: sum(range(10 ** 5)), CPU)
    assert r == sum(range(10 ** 5)) and 0 < s < 5
    assert 0 < bench.best_time(lambda: None, 3, CPU) <= s
    assert bench.device_name(CPU) == f"cpu ({os.cpu_count()} cores)"


def test_eot_hazard_sets_the_end_probability():
    """eot_at_lengths: at the first generated position P(eot) is h_1 = P(L = 1) / P(L >= 1) of the
    lengths given (here 1 of 4 samples has length 1: 0.25), at every position of a prefill."""
    model, eot = tiny(), 7
    hooks = bench.eot_at_lengths(model, eot, [1, 2, 3, 3])
    try:
        with torch.no_grad():
            logits, _ = model(torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0)))
    finally:
        for h in hooks:
            h.remove()
    p = logits.float().softmax(-1)[..., eot]
    assert torch.allclose(p, torch.full_like(p, 0.25), atol=1e-5), p


@pytest.mark.parametrize("fused", [False, True])
def test_eot_hazard_ends_samples_at_the_lengths_given(monkeypatch, fused):
    """Through either decode step (sampling.decoder: the fused one embeds one token a row), greedy
    samples end where the hazard first makes end-of-text likeliest (lengths 3, 3, 4: P(eot) 0, 0, 2/3
    at tokens 1-3): the hooks count the steps of each generate call."""
    import sampling
    monkeypatch.setattr(sampling, "FUSED", fused)
    model, eot = tiny(), 7
    hooks = bench.eot_at_lengths(model, eot, [3, 3, 4])
    try:
        for _ in range(2):     # a second call counts from its own prefill
            outs = sampling.generate(model, [[1, 2, 3], [4, 5]] * 3, 8, temperature=0, stop_ids=[eot])
            assert [len(o["tokens"]) for o in outs] == [3] * 6 and {o["tokens"][-1] for o in outs} == {eot}
    finally:
        for h in hooks:
            h.remove()
    hooks = bench.eot_at_lengths(model, eot, [3, 3])     # sampled: P(eot) 1 at the last length, not NaN
    try:
        outs = sampling.generate(model, [[1, 2, 3], [4, 5]] * 3, 8, temperature=1.0, stop_ids=[eot],
                                 generator=torch.Generator().manual_seed(0))
        assert [len(o["tokens"]) for o in outs] == [3] * 6
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_device_cuda_without_a_gpu_is_refused_in_one_line():
    p = subprocess.run([sys.executable, "-m", "lab.bench", "--device", "cuda", "model"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.strip() == "error: --device cuda but no CUDA device is visible"


@pytest.mark.slow   # the model part at its --quick sizes: ~20 s on 2 cores
def test_bench_model_command_names_the_device():
    p = subprocess.run([sys.executable, "-m", "lab.bench", "--quick", "--device", "cpu", "model"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0] == f"[model] on cpu ({os.cpu_count()} cores)"
    r = json.loads(lines[-1])
    assert r["device"] == f"cpu ({os.cpu_count()} cores)" and "machine" in r
    assert MODEL_KEYS <= set(r)
    for k in RATIOS:
        assert r[k] > 0, (k, r)
    assert r["kv_cache_recompute_extrapolated"] is True
