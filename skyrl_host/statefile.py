"""State files that run no code when read: a tree of plain values and arrays in one safetensors file.

A checkpoint's random state, a backend's ``state_dict`` (model, optimizer and schedule
state) and an asynchronous run's buffered rollouts are nested dicts, lists and tuples of
numbers, strings, tensors and numpy arrays. Pickle (what ``torch.save`` writes) would
rebuild them by calling whatever the file names, so a checkpoint folder from elsewhere
could run code on ``--resume``. Here every tensor and array is a safetensors entry (the
format is a JSON header plus raw bytes: nothing executes), and the shape of the tree is
JSON in the header's metadata, with a tag for each kind of node:

- JSON scalars (None, bools, ints, floats incl. NaN/inf, strings) as themselves;
- ``{"l": [...]}`` a list, ``{"t": [...]}`` a tuple, ``{"d": [[key, value], ...]}`` a dict
  (keys: strings, ints, floats, bools, None or tuples of them), ``{"b": "<base64>"}`` bytes;
- ``{"T": "<entry>"}`` a torch tensor, ``{"A": "<entry>"}`` a numpy array, ``{"s": "<dtype>",
  "v": value}`` a numpy scalar;
- ``{"R": {name: "<entry>", ...}}`` a :class:`~skyrl_host.rollout.RolloutBatch` (its
  ``to_arrays`` / ``from_arrays``, which validates every array).

Nothing else can be written (a ``TypeError`` names the path of the value) and nothing else
is read: an unknown tag, an entry the header does not hold, a tree nested deeper than
:data:`MAX_DEPTH` or a header that is not this format is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pathlib
from typing import Any, Mapping

FORMAT = "skyrl-state/1"
MAX_DEPTH = 64  # nesting of the tree: state dicts nest 4-6 deep


def _enc_key(key: Any, path: str) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    if isinstance(key, tuple):
        return {"t": [_enc_key(k, path) for k in key]}
    raise TypeError(f"{path}: a dict key of type {type(key).__name__} cannot be stored")


def save_state(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` (see the module docstring for what it may hold) to ``path`` (through a
    temporary file renamed into place: a reader never sees half a file)."""
    from safetensors.torch import save_file

    tensors, metadata = _encode(obj)
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def dumps_state(obj: Any) -> bytes:
    """``obj`` as the bytes of a state file (for messages between processes)."""
    from safetensors.torch import save

    tensors, metadata = _encode(obj)
    return save(tensors, metadata=metadata)


