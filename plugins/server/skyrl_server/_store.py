"""The durable store of training state (``[server] database``: any SQLAlchemy URL; an
SQLite file by default): what a restart of ``skyrl serve`` (even a SIGKILL) must keep.

Tables:

- ``sessions``: every session the server handed out, its tenant, and whether it finished
  (a model belongs to its session's tenant);
- ``models``: one row per training model: base, LoRA rank, seed, optimizer steps, the
  highest seq_id that ran, where its durable state lies in the storage root (NULL: fresh
  from its seed), whether acknowledged forward_backward gradients wait for an optim_step
  (they are not persisted: after a restart that step fails, see :mod:`skyrl_server._app`),
  and whether it was unloaded;
- ``futures``: every finished training future (request_id, model_id, seq_id, its tenant, kind,
  result bytes: JSON or protobuf); the unique ``(model_id, seq_id)`` index is the map a retried
  request is answered from, across restarts too. Sampling futures never come here;
- ``checkpoints``: save_state / save_weights_for_sampler saves, by tinker:// path, and whether
  their tenant published them (then every tenant may read them);
- ``boots``: one row per server start (request ids start with their boot's id, so a
  request id from before a restart is recognised).

Every write is one transaction and runs on the server's worker thread (never on the
event loop): a training request's result, its model's new row and its checkpoint row
commit together or not at all.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

import attrs
import sqlalchemy as sa

metadata = sa.MetaData()
sessions = sa.Table(
    "sessions", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("finished", sa.Boolean, nullable=False, default=False),
    sa.Column("tenant", sa.String(80), nullable=True),  # NULL: made before tenants (reachable by no key)
)
models = sa.Table(
    "models", metadata,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("session_id", sa.String(64), nullable=False),
    sa.Column("base", sa.String(400), nullable=False),
    sa.Column("rank", sa.Integer, nullable=False),
    sa.Column("seed", sa.Integer, nullable=False),
    sa.Column("parts", sa.String(40), nullable=False, default="attn,mlp,unembed"),  # what the adapters cover
    sa.Column("steps", sa.Integer, nullable=False, default=0),
    sa.Column("last_seq", sa.Integer, nullable=False, default=0),
    sa.Column("state", sa.Text, nullable=True),  # a file under the storage root; NULL: fresh from the seed
    sa.Column("grads", sa.Boolean, nullable=False, default=False),  # acknowledged gradients wait for a step
    sa.Column("unloaded", sa.Boolean, nullable=False, default=False),
    sa.Column("created", sa.Float, nullable=False),
)
futures = sa.Table(
    "futures", metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("model_id", sa.String(200), nullable=True),
    sa.Column("seq_id", sa.Integer, nullable=True),
    sa.Column("kind", sa.String(8), nullable=False),  # json | proto | error
    sa.Column("result", sa.LargeBinary, nullable=False),
    sa.Column("finished", sa.Float, nullable=False),
    sa.Column("tenant", sa.String(80), nullable=True),
    sa.UniqueConstraint("model_id", "seq_id", name="futures_model_seq"),
)
sa.Index("futures_finished", futures.c.finished)
checkpoints = sa.Table(
    "checkpoints", metadata,
    sa.Column("path", sa.String(500), primary_key=True),
    sa.Column("model_id", sa.String(200), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),  # weights | sampler_weights
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("public", sa.Boolean, nullable=False, default=False),  # published: readable by every tenant
)
# Columns added after the first release, added to an older database at start (ALTER TABLE).
ADDED = {"sessions": ("tenant", "VARCHAR(80)"), "futures": ("tenant", "VARCHAR(80)"),
         "checkpoints": ("public", "BOOLEAN NOT NULL DEFAULT 0")}
boots = sa.Table(
    "boots", metadata,
    sa.Column("id", sa.String(16), primary_key=True),
    sa.Column("started", sa.Float, nullable=False),
)


def encode(kind: str, value: Any) -> bytes:
    return bytes(value) if kind == "proto" else json.dumps(value).encode()


def decode(kind: str, data: bytes) -> Any:
    return bytes(data) if kind == "proto" else json.loads(data)


@attrs.define
class Record:
    """What one finished training request writes, in one transaction."""

    request_id: str
    model_id: str | None
    seq_id: int | None
    kind: str = ""
    value: Any = None
    new_model: dict[str, Any] | None = None  # a models row to insert (create_model, load into a new model)
    changes: dict[str, Any] = attrs.field(factory=dict)  # columns of the model's row to update
    checkpoint: tuple[str, str] | None = None  # (path, kind)
    after: Callable[[], None] | None = None  # run once committed (e.g. delete the model's older state file)
    undo: Callable[[], None] | None = None  # run when the commit fails (the model back to its stored state)
    tenant: str | None = None  # whose request it is


@attrs.define
class Loaded:
    """The store's contents at start."""

    boot: str
    boots: dict[str, float]
    sessions: dict[str, tuple[bool, str | None]]  # id -> (finished, tenant)
    models: list[dict[str, Any]]
    futures: list[dict[str, Any]]  # request_id, model_id, seq_id, tenant, kind, value, finished (wall clock)
    checkpoints: dict[str, tuple[str, bool]] = attrs.field(factory=dict)  # path -> (model_id, public)


