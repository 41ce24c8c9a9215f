"""agent.py --repo on a user's project, as an attacker and a new user try it (issue 60 items 4-8, issue 62
item 4): the verdict is the project's own test file as Python runs it, a module Python would import
otherwise is refused, nothing is written through a link, bad input is one error line before anything is
written, and the model reads the first failing test as training's issues state it.
    python -m pytest tests/test_agent_repo.py -q"""
import json
import os
import subprocess
import sys

import pytest
import torch

import agent
import env
from data import repos
from infra import common
from model import GPT, GPTConfig
from sandbox import SandboxPool
from tokenizer import train_tokenizer

SHOP = 'def total(prices, discount):\n    """The sum of prices, less discount percent."""\n' \
       '    return sum(prices) * (100 + discount) // 100\n'
FIX = "shop.py\ndef total(prices, discount):\n    return sum(prices) * (100 - discount) // 100\n"
TESTS = "from shop import total\n\n\ndef test_total():\n    assert total([10, 20, 30], 10) == 54\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny random model with the tool tokens, as a checkpoint."""
    tok = train_tokenizer([SHOP * 20, TESTS * 20, FIX * 20], 300).with_tools()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, seq_len=256, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                          n_expert=1, top_k=1, n_shared_expert=0, expert_hidden=32))
    path = str(tmp_path_factory.mktemp("repo") / "m.pt")
    common.save_checkpoint(path, model, tok)
    return path


def project(root, files=None):
    root.mkdir(parents=True)
    for p, text in (files or {"shop.py": SHOP, "test_shop.py": TESTS}).items():
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(text)
    return root


def scripted(seen, edits=(FIX,), during=None):
    """env.run_episodes for agent.main: the edits, a test run and submit, in the real tools (seen: the
    task it was given; during(): what happens on disk while the episode runs)."""
    def run_episodes(model, tok, tasks, n, tools, pool, *a, **kw):
        t, e = tasks[0], env.Episode(0)
        seen.append(t)
        tools.start(t, e)
        for name, payload in [("edit", x) for x in edits] + [("test", ""), ("submit", "")]:
            x = env.Turn([], env.action_ids(tok, name, payload), [])
            x.feedback = tools.step(tok, pool, [(t, e, x)], True)[0] or ""
            e.turns.append(x)
        tools.finish(pool, [(t, e)])
        if during:
            during()
        return [e]
    return run_episodes


