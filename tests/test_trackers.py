"""The W&B and MLflow observers as a user meets them: a real job logs to wandb (offline,
in the output folder) and to an MLflow file store, and the runs read back hold the job's
config, every step's metrics at its step, and how the job ended; ``--resume`` continues
the same runs without logging a step twice; a job asking for a missing package stops
with a one-line user error naming the extra."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import pytest

from skyrl_host import hookimpl
from skyrl_host.testing import step_rows

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")
TRACKED = {"use": ["wandb", "mlflow"], "wandb": {"mode": "offline"}}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """W&B offline with its folders under tmp_path; MLFLOW_ALLOW_FILE_STORE as the
    observer finds it (unset) and restored after; W&B's service process ended."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # remembered as unset, so restored to unset
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # ends the wandb-core service this process started


# -- reading the runs back -----------------------------------------------------------------


def wandb_records(path: pathlib.Path) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then LevelDB log
    framing (32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    pos, pending, records, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pb.Record.FromString(pending))
            pending = b""
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(folder: pathlib.Path) -> dict:
    """What the W&B UI would show of one offline run folder: its id, config, history
    (step -> {metric: value}), summary and exit code."""
    (path,) = folder.glob("run-*.wandb")
    out: dict = {"id": None, "config": {}, "history": {}, "summary": {}, "exit_code": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
        elif kind == "config":
            out["config"].update({_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            out["history"][record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "summary":
            out["summary"].update({_key(item): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def wandb_runs(out: pathlib.Path) -> list[dict]:
    return [wandb_run(f) for f in sorted((out / "wandb").glob("offline-run-*"))]


def mlflow_run(out: pathlib.Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    run_id = (out / "mlflow_run_id").read_text().strip()
    return client, client.get_run(run_id)


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def metric_names(rows) -> list[str]:
    return sorted({k for r in rows for k in r if k not in ("step", "time")})


# -- a tiny RL job, logged to both -----------------------------------------------------------


@pytest.mark.slow
def test_a_tiny_rl_job_logs_every_step_to_wandb_and_mlflow(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    job = skyrl_tiny_rl_job(tmp_path, observers=TRACKED)
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    rows = job.rows()
    assert [r["step"] for r in rows] == [1, 2, 3]
    recorded = json.loads((job.out / "job.json").read_text())

    client, run = mlflow_run(job.out)
    assert run.info.status == "FINISHED" and run.info.run_name == "job"
    assert client.get_experiment(run.info.experiment_id).name == "skyrl"
    assert run.data.tags["skyrl.status"] == "completed" and run.data.tags["skyrl.last_step"] == "3"
    for name in metric_names(rows):
        assert history(client, run.info.run_id, name) == [(r["step"], pytest.approx(r[name])) for r in rows], name
    params = run.data.params
    assert params["kind.name"] == "rl" and params["job.seed"] == "3" and params["job.steps"] == "3"
    assert params["plugins.model.0.config.preset"] == "tiny" and params["plugins.backend.0.name"] == "torch"
    assert params["plugins.backend.0.config.lr"] == "0.0005"
    artifact = client.download_artifacts(run.info.run_id, "job.json", str(tmp_path / "artifact"))
    assert json.loads(pathlib.Path(artifact).read_text()) == recorded

    (wb,) = wandb_runs(job.out)
    assert wb["id"] == (job.out / "wandb_run_id").read_text().strip()
    assert wb["config"]["kind"] == recorded["kind"] and wb["config"]["job"]["seed"] == 3
    assert wb["config"]["plugins"]["model"][0]["config"]["preset"] == "tiny"
    assert sorted(wb["history"]) == [1, 2, 3]
    for r in rows:
        logged = wb["history"][r["step"]]
        assert set(logged) == set(metric_names(rows))
        assert logged == {k: pytest.approx(v) for k, v in r.items() if k not in ("step", "time")}
    assert wb["summary"]["skyrl_status"] == "completed" and wb["summary"]["reward_mean"] == pytest.approx(rows[-1]["reward_mean"])
    assert wb["exit_code"] == 0


@pytest.mark.slow
def test_resume_continues_the_same_runs_without_logging_a_step_twice(skyrl_tiny_rl_job, tmp_path, monkeypatch) -> None:
    # Checkpoints at steps 2 and 3; without the last, the resumed run redoes step 3.
    job = skyrl_tiny_rl_job(tmp_path, job={"checkpoint_every": 2}, observers=TRACKED)
    first = subprocess.run([SKYRL, "run", str(job.path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    wandb_id = (job.out / "wandb_run_id").read_text()
    mlflow_id = (job.out / "mlflow_run_id").read_text()
    # As if killed after logging step 3, before its checkpoint was written.
    shutil.rmtree(job.out / "checkpoints" / "step_000003")
    assert (job.out / "checkpoints" / "step_000002").is_dir()
    resumed = subprocess.run(
        [SKYRL, "run", str(job.path), "--resume", "--set", "job.steps=4"], capture_output=True, text=True, timeout=300,
        cwd=ROOT,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed after step 2)" in resumed.stderr
    rows = step_rows(job.out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    assert (job.out / "mlflow_run_id").read_text() == mlflow_id
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the observer did in the jobs' processes
    client, run = mlflow_run(job.out)
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert run.info.status == "FINISHED" and run.data.tags["skyrl.last_step"] == "4"
    for name in ("reward_mean", "loss", "accuracy"):
        assert history(client, run.info.run_id, name) == [(r["step"], pytest.approx(r[name])) for r in rows], name

    # Offline, each process keeps its own folder of the one run (`wandb sync` joins them).
    assert (job.out / "wandb_run_id").read_text() == wandb_id
    before, after = wandb_runs(job.out)
    assert before["id"] == after["id"] == wandb_id.strip()
    assert sorted(before["history"]) == [1, 2, 3] and sorted(after["history"]) == [3, 4]
    assert after["history"][4]["reward_mean"] == pytest.approx(rows[3]["reward_mean"])
    assert after["config"]["job"]["steps"] == 4 and after["exit_code"] == 0


# -- a failing job, and jobs that do not ask ---------------------------------------------------


class Flaky:
    def __init__(self, run):
        self.run_ = run

    def run(self):
        for step in range(1, 4):
            self.run_.report(step, {"reward_mean": step / 10})
        raise RuntimeError("the engine went away")


class FlakyPlugin:
    @hookimpl
    def skyrl_register_jobs(self, register):
        register("flaky", Flaky, description="three steps, then an error")


def write_job(tmp_path, kind: str, observers=None, **keys) -> pathlib.Path:
    path = tmp_path / "job.toml"
    lines = [f'kind = "{kind}"', f'output_dir = "{tmp_path / "out"}"'] + [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    text = "[job]\n" + "\n".join(lines) + "\n"
    if observers:
        text += f"[observers]\nuse = {json.dumps(observers['use'])}\n"
        for name, sub in observers.items():
            if name != "use":
                text += f"[observers.{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in sub.items())
    path.write_text(text)
    return path


def test_a_failed_job_finishes_both_runs_as_failed(skyrl_cli, skyrl_plugin, tmp_path) -> None:
    skyrl_plugin(FlakyPlugin(), "flaky_plugin")
    with pytest.raises(RuntimeError, match="the engine went away"):  # an error of the job, not the user's
        skyrl_cli("run", str(write_job(tmp_path, "flaky", observers=TRACKED)))
    out = tmp_path / "out"
    client, run = mlflow_run(out)
    assert run.info.status == "FAILED" and run.data.tags["skyrl.status"] == "failed"
    assert "the engine went away" in run.data.tags["skyrl.error"]
    assert history(client, run.info.run_id, "reward_mean") == [(1, 0.1), (2, 0.2), (3, pytest.approx(0.3))]
    (wb,) = wandb_runs(out)
    assert wb["summary"]["skyrl_status"] == "failed" and wb["exit_code"] == 1
    assert {s: h["reward_mean"] for s, h in wb["history"].items()} == {1: 0.1, 2: 0.2, 3: pytest.approx(0.3)}


def test_no_tracker_unless_the_job_asks(skyrl_cli, skyrl_plugin, tmp_path) -> None:
    skyrl_plugin(FlakyPlugin(), "flaky_plugin")
    with pytest.raises(RuntimeError):
        skyrl_cli("run", str(write_job(tmp_path, "flaky")))
    out = tmp_path / "out"
    assert (out / "metrics.jsonl").exists()
    for name in ("wandb", "mlruns", "wandb_run_id", "mlflow_run_id"):
        assert not (out / name).exists(), name


@pytest.mark.parametrize("form", ["observers", "deprecated job keys"])
def test_an_mlflow_tracking_uri_and_experiment_from_the_job(form, skyrl_cli, skyrl_plugin, tmp_path) -> None:
    """Given in [observers.mlflow], or in [job] as before (still read, with a notice)."""
    skyrl_plugin(FlakyPlugin(), "flaky_plugin")
    store = tmp_path / "elsewhere"
    uri = store.as_uri()
    if form == "observers":
        job = write_job(tmp_path, "flaky", observers={"use": ["mlflow"], "mlflow": {"tracking_uri": uri, "experiment": "ablation"}})
    else:
        job = write_job(tmp_path, "flaky", mlflow=True, mlflow_tracking_uri=uri, mlflow_experiment="ablation")
    checked = skyrl_cli("validate", str(job))
    assert checked.exit_code == 0, checked.stderr
    notices = [line for line in checked.stderr.splitlines() if line.startswith("notice:")]
    if form == "observers":
        assert notices == []
    else:
        assert notices == [
            f"notice: {job}:4: [job] mlflow is deprecated; write [observers] use = [\"mlflow\"]",
            f"notice: {job}:5: [job] mlflow_tracking_uri is deprecated; write [observers.mlflow] tracking_uri",
            f"notice: {job}:6: [job] mlflow_experiment is deprecated; write [observers.mlflow] experiment",
        ]
    with pytest.raises(RuntimeError):
        skyrl_cli("run", str(job))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("ablation")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == (tmp_path / "out" / "mlflow_run_id").read_text().strip()
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]
    assert not (tmp_path / "out" / "mlruns").exists()


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_package_is_a_user_error_naming_the_extra(tracker, tmp_path) -> None:
    # A stand-in package that fails to import, ahead of the installed one on sys.path.
    fake = tmp_path / "not_installed" / tracker
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f'raise ModuleNotFoundError("No module named {tracker!r}", name="{tracker}")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [SKYRL, "run", "examples/reward_check.toml", "--set", f'observers.use=["{tracker}"]', "--set", "job.steps=1",
         "--set", f"job.output_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert f'pip install "skyrl-host[{tracker}]"' in proc.stderr and "observers.use" in proc.stderr
    assert "Traceback" not in proc.stderr
