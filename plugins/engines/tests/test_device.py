"""The embedded engine's ``device`` option: validation, resolution (``auto`` = the
model's device on a machine without CUDA, exactly as before), the job check."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from skyrl_engines._served_model import engine_model, resolve_device
from skyrl_engines.embedded import EmbeddedConfig, check, cuda_problem
from skyrl_host.errors import UserError

cuda = torch.cuda.is_available()


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_device_values_are_accepted(value) -> None:
    assert EmbeddedConfig(device=value).device == value


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "CPU", "", 0])
def test_other_device_values_are_refused(value) -> None:
    with pytest.raises(ValueError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        EmbeddedConfig(device=value)


def test_default_is_auto() -> None:
    assert EmbeddedConfig().device == "auto"


def test_auto_and_cpu_resolve_to_the_cpu_without_cuda() -> None:
    assert resolve_device("cpu", torch.device("cpu")) == torch.device("cpu")
    if not cuda:
        assert resolve_device("auto", torch.device("cpu")) == torch.device("cpu")


@pytest.mark.skipif(cuda, reason="checks the machine without CUDA")
@pytest.mark.parametrize("value", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_a_user_error(value) -> None:
    assert "needs CUDA" in cuda_problem(value)
    with pytest.raises(UserError, match="needs CUDA"):
        resolve_device(value, torch.device("cpu"))


def _spec(device: str, launcher: str = "local"):
    engine = types.SimpleNamespace(config=EmbeddedConfig(device=device))
    return types.SimpleNamespace(plugins={"engine": engine}, cluster=types.SimpleNamespace(launcher=launcher))


@pytest.mark.skipif(cuda, reason="checks the machine without CUDA")
def test_validate_says_cuda_is_missing() -> None:
    assert check(_spec("cpu")) == []
    assert check(_spec("auto")) == []
    [(key, message)] = check(_spec("cuda"))
    assert key == "engine.device" and "needs CUDA" in message
    assert check(_spec("cuda", launcher="ray")) == []  # each engine actor checks on its own node


def _tiny() -> torch.nn.Module:
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def test_same_dtype_same_device_shares_the_tensors() -> None:
    model = _tiny()
    served, shared = engine_model(model, torch.float32, torch.device("cpu"))
    assert shared
    assert all(a is b for a, b in zip(served.parameters(), model.parameters()))
    served, shared = engine_model(model, torch.float32)  # no device: where the parameters are (as before)
    assert shared


def test_another_dtype_is_a_copy_on_the_device() -> None:
    model = _tiny()
    served, shared = engine_model(model, torch.bfloat16, torch.device("cpu"))
    assert not shared
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in served.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())
