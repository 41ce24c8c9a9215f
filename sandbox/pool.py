"""sandbox/pool.py: a pool of warm, locked-down workers (sandbox/worker.py) that run untrusted programs.

    with SandboxPool(timeout_s=2.0) as pool:
        results = pool.run_batch(runs)        # [Result(reward, passed, outcome, feedback, ...)]

A Run is what to execute: a whole program (a task's prompt completed by a candidate, or a repository's
modules; env.py builds them), the function to call on each input, and the expected outputs, which
stay in this process: the judge of I/O runs is THIS process, the judge of assert tests (HumanEval) a
separate process in the sandbox. What came back becomes a Result, the reward. Why each wall:
docs/sandbox.md. No torch here: the workers must stay small.
"""
import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from infra.cli import die
from sandbox.worker import BadValue, encode, remove_tree, unpack

# A run: task_id names it; program is the whole code (None: the completion held no code, scored
# no_code without running); entry_point is called on each of inputs and compared with outputs here
# (I/O tasks), or test (an assert-style check(entry_point), HumanEval) runs in the judge process with
# prompt's helpers.
Run = collections.namedtuple("Run", "task_id program entry_point inputs outputs test prompt",
                             defaults=(None, ""))

OUTCOMES = ("pass", "wrong_answer", "runtime_error", "timeout", "memory", "output_limit",
            "syntax_error", "no_code", "sandbox_error")

@dataclasses.dataclass
class Result:
    """reward: 1.0 for a pass (fractional: passed/total); outcome: one of OUTCOMES; feedback: short,
    printable, safe to show the model. outcome == "sandbox_error" means the HARNESS failed, not the
    model (reward 0.0, passed False): callers must not count it as the model's failure: RL drops
    those samples (or their whole group) from the advantage computation, eval leaves them out of
    pass@k denominators and reports how many there were. values: what each case returned (I/O runs;
    None where it returned nothing or failed), for the agent's tools that show a run's value."""
    reward: float
    passed: bool
    outcome: str
    feedback: str
    n_passed: int
    n_tests: int
    values: tuple = ()

# The worker is a separate `python -I -S` process (no site-packages, no torch, no user env) that
# runs sandbox/worker.py. Why a warm zygote rather than one fresh interpreter per candidate: the
# interpreter start (~20 ms) would cap us far below the throughput goal, while fork() of a small,
# preloaded zygote costs ~1 ms; every candidate still gets its own process, torn down afterwards,
# and the zygote never holds a program, a reply or a result (sandbox_worker.py says why).
# Why a separate stdlib-only file and not functions of this module: the forked child must not hold
# the task generator (it could regenerate reference answers), nor anything of the trainer.
_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")

# The children cannot import from disk (chroot), so they get what the zygote imported: the stdlib
# an honest solution plausibly uses. Importing threading/queue works; starting a thread does not.
_PRELOAD = ("math cmath re string collections collections.abc itertools functools operator heapq bisect "
            "typing copy random fractions decimal statistics datetime hashlib array struct unicodedata "
            "textwrap enum dataclasses numbers abc base64 binascii zlib calendar queue graphlib secrets "
            "threading json io time types contextlib weakref pprint shlex difflib shutil").split()
_CHILD_KINDS = ("wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "syntax_error")
_warned = False

def _printable(s, n=300):
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(s)[:n])[:n]

def _same(e, g):
    """Compare an expected value with a returned one (exact builtin data from the codec): bool is
    not a number, ints compare exactly (3.0 is 3, 479001690.0 is not 479001600), tolerance only
    where the expected value is a float; a tuple answers a list (JSON has no tuples)."""
    te, tg = type(e), type(g)
    if te is bool or tg is bool:
        return te is tg and e == g
    if te is int:
        return tg in (int, float) and g == e
    if te is float:
        return tg in (int, float) and (e == g or math.isclose(e, g, rel_tol=1e-6, abs_tol=1e-9))
    if te in (list, tuple):
        return tg in (list, tuple) and len(e) == len(g) and all(map(_same, e, g))
    if te is dict:
        return tg is dict and e.keys() == g.keys() and all(_same(e[k], g[k]) for k in e)
    if te in (set, frozenset):
        return tg in (set, frozenset) and e == g
    return te is tg and e == g

