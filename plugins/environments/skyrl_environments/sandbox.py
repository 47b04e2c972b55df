"""The Python sandbox, for environment authors: run model-written code safely.

.. code-block:: python

    from skyrl_environments.sandbox import SandboxLimits, SandboxUnavailable, run_python

    result = run_python("print(6 * 7)", limits=SandboxLimits(wall_seconds=5, memory_bytes=256 * 2**20))
    result.stdout        # "42\\n"
    result.ok            # exit status 0 and not killed

``run_python(code, *, stdin="", limits=None) -> SandboxResult`` runs ``code`` as
``python -I -S -B main.py`` in a throwaway process tree and returns what it printed:
``stdout``, ``stderr`` (each cut at ``limits.output_bytes``: ``truncated``),
``exit_code`` (-N when signal N ended it, None when the sandbox killed it),
``timed_out``, ``killed_reason`` (None, ``"timeout"``, ``"cpu"``, ``"output"`` or
``"signal N"``), ``seconds``, and ``ok``. Threads may call it at once: every call has its
own processes, uid and folder. A run costs about 0.1 s of setup.

What it guarantees (each tested by code that tries to break it,
``plugins/environments/tests/test_sandbox.py``):

- the code's filesystem is a private tmpfs with only ``/usr``, the Python installation
  and a few ``/dev`` nodes bound in, read-only: none of the job's files exist for it;
- it writes only in ``/work`` (its cwd) and ``/tmp``, one tmpfs of
  ``limits.disk_bytes`` that is gone when the run ends;
- no network (its own network namespace, loopback down);
- ``wall_seconds`` and ``cpu_seconds`` (per process), ``memory_bytes`` (RLIMIT_AS per
  process), ``max_processes`` (counted for this run's own uid only) are enforced, and
  nothing it started outlives the run (its own PID namespace);
- it runs as a fresh unprivileged uid with ``no_new_privs``: no way back to root;
- it inherits none of the job's environment variables or file descriptors;
- it fails closed: where any step of the setup fails (not real root, namespaces
  refused), ``run_python`` raises :class:`SandboxUnavailable` and the code never runs.
  Try one run when your environment is made, and raise
  :class:`skyrl_host.errors.UserError` there, so such a machine stops the job at its
  start.

It is not a VM (the code runs on the host's kernel), only the standard library is
importable, and its limits are per process, not a cgroup: docs/environments.md, "The
Python sandbox", says what that means.

These names are the stable interface; ``skyrl_environments._sandbox`` is the
implementation and may change.
"""

from __future__ import annotations

from skyrl_environments._sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python"]