def main(argv, capsys):
    """agent.main: (exit code, stdout, stderr)."""
    try:
        agent.main(["--preset", "smoke", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(code, err):
    return code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1


def runs_as_python(root):
    """Python's own verdict on the project: its test file imported and each test_* function called, as
    pytest calls them (pytest itself starts in seconds)."""
    run = "import test_shop as t\nfor n in dir(t):\n    if n.startswith('test'):\n        getattr(t, n)()\n"
    return subprocess.run([sys.executable, "-B", "-c", run], cwd=root, capture_output=True, timeout=60).returncode == 0


def files_under(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ---------------------------------------------------------------------------------------------
# Item 4: the verdict is the test file as written, and exact

@pytest.mark.parametrize("shop, tests", ids=["list_for_tuple", "float", "int_float", "module_code_fails",
                                              "module_code_passes", "always_equal", "not_a_check"], argvalues=[
    ("def pair(x):\n    return [x, x]\n", "from shop import pair\n\n\ndef test_1():\n    assert pair(1) == (1, 1)\n"),
    ("def third():\n    return 0.1 + 0.2\n", "from shop import third\n\n\ndef test_1():\n    assert third() == 0.3\n"),
    ("def half():\n    return 2.0\n", "from shop import half\n\n\ndef test_1():\n    assert half() == 2\n"),
    ("TAX = 0\n\n\ndef total(p):\n    return sum(p) + TAX\n",             # module-level code: the test's
     "import shop\nfrom shop import total\n\nshop.TAX = 1\n\n\ndef test_1():\n    assert total([1, 2]) == 3\n"),
    ("TAX = 0\n\n\ndef total(p):\n    return sum(p) + TAX\n",
     "import shop\nfrom shop import total\n\nshop.TAX = 1\n\n\ndef test_1():\n    got = total([1, 2])\n"
     "    assert got == 4, got\n"),
    ("class Yes:\n    def __eq__(self, other):\n        return True\n\n\ndef total(p):\n    return Yes()\n",
     "from shop import total\n\n\ndef test_1():\n    assert total([1]) == 1\n"),
    ("def total(p):\n    return sum(p)\n", "from shop import total\n\n\ndef test_1():\n    assert total([1]) > 0\n"),
])
def test_the_verdict_is_the_test_file_as_python_runs_it(tmp_path, pool, shop, tests):
    """A trusted verdict is Python's on honest code (a tuple is not a list, 0.1 + 0.2 is not 0.3, 2.0 is
    2, the test file's module-level code runs), and an always-equal object still fails it; a test that is
    not `assert f(...) == literal` is run in the sandbox as written, untrusted."""
    root = project(tmp_path / "p", {"shop.py": shop, "test_shop.py": tests})
    task = agent.project_task(*agent.read_project(str(root)), "x")
    passed, trusted = agent.project_verdict(pool, task, task.files)
    assert trusted == (" > " not in tests)
    if "Yes()" in shop:                       # Python passes it: the judge does not
        assert not passed
        return
    assert passed == runs_as_python(root)


# ---------------------------------------------------------------------------------------------
# Item 5: a module Python would take from elsewhere

def test_a_module_and_a_package_of_one_name_are_refused(tmp_path, ckpt, capsys):
    root = project(tmp_path / "p", {"shop.py": SHOP, "shop/__init__.py": "def total(p, d):\n    return 54\n",
                                    "test_shop.py": TESTS})
    where = subprocess.run([sys.executable, "-c", "import shop; print(shop.__file__)"], cwd=root,
                           capture_output=True, text=True).stdout
    assert where.strip().endswith(os.path.join("shop", "__init__.py"))     # Python imports the package
    with pytest.raises(ValueError, match="'shop' is two modules"):
        agent.read_project(str(root))
    code, _, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out")], capsys)
    assert refused(code, err) and not (tmp_path / "out").exists()
    # a directory of data beside a module, or a package beside a module of another name, is fine
    (root / "shop" / "__init__.py").unlink()
    (root / "data.py").write_text("X = 1\n")
    project(root / "data", {"prices.csv": "1,2\n"})
    assert set(agent.read_project(str(root))[0]) == {"shop.py", "test_shop.py", "data.py"}


# ---------------------------------------------------------------------------------------------
# Items 6 and 7: no write through a link

def test_apply_writes_nothing_through_a_link(tmp_path, ckpt, capsys, monkeypatch):
    """--apply: a link planted where the old atomic write put its temporary file (PATH.tmp.<pid>), and a
    directory of the project swapped for a link during the episode: nothing outside is written."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep\n")
    root = project(tmp_path / "p")
    (root / f"shop.py.tmp.{os.getpid()}").symlink_to(outside / "victim")
    seen = []
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen))
    code, out, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out"), "--apply"],
                          capsys)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["applied"] is True
    assert (outside / "victim").read_text() == "keep\n"
    assert (root / "shop.py").read_text() == env.replace_function(SHOP, FIX.partition("\n")[2])[0]
    assert not (root / "shop.py").is_symlink()

    # a package directory becomes a link to elsewhere while the model works
    files = {"shop.py": "from pkg.rates import RATE\n\n\ndef total(p):\n    return sum(p) + RATE\n",
             "pkg/__init__.py": "", "pkg/rates.py": "RATE = 1\n\n\ndef rate():\n    return 1\n",
             "test_shop.py": "from shop import total\n\n\ndef test_1():\n    assert total([1]) == 1\n"}
    root = project(tmp_path / "q", files)
    (outside / "rates.py").write_text(files["pkg/rates.py"])

    def swap():
        (root / "pkg").rename(root / "pkg_real")
        (root / "pkg").symlink_to(outside)
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen, ["pkg/rates.py\ndef rate():\n    return 0\n"],
                                                            swap))
    code, _, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out2"), "--apply"],
                        capsys)
    assert refused(code, err) and "link" in err
    assert (outside / "rates.py").read_text() == files["pkg/rates.py"]
    assert files_under(tmp_path / "out2") == []                  # not even the copy: nothing half written


def test_the_out_dir_in_the_project_is_written_through_no_link(tmp_path, ckpt, capsys, monkeypatch):
    """Run from inside the project (the default out-dir, runs/agent-smoke, is then in it): a link planted
    as its directory is refused before the episode; links planted as its files are replaced, never
    written through (the next test); and the out-dir is not read as part of the project."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep\n")
    root = project(tmp_path / "p")
    (root / "runs").symlink_to(outside)
    monkeypatch.chdir(root)
    seen = []
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen))
    code, _, err = main(["--ckpt", ckpt, "--repo", "."], capsys)
    assert refused(code, err) and not seen and os.listdir(outside) == ["victim"]


