"""The Protocols each plugin kind implements: one per kind.

A registration hook registers a *factory*; the factory, called with the plugin's
validated config, returns an object of the matching Protocol below. The host and
the drivers only ever talk to plugins through these Protocols.

The engine and trainer contracts meet in the packed
:class:`skyrl_host.rollout.RolloutBatch`. This module imports no heavy module:
tensors are typed ``Any`` and documented by shape.
"""

from __future__ import annotations

import types
from typing import Any, Callable, ContextManager, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import attrs


@attrs.frozen
class Task:
    """One prompt of a dataset, with what its reward function needs to score it.

    A plain task has ``prompt`` only: the ``rl`` driver encodes it as it is. A chat task
    also has ``messages`` (``{"role": ..., "content": ...}`` mappings, oldest first; the
    last is not the assistant's): the driver renders them with the tokenizer's chat
    template and an opened assistant turn (``add_generation_prompt=True``), and
    ``prompt`` is then the last user message's text (for rewards and logs)."""

    prompt: str
    answer: str | None = None  # a reference completion that earns the maximal reward, if known
    meta: Mapping[str, Any] = attrs.field(factory=dict)
    messages: Sequence[Mapping[str, str]] | None = None  # a chat task's conversation so far


@runtime_checkable
class Dataset(Protocol):
    """Prompts and their reward. ``batch`` is a pure function of the dataset's seed
    and ``step``, so a resumed job sees exactly the prompts it would have seen."""

    def batch(self, step: int, size: int) -> Sequence[Task]:
        """``size`` tasks for ``step`` (counting from 1)."""
        ...

    # Datasets for models built from presets also offer ``alphabet`` (the
    # :class:`CharacterAlphabet` capability).

    def reward(self, task: Task, completion: str) -> float:
        """The reward of ``completion`` for ``task``, in [0, 1]."""
        ...


@runtime_checkable
class CharacterAlphabet(Protocol):
    """A dataset that names every character a prompt or a good answer can contain, so a
    model family can build a character-level tokenizer for a preset."""

    alphabet: str


@runtime_checkable
class RewardMetrics(Protocol):
    """A dataset whose reward keeps counters worth watching (answers the verifier could
    not parse, completions without an answer): the ``rl`` driver adds them to every
    step's metrics."""

    def reward_metrics(self) -> Mapping[str, float]:
        """The reward's counters so far, by metric name (counts since the dataset was made)."""
        ...


@runtime_checkable
class RewardPart(Protocol):
    """One part of a job's reward (``[reward] parts = [...]``): the job's reward of a
    completion is the sum of every part's score times its ``weight``. Made by
    ``factory(config, dataset=DATASET)``: the ``dataset`` part scores with the dataset's
    own reward; others with a model, a judge, a function. A part that cannot score raises
    (a UserError for what the user can fix); it never answers a silent zero."""

    weight: float  # its share of the job's reward (from its config; 1.0 unless set)

    def score(self, tasks: Sequence[Task], completions: Sequence[str]) -> Sequence[float]:
        """One finite number per (task, completion) pair, in order."""
        ...


@runtime_checkable
class FiniteDataset(Protocol):
    """A dataset with a fixed list of rows (files of prompts): an evaluation takes them
    all, once each, in file order."""

    def rows(self) -> Sequence[Task]:
        """Every row once, in order (a UserError names every bad row)."""
        ...


@runtime_checkable
class AnswerExtraction(Protocol):
    """A dataset whose reward compares an answer it extracts from a completion (a number,
    a boxed expression, a letter): an evaluation's majority vote (maj@k) counts those."""

    def extract_answer(self, task: Task, completion: str) -> str | None:
        """The answer ``task``'s reward would compare, normalized (None: the completion holds none)."""
        ...


@runtime_checkable
class DataSources(Protocol):
    """A dataset whose rows name where they come from (verl's and SkyRL's ``data_source``):
    an evaluation reports its metrics per source too."""

    def data_source(self, task: Task) -> str | None:
        """``task``'s data source (None: its row names none)."""
        ...


@attrs.frozen
class EnvStep:
    """What an episode answers to one response.

    ``observation``: what the environment says next, appended after the response's
    tokens and masked from the loss: chat messages (``{"role": ..., "content": ...}``,
    rendered with the tokenizer's chat template, only the new messages' tokens), plain
    text (encoded as it is: for tokenizers without a chat template, e.g. a preset's) or
    token ids (appended exactly); ``None`` when ``done``. ``reward``: this turn's reward
    (the ``rl`` job sums or discounts the turns' rewards into the trajectory's).
    ``metrics``: numbers worth averaging over the step's trajectories (``tool_calls``,
    ``invalid_calls``, ...)."""

    observation: Any = None
    reward: float = 0.0
    done: bool = False
    metrics: Mapping[str, float] = attrs.field(factory=dict)


@runtime_checkable
class Episode(Protocol):
    """One trajectory's environment, made by :meth:`Environment.episode`. The ``rl`` job
    calls ``reset`` once, then ``step`` once per generated response until an answer is
    ``done`` (or the job's turn or token budget ends the trajectory), then ``close``
    (always, also after a failure). Calls of one episode never overlap; different
    episodes' calls run concurrently in worker threads, each ``step`` under the job's
    ``step_timeout``. An exception, a timeout or a malformed answer ends only this
    trajectory (counted in the step's metrics)."""

    def reset(self) -> Any:
        """The first observation (the prompt): chat messages, plain text or token ids."""
        ...

    def step(self, response: str) -> EnvStep:
        """Answer the model's ``response`` (its text, stop tokens removed)."""
        ...

    def close(self) -> None:
        """Release what the episode holds (processes, folders). Called exactly once."""
        ...


