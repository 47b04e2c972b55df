"""Helpers shared by the model families built on transformers (imports torch).

- :func:`char_tokenizer`: a character-level tokenizer for a dataset's alphabet;
- :func:`seeded`: build a model's random weights from a seed without touching
  the process's own random state;
- :func:`load_folder`: a local Hugging Face folder -> (model, tokenizer), checking
  the model type against the family's;
- :func:`align_cpu_tensors`: copy loaded CPU weights that sit at unaligned addresses;
- :func:`stop_token_ids`: the EOS token first, then the generation config's;
- :func:`save_folder`: model + tokenizer to a Hugging Face folder, atomically.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import pathlib
import shutil
import types
import uuid
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from skyrl_host.errors import Problem, UserError

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)  # ids 0, 1, 2; the alphabet's characters follow, sorted

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

NO_ALPHABET = (
    "the dataset provides no alphabet; a preset model needs one to build its character-level "
    "tokenizer (use a dataset that defines `alphabet`, or set path to a Hugging Face folder "
    "that has its own tokenizer)"
)


def char_tokenizer(alphabet: str | None, *, model_max_length: int, key: str = "model.preset") -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    Vocabulary: ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2, then the distinct
    characters of ``alphabet`` in sorted order, so the ids depend only on the set
    of characters. Encoding adds no special tokens and gives one id per character
    (characters outside the alphabet -> ``<unk>``); decoding concatenates, so it
    round-trips any text made of the alphabet. Padding is on the left (batched
    generation with ``model.generate``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if alphabet is None:
        raise UserError(Problem(NO_ALPHABET, key=key))
    if not isinstance(alphabet, str):
        raise TypeError(f"a dataset's alphabet must be a str of characters, got {type(alphabet).__name__}")
    chars = sorted(set(alphabet))
    if not chars:
        message = "the dataset's alphabet is empty; a character-level tokenizer needs characters"
        raise UserError(Problem(message, key=key))
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()  # join without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=model_max_length,
    )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator for the block and restore the previous state after,
    so building a model is a pure function of ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def vocab_ids(tokenizer: Any) -> dict[str, Any]:
    """The config keys a preset takes from its tokenizer: the vocabulary size and the
    special ids (no BOS: the character tokenizer has none)."""
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
    }


def set_special_ids(model: Any, tokenizer: Any) -> None:
    """Make the model's config and generation config agree with the tokenizer."""
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is None:
            continue
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id


def read_model_type(path: str, *, key: str = "model.path") -> str | None:
    folder = pathlib.Path(path)
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(Problem(f"expected a folder with config.json, found none in {path!r}", key=key))
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(Problem(f"cannot read {config}: {exc}", key=key)) from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    return model_type if isinstance(model_type, str) else None