def test_links_planted_as_the_out_dirs_files_are_replaced(tmp_path, ckpt, capsys, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep\n")
    root = project(tmp_path / "p")
    monkeypatch.chdir(root)
    seen = []
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen))
    (root / "runs" / "agent-smoke" / "repo").mkdir(parents=True)
    (root / "runs" / "agent-smoke" / "transcript.txt").symlink_to(outside / "victim")
    (root / "runs" / "agent-smoke" / "repo" / "shop.py").symlink_to(outside / "victim")
    code, out, err = main(["--ckpt", ckpt, "--repo", "."], capsys)
    assert code == 0, err
    assert (outside / "victim").read_text() == "keep\n"
    for p in ("transcript.txt", "repo/shop.py"):
        assert not (root / "runs" / "agent-smoke" / p).is_symlink()
    assert (root / "runs" / "agent-smoke" / "transcript.txt").read_text() in out
    code, _, err = main(["--ckpt", ckpt, "--repo", "."], capsys)           # again: the copy is not the project
    assert code == 0 and sorted(seen[-1].files) == ["shop.py", "test_shop.py"]


def test_an_out_dir_outside_the_project_is_written_through_no_link(tmp_path, ckpt, capsys, monkeypatch):
    """The red team's rerun: an out-dir outside the project whose repo/ is a planted link (to the project,
    or anywhere) is refused, not followed; and an out-dir whose repo/ is the project itself (a project
    named repo, the out-dir its parent) is refused before the episode: neither writes the project
    without --apply."""
    root = project(tmp_path / "p")
    monkeypatch.setattr(agent.env, "run_episodes", scripted([]))
    out = tmp_path / "out"
    out.mkdir()
    (out / "repo").symlink_to(root)
    code, _, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(out)], capsys)
    assert code == 2 and err.startswith("error: ") and (root / "shop.py").read_text() == SHOP
    named = project(tmp_path / "q" / "repo")
    seen = []
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen))
    code, _, err = main(["--ckpt", ckpt, "--repo", str(named), "--out-dir", str(tmp_path / "q")], capsys)
    assert refused(code, err) and not seen and (named / "shop.py").read_text() == SHOP


