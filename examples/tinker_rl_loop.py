"""An RL loop written only against the official ``tinker`` SDK, learning the quickstart's
reverse-digits task ("4071:" -> "1704") on a LoRA adapter over a random tiny Qwen3.

    python examples/tinker_rl_loop.py                       # starts `skyrl serve` itself
    python examples/tinker_rl_loop.py --base-url http://127.0.0.1:8000 --api-key tml-...

Each step: ``save_weights_and_get_sampling_client`` (the adapter as it is now), sample
``--group`` responses for each of ``--prompts`` prompts, score them here with the
reverse_digits dataset's reward, normalise the rewards within each prompt's group (the
GRPO advantage), then ``forward_backward(..., loss_fn="importance_sampling")`` with the
sampler's logprobs and ``optim_step(AdamParams)``. Writes ``metrics.jsonl`` (one line a
step) and ``curve.png`` (the reward per step) in ``--out``.

The recipe is the quickstart's (examples/quickstart.toml: 32 prompts x 16 responses,
grpo's advantages, its "seq-mean-token-mean" loss, AdamW with betas 0.9/0.999, eps 1e-8,
gradient clip 1.0, lr 5e-4, temperature 1) on full-rank LoRA adapters (rank 64 = the
preset's hidden size, alpha 128 in the server file) of attention, MLP and the output
head, plus one thing the quickstart does not need: an entropy bonus in each token's
advantage (``--entropy-coef``, 0.1). Without it the LoRA policy collapses: the entropy
falls from 1.2 to 0.16 between steps 100 and 150 and the reward stalls at ~0.5 (the same
recipe through ``skyrl run`` with these adapters: 0.50 at step 400); with it the entropy
falls gradually (2.2 at step 100, 1.1 at 200, 0.45 at 350) and the reward keeps climbing.
The LoRA can't reach what full fine-tuning also trains here: the tied embedding and the
RMSNorm weights (among them Qwen3's q/k norms) stay at their random / unit values.

The server's models use character tokenizers: ids 0, 1, 2 are <pad>, <eos>, <unk>, then
the characters of the model's alphabet in sorted order (``[models."NAME"] alphabet`` in
the server file). The SDK cannot fetch such a tokenizer, so :class:`CharCodec` rebuilds it
from the same alphabet. Without ``--base-url`` the script serves
``examples/tinker_server.toml`` on a free port of 127.0.0.1, whose
``skyrl/qwen-tiny-digits`` has the task's alphabet (digits and ':').

What it learns (the defaults, 2 shared CPU cores; docs/img/tinker_rl_loop.png, docs/tinker.md):
450 steps in 438 s, the reward from 0.07 (first 5 steps) to 0.98 (last 5), its 5-step mean
first >= 0.8 at step 404. With entropy 0.05 it learns faster at first and flattens (0.73
over steps 376-400). Before: rank 32, alpha 16, lr 3e-3, the SDK's Adam defaults, the
loss summed over tokens and no entropy bonus: 0.07 -> 0.36 in 600 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable, Iterator

import attrs

HERE = pathlib.Path(__file__).resolve().parent
SERVER_FILE = HERE / "tinker_server.toml"
BASE_MODEL = "skyrl/qwen-tiny-digits"
ALPHABET = "0123456789:"
EOS = 1  # the character tokenizers' <eos>
FIRST_CHAR_ID = 3  # after <pad>, <eos>, <unk>


class CharCodec:
    """The server's character tokenizer for ``alphabet``, on the client side."""

    def __init__(self, alphabet: str):
        self.chars = sorted(set(alphabet))
        self.ids = {c: FIRST_CHAR_ID + i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self.ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the model's alphabet {''.join(self.chars)!r}") from None

    def decode(self, tokens: list[int]) -> str:
        """The text up to the first <eos> (other special ids are dropped)."""
        out = []
        for t in tokens:
            if t == EOS:
                break
            if t >= FIRST_CHAR_ID and t - FIRST_CHAR_ID < len(self.chars):
                out.append(self.chars[t - FIRST_CHAR_ID])
        return "".join(out)


@attrs.frozen
class LoopConfig:
    """The loop's settings (see the module docstring for what they reach)."""

    steps: int = 450
    prompts: int = 32  # prompts per step (the quickstart's batch_size)
    group: int = 16  # responses per prompt (its n_samples)
    rank: int = 64  # the tiny preset's hidden size: full-rank adapters
    learning_rate: float = 5e-4
    # AdamParams as the quickstart's torch backend has them (the SDK's defaults are beta2 0.95,
    # eps 1e-12 and no clipping); the clip acts on the quickstart's loss scale, see rl_step.
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    # Weight of an entropy bonus in each token's advantage: -coef * (its sampling logprob - the
    # batch's mean); 0 = the plain GRPO advantages.
    entropy_coef: float = 0.1
    max_tokens: int = 7  # up to 5 digits + <eos>, and a little room
    temperature: float = 1.0
    seed: int = 1
    min_len: int = 3
    max_len: int = 5


def rl_step(training: Any, dataset: Any, codec: CharCodec, step: int, cfg: LoopConfig) -> tuple[dict[str, float], list[Any]]:
    """One step of the loop: sample, score, update. Returns the step's metrics and the
    data it trained on (``loss_fn_inputs`` with the sampler's logprobs and advantages)."""
    import numpy as np
    from tinker import types

    t0 = time.perf_counter()
    sampler = training.save_weights_and_get_sampling_client().result()
    tasks = dataset.batch(step, cfg.prompts)
    prompts = [codec.encode(t.prompt) for t in tasks]
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=cfg.group,
                              sampling_params=types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature,
                                                                   seed=cfg.seed * 1_000_003 + step * 1000 + i))
               for i, p in enumerate(prompts)]
    results = [f.result() for f in futures]
    t_sample = time.perf_counter()

    # The quickstart's loss (grpo, loss_agg "seq-mean-token-mean"): each sequence's token mean of
    # -ratio * advantage, averaged over every sampled sequence. The server's importance_sampling
    # sums -ratio * advantage over tokens and data, so each token's advantage is divided by its
    # sequence's length and by the number of sequences: the same gradient, so the same clip.
    n_seqs = sum(len(res.sequences) for res in results)
    sampled = [lp for res in results for s in res.sequences for lp in s.logprobs]
    mean_lp = statistics.fmean(sampled) if sampled else 0.0
    data: list[Any] = []
    rewards: list[float] = []
    exact = 0
    kept_groups = 0
    response_tokens = 0
    for task, prompt, res in zip(tasks, prompts, results):
        seqs = res.sequences
        scores = [dataset.reward(task, codec.decode(list(s.tokens))) for s in seqs]
        rewards += scores
        exact += sum(1 for r in scores if r == 1.0)
        mean, std = statistics.fmean(scores), statistics.pstdev(scores)
        signal = std >= 1e-6  # else every response scored alike: no reward signal in this group
        kept_groups += signal
        if not signal and cfg.entropy_coef == 0:
            continue
        for s, r in zip(seqs, scores):
            tokens = list(s.tokens)
            if not tokens:
                continue
            response_tokens += len(tokens)
            full = prompt + tokens
            n_prompt = len(prompt) - 1  # targets that belong to the prompt
            advantage = (r - mean) / (std + 1e-6) if signal else 0.0  # the GRPO advantage (population std)
            per_token = [(advantage - cfg.entropy_coef * (lp - mean_lp)) / (len(tokens) * n_seqs) for lp in s.logprobs]
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray(full[1:], dtype=np.int64),
                    "logprobs": np.asarray([0.0] * n_prompt + list(s.logprobs), dtype=np.float32),
                    "advantages": np.asarray([0.0] * n_prompt + per_token, dtype=np.float32),
                },
            ))
    loss = grad_norm = float("nan")
    if data:
        fb = training.forward_backward(data, loss_fn="importance_sampling")
        opt = training.optim_step(types.AdamParams(learning_rate=cfg.learning_rate, beta2=cfg.beta2, eps=cfg.eps,
                                                   grad_clip_norm=cfg.grad_clip_norm))
        loss = fb.result().metrics["loss:sum"]
        grad_norm = (opt.result().metrics or {}).get("grad_norm:mean", float("nan"))
    t_end = time.perf_counter()
    metrics = {
        "step": step,
        "reward_mean": statistics.fmean(rewards),
        "exact_match": exact / len(rewards),
        "groups_with_signal": kept_groups,
        "data": len(data),
        "response_tokens": response_tokens,
        "loss_sum": loss,
        "grad_norm": grad_norm,
        "entropy": -mean_lp,  # the sampled tokens' mean -logprob: an estimate of the policy's entropy
        "sample_s": t_sample - t0,
        "train_s": t_end - t_sample,
    }
    return metrics, data