def _encode(obj: Any) -> tuple[dict[str, Any], dict[str, str]]:
    import numpy as np
    import torch

    from skyrl_host.rollout import RolloutBatch

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def entry(t: torch.Tensor) -> str:
        name = str(len(tensors))
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        if ptr and ptr in seen:  # safetensors refuses tensors that share memory: a copy of each repeat
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        tensors[name] = t
        return name

    def enc(x: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"{path}: nested deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int) and not isinstance(x, bool):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"f": repr(x)}
        if isinstance(x, torch.Tensor):
            return {"T": entry(x)}
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise TypeError(f"{path}: a numpy array of Python objects cannot be stored")
            return {"A": entry(torch.from_numpy(np.ascontiguousarray(x)))}
        if isinstance(x, np.generic):
            return {"s": x.dtype.str, "v": enc(x.item(), path, depth + 1)}
        if isinstance(x, (bytes, bytearray)):
            return {"b": base64.b64encode(bytes(x)).decode()}
        if isinstance(x, RolloutBatch):
            return {"R": {k: entry(torch.from_numpy(np.ascontiguousarray(v))) for k, v in x.to_arrays().items()}}
        if isinstance(x, list):
            return {"l": [enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"t": [enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, Mapping):  # dicts, and read-only mappings (read back as dicts)
            return {"d": [[_enc_key(k, path), enc(v, f"{path}[{k!r}]", depth + 1)] for k, v in x.items()]}
        raise TypeError(f"{path}: a value of type {type(x).__module__}.{type(x).__qualname__} cannot be stored "
                        "(plain values, lists, tuples, dicts, tensors, numpy arrays and rollout batches can)")

    tree = enc(obj, "state", 0)
    return tensors, {"format": FORMAT, "tree": json.dumps(tree, separators=(",", ":"))}


def load_state(path: str | os.PathLike[str]) -> Any:
    """Read what :func:`save_state` wrote. A file that is not one, or holds anything else,
    is a ``ValueError`` naming it; a missing file is ``FileNotFoundError``."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path} is not a state file ({_first(exc)})") from None
    return _decode(tensors, meta, str(path))


def loads_state(data: bytes, where: str = "a state message") -> Any:
    """Read what :func:`dumps_state` made; anything else is a ``ValueError`` naming ``where``."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = bytes(data)
    try:
        if len(data) < 8:
            raise ValueError("shorter than a header")
        n = int.from_bytes(data[:8], "little")
        if n > len(data) - 8:
            raise ValueError(f"its header claims {n} bytes, it has {len(data) - 8}")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        tensors = load(data)
    except (SafetensorError, RuntimeError, ValueError, AttributeError, RecursionError) as exc:
        raise ValueError(f"{where} is not a state file ({_first(exc)})") from None
    return _decode(tensors, meta, where)


def _first(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _decode(tensors: dict[str, Any], meta: Any, path: str) -> Any:
    import numpy as np
    import torch

    from skyrl_host.rollout import RolloutBatch

    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a state file (no metadata)")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a state file (its header says format {meta.get('format')!r}, not {FORMAT!r})")
    try:
        tree = json.loads(meta["tree"]) if isinstance(meta.get("tree"), str) else None
        if tree is None:
            raise ValueError("no tree")
    except (ValueError, RecursionError):
        raise ValueError(f"{path}: its tree is not JSON (or is nested too deep)") from None

    def tensor(name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in tensors:
            raise ValueError(f"{path}: the tree names an entry the file does not hold ({name!r})")
        return tensors[name]

    def key(k: Any, depth: int) -> Any:
        if k is None or isinstance(k, (bool, int, float, str)):
            return k
        if isinstance(k, dict) and set(k) == {"t"} and isinstance(k["t"], list) and depth < MAX_DEPTH:
            return tuple(key(v, depth + 1) for v in k["t"])
        raise ValueError(f"{path}: a dict key the format does not have ({str(k)[:80]})")

    def dec(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"{path}: the tree nests deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, dict) and len(x) == 1:
            (tag, v), = x.items()
            if tag == "l" and isinstance(v, list):
                return [dec(i, depth + 1) for i in v]
            if tag == "t" and isinstance(v, list):
                return tuple(dec(i, depth + 1) for i in v)
            if tag == "d" and isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
                return {key(k, depth + 1): dec(val, depth + 1) for k, val in v}
            if tag == "T":
                return tensor(v)
            if tag == "A":
                return tensor(v).numpy()
            if tag == "f" and v in ("nan", "inf", "-inf"):
                return float(v)
            if tag == "b" and isinstance(v, str):
                return base64.b64decode(v, validate=True)
            if tag == "R" and isinstance(v, dict):
                return RolloutBatch.from_arrays({str(k): tensor(n).numpy() for k, n in v.items()})
        if isinstance(x, dict) and set(x) == {"s", "v"} and isinstance(x["s"], str):
            try:
                dtype = np.dtype(x["s"])
            except TypeError:
                raise ValueError(f"{path}: unknown numpy dtype {x['s'][:40]!r}") from None
            if dtype.hasobject:
                raise ValueError(f"{path}: numpy object scalars are not stored")
            return dtype.type(dec(x["v"], depth + 1))
        raise ValueError(f"{path}: a node the format does not have ({str(x)[:80]})")

    try:
        return dec(tree, 0)
    except (TypeError, KeyError, AttributeError, ValueError) as exc:  # e.g. a RolloutBatch missing an array
        msg = str(exc)
        raise ValueError(msg if msg.startswith(path) else f"{path}: {msg}") from None
