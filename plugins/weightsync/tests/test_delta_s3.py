"""delta over a real S3 API: moto's server on 127.0.0.1, started and stopped by the tests,
reached through s3fs exactly as a bucket on AWS would be."""

from __future__ import annotations

import os
import time

import pytest
import torch

from skyrl_weightsync._delta.receiver import DeltaReceiver
from skyrl_weightsync._delta.sender import DeltaSender
from skyrl_weightsync._delta.store import DeltaError


@pytest.fixture
def bucket(skyrl_s3_server):
    import s3fs

    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": skyrl_s3_server}}
    fs = s3fs.S3FileSystem(**options)
    name = f"run-{os.getpid()}-{time.monotonic_ns()}"
    fs.mkdir(name)
    yield f"s3://{name}/weights", options
    fs.rm(name, recursive=True)


def test_versions_over_s3(bucket) -> None:
    uri, options = bucket
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(300, 200, generator=g), "b": torch.randn(50, generator=g)}
    sender = DeltaSender(uri, storage_options=options, keyframe_every=0)
    receiver = DeltaReceiver(uri, storage_options=options)

    class Engine:
        weight_version = 0

        def update_weights(self, named, version):
            self.weights, self.weight_version = {k: v.clone() for k, v in named}, version

    engine = Engine()
    sender.publish(1, w.items())
    for v in (2, 3):
        w["a"].view(-1)[torch.randint(0, 60000, (600,), generator=g)] += 0.01
        stats = sender.publish(v, w.items())
        assert stats["sync_bytes"] < 0.02 * stats["sync_full_bytes"]
    receiver.sync(engine)
    assert engine.weight_version == 3
    assert all(torch.equal(engine.weights[k], w[k].bfloat16()) for k in w)
    # A corrupted object on S3 is caught like a file's.
    w["b"] += 1
    sender.publish(4, w.items())
    path = f"{uri.removeprefix('s3://')}/e000/v00000004/pack0000.zst"  # b's small payload went in the pack
    data = bytearray(sender.store.fs.cat_file(path))
    data[-1] ^= 1
    sender.store.fs.pipe_file(path, bytes(data))
    with pytest.raises(DeltaError, match=rf"version 4: payload {uri}/e000/v00000004/pack0000\.zst bytes 0-{len(data)} "
                                         r"\(tensor 'b'\) fails its checksum"):
        receiver.sync(engine)
    assert engine.weight_version == 3


def test_big_tensors_go_as_parts_of_one_put_each(bucket, monkeypatch) -> None:
    """A tensor above PART_BYTES is sent as parts, each its own object: no object reaches the
    size at which s3fs switches to a multipart upload (whose completion moto cannot finish
    within s3fs's 15 s read timeout at 1 GiB, and which a retry cannot redo). Only the parts
    a step changed are written; a corrupted part is caught and names its file."""
    import json

    import zstandard

    from skyrl_weightsync._delta import sender as sender_module
    from skyrl_weightsync._delta import store

    # The real part size: even incompressible bytes, or the densest sparse payload, stay one PUT.
    one_put = 2 * 50 * 2**20  # s3fs's _pipe_file: below 2 x its 50 MiB chunk, a single put_object
    worst = len(zstandard.ZstdCompressor(level=1, threads=2).compress(os.urandom(store.PART_BYTES)))
    assert worst < one_put and 8 + 6 * (store.PART_BYTES // 2) * 0.2 < one_put

    monkeypatch.setattr(store, "PART_BYTES", 16 << 10)  # 16 KiB parts: "a" (120,000 bf16 bytes) in 8
    monkeypatch.setattr(sender_module, "PACK_BELOW", 0)  # (parts this small would share a pack object)
    uri, options = bucket
    g = torch.Generator().manual_seed(1)
    w = {"a": torch.randn(300, 200, generator=g), "b": torch.randn(50, generator=g)}
    sender = DeltaSender(uri, storage_options=options, keyframe_every=0)
    receiver = DeltaReceiver(uri, storage_options=options)

    class Engine:
        weight_version = 0

        def update_weights(self, named, version):
            self.weights, self.weight_version = {k: v.clone() for k, v in named}, version

    engine = Engine()
    sender.publish(1, w.items())
    root = uri.removeprefix("s3://")
    fs = sender.store.fs
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{root}/e000/v00000001")) == [
        "manifest.json", *[f"t00000.p{k:04d}.zst" for k in range(8)], "t00001.zst"]
    receiver.sync(engine)
    assert all(torch.equal(engine.weights[k], w[k].bfloat16()) for k in w)
    # Change elements in parts 2 and 5 only (8192 bf16 elements a part): two part objects.
    w["a"].view(-1)[[2 * 8192 + 7, 2 * 8192 + 900, 5 * 8192 + 3]] += 0.5
    stats = sender.publish(2, w.items())
    assert stats["sync_changed_words"] == 3 and stats["sync_words"] == 60050
    entry = json.loads(fs.cat_file(f"{root}/e000/v00000002/manifest.json"))["tensors"][0]
    assert entry["encoding"] == "parts"
    assert [p["encoding"] for p in entry["parts"]] == ["unchanged"] * 2 + ["sparse_xor"] + ["unchanged"] * 2 + [
        "sparse_xor"] + ["unchanged"] * 2
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{root}/e000/v00000002")) == [
        "manifest.json", "t00000.p0002.zst", "t00000.p0005.zst"]
    receiver.sync(engine)
    assert engine.weight_version == 2 and all(torch.equal(engine.weights[k], w[k].bfloat16()) for k in w)
    # A flipped byte in one part: the version is refused, naming that part; the engine keeps version 2.
    v2 = engine.weights["a"].clone()
    w["a"].view(-1)[[5 * 8192 + 10, 7 * 8192]] -= 0.25
    sender.publish(3, w.items())
    path = f"{root}/e000/v00000003/t00000.p0007.zst"
    data = bytearray(fs.cat_file(path))
    data[-1] ^= 1
    fs.pipe_file(path, bytes(data))
    with pytest.raises(DeltaError, match=rf"version 3: payload {uri}/e000/v00000003/t00000\.p0007\.zst "
                                         r"\(tensor 'a'\) fails its checksum"):
        receiver.sync(engine)
    assert engine.weight_version == 2 and torch.equal(engine.weights["a"], v2)
    fs.pipe_file(path, bytes(data[:-1] + bytes([data[-1] ^ 1])))  # repaired: version 3 applies exactly
    receiver.sync(engine)
    assert engine.weight_version == 3 and all(torch.equal(engine.weights[k], w[k].bfloat16()) for k in w)
