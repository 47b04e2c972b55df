"""The Protocols each plugin kind implements: one per kind.

A registration hook registers a *factory*; the factory, called with the plugin's
validated config, returns an object of the matching Protocol below. The host and
the drivers only ever talk to plugins through these Protocols.

The engine and trainer contracts meet in the packed
:class:`skyrl_host.rollout.RolloutBatch`. This module imports no heavy module:
tensors are typed ``Any`` and documented by shape.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import attrs


@attrs.frozen
class Task:
    """One prompt of a dataset, with what its reward function needs to score it."""

    prompt: str
    answer: str | None = None  # a reference completion that earns the maximal reward, if known
    meta: Mapping[str, Any] = attrs.field(factory=dict)


@runtime_checkable
class Dataset(Protocol):
    """Prompts and their reward. ``batch`` is a pure function of the dataset's seed
    and ``step``, so a resumed job sees exactly the prompts it would have seen."""

    def batch(self, step: int, size: int) -> Sequence[Task]:
        """``size`` tasks for ``step`` (counting from 1)."""
        ...

    # Datasets for models built from presets also provide ``alphabet: str``: every
    # character a prompt or a good answer can contain, so the model family can
    # build a character-level tokenizer for the task.

    def reward(self, task: Task, completion: str) -> float:
        """The reward of ``completion`` for ``task``, in [0, 1]."""
        ...


@runtime_checkable
class JobDriver(Protocol):
    """The loop of one job kind. Made by ``factory(run)``; reports each step with
    ``run.report(step, metrics)``."""

    def run(self) -> None: ...


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

    # Families may also offer ``load_tokenizer(*, alphabet) -> LoadedModel`` with
    # ``model=None``: what ``load`` gives without building or reading the model (the Ray
    # launcher's driver only encodes and decodes). Families of MoE models also offer
    # ``routers(model) -> list[RouterInfo]`` (in
    # layer order; empty for a dense model) and ``lora_targets: Sequence[str]``; the
    # built-in families map in-memory weight names (fused experts) to the on-disk ones:
    # ``disk_weights(model, named) -> iter[(disk name, tensor)]``,
    # ``memory_weights(model, disk) -> {name: tensor}`` and ``weight_layout(model)``.


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

    def start(self, loaded: LoadedModel) -> None:
        """Take the model to serve (the engine keeps its own copy or view)."""
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

    # Engines that continue conversations also offer
    # ``continue_turn(history, turns, *, sampler, max_new_tokens, seed) -> RolloutBatch``:
    # one response per conversation of ``history`` after the tokens ``turns[i]``,
    # returned as the new turn's segment only (see RolloutBatch.append_turn).


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
        self, loaded: LoadedModel, *, seed: int, total_steps: int, reference: bool, replay: Sequence[Any] = ()
    ) -> None:
        """Take the model to train; ``replay``: the job's ReplayStrategy objects (bind
        each to the policy model, enter ``replaying`` around every policy forward)."""
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

    # Backends that keep a reference model also offer
    # ``reference_logprobs(batch, *, temperature) -> float32 [T]`` (0 outside the
    # loss tokens), used when an algorithm applies its KL penalty to the rewards.

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


PROTOCOLS: Mapping[str, type] = {
    "models": ModelFamily,
    "algorithms": Algorithm,
    "replay_strategies": ReplayStrategy,
    "precisions": Precision,
    "weight_transports": WeightTransport,
    "samplers": Sampler,
    "datasets": Dataset,
    "data_strategies": DataStrategy,
    "engines": Engine,
    "backends": Backend,
    "jobs": JobDriver,
}
