"""Tokens/s of one RL step: our RL loop (``kind = "rl"``) vs TRL's ``GRPOTrainer``, on the quickstart's tiny Qwen3.

    python benchmarks/rl_step.py [--configs 16x8,32x16] [--rounds 15] [--block 2] [--warmup 2] [--threads 2]

Needs TRL, which is not a dependency of the project: ``.venv/bin/pip install trl``
(keep torch and transformers where they are, e.g. with a constraints file pinning
``torch==2.13.0`` and ``transformers==5.24.0``). Without it the script says so and exits 2.

The same model, task, batch and sampling settings go through both:

- model: the ``qwen`` family's preset ``tiny`` (hidden 64, 2 layers, 4 heads x 32,
  MLP 256, tied embeddings, 165,504 parameters with the character tokenizer of
  ``reverse_digits``), float32, built through the plugin host with the job's seed and
  the dataset's alphabet, then saved with ``family.save`` to a temporary folder from
  which TRL loads model and tokenizer (the script checks that TRL's initial weights
  equal the RL job's exactly, and that both tokenizers encode a prompt alike);
- task: the ``reverse_digits`` dataset plugin (3-5 distinct digits); TRL's reward
  function wraps the dataset's own ``reward``; TRL gets the prompts of
  ``dataset.batch(step, P)`` for steps 1, 2, ... in order (``shuffle_dataset=False``),
  i.e. the prompts our job sees;
- batch: ``P`` prompts x ``N`` completions per step (``--configs``, ``PxN``; default
  16x8 and the quickstart's 32x16), one optimizer update per batch;
- sampling: temperature 1.0 (no top-k / top-p), at most 7 new tokens, stop at ``<eos>``;
- training: GRPO (group-normalised advantages, token ratio clipped at 0.2/0.2, loss
  averaged per sequence then over sequences: TRL ``loss_type="grpo"``), no KL
  (TRL ``beta=0``), AdamW lr 5e-4 constant, no weight decay, gradient clipping at 1.0,
  float32, ``torch.set_num_threads(--threads)``.

TRL settings for a fair CPU comparison: ``use_cpu=True``, ``bf16=False`` (TRL needs
both on a CPU) and ``gradient_checkpointing=False``: GRPOConfig defaults to gradient
checkpointing, which recomputes activations and costs TRL ~30% on this model; our
backend's default is off.

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

Order, per config: ``--warmup`` steps of TRL then of ours (not measured), then rounds
of ``--block`` TRL steps followed by ``--block`` steps of ours. TRL drives the loop
(``trainer.train()``); a callback runs our block between two TRL steps, outside TRL's
timed window.

Other processes on the 2 cores distort everything (torch with 2 threads slows down
4-8x as soon as another process takes a core), so each step also records how many
cores other processes took meanwhile (``/proc/stat`` busy time minus this process's
CPU time, steal time included). Before each round the script waits, up to
``--max-wait`` seconds per config in all, for a quiet moment (``--quiet-cores``); a
round is *clean* when no step of it saw more than ``--contended-cores`` other cores
busy. It runs until ``--rounds`` clean rounds (or ``--max-rounds`` rounds) and reports
on the clean rounds (on all rounds, flagged, if fewer than 3 were clean).

Per round: tokens/s of a block = its tokens / its time; step time = the block's
median. Prints one JSON object: per config the medians over the reported steps, and
the medians of the per-round ratios ours/TRL of tokens/s and TRL/ours of step time
(both > 1 when ours is faster).
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
from typing import Any


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
MAX_NEW = 7
LR = 5e-4
TEMPERATURE = 1.0

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

[model]
family = "qwen"
preset = "tiny"

[dataset]
name = "reverse_digits"
min_len = 3
max_len = 5

[engine]
name = "embedded"

[sampler]
name = "temperature"
temperature = {temperature}

[algorithm]
name = "grpo"

[backend]
name = "torch"
lr = {lr}
"""


