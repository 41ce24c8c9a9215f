"""sandbox_worker.py: the sandbox's fork-server worker (stdlib only; never imported, always run).

env.SandboxPool starts one per core as `python -I -S sandbox_worker.py <config JSON>` and speaks
JSON lines with it: the worker answers {"hello": <isolation that works here>} once, then one reply
per job read from stdin. Each job runs in a freshly forked child; the worker watches it, kills it
and sends back what it wrote. The parent (env.py) judges the reply.

Why a separate stdlib-only file rather than functions of env.py: the forked child must not hold
the task generator (it could regenerate reference answers), the expected outputs, torch or
anything of the trainer, so this file imports none of env.py, tasks.py or torch. `-I` (no user
env, no user site, the script's directory not on sys.path: nothing of the repo is importable) and
`-S` (no site-packages) keep it that way. The worker runs as the trainer's user (root in CI) and
reads this file once at start, before any isolation; the children only fork, never exec, so after
chroot and the uid drop they need neither this file nor the interpreter binary.

Once per worker (as root): a network namespace (no network), a private tmpfs on /tmp, a per-worker
unprivileged uid; a probe of what works here (chroot, uid drop, RLIMIT_NPROC stopping fork).
Per candidate, in order:
  1. a fresh empty working dir (owned by the worker's uid), three pipes, fork;
  2. in the child: new session (own process group); stdin /dev/null, stdout+stderr into the
     output pipe, fd 3 the result pipe, fd 4 the trusted setup-error pipe, every other fd closed;
  3. rlimits: CPU, AS, FSIZE, NOFILE=64, NPROC=1 (no fork, no threads), CORE=0;
  4. chroot into the working dir (the host filesystem becomes invisible), then setgroups/setgid/
     setuid to the unprivileged uid (last: no way back to root); scrubbed env (no secrets, no GPU);
  5. trusted test code (assert mode) compiled first, fd 4 closed, then the candidate compiled and
     run; results go back on fd 3, tagged with a per-job nonce (strict JSON, exact builtin types);
  6. in the worker: wall-clock timeout and output/result caps enforced while reading, SIGKILL of
     the process group, reap, remove the working dir, one JSON reply on stdout.
Without root, only the rlimits and the process-group kill apply (env.py warns once).
"""
# Runs as __main__, so sys.argv[0] / __file__ name this file (harmless: after chroot, the path
# points nowhere the candidate can reach). Do not add imports of non-stdlib modules here.
import os, sys, json, time, signal, resource, select, shutil, random, errno, builtins, gc
CFG = json.loads(sys.argv[1])
for _m in CFG["preload"]:      # the child cannot import from disk (chroot): modules it may need
    try:
        __import__(_m)
    except Exception:
        pass
PROTO_IN, PROTO_OUT = os.fdopen(os.dup(0), "rb"), os.dup(1)
NULL = os.open(os.devnull, os.O_RDWR)
os.dup2(NULL, 0); os.dup2(2, 1)       # nothing may ever reach the protocol pipe by accident
_exit = os._exit

def send(obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(PROTO_OUT, data):]

