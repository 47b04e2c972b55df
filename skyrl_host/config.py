"""Job files: TOML -> attrs classes, each plugin validating its own table.

The host owns ``[job]`` (kind, seed, steps, output_dir, name), ``[cluster]`` and
the keys that select plugins (``[model] family``, ``[engine] name``, ...). The
selected plugin's attrs config class validates the rest of its table; the job
kind's config class validates the rest of ``[job]``.

Every problem is collected, located (file, dotted key path, line) and reported at
once as a :class:`~skyrl_host.errors.UserError`.
"""

from __future__ import annotations

import collections.abc
import math
import pathlib
import re
import tomllib
import types
import typing
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import attrs
import cattrs

from skyrl_host.errors import Problem, UserError, did_you_mean, quoted_list
from skyrl_host.kinds import EVAL_TABLE, KINDS, SLOT_KINDS, TEACHER_TABLE
from skyrl_host.options import OptionError, ge, gt, in_interval, le, lt, option  # noqa: F401 - the old home of these names
from skyrl_host.registry import Registration
from skyrl_host.sections import (
    HOST_CLUSTER_KEYS,
    HOST_EVAL_KEYS,
    HOST_JOB_KEYS,
    HOST_TEACHER_KEYS,
    ClusterSection,
    EvalSection,
    JobSection,
    TeacherSection,
)

if typing.TYPE_CHECKING:  # pragma: no cover
    from skyrl_host.plugins import PluginHost


@attrs.frozen
class Slot:
    """A table of the job file that selects a plugin of one kind (a row of the kind
    table, seen from the job file)."""

    table: str
    kind: str
    selector: str
    many: bool = False  # selector takes a list of names, each with its own sub-table


SLOTS: dict[str, Slot] = {t: Slot(t, k.key, k.selector, k.many) for t, k in SLOT_KINDS.items()}
LAUNCHER = KINDS["launchers"]
OBSERVERS = Slot("observers", "observers", KINDS["observers"].selector, many=True)  # every job kind's
EVAL = Slot(EVAL_TABLE, "datasets", "name")  # the evaluation's dataset, beside the host's keys of [eval]
TEACHER = Slot(TEACHER_TABLE, "models", "family")  # the teacher's model family, beside [teacher]'s host keys
# Tables of the host's keys beside one plugin of another kind's: (slot, host keys class, its keys, what it is).
HOSTED: Mapping[str, tuple[Slot, type, tuple[str, ...], str]] = {
    EVAL_TABLE: (EVAL, EvalSection, HOST_EVAL_KEYS, "evaluate"),
    TEACHER_TABLE: (TEACHER, TeacherSection, HOST_TEACHER_KEYS, "distil from a teacher"),
}
HOST_TABLES = ("job", "cluster", "observers", EVAL_TABLE, TEACHER_TABLE)
PLUGIN_TABLES: dict[str, Slot] = {**SLOTS, OBSERVERS.table: OBSERVERS, EVAL.table: EVAL, TEACHER.table: TEACHER}

# Keys of [job] that moved to [observers] (old name -> observer, its key there; None: the
# switch that lists the observer). Still read, with a notice; to be refused in a later release.
MOVED_JOB_KEYS: Mapping[str, tuple[str, str | None]] = {
    "tensorboard": ("tensorboard", None),
    "wandb": ("wandb", None),
    "wandb_project": ("wandb", "project"),
    "wandb_mode": ("wandb", "mode"),
    "mlflow": ("mlflow", None),
    "mlflow_tracking_uri": ("mlflow", "tracking_uri"),
    "mlflow_experiment": ("mlflow", "experiment"),
}


@attrs.frozen
class PluginChoice:
    """A plugin selected by a job file, with its validated configuration."""

    slot: str
    registration: Registration
    config: Any
    chosen_by: str | None = None  # why the host chose it for a table that names none (``claims``)

    @property
    def name(self) -> str:
        return self.registration.name

    def create(self, *args: Any, **kwargs: Any) -> Any:
        """Call the plugin's factory with its config (heavy imports happen here)."""
        return self.registration.create(self.config, *args, **kwargs)

    @property
    def traits(self) -> Any:
        """What other plugins may know of this one (its kind's traits class of
        :mod:`skyrl_host.interfaces`, as the plugin declared it with ``register(...,
        traits=)``, else the class's defaults). A declaration that fails or returns
        another class is a UserError naming the plugin (``skyrl validate`` reports it)."""
        kind = KINDS[self.registration.kind]
        if kind.traits is None:
            raise AttributeError(f"{kind.noun}s have no traits")
        declare = self.registration.traits
        if declare is None:
            return kind.traits()
        who = f"{kind.noun} {self.registration.name!r} ({self.registration.origin})"
        try:
            value = declare(self.config)
        except Exception as exc:  # noqa: BLE001 - the plugin's declaration, reported as its fault
            raise UserError(f"{who} declares its traits wrongly: {exc!r}") from None
        if not isinstance(value, kind.traits):
            raise UserError(f"{who} declares its traits as {type(value).__name__}, not {kind.traits.__name__}")
        return value


