"""Run model-written Python code in a throwaway, locked-down process.

``run_python(code, stdin=..., limits=...)`` starts this very file as a launcher
(``python -I -S -B _sandbox.py``, a new session) and sends it the request on its
stdin. The launcher (still root, still on the host) calls ``unshare`` for new
mount, network, PID, IPC and UTS namespaces and forks the first process of the
new PID namespace, which:

- mounts a private tmpfs (``disk_bytes``) as its future root and binds into it,
  read-only, nosuid and nodev, only ``/usr`` (with the ``/bin``, ``/lib``, ...
  links of a merged-/usr system), the Python installation that runs the code, and
  ``/dev/null``, ``/dev/zero``, ``/dev/random``, ``/dev/urandom``; it makes
  ``/work`` (the working folder and cwd) and ``/tmp`` there;
- ``chroot``s into it, sets the limits (RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC,
  RLIMIT_NOFILE, RLIMIT_FSIZE, RLIMIT_CORE = 0), drops to a fresh unprivileged uid
  and gid (random, unused by anything else: no capabilities left, and the process
  count limit counts this run's processes only), sets no_new_privs (setuid programs
  in /usr cannot give root back), installs a seccomp filter under which the kernel's
  key management (``add_key``, ``request_key``, ``keyctl``: the caller's session
  keyring is inherited across fork) fails with EPERM, and execs
  ``python -I -S -B /code/main.py`` with a minimal environment.

The tmpfs is bounded in bytes (``disk_bytes``) and in files (``disk_files`` inodes, plus
the ~20 the setup uses): empty files cost kernel memory, not bytes.

The network namespace has only a loopback device, down: no connection can leave,
not even to the host's 127.0.0.1. When the first process of the PID namespace ends
(the code finished, or the host killed the session at the wall-clock limit), the
kernel kills every process left in the namespace, so fork bombs and daemons die
with the run; the tmpfs, and so the working folder, goes with the last of them.

Needs root (real root, not root of a user namespace: the fresh uid must exist);
where a step of the setup fails, ``SandboxUnavailable`` is raised: code never runs
with less isolation than described here.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be set up here (not root, namespaces refused, ...)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. Sizes in bytes, times in seconds."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS, per process
    max_processes: int = 16  # RLIMIT_NPROC, for the run's uid (this run only)
    output_bytes: int = 64 * 2**10  # kept per stream (stdout, stderr)
    disk_bytes: int = 32 * 2**20  # the tmpfs holding /work and /tmp
    disk_files: int = 4096  # inodes of that tmpfs (files, folders, links): kernel memory stays bounded too
    open_files: int = 64

    def __post_init__(self):
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "max_processes",
                     "output_bytes", "disk_bytes", "disk_files", "open_files"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # the code's exit status; -N when a signal N ended it; None if killed by us
    timed_out: bool  # the wall-clock limit was hit
    killed_reason: str | None  # None, "timeout", "cpu", "output" or "signal N"
    truncated: bool  # stdout or stderr was cut at limits.output_bytes
    seconds: float  # wall-clock time of the run, setup included

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


# A run whose output passes this many times output_bytes is killed (the rest is dropped anyway).
_OUTPUT_KILL_FACTOR = 64
# Exit status the launcher uses when the sandbox could not be set up.
_SETUP_FAILED = 125
_BACKSTOP_SECONDS = 2.0
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _fresh_uid() -> int:
    with _uid_lock:
        while True:
            uid = 1_000_000 + secrets.randbelow(2**30)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


def _python_install() -> tuple[str, str]:
    """(the real interpreter binary, the installation folder it lives in)."""
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not exe.startswith(prefix + os.sep):
        raise SandboxUnavailable(f"the interpreter {exe} is not inside its installation {prefix}")
    return exe, prefix


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as ``python -I -S -B main.py`` in the sandbox; return what it printed.

    Thread-safe: each call has its own processes, uid and folders. Raises
    ``SandboxUnavailable`` where the sandbox cannot be set up; never runs the code
    unsandboxed.
    """
    limits = limits or SandboxLimits()
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the Python sandbox needs root: it uses mount, network and PID namespaces and runs "
            f"the code as a fresh unprivileged uid (this process runs as uid {os.geteuid()})")
    exe, prefix = _python_install()
    uid = _fresh_uid()
    mountpoint = tempfile.mkdtemp(prefix="skyrl-sandbox-")
    os.chmod(mountpoint, 0o700)
    status_r, status_w = os.pipe()
    t0 = time.monotonic()
    try:
        request = json.dumps({
            "exe": exe, "prefix": prefix, "uid": uid, "root": mountpoint, "status_fd": status_w,
            "wall": float(limits.wall_seconds),
            "cpu": int(limits.cpu_seconds), "memory": int(limits.memory_bytes),
            "nproc": int(limits.max_processes), "disk": int(limits.disk_bytes), "inodes": int(limits.disk_files),
            "nofile": int(limits.open_files), "fsize": int(limits.disk_bytes),
        }).encode()
        payload = b"".join(struct.pack("<Q", len(part)) + part
                           for part in (request, code.encode("utf-8", "surrogatepass"),
                                        stdin.encode("utf-8", "surrogatepass")))
        proc = subprocess.Popen(
            [exe, "-I", "-S", "-B", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(status_w,), start_new_session=True, cwd="/",
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        os.close(status_w)
        status_w = -1
        try:
            outcome = _communicate(proc, payload, status_r, limits, t0)
        finally:
            _kill_session(proc)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    finally:
        if status_w >= 0:
            os.close(status_w)
        os.close(status_r)
        with _uid_lock:
            _uids_in_use.discard(uid)
        try:
            os.rmdir(mountpoint)  # empty on the host: the tmpfs lived in the run's mount namespace
        except OSError:
            pass
    return outcome


def _kill_session(proc: subprocess.Popen) -> None:
    # The launcher leads its own session; the namespace's first process is in its
    # group and dies with the launcher (parent-death signal); the kernel then kills
    # the rest of the PID namespace, wherever they moved their process group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _communicate(proc, payload, status_r, limits, t0) -> SandboxResult:
    sel = selectors.DefaultSelector()
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    seen = {"stdout": 0, "stderr": 0}
    status = bytearray()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(status_r, selectors.EVENT_READ, "status")
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    pending = memoryview(payload)
    # the launcher enforces the wall-clock limit itself; this is the backstop
    deadline = t0 + limits.wall_seconds + _BACKSTOP_SECONDS
    killed_reason = None
    open_streams = 3
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            killed_reason = "timeout"
            break
        for key, _ in sel.select(timeout=left):
            name = key.data
            if name == "stdin":
                try:
                    n = os.write(key.fd, pending)
                except (BrokenPipeError, BlockingIOError) as e:
                    n = 0 if isinstance(e, BlockingIOError) else len(pending)
                pending = pending[n:]
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if name == "status":
                status += chunk
                continue
            seen[name] += len(chunk)
            room = limits.output_bytes - len(bufs[name])
            if room > 0:
                bufs[name] += chunk[:room]
            if seen[name] > _OUTPUT_KILL_FACTOR * limits.output_bytes:
                killed_reason = "output"
        if killed_reason:
            break
    sel.close()
    if not proc.stdin.closed:
        proc.stdin.close()
    if killed_reason:
        # ask the launcher to kill and reap the code (SIGUSR1: its handler kills its
        # child); the session is killed afterwards in any case
        try:
            proc.send_signal(signal.SIGUSR1)
            proc.wait(timeout=2)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    seconds = time.monotonic() - t0
    report = {}
    if status:
        try:
            report = json.loads(bytes(status).decode().splitlines()[-1])
        except (ValueError, IndexError):
            report = {}
    if "setup_error" in report:
        raise SandboxUnavailable(f"the Python sandbox could not be set up: {report['setup_error']}")
    if killed_reason is None and "exit" not in report:
        proc.wait()
        err = bytes(bufs["stderr"]).decode("utf-8", "replace").strip()
        raise SandboxUnavailable(
            f"the sandbox launcher ended without a report (exit status {proc.returncode}): {err[-500:]}")
    exit_code = None
    if killed_reason is None:
        exit_code = report["exit"]
        # The code is PID 1 of its namespace: nothing inside can SIGKILL it, so a SIGKILL
        # we did not send is the kernel's, at the CPU limit (or the OOM killer's: those
        # have not used most of their CPU time). rusage can read a little under the limit.
        cpu_spent = report.get("cpu_seconds", 0.0) >= 0.5 * limits.cpu_seconds
        if report.get("timed_out"):
            killed_reason, exit_code = "timeout", None
        elif exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL and cpu_spent):
            killed_reason = "cpu"
        elif exit_code < 0:
            killed_reason = f"signal {-exit_code}"
    return SandboxResult(
        stdout=bytes(bufs["stdout"]).decode("utf-8", "replace"),
        stderr=bytes(bufs["stderr"]).decode("utf-8", "replace"),
        exit_code=exit_code,
        timed_out=killed_reason == "timeout",
        killed_reason=killed_reason,
        truncated=any(seen[k] > limits.output_bytes for k in seen),
        seconds=seconds,
    )


# ---------------------------------------------------------------------------
# The launcher: everything below runs in the launcher process (python -I -S -B).

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_DEVICES = ("null", "zero", "random", "urandom")


def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(src, dst, fstype, flags, data=None):
        enc = (lambda s: None if s is None else s.encode())
        check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
              f"mount {src or fstype} on {dst}")

    def unshare(flags):
        check(libc.unshare(ctypes.c_int(flags)), "unshare")

    def prctl(option, arg, arg2=0):
        check(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(arg2),
                         ctypes.c_ulong(0), ctypes.c_ulong(0)), f"prctl {option}")

    return mount, unshare, prctl


