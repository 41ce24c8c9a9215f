"""env.py: coding tasks with unit tests, the prompt harness, and a sandbox that runs model code.

One module shared by train_rl.py and eval.py, so the model is trained in the same harness it is
evaluated in (Composer 2 report, "harness parity"). Three parts:
  1. Tasks live in tasks.py (`Task`, JSONL files, HumanEval, the generator and its train/test
     split by function identity, canaries); this module only runs them.
  2. Harness: render_prompt -> model writes the function BODY -> extract_completion -> build_program.
  3. Sandbox: `SandboxPool`, warm fork-server workers that run each candidate in a fresh,
     locked-down child process, and a judge in THIS process that turns what came back into a Result.

    python env.py show --split train --n 3                       # prompts + reference solutions
    python env.py export --split test --n 500 --out test.jsonl   # --seed S --difficulties 1,2
    python env.py check --split test --n 200                     # solutions through the sandbox
    python env.py check --humaneval                              # 164 canonical solutions
No torch here: the sandbox workers must stay small and the trainer must not import them.
"""
import argparse, concurrent.futures, dataclasses, json, math, os, queue, re, secrets, select
import shutil, signal, subprocess, sys, tempfile, threading, time, warnings

import tasks

# ----------------------------------------------------------------------------- harness

EOT = "<|endoftext|>"
# For early stopping during generation. extract_completion also ends the body at ANY unindented
# line, which subsumes these (the model writes an indented function body).
STOP_SEQUENCES = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ", "\n@", EOT]

def render_prompt(task) -> str:
    """Exactly the text the model is conditioned on: signature + docstring, ending with a newline."""
    return task.prompt if task.prompt.endswith("\n") else task.prompt + "\n"

def extract_completion(text: str, max_chars: int = 2000) -> str:
    """Cut generated text to the function body: at end-of-text, a stop sequence or the first
    non-blank line that is not indented; at most max_chars characters."""
    text = text[:max_chars].split(EOT)[0]
    m = re.search(r"^\S", text, re.M)        # every other stop sequence starts such a line
    return text[:m.start()] if m else text

def build_program(task, completion: str) -> str:
    return render_prompt(task) + completion

def corpus_text(task) -> str:
    """A solved task for the pretraining corpus (the caller appends end-of-text)."""
    if task.solution is None:
        raise ValueError(f"task {task.task_id} has no solution")
    return render_prompt(task) + task.solution

HACK_PATTERNS = {  # suspicious constructs, counted in RL logs (the sandbox scores them 0 anyway)
    "exit": r"\bsys\s*\.\s*exit\b|\bos\s*\.\s*_exit\b|(?<![\w.])(exit|quit)\s*\(",
    "atexit": r"\batexit\b", "excepthook": r"excepthook",
    "eq_override": r"\bdef\s+__(eq|ne|hash|bool|str|repr)__\b",
    "frame_walk": r"_getframe|\bf_back\b|\bf_locals\b|\bf_globals\b|\binspect\b|__traceback__|tb_frame",
    "gc": r"\bgc\s*\.\s*get_|\bimport\s+gc\b", "signal": r"\bsignal\b|\bos\s*\.\s*kill",
    "subprocess": r"\bsubprocess\b|\bos\s*\.\s*(system|popen|fork|exec\w*|spawn\w*)\b|\bmultiprocessing\b",
    "builtins": r"__builtins__|\bbuiltins\b|__import__|\bimportlib\b|__class__|__subclasses__",
    "skip_test": r"SkipTest|\bpytest\b|\bunittest\b", "eval_exec": r"(?<![\w.])(eval|exec|compile)\s*\(",
    "file_io": r"(?<![\w.])open\s*\(|\bos\s*\.\s*(remove|unlink|chmod|rmdir)|\bshutil\b",
    "env": r"\benviron\b|\bgetenv\b", "network": r"\bsocket\b|\burllib\b|\bhttp\b|\brequests\b",
    "ctypes": r"\bctypes\b", "print": r"(?<![\w.])print\s*\(",
}
_HACK_RE = {k: re.compile(v) for k, v in HACK_PATTERNS.items()}

def hack_counts(completion: str) -> dict[str, int]:
    return {k: len(p.findall(completion)) for k, p in _HACK_RE.items()}

# ----------------------------------------------------------------------------- sandbox

OUTCOMES = ("pass", "wrong_answer", "runtime_error", "timeout", "memory", "output_limit",
            "syntax_error", "no_code", "sandbox_error")

