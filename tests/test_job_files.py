"""Malformed job files: every problem is reported at once, without a traceback,
located as ``{file}:{line}: {key.path}: {what was expected}, {what was found}``,
and the command exits with code 2.

Each case writes its TOML to ``tmp_path`` and runs the ``skyrl`` command line
in-process with the ``skyrl_cli`` fixture (from ``skyrl_host.testing``). In the
expected substrings, ``{path}`` stands for the job file's path.
"""

from __future__ import annotations

import pathlib
import re
import textwrap
from typing import Any, Sequence

import attrs
import pytest

from skyrl_host import hookimpl
from skyrl_host.config import ge, in_interval, locate_keys, option
from skyrl_host.plugins import build_host


@pytest.fixture
def skyrl_host() -> Any:
    """Only the plugins these job files use, so the messages that list what is
    available stay the same whatever else is installed."""
    yield build_host(env={"SKYRL_LOAD_PLUGINS": "letter_count,reward_check,metrics_jsonl,local,ray"})

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "reward_check.toml"
USER_ERROR = 2

VALID_TABLES = (
    "valid tables: 'algorithm', 'backend', 'cluster', 'corpus', 'data', 'dataset', 'engine', 'environment', 'eval', 'job', 'model', "
    "'observers', 'precision', 'replay', 'reward', 'sampler', 'teacher', 'weight_sync'"
)
JOB_KEYS = (
    "valid keys: 'batch_size', 'kind', 'max_shuffled_reward', 'name', 'output_dir', 'seed', 'steps'"
)
DATASET_KEYS = "valid keys: 'alphabet', 'max_len', 'min_len', 'name', 'partial_credit', 'seed_offset'"


