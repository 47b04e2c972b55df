"""Where the ``rl`` job's rollouts come from: one :class:`RolloutSource`, chosen once in
``RLDriver.build``.

- :class:`SingleTurnSource`: a step's prompts, ``n_samples`` responses each, generated in
  one batch and scored by the dataset (with dynamic sampling's refill rounds);
- :class:`MultiTurnSource`: a step's trajectories through a multi-turn environment;
- :class:`WaitingSource` (``mode = "async"``, ``stale_samples = "wait"``): one of those
  two run ahead in a thread, each step generated with the weights the staleness bound
  names (:class:`skyrl_host.asyncrl.RolloutPipeline`);
- :class:`DroppingSource` (``stale_samples = "drop"``): one of those two run ahead with
  the newest weights, rollouts too stale when taken dropped and generated again
  (:class:`skyrl_host.asyncrl.DroppingPipeline`).

A source hands out :class:`Rollout` records and keeps what a checkpoint must hold of
them (``state_dict`` / ``load_state_dict``): nothing for the synchronous two, the rollouts
generated ahead for the asynchronous two.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Protocol

import attrs

from skyrl_host.contracts import has
from skyrl_host.errors import UserError
from skyrl_host.interfaces import RewardMetrics


@attrs.define
class Rollout:
    """One step's rollout: the sequences to train on, their rewards (shaped, one per
    sequence), the step's rollout metrics, and the generation's seconds and tokens."""

    batch: Any
    rewards: Any
    metrics: dict[str, float]
    gen_time: float
    gen_tokens: int

    def to_state(self) -> tuple:
        """As a checkpoint holds it (a tuple: the layout checkpoints have always had)."""
        return (self.batch, self.rewards, dict(self.metrics), float(self.gen_time), int(self.gen_tokens))

    @classmethod
    def from_state(cls, state: Any) -> "Rollout":
        batch, rewards, metrics, gen_time, gen_tokens = state
        return cls(batch, rewards, dict(metrics), float(gen_time), int(gen_tokens))


class RolloutSource(Protocol):
    def take(self, step: int) -> Rollout:
        """Step ``step``'s rollout (generating it, or waiting for the thread that does)."""

    def after_step(self, step_time: float) -> Mapping[str, float]:
        """Metrics of the step just ended that only the source knows (the engine's idle time)."""

    def state_dict(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint after ``step`` keeps of this source (None: nothing)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before the first :meth:`take`); a
        ValueError says why a state cannot be restored."""

    def close(self) -> None: ...


def step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The generation seed of a step: a pure function, so resumes reproduce it."""
    return (seed * 1_000_003 + step * 9_973 + round_ * 101) % (2**63 - 1)


def encode_task(tokenizer: Any, task: Any) -> list[int]:
    """A task's prompt ids: a plain task's ``prompt`` encoded as it is; a chat task's
    ``messages`` rendered with the tokenizer's chat template, the assistant's turn opened
    (``add_generation_prompt=True``)."""
    if task.messages is None:
        return list(tokenizer.encode(task.prompt))
    ids = tokenizer.apply_chat_template([dict(m) for m in task.messages], add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(i) for i in ids]


def check_chat_template(tokenizer: Any, messages: Any) -> None:
    """Raise a UserError naming the tokenizer's folder unless its chat template renders
    ``messages`` and opens the assistant's turn (``add_generation_prompt`` adds text)."""
    messages = [dict(m) for m in messages]
    name = str(tokenizer.name_or_path or "")
    where = f"the tokenizer of [model] path {name!r}" if name else "the model's tokenizer (a preset's, built for characters)"
    if not tokenizer.chat_template:
        fix = ("add a chat template to that folder (a chat_template.jinja file, or the chat_template key of "
               "tokenizer_config.json)") if name else "set [model] path to a checkpoint with a chat template"
        raise UserError(
            f"[dataset]: the prompts are chats (messages), but {where} has no chat template; {fix}, "
            "or give the dataset plain-text prompts"
        )
    try:
        opened = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template that fails to render (a jinja error, raise_exception)
        raise UserError(f"[dataset]: the chat template of {where} cannot render the prompt's messages: {exc}") from None
    if opened == closed:
        raise UserError(
            f"[dataset]: the chat template of {where} renders no generation prompt (add_generation_prompt=True adds "
            "nothing, so the model would not start the assistant's turn); use a template that opens it, e.g. ending "
            "with {% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
        )