@runtime_checkable
class Environment(Protocol):
    """Multi-turn and tool-using environments (``[environment] name``): built once per
    job by ``factory(config, dataset=DATASET, seed=SEED)``; makes one :class:`Episode`
    per trajectory from a dataset record. ``episode`` is a pure function of
    ``(task, seed)`` so a resumed job replays the same trajectories; it may be called
    from worker threads."""

    def episode(self, task: Task, *, seed: int) -> Episode:
        """A fresh episode for ``task`` (``seed``: this trajectory's, for any randomness)."""
        ...


@runtime_checkable
class JobDriver(Protocol):
    """The loop of one job kind. Made by ``factory(run)``; reports each step with
    ``run.report(step, metrics)``."""

    def run(self) -> None: ...


@runtime_checkable
class StandaloneEvaluation(Protocol):
    """A job driver that can evaluate without training (``skyrl eval``): it builds what the
    job's ``[eval]`` needs, evaluates the weights it was given (the run's ``resume_path``
    checkpoint, or the model the job names), and stops everything it started."""

    def evaluate_alone(self) -> Mapping[str, Any]:
        """The evaluation's results: ``overall`` and ``by_data_source`` metrics, seconds, settings."""
        ...


@attrs.define
class LoadedModel:
    """What a model family hands the backend and the engine."""

    model: Any  # a torch.nn.Module (a transformers PreTrainedModel for the built-in families)
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    stop_token_ids: Sequence[int]  # generation ends at any of these (the EOS token first)
    family: str = ""
    # The model's MoE routers in layer order (empty for a dense model), as the family's
    # ``routers(model)`` lists them: for routing capture in the engine and replay in the trainer.
    routers: Sequence["RouterInfo"] = ()
    # The family's ``lora_targets``: names (last module-path component) of the nn.Linear
    # modules LoRA adapts by default, e.g. ("q_proj", "k_proj", ...); empty if it names none.
    lora_targets: Sequence[str] = ()
    # The family's ``precision_keep``: module-path components a quantized precision keeps
    # in high precision (output head, embeddings, routers; norms always stay).
    precision_keep: Sequence[str] = ()
    # Router-shaped modules the family found but cannot describe as a RouterInfo (their
    # weights follow another rule): {module path: why}, for the message of whoever needs
    # routers (r3, routing capture).
    router_problems: Mapping[str, str] = attrs.Factory(dict)


@attrs.frozen
class RouterInfo:
    """One MoE router of a model, as a model family describes it (for routing capture
    in the engine and routing replay in the trainer)."""

    layer: int  # index of the decoder layer
    path: str  # dotted module path of the router, e.g. "model.layers.1.mlp.gate"
    kind: str  # "softmax_topk" | "sigmoid_group_topk"
    n_experts: int
    top_k: int
    # How the chosen experts' weights follow from the router logits:
    # softmax_topk: softmax over all experts, gathered at the chosen ids;
    # sigmoid_group_topk: sigmoid scores gathered at the chosen ids (the correction
    # bias only affects the choice). Then divided by their sum when ``normalize``,
    # then multiplied by ``scale`` (``routed_scaling_factor``).
    normalize: bool = True
    scale: float = 1.0


@runtime_checkable
class ModelFamily(Protocol):
    """A model family (``[model] family``): which transformers model types it
    covers, how to build, load and save its models."""

    model_types: Sequence[str]

    def load(self, *, alphabet: str | None, seed: int) -> LoadedModel:
        """Build a preset (random weights from ``seed``, a tokenizer for the
        characters of ``alphabet``) or load the local Hugging Face folder the
        config names."""
        ...

    def save(self, loaded: LoadedModel, path: str) -> None:
        """Write a Hugging Face folder (config.json, *.safetensors, tokenizer
        files) that ``AutoModelForCausalLM.from_pretrained`` loads."""
        ...

    # Capabilities families may offer: :class:`TokenizerLoading` (the tokenizer alone)
    # and :class:`WeightLayout` (in-memory <-> on-disk weight names). What a family knows
    # about a loaded model (its MoE routers, LoRA targets, layers kept in high precision)
    # travels in the LoadedModel.


@attrs.frozen
class SampleOutput:
    token_ids: Any  # torch.LongTensor [B]
    logprobs: Any  # torch.FloatTensor [B]: log_softmax(logits / temperature) at the chosen ids


@runtime_checkable
class Sampler(Protocol):
    """Chooses the next token from logits (``[sampler] name``). ``temperature`` is
    public so the trainer scores tokens under the same distribution."""

    temperature: float

    def sample(self, logits: Any, generator: Any) -> SampleOutput:
        """``logits``: float32 [B, V]; ``generator``: a seeded torch.Generator. The
        returned logprobs are of the temperature-scaled full distribution (what
        the trainer computes), not of the truncated one."""
        ...


