"""Reading JSON request bodies: one-line 400s for what does not parse or has the wrong type."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from skyrl_server._errors import BadRequest


def _no_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def _body_json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}", parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
    except RecursionError:
        raise BadRequest("the body is JSON nested too deep") from None
    if not isinstance(value, dict):
        raise BadRequest("the body must be a JSON object")
    return value


def _get(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, required: bool = True, default: Any = None) -> Any:
    if key not in body or body[key] is None:
        if required:
            raise BadRequest(f"{key}: missing")
        return default
    value = body[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise BadRequest(f"{key}: expected {getattr(kind, '__name__', kind)}, found a boolean")
    if float in (kind if isinstance(kind, tuple) else (kind,)) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind):
        names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise BadRequest(f"{key}: expected {names}, found {type(value).__name__}")
    # Numbers reach tensors, stores and generators: a 64-bit integer, a finite float.
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        raise BadRequest(f"{key}: {value} does not fit a 64-bit integer")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"{key}: expected a finite number, found {value}")
    return value
