"""The ``skyrl`` command line: run | validate | plugins, plus plugin commands."""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import json
import sys
import time
from typing import Any, Sequence

import click

from skyrl_host.errors import USER_ERROR_EXIT_CODE, JobFailed, UserError
from skyrl_host.plugins import ENV_ALLOW, ENV_DISABLE, PluginHost, build_host
from skyrl_host.registry import KINDS


def host_version() -> str:
    try:
        return importlib_metadata.version("skyrl-host")
    except importlib_metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


def _version_text(host: PluginHost) -> str:
    lines = [f"skyrl-host {host_version()}"]
    for dist, version in host.plugin_distributions():
        if dist != "skyrl-host":
            lines.append(f"  {dist} {version}")
    return "\n".join(lines)


def _host(ctx: click.Context) -> PluginHost:
    return ctx.find_object(PluginHost)  # type: ignore[return-value]


SET_HELP = "Override a job key, e.g. --set job.steps=10 (VALUE is a TOML value). Repeatable."


def _notices(spec: Any) -> None:
    """What the job file says in a form that still works but will not (a moved key), on stderr."""
    for notice in spec.notices:
        click.echo(f"notice: {notice}", err=True)


def make_cli(host: PluginHost) -> click.Group:
    """Build the CLI for ``host``; plugins add their commands through
    ``skyrl_register_commands``."""

    @click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
    @click.version_option(message=_version_text(host), help="Show the host and plugin versions and exit.")
    @click.pass_context
    def cli(ctx: click.Context) -> None:
        """skyrl: reinforcement-learning post-training of open LLMs, built from plugins.

        A job file (TOML) names a job kind and the plugins it uses; `skyrl run`
        runs it. Plugins are discovered through the `skyrl` entry-point group;
        block or allow them with SKYRL_DISABLE_PLUGINS / SKYRL_LOAD_PLUGINS
        (comma-separated plugin or distribution names).
        """
        ctx.obj = host

    @cli.command()
    @click.argument("job_file", type=click.Path(dir_okay=False))
    @click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help=SET_HELP)
    @click.option("--overwrite", is_flag=True, help="Replace a previous run in the job's output folder.")
    @click.option("--resume", is_flag=True, help="Continue the run in the job's output folder from its latest checkpoint.")
    @click.pass_context
    def run(ctx: click.Context, job_file: str, overrides: Sequence[str], overwrite: bool, resume: bool) -> None:
        """Validate JOB_FILE, resolve its plugins and run its job kind."""
        from skyrl_host.config import load_job
        from skyrl_host.runner import run_restarting

        spec = load_job(job_file, _host(ctx), overrides)
        _notices(spec)
        start = time.monotonic()
        result = run_restarting(_host(ctx), spec, overwrite=overwrite, resume=resume,
                                notice=lambda line: click.echo(line, err=True))
        resumed = f" (resumed after step {result.resume_step})" if result.resuming else ""
        click.echo(
            f"{spec.kind.name} job {spec.name!r} completed {result.last_step} step(s){resumed} in "
            f"{time.monotonic() - start:.1f} s; results in {result.output_dir}",
            err=True,
        )

    @cli.command("eval")
    @click.argument("job_file", type=click.Path(dir_okay=False))
    @click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help=SET_HELP)
    @click.option("--checkpoint", metavar="PATH", help="Evaluate this checkpoint (checkpoints/step_N, or a run's "
                  "output folder: its latest).")
    @click.option("--model", "model_path", metavar="PATH", help="Evaluate this model folder instead of the job's "
                  "(sets [model] path).")
    @click.option("--out", metavar="FILE", help="Write the results as JSON here (default: <output_dir>/eval.json).")
    @click.pass_context
    def evaluate(ctx: click.Context, job_file: str, overrides: Sequence[str], checkpoint: str | None,
                 model_path: str | None, out: str | None) -> None:
        """Evaluate a checkpoint or a model with JOB_FILE's [eval], without training."""
        import pathlib

        from rich.console import Console

        from skyrl_host.config import load_job
        from skyrl_host.errors import UserError as Refused
        from skyrl_host.jobs.evaluation import evaluate_job, render_table

        if checkpoint and model_path:
            raise Refused("--checkpoint and --model exclude each other")
        if model_path:
            overrides = (*overrides, f"model.path={json.dumps(model_path)}")
        spec = load_job(job_file, _host(ctx), overrides)
        _notices(spec)
        result = evaluate_job(_host(ctx), spec, checkpoint=checkpoint)
        result["evaluated"] = {"checkpoint": checkpoint, "model": model_path, "job": str(spec.path)}
        target = pathlib.Path(out) if out else spec.output_dir / "eval.json"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            raise Refused(f"--out {target}: cannot write: {exc.strerror or exc}") from None
        Console().print(render_table(result))
        click.echo(f"results in {target}", err=True)

    @cli.command()
    @click.argument("job_file", type=click.Path(dir_okay=False))
    @click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE", help=SET_HELP)
    @click.option("--explain", is_flag=True, help="List every key the job may set: type, default, value, description.")
    @click.option("--json", "as_json", is_flag=True, help="Print the resolved job as JSON.")
    @click.pass_context
    def validate(ctx: click.Context, job_file: str, overrides: Sequence[str], explain: bool, as_json: bool) -> None:
        """Check JOB_FILE and its plugins without running anything."""
        from skyrl_host.config import explain_job, load_job
        from skyrl_host.runner import describe_spec

        spec = load_job(job_file, _host(ctx), overrides)
        _notices(spec)
        if as_json:
            click.echo(json.dumps(describe_spec(spec), indent=2, default=str))
            return
        k = spec.kind
        click.echo(f"{job_file}: valid {k.name!r} job ({k.origin}), {spec.job.steps} steps, seed {spec.job.seed}")
        for choice in spec.choices():
            chosen = f" ({choice.chosen_by})" if getattr(choice, "chosen_by", None) else ""
            click.echo(f"  {'[' + choice.slot + ']':<14}{choice.name:<16} {choice.registration.origin}{chosen}")
        click.echo(f"  [cluster] launcher = {spec.cluster.launcher!r}")
        click.echo(f"  output: {spec.output_dir}")
        if explain:
            values = _flatten(spec)
            click.echo("\nkeys (type; default; value in this job; description):")
            for doc in explain_job(spec):
                value = values.get(doc.key, "-")
                click.echo(f"  {doc.key}: {doc.type}; default {doc.default}; value {value}")
                if doc.help:
                    click.echo(f"      {doc.help}  [{doc.owner}]")

    @cli.command()
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    @click.option("--all", "show_all", is_flag=True, help="Include blocked plugins and tracebacks of failures.")
    @click.option("--hook", "hook_name", metavar="NAME", help="Only plugins that implement hook NAME.")
    @click.pass_context
    def plugins(ctx: click.Context, as_json: bool, show_all: bool, hook_name: str | None) -> None:
        """List plugins: distribution, version, hooks and registered names."""
        h = _host(ctx)
        h.registry  # noqa: B018 - calling the registration hooks fills record.registered
        if hook_name is not None and not hasattr(h.pm.hook, hook_name):
            from skyrl_host.errors import did_you_mean

            known = [n for n in dir(h.pm.hook) if n.startswith("skyrl_")]
            raise UserError(f"--hook: unknown hook {hook_name!r}{did_you_mean(hook_name, known)}")
        records = [
            r
            for r in h.records.values()
            if (show_all or r.status != "blocked") and (hook_name is None or hook_name in r.hooks)
        ]
        conflicts = [c.message() for c in h.registry.conflicts()]
        if as_json:
            rows = []
            for r in records:
                row = r.to_json()
                if not show_all:
                    row.pop("traceback")
                rows.append(row)
            click.echo(json.dumps({"plugins": rows, "conflicts": conflicts}, indent=2))
            return
        for r in records:
            dist = f"{r.distribution} {r.version}" if r.distribution else "(registered in-process)"
            click.echo(f"{r.name}  [{r.status}]  {dist}" + (f"  {r.entry_point}" if r.entry_point else ""))
            if r.hooks:
                click.echo(f"    hooks: {', '.join(r.hooks)}")
            for kind, names in sorted(r.registered.items()):
                for name in sorted(names):
                    click.echo(f"    {KINDS[kind].noun} {name}: {_description(h, kind, name, r.name)}")
            if r.error:
                click.echo(f"    error: {r.error}")
            if show_all and r.traceback:
                click.echo("    " + r.traceback.rstrip().replace("\n", "\n    "))
        for msg in conflicts:
            click.echo(f"conflict: {msg}")
        blocked = sum(r.status == "blocked" for r in h.records.values())
        if blocked and not show_all:
            click.echo(f"({blocked} blocked by {ENV_DISABLE}/{ENV_ALLOW}; --all lists them)")

    host.add_commands(cli)
    return cli


