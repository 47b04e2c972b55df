"""How plugin config classes are validated: attrs validators, method validators,
cross-field checks, converters and factories."""

from __future__ import annotations

import attrs
import pytest

from skyrl_host.config import OptionError, Located, explain_class, gt, in_interval, option, structure_table


@attrs.frozen
class Quant:
    block_size: int = attrs.field(default=128, validator=attrs.validators.in_([64, 128]))
    scale: float = option(1.0, help="scale", validator=gt(0))
    name: str = attrs.field(default="fp8", validator=attrs.validators.matches_re(r"[a-z0-9]+"))
    groups: list[int] = attrs.field(factory=lambda: [32])
    low: int = option(0, help="low")
    high: int = option(10, help="high", validator=in_interval(0, 100))

    @groups.validator
    def _groups(self, attribute, value):
        if any(g <= 0 for g in value) or value != sorted(value):
            raise ValueError(f"expected increasing positive sizes, found {value!r}")

    def __attrs_post_init__(self):
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")


def check(data):
    out = Located("job.toml", {})
    inst = structure_table(Quant, data, "precision", out, skip=["name_"])
    return inst, [f"{p.key}: {p.message}" for p in out.problems]


def test_valid_table_with_defaults() -> None:
    inst, problems = check({"block_size": 64, "groups": [16, 32]})
    assert problems == []
    assert inst == Quant(block_size=64, groups=[16, 32])


def test_attrs_builtin_validators_give_their_sentence_not_a_tuple() -> None:
    _, problems = check({"block_size": 96, "name": "FP8!"})
    assert problems[0] == "precision.block_size: 'block_size' must be in [64, 128] (got 96)"
    assert problems[1].startswith("precision.name: 'name' must match regex '[a-z0-9]+' ('FP8!' doesn't)")


def test_every_field_validator_runs_and_cross_checks_wait_for_valid_fields() -> None:
    _, problems = check({"scale": -1.0, "groups": [32, 16], "low": 50, "high": 200})
    assert problems == [
        "precision.scale: expected a value > 0, found -1.0",
        "precision.groups: expected increasing positive sizes, found [32, 16]",
        "precision.high: expected a value in [0, 100], found 200",
    ]
    _, problems = check({"low": 50, "high": 20})
    assert problems == ["precision: low (50) must not exceed high (20)"]


def test_explain_lists_defaults_from_factories_and_bounds() -> None:
    docs = {d.key: d for d in explain_class(Quant, "precision", "test")}
    assert docs["precision.groups"].default == "[32]"
    assert docs["precision.groups"].type == "an array of integers"
    assert docs["precision.scale"].help == "scale (> 0)"
    assert docs["precision.high"].help == "high (in [0, 100])"
    assert docs["precision.block_size"].default == "128"


@attrs.frozen
class Lists:
    ops: list[str] = option(factory=lambda: ["+"], help="operations")
    pair: tuple[int, int] = option((1, 2), help="two integers")
    sizes: tuple[int, ...] = option((), help="any number of integers")


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"ops": "+-"}, "lists.ops: expected an array of strings, found string '+-'"),
        ({"ops": {"a": 1}}, "lists.ops: expected an array of strings, found a table"),
        ({"ops": ["+", 1]}, "lists.ops: expected an array of strings, found array ['+', 1]"),
        ({"pair": [1, 2, 3]}, "lists.pair: expected an array of integers, found array [1, 2, 3]"),
        ({"sizes": [1, 2.5]}, "lists.sizes: expected an array of integers, found array [1, 2.5]"),
    ],
)
def test_arrays_are_never_made_from_strings_or_tables(data, problem) -> None:
    out = Located("job.toml", {})
    assert structure_table(Lists, data, "lists", out) is None
    assert [f"{p.key}: {p.message}" for p in out.problems] == [problem]


def test_arrays_structure_to_their_types() -> None:
    out = Located("job.toml", {})
    inst = structure_table(Lists, {"ops": ["+", "*"], "pair": [3, 4], "sizes": [1, 2, 3]}, "lists", out)
    assert inst == Lists(ops=["+", "*"], pair=(3, 4), sizes=(1, 2, 3))


def test_option_error_locates_a_cross_field_problem_at_its_key() -> None:
    @attrs.frozen
    class Range:
        low: int = option(0, help="low")
        high: int = option(1, help="high")

        def __attrs_post_init__(self):
            if self.low > self.high:
                raise OptionError("low", f"expected at most high ({self.high}), found {self.low}")

    out = Located("job.toml", {"range.low": 3, "range": 2})
    assert structure_table(Range, {"low": 5, "high": 1}, "range", out) is None
    assert [str(p) for p in out.problems] == ["job.toml:3: range.low: expected at most high (1), found 5"]
