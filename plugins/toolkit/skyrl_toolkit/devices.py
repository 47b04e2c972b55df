"""The ``device`` option plugins that place tensors share (engines, backends): its
validator and the check of what this machine has. Light: imports torch only to ask
about a CUDA device."""

from __future__ import annotations

import re
from typing import Any


def check_device(_inst: Any, _attr: Any, value: Any) -> None:
    """An attrs validator: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if not isinstance(value, str) or not (value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value)):
        raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', found {value!r}")


check_device.__doc__ = "one of auto, cpu, cuda, cuda:N"


def cuda_problem(device: str) -> str | None:
    """Why ``device`` cannot be used on this machine (None when it can): ``"cuda"`` or
    ``"cuda:N"`` without CUDA, or without device N."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return f"device {device!r} needs CUDA, and torch finds no CUDA device on this machine; use \"auto\" or \"cpu\""
    if ":" in device and int(device.split(":", 1)[1]) >= torch.cuda.device_count():
        return f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None
