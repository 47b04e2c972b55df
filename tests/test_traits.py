"""Declared traits instead of probes: what one plugin may know of another is what the
other declared (``register(..., traits=)``), typed by the contracts
(:mod:`skyrl_host.interfaces`: ModelTraits, EngineTraits, BackendTraits, SamplerTraits).
A declaration that fails or has the wrong type is a located user error at ``skyrl
validate``; a plugin that declares nothing gets the defaults ("unknown", "off"); and no
module reads another distribution's plugin options by name (counted here)."""

from __future__ import annotations

import ast
import pathlib

import attrs
import pytest

from skyrl_host import hookimpl
from skyrl_host.interfaces import BackendTraits, EngineTraits, ModelTraits, SamplerTraits
from skyrl_host.options import option

ROOT = pathlib.Path(__file__).resolve().parents[1]


@attrs.frozen
class ProbeConfig:
    dtype: str = option("auto", help="the dtype it serves")
    return_token_versions: bool = option(False, help="record versions")


def engine_plugin(name: str, traits):
    class Plugin:
        @hookimpl
        def skyrl_register_engines(self, register):
            register(name, lambda config=None: None, config=ProbeConfig, description="an engine for a test",
                     **({"traits": traits} if traits is not None else {}))

    return Plugin()


def async_job(make_job, tmp_path, engine: str):
    return make_job(tmp_path, "job", job={"mode": "async", "weight_updates": "in_flight"},
                    engine={"name": engine})


def test_the_builtin_plugins_declare_what_the_checks_read(skyrl_host, skyrl_tiny_rl_job, tmp_path) -> None:
    from skyrl_host.config import load_job

    job = skyrl_tiny_rl_job(tmp_path, "job", engine={"dtype": "bfloat16", "return_routed_experts": False},
                            backend={"lora_rank": 4}, sampler={"name": "top_k", "top_k": 5})
    spec = load_job(job.path, skyrl_host)
    model, engine = spec.plugins["model"].traits, spec.plugins["engine"].traits
    backend, sampler = spec.plugins["backend"].traits, spec.plugins["sampler"].traits
    assert isinstance(model, ModelTraits) and model.key == "model.preset" and model.name == "tiny"
    assert model.dtype == "float32" and model.is_moe is False and model.path is None
    assert engine == EngineTraits(dtype="bfloat16", device="auto", token_versions=False, routed_experts=False,
                                  indexer_topk=True, switches={"token_versions": "return_token_versions",
                                                               "routed_experts": "return_routed_experts"})
    assert backend.adapter_rank == 4 and not backend.owns_weights and backend.switches["adapter_rank"] == "lora_rank"
    assert sampler == SamplerTraits(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0,
                                    switches={"support": "return_support"})
    assert isinstance(backend, BackendTraits)


def test_a_plugin_that_declares_nothing_gets_the_defaults(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job,
                                                          tmp_path) -> None:
    skyrl_plugin(engine_plugin("quiet", None))
    job = async_job(skyrl_tiny_rl_job, tmp_path, "quiet")
    result = skyrl_cli("validate", str(job.path))
    # token_versions unknown (None): validate cannot refuse; the run checks the started engine
    assert result.exit_code == 0, result.stderr


def test_a_declared_trait_is_what_the_checks_read(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job, tmp_path) -> None:
    skyrl_plugin(engine_plugin("declared", lambda c: EngineTraits(
        token_versions=c.return_token_versions, switches={"token_versions": "return_token_versions"})))
    job = async_job(skyrl_tiny_rl_job, tmp_path, "declared")
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2
    assert ('weight_updates = "in_flight": the engine must record the version of every token (a generation can '
            'span versions); set [engine] return_token_versions = true') in result.stderr


@pytest.mark.parametrize("traits, says", [
    (lambda c: EngineTraits(token_version=True), "declares its traits wrongly: TypeError("),  # a renamed trait
    (lambda c: BackendTraits(), "declares its traits as BackendTraits, not EngineTraits"),
    (lambda c: c.no_such_option, "declares its traits wrongly: AttributeError("),
])
def test_a_wrong_declaration_fails_validate_naming_the_plugin(skyrl_cli, skyrl_plugin, skyrl_tiny_rl_job, tmp_path,
                                                             traits, says) -> None:
    skyrl_plugin(engine_plugin("wrong", traits), "wrong-traits")
    job = async_job(skyrl_tiny_rl_job, tmp_path, "wrong")
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "engine.name: engine 'wrong' (plugin 'wrong-traits')" in result.stderr and says in result.stderr


