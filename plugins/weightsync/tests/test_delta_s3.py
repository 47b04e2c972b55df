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
    path = f"{uri.removeprefix('s3://')}/e000/v00000004/t00001.zst"
    data = bytearray(sender.store.fs.cat_file(path))
    data[-1] ^= 1
    sender.store.fs.pipe_file(path, bytes(data))
    with pytest.raises(DeltaError, match=rf"version 4: payload {uri}/e000/v00000004/t00001\.zst \(tensor 'b'\) fails its checksum"):
        receiver.sync(engine)
    assert engine.weight_version == 3
