"""A pytest plugin for plugin authors (loaded through the ``pytest11`` entry point).

Fixtures:

``skyrl_host``
    A new :class:`~skyrl_host.plugins.PluginHost` with the installed plugins loaded,
    as ``skyrl`` would load them. Every test gets its own.
``skyrl_empty_host``
    A new host with no plugins at all.
``skyrl_plugin``
    ``skyrl_plugin(obj, name=None)`` registers a plugin object (module, class or
    instance) on ``skyrl_host`` for the current test only and returns its record.
``skyrl_cli``
    ``skyrl_cli(*args)`` runs the ``skyrl`` command line in-process against
    ``skyrl_host`` and returns a :class:`CliResult` (exit code, stdout, stderr).
``skyrl_s3_server``
    The endpoint URL of a local S3 API (moto's server on 127.0.0.1), per test module.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterator

import attrs
import pytest

from skyrl_host.plugins import PluginHost, PluginRecord, build_host

_counter = itertools.count()


@attrs.frozen
class CliResult:
    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def skyrl_host() -> Iterator[PluginHost]:
    """A new plugin host with the installed plugins loaded, as `skyrl` loads them."""
    yield build_host()


@pytest.fixture
def skyrl_empty_host() -> Iterator[PluginHost]:
    """A new plugin host with no plugins at all."""
    yield build_host(entry_points=False)


@pytest.fixture
def skyrl_plugin(skyrl_host: PluginHost) -> Iterator[Callable[..., PluginRecord]]:
    """``skyrl_plugin(obj, name=None)``: register a plugin object on ``skyrl_host``
    for this test only; returns its record."""
    added: list[str] = []

    def register(obj: Any, name: str | None = None) -> PluginRecord:
        name = name or f"test-plugin-{next(_counter)}"
        record = skyrl_host.add_plugin(obj, name)
        added.append(name)
        return record

    yield register
    for name in added:
        skyrl_host.remove_plugin(name)


@pytest.fixture
def skyrl_cli(skyrl_host: PluginHost, capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """``skyrl_cli(*args)``: run the `skyrl` CLI in-process against ``skyrl_host``;
    returns a CliResult(exit_code, stdout, stderr)."""
    from skyrl_host.cli import main

    def invoke(*args: str) -> CliResult:
        capsys.readouterr()
        code = main(list(args), host=skyrl_host)
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return invoke


@pytest.fixture(scope="module")
def skyrl_s3_server() -> Iterator[str]:
    """The endpoint URL of a local S3 API (moto's server on 127.0.0.1, started for the
    test module, stopped after it): see :mod:`skyrl_host.s3server`."""
    from skyrl_host.s3server import local_s3_server, moto_server_path

    if moto_server_path() is None:
        pytest.fail("skyrl_s3_server needs moto's server: pip install 'moto[server]' (in the test requirements)")
    with local_s3_server() as (url, _pid):
        yield url
