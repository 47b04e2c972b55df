"""`skyrl models list` and `skyrl models show NAME`."""

from __future__ import annotations

import json
import sys

from skyrl_models import glm, hf, kimi, nemotron, qwen

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
from test_light_imports import heavy_modules_after  # noqa: E402


def test_list_has_tiny_and_full_size_presets_of_every_family(skyrl_cli) -> None:
    got = skyrl_cli("models", "list")
    assert got.exit_code == 0, got.stderr
    lines = {line.split()[0]: line for line in got.stdout.splitlines()[1:]}
    expected = {*qwen.PRESETS, *qwen.FULL_PRESETS, *glm.PRESETS, *glm.FULL_PRESETS, *kimi.PRESETS,
                *kimi.FULL_PRESETS, *nemotron.PRESETS, *nemotron.FULL_CONFIGS, *hf.PRESETS}
    assert set(lines) == expected
    assert lines["tiny-mixtral"].split()[1:3] == ["hf", "mixtral"] and "random (tiny)" in lines["tiny-mixtral"]
    assert lines["tiny"].split()[1:3] == ["qwen", "qwen3"] and "random (tiny)" in lines["tiny"]
    assert lines["kimi-k2.6"].split()[1:3] == ["kimi", "deepseek_v3"] and "config only" in lines["kimi-k2.6"]
    rows = {r["name"]: r for r in json.loads(skyrl_cli("models", "list", "--json").stdout)}
    assert rows["glm-5"] == {"name": "glm-5", "family": "glm", "model_type": "glm_moe_dsa", "weights": False}
    assert rows["tiny-nemotron-h"]["weights"] is True
    assert rows["tiny-qwen3.5-moe"]["model_type"] == "qwen3_5_moe_text"
    assert rows["qwen3-next-80b-a3b"] == {
        "name": "qwen3-next-80b-a3b", "family": "qwen", "model_type": "qwen3_next", "weights": False
    }


def test_show_kimi_k26_is_about_1t_total_32b_active(skyrl_cli) -> None:
    got = skyrl_cli("models", "show", "kimi-k2.6", "--json")
    assert got.exit_code == 0, got.stderr
    info = json.loads(got.stdout)
    assert (info["family"], info["model_type"], info["weights"]) == ("kimi", "deepseek_v3", False)
    assert (info["hidden_size"], info["num_layers"], info["num_heads"], info["vocab_size"]) == (7168, 61, 64, 163840)
    assert (info["num_experts"], info["top_k"], info["n_group"], info["topk_group"]) == (384, 8, 1, 1)
    assert info["routed_scaling_factor"] == 2.827
    assert 1.0e12 < info["total_params"] < 1.06e12 and 31e9 < info["active_params"] < 34e9
    text = skyrl_cli("models", "show", "kimi-k2.6").stdout
    assert "1.03T" in text and "32.9B" in text


def test_show_tiny_gives_the_165k_qwen3(skyrl_cli) -> None:
    info = json.loads(skyrl_cli("models", "show", "tiny", "--json").stdout)
    assert info["family"] == "qwen" and info["weights"] is True
    assert info["vocab_size"] == 19  # reverse_digits' 16 characters + <pad>, <eos>, <unk>
    assert info["total_params"] == info["active_params"] == 165_504  # as test_tiny_is_the_165k_qwen3
    assert "num_experts" not in info


def test_an_unknown_name_is_a_usage_error_with_suggestions(skyrl_cli) -> None:
    got = skyrl_cli("models", "show", "kimi-k2.8")
    assert got.exit_code == 2
    assert "unknown model preset 'kimi-k2.8'" in got.stderr and "kimi-k2.7" in got.stderr


def test_skyrl_help_and_models_help_import_no_torch(tmp_path) -> None:
    for args in (["--help"], ["models", "--help"], ["models", "list"]):
        assert heavy_modules_after(tmp_path, args) == {"rc": 0, "heavy": []}


def test_show_qwen3_30b_a3b_and_the_hybrid_qwen3_5(skyrl_cli) -> None:
    info = json.loads(skyrl_cli("models", "show", "qwen3-30b-a3b", "--json").stdout)
    assert (info["family"], info["model_type"], info["weights"]) == ("qwen", "qwen3_moe", False)
    assert (info["num_layers"], info["num_experts"], info["top_k"], info["shared_experts"]) == (48, 128, 8, 0)
    assert 30.3e9 < info["total_params"] < 30.7e9 and 3.2e9 < info["active_params"] < 3.4e9  # "30.5B / 3.3B"
    text = skyrl_cli("models", "show", "qwen3.5-397b-a17b").stdout
    assert "396B" in text and "17.3B" in text
    info = json.loads(skyrl_cli("models", "show", "tiny-qwen3-next", "--json").stdout)
    assert info["layer_types"] == {"linear_attention": 3, "full_attention": 1}
    assert (info["shared_experts"], info["shared_expert_size"], info["total_params"]) == (1, 64, 336_200)
