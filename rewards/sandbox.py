"""Isolation for model-written code, from the operating system rather than from Python.

Every program runs under bubblewrap (bwrap, the tool Flatpak uses): new user, pid, network, ipc, uts and mount
namespaces; uid 65534 with no capabilities; a read-only view of only the system libraries and this Python's own
installation; a private, size-capped scratch directory (a tmpfs of its own) and /tmp as its only writable places; its
own /proc (it sees only its own processes), a minimal /dev, no host home, /root or /etc; an empty environment. Resource
limits apply inside (CPU seconds, address space, processes, file size, open files; as root, whom the kernel exempts
from the process limit, a pids cgroup caps processes instead); output is read in bounded chunks and cut at its cap
while the program runs; a timeout kills every process in it, and returns once they are gone (the pid namespace dies
with its first process). Where bwrap is missing or user namespaces are refused, nothing runs: require() says how to get
them. There is no weaker fallback, and nothing here relies on Python-level guards.

    run_python(code)                        -> what a model should see: stdout, or the error
    run_python(code, with_images=True)      -> (that text, the PNG images the code saved, size-checked)
    call_functions(code, calls)             -> each call's value as repr(), None where it raised (code rewards)
    SandboxWorker(setup, handler)           -> a warm sandboxed process that runs handler(request) in a fresh fork
                                               per call, with a hard deadline (the math grader's verifier)
"""
import ast
import contextlib
import functools
import io
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time

TIMEOUT = float(os.environ.get("MOLT_SANDBOX_TIMEOUT", 10))
MEMORY = int(os.environ.get("MOLT_SANDBOX_MEMORY_MB", 1024)) << 20
OUTPUT_BYTES = int(os.environ.get("MOLT_SANDBOX_OUTPUT_BYTES", 64 << 10))  # kept of stdout and of stderr
FLOOD_BYTES = 64 << 20  # read and dropped past OUTPUT_BYTES; beyond this the program is stopped
OUTPUT_CHARS = int(os.environ.get("MOLT_SANDBOX_OUTPUT_CHARS", 4096))  # shown to the model
IMAGE_BYTES = int(float(os.environ.get("MOLT_IMAGE_MAX_MB", 16)) * 2**20)  # the caps of Molt's image intake
IMAGE_PIXELS = int(os.environ.get("MOLT_IMAGE_MAX_PIXELS", 16_000_000))
IMAGES_BYTES = 4 * IMAGE_BYTES + 64  # all the images of one run
SCRATCH_BYTES = int(os.environ.get("MOLT_SANDBOX_SCRATCH_MB", 128)) << 20  # all it may write, /tmp included
NOBODY = "65534"
# bwrap's own environment: its first process lives on inside the sandbox as pid 1, and /proc/1/environ is readable
# there, so the host's variables (API keys) must not reach bwrap at all, not only the program it starts
BWRAP_ENV = {"PATH": "/usr/bin:/bin"}
PROCESSES = 32  # processes (and threads) the program may have at once
PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1's pids hierarchy, or v2 with pids enabled


class SandboxUnavailable(RuntimeError):
    """bwrap is missing, or the kernel refuses it the namespaces it needs."""


HOW_TO = ("the sandbox runs model-written code only under bubblewrap with unprivileged user namespaces: install it "
          "(Debian/Ubuntu: apt-get install bubblewrap; scripts/setup.sh does so as root) and allow user namespaces "
          "(sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone = 1 where it exists; in a container, "
          "a seccomp profile that permits unshare/clone of namespaces)")


def _limits(side_w: int | None = None, side: int | None = None):
    """Applied in the child before bwrap starts; inherited by everything inside, where no capability lifts them.
    The process limit is set inside instead (prlimit, after the user namespace exists): set here, the kernel would
    also count the host user's own processes against it (root is exempt from it: _pids_cgroup caps root's sandboxes).
    The side channel's pipe end becomes fd `side`."""
    if side_w is not None and side_w != side:
        os.dup2(side_w, side)
        os.close(side_w)
    cpu = int(TIMEOUT) + 1
    for kind, value in [(resource.RLIMIT_AS, MEMORY), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 64 << 20),
                        (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]:
        resource.setrlimit(kind, (value, value))


