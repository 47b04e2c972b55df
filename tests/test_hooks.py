"""One test per hook (``test_hook_<hook name>``), and the meta-tests that keep it so:
every hook in hookspecs.py has a test here and a heading in docs/hooks.md."""

from __future__ import annotations

import json
import pathlib
import textwrap

import attrs
import click
import pytest

from skyrl_host import hookimpl, hookspecs
from skyrl_host.config import SLOTS, load_job
from skyrl_host.contracts import members
from skyrl_host.errors import UserError
from skyrl_host.interfaces import Engine, Launcher
from skyrl_host.kinds import KINDS
from skyrl_host.options import gt, option
from skyrl_host.runner import run_job

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("skyrl_") and callable(getattr(hookspecs, n)))


@attrs.frozen
class LevelConfig:
    level: int = option(1, help="a level", validator=gt(0))


class Driver:
    """A job kind that reports ``steps`` steps with one metric."""

    def __init__(self, run):
        self.run_ = run

    def run(self) -> None:
        for step in range(1, self.run_.total_steps + 1):
            self.run_.report(step, {"square": step * step, "level": self.run_.spec.kind_config.level})


def _register_job(register, name="counting", slots=None):
    register(name, Driver, config=LevelConfig, description="reports squares", slots=slots or {})


def conforming(protocol: type, **values: object) -> object:
    """An object with every member ``protocol`` declares (methods that do nothing)."""
    attrs_ = {name: (lambda *a, **k: None) for name in members(protocol)}
    attrs_.update(values)
    return type(f"Fake{protocol.__name__}", (), attrs_)()


def _check_registration(host, tmp_path, kind_key: str) -> None:
    """Register "thing" of ``kind_key``; select it from a job file; call its factory."""
    calls = []
    kind = KINDS[kind_key]

    def factory(config, *args, **kwargs):
        calls.append(config)
        return conforming(kind.protocol, config=config)

    class Plugin:
        pass

    def register_thing(register):
        register("thing", factory, config=LevelConfig, description=f"a {kind.noun}")

    setattr(Plugin, kind.hook, staticmethod(hookimpl(register_thing)))
    host.add_plugin(Plugin(), "thing_plugin")
    table = next(t for t, s in SLOTS.items() if s.kind == kind_key)

    class JobPlugin:
        @hookimpl
        def skyrl_register_jobs(self, register):
            _register_job(register, "uses_it", {table: None})

    host.add_plugin(JobPlugin(), "job_plugin")
    slot = SLOTS[table]
    if slot.many:
        body = f'[{table}]\n{slot.selector} = ["thing"]\n[{table}.thing]\nlevel = 3\n'
    else:
        body = f'[{table}]\n{slot.selector} = "thing"\nlevel = 3\n'
    job = tmp_path / "job.toml"
    job.write_text('[job]\nkind = "uses_it"\n' + body)
    spec = load_job(job, host)
    choice = spec.plugins[table][0] if slot.many else spec.plugins[table]
    assert choice.registration.origin.plugin == "thing_plugin"
    assert choice.create().config == LevelConfig(level=3)
    assert calls == [LevelConfig(level=3)]


def test_hook_skyrl_register_models(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "models")


def test_hook_skyrl_register_algorithms(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "algorithms")


def test_hook_skyrl_register_replay_strategies(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "replay_strategies")


def test_hook_skyrl_register_precisions(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "precisions")


def test_hook_skyrl_register_weight_transports(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "weight_transports")


def test_hook_skyrl_register_samplers(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "samplers")


def test_hook_skyrl_register_datasets(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "datasets")


def test_hook_skyrl_register_environments(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "environments")


def test_hook_skyrl_register_rewards(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "rewards")


def test_hook_skyrl_register_data_strategies(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "data_strategies")


def test_hook_skyrl_register_engines(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "engines")


def test_hook_skyrl_register_backends(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "backends")


def test_hook_skyrl_register_corpus_readers(skyrl_empty_host, tmp_path) -> None:
    _check_registration(skyrl_empty_host, tmp_path, "corpus_readers")


