"""Cheap checks of a checkpoint folder's safetensors files (no heavy imports, no tensor
data read): each file's 8-byte header length, its JSON header, and that the file is as
long as the header says; for a sharded checkpoint, ``model.safetensors.index.json`` and
every shard it names. A truncated, corrupt or missing file is a user error naming the file
and the fix, found by ``skyrl validate`` (the ``[model] path`` validator) and again right
before ``from_pretrained`` loads the folder.

- :func:`safetensors_problem`: the sentence for the first bad file of a folder, or None;
- :func:`check_safetensors`: the same, raised as a :class:`~skyrl_host.errors.UserError`;
- :func:`load_errors` / :func:`load_error`: what ``from_pretrained`` raises for an
  unreadable weight file, and the user error it becomes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from skyrl_host.errors import Problem, UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100_000_000  # bytes: the safetensors format's own limit on the JSON header
FIX = "re-download or re-save the checkpoint"


def _file_problem(file: str) -> str | None:
    """What is wrong with one safetensors file, or None if its header and length agree."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{file!r} is truncated: {size} bytes, not even the 8-byte header length; {FIX}"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                return (f"{file!r} is not a safetensors file (corrupt): its first 8 bytes give a header of "
                        f"{n} bytes, more than the format allows; {FIX}")
            if 8 + n > size:
                return (f"{file!r} is truncated: its header alone is {8 + n} bytes long, the file has {size}; {FIX}")
            raw = f.read(n)
    except OSError as exc:
        return f"cannot read {file!r}: {exc.strerror or exc}"
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        return f"{file!r} is corrupt: its header is not a JSON object; {FIX}"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(x) is int for x in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            return f"{file!r} is corrupt: its header gives tensor {name!r} no valid data_offsets; {FIX}"
        end = max(end, offsets[1])
    expected = 8 + n + end
    if size < expected:
        return f"{file!r} is truncated: the header promises {expected} bytes, the file has {size}; {FIX}"
    if size > expected:
        return (f"{file!r} is corrupt: the header accounts for {expected} bytes, the file has {size} "
                f"({size - expected} bytes too many); {FIX}")
    return None


def safetensors_problem(folder: str | os.PathLike[str]) -> str | None:
    """The first problem of the safetensors files of ``folder``: those its
    ``model.safetensors.index.json`` names (all must be there), else ``model.safetensors``
    if present. None if they are sound, or if the folder has no safetensors weights at all
    (``from_pretrained`` says what it misses)."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            return f"cannot read {index!r}: {exc.strerror or exc}"
        except (UnicodeDecodeError, ValueError):
            return f"{index!r} is corrupt: not valid JSON; {FIX}"
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if (not isinstance(weight_map, dict) or not weight_map
                or not all(isinstance(v, str) for v in weight_map.values())):
            return f"{index!r} is corrupt: it has no weight_map of tensor names to shard files; {FIX}"
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            file = os.path.join(folder, shard)
            if not os.path.isfile(file):
                return f"{file!r} is missing: {INDEX} names {len(shards)} shards; {FIX}"
        for shard in shards:
            problem = _file_problem(os.path.join(folder, shard))
            if problem:
                return problem
        return None
    single = os.path.join(folder, SINGLE)
    return _file_problem(single) if os.path.isfile(single) else None


def check_safetensors(folder: str | os.PathLike[str], *, key: str = "model.path") -> None:
    """Raise a :class:`UserError` at ``key`` naming the first bad safetensors file of ``folder``."""
    problem = safetensors_problem(folder)
    if problem:
        raise UserError(Problem(problem, key=key))


def load_errors() -> tuple[type[BaseException], ...]:
    """What ``from_pretrained`` raises for a missing or unreadable weight file."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - transformers depends on safetensors
        return (OSError,)
    return (OSError, SafetensorError)


def load_error(path: str, exc: BaseException, *, key: str = "model.path") -> UserError:
    """The user error for ``exc``, raised by ``from_pretrained(path)``: the bad file if the
    files tell which (e.g. one changed since the check), else ``exc``'s own words."""
    problem = safetensors_problem(path)
    if problem is None:
        problem = f"cannot load the model from {path!r}: {_one_line(exc)}"
        if "deserializing header" in str(exc) or type(exc).__name__ == "SafetensorError":
            problem += f"; {FIX}"
    return UserError(Problem(problem, key=key))


def _one_line(exc: Any) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
