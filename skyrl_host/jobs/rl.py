"""``kind = "rl"``: generate → reward → filter → advantages → train → sync.

Every part is a plugin selected by the job file: the model family, the engine,
the sampler, the algorithm, the dataset, the backend and the weight transport.
This driver only moves data between them, measures, checkpoints and resumes.

Determinism: the prompts of step ``s`` are ``dataset.batch(s, ...)`` and the
generation seed is a function of (job seed, step, refill round), so a run
resumed from a checkpoint reproduces the uninterrupted run's metrics exactly
(async with ``stale_samples = "drop"``: a step trains some dataset position's prompts,
each position once, in an order that timing decides; docs/async.md).
"""

from __future__ import annotations

import json
import pathlib
import random
import time
from typing import Any, Mapping

import attrs

from skyrl_host import hookimpl
from skyrl_host.checkpoints import CheckpointWriter, load_backend_state, read_state, save_backend_state
from skyrl_host.contracts import has, shares_trainer_tensors
from skyrl_host.errors import UserError
from skyrl_host.interfaces import (
    AbortingUpdates,
    AdapterTraining,
    CharacterAlphabet,
    EngineSideCommit,
    OrderedTrainStep,
    PlacementRequest,
    RewardKL,
    RewardMetrics,
    SideChannels,
    StagedPlacement,
    TokenizerLoading,
    TurnContinuation,
)
from skyrl_host.jobs.common import restore_rng, run_steps, save_rng
from skyrl_host.multiturn import SingleTurn
from skyrl_host.options import ge, gt, gt_le, in_interval, option


def one_of(*choices: str) -> Any:
    """An option validator: the value is one of ``choices``."""

    def check(_inst: Any, _attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(map(repr, choices))}, found {value!r}")
    return check

SLOTS = {
    "model": None,
    "dataset": None,
    "engine": "embedded",
    "sampler": "temperature",
    "algorithm": "grpo",
    "backend": "torch",
    "weight_sync": "inproc",
    "replay": (),
    "precision": "bf16",
    # Single-turn unless [environment] names a multi-turn environment (skyrl_host.multiturn).
    "environment": "single_turn",
}


@attrs.frozen
class RLConfig:
    batch_size: int = option(32, help="prompts per step (groups)", validator=gt_le(0, 1 << 20))
    n_samples: int = option(8, help="responses sampled per prompt (the group size)", validator=gt_le(0, 1 << 16))
    max_new_tokens: int = option(16, help="new-token limit per response", validator=gt_le(0, 1 << 24))
    checkpoint_every: int = option(50, help="steps between checkpoints (0: only at the end)", validator=ge(0))
    keep_checkpoints: int = option(2, help="checkpoints kept on disk", validator=gt(0))
    save_final: bool = option(True, help="write the final model as a Hugging Face folder in <output_dir>/final")
    threads: int | None = option(None, help="torch threads (default: leave torch's choice)", validator=gt(0))
    # Multi-turn rollouts ([environment] name = ...); a single-turn job ignores these.
    max_turns: int = option(4, help="multi-turn: most responses per trajectory", validator=gt(0))
    max_total_tokens: int = option(
        512, help="multi-turn: token budget per trajectory (prompt, responses and observations)", validator=gt(1)
    )
    step_timeout: float = option(30.0, help="multi-turn: seconds an environment's reset or step may take", validator=gt(0))
    reward_gamma: float = option(
        1.0, help="multi-turn: a trajectory's reward is sum(gamma**t * reward_t); 1.0 sums the turns' rewards",
        validator=in_interval(0, 1),
    )
    failed_trajectories: str = option(
        "zero", help="multi-turn: a trajectory whose environment failed trains with reward 0 ('zero') or not at "
        "all ('exclude')", validator=one_of("zero", "exclude"),
    )
    env_workers: int = option(16, help="multi-turn: threads running environment steps concurrently", validator=gt(0))
    mode: str = option(
        "sync", help="'sync': generate, then train, each step; 'async': a thread generates the coming steps' "
        "rollouts while the trainer trains (skyrl_host.asyncrl)", validator=one_of("sync", "async"),
    )
    max_staleness: int = option(
        1, help="async: a trained sample is at most this many weight versions behind the trainer (step t is "
        "generated with version t-1-k; 0 = the synchronous schedule)", validator=ge(0),
    )
    weight_updates: str = option(
        "idle", help="async: 'idle': a new version reaches the engine only between generations (a pure function "
        "of the seed); 'in_flight': at once, between two decode steps of the generation in progress, which goes on "
        "on the old weights' KV (each token records its version; needs an engine with the token_versions side "
        "channel); 'abort': at once too, but the requests in progress are aborted and resubmitted with what they "
        "generated, prefilled again with the new weights (an engine with abort_on_update, e.g. embedded)",
        validator=one_of("idle", "in_flight", "abort"),
    )
    stale_samples: str = option(
        "wait", help="async: how max_staleness is kept: 'wait': the rollout thread waits for version t-1-k before "
        "generating step t (nothing is dropped; a pure function of the seed with idle updates); 'drop': it never "
        "waits for a version, generates ahead with the newest weights into a buffer of k+1 rollouts, and a rollout "
        "more than k versions old when the trainer takes it is dropped and its prompts generated again "
        "(dropped_samples; the order of the dataset's batches then depends on timing)",
        validator=one_of("wait", "drop"),
    )
    env_waves: int = option(
        1, help="multi-turn: split the trajectories in this many waves; a wave's environment steps run while the "
        "others decode (1: decode and steps take turns; 2+ hides slow tools at the cost of smaller decode batches)",
        validator=gt(0),
    )


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