class Prompts:
    """Turns tasks into prompt ids with the policy's tokenizer, checking its chat template
    against the first chat it meets (unless ``checked``: the driver checked it before any
    model was read)."""

    def __init__(self, tokenizer: Any, *, checked: bool = False):
        self.tokenizer, self.checked = tokenizer, checked

    def check(self, tasks: list[Any]) -> None:
        if not self.checked and any(t.messages is not None for t in tasks):
            check_chat_template(self.tokenizer, next(t.messages for t in tasks if t.messages is not None))
            self.checked = True

    def encode(self, tasks: list[Any]) -> list[list[int]]:
        self.check(tasks)
        return [encode_task(self.tokenizer, t) for t in tasks]


class RewardParts:
    """The job's reward parts (``[reward] parts``, each a
    :class:`~skyrl_host.interfaces.RewardPart`): a completion's reward is the sum of the
    parts' scores times their weights. A part that fails stops the job naming the part."""

    def __init__(self, parts: list[tuple[str, Any]]):
        self.parts = parts
        # The default (the dataset's reward alone, weight 1) adds no metric: jobs without
        # [reward] report what they always did.
        self.report = not (len(parts) == 1 and parts[0][0] == "dataset" and parts[0][1].weight == 1.0)

    def score(self, tasks: list[Any], completions: list[str]) -> tuple[Any, dict[str, float]]:
        import numpy as np

        total = np.zeros(len(completions), dtype=np.float64)
        metrics: dict[str, float] = {}
        for name, part in self.parts:
            try:
                values = np.asarray(part.score(tasks, completions), dtype=np.float64)
            except UserError:
                raise
            except Exception as exc:
                raise RuntimeError(f"[reward] part {name!r} failed to score {len(completions)} completions: "
                                   f"{exc!r}") from exc
            if values.shape != (len(completions),) or not np.isfinite(values).all():
                raise RuntimeError(f"[reward] part {name!r} returned {values.shape[0] if values.ndim else 'no'} "
                                   f"scores for {len(completions)} completions, or a score that is not finite")
            total += part.weight * values
            if self.report:
                metrics[f"reward/{name}_mean"] = float(values.mean())
            if has(part, RewardMetrics):  # the part's counters (a judge's requests, fallbacks, ...)
                metrics.update({k: float(v) for k, v in part.reward_metrics().items()})
        return total.astype(np.float32), metrics


@attrs.frozen
class RolloutParts:
    """What a synchronous source generates with: the job's plugin products, its sizes and seed."""

    dataset: Any
    engine: Any
    sampler: Any
    algorithm: Any
    prompts: Prompts
    stop_token_ids: Any
    batch_size: int
    n_samples: int
    max_new_tokens: int
    seed: int
    rewards: RewardParts | None = None  # [reward] parts (None: the dataset's reward alone)

    def dataset_metrics(self) -> dict[str, float]:
        """The dataset's own reward metrics (e.g. answers the math verifier could not parse)."""
        return {k: float(v) for k, v in self.dataset.reward_metrics().items()} if has(self.dataset, RewardMetrics) else {}