@dataclasses.dataclass
class Result:
    """reward: 1.0 for a pass (fractional: passed/total); outcome: one of OUTCOMES; feedback: short,
    printable, safe to show the model. outcome == "sandbox_error" means the HARNESS failed, not the
    model (reward 0.0, passed False): callers must not count it as the model's failure: RL drops
    those samples (or their whole group) from the advantage computation, eval leaves them out of
    pass@k denominators and reports how many there were."""
    reward: float
    passed: bool
    outcome: str
    feedback: str
    n_passed: int
    n_tests: int

# The worker is a separate `python -I -S` process (no site-packages, no torch, no user env) that
# runs sandbox_worker.py. Why a warm fork server rather than one fresh interpreter per candidate: the
# interpreter start (~20 ms) would cap us far below the throughput goal, while fork() of a small,
# preloaded worker costs ~1 ms; every candidate still gets its own process, torn down afterwards.
# Why a separate stdlib-only file and not functions of this module: the forked child must not hold
# the task generator (it could regenerate reference answers), nor anything of the trainer.
_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")

_PRELOAD = ("math cmath re string collections collections.abc itertools functools operator heapq bisect "
            "typing copy random fractions decimal statistics datetime hashlib array struct unicodedata "
            "textwrap enum dataclasses numbers abc base64 binascii zlib calendar").split()
_CHILD_KINDS = ("wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "syntax_error")
_warned = False

def _printable(s, n=300):
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(s)[:n])[:n]

def _same(e, g):
    """Parent-side comparison of JSON values: bool is not a number, floats with tolerance."""
    if type(e) is bool or type(g) is bool:
        return type(e) is type(g) and e == g
    if type(e) in (int, float) and type(g) in (int, float):
        return math.isclose(e, g, rel_tol=1e-6, abs_tol=1e-9) if float in (type(e), type(g)) else e == g
    if type(e) is not type(g):
        return False
    if type(e) is list:
        return len(e) == len(g) and all(map(_same, e, g))
    if type(e) is dict:
        return e.keys() == g.keys() and all(_same(e[k], g[k]) for k in e)
    return e == g

def _death(rep):
    code = rep.get("exit", 0)
    if code == -signal.SIGXCPU:
        return "timeout", "CPU time limit exceeded"
    if code == -signal.SIGXFSZ:
        return "output_limit", "file size limit exceeded"
    if code < 0:
        return "runtime_error", f"process killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else "process killed"
    return "runtime_error", f"process exited (code {code}) before the tests finished"

