"""Isolation for model-written code, from the operating system rather than from Python.

Every program runs under bubblewrap (bwrap, the tool Flatpak uses), and as nobody with power on the host:
- Who: a new user namespace whose only uid, 65534, maps to an unprivileged host uid. Run as root, Molt first drops
  to a host uid and gid of the sandbox's own (one of SANDBOX_UIDS from SANDBOX_UID, none shared by two sandboxes at
  once), so no uid inside is host root and no sandbox spends another's per-user kernel budgets; no capabilities; no
  further user namespaces (bwrap's --disable-userns, and seccomp).
- What it sees: new pid, network, ipc, uts, cgroup and mount namespaces; read-only system libraries and this
  Python's own installation (bound at the paths the interpreter resolves to, so a symlinked virtual environment
  works); its own /proc with /proc/sys read-only; a read-only /dev of its own (null, zero, full, random, urandom:
  no tty) whose /dev/shm, like /tmp, is a directory of the one scratch tmpfs; no host home, /root or /etc; an empty
  environment; a fresh, empty session keyring (the host's is never inherited).
- What it may call: a seccomp filter built with libseccomp (through its Python bindings) refuses new namespaces,
  mounts, io_uring and native AIO, userfaultfd, bpf, perf events, inotify, file locks (flock and fcntl's), the key
  calls, ptrace, module and clock calls and the rest a code sandbox has no use for (inotify, locks and AIO reach
  kernel state the host and other sandboxes share through the bound directories or host-wide counts), terminal
  injection (TIOCSTI), and sockets other than unix, IPv4 and IPv6. bwrap's own root is remounted read-only: only
  the scratch tmpfs is writable.
- How much: one cap for the whole sandbox where the host lets Molt make cgroups (as root, or with a delegated
  cgroup): a memory cgroup holds all its processes and its tmpfs together to MEMORY, a pids cgroup its processes
  to PROCESSES. Inside, per process: the address space (MEMORY), CPU seconds, file size, open files, no core
  files, and at most PROCESSES processes (RLIMIT_NPROC, counted in its own user namespace). The scratch tmpfs
  (/scratch, with /tmp and /dev/shm in it) holds SCRATCH_BYTES in all. Without the cgroups, memory is bounded
  only per process: PROCESSES x MEMORY, plus the scratch.
- How long: output is read in bounded chunks and cut at its cap while the program runs; a timeout kills every
  process in it, and returns once they are gone (the pid namespace dies with its first process).
Where bwrap (0.8 or newer), user namespaces or libseccomp are missing, nothing runs: require() says what to install.
There is no weaker fallback, and nothing here relies on Python-level guards. A sandbox that cannot start raises
SandboxError: an infrastructure failure is never reported as the program's own failure (which would score 0).

    run_python(code)                        -> what a model should see: stdout, or the error
    run_python(code, with_images=True)      -> (that text, the PNG images the code saved, size-checked)
    run(source, stdin, timeout, side=True)  -> (stdout, stderr, side channel bytes, exit code, why it was stopped)
    run_program(argv, workdir, timeout, relay=(port, socket))
                                            -> (stdout, stderr, exit code, why it was stopped): a program (an agent
                                               CLI) with a writable work directory, reaching only the relayed server
    SandboxWorker(setup), WorkerPool(setup, n) -> warm sandboxed processes that run the setup's handler(request) in
                                               a fresh fork per call, with a hard deadline (the graders' workers)
"""
import contextlib
import functools
import io
import json
import os
import random
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

