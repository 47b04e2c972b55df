"""Continuous batching behind ``asample``, driven by the official SDK: many concurrent
requests from sampling clients with different adapters decode in one batch and get
what each gets alone; past ``[server] max_queued_tokens`` asample answers 429 at once
while the requests in flight go on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402

BASE = "skyrl/qwen-tiny"
KEY = "tml-batching-key"
LIMIT = 6000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("batching")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 4
poll_seconds = 5
max_queued_tokens = {LIMIT}

[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "0123456789:abcdef"
""") as served:
        yield {"url": served.url, "service": served.service}


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server["url"], api_key=KEY)
    yield client
    client.close("completed")


def _post(url: str, body: dict) -> tuple[int, object]:
    """The status and the JSON body (a protobuf body: the parsed SampleResponse)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-API-Key": KEY})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            if "protobuf" in r.headers.get("Content-Type", ""):
                from tinker.proto import tinker_public_pb2

                msg = tinker_public_pb2.SampleResponse()
                msg.ParseFromString(r.read())
                return r.status, msg
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _trained_sampler(service, tokens: list[int], seed: int):
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                        "weights": np.ones(len(tokens) - 1, dtype=np.float32)})
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return training.save_weights_and_get_sampling_client().result()


def test_concurrent_requests_of_two_adapters_share_batches_and_equal_solo_runs(server, service) -> None:
    clients = {"a": _trained_sampler(service, [3, 4, 5, 6, 7, 8, 9], 1),
               "b": _trained_sampler(service, [9, 9, 1, 1, 9, 9, 1], 2),
               "base": service.create_sampling_client(base_model=BASE).result()}
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [2, 2, 2, 2], [12, 13, 14]]
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)

    def run(name, prompt):
        return clients[name].sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=greedy)

    solo = {(k, i): run(k, p).result().sequences[0] for k in clients for i, p in enumerate(prompts)}
    assert [list(solo["a", i].tokens) for i in range(6)] != [list(solo["b", i].tokens) for i in range(6)]
    batcher = server["service"].batcher(server["service"].bases[BASE])
    before = dict(batcher.stats)
    jobs = [(k, i) for _ in range(4) for k in clients for i in range(len(prompts))]  # 72 requests at once
    futures = [run(k, prompts[i]) for k, i in jobs]
    for (k, i), f in zip(jobs, futures):
        seq = f.result(timeout=60).sequences[0]
        assert list(seq.tokens) == list(solo[k, i].tokens), (k, i)
        np.testing.assert_allclose(seq.logprobs, solo[k, i].logprobs, atol=1e-4)
    stats = batcher.stats
    # They shared decode batches (rows of both adapters and the base at once) ...
    assert stats["max_adapters"] >= 2 and stats["max_rows"] >= 12
    # ... so far fewer decode forwards than one request at a time (7 each)
    assert stats["decode_forwards"] - before["decode_forwards"] < 7 * len(jobs) / 4
    assert batcher.queued_tokens == 0


def test_past_max_queued_tokens_asample_answers_429_while_others_go_on(server, service) -> None:
    url = server["url"] + "/api/v1/"
    big = {"base_model": BASE, "prompt": {"chunks": [{"tokens": [1, 2, 3, 4, 5]}]}, "num_samples": 64,
           "sampling_params": {"max_tokens": 60, "seed": 3}}  # 64 * (5 + 60) = 4160 tokens
    status, first = _post(url + "asample", big)
    assert status == 200 and len(first["sample_sequence_ids"]) == 64
    status, busy = _post(url + "asample", {**big, "num_samples": 30})  # + 1950 > 6000: refused at once
    assert status == 429 and "max_queued_tokens" in busy["error"] and "\n" not in busy["error"]
    # The SDK backs off on 429 and sends it again: this one completes once there is room.
    sampler = service.create_sampling_client(base_model=BASE).result()
    later = sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3, 4, 5]), num_samples=30,
                           sampling_params=types.SamplingParams(max_tokens=60, seed=3))
    while True:  # the request in flight went on and finished
        status, done = _post(url + "retrieve_future", {"request_id": first["request_id"]})
        if not isinstance(done, dict) or done.get("type") != "try_again":
            break
    assert status == 200 and len(done.sequences) == 64
    assert len(later.result(timeout=60).sequences) == 30
    # A request that could never fit is the user's error, and the SDK raises it.
    with pytest.raises(Exception, match="max_queued_tokens"):
        sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3, 4, 5]), num_samples=100,
                       sampling_params=types.SamplingParams(max_tokens=60)).result(timeout=60)
    assert server["service"].queued_tokens() == 0


def test_record_stability_info_keeps_each_sequences_kept_sets_for_replay(server, service) -> None:
    sampler = service.create_sampling_client(base_model=BASE, record_stability_info=True).result()
    res = sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=0.8, top_k=3, seed=1)).result()
    for seq in res.sequences:
        record = server["service"].route_store.get(seq.sequence_id)
        assert record is not None and record.tokens.tolist() == list(seq.tokens) and record.temperature == 0.8
        rows = [record.support.row(i).tolist() for i in range(record.support.n_rows)]
        assert len(rows) == len(seq.tokens) and all(len(r) == 3 and t in r for t, r in zip(seq.tokens, rows))


def test_topk_sample_and_prompt_logprobs_are_the_models_most_likely_tokens(server, service) -> None:
    sampler = service.create_sampling_client(base_model=BASE).result()
    prompt = [1, 2, 3, 4, 5]
    res = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1, include_prompt_logprobs=True,
                         topk_prompt_logprobs=3, topk_sample_logprobs=4,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    seq = res.sequences[0]
    base = server["service"].bases[BASE]
    with torch.no_grad():
        logits = base.engine.model(input_ids=torch.tensor([prompt + list(seq.tokens)])).logits[0]
    lsm = torch.log_softmax(logits.float(), -1)
    want = torch.topk(lsm, 4, -1)
    for t, entries in enumerate(seq.topk_logprobs):  # position len(prompt) - 1 + t predicts sampled token t
        p = len(prompt) - 1 + t
        assert [i for i, _ in entries] == want.indices[p].tolist()
        np.testing.assert_allclose([v for _, v in entries], want.values[p].numpy(), atol=1e-5)
        assert entries[0][0] == seq.tokens[t]  # greedy: the sampled token is the most likely one
    prompt_topk = res.topk_prompt_logprobs
    assert prompt_topk[0] is None and len(prompt_topk) == len(prompt)
    for p in range(1, len(prompt)):
        assert [i for i, _ in prompt_topk[p]] == want.indices[p - 1, :3].tolist()
