"""The storage root (``[server] storage``, any fsspec URL): sampler weights by name.

``tinker://{model_id}/sampler_weights/{name}`` is stored at
``{root}/{model_id}/sampler_weights/{name}.safetensors`` (the adapters in safetensors,
their config and base model in its metadata).
"""

from __future__ import annotations

import re
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

    def write_state(self, path: str, state: dict[str, Any]) -> None:
        """A training state (adapters, their config, base model, optimizer) at a ``.../weights/NAME`` path."""
        import io

        import torch

        buf = io.BytesIO()
        torch.save(state, buf)
        file = self._file(path, "weights")
        self.fs.makedirs(file.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(file, "wb") as f:
            f.write(buf.getvalue())

    def read_state(self, path: str) -> dict[str, Any]:
        import io

        import torch

        file = self._file(path, "weights")
        if not self.fs.exists(file):
            raise BadRequest(f"path {path!r}: no such training state", status=404)
        with self.fs.open(file, "rb") as f:
            return torch.load(io.BytesIO(f.read()), weights_only=True)  # tensors and plain values only

    def write_sampler_weights(self, path: str, weights: Any) -> None:
        from skyrl_server._sampling import safetensors_bytes

        file = self._file(path)
        self.fs.makedirs(file.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(file, "wb") as f:
            f.write(safetensors_bytes(weights.tensors, weights.config, weights.base))

    def read_sampler_weights(self, path: str) -> Any:
        from skyrl_server._sampling import SamplerWeights, from_safetensors_bytes

        file = self._file(path)
        if not self.fs.exists(file):
            raise BadRequest(f"model_path {path!r}: no such sampler weights", status=404)
        with self.fs.open(file, "rb") as f:
            tensors, config, base = from_safetensors_bytes(f.read())
        return SamplerWeights(base, tensors, config, 0)