class _Synchronous:
    """What the synchronous sources share: nothing for the checkpoint, nothing after a step."""

    def after_step(self, step_time: float) -> Mapping[str, float]:
        return {}

    def state_dict(self, step: int) -> None:
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class SingleTurnSource(_Synchronous):
    """One response per prompt, ``n_samples`` per prompt, in one generation; the dataset
    scores them; the algorithm shapes the rewards and keeps groups (dynamic sampling
    refills the step with further prompts of the same step until it is full)."""

    def __init__(self, parts: RolloutParts):
        self.parts = parts

    def _generate(self, step: int, round_: int, tasks: list[Any], group_offset: int) -> Any:
        p = self.parts
        return p.engine.generate(
            p.prompts.encode(tasks), n=p.n_samples, sampler=p.sampler, max_new_tokens=p.max_new_tokens,
            seed=step_seed(p.seed, step, round_), group_offset=group_offset,
        )

    def _score(self, batch: Any, tasks: list[Any], group_offset: int) -> dict[str, float]:
        import numpy as np

        p = self.parts
        stop = set(p.stop_token_ids)
        tokenizer = p.prompts.tokenizer
        texts, owners = [], []
        for i in range(batch.n_sequences):
            ids = [int(t) for t in batch.response(i) if int(t) not in stop]
            # Only the stop tokens are dropped: any other special token the policy emits
            # stays in the text the reward sees (else emitting <unk> would be free).
            texts.append(tokenizer.decode(ids, skip_special_tokens=False))
            owners.append(tasks[int(batch.group_ids[i]) - group_offset])
        if p.rewards is None:
            batch.rewards = np.asarray([float(p.dataset.reward(t, x)) for t, x in zip(owners, texts)], dtype=np.float32)
            return {}
        batch.rewards, metrics = p.rewards.score(owners, texts)
        return metrics

    def take(self, step: int) -> Rollout:
        import numpy as np

        from skyrl_host.rollout import RolloutBatch

        p = self.parts
        algorithm = p.algorithm
        tasks = list(p.dataset.batch(step, p.batch_size))
        gen_time, gen_tokens = 0.0, 0
        g0 = time.perf_counter()
        first = self._generate(step, 0, tasks, 0)
        gen_time += time.perf_counter() - g0
        gen_tokens += int(first.loss_mask.sum())
        part_metrics = self._score(first, tasks, 0)
        raw = first.rewards.copy()
        shaped = np.asarray(algorithm.shape_rewards(first, p.max_new_tokens), dtype=np.float32)
        # Dynamic sampling judges groups by their outcome (raw rewards), not by shaping.
        keep = np.asarray(algorithm.keep(first, raw), dtype=bool)
        kept, kept_rewards = [first.select(np.flatnonzero(keep))], [shaped[keep]]
        n_groups = len(np.unique(first.group_ids[keep]))
        rounds = 0
        dynamic, max_rounds = bool(algorithm.dynamic_sampling), int(algorithm.max_refill_rounds)
        # Dynamic sampling: refill with further prompts of this step until the batch is full.
        while dynamic and n_groups < p.batch_size and rounds < max_rounds:
            rounds += 1
            more = list(p.dataset.batch(step, p.batch_size * (rounds + 1)))[p.batch_size * rounds :]
            offset = p.batch_size * rounds
            g0 = time.perf_counter()
            extra = self._generate(step, rounds, more, offset)
            gen_time += time.perf_counter() - g0
            gen_tokens += int(extra.loss_mask.sum())
            self._score(extra, more, offset)
            ex_shaped = np.asarray(algorithm.shape_rewards(extra, p.max_new_tokens), dtype=np.float32)
            ex_keep = np.asarray(algorithm.keep(extra, extra.rewards), dtype=bool)
            groups = [g for g in dict.fromkeys(extra.group_ids[ex_keep].tolist())][: p.batch_size - n_groups]
            take = np.flatnonzero(np.isin(extra.group_ids, groups) & ex_keep)
            kept.append(extra.select(take))
            kept_rewards.append(ex_shaped[take])
            n_groups += len(groups)
        metrics: dict[str, float] = {
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.std()),
            "accuracy": float((raw >= 1.0).mean()),
            "response_length_mean": float(first.response_lens.mean()),
            "truncated_fraction": float(first.truncated.mean()),
            "weight_version": float(first.versions.min()),  # the weights that generated this step's rollouts
            "kept_groups": float(n_groups),
            "refill_rounds": float(rounds),
            **part_metrics,
            **p.dataset_metrics(),
        }
        batch = RolloutBatch.concat(kept)
        return Rollout(batch, np.concatenate(kept_rewards).astype(np.float32), metrics, gen_time, gen_tokens)