def check_rl_job(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks (``skyrl validate``, and ``skyrl run`` before anything starts):
    updates that land inside generations need an engine recording each token's version,
    and resubmitting (``weight_updates = "abort"``) cannot keep recorded routes
    consistent."""
    cfg = spec.kind_config
    problems = []
    if cfg.stale_samples == "drop" and cfg.mode != "async":
        problems.append(("job.stale_samples", 'stale_samples = "drop" needs mode = "async" (a synchronous step trains '
                         'what it has just generated: nothing is ever stale)'))
    elif cfg.stale_samples == "drop" and cfg.max_staleness == 0:
        problems.append(("job.stale_samples", 'stale_samples = "drop" with max_staleness = 0 would drop every rollout '
                         'generated while the trainer trains; use stale_samples = "wait" (k = 0 is the synchronous '
                         'schedule) or max_staleness >= 1'))
    if cfg.mode != "async" or cfg.weight_updates == "idle":
        return problems
    updates = cfg.weight_updates
    engine = spec.plugins.get("engine")
    engine_config = getattr(engine, "config", None)
    if getattr(engine_config, "return_token_versions", True) is False:
        problems.append(("job.weight_updates", f'weight_updates = "{updates}": the engine must record the version of '
                         'every token (a generation can span versions); set [engine] return_token_versions = true'))
    if updates != "abort":
        return problems
    if getattr(engine_config, "return_routed_experts", False):
        problems.append(("job.weight_updates", 'weight_updates = "abort" cannot be used with [engine] '
                         'return_routed_experts = true: a resubmitted request\'s earlier tokens would have two sets of '
                         'routes; use "in_flight" or "idle"'))
    return problems


class RLDriver:
    def __init__(self, run: Any):
        self.run_ = run
        self.cfg: RLConfig = run.spec.kind_config
        self.seed = run.spec.job.seed
        self.placement: Any = None
        self.pipeline: Any = None  # async mode: the rollout thread (skyrl_host.asyncrl.RolloutPipeline)
        self._saved_rollouts: dict[int, Any] = {}  # async resume: rollouts generated before the checkpoint
        self._chat_checked = False  # the tokenizer's chat template is checked at the first chat prompt

    # -- set-up ----------------------------------------------------------------

    def build(self) -> None:
        import torch

        run, cfg = self.run_, self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        self.dataset = run.plugin("dataset").create(seed=self.seed)
        self.sampler = run.plugin("sampler").create()
        self.algorithm = run.plugin("algorithm").create()
        self.environment = run.plugin("environment").create(dataset=self.dataset, seed=self.seed)
        self.multiturn: Any = None  # the multi-turn rollout, unless the environment is single-turn
        alphabet = self.dataset.alphabet if has(self.dataset, CharacterAlphabet) else None
        self._check_chats_first(alphabet)
        request = PlacementRequest(
            model=run.plugin("model"), backend=run.plugin("backend"), precision=run.plugin("precision"),
            alphabet=alphabet, seed=self.seed, total_steps=run.total_steps, algorithm=self.algorithm,
            replay=tuple(run.plugin("replay")), engine=run.plugin("engine"), sampler=run.plugin("sampler"),
            weight_sync=run.plugin("weight_sync"), threads=cfg.threads,
            in_flight_updates=cfg.mode == "async" and cfg.weight_updates in ("in_flight", "abort"),
        )
        self.placement = run.launcher().place(request)
        self.loaded = self.placement.loaded
        self.tokenizer = self.loaded.tokenizer
        self.backend, self.engine = self.placement.backend, self.placement.engine
        self.kl_in_reward = has(self.algorithm, RewardKL) and bool(self.algorithm.kl_in_reward)
        self.start_step = 1
        if run.resume_path is not None:
            self._load_checkpoint(run.resume_path)
            self.start_step = run.resume_step + 1
        if not isinstance(self.environment, SingleTurn):
            self._start_multiturn()
        self._publish(self.start_step - 1)
        if cfg.mode == "async":
            self._start_async()

    def _start_async(self) -> None:
        from skyrl_host.asyncrl import RolloutPipeline

        if shares_trainer_tensors(self.engine, self.backend) and not (
                has(self.backend, AdapterTraining) and self.backend.adapter_config() is not None):
            raise UserError(
                "[job] mode = \"async\": the engine serves the trainer's own weight tensors, which training changes "
                "while the engine generates; give the engine a copy of its own ([engine] share_weights = false) or "
                "run mode = \"sync\""
            )
        updates = self.cfg.weight_updates
        in_flight = updates in ("in_flight", "abort")  # published at once, landing inside generations
        if in_flight and has(self.engine, SideChannels) and "token_versions" not in self.engine.side_channels(self.sampler):
            raise UserError(
                f"[job] weight_updates = \"{updates}\": the engine must record the version of every token (a "
                "generation can span versions); set [engine] return_token_versions = true"
            )
        if updates == "abort":
            if not has(self.engine, AbortingUpdates):
                raise UserError(
                    f"[job] weight_updates = \"abort\": engine {self.run_.plugin('engine').registration.name!r} "
                    "cannot abort and resubmit the requests in progress at a weight update (no abort_on_update); use "
                    "weight_updates = \"in_flight\" or \"idle\""
                )
            self.engine.abort_on_update(True)
        import torch

        threads = torch.get_num_threads()  # a new thread starts with the default count, not the job's
        if self.cfg.stale_samples == "drop":
            from skyrl_host.asyncrl import DroppingPipeline

            self.pipeline = DroppingPipeline(
                self._rollout, first=self.start_step, last=self.run_.total_steps,
                max_staleness=self.cfg.max_staleness, version=self.start_step - 1, saved=self._saved_rollouts,
                on_start=lambda: torch.set_num_threads(threads), in_flight=in_flight,
                version_of=lambda out: int(out[2]["weight_version"]),  # the oldest weights that generated it
            )
            self._saved_rollouts = {}
            return
        # A staged hand-over whose engine half needs nothing more from the trainer is
        # committed by the rollout thread, between two rollouts: the trainer never waits
        # for the engine to be idle.
        engine_side = (not in_flight and has(self.placement, StagedPlacement)
                       and has(self.placement, EngineSideCommit) and self.placement.commit_on_engine_side())
        self.pipeline = RolloutPipeline(
            self._rollout, first=self.start_step, last=self.run_.total_steps, max_staleness=self.cfg.max_staleness,
            version=self.start_step - 1, saved=self._saved_rollouts, on_start=lambda: torch.set_num_threads(threads),
            in_flight=in_flight, commit=self.placement.commit if engine_side else None,
        )
        self._saved_rollouts = {}

    def _start_multiturn(self) -> None:
        from skyrl_host.multiturn import EnvWorkers, MultiTurnOptions, MultiTurnRollout

        cfg = self.cfg
        if not has(self.engine, TurnContinuation):
            raise UserError(
                f"[environment]: a multi-turn environment needs an engine that continues conversations "
                f"(continue_turn); [engine] name = {self.run_.plugin('engine').registration.name!r} does not"
            )
        options = MultiTurnOptions(
            max_turns=cfg.max_turns, max_total_tokens=cfg.max_total_tokens, max_new_tokens=cfg.max_new_tokens,
            step_timeout=cfg.step_timeout, reward_gamma=cfg.reward_gamma, failed_trajectories=cfg.failed_trajectories,
            env_waves=cfg.env_waves,
        )
        self.multiturn = MultiTurnRollout(
            self.environment, self.engine, self.sampler, self.tokenizer, self.loaded.stop_token_ids, options,
            EnvWorkers(cfg.env_workers),
        )

    def _check_chats_first(self, alphabet: str | None) -> None:
        """Check the tokenizer's chat template against the first step's first chat before
        any model is read or any process started (a family that can load its tokenizer
        alone: TokenizerLoading); later batches' first chat is checked in ``_encode``."""
        tasks = self.dataset.batch(1, self.cfg.batch_size)
        chat = next((t.messages for t in tasks if t.messages is not None), None)
        if chat is None:
            return
        family = self.run_.plugin("model").create()
        if has(family, TokenizerLoading):
            check_chat_template(family.load_tokenizer(alphabet=alphabet).tokenizer, chat)
            self._chat_checked = True

    def _publish(self, version: int) -> Mapping[str, float]:
        return self.placement.publish(version)

    def close(self) -> None:
        """Stop what the launcher started (also after a failed start)."""
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.close()
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.close()

    # -- one step ----------------------------------------------------------------

    def _encode(self, tasks: list[Any]) -> list[list[int]]:
        if not self._chat_checked and any(t.messages is not None for t in tasks):
            check_chat_template(self.tokenizer, next(t.messages for t in tasks if t.messages is not None))
            self._chat_checked = True
        return [encode_task(self.tokenizer, t) for t in tasks]

    def _generate(self, step: int, round_: int, tasks: list[Any], group_offset: int) -> Any:
        return self.engine.generate(
            self._encode(tasks),
            n=self.cfg.n_samples,
            sampler=self.sampler,
            max_new_tokens=self.cfg.max_new_tokens,
            seed=step_seed(self.seed, step, round_),
            group_offset=group_offset,
        )

    def _score(self, batch: Any, tasks: list[Any], group_offset: int) -> None:
        import numpy as np

        stop = set(self.loaded.stop_token_ids)
        rewards = np.empty(batch.n_sequences, dtype=np.float32)
        for i in range(batch.n_sequences):
            ids = [int(t) for t in batch.response(i) if int(t) not in stop]
            # Only the stop tokens are dropped: any other special token the policy emits
            # stays in the text the reward sees (else emitting <unk> would be free).
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            task = tasks[int(batch.group_ids[i]) - group_offset]
            rewards[i] = float(self.dataset.reward(task, text))
        batch.rewards = rewards

    def _single_turn(self, step: int) -> tuple[Any, Any, dict[str, float], float, int]:
        import numpy as np

        from skyrl_host.rollout import RolloutBatch

        cfg = self.cfg
        tasks = list(self.dataset.batch(step, cfg.batch_size))
        gen_time, gen_tokens = 0.0, 0
        g0 = time.perf_counter()
        first = self._generate(step, 0, tasks, 0)
        gen_time += time.perf_counter() - g0
        gen_tokens += int(first.loss_mask.sum())
        self._score(first, tasks, 0)
        raw = first.rewards.copy()
        shaped = np.asarray(self.algorithm.shape_rewards(first, cfg.max_new_tokens), dtype=np.float32)
        # Dynamic sampling judges groups by their outcome (raw rewards), not by shaping.
        keep = np.asarray(self.algorithm.keep(first, raw), dtype=bool)
        kept, kept_rewards = [first.select(np.flatnonzero(keep))], [shaped[keep]]
        n_groups = len(np.unique(first.group_ids[keep]))
        rounds = 0
        dynamic, max_rounds = bool(self.algorithm.dynamic_sampling), int(self.algorithm.max_refill_rounds)
        # Dynamic sampling: refill with further prompts of this step until the batch is full.
        while dynamic and n_groups < cfg.batch_size and rounds < max_rounds:
            rounds += 1
            more = list(self.dataset.batch(step, cfg.batch_size * (rounds + 1)))[cfg.batch_size * rounds :]
            offset = cfg.batch_size * rounds
            g0 = time.perf_counter()
            extra = self._generate(step, rounds, more, offset)
            gen_time += time.perf_counter() - g0
            gen_tokens += int(extra.loss_mask.sum())
            self._score(extra, more, offset)
            ex_shaped = np.asarray(self.algorithm.shape_rewards(extra, cfg.max_new_tokens), dtype=np.float32)
            ex_keep = np.asarray(self.algorithm.keep(extra, extra.rewards), dtype=bool)
            groups = [g for g in dict.fromkeys(extra.group_ids[ex_keep].tolist())][: cfg.batch_size - n_groups]
            take = np.flatnonzero(np.isin(extra.group_ids, groups) & ex_keep)
            kept.append(extra.select(take))
            kept_rewards.append(ex_shaped[take])
            n_groups += len(groups)
        batch = RolloutBatch.concat(kept)
        rewards = np.concatenate(kept_rewards).astype(np.float32)

        metrics: dict[str, float] = {
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.std()),
            "accuracy": float((raw >= 1.0).mean()),
            "response_length_mean": float(first.response_lens.mean()),
            "truncated_fraction": float(first.truncated.mean()),
            "weight_version": float(first.versions.min()),  # the weights that generated this step's rollouts
            "kept_groups": float(n_groups),
            "refill_rounds": float(rounds),
        }
        return batch, rewards, metrics, gen_time, gen_tokens

    def _multi_turn(self, step: int) -> tuple[Any, Any, dict[str, float], float, int]:
        """The step's trajectories (``n_samples`` per record: the GRPO groups); no
        reward shaping and no refills (dynamic sampling still drops uniform groups)."""
        import numpy as np

        cfg = self.cfg
        tasks = list(self.dataset.batch(step, cfg.batch_size))
        if not self._chat_checked and any(t.messages is not None for t in tasks):
            check_chat_template(self.tokenizer, next(t.messages for t in tasks if t.messages is not None))
            self._chat_checked = True
        out = self.multiturn.run(tasks, cfg.n_samples, step_seed(self.seed, step))
        batch, raw = out.batch, out.rewards
        n_groups = 0
        if batch is not None and batch.n_sequences:
            keep = np.asarray(self.algorithm.keep(batch, raw), dtype=bool)
            n_groups = len(np.unique(batch.group_ids[keep]))
            metrics_batch = batch
            batch, rewards = batch.select(np.flatnonzero(keep)), raw[keep]
        else:
            from skyrl_host.rollout import RolloutBatch

            batch = metrics_batch = RolloutBatch.from_sequences([], [], [], group_ids=[])
            rewards = raw
        gen_lens = np.add.reduceat(metrics_batch.loss_mask, metrics_batch.cu_seqlens[:-1]) if raw.size else raw
        metrics: dict[str, float] = {
            "reward_mean": float(raw.mean()) if raw.size else 0.0,
            "reward_std": float(raw.std()) if raw.size else 0.0,
            "accuracy": float((raw >= 1.0).mean()) if raw.size else 0.0,
            "response_length_mean": float(np.mean(gen_lens)) if raw.size else 0.0,  # generated tokens, all turns
            "truncated_fraction": float(metrics_batch.truncated.mean()) if raw.size else 0.0,
            "weight_version": float(metrics_batch.versions.min()) if raw.size else float(self.engine.weight_version),
            "kept_groups": float(n_groups),
            "refill_rounds": 0.0,
        }
        metrics.update(out.metrics)
        return batch, rewards, metrics, out.gen_time, out.gen_tokens

    def _rollout(self, step: int) -> tuple[Any, Any, dict[str, float], float, int]:
        """Generate and score step ``step``'s samples (in async mode, in the rollout thread)."""
        aborting = self.cfg.mode == "async" and self.cfg.weight_updates == "abort"
        resubmitted = self.engine.resubmitted if aborting else 0
        if self.multiturn is None:
            batch, rewards, metrics, gen_time, gen_tokens = self._single_turn(step)
        else:
            batch, rewards, metrics, gen_time, gen_tokens = self._multi_turn(step)
        if has(self.dataset, RewardMetrics):  # e.g. answers the math verifier could not parse
            metrics.update({k: float(v) for k, v in self.dataset.reward_metrics().items()})
        if aborting:  # requests an update landed in, resubmitted with what they had generated
            metrics["resubmitted_requests"] = float(self.engine.resubmitted - resubmitted)
        return batch, rewards, metrics, gen_time, gen_tokens

    def step(self, step: int) -> dict[str, float]:
        import numpy as np

        cfg = self.cfg
        t0 = time.perf_counter()
        max_len = cfg.max_new_tokens if self.multiturn is None else cfg.max_total_tokens
        if self.pipeline is None:
            batch, rewards, metrics, gen_time, gen_tokens = self._rollout(step)
        else:
            if cfg.stale_samples == "drop":
                position, out, dropped, waited = self.pipeline.take(step)
                (batch, rewards, metrics, gen_time, gen_tokens) = out
                metrics = dict(metrics)
                metrics["dataset_position"] = float(position)  # whose prompts this step trains
                metrics["dropped_samples"] = float(sum(d[0].n_sequences for d in dropped))
            else:
                (batch, rewards, metrics, gen_time, gen_tokens), waited = self.pipeline.take(step)
                metrics = dict(metrics)
            metrics["rollout_wait_time_s"] = waited
            if batch.n_sequences > 0:
                staleness = (step - 1) - np.asarray(batch.versions, dtype=np.float64)  # each sample's oldest token
                metrics["staleness_mean"] = float(staleness.mean())
                metrics["staleness_max"] = float(staleness.max())
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
        staging = self.pipeline is not None and getattr(self.pipeline, "commit_fn", None) is not None
        staged = None  # (sync, waited) when the version was staged behind the train step
        if batch.n_sequences > 0 and self.kl_in_reward:
            # KL against the reference policy as a reward penalty (instead of a loss term).
            ref = self.backend.reference_logprobs(batch, temperature=self.sampler.temperature)
            penalty = np.asarray(self.algorithm.kl_reward_penalty(batch, ref), dtype=np.float32)
            rewards = rewards - penalty
            metrics["kl_reward_penalty_mean"] = float(penalty.mean())
        if batch.n_sequences > 0:
            advantages = np.asarray(self.algorithm.advantages(batch, rewards), dtype=np.float32)
            t_train = time.perf_counter()
            if staging and has(self.backend, OrderedTrainStep):
                # Stage right behind the train step: sent while it runs (once the engines hold
                # the previous version), run by the backend as soon as the step ends.
                finish = self.backend.start_train_step(
                    batch, advantages, self.algorithm, temperature=self.sampler.temperature, max_new_tokens=max_len
                )
                staged = self.pipeline.hand_over(step, self.placement.stage)
                train, train_time = finish()
            else:
                train = self.backend.train_step(
                    batch, advantages, self.algorithm, temperature=self.sampler.temperature, max_new_tokens=max_len
                )
                train_time = time.perf_counter() - t_train
            # The backend's own timings are superseded by the driver's, measured alike for every backend.
            metrics.update({k: float(v) for k, v in train.items() if k not in ("tokens_per_s", "step_time_s")})
            metrics["train_tokens_per_s"] = float(batch.n_tokens / max(train_time, 1e-9))
        if self.pipeline is None:
            sync = self._publish(step)
        elif staging:
            # Staged now; the rollout thread commits it just before the first rollout that needs
            # it. ``sync``: this version's stage and the previous version's commit (sync_pause_s, ...).
            sync, waited = staged if staged is not None else self.pipeline.hand_over(step, self.placement.stage)
            metrics["publish_wait_time_s"] = waited
        elif has(self.placement, StagedPlacement):
            # Send (and, for delta, fetch and verify) while the engine still generates; the
            # apply, once the engine is idle, is the only pause.
            sent = dict(self.placement.stage(step))
            sync, waited = self.pipeline.publish(step, self.placement.commit)
            sync = {**sent, **sync}
            metrics["publish_wait_time_s"] = waited
        else:
            sync, waited = self.pipeline.publish(step, self._publish)
            metrics["publish_wait_time_s"] = waited
        metrics.update({k: float(v) for k, v in sync.items()})
        metrics["gen_tokens_per_s"] = float(gen_tokens / max(gen_time, 1e-9))
        metrics["step_time"] = time.perf_counter() - t0
        if self.pipeline is not None:
            busy, self.pipeline.busy_s = self.pipeline.busy_s, 0.0
            metrics["engine_idle_fraction"] = max(0.0, 1.0 - busy / max(metrics["step_time"], 1e-9))
        return metrics

    # -- checkpoints ----------------------------------------------------------------

    def _save_checkpoint(self, step: int) -> None:
        from skyrl_host.statefile import save_state

        with CheckpointWriter(self.run_.output_dir, step, keep=self.cfg.keep_checkpoints) as folder:
            save_backend_state(folder, self.backend)
            save_rng(folder / "rng.safetensors")
            (folder / "driver.json").write_text(json.dumps({"step": step, "weight_version": step}))
            if self.pipeline is not None and self.cfg.stale_samples == "drop":
                # By dataset position, with the versions that made them; and the positions not generated yet.
                pending = self.pipeline.pending()
                save_state({"stale_samples": "drop", "positions": sorted(pending["ready"]),
                            "rollouts": {p: r for p, (_, r) in pending["ready"].items()},
                            "versions": {p: v for p, (v, _) in pending["ready"].items()},
                            "regenerate": pending["todo"], "next_position": pending["next_position"]},
                           folder / "rollouts.safetensors")
            elif self.pipeline is not None:  # generated, not trained yet: made with weights a resume cannot remake
                pending = self.pipeline.pending(through=step + self.cfg.max_staleness)
                save_state({"steps": sorted(pending), "rollouts": pending}, folder / "rollouts.safetensors")

    def _load_checkpoint(self, folder: pathlib.Path) -> None:
        rng = read_state(folder, "rng")
        load_backend_state(folder, self.backend)
        restore_rng(rng, folder)
        if self.cfg.mode == "async" and any((folder / f"rollouts.{x}").is_file() for x in ("safetensors", "pt")):
            saved = read_state(folder, "rollouts")
            if not isinstance(saved, dict):
                raise UserError(f"--resume: {folder}'s rollouts hold a {type(saved).__name__}, not what this job wrote")
            written = saved.get("stale_samples", "wait")
            if written != self.cfg.stale_samples:
                raise UserError(f"--resume: checkpoint {folder} was written with [job] stale_samples = \"{written}\", "
                                f"the job says \"{self.cfg.stale_samples}\"; resume it with stale_samples = "
                                f"\"{written}\"")
            if written == "drop":
                self._saved_rollouts = {
                    "ready": {p: (int(saved["versions"][p]), saved["rollouts"][p]) for p in saved["positions"]},
                    "todo": list(saved["regenerate"]), "next_position": int(saved["next_position"]),
                }
            else:
                self._saved_rollouts = dict(saved["rollouts"])

    def _save_final(self) -> None:
        self.placement.save_final(str(self.run_.output_dir / "final"))

    # -- the loop ------------------------------------------------------------------

    def run(self) -> None:
        self.run_.headline = ["reward_mean", "accuracy", "entropy"]
        run_steps(self)


@hookimpl
def skyrl_register_environments(register: Any) -> None:
    register(
        "single_turn",
        SingleTurn,
        description="One response per prompt, rewarded by the dataset (the rl job's default)",
    )


@hookimpl
def skyrl_register_jobs(register: Any) -> None:
    register(
        "rl",
        RLDriver,
        config=RLConfig,
        description="Reinforcement learning: generate, reward, filter, advantages, train, sync",
        slots=SLOTS,
        check=check_rl_job,
    )
