"""The official tinker SDK (tinker.ServiceClient) against ``skyrl serve``, on the tiny preset.

One server for the module, on 127.0.0.1 at a free port, in a thread. The numbers are
checked against the same preset built here and scored with plain torch."""

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
KEY = "tml-test-key"
ALPHABET = "0123456789:abcdef"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("serve")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 8
poll_seconds = 5

[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "{ALPHABET}"
""") as served:
        yield {"url": served.url, "base": served.service.bases[BASE], "host": served.host,
               "service_models": lambda: served.service.models}


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server["url"], api_key=KEY)
    yield client
    client.close("completed")


@pytest.fixture(scope="module")
def reference(server):
    """The preset's own weights, built again here: logprobs of plain torch."""
    host = server["host"]
    reg = host.get("models", "qwen")
    family = reg.create(reg.config(preset="tiny"))
    model = family.load(alphabet=ALPHABET, seed=0).model.float().eval()

    def logprobs(inputs, targets):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([inputs])).logits[0].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0].numpy()

    return logprobs


def _datum(tokens, weights=None, **extra):
    inputs = {"target_tokens": np.array(tokens[1:], dtype=np.int64)}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    inputs.update({k: np.asarray(v, dtype=np.float32) for k, v in extra.items()})
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _post(url, path, body, key):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **({"X-API-Key": key} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cross_entropy_loss_and_logprobs_equal_a_hand_computation(service, reference) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4).result()
    a, b = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]
    wa = [1.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.25]
    out = training.forward_backward([_datum(a, wa), _datum(b, [1.0, 1.0, 1.0])], "cross_entropy").result()
    lp_a, lp_b = (o["logprobs"].to_numpy() for o in out.loss_fn_outputs)
    # B = 0 at the start: the adapted model is the base, scored here with plain torch.
    np.testing.assert_allclose(lp_a, reference(a[:-1], a[1:]), atol=1e-5)
    np.testing.assert_allclose(lp_b, reference(b[:-1], b[1:]), atol=1e-5)
    hand = -(np.dot(wa, lp_a) + lp_b.sum())
    assert out.metrics["loss:sum"] == pytest.approx(hand, rel=1e-5)
    assert lp_a.max() < -1.0  # a random model: far from certain of any token


def test_optim_step_lowers_the_loss_and_importance_sampling_matches(service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    data = [_datum([5, 6, 7, 8, 9, 5, 6, 7], [1.0] * 7)]
    before = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    again = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert again == before  # forward-only: no gradient, no change
    losses = []
    for _ in range(6):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert losses[0] == pytest.approx(before, rel=1e-6)
    assert after < 0.8 * before, (before, losses, after)

    # importance_sampling: -sum(exp(logprobs - sampling_logprobs) * advantages)
    tokens = [1, 2, 3, 4, 5, 6]
    lp = training.forward([_datum(tokens, [1.0] * 5)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    sampling = lp - np.array([0.1, -0.2, 0.0, 0.3, 0.05], dtype=np.float32)
    adv = np.array([1.0, -0.5, 2.0, 0.0, 1.5], dtype=np.float32)
    out = training.forward([_datum(tokens, logprobs=sampling, advantages=adv)], "importance_sampling").result()
    hand = -(np.exp(lp - sampling) * adv).sum()
    assert out.metrics["loss:sum"] == pytest.approx(hand, rel=1e-5)


def test_sampler_sees_the_trained_adapter_and_its_logprobs_equal_the_trainers(service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    data = [_datum([9, 8, 7, 6, 5, 4], [1.0] * 5)]
    for _ in range(3):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = [3, 1, 4]
    res = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=6, seed=7)).result()
    assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6 and seq.stop_reason in ("stop", "length")
        full = prompt + list(seq.tokens)
        lp = training.forward([_datum(full, [1.0] * (len(full) - 1))], "cross_entropy").result()
        trained = lp.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
        np.testing.assert_allclose(np.array(seq.logprobs), trained, atol=1e-4)
    # The same seed gives the same samples; a stop token ends a sequence at it.
    again = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                           sampling_params=types.SamplingParams(max_tokens=6, seed=7)).result()
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in res.sequences]
    first = res.sequences[0].tokens
    stop = first[1] if len(first) > 1 else first[0]
    cut = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=6, seed=7, stop=[stop])).result()
    expected = list(first[: list(first).index(stop) + 1])
    assert list(cut.sequences[0].tokens) == expected and cut.sequences[0].stop_reason == "stop"
    # The base model's sampler differs from the trained one's (the adapter is applied).
    base = service.create_sampling_client(base_model=BASE).result()
    base_res = base.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=1, seed=7)).result()
    tok = int(base_res.sequences[0].tokens[0])
    base_lp = base_res.sequences[0].logprobs[0]
    trained_lp = training.forward([_datum(prompt + [tok], [1.0] * 3)], "cross_entropy").result()
    assert abs(trained_lp.loss_fn_outputs[0]["logprobs"].to_numpy()[-1] - base_lp) > 1e-3