def test_hook_skyrl_register_observers(skyrl_empty_host, tmp_path) -> None:
    """An observer is listed in [observers] use (a host table, for every job kind), its
    keys in [observers.NAME]; made once per run with its config; told of the start, each
    step and the end, in order; ended even when the job fails, without hiding its error."""
    told = []

    class Tally:
        def __init__(self, config):
            self.level = config.level

        def started(self, run):
            told.append(("started", self.level, run.resume_step))

        def step_finished(self, run, step, metrics):
            told.append((step, metrics["square"]))

        def finished(self, run, status, error):
            told.append(("finished", status, type(error).__name__ if error else None))
            raise OSError("the dashboard is gone")  # never hides the job's own error

    class Broken:
        def __init__(self):
            self.run_ = None

        def run(self):
            raise RuntimeError("the job's own error")

    class Plugin:
        @hookimpl
        def skyrl_register_observers(self, register):
            register("tally", Tally, config=LevelConfig, description="tallies steps")

        @hookimpl
        def skyrl_register_jobs(self, register):
            _register_job(register, "uses_it", {})
            register("broken", lambda run: Broken(), description="fails")

    skyrl_empty_host.add_plugin(Plugin(), "tally_plugin")
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "uses_it"\nsteps = 2\noutput_dir = "{tmp_path / "a"}"\n'
                   '[observers]\nuse = ["tally"]\n[observers.tally]\nlevel = 3\n')
    spec = load_job(job, skyrl_empty_host)
    assert [c.name for c in spec.plugins["observers"]] == ["tally"]
    with pytest.raises(OSError, match="the dashboard is gone"):  # a completed job whose observer failed to end
        run_job(skyrl_empty_host, spec)
    assert told == [("started", 3, 0), (1, 1), (2, 4), ("finished", "completed", None)]

    told.clear()
    job.write_text(job.read_text().replace('"uses_it"', '"broken"').replace('/a"', '/b"'))
    with pytest.raises(RuntimeError, match="the job's own error"):
        run_job(skyrl_empty_host, load_job(job, skyrl_empty_host))
    assert told == [("started", 3, 0), ("finished", "failed", "RuntimeError")]

    job.write_text(job.read_text().replace("level = 3", "level = 0"))
    with pytest.raises(UserError, match=r"job.toml:8: observers.tally.level: "):
        load_job(job, skyrl_empty_host)


def test_hook_skyrl_register_launchers(skyrl_empty_host, tmp_path) -> None:
    """A launcher is selected by [cluster] launcher (a host table: no job kind lists it),
    its own keys beside the host's; its factory gets (config, cluster)."""
    made = []

    class Plugin:
        @hookimpl
        def skyrl_register_launchers(self, register):
            def factory(config, cluster):
                made.append((config, cluster.trainer_ranks))
                return conforming(Launcher, config=config)

            register("thing", factory, config=LevelConfig, description="a launcher")

        @hookimpl
        def skyrl_register_jobs(self, register):
            _register_job(register, "uses_it", {})

    skyrl_empty_host.add_plugin(Plugin(), "thing_plugin")
    job = tmp_path / "job.toml"
    job.write_text('[job]\nkind = "uses_it"\n[cluster]\nlauncher = "thing"\ntrainer_ranks = 3\nlevel = 2\n')
    spec = load_job(job, skyrl_empty_host)
    assert spec.launcher.registration.origin.plugin == "thing_plugin"
    assert spec.cluster.trainer_ranks == 3
    assert spec.launcher.create(spec.cluster).config == LevelConfig(level=2)
    assert made == [(LevelConfig(level=2), 3)]
    job.write_text('[job]\nkind = "uses_it"\n[cluster]\nlauncher = "thing"\nlevle = 2\n')
    with pytest.raises(UserError, match=r"job.toml:5: cluster.levle: unknown key \(did you mean 'level'\?\)"):
        load_job(job, skyrl_empty_host)


