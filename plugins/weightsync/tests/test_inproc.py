"""inproc: the engine serves the trainer's own tensors when it can, copies in
place when it must, and reports which."""

from __future__ import annotations

import torch
import transformers

from skyrl_host.interfaces import LoadedModel
from skyrl_host.plugins import build_host


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=16, intermediate_size=64, vocab_size=16, tie_word_embeddings=True)
    return transformers.Qwen3ForCausalLM(cfg).eval()


class Backend:
    def __init__(self, model):
        self.model = model

    def named_weights(self):
        return [(k, v.detach()) for k, v in self.model.state_dict().items()]


def make(host, kind, name, **config):
    reg = host.registry.get(kind, name)
    cfg = reg.config(**config) if reg.config else None
    return reg.create(cfg)


def test_registered() -> None:
    host = build_host()
    assert host.registry.get("weight_transports", "inproc").origin.distribution == "skyrl-weightsync"


def test_shared_weights_cost_nothing_and_versions_advance() -> None:
    host = build_host()
    model = tiny_model()
    engine = make(host, "engines", "embedded")
    engine.start(LoadedModel(model, None, [1]))
    transport = make(host, "weight_transports", "inproc")
    stats = transport.publish(Backend(model), engine, 7)
    assert engine.weight_version == 7
    assert stats["sync_bytes_copied"] == 0.0 and stats["sync_tensors_shared"] > 0


def test_other_weights_are_copied_in_place() -> None:
    host = build_host()
    engine = make(host, "engines", "embedded")
    served = tiny_model(0)
    engine.start(LoadedModel(served, None, [1]))
    trained = tiny_model(1)
    stats = make(host, "weight_transports", "inproc").publish(Backend(trained), engine, 1)
    assert stats["sync_bytes_copied"] > 0
    for (name, a), b in zip(served.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name
