"""On-policy distillation as a user meets it: [teacher] names a model, the algorithm opd
makes the teacher's per-token signal the advantage, and the student moves toward the
teacher (the reverse KL it reports falls); a teacher identical to the student gives no
signal; what cannot work is refused with one message."""

from __future__ import annotations

import numpy as np
import pytest

from skyrl_host.rollout import RolloutBatch


def test_opd_advantages_are_the_teachers_per_token_signal() -> None:
    from skyrl_algorithms.opd import Opd, OpdConfig

    batch = RolloutBatch.from_sequences([[1, 2], [3]], [[4, 5, 6], [7]], [[-1.0, -2.0, -0.5], [-3.0]], group_ids=[0, 0])
    batch.rewards = np.array([1.0, 0.0], dtype=np.float32)
    teacher = np.zeros(batch.n_tokens, dtype=np.float32)
    teacher[batch.loss_mask != 0] = [-0.5, -2.5, -0.5, -1.0]
    batch.side_channels["teacher_logprobs"] = teacher
    adv = Opd(OpdConfig(teacher_coef=2.0)).advantages(batch, batch.rewards)
    assert adv[batch.loss_mask == 0].tolist() == [0.0] * 3  # prompt tokens
    assert adv[batch.loss_mask != 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 4.0])
    mixed = Opd(OpdConfig(reward_weight=1.0)).advantages(batch, batch.rewards)
    assert mixed[batch.loss_mask != 0][0] > 0.5  # plus the first sequence's positive group advantage
    from skyrl_host.errors import UserError

    del batch.side_channels["teacher_logprobs"]
    with pytest.raises(UserError, match="add a \\[teacher\\] table"):
        Opd(OpdConfig()).advantages(batch, batch.rewards)


def _job(skyrl_tiny_rl_job, tmp_path, name, **sections):
    return skyrl_tiny_rl_job(tmp_path, name, **sections)


@pytest.mark.slow
def test_the_student_moves_toward_its_teacher(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    # A teacher: the tiny preset at another seed, saved as a folder (its character tokenizer with it).
    made = _job(skyrl_tiny_rl_job, tmp_path, "teacher_src", job={"seed": 9, "steps": 1, "save_final": True})
    assert skyrl_cli("run", str(made.path)).exit_code == 0
    folder = made.out / "final"
    same = _job(skyrl_tiny_rl_job, tmp_path, "same", algorithm={"name": "opd"},
                teacher={"family": "qwen", "preset": "tiny"})  # the student's own start
    assert skyrl_cli("run", str(same.path)).exit_code == 0
    assert abs(same.rows()[0]["teacher_kl"]) < 1e-5  # no signal from a copy of itself
    job = _job(skyrl_tiny_rl_job, tmp_path, "distil", job={"steps": 25}, algorithm={"name": "opd"},
               teacher={"family": "qwen", "path": str(folder)}, backend={"lr": 3e-3})
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    kl = [r["teacher_kl"] for r in job.rows()]
    first, last = np.mean(kl[:3]), np.mean(kl[-3:])
    print(f"teacher_kl {first:.3f} -> {last:.3f}")
    assert first > 0.01 and last < 0.5 * first, (first, last)  # measured: 0.027 -> 0.003


def test_what_cannot_work_is_refused(skyrl_cli, skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path) -> None:
    job = _job(skyrl_tiny_rl_job, tmp_path, "no_teacher", algorithm={"name": "opd"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "algorithm 'opd' distils from a teacher: add a [teacher] table" in result.stderr
    job = _job(skyrl_tiny_rl_job, tmp_path, "grpo_teacher", teacher={"family": "qwen", "preset": "tiny"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "teacher: algorithm 'grpo' does not use a teacher" in result.stderr
    # Another tokenizer: the real-shaped checkpoint's BPE against the preset's characters.
    job = _job(skyrl_tiny_rl_job, tmp_path, "other_vocab", algorithm={"name": "opd"},
               teacher={"family": "qwen", "path": str(skyrl_real_checkpoint("qwen3"))})
    assert skyrl_cli("validate", str(job.path)).exit_code == 0
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "[teacher]: its tokenizer (" in result.stderr and "is not the student's" in result.stderr
