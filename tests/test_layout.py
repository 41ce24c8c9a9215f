"""The layout's promises, measured: imports run one way (no circle between modules, none between rooms,
a package counting as one room), and the reading path is short: one RL step of the cpu preset passes
through at most 8 of the project's files, one agent episode through at most 6 (sys.setprofile over the
step: every file of the project whose functions it calls, tests left out). The counts print with -s:
    python -m pytest tests/test_layout.py -q -s"""
import ast
import collections
import os
import sys
import zlib
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import env  # noqa: E402
import sandbox  # noqa: E402
from infra import common  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from data.tasks import generate_tasks  # noqa: E402
from tokenizer import train_tokenizer  # noqa: E402


def project_modules(root=ROOT):
    """{module name: path} of every project module outside tests/ (lab/experiments/*.py included): not
    hidden directories, nor a virtual environment's (its root holds pyvenv.cfg: `python -m venv .venv` or
    `venv` in the checkout, as a user installs the requirements)."""
    out = {}
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and (top != root or d != "tests")
                   and not os.path.isfile(os.path.join(top, d, "pyvenv.cfg"))]
        for name in files:
            rel = os.path.relpath(os.path.join(top, name), root)
            if name.endswith(".py") and name != "__init__.py":
                out[rel[:-3].replace(os.sep, ".")] = rel
    return out


def import_graph():
    """{module: the project modules it imports}, local imports included (a circle through a function's
    import is still a circle)."""
    mods, graph = project_modules(), {}
    for name, rel in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, rel)).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycle(graph):
    """A circle of the graph as a list of nodes, or None."""
    state = {}

    def visit(n, path):
        state[n] = "open"
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m, path + [m])):
                return found
        state[n] = "done"
        return None
    for n in sorted(graph):
        if n not in state and (found := visit(n, [n])):
            return found
    return None


def test_no_import_circles_between_modules_or_rooms():
    graph = import_graph()
    assert {"train_rl", "env", "sandbox", "rl.algo", "data.repos", "lab.bench"} <= set(graph)
    assert cycle(graph) is None
    room = lambda m: m.split(".")[0] if "." in m else m     # a package is one room; a top-level file its own
    rooms = collections.defaultdict(set)
    for m, deps in graph.items():
        rooms[room(m)] |= {room(d) for d in deps if room(d) != room(m)}
    assert cycle(rooms) is None, cycle(rooms)
    # the sandbox imports nothing of the project (its workers run from this file's image; the trainer's
    # side reaches infra/cli.py's one-line error inside the function that refuses to start), and the
    # bottom floor (model, tokenizer, infra) nothing above it
    assert graph["sandbox"] <= {"infra.cli"}
    for low in ("model", "tokenizer", "infra.common", "infra.cli"):
        assert graph[low] <= {"model", "tokenizer", "infra.common", "infra.cli"}, (low, graph[low])


