"""Evaluation while training ([eval]) and alone (skyrl eval): the estimators against
brute force, a job that evaluates before its first step, every N steps and after its last
without changing what it trains, and `skyrl eval` giving the same numbers for the same
weights."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from skyrl_host.jobs.evaluation import group_metrics, majority_right, pass_at_k
from skyrl_host.testing import learning_metrics


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (c of them correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001) and pass_at_k(1000, 0, 100) == 0.0
    assert pass_at_k(256, 3, 64) == pytest.approx(1 - math.comb(253, 64) / math.comb(256, 64))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_and_the_metrics_of_a_group() -> None:
    assert majority_right(["4", "5", "4", None], [True, False, True, False])
    assert not majority_right(["5", "5", "4"], [False, False, True])
    assert majority_right(["4", "5"], [True, False])  # a tie goes to the answer given first
    assert not majority_right([None, None], [True, True])  # no extracted answer votes
    groups = [
        {"correct": [True, False, False, False], "rewards": [1.0, 0.0, 0.5, 0.0], "lengths": [3, 4, 5, 4],
         "truncated": [False, False, True, False], "answers": ["7", "8", "8", None]},
        {"correct": [False, False, True, True], "rewards": [0.0, 0.0, 1.0, 1.0], "lengths": [2, 2, 2, 2],
         "truncated": [False] * 4, "answers": ["1", "2", "3", "3"]},
    ]
    m = group_metrics(groups, [1, 4])
    assert m["prompts"] == 2 and m["pass_at_1"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["pass_at_4"] == 1.0 and m["mean_at_1"] == 0.5 and m["mean_at_4"] == pytest.approx(3 / 8)
    assert m["maj_at_1"] == 0.5 and m["maj_at_4"] == 0.5  # "8" wins the first (wrong), "3" the second (right)
    assert m["reward_mean"] == pytest.approx(3.5 / 8) and m["response_length_mean"] == 3.0
    assert m["truncated_fraction"] == 1 / 8


def _rows(tmp_path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k" if i % 2 else "cais/mmlu",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? End with #### and the number."}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i) if i % 2 else "B"}} for i in range(12)]
    path = tmp_path / "heldout.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _job(skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path, name, *, evaluates=True):
    data = _rows(tmp_path)
    return skyrl_tiny_rl_job(
        tmp_path, name, job={"steps": 3, "batch_size": 4, "n_samples": 2, "max_new_tokens": 6, "checkpoint_every": 0},
        model={"family": "qwen", "path": skyrl_real_checkpoint("qwen3"), "preset": None},
        dataset={"name": "files", "path": data, "min_len": None, "max_len": None, "prefix": None},
        backend={"micro_batch_tokens": 512},
        **({"eval": {"every": 2, "n_samples": 4, "k": [1, 4], "temperature": 1.0, "name": "files", "path": data}}
           if evaluates else {}))


@pytest.mark.slow
def test_a_job_evaluates_before_every_n_and_after_the_last_step_and_trains_the_same(
        skyrl_cli, skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path) -> None:
    job = _job(skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path, "with_eval")
    result = skyrl_cli("run", str(job.path))
    assert result.exit_code == 0, result.stderr
    rows = job.rows()
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    evaluated = [r["step"] for r in rows if "eval/pass_at_1" in r]
    assert evaluated == [0, 2, 3]  # before training, every 2 steps, after the last
    for r in rows:
        if r["step"] in evaluated:
            assert r["eval/prompts"] == 12.0 and r["eval/openai/gsm8k/prompts"] == 6.0 and r["eval/cais/mmlu/prompts"] == 6.0
            assert 0.0 <= r["eval/mean_at_4"] <= r["eval/pass_at_4"] <= 1.0 and "eval/maj_at_4" in r
            assert r["eval/pass_at_1"] <= r["eval/pass_at_4"]
    assert (job.out / "plot.png").stat().st_size > 10_000

    plain = _job(skyrl_tiny_rl_job, skyrl_real_checkpoint, tmp_path, "without_eval", evaluates=False)
    assert skyrl_cli("run", str(plain.path)).exit_code == 0
    strip = lambda r: {k: v for k, v in learning_metrics(r).items() if not k.startswith("eval/")}  # noqa: E731
    assert [strip(r) for r in plain.rows()] == [strip(r) for r in rows if r["step"] > 0]

    # skyrl eval: the same weights and seed give the same numbers, without training or reporting.
    out = tmp_path / "alone.json"
    alone = skyrl_cli("eval", str(job.path), "--checkpoint", str(job.out), "--out", str(out))
    assert alone.exit_code == 0, alone.stderr
    assert "pass@4" in alone.stdout and "openai/gsm8k" in alone.stdout
    found = json.loads(out.read_text())
    last = rows[-1]
    assert {f"eval/{k}": v for k, v in found["overall"].items()} == {k: last[k] for k in last if k.startswith(
        "eval/") and k.count("/") == 1 and k not in ("eval/wall_time_s", "eval/gen_tokens_per_s")}
    assert found["by_data_source"]["cais/mmlu"]["pass_at_1"] == last["eval/cais/mmlu/pass_at_1"]
    start = skyrl_cli("eval", str(job.path), "--model", str(skyrl_real_checkpoint("qwen3")), "--out", str(out))
    assert start.exit_code == 0, start.stderr
    assert json.loads(out.read_text())["overall"]["pass_at_4"] == rows[0]["eval/pass_at_4"]
    assert [r["step"] for r in job.rows()] == [0, 1, 2, 3]  # nothing reported by skyrl eval


def test_eval_tables_that_cannot_work_are_refused_at_validate(skyrl_cli, skyrl_tiny_rl_job, tmp_path) -> None:
    job = skyrl_tiny_rl_job(tmp_path, "bad", eval={"n_samples": 2, "k": [1, 4], "name": "reverse_digits",
                                                   "min_len": 3, "max_len": 4, "prefix": ""},
                            job={"mode": "async"})
    result = skyrl_cli("validate", str(job.path))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "eval.k: pass@4 needs at least 4 samples per prompt; n_samples is 2" in result.stderr
    result = skyrl_cli("validate", str(job.path), "--set", "eval.k=[1, 2]")
    assert result.exit_code == 2 and 'eval: [eval] evaluates between the steps of a synchronous job' in result.stderr
    result = skyrl_cli("validate", str(job.path), "--set", "eval.k=[1, 2]", "--set", 'job.mode="sync"',
                       "--set", 'eval.name="revers_digits"')
    assert result.exit_code == 2 and "eval.name: unknown dataset 'revers_digits' (did you mean 'reverse_digits'?)" in result.stderr
    # A generated dataset has no fixed rows: how many prompts to evaluate must be said.
    result = skyrl_cli("run", str(job.path), "--set", "eval.k=[1, 2]", "--set", 'job.mode="sync"')
    assert result.exit_code == 2 and "eval.prompts: the evaluation's dataset is generated" in result.stderr
    no_eval = skyrl_tiny_rl_job(tmp_path, "plain")
    result = skyrl_cli("eval", str(no_eval.path))
    assert result.exit_code == 2 and "eval: the job has no [eval] table" in result.stderr


def test_a_job_kind_that_does_not_evaluate_refuses_the_table(skyrl_cli, tmp_path) -> None:
    job = tmp_path / "check.toml"
    job.write_text('[job]\nkind = "reward_check"\n[dataset]\nname = "arithmetic"\n[eval]\nname = "arithmetic"\n')
    result = skyrl_cli("validate", str(job))
    assert result.exit_code == 2
    assert "check.toml:5: eval: job kind 'reward_check' does not evaluate: it takes no [eval] table" in result.stderr