class SandboxPool:
    """Warm fork-server workers (one per core) that run candidates in fresh, limited child processes.

    Per candidate, in the child: new session; RLIMIT_CPU/AS/FSIZE/NOFILE/CORE; RLIMIT_NPROC=1 under a
    per-worker unprivileged uid (no fork, no threads, so nothing can outlive the child); chroot into
    a fresh empty working dir (a private tmpfs when possible; the host filesystem is invisible);
    stdin /dev/null; stdout+stderr into a pipe capped while reading; scrubbed env; no network
    (a network namespace per worker). The worker enforces the wall-clock timeout, SIGKILLs the
    process group, reaps it and removes the dir. Without root, only the rlimits and the
    process-group kill apply (a warning says so once): run untrusted code as root in a VM/container.

    I/O tasks (the default for training): the child only sends back return values (strict JSON,
    exact builtin types) on a dedicated pipe; the expected outputs stay in this process, which
    compares them. Assert tasks (HumanEval): the child prints a per-run nonce only after check()
    returns, so exit/atexit/excepthook tricks score 0, and return values are rebuilt from exact
    builtin types before check sees them. NOT stopped in assert mode: code in the same interpreter
    as check() can read the test's constants (e.g. via frames or gc) or tamper with check and the
    nonce in memory; hence I/O tests for training.
    """
    def __init__(self, workers: int | None = None, timeout_s: float = 2.0, memory_mb: int = 512,
                 output_kb: int = 64, file_mb: int = 4, result_kb: int = 1024):
        self.workers, self.timeout_s = workers or os.cpu_count() or 1, timeout_s
        self.output_kb, self.result_kb, self.memory_mb = output_kb, result_kb, memory_mb
        self._cfg = json.dumps({"timeout": timeout_s, "memory_mb": memory_mb, "file_mb": file_mb,
                                "output_bytes": output_kb << 10, "result_bytes": result_kb << 10,
                                "tmpfs_mb": max(64, 4 * file_mb), "uid_base": 1_000_000,
                                "preload": _PRELOAD, "tmpdir": tempfile.gettempdir()})
        self._q, self._lock, self._closed = queue.Queue(), threading.Lock(), False
        self._procs = [self._spawn() for _ in range(self.workers)]
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def _spawn(self):
        # Same user as this process (root in CI): it reads sandbox_worker.py once at start; its
        # children only fork (never exec), so chroot/uid drop never need the file or interpreter.
        p = subprocess.Popen([sys.executable, "-I", "-S", _WORKER_PATH, self._cfg], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                             start_new_session=True)
        p.info = self._recv(p, 30)["hello"]
        global _warned
        self.isolation = p.info
        missing = [k for k in ("uid", "chroot", "nproc", "netns", "private_tmp") if not p.info[k]]
        if missing and not _warned:
            _warned = True
            warnings.warn(f"sandbox: degraded isolation, unavailable: {missing} (needs root on Linux); "
                          "candidates may see files/network of this user", RuntimeWarning)
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
        return [p.info["uid"] for p in self._procs if p.info.get("uid") is not None]

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
        if not old.info["private_tmp"]:        # a killed worker could not remove its own dir
            shutil.rmtree(os.path.join(tempfile.gettempdir(), f"sandbox-{old.pid}"), ignore_errors=True)
        for _ in range(3):
            try:
                if not self._closed:
                    self._procs[i] = self._spawn()
                return
            except Exception:
                time.sleep(0.5)

    def _job(self, task, completion):
        if not any(l.strip() and not l.strip().startswith("#") for l in completion.splitlines()):
            return None
        if task.inputs is None and task.test is None:
            raise ValueError(f"task {task.task_id} has neither inputs/outputs nor test")
        io = task.inputs is not None
        return {"program": build_program(task, completion), "entry": task.entry_point,
                "inputs": [json.dumps(a) for a in task.inputs] if io else None,
                "test": None if io else task.test, "nonce": secrets.token_hex(16)}

    def _score(self, task, job, rep, fractional):
        n = len(task.inputs) if task.inputs is not None else 1
        def res(outcome, passed, feedback):
            reward = 1.0 if outcome == "pass" else (passed / n if fractional and outcome != "sandbox_error" else 0.0)
            return Result(reward, outcome == "pass", outcome, _printable(feedback), passed, n)
        if "error" in rep:
            return res("sandbox_error", 0, rep["error"])
        if rep["setup"].startswith(job["nonce"] + "\t"):   # the trusted channel: OUR failure
            try:
                why = str(json.loads(rep["setup"][len(job["nonce"]) + 1:])[1])
            except (ValueError, IndexError, TypeError):
                why = "sandbox setup failed"
            return res("sandbox_error", 0, why)
        msgs = []
        for line in rep["res"].split("\n"):    # only lines carrying this run's nonce count
            if line.startswith(job["nonce"] + "\t"):
                try:
                    m = json.loads(line[len(job["nonce"]) + 1:])
                except (ValueError, RecursionError):
                    continue
                if type(m) is list and m and type(m[0]) is str:
                    msgs.append(m)
        kind = lambda k: k if k in _CHILD_KINDS else "runtime_error"   # never pass/sandbox_error
        load = next((m for m in msgs if m[0] == "load" and len(m) == 3), None)
        if load:
            return res(kind(load[1]), 0, load[2])
        limit = (f"output limit exceeded (more than {self.output_kb} KB printed)" if rep["over"] == "output"
                 else f"result data limit exceeded ({self.result_kb} KB)")
        if task.inputs is None:
            if ["done"] in msgs:
                return res("pass", 1, "check() passed")
            if rep["over"]:
                return res("output_limit", 0, limit)
            if rep["timed_out"]:
                return res("timeout", 0, f"timed out after {self.timeout_s} s")
            fail = next((m for m in msgs if m[0] == "fail" and len(m) == 3), None)
            if fail:
                return res(kind(fail[1]), 0, fail[2])
            outcome, why = _death(rep)
            return res(outcome, 0, why)
        cases = {}
        for m in msgs:
            if m[0] == "case" and len(m) == 4 and type(m[1]) is int and type(m[2]) is str:
                cases.setdefault(m[1], m)
        passed, first = 0, None
        for i, exp in enumerate(task.outputs):
            m = cases.get(i)
            if m is not None and m[2] == "ok" and _same(exp, m[3]):
                passed += 1
            elif first is None:
                first = i
        if first is None:
            return res("pass", passed, f"passed {n}/{n} tests")
        if rep["over"]:
            return res("output_limit", passed, limit)
        if rep["timed_out"]:
            return res("timeout", passed, f"timed out after {self.timeout_s} s ({passed}/{n} tests passed)")
        m, exp = cases.get(first), task.outputs[first]
        call = f"{task.entry_point}({', '.join(map(repr, task.inputs[first]))})"
        if m is None:
            outcome, why = _death(rep)
            return res(outcome, passed, f"{why}; {passed}/{n} tests passed")
        if m[2] == "ok":
            return res("wrong_answer", passed, f"{call} should return {exp!r}, got {m[3]!r}")
        if m[2] == "bad":
            return res("wrong_answer", passed, f"{call}: {m[3]}")
        return res(kind(m[2]), passed, f"{call} raised {m[3]}")

    def submit_batch(self, tasks, completions, fractional=False) -> concurrent.futures.Future:
        """Non-blocking: returns a Future of list[Result] (same order), so the trainer can keep
        generating while the workers run the tests."""
        if len(tasks) != len(completions):
            raise ValueError("tasks and completions differ in length")
        if self._closed:
            raise RuntimeError("SandboxPool is closed")
        fut, results = concurrent.futures.Future(), [None] * len(tasks)
        left = [len(tasks)]
        def finish(i, r):
            results[i] = r
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fut.set_result(results)
        jobs = [(i, t, self._job(t, c)) for i, (t, c) in enumerate(zip(tasks, completions))]
        for i, t, job in jobs:
            if job is None:
                finish(i, Result(0.0, False, "no_code", "the completion contains no code", 0,
                                 len(t.inputs) if t.inputs is not None else 1))
                continue
            def done(rep, i=i, t=t, job=job):
                try:
                    r = self._score(t, job, rep, fractional)
                except Exception as e:      # a judge bug must not hang the batch
                    r = Result(0.0, False, "sandbox_error", _printable(f"judge failed: {e!r}"), 0, 1)
                finish(i, r)
            self._q.put((job, done))
        if not tasks:
            fut.set_result([])
        return fut

    def run_batch(self, tasks, completions, fractional=False) -> list[Result]:
        return self.submit_batch(tasks, completions, fractional).result()

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

