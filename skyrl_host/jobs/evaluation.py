"""Evaluation while training (``[eval]``) and of a checkpoint alone (``skyrl eval``).

The prompts are the ``[eval]`` dataset's: every row of a dataset with a fixed list of
rows (:class:`~skyrl_host.interfaces.FiniteDataset`, e.g. ``files``), or the first
``prompts`` of a generated one. Each is sampled ``n_samples`` times with the job's
engine (no second copy of the model) and sampler (or a temperature of ``[eval]``'s own),
with a seed that is the same at every evaluation, so two evaluations differ only by the
weights. A sample is correct when its reward is 1.

Metrics, overall and per data source (:class:`~skyrl_host.interfaces.DataSources`):

- ``pass_at_K``: the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, K) / C(n, K)``
  for a prompt with ``c`` correct samples of ``n``, averaged over the prompts;
- ``mean_at_K``: the accuracy of the first ``K`` samples of each prompt;
- ``maj_at_K``: the first ``K`` samples vote with the answers the reward extracts
  (:class:`~skyrl_host.interfaces.AnswerExtraction`; the most frequent wins, ties to the
  earliest); right when a sample giving the winning answer is correct;
- ``reward_mean``, ``response_length_mean``, ``truncated_fraction``, ``prompts``.

Names are ``eval/<metric>`` and ``eval/<data source>/<metric>`` (``@`` is spelled
``_at_``, which every tracker accepts).
"""

from __future__ import annotations

import collections
import math
import re
import sys
import time
from typing import Any, Sequence

from skyrl_host.contracts import has
from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import AnswerExtraction, DataSources, FiniteDataset

