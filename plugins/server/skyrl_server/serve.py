"""``skyrl serve server.toml``: the Tinker API (what the official ``tinker`` SDK calls) over
skyrl's backends and engines. See docs/tinker.md.

This module only adds the command: aiohttp, torch and the SDK's messages are imported
when the command runs.
"""

from __future__ import annotations

import click

from skyrl_host import hookimpl


def serve(path: str, host_plugins: object, *, host: str | None = None, port: int | None = None) -> None:
    """Validate ``path``, load its models and serve until interrupted."""
    import attrs

    from skyrl_server._app import build, serve_forever
    from skyrl_server._config import load_server_file

    spec = load_server_file(path, host_plugins)
    server = attrs.evolve(spec.server, **{k: v for k, v in (("host", host), ("port", port)) if v is not None})
    spec = attrs.evolve(spec, server=server)
    app = build(spec, host_plugins)

    def started() -> None:
        from skyrl_server._store import describe

        click.echo(f"skyrl serve: {', '.join(spec.models)} on http://{server.host}:{server.port} "
                   f"(training state: {describe(spec.database)})", err=True)

    import uvloop  # the event loop: under 4,096 in-flight requests aiohttp's transports on asyncio's own loop are a third of the server's CPU

    try:
        uvloop.run(serve_forever(app, server.host, server.port, started))
    except OSError as exc:  # the address is taken or cannot be bound
        from skyrl_host.errors import UserError

        raise UserError(f"cannot listen on {server.host}:{server.port}: {exc.strerror or exc}") from None


@hookimpl
def skyrl_register_commands(cli: click.Group) -> None:
    @cli.command(name="serve")
    @click.argument("server_file", metavar="SERVER.toml", type=click.Path(dir_okay=False))
    @click.option("--host", default=None, help="Address to listen on (overrides [server] host).")
    @click.option("--port", type=click.IntRange(1, 65535), default=None, help="TCP port (overrides [server] port).")
    @click.pass_context
    def serve_cmd(ctx: click.Context, server_file: str, host: str | None, port: int | None) -> None:
        """Serve the Tinker API (the official tinker SDK's training and sampling calls) for the
        base models of SERVER.toml: LoRA training clients on shared frozen bases, sampling
        through the embedded engine. See docs/tinker.md."""
        serve(server_file, ctx.obj, host=host, port=port)