# ----------------------------------------------------------------------------- CLI

def main(argv=None):
    ap = argparse.ArgumentParser(description="Coding tasks and sandbox: export, show or check tasks.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, text in [("export", "write tasks to JSONL"), ("show", "print prompts + reference solutions"),
                       ("check", "run reference solutions through the sandbox")]:
        p = sub.add_parser(name, help=text)
        p.add_argument("--split", choices=["train", "test"], default="test", help="task split")
        p.add_argument("--n", type=int, default=3 if name == "show" else 500, help="number of tasks")
        p.add_argument("--seed", type=int, default=0, help="generator seed")
        p.add_argument("--difficulties", default="", help="subset of 1..5, e.g. 1-3 or 1,2,5 (default: all)")
        p.add_argument("--families", default="", help=f"comma-separated subset of {','.join(tasks.FAMILIES)}")
        p.add_argument("--canaries", action="store_true", help="append the canary tasks")
        p.add_argument("--humaneval", action="store_true", help="use the 164 HumanEval problems instead")
        if name == "export":
            p.add_argument("--out", required=True, help="output JSONL path")
        if name == "check":
            p.add_argument("--workers", type=int, default=None, help="sandbox workers (default: cores)")
            p.add_argument("--timeout", type=float, default=3.0, help="seconds per candidate")
    a = ap.parse_args(argv)
    try:
        fams = [x.strip() for x in a.families.split(",") if x.strip()] or None
        levels = tasks.parse_difficulties(a.difficulties)
        todo = tasks.load_humaneval() if a.humaneval else tasks.generate_tasks(a.split, a.n, a.seed, levels, fams)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    todo += tasks.canary_tasks() if a.canaries else []
    summary = {"cmd": a.cmd, "n_tasks": len(todo)}
    if a.cmd == "export":
        tasks.save_tasks(todo, a.out)
        summary["out"] = a.out
    elif a.cmd == "show":
        for t in todo:
            hidden = len(t.inputs or []) - t.prompt.count(">>> ")
            print(f"# {t.task_id} family={t.family} difficulty={t.difficulty} slice={t.slice or '-'} hidden_tests={hidden}")
            print(corpus_text(t))
    else:
        with SandboxPool(a.workers, timeout_s=a.timeout) as pool:
            t0 = time.time()
            results = pool.run_batch(todo, [t.solution or "" for t in todo])
            dt = time.time() - t0
        for t, r in zip(todo, results):
            if not r.passed and not t.canary:
                print(f"{t.task_id}: {r.outcome}: {r.feedback}")
        outcomes = {}
        for r in results:
            outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
        summary.update(pass_rate=sum(r.passed for r in results) / max(1, len(results)), outcomes=outcomes,
                       runs_per_s=round(len(results) / dt, 1), isolation=pool.isolation)
    print(json.dumps(summary))

if __name__ == "__main__":
    main()
