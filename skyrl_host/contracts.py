"""Checking plugins against their contracts when a job is built.

Every factory's product is checked against its kind's Protocol
(:data:`skyrl_host.kinds.PROTOCOLS`) as it is made, and code that needs a capability
(a Protocol of :mod:`skyrl_host.interfaces`) says so with :func:`require` before it
uses it. A plugin that lacks a member is a :class:`~skyrl_host.errors.UserError`
naming the plugin, the Protocol and the missing members, raised before the job
starts, instead of an AttributeError half-way through a run.
"""

from __future__ import annotations

from typing import Any, Protocol

from skyrl_host.errors import UserError
from skyrl_host.kinds import KINDS

_PROTOCOL_INTERNALS = {"_is_protocol", "_is_runtime_protocol", "__init__", "__subclasshook__", "__protocol_attrs__",
                       "__non_callable_proto_members__", "__parameters__", "__abstractmethods__"}


def members(protocol: type) -> list[str]:
    """The names a Protocol declares (methods and annotated attributes), its bases' too."""
    names: list[str] = []
    for base in protocol.__mro__:
        if base in (object, Protocol) or base.__name__ == "Generic":
            continue
        for name in list(base.__dict__.get("__annotations__", {})) + list(base.__dict__):
            if name.startswith("__") and name.endswith("__") or name in _PROTOCOL_INTERNALS:
                continue
            if name.startswith("_abc_") or name in names:
                continue
            names.append(name)
    return names


def missing(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (methods must be callable)."""
    out = []
    for name in members(protocol):
        declared = protocol.__dict__.get(name, None)
        for base in protocol.__mro__:
            if name in base.__dict__:
                declared = base.__dict__[name]
                break
        try:
            value = getattr(obj, name)
        except AttributeError:
            out.append(name)
            continue
        if callable(declared) and not callable(value):
            out.append(name)
    return out


def has(obj: Any, protocol: type) -> bool:
    """Whether ``obj`` offers every member of the capability ``protocol``."""
    return obj is not None and not missing(obj, protocol)


def shares_trainer_tensors(engine: Any, backend: Any) -> bool:
    """Whether ``engine`` serves the very tensors ``backend`` trains (one process, the
    engine sharing the loaded model, a backend that trains it in place)."""
    from skyrl_host.interfaces import OwnWeights, SharedWeights

    return (has(engine, SharedWeights) and bool(engine.shares_weights)
            and not (has(backend, OwnWeights) and backend.owns_weights))


def receives_in_workers(engine: Any) -> bool:
    """Whether ``engine``'s own worker processes run a transport's receiving half (as
    configured now: :class:`skyrl_host.interfaces.WorkerReceiving`)."""
    from skyrl_host.interfaces import WorkerReceiving

    return has(engine, WorkerReceiving) and bool(engine.receives_in_workers)


def require(obj: Any, protocol: type, *, who: str, needed_by: str) -> Any:
    """``obj``, once checked to offer ``protocol``; else a UserError such as
    ``engine 'x' (plugin 'p' (dist 1.0)) lacks the AdapterServing capability
    (update_adapter), which transport 'lora' needs``."""
    lacking = missing(obj, protocol)
    if lacking:
        raise UserError(f"{who} lacks the {protocol.__name__} capability ({', '.join(lacking)}), which {needed_by} needs")
    return obj


def check_product(registration: Any, obj: Any) -> Any:
    """``obj`` (what ``registration``'s factory returned), once checked against its
    kind's Protocol; else a UserError naming the plugin and what it lacks."""
    kind = KINDS[registration.kind]
    lacking = missing(obj, kind.protocol)
    if lacking:
        raise UserError(
            f"{kind.noun} {registration.name!r} ({registration.origin}) does not implement "
            f"{kind.protocol.__name__}: its factory returned {type(obj).__name__!s}, which lacks {', '.join(lacking)}"
        )
    return obj


def describe(choice: Any) -> str:
    """How messages name a selected plugin: ``engine 'vllm' (plugin 'vllm' (skyrl-engines 0.1.0))``."""
    reg = choice.registration if hasattr(choice, "registration") else choice
    return f"{KINDS[reg.kind].noun} {reg.name!r} ({reg.origin})"
