"""Requests a careless or hostile key holder sends (SECURITY.md): each is answered by
itself with a 4xx and one line, and every other client's requests finish as if it had
not been sent. Each case failed on 82d5798 (issue 35: a top_k of 1e21 failed the shared
decode batch for everyone; a 30 KB zstd body inflated to gigabytes on the event loop;
JSON nested 100k deep answered 500; a seq_id of 2**70 stranded its model). A request refused
after its route accepted it gets a future holding a user error, as the Tinker API reports them."""

from __future__ import annotations

import asyncio
import json

import pytest
import zstandard

aiohttp = pytest.importorskip("aiohttp")

BASE = "skyrl/qwen-tiny"
KEY = "tml-hostile-key"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("hostile")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 4
poll_seconds = 2
order_wait_seconds = 0.2
max_json_bytes = 65536
max_body_bytes = 1048576

[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "0123456789:"
""") as served:
        yield f"{served.url}/api/v1"


async def post(s, url, route, data, headers=None):
    body = data if isinstance(data, (bytes, str)) else json.dumps(data)
    async with s.post(f"{url}/{route}", data=body, headers={"Content-Type": "application/json", "X-API-Key": KEY,
                                                             **(headers or {})}) as r:
        raw = await r.read()
        value = json.loads(raw) if r.content_type == "application/json" else raw
        return r.status, value


async def result(s, url, reply):
    for _ in range(200):
        status, value = await post(s, url, "retrieve_future", {"request_id": reply["request_id"]})
        if not (isinstance(value, dict) and value.get("type") == "try_again"):
            return status, value
    raise AssertionError("no result")


def sample(**params):
    return {"base_model": BASE, "num_samples": 2, "prompt": PROMPT,
            "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 1, **params}}


def test_odd_sampling_numbers_fail_alone_and_the_batch_goes_on(url) -> None:
    async def main():
        async with aiohttp.ClientSession() as s:
            normal = [await post(s, url, "asample", sample(seed=i)) for i in range(6)]
            odd = {
                "top_k 1e21": sample(top_k=10**21),       # past int64: refused at the route
                "top_k past the vocabulary": sample(top_k=2**40),  # keeps every token: served as top_k off
                "seed 2**70": sample(seed=2**70),
                "negative seed": sample(seed=-5),
                "NaN temperature": json.dumps(sample()).replace('"temperature": 1.0', '"temperature": NaN'),
                "inf top_p": json.dumps(sample()).replace('"temperature": 1.0', '"top_p": Infinity'),
                "max_tokens 2**62": sample(max_tokens=2**62),
            }
            answers = {name: await post(s, url, "asample", body) for name, body in odd.items()}
            more = [await post(s, url, "asample", sample(seed=10 + i)) for i in range(6)]
            outcomes = {}
            for name, (status, value) in answers.items():
                if status == 200:
                    status, value = await result(s, url, value)
                outcomes[name] = (status, value if isinstance(value, dict) else "result")
            finished = [await result(s, url, v) for st, v in normal + more if st == 200]
            return normal + more, finished, outcomes

    sent, finished, outcomes = asyncio.run(main())
    assert all(st == 200 for st, _ in sent) and len(finished) == 12
    assert all(st == 200 and isinstance(v, bytes) for st, v in finished)  # every other request sampled
    assert outcomes["top_k past the vocabulary"] == (200, "result")
    for name in ("top_k 1e21", "seed 2**70", "negative seed", "NaN temperature", "inf top_p", "max_tokens 2**62"):
        status, value = outcomes[name]  # refused at the route (4xx), or its own future holds a user error
        assert (400 <= status < 500 or value.get("category") == "user") and "\n" not in value["error"], (name, value)
    assert "does not fit a 64-bit integer" in outcomes["top_k 1e21"][1]["error"]
    assert "seed: 1180591620717411303424 does not fit a 64-bit integer" in outcomes["seed 2**70"][1]["error"]
    assert "seed must be in [0, 2**63), found -5" in outcomes["negative seed"][1]["error"]


def test_big_bombed_and_deep_bodies_are_refused_without_stalling_others(url) -> None:
    async def main():
        async with aiohttp.ClientSession() as s:
            deep = "[" * 30_000 + "]" * 30_000  # under max_json_bytes, far deeper than Python's parser recurses
            big = json.dumps({"tags": ["x" * 70_000], "sdk_version": "0.38.0"})
            bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))  # 64 MiB of zeros in ~2 KB
            answers = {
                "deep JSON": await post(s, url, "create_session", deep),
                "JSON over max_json_bytes": await post(s, url, "create_session", big),
                "zstd bomb": await post(s, url, "forward_backward", bomb,
                                        {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}),
                "gzip": await post(s, url, "forward_backward", b"x",
                                   {"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"}),
            }
            fine = await post(s, url, "create_session", {"tags": [], "sdk_version": "0.38.0"})
            return answers, fine, len(bomb)

    answers, fine, bomb_bytes = asyncio.run(main())
    assert bomb_bytes < 10_000
    assert answers["deep JSON"][0] == 400 and "nested too deep" in answers["deep JSON"][1]["error"]
    assert answers["JSON over max_json_bytes"][0] == 413
    assert answers["zstd bomb"][0] == 413 and "inflates" in answers["zstd bomb"][1]["error"]
    assert answers["gzip"][0] == 415
    assert fine[0] == 200


def test_a_seq_id_leap_is_refused_and_the_model_keeps_serving(url) -> None:
    async def main():
        async with aiohttp.ClientSession() as s:
            _, created = await post(s, url, "create_session", {"tags": [], "sdk_version": "0.38.0"})
            lora = {"session_id": created["session_id"], "model_seq_id": 0, "base_model": BASE,
                    "lora_config": {"rank": 2, "seed": 1}}
            _, fut = await post(s, url, "create_model", lora)
            await result(s, url, fut)
            mid = fut["model_id"]
            adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
            huge = await post(s, url, "optim_step", {"model_id": mid, "seq_id": 2**70, "adam_params": adam})
            leap = await post(s, url, "optim_step", {"model_id": mid, "seq_id": 2**62, "adam_params": adam})
            ok = await post(s, url, "optim_step", {"model_id": mid, "seq_id": 1, "adam_params": adam})
            done = await result(s, url, ok[1])
            return huge, leap, done

    huge, leap, done = asyncio.run(main())
    assert huge[0] == 400 and "does not fit a 64-bit integer" in huge[1]["error"]
    assert leap[0] == 400 and "past the last one" in leap[1]["error"]
    assert done[0] == 200 and done[1].get("type") != "try_again" and "error" not in done[1], done


def test_hypothesis_generated_sampling_requests_get_4xx_or_their_own_user_error(url) -> None:
    """Hypothesis writes asample bodies: every sampling parameter, the sample count, the
    prompt's tokens and the top-k fields drawn from huge, negative, fractional, non-finite,
    wrong-typed and missing values. Each is sent beside a normal request of another client:
    the odd one gets a 4xx at its route or a future holding its own user error, never a 5xx
    or a server fault, and the normal one samples every time."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    odd = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 10**21]),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                    st.lists(st.integers(-3, 40), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    fields = st.fixed_dictionaries({}, optional={
        "max_tokens": odd, "temperature": odd, "top_k": odd, "top_p": odd, "seed": odd, "stop": odd})
    body = st.fixed_dictionaries({"sampling_params": fields}, optional={
        "num_samples": odd, "prompt_logprobs": odd, "topk_sample_logprobs": odd, "topk_prompt_logprobs": odd,
        "prompt_logprobs_last_n": odd,
        "tokens": st.one_of(odd, st.lists(st.integers(-(2**70), 2**70), max_size=4))})
    seen = {"examples": 0, "4xx": 0, "user": 0, "ok": 0}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body)
    def check(b):
        request = {"base_model": BASE, "prompt": {"chunks": [{"type": "encoded_text",
                                                               "tokens": b.pop("tokens", [1, 2, 3])}]}, **b}
        text = json.dumps(request, allow_nan=True)  # NaN / Infinity literals as a careless client writes them

        async def main():
            async with aiohttp.ClientSession() as s:
                normal = asyncio.ensure_future(post(s, url, "asample", sample(seed=5)))
                status, value = await post(s, url, "asample", text)
                if status == 200:
                    status, value = await result(s, url, value)
                n_status, n_value = await normal
                assert n_status == 200
                n_status, n_value = await result(s, url, n_value)
                return status, value, n_status, n_value

        status, value, n_status, n_value = asyncio.run(main())
        seen["examples"] += 1
        assert status < 500, (request, value)
        if isinstance(value, dict):
            assert "\n" not in value["error"] and (status >= 400 or value.get("category") == "user"), (request, value)
            seen["4xx" if status >= 400 else "user"] += 1
        else:
            seen["ok"] += 1
        assert n_status == 200 and isinstance(n_value, bytes), n_value  # the other client sampled

    check()
    print("hypothesis asample examples:", seen)
    assert seen["examples"] >= 40 and seen["4xx"] > 0
