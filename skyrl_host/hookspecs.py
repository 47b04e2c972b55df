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
#     register(name, factory, *, config=None, description, override=False)
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


@hookspec
def skyrl_register_models(register: Register) -> None:
    """Register model families (``[model] family = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.ModelFamily`.
    """


@hookspec
def skyrl_register_algorithms(register: Register) -> None:
    """Register RL algorithms (``[algorithm] name = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.Algorithm`.
    """


@hookspec
def skyrl_register_replay_strategies(register: Register) -> None:
    """Register replay strategies (``[replay] strategies = [NAME, ...]``).

    Each strategy's keys live in the sub-table ``[replay.NAME]``. The factory is
    called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.ReplayStrategy`.
    """


@hookspec
def skyrl_register_precisions(register: Register) -> None:
    """Register numeric precisions (``[precision] name = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.Precision`.
    """


@hookspec
def skyrl_register_weight_transports(register: Register) -> None:
    """Register weight-sync transports (``[weight_sync] transport = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.WeightTransport`.
    """


@hookspec
def skyrl_register_samplers(register: Register) -> None:
    """Register token samplers (``[sampler] name = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.Sampler`.
    """


@hookspec
def skyrl_register_datasets(register: Register) -> None:
    """Register datasets and verifiable tasks (``[dataset] name = NAME``).

    The factory is called as ``factory(config, seed=SEED)`` and returns a
    :class:`skyrl_host.interfaces.Dataset`.
    """


@hookspec
def skyrl_register_data_strategies(register: Register) -> None:
    """Register data sampling strategies (``[data] strategy = NAME``): the order in
    which an SFT job reads the documents of its pretokenized datasets.

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.DataStrategy`; the driver binds it to the
    datasets' document lengths and the job's seed, then draws one document at a
    time and checkpoints its ``state_dict``.
    """


@hookspec
def skyrl_register_corpus_readers(register: Register) -> None:
    """Register corpus readers (``[corpus] reader = NAME``): what opens an SFT job's
    pretokenized corpora (``[job] data_paths``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.CorpusReader`, whose ``open(path, ...)`` gives a
    :class:`skyrl_host.interfaces.Corpus`.
    """


@hookspec
def skyrl_register_environments(register: Register) -> None:
    """Register multi-turn and tool-using environments (``[environment] name = NAME``).

    The factory is called as ``factory(config, dataset=DATASET, seed=SEED)`` (the job's
    :class:`skyrl_host.interfaces.Dataset`, whose ``reward`` an environment may use to
    score final answers, and the job's seed) and returns a
    :class:`skyrl_host.interfaces.Environment`, which makes one
    :class:`skyrl_host.interfaces.Episode` per trajectory. An ``rl`` job without an
    ``[environment]`` table is single-turn: one response per prompt, scored by the
    dataset.
    """


@hookspec
def skyrl_register_engines(register: Register) -> None:
    """Register inference engines (``[engine] name = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.Engine`.
    """


@hookspec
def skyrl_register_backends(register: Register) -> None:
    """Register training backends (``[backend] name = NAME``).

    The factory is called as ``factory(config)`` and returns a
    :class:`skyrl_host.interfaces.Backend`.
    """


@hookspec
def skyrl_register_launchers(register: Register) -> None:
    """Register launchers (``[cluster] launcher = NAME``): what places a job's backend
    ranks and engine replicas (one process, Ray actors, ...).

    The factory is called as ``factory(config, cluster)`` (``cluster``: the host's
    :class:`skyrl_host.sections.ClusterSection`, with ``trainer_ranks`` and
    ``engine_replicas``) and returns a :class:`skyrl_host.interfaces.Launcher`. Its
    own keys sit in ``[cluster]`` beside the host's.
    """


@hookspec
def skyrl_register_jobs(register: Register) -> None:
    """Register job kinds (``[job] kind = NAME``): the drivers ``skyrl run`` runs.

    Besides the common arguments, ``register`` takes ``slots``: a mapping from
    the plugin tables the job uses (``"dataset"``, ``"model"``, ...) to ``None``
    when the table is required, or to the name of the plugin to use when the
    table is absent. A job file may only contain the tables its kind uses. The
    ``config`` class validates the keys of ``[job]`` other than the ones the host
    owns (kind, seed, steps, output_dir). The factory is called as
    ``factory(run)`` with a :class:`skyrl_host.runner.Run` and returns a
    :class:`skyrl_host.interfaces.JobDriver`.
    """


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