def test_undecodable_issue_bytes_and_a_forged_check_are_no_traceback(tmp_path, ckpt, capsys, monkeypatch):
    """An --issue holding bytes that are not UTF-8 (argv's surrogates) is printed and kept with the bytes
    escaped, after --apply wrote the fix; a check whose value the project's code forged as an empty
    tuple fails the verdict instead of raising IndexError."""
    root = project(tmp_path / "p")
    monkeypatch.setattr(agent.env, "run_episodes", scripted([]))
    code, out, err = main(["--ckpt", ckpt, "--repo", str(root), "--issue", "caf\udce9", "--apply",
                           "--out-dir", str(tmp_path / "out")], capsys)
    assert code == 0 and "caf\\udce9" in out and (root / "shop.py").read_text() != SHOP, err
    assert "caf\\udce9" in (tmp_path / "out" / "transcript.txt").read_text()
    task = agent.project_task({"shop.py": SHOP, "test_shop.py": TESTS}, "test_shop.py", "x")
    real = agent.run_tests
    forge = lambda pool, t, repo: (*real(pool, t, repo)[:3], {"test_total": ()})   # a result line of ()
    monkeypatch.setattr(agent, "run_tests", forge)
    with SandboxPool(workers=1) as pool:
        assert agent.project_verdict(pool, task, task.files) == (False, True)
        assert agent.project_issue(pool, task).startswith("A test in test_shop.py fails")


@pytest.mark.parametrize("extra", ids=["class", "second_file", "tests_dir", "imported", "assigned", "conftest",
                                       "pytest_ini", "pyproject", "stdlib_name", "cookie", "sourceless"], argvalues=[
    {"test_shop.py": TESTS + "\n\nclass TestMore:\n    def test_x(self):\n        assert False\n"},
    {"test_b.py": "def test_b():\n    assert False\n"},
    {"tests/test_c.py": "def test_c():\n    assert False\n"},
    {"test_shop.py": "from checks import test_extra\n" + TESTS, "checks.py": "def test_extra():\n    assert 0\n"},
    {"test_shop.py": TESTS + "\ntest_generated = lambda: 1 / 0\n"},
    {"conftest.py": "import shop\nshop.RATE = 110\n"},
    {"pytest.ini": "[pytest]\naddopts = --doctest-modules\n"},
    {"pyproject.toml": "[tool.pytest.ini_options]\naddopts = '-x'\n"},
    {"cmath.py": "def sqrt(x):\n    return 0\n"},
    {"shop.py": "# -*- coding: utf-7 -*-\n" + SHOP},
    {"shop/__init__.pyc": ""}])
def test_what_pytest_would_run_and_the_harness_not_is_refused(tmp_path, extra):
    """The red team's rerun: tests the harness never runs (a class, another test file, a tests/ directory,
    a test imported or assigned), code it would not import as Python does (a conftest.py, pytest
    settings, a module named as the standard library's, a coding cookie, a sourceless package beside
    shop.py) made a PASS where pytest fails: each is refused before the episode, with one line."""
    root = project(tmp_path / "p", {"shop.py": SHOP, "test_shop.py": TESTS, **extra})
    with pytest.raises(ValueError, match="^--repo: "):
        agent.read_project(str(root))
    assert agent.read_project(str(project(tmp_path / "ok")))[1] == "test_shop.py"


# ---------------------------------------------------------------------------------------------
# Item 8: bad input, one line, nothing written

def test_a_deep_tree_is_one_error_line(tmp_path, ckpt, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen))
    root = project(tmp_path / "p")
    deep = root
    try:
        for _ in range(1100):                  # os.makedirs would recurse as deep
            deep = deep / "a"
            deep.mkdir()
        (deep / "x.py").write_text("X = 1\n")
        code, _, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out")], capsys)
        assert refused(code, err) and "deeper than" in err and not (tmp_path / "out").exists() and not seen
    finally:
        while deep != root:
            for f in os.listdir(deep):
                os.unlink(deep / f)
            deep.rmdir()
            deep = deep.parent