@attrs.frozen
class JobSpec:
    """A validated job file with every plugin resolved."""

    path: pathlib.Path
    job: JobSection
    kind: Registration
    kind_config: Any
    cluster: ClusterSection
    plugins: Mapping[str, PluginChoice | tuple[PluginChoice, ...]]
    raw: Mapping[str, Any]
    launcher: PluginChoice | None = None  # [cluster] launcher, with its own keys of [cluster]
    eval: EvalSection | None = None  # [eval]'s host keys (its dataset: plugins["eval"]); None: no evaluation
    teacher: TeacherSection | None = None  # [teacher]'s host keys (its model family: plugins["teacher"])
    # Where each key path sits in the file, and which came from --set (for error()).
    lines: Mapping[str, int] = attrs.field(factory=dict, eq=False, repr=False)
    overridden: Mapping[str, str] = attrs.field(factory=dict, eq=False, repr=False)
    notices: tuple[str, ...] = attrs.field(default=(), eq=False)  # e.g. a key that moved (the CLI prints them)

    def error(self, key: str, message: str) -> UserError:
        """A UserError about ``key`` located as ``skyrl validate``'s are (the file and the
        line of the key, or the ``--set`` that gave it its value), for problems a driver
        finds when it runs (a corpus that does not open, ...)."""
        out = Located(str(self.path), self.lines, self.overridden)
        out.add(key, message)
        return UserError(out.problems)

    @property
    def name(self) -> str:
        return self.job.name or self.path.stem

    @property
    def output_dir(self) -> pathlib.Path:
        if self.job.output_dir:
            return pathlib.Path(self.job.output_dir)
        return pathlib.Path("runs") / self.name

    def choices(self) -> list[PluginChoice]:
        out: list[PluginChoice] = []
        for value in self.plugins.values():
            out += list(value) if isinstance(value, tuple) else [value]
        return out


