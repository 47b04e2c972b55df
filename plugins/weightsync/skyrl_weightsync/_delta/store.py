"""Where ``delta`` versions live: the layout under the URL (``LATEST``, epochs, per
version a manifest and its payloads) and whole-object writes and reads through fsspec
(see the package's docstring for the layout; imports fsspec)."""

from __future__ import annotations

import collections
import json
import os
import re
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import fsspec

from skyrl_host.errors import Problem, UserError
from skyrl_toolkit.remote_errors import endpoint_of, remote_error

# Format 3 packs small payloads into shared objects (``payload_offset``); format 2 added
# tensors in parts; formats 1 and 2 (every payload an object of its own) read the same way.
FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
LATEST = "LATEST"
_INFLIGHT_BYTES = 256 << 20  # payload bytes a sender may have queued for writing
# Tensor bytes per payload object. Every object then stays below the size at which fsspec
# filesystems switch to a multipart upload (s3fs: 100 MiB), so each is one PUT: atomic,
# safe to retry, and a big tensor's parts are written and read in parallel. A multipart
# upload's completion is one request that must answer within the client's read timeout
# (s3fs: 15 s) and cannot be retried once the server consumed it: moto takes ~17 s to
# complete 1 GiB, and a slow S3-compatible store can too.
PART_BYTES = 64 << 20
# Payloads under PACK_BELOW bytes (norms, biases, small matrices: half the tensors of a
# real model, all of a tiny one) share pack objects of about PACK_BYTES: one write and one
# read each instead of one per tensor (on local disk a write is a create, write and rename;
# on an object store, a request's round trip).
PACK_BELOW = 1 << 20
PACK_BYTES = 8 << 20
DEFAULT_MAX_BYTES = 1 << 40  # a version's tensors, together (1 TiB: a 500B-parameter model in bf16)


def parts_of(nbytes: int, part_bytes: int | None = None) -> list[tuple[int, int]]:
    """The (start, end) byte spans a tensor of ``nbytes`` is sent in: one span up to
    ``PART_BYTES``, else spans of ``PART_BYTES`` (a multiple of 8) and the rest."""
    size = PART_BYTES if part_bytes is None else part_bytes
    if nbytes <= size:
        return [(0, nbytes)]
    return [(a, min(a + size, nbytes)) for a in range(0, nbytes, size)]


