"""A delta ``uri`` on S3 that cannot be used (no credentials, wrong credentials, a missing
bucket, an endpoint that does not answer): ``skyrl run`` says so in one line naming the URL
and the fix (exit code 2), within seconds, before training, and leaves no version behind.
Against moto's real S3 server on 127.0.0.1 (``skyrl_s3_server``) and a closed local port."""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from typing import Any, Iterator

import pytest
import torch

from skyrl_host.errors import USER_ERROR_EXIT_CODE, UserError
from skyrl_weightsync._delta.receiver import DeltaReceiver
from skyrl_weightsync._delta.sender import DeltaSender

FAST = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}  # an unreachable endpoint fails fast
CREDENTIALS = {"key": "testing", "secret": "testing"}
ENV_FIX = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"
DENIED_FIX = ("check the credentials (weight_sync.storage_options key and secret, or AWS_ACCESS_KEY_ID and "
              "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)) and that they may read and write this bucket")


@pytest.fixture(autouse=True)
def _no_ambient_credentials(skyrl_no_ambient_aws: None) -> None:
    """Credentials come only from the job (skyrl_host.testing)."""


def s3(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**CREDENTIALS, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)


@pytest.fixture
def bucket(skyrl_s3_server: str) -> Iterator[str]:
    fs = s3(skyrl_s3_server)
    name = f"run-{os.getpid()}-{time.monotonic_ns()}"
    fs.mkdir(name)
    yield name
    fs.rm(name, recursive=True)