class MultiTurnSource(_Synchronous):
    """The step's trajectories (``n_samples`` per record: the GRPO groups) through a
    multi-turn environment; no reward shaping and no refills (dynamic sampling still drops
    uniform groups)."""

    def __init__(self, parts: RolloutParts, multiturn: Any):
        self.parts, self.multiturn = parts, multiturn

    def take(self, step: int) -> Rollout:
        import numpy as np

        from skyrl_host.rollout import RolloutBatch

        p = self.parts
        tasks = list(p.dataset.batch(step, p.batch_size))
        p.prompts.check(tasks)
        out = self.multiturn.run(tasks, p.n_samples, step_seed(p.seed, step))
        batch, raw = out.batch, out.rewards
        n_groups = 0
        if batch is not None and batch.n_sequences:
            keep = np.asarray(p.algorithm.keep(batch, raw), dtype=bool)
            n_groups = len(np.unique(batch.group_ids[keep]))
            metrics_batch = batch
            batch, rewards = batch.select(np.flatnonzero(keep)), raw[keep]
        else:
            batch = metrics_batch = RolloutBatch.from_sequences([], [], [], group_ids=[])
            rewards = raw
        gen_lens = np.add.reduceat(metrics_batch.loss_mask, metrics_batch.cu_seqlens[:-1]) if raw.size else raw
        metrics: dict[str, float] = {
            "reward_mean": float(raw.mean()) if raw.size else 0.0,
            "reward_std": float(raw.std()) if raw.size else 0.0,
            "accuracy": float((raw >= 1.0).mean()) if raw.size else 0.0,
            "response_length_mean": float(np.mean(gen_lens)) if raw.size else 0.0,  # generated tokens, all turns
            "truncated_fraction": float(metrics_batch.truncated.mean()) if raw.size else 0.0,
            "weight_version": float(metrics_batch.versions.min()) if raw.size else float(p.engine.weight_version),
            "kept_groups": float(n_groups),
            "refill_rounds": 0.0,
        }
        metrics.update(out.metrics)
        metrics.update(p.dataset_metrics())
        return Rollout(batch, rewards, metrics, out.gen_time, out.gen_tokens)