def toml(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def case(
    id: str,
    text: str,
    expected: Sequence[str],
    *,
    args: Sequence[str] = (),
    cmd: str = "validate",
    problems: int = 1,
    names_file: bool = True,
) -> Any:
    """One row: the job file, what stderr must contain, and how many problems it lists.

    ``names_file=False`` for problems located in a --set argument rather than in the file."""
    return pytest.param(toml(text), list(expected), tuple(args), cmd, problems, names_file, id=id)


def check_user_error(result: Any, path: str, expected: Sequence[str], problems: int, names_file: bool = True) -> None:
    err = result.stderr
    assert result.exit_code == USER_ERROR, err
    assert result.stdout == ""
    assert "Traceback" not in err
    assert err.startswith("error: ")
    if problems == 1:
        assert err.count("\n") == 1, f"expected one line, got:\n{err}"
        assert "problems" not in err.splitlines()[0]
        lines = [err.removeprefix("error: ").rstrip("\n")]
    else:
        head, *lines = err.rstrip("\n").splitlines()
        assert head == f"error: {problems} problems"
        assert len(lines) == problems and all(line.startswith("  - ") for line in lines), err
        lines = [line.removeprefix("  - ") for line in lines]
    where = re.escape(path) if names_file else r"--set"
    for line in lines:  # every problem is located: "{path}[:{line}]: ..." or "--set: ..."
        assert re.match(rf"({where}|--set)(:\d+)?: ", line), line
    if names_file:
        assert path in err
    for text in expected:
        assert text.format(path=path) in err, f"{text.format(path=path)!r} not in:\n{err}"


# ---------------------------------------------------------------------------
# Job files for the `reward_check` job kind and the `letter_count` dataset.
# ---------------------------------------------------------------------------

CASES = [
    # -- TOML syntax ---------------------------------------------------------
    case(
        "toml-syntax-error",
        """
        [job]
        kind = "reward_check"
        steps = = 3
        """,
        ["error: {path}:3: invalid TOML: ", "(column 9)"],
    ),
    case(
        "toml-duplicate-key",
        """
        [job]
        kind = "reward_check"
        steps = 1
        steps = 2
        """,
        ["error: {path}:4: invalid TOML: "],
    ),
    case(
        "toml-unclosed-table-header",
        """
        [job]
        kind = "reward_check"

        [dataset
        name = "letter_count"
        """,
        ["error: {path}:4: invalid TOML: "],
    ),
    # -- [job] -----------------------------------------------------------------
    case(
        "missing-job-table",
        """
        [dataset]
        name = "letter_count"
        """,
        ['error: {path}: job: missing required table [job] (with at least kind = "...")'],
    ),
    case("empty-file", "", ['error: {path}: job: missing required table [job] (with at least kind = "...")']),
    case(
        "missing-job-kind",
        """
        [job]
        steps = 3

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:1: job.kind: missing required key (a string)"],
    ),
    case(
        "job-kind-wrong-type",
        """
        [job]
        kind = 3

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:2: job.kind: expected a string, found integer 3"],
    ),
    case(
        "unknown-job-kind",
        """
        [job]
        kind = "reward_chek"

        [dataset]
        name = "letter_count"
        """,
        [
            "error: {path}:2: job.kind: unknown job kind 'reward_chek' (did you mean 'reward_check'?); "
            "available: 'reward_check'"
        ],
    ),
    case(
        # The kind's own keys (batch_size) cannot be checked, but the host's still are.
        "unknown-job-kind-and-bad-host-key",
        """
        [job]
        kind = "nope"
        steps = 0
        batch_size = 3
        """,
        [
            "{path}:2: job.kind: unknown job kind 'nope'; available: 'reward_check'",
            "{path}:3: job.steps: expected a value > 0, found 0",
        ],
        problems=2,
    ),
    case(
        "unknown-job-key",
        """
        [job]
        kind = "reward_check"
        stpes = 3

        [dataset]
        name = "letter_count"
        """,
        [f"error: {{path}}:3: job.stpes: unknown key (did you mean 'steps'?); {JOB_KEYS}"],
    ),
    case(
        "job-sub-table",
        """
        [job]
        kind = "reward_check"

        [job.options]
        steps = 3

        [dataset]
        name = "letter_count"
        """,
        [f"error: {{path}}:4: job.options: unknown key; {JOB_KEYS}"],
    ),
    # -- top-level tables --------------------------------------------------------
    case(
        "unknown-table",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"

        [datset]
        min_len = 3
        """,
        [f"error: {{path}}:7: datset: unknown table (did you mean 'dataset'?); {VALID_TABLES}"],
    ),
    case(
        "job-not-a-table",
        """
        job = "reward_check"
        """,
        ["error: {path}:1: job: expected a table [job], found string 'reward_check'"],
    ),
    case(
        "job-array-of-tables",
        """
        [[job]]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:1: job: expected a table [job], found array [{{'kind': 'reward_check'}}]"],
    ),
    case(
        # Reported once: not also as "missing required table [dataset]".
        "dataset-not-a-table",
        """
        dataset = "letter_count"

        [job]
        kind = "reward_check"
        """,
        ["error: {path}:1: dataset: expected a table [dataset], found string 'letter_count'"],
    ),
    case(
        "cluster-not-a-table",
        """
        cluster = "ray"

        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:1: cluster: expected a table [cluster], found string 'ray'"],
    ),
    case(
        "table-the-kind-does-not-use",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"

        [sampler]
        name = "greedy"
        """,
        ["error: {path}:7: sampler: job kind 'reward_check' does not use [sampler]; it uses [dataset]"],
    ),
    case(
        "missing-required-plugin-table",
        """
        [job]
        kind = "reward_check"
        """,
        ["error: {path}: dataset: missing required table [dataset] (job kind 'reward_check' needs a dataset)"],
    ),
    case(
        # An inline table under [job] is a key of [job], not the [dataset] table.
        "dataset-inline-table-inside-job",
        """
        [job]
        kind = "reward_check"
        dataset = { name = "letter_count" }
        """,
        [
            f"{{path}}:3: job.dataset: unknown key; {JOB_KEYS}",
            "{path}: dataset: missing required table [dataset] (job kind 'reward_check' needs a dataset)",
        ],
        problems=2,
    ),
    # -- wrong types -------------------------------------------------------------
    case(
        "string-for-int",
        """
        [job]
        kind = "reward_check"
        steps = "ten"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.steps: expected an integer, found string 'ten'"],
    ),
    case(
        "float-for-int",
        """
        [job]
        kind = "reward_check"
        seed = 1.5

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.seed: expected an integer, found float 1.5"],
    ),
    case(
        "bool-for-int",
        """
        [job]
        kind = "reward_check"
        batch_size = true

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.batch_size: expected an integer, found boolean true"],
    ),
    case(
        "int-for-str",
        """
        [job]
        kind = "reward_check"
        name = 3

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.name: expected a string, found integer 3"],
    ),
    case(
        "array-for-str",
        """
        [job]
        kind = "reward_check"
        output_dir = ["runs", "a"]

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.output_dir: expected a string, found array ['runs', 'a']"],
    ),
    case(
        "string-for-float-in-plugin-table",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        partial_credit = "half"
        """,
        ["error: {path}:6: dataset.partial_credit: expected a number, found string 'half'"],
    ),
    case(
        "dataset-name-wrong-type",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = 3
        """,
        ["error: {path}:5: dataset.name: expected a string (a dataset name), found integer 3"],
    ),
    case(
        "dataset-name-is-a-table",
        """
        [job]
        kind = "reward_check"

        [dataset.name]
        min_len = 3
        """,
        ["error: {path}:4: dataset.name: expected a string (a dataset name), found a table"],
    ),
    # -- values out of range -----------------------------------------------------
    case(
        "negative-seed",
        """
        [job]
        kind = "reward_check"
        seed = -1

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.seed: expected a value >= 0, found -1"],
    ),
    case(
        "zero-steps",
        """
        [job]
        kind = "reward_check"
        steps = 0

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.steps: expected a value > 0, found 0"],
    ),
    case(
        "negative-steps",
        """
        [job]
        kind = "reward_check"
        steps = -5

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.steps: expected a value > 0, found -5"],
    ),
    case(
        "nan-for-positive-float",
        """
        [job]
        kind = "reward_check"
        max_shuffled_reward = nan

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.max_shuffled_reward: expected a number, found float nan (a finite number is needed)"],
    ),
    case(
        "partial-credit-out-of-range",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        partial_credit = 1.5
        """,
        ["error: {path}:6: dataset.partial_credit: expected a value in [0, 1), found 1.5"],
    ),
    case(
        "min-len-zero",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        min_len = 0
        """,
        ["error: {path}:6: dataset.min_len: expected a value > 0, found 0"],
    ),
    case(
        "min-len-greater-than-max-len",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        min_len = 10
        max_len = 3
        """,
        ["error: {path}:6: dataset.min_len: expected at most max_len (3), found 10"],
    ),
    case(
        "alphabet-field-validator",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        alphabet = "a"
        """,
        ["error: {path}:6: dataset.alphabet: expected at least 2 distinct letters, found 'a'"],
    ),
    case(
        "cluster-launcher-typo",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"

        [cluster]
        launcher = "rya"
        """,
        ["error: {path}:8: cluster.launcher: unknown launcher 'rya' (did you mean 'ray'?); available: 'local', 'ray'"],
    ),
    case(
        "cluster-cpus-and-gpus",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"

        [cluster]
        num_cpus = 0
        num_gpus = -1
        """,
        [
            "{path}:8: cluster.num_cpus: expected a value > 0, found 0",
            "{path}:9: cluster.num_gpus: expected a value >= 0, found -1",
        ],
        problems=2,
    ),
    # -- plugin names and options -------------------------------------------------
    case(
        "unknown-dataset",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_cout"
        """,
        [
            "error: {path}:5: dataset.name: unknown dataset 'letter_cout' (did you mean 'letter_count'?); "
            "available: ",
            "'letter_count'",
        ],
    ),
    case(
        "dataset-without-name",
        """
        [job]
        kind = "reward_check"

        [dataset]
        min_len = 3
        """,
        ["error: {path}:4: dataset.name: missing required key (the dataset to use)"],
    ),
    case(
        "unknown-plugin-option",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        min_length = 3
        """,
        [f"error: {{path}}:6: dataset.min_length: unknown key (did you mean 'min_len'?); {DATASET_KEYS}"],
    ),
    # -- line numbers in unusual layouts ------------------------------------------
    case(
        "dotted-keys-at-top-level",
        """
        job.kind = "reward_check"
        job.steps = 0
        dataset.name = "letter_count"
        dataset.min_len = 0
        """,
        [
            "{path}:2: job.steps: expected a value > 0, found 0",
            "{path}:4: dataset.min_len: expected a value > 0, found 0",
        ],
        problems=2,
    ),
    case(
        "inline-tables-at-top-level",
        """
        job = { kind = "reward_check", steps = 0 }
        dataset = { name = "letter_count", min_len = 0 }
        """,
        [
            "{path}:1: job.steps: expected a value > 0, found 0",
            "{path}:2: dataset.min_len: expected a value > 0, found 0",
        ],
        problems=2,
    ),
    case(
        "quoted-keys",
        """
        [job]
        "kind" = "reward_check"
        'steps' = 0

        ["dataset"]
        name = "letter_count"
        """,
        ["error: {path}:3: job.steps: expected a value > 0, found 0"],
    ),
    case(
        # The inner "[1, 2]" line is part of the array, not a table header.
        "line-after-multiline-nested-array",
        """
        [job]
        kind = "reward_check"
        name = [
          [1, 2]
        ]
        steps = "x"

        [dataset]
        name = "letter_count"
        """,
        [
            "{path}:6: job.steps: expected an integer, found string 'x'",
            "{path}:3: job.name: expected a string, found array [[1, 2]]",
        ],
        problems=2,
    ),
    case(
        # Three double quotes inside a one-line literal string do not open a multi-line string.
        "triple-quote-inside-literal-string",
        """
        [job]
        kind = "reward_check"
        name = '\"\"\"'
        steps = "x"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:4: job.steps: expected an integer, found string 'x'"],
    ),
    case(
        # Lines inside a multi-line string are neither headers nor keys.
        "header-like-text-in-multiline-string",
        '''
        [job]
        kind = "reward_check"
        name = """
        [dataset]
        steps = 3"""
        steps = "x"

        [dataset]
        name = "letter_count"
        ''',
        ["error: {path}:6: job.steps: expected an integer, found string 'x'"],
    ),
    # -- several problems at once ------------------------------------------------
    case(
        "several-problems",
        """
        [job]
        kind = "reward_check"
        steps = 0
        seed = -1

        [dataset]
        name = "letter_count"
        alphabet = "a"

        [cluster]
        launcher = "rya"

        [datset]
        """,
        [
            "{path}:13: datset: unknown table (did you mean 'dataset'?)",
            "{path}:4: job.seed: expected a value >= 0, found -1",
            "{path}:3: job.steps: expected a value > 0, found 0",
            "{path}:11: cluster.launcher: unknown launcher 'rya' (did you mean 'ray'?); available: 'local', 'ray'",
            "{path}:8: dataset.alphabet: expected at least 2 distinct letters, found 'a'",
        ],
        problems=5,
    ),
    case(
        "several-wrong-types-in-one-table",
        """
        [job]
        kind = "reward_check"
        steps = "ten"
        seed = 1.5
        batch_size = true
        name = 3
        """,
        [
            "{path}:4: job.seed: expected an integer, found float 1.5",
            "{path}:3: job.steps: expected an integer, found string 'ten'",
            "{path}:6: job.name: expected a string, found integer 3",
            "{path}:5: job.batch_size: expected an integer, found boolean true",
            "{path}: dataset: missing required table [dataset]",
        ],
        problems=5,
    ),
    # -- `skyrl run` reports the same problems before running anything -------------
    case(
        "run-zero-steps",
        """
        [job]
        kind = "reward_check"
        steps = 0

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}:3: job.steps: expected a value > 0, found 0"],
        cmd="run",
    ),
    case(
        "run-unknown-kind",
        """
        [job]
        kind = "reward_chek"
        """,
        ["error: {path}:2: job.kind: unknown job kind 'reward_chek' (did you mean 'reward_check'?)"],
        cmd="run",
    ),
    case(
        "run-missing-dataset-table",
        """
        [job]
        kind = "reward_check"
        """,
        ["error: {path}: dataset: missing required table [dataset]"],
        cmd="run",
    ),
    # -- --set overrides -------------------------------------------------------------
    case(
        "set-wrong-type",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}: job.steps: expected an integer, found string 'zero' (from --set job.steps=zero)"],
        args=["--set", "job.steps=zero"],
    ),
    case(
        # The value comes from --set, so the file's line 3 is not named.
        "set-negative-steps-over-file-value",
        """
        [job]
        kind = "reward_check"
        steps = 10

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}: job.steps: expected a value > 0, found -1 (from --set job.steps=-1)"],
        args=["--set", "job.steps=-1"],
    ),
    case(
        "set-run-wrong-type",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}: dataset.min_len: expected an integer, found float 2.5 (from --set dataset.min_len=2.5)"],
        args=["--set", "dataset.min_len=2.5"],
        cmd="run",
    ),
    case(
        "set-without-equals",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: --set: expected KEY.PATH=VALUE, found 'job.steps'"],
        args=["--set", "job.steps"],
        names_file=False,
    ),
    case(
        "set-empty-key-part",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: --set: expected KEY.PATH=VALUE, found 'job..steps=3'"],
        args=["--set", "job..steps=3"],
        names_file=False,
    ),
    case(
        "set-key-with-space",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: --set: expected KEY.PATH=VALUE, found 'job steps=3'"],
        args=["--set", "job steps=3"],
        names_file=False,
    ),
    case(
        "set-unknown-key",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        [f"error: {{path}}: job.stpes: unknown key (did you mean 'steps'?); {JOB_KEYS} (from --set job.stpes=3)"],
        args=["--set", "job.stpes=3"],
    ),
    case(
        "set-unknown-table",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        [
            "error: {path}: datset: unknown table (did you mean 'dataset'?); "
            f"{VALID_TABLES} (from --set datset.min_len=3)"
        ],
        args=["--set", "datset.min_len=3"],
    ),
    case(
        "set-below-a-value",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: --set: job.kind.x: job.kind is string 'reward_check', not a table"],
        args=["--set", "job.kind.x=3"],
        names_file=False,
    ),
    case(
        "set-table-to-a-value",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        ["error: {path}: dataset: expected a table [dataset], found integer 3 (from --set dataset=3)"],
        args=["--set", "dataset=3"],
    ),
    case(
        "set-inline-table",
        """
        [job]
        kind = "reward_check"

        [dataset]
        name = "letter_count"
        """,
        [
            "error: {path}: dataset.name: unknown dataset 'letter_cout' (did you mean 'letter_count'?); "
            "available: ",
            "'letter_count'",
            " (from --set dataset={{name = \"letter_cout\"}})",
        ],
        args=["--set", 'dataset={name = "letter_cout"}'],
    ),
    case(
        "set-and-file-problems-together",
        """
        [job]
        kind = "reward_check"
        seed = -1

        [dataset]
        name = "letter_count"
        """,
        [
            "{path}:3: job.seed: expected a value >= 0, found -1",
            "{path}: job.steps: expected a value > 0, found 0 (from --set job.steps=0)",
        ],
        args=["--set", "job.steps=0"],
        problems=2,
    ),
    case(
        "misspelled-selector-in-readme",
        """
        [job]
        kind = "reward_check"
        steps = 0

        [dataset]
        nmae = "letter_count"

        [cluster]
        launcher = "rya"
        """,
        [
            "error: 4 problems\n"
            "  - {path}:3: job.steps: expected a value > 0, found 0\n"
            "  - {path}:5: dataset.name: missing required key (the dataset to use)\n"
            "  - {path}:6: dataset.nmae: unknown key (did you mean 'name'?)\n"
            "  - {path}:9: cluster.launcher: unknown launcher 'rya' (did you mean 'ray'?); available: 'local', 'ray'\n"
        ],
        problems=4,
    ),
]


