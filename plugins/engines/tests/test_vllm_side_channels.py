"""What the vllm engine makes of vLLM's side channels and of its servers' ranks (no server
needed: the routes and masks a CUDA vLLM returns cannot come from the CPU build, so these
check the decoding against vLLM's documented encoding; benchmarks/device/vllm_gpu_check.sh
runs them against real servers on a GPU)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from skyrl_engines._vllm_engine import VllmEngine, _tensor_parallel, routes_from_choice, support_from_choice
from skyrl_engines.vllm import VllmConfig


def encoded(arr: np.ndarray) -> str:
    """How vLLM 0.33 returns ``routed_experts`` per choice: base64 of ``np.save`` bytes."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue()).decode()


def test_routes_keep_the_moe_layers_and_leave_the_last_token_free() -> None:
    # a 4-layer model whose layers 1 and 3 are MoE (0 and 2 dense: vLLM returns a column for every layer)
    rng = np.random.default_rng(0)
    prompt, gen = 5, 3
    arr = rng.integers(0, 64, size=(prompt + gen - 1, 4, 2)).astype(np.uint8)
    rows = routes_from_choice(encoded(arr), prompt, gen, [1, 3], "prompt 0 sample 0")
    assert rows.shape == (prompt + gen, 2, 2) and rows.dtype == np.uint8
    assert np.array_equal(rows[:-1], arr[:, [1, 3]])  # every token the model ran, in order
    assert not rows[-1].any()  # the last generated token never ran: routed freely by replay
    wide = rng.integers(0, 384, size=(prompt + gen - 1, 4, 8)).astype(np.uint16)  # Kimi K2: 384 experts
    assert routes_from_choice(encoded(wide), prompt, gen, [1, 3], "x").dtype == np.uint16


def test_routes_that_do_not_fit_name_the_sequence() -> None:
    arr = np.zeros((6, 4, 2), dtype=np.uint8)
    with pytest.raises(RuntimeError, match=r"shape \[6, 4, 2\] for prompt 2 sample 1; expected \[7, layers > 3"):
        routes_from_choice(encoded(arr), 5, 3, [1, 3], "prompt 2 sample 1")
    with pytest.raises(RuntimeError, match="no routed experts for prompt 0 sample 0: .*--enable-return-routed-experts"):
        routes_from_choice(None, 5, 3, [1, 3], "prompt 0 sample 0")


def test_sampling_masks_become_one_row_per_generated_token() -> None:
    mask = [[3, 7, 9], [4], [1, 2, 3, 4]]
    assert support_from_choice(mask, 3, "x") == mask
    with pytest.raises(RuntimeError, match="2 sampling-mask rows for prompt 1 sample 0, which generated 3 tokens"):
        support_from_choice(mask[:2], 3, "prompt 1 sample 0")
    with pytest.raises(RuntimeError, match="no sampling mask .*--return-sampling-mask"):
        support_from_choice(None, 3, "x")


def test_collective_recipes_give_each_servers_workers_their_ranks() -> None:
    """A broadcast group's members: the trainer (0), then each server's workers; a server
    with tensor parallelism 2 holds two ranks, so the next server starts two further on."""
    assert _tensor_parallel(["--max-num-seqs", "8"]) == 1
    assert _tensor_parallel(["--tensor-parallel-size", "2"]) == _tensor_parallel(["-tp=2"]) == 2
    engine = VllmEngine(VllmConfig(server_args=("--tensor-parallel-size", "2")))
    engine.urls = ["http://a", "http://b", "http://c"]
    assert engine.worker_ranks() == 6
    recipe = {"receiver": "broadcast", "kwargs": {}, "group": {"address": "tcp://h:1", "rank": 1, "world": 7, "backend": "nccl"}}
    assert [engine._recipe_for(recipe, i)["group"]["rank"] for i in range(3)] == [1, 3, 5]
    assert recipe["group"]["rank"] == 1  # the caller's recipe is left as it was
    plain = {"receiver": "delta", "kwargs": {"uri": "file:///w"}}
    assert engine._recipe_for(plain, 2) == plain


def test_what_vllm_needs_of_a_sampler_whose_kept_sets_it_returns() -> None:
    from skyrl_engines.vllm import support_problems
    from skyrl_samplers.greedy import build_greedy, GreedyConfig
    from skyrl_samplers.top_p import TopPConfig, build_sampler

    def declared(config):  # what the sampler declares (its traits), as the job's choice would give them
        return build_sampler(config).traits

    assert support_problems(declared(TopPConfig(top_p=0.9, top_k=50, return_support=True))) == []
    [(key, why)] = support_problems(declared(TopPConfig(top_p=0.9, return_support=True)))
    assert key == "sampler.top_k" and "top_k > 0" in why
    [(key, why)] = support_problems(build_greedy(GreedyConfig(return_support=True)).traits)
    assert key == "sampler.return_support" and "temperature above 0" in why


def test_a_recipe_builds_only_a_registered_receiver(tmp_path) -> None:
    """Recipes name receivers of the skyrl.receivers group; an importable path, an unknown
    name or the old factory form is refused before anything is imported or called."""
    from skyrl_engines.vllm_worker import build_receiver, registered_receivers
    from skyrl_weightsync.delta import DeltaReceiver

    assert {"delta", "broadcast", "nixl"} <= set(registered_receivers())
    built = build_receiver({"receiver": "delta", "kwargs": {"uri": (tmp_path / "store").as_uri()}})
    assert isinstance(built, DeltaReceiver)
    marker = tmp_path / "ran"
    for recipe in ({"receiver": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}},
                   {"factory": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}},
                   {"receiver": "os.system", "kwargs": {"command": f"touch {marker}"}},
                   {"receiver": ["delta"]}):
        with pytest.raises(ValueError, match="bad receiver recipe"):
            build_receiver(recipe)
    assert not marker.exists()


def test_the_job_token_middleware_lets_only_the_job_in(monkeypatch) -> None:
    import asyncio

    from skyrl_engines.vllm_worker import TOKEN_ENV, JobTokenMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(mw, path, auth=None, method="POST"):
        sent = []

        async def send(msg):
            sent.append(msg)

        headers = [(b"authorization", auth.encode())] if auth is not None else []
        asyncio.run(mw({"type": "http", "path": path, "method": method, "headers": headers}, None, send))
        return sent[0]["status"]

    monkeypatch.setenv(TOKEN_ENV, "s3cret-token")
    mw = JobTokenMiddleware(app)
    assert call(mw, "/update_weights", "Bearer s3cret-token") == 200
    for auth in (None, "Bearer wrong", "Bearer s3cret-toke", "s3cret-token", "Basic s3cret-token"):
        assert call(mw, "/update_weights", auth) == 401
        assert call(mw, "/v1/models", auth, "GET") == 401
    assert call(mw, "/health", None, "GET") == 200  # readiness stays open
    assert call(mw, "/health", None, "POST") == 401
    monkeypatch.delenv(TOKEN_ENV)
    closed = JobTokenMiddleware(app)  # no token given: nothing but /health
    assert call(closed, "/update_weights", "Bearer ") == 401 and call(closed, "/health", None, "GET") == 200
