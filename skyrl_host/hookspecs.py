"""Every hook of skyrl-host, in one place.

Hooks come in three phases, and each docstring says when the hook fires, what it
receives, what it returns and how the results of several plugins combine.

A plugin implements a hook by defining a function of the same name decorated with
:data:`hookimpl` (``from skyrl_host import hookimpl``). It may accept any subset of
the arguments listed in the specification. A function whose name starts with
``skyrl_`` but matches no hook below is an error that names its plugin.

Registration hooks only register: they must not import heavy modules (torch,
transformers, ray, vllm, nixl, megatron) at call time or at import time of the
plugin module. Factories import what they need when they are called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import pluggy

from skyrl_host.kinds import KINDS, Kind

if TYPE_CHECKING:  # pragma: no cover - typing only
    import click

    from skyrl_host.registry import Register
    from skyrl_host.runner import Run

PROJECT = "skyrl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------
# Registration: called once per host, right after the plugins are loaded.
#
# Each registration hook receives ``register``, a callable bound to the calling
# plugin so the host records which plugin and distribution every name came from:
#
#     register(name, factory, *, config=None, description, override=False, check=None,
#              claims=None, traits=None)
#
# ``factory`` is called by the host when a job selects ``name``; ``config`` is an
# attrs class that validates the plugin's table of the job file (None: the table
# takes no keys besides the selector). Registering a name twice within one kind is
# an error naming both plugins, unless exactly one of them passes override=True.
# The host calls every implementation; return values are ignored. If an
# implementation raises, the plugin is listed as failed and taken back whole:
# none of its registrations (from any hook) are kept and its other hooks no
# longer fire, so a plugin never half-applies.
# ---------------------------------------------------------------------------


def _registration_hook(kind: Kind) -> Any:
    """The registration hook of ``kind``, made from its row of the kind table."""

    def spec(register: Register) -> None:
        pass

    spec.__name__ = spec.__qualname__ = kind.hook
    selects = f"[{kind.table}] {kind.selector} = " + ("[NAME, ...]" if kind.many else "NAME")
    spec.__doc__ = (
        f"Register {kind.noun} plugins (``{selects}``): {kind.description}.\n\n"
        f"    {kind.details + ' ' if kind.details else ''}The factory is called as ``{kind.factory_call}`` and "
        f"returns a :class:`skyrl_host.interfaces.{kind.protocol.__name__}`.\n"
    )
    return hookspec(spec)


# One registration hook per row of the kind table (skyrl_register_models, ...).
for _kind in KINDS.values():
    globals()[_kind.hook] = _registration_hook(_kind)
del _kind


@hookspec
def skyrl_register_commands(cli: click.Group) -> None:
    """Add sub-commands to the ``skyrl`` command line.

    Called once when the CLI is built, after the built-in commands exist.
    ``cli`` is the top-level :class:`click.Group`; add commands with
    ``@cli.command()``. A plugin whose implementation raises is listed as
    failed and the CLI still starts. Return values are ignored.
    """


# ---------------------------------------------------------------------------
# Lifecycle: fired by the host around ``skyrl run``, for observers (metrics
# writers, progress bars, plots, early stopping). Every implementation is called
# (newest registered first); return values are ignored. An observer that raises
# stops the job: the host still fires ``skyrl_job_finished`` with the error.
# ---------------------------------------------------------------------------


@hookspec
def skyrl_job_started(run: Run) -> None:
    """The job's plugins are resolved and its output folder exists; the driver
    has not started yet. If an implementation raises, the job does not start
    and ``skyrl_job_finished`` fires with status ``"failed"``.

    ``run`` carries the validated job (``run.job``), the output folder
    (``run.output_dir``), the planned number of steps (``run.total_steps``) and a
    per-plugin scratch dictionary (``run.scratch``) where observers keep state.
    """


@hookspec
def skyrl_step_finished(run: Run, step: int, metrics: Mapping[str, Any]) -> None:
    """The driver finished step ``step`` (counting from 1) and measured ``metrics``
    (a flat mapping of metric name to number). Fired once per step, in order.
    """


@hookspec
def skyrl_job_finished(run: Run, status: str, error: BaseException | None) -> None:
    """The job ended. ``status`` is ``"completed"``, ``"failed"`` or
    ``"interrupted"``; ``error`` is the exception that ended a failed or
    interrupted job, else None. Fired exactly once for every fired
    ``skyrl_job_started``, also when the driver raised.
    """