def entry_parts(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A manifest entry's parts, each with ``offset``, ``nbytes``, ``encoding`` and (unless
    unchanged) ``payload``, ``payload_bytes``, ``payload_xxh3``: a tensor sent in one part
    keeps these fields in its own entry."""
    if "parts" in entry:
        return entry["parts"]
    return [{**entry, "offset": 0}]


class DeltaError(RuntimeError):
    """A version cannot be applied; the receiver (and the engine) kept their last one."""


def version_dir(epoch: int, version: int) -> str:
    return f"e{epoch:03d}/v{version:08d}"


class Store:
    """The fsspec target: ``uri`` plus options; writes whole objects, atomically."""

    def __init__(self, uri: str, storage_options: Mapping[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.uri = uri.rstrip("/")
        self.max_bytes = int(max_bytes)  # the most tensor bytes a manifest read from here may claim
        self.endpoint = endpoint_of(dict(storage_options or {}))
        try:
            self.fs, root = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
        except TypeError as exc:
            self._user_error(exc)
            raise
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols
        # Threads for payload reads and writes: object stores answer each request after a
        # round trip (many at once pay it once); local files overlap with the encoding.
        self.workers = 0 if "memory" in protocols else (2 if self.local else 8)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url(self, *parts: str) -> str:
        return "/".join([self.uri, *parts])

    def _user_error(self, exc: BaseException) -> None:
        """Raise the user's mistake behind ``exc`` (no or wrong credentials, an endpoint that
        does not answer, a missing bucket, an option the filesystem does not take) as one line
        naming the URL; else return."""
        if isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc):  # s3fs: on first use
            message = f"the filesystem of {self.uri} refuses these options: {' '.join(str(exc).split())}"
            raise UserError(Problem(message, key="weight_sync.storage_options")) from None
        if not getattr(self, "local", False):
            error = remote_error(self.uri, exc, key="weight_sync.uri", options="weight_sync.storage_options",
                                 endpoint=self.endpoint)
            if error is not None:
                raise error from None

    def write(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # readers see the old object or the whole new one
        else:
            try:
                self.fs.pipe_file(path, data)  # one PUT: atomic for readers on object stores
            except Exception as exc:
                self._user_error(exc)
                raise

    def read(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel))
        except Exception as exc:  # a missing bucket is a FileNotFoundError too: told apart here
            self._user_error(exc)
            raise

    def exists(self, rel: str) -> bool:
        try:
            return self.fs.exists(self.path(rel))
        except Exception as exc:
            self._user_error(exc)
            raise

    def latest(self) -> tuple[int, int] | None:
        """(epoch, version) of the newest complete version, or None before the first."""
        try:
            data = json.loads(self.read(LATEST))
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise DeltaError(f"{self.url(LATEST)} is not valid JSON ({exc})") from None
        return int(data["epoch"]), int(data["version"])

    def next_epoch(self) -> int:
        """The epoch a new publisher opens: the one after ``LATEST``'s (0 before the first)."""
        latest = self.latest()
        return 0 if latest is None else latest[0] + 1

    def manifest(self, epoch: int, version: int) -> dict:
        """The manifest of ``version`` of ``epoch``, checked to be of this format and version."""
        rel = f"{version_dir(epoch, version)}/manifest.json"
        try:
            data = json.loads(self.read(rel))
        except FileNotFoundError:
            raise DeltaError(f"version {version}: manifest {self.url(rel)} is missing") from None
        except ValueError as exc:
            raise DeltaError(f"version {version}: manifest {self.url(rel)} is not valid JSON ({exc})") from None
        if (not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS or data.get("version") != version
                or data.get("epoch") != epoch):
            got = data if not isinstance(data, dict) else {k: data.get(k) for k in ("format", "version", "epoch")}
            raise DeltaError(f"version {version}: manifest {self.url(rel)} is not this format's manifest of it ({got!r})")
        problem = manifest_problem(data, self.max_bytes)
        if problem:
            raise DeltaError(f"version {version}: manifest {self.url(rel)}: {problem}")
        return data

    def commit(self, epoch: int, version: int, manifest: Mapping[str, Any]) -> None:
        """Make a version whose payloads are all written complete: its manifest, then, last,
        ``LATEST`` naming it."""
        self.write(f"{version_dir(epoch, version)}/manifest.json", json.dumps(manifest).encode())
        self.write(LATEST, json.dumps({"epoch": epoch, "version": version}).encode())


# The names a sender gives payload objects: a tensor's own (``t00012.zst``, a part of it
# ``t00012.p0003.zst``) or a pack (``pack0001.zst``). Nothing else is read: no folder, no ``..``.
_PAYLOAD_NAME = re.compile(r"^(t\d{5,9}(\.p\d{4,9})?|pack\d{4,9})\.zst$")
_ENCODINGS = ("full", "xor", "sparse_xor", "unchanged")


