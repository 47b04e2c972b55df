"""The plugin author's face of job-file options: documented attrs fields and readable
validators. A plugin's config class is an attrs class whose fields come from
:func:`option`; ``skyrl validate --explain`` shows each field's help and bounds.

    @attrs.frozen
    class MyConfig:
        clip: float = option(0.2, help="PPO clip range", validator=in_interval(0, 1, low_open=True))
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

__all__ = ["option", "OptionError", "gt", "ge", "lt", "le", "in_interval"]



def option(default: Any = attrs.NOTHING, *, help: str, validator: Any = None, factory: Any = None) -> Any:
    """An attrs field with a description shown by ``skyrl validate --explain``."""
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata={"help": help})
    return attrs.field(default=default, validator=validator, metadata={"help": help})


class OptionError(ValueError):
    """Raise from ``__attrs_post_init__`` to locate a cross-field problem at a key:
    ``raise OptionError("min_len", "must not exceed max_len (5), found 9")``."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _bound(op: str, limit: float, test: Callable[[Any], bool]) -> Callable[[Any, Any, Any], None]:
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value is not None and not test(value):
            raise ValueError(f"expected a value {op} {limit}, found {value!r}")

    check.__doc__ = f"{op} {limit}"
    return check


def gt(limit: float) -> Callable[[Any, Any, Any], None]:
    return _bound(">", limit, lambda v: v > limit)


def ge(limit: float) -> Callable[[Any, Any, Any], None]:
    return _bound(">=", limit, lambda v: v >= limit)


def lt(limit: float) -> Callable[[Any, Any, Any], None]:
    return _bound("<", limit, lambda v: v < limit)


def le(limit: float) -> Callable[[Any, Any, Any], None]:
    return _bound("<=", limit, lambda v: v <= limit)


def gt_le(low: float, high: float) -> Callable[[Any, Any, Any], None]:
    """``low < value <= high``, each end with its own message (a count that must be positive
    and stay below what would hang or overflow a run)."""
    above, below = gt(low), le(high)

    def check(inst: Any, attr: Any, value: Any) -> None:
        above(inst, attr, value)
        below(inst, attr, value)

    check.__doc__ = f"> {low}, <= {high}"
    return check


def in_interval(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[..., None]:
    """``low <= value <= high``, with either end open: ``in_interval(0, 1, low_open=True)`` is (0, 1]."""
    text = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if value is None:
            return
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if not (ok_low and ok_high):
            raise ValueError(f"expected a value in {text}, found {value!r}")

    check.__doc__ = f"in {text}"
    return check
