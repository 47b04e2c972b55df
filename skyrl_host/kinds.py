"""The plugin kinds: one table that the registry, the job-file loader, the hook
specifications, ``skyrl plugins`` and the docs all read.

Each kind has one registration hook, one table of the job file with the key that
selects the plugin, and one Protocol (in :mod:`skyrl_host.interfaces`) that every
factory's product satisfies. Adding a kind is one row here: its registration hook is
generated from the row (:mod:`skyrl_host.hookspecs`), and a test checks that the docs
list it.
"""

from __future__ import annotations

from typing import Mapping

import attrs

import skyrl_host.interfaces as i


@attrs.frozen
class Kind:
    """One plugin kind."""

    key: str  # the registry's name for the kind: "models"
    hook: str  # the registration hook: "skyrl_register_models"
    noun: str  # how messages name one plugin of the kind: "model family"
    table: str  # the job file's table that selects it: "model"
    selector: str  # the key of that table naming the plugin: "family"
    protocol: type  # what the factory returns
    description: str  # one line, for the docs
    many: bool = False  # the selector takes a list of names, each with its own sub-table
    host_table: bool = False  # the host owns the table for every job kind ([job], [cluster])
    traits: type | None = None  # what a plugin of the kind declares for the others (register(..., traits=))
    factory_call: str = "factory(config)"  # how the host calls a registered factory
    details: str = ""  # more for the registration hook's docstring (generated: skyrl_host.hookspecs)


KINDS: Mapping[str, Kind] = {
    k.key: k
    for k in (
        Kind("models", "skyrl_register_models", "model family", "model", "family", i.ModelFamily,
             "builds, loads and saves the models of a family of transformers architectures", traits=i.ModelTraits),
        Kind("engines", "skyrl_register_engines", "engine", "engine", "name", i.Engine,
             "generates rollouts and receives new weights", traits=i.EngineTraits),
        Kind("samplers", "skyrl_register_samplers", "sampler", "sampler", "name", i.Sampler,
             "chooses the next token from logits", traits=i.SamplerTraits),
        Kind("algorithms", "skyrl_register_algorithms", "algorithm", "algorithm", "name", i.Algorithm,
             "rewards to advantages, group filtering and the policy loss", traits=i.AlgorithmTraits),
        Kind("replay_strategies", "skyrl_register_replay_strategies", "replay strategy", "replay", "strategies",
             i.ReplayStrategy, "makes the trainer score exactly what the engine sampled", many=True,
             details="Each strategy's keys live in the sub-table ``[replay.NAME]``."),
        Kind("precisions", "skyrl_register_precisions", "precision", "precision", "name", i.Precision,
             "how the backend computes and what the engine serves"),
        Kind("weight_transports", "skyrl_register_weight_transports", "weight transport", "weight_sync", "transport",
             i.WeightTransport, "moves new weights from the backend to the engines"),
        Kind("datasets", "skyrl_register_datasets", "dataset", "dataset", "name", i.Dataset,
             "prompts and their reward", factory_call="factory(config, seed=SEED)"),
        Kind("rewards", "skyrl_register_rewards", "reward part", "reward", "parts", i.RewardPart,
             "scores completions: a job's reward is the weighted sum of its parts", many=True,
             factory_call="factory(config, dataset=DATASET)",
             details="Each part's keys live in the sub-table ``[reward.NAME]`` (its ``weight`` among them). "
             "``dataset``: the job's Dataset (the ``dataset`` part scores with its ``reward``)."),
        Kind("data_strategies", "skyrl_register_data_strategies", "data strategy", "data", "strategy",
             i.DataStrategy, "the order in which an SFT job reads documents",
             details="The driver binds the strategy to the datasets' document lengths and the job's seed, then "
             "draws one document at a time and checkpoints its ``state_dict``."),
        Kind("corpus_readers", "skyrl_register_corpus_readers", "corpus reader", "corpus", "reader",
             i.CorpusReader, "opens pretokenized corpora for SFT",
             details="Its ``open(path, ...)`` gives a :class:`skyrl_host.interfaces.Corpus` (``[job] data_paths``)."),
        Kind("environments", "skyrl_register_environments", "environment", "environment", "name", i.Environment,
             "multi-turn and tool-using environments: one episode per trajectory",
             factory_call="factory(config, dataset=DATASET, seed=SEED)",
             details="``dataset``: the job's Dataset, whose ``reward`` an environment may use to score final answers. "
             "An ``rl`` job without an ``[environment]`` table is single-turn: one response per prompt, scored by "
             "the dataset."),
        Kind("backends", "skyrl_register_backends", "backend", "backend", "name", i.Backend,
             "owns parameters and optimizer; trains on rollouts", traits=i.BackendTraits),
        Kind("launchers", "skyrl_register_launchers", "launcher", "cluster", "launcher", i.Launcher,
             "places backend ranks and engine replicas (one process, Ray actors, ...)", host_table=True,
             factory_call="factory(config, cluster)",
             details="``cluster``: the host's :class:`skyrl_host.sections.ClusterSection` (``trainer_ranks``, "
             "``engine_replicas``); the launcher's own keys sit in ``[cluster]`` beside the host's."),
        Kind("observers", "skyrl_register_observers", "observer", "observers", "use", i.Observer,
             "sends a run's metrics somewhere besides metrics.jsonl (TensorBoard, W&B, MLflow, ...)", many=True,
             host_table=True,
             details="Every job kind may list observers; each one's keys live in the sub-table "
             "``[observers.NAME]``. (Observers that always run, like ``metrics_jsonl``, implement the run hooks "
             "instead.)"),
        Kind("jobs", "skyrl_register_jobs", "job kind", "job", "kind", i.JobDriver,
             "the loop of one kind of job (rl, sft, ...)", host_table=True, factory_call="factory(run)",
             details="Besides the common arguments, ``register`` takes ``slots``: the plugin tables the job uses "
             "(``\"dataset\"``, ``\"model\"``, ...), each mapped to None when required or to the plugin used when "
             "the table is absent; a job file may only contain the tables its kind uses. ``config`` validates the "
             "keys of ``[job]`` other than the host's (kind, seed, steps, output_dir). ``run``: a "
             ":class:`skyrl_host.runner.Run`."),
    )
}

# The evaluation's table: a dataset plugin (``name``) beside the host's keys of [eval]. A job
# kind that evaluates lists it in its slots (never required: absent, the job does not evaluate).
EVAL_TABLE = "eval"
# The teacher's table: a model family (``family``) beside the host's keys of [teacher]; a job
# kind that distils lists it in its slots (never required).
TEACHER_TABLE = "teacher"

# Tables a job kind may use (its slots): every kind's table but the host's own.
SLOT_KINDS: Mapping[str, Kind] = {k.table: k for k in KINDS.values() if not k.host_table}

PROTOCOLS: Mapping[str, type] = {k.key: k.protocol for k in KINDS.values()}
