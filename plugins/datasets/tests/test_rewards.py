"""The math and format rewards (skyrl_datasets.rewards) with the real math-verify, through
the jsonl dataset as a user selects them, and the GSM8K-style example data set."""

from __future__ import annotations

import ast
import importlib.util
import json
import operator
import pathlib
import re
import subprocess
import sys
import threading
from fractions import Fraction

import pytest

from skyrl_host.interfaces import Task

from skyrl_datasets.jsonl import Jsonl, JsonlConfig
from skyrl_datasets.rewards import FormatReward, MathFormatReward, MathReward, extract_answer, well_formatted

ROOT = pathlib.Path(__file__).resolve().parents[3]
DATA = ROOT / "examples" / "data" / "math_word_problems.jsonl"


def task(answer: str | None) -> Task:
    return Task(prompt="q", answer=answer)


def write(tmp_path: pathlib.Path, records: list[dict]) -> str:
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# -- the math reward ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "completion"),
    [
        ("1/2", "Half of it: \\boxed{0.5}"),
        ("0.5", "so the answer is \\boxed{\\frac{1}{2}}."),
        ("\\frac{1}{2}", "It is 1/2"),
        ("50%", "\\boxed{0.5}"),
        ("0.5", "That is 50% of the cake."),
        ("1,234", "\\boxed{1234}"),
        ("$12.50", "She pays \\boxed{12.5} dollars."),
        ("3\\frac{1}{2}", "\\boxed{3.5}"),
        ("7/4", "\\boxed{\\dfrac{7}{4}}"),
        ("-3", "The temperature drops to \\boxed{-3}"),
        ("2/3", "\\boxed{0.666667}"),  # math-verify rounds to 6 places
    ],
)
def test_equivalent_answers_score_one(answer: str, completion: str) -> None:
    reward = MathReward()
    assert reward(task(answer), completion) == 1.0
    assert (reward.scored, reward.correct, reward.unparsed) == (1, 1, 0)


@pytest.mark.parametrize(
    ("answer", "completion"),
    [
        ("1/2", "\\boxed{0.49}"),
        ("2/3", "\\boxed{0.67}"),
        ("42", "I get \\boxed{41}"),
        ("12", "\\boxed{12}\\boxed{13}"),  # two boxed answers are a set, not 12
        ("7/4", "\\boxed{4/7}"),
    ],
)
def test_different_answers_score_zero(answer: str, completion: str) -> None:
    reward = MathReward()
    assert reward(task(answer), completion) == 0.0
    assert (reward.scored, reward.correct) == (1, 0)


def test_the_boxed_answer_wins_else_the_last_number() -> None:
    reward = MathReward()
    boxed = "First \\boxed{3}, then I wonder about 5 and 8."
    assert (reward(task("3"), boxed), reward(task("8"), boxed)) == (1.0, 0.0)
    plain = "3 apples and 7 more make 10"
    assert (reward(task("10"), plain), reward(task("3"), plain)) == (1.0, 0.0)
    assert [str(x) for x in extract_answer(plain)] == ["10"]
    assert reward(task("10"), "I do not know.") == 0.0
    assert reward.metrics() == {"math_scored": 5.0, "math_unparsed": 0.0, "math_no_answer": 1.0, "math_correct": 2.0}


def test_an_unparseable_reference_scores_zero_and_is_counted() -> None:
    reward = MathReward()
    for answer in ("\\frac{", "", "   ", None, "{"):
        assert reward(task(answer), "\\boxed{1}") == 0.0
    assert reward(task("1"), "\\boxed{1}") == 1.0
    assert (reward.unparsed, reward.scored, reward.correct) == (5, 1, 1)


def test_a_reward_scored_off_the_main_thread_works() -> None:
    # math-verify's timeouts use signal.alarm, which raises outside the main thread.
    reward, got = MathReward(), []
    thread = threading.Thread(target=lambda: got.append(reward(task("1/2"), "\\boxed{0.5}")))
    thread.start()
    thread.join(60)
    assert got == [1.0]


# -- the format reward and the combination -------------------------------------------