def git_state() -> dict[str, Any]:
    """The commit measured, and whether tracked files differed from it."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, check=True).stdout

        commit = git("rev-parse", "--short", "HEAD").strip()
        modified = git("status", "--porcelain", "--untracked-files=no").split()[1::2]
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "modified_files": modified}


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class Ours:
    """Our RL job, built as ``skyrl run`` builds it, stepped one step at a time."""

    def __init__(self, host: Any, folder: pathlib.Path, prompts: int, n: int, steps: int, threads: int):
        from skyrl_host.config import load_job
        from skyrl_host.runner import Run, prepare_output_dir

        path = folder / "job.toml"
        path.write_text(
            JOB_TOML.format(
                seed=SEED, steps=steps, out=folder / "run", prompts=prompts, n=n, max_new=MAX_NEW,
                threads=threads, temperature=TEMPERATURE, lr=LR,
            )
        )
        self.host = host
        self.spec = load_job(path, host)
        out = prepare_output_dir(self.spec, overwrite=True)
        self.run = Run(spec=self.spec, host=host, output_dir=out, total_steps=self.spec.job.steps)
        host.pm.hook.skyrl_job_started(run=self.run)
        self.driver = self.spec.kind.create(self.run)
        self.driver.build()
        self.next_step = 1
        self.records: list[dict[str, float]] = []

    def step(self, meter: Any) -> None:
        s = self.next_step
        a = meter.sample()
        t0 = time.perf_counter()
        metrics = self.driver.step(s)
        dt = time.perf_counter() - t0
        others = meter.others(a, meter.sample())
        self.run.report(s, metrics)
        self.next_step += 1
        gen_tokens = metrics["response_length_mean"] * metrics["sequences"]
        self.records.append(
            {
                "time": dt,
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


def build_trl(
    model_dir: pathlib.Path, out: pathlib.Path, dataset: Any, prompts: int, n: int, steps: int, tokenizer: Any
) -> tuple[Any, list[int], list[float], list[tuple[int, float]]]:
    """A GRPOTrainer with the prompts of steps 1..steps in order, and logs of its tokens and generation."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from skyrl_host.interfaces import Task

    rows = [t for s in range(1, steps + 1) for t in dataset.batch(s, prompts)]
    train = Dataset.from_dict(
        {
            "prompt": [t.prompt for t in rows],
            "answer": [t.answer for t in rows],
            "digits": [t.meta["digits"] for t in rows],
        }
    )
    token_log: list[int] = []  # prompt + completion tokens of each scoring call (one per step)
    reward_log: list[float] = []  # mean reward of each scoring call

    def reverse_digits_reward(prompts, completions, completion_ids, answer, digits, **_kw):
        prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
        token_log.append(prompt_tokens + sum(len(c) for c in completion_ids))
        rewards = [
            float(dataset.reward(Task(prompt=p, answer=a, meta={"digits": d}), c))
            for p, c, a, d in zip(prompts, completions, answer, digits, strict=True)
        ]
        reward_log.append(statistics.fmean(rewards))
        return rewards

    args = GRPOConfig(
        output_dir=str(out),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default (True) costs it ~30% here; ours is off by default
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=prompts * n,  # completions: P prompts x N samples
        num_generations=n,
        gradient_accumulation_steps=1,  # one optimizer update per batch
        num_iterations=1,
        max_completion_length=MAX_NEW,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        max_steps=steps,
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
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reverse_digits_reward,
        args=args,
        train_dataset=train,
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)),
    )
    gen_log: list[tuple[int, float]] = []
    original = trainer._generate_single_turn

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        completion_ids, logprobs = original(*a, **kw)
        gen_log.append((sum(len(c) for c in completion_ids), time.perf_counter() - t0))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
    return trainer, token_log, reward_log, gen_log


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
        "reward_mean_last_steps": round(statistics.fmean(r["reward_mean"] for r in m[-5:]), 3),
    }
    if "train_tokens_per_s" in m[0]:
        out["train_tokens_per_s_median"] = round(median([r["train_tokens_per_s"] for r in m]), 1)
    return out