def load_folder(
    path: str,
    *,
    family: str,
    model_types: Sequence[str],
    dtype: str,
    attn_implementation: str,
    key: str = "model.path",
) -> tuple[Any, Any]:
    """Load a local Hugging Face folder; the model is in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_type = read_model_type(path, key=key)
    if model_type not in model_types:
        supported = ", ".join(repr(t) for t in model_types)
        found = f"model type {model_type!r}" if model_type else "a config.json without model_type"
        raise UserError(
            Problem(f"model family {family!r} loads model types {supported}; {path!r} has {found}", key=key)
        )
    # transformers 5 builds an empty tokenizer when a folder has none: refuse instead.
    if not any((pathlib.Path(path) / name).is_file() for name in TOKENIZER_FILES):
        names = ", ".join(TOKENIZER_FILES)
        raise UserError(Problem(f"{path!r} has no tokenizer files (expected one of {names})", key=key))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(Problem(f"cannot load a tokenizer from {path!r}: {exc}", key=key)) from None
    from skyrl_models._checkpoint_files import check_safetensors, load_error, load_errors

    check_safetensors(path, key=key)  # a truncated, corrupt or missing weight file, named (headers only)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    except load_errors() as exc:  # missing or unreadable weight files (OSError, SafetensorError)
        raise load_error(path, exc, key=key) from None
    return model.eval(), tokenizer


PRECISION_KEEP = ("lm_head", "embed_tokens", "gate", "router", "shared_expert_gate")

ALIGNMENT = 64  # bytes: what torch's CPU allocator gives every new tensor


def align_cpu_tensors(model: Any) -> int:
    """Copy every CPU parameter and buffer of ``model`` whose data does not start at a
    64-byte boundary into freshly allocated (aligned) memory; returns how many moved.

    ``from_pretrained`` leaves CPU weights inside the memory-mapped safetensors file,
    where a tensor starts wherever the previous one ended (e.g. after a ``[1, H]``
    ``shared_expert_gate`` of 4*H bytes). CPU matrix kernels pick their code path by
    alignment, so the same weights at a misaligned address give results that differ in
    the last bit; after this copy a loaded model computes exactly what the model that
    was saved did."""
    moved = 0
    with torch.no_grad():
        for module in model.modules():
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if t is None or t.device.type != "cpu" or t.data_ptr() % ALIGNMENT == 0:
                    continue
                t.data = t.data.clone()  # keeps the Parameter object (and any tying) intact
                moved += 1
    return moved


def stop_token_ids(model: Any, tokenizer: Any, *, key: str = "model.path") -> list[int]:
    """The tokenizer's EOS first, then any other EOS ids of the generation config
    (Qwen3 instruct models stop at both ``<|im_end|>`` and ``<|endoftext|>``)."""
    ids: list[int] = []
    candidates: list[Any] = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None)
    for cfg in (gen, model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        candidates += eos if isinstance(eos, (list, tuple)) else [eos]
    for i in candidates:
        if isinstance(i, int) and i not in ids:
            ids.append(i)
    if not ids:
        raise UserError(Problem("the model's tokenizer and generation config name no end-of-sequence token", key=key))
    return ids


def group_topk_router(layer: int, path: str, config: Any) -> Any:
    """The RouterInfo of a DeepSeek-V3-style router (GLM, Kimi, Nemotron-H): sigmoid scores,
    correction bias and group limit for the choice; ``normalize`` = ``norm_topk_prob``,
    ``scale`` = ``routed_scaling_factor``."""
    from skyrl_host.interfaces import RouterInfo

    return RouterInfo(
        layer=layer,
        path=path,
        kind="sigmoid_group_topk",
        n_experts=int(config.n_routed_experts),
        top_k=int(config.num_experts_per_tok),
        normalize=bool(config.norm_topk_prob),
        scale=float(config.routed_scaling_factor),
    )


def save_folder(model: Any, tokenizer: Any, path: str | os.PathLike[str]) -> None:
    """Write ``model`` and ``tokenizer`` as a Hugging Face folder at ``path``, atomically.

    Everything is written into a new folder beside ``path`` that is renamed into
    place at the end: readers see the old folder or the complete new one, never a
    partial one. An existing folder at ``path`` is replaced (moved aside, then
    deleted once the new one is in place)."""
    target = pathlib.Path(path).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"cannot save a model to {str(target)!r}: it is a file")
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:12]
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()  # honours the umask, unlike tempfile.mkdtemp
    try:
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # its "Writing model shards" bar would break our own progress display
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        if target.exists():
            old = target.parent / f".{target.name}.old-{tag}"
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class HFFamily(abc.ABC):
    """What every family over transformers models shares: a config with ``preset`` or
    ``path`` (+ ``dtype``, ``attn_implementation``), loading a folder or building a
    preset, and saving a Hugging Face folder. Subclasses set ``name`` and
    ``model_types`` and implement ``preset_config`` and ``model_class`` (``build_preset``
    builds the preset from them)."""

    name: str = ""
    model_types: Sequence[str] = ()
    # Module-path components a quantized precision keeps in high precision (norms always
    # stay): the output head, the embeddings and the MoE routers.
    precision_keep: Sequence[str] = PRECISION_KEEP

    def __init__(self, config: Any):
        self.config = config

    def load(self, *, alphabet: str | None, seed: int) -> Any:
        from skyrl_host.interfaces import LoadedModel

        if self.config.path is not None:
            model, tokenizer = self.load_folder(self.config.resolved_path)
            align_cpu_tensors(model)
        else:
            model, tokenizer = self.build_preset(alphabet, seed)
        return LoadedModel(
            model, tokenizer, stop_token_ids(model, tokenizer), family=self.name, routers=tuple(self.routers(model)),
            lora_targets=tuple(getattr(self, "lora_targets", ()) or ()), precision_keep=tuple(self.precision_keep),
        )

    def load_tokenizer(self, *, alphabet: str | None) -> Any:
        """What :meth:`load` gives, without the model (``model=None``): the tokenizer and
        the stop ids, for a process that only encodes prompts and decodes responses (the
        Ray launcher's driver). Reads only the tokenizer files and the configs' JSON."""
        from skyrl_host.interfaces import LoadedModel

        if self.config.path is None:
            tokenizer = char_tokenizer(alphabet, model_max_length=self.max_positions)
            return LoadedModel(None, tokenizer, [tokenizer.eos_token_id], family=self.name)  # set_special_ids' choice
        path = self.config.resolved_path
        read_model_type(path)  # the same error as load() for a folder without config.json
        from transformers import AutoTokenizer

        if not any((pathlib.Path(path) / name).is_file() for name in TOKENIZER_FILES):
            names = ", ".join(TOKENIZER_FILES)
            raise UserError(Problem(f"{path!r} has no tokenizer files (expected one of {names})", key="model.path"))
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise UserError(Problem(f"cannot load a tokenizer from {path!r}: {exc}", key="model.path")) from None
        configs = []
        for name in ("generation_config.json", "config.json"):
            file = pathlib.Path(path) / name
            data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
            # A composite (vision-language) folder keeps the language model's ids in text_config.
            text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
            configs.append(types.SimpleNamespace(eos_token_id=data.get("eos_token_id", text.get("eos_token_id"))))
        holder = types.SimpleNamespace(generation_config=configs[0], config=configs[1])
        return LoadedModel(None, tokenizer, stop_token_ids(holder, tokenizer), family=self.name)

    def routers(self, model: Any) -> list[Any]:
        """The model's MoE routers (:class:`skyrl_host.interfaces.RouterInfo`) in layer
        order; none for a dense model. Families of MoE models override this."""
        return []

    def load_folder(self, path: str) -> tuple[Any, Any]:
        return load_folder(
            path,
            family=self.name,
            model_types=self.model_types,
            dtype=self.config.dtype,
            attn_implementation=self.config.attn_implementation,
        )

    max_positions: int = 512  # the presets' max_position_embeddings (the tokenizer's model_max_length)

    def build_preset(self, alphabet: str | None, seed: int) -> tuple[Any, Any]:
        """(model, tokenizer) of the configured preset: a character-level tokenizer for
        ``alphabet``, random weights from ``seed`` (float32, then cast to ``dtype``), eval mode."""
        tokenizer = char_tokenizer(alphabet, model_max_length=self.max_positions)
        hf_config = self.preset_config(tokenizer)
        cls = self.model_class(hf_config)
        with seeded(seed):
            model = cls(hf_config)
        set_special_ids(model, tokenizer)
        model = model.to(DTYPES[self.config.dtype])
        return model.eval(), tokenizer

    @abc.abstractmethod
    def preset_config(self, tokenizer: Any) -> Any:
        """The transformers config of the configured preset (vocabulary from ``tokenizer``)."""

    @abc.abstractmethod
    def model_class(self, hf_config: Any) -> Any:
        """The causal-LM class that builds ``hf_config``."""

    def save(self, loaded: Any, path: str) -> None:
        save_folder(loaded.model, loaded.tokenizer, path)

    # -- in-memory vs on-disk weight names ---------------------------------------

    def disk_weights(self, model: Any, named_tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """In-memory weights (names of ``model.state_dict()``: fused 3-D experts) in the
        Hugging Face on-disk layout ``save_pretrained`` writes (one tensor per expert and
        projection), tensor by tensor. Uses transformers' own conversion mapping for the
        model type, so it follows what transformers loads and saves."""
        from transformers.core_model_loading import revert_weight_conversion

        for name, tensor in named_tensors:
            yield from revert_weight_conversion(model, {name: tensor}).items()

    def weight_layout(self, model: Any) -> dict[str, list[str]]:
        """Each in-memory weight name -> the on-disk names it is stored under."""
        return {
            name: [disk for disk, _ in self.disk_weights(model, [(name, torch.empty(t.shape, device="meta"))])]
            for name, t in model.state_dict().items()
        }

    def memory_weights(self, model: Any, disk: Mapping[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`disk_weights`: on-disk tensors (a mapping name -> tensor,
        e.g. a safetensors file's) -> in-memory names and shapes, fusing experts. Every
        element is placed where ``disk_weights`` took it from (the conversions only move
        elements: an index tensor run through them gives the placement), so the round
        trip is exact. A tied weight may be absent (``save_pretrained`` writes one copy).
        Raises KeyError naming a missing on-disk tensor, ValueError for a wrong shape or
        a tensor the model has no place for."""
        state = model.state_dict()
        used: set[str] = set()
        out: dict[str, Any] = {}
        by_storage: dict[int, str] = {}
        for name, ref in state.items():
            idx = torch.arange(ref.numel(), dtype=torch.int64).reshape(ref.shape)
            pieces = dict(self.disk_weights(model, [(name, idx)]))
            missing = [d for d in pieces if d not in disk]
            if missing:
                tied = by_storage.get(ref.data_ptr()) if ref.numel() else None
                if tied is not None and len(pieces) == 1:
                    out[name] = out[tied]  # a tied weight stored once
                    continue
                raise KeyError(f"on-disk weight {missing[0]!r} (part of {name!r}) is missing")
            flat = None
            for disk_name, where in pieces.items():
                value = disk[disk_name]
                if tuple(value.shape) != tuple(where.shape):
                    raise ValueError(
                        f"on-disk weight {disk_name!r} has shape {tuple(value.shape)}, expected {tuple(where.shape)}"
                    )
                if flat is None:
                    flat = torch.empty(ref.numel(), dtype=value.dtype, device=value.device)
                flat[where.reshape(-1).to(flat.device)] = value.reshape(-1)
                used.add(disk_name)
            out[name] = flat.reshape(ref.shape) if flat is not None else torch.empty(ref.shape, dtype=ref.dtype)
            by_storage.setdefault(ref.data_ptr(), name)
        extra = sorted(set(disk) - used)
        if extra:
            raise ValueError(f"on-disk weight {extra[0]!r} has no place in the model ({len(extra)} such)")
        return out
