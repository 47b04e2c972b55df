"""A curriculum start length that admits no document is a user error: at bind time an
OptionError at ``start_max_len`` (the SFT job reports it located, exit code 2, no
traceback); an end below the start is refused by `skyrl validate`."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from skyrl_host.options import OptionError
from skyrl_datasets.curriculum import Curriculum, CurriculumConfig


def test_bind_refuses_a_start_below_the_shortest_document() -> None:
    c = Curriculum(CurriculumConfig(start_max_len=5))
    with pytest.raises(OptionError) as info:
        c.bind([np.full(10, 9, dtype=np.int32), np.zeros(0, np.int32), np.array([7, 12], np.int32)], 0)
    assert info.value.key == "start_max_len"
    assert str(info.value) == (
        "start_max_len: no document of at most 5 tokens: the shortest of the datasets has 7; "
        "raise start_max_len to at least 7"
    )
    ok = Curriculum(CurriculumConfig(start_max_len=7))
    ok.bind([np.full(10, 9, dtype=np.int32), np.array([7, 12], np.int32)], 0)
    assert ok.draw(1) == (1, 0)


JOB = """\
[job]
kind = "sft"
seed = 5
steps = 2
data_paths = ["{corpus}"]
tokens_per_step = 64
max_seq_len = 32
alphabet = "0123456789:"
threads = 1
output_dir = "{out}"

[model]
family = "qwen"
preset = "tiny"

[data]
strategy = "curriculum"
start_max_len = {start}
{extra}
[backend]
name = "torch"
micro_batch_tokens = 64
"""


@pytest.fixture
def corpus(tmp_path) -> pathlib.Path:
    from skyrl_datasets.corpus import CorpusWriter

    prefix = tmp_path / "docs"
    with CorpusWriter(str(prefix), vocab_size=8, eos_id=1, tokenizer="test ids") as writer:
        for n in range(6, 12):  # documents of 6..11 tokens
            writer.add([2 + (i % 5) for i in range(n - 1)] + [1])
    return prefix


def write_job(tmp_path, corpus, start, extra="") -> pathlib.Path:
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(corpus=corpus, out=tmp_path / "out", start=start, extra=extra))
    return path


def test_an_sft_job_with_a_start_below_every_document_is_a_user_error(skyrl_cli, corpus, tmp_path) -> None:
    path = write_job(tmp_path, corpus, start=3)
    result = skyrl_cli("run", str(path))
    assert result.exit_code == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {path}:")
    assert lines[-1].endswith(
        "start_max_len: no document of at most 3 tokens: the shortest of the datasets has 6; raise start_max_len to at least 6"
    )
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])["status"] == "failed"


@pytest.mark.parametrize(
    ("start", "extra", "expected"),
    [
        (0, "", "data.start_max_len: expected a value > 0, found 0"),
        (8, "end_max_len = 4", "data.end_max_len: expected at least start_max_len (8), found 4"),
    ],
)
def test_validate_refuses_bad_lengths(skyrl_cli, corpus, tmp_path, start, extra, expected) -> None:
    path = write_job(tmp_path, corpus, start=start, extra=extra)
    result = skyrl_cli("validate", str(path))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {path}:") and result.stderr.rstrip().endswith(expected)