@runtime_checkable
class Engine(Protocol):
    """Generates rollouts (``[engine] name``) and receives new weights."""

    weight_version: int

    def start(self, loaded: LoadedModel, *, precision: "Precision | None" = None,
              sampler: "Sampler | None" = None) -> None:
        """Take the model to serve (the engine keeps its own copy or view). Both keywords
        are always passed by the host: ``precision``, the job's (an engine that cannot
        serve a quantizing precision raises a UserError naming it); ``sampler``, the
        job's (what the engine must be ready to return, e.g. servers started with
        sampling masks on when the sampler asks for supports; an engine may ignore it)."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        sampler: Sampler,
        max_new_tokens: int,
        seed: int,
        group_offset: int = 0,
    ) -> Any:
        """Sample ``n`` responses for every prompt (token ids); returns a
        :class:`skyrl_host.rollout.RolloutBatch` whose sequences are ordered
        prompt by prompt, with ``group_ids = group_offset + prompt index``, stop
        tokens included in the response, and the current ``weight_version``."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """Apply a complete new set of weights at a safe point (between generate
        calls) and start reporting ``version``."""
        ...

    # Capabilities engines may offer: SharedWeights, UpdateStats, AdapterServing,
    # SideChannels, TurnContinuation, AbortingUpdates (below).


@attrs.define
class LossInputs:
    """Per-token tensors of one micro-batch (all float32 [N] unless stated) and the
    normalisers of the whole optimizer step (all micro-batches, all ranks)."""

    logprobs: Any  # current policy, with grad
    old_logprobs: Any  # policy before this step's updates (detached)
    engine_logprobs: Any  # what the engine reported
    advantages: Any
    mask: Any  # float32 1/0: tokens that train
    seq_ids: Any  # int64 [N]: sequence index within the micro-batch, 0..n_seqs-1
    n_seqs: int
    global_tokens: float  # masked tokens in the whole step
    global_seqs: float  # sequences in the whole step
    ref_logprobs: Any = None  # frozen reference policy, when the algorithm asks for it
    teacher_logprobs: Any = None  # the [teacher]'s logprobs of the same tokens, when the job has one
    teacher_topk_logprobs: Any = None  # [N, k]: the [teacher]'s k most likely tokens' logprobs, when asked
    topk_logprobs: Any = None  # [N, k]: the current policy's logprobs of those tokens, with grad
    max_response_len: int = 0  # the job's max_new_tokens (Dr. GRPO's constant normaliser)


@runtime_checkable
class Algorithm(Protocol):
    """Rewards to advantages, group filtering, and the policy loss
    (``[algorithm] name``)."""

    needs_reference: bool  # the backend must keep a frozen reference model
    dynamic_sampling: bool  # the driver refills dropped groups with further prompts...
    max_refill_rounds: int  # ...at most this many times per step

    def shape_rewards(self, batch: Any, max_new_tokens: int) -> Any:
        """float32 [S]: the rewards used for advantages (e.g. overlong shaping)."""
        ...

    def keep(self, batch: Any, rewards: Any) -> Any:
        """bool [S]: sequences to train on (dynamic sampling drops whole groups)."""
        ...

    def advantages(self, batch: Any, rewards: Any) -> Any:
        """float32 [T]: one advantage per token of the packed batch (0 outside
        ``loss_mask``)."""
        ...

    def loss(self, inputs: LossInputs) -> tuple[Any, Mapping[str, Any]]:
        """The micro-batch's share of the step loss (summing the shares of every
        micro-batch and rank gives the step loss) and metric tensors."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Owns parameters and optimizer; trains on rollouts (``[backend] name``)."""

    def start(
        self, loaded: LoadedModel, *, seed: int, total_steps: int, reference: bool, replay: Sequence[Any] = (),
        precision: "Precision | None" = None,
    ) -> None:
        """Take the model to train; ``replay``: the job's ReplayStrategy objects (bind
        each to the policy model, enter ``replaying`` around every policy forward);
        ``precision``: the job's (a backend that cannot compute quantized raises a
        UserError naming it). The host passes every keyword. Raises ValueError when a
        replay strategy does not apply to the model."""
        ...

    def train_step(
        self, batch: Any, advantages: Any, algorithm: Algorithm, *, temperature: float, max_new_tokens: int
    ) -> Mapping[str, float]:
        """One optimizer step over ``batch`` (a RolloutBatch) with token-level
        ``advantages`` (float32 [T]); returns metrics (loss, entropy, kl, ...)."""
        ...

    def named_weights(self) -> Iterable[tuple[str, Any]]:
        """The weights to publish to the engine, as (name, tensor) pairs."""
        ...

    # Capabilities backends may offer: QuantizedServing, AdapterTraining,
    # ShardedWeights, ReferenceScoring, OwnWeights, ShardedCheckpoints (below).

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@attrs.frozen
class ReplayView:
    """One forward of the trainer, as a replay strategy sees it. The backend lays the
    batch's tokens out in its own way (rows, padding, micro-batches); these indices
    map that layout back to the RolloutBatch, so a strategy can fetch the side-channel
    rows of exactly the tokens the forward sees."""

    batch: Any  # the RolloutBatch being trained on
    slot_tokens: Any  # numpy int64 [n_slots]: the batch token at each input slot of the forward, row-major (-1: padding)
    scored_tokens: Any  # numpy int64 [K]: the batch token whose logprob each scored position computes
    device: Any  # where the forward runs (a torch.device)


@runtime_checkable
class ReplayStrategy(Protocol):
    """Makes the trainer score exactly what the engine sampled (``[replay] strategies``),
    from a RolloutBatch side channel the engine filled.

    A backend calls ``bind`` once when it starts, then, for every forward of the
    policy (and its backward), enters ``replaying(view)``. Strategies that change how
    token logprobs follow from the final hidden states also offer
    ``score(hidden, head, targets, view, temperature) -> (logprobs [K], entropy [K])``.
    A backend without hooks of its own kind (Megatron's RouterReplay) may implement a
    strategy natively by its ``name`` and ``side_channel`` instead."""

    name: str
    side_channel: str  # the RolloutBatch side channel it needs, e.g. "routed_experts"

    def bind(self, model: Any, loaded: LoadedModel) -> None:
        """Prepare ``model`` (the backend's own module, e.g. install router hooks);
        ``loaded`` says what the family knows (``routers``). Raises ValueError when the
        strategy does not apply (r3 on a model without MoE layers)."""
        ...

    def replaying(self, view: ReplayView) -> ContextManager[Any]:
        """Active around one forward (and its backward) of the policy over ``view``.
        Raises ValueError when the batch lacks the side channel or it is mis-shaped."""
        ...


