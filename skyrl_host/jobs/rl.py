"""``kind = "rl"``: take a rollout → penalise (KL) → advantages → train → hand the weights over.

Every part is a plugin selected by the job file: the model family, the engine, the
sampler, the algorithm, the dataset, the environment, the backend and the weight
transport. ``build`` chooses, once, where rollouts come from (a
:class:`~skyrl_host.jobs.rl_sources.RolloutSource`: batched single-turn, multi-turn, and
either run ahead in a thread that waits for weights or drops stale rollouts) and how a
trained version reaches the engines (a :class:`~skyrl_host.jobs.rl_handover.WeightHandover`:
publish, publish when idle, stage then commit, stage for the rollout thread); ``step``
then reads as the algorithm does.

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
    SideChannels,
    StagedPlacement,
    TeacherPlacement,
    TokenizerLoading,
    TurnContinuation,
)
from skyrl_host.jobs.common import restore_rng, run_steps, save_rng
from skyrl_host.jobs.rl_handover import (
    Publish,
    PublishWhenIdle,
    StageForTheProducer,
    StageThenCommit,
    Training,
    WeightHandover,
)
from skyrl_host.jobs.rl_sources import (  # noqa: F401 - step_seed, encode_task: also this module's public names
    DroppingSource,
    MultiTurnSource,
    Prompts,
    RewardParts,
    RolloutParts,
    RolloutSource,
    SingleTurnSource,
    WaitingSource,
    check_chat_template,
    encode_task,
    step_seed,
)
from skyrl_host.multiturn import SingleTurn
from skyrl_host.options import ge, gt, gt_le, in_interval, option


def one_of(*choices: str) -> Any:
    """An option validator: the value is one of ``choices``."""

    def check(_inst: Any, _attribute: Any, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(map(repr, choices))}, found {value!r}")
    return check

SLOTS = {
    "eval": None,  # [eval]: never required; absent, the job does not evaluate
    "teacher": None,  # [teacher]: never required; the algorithm opd needs it
    "model": None,
    "dataset": None,
    "engine": "embedded",
    "sampler": "temperature",
    "algorithm": "grpo",
    "backend": "torch",
    "weight_sync": "inproc",
    "replay": (),
    "reward": ("dataset",),  # [reward] parts: the dataset's own reward unless the job says more
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


def _teacher_tokenizer_problems(spec: Any) -> list[tuple[str, str]]:
    """The student's and the teacher's tokenizers, loaded alone (no model; families
    with :class:`TokenizerLoading`) and compared: a teacher that cannot score the
    student's tokens is refused before anything starts. A preset's character tokenizer
    is built from the dataset's alphabet, so the dataset is opened when it has one."""
    from skyrl_host.jobs.teacher import tokenizer_mismatch

    student, teacher = spec.plugins["model"].create(), spec.plugins["teacher"].create()
    if not (has(student, TokenizerLoading) and has(teacher, TokenizerLoading)):
        return []  # checked when the models are loaded
    dataset = spec.plugins["dataset"].create()
    alphabet = dataset.alphabet if has(dataset, CharacterAlphabet) else None
    problem = tokenizer_mismatch(student.load_tokenizer(alphabet=alphabet).tokenizer,
                                 teacher.load_tokenizer(alphabet=alphabet).tokenizer)
    return [] if problem is None else [("teacher", problem)]


