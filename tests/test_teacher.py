"""On-policy distillation as a user meets it: [teacher] names a model, the algorithm opd
makes the teacher's per-token signal the advantage, and the student moves toward the
teacher (the reverse KL it reports falls); any algorithm's ``teacher_kl_coef`` adds the KL
to its loss and keeps it near the teacher; a teacher identical to the student gives no
signal; what cannot work is refused with one message."""

from __future__ import annotations

import json
import pathlib

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


def test_the_teachers_top_k_is_its_most_likely_tokens_at_each_position() -> None:
    import torch

    from skyrl_host.jobs.teacher import NO_LOGPROB, Teacher
    from skyrl_host.sections import TeacherSection
    from skyrl_models.qwen import QwenConfig, make_family

    loaded = make_family(QwenConfig(preset="tiny")).load(alphabet="0123456789 ", seed=3)
    batch = RolloutBatch.from_sequences([[3, 4, 5], [6]], [[7, 8], [9, 10, 11]], [[0.0] * 2, [0.0] * 3], group_ids=[0, 1])
    # batch_tokens 4: one sequence per forward (padding would change nothing either).
    lps, ids, top = Teacher(loaded, TeacherSection(batch_tokens=4), temperature=0.5).score(batch, 3)
    assert ids.shape == top.shape == (batch.n_tokens, 3) and ids.dtype == np.int32
    cu = batch.cu_seqlens
    for s in range(2):
        tokens = torch.as_tensor(batch.tokens[cu[s]:cu[s + 1]], dtype=torch.long)[None]
        with torch.no_grad():
            full = torch.log_softmax(loaded.model(input_ids=tokens).logits[0, :-1].float() / 0.5, -1)
        expect = full.topk(3, -1)
        assert ids[cu[s] + 1:cu[s + 1]].tolist() == expect.indices.tolist()
        np.testing.assert_allclose(top[cu[s] + 1:cu[s + 1]], expect.values.numpy(), atol=1e-5)
        np.testing.assert_allclose(lps[cu[s] + 1:cu[s + 1]], full.gather(-1, tokens[0, 1:, None])[:, 0].numpy(),
                                   atol=1e-5)
        assert ids[cu[s]].tolist() == [0, 0, 0] and top[cu[s]].tolist() == [NO_LOGPROB] * 3 and lps[cu[s]] == 0
    assert np.all(np.diff(top[1:3], axis=1) <= 0)  # most likely first


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
    # The README's example names the quickstart's folder as its teacher: valid with one there.
    example = pathlib.Path(__file__).resolve().parents[1] / "examples" / "distillation.toml"
    checked = skyrl_cli("validate", str(example), "--set", f"teacher.path={json.dumps(str(folder))}")
    assert checked.exit_code == 0, checked.stderr