def bwrap_argv(extra: list[str] = ()) -> list[str]:
    """The bwrap command line around a program: what it sees, as whom, with which namespaces and limits."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(HOW_TO)
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL", "--die-with-parent",
            "--new-session", "--hostname", "sandbox", "--clearenv"]
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.exists(d):
            argv += ["--ro-bind", d, d]
    size = ["--size", str(SCRATCH_BYTES)]
    argv += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/scratch"]
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    for root in sorted(roots):  # this interpreter's installation and virtual environment, read-only; bound after the
        if not root.startswith(("/usr", "/bin", "/lib")):  # tmpfs, so a checkout under /tmp still finds its Python
            argv += ["--ro-bind", root, root]
    argv += ["--chdir", "/scratch", "--setenv", "HOME", "/scratch", "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "MPLBACKEND", "Agg", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "LANG", "C.UTF-8"]
    return argv + list(extra) + ["/usr/bin/prlimit", f"--nproc={PROCESSES}:{PROCESSES}", "--"]


_CHECKED: list = []


def require():
    """Raise SandboxUnavailable (saying how to get bwrap and user namespaces) unless a probe runs isolated."""
    if _CHECKED:
        return
    try:
        stdout, stderr, _, code, stopped = _run(bwrap_argv() + ["/usr/bin/id", "-u"], b"", 30)
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailable(f"{HOW_TO} ({err})") from None
    if code != 0 or stdout.decode().strip() != NOBODY:
        raise SandboxUnavailable(f"{HOW_TO} (bwrap said: {stopped or stderr.decode().strip()[-300:]})")
    _CHECKED.append(True)
    for root in [r for r in PIDS_ROOTS if os.geteuid() == 0 and os.path.isdir(r)]:
        for name in os.listdir(root):  # the empty cgroups of sandbox workers whose host process has exited
            if name.startswith("molt-sandbox-") and not os.path.exists(f"/proc/{name.split('-')[2]}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, name))


def _pids_cgroup() -> str | None:
    """A new pids cgroup for one sandbox, capped at PROCESSES plus bwrap and the namespace's first process; None where
    prlimit's RLIMIT_NPROC holds by itself. As root it does not: the kernel exempts uid 0 from it, and the sandbox's
    uid 65534 is uid 0 outside, so without the cgroup a fork bomb takes the host's pids until its deadline."""
    if os.geteuid() != 0:
        return None
    name = f"molt-sandbox-{os.getpid()}-{os.urandom(6).hex()}"  # pids get reused, and stale names may linger
    for root in PIDS_ROOTS:
        path = os.path.join(root, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        if os.path.exists(os.path.join(path, "pids.max")):  # made by the kernel: a cgroup with the pids controller
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(PROCESSES + 2))
            return path
        os.rmdir(path)  # a plain directory (/sys/fs/cgroup is a tmpfs under v1), or a cgroup without pids
    raise SandboxUnavailable(f"running as root, the sandbox caps processes with a pids cgroup, and none of "
                             f"{', '.join(PIDS_ROOTS)} let it make one: mount cgroup v1's pids controller there, "
                             f"enable pids in cgroup v2's subtree_control, or run Molt as a user other than root")


def _spawn(argv: list[str], limits, **popen) -> subprocess.Popen:
    """Popen argv (bwrap) in a session and a pids cgroup of its own, limits() applied in the child before it starts."""
    cgroup = _pids_cgroup()
    def preexec():
        if cgroup:  # join before exec, so bwrap and everything it starts is counted
            fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        limits()
    try:
        proc = subprocess.Popen(argv, preexec_fn=preexec, start_new_session=True, env=BWRAP_ENV, **popen)
    except BaseException:
        if cgroup:
            os.rmdir(cgroup)
        raise
    proc.cgroup = cgroup
    return proc


