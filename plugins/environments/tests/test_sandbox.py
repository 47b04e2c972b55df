"""The Python sandbox: code that tries to escape fails safely, normal code works.

Every test runs real code in the real sandbox (namespaces, chroot, rlimits, a
fresh uid). The machine these tests run on (CI, the dev box) runs them as root.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from skyrl_environments._sandbox import SandboxLimits, run_python

REPO = Path(__file__).resolve().parents[3]
PLUGIN_DIR = Path(__file__).resolve().parents[1]


def sandbox_processes() -> list[int]:
    """PIDs of processes owned by a sandbox uid (>= 1,000,000) still alive on the host."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if int(uid_line.split()[1]) >= 1_000_000:
            pids.append(int(entry))
    return pids


def assert_host_fine():
    result = run_python("print(6 * 7)")
    assert result.ok and result.stdout == "42\n"


def test_prints_reads_stdin_and_exits_cleanly():
    result = run_python("import sys\nname = input()\nprint('hello', name)\nprint('err', file=sys.stderr)",
                        stdin="sandbox\n")
    assert result.stdout == "hello sandbox\n"
    assert result.stderr == "err\n"
    assert result.exit_code == 0 and result.ok
    assert not result.timed_out and result.killed_reason is None and not result.truncated
    assert 0 < result.seconds < 5


def test_exception_gives_a_traceback_and_exit_status():
    result = run_python("def f():\n    return 1 / 0\nf()\n")
    assert result.exit_code == 1 and not result.ok
    assert "Traceback (most recent call last)" in result.stderr
    assert 'File "/code/main.py", line 2, in f' in result.stderr
    assert "ZeroDivisionError: division by zero" in result.stderr
    assert run_python("raise SystemExit(3)").exit_code == 3


def test_cannot_read_the_jobs_files_or_the_repo(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    secret = job / "metrics.jsonl"
    secret.write_text("top secret\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(job, 0o755)
    os.chmod(secret, 0o644)  # world-readable on the host: the chroot, not permissions, must stop it
    targets = [str(secret), str(job), str(REPO / "pyproject.toml"), str(Path(__file__).resolve()),
               str(REPO / ".venv" / "pyvenv.cfg"), "/proc/1/root/etc/passwd", "/etc/passwd", "/root"]
    code = textwrap.dedent(f"""
        import os
        for path in {targets!r}:
            try:
                if os.path.isdir(path):
                    print("LISTED", path, os.listdir(path))
                else:
                    print("READ", path, open(path).read())
            except OSError as e:
                print("blocked", path, type(e).__name__)
        print(sorted(os.listdir("/")))
    """)
    result = run_python(code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert "top secret" not in result.stdout
    assert lines[:-1] == [f"blocked {path} FileNotFoundError" for path in targets[:-1]] + \
        ["LISTED /root ['.pyenv']" if sys.base_prefix.startswith("/root/") else "blocked /root FileNotFoundError"]
    visible = set(eval(lines[-1]))  # the sandbox's root: system folders, the interpreter, its own
    assert visible <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "dev", "code", "work", "tmp",
                       Path(sys.base_prefix).parts[1]}
    assert {"proc", "sys", "etc", "home", "work"} & visible == {"work"}


def test_no_host_environment_variables_or_open_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SKYRL_TEST_SECRET", "s3cr3t")
    with open(tmp_path / "open.txt", "w") as held:  # a descriptor the host holds open
        held.write("held")
        held.flush()
        code = textwrap.dedent("""
            import os
            print(sorted(os.environ))
            open_fds = []
            for fd in range(3, 1024):
                try:
                    os.fstat(fd)
                    open_fds.append(fd)
                except OSError:
                    pass
            print(open_fds)
        """)
        result = run_python(code)
    assert result.ok, result.stderr
    env_names, fds = result.stdout.splitlines()
    assert eval(env_names) == ["HOME", "LANG", "PATH", "TMPDIR"] and "s3cr3t" not in result.stdout
    assert fds == "[]"


def test_no_network_not_even_the_hosts_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = textwrap.dedent(f"""
        import socket
        print([name for _, name in socket.if_nameindex()])
        for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port})),
                             (socket.AF_INET, ("1.1.1.1", 53))):
            s = socket.socket(family)
            s.settimeout(2)
            try:
                s.connect(addr)
                print("CONNECTED", addr)
            except OSError as e:
                print("refused", addr[0], e.errno)
        try:
            socket.getaddrinfo("pypi.org", 443)
            print("RESOLVED")
        except OSError:
            print("no dns")
    """)
    result = run_python(code)
    with pytest.raises(BlockingIOError):  # a connection would wait in the backlog
        server.accept()
    server.close()
    assert result.ok, result.stderr
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert result.stdout.splitlines()[0] == "['lo']"
    assert result.stdout.count("refused") == 3 and "no dns" in result.stdout


def test_fork_bomb_is_contained_and_leaves_nothing():
    code = textwrap.dedent("""
        import os, time
        while True:
            try:
                os.fork()
            except OSError as e:
                print("fork refused:", e.strerror, flush=True)
                time.sleep(0.01)
    """)
    result = run_python(code, limits=SandboxLimits(wall_seconds=2, max_processes=8))
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
    assert "fork refused: Resource temporarily unavailable" in result.stdout
    assert result.seconds < 2 + 2
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []
    assert_host_fine()


def test_ten_gigabytes_fail_and_the_host_does_not_grow():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = run_python("b = bytearray(10 * 2**30)\nprint('allocated')")
    assert result.exit_code == 1 and "MemoryError" in result.stderr and result.stdout == ""
    # and a slow grower is stopped at the limit too
    result = run_python("xs = []\nwhile True:\n    xs.append(bytearray(2**20))",
                        limits=SandboxLimits(memory_bytes=256 * 2**20))
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB
    assert_host_fine()


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    result = run_python("while True:\n    pass", limits=SandboxLimits(wall_seconds=1.0))
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code is None
    assert 1.0 <= result.seconds < 2.5
    # a sleeping program is stopped by the wall-clock limit too (it uses no CPU)
    result = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_seconds=0.5))
    assert result.timed_out and result.seconds < 2


