"""The torch backend's ``device`` option: validation, the device as a pure function of
what the machine has, ``auto`` = today's choice, the job check."""

from __future__ import annotations

import types

import pytest
import torch

from skyrl_backends import _parallel
from skyrl_backends.torch import TorchBackendConfig, check, create
from skyrl_host.errors import UserError

cuda = torch.cuda.is_available()


def resolve(requested, *, dp=False, cuda=True, group=None, local_rank=0, current=0):
    return _parallel.resolve_device(requested, data_parallel=dp, cuda=cuda, group_backend=group,
                                    local_rank=local_rank, current=current)


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda", "cuda:2"])
def test_device_values_are_accepted(value) -> None:
    assert TorchBackendConfig(device=value).device == value


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:-1", "Cuda"])
def test_other_device_values_are_refused(value) -> None:
    with pytest.raises(ValueError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        TorchBackendConfig(device=value)


def test_auto_is_cuda_when_present_else_cpu() -> None:
    assert resolve("auto", cuda=False) == torch.device("cpu")
    assert resolve("auto", cuda=True, current=1) == torch.device("cuda", 1)
    assert resolve("auto", dp=True, cuda=True, group="nccl", local_rank=3) == torch.device("cuda", 3)
    assert resolve("auto", dp=True, cuda=True, group="gloo") == torch.device("cpu")


def test_explicit_devices() -> None:
    assert resolve("cpu", cuda=True) == torch.device("cpu")
    assert resolve("cuda", cuda=True, current=2) == torch.device("cuda", 2)
    assert resolve("cuda:5", cuda=True) == torch.device("cuda", 5)
    assert resolve("cuda", dp=True, cuda=True, group="nccl", local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(UserError, match="needs CUDA"):
        resolve("cuda", cuda=False)
    with pytest.raises(UserError, match="gloo"):
        resolve("cuda:0", dp=True, cuda=True, group="gloo")


def test_pick_device_follows_the_option_here() -> None:
    assert _parallel.pick_device(False) == (torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    assert _parallel.pick_device(False, "cpu") == torch.device("cpu")
    if not cuda:
        with pytest.raises(UserError, match="needs CUDA"):
            _parallel.pick_device(False, "cuda")


def test_the_backend_trains_on_its_device_option(tiny) -> None:
    """The option reaches the device the backend trains on (``cpu`` here)."""
    backend = create(TorchBackendConfig(device="cpu"))
    backend.start(tiny.loaded(), seed=0, total_steps=1, reference=False)
    assert backend.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in backend.module.parameters())


def test_the_factory_keeps_starts_signature() -> None:
    import inspect

    backend = create(TorchBackendConfig(device="cpu"))
    assert "precision" in inspect.signature(backend.start).parameters


def _spec(device: str, launcher: str = "local"):
    backend = types.SimpleNamespace(config=TorchBackendConfig(device=device))
    return types.SimpleNamespace(plugins={"backend": backend},
                                 cluster=types.SimpleNamespace(launcher=launcher, trainer_ranks=1))


@pytest.mark.skipif(cuda, reason="checks the machine without CUDA")
def test_validate_says_cuda_is_missing() -> None:
    assert check(_spec("auto")) == [] and check(_spec("cpu")) == []
    [(key, message)] = check(_spec("cuda:0"))
    assert key == "backend.device" and "needs CUDA" in message
    assert check(_spec("cuda", launcher="ray")) == []