def _description(host: PluginHost, kind: str, name: str, plugin: str) -> str:
    for reg in host.registry.all_registrations():
        if (reg.kind, reg.name, reg.origin.plugin) == (kind, name, plugin):
            return reg.description
    return ""


def _flatten(spec: Any) -> dict[str, str]:
    """Dotted key -> repr(value) for every value the job resolved to."""
    from skyrl_host.runner import describe_spec

    desc = describe_spec(spec)
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = repr(value)

    walk("job", desc["job"])
    walk("job", desc["kind"]["config"])
    walk("cluster", desc["cluster"])
    if desc.get("launcher"):
        walk("cluster", desc["launcher"]["config"])
    for table in ("eval", "teacher"):
        if desc.get(table):
            walk(table, desc[table])
    from skyrl_host.config import PLUGIN_TABLES

    for table, entries in desc["plugins"].items():
        slot = PLUGIN_TABLES[table]
        names = [e["name"] for e in entries]
        out[f"{table}.{slot.selector}"] = repr(names if slot.many else names[0])
        for entry in entries:
            prefix = f"{table}.{entry['name']}" if PLUGIN_TABLES[table].many else table
            walk(prefix, entry["config"])
    return out


def _one_line(message: str) -> str:
    """``message`` on one line, in the house style: a lower-case start, no final period."""
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    if text[:1].isupper() and text[1:2].islower():
        text = text[0].lower() + text[1:]
    return text[:-1] if text.endswith(".") and not text.endswith("..") else text