TIMEOUT = float(os.environ.get("MOLT_SANDBOX_TIMEOUT", 10))
MEMORY = int(os.environ.get("MOLT_SANDBOX_MEMORY_MB", 1024)) << 20  # the whole sandbox (a cgroup), else each process
OUTPUT_BYTES = int(os.environ.get("MOLT_SANDBOX_OUTPUT_BYTES", 64 << 10))  # kept of stdout and of stderr
FLOOD_BYTES = 64 << 20  # read and dropped past OUTPUT_BYTES; beyond this the program is stopped
OUTPUT_CHARS = int(os.environ.get("MOLT_SANDBOX_OUTPUT_CHARS", 4096))  # shown to the model
IMAGE_BYTES = int(float(os.environ.get("MOLT_IMAGE_MAX_MB", 16)) * 2**20)  # the caps of Molt's image intake
IMAGE_PIXELS = int(os.environ.get("MOLT_IMAGE_MAX_PIXELS", 16_000_000))
PLOT_SIDE = int(os.environ.get("MOLT_PLOT_MAX_SIDE", 1024))  # a saved image is shown at most this wide and high
SIDE_BYTES = 4 * IMAGE_BYTES + 64  # what the side channel (fd 3) may carry in one run
SCRATCH_BYTES = int(os.environ.get("MOLT_SANDBOX_SCRATCH_MB", 128)) << 20  # /scratch, /tmp and /dev/shm together
# As root, each concurrent sandbox runs as a host uid (and gid) of its own from this range, held by a lock in
# UID_LOCKS for its life: the kernel's per-user budgets (pipe pages, processes) are then no sandbox's to exhaust for
# another. The range is far above any distribution's users and subordinate-id ranges.
SANDBOX_UID = int(os.environ.get("MOLT_SANDBOX_UID", 0x7FF00000))  # the first uid of the range
SANDBOX_UIDS = int(os.environ.get("MOLT_SANDBOX_UIDS", 1024))  # how many: at most this many sandboxes at once
UID_LOCKS = "/run/molt-sandbox-uids"
NOBODY = "65534"
# bwrap's own environment: its first process lives on inside the sandbox as pid 1, and /proc/1/environ is readable
# there, so the host's variables (API keys) must not reach bwrap at all, not only the program it starts
BWRAP_ENV = {"PATH": "/usr/bin:/bin"}
PROCESSES = 32  # processes (and threads) the program may have at once
STARTED = b"\x00molt-sandbox-started\n"  # the sandboxed Python's first write (stderr): the sandbox itself started
PROLOGUE = f"import os as _os\n_os.write(2, {STARTED!r})\ndel _os\n"


class SandboxUnavailable(RuntimeError):
    """bwrap, user namespaces or libseccomp are missing: nothing can run isolated."""


class SandboxError(RuntimeError):
    """A sandbox that should have started did not (an infrastructure failure, not the program's)."""


HOW_TO = ("the sandbox runs model-written code only under bubblewrap 0.8+ with unprivileged user namespaces and a "
          "seccomp filter from libseccomp: install them (Debian/Ubuntu: apt-get install bubblewrap libseccomp2; "
          "scripts/setup.sh does so as root; the Python bindings come with Molt's set-up as pyseccomp) and allow "
          "user namespaces (sysctl user.max_user_namespaces > 0; kernel.unprivileged_userns_clone = 1 where it "
          "exists; in a container, a seccomp profile that permits unshare/clone of namespaces)")


# ---------------------------------------------------------------------------------------------------------------
# What a sandbox may call: a seccomp filter, generated by libseccomp

DENIED_CALLS = (  # each a way into kernel code that a code sandbox never needs and privilege escalations go through
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
    "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev",
    "pidfd_getfd", "kcmp", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd", "open_by_handle_at", "name_to_handle_at",
    "lookup_dcookie", "vhangup", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm",
    "uselib", "nfsservctl", "sysfs", "ustat", "_sysctl", "fanotify_init", "inotify_init", "inotify_init1",
    "inotify_add_watch", "flock", "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy")
FILE_LOCKS = (5, 6, 7, 36, 37, 38, 1024)  # fcntl's F_GETLK, F_SETLK, F_SETLKW, the F_OFD_ three, F_SETLEASE
NEW_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)  # CLONE_NEW*
TERMINAL_INJECTION = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX
OTHER_FAMILIES = (0, 3, 4, 5, 6, 7, 8, 9)  # below 11, every socket family but AF_UNIX (1), AF_INET (2), AF_INET6 (10)


def _seccomp():
    """libseccomp's Python bindings: the official ones where installed, else pyseccomp (the same API over ctypes)."""
    try:
        import seccomp
    except ImportError:
        try:
            import pyseccomp as seccomp
        except (ImportError, OSError) as err:  # OSError: the bindings are there, libseccomp.so.2 is not
            raise SandboxUnavailable(f"{HOW_TO} (libseccomp: {err})") from None
    return seccomp