# ---------------------------------------------------------------------------
# Reading TOML, with line numbers for key paths.
# ---------------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY_PART = r"(?:[A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')"
_KEY = re.compile(rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*")
_ASSIGN = re.compile(rf"^\s*({_KEY.pattern})\s*=")


def _split_dotted(key: str) -> list[str]:
    parts = re.findall(r"\"[^\"]*\"|'[^']*'|[^.\s]+", key)
    return [p[1:-1] if p[:1] in "\"'" else p for p in parts]


def locate_keys(text: str) -> dict[str, int]:
    """Map dotted key paths (and table paths) to the line where they appear."""
    lines: dict[str, int] = {}
    table: list[str] = []
    value: tuple[str | None, int] = (None, 0)  # a value that goes on: open multi-line string, bracket depth
    for lineno, line in enumerate(text.splitlines(), 1):
        if value != (None, 0):
            value = _scan_value(line, value)
            continue
        header = _HEADER.match(line)
        if header:
            table = _split_dotted(header.group(1))
            lines.setdefault(".".join(table), lineno)
            continue
        assign = _ASSIGN.match(line)
        if assign:
            path = ".".join(table + _split_dotted(assign.group(1)))
            lines.setdefault(path, lineno)
            value = _scan_value(line[assign.end() :], (None, 0))
    return lines


def _scan_value(text: str, state: tuple[str | None, int]) -> tuple[str | None, int]:
    """Carry (open multi-line string delimiter, array/inline-table depth) of a
    TOML value over one more line, skipping strings and comments."""
    quote, depth = state
    i = 0
    while i < len(text):
        if quote:
            if text[i] == "\\" and quote[0] == '"':
                i += 2
            elif text.startswith(quote, i):
                i, quote = i + len(quote), None
            else:
                i += 1
            continue
        if text[i] == "#":
            break
        if text[i] in "\"'":
            quote = text[i] * 3 if text.startswith(text[i] * 3, i) else text[i]
            i += len(quote)
            continue
        depth += (text[i] in "[{") - (text[i] in "]}")
        i += 1
    return (quote if quote and len(quote) == 3 else None), depth


def parse_override(text: str) -> tuple[list[str], Any]:
    """``key.path=value`` -> (path, value); the value is parsed as a TOML value,
    falling back to a plain string for bare words (``cluster.launcher=ray``)."""
    if "=" not in text:
        raise UserError(Problem(f"expected KEY.PATH=VALUE, found {text!r}", file="--set"))
    key, _, value = text.partition("=")
    path = _split_dotted(key.strip())
    if not _KEY.fullmatch(key.strip()) or not all(path):
        raise UserError(Problem(f"expected KEY.PATH=VALUE, found {text!r}", file="--set"))
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return path, parsed


def apply_overrides(
    data: dict[str, Any], overrides: Sequence[str], sources: dict[str, str] | None = None
) -> list[Problem]:
    """Apply ``--set`` overrides to ``data``. ``sources``, when given, receives the
    dotted path of every key (and new table) set, mapped to the override's text."""
    problems: list[Problem] = []
    sources = {} if sources is None else sources
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            if part not in node:
                sources[".".join(path[: i + 1])] = text.strip()
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(
                    Problem(f"{'.'.join(path[: i + 1])} is {_found(child)}, not a table", file="--set", key=".".join(path))
                )
                break
            node = child
        else:
            node[path[-1]] = value
            sources[".".join(path)] = text.strip()
    return problems


def read_toml(path: str | pathlib.Path) -> tuple[dict[str, Any], str]:
    p = pathlib.Path(path)
    if not p.exists():
        raise UserError(Problem("no such job file", file=str(path)))
    if p.is_dir():
        raise UserError(Problem("is a folder, expected a TOML job file", file=str(path)))
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark some editors write is not TOML
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(Problem(f"cannot read: {exc}", file=str(path))) from None
    try:
        return tomllib.loads(text), text
    except RecursionError:
        raise UserError(Problem("invalid TOML: arrays or tables nested too deep", file=str(path))) from None
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        line = int(m.group(1)) if m else None
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", msg)
        if m:
            msg += f" (column {m.group(2)})"
        raise UserError(Problem(f"invalid TOML: {msg}", file=str(path), line=line)) from None


# ---------------------------------------------------------------------------
# Strict structuring of values into attrs classes.
# ---------------------------------------------------------------------------


def _found(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return f"array {value!r}"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value!r}"


def describe_type(tp: Any) -> str:
    """Human words for a type annotation."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return "any value"
    if tp is bool:
        return "a boolean"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is pathlib.Path:
        return "a path (string)"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(parts)
    if origin in (list, tuple, Sequence, typing.Sequence) or tp in (list, tuple):
        inner = describe_type(args[0]) if args else "any value"
        return f"an array of {inner.removeprefix('a ').removeprefix('an ')}s" if args else "an array"
    if origin in (dict, Mapping) or tp is dict:
        return "a table"
    if attrs.has(tp):
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _strict(check: Callable[[Any], bool], convert: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(value: Any, _tp: Any) -> Any:
        if not check(value):
            raise TypeError("mismatch")
        return convert(value)

    return hook


def make_converter() -> cattrs.Converter:
    """A cattrs converter that never coerces: "1" is not an int, 1.5 is not an int."""
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_structure_hook(bool, _strict(lambda v: isinstance(v, bool), bool))
    # Numbers reach tensors, seeds and loops: an int fits 64 bits, a float is finite.
    conv.register_structure_hook(int, _strict(lambda v: isinstance(v, int) and not isinstance(v, bool)
                                              and -(2**63) <= v < 2**63, int))
    conv.register_structure_hook(
        float, _strict(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                       and math.isfinite(v), float)
    )
    conv.register_structure_hook(str, _strict(lambda v: isinstance(v, str) and "\0" not in v, str))  # NUL: no path, no text
    conv.register_structure_hook(pathlib.Path, _strict(lambda v: isinstance(v, str) and "\0" not in v, pathlib.Path))

    # cattrs would turn the string "+-" into ["+", "-"]; only a TOML array is an array.
    def is_sequence(tp: Any) -> bool:
        return typing.get_origin(tp) in (list, tuple, collections.abc.Sequence) or tp in (list, tuple)

    def structure_sequence(value: Any, tp: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise TypeError("mismatch")
        args = typing.get_args(tp)
        if typing.get_origin(tp) is tuple or tp is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(conv.structure(v, args[0]) for v in value)
            if args and len(args) != len(value):
                raise TypeError("mismatch")
            return tuple(conv.structure(v, a) for v, a in zip(value, args)) if args else tuple(value)
        return [conv.structure(v, args[0]) for v in value] if args else list(value)

    conv.register_structure_hook_func(is_sequence, structure_sequence)

    # A union of several types (``str | list[str]``: one path or many): the first that fits.
    def is_union(tp: Any) -> bool:
        return typing.get_origin(tp) in (typing.Union, types.UnionType) and \
            len([a for a in typing.get_args(tp) if a is not type(None)]) > 1

    def structure_union(value: Any, tp: Any) -> Any:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return conv.structure(value, arg)
            except Exception:  # noqa: BLE001 - the next member may fit
                continue
        raise TypeError("mismatch")

    conv.register_structure_hook_func(is_union, structure_union)
    return conv


_CONVERTER = make_converter()


class Located:
    """Collects problems for one job file, with line numbers."""

    def __init__(self, file: str, lines: Mapping[str, int], overridden: Mapping[str, str] | None = None):
        self.file = file
        self.lines = lines
        self.overridden = {} if overridden is None else overridden  # key path -> the --set that gave it its value
        self.problems: list[Problem] = []

    def add(self, key: str | None, message: str) -> None:
        line = None
        parts = key.split(".") if key else []
        prefixes = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
        source = next((self.overridden[p] for p in prefixes if p in self.overridden), None)
        if source is not None:
            message = f"{message} (from --set {source})"
        elif key:
            probe = key
            while probe and line is None:
                line = self.lines.get(probe)
                probe = probe.rpartition(".")[0]
        self.problems.append(Problem(message, file=self.file, key=key, line=line))


def _field_types(cls: type) -> dict[str, Any]:
    attrs.resolve_types(cls)
    return {f.name: f.type for f in attrs.fields(cls)}


def structure_table(
    cls: type,
    data: Mapping[str, Any],
    prefix: str,
    out: Located,
    *,
    skip: Iterable[str] = (),
    extra_known: Iterable[str] = (),
) -> Any:
    """Validate ``data`` against the attrs class ``cls``; problems go to ``out``.

    Returns an instance, or None when anything was wrong. ``skip`` are keys owned
    by someone else (the host's selector keys); ``extra_known`` are additional
    valid key names, used only for did-you-mean suggestions.
    """
    types_ = _field_types(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.init}
    skip = set(skip)
    before = len(out.problems)
    for key in data:
        if key in skip or key in fields:
            continue
        known = list(fields) + list(skip) + list(extra_known)
        out.add(_join(prefix, key), f"unknown key{did_you_mean(key, known)}; valid keys: {quoted_list(known)}")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        path = _join(prefix, name)
        if name not in data:
            if field.default is attrs.NOTHING:
                out.add(path, f"missing required key ({describe_type(types_[name])})")
            continue
        value = data[name]
        tp = types_[name]
        if attrs.has(tp):
            if not isinstance(value, dict):
                out.add(path, f"expected a table, found {_found(value)}")
                continue
            sub = structure_table(tp, value, path, out)
            if sub is not None:
                kwargs[name] = sub
            continue
        try:
            kwargs[name] = _CONVERTER.structure(value, tp)
        except Exception:  # noqa: BLE001 - cattrs raises several types; all mean "wrong type"
            hint = ""
            if typing.get_origin(tp) is Literal and isinstance(value, str):
                hint = did_you_mean(value, [str(a) for a in typing.get_args(tp)])
            if isinstance(value, float) and not math.isfinite(value):
                hint = " (a finite number is needed)"
            elif isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
                hint = " (it does not fit a 64-bit integer)"
            elif isinstance(value, str) and "\0" in value:
                hint = " (it holds a NUL character)"
            out.add(path, f"expected {describe_type(tp)}, found {_found(value)}{hint}")
    if len(out.problems) > before:
        return None
    # Field validators first, on an instance built without __init__ (so method
    # validators work), then the cross-field checks of __attrs_post_init__,
    # which may rely on every field being valid.
    bare = _bare_instance(cls, kwargs)
    for name, field in fields.items():
        if field.validator is None:
            continue
        try:
            field.validator(bare, field, getattr(bare, name))
        except (TypeError, ValueError) as exc:
            out.add(_join(prefix, name), _message(exc))
    if len(out.problems) > before:
        return None
    with attrs.validators.disabled():
        try:
            return cls(**kwargs)
        except OptionError as exc:
            out.add(_join(prefix, exc.key), exc.message)
            return None
        except (TypeError, ValueError) as exc:
            out.add(prefix or None, _message(exc))
            return None


def _bare_instance(cls: type, kwargs: Mapping[str, Any]) -> Any:
    inst = object.__new__(cls)
    for field in attrs.fields(cls):
        if field.name in kwargs:
            value = kwargs[field.name]
            if field.converter is not None:
                value = field.converter(value)
        elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            factory = field.default
            value = factory.factory(inst) if factory.takes_self else factory.factory()  # type: ignore[union-attr]
        else:
            value = field.default
        object.__setattr__(inst, field.name, value)
    return inst


def _message(exc: BaseException) -> str:
    """attrs' own validators raise with a tuple of internals; keep the sentence."""
    if exc.args and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# ---------------------------------------------------------------------------
# The job file as a whole.
# ---------------------------------------------------------------------------


def load_job(
    path: str | pathlib.Path,
    host: PluginHost,
    overrides: Sequence[str] = (),
) -> JobSpec:
    """Read, override, validate and resolve a job file, or raise a UserError
    listing every problem found."""
    data, text = read_toml(path)
    file = str(path)
    overridden: dict[str, str] = {}
    out = Located(file, locate_keys(text), overridden)
    out.problems += apply_overrides(data, overrides, overridden)
    notices = _move_job_keys(data, out)

    for key, value in data.items():
        if key in HOST_TABLES or key in SLOTS:
            if not isinstance(value, dict):
                out.add(key, f"expected a table [{key}], found {_found(value)}")
            continue
        tables = list(HOST_TABLES) + list(SLOTS)
        out.add(key, f"unknown table{did_you_mean(key, tables)}; valid tables: {quoted_list(tables)}")

    # [job]: host keys, then the kind's own keys.
    job_table = data.get("job")
    job = kind = kind_config = None
    if job_table is None:
        out.add("job", "missing required table [job] (with at least kind = \"...\")")
    elif isinstance(job_table, dict):
        kind_name = job_table.get("kind")
        if isinstance(kind_name, str):
            kind = _resolve(host, "jobs", kind_name, "job.kind", out)
        kind_fields = [f.name for f in attrs.fields(kind.config)] if kind and kind.config else []
        if kind is None and "kind" in job_table:
            # The kind is unknown, so its own keys cannot be checked: check only the host's.
            host_part = {k: v for k, v in job_table.items() if k in HOST_JOB_KEYS}
        else:
            host_part = {k: v for k, v in job_table.items() if k in HOST_JOB_KEYS or k not in kind_fields}
        job = structure_table(JobSection, host_part, "job", out, extra_known=kind_fields)
        if kind is not None:
            own = {k: v for k, v in job_table.items() if k not in HOST_JOB_KEYS and k in kind_fields}
            kind_config = structure_table(kind.config, own, "job", out) if kind.config else None

    # [cluster]: the host's keys, then the selected launcher's own keys.
    cluster_table = data.get("cluster", {})
    cluster = launcher = None
    if isinstance(cluster_table, dict):
        host_part = {k: v for k, v in cluster_table.items() if k in HOST_CLUSTER_KEYS}
        cluster = structure_table(ClusterSection, host_part, "cluster", out)
        # The default launcher is resolved quietly: a job kind that places nothing (and a
        # host with the built-ins blocked) runs without one; Run.launcher() says so if needed.
        quiet = "launcher" not in cluster_table and not isinstance(host.registry.lookup(LAUNCHER.key, "local"), Registration)
        if cluster is not None and not quiet:
            reg = _resolve(host, LAUNCHER.key, cluster.launcher, "cluster.launcher", out)
            if reg is not None:
                config = _plugin_config(reg, cluster_table, "cluster", list(HOST_CLUSTER_KEYS), out)
                launcher = PluginChoice("cluster", reg, config) if config is not _INVALID else None

    # [eval], [teacher]: the host's keys, then one plugin (its selector) with its keys beside them.
    hosted: dict[str, Any] = {}
    hosted_choices: dict[str, PluginChoice] = {}
    for table, (slot, section_class, host_keys, verb) in HOSTED.items():
        section = data.get(table)
        if not isinstance(section, dict) or kind is None:
            continue
        if table not in kind.slots:
            out.add(table, f"job kind {kind.name!r} does not {verb}: it takes no [{table}] table")
            continue
        hosted[table] = structure_table(section_class, {k: v for k, v in section.items() if k in host_keys}, table, out)
        found = _choose(host, slot, {k: v for k, v in section.items() if k not in host_keys}, None, out)
        if isinstance(found, PluginChoice):
            hosted_choices[table] = found

    # Plugin tables: [observers] for every kind, the ones the kind uses (with defaults); others are errors.
    plugins: dict[str, PluginChoice | tuple[PluginChoice, ...]] = {}
    if isinstance(data.get("observers", {}), dict):
        observers = _choose(host, OBSERVERS, data.get("observers", {}), [], out)
        if observers:
            plugins["observers"] = observers
    plugins.update(hosted_choices)
    uses: Mapping[str, str | None] | None = kind.slots if kind is not None else None
    for table, slot in SLOTS.items():
        present = table in data and isinstance(data[table], dict)
        if uses is not None and table not in uses:
            if table in data:
                used = ", ".join(f"[{t}]" for t in uses) or "no plugin tables"
                out.add(table, f"job kind {kind.name!r} does not use [{table}]; it uses {used}")  # type: ignore[union-attr]
            continue
        if not present and (uses is None or table in data):
            continue  # absent and not needed, or not a table (reported above)
        section = data.get(table, {}) if present else {}
        default = uses.get(table) if uses is not None else None
        if not present and uses is not None and default is None:
            out.add(table, f"missing required table [{table}] (job kind {kind.name!r} needs a {KINDS[slot.kind].noun})")  # type: ignore[union-attr]
            continue
        choice = _choose(host, slot, section, default, out)
        if choice is not None:
            plugins[table] = choice

    if not out.problems:
        assert job is not None and kind is not None and cluster is not None
        spec = JobSpec(
            path=pathlib.Path(path),
            job=job,
            kind=kind,
            kind_config=kind_config,
            cluster=cluster,
            plugins=plugins,
            raw=data,
            launcher=launcher,
            eval=hosted.get(EVAL_TABLE) if EVAL_TABLE in hosted_choices else None,
            teacher=hosted.get(TEACHER_TABLE) if TEACHER_TABLE in hosted_choices else None,
            lines=dict(out.lines),
            overridden=dict(overridden),
            notices=tuple(notices),
        )
        _run_checks(spec, out)
    if out.problems:
        # In file order; problems without a line (a missing table, --set) last.
        out.problems.sort(key=lambda p: (p.line is None, p.line or 0))
        raise UserError(out.problems)
    return spec


def _move_job_keys(data: dict[str, Any], out: Located) -> list[str]:
    """Move the observers' old keys of ``[job]`` (``tensorboard = true``, ``wandb_project``,
    ...) to ``[observers]``, in place; a notice for each. A key that also has a value in
    ``[observers]`` keeps that value (the new place wins)."""
    job = data.get("job")
    if not isinstance(job, dict) or not any(k in job for k in MOVED_JOB_KEYS):
        return []
    table = data.setdefault("observers", {})
    if not isinstance(table, dict):
        return []  # reported as a table of the wrong type
    notices = []
    switches = {name for name, key in MOVED_JOB_KEYS.values() if key is None}
    wanted = {name for name in switches if job.get(name) is True}
    for old in [k for k in job if k in MOVED_JOB_KEYS]:
        name, key = MOVED_JOB_KEYS[old]
        value = job.pop(old)
        where = f"job.{old}"
        if key is None:
            new = f'[observers] use = ["{name}"]'
            if value is True and name not in table.setdefault("use", []):
                if isinstance(table["use"], list):
                    table["use"].append(name)
        else:
            new = f"[observers.{name}] {key}"
            sub = table.setdefault(name, {})
            if name in wanted and isinstance(sub, dict) and key not in sub:
                sub[key] = value
                # Errors about the value point where it was given.
                if where in out.overridden:
                    out.overridden[f"observers.{name}.{key}"] = out.overridden[where]
                elif where in out.lines:
                    out.lines[f"observers.{name}.{key}"] = out.lines[where]  # type: ignore[index]
        line = out.lines.get(where)
        given = f"--set {out.overridden[where]}" if where in out.overridden else f"{out.file}{f':{line}' if line else ''}"
        notices.append(f"{given}: [job] {old} is deprecated; write {new}")
    for name in list(table):
        if table[name] == {} and name != "use":
            del table[name]  # a sub-table made only for keys of an observer not used
    if table == {} or table == {"use": []}:
        del data["observers"]
    return notices


def _run_checks(spec: JobSpec, out: Located) -> None:
    """The job-level checks of the kind and of every selected plugin (a registration's
    ``check``): combinations of settings no single table can judge, e.g. a replay
    strategy that needs a side channel the engine is not asked to produce."""
    regs = [spec.kind] + ([spec.launcher.registration] if spec.launcher is not None else [])
    for value in spec.plugins.values():
        regs += [c.registration for c in (value if isinstance(value, tuple) else (value,))]
    for choice in spec.choices():  # declared traits, before any check reads them
        if KINDS[choice.registration.kind].traits is not None:
            try:
                choice.traits
            except UserError as exc:
                out.add(f"{choice.slot}.{KINDS[choice.registration.kind].selector}",
                        "; ".join(p.message for p in exc.problems))
                return
    for reg in regs:
        if reg.check is None:
            continue
        try:
            found = list(reg.check(spec) or ())
        except UserError as exc:
            found = [(p.key, p.message) for p in exc.problems]
        except Exception as exc:  # noqa: BLE001 - a plugin's bug must not look like the user's
            out.add(None, f"the job check of {KINDS[reg.kind].noun} {reg.name!r} ({reg.origin}) failed: {exc!r}")
            continue
        for key, message in found:
            out.add(key, message)


def _resolve(host: PluginHost, kind: str, name: str, key: str, out: Located) -> Registration | None:
    try:
        return host.get(kind, name)
    except UserError as exc:
        for p in exc.problems:
            out.add(key, p.message)
        return None


def claimed(host: PluginHost, kind: str, section: Mapping[str, Any]) -> tuple[str | None, str]:
    """A table that names no plugin of ``kind``: the plugin that claims it highest
    (``register(..., claims=...)``) and why; ``(None, "")`` when none claims it, and
    ``(None, message)`` when two claim it equally (the message names both)."""
    bids: list[tuple[int, str, str]] = []
    for reg in host.registry.entries(kind):
        if reg.claims is None:
            continue
        try:
            bid = reg.claims(section)
        except Exception:  # noqa: BLE001 - a plugin's bug: it simply does not claim the table
            continue
        if bid is not None:
            priority, why = bid if isinstance(bid, tuple) else (bid, "")
            bids.append((int(priority), reg.name, str(why)))
    if not bids:
        return None, ""
    bids.sort(key=lambda b: (-b[0], b[1]))
    if len(bids) > 1 and bids[0][0] == bids[1][0]:
        return None, (f"missing; both {KINDS[kind].noun} {bids[0][1]!r} and {bids[1][1]!r} could take this table: "
                      f"set {KINDS[kind].selector} to one of them")
    _, name, why = bids[0]
    return name, f"{KINDS[kind].selector} {name!r} chosen" + (f": {why}" if why else "")


def _choose(
    host: PluginHost, slot: Slot, section: Mapping[str, Any], default: str | None, out: Located
) -> PluginChoice | tuple[PluginChoice, ...] | None:
    selector_path = f"{slot.table}.{slot.selector}"
    selected = section.get(slot.selector, list(default) if isinstance(default, (list, tuple)) else default)
    chosen_by = None
    if selected is None and not slot.many and section:
        selected, chosen_by = claimed(host, slot.kind, section)
        if selected is None and chosen_by:  # claimed by two alike
            out.add(selector_path, chosen_by)
            return None
    if selected is None:
        out.add(selector_path, f"missing required key (the {KINDS[slot.kind].noun} to use)")
        for key in section:
            if did_you_mean(key, [slot.selector]):
                out.add(f"{slot.table}.{key}", f"unknown key{did_you_mean(key, [slot.selector])}")
        return None
    if not slot.many:
        if not isinstance(selected, str):
            out.add(selector_path, f"expected a string (a {KINDS[slot.kind].noun} name), found {_found(selected)}")
            return None
        reg = _resolve(host, slot.kind, selected, selector_path, out)
        if reg is None:
            return None
        config = _plugin_config(reg, section, slot.table, [slot.selector], out)
        return PluginChoice(slot.table, reg, config, chosen_by) if config is not _INVALID else None

    if not (isinstance(selected, list) and all(isinstance(s, str) for s in selected)):
        out.add(selector_path, f"expected an array of {KINDS[slot.kind].noun} names, found {_found(selected)}")
        return None
    if len(set(selected)) != len(selected):
        out.add(selector_path, f"lists a name twice: {selected!r}")
        return None
    for key in section:
        if key != slot.selector and key not in selected:
            hint = "" if isinstance(section[key], dict) else " (strategy options go in their own sub-table)"
            out.add(
                f"{slot.table}.{key}",
                f"unknown key{did_you_mean(key, [slot.selector, *selected])}: not a selected "
                f"{KINDS[slot.kind].noun} in {selector_path}{hint}",
            )
    chosen = []
    for name in selected:
        reg = _resolve(host, slot.kind, name, selector_path, out)
        if reg is None:
            continue
        sub = section.get(name, {})
        if not isinstance(sub, dict):
            out.add(f"{slot.table}.{name}", f"expected a table, found {_found(sub)}")
            continue
        config = _plugin_config(reg, sub, f"{slot.table}.{name}", [], out)
        if config is not _INVALID:
            chosen.append(PluginChoice(slot.table, reg, config))
    return tuple(chosen)


_INVALID = object()


def _plugin_config(reg: Registration, section: Mapping[str, Any], prefix: str, skip: list[str], out: Located) -> Any:
    if reg.config is None:
        extra = [k for k in section if k not in skip]
        for k in extra:
            out.add(f"{prefix}.{k}", f"unknown key: {KINDS[reg.kind].noun} {reg.name!r} takes no options")
        return _INVALID if extra else None
    config = structure_table(reg.config, section, prefix, out, skip=skip)
    return _INVALID if config is None else config


# ---------------------------------------------------------------------------
# --explain: every key of the selected plugins.
# ---------------------------------------------------------------------------


@attrs.frozen
class KeyDoc:
    key: str
    type: str
    default: str
    help: str
    owner: str


def _default_text(field: attrs.Attribute) -> str:
    if field.default is attrs.NOTHING:
        return "(required)"
    if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
        try:
            return repr(field.default.factory())  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001
            return "(computed)"
    return repr(field.default)


def explain_class(cls: type, prefix: str, owner: str, skip: Iterable[str] = ()) -> list[KeyDoc]:
    docs: list[KeyDoc] = []
    types_ = _field_types(cls)
    for field in attrs.fields(cls):
        if field.name in skip or not field.init:
            continue
        tp = types_[field.name]
        key = _join(prefix, field.name)
        if attrs.has(tp):
            docs += explain_class(tp, key, owner)
            continue
        help_text = field.metadata.get("help", "")
        check = getattr(field.validator, "__doc__", None) if field.validator else None
        if check and check.split()[0] in {">", ">=", "<", "<=", "in"}:
            help_text = f"{help_text} ({check})" if help_text else check
        docs.append(KeyDoc(key, describe_type(tp), _default_text(field), help_text, owner))
    return docs


def explain_job(spec: JobSpec) -> list[KeyDoc]:
    """Every key the job file may set, given its kind and selected plugins."""
    docs = explain_class(JobSection, "job", "host")
    if spec.kind.config:
        docs += explain_class(spec.kind.config, "job", str(spec.kind.origin))
    docs.append(KeyDoc("cluster.launcher", f"a {LAUNCHER.noun} name", "'local'", "selects the plugin", "host"))
    docs += explain_class(ClusterSection, "cluster", "host", skip=["launcher"])
    if spec.launcher is not None and spec.launcher.registration.config:
        docs += explain_class(spec.launcher.registration.config, "cluster", str(spec.launcher.registration.origin),
                              skip=HOST_CLUSTER_KEYS)
    if spec.eval is not None:
        docs += explain_class(EvalSection, EVAL_TABLE, "host")
    if spec.teacher is not None:
        docs += explain_class(TeacherSection, TEACHER_TABLE, "host")
    for table, value in spec.plugins.items():
        slot = PLUGIN_TABLES[table]
        choices = value if isinstance(value, tuple) else (value,)
        noun = KINDS[slot.kind].noun
        default = spec.kind.slots.get(table, [] if slot is OBSERVERS else None)
        default_text = "(required)" if default is None else repr(list(default) if isinstance(default, tuple) else default)
        if slot is EVAL:
            default_text = "(none: no evaluation)"
        elif slot is TEACHER:
            default_text = "(none: no teacher)"
        key = f"{table}.{slot.selector}"
        if slot.many:
            names = ", ".join(repr(c.name) for c in choices)
            docs.append(KeyDoc(key, f"an array of {noun} names", default_text, f"selected: {names}", "host"))
        else:
            docs.append(KeyDoc(key, f"a {noun} name", default_text, "selects the plugin", "host"))
        for c in choices:
            if c.registration.config:
                prefix = f"{table}.{c.name}" if slot.many else table
                docs += explain_class(c.registration.config, prefix, str(c.registration.origin), skip=[slot.selector])
    return docs
