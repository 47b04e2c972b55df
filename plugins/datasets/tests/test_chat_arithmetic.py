"""chat_arithmetic: chat questions with integer answers, scored on the response's last integer."""

from __future__ import annotations

import pytest

from skyrl_datasets.chat_arithmetic import ChatArithmetic, ChatArithmeticConfig, last_integer


def make(seed: int = 1, **options) -> ChatArithmetic:
    return ChatArithmetic(ChatArithmeticConfig(**options), seed=seed)


def test_questions_are_chats_a_pure_function_of_seed_and_step() -> None:
    ds = make()
    tasks = ds.batch(3, 16)
    assert [t.prompt for t in tasks] == [t.prompt for t in make().batch(3, 16)]
    assert [t.prompt for t in tasks] != [t.prompt for t in ds.batch(4, 16)]
    assert [t.prompt for t in tasks] != [t.prompt for t in make(seed=2).batch(3, 16)]
    for t in tasks:
        a, b = t.meta["a"], t.meta["b"]
        assert t.prompt == f"What is {a} + {b}? Answer with just the number." and 0 <= a <= 9 and 0 <= b <= 9
        assert t.messages == [{"role": "user", "content": t.prompt}] and t.answer == str(a + b)


def test_every_task_and_its_answer() -> None:
    tasks = make(tasks=["subtract", "multiply", "compare"], min_value=2, max_value=30, instruction="",
                 system_prompt="Be brief.").batch(1, 200)
    seen = {t.meta["task"] for t in tasks}
    assert seen == {"subtract", "multiply", "compare"}
    for t in tasks:
        a, b = t.meta["a"], t.meta["b"]
        want = {"subtract": a - b, "multiply": a * b, "compare": max(a, b)}[t.meta["task"]]
        assert int(t.answer) == want and 2 <= a <= 30 and 2 <= b <= 30
        if t.meta["task"] == "subtract":
            assert a >= b  # no negative results unless allow_negative
        if t.meta["task"] == "compare":
            assert a != b and t.prompt == f"Which is larger, {a} or {b}?"
        assert t.messages[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("completion, reward", [
    ("12", 1.0), ("7 + 5 = 12.", 1.0), ("The answer is 12<|im_end|>", 1.0), ("12, not 13", 0.0),
    ("It is 13.", 0.0), ("twelve", 0.0), ("", 0.0), ("-3 then 12", 1.0),
])
def test_the_reward_is_the_last_integer(completion, reward) -> None:
    ds = make()
    task = next(t for t in ds.batch(1, 64) if t.answer == "12")
    assert ds.reward(task, completion) == reward
    assert last_integer("a -4 b") == -4 and last_integer("none") is None


@pytest.mark.parametrize("options, message", [
    ({"tasks": []}, "expected at least one of"),
    ({"tasks": ["add", "divide"]}, "found 'divide'"),
    ({"min_value": 5, "max_value": 3}, "expected at most max_value (3), found 5"),
    ({"tasks": ["compare"], "min_value": 4, "max_value": 4}, "'compare' needs two different numbers"),
])
def test_bad_options_name_the_problem(options, message) -> None:
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        ChatArithmeticConfig(**options)
