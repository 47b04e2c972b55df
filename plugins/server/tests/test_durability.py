"""``skyrl serve`` killed with SIGKILL and started again on the same files: sessions,
models (adapters and optimizer), finished training futures and seq_id order survive;
the official SDK's clients go on. One subprocess server, killed once, on the tiny preset,
with its training state in SQLite (the default) and in a real PostgreSQL server."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

import numpy as np
import pytest
import sqlalchemy as sa

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

BASE = "skyrl/qwen-tiny"
KEY = "tml-durable"
ADAM = types.AdamParams(learning_rate=5e-3)


def _datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                       "weights": np.ones(len(tokens) - 1, dtype=np.float32)})


DATA = [_datum([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])]


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-API-Key": KEY})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
            return r.status, body if "protobuf" in r.headers.get("Content-Type", "") else json.loads(body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _start(path, port):
    proc = subprocess.Popen([sys.executable, "-c", "from skyrl_host.cli import entry; entry()", "serve", str(path),
                             "--port", str(port)], stderr=subprocess.PIPE, text=True)
    seen = []
    while not any(f"on http://127.0.0.1:{port}" in line for line in seen):  # printed once it listens
        line = proc.stderr.readline()
        if not line:
            proc.wait(10)
            raise AssertionError("".join(seen))
        seen.append(line)
    return proc


def _loss(client):
    return client.forward(DATA, "cross_entropy").result().metrics["loss:sum"]


def _train(client, steps):
    for _ in range(steps):
        client.forward_backward(DATA, "cross_entropy").result()
        client.optim_step(ADAM).result()


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    """(the ``[server] database`` line, an SQLAlchemy engine on the same database): the
    default SQLite file in the storage root, or a PostgreSQL server of its own (pgserver:
    PostgreSQL 16's binaries in a wheel; its socket in a short folder under /tmp)."""
    if request.param == "sqlite":
        engine = sa.create_engine(f"sqlite:///{tmp_path / 'storage' / 'tinker-state.sqlite'}")
        yield "", engine
        engine.dispose()
        return
    import pgserver

    folder = tempfile.mkdtemp(prefix="pg")
    server = pgserver.get_server(folder, cleanup_mode="stop")
    url = server.get_uri().replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sa.create_engine(url)
    try:
        yield f'database = "{url}"\n', engine
    finally:
        engine.dispose()
        server.cleanup()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_sigkilled_server_comes_back_with_its_models_futures_and_order(tmp_path, database) -> None:
    line, db_engine = database
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    path = tmp_path / "server.toml"
    path.write_text(f"""[server]
api_keys = ["{KEY}"]
storage = "{tmp_path / 'storage'}"
max_lora_rank = 4
order_wait_seconds = 30
{line}
[models."{BASE}"]
family = "qwen"
preset = "tiny"
alphabet = "0123456789"
""")
    proc = _start(path, port)
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        client = service.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
        _train(client, 2)
        checkpoint = client.save_state("two").result().path
        before = _loss(client)
        client.forward_backward(DATA, "cross_entropy").result()  # acknowledged gradients, no step yet
        # A model driven over HTTP: seq_id 1 finishes; seq_id 3 waits for 2 (never sent) when the server dies.
        _, session = _post(url, "/api/v1/create_session", {"tags": [], "sdk_version": "test"})
        raw = session["session_id"] + ":train:0"
        status, made = _post(url, "/api/v1/create_model", {"session_id": session["session_id"], "model_seq_id": 0,
                                                           "base_model": BASE, "lora_config": {"rank": 2}})
        assert status == 200 and _post(url, "/api/v1/retrieve_future", made)[1]["model_id"] == raw
        _, one = _post(url, "/api/v1/optim_step", {"model_id": raw, "seq_id": 1, "optim_params": {"learning_rate": 0.1}})
        status, one_result = _post(url, "/api/v1/retrieve_future", {"request_id": one["request_id"]})
        assert status == 200 and one_result["metrics"]["grad_norm:mean"] == 0.0
        _, three = _post(url, "/api/v1/optim_step", {"model_id": raw, "seq_id": 3, "optim_params": {"learning_rate": 0.1}})
        # A sampling request: answered, and never written to the database.
        _, sample = _post(url, "/api/v1/asample", {"base_model": BASE, "prompt": {"chunks": [{"tokens": [1, 2]}]},
                                                   "sampling_params": {"max_tokens": 2, "seed": 1}})
        status, sampled = _post(url, "/api/v1/retrieve_future", {"request_id": sample["request_id"]})
        assert status == 200 and isinstance(sampled, bytes) and len(sampled) > 0  # a protobuf SampleResponse
        with db_engine.connect() as db:
            stored = {r[0] for r in db.execute(sa.text("SELECT request_id FROM futures"))}
        assert one["request_id"] in stored and made["request_id"] in stored
        assert sample["request_id"] not in stored and three["request_id"] not in stored

        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        folder = tmp_path / "storage" / "_durable" / client.model_id.replace(":", "_")
        (kept,) = folder.iterdir()  # the state of the last acknowledged optim_step, nothing else
        (folder / ".tmp-torn").write_bytes(b"\x00" * 100)  # a write the kill cut short
        (folder / "9-stale.pt").write_bytes(b"not a state")  # a state written but never committed
        proc = _start(path, port)
        assert list(folder.iterdir()) == [kept]

        # (c) a request finished before the crash is still there, and a retry of it is answered once.
        assert _post(url, "/api/v1/retrieve_future", {"request_id": one["request_id"]}) == (200, one_result)
        status, again = _post(url, "/api/v1/optim_step", {"model_id": raw, "seq_id": 1, "optim_params": {"learning_rate": 0.1}})
        assert status == 200 and again["request_id"] == one["request_id"]
        # One that had not finished did not happen: a clear error, and sending it again runs it (after seq_id 2).
        status, lost = _post(url, "/api/v1/retrieve_future", {"request_id": three["request_id"]})
        assert status == 200 and lost["category"] == "server" and "send it again" in lost["error"]
        status, lost_sample = _post(url, "/api/v1/retrieve_future", {"request_id": sample["request_id"]})
        assert status == 200 and "is not kept: a sampling request" in lost_sample["error"]
        for seq in (2, 3):
            _, sent = _post(url, "/api/v1/optim_step", {"model_id": raw, "seq_id": seq, "optim_params": {"learning_rate": 0.1}})
            assert sent["request_id"] != three["request_id"]
            assert "metrics" in _post(url, "/api/v1/retrieve_future", sent)[1]

        # (a) the same SDK client goes on: its weights are the pre-crash ones; the lost
        # gradients fail the next step (it never steps without them), then it trains on.
        assert _loss(client) == before
        with pytest.raises(tinker.RequestFailedError, match="lost in a server restart"):
            client.optim_step(ADAM).result()
        _train(client, 1)
        after = _loss(client)
        reference = service.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
        _train(reference, 3)  # the same three steps, never interrupted
        assert after == pytest.approx(_loss(reference), abs=1e-6) and after < before - 0.05
        # (b) the checkpoint saved before the crash resumes with its optimizer state.
        resumed = service.create_training_client_from_state_with_optimizer(checkpoint).result()
        assert _loss(resumed) == before
        _train(resumed, 1)
        assert _loss(resumed) == pytest.approx(after, abs=1e-6)
        # A state that cannot be written fails its step and leaves the model as it was stored.
        _, made = _post(url, "/api/v1/create_model", {"session_id": session["session_id"], "model_seq_id": 1,
                                                      "base_model": BASE, "lora_config": {"rank": 2}})
        other = _post(url, "/api/v1/retrieve_future", made)[1]["model_id"]
        blocked = tmp_path / "storage" / "_durable" / other.replace(":", "_")
        blocked.write_text("a file where the model's folder goes")
        _, sent = _post(url, "/api/v1/optim_step", {"model_id": other, "seq_id": 1, "optim_params": {"learning_rate": 0.1}})
        failed = _post(url, "/api/v1/retrieve_future", sent)[1]
        assert failed["category"] == "server" and "metrics" not in failed
        blocked.unlink()
        _, sent = _post(url, "/api/v1/optim_step", {"model_id": other, "seq_id": 2, "optim_params": {"learning_rate": 0.1}})
        assert "metrics" in _post(url, "/api/v1/retrieve_future", sent)[1]
        with db_engine.connect() as db:
            assert db.execute(sa.text("SELECT COUNT(*) FROM futures WHERE request_id = :r"),
                              {"r": sample["request_id"]}).scalar() == 0
            steps = {r[0]: r[1] for r in db.execute(sa.text("SELECT id, steps FROM models"))}
        assert steps[client.model_id] == 3 and steps[resumed.model_id] == 3 and steps[raw] == 3
        assert steps[other] == 1  # the failed step was undone in memory too (else 2)
        service.close("completed")
    finally:
        proc.kill()
        proc.wait()


def test_a_bad_database_url_is_located_and_old_futures_are_deleted(tmp_path) -> None:
    from skyrl_host.cli import main
    from skyrl_host.errors import UserError
    from skyrl_host.plugins import build_host
    from skyrl_server._config import load_server_file
    from skyrl_server._store import Record, Store

    host = build_host()
    path = tmp_path / "server.toml"
    text = f'[server]\napi_keys = ["{KEY}"]\ndatabase = "DB"\n\n[models."{BASE}"]\nfamily = "qwen"\npreset = "tiny"\n'
    for url, message in (("nosuch://x", "Can't load plugin"), ("mysql+nodriver://h/db", "mysql.nodriver")):
        path.write_text(text.replace("DB", url))
        with pytest.raises(UserError, match=message) as exc:
            load_server_file(path, host, environ={})
        assert f"{path}:3: server.database" in str(exc.value)
    assert main(["serve", str(path)], host=host) == 2
    path.write_text(text.replace("DB", "state/train.sqlite"))
    assert load_server_file(path, host, environ={}).database == f"sqlite:///{tmp_path / 'state' / 'train.sqlite'}"

    store = Store(f"sqlite:///{tmp_path / 'keep.sqlite'}")
    for i in range(3):
        store.record(Record(f"r{i}", None, None, "json", {"i": i}))
    assert [f["value"] for f in store.start(keep_seconds=60).futures] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert store.forget(before=0.0) == 0
    assert store.start(keep_seconds=-1.0).futures == []  # all older than "keep -1 s": deleted at start
    store.close()


def test_a_stored_model_that_no_longer_fits_its_base_is_kept_but_not_served(tmp_path, caplog) -> None:
    """The server file now builds the base differently (another alphabet: another vocabulary):
    the server starts, serves the rest, logs why that model is not restored and keeps its state."""
    import asyncio
    import logging

    from aiohttp.test_utils import TestClient, TestServer

    from skyrl_host.plugins import build_host
    from skyrl_server._app import STATE, build
    from skyrl_server._config import load_server_file

    host = build_host()
    path = tmp_path / "server.toml"

    def spec(alphabet):
        path.write_text(f'[server]\napi_keys = ["{KEY}"]\nstorage = "{tmp_path / "storage"}"\n\n'
                        f'[models."{BASE}"]\nfamily = "qwen"\npreset = "tiny"\nalphabet = "{alphabet}"\n')
        return load_server_file(path, host, environ={})

    async def train(app):
        async with TestClient(TestServer(app, skip_url_asserts=True)) as client:
            headers = {"X-API-Key": KEY}
            session = await (await client.post("/api/v1/create_session", json={}, headers=headers)).json()
            made = await (await client.post("/api/v1/create_model", headers=headers, json={
                "session_id": session["session_id"], "model_seq_id": 0, "base_model": BASE,
                "lora_config": {"rank": 2}})).json()
            await client.post("/api/v1/retrieve_future", json={"request_id": made["request_id"]}, headers=headers)
            step = await (await client.post("/api/v1/optim_step", headers=headers, json={
                "model_id": made["model_id"], "seq_id": 1, "optim_params": {"learning_rate": 0.1}})).json()
            done = await (await client.post("/api/v1/retrieve_future", json=step, headers=headers)).json()
            assert "metrics" in done
            return made["model_id"]

    first = build(spec("0123"), host)
    model_id = asyncio.run(train(first))
    first[STATE].store.close()
    with caplog.at_level(logging.WARNING, logger="skyrl.serve"):
        second = build(spec("0123456789abc"), host)  # another vocabulary: the unembedding adapter's shape differs
    assert model_id not in second[STATE].service.models
    assert any(model_id in r.getMessage() and "not restored" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "storage" / "_durable" / model_id.replace(":", "_")).iterdir())  # its state is kept
    second[STATE].store.close()
