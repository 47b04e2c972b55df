"""The jsonl dataset: reading, epochs and shuffling, the three kinds of reward."""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import sys
import textwrap

import pytest

from skyrl_datasets.jsonl import Jsonl, JsonlConfig
from skyrl_host.errors import UserError
from skyrl_host.interfaces import Dataset, Task

_ids = itertools.count()


def write_jsonl(tmp_path: pathlib.Path, records: list, name: str = "data.jsonl") -> pathlib.Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def numbered(tmp_path: pathlib.Path, n: int) -> pathlib.Path:
    return write_jsonl(tmp_path, [{"prompt": f"p{i}", "answer": f"a{i}"} for i in range(n)])


@pytest.fixture
def reward_module(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    """Write a module into tmp_path, put tmp_path on sys.path, and return its unique name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def make(source: str) -> str:
        name = f"skyrl_test_reward_{next(_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    yield make
    for name in names:
        sys.modules.pop(name, None)


# -- reading ---------------------------------------------------------------------


def test_records_become_tasks_with_extra_fields_in_meta(tmp_path) -> None:
    path = write_jsonl(
        tmp_path,
        [
            {"prompt": "Capital of France?", "answer": "Paris", "topic": "geo", "level": 1},
            {"prompt": "7*6?", "answer": 42},
            "",  # blank lines are skipped
            {"prompt": "sep\u2028inside", "answer": "x", "tags": ["a", "b"]},
        ],
    )
    ds = Jsonl(JsonlConfig(path=str(path), shuffle=False))
    assert isinstance(ds, Dataset)
    assert ds.tasks == [
        Task(prompt="Capital of France?", answer="Paris", meta={"topic": "geo", "level": 1}),
        Task(prompt="7*6?", answer="42", meta={}),  # a number answer is compared as text
        Task(prompt="sep\u2028inside", answer="x", meta={"tags": ["a", "b"]}),
    ]


def test_custom_keys_and_a_byte_order_mark(tmp_path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text('\ufeff{"q": "one", "a": "1", "id": 7}\r\n{"q": "two", "a": "2", "id": 8}', encoding="utf-8")
    ds = Jsonl(JsonlConfig(path=str(path), prompt_key="q", answer_key="a", shuffle=False))
    assert [(t.prompt, t.answer, dict(t.meta)) for t in ds.tasks] == [("one", "1", {"id": 7}), ("two", "2", {"id": 8})]


def test_malformed_lines_are_user_errors_naming_file_and_line(tmp_path) -> None:
    path = write_jsonl(
        tmp_path,
        [
            {"prompt": "ok", "answer": "1"},
            '{"prompt": "broken", ',
            "[1, 2]",
            {"question": "no prompt key", "answer": "3"},
            {"prompt": 5, "answer": "4"},
            {"prompt": "no answer"},
            {"prompt": "bad answer", "answer": {"x": 1}},
        ],
    )
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=str(path)))
    problems = [str(p) for p in info.value.problems]
    assert problems[0].startswith(f"{path}:2: invalid JSON: ")
    assert problems[1:] == [
        f"{path}:3: expected a JSON object, found list",
        f"{path}:4: missing the prompt key 'prompt'; keys: 'question', 'answer'",
        f"{path}:5: expected the prompt 'prompt' to be a string, found 5",
        f"{path}:6: missing the answer key 'answer' (reward = 'exact' needs it)",
        f"{path}:7: expected the answer 'answer' to be a string or a number, found {{\"x\": 1}}",
    ]


def test_many_malformed_lines_are_summarised(tmp_path) -> None:
    path = write_jsonl(tmp_path, ["not json"] * 25)
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=str(path)))
    assert len(info.value.problems) == 21
    assert str(info.value.problems[-1]) == f"{path}: ... and 5 more malformed lines"


def test_an_empty_file_is_a_user_error(tmp_path) -> None:
    path = write_jsonl(tmp_path, ["", "  "])
    with pytest.raises(UserError, match="holds no records"):
        Jsonl(JsonlConfig(path=str(path)))


def test_missing_file_or_folder_is_reported_at_validation(tmp_path) -> None:
    with pytest.raises(ValueError, match=re.escape(f"expected an existing file, found nothing at {str(tmp_path / 'x.jsonl')!r}")):
        JsonlConfig(path=str(tmp_path / "x.jsonl"))
    with pytest.raises(ValueError, match=re.escape(f"expected an existing file, found a folder {str(tmp_path)!r}")):
        JsonlConfig(path=str(tmp_path))


def test_prompt_and_answer_keys_must_differ(tmp_path) -> None:
    with pytest.raises(ValueError, match="prompt_key and answer_key must differ"):
        JsonlConfig(path=str(numbered(tmp_path, 2)), prompt_key="x", answer_key="x")


# -- batches: epochs, shuffling, purity --------------------------------------------


def test_in_file_order_batches_straddle_epochs(tmp_path) -> None:
    ds = Jsonl(JsonlConfig(path=str(numbered(tmp_path, 5)), shuffle=False), seed=3)
    prompts = lambda step: [t.prompt for t in ds.batch(step, 3)]  # noqa: E731
    assert prompts(1) == ["p0", "p1", "p2"]
    assert prompts(2) == ["p3", "p4", "p0"]  # epoch 0 ends, epoch 1 begins
    assert prompts(3) == ["p1", "p2", "p3"]
    assert [t.prompt for t in ds.batch(2, 12)] == ["p2", "p3", "p4"] + ["p0", "p1", "p2", "p3", "p4"] + ["p0", "p1", "p2", "p3"]


def test_each_epoch_is_a_seeded_permutation(tmp_path) -> None:
    path = numbered(tmp_path, 7)
    ds = Jsonl(JsonlConfig(path=str(path)), seed=11)
    stream = [t.prompt for step in range(1, 15) for t in ds.batch(step, 3)]  # 42 items: 6 epochs of 7
    epochs = [stream[i : i + 7] for i in range(0, 42, 7)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(f"p{i}" for i in range(7))
    assert len({tuple(e) for e in epochs}) > 1  # epochs are shuffled differently
    assert epochs[0] != [f"p{i}" for i in range(7)]
    # Step 3 (items 6..8) straddles epochs 0 and 1.
    assert [t.prompt for t in ds.batch(3, 3)] == [epochs[0][6], epochs[1][0], epochs[1][1]]
    # The sequence does not depend on the batch size.
    assert [t.prompt for step in range(1, 8) for t in ds.batch(step, 6)] == stream
    # Another seed, another order; the same seed, the same order.
    other = [t.prompt for t in Jsonl(JsonlConfig(path=str(path)), seed=12).batch(1, 42)]
    assert other != stream
    assert [t.prompt for t in Jsonl(JsonlConfig(path=str(path)), seed=11).batch(1, 42)] == stream


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path) -> None:
    path = numbered(tmp_path, 10)
    ds = Jsonl(JsonlConfig(path=str(path)), seed=5)
    late = ds.batch(40, 4)  # epoch 15 and 16, before any earlier step was asked for
    for step in range(1, 40):
        ds.batch(step, 4)
    assert ds.batch(40, 4) == late == Jsonl(JsonlConfig(path=str(path)), seed=5).batch(40, 4)
    assert ds.batch(1, 4) != ds.batch(2, 4)
    with pytest.raises(ValueError, match="steps count from 1"):
        ds.batch(0, 4)


# -- rewards ---------------------------------------------------------------------------


def test_exact_reward_strips_and_compares(tmp_path) -> None:
    path = write_jsonl(tmp_path, [{"prompt": "Capital?", "answer": " Paris "}, {"prompt": "7*6?", "answer": 42}])
    ds = Jsonl(JsonlConfig(path=str(path), shuffle=False))
    paris, six = ds.tasks
    assert ds.reward(paris, "Paris") == 1.0
    assert ds.reward(paris, "\n Paris\t") == 1.0
    assert ds.reward(paris, "paris") == 0.0
    assert ds.reward(paris, "Paris, France") == 0.0
    assert ds.reward(paris, "") == 0.0
    assert ds.reward(six, "42") == 1.0
    assert ds.reward(six, "42.0") == 0.0
    assert ds.reward(Task(prompt="no answer"), "x") == 0.0


def test_regex_reward_fullmatches_the_stripped_completion(tmp_path) -> None:
    path = write_jsonl(tmp_path, [{"prompt": "2+2?", "answer": r"4|four", "topic": "math"}])
    ds = Jsonl(JsonlConfig(path=str(path), reward="regex"))
    (task,) = ds.tasks
    # A pattern is not a completion that earns the reward: it is kept in meta.
    assert task.answer is None and task.meta == {"answer": "4|four", "topic": "math"}
    assert ds.reward(task, "4") == 1.0
    assert ds.reward(task, " four\n") == 1.0
    assert ds.reward(task, "44") == 0.0
    assert ds.reward(task, "four!") == 0.0  # fullmatch, not search
    assert ds.reward(task, "") == 0.0


def test_an_invalid_regex_is_a_user_error_naming_the_line(tmp_path) -> None:
    path = write_jsonl(tmp_path, [{"prompt": "a", "answer": "ok"}, {"prompt": "b", "answer": "(unclosed"}])
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=str(path), reward="regex"))
    assert str(info.value.problems[0]).startswith(f"{path}:2: invalid regular expression '(unclosed' in 'answer': ")


def test_module_function_reward(tmp_path, reward_module) -> None:
    mod = reward_module(
        """
        def score(task, completion):
            if completion.strip() == task.answer:
                return 1.0
            return 0.5 if task.meta.get("lenient") and completion.strip().lower() == task.answer.lower() else 0

        class Holder:
            @staticmethod
            def half(task, completion):
                return 0.5
        """
    )
    path = write_jsonl(tmp_path, [{"prompt": "Capital?", "answer": "Paris", "lenient": True}, {"prompt": "free form"}])
    ds = Jsonl(JsonlConfig(path=str(path), reward=f"{mod}:score", shuffle=False))
    paris, free = ds.tasks
    assert free.answer is None  # the answer is optional for a custom reward
    assert ds.reward(paris, "Paris") == 1.0
    assert ds.reward(paris, "PARIS") == 0.5
    r = ds.reward(paris, "Lyon")
    assert r == 0.0 and isinstance(r, float)  # an int result comes back as a float
    holder = Jsonl(JsonlConfig(path=str(path), reward=f"{mod}:Holder.half"))
    assert holder.reward(paris, "x") == 0.5


def test_module_function_is_checked_without_importing_the_module(tmp_path, reward_module) -> None:
    mod = reward_module("raise RuntimeError('imported at validate time')\n")
    path = numbered(tmp_path, 1)
    JsonlConfig(path=str(path), reward=f"{mod}:score")  # found, not imported
    assert mod not in sys.modules
    with pytest.raises(RuntimeError, match="imported at validate time"):
        Jsonl(JsonlConfig(path=str(path), reward=f"{mod}:score"))  # the factory imports it


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exakt", "expected 'exact', 'regex' or 'module:function', found 'exakt' (did you mean 'exact'?)"),
        ("score", "expected 'exact', 'regex' or 'module:function', found 'score'"),
        ("mod:", "expected 'module:function' (dotted Python names), found 'mod:'"),
        ("my-mod:f", "expected 'module:function' (dotted Python names), found 'my-mod:f'"),
        ("a:b:c", "expected 'module:function' (dotted Python names), found 'a:b:c'"),
        ("skyrl_no_such_module_x:f", "cannot find module 'skyrl_no_such_module_x' of 'skyrl_no_such_module_x:f'; is it installed"),
        ("skyrl_no_such_pkg_x.sub:f", "cannot find module 'skyrl_no_such_pkg_x.sub' of 'skyrl_no_such_pkg_x.sub:f': No module named"),
    ],
)
def test_bad_reward_specs_are_rejected_at_validation(tmp_path, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        JsonlConfig(path=str(numbered(tmp_path, 1)), reward=spec)


def test_missing_or_uncallable_function_is_a_user_error_naming_the_key(tmp_path, reward_module) -> None:
    mod = reward_module("THRESHOLD = 0.5\n")
    path = numbered(tmp_path, 1)
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=str(path), reward=f"{mod}:score"))
    assert str(info.value.problems[0]) == f"dataset.reward: module {mod!r} has no attribute 'score'"
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=str(path), reward=f"{mod}:THRESHOLD"))
    assert str(info.value.problems[0]) == f"dataset.reward: '{mod}:THRESHOLD' is float, not a callable f(task, completion)"


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "float('nan')", "'1'", "None"])
def test_a_custom_reward_outside_zero_one_is_a_user_error(tmp_path, reward_module, bad: str) -> None:
    mod = reward_module(f"def score(task, completion):\n    return {bad}\n")
    ds = Jsonl(JsonlConfig(path=str(numbered(tmp_path, 1)), reward=f"{mod}:score"))
    with pytest.raises(UserError, match=r"dataset.reward: reward function .* returned .* expected a number in \[0, 1\]"):
        ds.reward(ds.tasks[0], "x")
