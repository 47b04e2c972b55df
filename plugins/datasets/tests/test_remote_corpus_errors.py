"""An sft job whose ``data_paths`` entry is an ``s3://`` URL that cannot be read (no
credentials, wrong credentials, a missing bucket, an endpoint that does not answer):
``skyrl run`` says so in one line naming the URL and the fix (exit code 2), within seconds,
before training. Against moto's real S3 server on 127.0.0.1 (``skyrl_s3_server``) and a
closed local port; ``skyrl data info`` says the same."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from typing import Any, Iterator

import pytest

from skyrl_host.errors import USER_ERROR_EXIT_CODE
from skyrl_host.testing import step_rows

FAST = {"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}}  # an unreachable endpoint fails fast
CREDENTIALS = {"key": "testing", "secret": "testing"}
ENV_FIX = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"

JOB = """\
[job]
kind = "sft"
seed = 5
steps = 2
data_paths = [{url}]
storage_options = {options}
cache_dir = {cache}
tokens_per_step = 64
max_seq_len = 32
alphabet = "0123456789:"
threads = 1
output_dir = {out}

[model]
family = "qwen"
preset = "tiny"

[backend]
name = "torch"
micro_batch_tokens = 64
"""


def toml(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # strings and numbers: JSON's are TOML's


@pytest.fixture(autouse=True)
def _no_ambient_credentials(skyrl_no_ambient_aws: None) -> None:
    """Credentials come only from the job (skyrl_host.testing)."""


def s3(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**CREDENTIALS, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)


@pytest.fixture
def remote_corpus(skyrl_s3_server: str, tmp_path) -> Iterator[str]:
    """A small corpus in our format uploaded to a fresh bucket; its URL."""
    from skyrl_datasets.corpus import CorpusWriter

    prefix = tmp_path / "local" / "docs"
    with CorpusWriter(str(prefix), vocab_size=8, eos_id=1, tokenizer="test ids") as writer:
        for n in range(6, 12):
            writer.add([2 + (i % 5) for i in range(n - 1)] + [1])
    fs = s3(skyrl_s3_server)
    bucket = f"data-{os.getpid()}-{time.monotonic_ns()}"
    fs.mkdir(bucket)
    for file in sorted((tmp_path / "local").iterdir()):
        fs.put_file(str(file), f"{bucket}/corpora/{file.name}")
    yield f"s3://{bucket}/corpora/docs"
    fs.rm(bucket, recursive=True)


@pytest.fixture
def auth(skyrl_s3_server: str) -> Iterator[Any]:
    """``auth(n)``: moto's server checks credentials after n more requests (inf: never)."""

    def set_auth(n: float) -> None:
        req = urllib.request.Request(f"{skyrl_s3_server}/moto-api/reset-auth", data=str(n).encode(), method="POST",
                                     headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(req, timeout=10).read()

    yield set_auth
    set_auth(float("inf"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


def run(skyrl_cli, tmp_path, url: str, options: dict[str, Any]) -> tuple[Any, str, float]:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(url=json.dumps(url), options=toml(options), cache=json.dumps(str(tmp_path / "cache")),
                               out=json.dumps(str(tmp_path / "out"))))
    line = next(i for i, t in enumerate(path.read_text().splitlines(), 1) if t.startswith("data_paths"))
    t0 = time.monotonic()
    result = skyrl_cli("run", str(path))
    seconds = time.monotonic() - t0
    assert result.exit_code == USER_ERROR_EXIT_CODE, result
    assert "Traceback" not in result.stderr + result.stdout
    errors = [x for x in result.stderr.splitlines() if x.startswith("error")]
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1], result.stderr
    prefix = f"error: {path}:{line}: job.data_paths: [0] {url!r}: "
    assert errors[0].startswith(prefix), errors[0]
    return result, errors[0].removeprefix(prefix), seconds


def test_no_credentials(skyrl_cli, tmp_path, skyrl_s3_server, remote_corpus) -> None:
    options = {"client_kwargs": {"endpoint_url": skyrl_s3_server}, "config_kwargs": FAST}
    _, message, seconds = run(skyrl_cli, tmp_path, remote_corpus, options)
    assert message == (f"no credentials to reach {remote_corpus}: "
                       f'set storage_options = {{key = "...", secret = "..."}}, or {ENV_FIX}')
    assert seconds < 60
    assert step_rows(tmp_path / "out") == []  # refused before the first step
    end = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (end["event"], end["status"], end["last_step"]) == ("end", "failed", 0)


def test_wrong_credentials(skyrl_cli, tmp_path, skyrl_s3_server, remote_corpus, auth) -> None:
    options = {"key": "wrong", "secret": "wrong", "client_kwargs": {"endpoint_url": skyrl_s3_server},
               "config_kwargs": FAST}
    auth(0)
    _, message, _ = run(skyrl_cli, tmp_path, remote_corpus, options)
    auth(float("inf"))
    assert message == (f"access to {remote_corpus} is denied (403): check the credentials (storage_options key and "
                       "secret, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)) and that they may "
                       "read and write this bucket")


def test_missing_bucket(skyrl_cli, tmp_path, skyrl_s3_server) -> None:
    url = "s3://no-such-bucket/corpora/docs"
    options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": skyrl_s3_server}, "config_kwargs": FAST}
    _, message, _ = run(skyrl_cli, tmp_path, url, options)
    assert message == (f"cannot reach {url}: the bucket 'no-such-bucket' does not exist; "
                       "create it, or fix the bucket in the URL")


def test_unreachable_endpoint_fails_in_seconds(skyrl_cli, tmp_path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    url = "s3://bucket-a/corpora/docs"
    options = {**CREDENTIALS, "client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": FAST}
    _, message, seconds = run(skyrl_cli, tmp_path, url, options)
    assert message == (f"cannot reach {url}: the endpoint {endpoint} does not answer; check storage_options's "
                       'client_kwargs = {endpoint_url = "..."} (is the server up?)')
    assert seconds < 30  # the corpus is opened before the model is built
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_good_url_still_opens_and_data_info_says_the_same(skyrl_cli, tmp_path, skyrl_s3_server,
                                                            remote_corpus) -> None:
    from skyrl_datasets.corpus import open_corpus

    good = {**CREDENTIALS, "client_kwargs": {"endpoint_url": skyrl_s3_server}}
    with open_corpus(remote_corpus, storage_options=good, cache_dir=tmp_path / "cache") as c:
        assert c.n_docs == 6
    result = skyrl_cli("data", "info", remote_corpus, "--storage-options",
                       json.dumps({"client_kwargs": {"endpoint_url": skyrl_s3_server}, "config_kwargs": FAST}))
    assert result.exit_code == USER_ERROR_EXIT_CODE, result
    assert result.stderr.strip().splitlines()[-1] == (
        f'error: no credentials to reach {remote_corpus}: set storage_options = {{key = "...", secret = "..."}}, '
        f"or {ENV_FIX}"
    ), result.stderr
