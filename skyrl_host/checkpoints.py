"""Checkpoint folders of a run: ``<output_dir>/checkpoints/step_000010/``.

A checkpoint is written into a temporary folder and renamed into place only when
complete (a rename is atomic), so a run killed mid-write leaves either the old
set of checkpoints or the new one, never a torn checkpoint that resume would
trust. Old checkpoints beyond ``keep`` are removed after a new one lands.

Every checkpoint carries ``job.json``, the record of the job that wrote it (a copy of
the run's ``<output_dir>/job.json``), so ``skyrl run --resume`` can tell a checkpoint
of another job (another model family or size, another backend) from one of this
job before any state is loaded (:func:`resume_mismatches`); :func:`load_backend_state`
turns a state the backend refuses into a user error naming the checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Any, Iterator, Mapping

from skyrl_host.errors import UserError

CHECKPOINTS = "checkpoints"
JOB_RECORD = "job.json"  # in the output folder (the run's job) and in each checkpoint (the job that wrote it)
BACKEND_STATE = "backend.safetensors"  # skyrl_host.statefile: no pickle, nothing in it runs on --resume
BACKEND_SHARDS = "backend"  # the folder a ShardedCheckpoints backend's ranks write into
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: pathlib.Path) -> pathlib.Path:
    return output_dir / CHECKPOINTS


def list_checkpoints(output_dir: pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = _STEP.match(path.name)
        if m and path.is_dir():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: pathlib.Path) -> tuple[int, pathlib.Path] | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


class CheckpointWriter:
    """``with CheckpointWriter(output_dir, step) as folder: ...write files...``;
    the folder becomes visible as ``step_<n>`` only if the block succeeds."""

    def __init__(self, output_dir: pathlib.Path, step: int, keep: int = 2):
        self.root = checkpoint_root(output_dir)
        self.final = self.root / f"step_{step:06d}"
        self.tmp = self.root / f".step_{step:06d}.tmp"
        self.keep = keep

    def __enter__(self) -> pathlib.Path:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        record = self.root.parent / JOB_RECORD
        if record.is_file() and not (self.tmp / JOB_RECORD).exists():
            shutil.copyfile(record, self.tmp / JOB_RECORD)  # which job wrote this checkpoint
        if self.final.exists():
            shutil.rmtree(self.final)
        self.tmp.rename(self.final)
        for _, old in list_checkpoints(self.root.parent)[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def stale_temporaries(output_dir: pathlib.Path) -> Iterator[pathlib.Path]:
    root = checkpoint_root(output_dir)
    if root.is_dir():
        yield from (p for p in root.iterdir() if p.name.endswith(".tmp"))


# -- does a checkpoint belong to the job resuming from it? --------------------------


def read_job_record(path: pathlib.Path) -> dict[str, Any] | None:
    """The job record (``describe_spec``'s JSON) at ``path``; None when there is no file.
    A file that is not a job record is a user error naming it."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"--resume: {path} is not a skyrl job record: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), dict) or not isinstance(record.get("plugins"), dict):
        raise UserError(f"--resume: {path} is not a skyrl job record (no 'kind' and 'plugins' tables)")
    return record


def _shown(value: Any) -> str:
    return "unset" if value is None else json.dumps(value, default=str)


def _entry(record: Mapping[str, Any], table: str) -> Mapping[str, Any] | None:
    entries = record.get("plugins", {}).get(table) or []
    return entries[0] if entries and isinstance(entries[0], Mapping) else None


