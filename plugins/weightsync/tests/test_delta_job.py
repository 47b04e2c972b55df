"""delta in a real RL job (one process): the engine keeps its own bf16 copy, every step's
weights travel as a delta through the folder, and the job learns like with inproc."""

from __future__ import annotations

import json
import pathlib

from skyrl_host.testing import step_rows


def write(make_job, tmp_path: pathlib.Path, *, steps: int = 4, engine_dtype: str = "bfloat16",
          uri: str | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny RL job (``make_job``: the skyrl_tiny_rl_job fixture) with delta through a folder."""
    job = make_job(tmp_path, job={"steps": steps, "output_dir": tmp_path / "out"}, engine={"dtype": engine_dtype},
                   weight_sync={"transport": "delta", "uri": uri or f"file://{tmp_path}/weights", "keyframe_every": 3})
    return job.path, job.out


def test_rl_job_with_delta(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, out = write(skyrl_tiny_rl_job, tmp_path)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["sync_version"] for r in rows] == [1, 2, 3, 4]
    assert [r["sync_keyframe"] for r in rows] == [0, 0, 1, 0]  # version 0 (start) was the first keyframe
    assert all(r["sync_bytes"] < r["sync_full_bytes"] for r in rows if not r["sync_keyframe"])
    # The sender counts the bf16 words each delta changed (2 bytes a word on the wire, before zstd).
    assert all(0 < r["sync_changed_words"] <= r["sync_words"] == r["sync_full_bytes"] / 2
               for r in rows if not r["sync_keyframe"])
    assert all("sync_changed_words" not in r for r in rows if r["sync_keyframe"])
    assert [r["weight_version"] for r in rows] == [0, 1, 2, 3]  # step s generates with version s - 1
    assert json.loads((tmp_path / "weights" / "LATEST").read_text()) == {"epoch": 0, "version": 4}
    # The engine computes in bf16, the trainer in fp32: a small, nonzero logprob gap.
    assert all(0 < r["logprob_diff_mean"] < 0.05 for r in rows)


def test_delta_refuses_an_engine_sharing_the_trainers_tensors(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, _ = write(skyrl_tiny_rl_job, tmp_path, engine_dtype="auto")
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t == "[weight_sync]")
    assert result.stderr.strip() == (
        f"error: {path}:{line}: weight_sync: the delta transport ships bfloat16 weights, but the engine serves the "
        "trainer's own float32 tensors (engine.dtype = 'auto'); set engine.dtype = \"bfloat16\" so the engine keeps "
        "its own copy"
    )


def test_bad_uri_is_a_user_error(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, _ = write(skyrl_tiny_rl_job, tmp_path, uri="nosuch://bucket/x")
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "weight_sync.uri: unknown protocol 'nosuch' in 'nosuch://bucket/x'" in result.stderr
