"""``[cluster] max_restarts``: a job that stops on a lost process (``ProcessLost``) is
resumed from its last checkpoint by the host, up to that many times, with a notice each
time; without it, one error line and exit code 1; other failures are never retried."""

from __future__ import annotations

import attrs
import pytest

from skyrl_host import hookimpl
from skyrl_host.cli import main
from skyrl_host.errors import ProcessLost
from skyrl_host.options import option


@attrs.frozen
class FlakyConfig:
    losses: int = option(0, help="how many runs lose a process after step 2")
    error: str = option("lost", help="'lost' or 'bug'")


class Flaky:
    """Reports steps; the first ``losses`` runs lose a process after step 2. Counts its runs
    and where each started (the host's resume step)."""

    runs: list[int] = []

    def __init__(self, run):
        self.run_ = run

    def run(self) -> None:
        cfg = self.run_.spec.kind_config
        Flaky.runs.append(self.run_.resume_step if self.run_.resuming else -1)
        for step in range(self.run_.last_step + 1, self.run_.total_steps + 1):
            self.run_.report(step, {"x": float(step)})
            if step == 2 and len(Flaky.runs) <= cfg.losses:
                if cfg.error == "bug":
                    raise RuntimeError("a bug, not a lost process")
                raise ProcessLost("the actor of rank 0 died; `skyrl run JOB --resume` continues from the last checkpoint")


@pytest.fixture
def flaky_host(skyrl_empty_host):
    class Plugin:
        @hookimpl
        def skyrl_register_jobs(self, register):
            register("flaky", Flaky, config=FlakyConfig, description="loses a process", slots={})

    skyrl_empty_host.add_plugin(Plugin(), "flaky")
    Flaky.runs = []
    return skyrl_empty_host


def _job(tmp_path, **job) -> str:
    path = tmp_path / "job.toml"
    lines = [f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in job.items()]
    path.write_text("[job]\nkind = \"flaky\"\nsteps = 4\n" + "\n".join(lines).replace("'", '"') + "\n"
                    f"output_dir = \"{tmp_path / 'out'}\"\n")
    return str(path)


def test_a_lost_process_stops_the_job_with_one_line(flaky_host, tmp_path, capsys) -> None:
    assert main(["run", _job(tmp_path, losses=1)], host=flaky_host) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("error: the actor of rank 0 died; `skyrl run JOB --resume` continues from the "
                                    "last checkpoint")
    assert "Traceback" not in err and Flaky.runs == [-1]


def test_max_restarts_resumes_by_itself_up_to_n_times(flaky_host, tmp_path, capsys) -> None:
    job = _job(tmp_path, losses=2)
    assert main(["run", job, "--set", "cluster.max_restarts=2"], host=flaky_host) == 0
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("notice:")]
    assert len(notices) == 2
    assert notices[1].endswith("resuming from the last checkpoint (restart 2 of 2, [cluster] max_restarts)")
    assert Flaky.runs == [-1, 0, 0]  # each restart resumed (no checkpoint here: from the start)
    # One more loss than allowed: the last one is the job's error.
    Flaky.runs = []
    assert main(["run", job, "--overwrite", "--set", "cluster.max_restarts=1"], host=flaky_host) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: the actor of rank 0 died")
    assert Flaky.runs == [-1, 0]


def test_other_failures_are_not_retried(flaky_host, tmp_path) -> None:
    with pytest.raises(RuntimeError, match="a bug"):
        main(["run", _job(tmp_path, losses=1, error="bug"), "--set", "cluster.max_restarts=3"], host=flaky_host)
    assert Flaky.runs == [-1]