def test_keys_and_bad_requests_answer_4xx(server, service) -> None:
    url = server["url"]
    with urllib.request.urlopen(url + "/api/v1/healthz", timeout=10) as r:
        assert r.status == 200  # health needs no key
    for key in (None, "tml-wrong"):
        status, body = _post(url, "/api/v1/create_session", {"tags": [], "sdk_version": "x"}, key)
        assert status == 401 and "X-API-Key" in body["error"]
    status, body = _post(url, "/api/v1/create_session", {"tags": [], "sdk_version": "x"}, KEY)
    session = body["session_id"]
    lora = {"session_id": session, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 64}}
    status, body = _post(url, "/api/v1/create_model", lora, KEY)
    assert status == 400 and "rank must be in [1, 8]" in body["error"]
    status, body = _post(url, "/api/v1/create_model", {**lora, "base_model": "nope", "lora_config": {"rank": 2}}, KEY)
    assert status == 404 and "unknown base_model" in body["error"]
    status, body = _post(url, "/api/v1/retrieve_future", {"request_id": 3}, KEY)
    assert status == 400 and "request_id" in body["error"]
    req = urllib.request.Request(url + "/api/v1/forward_backward", data=b"\xff\x00garbage", method="POST",
                                 headers={"Content-Type": "application/x-protobuf", "X-API-Key": KEY})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    with pytest.raises(tinker.APIStatusError) as exc:
        service.create_lora_training_client(base_model=BASE, rank=9).result()
    assert exc.value.status_code == 400


def test_a_wrong_key_is_refused_by_the_sdk(server) -> None:
    with pytest.raises(tinker.APIStatusError) as exc:
        tinker.ServiceClient(base_url=server["url"], api_key="tml-wrong").create_lora_training_client(
            base_model=BASE, rank=2).result()
    assert exc.value.status_code == 401


def test_compute_logprobs_and_models_that_share_a_base_stay_apart(service) -> None:
    one = service.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    two = service.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    data = [_datum([4, 4, 2, 2, 4, 4], [1.0] * 5)]
    start = two.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    for _ in range(3):
        one.forward_backward(data, "cross_entropy").result()
        one.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    trained = one.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    untouched = two.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(untouched, start)  # training one adapter leaves the other (and the base) alone
    assert trained.sum() > start.sum() + 0.5
    sampler = one.save_weights_and_get_sampling_client().result()
    tokens = [4, 4, 2, 2, 4, 4]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert scored[0] is None and len(scored) == len(tokens)
    np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), trained, atol=1e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=2).result()
    assert last[:-2] == [None] * 4 and np.allclose(last[-2:], trained[-2:], atol=1e-4)


def test_a_repeated_seq_id_is_answered_once(server, service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=2).result()
    url, model_id = server["url"], training.model_id
    adam = {"learning_rate": 0.1}
    status, first = _post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "optim_params": adam}, KEY)
    assert status == 200
    status, again = _post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 1, "optim_params": adam}, KEY)
    assert status == 200 and again["request_id"] == first["request_id"]
    status, done = _post(url, "/api/v1/retrieve_future", {"request_id": first["request_id"]}, KEY)
    assert status == 200 and "grad_norm:mean" in done["metrics"]
    status, late = _post(url, "/api/v1/optim_step", {"model_id": model_id, "seq_id": 0, "optim_params": adam}, KEY)
    assert status == 400 and "seq_id" in late["error"]


