"""The plugin manager: discover ``skyrl`` entry points, load them one by one,
honour the block/allow lists, and record what each plugin did or why it failed.

There is no module-global manager: :func:`build_host` makes a new one each time.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import inspect
import os
import sys
import traceback
from typing import Any, Iterable, Mapping

import attrs
import pluggy

from skyrl_host import hookspecs
from skyrl_host.errors import did_you_mean
from skyrl_host.registry import KINDS, Origin, Registration, Registry, make_register

ENTRY_POINT_GROUP = "skyrl"
ENV_DISABLE = "SKYRL_DISABLE_PLUGINS"
ENV_ALLOW = "SKYRL_LOAD_PLUGINS"
ENV_TRACE = "SKYRL_TRACE_HOOKS"


@attrs.define
class PluginRecord:
    """What the host knows about one plugin, loaded or not."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None  # "module:attr" as written in the entry point
    status: str = "loaded"  # "loaded" | "failed" | "blocked"
    error: str | None = None  # one line: "ImportError: No module named 'x'"
    traceback: str | None = None
    hooks: list[str] = attrs.field(factory=list)
    registered: dict[str, list[str]] = attrs.field(factory=dict)

    @property
    def origin(self) -> Origin:
        return Origin(self.name, self.distribution, self.version)

    def describe(self) -> str:
        return str(self.origin)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class SkyrlPluginManager(pluggy.PluginManager):
    """Treats every routine named ``skyrl_*`` as a hook implementation, marked or
    not, so that a misspelled, unmarked hook still fails loudly (as pytest does)."""

    def parse_hookimpl_opts(self, plugin: Any, name: str):  # type: ignore[override]
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(hookspecs.PROJECT + "_"):
            if inspect.isroutine(getattr(plugin, name, None)):
                return {}
        return opts


