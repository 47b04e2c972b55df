"""The tables of the job file that the host owns: ``[job]`` (its host keys) and
``[cluster]`` (the launcher and what every launcher places)."""

from __future__ import annotations

import attrs

from skyrl_host.options import ge, gt, gt_le, option


@attrs.frozen
class JobSection:
    """The keys of ``[job]`` that the host owns."""

    kind: str = option(help="the job kind to run (a registered job plugin)")
    seed: int = option(0, help="seed for every random choice of the job", validator=ge(0))
    steps: int = option(100, help="number of steps to run", validator=gt_le(0, 1 << 40))
    output_dir: str | None = option(None, help="folder for metrics, plots and checkpoints (default: runs/<name>)")
    name: str | None = option(None, help="run name (default: the job file's stem)")


@attrs.frozen
class ClusterSection:
    """The keys of ``[cluster]`` that the host owns: which launcher places the job's
    processes (a plugin; its own keys sit beside these), and how many of each it places."""

    launcher: str = option("local", help="the launcher placing the job's processes (a registered launcher plugin)")
    num_cpus: int | None = option(None, help="CPUs the job may use (default: all)", validator=gt(0))
    num_gpus: int | None = option(None, help="GPUs the job may use (default: all)", validator=ge(0))
    trainer_ranks: int = option(
        1, help="backend ranks, data parallel as [backend] says (a launcher that places processes)", validator=gt(0)
    )
    engine_replicas: int = option(
        1, help="engine replicas; a step's prompts are split between them (a launcher that places processes)",
        validator=gt(0),
    )


HOST_JOB_KEYS = tuple(f.name for f in attrs.fields(JobSection))
HOST_CLUSTER_KEYS = tuple(f.name for f in attrs.fields(ClusterSection))
