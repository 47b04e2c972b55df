"""Typed registries filled by the registration hooks.

Every registered name records its factory, its attrs config class, a one-line
description and its origin (plugin, distribution, version). A name registered by
two plugins within one kind is a conflict, resolved only when exactly one of them
said ``override=True``; a job that uses a conflicting name gets an error naming
both plugins.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping, Protocol

import attrs

from skyrl_host.contracts import check_product
from skyrl_host.errors import UserError, did_you_mean, quoted_list
from skyrl_host.kinds import EVAL_TABLE, KINDS, SLOT_KINDS, TEACHER_TABLE
from skyrl_host.sections import HOST_JOB_KEYS


_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")


@attrs.frozen
class Origin:
    """Where a registration came from."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.distribution:
            return f"plugin {self.plugin!r} ({self.distribution} {self.version})"
        return f"plugin {self.plugin!r}"


@attrs.frozen
class Registration:
    """One registered name of one kind."""

    kind: str
    name: str
    factory: Callable[..., Any]
    config: type | None
    description: str
    origin: Origin
    override: bool = False
    slots: Mapping[str, Any] = attrs.field(factory=dict)  # job kinds only
    # Job-level consistency check: check(spec) -> [(key path, message), ...]; run by
    # load_job once every plugin is resolved (skyrl validate, skyrl run).
    check: Callable[[Any], Any] | None = None
    # For a table that names no plugin: claims(table) -> (priority, why) or None. The host
    # picks the highest claim (e.g. a [model] table with only a path: the family that
    # covers its config.json's model_type).
    claims: Callable[[Mapping[str, Any]], Any] | None = None
    # What other plugins may know of it from its config: traits(config) -> its kind's
    # traits class (skyrl_host.interfaces: ModelTraits, EngineTraits, ...).
    traits: Callable[[Any], Any] | None = None

    def create(self, *args: Any, **kwargs: Any) -> Any:
        """Call the factory (this is where heavy imports may happen); its product is
        checked against the kind's Protocol (a UserError naming what it lacks)."""
        return check_product(self, self.factory(*args, **kwargs))


class Register(Protocol):
    """The ``register`` callable each registration hook receives."""

    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        config: type | None = None,
        description: str,
        override: bool = False,
        slots: Mapping[str, Any] | None = None,
        check: Callable[[Any], Any] | None = None,
        claims: Callable[[Mapping[str, Any]], Any] | None = None,
        traits: Callable[[Any], Any] | None = None,
    ) -> None: ...


def make_register(kind: str, origin: Origin, sink: list[Registration]) -> Register:
    """A ``register`` callable that validates its arguments and appends to ``sink``."""

    def register(
        name: str,
        factory: Callable[..., Any],
        *,
        config: type | None = None,
        description: str,
        override: bool = False,
        slots: Mapping[str, Any] | None = None,
        check: Callable[[Any], Any] | None = None,
        claims: Callable[[Mapping[str, Any]], Any] | None = None,
        traits: Callable[[Any], Any] | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"invalid {KINDS[kind].noun} name {name!r}: use letters, digits, '_', '-', '.'")
        if not callable(factory):
            raise TypeError(f"{KINDS[kind].noun} {name!r}: factory must be callable, got {factory!r}")
        if config is not None and not attrs.has(config):
            raise TypeError(f"{KINDS[kind].noun} {name!r}: config must be an attrs class, got {config!r}")
        if not isinstance(description, str) or not description.strip() or "\n" in description.strip():
            raise ValueError(f"{KINDS[kind].noun} {name!r}: description must be one non-empty line")
        if check is not None and not callable(check):
            raise TypeError(f"{KINDS[kind].noun} {name!r}: check must be callable, got {check!r}")
        if claims is not None and not callable(claims):
            raise TypeError(f"{KINDS[kind].noun} {name!r}: claims must be callable, got {claims!r}")
        if traits is not None and (KINDS[kind].traits is None or not callable(traits)):
            raise TypeError(f"{KINDS[kind].noun} {name!r}: traits must be a callable, for a kind that has traits "
                            f"({quoted_list(k.key for k in KINDS.values() if k.traits is not None)}), got {traits!r}")
        if slots is not None and kind != "jobs":
            raise TypeError(f"{KINDS[kind].noun} {name!r}: only job kinds take slots")
        if kind == "jobs":
            _check_job_kind(name, config, slots or {})
        sink.append(
            Registration(
                kind=kind,
                name=name,
                factory=factory,
                config=config,
                description=description.strip(),
                origin=origin,
                override=bool(override),
                slots=dict(slots or {}),
                check=check,
                claims=claims,
                traits=traits,
            )
        )

    register.__qualname__ = "register"  # error messages read "register() missing ..."
    return register