@pytest.mark.parametrize("text, expected, args, cmd, problems, names_file", CASES)
def test_malformed_job_file(
    skyrl_cli: Any,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    expected: list[str],
    args: tuple[str, ...],
    cmd: str,
    problems: int,
    names_file: bool,
) -> None:
    monkeypatch.chdir(tmp_path)  # `run` must never write into the source tree
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    result = skyrl_cli(cmd, str(path), *args)
    check_user_error(result, str(path), expected, problems, names_file)
    assert not (tmp_path / "runs").exists()


def test_enough_cases() -> None:
    assert len(CASES) >= 25
    assert len({p.id for p in CASES}) == len(CASES)


# ---------------------------------------------------------------------------
# Job files that are not there, or not files, or not text.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["validate", "run"])
def test_missing_job_file(skyrl_cli: Any, tmp_path: pathlib.Path, cmd: str) -> None:
    path = tmp_path / "nope.toml"
    result = skyrl_cli(cmd, str(path))
    assert result.exit_code == USER_ERROR
    assert result.stdout == ""
    assert result.stderr == f"error: {path}: no such job file\n"


@pytest.mark.parametrize("cmd", ["validate", "run"])
def test_directory_as_job_file(skyrl_cli: Any, tmp_path: pathlib.Path, cmd: str) -> None:
    result = skyrl_cli(cmd, str(tmp_path))
    assert result.exit_code == USER_ERROR
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert f"'{tmp_path}' is a directory" in result.stderr