@functools.lru_cache(maxsize=2)
def seccomp_program(locks: bool = False) -> bytes:
    """The sandbox's seccomp filter as BPF: every call allowed except DENIED_CALLS, fcntl's FILE_LOCKS commands (both
    allowed with `locks`: an agent CLI's SQLite state needs them; a lock on a bound file is then seen by the host) and
    clone into new namespaces (EPERM), clone3 (ENOSYS: its flags sit in memory a filter cannot read, and the C library falls back to clone),
    terminal injection (EPERM) and other socket families (EAFNOSUPPORT). Calls through another architecture's ABI
    (i386, x32) kill the process: libseccomp's default for a foreign architecture."""
    import errno
    sc = _seccomp()
    f = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_CALLS:
        if not (locks and name == "flock"):
            f.add_rule(sc.ERRNO(errno.EPERM), name)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in NEW_NAMESPACES:
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    for command in FILE_LOCKS if not locks else ():
        f.add_rule(sc.ERRNO(errno.EPERM), "fcntl", sc.Arg(1, sc.EQ, command))
    for request in TERMINAL_INJECTION:
        f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    for family in OTHER_FAMILIES:
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.EQ, family))
    f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.GE, 11))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


# ---------------------------------------------------------------------------------------------------------------
# How much: cgroups for the whole sandbox, where the host lets Molt make them

CGROUP_CAPS = [("pids.max", PROCESSES + 2), ("memory.limit_in_bytes", MEMORY), ("memory.memsw.limit_in_bytes", MEMORY),
               ("memory.max", MEMORY), ("memory.swap.max", 0)]  # v1 and v2 names; + 2: bwrap and the first process


@functools.lru_cache(maxsize=None)
def cgroup_parents(pid: int = 0) -> tuple[str, ...]:
    """This process's own cgroup in each hierarchy that can hold a pids or memory cap (cgroup v1 mounts each controller
    apart; v2 holds all in one): a sandbox's cgroups are made inside them, so whatever caps the caller (a container's
    limits) still caps its sandboxes. (pid only keys the cache: a forked process reads its own.)"""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            own[names] = path
    parents = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, rest = line.split(" - ", 1)
            root, point = fields.split()[3:5]
            kind, _, options = rest.split()[:3]
            if kind == "cgroup":  # v1: the hierarchy is named in /proc/self/cgroup by its controllers
                wanted = [c for c in ("pids", "memory") if c in options.split(",")]
                key = next((k for k in own if wanted and wanted[0] in k.split(",")), None)
            else:
                key = "" if kind == "cgroup2" else None
            if key is None or key not in own:
                continue
            path = own[key][len(root):] if root != "/" and own[key].startswith(root) else own[key]
            parent = os.path.normpath(f"{point}/{path}")
            if kind == "cgroup2" and not {"pids", "memory"} & set(_read(f"{parent}/cgroup.subtree_control").split()):
                continue  # a v2 child gets only the controllers its parent hands down
            parents.append(parent)
    return tuple(dict.fromkeys(parents))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _make_cgroups(processes: int = PROCESSES) -> list[str]:
    """New cgroups for one sandbox (its processes join them before bwrap starts), capped by CGROUP_CAPS (pids at
    `processes`), in each hierarchy where this process may make one; [] where it may make none (not root, no delegated
    cgroup)."""
    made, name = [], f"molt-sandbox-{os.getpid()}-{os.urandom(6).hex()}"  # pids get reused: stale names may linger
    for parent in cgroup_parents(os.getpid()):
        path = os.path.join(parent, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        caps = [(file, processes + 2 if file == "pids.max" else value) for file, value in CGROUP_CAPS
                if os.path.exists(os.path.join(path, file))]
        try:
            for file, value in caps:  # in order: v1's memsw may not go below the memory limit
                with open(os.path.join(path, file), "w") as f:
                    f.write(str(value))
        except OSError:
            caps = []
        if caps:
            made.append(path)
        else:  # a plain directory (a tmpfs at /sys/fs/cgroup), or a cgroup without these controllers
            os.rmdir(path)
    return made


def _remove_cgroups(paths: list[str]):
    """Drop a finished sandbox's cgroups. They are empty by then (_kill returns only once the namespace is gone), but
    cgroup v1 may refuse the rmdir (EBUSY) for a few milliseconds after the last exit: seen here, so retry briefly."""
    for path in paths:
        for _ in range(100):
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)