def run_loop(service: Any, cfg: LoopConfig, *, base_model: str = BASE_MODEL, alphabet: str = ALPHABET,
             on_step: Callable[[dict[str, float]], None] | None = None) -> tuple[Any, list[dict[str, float]]]:
    """Create a LoRA training client on ``base_model`` and run ``cfg.steps`` steps;
    returns the training client and every step's metrics."""
    from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig

    dataset = ReverseDigits(ReverseDigitsConfig(min_len=cfg.min_len, max_len=cfg.max_len, prefix=""), seed=cfg.seed)
    codec = CharCodec(alphabet)
    training = service.create_lora_training_client(base_model=base_model, rank=cfg.rank, seed=cfg.seed).result()
    rows = []
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        metrics, _ = rl_step(training, dataset, codec, step, cfg)
        metrics["elapsed_s"] = time.perf_counter() - start
        rows.append(metrics)
        if on_step is not None:
            on_step(metrics)
    return training, rows


# -- the server ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(server_file: pathlib.Path, api_key: str, timeout: float = 120.0) -> Iterator[str]:
    """``skyrl serve SERVER_FILE`` on a free port of 127.0.0.1, in a subprocess; yields its URL.
    It runs in a temporary folder, so a relative ``[server] storage`` (its saved weights and
    its state store) starts empty and goes away with it."""
    import tempfile

    port = _free_port()
    folder = tempfile.TemporaryDirectory(prefix="tinker_rl_loop_")
    env = {**os.environ, "SKYRL_API_KEYS": api_key}
    cmd = [sys.executable, "-c", "from skyrl_host.cli import entry; entry()", "serve", str(pathlib.Path(server_file).resolve()),
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, cwd=folder.name)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"skyrl serve exited with code {proc.returncode} before it listened")
            try:
                with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"skyrl serve did not answer on {url} within {timeout:.0f} s") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        folder.cleanup()


