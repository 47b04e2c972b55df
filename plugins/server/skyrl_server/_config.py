"""The server file of ``skyrl serve`` (``server.toml``), validated like a job file.

```toml
[server]
port = 8000
api_keys = ["tml-..."]            # and/or api_keys_env / api_keys_file, and the env SKYRL_API_KEYS: one tenant each
storage = "runs/tinker"           # any fsspec URL: sampler weights and checkpoints
database = "state.sqlite"         # durable training state: an SQL URL or an SQLite file (default: in storage)

[tenants.research]                # optional: keys that share one tenant (its models, checkpoints, futures)
keys = ["tml-...", "tml-..."]     # and/or keys_env / keys_file
max_models = 8                    # default: [server] max_models_per_tenant

[models."skyrl/qwen-tiny"]        # the base-model name the SDK sends
family = "qwen"                   # a model plugin; the rest of the table is the family's options
preset = "tiny"

[engine]                          # optional; default: name = "embedded"
name = "embedded"

[backend]                         # optional; default: name = "torch" (the request's LoraConfig sets lora_rank)
name = "torch"
```

Problems are collected and raised together as one :class:`UserError`, each located
``file:line: key`` with the host's own helpers (:mod:`skyrl_host.config`).
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Mapping

import attrs

from skyrl_host.config import Located, PluginChoice, locate_keys, read_toml, structure_table
from skyrl_host.errors import UserError, did_you_mean, quoted_list
from skyrl_host.options import OptionError, ge, gt, in_interval, option

ENV_KEYS = "SKYRL_API_KEYS"
KEY_PREFIX = "tml-"  # the SDK refuses keys without it
# A preset model's character tokenizer: printable ASCII unless [models."NAME"] alphabet says otherwise.
DEFAULT_ALPHABET = "".join(chr(c) for c in range(32, 127))


def _port(_inst: Any, _attr: Any, value: int) -> None:
    if not 1 <= value <= 65535:
        raise ValueError(f"expected a TCP port in [1, 65535], found {value!r}")


_port.__doc__ = "in [1, 65535]"


@attrs.frozen
class ServerSection:
    """``[server]``: where the server listens, who may call it, where it keeps weights."""

    host: str = option("127.0.0.1", help="address to listen on (--host overrides it)")
    port: int = option(8000, help="TCP port to listen on (--port overrides it)", validator=_port)
    api_keys: list[str] = option(factory=list, help="API keys the SDK may send as X-API-Key (each starts with 'tml-')")
    api_keys_env: str | None = option(None, help="name of an environment variable holding comma-separated API keys")
    api_keys_file: str | None = option(None, help="a file with one API key a line (blank lines and # comments skipped)")
    storage: str = option("tinker-storage", help="fsspec URL (or folder) where sampler weights are written")
    max_lora_rank: int = option(64, help="the largest LoRA rank a create_model request may ask for", validator=gt(0))
    poll_seconds: float = option(
        20.0, help="how long retrieve_future waits for a result before answering try_again (the SDK times out at 45 s)",
        validator=in_interval(0, 40, low_open=True),
    )
    order_wait_seconds: float = option(
        2.0, help="how long a model's request waits for a missing lower seq_id before it runs anyway", validator=ge(0)
    )
    seed: int = option(0, help="seed of the base models' preset weights (and of adapters whose request names none)")
    database: str | None = option(
        None, help="the durable store of sessions, models, training futures and checkpoints: an SQLAlchemy URL "
        "(sqlite:///state.sqlite, postgresql://user@host/db: its driver must be installed) or a file path (an SQLite "
        "file, relative to the server file's folder); default: tinker-state.sqlite in the storage root when that is "
        "a local folder, else beside the server file",
    )
    max_queued_tokens: int = option(
        1 << 22, help="admission control: past this many tokens (prompt + max_tokens) of sampling requests queued or "
        "decoding, asample answers 429", validator=gt(0),
    )
    max_json_bytes: int = option(
        8 << 20, help="the largest JSON request body (413 past it); bodies over 64 KiB are parsed off the event loop",
        validator=gt(0),
    )
    max_body_bytes: int = option(
        256 << 20, help="the largest forward_backward body, decompressed (a zstd body that would inflate past it is "
        "refused with 413 before it is); decompressed and parsed off the event loop", validator=gt(0),
    )
    route_cache_bytes: int = option(
        1 << 30, help="bound of what sampling requests with record_stability_info keep for replay (routes of MoE "
        "bases, kept sets): past it the least recently used sequences are evicted and score without replay",
        validator=gt(0),
    )

    max_models_per_tenant: int = option(
        32, help="how many training models one tenant may hold loaded at once (create_model past it: 403)",
        validator=gt(0),
    )
    max_in_flight_per_tenant: int = option(
        1024, help="how many unfinished futures (training and sampling requests) one tenant may have at once "
        "(past it: 429, the SDK backs off and sends again)", validator=gt(0),
    )

    def __attrs_post_init__(self) -> None:
        bad = [k for k in self.api_keys if not k.startswith(KEY_PREFIX)]
        if bad:
            raise OptionError("api_keys", f"every key must start with {KEY_PREFIX!r} (the SDK refuses others), found {bad[0]!r}")


@attrs.frozen
class TenantSection:
    """``[tenants.NAME]``: API keys that act as one tenant, and its limits."""

    keys: list[str] = option(factory=list, help="the tenant's API keys (each starts with 'tml-')")
    keys_env: str | None = option(None, help="name of an environment variable holding more of its keys, comma-separated")
    keys_file: str | None = option(None, help="a file with more of its keys, one a line (blank lines and # comments skipped)")
    max_models: int | None = option(None, help="its limit of loaded training models (default: [server] "
                                    "max_models_per_tenant)", validator=attrs.validators.optional(gt(0)))
    max_in_flight: int | None = option(None, help="its limit of unfinished futures (default: [server] "
                                       "max_in_flight_per_tenant)", validator=attrs.validators.optional(gt(0)))


@attrs.frozen
class Tenants:
    """Who is who: each accepted key's tenant, and each tenant's limits."""

    of_key: Mapping[str, str]  # API key -> tenant name
    max_models: Mapping[str, int]  # tenant -> limit (tenants with their own table only; else the server's)
    max_in_flight: Mapping[str, int]


def key_tenant(key: str) -> str:
    """The tenant of a key listed alone (in [server] or SKYRL_API_KEYS): ``key-`` and the
    first 16 hex digits of its SHA-256, stable across restarts, revealing nothing of the key."""
    import hashlib

    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


@attrs.frozen
class ServerSpec:
    """A validated server file."""

    path: pathlib.Path
    server: ServerSection
    api_keys: frozenset[str]
    models: Mapping[str, PluginChoice]  # base-model name (as the SDK sends it) -> the family and its options
    engine: PluginChoice
    backend: PluginChoice
    alphabets: Mapping[str, str]  # base-model name -> the characters of a preset's tokenizer (unused with path)
    database: str = ""  # the resolved SQLAlchemy URL of [server] database
    tenants: Tenants = Tenants({}, {}, {})  # each key's tenant (every key of api_keys has one) and their limits

    def tenant_limits(self, tenant: str) -> tuple[int, int]:
        """(max_models, max_in_flight) of ``tenant``."""
        return (self.tenants.max_models.get(tenant, self.server.max_models_per_tenant),
                self.tenants.max_in_flight.get(tenant, self.server.max_in_flight_per_tenant))


def database_url(server: ServerSection, base: pathlib.Path, out: Located) -> str:
    """The SQLAlchemy URL of ``[server] database`` (see its help), checked: it parses and
    its dialect and driver load (nothing connects yet)."""
    value = server.database
    if value is None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(server.storage)
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        folder = pathlib.Path(root).resolve() if local else base
        return f"sqlite:///{folder / 'tinker-state.sqlite'}"
    if not value.strip():
        out.add("server.database", "expected an SQL URL or a file path, found an empty string")
        return ""
    if "://" not in value:
        p = pathlib.Path(value).expanduser()
        return f"sqlite:///{p if p.is_absolute() else (base / p).resolve()}"
    import sqlalchemy as sa

    try:
        sa.create_engine(sa.engine.make_url(value)).dispose()
    except Exception as exc:  # noqa: BLE001 - a bad URL or a missing driver: the user's to fix
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        out.add("server.database", f"cannot use {value!r}: {first}")
        return ""
    return value


TABLES = ("server", "tenants", "models", "engine", "backend")


def _choice(host: Any, kind: str, table: str, selector: str, section: Mapping[str, Any], prefix: str,
            default: str | None, out: Located, also: tuple[str, ...] = ()) -> PluginChoice | None:
    name = section.get(selector, default)
    key = f"{prefix}.{selector}"
    if name is None and section:  # e.g. a model with only a path: the family that claims its config.json
        from skyrl_host.config import claimed

        name, why = claimed(host, kind, section)
        if name is None and why:
            out.add(key, why)
            return None
    if not isinstance(name, str):
        out.add(key, "missing required key" if name is None else f"expected a string, found {name!r}")
        return None
    try:
        reg = host.get(kind, name)
    except UserError as exc:
        for p in exc.problems:
            out.add(key, p.message)
        return None
    if reg.config is None:
        extra = [k for k in section if k != selector and k not in also]
        for k in extra:
            out.add(f"{prefix}.{k}", f"unknown key: {reg.name!r} takes no options")
        return None if extra else PluginChoice(table, reg, None)
    config = structure_table(reg.config, section, prefix, out, skip=[selector, *also])
    return None if config is None else PluginChoice(table, reg, config)


def _read_keys_file(path: str, base: pathlib.Path, out: Located, where: str = "server.api_keys_file") -> list[str]:
    p = pathlib.Path(path)
    p = p if p.is_absolute() else base / p
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        out.add(where, f"cannot read {str(p)!r}: {exc.strerror or exc}")
        return []
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def tenants(table: Mapping[str, Any], server: ServerSection, alone: frozenset[str], base: pathlib.Path,
            environ: Mapping[str, str], out: Located) -> Tenants:
    """The ``[tenants.NAME]`` tables read and checked (names, keys, each key in one place
    only), with the keys listed alone (``alone``) as one tenant each."""
    import re

    of_key = {k: key_tenant(k) for k in alone}
    where = {k: "server.api_keys" for k in alone}
    models: dict[str, int] = {}
    flight: dict[str, int] = {}
    for name, section in table.items():
        prefix = f"tenants.{name}"
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name.startswith("key-"):
            out.add(prefix, "a tenant's name is 1-64 letters, digits, '.', '_' or '-', not starting with 'key-' "
                    "(the names of keys listed alone)")
            continue
        if not isinstance(section, dict):
            out.add(prefix, f"expected a table [tenants.{name}] with keys = [...], found {section!r}")
            continue
        spec = structure_table(TenantSection, section, prefix, out)
        if spec is None:
            continue
        keys = list(spec.keys)
        if spec.keys_env is not None:
            value = environ.get(spec.keys_env)
            if value is None:
                out.add(f"{prefix}.keys_env", f"the environment variable {spec.keys_env!r} is not set")
            else:
                keys += [k.strip() for k in value.split(",") if k.strip()]
        if spec.keys_file is not None:
            keys += _read_keys_file(spec.keys_file, base, out, f"{prefix}.keys_file")
        if not keys:
            out.add(prefix, "a tenant needs at least one key (keys, keys_env or keys_file)")
        for k in keys:
            if not k.startswith(KEY_PREFIX):
                out.add(f"{prefix}.keys", f"every key must start with {KEY_PREFIX!r} (the SDK refuses others); one does not")
            elif k in where:
                out.add(f"{prefix}.keys", f"a key of this tenant is also listed in {where[k]}: a key belongs to one "
                        "tenant (remove it there)")
            else:
                of_key[k], where[k] = name, prefix
        models[name] = spec.max_models or server.max_models_per_tenant
        flight[name] = spec.max_in_flight or server.max_in_flight_per_tenant
    return Tenants(of_key, models, flight)


def api_keys(server: ServerSection, base: pathlib.Path, environ: Mapping[str, str], out: Located,
             grouped: bool = False) -> frozenset[str]:
    """Every key listed alone: the file's list, its env var, its key file and
    ``SKYRL_API_KEYS`` (``grouped``: the server file has [tenants] tables, so none alone is fine)."""
    keys = list(server.api_keys)
    if server.api_keys_env is not None:
        value = environ.get(server.api_keys_env)
        if value is None:
            out.add("server.api_keys_env", f"the environment variable {server.api_keys_env!r} is not set")
        else:
            keys += [k.strip() for k in value.split(",") if k.strip()]
    if server.api_keys_file is not None:
        keys += _read_keys_file(server.api_keys_file, base, out)
    keys += [k.strip() for k in environ.get(ENV_KEYS, "").split(",") if k.strip()]
    bad = [k for k in keys if not k.startswith(KEY_PREFIX)]
    if bad:
        out.add("server.api_keys", f"every key must start with {KEY_PREFIX!r} (the SDK refuses others); "
                f"one key read from the file, its env var or {ENV_KEYS} does not")
    if not keys and not grouped:
        out.add("server", f"no API keys: set [server] api_keys, api_keys_env or api_keys_file, [tenants.NAME] keys, "
                f"or the env {ENV_KEYS}")
    return frozenset(keys)


def load_server_file(path: str | pathlib.Path, host: Any, environ: Mapping[str, str] | None = None) -> ServerSpec:
    """Read and validate a server file, or raise a UserError listing every problem."""
    environ = os.environ if environ is None else environ
    data, text = read_toml(path)
    out = Located(str(path), locate_keys(text))
    for key, value in data.items():
        if key not in TABLES:
            out.add(key, f"unknown table{did_you_mean(key, TABLES)}; valid tables: {quoted_list(TABLES)}")
        elif not isinstance(value, dict):
            out.add(key, f"expected a table [{key}], found {value!r}")

    def table(name: str) -> dict[str, Any]:
        value = data.get(name, {})
        return value if isinstance(value, dict) else {}

    server = structure_table(ServerSection, table("server"), "server", out)
    folder = pathlib.Path(path).resolve().parent
    keys = api_keys(server, folder, environ, out, grouped=bool(table("tenants"))) if server is not None else frozenset()
    who = tenants(table("tenants"), server, keys, folder, environ, out) if server is not None else None
    database = database_url(server, pathlib.Path(path).resolve().parent, out) if server is not None else ""

    models: dict[str, PluginChoice] = {}
    alphabets: dict[str, str] = {}
    if not table("models"):
        out.add("models", 'missing required table: at least one [models."NAME"] with family = "..." (and preset or path)')
    for name, section in table("models").items():
        prefix = f"models.{name}"
        if not isinstance(section, dict):
            out.add(prefix, f'expected a table [models."{name}"] with family = "...", found {section!r}')
            continue
        choice = _choice(host, "models", "model", "family", section, prefix, None, out, also=("alphabet",))
        alphabet = section.get("alphabet", DEFAULT_ALPHABET)
        if not isinstance(alphabet, str) or not alphabet or len(set(alphabet)) != len(alphabet):
            out.add(f"{prefix}.alphabet", f"expected a string of distinct characters, found {alphabet!r}")
        elif choice is not None:
            models[name] = choice
            alphabets[name] = alphabet

    engine = _choice(host, "engines", "engine", "name", table("engine"), "engine", "embedded", out)
    backend = _choice(host, "backends", "backend", "name", table("backend"), "backend", "torch", out)
    if backend is not None and backend.name != "torch":
        out.add("backend.name", f"training clients run on the torch backend only (yet), found {backend.name!r}")
    elif backend is not None and backend.traits.adapter_rank:
        out.add(f"backend.{backend.traits.switches.get('adapter_rank', 'name')}", "each create_model request chooses "
                "its LoRA rank (LoraConfig.rank); limit it with [server] max_lora_rank")
    elif backend is not None and backend.traits.adapter_targets is not None:
        out.add(f"backend.{backend.traits.switches.get('adapter_targets', 'name')}", "each create_model request "
                "chooses the layers its adapters cover (LoraConfig.train_attn / train_mlp / train_unembed)")
    if out.problems:
        out.problems.sort(key=lambda p: (p.line is None, p.line or 0))
        raise UserError(out.problems)
    assert server is not None and engine is not None and backend is not None
    assert who is not None
    return ServerSpec(pathlib.Path(path), server, frozenset(who.of_key), models, engine, backend, alphabets, database,
                      who)


__all__ = ["ServerSection", "ServerSpec", "TenantSection", "Tenants", "load_server_file", "api_keys", "key_tenant",
           "tenants", "ENV_KEYS"]