ISO = {"uid": None, "chroot": False, "nproc": False, "netns": False, "private_tmp": False}
if os.geteuid() == 0:
    try:   # namespaces once per worker (per candidate would cost ms): no network, a private /tmp
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        ISO["netns"] = libc.unshare(0x40000000) == 0                    # CLONE_NEWNET
        if libc.unshare(0x20000) == 0 and libc.mount(b"none", b"/", None, 0x44000, None) == 0:
            opts = ("size=%dm,mode=700" % CFG["tmpfs_mb"]).encode()    # (MS_REC|MS_PRIVATE first)
            ISO["private_tmp"] = libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, opts) == 0
        del libc, ctypes
    except Exception:
        pass
    for _k in [k for k in sys.modules if k.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[_k]
    ISO["uid"] = CFG["uid_base"] + os.getpid()   # unique among live workers: no cross-talk
BASE = os.path.join("/tmp" if ISO["private_tmp"] else CFG["tmpdir"], "sandbox-%d" % os.getpid())
shutil.rmtree(BASE, ignore_errors=True)
os.mkdir(BASE, 0o711)

def drop(wd, uid):
    if ISO["chroot"]:
        os.chroot(wd); os.chdir("/")       # the host filesystem becomes invisible
    else:
        os.chdir(wd)
    if uid is not None:                    # last: after this, no way back to root
        os.setgroups([]); os.setgid(uid); os.setuid(uid)

def probe():   # what actually works here: chroot (1), uid drop (2), RLIMIT_NPROC stops fork (4)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chroot(BASE); os.chdir("/"); code |= 1
        except OSError:
            pass
        try:
            if ISO["uid"] is not None:
                os.setgroups([]); os.setgid(ISO["uid"]); os.setuid(ISO["uid"]); code |= 2
            resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
            if os.fork() == 0:
                _exit(0)
        except OSError:
            code |= 4
        _exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
_code = probe()
ISO["chroot"], ISO["nproc"] = bool(_code & 1), bool(_code & 4)
if not _code & 2:
    ISO["uid"] = None
T = CFG["timeout"]
LIMITS = [(resource.RLIMIT_CPU, (int(T) + 1, int(T) + 2)), (resource.RLIMIT_AS, (CFG["memory_mb"] << 20,) * 2),
          (resource.RLIMIT_FSIZE, (CFG["file_mb"] << 20,) * 2), (resource.RLIMIT_NOFILE, (64, 64)),
          (resource.RLIMIT_NPROC, (1, 1)),   # 1 = no fork, no threads: no escapee can outlive the child
          (resource.RLIMIT_CORE, (0, 0))]
gc.collect(); gc.freeze()      # fewer copy-on-write faults in the children
send({"hello": dict(ISO, pid=os.getpid())})

class BadValue(Exception):
    pass

def strict(v):
    """Plain JSON data only, checked by exact type (`is`, never ==: a metaclass can lie)."""
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        if v != v or v in (float("inf"), float("-inf")):
            raise BadValue("non-finite float")
        return v
    if t is list or t is tuple:
        return [strict(x) for x in v]
    if t is dict:
        out = {}
        for k, x in v.items():
            if type(k) is not str:
                raise BadValue("dict key that is not a str")
            out[k] = strict(x)
        return out
    raise BadValue("value of type " + tname(v))

def clean(v):
    """Assert mode: rebuild the return value from exact builtin types, so an object with a lying
    __eq__ or an int subclass never reaches the test's comparisons."""
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str or t is bytes or t is complex:
        return v
    if t is list or t is tuple or t is set or t is frozenset:
        return t([clean(x) for x in v])
    if t is dict:
        return {clean(k): clean(x) for k, x in v.items()}
    raise BadValue("returned a value of type " + tname(v))

def tname(v):
    try:
        return str(type(v).__name__)[:50]
    except BaseException:
        return "?"

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

def child(job, wd, rw, ow, sw):
    nonce = job["nonce"]
    def emit(msg, fd=3):
        data = (nonce + "\t" + json.dumps(msg, allow_nan=False) + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    os.setsid()                            # own session + process group: killpg reaches everything
    os.dup2(NULL, 0); os.dup2(ow, 1); os.dup2(ow, 2); os.dup2(rw, 3); os.dup2(sw, 4)
    os.closerange(5, 1 << 16)
    try:
        for res, lim in LIMITS:
            resource.setrlimit(res, lim)
        drop(wd, ISO["uid"])
        home = "/" if ISO["chroot"] else wd
        os.environ.clear()                 # no secrets, no GPU
        os.environ.update(PATH="/usr/bin:/bin", HOME=home, TMPDIR=home, LANG="C.UTF-8", CUDA_VISIBLE_DEVICES="")
        random.seed()
        sys.stdout = sys.stderr = open(1, "w", buffering=1, errors="backslashreplace", closefd=False)
        sys.stdin = open(0, closefd=False)
    except BaseException as e:             # fd 4: the trusted channel, for OUR failures only
        return emit(["sandbox_error", "sandbox setup failed: " + describe(e)], 4)
    g = {"__name__": "__candidate__", "__builtins__": builtins}
    check = None
    if job["test"] is not None:            # trusted test code first, so the program cannot replace check
        try:
            exec(compile(job["test"], "<test>", "exec"), g)
            check = g["check"]
        except BaseException as e:
            return emit(["sandbox_error", "test code failed: " + describe(e)], 4)
    os.close(4)                            # closed before any candidate code runs: it cannot forge
    try:
        code = compile(job["program"], "<candidate>", "exec")
    except BaseException as e:
        return emit(["load", "syntax_error" if isinstance(e, (SyntaxError, ValueError)) else kind(e), describe(e)])
    try:
        exec(code, g)
    except BaseException as e:
        return emit(["load", kind(e), describe(e)])
    fn = g.get(job["entry"])
    if not callable(fn):
        return emit(["load", "runtime_error", "NameError: %r is not defined" % job["entry"]])
    if check is not None:
        def candidate(*a, **k):
            return clean(fn(*a, **k))
        try:
            check(candidate)
        except (AssertionError, BadValue) as e:
            return emit(["fail", "wrong_answer", describe(e)])
        except BaseException as e:
            return emit(["fail", kind(e), describe(e)])
        return emit(["done"])              # the nonce proves check() returned
    for i, a in enumerate(job["inputs"]):
        try:
            r = fn(*json.loads(a))         # a fresh copy of the arguments for every case
        except BaseException as e:
            emit(["case", i, kind(e), describe(e)])
            continue
        try:
            emit(["case", i, "ok", strict(r)])
        except BaseException:
            emit(["case", i, "bad", "returned a value that is not plain JSON data (%s)" % tname(r)])
    emit(["done"])

def remove(path):
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):               # non-root: undo a candidate's chmod 000, then retry
        for root, dirs, _ in os.walk(path):
            for d in [root] + [os.path.join(root, d) for d in dirs]:
                try:
                    os.chmod(d, 0o700)
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)

