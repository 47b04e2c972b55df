"""Tenants of ``skyrl serve``, through the official tinker SDK and raw HTTP: each key (or
``[tenants.NAME]`` group of keys) sees only its own sessions, models, checkpoints, samplers
and futures (another's answer 404, as if they did not exist); a published checkpoint is
readable by all; per-tenant limits on models and requests in flight; all of it kept across
a restart."""

from __future__ import annotations

import json
import sqlite3
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "skyrl/qwen-tiny"
ALICE, BOB1, BOB2, SOLO = "tml-alice", "tml-bob-1", "tml-bob-2", "tml-solo"


def server_toml(folder) -> str:
    return f"""
[server]
api_keys = ["{ALICE}"]
storage = "{folder / 'storage'}"
max_lora_rank = 8
poll_seconds = 5

[tenants.lab]
keys = ["{BOB1}", "{BOB2}"]
max_models = 2

[tenants.solo]
keys = ["{SOLO}"]
max_in_flight = 1

[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "0123456789:abcdef"
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tenants")


@pytest.fixture(scope="module")
def served(folder):
    from skyrl_server.testing import serving

    with serving(folder, server_toml(folder)) as s:
        yield s


def post(url, path, body, key, method="POST"):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 method=method, headers={"Content-Type": "application/json", "X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


def client(served, key):
    return tinker.ServiceClient(base_url=served.url, api_key=key)


@pytest.fixture(scope="module")
def alice(served):
    """Alice's trained model, its saved state and sampler weights, and one of her request ids."""
    c = client(served, ALICE)
    training = c.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    training.forward_backward([datum([1, 2, 3, 4, 5])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("mine").result().path
    sampler_path = training.save_weights_for_sampler("mine").result().path
    status, body = post(served.url, "/api/v1/get_info", {"model_id": training.model_id}, ALICE)
    assert status == 200 and body["model_id"] == training.model_id
    status, fut = post(served.url, "/api/v1/optim_step",
                       {"model_id": training.model_id, "adam_params": {"learning_rate": 0.0}}, ALICE)
    assert status == 200
    yield {"client": c, "training": training, "state": state, "sampler": sampler_path, "request_id": fut["request_id"],
           "model_id": training.model_id, "session_id": training.model_id.split(":")[0]}
    c.close("completed")


def test_another_tenant_gets_404_for_every_thing_of_alices(served, alice) -> None:
    url, mid = served.url, alice["model_id"]
    for key in (BOB1, SOLO):
        for path, body in (
            ("/api/v1/get_info", {"model_id": mid}),
            ("/api/v1/optim_step", {"model_id": mid, "adam_params": {"learning_rate": 1.0}}),
            ("/api/v1/save_weights", {"model_id": mid, "path": "stolen"}),
            ("/api/v1/save_weights_for_sampler", {"model_id": mid, "path": "stolen"}),
            ("/api/v1/unload_model", {"model_id": mid}),
            ("/api/v1/load_weights", {"model_id": mid, "path": alice["state"]}),
            ("/api/v1/retrieve_future", {"request_id": alice["request_id"]}),
            ("/api/v1/session_heartbeat", {"session_id": alice["session_id"]}),
            ("/api/v1/create_model", {"session_id": alice["session_id"], "model_seq_id": 99, "base_model": BASE,
                                      "lora_config": {"rank": 2}}),
            ("/api/v1/create_sampling_session", {"session_id": alice["session_id"], "sampling_session_seq_id": 9,
                                                 "base_model": BASE}),
        ):
            status, body_out = post(url, path, body, key)
            assert status == 404, (key, path, status, body_out)
            assert "unknown" in body_out["error"], body_out
        status, _ = post(url, f"/api/v1/sessions/{alice['session_id']}/finish", {}, key)
        assert status == 404
    # Alice's own calls still work: nothing of hers changed (her model is still loaded and hers).
    status, body = post(url, "/api/v1/get_info", {"model_id": mid}, ALICE)
    assert status == 200 and body["lora_rank"] == 4
    status, body = post(url, "/api/v1/retrieve_future", {"request_id": alice["request_id"]}, ALICE)
    assert status == 200 and "metrics" in body


def test_another_tenant_cannot_sample_from_or_load_alices_checkpoints_until_she_publishes(served, alice) -> None:
    bob = client(served, BOB1)
    prompt = types.ModelInput.from_ints([3, 1, 4])
    params = types.SamplingParams(max_tokens=4, seed=3)
    for attempt in (lambda: bob.create_sampling_client(model_path=alice["sampler"]).result().sample(prompt, 1, params).result(),
                    lambda: bob.create_training_client_from_state(alice["state"]).result()):
        with pytest.raises(Exception, match="unknown checkpoint"):
            attempt()
    status, body = post(served.url, "/api/v1/asample", {"model_path": alice["sampler"], "num_samples": 1,
                        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 1, 4]}]},
                        "sampling_params": {"max_tokens": 2}}, BOB1)
    assert status == 404 and "unknown checkpoint" in body["error"]
    # Bob cannot publish Alice's checkpoint; Alice can, with the SDK's RestClient.
    run, _, ckpt = alice["sampler"][len("tinker://"):].partition("/")
    status, _ = post(served.url, f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish", None, BOB1)
    assert status == 404
    rest_alice = tinker.RestClient(base_url=served.url, api_key=ALICE)
    rest_alice.publish_checkpoint_from_tinker_path(alice["sampler"]).result()
    rest_alice.publish_checkpoint_from_tinker_path(alice["state"]).result()
    # Published: Bob samples what Alice's own sampler samples, and loads her adapters.
    mine = alice["client"].create_sampling_client(model_path=alice["sampler"]).result().sample(prompt, 2, params).result()
    theirs = bob.create_sampling_client(model_path=alice["sampler"]).result().sample(prompt, 2, params).result()
    assert [list(s.tokens) for s in theirs.sequences] == [list(s.tokens) for s in mine.sequences]
    copy = bob.create_training_client_from_state(alice["state"]).result()
    data = [datum([2, 4, 6, 8, 1])]
    lp = [c.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
          for c in (alice["training"], copy)]
    np.testing.assert_array_equal(lp[1], lp[0])
    # The copy is Bob's own model; Alice cannot reach it.
    status, _ = post(served.url, "/api/v1/get_info", {"model_id": copy.model_id}, ALICE)
    assert status == 404
    status, _ = post(served.url, "/api/v1/get_info", {"model_id": copy.model_id}, BOB2)  # same tenant, other key
    assert status == 200
    post(served.url, "/api/v1/unload_model", {"model_id": copy.model_id}, BOB2)
    # Unpublished: private again.
    rest_alice.unpublish_checkpoint_from_tinker_path(alice["state"]).result()
    with pytest.raises(Exception, match="unknown checkpoint"):
        bob.create_training_client_from_state(alice["state"]).result()
    bob.close("completed")


def test_keys_of_one_group_share_a_tenant_and_its_model_limit(served) -> None:
    one, two = client(served, BOB1), client(served, BOB2)
    a = one.create_lora_training_client(base_model=BASE, rank=2, seed=1).result()
    b = two.create_lora_training_client(base_model=BASE, rank=2, seed=2).result()
    # The second key uses the first key's model (same tenant), and the tenant is at max_models = 2.
    status, body = post(served.url, "/api/v1/get_info", {"model_id": a.model_id}, BOB2)
    assert status == 200
    with pytest.raises(Exception, match="max_models"):
        one.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    # Alice's own limit is the server's default: she is not held back by the lab's models.
    alice = client(served, ALICE)
    other = alice.create_lora_training_client(base_model=BASE, rank=2, seed=4).result()
    post(served.url, "/api/v1/unload_model", {"model_id": other.model_id}, ALICE)
    alice.close("completed")
    # Unloading one makes room again.
    status, fut = post(served.url, "/api/v1/unload_model", {"model_id": b.model_id}, BOB1)
    assert status == 200
    for _ in range(20):
        status, body = post(served.url, "/api/v1/retrieve_future", {"request_id": fut["request_id"]}, BOB1)
        if body.get("type") != "try_again":
            break
    assert body.get("type") == "unload_model", body
    c = one.create_lora_training_client(base_model=BASE, rank=2, seed=3).result()
    for m in (a, c):
        post(served.url, "/api/v1/unload_model", {"model_id": m.model_id}, BOB1)
    one.close("completed")
    two.close("completed")


def test_requests_in_flight_past_the_tenants_limit_get_429(served) -> None:
    """The solo tenant may have one unfinished future: with the worker thread held busy, its
    first request stays in flight and the second is answered 429; other tenants are not held."""
    from skyrl_server._app import STATE

    app = served.app[STATE]
    status, body = post(served.url, "/api/v1/create_session", {}, SOLO)
    session = body["session_id"]
    release, started = threading.Event(), threading.Event()
    app.worker.submit(lambda: (started.set(), release.wait(60)))
    try:
        assert started.wait(30)
        create = {"session_id": session, "base_model": BASE, "lora_config": {"rank": 2}}
        status, first = post(served.url, "/api/v1/create_model", {**create, "model_seq_id": 1}, SOLO)
        assert status == 200
        status, body = post(served.url, "/api/v1/create_model", {**create, "model_seq_id": 2}, SOLO)
        assert status == 429 and "max_in_flight" in body["error"]
        status, body = post(served.url, "/api/v1/asample", {"base_model": BASE, "num_samples": 1,
                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                            "sampling_params": {"max_tokens": 1}}, BOB1)
        assert status == 200  # another tenant goes on
    finally:
        release.set()
    for _ in range(20):
        status, body = post(served.url, "/api/v1/retrieve_future", {"request_id": first["request_id"]}, SOLO)
        if body.get("type") != "try_again":
            break
    assert body.get("type") == "create_model", body
    status, _ = post(served.url, "/api/v1/create_model", {**create, "model_seq_id": 2}, SOLO)
    assert status == 200  # the first finished: room again
    assert app.in_flight["solo"] in (0, 1)


def test_ownership_survives_a_restart(folder, served, alice) -> None:
    """A second server on the same database (the first keeps running on its own port, as a
    restarted one would find it): Alice's model, session and futures are hers, Bob's 404."""
    from skyrl_server.testing import serving

    with serving(folder, server_toml(folder)) as again:
        status, _ = post(again.url, "/api/v1/get_info", {"model_id": alice["model_id"]}, ALICE)
        assert status == 200
        for path, body in (("/api/v1/get_info", {"model_id": alice["model_id"]}),
                           ("/api/v1/retrieve_future", {"request_id": alice["request_id"]}),
                           ("/api/v1/load_weights", {"session_id": "x", "model_seq_id": 1, "path": alice["state"]})):
            status, out = post(again.url, path, body, BOB1)
            assert status == 404, (path, out)
        status, body = post(again.url, "/api/v1/retrieve_future", {"request_id": alice["request_id"]}, ALICE)
        assert status == 200 and "metrics" in body
        # The published sampler weights stay published.
        status, body = post(again.url, "/api/v1/asample", {"model_path": alice["sampler"], "num_samples": 1,
                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [3, 1]}]},
                            "sampling_params": {"max_tokens": 1}}, BOB1)
        assert status == 200, body


