"""The engine's half of ``delta``: :class:`DeltaReceiver` fetches the versions it needs
(checking every payload's checksum), applies them byte-exactly to its copy of the
weights, undoing everything on any mismatch, and hands the engine the complete set."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import numpy as np
import zstandard

from skyrl_host.contracts import has
from skyrl_host.interfaces import WorkerReceiving

from .codec import checksum, fill, from_bytes, sparse_raw, xor_payload, xor_sparse
from .store import DEFAULT_MAX_BYTES, DeltaError, Store, entry_parts, payload_key, version_dir


class DeltaReceiver:
    """The engine's half: ``fetch()`` (may run while the engine generates), then
    ``apply(engine)`` at a safe point; ``sync(engine)`` does both."""

    def __init__(self, uri: str, *, storage_options: Mapping[str, Any] | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.store = Store(uri, storage_options, max_bytes)  # every manifest is checked (store.manifest_problem)
        self.version: int | None = None
        self.epoch: int | None = None
        self._bufs: dict[str, np.ndarray] = {}  # the current bytes of every tensor
        self._meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._fetched: list[tuple[dict, dict[str, bytes]]] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.decompressor = zstandard.ZstdDecompressor()
        self._pool: ThreadPoolExecutor | None = None
        self._scratch = np.empty(0, np.uint8)  # payloads are decompressed here (reused: no page faults)
        self.changed: set[str] | None = None  # the tensors the last apply changed (None: not known)
        self.storage_options = dict(storage_options or {})

    # -- fetching ----------------------------------------------------------------

    def _plan(self, epoch: int, target: int) -> list[dict]:
        """The manifests to apply, oldest first, to go from the receiver's version to
        ``target`` of ``epoch`` (from the epoch's keyframe when the receiver is elsewhere)."""
        chain: list[dict] = []
        v: int | None = target
        while v is not None:
            if self.epoch == epoch and self.version is not None and v == self.version:
                break
            m = self.store.manifest(epoch, v)
            chain.append(m)
            if m["base"] is None:
                break
            v = int(m["base"])
        return chain[::-1]

    def fetch(self, target: int | None = None) -> int | None:
        """Download what is needed to reach ``target`` (default: the latest complete
        version), verifying payload checksums. Returns the version fetched (None: up to
        date)."""
        latest = self.store.latest()
        if latest is None:
            self._fetched = []
            return None
        epoch = latest[0]
        target = latest[1] if target is None else int(target)
        if epoch == self.epoch and target == self.version:
            self._fetched = []
            return None
        fetched = []
        for m in self._plan(epoch, target):
            todo = [(e, p) for e in m["tensors"] for p in entry_parts(e) if "payload" in p]
            files: dict[str, dict] = {}  # each object once (a pack holds many payloads), with its first tensor
            for e, p in todo:
                files.setdefault(p["payload"], e)
            if self.store.workers and len(files) > 1:  # all at once, then the first failure in manifest order
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.store.workers, thread_name_prefix="delta-read")
                got: Iterable[Any] = self._pool.map(lambda fe, m=m: self._read(m, *fe), files.items())
            else:
                got = (self._read(m, f, e) for f, e in files.items())
            objects = dict(zip(files, got))
            payloads: dict[tuple[str, int], bytes] = {}  # by (object, offset)
            for entry, part in todo:
                data = objects[part["payload"]]
                if isinstance(data, BaseException):
                    raise data
                payloads[payload_key(part)] = self._check(m, entry, part, data)
            fetched.append((m, payloads))
        self._fetched = fetched
        return target

    def _read(self, m: dict, file: str, entry: dict) -> bytes | BaseException:
        """The object ``file`` of version ``m`` (holding a payload of tensor ``entry``), or the error to raise."""
        rel = f"{version_dir(m['epoch'], m['version'])}/{file}"
        try:
            return self.store.read(rel)
        except FileNotFoundError:
            return DeltaError(f"version {m['version']}: payload {self.store.url(rel)} "
                              f"(tensor {entry['name']!r}) is missing")
        except Exception as exc:  # noqa: BLE001 - raised by fetch, in manifest order
            return exc

    def _check(self, m: dict, entry: dict, part: Mapping[str, Any], data: bytes) -> bytes:
        """``part``'s payload in the object ``data`` (all of it, or its slice of a pack),
        checked against the manifest's size and checksum."""
        url = self.store.url(version_dir(m["epoch"], m["version"]), part["payload"])
        size = part["payload_bytes"]
        if "payload_offset" in part:
            at = part["payload_offset"]
            if not isinstance(at, int) or at < 0:
                raise DeltaError(f"version {m['version']}: manifest gives tensor {entry['name']!r} the offset {at!r} "
                                 f"in {url}")
            data, url = data[at:at + size], f"{url} bytes {at}-{at + size}"
        if len(data) != size or checksum(data) != part["payload_xxh3"]:
            raise DeltaError(f"version {m['version']}: payload {url} (tensor {entry['name']!r}) fails its checksum")
        return data

    def prefetch(self, target: int | None = None) -> None:
        """``fetch`` in a background thread (the engine keeps generating); ``apply`` waits for it."""
        self._error = None

        def run() -> None:
            try:
                self.fetch(target)
            except BaseException as exc:  # noqa: BLE001 - re-raised by apply()
                self._error = exc

        self._thread = threading.Thread(target=run, name="delta-prefetch", daemon=True)
        self._thread.start()

    # -- applying ----------------------------------------------------------------

    def _apply_one(self, m: dict, payloads: dict[str, bytes]) -> list[tuple[str, int, int, str, bytes]]:
        """Apply one manifest to the buffers; returns the undo list (name, offset, size, encoding, payload)."""
        undo: list[tuple[str, int, int, str, bytes]] = []
        version, epoch = m["version"], m["epoch"]
        keyframe = m["base"] is None
        if not keyframe and (m["base"] != self.version or epoch != self.epoch):
            raise DeltaError(f"version {version}: based on version {m['base']}, but the receiver has {self.version}")
        if not keyframe and {e["name"] for e in m["tensors"]} != set(self._bufs):
            raise DeltaError(f"version {version}: its tensors are not those of version {self.version} it is based on")
        new_bufs: dict[str, np.ndarray] = {}
        try:
            for entry in m["tensors"]:
                name = entry["name"]
                parts = entry_parts(entry)
                self._check_parts(m, entry, parts)
                if keyframe:
                    buf = np.empty(entry["nbytes"], dtype=np.uint8)
                    new_bufs[name] = buf
                else:
                    buf = self._bufs.get(name)
                    if buf is None or buf.size != entry["nbytes"]:
                        raise DeltaError(f"version {version}: tensor {name!r} does not match the receiver's version {self.version}")
                for part in parts:
                    enc, a = part["encoding"], part["offset"]
                    view = buf[a:a + part["nbytes"]]
                    if keyframe:
                        if enc != "full":
                            raise DeltaError(f"version {version}: keyframe tensor {name!r} has encoding {enc!r}")
                        if view.size:
                            self._decompress_into(payloads[payload_key(part)], view, m, entry, part)
                        continue
                    if enc == "unchanged":
                        continue
                    file = self.store.url(version_dir(epoch, version), part.get("payload", "?"))
                    if enc not in ("xor", "sparse_xor"):
                        raise DeltaError(f"version {version}: tensor {name!r} has unknown encoding {enc!r}")
                    payload = payloads[payload_key(part)]
                    if enc == "xor":
                        xor = self._scratch_buffer(view.size)
                        self._decompress_into(payload, xor, m, entry, part)
                        np.bitwise_xor(view, xor, out=view)
                    else:
                        try:
                            xor_sparse(view, sparse_raw(self.decompressor, payload, self._scratch_buffer))
                        except (ValueError, zstandard.ZstdError) as exc:
                            raise DeltaError(f"version {version}: payload {file} (tensor {name!r}): {exc}") from None
                    undo.append((name, a, view.size, enc, payload))  # undone by applying it again
                if checksum(buf) != entry["result_xxh3"]:
                    where = entry.get("payload", "manifest.json") if len(parts) == 1 else "manifest.json"
                    file = f"{version_dir(epoch, version)}/{where}"
                    raise DeltaError(f"version {version}: tensor {name!r} from {self.store.url(file)} does not give "
                                     "the published bytes (checksum mismatch)")
        except BaseException:
            self._undo(undo)
            raise
        if keyframe:
            self._bufs = new_bufs
        self._meta = {e["name"]: (e["dtype"], tuple(e["shape"])) for e in m["tensors"]}
        self.version, self.epoch = version, epoch
        return undo

    def _check_parts(self, m: dict, entry: dict, parts: list[Mapping[str, Any]]) -> None:
        """The parts must cover the tensor's bytes end to end, in order."""
        at = 0
        for part in parts:
            if part.get("offset") != at or not isinstance(part.get("nbytes"), int) or part["nbytes"] < 0:
                break
            at += part["nbytes"]
        else:
            if at == entry["nbytes"]:
                return
        file = self.store.url(version_dir(m["epoch"], m["version"]), "manifest.json")
        raise DeltaError(f"version {m['version']}: the parts of tensor {entry['name']!r} in {file} do not cover "
                         f"its {entry['nbytes']} bytes")

    def _undo(self, undo: list[tuple[str, int, int, str, bytes]]) -> None:
        """XOR is its own inverse: apply the same payloads again, newest first."""
        for name, a, n, encoding, payload in reversed(undo):
            xor_payload(self._bufs[name][a:a + n], encoding, payload, self.decompressor, self._scratch_buffer)

    def _scratch_buffer(self, n: int) -> np.ndarray:
        if self._scratch.size < n:
            self._scratch = np.empty(n, dtype=np.uint8)
        return self._scratch[:n]

    def _decompress_into(self, payload: bytes, out: np.ndarray, m: dict, entry: dict, part: Mapping[str, Any]) -> None:
        """Decompress a payload straight into ``out`` (no intermediate buffer); it must fill it exactly."""
        version = m["version"]
        file = self.store.url(version_dir(m["epoch"], version), part.get("payload", "?"))
        try:
            full = fill(self.decompressor, payload, out)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"version {version}: payload {file} (tensor {entry['name']!r}): {exc}") from None
        if not full:
            raise DeltaError(f"version {version}: payload {file} (tensor {entry['name']!r}) does not hold "
                             f"{out.size} bytes")

    def apply(self, engine: Any) -> dict[str, float]:
        """Apply what ``fetch``/``prefetch`` got, all versions or none, then hand the
        engine the complete new weights (``engine.update_weights``)."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                error, self._error = self._error, None
                raise error
        fetched, self._fetched = self._fetched, None
        if fetched is None:
            raise RuntimeError("apply() before fetch() or prefetch()")
        if not fetched:
            return {"sync_applied": 0.0}
        saved = (self.version, self.epoch, dict(self._bufs), dict(self._meta))
        undos: list[list[tuple[str, int, int, str, bytes]]] = []
        self.changed = set()
        try:
            for m, payloads in fetched:
                undos.append(self._apply_one(m, payloads))
                self.changed.update(e["name"] for e in m["tensors"] if m["base"] is None
                                    or any(p["encoding"] != "unchanged" for p in entry_parts(e)))
            engine.update_weights(self.current_weights(), self.version)
        except BaseException:
            for undo in reversed(undos):
                self._undo(undo)
            self.version, self.epoch, self._bufs, self._meta = saved
            raise
        return {"sync_applied": float(len(fetched)), "sync_apply_s": time.perf_counter() - t0}

    def current_weights(self) -> list[tuple[str, Any]]:
        """The tensors of the version this receiver holds (after a failed apply: the
        version before it)."""
        return [(name, from_bytes(buf, *self._meta[name])) for name, buf in self._bufs.items()]

    def worker_recipe(self) -> dict[str, Any]:
        """How an engine's own worker processes build this receiver (see
        :class:`skyrl_host.interfaces.WorkerReceiving`)."""
        return {"receiver": "delta",
                "kwargs": {"uri": self.store.uri, "storage_options": self.storage_options,
                           "max_bytes": self.store.max_bytes}}

    def sync(self, engine: Any, target: int | None = None) -> dict[str, float]:
        """Fetch and apply ``target``; an engine whose workers receive weights themselves
        (vLLM's) is handed this receiver's recipe and does both in its workers."""
        if has(engine, WorkerReceiving) and engine.receives_in_workers:
            return dict(engine.receive_in_workers(self.worker_recipe(), target))
        t0 = time.perf_counter()
        self.fetch(target)
        fetch_s = time.perf_counter() - t0
        out = self.apply(engine)
        out["sync_fetch_s"] = fetch_s
        return out