def check_rl_job(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks (``skyrl validate``, and ``skyrl run`` before anything starts):
    updates that land inside generations need an engine recording each token's version,
    and resubmitting (``weight_updates = "abort"``) cannot keep recorded routes
    consistent."""
    cfg = spec.kind_config
    problems = []
    if spec.eval is not None and cfg.mode == "async":
        problems.append(("eval", '[eval] evaluates between the steps of a synchronous job; with mode = "async" the '
                         'engine is generating the coming steps meanwhile (evaluate the checkpoints with skyrl eval)'))
    algorithm = spec.plugins.get("algorithm")
    distils = algorithm is not None and algorithm.traits.teacher
    if distils and spec.teacher is None:
        problems.append(("algorithm.name", f"algorithm {algorithm.name!r} learns from a teacher (opd, or "
                         "teacher_kl_coef > 0): add a [teacher] table naming its model (family and path or preset)"))
    elif spec.teacher is not None and algorithm is not None and not distils:
        problems.append(("teacher", f"algorithm {algorithm.name!r} does not use a teacher; [teacher] is for "
                         "algorithm = \"opd\" or an algorithm's teacher_kl_coef > 0"))
    if distils and spec.teacher is not None:
        problems += _teacher_tokenizer_problems(spec)
    parts = [c.name for c in spec.plugins.get("reward", ())]
    environment = spec.plugins.get("environment")
    if parts and parts != ["dataset"] and environment is not None and environment.name != "single_turn":
        problems.append(("reward.parts", f"[reward] parts score single-turn responses; environment "
                         f"{environment.name!r} rewards its episodes itself (use parts = [\"dataset\"] or no [reward])"))
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
    if engine is None:
        return problems
    traits = engine.traits
    if traits.token_versions is False:
        option = traits.switches.get("token_versions", "its token-version recording")
        problems.append(("job.weight_updates", f'weight_updates = "{updates}": the engine must record the version of '
                         f'every token (a generation can span versions); set [engine] {option} = true'))
    if updates != "abort":
        return problems
    if traits.routed_experts:
        option = traits.switches.get("routed_experts", "its routed-experts recording")
        problems.append(("job.weight_updates", 'weight_updates = "abort" cannot be used with [engine] '
                         f'{option} = true: a resubmitted request\'s earlier tokens would have two sets of '
                         'routes; use "in_flight" or "idle"'))
    return problems


class RLDriver:
    def __init__(self, run: Any):
        self.run_ = run
        self.cfg: RLConfig = run.spec.kind_config
        self.seed = run.spec.job.seed
        self.placement: Any = None
        self.source: RolloutSource | None = None
        self.handover: WeightHandover | None = None
        self._saved_rollouts: Mapping[str, Any] | None = None  # async resume: what the source had generated
        self.evaluation: Any = None  # [eval]: a jobs.evaluation.Evaluation
        self.teacher: Any = None  # [teacher]: a jobs.teacher.Teacher, ServedTeacher or a placement's
        self.teacher_topk = 0  # the algorithm's teacher_kl_topk: top-k of the teacher's distribution per token
        self._alone = False  # evaluate_alone(): no evaluation before training, nothing reported

    # -- set-up ----------------------------------------------------------------

    def build(self) -> None:
        import torch

        run, cfg = self.run_, self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        self.dataset = run.plugin("dataset").create(seed=self.seed)
        self.algorithm = run.plugin("algorithm").create()
        self.environment = run.plugin("environment").create(dataset=self.dataset, seed=self.seed)
        alphabet = self.dataset.alphabet if has(self.dataset, CharacterAlphabet) else None
        first_chat = next((t.messages for t in self.dataset.batch(1, cfg.batch_size) if t.messages is not None), None)
        request = PlacementRequest(
            model=run.plugin("model"), backend=run.plugin("backend"), precision=run.plugin("precision"),
            alphabet=alphabet, seed=self.seed, total_steps=run.total_steps, algorithm=self.algorithm,
            replay=tuple(run.plugin("replay")), engine=run.plugin("engine"), sampler=run.plugin("sampler"),
            weight_sync=run.plugin("weight_sync"), threads=cfg.threads,
            in_flight_updates=cfg.mode == "async" and cfg.weight_updates in ("in_flight", "abort"),
            # The chat template, against the first step's first chat, as soon as the tokenizer
            # exists (before any process starts); later batches' first chat when encoded.
            check_tokenizer=(lambda tokenizer: check_chat_template(tokenizer, first_chat)) if first_chat else None,
        )
        self.placement = run.launcher().place(request)
        self.loaded = self.placement.loaded
        self.tokenizer = self.loaded.tokenizer
        self.backend, self.engine, self.sampler = self.placement.backend, self.placement.engine, self.placement.sampler
        self.prompts = Prompts(self.tokenizer, checked=first_chat is not None)
        if run.spec.teacher is not None:
            self.teacher = self._make_teacher(run, alphabet)
            self.teacher_topk = int(run.spec.plugins["algorithm"].traits.teacher_topk)
        self.kl_in_reward = has(self.algorithm, RewardKL) and bool(self.algorithm.kl_in_reward)
        self.start_step = 1
        if run.resume_path is not None:
            self._load_checkpoint(run.resume_path)
            self.start_step = run.resume_step + 1
        rewards = RewardParts([(c.name, c.create(dataset=self.dataset)) for c in run.plugin("reward")])
        parts = RolloutParts(
            dataset=self.dataset, engine=self.engine, sampler=self.sampler, algorithm=self.algorithm,
            prompts=self.prompts, stop_token_ids=self.loaded.stop_token_ids, batch_size=cfg.batch_size,
            n_samples=cfg.n_samples, max_new_tokens=cfg.max_new_tokens, seed=self.seed, rewards=rewards,
        )
        single = isinstance(self.environment, SingleTurn)
        source: RolloutSource = SingleTurnSource(parts) if single else MultiTurnSource(parts, self._multiturn())
        self.max_len = cfg.max_new_tokens if single else cfg.max_total_tokens  # a sequence's most trained tokens
        self.placement.publish(self.start_step - 1)
        self.evaluation = self._evaluation() if run.spec.eval is not None else None
        if (self.evaluation is not None and self.start_step == 1 and run.spec.eval.before and not run.resuming
                and not self._alone):
            run.report(0, self.evaluation("before training"))
        if cfg.mode == "async":
            self.source, self.handover = self._ahead(source)
        else:
            self.source, self.handover = source, Publish(self.placement)

    def _evaluation(self) -> Any:
        from skyrl_host.jobs.evaluation import EVAL_SEED_OFFSET, Evaluation, eval_sampler

        run = self.run_
        options = run.spec.eval
        dataset = run.plugin("eval").create(seed=self.seed + EVAL_SEED_OFFSET)
        sampler = eval_sampler(run.host, self.sampler, options.temperature)
        return Evaluation(options, dataset, engine=self.engine, sampler=sampler, prompts=self.prompts,
                          stop_token_ids=self.loaded.stop_token_ids, max_new_tokens=self.cfg.max_new_tokens,
                          seed=self.seed)

    def evaluate_alone(self) -> Mapping[str, Any]:
        """``skyrl eval``: build (loading the run's ``resume_path`` checkpoint, if any),
        evaluate the engine's weights once, close."""
        if self.run_.spec.eval is None:
            raise UserError(f"{self.run_.spec.path}: the job has no [eval] table to evaluate with (docs/evaluation.md)")
        self._alone = True
        try:
            self.build()
            label = f"step {self.run_.resume_step}" if self.run_.resume_path is not None else "model"
            self.evaluation(label)
            return self.evaluation.last
        finally:
            self.close()

    def evaluate_now(self, step: int) -> bool:
        """Whether ``[eval]`` evaluates after ``step`` (every N steps, and after the last)."""
        every = self.run_.spec.eval.every if self.evaluation is not None else 0
        return self.evaluation is not None and ((every and step % every == 0) or step == self.run_.total_steps)

    def _ahead(self, inner: RolloutSource) -> tuple[RolloutSource, WeightHandover]:
        """``mode = "async"``: ``inner`` run ahead in a thread, and the hand-over that fits
        the placement and ``weight_updates``."""
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

        options = dict(first=self.start_step, last=self.run_.total_steps, max_staleness=self.cfg.max_staleness,
                       version=self.start_step - 1, threads=torch.get_num_threads(), in_flight=in_flight,
                       resubmitted=(lambda: self.engine.resubmitted) if updates == "abort" else None)
        source: DroppingSource | WaitingSource
        source = DroppingSource(inner, **options) if self.cfg.stale_samples == "drop" else WaitingSource(inner, **options)
        if self._saved_rollouts is not None:
            try:
                source.load_state_dict(self._saved_rollouts)
            except ValueError as exc:
                raise UserError(f"--resume: checkpoint {self.run_.resume_path}: {exc}") from None
            self._saved_rollouts = None
        staged = has(self.placement, StagedPlacement)
        # A staged hand-over whose engine half needs nothing more from the trainer is
        # committed by the rollout thread, between two rollouts: the trainer never waits
        # for the engine to be idle.
        if (isinstance(source, WaitingSource) and not in_flight and staged
                and has(self.placement, EngineSideCommit) and self.placement.commit_on_engine_side()):
            source.start(commit=self.placement.commit)
            return source, StageForTheProducer(self.placement, source.pipeline,
                                               ordered_training=has(self.backend, OrderedTrainStep))
        source.start()
        return source, (StageThenCommit if staged else PublishWhenIdle)(self.placement, source.pipeline)

    def _multiturn(self) -> Any:
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
        return MultiTurnRollout(
            self.environment, self.engine, self.sampler, self.tokenizer, self.loaded.stop_token_ids, options,
            EnvWorkers(cfg.env_workers),
        )

    def close(self) -> None:
        """Stop what the launcher started (also after a failed start)."""
        source, self.source = self.source, None
        if source is not None:
            source.close()
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.close()

    # -- one step ----------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        import numpy as np

        t0 = time.perf_counter()
        rollout = self.source.take(step)
        batch, rewards, metrics = rollout.batch, rollout.rewards, dict(rollout.metrics)
        training = None
        if batch.n_sequences > 0 and self.teacher is not None:
            self._teach(batch, metrics)
        if batch.n_sequences > 0:
            if self.kl_in_reward:
                rewards = rewards - self._kl_penalty(batch, metrics)
            advantages = np.asarray(self.algorithm.advantages(batch, rewards), dtype=np.float32)
            training = Training(self.backend, batch, advantages, self.algorithm, temperature=self.sampler.temperature,
                                max_new_tokens=self.max_len, ordered=self.handover.ordered_training)
        handed = self.handover.after_train(step, training)
        if training is not None:
            metrics.update(training.metrics())
        metrics.update(handed)
        metrics["gen_tokens_per_s"] = float(rollout.gen_tokens / max(rollout.gen_time, 1e-9))
        metrics["step_time"] = time.perf_counter() - t0
        metrics.update(self.source.after_step(metrics["step_time"]))
        if self.evaluate_now(step):  # the weights just handed over: the engine serves version `step`
            metrics.update(self.evaluation(f"step {step}"))
        return metrics

    def _make_teacher(self, run: Any, alphabet: str | None) -> Any:
        """[teacher]: a vLLM server serving it (``base_url``; its tokenizer alone loaded
        here), or its model in a process of its own where the placement offers one
        (TeacherPlacement: the Ray launcher's actor), or in this process; its tokenizer must
        be the student's."""
        from skyrl_host.jobs.teacher import ServedTeacher, Teacher, check_same_tokenizer

        options, family = run.spec.teacher, run.plugin("teacher").create()
        if options.base_url is not None:
            if not has(family, TokenizerLoading):
                raise UserError(f"[teacher] base_url: model family {run.plugin('teacher').name!r} cannot load its "
                                "tokenizer alone; score the teacher in this process (no base_url)")
            check_same_tokenizer(self.tokenizer, family.load_tokenizer(alphabet=alphabet).tokenizer)
            return ServedTeacher(options, temperature=self.sampler.temperature)
        if has(self.placement, TeacherPlacement):  # its own process (the Ray launcher: an actor)
            remote = self.placement.place_teacher(run.plugin("teacher"), options, alphabet=alphabet, seed=self.seed,
                                                  temperature=self.sampler.temperature)
            check_same_tokenizer(self.tokenizer, remote.vocab())
            return remote
        taught = family.load(alphabet=alphabet, seed=self.seed)
        check_same_tokenizer(self.tokenizer, taught.tokenizer)
        return Teacher(taught, options, temperature=self.sampler.temperature)

    def _teach(self, batch: Any, metrics: dict[str, float]) -> None:
        """The teacher's logprobs of the sampled tokens, into the batch (``teacher_logprobs``;
        with an algorithm's ``teacher_kl_topk`` = k, also its k most likely tokens at each
        position: ``teacher_topk_ids`` int32 [T, k], ``teacher_topk_logprobs`` [T, k]), and
        how far the student is from it: ``teacher_kl``, the mean over generated tokens of
        log p_student - log p_teacher (the reverse KL's sample estimate)."""
        import numpy as np

        t0 = time.perf_counter()
        teacher, top_ids, top_lps = self.teacher.score(batch, self.teacher_topk)
        batch.side_channels["teacher_logprobs"] = teacher
        if self.teacher_topk:
            if top_ids.size and int(top_ids.max()) >= self.placement.vocab_size:
                raise UserError(f"[teacher]: its top-k holds token id {int(top_ids.max())}; the student has "
                                f"{self.placement.vocab_size} ids")
            batch.side_channels["teacher_topk_ids"] = top_ids
            batch.side_channels["teacher_topk_logprobs"] = top_lps
        mask = batch.loss_mask != 0
        metrics["teacher_kl"] = float(np.mean(batch.logprobs[mask] - teacher[mask])) if mask.any() else 0.0
        metrics["teacher_time_s"] = time.perf_counter() - t0
        metrics.update(self.teacher.counters)

    def _kl_penalty(self, batch: Any, metrics: dict[str, float]) -> Any:
        """KL against the reference policy as a reward penalty (instead of a loss term)."""
        import numpy as np

        ref = self.backend.reference_logprobs(batch, temperature=self.sampler.temperature)
        penalty = np.asarray(self.algorithm.kl_reward_penalty(batch, ref), dtype=np.float32)
        metrics["kl_reward_penalty_mean"] = float(penalty.mean())
        return penalty

    # -- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self, step: int) -> None:
        from skyrl_host.statefile import save_state

        with CheckpointWriter(self.run_.output_dir, step, keep=self.cfg.keep_checkpoints) as folder:
            save_backend_state(folder, self.backend)
            save_rng(folder / "rng.safetensors")
            (folder / "driver.json").write_text(json.dumps({"step": step, "weight_version": step}))
            rollouts = self.source.state_dict(step)  # async: generated, not trained yet
            if rollouts is not None:
                save_state(rollouts, folder / "rollouts.safetensors")

    def _load_checkpoint(self, folder: pathlib.Path) -> None:
        rng = read_state(folder, "rng")
        load_backend_state(folder, self.backend)
        restore_rng(rng, folder)
        if self.cfg.mode == "async" and any((folder / f"rollouts.{x}").is_file() for x in ("safetensors", "pt")):
            saved = read_state(folder, "rollouts")
            if not isinstance(saved, dict):
                raise UserError(f"--resume: {folder}'s rollouts hold a {type(saved).__name__}, not what this job wrote")
            self._saved_rollouts = saved

    def save_final(self) -> None:
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
