"""A local S3 API for tests and benchmarks: moto's server (``pip install "moto[server]"``)
on a free port of 127.0.0.1, so fsspec/s3fs code runs against a real S3 protocol with
no network. The pytest fixture ``skyrl_s3_server`` (skyrl_toolkit.testing) wraps it.

moto keeps objects in Python and is slow at big ones: completing a multipart upload copies
the whole object several times (~17 s for 1 GiB here, ~8 s for 0.5 GiB, ~5.6 GiB of server
memory). s3fs gives each request 15 s to answer (``read_timeout``), then botocore retries
it, and a retried ``CompleteMultipartUpload`` finds the upload already consumed by the
first attempt ("The specified upload does not exist"). :func:`client_options` are the
fsspec options for this server, with a read timeout long enough for such objects."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator


READ_TIMEOUT_S = 600.0  # seconds a request to the local server may take to answer (see above)


def client_options(url: str) -> dict:
    """fsspec/s3fs storage options for the server at ``url``: any credentials, its endpoint,
    and a read timeout that covers moto completing a multipart upload of several GiB."""
    return {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": url},
            "config_kwargs": {"read_timeout": READ_TIMEOUT_S}}


def moto_server_path() -> str | None:
    exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    return exe if os.path.exists(exe) else None


@contextlib.contextmanager
def local_s3_server(timeout_s: float = 30.0, host: str = "127.0.0.1") -> Iterator[tuple[str, int]]:
    """Start moto's S3 server on ``host`` (an address of this machine); yields (endpoint
    URL, pid); stops it on exit. Credentials are any (e.g. key = secret = "testing")."""
    exe = moto_server_path()
    if exe is None:
        raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", host, "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {url}") from None
                time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