def _command_path(cli: click.Group, argv: Sequence[str]) -> str:
    """``skyrl models show`` for ``["models", "show", "X"]``: the (sub)commands that
    ``argv`` names, for the usage errors click raises before a context exists."""
    path, command = ["skyrl"], cli
    for arg in argv:
        if not isinstance(command, click.Group) or arg.startswith("-"):
            break
        sub = command.commands.get(arg)
        if sub is None:
            break
        path.append(arg)
        command = sub
    return " ".join(path)


def usage_error_line(exc: click.UsageError, cli: click.Group | None = None, argv: Sequence[str] = ()) -> str:
    """click's usage error (``Usage: ...``, ``Try ... --help``, ``Error: ...``, three
    lines) as the host's one line: ``error: COMMAND: message (see 'COMMAND --help')``.

    The hint is left out where the message already points at a command."""
    message = _one_line(exc.format_message())
    if exc.ctx is not None:
        path = exc.ctx.command_path
    elif cli is not None:
        path = _command_path(cli, argv)
    else:
        return f"error: {message}"
    hint = "" if "'skyrl " in message else f" (see '{path} --help')"
    return f"error: {path}: {message}{hint}"


def main(argv: Sequence[str] | None = None, host: PluginHost | None = None) -> int:
    """Console entry point: user errors print one message and exit with code 2.

    ``host`` defaults to a new host with the installed plugins loaded."""
    args = list(argv) if argv is not None else sys.argv[1:]
    cli: click.Group | None = None
    try:
        host = build_host() if host is None else host
        cli = make_cli(host)
        rc = cli.main(args=args, prog_name="skyrl", standalone_mode=False)
    except UserError as exc:
        click.echo(exc.render(), err=True)
        return USER_ERROR_EXIT_CODE
    except JobFailed as exc:
        click.echo(f"error: {exc}", err=True)
        return 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.UsageError as exc:  # a bad option or argument, of a host or a plugin command
        click.echo(usage_error_line(exc, cli, args), err=True)
        return USER_ERROR_EXIT_CODE
    except click.ClickException as exc:
        click.echo(f"error: {_one_line(exc.format_message())}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return rc if isinstance(rc, int) else 0


def entry() -> None:
    sys.exit(main())