def _check_job_kind(name: str, config: type | None, slots: Mapping[str, str | None]) -> None:
    for table, default in slots.items():
        if table in (EVAL_TABLE, TEACHER_TABLE):
            if default is not None:
                raise TypeError(f"job kind {name!r}: slot {table!r} takes None (the table is never required)")
            continue
        if table not in SLOT_KINDS:
            raise ValueError(
                f"job kind {name!r}: unknown slot table {table!r}{did_you_mean(table, SLOT_KINDS)}; "
                f"tables: {quoted_list(SLOT_KINDS)}"
            )
        if SLOT_KINDS[table].many and default is not None:
            if not (isinstance(default, (list, tuple)) and all(isinstance(d, str) for d in default)):
                raise TypeError(f"job kind {name!r}: the default of slot {table!r} must be a list of names or None")
        elif default is not None and not isinstance(default, str):
            raise TypeError(f"job kind {name!r}: the default of slot {table!r} must be a name or None")
    if config is not None:
        clash = sorted(set(HOST_JOB_KEYS) & {f.name for f in attrs.fields(config)})
        if clash:
            raise ValueError(f"job kind {name!r}: config key {clash[0]!r} is owned by the host's [job] table")


@attrs.frozen
class Conflict:
    kind: str
    name: str
    candidates: tuple[Registration, ...]

    def message(self) -> str:
        noun = KINDS[self.kind].noun
        names = [str(r.origin) for r in self.candidates]
        who = ", ".join(names[:-1]) + " and " + names[-1]
        n_override = sum(r.override for r in self.candidates)
        why = "none passes override=True" if n_override == 0 else f"{n_override} pass override=True"
        if len(self.candidates) == 2:
            why = {0: "neither passes override=True", 2: "both pass override=True"}[n_override]
        return (
            f"{noun} {self.name!r} is registered by {who} and {why}; block all but one with "
            f"SKYRL_DISABLE_PLUGINS, or let exactly one register with override=True"
        )


class Registry:
    """Names per kind, resolved from every plugin's registrations."""

    def __init__(self, registrations: Iterable[Registration] = ()):
        self._candidates: dict[str, dict[str, list[Registration]]] = {k: {} for k in KINDS}
        for reg in registrations:
            self._candidates[reg.kind].setdefault(reg.name, []).append(reg)

    def _resolve(self, kind: str, name: str) -> Registration | Conflict | None:
        regs = self._candidates[kind].get(name)
        if not regs:
            return None
        if len(regs) == 1:
            return regs[0]
        overriding = [r for r in regs if r.override]
        if len(overriding) == 1:
            return overriding[0]
        return Conflict(kind, name, tuple(regs))

    def names(self, kind: str) -> list[str]:
        return sorted(self._candidates[kind])

    def entries(self, kind: str) -> list[Registration]:
        """The winning registration of every name (conflicts left out)."""
        out = []
        for name in self.names(kind):
            got = self._resolve(kind, name)
            if isinstance(got, Registration):
                out.append(got)
        return out

    def all_registrations(self) -> list[Registration]:
        return [r for kind in KINDS for regs in self._candidates[kind].values() for r in regs]

    def conflicts(self) -> list[Conflict]:
        out = []
        for kind in KINDS:
            for name in self.names(kind):
                got = self._resolve(kind, name)
                if isinstance(got, Conflict):
                    out.append(got)
        return out

    def overridden(self) -> list[tuple[Registration, Registration]]:
        """(winner, loser) pairs of resolved overrides."""
        pairs = []
        for kind in KINDS:
            for name in self.names(kind):
                got = self._resolve(kind, name)
                if isinstance(got, Registration):
                    pairs += [(got, r) for r in self._candidates[kind][name] if r is not got]
        return pairs

    def lookup(self, kind: str, name: str) -> Registration | Conflict | None:
        return self._resolve(kind, name)

    def get(self, kind: str, name: str) -> Registration:
        """The registration of ``name``, or a :class:`UserError` saying what exists."""
        got = self._resolve(kind, name)
        if isinstance(got, Registration):
            return got
        if isinstance(got, Conflict):
            raise UserError(got.message())
        raise UserError(self.unknown_message(kind, name))

    def unknown_message(self, kind: str, name: Any) -> str:
        noun = KINDS[kind].noun
        names = self.names(kind)
        return f"unknown {noun} {name!r}{did_you_mean(name, names)}; available: {quoted_list(names)}"
