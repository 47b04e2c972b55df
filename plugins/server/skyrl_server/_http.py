"""Reading JSON request bodies: one-line 400s for what does not parse or has the wrong type."""

from __future__ import annotations

import json
from typing import Any, Mapping

from skyrl_server._errors import BadRequest


def _body_json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
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
    return value