def test_cpu_limit_kills_a_busy_program():
    result = run_python("while True:\n    pass", limits=SandboxLimits(wall_seconds=20, cpu_seconds=1))
    assert result.killed_reason == "cpu" and not result.timed_out
    assert result.exit_code == -9
    assert result.seconds < 5


def test_writes_stay_in_its_own_folder_which_is_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's mount point goes
    job = tmp_path / "job"
    job.mkdir()
    os.chmod(job, 0o777)  # even a world-writable job folder is out of reach
    targets = ["/x", "/usr/x", "/code/main.py", "/dev/x", str(job / "x"), sys.base_prefix + "/x",
               str(REPO / "x")]
    code = textwrap.dedent(f"""
        import os
        with open("/work/mine.txt", "w") as f:
            f.write("mine")
        print("cwd", os.getcwd(), os.listdir("."))
        for path in {targets!r}:
            try:
                open(path, "w").write("escaped")
                print("WROTE", path)
            except OSError as e:
                print("blocked", path, type(e).__name__)
        try:
            open("/work/big", "wb").write(b"x" * (64 * 2**20))
            print("WROTE big")
        except OSError as e:
            print("disk full", e.errno)
    """)
    result = run_python(code, limits=SandboxLimits(disk_bytes=16 * 2**20))
    assert result.ok, result.stderr
    assert "WROTE" not in result.stdout
    assert result.stdout.startswith("cwd /work ['mine.txt']\n")
    assert result.stdout.count("blocked") == len(targets) and "disk full 28" in result.stdout
    assert list(job.iterdir()) == [] and not (REPO / "x").exists()
    assert list(tmp_path.iterdir()) == [job]  # no folder left behind on the host
    # the next run starts from an empty folder
    again = run_python("import os\nprint(os.listdir('/work'), os.path.exists('/work/mine.txt'))")
    assert again.stdout == "[] False\n"


