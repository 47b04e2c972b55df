"""Multi-turn rollouts (skyrl_host.multiturn) on the embedded engine, CPU; JSON out.

Two claims, each a ratio measured in one run, variants alternated A B C A B C, medians:

1. ``per_token``: the rollout cost per row token of trajectories of the *same total
   length* (prompt + responses + observations) split into 1, 4 and 16 turns. Each turn
   continues from the history's exact ids (``continue_turn``: only the new segment is
   returned and assembled), and the engine keeps each conversation's KV between turns
   (``[engine] turn_cache_mb``), so a turn prefills only its new tokens. Baseline: the
   same engine with the turn cache off, prefilling the whole history every turn (what a
   loop around a plain ``generate`` does). Ratio: cost per token at T turns / at 1 turn
   (goal: ~1, O(N)).
2. ``slow_tools``: each environment step sleeps ``L`` seconds (a tool call); the
   fraction of the rollout's wall-clock the engine spends waiting on environments, with
   the trajectories in 1 wave (decode and steps take turns: the lock-step loop most
   stacks run) and in 2 and 4 waves (a wave's steps run while the others decode). ``L``
   is set relative to the measured decode time of one turn (0.5x, 1x, 2x), so the
   result does not depend on this machine's speed. ``hidden`` = 1 - wait(W) / wait(1).

    flock /tmp/cpu.lock .venv/bin/python benchmarks/multiturn.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import attrs
import torch

from skyrl_host.interfaces import EnvStep, Task
from skyrl_host.multiturn import EnvWorkers, MultiTurnOptions, MultiTurnRollout
from skyrl_host.plugins import build_host

ALPHABET = "0123456789:abcdef"


class FixedTurns:
    """Every step answers ``obs`` (token ids) until ``turns`` responses; each step may
    sleep ``delay`` seconds (a tool call). Reward 1 per step."""

    def __init__(self, turns: int, obs: list[int], delay: float = 0.0):
        self.turns, self.obs, self.delay = turns, obs, delay

    def episode(self, task: Task, *, seed: int):
        env = self

        class Episode:
            t = 0

            def reset(self):
                return task.prompt

            def step(self, response):
                if env.delay:
                    time.sleep(env.delay)
                self.t += 1
                done = self.t >= env.turns
                return EnvStep(observation=None if done else list(env.obs), reward=1.0, done=done)

            def close(self):
                pass

        return Episode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--hidden", type=int, default=None, help="preset override: model width")
    ap.add_argument("--layers", type=int, default=None, help="preset override: decoder layers")
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--tool-trajectories", type=int, default=512,
                    help="claim 2: trajectories per rollout (the quickstart's 32 prompts x 16 samples)")
    ap.add_argument("--max-batch-size", type=int, default=None, help="the engine's max_batch_size (default: its own)")
    ap.add_argument("--total", type=int, default=272, help="row length of every trajectory in claim 1")
    ap.add_argument("--obs", type=int, default=4, help="observation tokens per turn in claim 1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer trajectories (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.trajectories, args.tool_trajectories = 1, 8, 64
    torch.set_num_threads(args.threads)
    host = build_host()
    reg = host.get("models", "qwen")
    shape = {k: v for k, v in (("hidden_size", args.hidden), ("num_layers", args.layers)) if v is not None}
    if args.hidden:
        shape["intermediate_size"] = 3 * args.hidden
    loaded = reg.create(reg.config(preset=args.preset, **shape)).load(alphabet=ALPHABET, seed=0)
    loaded = attrs.evolve(loaded, stop_token_ids=[])  # responses run to their cap: exact lengths
    ereg = host.get("engines", "embedded")
    batch_opt = {} if args.max_batch_size is None else {"max_batch_size": args.max_batch_size}
    engine = ereg.create(ereg.config(**batch_opt))  # the turn cache on (the default)
    engine.start(loaded)
    reprefill = ereg.create(ereg.config(turn_cache_mb=0, **batch_opt))  # every turn prefills the whole history
    reprefill.start(loaded)
    sreg = host.get("samplers", "temperature")
    sampler = sreg.create(sreg.config(temperature=1.0))
    workers = EnvWorkers(max(16, args.trajectories, args.tool_trajectories))
    tok = loaded.tokenizer
    prompt = "0123456789abcdef"
    P = len(tok.encode(prompt))
    obs = [int(i) for i in tok.encode("ab:" * args.obs, add_special_tokens=False)[: args.obs]]

    def rollout(turns: int, new_tokens: int, delay: float = 0.0, waves: int = 1, total: int = 100_000,
                count: int = args.trajectories, eng=engine):
        opt = MultiTurnOptions(max_turns=turns, max_total_tokens=total, max_new_tokens=new_tokens,
                               step_timeout=600.0, reward_gamma=1.0, failed_trajectories="zero", env_waves=waves)
        mt = MultiTurnRollout(FixedTurns(turns, obs, delay), eng, sampler, tok, [], opt, workers)
        t0 = time.perf_counter()
        out = mt.run([Task(prompt=prompt)] * count, 1, seed=3)
        return out, time.perf_counter() - t0

    # -- 1. cost per token at equal total length ------------------------------------
    shapes = {}
    for T in (1, 4, 16):
        r = (args.total - P - (T - 1) * args.obs) // T
        shapes[T] = r
    rollout(4, 8), rollout(4, 8, eng=reprefill)  # warm up
    per_token: dict[tuple[str, int], list[float]] = {(e, T): [] for e in ("turn_cache", "reprefill") for T in shapes}
    lengths = {}
    for _ in range(args.repeats):
        for T, r in shapes.items():
            for name, eng in (("turn_cache", engine), ("reprefill", reprefill)):
                out, dt = rollout(T, r, eng=eng)
                tokens = int(out.batch.seq_lens.sum())
                lengths[T] = int(out.batch.seq_lens[0])
                assert out.metrics["turns_mean"] == T
                per_token[name, T].append(dt / tokens)
    claim1: dict[str, Any] = {}
    for (name, T), v in per_token.items():
        base = per_token[name, 1]
        claim1.setdefault(name, {})[str(T)] = {
            "turns": T, "response_tokens_per_turn": shapes[T], "row_tokens": lengths[T],
            "median_us_per_token": 1e6 * statistics.median(v),
            "ratio_vs_1_turn": statistics.median(x / y for x, y in zip(v, base)),
        }
    claim1["turn_cache_speedup_at_16_turns"] = statistics.median(
        y / x for x, y in zip(per_token["turn_cache", 16], per_token["reprefill", 16]))

    # -- 2. slow tools: the wait the waves hide ---------------------------------------
    turns, new_tokens = 4, 16
    count = args.tool_trajectories
    out, dt = rollout(turns, new_tokens, count=count)
    decode_per_turn = out.gen_time / turns  # one wave's whole decode of one turn
    claim2 = {}
    for scale in (0.5, 1.0, 2.0):
        delay = scale * decode_per_turn
        runs: dict[int, list[tuple[float, float]]] = {1: [], 2: [], 4: []}
        for _ in range(args.repeats):
            for W in runs:
                out, dt = rollout(turns, new_tokens, delay=delay, waves=W, count=count)
                runs[W].append((out.metrics["env_wait_time_s"], dt))
        wait1 = statistics.median(w for w, _ in runs[1])
        time1 = statistics.median(t for _, t in runs[1])
        claim2[f"tool_{scale}x_decode"] = {
            "tool_seconds": delay,
            **{f"waves_{W}": {
                "median_rollout_s": statistics.median(t for _, t in v),
                "median_env_wait_s": statistics.median(w for w, _ in v),
                "wait_fraction": statistics.median(w / t for w, t in v),
                "hidden": 1.0 - statistics.median(w for w, _ in v) / wait1,
                "time_vs_1_wave": statistics.median(t for _, t in v) / time1,
            } for W, v in runs.items()},
        }
    print(json.dumps({
        "preset": args.preset, "shape": shape, "threads": args.threads, "trajectories": args.trajectories, "tool_trajectories": count,
        "max_batch_size": engine.config.max_batch_size,
        "repeats": args.repeats, "decode_s_per_turn_1_wave": decode_per_turn,
        "per_token": claim1, "slow_tools": claim2,
    }, indent=1))


if __name__ == "__main__":
    main()