ROUTES = ["client/config", "create_session", "session_heartbeat", "telemetry", "sessions/nope/finish", "create_model",
          "get_info", "unload_model", "forward_backward", "optim_step", "save_weights_for_sampler",
          "create_sampling_session", "asample", "retrieve_future", "save_weights", "load_weights"]
BODIES = [b"", b"{}", b"[]", b"null", b'"x"', b"\xff\xfe\x00", b'{"model_id": 5, "seq_id": "a"}',
          b'{"session_id": "nope", "model_seq_id": -1, "base_model": "' + BASE.encode() + b'", "lora_config": {"rank": "8"}}',
          b'{"sampling_session_id": "nope", "prompt": {"chunks": [{"tokens": [1, -5]}]}, "sampling_params": {}}',
          b'{"base_model": "' + BASE.encode() + b'", "prompt": {"chunks": [{"tokens": [1, 2]}]}, '
          b'"sampling_params": {"max_tokens": -3}, "num_samples": 2}',
          b'{"model_id": "x:train:0", "optim_params": {"learning_rate": "fast"}}']


def test_fuzzed_bodies_get_4xx_never_5xx(server) -> None:
    url = server["url"]
    for route in ROUTES:
        for body in BODIES:
            for ctype in ("application/json", "application/x-protobuf"):
                req = urllib.request.Request(f"{url}/api/v1/{route}", data=body, method="POST",
                                             headers={"Content-Type": ctype, "X-API-Key": KEY})
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        status, text = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, text = e.code, e.read()
                assert status < 500, (route, body, status, text)
                if status >= 400:
                    message = json.loads(text)["error"]
                    assert message and "\n" not in message, (route, body, message)
    status, reply = _post(url, "/api/v1/asample", json.loads(BODIES[9]), KEY)
    assert status == 400 and "max_tokens must be at least 1" in reply["error"]
    # A prompt longer than the context is refused when it is computed: the future holds a user error.
    long = {"base_model": BASE, "prompt": {"chunks": [{"tokens": [1] * 600}]}, "sampling_params": {"max_tokens": 4}}
    status, reply = _post(url, "/api/v1/asample", long, KEY)
    assert status == 200 and len(reply["sample_sequence_ids"]) == 1
    status, result = _post(url, "/api/v1/retrieve_future", {"request_id": reply["request_id"]}, KEY)
    assert status == 200 and result["category"] == "user" and "context" in result["error"]


