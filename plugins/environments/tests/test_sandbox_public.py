"""skyrl_environments.sandbox: the sandbox's public names, as an environment author uses them."""

from __future__ import annotations

import skyrl_environments._sandbox as implementation
import skyrl_environments.sandbox as sandbox
from skyrl_environments.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python


def test_the_public_names_are_the_implementations():
    assert sandbox.__all__ == ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]
    assert run_python is implementation.run_python and SandboxUnavailable is implementation.SandboxUnavailable
    assert "guarantees" in sandbox.__doc__


def test_code_runs_and_a_limit_stops_it():
    result = run_python("import sys; print(6 * 7); print(sys.stdin.read().upper())", stdin="hi")
    assert isinstance(result, SandboxResult)
    assert (result.stdout, result.exit_code, result.ok, result.killed_reason) == ("42\nHI\n", 0, True, None)
    slow = run_python("while True: pass", limits=SandboxLimits(wall_seconds=1.0, cpu_seconds=30))
    assert slow.timed_out and slow.killed_reason == "timeout" and not slow.ok and slow.exit_code is None
    assert 1.0 <= slow.seconds < 5.0
    hungry = run_python("x = bytearray(1024 * 2**20)", limits=SandboxLimits(memory_bytes=256 * 2**20))
    assert hungry.exit_code == 1 and "MemoryError" in hungry.stderr
