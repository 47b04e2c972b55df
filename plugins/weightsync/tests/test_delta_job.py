"""delta in a real RL job (one process): the engine keeps its own bf16 copy, every step's
weights travel as a delta through the folder, and the job learns like with inproc."""

from __future__ import annotations

import json
import pathlib

JOB = """
[job]
kind = "rl"
seed = 3
steps = {steps}
batch_size = 8
n_samples = 4
max_new_tokens = 6
checkpoint_every = 0
save_final = false
threads = 1
output_dir = "{out}"

[model]
family = "qwen"
preset = "tiny"

[dataset]
name = "reverse_digits"
min_len = 3
max_len = 4
prefix = ""

[engine]
name = "embedded"
dtype = "{engine_dtype}"

[weight_sync]
transport = "delta"
uri = "{uri}"
keyframe_every = 3

[backend]
name = "torch"
lr = 5e-4
"""


def write(tmp_path: pathlib.Path, *, steps: int = 4, engine_dtype: str = "bfloat16") -> tuple[pathlib.Path, pathlib.Path]:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(steps=steps, out=out, uri=f"file://{tmp_path}/weights", engine_dtype=engine_dtype))
    return path, out


def test_rl_job_with_delta(skyrl_cli, tmp_path) -> None:
    path, out = write(tmp_path)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "event" not in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["sync_version"] for r in rows] == [1, 2, 3, 4]
    assert [r["sync_keyframe"] for r in rows] == [0, 0, 1, 0]  # version 0 (start) was the first keyframe
    assert all(r["sync_bytes"] < r["sync_full_bytes"] for r in rows if not r["sync_keyframe"])
    assert [r["weight_version"] for r in rows] == [0, 1, 2, 3]  # step s generates with version s - 1
    assert json.loads((tmp_path / "weights" / "LATEST").read_text()) == {"epoch": 0, "version": 4}
    # The engine computes in bf16, the trainer in fp32: a small, nonzero logprob gap.
    assert all(0 < r["logprob_diff_mean"] < 0.05 for r in rows)


def test_delta_refuses_an_engine_sharing_the_trainers_tensors(skyrl_cli, tmp_path) -> None:
    path, _ = write(tmp_path, engine_dtype="auto")
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t == "[weight_sync]")
    assert result.stderr.strip() == (
        f"error: {path}:{line}: weight_sync: the delta transport ships bfloat16 weights, but the engine serves the "
        "trainer's own float32 tensors (engine.dtype = 'auto'); set engine.dtype = \"bfloat16\" so the engine keeps "
        "its own copy"
    )


def test_bad_uri_is_a_user_error(skyrl_cli, tmp_path) -> None:
    path, _ = write(tmp_path)
    path.write_text(path.read_text().replace(f"file://{tmp_path}/weights", "nosuch://bucket/x"))
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "weight_sync.uri: unknown protocol 'nosuch' in 'nosuch://bucket/x'" in result.stderr
