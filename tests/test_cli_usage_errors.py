"""A bad option or argument, to a host command or a plugin command, is one line
``error: COMMAND: message`` with exit code 2: never click's three-line usage block."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import click
import pytest

from skyrl_host import hookimpl

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "Usage:" not in result.stderr and "Try '" not in result.stderr and "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run"], "error: skyrl run: missing argument 'JOB_FILE' (see 'skyrl run --help')"),
        (["run", "--bogus", "job.toml"], "error: skyrl run: no such option '--bogus' (see 'skyrl run --help')"),
        (["run", "a.toml", "b.toml"], "error: skyrl run: got unexpected extra argument (b.toml) (see 'skyrl run --help')"),
        (
            ["validate", "examples/reward_check.toml", "--set"],
            "error: skyrl validate: option '--set' requires an argument (see 'skyrl validate --help')",
        ),
        (["plugins", "--json=3"], "error: skyrl plugins: option '--json' does not take a value (see 'skyrl plugins --help')"),
        (["nosuchcommand"], "error: skyrl: no such command 'nosuchcommand' (see 'skyrl --help')"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_host_command_usage_errors_are_one_line(skyrl_cli, args, expected) -> None:
    assert one_error_line(skyrl_cli(*args)) == expected


def test_plugin_commands_get_the_one_line_too(skyrl_cli, skyrl_plugin) -> None:
    class Commands:
        @hookimpl
        def skyrl_register_commands(self, cli):
            @cli.command(name="greet")
            @click.argument("who")
            @click.option("--times", type=click.IntRange(min=1), default=1)
            def greet(who: str, times: int) -> None:
                if who == "nobody":
                    raise click.UsageError("nobody is not a name")
                click.echo(f"hello {who}" * times)

    skyrl_plugin(Commands(), "greeter")
    assert skyrl_cli("greet", "you").stdout == "hello you\n"
    assert one_error_line(skyrl_cli("greet")) == "error: skyrl greet: missing argument 'WHO' (see 'skyrl greet --help')"
    assert one_error_line(skyrl_cli("greet", "you", "--times", "0")) == (
        "error: skyrl greet: invalid value for '--times': 0 is not in the range x>=1 (see 'skyrl greet --help')"
    )
    assert one_error_line(skyrl_cli("greet", "nobody")) == (
        "error: skyrl greet: nobody is not a name (see 'skyrl greet --help')"
    )


def test_installed_plugin_commands_through_the_console_script() -> None:
    def skyrl(*args):
        proc = subprocess.run([SKYRL, *args], capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), timeout=120)
        return proc

    shown = skyrl("models", "show", "NOSUCH")
    assert (shown.returncode, shown.stdout) == (2, "")
    assert shown.stderr == "error: skyrl models show: unknown model preset 'NOSUCH'. See 'skyrl models list'\n"
    tok = skyrl("data", "tokenize")
    assert (tok.returncode, tok.stderr) == (2, "error: skyrl data tokenize: missing argument 'INPUT...' (see 'skyrl data tokenize --help')\n")
    both = skyrl("data", "tokenize", "in.jsonl", "--tokenizer", "t", "--out", "o", "--resume", "--force")
    assert (both.returncode, both.stderr) == (
        2, "error: skyrl data tokenize: --resume and --force exclude each other (see 'skyrl data tokenize --help')\n"
    )
    info = skyrl("data", "info", "/nonexistent/corpus")
    assert info.returncode == 2 and info.stderr.count("\n") == 1
    assert info.stderr.startswith("error: /nonexistent/corpus: no corpus at this prefix")