def _sweep_cgroups():
    """The cgroups of sandboxes whose host process has exited (killed before it could remove them)."""
    for parent in cgroup_parents(os.getpid()):
        for name in os.listdir(parent) if os.path.isdir(parent) else ():
            if name.startswith("molt-sandbox-") and not os.path.exists(f"/proc/{name.split('-')[2]}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))


@functools.lru_cache(maxsize=1)
def cgroup_caps() -> set[str]:
    """Which whole-sandbox caps this host lets Molt set: a subset of {"pids", "memory"}."""
    made = _make_cgroups()
    try:
        return {kind for kind in ("pids", "memory") for path in made
                if any(os.path.exists(os.path.join(path, f)) for f, _ in CGROUP_CAPS if f.startswith(kind))}
    finally:
        _remove_cgroups(made)


# ---------------------------------------------------------------------------------------------------------------
# Who and where: the child's set-up before bwrap starts, and bwrap's command line

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
STAGE = "/tmp"  # as root: where the child's own mount namespace puts what bwrap binds (_stage)
CLONE_NEWNS, MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 2, 4, 4096, 16384, 1 << 18
RUN_LIMITS = [(resource.RLIMIT_AS, MEMORY), (resource.RLIMIT_CPU, int(TIMEOUT) + 1),
              (resource.RLIMIT_FSIZE, 64 << 20), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)]
WORKER_LIMITS = RUN_LIMITS[2:]  # a worker limits memory and time per call, in its forks


def _under(path: str, dirs) -> bool:
    return any(path == d or path.startswith(d + "/") for d in dirs)


def python_roots() -> list[tuple[str, list[str]]]:
    """This interpreter's installation and virtual environment outside the system directories: [(real path, [the
    paths it is bound at])]: its real path, and the path the interpreter runs from when that differs (a virtual
    environment reached through a symlink, whose interpreter is started by that path)."""
    roots: dict[str, list[str]] = {}
    for prefix in (sys.base_prefix, sys.prefix, sys.exec_prefix):
        real = os.path.realpath(prefix)
        if not _under(real, SYSTEM_DIRS):
            paths = roots.setdefault(real, [])
            paths += [p for p in (real, os.path.abspath(prefix)) if p not in paths and not _under(p, SYSTEM_DIRS)]
    return sorted(roots.items())


