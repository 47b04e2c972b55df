"""Tests of the example plugin, written as a plugin author would, with the
fixtures of skyrl_host.testing (loaded automatically through pytest11)."""

from __future__ import annotations

import textwrap

import skyrl_letter_count
from skyrl_letter_count import LetterCount, LetterCountConfig

from skyrl_host.interfaces import Dataset, Task


def test_reward_exact_partial_and_wrong() -> None:
    ds = LetterCount(LetterCountConfig(partial_credit=0.5))
    task = Task(prompt="How many times does 'a' occur in 'banana'?", answer="3")
    assert ds.reward(task, "3") == 1.0
    assert ds.reward(task, " 3 apples") == 1.0
    assert ds.reward(task, "4") == 0.5
    assert ds.reward(task, "1") == 0.25
    assert ds.reward(task, "three") == 0.0
    assert ds.reward(task, "") == 0.0


def test_batches_are_reproducible_and_answers_correct() -> None:
    ds = LetterCount(LetterCountConfig(min_len=3, max_len=5, alphabet="ab"), seed=7)
    assert isinstance(ds, Dataset)
    first = ds.batch(1, 16)
    assert first == LetterCount(LetterCountConfig(min_len=3, max_len=5, alphabet="ab"), seed=7).batch(1, 16)
    assert first != ds.batch(2, 16)
    for t in first:
        assert 3 <= len(t.meta["word"]) <= 5
        assert t.answer == str(t.meta["word"].count(t.meta["letter"]))


def test_registered_through_installed_entry_point(skyrl_host) -> None:
    reg = skyrl_host.registry.get("datasets", "letter_count")
    assert reg.factory is LetterCount
    assert reg.origin.distribution == "skyrl-letter-count"
    assert skyrl_host.records["letter_count"].entry_point == "skyrl_letter_count"
    assert skyrl_host.pm.get_plugin("letter_count") is skyrl_letter_count


def test_bad_config_is_reported_with_key_paths(skyrl_cli, tmp_path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        textwrap.dedent(
            """\
            [job]
            kind = "reward_check"

            [dataset]
            name = "letter_count"
            alphabet = "a"
            partial_credit = 1.5
            """
        )
    )
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    assert f"{job}:6: dataset.alphabet: expected at least 2 distinct letters, found 'a'" in result.stderr
    assert f"{job}:7: dataset.partial_credit: expected a value in [0, 1), found 1.5" in result.stderr
    assert "Traceback" not in result.stderr


def test_reward_check_job_passes(skyrl_cli, tmp_path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        f'[job]\nkind = "reward_check"\nsteps = 3\nbatch_size = 8\noutput_dir = "{tmp_path / "run"}"\n'
        '[dataset]\nname = "letter_count"\n'
    )
    result = skyrl_cli("run", str(job))
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "run" / "metrics.jsonl").exists()
