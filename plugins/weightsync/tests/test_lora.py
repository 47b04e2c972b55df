"""lora: only the adapters move, in memory. The sender's payload (numpy + checksums)
survives pickling; the receiver verifies version, names, shapes and checksums before the
engine swaps the adapter; a corrupted or mismatched payload changes nothing; inproc with
a LoRA backend hands over adapters too (never merged weights into a shared base)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import transformers

from skyrl_host.interfaces import LoadedModel, SampleOutput
from skyrl_host.plugins import build_host
from skyrl_weightsync.lora import Lora, LoraSyncError

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_loaded(seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=32, tie_word_embeddings=True,
                                   initializer_range=0.2)
    return LoadedModel(transformers.Qwen3ForCausalLM(cfg), None, [1], family="qwen", lora_targets=tuple(TARGETS))


class Sampler:
    temperature = 1.0

    def sample(self, logits, generator):
        lp = torch.log_softmax(logits, -1)
        ids = torch.multinomial(lp.exp(), 1, generator=generator)[:, 0]
        return SampleOutput(ids, lp.gather(1, ids[:, None])[:, 0])


class Push:
    """A real policy-gradient algorithm in miniature: raise the logprob of every loss token."""

    needs_reference = False

    def loss(self, inputs):
        return -(inputs.logprobs * inputs.mask).sum() / inputs.global_tokens, {}


def trained_backend(loaded: LoadedModel, steps: int = 2, **options):
    from skyrl_backends.torch import TorchBackendConfig, create

    backend = create(TorchBackendConfig(lr=0.05, lora_rank=4, **options))
    backend.start(loaded, seed=0, total_steps=10, reference=False)
    train(backend, steps)
    return backend


def train(backend, steps: int) -> None:
    from skyrl_host.rollout import RolloutBatch

    batch = RolloutBatch.from_sequences([[3, 4, 5], [6, 7]], [[9, 9, 9], [12, 13]], [[-3.0] * 3, [-3.0] * 2],
                                        group_ids=[0, 1])
    for _ in range(steps):
        backend.train_step(batch, np.ones(batch.n_tokens, np.float32) * batch.loss_mask, Push(), temperature=1.0,
                           max_new_tokens=4)


def started_engine(loaded: LoadedModel, **config):
    from skyrl_engines.embedded import Embedded, EmbeddedConfig

    engine = Embedded(EmbeddedConfig(**config))
    engine.start(loaded)
    return engine


def generate(engine):
    return engine.generate(PROMPTS, n=4, sampler=Sampler(), max_new_tokens=8, seed=5)


def merged_engine(backend):
    model = tiny_loaded().model
    model.load_state_dict(dict(backend.named_weights()))
    return started_engine(LoadedModel(model, None, [1]))


def test_registered_with_its_check() -> None:
    host = build_host()
    reg = host.registry.get("weight_transports", "lora")
    assert reg.origin.distribution == "skyrl-weightsync"
    assert host.records["lora"].entry_point == "skyrl_weightsync.lora"
    assert Lora.carries_payload is True


def test_halves_move_only_adapters_through_a_pickled_payload() -> None:
    loaded = tiny_loaded()
    backend = trained_backend(loaded)
    engine = started_engine(loaded)
    transport = Lora()
    stats, payload = transport.sender().publish(3, backend)
    # What Ray's object store would carry: plain numpy arrays, read-only on the other side.
    payload = pickle.loads(pickle.dumps(payload, protocol=5))
    for array in payload["tensors"].values():
        assert isinstance(array, np.ndarray) and array.dtype == np.float32 and array.flags.c_contiguous
        array.flags.writeable = False
    adapter_bytes = sum(v.numel() * 4 for _, v in backend.named_adapters())
    assert stats["sync_bytes"] == adapter_bytes and stats["sync_tensors"] == 2 * 2 * len(TARGETS)
    assert payload["config"] == {"rank": 4, "alpha": 16.0, "targets": TARGETS}
    assert payload["version"] == 3 and payload["tensors"].keys() == payload["checksums"].keys()

    applied = transport.receiver().sync(engine, target=3, payload=payload)
    assert applied["sync_version"] == 3 and applied["sync_bytes"] == adapter_bytes
    assert engine.weight_version == 3
    got, want = generate(engine), generate(merged_engine(backend))
    assert (got.versions == 3).all()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=2e-5)
    full_bytes = sum(v.numel() * v.element_size() for _, v in backend.named_weights())
    assert adapter_bytes < 0.2 * full_bytes

    # The payload is a copy: further training does not reach it, or the engine.
    train(backend, 1)
    assert not all(np.array_equal(payload["tensors"][k], v.numpy()) for k, v in backend.named_adapters())
    np.testing.assert_array_equal(generate(engine).tokens, got.tokens)


def corrupt_byte(payload):
    name = "model.layers.1.self_attn.v_proj.lora_B"
    array = payload["tensors"][name].copy()
    array.reshape(-1).view(np.uint8)[37] ^= 0x10
    payload["tensors"][name] = array
    return "version 2: tensor 'model.layers.1.self_attn.v_proj.lora_B' fails its checksum"


def wrong_shape(payload):
    name = "model.layers.0.mlp.down_proj.lora_A"
    payload["tensors"][name] = payload["tensors"][name][:, :-1].copy()
    return (r"version 2: tensor 'model.layers.0.mlp.down_proj.lora_A' is float32 \(4, 127\), "
            r"expected float32 \(4, 128\)")


def missing_tensor(payload):
    payload["tensors"].pop("model.layers.0.self_attn.q_proj.lora_B")
    return "version 2: tensor 'model.layers.0.self_attn.q_proj.lora_B' is missing from the payload"


def unknown_tensor(payload):
    payload["tensors"]["model.layers.0.self_attn.q_norm.lora_A"] = np.zeros((4, 16), np.float32)
    return "version 2: tensor 'model.layers.0.self_attn.q_norm.lora_A' has no adapter slot"


def wrong_version(payload):
    payload["version"] = 7
    return "version 2: the payload carries version 7"


@pytest.mark.parametrize("spoil", [corrupt_byte, wrong_shape, missing_tensor, unknown_tensor, wrong_version])
def test_a_spoiled_payload_is_refused_and_the_engine_keeps_its_adapter(spoil) -> None:
    loaded = tiny_loaded()
    backend = trained_backend(loaded, steps=1)
    engine = started_engine(loaded)
    transport = Lora()
    receiver = transport.receiver()
    receiver.sync(engine, target=1, payload=transport.sender().publish(1, backend)[1])
    before = generate(engine)
    train(backend, 2)
    _, payload = transport.sender().publish(2, backend)
    message = spoil(payload)
    with pytest.raises(LoraSyncError, match=message):
        receiver.sync(engine, target=2, payload=payload)
    assert engine.weight_version == 1 and receiver.version == 1
    after = generate(engine)
    np.testing.assert_array_equal(after.tokens, before.tokens)
    np.testing.assert_array_equal(after.logprobs, before.logprobs)


def test_an_older_version_is_refused() -> None:
    loaded = tiny_loaded()
    backend = trained_backend(loaded, steps=1)
    engine = started_engine(loaded)
    transport = Lora()
    receiver = transport.receiver()
    old = transport.sender().publish(4, backend)[1]
    receiver.sync(engine, target=5, payload=transport.sender().publish(5, backend)[1])
    with pytest.raises(LoraSyncError, match=r"version 4: older than the version already applied \(5\)"):
        receiver.sync(engine, target=4, payload=old)
    assert engine.weight_version == 5


def test_local_publish_and_inproc_give_the_engine_the_same_adapters() -> None:
    loaded = tiny_loaded()
    backend = trained_backend(loaded)
    by_lora, by_inproc = started_engine(loaded), started_engine(loaded)
    stats = Lora().publish(backend, by_lora, 2)
    assert stats["sync_version"] == 2 and stats["sync_bytes"] == sum(v.numel() * 4 for _, v in backend.named_adapters())
    host = build_host()
    inproc = host.registry.get("weight_transports", "inproc").create(None)
    base = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    inproc.publish(backend, by_inproc, 2)
    # The engine shares the frozen base with the trainer: inproc must not write merged weights into it.
    assert all(torch.equal(v, base[k]) for k, v in loaded.model.state_dict().items())
    a, b = generate(by_lora), generate(by_inproc)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert (a.versions == 2).all() and (b.versions == 2).all()


def test_a_backend_without_adapters_is_refused() -> None:
    from skyrl_backends.torch import TorchBackendConfig, create

    backend = create(TorchBackendConfig())
    backend.start(tiny_loaded(), seed=0, total_steps=1, reference=False)
    with pytest.raises(LoraSyncError, match=r"version 1: the backend trains no LoRA adapters \(\[backend\] lora_rank = 0\)"):
        Lora().sender().publish(1, backend)
