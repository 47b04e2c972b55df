"""The qwen family's [model] options, checked through the host's job-file loader
(located messages with key paths), and its light registration module."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from skyrl_host import hookimpl
from skyrl_host.config import load_job
from skyrl_host.errors import UserError
from skyrl_models.qwen import QwenConfig, make_family


class ModelJobPlugin:
    """Job kind "model_check": needs only a [model] table."""

    @hookimpl
    def skyrl_register_jobs(self, register: Any) -> None:
        register("model_check", object, description="uses a model", slots={"model": None})


@pytest.fixture
def host(skyrl_host: Any, skyrl_plugin: Any) -> Any:
    skyrl_plugin(ModelJobPlugin(), name="model_check_kind")
    return skyrl_host


@pytest.fixture
def hf_folder(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return folder


def job(tmp_path: pathlib.Path, model: str) -> pathlib.Path:
    """A job file whose [model] table starts at line 4 (its first key after family at line 6)."""
    path = tmp_path / "job.toml"
    path.write_text('[job]\nkind = "model_check"\n\n[model]\nfamily = "qwen"\n' + textwrap.dedent(model).lstrip("\n"))
    return path


def errors(tmp_path: pathlib.Path, host: Any, model: str) -> str:
    path = job(tmp_path, model)
    with pytest.raises(UserError) as info:
        load_job(path, host)
    return str(info.value).replace(str(path), "{path}")


def test_registered_through_the_installed_entry_point(skyrl_host: Any) -> None:
    import skyrl_models.qwen

    reg = skyrl_host.registry.get("models", "qwen")
    assert reg.factory is make_family and reg.config is QwenConfig
    assert reg.origin.distribution == "skyrl-models"
    assert skyrl_host.records["qwen"].entry_point == "skyrl_models.qwen"
    assert skyrl_host.pm.get_plugin("qwen") is skyrl_models.qwen


def test_a_valid_table_resolves(tmp_path: pathlib.Path, host: Any, hf_folder: pathlib.Path) -> None:
    spec = load_job(job(tmp_path, 'preset = "tiny-moe"\ndtype = "bfloat16"\ntop_k = 3\n'), host)
    config = spec.plugins["model"].config
    assert config == QwenConfig(preset="tiny-moe", dtype="bfloat16", top_k=3)
    assert config.architecture()["top_k"] == 3 and config.is_moe
    spec = load_job(job(tmp_path, f'path = "{hf_folder}"\nattn_implementation = "eager"\n'), host)
    assert spec.plugins["model"].config.path == str(hf_folder)


def test_overrides_change_the_preset_and_kv_heads_follow_heads() -> None:
    arch = QwenConfig(preset="tiny", num_heads=2, head_dim=16, hidden_size=32).architecture()
    assert arch == {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "intermediate_size": 256,
    }
    assert QwenConfig(preset="tiny", num_kv_heads=2).architecture()["num_kv_heads"] == 2


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        pytest.param(
            'preset = "tiny"\npath = "/models/x"\n',
            # the path's own check runs first; both keys are located
            ["{path}:7: model.path: expected a folder with config.json, found nothing at '/models/x'"],
            id="both-and-bad-path",
        ),
        pytest.param(
            'preset = "tiny"\npath = "{hf}"\n',
            ["error: {path}:7: model.path: give either preset or path, not both (preset is 'tiny')"],
            id="both",
        ),
        pytest.param(
            "",
            [
                "error: {path}:4: model.preset: missing: give preset = 'tiny' or 'tiny-moe' or 'tiny-qwen3.5-moe' "
                "or 'tiny-qwen3-next' or 'tiny-qwen3.5', or path = a local"
            ],
            id="neither",
        ),
        pytest.param(
            'preset = "tiny-mo"\n',
            [
                "error: {path}:6: model.preset: expected one of 'tiny', 'tiny-moe', 'tiny-qwen3.5-moe', "
                "'tiny-qwen3-next', 'tiny-qwen3.5', found 'tiny-mo' (did you mean 'tiny-moe'?)"
            ],
            id="unknown-preset",
        ),
        pytest.param(
            "preset = 3\n", ["error: {path}:6: model.preset: expected a string, found integer 3"], id="preset-type"
        ),
        pytest.param(
            'path = "{hf}/missing"\n',
            ["error: {path}:6: model.path: expected a folder with config.json, found nothing at '{hf}/missing'"],
            id="missing-path",
        ),
        pytest.param(
            'path = "{hf}/config.json"\n',
            ["error: {path}:6: model.path: expected a folder with config.json, found a file '{hf}/config.json'"],
            id="path-is-a-file",
        ),
        pytest.param(
            'path = "{hf}/.."\n',
            ["error: {path}:6: model.path: expected a folder with config.json, found a folder without config.json"],
            id="folder-without-config",
        ),
        pytest.param(
            'preset = "tiny"\ndtype = "bfloat"\n',
            [
                "error: {path}:7: model.dtype: expected one of 'float32', 'bfloat16', found string 'bfloat' "
                "(did you mean 'bfloat16'?)"
            ],
            id="dtype",
        ),
        pytest.param(
            'preset = "tiny"\nattn_implementation = "flash"\n',
            ["error: {path}:7: model.attn_implementation: expected one of 'sdpa', 'eager', found string 'flash'"],
            id="attn-implementation",
        ),
        pytest.param(
            'preset = "tiny"\nhidden_size = 0\nnum_heads = -1\n',
            [
                "error: 2 problems",
                "{path}:7: model.hidden_size: expected a value > 0, found 0",
                "{path}:8: model.num_heads: expected a value > 0, found -1",
            ],
            id="overrides-not-positive",
        ),
        pytest.param(
            'preset = "tiny"\nnum_layers = 1.5\n',
            ["error: {path}:7: model.num_layers: expected an integer, found float 1.5"],
            id="override-type",
        ),
        pytest.param(
            'path = "{hf}"\nnum_layers = 4\n',
            ["error: {path}:7: model.num_layers: only applies to a preset; a model loaded from path keeps"],
            id="override-with-path",
        ),
        pytest.param(
            'preset = "tiny"\nnum_experts = 4\n',
            [
                "error: {path}:7: model.num_experts: only applies to a mixture-of-experts preset ('tiny-moe', "
                "'tiny-qwen3.5-moe', 'tiny-qwen3-next'), not 'tiny'"
            ],
            id="moe-override-on-dense",
        ),
        pytest.param(
            'preset = "tiny-moe"\ntop_k = 9\n',
            ["error: {path}:7: model.top_k: expected top_k (9) to be at most num_experts (8)"],
            id="top-k",
        ),
        pytest.param(
            'preset = "tiny"\nnum_kv_heads = 3\n',
            ["error: {path}:7: model.num_kv_heads: expected num_kv_heads (3) to divide num_heads (4)"],
            id="kv-heads",
        ),
        pytest.param(
            'preset = "tiny"\nlayers = 3\n',
            ["error: {path}:7: model.layers: unknown key (did you mean 'num_layers'?); valid keys: "],
            id="unknown-key",
        ),
    ],
)
def test_config_errors_are_located(
    tmp_path: pathlib.Path, host: Any, hf_folder: pathlib.Path, model: str, expected: list[str]
) -> None:
    text = errors(tmp_path, host, model.replace("{hf}", str(hf_folder)))
    assert "Traceback" not in text
    for line in expected:
        line = line.replace("{hf}", str(hf_folder))
        assert line in text, f"{line!r} not in:\n{text}"


def test_config_checks_in_python(hf_folder: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=re.escape("path: give either preset or path, not both")):
        QwenConfig(preset="tiny", path=str(hf_folder))
    with pytest.raises(ValueError, match="did you mean 'tiny'"):
        QwenConfig(preset="tyny")


def test_the_registered_module_imports_no_heavy_module() -> None:
    probe = (
        "import sys, skyrl_models.qwen as q\n"
        "c = q.QwenConfig(preset='tiny-moe'); c.architecture()\n"
        "heavy = ('torch', 'transformers', 'tokenizers', 'safetensors')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_hybrid_presets_take_the_same_overrides_and_full_size_names_are_refused() -> None:
    config = QwenConfig(preset="tiny-qwen3-next", top_k=3, num_layers=8)
    assert config.is_moe and config.model_type == "qwen3_next"
    assert (config.architecture()["top_k"], config.architecture()["num_layers"]) == (3, 8)
    assert QwenConfig(preset="tiny-qwen3.5-moe").model_type == "qwen3_5_moe_text"
    assert QwenConfig(preset="tiny").model_type == "qwen3" and not QwenConfig(preset="tiny").is_moe
    with pytest.raises(ValueError, match="'qwen3-30b-a3b' is a full-size architecture without weights"):
        QwenConfig(preset="qwen3-30b-a3b")