def test_a_file_name_that_is_not_utf8_is_one_error_line(tmp_path, ckpt, capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(agent.env, "run_episodes", scripted(seen))
    root = project(tmp_path / "p")
    bad = os.path.join(os.fsencode(root), b"caf\xe9.py")       # latin-1, not UTF-8
    with open(bad, "w") as f:
        f.write("X = 1\n")
    code, _, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out"), "--apply"], capsys)
    assert refused(code, err) and "not printable UTF-8" in err
    assert not (tmp_path / "out").exists() and not seen and (root / "shop.py").read_text() == SHOP


# ---------------------------------------------------------------------------------------------
# Issue 62 item 4: the task stated as training states it

def test_the_model_reads_the_first_failure_as_training_states_it(tmp_path, ckpt, capsys):
    """No --issue: the project's tests run first, in the sandbox, and the model's prompt is the first
    failure in data/repos.py's symptom form (a real episode of a tiny random model)."""
    root = project(tmp_path / "p")
    code, out, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out")], capsys)
    assert code == 0, err
    want = repos._symptom("total", [[10, 20, 30], 10], 66, 54)
    assert want == "`total([10, 20, 30], 10)` returns 66, expected 54."
    assert out.startswith(f"# Issue\n{want}\n# Files\nshop.py test_shop.py\n--- turn 1: ")   # the file list: a memory
    assert (tmp_path / "out" / "transcript.txt").read_text().startswith(f"# Issue\n{want}\n")
    # every test passing: nothing to fix unless --issue says what; one line, before any episode
    (root / "shop.py").write_text(SHOP.replace("100 + discount", "100 - discount"))
    code, _, err = main(["--ckpt", ckpt, "--repo", str(root), "--out-dir", str(tmp_path / "out2")], capsys)
    assert refused(code, err) and "--issue" in err and not (tmp_path / "out2").exists()


@pytest.mark.parametrize("shop, tests, issue", ids=["second_test", "raises", "not_a_check", "no_load"], argvalues=[
    (SHOP, "from shop import total\n\n\ndef test_none():\n    assert total([10], 0) == 10\n\n\n"
           "def test_total():\n    assert total([10], 10) == 9\n",
     "`total([10], 10)` returns 11, expected 9."),                            # the first failing test
    ("def total(prices, discount):\n    return sum(prices) / discount\n",
     "from shop import total as t\n\n\ndef test_0():\n    got = t([1], 0)\n    assert got == 1, got\n",
     "`t([1], 0)` raises ZeroDivisionError, expected 1."),
    ("import shop\n\n\ndef total(prices, discount):\n    return 1\n",
     "from shop import total\n\n\ndef test_0():\n    assert total([1], 0) > 1, 'total too small'\n",
     "A test in test_shop.py fails:\n0 passed, 1 failed\ntest_0: total too small"),
    (SHOP, "import pytest\nfrom shop import total\n\n\ndef test_0():\n    assert total([1], 0) == 1\n",
     "A test in test_shop.py fails:\n0 passed, 1 failed\nModuleNotFoundError: No module named 'pytest'"),
])
def test_the_issue_is_the_first_failure(tmp_path, pool, shop, tests, issue):
    root = project(tmp_path / "p", {"shop.py": shop, "test_shop.py": tests})
    task = agent.project_task(*agent.read_project(str(root)), None)
    assert agent.project_issue(pool, task) == issue


def test_a_huge_value_in_the_issue_is_capped(tmp_path, pool):
    root = project(tmp_path / "p", {"shop.py": "def total(prices, discount):\n    return 'x' * 5000\n",
                                    "test_shop.py": TESTS})
    issue = agent.project_issue(pool, agent.project_task(*agent.read_project(str(root)), None))
    assert issue.startswith("`total([10, 20, 30], 10)` returns 'xxx") and len(issue) <= env.OBS_CHARS


def test_a_test_file_python_cannot_import_is_refused(tmp_path):
    root = project(tmp_path / "p", {"shop.py": SHOP, "test_my-shop.py": TESTS})    # `import test_my-shop`
    with pytest.raises(ValueError, match="no test_"):
        agent.read_project(str(root))