def _death(code):
    if code == -signal.SIGXCPU:
        return "timeout", "CPU time limit exceeded"
    if code == -signal.SIGXFSZ:
        return "output_limit", "file size limit exceeded"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "a signal"
        return "runtime_error", f"process killed by {name}"
    return "runtime_error", f"process exited (code {code}) before the tests finished"

def _messages(text):
    """Lines of JSON lists that start with a str; anything else (the program may write over its
    own result channel) is skipped, never an error."""
    out = []
    for line in (text or "").split("\n"):
        try:
            m = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if type(m) is list and m and type(m[0]) is str:
            out.append(m)
    return out

def default_workers():
    """Sandbox workers for this process: the cores it may use, shared among the processes torchrun
    started on this machine (LOCAL_WORLD_SIZE), so 8 ranks do not start 8 times the cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

def _kill_uids(uids):
    """SIGKILL every process whose real uid is one of `uids` (a dead worker's candidates and judges:
    their uids are unique to that worker). Where there is no PID namespace to do it, this does."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(l.split()[1]) for l in f if l.startswith("Uid:"))
            if uid in uids:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, StopIteration, ValueError):
            pass

class SandboxPool:
    """Warm workers (one per core, the cores shared among local ranks) that run candidates in fresh,
    limited child processes.

    Per candidate, in a child forked from a pristine zygote (never from a process that held another
    candidate's program, reply or result): new session; RLIMIT_CPU/AS/FSIZE/NOFILE/CORE;
    RLIMIT_NPROC=1 under a per-worker unprivileged uid (no fork, no threads, so nothing can outlive
    the child); chroot into a fresh tmpfs of its own, unmounted as a whole afterwards; stdin
    /dev/null; stdout+stderr into a pipe capped while reading; scrubbed env; per worker a network
    namespace (no network), a PID namespace (nothing outlives a killed worker) and an IPC namespace
    in which no IPC object can be created; and a seccomp filter that refuses socket() and IPC calls
    (the wall that stays where a container forbids namespaces; as root with neither, the pool refuses
    to start). The worker enforces the wall-clock timeout, SIGKILLs the process group and reaps it.
    Without root, only the rlimits, the filter and the process-group kill apply (a warning says so
    once): run untrusted code as root in a VM/container.

    The judge is never in the candidate's process. I/O tasks (the default for training): the child
    only sends back return values as exact builtin data; the expected outputs stay in this process,
    which compares them. Assert tasks (HumanEval): check() runs in a separate judge process (own uid,
    own empty chroot) and calls the candidate over pipes that carry exact builtin data only; the
    candidate never sees the test, its constants or the verdict. Anything a candidate can cause is
    its own outcome; only a failure of the sandbox itself is `sandbox_error`.
    """
    _fallback = False   # tests only: take the no-root path even as root (never with untrusted code)
    _namespaces = True  # tests only: False acts as a container that forbids namespaces (root, no unshare)
    _seccomp = True     # tests only: False acts as a kernel without seccomp

    def __init__(self, workers: int | None = None, timeout_s: float = 2.0, memory_mb: int = 512,
                 output_kb: int = 64, file_mb: int = 4, result_kb: int = 1024):
        self.workers, self.timeout_s = workers or default_workers(), timeout_s
        self.output_kb, self.result_kb, self.memory_mb = output_kb, result_kb, memory_mb
        self._cfg = json.dumps({"timeout": timeout_s, "memory_mb": memory_mb, "file_mb": file_mb,
                                "output_bytes": output_kb << 10, "result_bytes": result_kb << 10,
                                "tmpfs_mb": max(64, 4 * file_mb), "uid_base": 1_000_000,
                                "preload": _PRELOAD, "tmpdir": tempfile.gettempdir(),
                                "fallback": self._fallback, "namespaces": self._namespaces,
                                "seccomp": self._seccomp})
        self._q, self._lock, self._closed = queue.Queue(), threading.Lock(), False
        self._procs = [self._spawn() for _ in range(self.workers)]
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True)
                         for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def _spawn(self):
        # Same user as this process (root in CI): the worker sets up namespaces, then re-executes
        # itself as the zygote; the children only fork (never exec), so after chroot and the uid
        # drop they need neither this file nor the interpreter binary.
        p = subprocess.Popen([sys.executable, "-I", "-S", _WORKER_PATH, self._cfg], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                             start_new_session=True)
        p.info = i = self._recv(p, 30)["hello"]
        global _warned
        self.isolation = i
        if i["uid"] is not None and not (i["netns"] and i["ipcns"]) and not i["seccomp"]:
            p.kill()   # a clear one-line error and exit code 2 (infra/cli.py: no torch, env stays light)
            die("sandbox: refusing to run candidates as root with neither namespaces nor seccomp (they would "
                "reach the network and IPC): allow unshare (e.g. docker --cap-add SYS_ADMIN), or run on "
                "Linux x86_64/aarch64 with seccomp, or use a VM")
        # What a container that forbids namespaces (root, no unshare) keeps by other means: the seccomp
        # filter closes network and IPC, _kill_uids does the PID namespace's work, chroot hides the
        # host's files (a private /tmp matters only without it).
        kept = {"netns": i["seccomp"], "ipcns": i["seccomp"], "pidns": i["uid"] is not None,
                "private_tmp": i["chroot"]}
        missing = [k for k in ("uid", "chroot", "nproc", "netns", "pidns", "ipcns", "private_tmp",
                               "tmpfs_per_run")
                   if not i[k] and not kept.get(k)]
        if missing and not _warned:
            _warned = True
            if i["uid"] is None:
                msg = (f"degraded isolation, unavailable: {missing}; candidates may see files"
                       f"{'' if i['seccomp'] else '/network/IPC'} of this user; run as root on Linux")
            else:
                msg = ("namespaces forbidden here: network and IPC closed by seccomp, stray processes killed "
                       "by uid, files hidden by chroot, but a run's files are not size-capped in total "
                       "(no per-run tmpfs); allow unshare (e.g. docker --cap-add SYS_ADMIN) for the full set")
            warnings.warn("sandbox: " + msg, RuntimeWarning)
        return p

    @staticmethod
    def _recv(p, timeout):
        if not select.select([p.stdout], [], [], timeout)[0]:
            raise TimeoutError("sandbox worker did not answer")
        line = p.stdout.readline()
        if not line:
            raise EOFError("sandbox worker died")
        return json.loads(line)

    @property
    def sandbox_uids(self) -> list[int]:
        """The candidates' uids and the judges' (uid + 1)."""
        return [u + d for p in self._procs if (u := p.info.get("uid")) is not None for d in (0, 1)]

    def _serve(self, i):
        while True:
            item = self._q.get()
            if item is None:
                return
            job, done = item
            for attempt in range(2):       # a dead/stuck worker is replaced and the job retried once
                try:
                    p = self._procs[i]
                    p.stdin.write((json.dumps(job) + "\n").encode())
                    p.stdin.flush()
                    rep = self._recv(p, self.timeout_s + 30)
                    break
                except Exception as e:
                    rep = {"error": f"sandbox worker failed: {e!r}"}
                    self._restart(i)
            done(rep)

    def _restart(self, i):                 # never raises: the serving thread must survive
        old = self._procs[i]
        for f in (old.kill, old.wait, old.stdin.close, old.stdout.close):
            try:
                f()
            except Exception:                  # e.g. BrokenPipeError flushing into a dead worker
                pass
        if old.info["uid"] is not None and not old.info["pidns"]:
            _kill_uids((old.info["uid"], old.info["uid"] + 1))   # no PID namespace: by uid instead
        remove_tree(old.info["base"], time.monotonic() + 5)      # a killed worker left its (empty) dir
        for _ in range(3):
            try:
                if not self._closed:
                    self._procs[i] = self._spawn()
                return
            except Exception:
                time.sleep(0.5)

    def _job(self, run):
        io = run.inputs is not None
        return {"program": run.program, "entry": run.entry_point,
                "inputs": [encode((tuple(a), {})) for a in run.inputs] if io else None,
                "test": None if io else run.test, "prompt": run.prompt}

    def _score(self, run, rep, fractional):
        n = len(run.inputs) if run.inputs is not None else 1
        got = {}

        def res(outcome, passed, feedback):
            reward = 1.0 if outcome == "pass" else (passed / n if fractional and outcome != "sandbox_error"
                                                    else 0.0)
            values = tuple(got.get(i) for i in range(n)) if got else ()
            return Result(reward, outcome == "pass", outcome, _printable(feedback), passed, n, values)
        if "error" in rep:
            return res("sandbox_error", 0, rep["error"])
        for text in rep["setup"]:              # written by our code before any program ran
            if text != "ok\n":
                m = _messages(text)
                why = "sandbox setup did not finish"
                if m and m[0][0] == "setup_error" and len(m[0]) == 2:
                    why = str(m[0][1])
                return res("sandbox_error", 0, why)
        kind = lambda k: k if k in _CHILD_KINDS else "runtime_error"   # never pass/sandbox_error
        limit = (f"output limit exceeded (more than {self.output_kb} KB printed)" if rep["over"] == "output"
                 else f"result data limit exceeded ({self.result_kb} KB)")
        if run.inputs is None:
            return self._score_assert(rep, res, kind, limit)
        msgs = _messages(rep["res"])
        load = next((m for m in msgs if m[0] == "load" and len(m) == 3), None)
        if load:
            return res(kind(load[1]), 0, load[2])
        cases = {}
        for m in msgs:
            if m[0] == "case" and len(m) == 4 and type(m[1]) is int and type(m[2]) is str:
                cases.setdefault(m[1], m)
        passed, first = 0, None
        for i, exp in enumerate(run.outputs):
            m = cases.get(i)
            if m is not None and m[2] == "ok":
                try:
                    got[i] = unpack(m[3])
                except (BadValue, TypeError, RecursionError):
                    cases[i] = ["case", i, "bad", "returned malformed data"]
            if i in got and _same(exp, got[i]):
                passed += 1
            elif first is None:
                first = i
        if first is None:
            return res("pass", passed, f"passed {n}/{n} tests")
        if rep["over"]:
            return res("output_limit", passed, limit)
        if rep["timed_out"]:
            return res("timeout", passed, f"timed out after {self.timeout_s} s ({passed}/{n} tests passed)")
        m, exp = cases.get(first), run.outputs[first]
        call = f"{run.entry_point}({', '.join(map(repr, run.inputs[first]))})"
        if m is None:
            outcome, why = _death(rep["exit"])
            return res(outcome, passed, f"{why}; {passed}/{n} tests passed")
        if first in got:
            return res("wrong_answer", passed, f"{call} should return {exp!r}, got {got[first]!r}")
        if m[2] == "bad":
            return res("wrong_answer", passed, f"{call}: {m[3]}")
        return res(kind(m[2]), passed, f"{call} raised {m[3]}")

    def _score_assert(self, rep, res, kind, limit):
        """The judge process wrote one verdict: done, load (the program did not load), fail
        (check() failed; "died" = the candidate stopped mid-test) or nothing (the judge died)."""
        v = next(iter(_messages(rep["verdict"])), None)
        if v == ["done"]:
            return res("pass", 1, "check() passed")
        if rep["over"]:
            return res("output_limit", 0, limit)
        if rep["timed_out"]:
            return res("timeout", 0, f"timed out after {self.timeout_s} s")
        if v is not None and v[0] in ("load", "fail") and len(v) == 3:
            if v[1] != "died":
                return res(kind(v[1]), 0, v[2])
            outcome, why = _death(rep["exit"])
            return res(outcome, 0, why)
        outcome, why = _death(rep["judge_exit"])   # e.g. a returned value too big for the judge's memory
        return res(outcome, 0, f"the judge stopped: {why}")

    def submit_batch(self, runs, fractional=False) -> concurrent.futures.Future:
        """Non-blocking: returns a Future of list[Result] (same order), so the trainer can keep
        generating while the workers run the tests."""
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        fut, results = concurrent.futures.Future(), [None] * len(runs)
        left = [len(runs)]
        def finish(i, r):
            results[i] = r
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fut.set_result(results)
        for i, run in enumerate(runs):
            if run.program is None:
                finish(i, Result(0.0, False, "no_code", "the completion contains no code", 0,
                                 len(run.inputs) if run.inputs is not None else 1))
                continue
            def done(rep, i=i, run=run):
                try:
                    r = self._score(run, rep, fractional)
                except Exception as e:      # a judge bug must not hang the batch
                    r = Result(0.0, False, "sandbox_error", _printable(f"judge failed: {e!r}"), 0, 1)
                finish(i, r)
            self._q.put((self._job(run), done))
        if not runs:
            fut.set_result([])
        return fut

    def run_batch(self, runs, fractional=False) -> list[Result]:
        return self.submit_batch(runs, fractional).result()

    def close(self):
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(self.timeout_s + 35)
        while True:                          # jobs queued behind the sentinels: answer, never hang
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1]({"error": "pool closed"})
        for p in self._procs:
            try:
                p.stdin.close()              # EOF: the worker removes its dir and exits
                p.wait(5)
            except Exception:
                p.kill()
                p.wait()
            p.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
