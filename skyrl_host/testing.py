"""A pytest plugin for plugin authors (loaded through the ``pytest11`` entry point).

Fixtures:

``skyrl_host``
    A new :class:`~skyrl_host.plugins.PluginHost` with the installed plugins loaded,
    as ``skyrl`` would load them. Every test gets its own.
``skyrl_empty_host``
    A new host with no plugins at all.
``skyrl_plugin``
    ``skyrl_plugin(obj, name=None)`` registers a plugin object (module, class or
    instance) on ``skyrl_host`` for the current test only and returns its record.
``skyrl_cli``
    ``skyrl_cli(*args)`` runs the ``skyrl`` command line in-process against
    ``skyrl_host`` and returns a :class:`CliResult` (exit code, stdout, stderr).
``skyrl_ray``
    A local Ray cluster (2 CPUs, no dashboard) for the test module, its files in a short
    folder of its own.
``skyrl_tiny_rl_job``
    ``skyrl_tiny_rl_job(directory, name="job", **sections)`` writes the tiny RL job file
    (:data:`TINY_RL_JOB`, each ``[section]`` given as a keyword merged into it) and
    returns a :class:`TinyJob` (its path, its output folder, its step rows): the same
    function as :func:`tiny_rl_job`, session-scoped so fixtures of any scope can use it.

Helpers (plain functions, importable from here):

:func:`step_rows`
    The step rows of a run's ``metrics.jsonl``.
:func:`learning_metrics`
    A metrics row without its timings (:func:`is_timing_metric`) and, by default, without
    the weight transport's own ``sync_*`` metrics: what two runs of one job must agree on.
:func:`run_gloo_ranks`
    Runs a function in N fresh processes joined in one gloo process group and returns
    what each rank returned.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping

import attrs
import pytest

from skyrl_host.plugins import PluginHost, PluginRecord, build_host

_counter = itertools.count()


@attrs.frozen
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def skyrl_host() -> Iterator[PluginHost]:
    """A new plugin host with the installed plugins loaded, as `skyrl` loads them."""
    yield build_host()


@pytest.fixture
def skyrl_empty_host() -> Iterator[PluginHost]:
    """A new plugin host with no plugins at all."""
    yield build_host(entry_points=False)


@pytest.fixture
def skyrl_plugin(skyrl_host: PluginHost) -> Iterator[Callable[..., PluginRecord]]:
    """``skyrl_plugin(obj, name=None)``: register a plugin object on ``skyrl_host``
    for this test only; returns its record."""
    added: list[str] = []

    def register(obj: Any, name: str | None = None) -> PluginRecord:
        name = name or f"test-plugin-{next(_counter)}"
        record = skyrl_host.add_plugin(obj, name)
        added.append(name)
        return record

    yield register
    for name in added:
        skyrl_host.remove_plugin(name)


@pytest.fixture
def skyrl_cli(skyrl_host: PluginHost, capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """``skyrl_cli(*args)``: run the `skyrl` CLI in-process against ``skyrl_host``;
    returns a CliResult(exit_code, stdout, stderr)."""
    from skyrl_host.cli import main

    def invoke(*args: str) -> CliResult:
        capsys.readouterr()
        code = main(list(args), host=skyrl_host)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return invoke


@pytest.fixture(scope="module")
def skyrl_ray() -> Iterator[None]:
    """A local Ray cluster for the test module (2 CPUs, no dashboard, no auth token), shut
    down after it. Its files go to a folder of its own directly under the system's
    temporary folder, removed after: Ray's socket paths under it must fit AF_UNIX's 107
    bytes, and pytest's temporary folders are deep (deeper still under pytest-xdist)."""
    import shutil
    import tempfile

    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    folder = tempfile.mkdtemp(prefix="ray")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=folder, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def skyrl_no_ambient_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """No AWS credentials or settings from the environment, the shared files or the EC2
    metadata address for this test: S3 access uses only what the job gives."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


# -- the tiny RL job ---------------------------------------------------------------------

#: The tiny RL job most end-to-end tests run: a few steps of the qwen "tiny" preset on
#: reverse_digits, an embedded engine, the torch backend. ``job.output_dir`` is set by
#: :func:`tiny_rl_job`. There is no ``[weight_sync]`` (the job's default) unless given.
TINY_RL_JOB: Mapping[str, Mapping[str, Any]] = {
    "job": {"kind": "rl", "seed": 3, "steps": 3, "batch_size": 8, "n_samples": 4, "max_new_tokens": 6,
            "checkpoint_every": 0, "save_final": False, "threads": 1},
    "model": {"family": "qwen", "preset": "tiny"},
    "dataset": {"name": "reverse_digits", "min_len": 3, "max_len": 4, "prefix": ""},
    "engine": {"name": "embedded", "dtype": "auto"},
    "backend": {"name": "torch", "lr": 5e-4},
}

_SECTION_ORDER = ("job", "cluster", "model", "dataset", "algorithm", "engine", "precision", "weight_sync", "backend")


@attrs.frozen
class TinyJob:
    """A job file written by :func:`tiny_rl_job`: ``path`` (the TOML file) and ``out``
    (its ``job.output_dir``)."""

    path: pathlib.Path
    out: pathlib.Path

    def rows(self) -> list[dict[str, Any]]:
        """The step rows of the run's metrics.jsonl (see :func:`step_rows`)."""
        return step_rows(self.out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value))  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {type(value).__name__}: {value!r}")


