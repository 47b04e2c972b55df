"""`skyrl validate` catches replay settings that cannot work, with the file, line and fix."""

from __future__ import annotations

import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "replay_ablation.toml"


def write(tmp_path: pathlib.Path, replace: dict[str, str]) -> pathlib.Path:
    text = EXAMPLE.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def line_of(path: pathlib.Path, needle: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(needle))


def test_the_example_is_valid(skyrl_cli) -> None:
    result = skyrl_cli("validate", str(EXAMPLE))
    assert result.exit_code == 0, result.stderr
    assert "[replay]      r3" in result.stdout and "[replay]      support" in result.stdout


def test_r3_without_routed_experts(skyrl_cli, tmp_path) -> None:
    path = write(tmp_path, {"return_routed_experts = true": "return_routed_experts = false"})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    line = line_of(path, "return_routed_experts")
    assert result.stderr.strip() == (
        f"error: {path}:{line}: engine.return_routed_experts: replay strategy 'r3' needs routed experts: "
        "set engine.return_routed_experts = true"
    )


def test_r3_when_the_key_is_absent_points_at_the_table(skyrl_cli, tmp_path) -> None:
    path = write(tmp_path, {"return_routed_experts = true": ""})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert f"{path}:{line_of(path, '[engine]')}: engine: replay strategy 'r3' needs routed experts" in result.stderr


def test_support_without_support_sets(skyrl_cli, tmp_path) -> None:
    path = write(tmp_path, {"return_support = true": "return_support = false"})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: {path}:{line_of(path, 'return_support')}: sampler.return_support: replay strategy 'support' "
        "needs sample support sets: set sampler.return_support = true"
    )


def test_r3_on_a_dense_model(skyrl_cli, tmp_path) -> None:
    path = write(tmp_path, {'family = "kimi"\npreset = "tiny-kimi"': 'family = "qwen"\npreset = "tiny"'})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert f"{path}:{line_of(path, 'preset')}: model.preset: replay strategy 'r3' replays MoE routing, but model 'tiny' (qwen) has no MoE layers" in result.stderr
    assert f"{path}:{line_of(path, 'return_routed_experts')}: engine.return_routed_experts: model 'tiny' (qwen) has no MoE layers" in result.stderr


def test_r3_on_a_dense_local_folder(skyrl_cli, tmp_path) -> None:
    folder = tmp_path / "dense"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 64}')
    (folder / "tokenizer.json").write_text("{}")
    path = write(tmp_path, {'family = "kimi"\npreset = "tiny-kimi"': f'family = "qwen"\npath = "{folder}"'})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "model.path: replay strategy 'r3' replays MoE routing" in result.stderr


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_r3_on_qwen_moe_presets_is_fine(skyrl_cli, tmp_path, preset) -> None:
    path = write(tmp_path, {'family = "kimi"\npreset = "tiny-kimi"': f'family = "qwen"\npreset = "{preset}"'})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 0, result.stderr


def test_a_sampler_that_cannot_return_support(skyrl_cli, tmp_path) -> None:
    path = write(tmp_path, {'name = "top_p"\ntop_p = 0.9\nreturn_support = true': 'name = "greedy"'})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert "replay strategy 'support' needs sample support sets" in result.stderr


@pytest.mark.parametrize("family, preset", [("glm", "tiny-glm-moe-dsa"), ("kimi", "tiny-deepseek-v3.2")])
def test_r3_on_indexer_presets_is_fine(skyrl_cli, tmp_path, family, preset) -> None:
    path = write(tmp_path, {'family = "kimi"\npreset = "tiny-kimi"': f'family = "{family}"\npreset = "{preset}"'})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 0, result.stderr


class RoutesOnlyEngine:
    """A third-party engine that returns routed experts but not an indexer's key picks
    (its declared traits say ``routed_experts``, not ``indexer_topk``): validated, never
    started."""

    @staticmethod
    def config_class():
        import attrs

        from skyrl_host.options import option

        @attrs.frozen
        class RoutesOnlyConfig:
            return_routed_experts: bool = option(False, help="record routed experts")

        return RoutesOnlyConfig

    def skyrl_register_engines(self, register):
        from skyrl_host.interfaces import EngineTraits

        register("routes_only", lambda config=None: None, config=self.config_class(),
                 description="returns routes, not indexer picks",
                 traits=lambda c: EngineTraits(routed_experts=c.return_routed_experts,
                                               switches={"routed_experts": "return_routed_experts"}))


def test_r3_on_an_indexer_model_needs_an_engine_that_records_its_picks(skyrl_cli, skyrl_plugin, tmp_path) -> None:
    from skyrl_host import hookimpl

    class Plugin(RoutesOnlyEngine):
        skyrl_register_engines = hookimpl(RoutesOnlyEngine.skyrl_register_engines)

    skyrl_plugin(Plugin(), "routes_only_engine")
    engine = {'name = "embedded"\ndtype = "bfloat16"': 'name = "routes_only"'}
    model = {'family = "kimi"\npreset = "tiny-kimi"': 'family = "glm"\npreset = "tiny-glm-moe-dsa"'}
    path = write(tmp_path, {**model, **engine})
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2, result.stderr
    line = line_of(path, 'name = "routes_only"')
    assert (
        f"{path}:{line}: engine.name: replay strategy 'r3' on model "
        "'tiny-glm-moe-dsa' (glm) must also replay the keys its sparse-attention indexer picked "
        "(side channel 'indexer_topk'), which engine 'routes_only' cannot record"
    ) in result.stderr
    # The same engine on a model without an indexer is fine.
    path = write(tmp_path, engine)
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 0, result.stderr