class Store:
    def __init__(self, url: str):
        parsed = sa.engine.make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
            # one in-memory database for every thread (a restart loses it: nothing is durable then)
            self.engine = sa.create_engine(parsed, poolclass=sa.pool.StaticPool,
                                           connect_args={"check_same_thread": False})
        else:
            self.engine = sa.create_engine(parsed)
        if self.engine.dialect.name == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        metadata.create_all(self.engine)
        self._add_columns()

    def _add_columns(self) -> None:
        """Bring a database made by an older server up to the current tables."""
        have = sa.inspect(self.engine)
        for table, (column, ddl) in ADDED.items():
            if column not in {c["name"] for c in have.get_columns(table)}:
                with self.engine.begin() as db:
                    db.execute(sa.text(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}"))

    def start(self, keep_seconds: float, now: float | None = None) -> Loaded:
        """Record a new boot, drop futures older than ``keep_seconds`` and read the rest."""
        now = time.time() if now is None else now
        boot = uuid.uuid4().hex[:8]
        with self.engine.begin() as db:
            db.execute(futures.delete().where(futures.c.finished < now - keep_seconds))
            db.execute(boots.insert().values(id=boot, started=now))
            past = {r.id: r.started for r in db.execute(sa.select(boots))}
            sess = {r.id: (bool(r.finished), r.tenant) for r in db.execute(sa.select(sessions))}
            rows = [dict(r._mapping) for r in db.execute(sa.select(models))]
            done = [{"request_id": r.request_id, "model_id": r.model_id, "seq_id": r.seq_id, "tenant": r.tenant,
                     "kind": r.kind, "value": decode(r.kind, r.result), "finished": r.finished}
                    for r in db.execute(sa.select(futures).order_by(futures.c.finished))]
            saved = {r.path: (r.model_id, bool(r.public)) for r in db.execute(sa.select(checkpoints))}
        return Loaded(boot, past, sess, rows, done, saved)

    def add_session(self, session_id: str, tenant: str | None = None) -> None:
        with self.engine.begin() as db:
            db.execute(sessions.insert().values(id=session_id, created=time.time(), finished=False, tenant=tenant))

    def publish(self, path: str, public: bool) -> bool:
        """Mark a checkpoint published (or not); False when no checkpoint has that path."""
        with self.engine.begin() as db:
            return db.execute(checkpoints.update().where(checkpoints.c.path == path).values(public=public)).rowcount > 0

    def finish_session(self, session_id: str) -> None:
        with self.engine.begin() as db:
            db.execute(sessions.update().where(sessions.c.id == session_id).values(finished=True))

    def record(self, rec: Record) -> None:
        """The finished request ``rec`` with its model and checkpoint rows: one transaction."""
        now = time.time()
        with self.engine.begin() as db:
            if rec.new_model is not None:
                db.execute(models.insert().values(created=now, **rec.new_model))
            changes = dict(rec.changes)
            if rec.model_id is not None and rec.seq_id is not None:
                changes["last_seq"] = sa.func.max(models.c.last_seq, rec.seq_id) if self.engine.dialect.name == "sqlite" \
                    else sa.func.greatest(models.c.last_seq, rec.seq_id)
            if rec.model_id is not None and changes:
                db.execute(models.update().where(models.c.id == rec.model_id).values(**changes))
            if rec.checkpoint is not None:
                path, kind = rec.checkpoint
                db.execute(checkpoints.delete().where(checkpoints.c.path == path))  # saved again: the newest, private
                db.execute(checkpoints.insert().values(path=path, model_id=rec.model_id, kind=kind, created=now,
                                                       public=False))
            db.execute(futures.insert().values(request_id=rec.request_id, model_id=rec.model_id, seq_id=rec.seq_id,
                                               tenant=rec.tenant, kind=rec.kind, result=encode(rec.kind, rec.value), finished=now))

    def forget(self, before: float) -> int:
        """Delete the futures finished before ``before`` (wall clock); their count."""
        with self.engine.begin() as db:
            return db.execute(futures.delete().where(futures.c.finished < before)).rowcount

    def close(self) -> None:
        self.engine.dispose()


def _sqlite_pragmas(conn: Any, _record: Any) -> None:
    """WAL: readers never block the writer; synchronous NORMAL: a commit survives the
    process being killed (not, in WAL mode, a power loss of the last commits)."""
    cur = conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def model_row(model_id: str, session_id: str, base: str, rank: int, seed: int, parts: str = "attn,mlp,unembed",
              **extra: Any) -> dict[str, Any]:
    return {"id": model_id, "session_id": session_id, "base": base, "rank": rank, "seed": seed, "parts": parts, "steps": 0,
            "last_seq": 0, "state": None, "grads": False, "unloaded": False, **extra}


def describe(url: str) -> str:
    """The URL with any password hidden (for logs)."""
    return sa.engine.make_url(url).render_as_string(hide_password=True)


__all__ = ["Loaded", "Record", "Store", "describe", "model_row"]
