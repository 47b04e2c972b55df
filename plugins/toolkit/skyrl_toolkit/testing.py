"""pytest fixtures of the toolkit, for plugin authors' tests (a ``pytest11`` entry point:
loaded by pytest once skyrl-toolkit is installed): ``skyrl_s3_server``."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="module")
def skyrl_s3_server() -> Iterator[str]:
    """The endpoint URL of a local S3 API (moto's server on 127.0.0.1, started for the
    test module, stopped after it): see :mod:`skyrl_toolkit.s3server`."""
    from skyrl_toolkit.s3server import local_s3_server, moto_server_path

    if moto_server_path() is None:
        pytest.fail("skyrl_s3_server needs moto's server: pip install 'moto[server]' (in the test requirements)")
    with local_s3_server() as (url, _pid):
        yield url
