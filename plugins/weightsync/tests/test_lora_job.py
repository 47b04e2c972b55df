"""lora in a real RL job (one process, lora_rank = 8): only adapters move each step, the
engine generates step s with version s - 1, the job learns exactly as with inproc + the
same LoRA backend, and the final folder holds the merged model (a frozen base plus
trained deltas on the target layers only)."""

from __future__ import annotations

import pathlib
import shutil

import torch

from skyrl_host.testing import learning_metrics, step_rows


def write(make_job, tmp_path: pathlib.Path, name: str, *, transport: str, rank: int = 8, save_final: bool = False):
    """The tiny RL job (``make_job``: the skyrl_tiny_rl_job fixture) with LoRA adapters,
    4 steps, a checkpoint every 2, the default engine."""
    job = make_job(tmp_path, name, job={"steps": 4, "checkpoint_every": 2, "save_final": save_final,
                                        "output_dir": tmp_path / f"{name}_out"},
                   engine=None, weight_sync={"transport": transport}, backend={"lr": 5e-3, "lora_rank": rank})
    return job.path, job.out


def learning(row: dict) -> dict:
    """What the job learned and generated: every metric but timings and the transport's own."""
    return learning_metrics(row)


def test_rl_job_with_lora_matches_inproc_with_lora(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, out = write(skyrl_tiny_rl_job, tmp_path, "lora", transport="lora", save_final=True)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    got = step_rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["sync_version"] for r in got] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in got] == [0, 1, 2, 3]  # step s generates with version s - 1
    # Only the adapters move: rank 8 on 7 Linear kinds x 2 layers of the tiny preset.
    assert len({r["sync_bytes"] for r in got}) == 1 and got[0]["sync_tensors"] == 28
    # The engine (base + adapter hooks) and the trainer compute the same fp32 logprobs.
    assert all(r["logprob_diff_max"] < 1e-5 for r in got)
    assert got[-1]["grad_norm"] > 0 and got[0]["loss_tokens"] > 0

    path, ref_out = write(skyrl_tiny_rl_job, tmp_path, "inproc", transport="inproc")
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    want = step_rows(ref_out)
    # Same adapters reach the engine either way (float32, bit for bit): every learning metric is equal.
    assert [learning(r) for r in got] == [learning(r) for r in want]
    assert "reward_std" in learning(got[0])

    # The final folder: the merged model; non-target weights are the untouched base.
    import transformers

    import skyrl_models.qwen as qwen

    final = transformers.AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    base = qwen.make_family(qwen.QwenConfig(preset="tiny")).load(alphabet=_alphabet(), seed=3).model.state_dict()
    assert final.keys() == base.keys()
    changed = {k for k in base if not torch.equal(final[k], base[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in qwen.LORA_TARGETS for k in changed), sorted(changed)

    # Resume from the step-2 checkpoint (adapters + optimizer only): steps 3 and 4 come out the same.
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"step_000002", "step_000004"}
    shutil.rmtree(out / "checkpoints" / "step_000004")
    result = skyrl_cli("run", str(path.with_name("lora.toml")), "--resume")
    assert result.exit_code == 0, result.stderr
    assert "(resumed after step 2)" in result.stderr
    resumed = step_rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [learning(r) for r in resumed] == [learning(r) for r in got]
    assert [r["sync_bytes"] for r in resumed] == [r["sync_bytes"] for r in got]


def _alphabet() -> str:
    from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig  # the job's dataset

    return ReverseDigits(ReverseDigitsConfig(min_len=3, max_len=4, prefix=""), seed=3).alphabet


def test_lora_transport_needs_a_lora_backend(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    path, _ = write(skyrl_tiny_rl_job, tmp_path, "full", transport="lora", rank=0)
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "weight_sync.transport: transport 'lora' moves LoRA adapters only, but [backend] lora_rank = 0" in result.stderr
    assert "set [backend] lora_rank > 0" in result.stderr
