"""A user's ``module:function`` named in a job file (a reward, a score), loaded with
errors that name the job key: the module cannot be imported, lacks the name, or holds
something that cannot be called. A class is made once, with no arguments."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from skyrl_host.errors import Problem, UserError


def load_function(spec: str, key: str) -> Callable[..., Any]:
    """The callable ``spec`` (``"module:attr.path"``) names; a UserError at ``key`` otherwise."""
    module_name, _, path = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(Problem(f"cannot import {module_name!r} of {spec!r}: {exc}", key=key)) from None
    for part in path.split("."):
        if not hasattr(obj, part):
            raise UserError(Problem(f"module {module_name!r} has no attribute {path!r}", key=key))
        obj = getattr(obj, part)
    if isinstance(obj, type):
        try:
            obj = obj()
        except TypeError as exc:
            raise UserError(Problem(f"cannot make {spec!r} with no arguments: {exc}", key=key)) from None
    if not callable(obj):
        raise UserError(Problem(f"{spec!r} is {type(obj).__name__}, not callable", key=key))
    return obj
