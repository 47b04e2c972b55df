"""Seeded fuzzing of every route: valid bodies with one field replaced, dropped or
nested wrongly, and valid protobuf bodies with flipped bytes or bad tensors. Every
answer is below 500 with a one-line error, and the server keeps serving."""

from __future__ import annotations

import asyncio
import copy
import json
import random

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
aiohttp = pytest.importorskip("aiohttp")

BASE = "skyrl/qwen-tiny"
KEY = "tml-fuzz-key"
ACCEPTED: list = []  # request ids of accepted requests: their futures must not hold a server fault
ODD = [None, -1, 0, 2**63, -(2**70), 1.5, float("nan"), "x", "", [], {}, True, [1, "a"], {"k": []}, "tml-" * 300]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("fuzz")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 4
poll_seconds = 2
order_wait_seconds = 0.2

[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "0123456789:"
""") as served:
        yield f"{served.url}/api/v1"


def _mutations(body, rng, count):
    """``count`` variants of ``body``: one (possibly nested) field replaced by an odd value or dropped."""
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + (k,))
                walk(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                paths.append(path + (i,))
                walk(v, path + (i,))

    walk(body, ())
    for _ in range(count):
        variant = copy.deepcopy(body)
        path = paths[rng.randrange(len(paths))]
        parent = variant
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict) and rng.random() < 0.2:
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(ODD[rng.randrange(len(ODD))])
        yield variant


async def _check(session, url, route, data, ctype="application/json"):
    async with session.post(f"{url}/{route}", data=data, headers={"Content-Type": ctype, "X-API-Key": KEY}) as r:
        text = await r.read()
        assert r.status < 500, (route, data[:200], r.status, text[:300])
        if r.status >= 400:
            message = json.loads(text)["error"]
            assert message and "\n" not in message, (route, message)
            return r.status, None
        if r.content_type == "application/json":
            value = json.loads(text)
            if route != "retrieve_future" and isinstance(value, dict) and "request_id" in value:
                ACCEPTED.append(value["request_id"])
            return r.status, value
        return r.status, text


async def _finish(s, url, reply) -> tuple[int, object]:
    """The result of an accepted request (``reply``: its future), polled until it is done."""
    for _ in range(100):
        status, result = await _check(s, url, "retrieve_future", json.dumps({"request_id": reply["request_id"]}))
        if not (isinstance(result, dict) and result.get("type") == "try_again"):
            return status, result
    raise AssertionError(f"request {reply['request_id']} did not finish")


def _sample_body() -> dict:
    return {"base_model": BASE, "num_samples": 2, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "top_k": 5, "top_p": 0.9, "seed": 3,
                                "stop": [4]}, "prompt_logprobs": True}


@pytest.fixture(scope="module")
def valid(url) -> dict:
    """A valid body for each JSON route, naming a session and a LoRA model made for them."""

    async def main():
        async with aiohttp.ClientSession() as s:
            _, created = await _check(s, url, "create_session", json.dumps({"tags": [], "sdk_version": "0.38.0"}))
            sid = created["session_id"]
            lora = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 2, "seed": 1}}
            _, fut = await _check(s, url, "create_model", json.dumps(lora))
            mid = fut["model_id"]
            await _finish(s, url, fut)
            sample = _sample_body()
            return {
                "create_session": {"tags": ["a"], "user_metadata": {}, "sdk_version": "0.38.0"},
                "session_heartbeat": {"session_id": sid},
                "create_model": {**lora, "model_seq_id": 5},
                "get_info": {"model_id": mid},
                "optim_step": {"model_id": mid, "seq_id": 1000, "adam_params": {"learning_rate": 1e-3, "beta1": 0.9,
                                                                                "beta2": 0.95, "eps": 1e-8}},
                "save_weights_for_sampler": {"model_id": mid, "seq_id": 1001, "path": "fuzz"},
                "save_weights": {"model_id": mid, "seq_id": 1002, "path": "fuzz-state"},
                "load_weights": {"model_id": mid, "seq_id": 1003, "path": f"tinker://{mid}/weights/fuzz-state",
                                 "optimizer": True},
                "create_sampling_session": {"session_id": sid, "sampling_session_seq_id": 1, "base_model": BASE},
                "asample": sample,
                "retrieve_future": {"request_id": fut["request_id"]},
                "unload_model": {"model_id": "none:train:9"},
            }

    return asyncio.run(main())


def test_mutated_json_and_protobuf_bodies_never_get_a_5xx(url, valid) -> None:
    from tinker import types
    from tinker.proto import tinker_public_pb2 as pb

    async def main():
        rng = random.Random(1234)
        async with aiohttp.ClientSession() as s:
            mid = valid["get_info"]["model_id"]
            sample = valid["asample"]
            answered = 0
            for route, body in valid.items():
                for variant in _mutations(body, rng, 20):
                    status, _ = await _check(s, url, route, json.dumps(variant))
                    answered += 1
            # Protobuf: a valid ForwardBackwardRequest, then byte flips, truncations and bad tensors.
            datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4]), loss_fn_inputs={
                "target_tokens": np.array([2, 3, 4, 5], dtype=np.int64), "weights": np.ones(4, np.float32)})
            from tinker.proto.request_conv import forward_backward_request_to_proto  # the SDK's own encoder

            msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
                model_id=mid, seq_id=2000))
            good = msg.SerializeToString()
            status, _ = await _check(s, url, "forward_backward", good, "application/x-protobuf")
            assert status == 200
            for i in range(120):
                raw = bytearray(good)
                kind = i % 3
                if kind == 0:
                    for _ in range(rng.randint(1, 4)):
                        raw[rng.randrange(len(raw))] = rng.randrange(256)
                elif kind == 1:
                    raw = raw[: rng.randrange(len(raw))]
                else:
                    m = pb.ForwardBackwardRequest.FromString(good)
                    m.seq_id = 3000 + i
                    t = m.data[0].loss_fn_inputs[rng.choice(["target_tokens", "weights"])]
                    choice = rng.randrange(5)
                    if choice == 0:
                        t.dense = t.dense[:-1]
                    elif choice == 1:
                        t.shape[:] = [7]
                    elif choice == 2:
                        t.dtype = rng.choice([0, 4, 9])
                    elif choice == 3:
                        t.dense = np.full(4, np.nan, np.float32).tobytes()
                    else:
                        m.data[0].model_input[0].encoded_text.tokens = np.array([1, 2, 10**6, -4], np.int32).tobytes()
                    m.loss_fn = rng.choice(["cross_entropy", "ppo", "nope", ""])
                    raw = bytearray(m.SerializeToString())
                await _check(s, url, "forward_backward", bytes(raw), "application/x-protobuf")
                answered += 1
            # Still serving everyone: a fresh sample completes.
            _, reply = await _check(s, url, "asample", json.dumps(sample))
            status, result = await _finish(s, url, reply)
            assert status == 200 and isinstance(result, bytes)  # a protobuf SampleResponse
            faults = []
            for rid in ACCEPTED:  # what was accepted ran to a result or a user error, never a server fault
                status, result = await _finish(s, url, {"request_id": rid})
                if isinstance(result, dict) and result.get("category") == "server":
                    faults.append(result["error"])
            assert not faults, faults[:5]
            assert len(ACCEPTED) > 40
            return answered

    answered = asyncio.run(main())
    assert answered >= 12 * 20 + 120


def test_hypothesis_mutated_bodies_of_every_route_get_4xx_and_leave_others_served(url, valid) -> None:
    """Hypothesis picks a JSON route, a field anywhere in its valid body (nested ones
    included) and replaces it with an odd value (huge, negative, fractional, non-finite,
    wrong-typed, nested) or drops it, and sends that beside another client's normal
    sample. The odd request gets a 4xx with one line, or is accepted and ends in a result
    or its own user error, never a 5xx or a server fault; the other client samples every
    time."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    def paths(node, path=()):
        if isinstance(node, dict):
            for k, v in node.items():
                yield path + (k,)
                yield from paths(v, path + (k,))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield path + (i,)
                yield from paths(v, path + (i,))

    where = [(route, p) for route, body in valid.items() for p in paths(body)]
    odd = st.one_of(st.sampled_from(ODD), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                    st.lists(st.one_of(st.integers(-3, 2**40), st.text(max_size=3)), max_size=3),
                    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    seen = {"examples": 0, "4xx": 0, "user": 0, "ok": 0}
    routes = set()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(where), st.one_of(st.just(None), odd), st.booleans())
    def check(at, value, drop):
        route, path = at
        body = copy.deepcopy(valid[route])
        parent = body
        for p in path[:-1]:
            parent = parent[p]
        if drop and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = value

        async def main():
            async with aiohttp.ClientSession() as s:
                normal = asyncio.ensure_future(_check(s, url, "asample", json.dumps(_sample_body())))
                status, reply = await _check(s, url, route, json.dumps(body, allow_nan=True))
                result = reply
                if status == 200 and isinstance(reply, dict) and "request_id" in reply and route != "retrieve_future":
                    status, result = await _finish(s, url, reply)
                n_status, n_reply = await normal
                n_status, n_result = await _finish(s, url, n_reply)
                return status, result, n_status, n_result

        status, result, n_status, n_result = asyncio.run(main())
        seen["examples"] += 1
        routes.add(route)
        assert status < 500, (route, body, result)
        if status >= 400:
            seen["4xx"] += 1
        elif isinstance(result, dict) and result.get("category") is not None:
            assert result["category"] == "user" and "\n" not in result["error"], (route, body, result)
            seen["user"] += 1
        else:
            seen["ok"] += 1
        assert n_status == 200 and isinstance(n_result, bytes), n_result  # the other client sampled

    check()
    print("hypothesis route examples:", seen, "routes:", len(routes))
    assert seen["examples"] >= 60 and seen["4xx"] > 0 and len(routes) >= 8