def test_ppo_and_cispo_equal_hand_computations(service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=2, seed=4).result()
    tokens = [7, 3, 5, 1, 2, 6, 4]
    lp = training.forward([_datum(tokens, [1.0] * 6)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    lp = lp.astype(np.float64)
    shift = np.array([0.5, -0.5, 0.05, -0.05, 1.5, 0.0])  # ratios e^0.5, e^-0.5, ~1, ~1, e^1.5, 1
    sampling = (lp - shift).astype(np.float32)
    adv = np.array([1.0, 1.0, -1.0, 2.0, -0.5, 1.0], dtype=np.float32)
    ratio = np.exp(lp - sampling.astype(np.float64))
    cases = [
        ("ppo", None, -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv).sum()),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
         -np.minimum(ratio * adv, np.clip(ratio, 0.5, 2.0) * adv).sum()),
        ("cispo", None, -(np.clip(ratio, 0.0, 4.0) * lp * adv).sum()),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, -(np.clip(ratio, 0.9, 1.1) * lp * adv).sum()),
    ]
    data = [_datum(tokens, logprobs=sampling, advantages=adv)]
    for loss_fn, config, hand in cases:
        out = training.forward(data, loss_fn, loss_fn_config=config).result()
        assert out.metrics["loss:sum"] == pytest.approx(hand, rel=1e-5), (loss_fn, config)
    with pytest.raises(Exception, match="clip_lo_threshold"):
        training.forward(data, "ppo", loss_fn_config={"clip_lo_threshold": 0.5}).result()
    # A loss with a gradient trains: cispo's step raises the logprob of positive-advantage tokens.
    training.forward_backward(data, "cispo").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward([_datum(tokens, [1.0] * 6)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.dot(after - lp, adv) > 0


def test_save_state_and_resume_with_the_optimizer(service) -> None:
    data = [_datum([2, 4, 6, 8, 1, 3, 5], [1.0] * 6)]
    adam = types.AdamParams(learning_rate=1e-2)
    first = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    for _ in range(2):
        first.forward_backward(data, "cross_entropy").result()
        first.optim_step(adam).result()
    path = first.save_state("step2").result().path
    assert path == f"tinker://{first.model_id}/weights/step2"
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    plain = service.create_training_client_from_state(path).result()
    lp = [c.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy() for c in (first, resumed, plain)]
    np.testing.assert_array_equal(lp[1], lp[0])  # the same adapters
    np.testing.assert_array_equal(lp[2], lp[0])
    for client in (first, resumed, plain):  # one more step each
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
    after = [c.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy() for c in (first, resumed, plain)]
    np.testing.assert_allclose(after[1], after[0], atol=1e-6)  # the same Adam moments: the same step
    assert np.abs(after[2] - after[0]).max() > 1e-4  # a fresh optimizer steps differently
    with pytest.raises(Exception, match="no such training state"):
        service.create_training_client_from_state(f"tinker://{first.model_id}/weights/nope").result()


def test_dro_equals_the_hand_computation_and_custom_losses_train(service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=2, seed=5).result()
    tokens = [4, 9, 2, 8, 1, 3, 6]
    lp = training.forward([_datum(tokens, [1.0] * 6)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    lp = lp.astype(np.float64)
    sampling = (lp - np.array([0.3, -0.2, 0.0, 0.7, -1.0, 0.1])).astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, 2.0, -0.5, 0.0], dtype=np.float32)
    data = [_datum(tokens, logprobs=sampling, advantages=adv)]
    for beta in (None, 0.5):
        b = 0.05 if beta is None else beta
        hand = -(lp * adv - 0.5 * b * (lp - sampling.astype(np.float64)) ** 2)
        out = training.forward(data, "dro", loss_fn_config=None if beta is None else {"beta": beta}).result()
        assert out.metrics["loss:sum"] == pytest.approx(hand.sum(), rel=1e-5)
        np.testing.assert_allclose(out.loss_fn_outputs[0]["elementwise_loss"].to_numpy(), hand, rtol=1e-4, atol=1e-6)
    with pytest.raises(Exception, match="beta must be >= 0"):
        training.forward(data, "dro", loss_fn_config={"beta": -1.0}).result()

    # forward_backward_custom: the SDK's forward, its local loss, then a weighted cross_entropy backward here.
    plain = [_datum(tokens, [1.0] * 6)]

    def squared(batch, logprobs):
        loss = sum((x ** 2).sum() for x in logprobs)
        return loss, {"squared:sum": float(loss.detach())}

    result = training.forward_backward_custom(plain, squared).result()
    assert result.metrics["squared:sum"] == pytest.approx(float((lp ** 2).sum()), rel=1e-4)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward(plain, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert (after.astype(np.float64) ** 2).sum() < 0.97 * (lp ** 2).sum()  # the custom loss went down


def test_lora_config_parts_choose_the_adapted_layers(server, service) -> None:
    svc = server["base"]
    full = service.create_lora_training_client(base_model=BASE, rank=2, seed=6).result()
    attn = service.create_lora_training_client(base_model=BASE, rank=2, seed=6, train_mlp=False,
                                               train_unembed=False).result()
    info = full.get_info()
    assert info.model_data.model_name == BASE
    models = server["service_models"]()
    names_full = {n.rsplit(".", 2)[-2] for n, _ in models[full.model_id].backend.named_adapters()}
    names_attn = {n.rsplit(".", 2)[-2] for n, _ in models[attn.model_id].backend.named_adapters()}
    assert "lm_head" in names_full and {"q_proj", "down_proj"} <= names_full  # Tinker's default: all three parts
    assert names_attn and "lm_head" not in names_attn and "down_proj" not in names_attn and "q_proj" in names_attn
    assert svc.name == BASE
    # An unembedding adapter trains and reaches the sampler.
    tokens = [4, 4, 2, 2, 4, 4]
    data = [_datum(tokens, [1.0] * 5)]
    start = full.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    for _ in range(3):
        full.forward_backward(data, "cross_entropy").result()
        full.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    trained = full.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert trained.sum() > start.sum() + 0.5
    sampler = full.save_weights_and_get_sampling_client().result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), trained, atol=1e-4)
    status, body = _post(server["url"], "/api/v1/create_session", {"tags": [], "sdk_version": "x"}, KEY)
    lora = {"rank": 2, "train_mlp": False, "train_attn": False, "train_unembed": False}
    status, body = _post(server["url"], "/api/v1/create_model", {"session_id": body["session_id"], "model_seq_id": 0,
                                                                  "base_model": BASE, "lora_config": lora}, KEY)
    assert status == 400 and "nothing to train" in body["error"]


def test_data_of_different_lengths_share_one_forward_and_score_as_alone(service) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=2, seed=8).result()
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 2], [7, 7, 1, 3, 5], [2, 9, 9, 9, 1, 1, 1, 1, 1, 1, 4]]
    data = [_datum(t, [1.0] * (len(t) - 1)) for t in seqs]
    together = training.forward(data, "cross_entropy").result()
    for out, datum in zip(together.loss_fn_outputs, data):
        alone = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(out["logprobs"].to_numpy(), alone, atol=1e-5)
    # and the gradient of the batch is the sum of the data's: one step on all == the same step on a twin fed one by one
    twin = service.create_lora_training_client(base_model=BASE, rank=2, seed=8).result()
    training.forward_backward(data, "cross_entropy").result()
    for datum in data:
        twin.forward_backward([datum], "cross_entropy").result()
    for client in (training, twin):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a, b = (c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (training, twin))
    assert a == pytest.approx(b, rel=1e-5) and a < together.metrics["loss:sum"]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_a_chunk_of_data_equals_its_data_one_by_one(server, service, loss_fn) -> None:
    """One forward_backward over data of different lengths (one packed chunk) gives each
    datum the logprobs, elementwise loss and gradient it gets alone, and the loss their sum."""
    training = service.create_lora_training_client(base_model=BASE, rank=2, seed=9).result()
    tm = server["service_models"]()[training.model_id]
    rng = np.random.default_rng(len(loss_fn))
    data = []
    for n in (9, 2, 5, 12, 3, 7):
        tokens = rng.integers(0, len(ALPHABET), n).tolist()
        extra = ({"weights": rng.uniform(0, 2, n - 1)} if loss_fn == "cross_entropy" else
                 {"logprobs": rng.normal(-2.5, 0.5, n - 1), "advantages": rng.normal(0, 1, n - 1)})
        data.append(_datum(tokens, **extra))

    def grads():
        out = np.concatenate([p.grad.detach().numpy().ravel().copy() for p in tm.params])
        training.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears them; lr 0 leaves the adapters
        return out

    together = training.forward_backward(data, loss_fn).result()
    g_together = grads()
    alone, total = [], 0.0
    for datum in data:
        out = training.forward_backward([datum], loss_fn).result()
        alone.append(out.loss_fn_outputs[0])
        total += out.metrics["loss:sum"]
    g_alone = grads()
    for i, (out, one) in enumerate(zip(together.loss_fn_outputs, alone)):
        for key in ("logprobs", "elementwise_loss"):
            np.testing.assert_allclose(out[key].to_numpy(), one[key].to_numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{i} {key}")
        assert out["logprobs"].to_numpy().shape == (len(data[i].loss_fn_inputs["target_tokens"].data),)
    assert together.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert np.abs(g_alone).max() > 1e-4  # the data carry a gradient
    np.testing.assert_allclose(g_together, g_alone, rtol=1e-4, atol=1e-6)