EVAL_SEED_OFFSET = 0x5EED_E7A1  # the evaluation dataset's seed: the job's plus this (other prompts than training's)
_UNSAFE = re.compile(r"[^A-Za-z0-9_./-]+")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from
    ``n``, of which ``c`` are correct, is correct: ``1 - C(n-c, k) / C(n, k)`` (computed
    as a product, stable for large ``n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def majority_right(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the most frequent answer (ties: the one given first; None answers do not
    vote) belongs to a correct sample."""
    votes = collections.Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return any(ok for a, ok in zip(answers, correct) if a == winner)


def group_metrics(groups: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, float]:
    """The metrics of a list of prompts' results (``correct``, ``rewards``, ``lengths``,
    ``truncated``, ``answers`` per prompt)."""
    out: dict[str, float] = {"prompts": float(len(groups))}
    for k in ks:
        out[f"pass_at_{k}"] = sum(pass_at_k(len(g["correct"]), sum(g["correct"]), k) for g in groups) / len(groups)
        out[f"mean_at_{k}"] = sum(sum(g["correct"][:k]) / k for g in groups) / len(groups)
        if all(g["answers"] is not None for g in groups):
            out[f"maj_at_{k}"] = sum(majority_right(g["answers"][:k], g["correct"][:k]) for g in groups) / len(groups)
    samples = sum(len(g["rewards"]) for g in groups)
    out["reward_mean"] = sum(sum(g["rewards"]) for g in groups) / samples
    out["response_length_mean"] = sum(sum(g["lengths"]) for g in groups) / samples
    out["truncated_fraction"] = sum(sum(g["truncated"]) for g in groups) / samples
    return out


class Evaluation:
    """One evaluation set-up: its prompts, fixed; :meth:`__call__` evaluates the engine's
    current weights and returns the metrics (``eval/...``)."""

    def __init__(self, options: Any, dataset: Any, *, engine: Any, sampler: Any, prompts: Any, stop_token_ids: Any,
                 max_new_tokens: int, seed: int, where: str = "eval", show_progress: bool = True) -> None:
        self.options, self.dataset, self.engine, self.sampler = options, dataset, engine, sampler
        self.prompts, self.stop = prompts, set(int(t) for t in stop_token_ids)
        self.max_new_tokens = options.max_new_tokens or max_new_tokens
        self.seed, self.show_progress = seed, show_progress
        if has(dataset, FiniteDataset):
            tasks = list(dataset.rows())
            self.tasks = tasks[: options.prompts] if options.prompts else tasks
        elif options.prompts:
            self.tasks = list(dataset.batch(1, options.prompts))
        else:
            raise UserError(Problem("the evaluation's dataset is generated (it has no fixed list of rows): "
                                    "set how many prompts to evaluate, e.g. prompts = 64", key=f"{where}.prompts"))
        if not self.tasks:
            raise UserError(Problem("the evaluation's dataset holds no prompts", key=f"{where}.name"))
        self.encoded = prompts.encode(self.tasks)
        self.extracts = has(dataset, AnswerExtraction)
        self.sources = [dataset.data_source(t) if has(dataset, DataSources) else None for t in self.tasks]
        self.last: dict[str, Any] = {}

    def _seed(self, chunk: int) -> int:
        return (self.seed * 1_000_003 + EVAL_SEED_OFFSET + chunk * 7_919) % (2**63 - 1)

    def __call__(self, label: str = "") -> dict[str, float]:
        opts = self.options
        tokenizer = self.prompts.tokenizer
        groups: list[dict[str, Any]] = []
        chunks = range(0, len(self.tasks), opts.batch_prompts)
        t0 = time.perf_counter()
        gen_tokens = 0
        progress = _progress(f"eval {label}".strip(), len(self.tasks)) if self.show_progress else None
        try:
            for c, start in enumerate(chunks):
                tasks = self.tasks[start : start + opts.batch_prompts]
                batch = self.engine.generate(self.encoded[start : start + len(tasks)], n=opts.n_samples,
                                             sampler=self.sampler, max_new_tokens=self.max_new_tokens, seed=self._seed(c))
                gen_tokens += int(batch.loss_mask.sum())
                results = [{"correct": [], "rewards": [], "lengths": [], "truncated": [],
                            "answers": [] if self.extracts else None} for _ in tasks]
                for i in range(batch.n_sequences):
                    g = int(batch.group_ids[i])
                    task, result = tasks[g], results[g]
                    ids = [int(t) for t in batch.response(i) if int(t) not in self.stop]
                    text = tokenizer.decode(ids, skip_special_tokens=False)
                    reward = float(self.dataset.reward(task, text))
                    result["rewards"].append(reward)
                    result["correct"].append(reward >= 1.0)
                    result["lengths"].append(int(batch.response_lens[i]))
                    result["truncated"].append(bool(batch.truncated[i]))
                    if self.extracts:
                        result["answers"].append(self.dataset.extract_answer(task, text))
                groups += results
                if progress is not None:
                    progress[0].update(progress[1], advance=len(tasks))
        finally:
            if progress is not None:
                progress[0].stop()
        seconds = time.perf_counter() - t0
        overall = group_metrics(groups, opts.k)
        by_source: dict[str, dict[str, float]] = {}
        sources = sorted({s for s in self.sources if s is not None})
        for source in sources:
            mine = [g for g, s in zip(groups, self.sources) if s == source]
            by_source[source] = group_metrics(mine, opts.k)
        self.last = {"overall": overall, "by_data_source": by_source, "seconds": seconds,
                     "gen_tokens_per_s": gen_tokens / max(seconds, 1e-9), "n_samples": opts.n_samples,
                     "k": list(opts.k), "max_new_tokens": self.max_new_tokens}
        metrics = {f"eval/{name}": value for name, value in overall.items()}
        if sources:
            for source, values in by_source.items():
                safe = _UNSAFE.sub("_", source).strip("/") or "_"
                metrics.update({f"eval/{safe}/{name}": value for name, value in values.items()})
        metrics["eval/wall_time_s"] = seconds
        metrics["eval/gen_tokens_per_s"] = self.last["gen_tokens_per_s"]
        return metrics


def eval_sampler(host: Any, job_sampler: Any, temperature: float | None) -> Any:
    """The evaluation's sampler: the job's, or (``temperature`` given) the one a job file
    would get from ``[sampler] name = "temperature"`` with that temperature (``greedy`` at 0)."""
    if temperature is None:
        return job_sampler
    from skyrl_host.config import Located, structure_table

    if temperature == 0:
        return host.get("samplers", "greedy").create()
    reg = host.get("samplers", "temperature")
    out = Located("[eval]", {})
    config = structure_table(reg.config, {"temperature": float(temperature)}, "eval", out)
    if config is None:
        raise UserError(out.problems)
    return reg.create(config)


def find_checkpoint(path: str) -> tuple[int, Any]:
    """``(step, folder)`` of ``path``: a checkpoint folder (``.../checkpoints/step_000010``) or
    a run's output folder (its latest checkpoint); a UserError otherwise."""
    import pathlib

    from skyrl_host.checkpoints import _STEP, latest_checkpoint

    folder = pathlib.Path(path)
    match = _STEP.match(folder.name)
    if match and folder.is_dir():
        return int(match.group(1)), folder
    found = latest_checkpoint(folder) if folder.is_dir() else None
    if found is None:
        raise UserError(Problem("not a checkpoint (a checkpoints/step_NNNNNN folder) nor a run's output folder "
                                "holding one", file=str(path)))
    return found


def evaluate_job(host: Any, spec: Any, *, checkpoint: str | None = None) -> dict[str, Any]:
    """``skyrl eval``: the job's ``[eval]`` on the weights of ``checkpoint`` (or the job's
    model), without training or reporting anything."""
    from skyrl_host.interfaces import StandaloneEvaluation
    from skyrl_host.kinds import EVAL_TABLE
    from skyrl_host.runner import Run

    if EVAL_TABLE not in spec.kind.slots:
        raise UserError(Problem(f"job kind {spec.kind.name!r} does not evaluate", file=str(spec.path), key="job.kind"))
    if spec.eval is None:
        raise UserError(Problem("the job has no [eval] table: add one naming the evaluation's dataset "
                                "(docs/evaluation.md)", file=str(spec.path), key=EVAL_TABLE))
    run = Run(spec=spec, host=host, output_dir=spec.output_dir, total_steps=spec.job.steps)
    if checkpoint is not None:
        run.resume_step, run.resume_path = find_checkpoint(checkpoint)
    driver = spec.kind.create(run)
    if not has(driver, StandaloneEvaluation):
        raise UserError(Problem(f"job kind {spec.kind.name!r} cannot evaluate alone", file=str(spec.path)))
    return dict(driver.evaluate_alone())


def render_table(result: Any) -> Any:
    """The results as a rich Table: a row per metric, a column overall and one per data source."""
    from rich.table import Table

    ks = result["k"]
    table = Table(title=f"evaluation: {result['n_samples']} samples per prompt, {result['seconds']:.1f} s")
    names = ["prompts"] + [f"{m}_at_{k}" for m in ("pass", "maj", "mean") for k in ks] + [
        "reward_mean", "response_length_mean", "truncated_fraction"]
    columns = [("all", result["overall"])] + list(result["by_data_source"].items())
    table.add_column("metric")
    for name, _ in columns:
        table.add_column(name, justify="right")
    for name in names:
        if name in result["overall"]:
            table.add_row(name.replace("_at_", "@"),
                          *(f"{v[name]:.0f}" if name == "prompts" else f"{v[name]:.3f}" for _, v in columns))
    return table


def _progress(title: str, total: int) -> tuple[Any, Any] | None:
    """A rich progress bar on stderr (prompts evaluated, rate, ETA), transient."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(file=sys.stderr)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
                        TimeRemainingColumn(), console=console, transient=True)
    task = progress.add_task(title, total=total)
    progress.start()
    return progress, task