def test_a_product_lacking_its_kind_protocol_is_a_user_error(skyrl_empty_host, tmp_path) -> None:
    """The host checks every factory's product against its kind's Protocol when it is made."""

    class Plugin:
        @hookimpl
        def skyrl_register_engines(self, register):
            register("half", lambda config: conforming(Engine, generate=None), description="an engine")

        @hookimpl
        def skyrl_register_jobs(self, register):
            _register_job(register, "uses_it", {"engine": "half"})

    skyrl_empty_host.add_plugin(Plugin(), "half_plugin")
    job = tmp_path / "job.toml"
    job.write_text('[job]\nkind = "uses_it"\n')
    spec = load_job(job, skyrl_empty_host)
    with pytest.raises(UserError) as info:
        spec.plugins["engine"].create()
    assert str(info.value) == (
        "error: engine 'half' (plugin 'half_plugin') does not implement Engine: its factory returned FakeEngine, "
        "which lacks generate"
    )


def test_hook_skyrl_register_jobs(skyrl_cli, skyrl_plugin, tmp_path) -> None:
    class JobPlugin:
        @hookimpl
        def skyrl_register_jobs(self, register):
            _register_job(register)

    skyrl_plugin(JobPlugin(), "counting_plugin")
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "counting"\nsteps = 4\nlevel = 2\noutput_dir = "{tmp_path / "out"}"\n')
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 0, result.stderr
    assert "counting job 'job' completed 4 step(s)" in result.stderr
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["square"], r["level"]) for r in lines if "step" in r] == [(1, 1, 2), (2, 4, 2), (3, 9, 2), (4, 16, 2)]
    record = json.loads((tmp_path / "out" / "job.json").read_text())
    assert record["kind"] == {
        "name": "counting", "plugin": "counting_plugin", "distribution": None, "version": None, "config": {"level": 2}
    }


def test_hook_skyrl_register_commands(skyrl_cli, skyrl_plugin) -> None:
    class Commands:
        @hookimpl
        def skyrl_register_commands(self, cli):
            @cli.command()
            @click.argument("who")
            def greet(who):
                """Say hello."""
                click.echo(f"hello {who}")

    class Broken:
        @hookimpl
        def skyrl_register_commands(self, cli):
            @cli.command()
            def half():
                """Added before the failure."""

            raise RuntimeError("cannot add commands")

    class Hijack:
        @hookimpl
        def skyrl_register_commands(self, cli):
            @cli.command(name="run")
            def run():
                """Replace the built-in run."""

    skyrl_plugin(Commands(), "greeter")
    broken = skyrl_plugin(Broken(), "broken_commands")
    hijack = skyrl_plugin(Hijack(), "hijack")
    assert skyrl_cli("greet", "world").stdout == "hello world\n"
    helptext = skyrl_cli("--help").stdout
    assert "greet" in helptext and "Say hello." in helptext and "half" not in helptext
    assert broken.status == "failed" and broken.error == "skyrl_register_commands raised RuntimeError: cannot add commands"
    assert hijack.status == "failed" and "command 'run' already exists" in hijack.error
    assert "Validate JOB_FILE, resolve its plugins and run its job kind." in skyrl_cli("run", "--help").stdout


