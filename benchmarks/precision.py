"""Precisions: bytes shipped per weight sync, the engine/trainer logprob gap, and a short
RL run per precision with the reward curves in one plot.

    python benchmarks/precision.py [--steps 300] [--gap-steps 20] [--hidden 1024] [--layers 8]
        [--plot docs/images/precision_rewards.png] [--threads 2] [--quick]

1. ``bytes``: a Qwen3 model built from a config (``--hidden``, ``--layers``, FFN 3x hidden,
   heads of 64, 2 query heads per KV head, vocabulary 32,768, untied head), float32
   masters; each precision is installed as the torch backend installs it
   (``prepare_model(train=True)`` with the family's ``precision_keep``) and the weights
   it serves (``pack``) are counted: payloads + scales + the tensors it keeps
   (embeddings, norms, head in bf16 on the wire). Reported against the whole state in
   bf16 (``ratio_vs_bf16``) and for the quantized layers alone.
2. ``gap``: the quickstart's task (tiny Qwen3, ``reverse_digits``) run ``--gap-steps``
   steps per precision with the engine in bfloat16 and a model copy of its own, so every
   version reaches it as the transport carries it; the job's ``logprob_diff_mean``
   (|trainer - engine| per generated token) averaged over the steps, and its ratio to
   bf16's in the same run. ``fp8`` and ``mxfp8`` also run weights-only
   (``activations = false``).
3. ``rl``: the quickstart itself (``examples/quickstart.toml``) for ``--steps`` steps per
   precision (engine sharing the trainer's model, as in the quickstart): reward per
   step, the mean reward of the last 20 steps and its ratio to bf16's; all curves in one
   PNG (``--plot``).

Prints one JSON object. Every number is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRECISIONS = ("bf16", "fp8", "mxfp8", "int4")
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def wire_bytes(hidden: int, layers: int) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from skyrl_host.plugins import build_host

    host = build_host()
    config = Qwen3Config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
                         vocab_size=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).float()
    family = host.registry.get("models", "qwen")
    keep = family.create(family.config(preset="tiny")).precision_keep
    bf16_total = sum(p.numel() * 2 for p in model.state_dict().values())
    out = {"model": {"parameters": sum(p.numel() for p in model.parameters()), "hidden": hidden, "layers": layers,
                     "bf16_bytes": bf16_total}}
    for name in PRECISIONS:
        reg = host.registry.get("precisions", name)
        precision = reg.create(reg.config())
        quantized = set(precision.prepare_model(model, keep=keep, train=True))
        t0 = time.perf_counter()
        total = layer_bytes = layer_bf16 = 0
        for n, t in precision.pack(model.state_dict().items()):
            b = t.numel() * (2 if t.dtype == torch.float32 and "@" not in n else t.element_size())
            total += b
            if n.split("@")[0] in quantized:
                layer_bytes += b
        pack_s = time.perf_counter() - t0
        for n, t in model.state_dict().items():
            if n in quantized:
                layer_bf16 += t.numel() * 2
        out[name] = {"bytes": total, "ratio_vs_bf16": total / bf16_total, "quantized_tensors": len(quantized),
                     "quantized_layers_ratio_vs_bf16": (layer_bytes / layer_bf16) if layer_bf16 else 1.0,
                     "pack_s": pack_s}
        for m in model.modules():  # the next precision starts from a clean model
            m._forward_pre_hooks.clear()
            m._forward_hooks.clear()
    return out


GAP_JOB = """
[job]
kind = "rl"
seed = 7
steps = {steps}
batch_size = 16
n_samples = 8
max_new_tokens = 7
checkpoint_every = 0
save_final = false
threads = {threads}
output_dir = "{out}"

[model]
family = "qwen"
preset = "tiny"

[dataset]
name = "reverse_digits"
min_len = 3
max_len = 5
prefix = ""

[engine]
name = "embedded"
dtype = "bfloat16"

[precision]
name = "{precision}"
{options}

[backend]
name = "torch"
lr = 5e-4
"""


def metrics(out: pathlib.Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step" in r and "event" not in r]


def run_job(path: pathlib.Path, *extra: str) -> None:
    env = dict(os.environ, SKYRL_DISABLE_PLUGINS=os.environ.get("SKYRL_DISABLE_PLUGINS", ""))
    result = subprocess.run([SKYRL, "run", str(path), *extra], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{path}: {result.stderr[-2000:]}")


def gaps(tmp: pathlib.Path, steps: int, threads: int) -> dict:
    cases = {p: (p, "") for p in PRECISIONS}
    cases.update({"fp8_weights_only": ("fp8", "activations = false"), "mxfp8_weights_only": ("mxfp8", "activations = false")})
    out = {}
    for case, (precision, options) in cases.items():
        folder = tmp / f"gap_{case}"
        path = tmp / f"gap_{case}.toml"
        path.write_text(GAP_JOB.format(steps=steps, threads=threads, out=folder, precision=precision, options=options))
        t0 = time.perf_counter()
        run_job(path)
        rows = metrics(folder)
        out[case] = {"logprob_diff_mean": sum(r["logprob_diff_mean"] for r in rows) / len(rows),
                     "logprob_diff_max": max(r["logprob_diff_max"] for r in rows), "wall_s": time.perf_counter() - t0}
    for case in out:
        out[case]["ratio_vs_bf16"] = out[case]["logprob_diff_mean"] / out["bf16"]["logprob_diff_mean"]
    return out


def rl_runs(tmp: pathlib.Path, steps: int, threads: int, plot: str | None) -> dict:
    out, curves = {}, {}
    for precision in PRECISIONS:
        folder = tmp / f"rl_{precision}"
        t0 = time.perf_counter()
        run_job(ROOT / "examples" / "quickstart.toml", "--set", f"job.steps={steps}", "--set", "job.checkpoint_every=0",
                "--set", "job.save_final=false", "--set", f"job.threads={threads}", "--set", f'job.output_dir="{folder}"',
                "--set", f'precision={{name="{precision}"}}')
        rows = metrics(folder)
        curves[precision] = [r["reward_mean"] for r in rows]
        tail = curves[precision][-20:]
        out[precision] = {"reward_first": curves[precision][0], "reward_last20": sum(tail) / len(tail),
                          "wall_s": time.perf_counter() - t0}
    for precision in PRECISIONS:
        out[precision]["last20_ratio_vs_bf16"] = out[precision]["reward_last20"] / out["bf16"]["reward_last20"]
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for precision, ys in curves.items():
            window = 10
            smooth = [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1]) for i in range(len(ys))]
            ax.plot(range(1, len(ys) + 1), smooth, label=precision)
        ax.set_xlabel("step")
        ax.set_ylabel("reward (mean, 10-step moving average)")
        ax.set_title("quickstart (reverse_digits, tiny Qwen3) per precision")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        pathlib.Path(plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(plot, dpi=110)
        out["plot"] = plot
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="RL steps per precision (the quickstart's task)")
    parser.add_argument("--gap-steps", type=int, default=20, help="steps of the logprob-gap jobs")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", default=None, help="PNG of the reward curves")
    parser.add_argument("--quick", action="store_true", help="a small model, 5 gap steps, 20 RL steps")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers, args.gap_steps, args.steps = 256, 2, 5, 20
    result = {"bytes": wire_bytes(args.hidden, args.layers)}
    with tempfile.TemporaryDirectory() as tmp:
        result["gap"] = gaps(pathlib.Path(tmp), args.gap_steps, args.threads)
        result["rl"] = rl_runs(pathlib.Path(tmp), args.steps, args.threads, args.plot)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