def _dtype_size(name: Any) -> int | None:
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def manifest_problem(m: Mapping[str, Any], max_bytes: int) -> str | None:
    """What is wrong with a manifest read from a store (None: nothing), checked before any
    payload is read or any buffer allocated: every name, dtype, shape and size well formed
    and consistent (a tensor's bytes = its shape times its dtype's size; its parts cover them
    in order; payload names only as a sender writes them; compressed sizes no larger than
    zstd can make them), and all tensors together at most ``max_bytes``."""
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62

    tensors = m.get("tensors")
    if not isinstance(tensors, list) or "base" not in m or (m["base"] is not None and not is_int(m["base"])):
        return "its tensor list or base version is malformed"
    total, names = 0, set()
    for i, e in enumerate(tensors):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not 0 < len(e["name"]) <= 1024 \
                or "\0" in e["name"] or e["name"] in names:
            return f"tensor {i} has no name, a malformed one or a repeated one"
        name = e["name"]
        names.add(name)
        size = _dtype_size(e.get("dtype"))
        shape = e.get("shape")
        if size is None or not isinstance(shape, list) or len(shape) > 16 or not all(is_int(d) for d in shape):
            return f"tensor {name!r} has dtype {str(e.get('dtype'))[:40]!r} and shape {str(shape)[:80]}"
        count = 1
        for d in shape:
            count *= d
        if not is_int(e.get("nbytes")) or e["nbytes"] != count * size:
            return f"tensor {name!r} claims {e.get('nbytes')!r} bytes, its shape and dtype make {count * size}"
        if not isinstance(e.get("result_xxh3"), str):
            return f"tensor {name!r} has no checksum of its result"
        total += e["nbytes"]
        if total > max_bytes:
            return f"its tensors hold more than the {max_bytes} bytes a version may have ([weight_sync] max_bytes)"
        at = 0
        for part in entry_parts(e):
            if not isinstance(part, dict) or part.get("offset") != at or not is_int(part.get("nbytes")) \
                    or part.get("encoding") not in _ENCODINGS:
                return f"tensor {name!r} has a malformed part"
            at += part["nbytes"]
            if "payload" in part:
                if not isinstance(part["payload"], str) or not _PAYLOAD_NAME.match(part["payload"]):
                    return f"tensor {name!r} names payload {str(part['payload'])[:80]!r}, not a payload's name"
                limit = part["nbytes"] + part["nbytes"] // 64 + 4096  # zstd's worst case is ~1/255 larger
                if not is_int(part.get("payload_bytes")) or part["payload_bytes"] > limit \
                        or not is_int(part.get("payload_offset", 0)) or not isinstance(part.get("payload_xxh3"), str):
                    return f"tensor {name!r} has a payload of {part.get('payload_bytes')!r} bytes for {part['nbytes']}"
            elif part["encoding"] != "unchanged":
                return f"tensor {name!r} has a {part['encoding']} part without a payload"
        if at != e["nbytes"]:
            return f"the parts of tensor {name!r} do not cover its {e['nbytes']} bytes"
    return None


def payload_key(part: Mapping[str, Any]) -> tuple[str, int]:
    """Where a part's payload lies: (object, byte offset in it; 0 for an object of its own)."""
    return part["payload"], int(part.get("payload_offset", 0))


class Packs:
    """The small payloads of one version, concatenated into pack objects
    ``pack0000.zst``, ``pack0001.zst``, ... (each payload a whole zstd frame): ``add``
    returns (object name, offset) and hands a pack to ``writes`` once it holds
    ``PACK_BYTES``; ``flush`` hands over the last one."""

    def __init__(self, writes: PayloadWrites, folder: str, pack_bytes: int | None = None):
        self.writes, self.folder = writes, folder
        self.pack_bytes = PACK_BYTES if pack_bytes is None else pack_bytes
        self.index, self.size = 0, 0
        self.chunks: list[bytes] = []

    def add(self, payload: bytes) -> tuple[str, int]:
        where = (f"pack{self.index:04d}.zst", self.size)
        self.chunks.append(payload)
        self.size += len(payload)
        if self.size >= self.pack_bytes:
            self.flush()
        return where

    def flush(self) -> None:
        if self.chunks:
            self.writes.submit(f"{self.folder}/pack{self.index:04d}.zst", b"".join(self.chunks))
            self.index, self.size, self.chunks = self.index + 1, 0, []


class PayloadWrites:
    """A publish's payload writes, in the store's threads while the next tensors are
    encoded (at most ``_INFLIGHT_BYTES`` queued); ``wait`` returns when all are written
    and raises the first error."""

    def __init__(self, store: Store, pool: ThreadPoolExecutor | None):
        self.store, self.pool = store, pool
        self.pending: collections.deque[tuple[Future, int]] = collections.deque()
        self.queued = 0

    def submit(self, rel: str, data: bytes) -> None:
        if self.pool is None:
            self.store.write(rel, data)
            return
        while self.pending and (self.queued > _INFLIGHT_BYTES or self.pending[0][0].done()):
            self._pop()
        self.pending.append((self.pool.submit(self.store.write, rel, data), len(data)))
        self.queued += len(data)

    def _pop(self) -> None:
        future, size = self.pending.popleft()
        self.queued -= size
        future.result()

    def wait(self) -> None:
        while self.pending:
            self._pop()

    def abandon(self) -> None:
        """After an error: let the queued writes finish (no manifest will name them)."""
        for future, _ in self.pending:
            future.exception()
        self.pending.clear()
