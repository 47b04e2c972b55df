"""The judge part's own behaviour, without a served model: a judge that is down is one
clear error, or the configured fallback counted; a pair sampled twice is judged once; the
score is parsed from the reply's last match. (Against a real `vllm serve`:
plugins/engines/tests/test_vllm_judge.py.)"""

from __future__ import annotations

import socket

import pytest

from skyrl_host.errors import UserError
from skyrl_host.interfaces import Task
from skyrl_rewards.judge import Judge, JudgeConfig, JudgeError


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_a_judge_that_is_down_is_an_error_or_the_fallback(monkeypatch) -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    tasks = [Task(prompt="What is 2 + 2?", answer="4")] * 3
    judge = Judge(JudgeConfig(base_url=url, model="m", retries=1, backoff=0.0, timeout=5))
    with pytest.raises(UserError) as exc:
        judge.score(tasks[:1], ["4"])
    message = str(exc.value.problems[0])
    assert message.startswith("reward.judge: the judge 'm' could not grade a response: ")
    assert f"{url}/chat/completions did not answer after 2 attempt(s): ClientConnectorError" in message
    assert "set fallback" in message
    kind = Judge(JudgeConfig(base_url=url, model="m", retries=0, fallback=0.25, timeout=5))
    assert kind.score(tasks, ["4", "5", "4"]) == [0.25, 0.25, 0.25]
    m = kind.reward_metrics()
    assert m["judge_fallbacks"] == 2 and m["judge_requests"] == 2 and m["judge_cache_hits"] == 1  # "4" judged once
    assert kind.score(tasks[:1], ["4"]) == [0.25] and kind.reward_metrics()["judge_cache_hits"] == 2


def test_the_reply_is_parsed_and_the_options_checked(monkeypatch) -> None:
    judge = Judge(JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m"))
    assert judge.parse("Looks right.\nScore: 7\nActually, Score: 9") == 0.9
    with pytest.raises(JudgeError, match="holds no score"):
        judge.parse("I refuse.")
    user = judge.messages(Task(prompt="Q?", answer="A"), "R")[-1]["content"]
    assert "Question:\nQ?" in user and "Response:\nR" in user and "The reference answer is: A" in user
    with pytest.raises(ValueError, match="expected an http"):
        JudgeConfig(base_url="ftp://x", model="m")
    with pytest.raises(ValueError, match="needs a group"):
        JudgeConfig(base_url="http://x/v1", model="m", score_pattern=r"\d+")
    with pytest.raises(ValueError, match="must show the judge the"):
        JudgeConfig(base_url="http://x/v1", model="m", template="{prompt}")
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(UserError, match="'JUDGE_KEY' is not set"):
        Judge(JudgeConfig(base_url="http://x/v1", model="m", api_key_env="JUDGE_KEY"))