def tiny_rl_job(directory: str | os.PathLike[str], name: str = "job", **sections: Mapping[str, Any] | None) -> TinyJob:
    """Write ``directory/<name>.toml``: :data:`TINY_RL_JOB` with each keyword a
    ``[section]`` merged into it key by key (a key set to None is left out; a section set
    to None is left out whole; sections in the order job, cluster, model, dataset, algorithm, engine, precision,
    weight_sync, backend, then any others in keyword order).
    ``job.output_dir`` is ``directory/<name>`` unless given. Returns the :class:`TinyJob`."""
    directory = pathlib.Path(directory)
    merged: dict[str, dict[str, Any]] = {k: dict(v) for k, v in TINY_RL_JOB.items()}
    merged["job"]["output_dir"] = directory / name
    for section, overrides in sections.items():
        if overrides is None:
            merged.pop(section, None)
            continue
        merged.setdefault(section, {}).update(overrides)
    order = {name: i for i, name in enumerate(_SECTION_ORDER)}
    lines: list[str] = []
    for section, table in sorted(merged.items(), key=lambda item: order.get(item[0], len(order))):
        lines += [f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None] + [""]
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines))
    out = merged.get("job", {}).get("output_dir")
    return TinyJob(path, pathlib.Path(out) if out is not None else directory / name)


@pytest.fixture(scope="session")
def skyrl_tiny_rl_job() -> Callable[..., TinyJob]:
    """``skyrl_tiny_rl_job(directory, name="job", **sections)``: write the tiny RL job
    file with sections overridden (see :func:`tiny_rl_job`); returns a TinyJob."""
    return tiny_rl_job


def step_rows(out: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The step rows (not the start and end events) of ``out/metrics.jsonl``; of a running
    job, the lines written whole so far."""
    from skyrl_host.observers.metrics_jsonl import read_metrics

    return read_metrics(pathlib.Path(out) / "metrics.jsonl")


#: Metrics that measure the clock, not what was learned.
TIMING_METRICS = frozenset({"time", "step_time", "step_time_s", "data_time_s", "tokens_per_s", "gen_tokens_per_s",
                            "train_tokens_per_s", "engine_idle_fraction"})
_TIMING_SUFFIXES = ("_time", "_time_s", "_seconds", "_tokens_per_s")


def is_timing_metric(name: str) -> bool:
    """Whether a metric measures time (a timestamp, a duration or a rate): the names in
    :data:`TIMING_METRICS` and those ending in _time, _time_s, _seconds or _tokens_per_s."""
    return name in TIMING_METRICS or name.endswith(_TIMING_SUFFIXES)


def learning_metrics(row: Mapping[str, Any], *, transport: bool = False) -> dict[str, Any]:
    """``row`` without its timing metrics and (unless ``transport``) the weight
    transport's own ``sync_*`` metrics: what two runs of one job, with another launcher or
    transport, must agree on."""
    return {k: v for k, v in row.items() if not is_timing_metric(k) and (transport or not k.startswith("sync_"))}


# -- processes in one gloo group -------------------------------------------------------------

_RANK_MAIN = r"""
import datetime, importlib.util, os, sys, traceback

path, function, rank, world, store, out, group_timeout, barrier = sys.argv[1:9]
args = sys.argv[9:]
rank, world = int(rank), int(world)
try:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(group_timeout)))
    result = getattr(module, function)(rank, world, *args)
    from skyrl_host.statefile import save_state
    save_state(result, out)
    if barrier == "1":
        dist.barrier()
        dist.destroy_process_group()
except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # not the interpreter's exit: it can abort after destroy_process_group
"""


def run_gloo_ranks(path: str | os.PathLike[str], function: str, world: int = 2, *args: str, timeout: float = 150,
                   group_timeout: float = 60, barrier: bool = True) -> list[Any]:
    """Run ``function(rank, world, *args)`` from the Python file ``path`` in ``world``
    fresh processes (one torch thread each) joined in one gloo process group (a file
    store), and return what each rank returned, in rank order (a state file,
    :mod:`skyrl_host.statefile`: plain values, tensors, arrays and rollout batches).

    After the function returns, each rank waits for the others (``barrier``) and leaves
    the group; with ``barrier=False`` it exits at once (for a test in which a rank dies on
    purpose). A rank that exits 0 without returning (``os._exit``) gives None. A rank that
    raises, exits otherwise, or any rank still running after ``timeout`` seconds fails the
    test with every rank's output; all the ranks are gone when this returns."""
    path = os.path.abspath(os.fspath(path))
    with tempfile.TemporaryDirectory(prefix="skyrl-gloo-") as d:
        logs = [open(os.path.join(d, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [
            subprocess.Popen([sys.executable, "-c", _RANK_MAIN, path, function, str(r), str(world),
                              os.path.join(d, "store"), os.path.join(d, f"rank{r}.state"), str(group_timeout),
                              "1" if barrier else "0", *args], stdout=logs[r], stderr=subprocess.STDOUT)
            for r in range(world)
        ]
        try:
            deadline = time.monotonic() + timeout
            failed = None
            while any(p.poll() is None for p in procs):
                failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            else:
                failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        output = []
        for r, log in enumerate(logs):
            log.seek(0)
            output.append(f"--- rank {r} (exit {procs[r].returncode})\n{log.read()[-3000:]}")
            log.close()
        if failed is not None or any(p.returncode != 0 for p in procs):
            why = f"rank {failed} failed" if failed is not None else f"the ranks ran past {timeout:g} s"
            pytest.fail(f"{why}:\n" + "\n".join(output), pytrace=False)
        from skyrl_host.statefile import load_state

        return [load_state(os.path.join(d, f"rank{r}.state"))
                if os.path.exists(os.path.join(d, f"rank{r}.state")) else None for r in range(world)]