def test_no_root_inside_and_no_way_back():
    code = textwrap.dedent("""
        import os, subprocess
        print(os.getuid() >= 1_000_000, os.getgroups())
        for attempt in (lambda: os.setuid(0), lambda: os.chroot("/tmp"), lambda: os.kill(1, 0)):
            try:
                attempt()
                print("ALLOWED")
            except OSError as e:
                print("denied", type(e).__name__)
        su = subprocess.run(["/usr/bin/su", "-c", "id"], capture_output=True)
        print("su", su.returncode)
    """)
    result = run_python(code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "True []"
    assert lines[1:3] == ["denied PermissionError"] * 2
    assert lines[3] == "ALLOWED"  # its own process (PID 1 of its namespace), nothing else is visible
    assert lines[4] != "su 0"


def test_output_is_truncated_and_a_flood_is_stopped():
    result = run_python("import sys\nprint('a' * 50_000)\nsys.stderr.write('b' * 5000)",
                        limits=SandboxLimits(output_bytes=1000))
    assert result.truncated and result.ok
    assert result.stdout == "a" * 1000 and result.stderr == "b" * 1000
    flood = run_python("while True:\n    print('x' * 10_000)",
                       limits=SandboxLimits(output_bytes=1000, wall_seconds=30))
    assert flood.killed_reason == "output" and flood.truncated and flood.stdout == "x" * 1000
    assert flood.seconds < 5
    assert_host_fine()


def test_threads_run_sandboxes_concurrently():
    results = [None] * 4

    def work(i):
        results[i] = run_python(f"import time\ntime.sleep(1.0)\nprint({i})")

    t0 = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(len(results))], results
    assert all(r.ok for r in results), results
    assert elapsed < 1.0 * len(results), elapsed  # they overlapped (one after another: >= 4 s)


def _run_host(prefix: list[str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd="/", env={"PYTHONPATH": str(PLUGIN_DIR), "PATH": os.environ["PATH"]})


PROBE = textwrap.dedent("""
    import os, sys
    from skyrl_environments._sandbox import run_python, SandboxUnavailable
    {drop}
    try:
        result = run_python("print('RAN')")
    except SandboxUnavailable as e:
        print("unavailable:", e)
    else:
        print("ran:", result)
""")


def test_fails_closed_without_root():
    # (the interpreter lives under /root here: drop the effective uid once imports are done)
    proc = _run_host([], PROBE.format(drop="os.setegid(65534); os.seteuid(65534)"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("unavailable: the Python sandbox needs root"), proc.stdout
    assert "RAN" not in proc.stdout


def test_fails_closed_as_root_of_a_user_namespace():
    # root of a user namespace may make namespaces but cannot become a fresh uid:
    # the setup fails and the code never runs
    proc = _run_host(["unshare", "--user", "--map-root-user"], PROBE.format(drop=""))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("unavailable: the Python sandbox could not be set up: "), proc.stdout
    assert "RAN" not in proc.stdout


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wall_seconds must be > 0"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="memory_bytes must be > 0"):
        SandboxLimits(memory_bytes=-1)


def test_the_callers_keyrings_are_out_of_reach_and_none_is_left():
    """keyctl / add_key / request_key fail with EPERM inside (on 82d5798 model-written code
    read, added to and cleared the trainer's session keyring, and runs left keyrings)."""
    import platform

    calls = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}[platform.machine()]
    code = textwrap.dedent(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        add_key, request_key, keyctl = {calls}
        out = []
        # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 1), add_key("user", "x", "v", 1, @s)
        for nr, args in ((keyctl, (0, -3, 1)), (add_key, (b"user", b"x", b"v", 1, -3)),
                         (request_key, (b"user", b"x", None, 0))):
            ret = libc.syscall(nr, *args)
            out.append((ret, os.strerror(ctypes.get_errno())))
        print(out)
    """)
    keys_before = Path("/proc/keys").read_text().count("\n") if Path("/proc/keys").exists() else None
    result = run_python(code)
    assert result.ok, result.stderr
    assert result.stdout.strip() == str([(-1, "Operation not permitted")] * 3)
    if keys_before is not None:  # nothing new in the kernel's key list (as far as this namespace sees)
        assert Path("/proc/keys").read_text().count("\n") <= keys_before
    assert_host_fine()


def test_files_are_bounded_by_count_as_well_as_bytes():
    """Empty files cost no bytes but kernel memory: the tmpfs has an inode limit (on
    82d5798 650k empty files cost 642 MiB)."""
    code = textwrap.dedent("""
        import os
        made = 0
        try:
            for i in range(100_000):
                open(f"f{i}", "w").close()
                made += 1
        except OSError as e:
            print(made, e.strerror)
    """)
    result = run_python(code, limits=SandboxLimits(disk_files=500))
    assert result.ok, result.stderr
    made, reason = result.stdout.split(" ", 1)
    assert 450 <= int(made) <= 500 + 64 and reason.strip() == "No space left on device", result.stdout  # + the setup's
    with pytest.raises(ValueError, match="disk_files"):
        SandboxLimits(disk_files=0)
