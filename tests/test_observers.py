"""The built-in observers as a user meets them: metrics.jsonl, the plot, TensorBoard."""

from __future__ import annotations

import json
import struct

import pytest

from skyrl_host import hookimpl


class Squares:
    def __init__(self, run):
        self.run_ = run

    def run(self):
        self.run_.headline = ["square"]
        for step in range(1, self.run_.total_steps + 1):
            self.run_.report(step, {"square": float(step * step), "half": step / 2})


class JobPlugin:
    @hookimpl
    def skyrl_register_jobs(self, register):
        register("squares", Squares, description="reports squares")


def read_events(folder):
    """Scalars from TensorBoard event files (TFRecord framing, Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.append((event.step, v.tag, round(v.simple_value, 4)))
    return out


@pytest.fixture
def job(skyrl_plugin, tmp_path):
    skyrl_plugin(JobPlugin(), "squares_plugin")
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nkind = "squares"\nsteps = 12\noutput_dir = "{tmp_path / "out"}"\n')
    return path


def test_metrics_jsonl_and_plot(skyrl_cli, job, tmp_path) -> None:
    assert skyrl_cli("run", str(job)).exit_code == 0
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["event"] == "start" and rows[-1] == {**rows[-1], "event": "end", "status": "completed", "last_step": 12}
    assert [r["square"] for r in rows[1:-1]] == [float(s * s) for s in range(1, 13)]
    png = (tmp_path / "out" / "plot.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


@pytest.mark.parametrize("ask", ['observers.use=["tensorboard"]', "job.tensorboard=true"])
def test_tensorboard_when_asked(ask, skyrl_cli, job, tmp_path) -> None:
    """Listed in [observers], or with the [job] key it had before (a notice says where it moved)."""
    result = skyrl_cli("run", str(job), "--set", ask)
    assert result.exit_code == 0, result.stderr
    moved = "notice: --set job.tensorboard=true: [job] tensorboard is deprecated; write [observers] use = [\"tensorboard\"]"
    assert (moved in result.stderr) == ask.startswith("job.")
    events = read_events(tmp_path / "out" / "tensorboard")
    assert (12, "square", 144.0) in events and (3, "half", 1.5) in events
    assert len([e for e in events if e[1] == "square"]) == 12


def test_no_tensorboard_by_default(skyrl_cli, job, tmp_path) -> None:
    assert skyrl_cli("run", str(job)).exit_code == 0
    assert not (tmp_path / "out" / "tensorboard").exists()


def test_a_line_being_written_is_not_read(tmp_path) -> None:
    """A reader watching a running job (a benchmark, a dashboard) can see the line being
    written in part: it reads the lines written whole, as a resumed run keeps them."""
    from skyrl_host.observers.metrics_jsonl import read_metrics
    from skyrl_host.testing import step_rows

    whole = [json.dumps({"event": "start"}), json.dumps({"step": 1, "loss": 0.5}), json.dumps({"step": 2, "loss": 0.25})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(whole) + "\n" + json.dumps({"step": 3, "loss": 0.125})[:12])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in step_rows(tmp_path)] == [1, 2]


class Recorder:
    """A third party's observer: keeps what it was told, in a file of the output folder."""

    def __init__(self, config):
        self.config, self.lines = config, []

    def started(self, run):
        self.lines.append(f"start {self.config.label}")

    def step_finished(self, run, step, metrics):
        if step % self.config.every == 0:
            self.lines.append(f"{step} {metrics['square']}")

    def finished(self, run, status, error):
        self.lines.append(f"end {status}")
        (run.output_dir / "recorded.txt").write_text("\n".join(self.lines) + "\n")


def test_a_registered_observer_with_its_own_table(skyrl_cli, skyrl_plugin, job, tmp_path) -> None:
    import attrs

    @attrs.frozen
    class RecorderOptions:
        label: str = "run"
        every: int = 1

    class RecorderPlugin:
        @hookimpl
        def skyrl_register_observers(self, register):
            register("recorder", Recorder, config=RecorderOptions, description="records steps")

    skyrl_plugin(RecorderPlugin(), "recorder_plugin")
    job.write_text(job.read_text() + '[observers]\nuse = ["recorder"]\n[observers.recorder]\nlabel = "mine"\nevery = 4\n')
    shown = skyrl_cli("validate", str(job), "--explain")
    assert shown.exit_code == 0 and "observers.recorder.every: " in shown.stdout
    assert skyrl_cli("run", str(job)).exit_code == 0
    assert (tmp_path / "out" / "recorded.txt").read_text() == "start mine\n4 16.0\n8 64.0\n12 144.0\nend completed\n"
    recorded = json.loads((tmp_path / "out" / "job.json").read_text())
    assert recorded["plugins"]["observers"][0]["config"] == {"label": "mine", "every": 4}

    job.write_text(job.read_text().replace('"recorder"]', '"recorderr"]').replace("every = 4", "every = 4\nevry = 2"))
    bad = skyrl_cli("validate", str(job))
    assert bad.exit_code == 2 and "Traceback" not in bad.stderr
    assert "observers.use: unknown observer 'recorderr'" in bad.stderr and "did you mean 'recorder'?" in bad.stderr
