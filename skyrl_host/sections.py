"""The tables of the job file that the host owns: ``[job]`` (its host keys),
``[cluster]`` (the launcher and what every launcher places), ``[eval]`` (how a job
kind that evaluates does it; its dataset plugin's keys beside) and ``[teacher]`` (where a
distilling job's teacher scores; its model family's keys beside)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from skyrl_host.options import ge, gt, gt_le, option


@attrs.frozen
class JobSection:
    """The keys of ``[job]`` that the host owns."""

    kind: str = option(help="the job kind to run (a registered job plugin)")
    seed: int = option(0, help="seed for every random choice of the job", validator=ge(0))
    steps: int = option(100, help="number of steps to run", validator=gt_le(0, 1 << 40))
    output_dir: str | None = option(None, help="folder for metrics, plots and checkpoints (default: runs/<name>)")
    name: str | None = option(None, help="run name (default: the job file's stem)")


@attrs.frozen
class ClusterSection:
    """The keys of ``[cluster]`` that the host owns: which launcher places the job's
    processes (a plugin; its own keys sit beside these), and how many of each it places."""

    launcher: str = option("local", help="the launcher placing the job's processes (a registered launcher plugin)")
    num_cpus: int | None = option(None, help="CPUs the job may use (default: all)", validator=gt(0))
    num_gpus: int | None = option(None, help="GPUs the job may use (default: all)", validator=ge(0))
    trainer_ranks: int = option(
        1, help="backend ranks, data parallel as [backend] says (a launcher that places processes)", validator=gt(0)
    )
    engine_replicas: int = option(
        1, help="engine replicas; a step's prompts are split between them (a launcher that places processes)",
        validator=gt(0),
    )
    max_restarts: int = option(
        0, help="when a process the job placed is lost (a Ray node, an inference server), resume from the last "
        "checkpoint by itself up to this many times (0: stop with the message)", validator=ge(0),
    )


def _ks(inst: "EvalSection", _attr: Any, value: list[int]) -> None:
    if not value or any(k < 1 for k in value) or len(set(value)) != len(value):
        raise ValueError(f"expected distinct values >= 1, found {value!r}")
    if max(value) > inst.n_samples:
        raise ValueError(f"pass@{max(value)} needs at least {max(value)} samples per prompt; n_samples is {inst.n_samples}")


@attrs.frozen
class EvalSection:
    """The keys of ``[eval]`` that the host owns (for job kinds that evaluate, e.g. ``rl``);
    ``name`` selects the evaluation's dataset plugin, whose own keys sit beside these."""

    every: int = option(0, help="evaluate after every N steps (0: only before the first and after the last)",
                        validator=ge(0))
    before: bool = option(True, help="evaluate the starting weights before the first step (reported at step 0)")
    n_samples: int = option(8, help="responses sampled per prompt", validator=gt_le(0, 1 << 12))
    k: list[int] = option(factory=lambda: [1], help="the k of pass@k, maj@k and mean@k (each <= n_samples)",
                          validator=_ks)
    prompts: int | None = option(
        None, help="prompts evaluated (default: every row of a dataset that has a fixed list of rows; a generated "
        "dataset needs it)", validator=gt(0))
    temperature: float | None = option(
        None, help="sampling temperature (default: the job's sampler, as it is; 0: greedy)", validator=ge(0))
    max_new_tokens: int | None = option(None, help="new-token limit per response (default: the job's)",
                                        validator=gt(0))
    batch_prompts: int = option(64, help="prompts per generation call", validator=gt(0))


@attrs.frozen
class TeacherSection:
    """The keys of ``[teacher]`` that the host owns (for job kinds that distil, e.g. ``rl``
    with ``opd``); ``family`` selects the teacher's model family, whose own keys (``path``,
    ``preset``, ...) sit beside these."""

    device: str = option("cpu", help="where the teacher scores: cpu, cuda, cuda:1, ... (in the driver's process)")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the dtype the teacher computes in")
    batch_tokens: int = option(8192, help="tokens per teacher forward (or per request to base_url) at most",
                               validator=gt(0))
    # A teacher served elsewhere: an OpenAI-compatible vLLM server's prompt logprobs.
    base_url: str | None = option(
        None, help="score with a vLLM server serving the teacher (its prompt logprobs), e.g. "
        "http://10.0.0.5:8000/v1, instead of in the driver's process (the family's tokenizer alone is loaded)",
        validator=lambda _i, _a, v: _check_url(v))
    served_model: str | None = option(None, help="with base_url: the served model's name (default: the server's "
                                      "only model, from /v1/models)")
    api_key_env: str | None = option(None, help="with base_url: the environment variable holding its API key")
    concurrency: int = option(4, help="with base_url: requests in flight at once", validator=gt(0))
    timeout: float = option(120.0, help="with base_url: seconds one request may take", validator=gt(0))
    retries: int = option(3, help="with base_url: retries of a request that failed to connect, timed out, or got a "
                          "429/5xx (waiting 1, 2, 4... s)", validator=ge(0))


def _check_url(value: str | None) -> None:
    if value is None:
        return
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http:// or https:// URL with a host, found {value!r}")


HOST_JOB_KEYS = tuple(f.name for f in attrs.fields(JobSection))
HOST_CLUSTER_KEYS = tuple(f.name for f in attrs.fields(ClusterSection))
HOST_EVAL_KEYS = tuple(f.name for f in attrs.fields(EvalSection))
HOST_TEACHER_KEYS = tuple(f.name for f in attrs.fields(TeacherSection))
