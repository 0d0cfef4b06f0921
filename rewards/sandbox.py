"""A Python sandbox for tool calls and code rewards: run_python(code) -> an observation string, never an exception.

Each run gets a fresh temporary directory as its working directory and home, a wall-clock timeout, and resource
limits (address space, CPU seconds, processes, file size, open files). Inside the child an audit hook, installed
before the user's code runs and impossible to remove from Python, refuses sockets, new processes, and writes
outside the working directory; where the kernel allows, the child also runs in its own network namespace
(`unshare -n`), so it has no network at all. Output is truncated. Images the code saves as .png in its directory
are returned too (run_python(..., with_images=True)), so a tool can show the model a plot.

    from rewards.sandbox import run_python     # or load this file by path, as the agents do
    run_python("print(6 * 7)")                 # '42\\n'
"""
import os
import resource
import shutil
import subprocess
import sys
import tempfile

TIMEOUT = float(os.environ.get("MOLT_SANDBOX_TIMEOUT", 10))
MEMORY = int(os.environ.get("MOLT_SANDBOX_MEMORY_MB", 1024)) << 20
OUTPUT_CHARS = int(os.environ.get("MOLT_SANDBOX_OUTPUT_CHARS", 4096))

# Runs in the child before the user's code: refuse network, processes and writes outside the working directory.
GUARD = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_deny = {"socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo", "subprocess.Popen", "os.system",
         "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "ctypes.dlopen", "pty.spawn"}
def _guard(event, args):
    if event in _deny or event.startswith(("os.exec", "os.spawn")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args[1] is not None and any(m in str(args[1]) for m in "wax+"):
        target = args[0]
        if isinstance(target, int):
            return
        path = os.path.realpath(os.fsdecode(target))
        if path != _root and not path.startswith(_root + os.sep):
            raise PermissionError(f"sandbox: writing outside the working directory ({path}) is not allowed")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.symlink"):
        path = os.path.realpath(os.fsdecode(args[0])) if args and not isinstance(args[0], int) else _root
        if path != _root and not path.startswith(_root + os.sep):
            raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")
sys.addaudithook(_guard)
del _guard
import math
'''


def _limits():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (int(TIMEOUT) + 1, int(TIMEOUT) + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64)) if os.getuid() != 0 else None
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    os.setsid()


def _no_network_prefix() -> list[str]:
    """`unshare -n` (a network namespace with no interfaces) where the kernel lets us; else the audit hook alone."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn"]
    return []


_PREFIX = None


def _truncate(text: str) -> str:
    if len(text) <= OUTPUT_CHARS:
        return text
    return text[:OUTPUT_CHARS - 64] + f"\n... [{len(text) - OUTPUT_CHARS + 64} more characters truncated]"


def run_python(code, timeout: float = TIMEOUT, with_images: bool = False):
    """Run code; return what a model should see (stdout, or the error), plus PNG images when with_images."""
    global _PREFIX
    if not isinstance(code, str) or not code.strip():
        out, images = "Error: no code to run.", []
        return (out, images) if with_images else out
    if _PREFIX is None:
        _PREFIX = _no_network_prefix()
    work = tempfile.mkdtemp(prefix="molt-sandbox-")
    images = []
    try:
        cmd = _PREFIX + [sys.executable, "-I", "-c", GUARD + "\n" + code]
        env = {"HOME": work, "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg"}
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                                  preexec_fn=_limits)
        except subprocess.TimeoutExpired:  # run() kills the child; the guard forbids it any children of its own
            out = f"Error: execution timed out after {timeout:.1f}s."
        else:
            out = _describe(proc)
        if with_images:
            images = [_png(os.path.join(work, f)) for f in sorted(os.listdir(work)) if f.endswith(".png")][:4]
    except Exception as err:  # noqa: BLE001 - the sandbox must answer with an observation, whatever happens
        out = f"Error: the sandbox could not run the code ({type(err).__name__}: {err})."
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return (_truncate(out), [i for i in images if i is not None]) if with_images else _truncate(out)


def _describe(proc) -> str:
    if proc.returncode == 0:
        return proc.stdout if proc.stdout else ("(no output)" if not proc.stderr else f"(no stdout)\nstderr:\n{proc.stderr}")
    if proc.returncode < 0:
        reason = {9: "killed (memory or CPU limit)", 24: "CPU time limit exceeded", 11: "crashed (segfault)"}
        return f"Error: the process was {reason.get(-proc.returncode, f'killed by signal {-proc.returncode}')}.\n" \
               f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-2000:]}"
    return f"Exit code {proc.returncode}.\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-2000:]}"


def _png(path):
    try:
        from PIL import Image
        return Image.open(path).convert("RGB")
    except Exception:  # noqa: BLE001 - an unreadable file is simply not shown
        return None


# The OpenAI function schema of this tool, offered to models by the agents that use it.
TOOL_SCHEMA = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return its printed output (and any .png it saves).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                   "required": ["code"]}}}


def tool_code(call: dict) -> str | None:
    """The code argument of a parsed tool call (arguments as a JSON string or dict), or None."""
    import json
    args = call.get("arguments", {})
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return None
    return args.get("code") if isinstance(args, dict) else None