def _read_exact(fd, n):
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("request cut short")
        out += chunk
    return bytes(out)


def _read_part(fd):
    (n,) = struct.unpack("<Q", _read_exact(fd, 8))
    return _read_exact(fd, n)


def _launcher_main():
    started = time.monotonic()
    request = json.loads(_read_part(0))
    code = _read_part(0)
    stdin_data = _read_part(0)
    status_fd = request["status_fd"]
    os.set_inheritable(status_fd, False)

    def report(**kw):
        os.write(status_fd, (json.dumps(kw) + "\n").encode())

    try:
        mount, unshare, prctl = _libc()
        unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS)
    except Exception as e:  # noqa: BLE001 - reported to the host, which raises
        report(setup_error=f"{type(e).__name__}: {e}")
        os._exit(_SETUP_FAILED)
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        try:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            _setup_child(request, code, stdin_data, mount, prctl)
            os.set_inheritable(err_w, False)
            os.closerange(3, err_w)
            os.closerange(err_w + 1, 65536)
            os.execve(request["exe"], [request["exe"], "-I", "-S", "-B", "/code/main.py"],
                      {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8", "TMPDIR": "/tmp"})
        except BaseException as e:  # noqa: BLE001
            try:
                os.write(err_w, f"{type(e).__name__}: {e}".encode())
            finally:
                os._exit(_SETUP_FAILED)
    os.close(err_w)
    timed_out = []

    def on_alarm(signum, frame):
        timed_out.append(True)
        os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid cannot have been reused

    def on_stop(signum, frame):
        os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGUSR1, on_stop)
    signal.setitimer(signal.ITIMER_REAL, max(request["wall"] - (time.monotonic() - started), 0.001))
    setup_error = b""
    while True:  # closes on exec (success) or carries the error
        chunk = os.read(err_r, 4096)
        if not chunk:
            break
        setup_error += chunk
    _, wstatus, usage = os.wait4(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if setup_error:
        report(setup_error=setup_error.decode("utf-8", "replace"))
        os._exit(_SETUP_FAILED)
    report(exit=os.waitstatus_to_exitcode(wstatus), timed_out=bool(timed_out),
           cpu_seconds=usage.ru_utime + usage.ru_stime)
    os._exit(0)


def _setup_child(request, code, stdin_data, mount, prctl):
    import resource

    root, prefix, uid = request["root"], request["prefix"], request["uid"]
    mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    # the setup's own files and folders (/usr, /dev, /code, ...) need ~20 inodes beyond the code's
    mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV,
          f"size={request['disk']},nr_inodes={request['inodes'] + 64},mode=755")

    def bind_ro(src, dst, device=False):
        if device:
            open(dst, "w").close()
        else:
            os.makedirs(dst, exist_ok=True)
        mount(src, dst, None, _MS_BIND)
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | (0 if device else _MS_NODEV)
        mount(None, dst, None, flags)

    bind_ro("/usr", root + "/usr")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            bind_ro(host, f"{root}/{name}")
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        bind_ro(prefix, root + prefix)
    os.makedirs(root + "/dev")
    for dev in _DEVICES:
        bind_ro("/dev/" + dev, f"{root}/dev/{dev}", device=True)
    os.makedirs(root + "/code")
    with open(root + "/code/main.py", "wb") as f:
        f.write(code)
    os.chmod(root + "/code/main.py", 0o644)
    for d, mode in (("/work", 0o700), ("/tmp", 0o700)):
        os.mkdir(root + d)
        os.chown(root + d, uid, uid)
        os.chmod(root + d, mode)
    with open(root + "/.stdin", "wb") as f:
        f.write(stdin_data)
    fd = os.open(root + "/.stdin", os.O_RDONLY)
    os.unlink(root + "/.stdin")
    os.dup2(fd, 0)
    os.close(fd)
    os.chroot(root)
    os.chdir("/work")
    # soft = hard: the kernel sends SIGKILL at the CPU limit (the code is PID 1 of its
    # namespace, which ignores SIGXCPU)
    for lim, value in ((resource.RLIMIT_CPU, request["cpu"]), (resource.RLIMIT_AS, request["memory"]), (resource.RLIMIT_NPROC, request["nproc"]),
                       (resource.RLIMIT_NOFILE, request["nofile"]), (resource.RLIMIT_FSIZE, request["fsize"]),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(lim, (value, value))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("could not drop to the sandbox uid")
    _deny_keyrings(prctl)


# The kernel's key management (add_key, request_key, keyctl) reaches the caller's session
# keyring, which a fork inherits, and keeps keyrings after the run: the code gets EPERM.
_KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _SECCOMP_RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_EPERM = 1


def _deny_keyrings(prctl):
    """A seccomp filter (after no_new_privs, before exec; it survives exec and fork): the
    key syscalls fail with EPERM; a syscall of another architecture than this one kills
    the process (a 32-bit syscall table would number the key syscalls differently)."""
    import ctypes
    import platform

    machine = platform.machine()
    if machine not in _KEY_SYSCALLS:
        raise OSError(f"no seccomp filter for this architecture ({machine})")
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    calls = _KEY_SYSCALLS[machine]
    n = len(calls)
    # 0 arch?  2 kill  3 nr  4 x32 (nr >= 2**30 on x86-64)?  5.. key calls?  5+n allow  6+n EPERM  7+n kill
    prog = [(ld_abs, 0, 0, 4),  # seccomp_data.arch
            (jeq, 1, 0, _AUDIT_ARCH[machine]),
            (ret, 0, 0, _SECCOMP_RET_KILL_PROCESS),
            (ld_abs, 0, 0, 0),  # seccomp_data.nr
            (jge, n + 2, 0, 0x40000000)]
    for i, nr in enumerate(calls):
        prog.append((jeq, n - i, 0, nr))
    prog += [(ret, 0, 0, _SECCOMP_RET_ALLOW), (ret, 0, 0, _SECCOMP_RET_ERRNO | _EPERM),
             (ret, 0, 0, _SECCOMP_RET_KILL_PROCESS)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    program = Prog(len(prog), ctypes.cast(filters, ctypes.POINTER(Filter)))
    prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(program))


if __name__ == "__main__":
    _launcher_main()