COUNTER = 0
def run(job):
    global COUNTER
    COUNTER += 1
    wd = os.path.join(BASE, str(COUNTER))
    os.mkdir(wd, 0o700)
    if ISO["uid"] is not None:
        os.chown(wd, ISO["uid"], ISO["uid"])
    (rr, rw), (orr, ow), (sr, sw) = os.pipe(), os.pipe(), os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            child(job, wd, rw, ow, sw)
        finally:
            _exit(0)                       # never return into the worker loop; skips atexit
    for fd in (rw, ow, sw):
        os.close(fd)
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None
    poller = select.poll()
    for fd in (rr, orr, sr) + ((pfd,) if pfd is not None else ()):
        poller.register(fd, select.POLLIN)
    caps = {rr: CFG["result_bytes"], orr: CFG["output_bytes"], sr: 1 << 16}
    bufs, sizes, live = {rr: bytearray(), sr: bytearray()}, dict.fromkeys(caps, 0), set(caps)
    exited, over, timed_out, deadline = pfd is None, None, False, t0 + T
    while (live or not exited) and not over:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(int(left * 1000) + 1):
            if fd == pfd:
                exited = True
                poller.unregister(fd)
                continue
            data = os.read(fd, 65536)
            if not data:
                live.discard(fd)
                poller.unregister(fd)
                continue
            sizes[fd] += len(data)         # caps enforced while reading, not after
            if fd in bufs:
                bufs[fd] += data[:max(0, caps[fd] - len(bufs[fd]))]
            if sizes[fd] > caps[fd]:
                over = "output" if fd == orr else "result"
    try:
        os.killpg(pid, signal.SIGKILL)     # before reaping: the group id cannot be reused yet
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    status = os.waitpid(pid, 0)[1]
    for fd in (rr, orr, sr) + ((pfd,) if pfd is not None else ()):
        os.close(fd)
    remove(wd)
    return {"res": bufs[rr].decode("utf-8", "replace"), "setup": bufs[sr].decode("utf-8", "replace"), "timed_out": timed_out, "over": over,
            "exit": os.waitstatus_to_exitcode(status), "wall": round(time.monotonic() - t0, 4)}

for line in PROTO_IN:
    try:
        reply = run(json.loads(line))
    except Exception as e:
        reply = {"error": "worker: %r" % (e,)}
    send(reply)
remove(BASE)