def resume_mismatches(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(job key, what differs)`` for each part of the job that a checkpoint's state
    depends on and that differs between the job that wrote it (``recorded``) and the
    job resuming from it (``current``), both as ``runner.describe_spec`` writes them.

    Compared: the job kind, the model family and every key of its config (its
    architecture and weights), and the backend (whose state format the checkpoint
    holds). Everything else (steps, learning rate, engine, data...) may change on resume."""
    from skyrl_host.config import SLOTS

    out: list[tuple[str, str]] = []
    was, now = recorded.get("kind", {}).get("name"), current.get("kind", {}).get("name")
    if was != now:
        return [("job.kind", f"it was written by a {was!r} job, this is a {now!r} job")]
    for table in ("model", "backend"):
        old, new = _entry(recorded, table), _entry(current, table)
        if old is None or new is None:
            continue
        selector = SLOTS[table].selector
        if old.get("name") != new.get("name"):
            out.append((f"{table}.{selector}",
                        f"it was written with {table}.{selector} = {_shown(old.get('name'))}, this job has "
                        f"{_shown(new.get('name'))}"))
            continue
        if table != "model":
            continue
        old_cfg, new_cfg = old.get("config") or {}, new.get("config") or {}
        for key in sorted(set(old_cfg) | set(new_cfg)):
            if old_cfg.get(key) != new_cfg.get(key):
                out.append((f"{table}.{key}",
                            f"it was written with {table}.{key} = {_shown(old_cfg.get(key))}, this job has "
                            f"{_shown(new_cfg.get(key))}"))
    return out


def _first_lines(text: str, limit: int = 300) -> str:
    """An exception's message on one line, cut to ``limit`` characters."""
    one = " ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return one if len(one) <= limit else one[: limit - 3].rstrip() + "..."


def _sharded(backend: Any) -> bool:
    from skyrl_host.contracts import has
    from skyrl_host.interfaces import ShardedCheckpoints

    return has(backend, ShardedCheckpoints)


def save_backend_state(folder: pathlib.Path, backend: Any) -> None:
    """The backend's training state into the checkpoint being written in ``folder``: a
    :class:`~skyrl_host.interfaces.ShardedCheckpoints` backend's ranks each write their
    own shards into ``folder/backend/``, any other backend's ``state_dict`` goes to
    ``folder/backend.safetensors`` (:mod:`skyrl_host.statefile`)."""
    if _sharded(backend):
        (folder / BACKEND_SHARDS).mkdir(exist_ok=True)
        backend.save_checkpoint(str(folder / BACKEND_SHARDS))
        return
    from skyrl_host.statefile import save_state

    save_state(backend.state_dict(), folder / BACKEND_STATE)


def read_state(folder: pathlib.Path, stem: str) -> Any:
    """``folder/<stem>.safetensors`` (:func:`skyrl_host.statefile.load_state`); a checkpoint
    written before that format (``<stem>.pt``) through torch's weights-only loader, which
    rebuilds tensors and plain values and refuses anything else. Unreadable: a user error
    naming the file."""
    import pickle

    from skyrl_host.statefile import load_state

    path = folder / f"{stem}.safetensors"
    legacy = folder / f"{stem}.pt"
    if not path.is_file() and legacy.is_file():
        import torch

        try:
            return torch.load(legacy, weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
            raise UserError(
                f"--resume: cannot read {legacy} (a checkpoint of an older skyrl-host, read with torch's weights-only "
                f"loader, since pickle from a file could run code): {_first_lines(str(exc))}") from None
    try:
        return load_state(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--resume: cannot read checkpoint {folder}: {_first_lines(str(exc))}") from None


# What a torch.distributed.checkpoint ``.metadata`` pickle may name: its own dataclasses and
# enums, torch.Size, dtypes, layouts and memory formats, paths. Anything else (a function, a class
# that runs code when built) means the file was made to run code when unpickled.
_DCP_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "TensorWriteData", "WriteItem", "WriteItemType", "LoadPlan", "ReadItem", "LoadItemType"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # the checkpoint_id it was saved to
}


def dcp_metadata_problem(path: pathlib.Path) -> str | None:
    """None when ``path`` (a ``.metadata`` file of torch.distributed.checkpoint, which
    torch reads with plain pickle) names only the classes such metadata holds; else what it
    names. Read with an unpickler that builds nothing else, so a planted file runs nothing
    here and is refused before torch unpickles it."""
    import pickle

    import torch

    class Restricted(pickle.Unpickler):  # noqa: the one unpickler: find_class allows only the names above
        def find_class(self, module: str, name: str) -> Any:
            value = getattr(torch, name, None) if module == "torch" else None
            if (module == "torch" and (name == "Size" or isinstance(value, (torch.dtype, torch.layout,
                                                                               torch.memory_format)))) \
                    or name in _DCP_ALLOWED.get(module, ()):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"it names {module}.{name}")

        def persistent_load(self, pid: Any) -> Any:
            raise pickle.UnpicklingError("it refers to persistent objects")

    try:
        with open(path, "rb") as f:
            Restricted(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, MemoryError) as exc:
        return str(exc) or type(exc).__name__
    return None


def load_backend_state(folder: pathlib.Path, backend: Any, state: Any = None) -> None:
    """Restore the backend's state from the checkpoint in ``folder``: its ``backend/``
    shards (a :class:`~skyrl_host.interfaces.ShardedCheckpoints` backend), else
    ``backend.load_state_dict`` of its ``backend.safetensors`` (or of ``state``, already read
    from it). A state the backend refuses (missing or unexpected keys, shape mismatches,
    another format) is a user error naming the checkpoint folder."""
    shards = folder / BACKEND_SHARDS
    if state is None and shards.is_dir():
        if not _sharded(backend):
            raise UserError(f"--resume: checkpoint {folder} holds a sharded backend state ({shards}/), which this "
                            f"job's backend cannot read (was it written by another backend?)")
        for meta in sorted(shards.rglob(".metadata")):  # torch.distributed.checkpoint unpickles these
            problem = dcp_metadata_problem(meta)
            if problem:
                raise UserError(f"--resume: {meta} is not a distributed checkpoint's metadata: {problem}")
        try:
            backend.load_checkpoint(str(shards))
        except (KeyError, ValueError, RuntimeError, OSError) as exc:
            what = _first_lines(str(exc) if not isinstance(exc, KeyError) else f"missing key {exc}")
            raise UserError(f"--resume: checkpoint {folder} does not fit this job's backend: {what}") from None
        return
    if state is None:
        state = read_state(folder, "backend")
    if not isinstance(state, Mapping):
        raise UserError(f"--resume: checkpoint {folder} holds no backend state ({BACKEND_STATE} holds a {type(state).__name__})")
    try:
        backend.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError) as exc:
        what = _first_lines(str(exc) if not isinstance(exc, KeyError) else f"missing key {exc}")
        raise UserError(
            f"--resume: checkpoint {folder} does not fit this job's backend (was it written by another job?): {what}"
        ) from None