def staleness_metrics(step: int, batch: Any) -> dict[str, float]:
    """How far behind the trainer (which holds version ``step - 1``) a rollout's samples
    are: by each sample's oldest token, and (with the ``token_versions`` side channel) by
    token, with the share of samples an update landed in."""
    import numpy as np

    if batch.n_sequences == 0:
        return {}
    staleness = (step - 1) - np.asarray(batch.versions, dtype=np.float64)  # each sample's oldest token
    metrics = {"staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())}
    tv = batch.side_channels.get("token_versions")
    if tv is not None:  # per generated token; a sample an update landed in spans two versions
        on = np.asarray(batch.loss_mask) != 0
        v = np.asarray(tv, dtype=np.int64)
        metrics["token_staleness_mean"] = float(((step - 1) - v[on]).mean()) if on.any() else 0.0
        seq = np.repeat(np.arange(batch.n_sequences), np.diff(batch.cu_seqlens))[on]
        lo = np.full(batch.n_sequences, np.iinfo(np.int64).max)
        hi = np.full(batch.n_sequences, np.iinfo(np.int64).min)
        np.minimum.at(lo, seq, v[on])
        np.maximum.at(hi, seq, v[on])
        metrics["mixed_version_fraction"] = float(np.mean(hi > lo))
    return metrics


class _AheadSource:
    """What both asynchronous sources share: ``inner`` (a synchronous source) runs in the
    pipeline's thread; ``resubmitted`` (with ``weight_updates = "abort"``): the engine's
    count of requests resubmitted at an update, reported per rollout."""

    stale_samples = ""

    def __init__(self, inner: RolloutSource, *, first: int, last: int, max_staleness: int, version: int,
                 threads: int, in_flight: bool, resubmitted: Callable[[], int] | None = None):
        self.inner, self.first, self.last, self.k = inner, first, last, max_staleness
        self.version, self.threads, self.in_flight, self.resubmitted = version, threads, in_flight, resubmitted
        self.saved: Any = None
        self.pipeline: Any = None

    def _rollout(self, position: int) -> Rollout:
        before = self.resubmitted() if self.resubmitted is not None else 0
        rollout = self.inner.take(position)
        if self.resubmitted is not None:  # requests an update landed in, resubmitted with what they had generated
            rollout.metrics["resubmitted_requests"] = float(self.resubmitted() - before)
        return rollout

    def _on_start(self) -> None:
        import torch

        torch.set_num_threads(self.threads)  # a new thread starts with the default count, not the job's

    def after_step(self, step_time: float) -> Mapping[str, float]:
        busy, self.pipeline.busy_s = self.pipeline.busy_s, 0.0
        return {"engine_idle_fraction": max(0.0, 1.0 - busy / max(step_time, 1e-9))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        written = state.get("stale_samples", "wait")
        if written != self.stale_samples:
            raise ValueError(f'it was written with [job] stale_samples = "{written}", the job says '
                             f'"{self.stale_samples}"; resume it with stale_samples = "{written}"')
        self.saved = state

    def close(self) -> None:
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.close()


class WaitingSource(_AheadSource):
    """``stale_samples = "wait"``: step ``t`` is generated with version ``t - 1 - k``, in a
    thread, while the trainer trains (:class:`skyrl_host.asyncrl.RolloutPipeline`);
    ``commit`` (a staged hand-over whose engine half needs nothing more from the trainer):
    the thread commits each version just before the first rollout that needs it."""

    stale_samples = "wait"

    def start(self, commit: Callable[[int], Mapping[str, float]] | None = None) -> None:
        from skyrl_host.asyncrl import RolloutPipeline

        saved = {int(s): Rollout.from_state(r) for s, r in (self.saved or {}).get("rollouts", {}).items()}
        self.pipeline = RolloutPipeline(
            self._rollout, first=self.first, last=self.last, max_staleness=self.k, version=self.version,
            saved=saved, on_start=self._on_start, in_flight=self.in_flight, commit=commit,
        )
        self.saved = None

    def take(self, step: int) -> Rollout:
        rollout, waited = self.pipeline.take(step)
        rollout.metrics.update({"rollout_wait_time_s": waited, **staleness_metrics(step, rollout.batch)})
        return rollout

    def state_dict(self, step: int) -> dict[str, Any]:
        """The rollouts generated and not trained yet, once every step that weights older
        than ``step``'s generate is generated (a resumed run could not remake them)."""
        pending = self.pipeline.pending(through=step + self.k)
        return {"steps": sorted(pending), "rollouts": {s: r.to_state() for s, r in pending.items()}}


class DroppingSource(_AheadSource):
    """``stale_samples = "drop"``: dataset positions generated ahead with the newest
    weights; a rollout more than ``k`` versions old when taken is dropped and its
    position generated again (:class:`skyrl_host.asyncrl.DroppingPipeline`)."""

    stale_samples = "drop"

    def start(self) -> None:
        from skyrl_host.asyncrl import DroppingPipeline

        saved = None
        if self.saved is not None:
            s = self.saved
            saved = {"ready": {int(p): (int(s["versions"][p]), Rollout.from_state(s["rollouts"][p]))
                               for p in s["positions"]},
                     "todo": list(s["regenerate"]), "next_position": int(s["next_position"])}
        self.pipeline = DroppingPipeline(
            self._rollout, first=self.first, last=self.last, max_staleness=self.k, version=self.version, saved=saved,
            on_start=self._on_start, in_flight=self.in_flight,
            version_of=lambda rollout: int(rollout.metrics["weight_version"]),  # the oldest weights that made it
        )
        self.saved = None

    def take(self, step: int) -> Rollout:
        position, rollout, dropped, waited = self.pipeline.take(step)
        rollout.metrics["dataset_position"] = float(position)  # whose prompts this step trains
        rollout.metrics["dropped_samples"] = float(sum(d.batch.n_sequences for d in dropped))
        rollout.metrics.update({"rollout_wait_time_s": waited, **staleness_metrics(step, rollout.batch)})
        return rollout

    def state_dict(self, step: int) -> dict[str, Any]:
        """By dataset position, with the versions that made them; and the positions not generated yet."""
        pending = self.pipeline.pending()
        ready = pending["ready"]
        return {"stale_samples": "drop", "positions": sorted(ready),
                "rollouts": {p: r.to_state() for p, (_, r) in ready.items()},
                "versions": {p: v for p, (v, _) in ready.items()},
                "regenerate": pending["todo"], "next_position": pending["next_position"]}