def run_config(host: Any, prompts: int, n: int, args: argparse.Namespace, tmp: pathlib.Path) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    total = args.warmup + args.max_rounds * args.block
    folder = tmp / f"c{prompts}x{n}"
    folder.mkdir()

    # The model, built through the plugin host exactly as the job builds it, saved for TRL.
    dataset_reg = host.registry.get("datasets", "reverse_digits")
    dataset = dataset_reg.create(dataset_reg.config(min_len=3, max_len=5), seed=SEED)
    family_reg = host.registry.get("models", "qwen")
    family = family_reg.create(family_reg.config(preset="tiny"))
    loaded = family.load(alphabet=dataset.alphabet, seed=SEED)
    family.save(loaded, str(folder / "model"))

    ours = Ours(host, folder, prompts, n, total, args.threads)
    trainer, token_log, reward_log, gen_log = build_trl(
        folder / "model", folder / "trl", dataset, prompts, n, total, loaded.tokenizer
    )

    # Same starting point: TRL's model and tokenizer equal the job's; no gradient checkpointing.
    mine = ours.driver.loaded.model.state_dict()
    theirs = trainer.model.state_dict()
    same_weights = set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in mine)
    probe = dataset.batch(1, 1)[0].prompt
    theirs_ids = trainer.processing_class(text=[probe])["input_ids"][0]
    same_tokens = list(ours.driver.tokenizer.encode(probe)) == list(theirs_ids)
    if not (same_weights and same_tokens):
        raise SystemExit(f"rl_step.py: the setups differ (same weights: {same_weights}, same tokens: {same_tokens})")
    cls = type(trainer.model)
    name = "is_activation_checkpointing" if hasattr(cls, "is_activation_checkpointing") else "is_gradient_checkpointing"
    if getattr(trainer.model, name, False):
        raise SystemExit("rl_step.py: TRL's model has gradient checkpointing on; the comparison expects it off")
    torch.set_num_threads(args.threads)

    meter = CpuMeter()
    trl_records: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []  # one per round: TRL's block of steps, then ours
    waited = [0.0]

    class Interleave(TrainerCallback):
        a: Any = None
        t0 = 0.0

        def on_step_begin(self, _args, state, control, **kw):
            step = state.global_step + 1  # the step about to run
            measured = step > args.warmup
            if measured and (step - args.warmup - 1) % args.block == 0 and args.quiet_cores is not None:
                waited[0] += meter.wait_quiet(args.quiet_cores, max(0.0, args.max_wait - waited[0]))
            if torch.get_num_threads() != args.threads:
                torch.set_num_threads(args.threads)
            self.a = meter.sample()
            self.t0 = time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            others = meter.others(self.a, meter.sample())
            step = state.global_step
            if len(token_log) != step or len(gen_log) != step:
                raise RuntimeError(f"TRL step {step}: {len(token_log)} scoring calls, {len(gen_log)} generate calls")
            gen_tokens, gen_time = gen_log[-1]
            trl_records.append(
                {
                    "time": dt,
                    "tokens": float(token_log[-1]),
                    "gen_tokens_per_s": gen_tokens / gen_time,
                    "gen_time": gen_time,
                    "reward_mean": reward_log[-1],
                    "others": others,
                }
            )
            if step == args.warmup:
                for _ in range(args.warmup):
                    ours.step(meter)
            elif step > args.warmup and (step - args.warmup) % args.block == 0:
                start = len(ours.records)
                for _ in range(args.block):
                    ours.step(meter)
                ob = list(range(start, start + args.block))
                tb = list(range(step - args.block, step))
                busy = max([trl_records[i]["others"] for i in tb] + [ours.records[i]["others"] for i in ob])
                pairs.append({"trl": tb, "ours": ob, "others": busy, "clean": busy <= args.contended_cores})
                if sum(p["clean"] for p in pairs) >= args.rounds or len(pairs) >= args.max_rounds:
                    control.should_training_stop = True

    trainer.add_callback(Interleave())
    with contextlib.redirect_stdout(sys.stderr):
        trainer.train()
    ours.finish()

    def block_tps(records: list[dict[str, Any]], idx: list[int]) -> float:
        return sum(records[i]["tokens"] for i in idx) / sum(records[i]["time"] for i in idx)

    def ratios(chosen: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
        tps = [block_tps(ours.records, p["ours"]) / block_tps(trl_records, p["trl"]) for p in chosen]
        st = [
            median([trl_records[i]["time"] for i in p["trl"]])
            / median([ours.records[i]["time"] for i in p["ours"]])
            for p in chosen
        ]
        return tps, st

    clean = [p for p in pairs if p["clean"]]
    chosen = clean if len(clean) >= min(3, args.rounds) else pairs
    tps, st = ratios(chosen)
    tps_all, _ = ratios(pairs)
    return {
        "prompts": prompts,
        "completions_per_prompt": n,
        "sequences_per_step": prompts * n,
        "rounds": len(pairs),
        "clean_rounds": len(clean),
        "measured_on": "clean rounds" if chosen is clean else "ALL rounds (too few clean: the machine was busy)",
        "waited_for_quiet_s": round(waited[0], 1),
        "ours": summarize(ours.records, [p["ours"] for p in chosen]),
        "trl": summarize(trl_records, [p["trl"] for p in chosen]),
        "ratio_tokens_per_s_ours_vs_trl": round(median(tps), 3),
        "ratio_step_time_trl_vs_ours": round(median(st), 3),
        "ratio_tokens_per_s_per_round": [round(x, 3) for x in tps],
        "ratio_tokens_per_s_all_rounds_median": round(median(tps_all), 3),
        "other_cores_per_round": [round(p["others"], 2) for p in pairs],
        "trl_optimizer": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="16x8,32x16", help="comma-separated PROMPTSxCOMPLETIONS")
    ap.add_argument("--rounds", type=int, default=15, help="clean rounds wanted (a round: TRL's block, then ours)")
    ap.add_argument("--block", type=int, default=2, help="steps per block")
    ap.add_argument("--max-rounds", type=int, default=40, help="stop after this many rounds, clean or not")
    ap.add_argument(
        "--contended-cores", type=float, default=0.25,
        help="a round is clean when other processes used at most this many cores during each of its steps",
    )
    ap.add_argument(
        "--quiet-cores", type=float, default=0.25,
        help="before each round, wait until other processes use at most this many cores (negative: never wait)",
    )
    ap.add_argument("--max-wait", type=float, default=300.0, help="most seconds spent waiting for quiet, per config")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps of each before the first round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    configs = []
    for c in args.configs.split(","):
        p, _, n = c.strip().partition("x")
        configs.append((int(p), int(n)))
    if args.rounds < 1 or args.block < 1 or args.warmup < 0 or args.max_rounds < args.rounds:
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
    env = dict(os.environ)
    disabled = [x for x in env.get("SKYRL_DISABLE_PLUGINS", "").split(",") if x.strip()]
    env["SKYRL_DISABLE_PLUGINS"] = ",".join(disabled + ["progress"])
    host = build_host(env=env)

    results = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
        for p, n in configs:
            results[f"{p}x{n}"] = run_config(host, p, n, args, pathlib.Path(tmp))

    print(
        json.dumps(
            {
                "benchmark": "rl_step",
                "date": datetime.date.today().isoformat(),
                "model": "qwen preset tiny (hidden 64, 2 layers, 4 heads x 32, MLP 256, vocab 19, tied), float32",
                "task": "reverse_digits (3-5 distinct digits)",
                "max_new_tokens": MAX_NEW,
                "temperature": TEMPERATURE,
                "lr": LR,
                "threads": args.threads,
                "block": args.block,
                "warmup": args.warmup,
                "contended_cores": args.contended_cores,
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                "versions": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "trl": trl.__version__,
                },
                "git": git,
                "trl_settings": "use_cpu=True, bf16=False, gradient_checkpointing=False (TRL's default True costs "
                "~30%), loss_type='grpo', beta=0, num_iterations=1, one update per batch",
                "configs": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
