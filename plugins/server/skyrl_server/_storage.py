"""The storage root (``[server] storage``, any fsspec URL): sampler weights by name.

``tinker://{model_id}/sampler_weights/{name}`` is stored at
``{root}/{model_id}/sampler_weights/{name}.safetensors`` (the adapters in safetensors,
their config and base model in its metadata); ``tinker://{model_id}/weights/{name}``
(save_state: adapters, optimizer state, steps) at ``{root}/{model_id}/weights/{name}.pt``;
a model's durable state (written at each acknowledged optim_step, see
:mod:`skyrl_server._store`) at ``{root}/_durable/{model_id}/{steps}-{request}.pt``.
Every file is written under a temporary name and then moved over its own, so a write
cut short (a killed server) never replaces the last good file.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from skyrl_server._errors import BadRequest

SCHEME = "tinker://"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def sampler_path(model_id: str, name: str, kind: str = "sampler_weights") -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise BadRequest(f"path {name!r}: expected a name of letters, digits, '.', '_' or '-'")
    return f"{SCHEME}{model_id}/{kind}/{name}"


_EXTENSION = {"sampler_weights": "safetensors", "weights": "pt"}


class Storage:
    def __init__(self, root: str):
        import fsspec

        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.fs.makedirs(self.root, exist_ok=True)

    def _file(self, path: str, kind: str = "sampler_weights") -> str:
        expected = f"expected tinker://MODEL_ID/{kind}/NAME"
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise BadRequest(f"path {path!r}: {expected}")
        model_id, _, rest = path[len(SCHEME):].partition("/")
        found, _, name = rest.partition("/")
        if found != kind or not _NAME.match(name) or not model_id or "/" in model_id or ".." in model_id:
            raise BadRequest(f"path {path!r}: {expected}")
        safe_id = model_id.replace(":", "_")
        return f"{self.root.rstrip('/')}/{safe_id}/{kind}/{name}.{_EXTENSION[kind]}"

    def _write(self, file: str, data: bytes) -> None:
        """``data`` at ``file``: written to a temporary name beside it, then moved over it."""
        folder = file.rsplit("/", 1)[0]
        self.fs.makedirs(folder, exist_ok=True)
        temp = f"{folder}/.tmp-{uuid.uuid4().hex}"
        try:
            with self.fs.open(temp, "wb") as f:
                f.write(data)
            self.fs.mv(temp, file)
        finally:
            if self.fs.exists(temp):
                self.fs.rm(temp)

    def write_state(self, path: str, state: dict[str, Any]) -> None:
        """A training state (adapters, their config, base model, optimizer) at a ``.../weights/NAME`` path."""
        self._write(self._file(path, "weights"), _torch_bytes(state))

    def read_state(self, path: str) -> dict[str, Any]:
        file = self._file(path, "weights")
        if not self.fs.exists(file):
            raise BadRequest(f"path {path!r}: no such training state", status=404)
        return self._read_torch(file)

    def _read_torch(self, file: str) -> dict[str, Any]:
        import io

        import torch

        with self.fs.open(file, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True)  # tensors and plain values only

    # -- durable model states (the database row names the file) -------------------------

    def _durable_folder(self, model_id: str) -> str:
        return f"{self.root.rstrip('/')}/_durable/{model_id.replace(':', '_')}"

    def write_durable(self, model_id: str, name: str, state: dict[str, Any]) -> str:
        """The model's state as ``{name}.pt`` in its durable folder; the file's location."""
        if not _NAME.match(name):
            raise ValueError(f"bad durable state name {name!r}")
        file = f"{self._durable_folder(model_id)}/{name}.pt"
        self._write(file, _torch_bytes(state))
        return file

    def read_durable(self, file: str) -> dict[str, Any]:
        return self._read_torch(file)

    def prune_durable(self, model_id: str, keep: str | None) -> None:
        """Delete the model's durable files other than ``keep`` (older states, torn writes)."""
        folder = self._durable_folder(model_id)
        if not self.fs.exists(folder):
            return
        for file in self.fs.ls(folder, detail=False):
            if file.rstrip("/").rsplit("/", 1)[-1] != (keep or "").rstrip("/").rsplit("/", 1)[-1]:
                self.fs.rm(file)

    def write_sampler_weights(self, path: str, weights: Any) -> None:
        from skyrl_server._sampling import safetensors_bytes

        self._write(self._file(path), safetensors_bytes(weights.tensors, weights.config, weights.base))

    def read_sampler_weights(self, path: str) -> Any:
        from skyrl_server._sampling import SamplerWeights, from_safetensors_bytes

        file = self._file(path)
        if not self.fs.exists(file):
            raise BadRequest(f"model_path {path!r}: no such sampler weights", status=404)
        with self.fs.open(file, "rb") as f:
            tensors, config, base = from_safetensors_bytes(f.read())
        return SamplerWeights(base, tensors, config, 0)


def _torch_bytes(state: dict[str, Any]) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()