@pytest.mark.parametrize(
    ("completion", "ok"),
    [
        ("So 3 + 4 = 7. The answer is \\boxed{7}", True),
        ("The answer is \\boxed{7}.\n", True),
        ("$\\boxed{\\frac{1}{2}}$", True),
        ("\\[\\boxed{7}\\]", True),
        ("The answer is \\boxed{7}. Let me check again: 3 + 4", False),  # the answer does not end it
        ("\\boxed{3} or \\boxed{7}", False),
        ("\\boxed{}", False),
        ("\\boxed{  }", False),
        ("\\boxed{7", False),
        ("\\boxed 7", False),
        ("The answer is 7.", False),
    ],
)
def test_format_rule(completion: str, ok: bool) -> None:
    reward = FormatReward()
    assert well_formatted(completion) is ok
    assert reward(task(None), completion) == float(ok)
    assert reward.metrics() == {"format_scored": 1.0, "format_ok": float(ok)}


def test_math_format_is_a_weighted_sum(tmp_path) -> None:
    reward = MathFormatReward(format_weight=0.25)
    assert reward(task("7"), "3 + 4 = \\boxed{7}") == 1.0
    assert reward(task("7"), "\\boxed{7}, I think, or maybe 8") == 0.75
    assert reward(task("7"), "\\boxed{8}") == 0.25
    assert reward(task("7"), "8") == 0.0
    assert reward.metrics()["format_ok"] == 2.0 and reward.metrics()["math_correct"] == 2.0


# -- through the jsonl dataset ---------------------------------------------------------


def test_jsonl_selects_the_rewards_by_name(tmp_path) -> None:
    path = write(tmp_path, [{"prompt": "Half of 1?", "answer": "1/2"}, {"prompt": "2 + 2?", "answer": 4}])
    half, four = Jsonl(JsonlConfig(path=path, reward="math", shuffle=False)).tasks
    math = Jsonl(JsonlConfig(path=path, reward="math", shuffle=False))
    assert math.reward(half, "\\boxed{0.5}") == 1.0
    assert math.reward(four, "2 + 2 = 4") == 1.0  # a number answer is read as its JSON text
    assert math.reward(four, "\\boxed{5}") == 0.0
    assert math.reward_metrics()["math_scored"] == 3.0
    fmt = Jsonl(JsonlConfig(path=path, reward="format"))
    assert (fmt.reward(half, "\\boxed{9}"), fmt.reward(half, "9")) == (1.0, 0.0)
    both = Jsonl(JsonlConfig(path=path, reward="math_format", format_weight=0.5))
    assert both.reward(half, "0.5") == 0.5
    assert Jsonl(JsonlConfig(path=path, reward="math_format")).reward(half, "0.5") == pytest.approx(0.9)
    by_path = Jsonl(JsonlConfig(path=path, reward="skyrl_datasets.rewards:MathReward"))
    by_path.reward(half, "\\boxed{0.5}")
    by_path.reward(half, "\\boxed{2}")
    assert by_path.reward_metrics() == {"math_scored": 2.0, "math_unparsed": 0.0, "math_no_answer": 0.0, "math_correct": 1.0}


def test_jsonl_counts_an_unparseable_answer_and_goes_on(tmp_path) -> None:
    path = write(tmp_path, [{"prompt": "a", "answer": "\\frac{"}, {"prompt": "b", "answer": "3"}])
    ds = Jsonl(JsonlConfig(path=path, reward="math", shuffle=False))
    bad, good = ds.tasks
    assert [ds.reward(bad, "\\boxed{1}"), ds.reward(good, "\\boxed{3}"), ds.reward(bad, "x")] == [0.0, 1.0, 0.0]
    assert ds.reward_metrics()["math_unparsed"] == 2.0
    assert ds.reward_metrics()["math_scored"] == 1.0
    assert Jsonl(JsonlConfig(path=path, reward="exact")).reward_metrics() == {}