class Profile:
    """The project files (project_modules: outside tests/, nor a virtual environment's packages) whose
    functions run while it is on."""
    def __init__(self):
        self.files, self.ours = collections.Counter(), set(project_modules().values())

    def __call__(self, frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and f.startswith(ROOT + os.sep) and (rel := os.path.relpath(f, ROOT)) in self.ours:
            self.files[rel] += 1

    def around(self, fn):
        def traced(*a, **kw):
            sys.setprofile(self)
            try:
                return fn(*a, **kw)
            finally:
                sys.setprofile(None)
        return traced


def test_a_virtual_environment_in_the_checkout_is_not_the_projects(tmp_path):
    """`python -m venv .venv` (or venv) at the checkout's root, the requirements installed there: its
    site-packages are neither project modules nor files an RL step passes through."""
    for rel in ["a.py", "pkg/__init__.py", "pkg/m.py", "tests/test_a.py", ".venv/pyvenv.cfg",
                ".venv/lib/python3.11/site-packages/tqdm/std.py", "venv/pyvenv.cfg",
                "venv/lib/python3.11/site-packages/torch/nn.py", ".git/hooks/x.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert project_modules(str(tmp_path)) == {"a": "a.py", "pkg.m": os.path.join("pkg", "m.py")}
    profile = Profile()
    for path in [".venv/lib/python3.11/site-packages/tqdm/std.py", "venv/lib/python3.11/site-packages/torch/nn.py",
                 "env.py", "tests/test_layout.py"]:
        profile(SimpleNamespace(f_code=SimpleNamespace(co_filename=os.path.join(ROOT, path))), "call", None)
    assert dict(profile.files) == {"env.py": 1}


class CoinSandbox(sandbox.SandboxPool):
    """The real sandbox runs every program; then a run passes when a hash of it and its place is even, so
    that an untrained model's groups vary and the step trains (a step without signal skips the loss)."""
    def submit_batch(self, runs, fractional=False):
        f = super().submit_batch(runs, fractional)
        done = f.result()
        coin = [zlib.crc32(f"{i}/{r.task_id}/{r.program}".encode()) % 2 == 0 for i, r in enumerate(runs)]
        f = type(f)()
        f.set_result([sandbox.Result(float(c), c, "pass" if c else "wrong_answer", "", int(c), 1)
                      if d.outcome != "sandbox_error" else d for c, d in zip(coin, done)])
        return f


def test_one_rl_step_of_the_cpu_preset_passes_through_at_most_8_files(tmp_path, monkeypatch):
    """Each step is profiled on its own. The train stream is a data loader: it generates tasks only when
    it runs out (it doubles, rl/rollouts.next_tasks), and such a step also passes through the task
    generator's files (data/tasks.py, world.py, families.py); the others do not."""
    import json
    import train_rl
    texts = [env.corpus_text(t) for t in generate_tasks("train", 300, seed=0)]
    tok = train_tokenizer(texts, 320)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=160, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=4, top_k=2, expert_hidden=32, n_dense_layers=1))
    ckpt = str(tmp_path / "tiny.pt")
    common.save_checkpoint(ckpt, model, tok)
    profiles, step = [], train_rl.rl_step

    def profiled(ctx, i):
        profiles.append(Profile())
        return profiles[-1].around(step)(ctx, i)
    monkeypatch.setattr(train_rl, "rl_step", profiled)
    monkeypatch.setattr(train_rl, "SandboxPool", CoinSandbox)
    train_rl.main(["--preset", "cpu", "--device", "cpu", "--init-from", ckpt, "--out-dir", str(tmp_path / "rl"),
                   "--steps", "4", "--batch-tasks", "4", "--group-size", "4", "--max-new-tokens", "16",
                   "--eval-tasks", "0"], canary_every=0, gen_batch=16, sandbox_workers=1)
    rows = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl") if '"eval"' not in line]
    assert all(r["trained_seqs"] > 0 for r in rows)               # every step trained: loss and update ran
    loader = {"data/tasks.py", "data/world.py", "data/families.py"}
    for i, p in enumerate(profiles):
        print(f"\nRL step {i + 1} (cpu preset): {len(p.files)} files: {sorted(p.files)}")
        assert {"train_rl.py", "rl/algo.py", "rl/rollouts.py", "env.py", "sandbox.py", "model.py"} <= set(p.files)
        assert len(set(p.files) - loader) <= 8
    assert any(len(p.files) <= 8 for p in profiles)                # a step that generates no task


def test_one_agent_episode_passes_through_at_most_6_files(tmp_path, monkeypatch, capsys):
    import agent
    tok = train_tokenizer(["def total(prices):\n    return sum(prices)\n" * 50], 300).with_tools()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=512, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=2, top_k=1, expert_hidden=32))
    ckpt = str(tmp_path / "m.pt")
    common.save_checkpoint(ckpt, model, tok)
    project = tmp_path / "p"
    project.mkdir()
    (project / "shop.py").write_text("def total(prices):\n    return sum(prices) + 1\n")
    (project / "test_shop.py").write_text("from shop import total\n\n\ndef test_total():\n"
                                          "    assert total([1, 2]) == 3\n")
    profile = Profile()
    # the episode: from its first turn to the judge's verdict on the final copy (loading and printing
    # around it are the command's, not the episode's)
    monkeypatch.setattr(agent.env, "run_episodes", profile.around(env.run_episodes))
    monkeypatch.setattr(agent, "project_verdict", profile.around(agent.project_verdict))
    agent.main(["--preset", "smoke", "--ckpt", ckpt, "--repo", str(project), "--out-dir", str(tmp_path / "out")])
    capsys.readouterr()
    with capsys.disabled():
        print(f"\none agent episode (agent.py --repo): {len(profile.files)} files: {dict(profile.files)}")
    assert {"env.py", "sampling.py", "model.py", "sandbox.py", "agent.py"} <= set(profile.files)
    assert len(profile.files) <= 6


def test_train_pretrain_keeps_to_35_options():
    """The trainers keep their flags to run settings and the ablations the README lists; the rest are a
    preset's settings. train_pretrain.py: at most 35 options, --help included (round four's line)."""
    import re
    import subprocess
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train_pretrain.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT).stdout
    options = re.findall(r"^  (?:-\w, )?(--[\w-]+)", out, re.M)
    assert {"--help", "--mix", "--init-from", "--n-expert"} <= set(options) and len(options) <= 35, options


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