def _reap(proc: subprocess.Popen) -> int:
    """Wait for bwrap and drop its cgroup. It is empty by then (_kill returns only once the namespace is gone), but
    cgroup v1 may refuse the rmdir (EBUSY) for a few milliseconds after the last exit: seen here, so retry briefly."""
    code = proc.wait()
    for _ in range(100 if proc.cgroup else 0):
        try:
            os.rmdir(proc.cgroup)
            break
        except OSError:
            time.sleep(0.01)
    return code


def _run(argv: list[str], stdin: bytes, timeout: float, side: int | None = None):
    """Run argv, feed it stdin, and read stdout, stderr (and the side channel fd, if any) in chunks while it runs,
    keeping OUTPUT_BYTES of each and dropping the rest; the whole sandbox is killed at the deadline or past
    FLOOD_BYTES printed. -> (stdout, stderr, side bytes, exit code or None, why it was stopped or "")."""
    r, w = os.pipe() if side else (None, None)
    proc = _spawn(argv, functools.partial(_limits, w, side), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, pass_fds=(w, side) if side else ())
    if side:
        os.close(w)
    threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    out, err, extra, stopped, printed = bytearray(), bytearray(), bytearray(), "", 0
    sel = selectors.DefaultSelector()
    for f, buf in [(proc.stdout, out), (proc.stderr, err)] + ([(r, extra)] if side else []):
        sel.register(f, selectors.EVENT_READ, buf)
    deadline = time.monotonic() + timeout
    while sel.get_map() and not stopped:
        left = deadline - time.monotonic()
        for key, _ in sel.select(max(0.0, min(left, 1.0))):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            printed += len(chunk) if key.data is not extra else 0
            key.data.extend(chunk[:max(0, OUTPUT_BYTES - len(key.data))] if key.data is not extra else chunk)
        if left <= 0:
            stopped = f"timed out after {timeout:.1f}s"
        elif printed > FLOOD_BYTES:
            stopped = f"printed more than {FLOOD_BYTES >> 20} MiB"
        elif len(extra) > IMAGES_BYTES:
            stopped = f"saved more than {IMAGES_BYTES >> 20} MiB of images"
    if stopped:
        _kill(proc)
    code = _reap(proc)
    sel.close()
    for f in (proc.stdout, proc.stderr):
        f.close()
    if side:
        os.close(r)
    return bytes(out), bytes(err), bytes(extra), None if stopped else code, stopped


def _feed(pipe, data: bytes):
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


