"""R3 for Tinker clients on a mixture-of-experts base: routes the engine recorded while
sampling, replayed in forward_backward when a datum's provenance spans name them."""

from __future__ import annotations


import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402
from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan  # noqa: E402

MOE = "skyrl/qwen-tiny-moe"
KEY = "tml-replay-key"
ALPHABET = "0123456789:"
NEAR_TIE = 1e-7


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("replay")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 4

[models."{MOE}"]
family = "qwen"
preset = "tiny-moe"
alphabet = "{ALPHABET}"
""") as served:
        # Near-tied routers, as bf16 makes them in practice: every expert scores almost like
        # the first, so float noise between the engine's cached decode and the trainer's full
        # forward picks different experts for some tokens (R3's reason to be).
        base = served.service.bases[MOE]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for info in base.loaded.routers:
                weight = base.loaded.model.get_submodule(info.path).weight
                weight.copy_(weight[0] + NEAR_TIE * torch.randn(weight.shape, generator=gen))
        client = tinker.ServiceClient(base_url=served.url, api_key=KEY)
        yield {"service": served.service, "client": client, "host": served.host}
        client.close("completed")


def _sample(server, prompt, n, seed, ids):
    """Sample on the base's engine (it records routes on a MoE base) and keep the records."""
    service = server["service"]
    base = service.bases[MOE]
    reg = server["host"].get("samplers", "temperature")
    batch = base.engine.generate([prompt], n=n, sampler=reg.create(reg.config(temperature=1.0)), max_new_tokens=10,
                                 seed=seed)
    assert "routed_experts" in batch.side_channels  # the server turned recording on for the MoE base
    service.record_stability(batch, len(prompt), ids)
    return batch


def _datum(prompt, response, sequence_id, spans=True):
    tokens = list(prompt) + list(response)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
    if not spans:
        return datum
    return datum.with_provenance(
        model_input=[PromptProvenanceSpan(sequence_id=sequence_id, offset=0, length=len(prompt)),
                     SampledProvenanceSpan(sequence_id=sequence_id, offset=0, length=len(response) - 1)],
        loss_fn_inputs=[PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=len(prompt) - 1),
                        SampledProvenanceSpan(sequence_id=sequence_id, offset=0, length=len(response))])


def test_replayed_routes_make_the_trainer_equal_the_sampler(server) -> None:
    training = server["client"].create_lora_training_client(base_model=MOE, rank=2, seed=1).result()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ids = [f"seq-{i}" for i in range(16)]
    batch = _sample(server, prompt, 16, 7, ids)
    responses = [np.asarray(batch.response(i)) for i in range(16)]
    engine_lp = [np.asarray(batch.response_logprobs(i), dtype=np.float64) for i in range(16)]
    keep = [i for i in range(16) if len(responses[i]) >= 2]
    replayed = training.forward([_datum(prompt, responses[i], ids[i]) for i in keep], "cross_entropy").result()
    free = training.forward([_datum(prompt, responses[i], ids[i], spans=False) for i in keep], "cross_entropy").result()
    p = len(prompt) - 1
    gaps_replay = [np.abs(o["logprobs"].to_numpy()[p:] - engine_lp[i]).max()
                   for o, i in zip(replayed.loss_fn_outputs, keep)]
    gaps_free = [np.abs(o["logprobs"].to_numpy()[p:] - engine_lp[i]).max() for o, i in zip(free.loss_fn_outputs, keep)]
    assert max(gaps_replay) <= 1e-5, gaps_replay
    assert max(gaps_free) > 1e-3  # free routing: some token routes to other experts than the sampler's
    # Every input token is forced but each response's last input... all are fed: prompt + response[:-1].
    expected = sum(len(prompt) + len(responses[i]) - 1 for i in keep)
    assert replayed.metrics["replay_tokens:sum"] == expected
    assert replayed.metrics["replay_missed_tokens:sum"] == 0
    assert "replay_tokens:sum" not in free.metrics


def test_unknown_or_evicted_sequences_fall_back_and_lying_spans_are_refused(server) -> None:
    service = server["service"]
    training = server["client"].create_lora_training_client(base_model=MOE, rank=2, seed=2).result()
    prompt = [2, 7, 1, 8, 2, 8]
    batch = _sample(server, prompt, 2, 3, ["keep-0", "keep-1"])
    response = list(batch.response(0))
    out = training.forward([_datum(prompt, response, "never-sampled")], "cross_entropy").result()
    assert out.metrics["replay_tokens:sum"] == 0
    assert out.metrics["replay_missed_tokens:sum"] == len(prompt) + len(response) - 1
    lying = _datum(prompt[:-1] + [0], response, "keep-0")
    with pytest.raises(tinker.RequestFailedError if hasattr(tinker, "RequestFailedError") else Exception,
                       match="not the prompt tokens"):
        training.forward([lying], "cross_entropy").result()
    # The store is bounded by bytes: a tiny bound evicts the oldest record.
    store = service.route_store
    before = store.evicted
    old_bound, store.max_bytes = store.max_bytes, store.bytes  # full: the next record pushes the oldest out
    try:
        _sample(server, prompt, 1, 4, ["newer"])
        assert store.evicted > before and store.get("newer") is not None
    finally:
        store.max_bytes = old_bound


def test_kept_sets_make_truncated_sampling_logprobs_match(server) -> None:
    """top_k / temperature sampling reports the logprobs of its truncated distribution;
    with the kept sets recorded, the trainer scores the same distribution."""
    service = server["service"]
    training = server["client"].create_lora_training_client(base_model=MOE, rank=2, seed=3).result()
    prompt = [5, 3, 5, 8, 9, 7]
    reg = server["host"].get("samplers", "temperature")
    sampler = reg.create(reg.config(temperature=0.7, top_k=3, return_support=True))
    batch = service.bases[MOE].engine.generate([prompt], n=6, sampler=sampler, max_new_tokens=8, seed=11)
    ids = [f"kept-{i}" for i in range(6)]
    service.record_stability(batch, len(prompt), ids, temperature=0.7)
    keep = [i for i in range(6) if len(batch.response(i)) >= 2]
    data = [_datum(prompt, list(batch.response(i)), ids[i]) for i in keep]
    out = training.forward(data, "cross_entropy").result()
    free = training.forward([_datum(prompt, list(batch.response(i)), ids[i], spans=False) for i in keep],
                            "cross_entropy").result()
    p = len(prompt) - 1
    for o, f, i in zip(out.loss_fn_outputs, free.loss_fn_outputs, keep):
        engine = np.asarray(batch.response_logprobs(i), dtype=np.float64)
        np.testing.assert_allclose(o["logprobs"].to_numpy()[p:], engine, atol=1e-5)
        assert np.abs(f["logprobs"].to_numpy()[p:] - engine).max() > 1e-2  # raw logprobs: another distribution
    assert out.metrics["support_tokens:sum"] == sum(len(batch.response(i)) for i in keep)
    assert out.metrics["support_missed_tokens:sum"] == 0