def test_job_file_not_utf8(skyrl_cli: Any, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b'[job]\nkind = "\xff"\n')
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == USER_ERROR
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {path}: cannot read: 'utf-8' codec can't decode byte 0xff")


# ---------------------------------------------------------------------------
# Valid job files: the example, a --set that fixes a file, --explain.
# ---------------------------------------------------------------------------


def test_example_job_file_is_valid(skyrl_cli: Any) -> None:
    result = skyrl_cli("validate", str(EXAMPLE))
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{EXAMPLE}: valid 'reward_check' job (plugin 'reward_check' (skyrl-host ")
    assert lines[0].endswith("), 20 steps, seed 1")
    assert re.fullmatch(r"  \[dataset\] +letter_count +plugin 'letter_count' \(skyrl-letter-count \S+\)", lines[1])
    assert "  [cluster] launcher = 'local'" in lines
    assert "  output: runs/reward_check" in lines


def test_set_fixes_an_invalid_file(skyrl_cli: Any, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        toml(
            """
            [job]
            kind = "reward_check"
            steps = 0

            [dataset]
            name = "letter_count"
            alphabet = "a"
            """
        )
    )
    assert skyrl_cli("validate", str(path)).exit_code == USER_ERROR
    result = skyrl_cli("validate", str(path), "--set", "job.steps=3", "--set", "dataset.alphabet=ab")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith(f"{path}: valid 'reward_check' job (plugin 'reward_check' (")
    assert "), 3 steps, seed 0\n" in result.stdout


def test_explain_lists_keys_with_type_default_and_description(skyrl_cli: Any) -> None:
    result = skyrl_cli("validate", str(EXAMPLE), "--explain", "--set", "dataset.min_len=5")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "keys (type; default; value in this job; description):" in out
    for text in [
        "  job.kind: a string; default (required); value 'reward_check'\n"
        "      the job kind to run (a registered job plugin)  [host]\n",
        "  job.steps: an integer; default 100; value 20\n      number of steps to run (> 0, <= 1099511627776)  [host]\n",
        "  job.seed: an integer; default 0; value 1\n",
        "  job.batch_size: an integer; default 64; value 64\n"
        "      prompts drawn from the dataset per step (> 0)  [plugin 'reward_check' (skyrl-host ",
        "  cluster.launcher: a launcher name; default 'local'; value 'local'\n      selects the plugin  [host]\n",
        # The dataset slot of reward_check has no default: the key is required.
        "  dataset.name: a dataset name; default (required); value 'letter_count'\n      selects the plugin  [host]\n",
        "  dataset.min_len: an integer; default 4; value 5\n"
        "      shortest word (> 0)  [plugin 'letter_count' (skyrl-letter-count ",
        "  dataset.partial_credit: a number; default 0.5; value 0.5\n"
        "      reward for an answer off by one (halved per further step) (in [0, 1))  [plugin 'letter_count'",
        "  dataset.alphabet: a string; default 'abcde'; value 'abcde'\n",
    ]:
        assert text in out, f"{text!r} not in:\n{out}"


# ---------------------------------------------------------------------------
# A job kind with several slots: a default slot, a "many" slot ([replay]).
# ---------------------------------------------------------------------------


@attrs.frozen
class GreedyConfig:
    top_p: float = option(1.0, help="probability mass to sample from", validator=in_interval(0, 1, low_open=True))
    temperature: float = option(0.0, help="sampling temperature", validator=ge(0))


@attrs.frozen
class FifoConfig:
    capacity: int = option(100, help="batches kept", validator=ge(1))


class MultiSlotPlugin:
    """Job kind "multi": a dataset (required), a sampler (default "greedy") and
    replay strategies (required)."""

    @hookimpl
    def skyrl_register_jobs(self, register: Any) -> None:
        register(
            "multi",
            object,
            description="uses several slots",
            slots={"dataset": None, "sampler": "greedy", "replay": None},
        )

    @hookimpl
    def skyrl_register_samplers(self, register: Any) -> None:
        register("greedy", object, config=GreedyConfig, description="greedy decoding")
        register("beam", object, description="beam search, no options")

    @hookimpl
    def skyrl_register_replay_strategies(self, register: Any) -> None:
        register("fifo", object, config=FifoConfig, description="first in, first out")
        register("prioritized", object, description="by priority, no options")


@pytest.fixture
def multi(skyrl_plugin: Any) -> Any:
    return skyrl_plugin(MultiSlotPlugin(), name="multi_slots")


MULTI_HEAD = toml(
    """
    [job]
    kind = "multi"

    [dataset]
    name = "letter_count"
    """
)  # lines 1-5 of every multi job file


def mcase(id: str, rest: str, expected: Sequence[str], **kw: Any) -> Any:
    return case(id, MULTI_HEAD + "\n" + textwrap.dedent(rest).lstrip("\n"), expected, **kw)


MULTI_CASES = [
    mcase(
        "top-p-zero",
        """
        [replay]
        strategies = []

        [sampler]
        top_p = 0
        """,
        ["error: {path}:11: sampler.top_p: expected a value in (0, 1], found 0.0"],
    ),
    mcase(
        "top-p-above-one",
        """
        [replay]
        strategies = []

        [sampler]
        name = "greedy"
        top_p = 1.5
        """,
        ["error: {path}:12: sampler.top_p: expected a value in (0, 1], found 1.5"],
    ),
    mcase(
        "unknown-sampler",
        """
        [replay]
        strategies = []

        [sampler]
        name = "gredy"
        """,
        [
            "error: {path}:11: sampler.name: unknown sampler 'gredy' (did you mean 'greedy'?); "
            "available: 'beam', 'greedy'"
        ],
    ),
    mcase(
        "options-for-plugin-without-options",
        """
        [replay]
        strategies = []

        [sampler]
        name = "beam"
        top_p = 0.5
        """,
        ["error: {path}:12: sampler.top_p: unknown key: sampler 'beam' takes no options"],
    ),
    mcase(
        "table-not-used-by-kind",
        """
        [replay]
        strategies = []

        [model]
        family = "qwen"
        """,
        ["error: {path}:10: model: job kind 'multi' does not use [model]; it uses [dataset], [sampler], [replay]"],
    ),
    mcase(
        "missing-replay-table",
        "",
        ["error: {path}: replay: missing required table [replay] (job kind 'multi' needs a replay strategy)"],
    ),
    mcase(
        "replay-without-strategies",
        """
        [replay]
        """,
        ["error: {path}:7: replay.strategies: missing required key (the replay strategy to use)"],
    ),
    mcase(
        "replay-strategies-not-a-list",
        """
        [replay]
        strategies = "fifo"
        """,
        ["error: {path}:8: replay.strategies: expected an array of replay strategy names, found string 'fifo'"],
    ),
    mcase(
        "replay-strategies-not-all-strings",
        """
        [replay]
        strategies = ["fifo", 3]
        """,
        ["error: {path}:8: replay.strategies: expected an array of replay strategy names, found array ['fifo', 3]"],
    ),
    mcase(
        "unknown-replay-strategy",
        """
        [replay]
        strategies = ["fifi", "lifo"]
        """,
        [
            "{path}:8: replay.strategies: unknown replay strategy 'fifi' (did you mean 'fifo'?); "
            "available: 'fifo', 'prioritized'",
            "{path}:8: replay.strategies: unknown replay strategy 'lifo'",
        ],
        problems=2,
    ),
    mcase(
        "duplicated-replay-strategy",
        """
        [replay]
        strategies = ["fifo", "fifo"]
        """,
        ["error: {path}:8: replay.strategies: lists a name twice: ['fifo', 'fifo']"],
    ),
    mcase(
        "options-of-unselected-strategy",
        """
        [replay]
        strategies = ["prioritized"]

        [replay.fifo]
        capacity = 5
        """,
        ["error: {path}:10: replay.fifo: unknown key: not a selected replay strategy in replay.strategies"],
    ),
    mcase(
        "strategy-option-directly-in-replay",
        """
        [replay]
        strategies = ["fifo"]
        capacity = 5
        """,
        [
            "error: {path}:9: replay.capacity: unknown key: not a selected replay strategy in replay.strategies "
            "(strategy options go in their own sub-table)"
        ],
    ),
    mcase(
        "strategy-options-not-a-table",
        """
        [replay]
        strategies = ["fifo"]
        fifo = 3
        """,
        ["error: {path}:9: replay.fifo: expected a table, found integer 3"],
    ),
    mcase(
        "strategy-option-out-of-range",
        """
        [replay]
        strategies = ["fifo", "prioritized"]

        [replay.fifo]
        capacity = 0
        """,
        ["error: {path}:11: replay.fifo.capacity: expected a value >= 1, found 0"],
    ),
    mcase(
        "unknown-strategy-option",
        """
        [replay]
        strategies = ["fifo"]

        [replay.fifo]
        capacty = 5
        """,
        ["error: {path}:11: replay.fifo.capacty: unknown key (did you mean 'capacity'?); valid keys: 'capacity'"],
    ),
    mcase(
        "options-for-strategy-without-options",
        """
        [replay]
        strategies = ["prioritized"]

        [replay.prioritized]
        alpha = 0.6
        """,
        ["error: {path}:11: replay.prioritized.alpha: unknown key: replay strategy 'prioritized' takes no options"],
    ),
    mcase(
        "set-strategy-option",
        """
        [replay]
        strategies = []
        """,
        ["error: {path}: replay.fifo.capacity: expected a value >= 1, found 0 (from --set replay.fifo.capacity=0)"],
        args=["--set", 'replay.strategies=["fifo"]', "--set", "replay.fifo.capacity=0"],
    ),
]


@pytest.mark.parametrize("text, expected, args, cmd, problems, names_file", MULTI_CASES)
def test_malformed_multi_slot_job_file(
    multi: Any,
    skyrl_cli: Any,
    tmp_path: pathlib.Path,
    text: str,
    expected: list[str],
    args: tuple[str, ...],
    cmd: str,
    problems: int,
    names_file: bool,
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    result = skyrl_cli(cmd, str(path), *args)
    check_user_error(result, str(path), expected, problems, names_file)


def test_multi_slot_default_slot_may_be_omitted(multi: Any, skyrl_cli: Any, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        MULTI_HEAD
        + toml(
            """
            [replay]
            strategies = ["fifo", "prioritized"]

            [replay.fifo]
            capacity = 5
            """
        )
    )
    result = skyrl_cli("validate", str(path), "--explain")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"{path}: valid 'multi' job (plugin 'multi_slots'), 100 steps, seed 0\n")
    assert re.search(r"^  \[sampler\] +greedy +plugin 'multi_slots'$", out, re.M)
    assert re.search(r"^  \[replay\] +fifo +plugin 'multi_slots'$", out, re.M)
    assert re.search(r"^  \[replay\] +prioritized +plugin 'multi_slots'$", out, re.M)
    assert re.search(r"^  \[dataset\] +letter_count +plugin 'letter_count' \(skyrl-letter-count ", out, re.M)
    for text in [
        "  sampler.name: a sampler name; default 'greedy'; value 'greedy'\n",
        "  sampler.top_p: a number; default 1.0; value 1.0\n"
        "      probability mass to sample from (in (0, 1])  [plugin 'multi_slots']\n",
        "  replay.strategies: an array of replay strategy names; default (required); value ['fifo', 'prioritized']\n"
        "      selected: 'fifo', 'prioritized'  [host]\n",
        "  replay.fifo.capacity: an integer; default 100; value 5\n      batches kept (>= 1)  [plugin 'multi_slots']\n",
    ]:
        assert text in out, f"{text!r} not in:\n{out}"


def test_multi_slot_top_p_boundaries(multi: Any, skyrl_cli: Any, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(MULTI_HEAD + '\n[replay]\nstrategies = []\n\n[sampler]\ntop_p = 1\n')
    assert skyrl_cli("validate", str(path)).exit_code == 0
    tiny = skyrl_cli("validate", str(path), "--set", "sampler.top_p=1e-9")
    assert tiny.exit_code == 0, tiny.stderr


# ---------------------------------------------------------------------------
# locate_keys directly: the line of every key and table.
# ---------------------------------------------------------------------------


def test_locate_keys() -> None:
    text = toml(
        '''
        [job]
        kind = "reward_check"  # a comment with [brackets]
        name = """
        [not_a_table]
        not_a_key = 1
        """
        tags = [
          ["a", "]"],
          { x = 1 },
        ]
        seed = 1

        [dataset]
        name = 'it"s'
        "quoted.key" = 2
        a.b = 3
        '''
    )
    assert locate_keys(text) == {
        "job": 1,
        "job.kind": 2,
        "job.name": 3,
        "job.tags": 7,
        "job.seed": 11,
        "dataset": 13,
        "dataset.name": 14,
        "dataset.quoted.key": 15,
        "dataset.a.b": 16,
    }