def bwrap_argv(extra: list[str] = (), seccomp_fd: int | None = None, staged: bool = False, binds: list = (),
               processes: int = PROCESSES, home: str = "/scratch") -> list[str]:
    """The bwrap command line around a program: what it sees, as whom, with which namespaces and limits. binds:
    [(host directory, path inside, writable)], staged after the Python roots; home: its working directory and HOME."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(HOW_TO)
    argv = [bwrap, "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--uid", NOBODY, "--gid", NOBODY, "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    argv += [a for d in SYSTEM_DIRS if os.path.exists(d) for a in ("--ro-bind", d, d)]
    argv += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--tmpfs", "/dev"]
    argv += [a for d in DEVICES for a in ("--dev-bind", f"/dev/{d}", f"/dev/{d}")]
    argv += [a for i, name in enumerate(("stdin", "stdout", "stderr")) for a in ("--symlink", f"/proc/self/fd/{i}",
                                                                                   f"/dev/{name}")]
    # one scratch tmpfs holds all it may write: /tmp and /dev/shm are directories of it (relative links, which
    # resolve the same while bwrap sets up and inside)
    argv += ["--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "../scratch/.shm", "/dev/shm", "--remount-ro",
             "/dev", "--size", str(SCRATCH_BYTES), "--tmpfs", "/scratch", "--dir", "/scratch/.tmp", "--dir",
             "/scratch/.shm", "--symlink", "scratch/.tmp", "/tmp"]
    roots = python_roots()
    for i, (real, paths) in enumerate(roots):  # after the scratch, so a checkout under /tmp finds its Python
        argv += [a for p in paths for a in ("--ro-bind", f"{STAGE}/{i}" if staged else real, p)]
    for i, (real, path, writable) in enumerate(binds, len(roots)):
        argv += ["--bind" if writable else "--ro-bind", f"{STAGE}/{i}" if staged else real, path]
    argv += ["--remount-ro", "/"]  # bwrap's root is a tmpfs of no size: writable, it bypassed the scratch cap
    argv += ["--chdir", home, "--setenv", "HOME", home, "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "MPLBACKEND", "Agg", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "LANG", "C.UTF-8"]
    argv += ["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []
    return argv + list(extra) + ["/usr/bin/prlimit", f"--nproc={processes}:{processes}", "--"]


@functools.lru_cache(maxsize=1)
def _native():
    """(libc, keyctl's call number): looked up in the parent, since the child may only call what is ready."""
    import ctypes
    sc = _seccomp()
    return ctypes.CDLL(None, use_errno=True), sc.resolve_syscall(sc.system_arch(), "keyctl")


def _claim_uid() -> tuple[int, int]:
    """As root: (a uid of the range no other sandbox on this host holds, the descriptor whose flock holds it until
    the sandbox is reaped); else (-1, -1)."""
    import fcntl
    if os.geteuid() != 0:
        return -1, -1
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    start = random.randrange(SANDBOX_UIDS)  # (fewer held ones to step over)
    for i in range(SANDBOX_UIDS):
        uid = SANDBOX_UID + (start + i) % SANDBOX_UIDS
        fd = os.open(f"{UID_LOCKS}/{uid}", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise SandboxError(f"all {SANDBOX_UIDS} sandbox uids are held: more sandboxes at once than MOLT_SANDBOX_UIDS")


def _enter(cgroups: list[str], roots: list[str], limits: list, side_w: int | None, side: int | None, uid: int):
    """In the child, before bwrap starts: join the sandbox's cgroups; as root, stage what bwrap binds (_stage); set
    the limits; trade the host's session keyring for a new, empty one; and, as root, become `uid` for good, so
    nothing after this runs as host root. Everything inside inherits all of it, and no capability there undoes it.
    The side channel's pipe end becomes fd `side`."""
    for path in cgroups:  # joined before exec: bwrap and everything it starts is counted
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    libc, keyctl = _native()
    if os.geteuid() == 0:  # staged before the limits: the caller's descriptors are all still open here
        _stage(libc, roots)
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    libc.syscall(keyctl, 1, None)  # KEYCTL_JOIN_SESSION_KEYRING, no name: a new anonymous keyring (seccomp denies
    if os.geteuid() == 0:          # the key calls inside anyway; a host that refuses keyctl itself refuses it here)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if side_w is not None and side_w != side:
        os.dup2(side_w, side)
        os.close(side_w)


def _stage(libc, roots: list[str]):
    """As root, in the child's own mount namespace (private: nothing propagates to the host), bind each Python root at
    STAGE/i, through a descriptor opened before STAGE is covered (a root may lie under it), then closed (one left open
    would lead out of any mount namespace). The sandbox's uid may not reach a root by its path (a pyenv under /root,
    mode 0700), so bwrap, which runs as that uid, binds from STAGE."""
    import ctypes

    def check(ret: int):
        if ret != 0:
            raise OSError(ctypes.get_errno(), "staging the sandbox's Python")
    check(libc.unshare(CLONE_NEWNS))
    check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None))
    fds = [os.open(root, os.O_PATH | os.O_DIRECTORY) for root in roots]  # opened in this namespace: mountable here
    check(libc.mount(b"tmpfs", STAGE.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=64k"))
    for i, fd in enumerate(fds):
        os.mkdir(f"{STAGE}/{i}")
        check(libc.mount(f"/proc/self/fd/{fd}".encode(), f"{STAGE}/{i}".encode(), None, MS_BIND, None))
        os.close(fd)


def _give(top: str, uid: int):
    """Everything under top (links themselves, never followed) owned by uid: the sandbox may write there."""
    os.chown(top, uid, uid, follow_symlinks=False)
    for root, dirs, files in os.walk(top):
        for name in dirs + files:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)


def _high(fd: int) -> int:
    """fd moved to 10 or above, clear of the side channel's fixed number (3)."""
    import fcntl
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


def _spawn(program: list[str], limits: list, extra: list[str] = (), side: int | None = None, binds: list = (),
           processes: int = PROCESSES, home: str = "/scratch", locks: bool = False, **popen):
    """Popen bwrap around program, in a session and cgroups of its own, _enter'ed; proc.side reads the side channel
    (fd `side` inside), when asked for. A writable bind's directory becomes the sandbox uid's (as root)."""
    _native()  # looked up here: the child may only call what is ready
    staged = os.geteuid() == 0
    roots = [real for real, _ in python_roots()] + [real for real, _, _ in binds] if staged else []
    rules = _high(os.memfd_create("molt-seccomp"))
    os.write(rules, seccomp_program(locks))
    os.lseek(rules, 0, os.SEEK_SET)
    r, w = (_high(fd) for fd in os.pipe()) if side else (None, None)
    cgroups, (uid, held) = _make_cgroups(processes), _claim_uid()
    for real, _, writable in binds if uid >= 0 else ():
        if writable:
            _give(real, uid)
    argv = bwrap_argv(extra, rules, staged, binds, processes, home) + program
    try:
        proc = subprocess.Popen(argv, preexec_fn=functools.partial(_enter, cgroups, roots, limits, w, side, uid),
                                start_new_session=True, env=BWRAP_ENV, cwd="/",
                                pass_fds=(rules, *((w, side) if side else ())), **popen)
    except BaseException:
        _remove_cgroups(cgroups)
        _release(held)
        if side:
            os.close(r)
        raise
    finally:
        for fd in (rules, *((w,) if side else ())):
            os.close(fd)
    proc.cgroups, proc.side, proc.held = cgroups, r, held
    return proc


# ---------------------------------------------------------------------------------------------------------------
# How long: running a program, reading its output in bounded chunks, killing it at its deadline

def _run(program: list[str], stdin: bytes, timeout: float, extra: list[str] = (), side: int | None = None,
         side_bytes: int = SIDE_BYTES, limits: list = RUN_LIMITS, **shape):
    """Run program in a sandbox, feed it stdin, and read stdout, stderr (and the side channel, if any) in chunks while
    it runs, keeping OUTPUT_BYTES of each (side_bytes of the side channel) and dropping the rest; the whole sandbox is
    killed at the deadline or past FLOOD_BYTES printed. -> (stdout, stderr, side bytes, exit code or None, why it was
    stopped or "")."""
    proc = _spawn(program, limits, extra, side, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, **shape)
    threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
    out, err, extra_out, stopped, printed = bytearray(), bytearray(), bytearray(), "", 0
    sel = selectors.DefaultSelector()
    for f, buf in [(proc.stdout, out), (proc.stderr, err)] + ([(proc.side, extra_out)] if side else []):
        sel.register(f, selectors.EVENT_READ, buf)
    deadline = time.monotonic() + timeout
    while sel.get_map() and not stopped:
        left = deadline - time.monotonic()
        for key, _ in sel.select(max(0.0, min(left, 1.0))):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            printed += len(chunk) if key.data is not extra_out else 0
            key.data.extend(chunk[:max(0, OUTPUT_BYTES - len(key.data))] if key.data is not extra_out else chunk)
        if left <= 0:
            stopped = f"timed out after {timeout:.1f}s"
        elif printed > FLOOD_BYTES:
            stopped = f"printed more than {FLOOD_BYTES >> 20} MiB"
        elif len(extra_out) > side_bytes:
            stopped = f"sent more than {side_bytes} bytes back"
    if stopped:
        _kill(proc)
    code = _reap(proc)
    sel.close()
    for f in (proc.stdout, proc.stderr):
        f.close()
    if side:
        os.close(proc.side)
    return bytes(out), bytes(err), bytes(extra_out), None if stopped else code, stopped


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


def _reap(proc: subprocess.Popen) -> int:
    """Wait for bwrap (the pid namespace, and every process in it, dies with it), drop its cgroups, free its uid."""
    code = proc.wait()
    _remove_cgroups(proc.cgroups)
    _release(proc.held)
    proc.held = -1  # (closed once: the number may soon be another file's)
    return code


def _release(held: int):
    if held >= 0:
        os.close(held)


def run(source: str, stdin: bytes = b"", timeout: float = TIMEOUT, side: bool | int = False, env: dict | None = None):
    """Run Python `source` in a fresh sandbox, stdin fed to it, fd 3 a channel back to the host when `side` (an int:
    at most that many bytes, else SIDE_BYTES), env set.
    -> (stdout, stderr, side bytes, exit code or None, why it was stopped or ""). Raises SandboxError when the
    sandbox itself did not start (bwrap refused, the interpreter is out of its reach): that is no program's failure."""
    require()
    extra = [a for k, v in (env or {}).items() for a in ("--setenv", k, str(v))]
    out, err, back, code, stopped = _run([sys.executable, "-I", "-c", PROLOGUE + source], stdin, timeout, extra,
                                         3 if side else None, SIDE_BYTES if side is True else int(side))
    return out, _started(err, code, stopped), back, code, stopped


def _started(err: bytes, code: int | None, stopped: str) -> bytes:
    """stderr after the sandboxed Python's first write; SandboxError where it never came (bwrap refused, the
    interpreter out of reach): that is no program's failure."""
    if not err.startswith(STARTED):
        raise SandboxError(f"the sandbox did not start ({stopped or f'exit code {code}'}): "
                           f"{err.decode(errors='replace').strip()[-600:]}")
    return err[len(STARTED):]


# A program run by a Python parent (its first write tells the sandbox started) that exits with the program's status.
# With a port, the parent relays 127.0.0.1:PORT inside the sandbox's network namespace, connection by connection, to
# the host's unix socket bound at RELAYED (a server the program talks to: the loopback session); nothing else leads out.
RELAYED, WORK = "/run/molt", "/home/agent"  # (paths no Python root is bound at)
RELAY = r'''
import socket, subprocess, sys, threading
port, path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
def pump(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def relay(lo):
    while True:
        near, _ = lo.accept()
        far = socket.socket(socket.AF_UNIX)
        try:
            far.connect(path)
        except OSError:
            near.close()
            continue
        for a, b in ((near, far), (far, near)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()
if port:
    threading.Thread(target=relay, args=(socket.create_server(("127.0.0.1", port)),), daemon=True).start()
code = subprocess.run(argv).returncode
sys.exit(128 - code if code < 0 else code)  # (killed by a signal: as a shell says it)
'''
PROGRAM_PROCESSES = 512  # threads count too: a Node or Rust CLI starts dozens
PROGRAM_FILES = 4096


def run_program(argv: list[str], workdir: str, timeout: float, relay: tuple[int, str] | None = None,
                env: dict | None = None, stdin: bytes = b"", shared: list[str] = ()):
    """Run a program (an agent CLI and what it executes) in a sandbox whose only writable host directory is
    `workdir`, at WORK (its working directory and HOME; as root it becomes the sandbox uid's), with `env` as its whole
    environment. relay (port, host unix socket): inside, 127.0.0.1:port leads to that socket (the episode's loopback
    session) and nothing else does. shared: host directories it may read, at their own paths (the program's
    installation, where this Python's does not hold it). It may take file locks (an agent CLI's SQLite state needs
    them). The whole sandbox is capped at MEMORY by its cgroup (where none can be made, each process's address space
    at 4 x MEMORY); its CPU seconds at the timeout.
    -> (stdout, stderr, exit code or None, why it was stopped or ""). Raises SandboxError when the sandbox itself did
    not start."""
    require()
    extra = [a for k, v in (env or {}).items() for a in ("--setenv", k, str(v))]
    port, path = relay or (0, "")
    binds = [(os.path.realpath(workdir), WORK, True)]
    binds += [(os.path.dirname(os.path.realpath(path)), RELAYED, False)] if relay else []
    binds += [(os.path.realpath(d), os.path.realpath(d), False) for d in shared]
    program = [sys.executable, "-I", "-c", PROLOGUE + RELAY, str(port), f"{RELAYED}/{os.path.basename(path)}", *argv]
    limits = [(resource.RLIMIT_CPU, int(timeout) + 1), (resource.RLIMIT_FSIZE, 64 << 20),
              (resource.RLIMIT_NOFILE, PROGRAM_FILES), (resource.RLIMIT_CORE, 0)]
    limits += [] if "memory" in cgroup_caps() else [(resource.RLIMIT_AS, 4 * MEMORY)]
    out, err, _, code, stopped = _run(program, stdin, timeout, extra, limits=limits, binds=binds,
                                      processes=PROGRAM_PROCESSES, home=WORK, locks=True)
    return out, _started(err, code, stopped), code, stopped


_CHECKED: list = []
# Run as the probe: what the sandbox holds (no capabilities, no new privileges, a seccomp filter). (Its host uid
# cannot be read from inside: --disable-userns nests one more user namespace, whose uid_map shows bwrap's.)
PROBE = ("print(*[line.split()[1] for line in open('/proc/self/status')"
         " if line.startswith(('CapEff', 'NoNew', 'Seccomp:'))])")


def require():
    """Raise SandboxUnavailable (saying what to install) unless a probe runs isolated: bwrap with user namespaces,
    no capabilities and the seccomp filter. Warn once where the host lets Molt make no memory cgroup."""
    if _CHECKED:
        return
    if SANDBOX_UID <= 0:
        raise SandboxUnavailable("MOLT_SANDBOX_UID is 0: the sandbox must run as unprivileged host uids")
    _sweep_cgroups()
    try:
        out, err, _, code, stopped = _run([sys.executable, "-I", "-c", PROBE], b"", 60)
    except (OSError, subprocess.SubprocessError) as error:
        raise SandboxUnavailable(f"{HOW_TO} ({type(error).__name__}: {error})") from None
    seen = out.decode(errors="replace").split()
    if code != 0 or seen != ["0000000000000000", "1", "2"]:
        said = stopped or err.decode(errors="replace").strip()[-300:] or f"the probe saw {seen}"
        raise SandboxUnavailable(f"{HOW_TO} (bwrap said: {said})")
    _CHECKED.append(True)
    if "memory" not in cgroup_caps():
        print(f"[sandbox] no memory cgroup can be made here (not root, no delegated cgroup): a sandbox's memory is "
              f"capped per process only, {PROCESSES} x {MEMORY >> 20} MiB plus {SCRATCH_BYTES >> 20} MiB of scratch",
              file=sys.stderr)


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
    env = {"MOLT_IMAGES_FD": 3, "MOLT_IMAGE_BYTES": IMAGE_BYTES} if with_images else {}
    stdout, stderr, side, code_, stopped = run(RUNNER, code.encode(), timeout, with_images, env)
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
    """The length-prefixed PNGs the runner sent: each at most IMAGE_BYTES and IMAGE_PIXELS, checked before decoding,
    and shown at most PLOT_SIDE wide and high (a 16-megapixel plot is ~20k image tokens); anything malformed is
    dropped."""
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
                        image = im.convert("RGB")
                        image.thumbnail((PLOT_SIDE, PLOT_SIDE))
                        images.append(image)
        except Exception:  # noqa: BLE001 - an unreadable or oversized file is simply not shown
            continue
    return images


class SandboxWorker:
    """A warm sandboxed Python that serves handler(request) calls, one JSON line each. Every call runs in a fresh
    fork of the warm process (nothing a call does reaches the next), under its own address-space limit, and is
    killed at its deadline; if the server itself stops answering it is killed and restarted. setup: source that
    defines `handler(request: dict) -> dict` (its imports happen once, before any request)."""

    SERVER = r'''
import json, os, resource, select, signal, sys, time
exec(sys.argv[1])
sys.stdout.write("ready\n")
sys.stdout.flush()
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
        """Start the worker and wait for its set-up (imports) to finish; SandboxError, saying why, if it cannot."""
        require()
        self.proc = _spawn([sys.executable, "-I", "-c", self.SERVER, self.setup], WORKER_LIMITS, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if _readline(self.proc.stdout, 120) != b"ready\n":
            self.close()
            try:  # the same set-up alone, to say why
                _, err, _, code, stopped = run(self.setup, timeout=120)
                why = f"its set-up ended with {stopped or f'exit code {code}'}: {err.decode(errors='replace')[-600:]}"
            except SandboxError as error:
                why = str(error)
            raise SandboxError(f"a sandboxed worker did not start: {why}")

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


class WorkerPool:
    """Up to n SandboxWorkers of one set-up, each started on its first call and serving one call at a time."""

    def __init__(self, setup: str, n: int):
        import queue
        self.free = queue.Queue()
        for _ in range(n):
            self.free.put(SandboxWorker(setup))

    def call(self, request: dict, timeout: float) -> dict:
        worker = self.free.get()
        try:
            return worker.call(request, timeout)
        finally:
            self.free.put(worker)


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
