"""The server file of ``skyrl serve``: validated like a job file (file:line: key, exit 2)."""

from __future__ import annotations

import pathlib

import pytest

from skyrl_host.cli import main
from skyrl_host.errors import UserError
from skyrl_host.plugins import build_host
from skyrl_server._config import load_server_file

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def host():
    return build_host()


def _write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "server.toml"
    path.write_text(text)
    return path


GOOD = """[server]
api_keys = ["tml-a"]
port = 8123

[models."Qwen/Qwen3-0.6B"]
family = "qwen"
preset = "tiny"
"""


def test_the_example_serves_a_tiny_preset(host) -> None:
    spec = load_server_file(ROOT / "examples" / "tinker_server.toml", host, environ={"SKYRL_API_KEYS": "tml-x,tml-y"})
    assert any("tiny" in name for name in spec.models)
    assert {c.config.preset for c in spec.models.values()} == {"tiny", "tiny-moe"}
    assert spec.api_keys == {"tml-x", "tml-y"}
    assert spec.engine.name == "embedded" and spec.backend.name == "torch"


def test_keys_come_from_the_list_an_env_var_a_file_and_skyrl_api_keys(host, tmp_path) -> None:
    (tmp_path / "keys.txt").write_text("# team keys\ntml-file\n\n")
    path = _write(tmp_path, GOOD.replace('api_keys = ["tml-a"]',
                                         'api_keys = ["tml-a"]\napi_keys_env = "MY_KEYS"\napi_keys_file = "keys.txt"'))
    spec = load_server_file(path, host, environ={"MY_KEYS": "tml-env1, tml-env2", "SKYRL_API_KEYS": "tml-all"})
    assert spec.api_keys == {"tml-a", "tml-env1", "tml-env2", "tml-file", "tml-all"}
    assert list(spec.models) == ["Qwen/Qwen3-0.6B"] and spec.server.port == 8123


@pytest.mark.parametrize(("change", "where", "message"), [
    (("port = 8123", "port = 70000"), ":3: server.port", "TCP port"),
    (('preset = "tiny"', 'preset = "tinny"'), ":7: models.Qwen/Qwen3-0.6B.preset", "tiny"),
    (('family = "qwen"', 'family = "qwne"'), ":6: models.Qwen/Qwen3-0.6B.family", "did you mean 'qwen'"),
    (('api_keys = ["tml-a"]', 'api_keys = ["sk-a"]'), ":2: server.api_keys", "start with 'tml-'"),
    (("port = 8123", "port = 8123\npoll_seconds = 60"), ":4: server.poll_seconds", "(0, 40]"),
    (("[server]", "[server]\nlistn = 1"), ":2: server.listn", "unknown key"),
    (("[server]", "[backend]\nname = \"torch\"\nlora_rank = 8\n[server]"), ":3: backend.lora_rank", "max_lora_rank"),
])
def test_a_bad_key_is_located(host, tmp_path, change, where, message) -> None:
    path = _write(tmp_path, GOOD.replace(*change))
    with pytest.raises(UserError) as exc:
        load_server_file(path, host, environ={})
    text = str(exc.value)
    assert f"{path}{where}" in text and message in text, text


def test_no_key_at_all_is_an_error(host, tmp_path) -> None:
    path = _write(tmp_path, GOOD.replace('api_keys = ["tml-a"]', ""))
    with pytest.raises(UserError, match="no API keys"):
        load_server_file(path, host, environ={})
    assert load_server_file(path, host, environ={"SKYRL_API_KEYS": "tml-k"}).api_keys == {"tml-k"}


def test_skyrl_serve_exits_2_with_one_line(host, tmp_path, capsys) -> None:
    path = _write(tmp_path, GOOD.replace("port = 8123", 'port = "x"'))
    assert main(["serve", str(path)], host=host) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}:3: server.port" in err


def test_skyrl_serve_serves_until_sigterm(tmp_path) -> None:
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = _write(tmp_path, GOOD.replace("port = 8123", f"port = 1\nstorage = \"{tmp_path / 'store'}\""))
    proc = subprocess.Popen([sys.executable, "-c", "from skyrl_host.cli import entry; entry()", "serve", str(path),
                             "--port", str(port)], stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not any(f"on http://127.0.0.1:{port}" in line for line in seen):  # printed once it listens
            line = proc.stderr.readline()
            assert line, "".join(seen)  # it exited
            seen.append(line)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/get_server_capabilities",
                                     headers={"X-API-Key": "tml-a"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["supported_models"][0]["model_name"] == "Qwen/Qwen3-0.6B"
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0 and time.monotonic() - start < 30
    finally:
        proc.kill()
        proc.wait()