def _split_env(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {_norm(v) for v in value.split(",") if v.strip()}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def iter_entry_points() -> list[importlib_metadata.EntryPoint]:
    """Every ``skyrl`` entry point once, sorted by (name, distribution, value)."""
    seen: dict[tuple[str, str, str], importlib_metadata.EntryPoint] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.metadata["Name"] if ep.dist is not None else ""
        seen.setdefault((ep.name, _norm(dist or ""), ep.value), ep)
    return [seen[k] for k in sorted(seen)]


class PluginHost:
    """A plugin manager plus the records and registry built from it."""

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = dict(os.environ if env is None else env)
        self.pm = SkyrlPluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._registry: Registry | None = None
        if self.env.get(ENV_TRACE):
            self.pm.trace.root.setwriter(sys.stderr.write)
            self.pm.enable_tracing()

    # -- loading ------------------------------------------------------------

    def is_blocked(self, name: str, distribution: str | None) -> str | None:
        """Why ``name`` must not be imported, or None."""
        names = {_norm(name)} | ({_norm(distribution)} if distribution else set())
        disabled = _split_env(self.env.get(ENV_DISABLE)) or set()
        if names & disabled:
            return f"blocked by {ENV_DISABLE}"
        allowed = _split_env(self.env.get(ENV_ALLOW))
        if allowed is not None and not names & allowed:
            return f"not listed in {ENV_ALLOW}"
        return None

    def load_entry_points(self, entry_points: Iterable[importlib_metadata.EntryPoint] | None = None) -> None:
        """Import and register every entry point, each on its own; failures are recorded."""
        for ep in iter_entry_points() if entry_points is None else entry_points:
            dist = ep.dist.metadata["Name"] if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            record = PluginRecord(ep.name, dist, version, ep.value)
            if ep.name in self.records:
                other = self.records[ep.name]
                record.status = "failed"
                record.error = f"plugin name {ep.name!r} is already used by {other.describe()}"
                self.records[f"{ep.name} ({dist})"] = record
                continue
            self.records[ep.name] = record
            reason = self.is_blocked(ep.name, dist)
            if reason:
                record.status = "blocked"
                record.error = reason
                self.pm.set_blocked(ep.name)
                continue
            try:
                obj = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a plugin must never take the host down
                if isinstance(exc, KeyboardInterrupt):
                    raise
                self._fail(record, exc)
                continue
            self._register_object(obj, record)
        self.check_pending()

    def add_plugin(
        self,
        obj: Any,
        name: str,
        distribution: str | None = None,
        version: str | None = None,
    ) -> PluginRecord:
        """Register an already imported plugin object (a module, class or instance)."""
        if name in self.records and self.records[name].status == "loaded":
            raise ValueError(f"plugin name {name!r} is already used by {self.records[name].describe()}")
        record = PluginRecord(name, distribution, version, None)
        self.records[name] = record
        self._register_object(obj, record)
        self.check_pending()
        return record

    def remove_plugin(self, name: str) -> None:
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        self.records.pop(name, None)
        self._registry = None

    def _register_object(self, obj: Any, record: PluginRecord) -> None:
        try:
            self.pm.register(obj, name=record.name)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._fail(record, exc)
            return
        record.hooks = sorted(h.name for h in self.pm.get_hookcallers(obj) or [])
        self._registry = None

    def _fail(self, record: PluginRecord, exc: BaseException | str) -> None:
        """Mark a plugin failed and take back everything it registered."""
        record.status = "failed"
        if isinstance(exc, BaseException):
            record.error = f"{type(exc).__name__}: {exc}".strip()
            record.traceback = "".join(traceback.format_exception(exc))
        else:
            record.error = exc
        record.registered = {}
        if self.pm.get_plugin(record.name) is not None:
            self.pm.unregister(name=record.name)
        self._registry = None

    def check_pending(self) -> None:
        """Fail every plugin that implements a ``skyrl_*`` hook that does not exist."""
        known = [
            name
            for name in dir(self.pm.hook)
            if name.startswith(hookspecs.PROJECT + "_") and getattr(self.pm.hook, name).has_spec()
        ]
        for name, plugin in list(self.pm.list_name_plugin()):
            bad = [
                caller.name
                for caller in self.pm.get_hookcallers(plugin) or []
                if not caller.has_spec()
                and any(not impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin)
            ]
            if bad and name in self.records:
                hint = "; ".join(f"unknown hook {b!r}{did_you_mean(b, known)}" for b in sorted(bad))
                self._fail(self.records[name], f"PluginValidationError: {hint}")
        self.pm.check_pending()

    # -- registry -----------------------------------------------------------

    @property
    def registry(self) -> Registry:
        """All registrations, built on first use by calling the registration hooks."""
        if self._registry is None:
            self._registry = self._build_registry()
        return self._registry

    def _build_registry(self) -> Registry:
        staged: dict[str, list[Registration]] = {}
        failed: set[str] = set()
        for kind in KINDS.values():
            caller = getattr(self.pm.hook, kind.hook)
            for impl in caller.get_hookimpls():
                name = impl.plugin_name
                if name in failed or name not in self.records:
                    continue
                record = self.records[name]
                sink: list[Registration] = []
                register = make_register(kind.key, record.origin, sink)
                try:
                    self._trace(f"{kind.hook} [{name}]")
                    impl.function(**{arg: register for arg in impl.argnames})
                except Exception as exc:  # noqa: BLE001
                    failed.add(name)
                    self._fail(record, exc)
                    record.error = f"{kind.hook} raised {record.error}"
                    staged.pop(name, None)
                    continue
                staged.setdefault(name, []).extend(sink)
        regs = [r for name, rs in staged.items() if name not in failed for r in rs]
        for record in self.records.values():
            record.registered = {}
        for reg in regs:
            self.records[reg.origin.plugin].registered.setdefault(reg.kind, []).append(reg.name)
        return Registry(regs)

    def add_commands(self, cli: Any) -> None:
        """Call ``skyrl_register_commands`` plugin by plugin; a plugin that raises or
        replaces an existing command is marked failed and its commands removed."""
        for impl in list(self.pm.hook.skyrl_register_commands.get_hookimpls()):
            record = self.records.get(impl.plugin_name)
            if record is None or record.status != "loaded":
                continue
            before = dict(cli.commands)
            try:
                self._trace(f"skyrl_register_commands [{record.name}]")
                impl.function(**{arg: cli for arg in impl.argnames})
                replaced = [n for n, c in before.items() if cli.commands.get(n) is not c]
                if replaced:
                    raise ValueError(f"command {replaced[0]!r} already exists")
            except Exception as exc:  # noqa: BLE001
                cli.commands.clear()
                cli.commands.update(before)
                self._fail(record, exc)
                record.error = f"skyrl_register_commands raised {record.error}"

    def _trace(self, text: str) -> None:
        if self.env.get(ENV_TRACE):
            sys.stderr.write(f"skyrl hook: {text}\n")

    # -- queries ------------------------------------------------------------

    def failures(self) -> list[PluginRecord]:
        return [r for r in self.records.values() if r.status == "failed"]

    def get(self, kind: str, name: str) -> Registration:
        """Like :meth:`Registry.get`, but an unknown name also names the plugin
        that failed to load and would have provided it."""
        from skyrl_host.errors import UserError

        got = self.registry.lookup(kind, name)
        if got is None:
            raise UserError(self.unknown_message(kind, name))
        return self.registry.get(kind, name)

    def unknown_message(self, kind: str, name: Any) -> str:
        msg = self.registry.unknown_message(kind, name)
        same = [
            r for r in self.records.values() if r.status != "loaded" and _norm(r.name) == _norm(str(name))
        ]
        if same:
            r = same[0]
            why = "which failed to load: " if r.status == "failed" else "which is "
            hint = " (run `skyrl plugins --all` for details)" if r.status == "failed" else ""
            return f"{KINDS[kind].noun} {name!r} would come from {r.describe()}, {why}{r.error}{hint}"
        failed = self.failures()
        if failed:
            msg += "; plugins that failed to load and may provide it: " + ", ".join(
                f"{r.describe()}: {r.error}" for r in failed
            )
        return msg

    def plugin_distributions(self) -> list[tuple[str, str]]:
        """(distribution, version) of every distribution that provides plugins."""
        seen = {(r.distribution, r.version) for r in self.records.values() if r.distribution}
        return sorted(seen)  # type: ignore[arg-type]


def build_host(
    *,
    entry_points: bool | Iterable[importlib_metadata.EntryPoint] = True,
    env: Mapping[str, str] | None = None,
) -> PluginHost:
    """Make a new host and load the installed plugins (or the given entry points)."""
    host = PluginHost(env=env)
    if entry_points is True:
        host.load_entry_points()
    elif entry_points:
        host.load_entry_points(entry_points)
    return host