def set_auth(endpoint: str, requests_before_auth: float) -> None:
    """moto's server checks credentials after that many more requests (inf: never)."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=str(requests_before_auth).encode(),
                                 method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()


@pytest.fixture
def auth(skyrl_s3_server: str) -> Iterator[Any]:
    yield lambda n: set_auth(skyrl_s3_server, n)
    set_auth(skyrl_s3_server, float("inf"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, uri: str, options: dict[str, Any]) -> tuple[Any, Any, float]:
    job = skyrl_tiny_rl_job(tmp_path, job={"steps": 2}, engine={"dtype": "bfloat16"},
                            weight_sync={"transport": "delta", "uri": uri, "storage_options": options})
    t0 = time.monotonic()
    result = skyrl_cli("run", str(job.path))
    return job, result, time.monotonic() - t0


def assert_one_line(result: Any, line: str) -> None:
    assert result.exit_code == USER_ERROR_EXIT_CODE, result
    assert "Traceback" not in result.stderr + result.stdout
    assert [x for x in result.stderr.splitlines() if x.startswith("error")] == [line], result.stderr
    assert line in result.stderr.strip().splitlines()[-1], result.stderr


def test_no_credentials(skyrl_cli, skyrl_tiny_rl_job, tmp_path, skyrl_s3_server, bucket) -> None:
    uri = f"s3://{bucket}/weights"
    options = {"client_kwargs": {"endpoint_url": skyrl_s3_server}, "config_kwargs": FAST}
    job, result, seconds = run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, uri, options)
    assert_one_line(result, f"error: weight_sync.uri: no credentials to reach {uri}: set weight_sync.storage_options = "
                            f'{{key = "...", secret = "..."}}, or {ENV_FIX}')
    assert seconds < 60
    assert s3(skyrl_s3_server).find(bucket) == []  # nothing written
    assert not job.rows() if (job.out / "metrics.jsonl").exists() else True  # no step trained


def test_wrong_credentials(skyrl_cli, skyrl_tiny_rl_job, tmp_path, skyrl_s3_server, bucket, auth) -> None:
    uri = f"s3://{bucket}/weights"
    options = {"key": "wrong", "secret": "wrong", "client_kwargs": {"endpoint_url": skyrl_s3_server},
               "config_kwargs": FAST}
    auth(0)
    _, result, _ = run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, uri, options)
    auth(float("inf"))
    assert_one_line(result, f"error: weight_sync.uri: access to {uri} is denied (403): {DENIED_FIX}")
    assert s3(skyrl_s3_server).find(bucket) == []


def test_missing_bucket(skyrl_cli, skyrl_tiny_rl_job, tmp_path, skyrl_s3_server) -> None:
    uri = "s3://no-such-bucket/weights"
    options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": skyrl_s3_server}, "config_kwargs": FAST}
    _, result, _ = run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, uri, options)
    assert_one_line(result, f"error: weight_sync.uri: cannot reach {uri}: the bucket 'no-such-bucket' does not exist; "
                            "create it, or fix the bucket in the URL")
    assert not s3(skyrl_s3_server).exists("no-such-bucket")


def test_unreachable_endpoint_fails_in_seconds(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    uri = "s3://bucket-a/weights"
    options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": FAST}
    _, result, seconds = run_job(skyrl_cli, skyrl_tiny_rl_job, tmp_path, uri, options)
    assert_one_line(result, f"error: weight_sync.uri: cannot reach {uri}: the endpoint {endpoint} does not answer; "
                            'check weight_sync.storage_options\'s client_kwargs = {endpoint_url = "..."} '
                            "(is the server up?)")
    assert seconds < 60  # the model is built first; the store answers in well under a second


def test_bad_storage_options_and_a_url_without_bucket(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    job = skyrl_tiny_rl_job(tmp_path, engine={"dtype": "bfloat16"},
                            weight_sync={"transport": "delta", "uri": "s3:///weights"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == USER_ERROR_EXIT_CODE
    assert result.stderr.strip().endswith("weight_sync.uri: no bucket in 's3:///weights': expected s3://bucket/prefix, "
                                          "e.g. 's3://my-bucket/run-1'"), result.stderr
    options = {"retries": 1, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{closed_port()}"}}
    with pytest.raises(UserError) as info:  # s3fs takes no ``retries``: refused on first use
        DeltaSender("s3://bucket-a/weights", storage_options=options).publish(1, [("a", torch.ones(3))])
    assert str(info.value).startswith("error: weight_sync.storage_options: the filesystem of s3://bucket-a/weights "
                                      "refuses these options: ")


def test_writes_refused_midway_leave_no_version(skyrl_s3_server, bucket, auth, monkeypatch) -> None:
    """The first requests pass, then the credentials are refused while payloads are written:
    the publish fails with the user error, no manifest or LATEST names the version, a receiver
    sees none, and the next publish (credentials fixed) is a complete version."""
    from skyrl_weightsync._delta import store

    monkeypatch.setattr(store, "PACK_BYTES", 1)  # each small payload a pack object of its own: 6 writes
    uri = f"s3://{bucket}/weights"
    options = {"key": "wrong", "secret": "wrong", "client_kwargs": {"endpoint_url": skyrl_s3_server},
               "config_kwargs": FAST}
    sender = DeltaSender(uri, storage_options=options, keyframe_every=0)
    g = torch.Generator().manual_seed(0)
    weights = {f"t{i}": torch.randn(64, generator=g) for i in range(6)}
    auth(4)  # LATEST's lookup (2 requests) and 2 payload writes pass, then every request is refused
    with pytest.raises(UserError, match=rf"^error: weight_sync.uri: access to {uri} is denied \("):
        sender.publish(1, weights.items())
    auth(float("inf"))
    fs = s3(skyrl_s3_server)
    names = [p.rsplit("/", 1)[1] for p in fs.find(bucket)]
    assert any(n.endswith(".zst") for n in names)  # some payloads were written: it failed midway
    assert "LATEST" not in names and "manifest.json" not in names
    good = {**CREDENTIALS, "client_kwargs": {"endpoint_url": skyrl_s3_server}}
    receiver = DeltaReceiver(uri, storage_options=good)
    assert receiver.fetch() is None  # no version to apply
    DeltaSender(uri, storage_options=good, keyframe_every=0).publish(2, weights.items())

    class Engine:
        weight_version = 0

        def update_weights(self, named, version):
            self.weights, self.weight_version = dict(named), version

    engine = Engine()
    receiver.sync(engine)
    assert engine.weight_version == 2
    assert all(torch.equal(engine.weights[k], weights[k].bfloat16()) for k in weights)