def _kill(proc):
    """Everything in the sandbox, gone by the time this returns. SIGKILL goes to bwrap's child, the pid namespace's
    first process: the kernel kills the rest of the namespace and waits for them before that process exits, and bwrap
    exits only after it. Killing bwrap first would return while --die-with-parent still tears the namespace down."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            inits = [int(pid) for pid in f.read().split()]
    except OSError:  # bwrap already gone
        inits = []
    for pid in inits:  # still bwrap's unreaped children, so these pids cannot have been reused
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10 if inits else 0)
    except subprocess.TimeoutExpired:  # bwrap had not forked yet, or is stuck: kill bwrap itself
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# Runs the model's code (read from stdin) in a fresh namespace; then, when asked, sends the PNG files it left in its
# scratch directory to the host over fd 3 (length-prefixed). The code can skip or garble that step; it only loses its
# own images, which the host checks (size, pixels) before decoding anyway.
RUNNER = r'''
import os, stat, sys
_code = sys.stdin.read()
try:
    exec(compile(_code, "<code>", "exec"), {"__name__": "__main__"})
finally:
    if os.environ.get("MOLT_IMAGES_FD"):
        for _name in sorted(os.listdir("."))[:64]:
            _st = os.lstat(_name)
            if _name.endswith(".png") and stat.S_ISREG(_st.st_mode) and _st.st_size <= int(os.environ["MOLT_IMAGE_BYTES"]):
                with open(_name, "rb") as _f:
                    _data = _f.read()
                os.write(3, len(_data).to_bytes(8, "big") + _data)
'''


def run_python(code, timeout: float = TIMEOUT, with_images: bool = False):
    """Run code; return what a model should see (stdout, or the error), plus PNG images when with_images."""
    if not isinstance(code, str) or not code.strip():
        out, images = "Error: no code to run.", []
        return (out, images) if with_images else out
    require()
    env = ["--setenv", "MOLT_IMAGES_FD", "3", "--setenv", "MOLT_IMAGE_BYTES", str(IMAGE_BYTES)] if with_images else []
    argv = bwrap_argv(env) + [sys.executable, "-I", "-c", RUNNER]
    stdout, stderr, side, code_, stopped = _run(argv, code.encode(), timeout, side=3 if with_images else None)
    out = _truncate(_describe(stdout.decode(errors="replace"), stderr.decode(errors="replace"), code_, stopped))
    return (out, decode_images(side)) if with_images else out


def _describe(stdout: str, stderr: str, code: int | None, stopped: str) -> str:
    if stopped:
        return f"Error: execution {stopped}; it was stopped.\nstdout:\n{stdout[-2000:]}"
    if code == 0:
        return stdout if stdout else ("(no output)" if not stderr else f"(no stdout)\nstderr:\n{stderr}")
    if code < 0:
        reason = {9: "killed (memory or CPU limit)", 24: "CPU time limit exceeded", 25: "file size limit exceeded",
                  11: "crashed (segfault)"}
        return f"Error: the process was {reason.get(-code, f'killed by signal {-code}')}.\n" \
               f"stdout:\n{stdout}\nstderr:\n{stderr[-2000:]}"
    return f"Exit code {code}.\nstdout:\n{stdout}\nstderr:\n{stderr[-2000:]}"


def _truncate(text: str) -> str:
    if len(text) <= OUTPUT_CHARS:
        return text
    return text[:OUTPUT_CHARS - 64] + f"\n... [{len(text) - OUTPUT_CHARS + 64} more characters truncated]"


def decode_images(data: bytes, limit: int = 4) -> list:
    """The length-prefixed PNGs the runner sent: each at most IMAGE_BYTES and IMAGE_PIXELS, checked before decoding;
    anything malformed is dropped."""
    import warnings

    from PIL import Image
    images, at = [], 0
    while at + 8 <= len(data) and len(images) < limit:
        n = int.from_bytes(data[at:at + 8], "big")
        blob, at = data[at + 8:at + 8 + n], at + 8 + n
        if n > IMAGE_BYTES or len(blob) != n:
            break
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)  # PIL's bomb guard, as an error
                with Image.open(io.BytesIO(blob)) as im:
                    if im.format == "PNG" and im.width * im.height <= IMAGE_PIXELS:
                        images.append(im.convert("RGB"))
        except Exception:  # noqa: BLE001 - an unreadable or oversized file is simply not shown
            continue
    return images


# A code reward's harness. The expected values never enter the sandbox: it returns what each call evaluated to, and
# the caller compares them outside, so exiting early, printing a fake result or rebinding builtins earns nothing.
HARNESS = r'''
import json, sys
_payload = json.loads(sys.stdin.read())
_ns = {"__name__": "__main__"}
try:
    exec(compile(_payload["code"], "<solution>", "exec"), _ns)
except BaseException:
    pass
_values = []
for _call in _payload["calls"]:
    try:
        _values.append(repr(eval(_call, _ns)))
    except BaseException:
        _values.append(None)
sys.stdout.write("\n" + json.dumps(_values) + "\n")
'''


def call_functions(code: str, calls: list[str], timeout: float = TIMEOUT) -> list[str | None]:
    """Run the solution, then evaluate each call expression after it, in one sandboxed process. -> repr() of each
    value, None where the call raised; all None when the process gave no well-formed answer."""
    require()
    argv = bwrap_argv() + [sys.executable, "-I", "-c", HARNESS]
    stdout, _, _, _, _ = _run(argv, json.dumps({"code": code, "calls": calls}).encode(), timeout)
    try:
        values = json.loads(stdout.decode(errors="replace").rstrip().rsplit("\n", 1)[-1])
    except ValueError:
        return [None] * len(calls)
    ok = isinstance(values, list) and len(values) == len(calls) and all(v is None or isinstance(v, str) for v in values)
    return values if ok else [None] * len(calls)


def split_test(test: str):
    """'assert CALL == LITERAL' -> (CALL, the literal's value); any other assertion -> (its expression, True). Only
    the first kind keeps the expected value out of the solution's reach: a bare assertion's True can be guessed."""
    node = ast.parse(test).body[0]
    expr = node.test if isinstance(node, ast.Assert) else node.value
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], ast.Eq):
        try:
            return ast.unparse(expr.left), ast.literal_eval(expr.comparators[0])
        except ValueError:
            pass
    return ast.unparse(expr), True


def matches(value: str | None, expected) -> bool:
    """The solution's repr() against the expected value, read as a literal outside the sandbox (never evaluated)."""
    if value is None:
        return False
    try:
        return ast.literal_eval(value) == expected
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


class SandboxWorker:
    """A warm sandboxed Python that serves handler(request) calls, one JSON line each. Every call runs in a fresh
    fork of the warm process (nothing a call does reaches the next), under its own address-space limit, and is
    killed at its deadline; if the server itself stops answering it is killed and restarted. setup: source that
    defines `handler(request: dict) -> dict` (its imports happen once, before any request)."""

    SERVER = r'''
import json, os, resource, select, signal, sys, time
exec(sys.argv[1])
for line in sys.stdin:
    req = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        resource.setrlimit(resource.RLIMIT_AS, (req["memory"], req["memory"]))
        try:
            out = handler(req["request"])
        except BaseException as err:
            out = {"error": f"{type(err).__name__}: {err}"[:500]}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data, deadline = b"", time.monotonic() + req["timeout"]
    while time.monotonic() < deadline and len(data) <= 65536:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(r, 65536) if ready else b""
        if not chunk:
            break
        data += chunk
    timed_out = time.monotonic() >= deadline
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    try:
        out = {"timeout": True} if timed_out else json.loads(data)
    except ValueError:
        out = {"error": "no answer"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
'''

    def __init__(self, setup: str, memory: int = MEMORY):
        self.setup, self.memory = setup, memory
        self.lock, self.proc = threading.Lock(), None

    def start(self):
        require()
        argv = bwrap_argv() + [sys.executable, "-I", "-c", self.SERVER, self.setup]
        self.proc = _spawn(argv, _server_limits, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL)

    def call(self, request: dict, timeout: float) -> dict:
        """handler(request) in a fresh fork: its answer, {"timeout": True} past the deadline, {"error": ...} if it
        raised."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:
                self.close()  # it died: reap it and drop its cgroup
            if self.proc is None:
                self.start()
            line = json.dumps({"request": request, "timeout": timeout, "memory": self.memory}) + "\n"
            try:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()
                answer = _readline(self.proc.stdout, timeout + 60)  # the first call also waits for the imports
            except OSError:
                answer = None
            if answer is None:  # the server itself is stuck or gone: start afresh next time
                self.close()
                return {"timeout": True}
            return json.loads(answer)

    def close(self):
        if self.proc is not None:
            _kill(self.proc)
            _reap(self.proc)
            self.proc = None


def _server_limits():
    """A worker's own limits: memory and time are limited per call (in its forks), files here, processes inside."""
    for kind, value in [(resource.RLIMIT_FSIZE, 64 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]:
        resource.setrlimit(kind, (value, value))


def _readline(pipe, timeout: float) -> bytes | None:
    sel = selectors.DefaultSelector()
    sel.register(pipe, selectors.EVENT_READ)
    try:
        return (pipe.readline() or None) if sel.select(timeout) else None
    finally:
        sel.close()


# The OpenAI function schema of the Python tool, offered to models by the agents that use it.
TOOL_SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return its printed output (and any .png it saves).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                   "required": ["code"]}}}


def tool_code(call: dict) -> str | None:
    """The code argument of a parsed tool call (arguments as a JSON string or dict), or None."""
    args = call.get("arguments", {})
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return None
    return args.get("code") if isinstance(args, dict) else None