def test_a_database_from_before_tenants_gets_the_new_columns(tmp_path) -> None:
    """An older server's database (no tenant or public columns) is brought up to date at
    start; its sessions have no tenant, so no key reaches them."""
    from skyrl_server._store import Store

    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    con.executescript("""
        CREATE TABLE sessions (id VARCHAR(64) PRIMARY KEY, created FLOAT NOT NULL, finished BOOLEAN NOT NULL);
        CREATE TABLE futures (request_id VARCHAR(64) PRIMARY KEY, model_id VARCHAR(200), seq_id INTEGER,
                              kind VARCHAR(8) NOT NULL, result BLOB NOT NULL, finished FLOAT NOT NULL);
        CREATE TABLE checkpoints (path VARCHAR(500) PRIMARY KEY, model_id VARCHAR(200) NOT NULL,
                                  kind VARCHAR(32) NOT NULL, created FLOAT NOT NULL);
        INSERT INTO sessions VALUES ('s1', 1.0, 0);
        INSERT INTO checkpoints VALUES ('tinker://s1:train:1/weights/a', 's1:train:1', 'weights', 1.0);
    """)
    con.commit()
    con.close()
    store = Store(f"sqlite:///{db}")
    loaded = store.start(900.0)
    store.close()
    assert loaded.sessions == {"s1": (False, None)}
    assert loaded.checkpoints == {"tinker://s1:train:1/weights/a": ("s1:train:1", False)}