@runtime_checkable
class Precision(Protocol):
    """How the backend computes and what the engine serves (``[precision] name``).

    A quantized precision fake-quantizes the chosen layers in the trainer's forward
    (straight-through gradients, master weights kept in high precision) and ships the
    engine exactly the quantized weights that forward used: each as its payload under
    its own name plus its scales under ``f"{name}@{format}"`` (the format tag), so
    every transport carries them as ordinary named tensors."""

    name: str
    quantizes: bool  # False for a precision that changes nothing (bf16)

    def prepare_model(self, model: Any, *, keep: Sequence[str] = (), train: bool = True, source: Any = None) -> Any:
        """Install the precision on ``model`` in place (``train=True``: the backend's
        policy; ``False``: an engine's own copy, whose chosen weights become their
        quantized values). ``keep``: module-path components that stay in high precision
        (the family's ``precision_keep``). Returns the names of the quantized weights."""
        ...

    def invalidate(self) -> None:
        """The weights changed (an optimizer step, a loaded checkpoint)."""
        ...

    def pack(self, named_tensors: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """What the sender ships: quantized weights as payload + scales, the rest as given."""
        ...

    def unpack(self, named_tensors: Iterable[tuple[str, Any]], dtype: Any) -> Iterable[tuple[str, Any]]:
        """The engine's side: payload + scales back to the weights the trainer computed with."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """Moves new weights from the backend to the engine (``[weight_sync] transport``).

    Transports between processes have two decoupled halves, so either side can be
    swapped: ``transport.sender(**context).publish(version, named_tensors)`` in the
    trainer's process, and ``transport.receiver(**context)``: ``fetch()`` (while the
    engine generates) then ``apply(engine)`` at a safe point in the engine's process
    (``sync(engine)`` does both). ``collective = True`` marks a transport whose halves
    take part in the same collectives (start the receiver's ``sync`` before ``publish``);
    otherwise the receiver reads what ``publish`` wrote. Versions grow
    monotonically; a receiver applies only complete, verified versions, through
    ``engine.update_weights``, and otherwise raises naming the version and the file
    or peer, leaving the engine on its last complete version."""

    def publish(self, backend: Backend, engine: Engine, version: int) -> Mapping[str, float]:
        """Both halves in one process: make ``version`` of the backend's weights the
        engine's; returns metrics (bytes moved, seconds)."""
        ...


@runtime_checkable
class DataStrategy(Protocol):
    """The order in which an SFT job reads documents (``[data] strategy``).

    The driver calls ``bind`` once, then ``draw`` once per document it trains on;
    ``state_dict``/``load_state_dict`` checkpoint the position, so a resumed job
    draws exactly the documents the uninterrupted one would have drawn.
    Strategies import numpy at most: the host keeps no data in them."""

    def bind(self, lengths: Sequence[Any], seed: int) -> None:
        """Start at the beginning over these datasets: ``lengths[d]`` is dataset
        ``d``'s token count per document (an int array with one entry per document,
        usually memory-mapped: read only the entries you need); ``seed`` is the
        job's seed. Raises ValueError when the strategy cannot serve them (weights
        for three datasets given two, no documents at all)."""
        ...

    def draw(self, step: int) -> tuple[int, int]:
        """The next document, as (dataset index, document index), for training
        step ``step`` (counting from 1). Deterministic given the seed, the datasets
        and the draws before; never ends (epochs wrap around)."""
        ...

    def state_dict(self) -> Mapping[str, Any]:
        """The position, as JSON-able values (numbers, strings, lists, dicts)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position from ``state_dict`` into a strategy bound to the same
        datasets and seed."""
        ...


# ---------------------------------------------------------------------------
# Traits: what other plugins may know of a selected plugin from its options alone.
#
# A plugin declares them with ``register(..., traits=fn)``: ``fn(config)`` returns its
# kind's traits class below (kinds without one have none). Job-level checks
# (``skyrl validate``) and other plugins read ``choice.traits`` (a
# :class:`skyrl_host.config.PluginChoice`), never another plugin's options by name; a
# plugin that declares none gets the class's defaults ("unknown", "off"). ``switches``
# maps a trait to the option of the plugin that turns it on, for messages ("set
# engine.return_routed_experts = true").
# ---------------------------------------------------------------------------


@attrs.frozen
class ModelTraits:
    """A ``[model]`` choice."""

    name: str | None = None  #: how messages name the model: its folder or preset
    key: str = "model"  #: the job key that chose it: "model.path", "model.preset"
    path: str | None = None  #: the local Hugging Face folder (absolute), if any
    model_type: str | None = None  #: transformers' model_type, when known
    dtype: str | None = None  #: the dtype its weights are loaded in ("float32", "bfloat16")
    is_moe: bool | None = None  #: has mixture-of-experts layers (None: unknown until loaded)
    has_indexer: bool | None = None  #: attends through a sparse-attention key indexer (GLM-5, DeepSeek-V3.2)


@attrs.frozen
class EngineTraits:
    """An ``[engine]`` choice."""

    dtype: str | None = None  #: the dtype it serves ("auto": the model's; None: unknown)
    device: str = "auto"
    token_versions: bool | None = None  #: records each token's weight version (None: cannot say before it starts)
    routed_experts: bool | None = None  #: records routed experts for r3 (None: it cannot; False: it can, off)
    indexer_topk: bool = False  #: can record a sparse-attention indexer's picks for r3
    switches: Mapping[str, str] = attrs.field(factory=dict, converter=lambda m: types.MappingProxyType(dict(m)))


@attrs.frozen
class AlgorithmTraits:
    """An ``[algorithm]`` choice."""

    #: it learns from a teacher (opd's advantages; any algorithm's ``teacher_kl_coef``): the
    #: job needs ``[teacher]``, whose logprobs of the sampled tokens the driver puts in the
    #: batch's ``teacher_logprobs`` side channel (float32 [T]) before ``advantages``; the
    #: backend gives each micro-batch's share to the loss as ``LossInputs.teacher_logprobs``
    teacher: bool = False
    #: k > 0: the loss also needs the teacher's k most likely tokens at each position: the
    #: driver adds ``teacher_topk_ids`` (int32 [T, k]) and ``teacher_topk_logprobs`` ([T, k])
    #: side channels, the backend gives the loss ``LossInputs.teacher_topk_logprobs`` and the
    #: policy's logprobs of the same ids, ``LossInputs.topk_logprobs`` (with their gradient)
    teacher_topk: int = 0


@attrs.frozen
class BackendTraits:
    """A ``[backend]`` choice."""

    owns_weights: bool = False  #: trains tensors of its own making, never the loaded model's (OwnWeights)
    adapter_rank: int | None = None  #: LoRA rank it trains (0: every weight; None: it trains no adapters)
    adapter_targets: tuple[str, ...] | None = None  #: the modules its adapters cover (None: its default)
    device: str = "auto"
    data_parallel: bool = False  #: its ranks split batches (DDP, FSDP2); False: one rank only
    switches: Mapping[str, str] = attrs.field(factory=dict, converter=lambda m: types.MappingProxyType(dict(m)))


@attrs.frozen
class SamplerTraits:
    """A ``[sampler]`` choice."""

    support: bool = False  #: returns each token's sample support (for support replay)
    greedy: bool = False  #: takes the most likely token (temperature and truncation do not apply)
    #: the truncation it applies, in this order; None where it is not of this shape (an engine
    #: that reproduces samplers by these numbers refuses it)
    temperature: float | None = None
    top_k: int | None = None  #: 0: off
    top_p: float | None = None  #: 1.0: off
    min_p: float | None = None  #: 0.0: off
    logprobs: str = "processed"  #: "processed": of the distribution sampled from; "full": log_softmax(logits / T)
    switches: Mapping[str, str] = attrs.field(factory=dict, converter=lambda m: types.MappingProxyType(dict(m)))


# ---------------------------------------------------------------------------
# Capabilities: what a plugin may offer beyond its kind's Protocol.
#
# A job that needs a capability asks for it by name when it is built
# (:func:`skyrl_host.contracts.require`): a plugin lacking it is a user error naming
# the plugin and the missing members, never an AttributeError half-way through.
# A plugin offers a capability by having its members; no registration is needed.
# ---------------------------------------------------------------------------


@runtime_checkable
class TokenizerLoading(Protocol):
    """A model family that can hand out its tokenizer alone (a driver whose models live
    in other processes only encodes and decodes)."""

    def load_tokenizer(self, *, alphabet: str | None) -> LoadedModel:
        """What ``load`` gives, with ``model=None``: the same tokenizer, stop ids and
        family facts, without building or reading the model."""
        ...


@runtime_checkable
class WeightLayout(Protocol):
    """A model family that maps in-memory weight names (fused experts) to the on-disk
    Hugging Face ones, both ways."""

    def disk_weights(self, model: Any, named: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]: ...

    def memory_weights(self, model: Any, disk: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def weight_layout(self, model: Any) -> Any: ...


@runtime_checkable
class SamplingTraits(Protocol):
    """A sampler object that states what it does (its :class:`SamplerTraits`), for an
    engine that reproduces samplers by their numbers (vLLM) rather than calling them."""

    traits: SamplerTraits


@runtime_checkable
class SupportSampling(Protocol):
    """A sampler that can report, with each token, the candidate set it kept (for the
    ``support`` replay strategy)."""

    return_support: bool  # the job asked for support sets (``[sampler] return_support``)

    def sample_with_support(self, logits: Any, generator: Any) -> tuple[SampleOutput, Any]:
        """As ``sample``, plus a bool [B, V] mask of the kept candidates."""
        ...


@runtime_checkable
class QuantizedServing(Protocol):
    """A backend that serves the engine the weights its quantized forward used."""

    def serving_weights(self, local: bool = False) -> Iterable[tuple[str, Any]]:
        """With a quantizing precision: each quantized weight as its payload under its
        own name plus its scales under ``f"{name}@{format}"``; the rest as
        ``named_weights`` gives them. ``local=True``: this rank's own shards only
        (sharded transports)."""
        ...


@runtime_checkable
class ActivationQuantizing(Protocol):
    """A precision a backend can apply to layers of its own making (megatron-core's fused
    linears rather than the transformers model's modules): the weights through ``pack`` /
    ``unpack``, the activations through this."""

    def fake_activation(self, x: Any) -> Any:
        """``x`` as a chosen layer's input computes with it (fake-quantized, no gradient),
        or None where this precision keeps activations in high precision."""
        ...


@runtime_checkable
class AdapterTraining(Protocol):
    """A backend that trains LoRA adapters on a frozen base."""

    def adapter_config(self) -> Mapping[str, Any] | None:
        """The adapters' configuration (rank, alpha, targets) in PEFT's terms, or None
        when this backend trains full weights."""
        ...

    def named_adapters(self) -> Iterable[tuple[str, Any]]:
        """The adapter tensors (a collective under FSDP2: every rank iterates)."""
        ...

    def save_adapters(self, path: str, *, base_model: str | None = None) -> None:
        """Write the adapters into the folder ``path`` in PEFT's format (``adapter_config.json``
        + ``adapter_model.safetensors``, which ``peft`` and vLLM load); rank 0 writes.
        ``base_model``: the folder of the frozen base the adapters apply to (their
        ``base_model_name_or_path``), None where there is none to name."""
        ...


@runtime_checkable
class ShardedWeights(Protocol):
    """A backend that can name the weights this rank holds, without gathering (DTensor
    shards under FSDP2, whole tensors otherwise): what sharded transports serve."""

    def local_weights(self) -> Iterable[tuple[str, Any]]: ...


@runtime_checkable
class ReferenceScoring(Protocol):
    """A backend that keeps a frozen reference model and scores batches with it (a KL
    penalty on the rewards)."""

    def reference_logprobs(self, batch: Any, *, temperature: float) -> Any:
        """float32 [T]: the reference policy's logprob of every token (0 outside the
        loss tokens)."""
        ...


@runtime_checkable
class SharedWeights(Protocol):
    """An engine that may serve the trainer's own tensors (one process, same dtype and
    device): ``update_weights`` then moves nothing, and a transport must not hand it
    weights in another dtype."""

    shares_weights: bool


@runtime_checkable
class OwnWeights(Protocol):
    """A backend that trains tensors of its own making (megatron-core's, converted from the
    loaded model), never the loaded model's: an engine sharing the loaded model's tensors
    (:class:`SharedWeights`) does not share the trainer's, and is handed copies."""

    owns_weights: bool


@runtime_checkable
class ShardedCheckpoints(Protocol):
    """A backend whose ranks write and read their own parts of the training state in a
    checkpoint's folder (megatron-core's distributed checkpointing): no rank gathers the
    whole state, and a checkpoint resumes under another parallel layout. Both are
    collectives (every rank calls them with the same folder, which the ranks share); the
    drivers call them instead of ``state_dict`` / ``load_state_dict``
    (``skyrl_host.checkpoints.save_backend_state`` / ``load_backend_state``)."""

    def save_checkpoint(self, folder: str) -> None: ...

    def load_checkpoint(self, folder: str) -> None: ...


@runtime_checkable
class UpdateStats(Protocol):
    """An engine that says what its last weight update moved."""

    last_update: Mapping[str, int]  # {"bytes": ..., "shared": n tensors, "copied": n tensors}


@runtime_checkable
class AdapterServing(Protocol):
    """An engine that serves LoRA adapters over its frozen base."""

    def update_adapter(self, named_tensors: Iterable[tuple[str, Any]], config: Mapping[str, Any], version: int) -> None:
        """Swap in a complete new set of adapters at a safe point; generations in flight
        keep the adapters they started with."""
        ...


@runtime_checkable
class SideChannels(Protocol):
    """An engine that fills RolloutBatch side channels (``routed_experts``,
    ``sample_support``) besides tokens and logprobs."""

    def side_channels(self, sampler: Sampler) -> set[str]:
        """The side channels every batch of ``generate`` with ``sampler`` carries, as
        this engine is configured."""
        ...


@runtime_checkable
class AbortingUpdates(Protocol):
    """An engine that, when ``update_weights`` lands in a generation in progress, can abort
    that generation's requests and resubmit them with what they generated: each request's
    generated tokens become part of its continued prompt, prefilled with the new weights,
    and decoding goes on from there (instead of on the old weights' KV). The returned
    batch is the same as without an abort: prompt, all generated tokens, their sampling
    logprobs, and (``token_versions``) the version that produced each token."""

    resubmitted: int  # requests resubmitted so far (one per live request per abort)

    def abort_on_update(self, enabled: bool) -> None:
        """Abort and resubmit (``True``) or continue on the kept KV (``False``, the default)
        at an update that lands inside a generation; raises a UserError where the engine, as
        configured, cannot resubmit (e.g. recorded routes it could not keep consistent)."""
        ...


@runtime_checkable
class TurnContinuation(Protocol):
    """An engine that continues conversations (multi-turn rollouts)."""

    def continue_turn(
        self, history: Any, turns: Sequence[Sequence[int]], *, sampler: Sampler, max_new_tokens: int, seed: int
    ) -> Any:
        """One response per conversation of ``history`` (a RolloutBatch) after the tokens
        ``turns[i]``, returned as the new turn's segment only (see
        :meth:`skyrl_host.rollout.RolloutBatch.append_turn`); the earlier turns' side
        channels (routes) are forced, not recomputed."""
        ...


@runtime_checkable
class ScoringReplay(Protocol):
    """A replay strategy that changes how token logprobs follow from hidden states."""

    def score(self, hidden: Any, head: Any, targets: Any, view: ReplayView, temperature: float) -> tuple[Any, Any]:
        """(logprobs [K], entropy [K]) of the ``targets`` at the scored positions. ``head``:
        the output head (``weight`` [V, H], ``bias``), or under tensor parallelism a
        :class:`VocabShard` (this rank's rows of the vocabulary)."""
        ...


@runtime_checkable
class VocabShard(Protocol):
    """An output head that holds one tensor-parallel rank's rows of the vocabulary: its
    ``weight`` is rows ``vocab_start .. vocab_start + len(weight)`` of ``vocab_size``. A
    scorer reduces its maxima and sums over the ranks with ``all_reduce`` instead of
    gathering logits."""

    vocab_start: int
    vocab_size: int

    def all_reduce(self, tensor: Any, op: str) -> None:
        """In place over the ranks holding the other shards; ``op``: "max" or "sum"."""
        ...


@runtime_checkable
class RewardKL(Protocol):
    """An algorithm that may apply its KL penalty to the rewards instead of the loss."""

    kl_in_reward: bool  # the job asked for it

    def kl_reward_penalty(self, batch: Any, ref_logprobs: Any) -> Any:
        """float32 [S]: the penalty subtracted from each sequence's reward."""
        ...


@runtime_checkable
class WeightSender(Protocol):
    """The trainer's half of a split transport."""

    def publish(self, version: int, named_tensors: Any) -> Mapping[str, float]:
        """Publish ``version`` (the tensors; a backend for transports that carry their
        payload). Returns metrics, or (metrics, payload) with ``carries_payload``."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """The engine's half of a split transport."""

    def sync(self, engine: Engine, **kwargs: Any) -> Mapping[str, float]:
        """Fetch and apply a version (``target=``; ``payload=`` for transports that carry
        it), all or nothing."""
        ...


@runtime_checkable
class WorkerReceiving(Protocol):
    """An engine whose own worker processes run a transport's receiving half (vLLM's
    workers, through vLLM's weight-transfer plugins): a receiver that offers a
    ``worker_recipe()`` hands the engine that recipe instead of tensors."""

    receives_in_workers: bool  # false where this engine, as configured, cannot
    device: str  # where the workers hold the weights ("cpu", "cuda"): decides a collective group's backend

    def worker_ranks(self) -> int:
        """How many worker processes run a receiver: the ranks a collective recipe's group
        gives this engine."""
        ...

    def init_workers(self, recipe: Mapping[str, Any]) -> None:
        """Build the receiver ``recipe`` names in every worker now. A recipe is
        ``{"receiver": "NAME", "kwargs": {...}}``, NAME an entry point of the
        ``skyrl.receivers`` group (never an importable path); a collective one also has
        ``"group": {"address", "world", "backend", "rank"}``: the engine's k-th worker
        joins that weight group (:func:`skyrl_toolkit.groups.weight_group`) as ``rank + k``,
        and this call blocks until every member joined, so the sender joins meanwhile."""
        ...

    def fetch_in_workers(self, recipe: Mapping[str, Any], target: int) -> None:
        """Start fetching ``target`` in every worker and return at once: the workers go on
        generating while it arrives; ``receive_in_workers`` for the same target then waits
        for it and applies it (a staged hand-over: the fetch starts when the trainer
        publishes, the pause waits for the commit)."""
        ...

    def receive_in_workers(self, recipe: Mapping[str, Any], target: int | None) -> Mapping[str, float]:
        """Build the receiver ``recipe`` names in every worker (once per recipe), fetch and
        verify ``target`` there, then pause generation, apply it everywhere, resume. All or
        nothing: a failed fetch changes no worker. With a collective recipe the fetch takes
        part in the sender's collectives: the sender publishes meanwhile."""
        ...


@runtime_checkable
class Rendezvous(Protocol):
    """Senders and receivers that meet peer to peer (every trainer rank serves its own
    shards; receivers connect to all of them)."""

    def endpoint(self) -> Any:
        """This sender's address, handed to every receiver's ``connect``."""
        ...


@runtime_checkable
class SplitTransport(Protocol):
    """A transport whose halves run in different processes (what a launcher that places
    engines apart from the trainer needs)."""

    collective: bool  # the halves take part in the same collectives: start the receivers' sync first
    rendezvous: bool  # every trainer rank has a sender; receivers connect to their endpoints
    carries_payload: bool  # the sender returns the payload, the launcher hands it to the receivers

    def sender(self, **context: Any) -> WeightSender:
        """The trainer's half; ``context``: ``group``/``src`` (collective), ``rank``/``world``
        (rendezvous), or nothing."""
        ...

    def receiver(self, **context: Any) -> WeightReceiver:
        """The engine's half; ``context``: ``group``/``src``/``device`` (collective) or nothing.
        For an engine whose workers receive weights themselves (WorkerReceiving) also
        ``engine``, and for a collective transport ``members`` = (address, first rank,
        world, backend) of the group its workers join, instead of ``group``."""
        ...


# ---------------------------------------------------------------------------
# Launchers (``[cluster] launcher``): where backend ranks and engine replicas run.
# ---------------------------------------------------------------------------


@attrs.frozen
class PlacementRequest:
    """What a driver asks a launcher to place: the plugin choices (each a
    :class:`skyrl_host.config.PluginChoice`, created where the launcher builds the
    object: once per process, never by the driver as well) and the facts every copy
    needs to build the same model."""

    model: Any  # [model]
    backend: Any  # [backend]
    precision: Any  # [precision]
    alphabet: str | None
    seed: int
    total_steps: int
    algorithm: Any = None  # [algorithm], or the driver's own Algorithm object (sft's loss)
    replay: Sequence[Any] = ()  # [replay] strategies
    engine: Any = None  # [engine]; None: no engines (sft)
    sampler: Any = None  # [sampler]
    weight_sync: Any = None  # [weight_sync]
    threads: int | None = None
    # Async RL with updates inside generations ([job] weight_updates = "in_flight" or "abort"):
    # a weight sync may reach an engine while it generates (the ray launcher's engine actors
    # then serve a sync beside the generate call in progress).
    in_flight_updates: bool = False
    # Called with the policy's tokenizer as soon as the placement has it, before it starts
    # any process (e.g. the rl driver's check of the chat template); a UserError stops the job.
    check_tokenizer: Callable[[Any], None] | None = None


@runtime_checkable
class BackendHandle(Protocol):
    """What a driver calls on the backend a launcher placed: a :class:`Backend` in the
    driver's process, or a handle on backend ranks elsewhere (which may also offer
    :class:`ReferenceScoring`)."""

    def train_step(
        self, batch: Any, advantages: Any, algorithm: Algorithm, *, temperature: float, max_new_tokens: int
    ) -> Mapping[str, float]: ...

    def state_dict(self) -> Mapping[str, Any]:
        """The full training state (gathered to the driver from sharded ranks)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class EngineHandle(Protocol):
    """What a driver calls on the engines a launcher placed: an :class:`Engine` in the
    driver's process, or a handle spreading each call over engine replicas."""

    weight_version: int  # the oldest version any replica serves

    def generate(
        self, prompts: Sequence[Sequence[int]], *, n: int, sampler: Sampler, max_new_tokens: int, seed: int,
        group_offset: int = 0,
    ) -> Any: ...


@runtime_checkable
class Placement(Protocol):
    """What a launcher hands the driver: handles that satisfy the kinds' Protocols
    wherever the objects run."""

    loaded: LoadedModel  # the driver's copy: tokenizer and stop ids (``model`` may be None)
    backend: BackendHandle
    engine: EngineHandle | None  # None without [engine]
    sampler: Any  # the job's Sampler in the driver's process (None without [sampler]); made once, here
    vocab_size: int  # rows of the trained model's input embedding

    def publish(self, version: int) -> Mapping[str, float]:
        """Make ``version`` of the backend's weights the engines' (through the job's
        transport); returns its metrics."""
        ...

    def save_final(self, path: str) -> None:
        """The trained model as a Hugging Face folder at ``path`` (adapters beside it)."""
        ...

    def close(self) -> None:
        """Stop what ``place`` started (also after a failed start); idempotent."""
        ...


@runtime_checkable
class StagedTransport(Protocol):
    """A weight transport that moves a version toward the engine while it still
    generates (send, fetch, verify) and applies it later, the apply the only pause
    (async RL: :mod:`skyrl_host.asyncrl`)."""

    def stage(self, backend: Backend, engine: Engine, version: int) -> Mapping[str, float]:
        """Send ``version`` and start bringing it to the engine's side; the engine is not
        touched and may be generating. Returns metrics."""
        ...

    def commit(self, engine: Engine, version: int) -> Mapping[str, float]:
        """Apply the staged ``version`` (the engine is idle); all or nothing. Returns metrics."""
        ...


@runtime_checkable
class StagedPlacement(Protocol):
    """A placement whose ``publish`` can be split into :meth:`stage` (while the engines
    generate) and :meth:`commit` (while they are idle)."""

    def stage(self, version: int) -> Mapping[str, float]: ...

    def commit(self, version: int) -> Mapping[str, float]: ...


@runtime_checkable
class TeacherPlacement(Protocol):
    """A placement that runs a distilling job's ``[teacher]`` in a process of its own (the
    Ray launcher: an actor, with a GPU of its own when the cluster has one free), so the
    driver keeps only the tokenizer."""

    def place_teacher(self, family: Any, options: Any, *, alphabet: str | None, seed: int,
                      temperature: float) -> Any:
        """Start the teacher (``family``: the [teacher]'s model-family choice; ``options``:
        its host keys); returns what scores batches: ``score(batch, k)`` (as
        :meth:`skyrl_host.jobs.teacher.Teacher.score`), ``vocab()`` (its tokenizer's) and
        ``counters`` (a dict the step's metrics gain)."""
        ...


@runtime_checkable
class EngineSideCommit(Protocol):
    """A :class:`StagedPlacement` whose :meth:`~StagedPlacement.stage` may take a version
    from the trainer whole, so that :meth:`~StagedPlacement.commit` touches only the
    engines and may run while the trainer trains the next step (async RL then applies each
    version from the rollout thread, just before the rollout that needs it)."""

    def commit_on_engine_side(self) -> bool:
        """True when the staged versions' commits need nothing more from the trainer."""
        ...


@runtime_checkable
class OrderedTrainStep(Protocol):
    """A :class:`Backend` (a launcher's handle on remote ranks) whose calls run in the order
    they are made, so a train step can be started now and waited for later: a call made in
    between (a placement's :meth:`~StagedPlacement.stage`) runs right after the step, with
    no round trip to the driver between them. Async RL stages each version so."""

    def start_train_step(self, batch: Any, advantages: Any, algorithm: Any, *, temperature: float,
                         max_new_tokens: int) -> Callable[[], tuple[Mapping[str, float], float]]:
        """Start :meth:`Backend.train_step`; returns ``finish()``, which waits for it and
        returns its metrics and the seconds from the start to the step's end."""
        ...


@runtime_checkable
class Launcher(Protocol):
    """Places a job's backend ranks and engine replicas (``[cluster] launcher``).

    Made by ``factory(config, cluster)`` (``cluster``: the host's
    :class:`skyrl_host.config.ClusterSection`); the driver calls ``place`` once."""

    def place(self, request: PlacementRequest) -> Placement: ...


# ---------------------------------------------------------------------------
# Corpora (``[corpus] reader``): pretokenized documents for SFT.
# ---------------------------------------------------------------------------


@runtime_checkable
class Corpus(Protocol):
    """One pretokenized corpus, opened: documents of token ids with an optional loss mask."""

    n_docs: int
    lengths: Any  # int array [n_docs]: tokens per document (memory-mapped: read what you need)
    meta: Mapping[str, Any]  # e.g. {"vocab_size": ...}

    def tokens(self, i: int) -> Any:
        """Document ``i``'s token ids (a read-only array view)."""
        ...

    def mask(self, i: int) -> Any:
        """Document ``i``'s loss mask (uint8 1/0 per token), or None when the corpus has none."""
        ...

    def read_into(self, i: int, tokens_out: Any, mask_out: Any = None) -> int:
        """Copy document ``i``'s ids into ``tokens_out[:n]`` (and its mask into
        ``mask_out[:n]``, ones without one); returns ``n``: a packer's copy, with no
        view kept."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class CorpusPieces(Protocol):
    """A :class:`Corpus` capability: copy many pieces (token ranges of documents) into
    one buffer in one call. The ``sft`` driver packs each step through it; a corpus
    without it is packed from its ``tokens(i)`` / ``mask(i)`` views, piece by piece
    (the same batch, slower)."""

    dtype: Any  # the token ids' numpy dtype: read_pieces_into's tokens_out is of it

    def read_pieces_into(self, docs: Any, starts: Any, ends: Any, at: Any, tokens_out: Any, mask_out: Any) -> int:
        """For every ``k``: tokens ``starts[k]:ends[k]`` of document ``docs[k]`` into
        ``tokens_out[at[k]:at[k] + ends[k] - starts[k]]``, and the same range of its
        loss mask into ``mask_out`` (ones without one); returns the tokens copied."""
        ...


@runtime_checkable
class CorpusReader(Protocol):
    """Opens pretokenized corpora (``[corpus] reader``)."""

    def open(self, path: str, *, storage_options: Mapping[str, Any] | None = None, cache_dir: str | None = None) -> Corpus:
        """Open the corpus at ``path`` (a path prefix or an fsspec URL), or raise a
        UserError naming the path and what is wrong with it."""
        ...


# ---------------------------------------------------------------------------
# Observers (``[observers] use = [...]``): where a run's metrics go besides metrics.jsonl.
# ---------------------------------------------------------------------------


@runtime_checkable
class Observer(Protocol):
    """Follows one run: made by ``factory(config)`` when the job lists it in
    ``[observers] use``, then told of the run's start, each step's metrics and the
    end. ``finished`` is called for every observer whose ``started`` returned, whatever
    happened after (a failed job, an interrupt)."""

    def started(self, run: Any) -> None:
        """The run begins (``run``: a :class:`skyrl_host.runner.Run`; ``run.resuming``
        and ``run.resume_step`` say whether it continues an earlier one). A missing
        optional package is a UserError naming the table."""
        ...

    def step_finished(self, run: Any, step: int, metrics: Mapping[str, float | int]) -> None:
        """One step's metrics, as the driver reported them (names to numbers)."""
        ...

    def finished(self, run: Any, status: str, error: BaseException | None) -> None:
        """The run ended: ``status`` is ``completed``, ``failed`` or ``interrupted``."""
        ...
