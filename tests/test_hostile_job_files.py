"""Job files a careless user (or a generator gone wrong) writes: ``skyrl validate`` exits
0 or 2 with one message, never a traceback and never a hang, and what it passes runs.
The named cases each passed validate, or crashed it, on 82d5798 (issue 35, finding 9);
the fuzzing part mutates the tiny job's values and tables with hypothesis."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skyrl_host.cli import main
from skyrl_host.testing import TINY_RL_JOB, tiny_rl_job

FUZZ_EXAMPLES = 120


@pytest.fixture(scope="module")
def host():
    from skyrl_host.plugins import build_host

    return build_host()


def validate(host, path: pathlib.Path, capsys) -> tuple[int, str]:
    code = main(["validate", str(path)], host=host)
    err = capsys.readouterr().err
    return code, err


def one_message(err: str) -> bool:
    return err.startswith("error") and "Traceback" not in err


@pytest.mark.parametrize("name, edit, found", [
    ("deep arrays", lambda t: t.replace("[job]\n", "[job]\nx = " + "[" * 5000 + "]" * 5000 + "\n"), "nested too deep"),
    ("deep inline tables", lambda t: t.replace("[job]\n", "[job]\nx = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n"),
     "nested too deep"),
    ("lr = inf", lambda t: t.replace("lr = 0.0005", "lr = inf"), "a finite number is needed"),
    ("lr = nan", lambda t: t.replace("lr = 0.0005", "lr = nan"), "a finite number is needed"),
    ("seed = 2**64", lambda t: t.replace("seed = 3", "seed = 18446744073709551616"), "does not fit a 64-bit integer"),
    ("a NUL in output_dir", lambda t: t.replace('output_dir = "', 'output_dir = "a\\u0000'), "NUL character"),
    ("batch_size = 2**63-1", lambda t: t.replace("batch_size = 8", "batch_size = 9223372036854775807"),
     "expected a value <= 1048576"),
    ("steps = 1e32", lambda t: t.replace("steps = 3", "steps = 1e32"), "expected an integer, found float 1e+32"),
    ("steps = 2**62", lambda t: t.replace("steps = 3", "steps = 4611686018427387904"),
     "expected a value <= 1099511627776"),
])
def test_job_files_that_crashed_or_hung_get_one_message_and_exit_2(tmp_path, host, capsys, name, edit, found) -> None:
    job = tiny_rl_job(tmp_path, "job")
    job.path.write_text(edit(job.path.read_text()))
    code, err = validate(host, job.path, capsys)
    assert code == 2 and one_message(err), (name, code, err[-2000:])
    assert found in err, (name, err)


def test_a_byte_order_mark_is_not_an_error(tmp_path, host, capsys) -> None:
    job = tiny_rl_job(tmp_path, "job")
    job.path.write_bytes(b"\xef\xbb\xbf" + job.path.read_bytes())
    code, err = validate(host, job.path, capsys)
    assert code == 0, err


ODD_VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.booleans(),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.dictionaries(st.sampled_from(["a", "name", "lr"]), st.integers(min_value=0, max_value=3), max_size=2),
)


def toml_value(v) -> str:
    import json
    import math

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"


KEYS = [(section, key) for section, table in TINY_RL_JOB.items() for key in table] + [
    ("job", "extra"), ("backend", "micro_batch_tokens"), ("engine", "max_batch_size"), ("algorithm", "eps")]


def test_fuzzed_job_files_validate_with_exit_0_or_2_and_never_a_traceback(tmp_path_factory, host) -> None:
    """Up to FUZZ_EXAMPLES job files, each the tiny job with 1-3 values replaced by odd ones
    (huge or negative ints, NaN/inf, strings, arrays, tables) or new keys added."""
    import contextlib
    import io

    seen = {"examples": 0, "exit_0": 0, "exit_2": 0}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(edits=st.lists(st.tuples(st.sampled_from(KEYS), ODD_VALUES), min_size=1, max_size=3))
    def one(edits) -> None:
        tables: dict[str, dict] = {s: dict(t) for s, t in TINY_RL_JOB.items()}
        for (section, key), value in edits:
            tables.setdefault(section, {})[key] = value
        folder = tmp_path_factory.mktemp("fuzz")
        tables["job"]["output_dir"] = str(folder / "out")
        text = "".join(f"[{s}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items())
                       for s, t in tables.items())
        path = folder / "job.toml"
        path.write_text(text)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["validate", str(path)], host=host)  # an exception fails the test with its traceback
        seen["examples"] += 1
        seen[f"exit_{code}"] = seen.get(f"exit_{code}", 0) + 1
        assert code in (0, 2), (code, text, err.getvalue())
        if code == 2:
            assert one_message(err.getvalue()), err.getvalue()

    one()
    print(f"job-file fuzzing: {seen}")
    assert seen["examples"] >= FUZZ_EXAMPLES // 2 and seen["exit_2"] > 0, seen
