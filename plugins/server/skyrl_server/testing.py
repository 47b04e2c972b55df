"""A Tinker server in a thread of this process, for tests and notebooks.

```python
from skyrl_server.testing import serving

with serving(folder, '[server]\\napi_keys = ["tml-k"]\\n[models."m"]\\nfamily = "qwen"\\npreset = "tiny"\\n') as served:
    client = tinker.ServiceClient(base_url=served.url, api_key="tml-k")
```

The text is written to ``folder/server.toml`` and validated like ``skyrl serve``'s file
(the environment's ``SKYRL_API_KEYS`` is not read); the server listens on a free port of
127.0.0.1 until the block ends. ``served.app`` and ``served.service`` give the
application's state (the models, the batchers) to tests that look inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
import threading
from typing import Any, Iterator

import attrs


@attrs.frozen
class Served:
    url: str  # http://127.0.0.1:PORT
    app: Any  # the aiohttp application
    host: Any  # the plugin host it was built with

    @property
    def service(self) -> Any:
        from skyrl_server._app import STATE

        return self.app[STATE].service


@contextlib.contextmanager
def serving(folder: str | pathlib.Path, server_toml: str, host: Any = None) -> Iterator[Served]:
    """Serve ``server_toml`` (the server file's text) from a thread until the block ends."""
    from aiohttp import web

    from skyrl_host.plugins import build_host
    from skyrl_server._app import STATE, build, runner
    from skyrl_server._config import load_server_file

    path = pathlib.Path(folder) / "server.toml"
    path.write_text(server_toml)
    host = build_host() if host is None else host
    app = build(load_server_file(path, host, environ={}), host)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    run = runner(app)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(run.setup())
        loop.run_until_complete(web.TCPSite(run, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="skyrl-serve-test", daemon=True)
    thread.start()
    if not started.wait(60):
        raise RuntimeError("the test server did not start within 60 s")
    try:
        yield Served(f"http://127.0.0.1:{port}", app, host)
    finally:
        asyncio.run_coroutine_threadsafe(run.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)
        app[STATE].service.close()
        app[STATE].worker.shutdown(wait=True)
        app[STATE].store.close()


__all__ = ["Served", "serving"]
