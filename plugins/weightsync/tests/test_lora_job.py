"""lora in a real RL job (one process, lora_rank = 8): only adapters move each step, the
engine generates step s with version s - 1, the job learns exactly as with inproc + the
same LoRA backend, and the final folder holds the merged model (a frozen base plus
trained deltas on the target layers only)."""

from __future__ import annotations

import json
import pathlib
import shutil

import torch

JOB = """
[job]
kind = "rl"
seed = 3
steps = 4
batch_size = 8
n_samples = 4
max_new_tokens = 6
checkpoint_every = 2
save_final = {save_final}
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

[weight_sync]
transport = "{transport}"

[backend]
name = "torch"
lr = 5e-3
lora_rank = {rank}
"""
SYNC = ("sync_",)
TIMING = ("time", "tokens_per_s", "seconds", "step_time", "step_time_s")


def write(tmp_path: pathlib.Path, name: str, *, transport: str, rank: int = 8, save_final: bool = False):
    out = tmp_path / f"{name}_out"
    path = tmp_path / f"{name}.toml"
    path.write_text(JOB.format(out=out, transport=transport, rank=rank, save_final=str(save_final).lower()))
    return path, out


def rows(out: pathlib.Path) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "step" in r and "event" not in r]


def learning(row: dict) -> dict:
    """What the job learned and generated: every metric but timings and the transport's own."""
    return {k: v for k, v in row.items()
            if not k.startswith(SYNC) and not any(k == t or k.endswith(t) for t in TIMING)}


def test_rl_job_with_lora_matches_inproc_with_lora(skyrl_cli, tmp_path) -> None:
    path, out = write(tmp_path, "lora", transport="lora", save_final=True)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["sync_version"] for r in got] == [1, 2, 3, 4]
    assert [r["weight_version"] for r in got] == [0, 1, 2, 3]  # step s generates with version s - 1
    # Only the adapters move: rank 8 on 7 Linear kinds x 2 layers of the tiny preset.
    assert len({r["sync_bytes"] for r in got}) == 1 and got[0]["sync_tensors"] == 28
    # The engine (base + adapter hooks) and the trainer compute the same fp32 logprobs.
    assert all(r["logprob_diff_max"] < 1e-5 for r in got)
    assert got[-1]["grad_norm"] > 0 and got[0]["loss_tokens"] > 0

    path, ref_out = write(tmp_path, "inproc", transport="inproc")
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 0, result.stderr
    want = rows(ref_out)
    # Same adapters reach the engine either way (float32, bit for bit): every learning metric is equal.
    assert [learning(r) for r in got] == [learning(r) for r in want]

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
    resumed = rows(out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [learning(r) for r in resumed] == [learning(r) for r in got]
    assert [r["sync_bytes"] for r in resumed] == [r["sync_bytes"] for r in got]


def _alphabet() -> str:
    from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig  # the job's dataset

    return ReverseDigits(ReverseDigitsConfig(min_len=3, max_len=4, prefix=""), seed=3).alphabet


def test_lora_transport_needs_a_lora_backend(skyrl_cli, tmp_path) -> None:
    path, _ = write(tmp_path, "full", transport="lora", rank=0)
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "weight_sync.transport: transport 'lora' moves LoRA adapters only, but [backend] lora_rank = 0" in result.stderr
    assert "set [backend] lora_rank > 0" in result.stderr