# -- output ----------------------------------------------------------------------------


def plot(rows: list[dict[str, float]], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["reward_mean"] for r in rows], alpha=0.35, label="reward (per step)")
    k = 5
    smooth = [statistics.fmean(r["reward_mean"] for r in rows[max(0, i - k + 1): i + 1]) for i in range(len(rows))]
    ax.plot(steps, smooth, label=f"reward ({k}-step mean)")
    ax.plot(steps, [r["exact_match"] for r in rows], alpha=0.6, label="exact match")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("step")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    d = LoopConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"),
                        help="a running server (env TINKER_BASE_URL); without it, `skyrl serve` is started here")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_API_KEY", "tml-local-dev"),
                        help="the X-API-Key (env TINKER_API_KEY)")
    parser.add_argument("--server-file", type=pathlib.Path, default=SERVER_FILE,
                        help="the server file served when no --base-url is given")
    parser.add_argument("--base-model", default=BASE_MODEL)
    parser.add_argument("--alphabet", default=ALPHABET, help="the base model's tokenizer alphabet (as in the server file)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--prompts", type=int, default=d.prompts)
    parser.add_argument("--group", type=int, default=d.group)
    parser.add_argument("--rank", type=int, default=d.rank)
    parser.add_argument("--lr", type=float, default=d.learning_rate)
    parser.add_argument("--beta2", type=float, default=d.beta2)
    parser.add_argument("--eps", type=float, default=d.eps)
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip_norm, help="AdamParams.grad_clip_norm (0 = none)")
    parser.add_argument("--entropy-coef", type=float, default=d.entropy_coef)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/tinker_rl_loop"))
    parser.add_argument("--png", type=pathlib.Path, default=None, help="where to write the curve (default: OUT/curve.png)")
    args = parser.parse_args(argv)
    cfg = attrs.evolve(d, steps=args.steps, prompts=args.prompts, group=args.group, rank=args.rank,
                       learning_rate=args.lr, beta2=args.beta2, eps=args.eps, grad_clip_norm=args.grad_clip,
                       entropy_coef=args.entropy_coef, seed=args.seed)

    import signal

    import tinker

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the server started here is stopped too
    args.out.mkdir(parents=True, exist_ok=True)
    metrics_path = args.out / "metrics.jsonl"
    metrics_file = metrics_path.open("w")

    def on_step(m: dict[str, float]) -> None:
        metrics_file.write(json.dumps(m) + "\n")
        metrics_file.flush()
        print(f"step {m['step']:4d}  reward {m['reward_mean']:.3f}  exact {m['exact_match']:.2f}  "
              f"entropy {m['entropy']:.2f}  {m['elapsed_s']:.0f} s", file=sys.stderr)

    with contextlib.ExitStack() as stack:
        url = args.base_url or stack.enter_context(local_server(args.server_file, args.api_key))
        service = tinker.ServiceClient(base_url=url, api_key=args.api_key)
        start = time.perf_counter()
        _, rows = run_loop(service, cfg, base_model=args.base_model, alphabet=args.alphabet, on_step=on_step)
        wall = time.perf_counter() - start
        service.close("completed")
    metrics_file.close()
    first = statistics.fmean(r["reward_mean"] for r in rows[:5])
    last = statistics.fmean(r["reward_mean"] for r in rows[-5:])
    summary = {
        "steps": len(rows), "wall_s": round(wall, 1), "s_per_step": round(wall / len(rows), 3),
        "reward_first5": round(first, 3), "reward_last5": round(last, 3),
        "exact_match_last5": round(statistics.fmean(r["exact_match"] for r in rows[-5:]), 3),
        "config": attrs.asdict(cfg), "base_model": args.base_model, "metrics": str(metrics_path),
    }
    png = args.png or args.out / "curve.png"
    plot(rows, png, f"tinker SDK RL loop, LoRA rank {cfg.rank}, {cfg.prompts}x{cfg.group} per step: "
         f"{first:.2f} -> {last:.2f} in {len(rows)} steps ({wall / 60:.1f} min)")
    summary["png"] = str(png)
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