def test_traits_are_refused_for_a_kind_without_them(skyrl_host) -> None:
    from skyrl_host.registry import make_register

    register = make_register("datasets", None, [])
    with pytest.raises(TypeError, match="traits must be a callable, for a kind that has traits"):
        register("d", lambda config=None: None, description="a dataset", traits=lambda c: None)


# -- no module reads another distribution's plugin options by name ------------------------

#: the names a module gives another plugin (its choice, its product) and the distribution
#: whose plugin kind that is; ``choice``: any plugin's
NAMES = {"engine": "skyrl_engines", "backend": "skyrl_backends", "model": "skyrl_models",
         "family": "skyrl_models", "sampler": "skyrl_samplers", "precision": "skyrl_precisions",
         "transport": "skyrl_weightsync", "choice": None}


def _owner(node: ast.AST) -> str | None:
    """``engine`` for ``engine.config``, ``request.engine.config``,
    ``spec.plugins["engine"].config`` and ``self.engine.config``."""
    if not (isinstance(node, ast.Attribute) and node.attr == "config"):
        return None
    base = node.value
    if isinstance(base, ast.Name):
        return None if base.id == "self" else base.id  # self.config: a plugin's own options
    if isinstance(base, ast.Attribute) and not (isinstance(base.value, ast.Name) and base.value.id == "self"
                                                 and base.attr == "config"):
        return base.attr
    if isinstance(base, ast.Subscript) and isinstance(base.slice, ast.Constant) and isinstance(base.slice.value, str):
        return base.slice.value
    return None


def reads_in(tree: ast.AST) -> list[tuple[int, str, str]]:
    """``(line, plugin name, option)`` of every ``getattr``/``hasattr`` on, and attribute
    read of, a ``<plugin>.config`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            target, field = _owner(node.args[0]), node.args[1].value
        elif isinstance(node, ast.Attribute):
            target, field = _owner(node.value), node.attr
        else:
            continue
        if target is not None:
            out.append((node.lineno, target, field))
    return out


def cross_reads() -> list[str]:
    """Every read of a ``<plugin>.config`` option in a module of a distribution other than
    that plugin's (tests excluded). A transformers model's ``model.config`` (its Hugging
    Face config, read by the model and backend distributions) is not a plugin's options:
    the fields of HF_FIELDS are allowed."""
    hf_fields = {"max_position_embeddings", "vocab_size", "model_type", "multi_latent_attention",
                 "tie_word_embeddings", "get_text_config"}
    files = list((ROOT / "skyrl_host").rglob("*.py"))
    for dist in (ROOT / "plugins").iterdir():
        files += [p for p in dist.rglob("*.py") if "tests" not in p.relative_to(dist).parts]
    found = []
    for path in files:
        rel = path.relative_to(ROOT).parts
        package = rel[0] if rel[0] == "skyrl_host" else rel[2]
        for line, target, field in reads_in(ast.parse(path.read_text(encoding="utf-8"))):
            if target not in NAMES or field in hf_fields:
                continue
            if NAMES[target] == package:
                continue  # its own distribution's plugin
            found.append(f"{path.relative_to(ROOT)}:{line}: {target}.config.{field}")
    return sorted(set(found))


def test_no_module_reads_another_distributions_plugin_options() -> None:
    reads = cross_reads()
    print("cross-distribution config reads:", len(reads))
    assert reads == [], "read declared traits (choice.traits) instead:\n" + "\n".join(reads)


def test_the_count_sees_a_cross_read() -> None:
    """The scan itself: a host module reading an engine's option by name is found."""
    tree = ast.parse('x = getattr(spec.plugins["engine"].config, "return_token_versions", True)\n'
                     'y = request.backend.config.lora_rank\n'
                     'z = self.config.dtype\n')
    assert [(t, f) for _, t, f in reads_in(tree)] == [("engine", "return_token_versions"), ("backend", "lora_rank")]