@pytest.mark.parametrize("tables, message", [
    ('[server]\napi_keys = ["tml-a"]\n[tenants.x]\nkeys = ["tml-a"]\n', "a key belongs to one tenant"),
    ('[tenants."bad name"]\nkeys = ["tml-a"]\n', "a tenant's name is 1-64 letters"),
    ('[tenants.key-abc]\nkeys = ["tml-a"]\n', "not starting with 'key-'"),
    ('[tenants.x]\nmax_models = 2\n', "a tenant needs at least one key"),
    ('[tenants.x]\nkeys = ["nope"]\n', "must start with 'tml-'"),
    ('[tenants.x]\nkeys = ["tml-a"]\nmax_in_flight = 0\n', "tenants.x.max_in_flight"),
    ('[tenants.x]\nkeys = ["tml-a"]\n[tenants.y]\nkeys = ["tml-a"]\n', "also listed in tenants.x"),
])
def test_bad_tenant_tables_are_located_user_errors(tmp_path, tables, message) -> None:
    from skyrl_host.errors import UserError
    from skyrl_host.plugins import build_host
    from skyrl_server._config import load_server_file

    path = tmp_path / "server.toml"
    path.write_text(tables + f'[models."{BASE}"]\nfamily = "qwen"\npreset = "tiny"\n')
    with pytest.raises(UserError) as err:
        load_server_file(path, build_host(), environ={})
    assert message in str(err.value), str(err.value)


def test_a_group_without_lone_keys_is_enough_and_lone_keys_are_tenants_of_their_own(tmp_path) -> None:
    from skyrl_host.plugins import build_host
    from skyrl_server._config import key_tenant, load_server_file

    path = tmp_path / "server.toml"
    path.write_text(f'[server]\napi_keys = ["tml-a", "tml-b"]\n[tenants.g]\nkeys = ["tml-c"]\nmax_models = 3\n'
                    f'[models."{BASE}"]\nfamily = "qwen"\npreset = "tiny"\n')
    spec = load_server_file(path, build_host(), environ={})
    assert spec.tenants.of_key == {"tml-a": key_tenant("tml-a"), "tml-b": key_tenant("tml-b"), "tml-c": "g"}
    assert key_tenant("tml-a") != key_tenant("tml-b") and "tml-a" not in key_tenant("tml-a")
    assert spec.tenant_limits("g") == (3, 1024) and spec.tenant_limits(key_tenant("tml-a")) == (32, 1024)
    assert spec.api_keys == {"tml-a", "tml-b", "tml-c"}