def test_jsonl_math_needs_the_answer_format_does_not(tmp_path) -> None:
    from skyrl_host.errors import UserError

    path = write(tmp_path, [{"prompt": "no answer here"}])
    with pytest.raises(UserError) as info:
        Jsonl(JsonlConfig(path=path, reward="math"))
    assert str(info.value.problems[0]) == f"{path}:1: missing the answer key 'answer' (reward = 'math' needs it)"
    assert Jsonl(JsonlConfig(path=path, reward="format")).reward(Task(prompt="x"), "\\boxed{1}") == 1.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"reward": "math_format", "format_weight": 1.5}, "expected a value in [0, 1], found 1.5"),
        ({"reward": "math", "format_weight": 0.2}, "applies only to reward = 'math_format', found reward = 'math'"),
        ({"reward": "maths"}, "found 'maths' (did you mean 'math'?)"),
    ],
)
def test_bad_math_reward_options_are_rejected_at_validation(tmp_path, options: dict, message: str) -> None:
    path = write(tmp_path, [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ValueError, match=re.escape(message)):
        JsonlConfig(path=path, **options)


def test_discovery_and_creating_the_dataset_import_no_math_verify(tmp_path) -> None:
    path = write(tmp_path, [{"prompt": "a", "answer": "1/2"}])
    code = f"""
import sys
from skyrl_host.plugins import build_host
from skyrl_datasets.jsonl import Jsonl, JsonlConfig
build_host()
ds = Jsonl(JsonlConfig(path={path!r}, reward="math_format"))
before = sorted(m for m in ("math_verify", "sympy", "latex2sympy2_extended") if m in sys.modules)
score = ds.reward(ds.tasks[0], "\\\\boxed{{0.5}}")
print(before, score, "math_verify" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[] 1.0 True"


# -- the example data set ----------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def exact(expr: str) -> Fraction:
    """An arithmetic expression of the solutions (numbers, + - * /, parentheses), exactly."""

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    return ev(ast.parse(expr, mode="eval").body)


def answer_value(answer: str) -> Fraction:
    frac = re.fullmatch(r"\\frac\{(\d+)\}\{(\d+)\}", answer)
    if frac:
        return Fraction(int(frac[1]), int(frac[2]))
    return exact(answer.removesuffix("%"))


def load_generator():
    spec = importlib.util.spec_from_file_location("math_word_problems", ROOT / "examples" / "math_word_problems.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_data_file_is_what_the_generator_writes(tmp_path) -> None:
    gen = load_generator()
    assert gen.render(gen.generate()).encode() == DATA.read_bytes()
    out = tmp_path / "again.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "math_word_problems.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == DATA.read_bytes()
    assert gen.render(gen.generate(seed=14)) != DATA.read_text()


def test_every_answer_checks_by_hand_and_by_the_math_reward() -> None:
    records = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(records) == 200 and len({r["messages"][0]["content"] for r in records}) == 200
    assert len({r["template"] for r in records}) >= 8
    kinds = {"/" in r["answer"] or "frac" in r["answer"] for r in records} | {"%" in r["answer"] for r in records}
    assert kinds == {True, False}
    assert any(r["answer"].isdigit() for r in records) and any("." in r["answer"] for r in records)
    reward = MathReward()
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["user"] and "prompt" not in r
        worked = r["solution"].split(" The answer is")[0]
        steps = [line.split(" = ") for line in worked.removesuffix(".").split(". ")]  # "expr = value. expr = value."
        assert 2 <= len(steps) <= 3, r["solution"]
        for expr, value in steps:
            assert exact(expr) == exact(value), (expr, value, r["solution"])
        truth = exact(steps[-1][1])
        assert answer_value(r["answer"]) == truth, r
        t = Task(prompt=r["messages"][0]["content"], answer=r["answer"])
        right = r["solution"].split(" The answer is")[0] + f" The answer is \\boxed{{{r['answer']}}}."
        wrong = f"The answer is \\boxed{{{float(truth + 1):g}}}."
        assert reward(t, right) == 1.0, r
        assert reward(t, r["solution"]) == 1.0, r
        assert reward(t, wrong) == 0.0, r
        if r["answer"].endswith("%"):  # LaTeX writes the percent sign escaped
            assert reward(t, f"\\boxed{{{r['answer'][:-1]}\\%}}") == 1.0, r
        assert well_formatted(r["solution"])
    assert reward.unparsed == 0 and reward.correct == 400 + sum(r["answer"].endswith("%") for r in records)
