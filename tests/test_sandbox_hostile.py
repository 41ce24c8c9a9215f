"""Hostile completions: each must score 0 with the right outcome and leave the host untouched.

All hostile code runs ONLY inside env.SandboxPool (never in this process). The whole list runs as
one batch (fast on 2 cores); the individual tests then check each result.
    timeout 300 python -m pytest tests/test_sandbox_hostile.py -q -x
"""
import os
import signal
import tempfile
import time

import pytest

import env
from tasks import Task

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
    "fake_pass_markers": ("    import os\n    print('PASS', 'all tests passed', '\\t[\"done\"]')\n"
                          "    os.write(3, b'0000\\t[\"case\", 0, \"ok\", 1]\\n0000\\t[\"done\"]\\n')\n    return None\n", {"wrong_answer"}),
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
    pool = env.SandboxPool(workers=2, timeout_s=1.0, memory_mb=256)
    if os.geteuid() == 0 and not pool.isolation["uid"]:
        pool.close()
        pytest.skip("root without privilege drop: refusing to run hostile code")
    worker_pids = [p.pid for p in pool._procs]
    names = list(HOSTILE_IO) + list(HOSTILE_ASSERT)
    tasks = [io_task()] * len(HOSTILE_IO) + [assert_task()] * len(HOSTILE_ASSERT)
    comps = [c.replace("{S}", str(sentinel)) for c, _ in list(HOSTILE_IO.values()) + list(HOSTILE_ASSERT.values())]
    t0 = time.time()
    results = dict(zip(names, pool.run_batch(tasks, comps)))
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
    rs = pool.run_batch([io_task(), assert_task()], ["    return x + 1\n"] * 2)
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
    uids = set(hostile["pool"].sandbox_uids)
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
    pool = env.SandboxPool(workers=2, timeout_s=1.0)
    uids, pids = set(pool.sandbox_uids), {p.pid for p in pool._procs}
    pool.run_batch([io_task()] * 2, ["    import time\n    time.sleep(100)\n", "    return x + 1\n"])
    pool.close()
    procs = _procs()
    assert not [p for p in procs if p[1] == os.getpid() and p[0] not in before], "workers outlive close()"
    assert not [p for p in procs if p[0] in pids or p[1] in pids or p[2] in uids]
    os.kill(os.getpid(), 0)   # and we are alive
