"""`skyrl run --resume` refuses a checkpoint that another job wrote (another model
family or size, another backend state, files that are not ours): one user error
naming the checkpoint folder and what does not match, exit code 2, no traceback."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from skyrl_host.checkpoints import load_backend_state, resume_mismatches
from skyrl_host.config import locate_keys
from skyrl_host.errors import UserError
from skyrl_host.testing import tiny_rl_job

def write_job(tmp_path: pathlib.Path, name: str, out: pathlib.Path, preset: str = "tiny") -> pathlib.Path:
    """The tiny RL job (2 steps, a checkpoint at the end) in ``out``, with model ``preset``."""
    job = tiny_rl_job(tmp_path, name, job={"steps": 2, "batch_size": 4, "n_samples": 2, "max_new_tokens": 4,
                                           "output_dir": out}, model={"preset": preset},
                      algorithm={"name": "grpo"}, backend={"lr": 1e-3, "micro_batch_tokens": 128})
    return job.path


def user_error(result) -> str:
    assert result.exit_code == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.fixture
def finished_run(skyrl_cli, tmp_path):
    out = tmp_path / "out"
    path = write_job(tmp_path, "job", out)
    first = skyrl_cli("run", str(path))
    assert first.exit_code == 0, first.stderr
    return path, out


@pytest.mark.slow
def test_resume_with_another_model_size_or_family_is_a_user_error(skyrl_cli, finished_run, tmp_path) -> None:
    path, out = finished_run
    ckpt = out / "checkpoints" / "step_000002"
    assert json.loads((ckpt / "job.json").read_text())["plugins"]["model"][0]["config"]["preset"] == "tiny"

    moe = skyrl_cli("run", str(path), "--resume", "--set", 'model.preset="tiny-moe"')
    assert user_error(moe) == (
        f"error: {path}: model.preset: --resume: checkpoint '{ckpt}' belongs to another job: "
        'it was written with model.preset = "tiny", this job has "tiny-moe"\n'
    )
    wider = skyrl_cli("run", str(path), "--resume", "--set", "model.hidden_size=32")
    assert user_error(wider) == (
        f"error: {path}: model.hidden_size: --resume: checkpoint '{ckpt}' belongs to another job: "
        "it was written with model.hidden_size = unset, this job has 32\n"
    )
    kimi = skyrl_cli("run", str(path), "--resume", "--set", 'model.family="kimi"', "--set", 'model.preset="tiny-kimi"')
    assert user_error(kimi) == (
        f"error: {path}: model.family: --resume: checkpoint '{ckpt}' belongs to another job: "
        'it was written with model.family = "qwen", this job has "kimi"\n'
    )
    # The job file itself names another size: its line is given.
    other = write_job(tmp_path, "other", out, preset="tiny-moe")
    located = skyrl_cli("run", str(other), "--resume")
    line = locate_keys(other.read_text())["model.preset"]  # the error points at the key's line in the file
    assert user_error(located).startswith(f"error: {other}:{line}: model.preset: --resume: checkpoint '{ckpt}' ")

    # The refusals left the run as it was: the job that wrote it still resumes.
    again = skyrl_cli("run", str(path), "--resume", "--set", "job.steps=3")
    assert again.exit_code == 0, again.stderr
    assert "completed 3 step(s) (resumed after step 2)" in again.stderr


@pytest.mark.slow
def test_a_state_the_backend_refuses_names_the_checkpoint(skyrl_cli, finished_run) -> None:
    path, out = finished_run
    ckpt = out / "checkpoints" / "step_000002"
    lora = skyrl_cli("run", str(path), "--resume", "--set", "backend.lora_rank=4")
    line = user_error(lora).strip().splitlines()[-1]
    assert line.startswith(
        f"error: --resume: checkpoint {ckpt} does not fit this job's backend (was it written by another job?): "
        "the checkpoint was written by full fine-tuning (lora_rank = 0), but this backend runs LoRA"
    )
    # The checkpoint still records the job that wrote it: that job resumes from it.
    again = skyrl_cli("run", str(path), "--resume", "--set", "job.steps=3")
    assert again.exit_code == 0, again.stderr


@pytest.mark.slow
def test_a_checkpoint_copied_from_another_job_is_refused(skyrl_cli, finished_run, tmp_path) -> None:
    path, out = finished_run
    # Another job (a wider model) in another folder; its checkpoint copied into this run.
    other_out = tmp_path / "other_out"
    other = write_job(tmp_path, "other", other_out)
    assert skyrl_cli("run", str(other), "--set", "model.hidden_size=32").exit_code == 0
    foreign = out / "checkpoints" / "step_000009"
    shutil.copytree(other_out / "checkpoints" / "step_000002", foreign)
    result = skyrl_cli("run", str(path), "--resume", "--set", "job.steps=10")
    assert user_error(result) == (
        f"error: {path}: model.hidden_size: --resume: checkpoint '{foreign}' belongs to another job: "
        "it was written with model.hidden_size = 32, this job has unset\n"
    )
    # A job record that is not one: named, no traceback.
    (foreign / "job.json").write_text("not json")
    garbled = user_error(skyrl_cli("run", str(path), "--resume", "--set", "job.steps=10"))
    assert garbled.startswith(f"error: --resume: {foreign / 'job.json'} is not a skyrl job record: ")
    assert garbled.count("\n") == 1


def test_resume_mismatches_compare_kind_model_and_backend_only() -> None:
    def record(kind="rl", family="qwen", preset="tiny", backend="torch", lr=1e-3, steps=2):
        return {
            "job": {"steps": steps},
            "kind": {"name": kind},
            "plugins": {
                "model": [{"name": family, "config": {"preset": preset}}],
                "backend": [{"name": backend, "config": {"lr": lr}}],
                "engine": [{"name": "embedded", "config": {}}],
            },
        }

    assert resume_mismatches(record(), record(lr=3e-4, steps=10)) == []  # a run may continue with other settings
    assert resume_mismatches(record(), record(kind="sft")) == [("job.kind", "it was written by a 'rl' job, this is a 'sft' job")]
    assert resume_mismatches(record(), record(backend="megatron")) == [
        ("backend.name", 'it was written with backend.name = "torch", this job has "megatron"')
    ]
    assert resume_mismatches(record(), record(family="glm", preset="tiny-glm4-moe")) == [
        ("model.family", 'it was written with model.family = "qwen", this job has "glm"')
    ]


class Refuses:
    def __init__(self, exc: Exception):
        self.exc = exc

    def load_state_dict(self, state):
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "what"),
    [
        (
            RuntimeError('Error(s) in loading state_dict for Qwen3ForCausalLM:\n\tsize mismatch for model.embed.weight: '
                         "copying a param with shape torch.Size([19, 32]), the shape in current model is torch.Size([19, 64])."),
            "Error(s) in loading state_dict for Qwen3ForCausalLM: size mismatch for model.embed.weight: copying a param "
            "with shape torch.Size([19, 32]), the shape in current model is torch.Size([19, 64]).",
        ),
        (KeyError("optimizer"), "missing key 'optimizer'"),
        (ValueError("not a torch backend state: no 'steps'"), "not a torch backend state: no 'steps'"),
    ],
)
def test_a_state_the_backend_refuses_is_a_user_error_naming_the_checkpoint(tmp_path, exc, what) -> None:
    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, Refuses(exc), {"model": {}})
    assert info.value.render() == (
        f"error: --resume: checkpoint {tmp_path} does not fit this job's backend (was it written by another job?): {what}"
    )


def test_backend_state_files_that_are_not_ours(tmp_path) -> None:
    import torch

    from skyrl_host.statefile import save_state

    save_state(torch.zeros(3), tmp_path / "backend.safetensors")
    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, Refuses(RuntimeError("unreached")))
    assert info.value.render() == (
        f"error: --resume: checkpoint {tmp_path} holds no backend state (backend.safetensors holds a Tensor)")
    (tmp_path / "backend.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, Refuses(RuntimeError("unreached")))
    assert info.value.render().startswith(f"error: --resume: cannot read checkpoint {tmp_path}: ")
    assert "\n" not in info.value.render()


class Shards:
    """A ShardedCheckpoints backend that records what it was asked (or refuses)."""

    def __init__(self, exc: Exception | None = None):
        self.exc, self.calls = exc, []

    def state_dict(self):
        raise AssertionError("a sharded backend's state goes through save_checkpoint")

    def load_state_dict(self, state):
        raise AssertionError("a sharded backend's state comes through load_checkpoint")

    def save_checkpoint(self, folder: str) -> None:
        self.calls.append(("save", folder))

    def load_checkpoint(self, folder: str) -> None:
        self.calls.append(("load", folder))
        if self.exc is not None:
            raise self.exc


def test_a_sharded_backend_writes_and_reads_its_own_folder(tmp_path) -> None:
    from skyrl_host.checkpoints import save_backend_state

    be = Shards()
    save_backend_state(tmp_path, be)
    assert be.calls == [("save", str(tmp_path / "backend"))] and (tmp_path / "backend").is_dir()
    assert not (tmp_path / "backend.safetensors").exists()
    load_backend_state(tmp_path, be)
    assert be.calls[-1] == ("load", str(tmp_path / "backend"))
    # A backend without the capability cannot read it; a refused folder names the checkpoint.
    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, Refuses(RuntimeError("unreached")))
    assert info.value.render() == (f"error: --resume: checkpoint {tmp_path} holds a sharded backend state "
                                   f"({tmp_path / 'backend'}/), which this job's backend cannot read (was it "
                                   "written by another backend?)")
    with pytest.raises(UserError) as info:
        load_backend_state(tmp_path, Shards(ValueError("the checkpoint's tensors do not fit this model: shape")))
    assert info.value.render() == (f"error: --resume: checkpoint {tmp_path} does not fit this job's backend: the "
                                   "checkpoint's tensors do not fit this model: shape")