class Recorder:
    """An observer that records every lifecycle call."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def skyrl_job_started(self, run):
        self.calls.append(("started", run.total_steps, (run.output_dir / "job.json").exists()))

    @hookimpl
    def skyrl_step_finished(self, run, step, metrics):
        self.calls.append(("step", step, dict(metrics)))

    @hookimpl
    def skyrl_job_finished(self, run, status, error):
        self.calls.append(("finished", status, type(error).__name__ if error else None))


def _job(host, tmp_path, steps=3, driver=Driver):
    class JobPlugin:
        @hookimpl
        def skyrl_register_jobs(self, register):
            register("counting", driver, config=LevelConfig, description="test job")

    host.add_plugin(JobPlugin(), "counting_plugin")
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nkind = "counting"\nsteps = {steps}\noutput_dir = "{tmp_path / "out"}"\n')
    return load_job(job, host)


def test_hook_skyrl_job_started(skyrl_empty_host, tmp_path) -> None:
    rec = Recorder()
    skyrl_empty_host.add_plugin(rec, "recorder")
    run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path, steps=2))
    assert rec.calls[0] == ("started", 2, True)


def test_hook_skyrl_step_finished(skyrl_empty_host, tmp_path) -> None:
    rec = Recorder()
    skyrl_empty_host.add_plugin(rec, "recorder")
    run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path, steps=3))
    steps = [c for c in rec.calls if c[0] == "step"]
    assert steps == [("step", s, {"square": s * s, "level": 1}) for s in (1, 2, 3)]


def test_hook_skyrl_job_finished(skyrl_empty_host, tmp_path) -> None:
    rec = Recorder()
    skyrl_empty_host.add_plugin(rec, "recorder")
    run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path, steps=1))
    assert rec.calls[-1] == ("finished", "completed", None)


@pytest.mark.parametrize("exc, status", [(RuntimeError("driver fault"), "failed"), (KeyboardInterrupt(), "interrupted")])
def test_job_finished_fires_when_the_driver_raises(skyrl_empty_host, tmp_path, exc, status) -> None:
    class Failing(Driver):
        def run(self):
            self.run_.report(1, {"x": 1.0})
            raise exc

    rec = Recorder()
    skyrl_empty_host.add_plugin(rec, "recorder")
    spec = _job(skyrl_empty_host, tmp_path, driver=Failing)
    with pytest.raises(type(exc)):
        run_job(skyrl_empty_host, spec)
    assert [c[0] for c in rec.calls] == ["started", "step", "finished"]
    assert rec.calls[-1] == ("finished", status, type(exc).__name__)


def test_lifecycle_order_is_pinned(skyrl_empty_host, tmp_path) -> None:
    rec = Recorder()
    skyrl_empty_host.add_plugin(rec, "recorder")
    run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path, steps=3))
    assert [c[:2] for c in rec.calls] == [
        ("started", 3), ("step", 1), ("step", 2), ("step", 3), ("finished", "completed")
    ]


def test_metrics_must_be_numbers_and_steps_increase(skyrl_empty_host, tmp_path) -> None:
    class BadMetrics(Driver):
        def run(self):
            self.run_.report(1, {"loss": "low"})

    class Backwards(Driver):
        def run(self):
            self.run_.report(2, {})
            self.run_.report(2, {})

    with pytest.raises(TypeError, match="metric 'loss' must map a name to a number, got 'low'"):
        run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path, driver=BadMetrics))
    skyrl_empty_host.remove_plugin("counting_plugin")
    with pytest.raises(ValueError, match="step 2 reported after step 2"):
        run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path, driver=Backwards), overwrite=True)


def test_every_hook_has_a_test() -> None:
    missing = [h for h in HOOKS if f"test_hook_{h}" not in globals()]
    assert HOOKS and not missing, f"hooks without a test_hook_<name> test: {missing}"


def test_every_hook_is_documented() -> None:
    doc = (ROOT / "docs" / "hooks.md").read_text()
    headings = [line for line in doc.splitlines() if line.startswith("###")]
    missing = [h for h in HOOKS if not any(f"`{h}" in line for line in headings)]
    assert not missing, f"hooks missing from docs/hooks.md: {missing}"


def test_every_hook_docstring_states_its_contract() -> None:
    for name in HOOKS:
        doc = textwrap.dedent(getattr(hookspecs, name).__doc__ or "")
        assert len(doc.split()) >= 12, f"{name} needs a docstring saying when it fires, args, returns"


def test_job_finished_fires_when_an_observer_fails_to_start(skyrl_empty_host, tmp_path) -> None:
    class BadStart:
        @hookimpl
        def skyrl_job_started(self, run):
            raise OSError("cannot open the dashboard")

    rec = Recorder()
    skyrl_empty_host.add_plugin(rec, "recorder")
    skyrl_empty_host.add_plugin(BadStart(), "bad_start")  # newest first: it fires before the recorder
    with pytest.raises(OSError):
        run_job(skyrl_empty_host, _job(skyrl_empty_host, tmp_path))
    assert rec.calls == [("finished", "failed", "OSError")]