@pytest.mark.slow
def test_a_teacher_kl_term_keeps_any_algorithm_near_its_teacher(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    made = _job(skyrl_tiny_rl_job, tmp_path, "teacher_src", job={"seed": 9, "steps": 1, "save_final": True})
    assert skyrl_cli("run", str(made.path)).exit_code == 0
    teacher = {"family": "qwen", "path": str(made.out / "final")}

    def drift(name: str, algorithm: dict) -> float:
        job = _job(skyrl_tiny_rl_job, tmp_path, name, job={"steps": 25}, algorithm=algorithm, teacher=teacher,
                   backend={"lr": 3e-3})
        result = skyrl_cli("run", str(job.path))
        assert result.exit_code == 0, result.stderr
        rows = job.rows()
        if algorithm.get("teacher_kl_coef"):
            assert all(np.isfinite(r["teacher_kl_loss"]) for r in rows)
        return float(np.mean([r["teacher_kl"] for r in rows[-5:]]))

    # The control learns from the reward alone (opd without its teacher signal reports the KL it
    # drifts to); the same with the KL term, and GRPO with it, stay near the teacher.
    reward_only = {"name": "opd", "teacher_coef": 0.0, "reward_weight": 1.0}
    control = drift("control", reward_only)
    same_plus_term = drift("term", {**reward_only, "teacher_kl_coef": 1.0})
    grpo_plus_term = drift("grpo", {"name": "grpo", "teacher_kl_coef": 1.0})
    grpo_top_k = drift("grpo_topk", {"name": "grpo", "teacher_kl_coef": 1.0, "teacher_kl_topk": 8})
    same_top_k = drift("opd_topk", {**reward_only, "teacher_kl_coef": 1.0, "teacher_kl_topk": 8})
    print(f"teacher_kl of the last 5 steps: reward alone {control:.3f}, with the term {same_plus_term:.3f}, "
          f"grpo with it {grpo_plus_term:.3f}, grpo with its top-8 form {grpo_top_k:.3f}, the same algorithm "
          f"with its top-8 form {same_top_k:.3f}")
    # measured: 0.46, 0.03, 0.04, 0.13, 0.16 (the top-k form bounds the forward KL, not this reverse estimate)
    assert control > 0.1 and same_plus_term < 0.3 * control and grpo_plus_term < 0.3 * control
    assert grpo_top_k < 0.5 * control and same_top_k < 0.5 * control


def test_what_cannot_work_is_refused(skyrl_cli, skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path) -> None:
    job = _job(skyrl_tiny_rl_job, tmp_path, "no_teacher", algorithm={"name": "opd"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "algorithm 'opd' learns from a teacher (opd, or teacher_kl_coef > 0): add a [teacher] table" in result.stderr
    job = _job(skyrl_tiny_rl_job, tmp_path, "kl_no_teacher", algorithm={"name": "grpo", "teacher_kl_coef": 0.1})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "algorithm 'grpo' learns from a teacher" in result.stderr
    job = _job(skyrl_tiny_rl_job, tmp_path, "kl_k1", algorithm={"name": "grpo", "teacher_kl_coef": 0.1,
                                                               "teacher_kl_estimator": "k1"},
               teacher={"family": "qwen", "preset": "tiny"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "teacher_kl_estimator" in result.stderr and "'k1'" in result.stderr
    job = _job(skyrl_tiny_rl_job, tmp_path, "bad_url", algorithm={"name": "opd"},
               teacher={"family": "qwen", "preset": "tiny", "base_url": "ftp://teacher"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "teacher.base_url" in result.stderr and "http:// or https://" in result.stderr
    job = _job(skyrl_tiny_rl_job, tmp_path, "grpo_teacher", teacher={"family": "qwen", "preset": "tiny"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "teacher: algorithm 'grpo' does not use a teacher" in result.stderr
    # Another tokenizer: the real-shaped checkpoint's BPE against the preset's characters.
    job = _job(skyrl_tiny_rl_job, tmp_path, "other_vocab", algorithm={"name": "opd"},
               teacher={"family": "qwen", "path": str(skyrl_real_checkpoint("qwen3"))})
    for command in ("validate", "run"):
        result = skyrl_cli(command, str(job.path))
        assert result.exit_code == 2 and "Traceback" not in result.stderr
        assert "teacher: the teacher's tokenizer (" in result.stderr and "tokens) is not the student's (" in result.stderr
        assert str(skyrl_real_checkpoint("qwen3")) in result.stderr  # the teacher's folder named


class _Answers:
    """A local HTTP server answering /v1/models and /v1/completions with what a test sets
    (a server that is not vLLM, or a broken one); it counts the requests."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        self.completions: tuple[int, bytes] = (200, b"{}")
        self.models = {"data": [{"id": "t"}]}
        self.posts = 0
        answers = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(200, json.dumps(answers.models).encode())

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                answers.posts += 1
                self._send(*answers.completions)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_served_teacher_that_fails_or_is_not_vllm_is_one_clear_error(monkeypatch) -> None:
    import json
    import socket

    from skyrl_host.errors import UserError
    from skyrl_host.jobs.teacher import ServedTeacher
    from skyrl_host.sections import TeacherSection

    batch = RolloutBatch.from_sequences([[5, 6]], [[7, 8]], [[-1.0, -1.0]], group_ids=[0])
    answers = _Answers()
    try:
        teacher = ServedTeacher(TeacherSection(base_url=answers.url, retries=0), temperature=1.0)
        assert teacher.model == "t"  # the only model the server lists
        # A server that is not vLLM: choices without prompt logprobs.
        answers.completions = (200, json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode())
        with pytest.raises(UserError, match="sequence 0 of 4 tokens came back with no prompt logprobs"):
            teacher.logprobs(batch)
        # The wrong token's logprob: refused, never used.
        entries = [None] + [{"99": {"logprob": -1.0}}] * 3
        answers.completions = (200, json.dumps({"choices": [{"index": 0, "prompt_logprobs": entries}]}).encode())
        with pytest.raises(UserError, match=r"token 1 \(id 6\): no logprob of that token"):
            teacher.logprobs(batch)
        # The right ones: each token's, 0 at the first.
        entries = [None] + [{str(t): {"logprob": -0.5 * t}} for t in (6, 7, 8)]
        answers.completions = (200, json.dumps({"choices": [{"index": 0, "prompt_logprobs": entries}]}).encode())
        assert teacher.logprobs(batch).tolist() == [0.0, -3.0, -3.5, -4.0]
        # Top-k: the k best of what came back, most likely first; fewer than k is refused.
        entries = [None] + [{str(t): {"logprob": -0.5 * t}, "3": {"logprob": -0.1}, "4": {"logprob": -9.0}}
                            for t in (6, 7, 8)]
        answers.completions = (200, json.dumps({"choices": [{"index": 0, "prompt_logprobs": entries}]}).encode())
        lps, ids, top = teacher.score(batch, 2)
        assert ids.tolist() == [[0, 0], [3, 6], [3, 7], [3, 8]] and top[1].tolist() == pytest.approx([-0.1, -3.0])
        with pytest.raises(UserError, match="3 top-k entries, expected 4"):
            teacher.score(batch, 4)
        # Not JSON; an answer larger than the request allows.
        answers.completions = (200, b"<html>")
        with pytest.raises(UserError, match="not JSON"):
            teacher.logprobs(batch)
        answers.completions = (200, b" " * (2 << 20))
        with pytest.raises(UserError, match="answered more than"):
            teacher.logprobs(batch)
        # A 503 is retried (1 s, then 2 s), then the job stops naming the last answer.
        answers.completions, answers.posts = (503, b"overloaded"), 0
        retrying = ServedTeacher(TeacherSection(base_url=answers.url, retries=2), temperature=1.0)
        with pytest.raises(UserError, match="failed 3 times; last: HTTP 503: overloaded"):
            retrying.logprobs(batch)
        assert answers.posts == 3  # and the listing of its models before them:
        assert retrying.counters == {"teacher_requests": 4.0, "teacher_retries": 2.0}
        # Two models and no served_model.
        answers.models = {"data": [{"id": "a"}, {"id": "b"}]}
        with pytest.raises(UserError, match=r"serves \['a', 'b'\]; name one with served_model"):
            ServedTeacher(TeacherSection(base_url=answers.url), temperature=1.0)
    finally:
        answers.server.shutdown()
    # Nothing listening.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UserError, match=f"GET http://127.0.0.1:{port}/v1/models failed 1 times"):
        ServedTeacher(TeacherSection(base_url=f"http://127.0.0.1:{port}/v1", retries=0), temperature=1.0)
    # Sampling at another temperature than the server's prompt logprobs: refused.
    with pytest.raises(UserError, match="untempered distribution, but the job samples at temperature 0.7"):
        ServedTeacher(TeacherSection(base_url="http://127.0.0.1:1/v1"), temperature=0.7)
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(UserError, match="'NO_SUCH_KEY_VAR' is not set"):
        ServedTeacher(TeacherSection(base_url="http://127.0.0.1:1/v1", api_key_env="NO_SUCH_KEY_VAR"), temperature=1.0)
