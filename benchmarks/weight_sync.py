"""Weight sync: ``delta`` vs a full safetensors write + read; ``nixl`` (sharded) vs ``broadcast`` vs raw NIXL.

    python benchmarks/weight_sync.py [--size-gib 1] [--fractions 0.01 0.03 0.1] [--repeats 3]
        [--targets file s3] [--s3-full-rounds 2] [--level 1] [--threads 2] [--links 1 10 100]
        [--compare-rev REV] [--tmp-dir DIR] [--torch-threads 2] [--seed 0]
        [--sharded-gib 0.5] [--sharded-repeats 5] [--real-steps 20] [--real-lr 1e-6] [--quick]

The model state. A decoder-only transformer's weights (Qwen-like names and shapes:
hidden 2048, 16 query heads and 8 KV heads of 128, FFN 6144, vocabulary 32,768, embedding
and LM head untied, RMSNorm weights), as **bfloat16** tensors fed straight to
``publish``, with as many layers as it takes to reach ``--size-gib`` (default 1: 8 layers,
537M parameters, 1.0 GiB; below 0.25 GiB a narrower model, hidden 256). Values: N(0,
0.02^2) rounded to bf16 (norms 1 + N(0, 0.01^2)).

An RL step's update. Before every step a fraction ``f`` of the elements of every tensor
(``--fractions``, default 1%, 3% and 10%; positions uniform, distinct, independent per
element) moves by a few bf16 ulps, as small updates through fp32 master weights do (most
elements do not cross a bf16 rounding boundary, those that do move by one or two ulps):
the 16-bit pattern gets +/-1 (75%), +/-2 (20%) or +/-3..8 (5%), sign at random (but away
from 0 within 16 ulps of it: no sign flip). Every changed element changes its 16-bit
word, so ``f`` of the words differ (``changed_fraction``: as drawn).

Per target and step, interleaved (the order rotates every round):

- ``delta``: ``DeltaSender.publish`` (keyframe_every=0, so every step is a delta on the
  previous one; ``--level``, ``--threads`` are zstd's), then ``DeltaReceiver.fetch`` and
  ``DeltaReceiver.apply(engine)``;
- ``full`` (the baseline): ``safetensors.torch.save`` to bytes + ``fs.pipe_file`` of one
  object, then ``fs.cat_file`` + ``safetensors.torch.load`` + the engine's update.

The engine keeps preallocated bf16 tensors and copies every tensor it is handed into
them (``param.copy_(tensor)``), like a real inference engine; its copy time is reported
apart (``engine_copy_s``). Both paths hand it the whole model.

Targets (``--targets``): ``file`` (``file://`` in a temp dir under ``--tmp-dir``: the page
cache, nothing is fsync'ed, so this is the CPU cost of each path) and ``s3`` (moto's S3
server on 127.0.0.1, through s3fs, as a bucket on AWS would be reached; skipped when
moto or s3fs is missing). The full path's ``pipe_file`` of 1 GiB is a multipart upload
(s3fs: 50 MiB parts, 10 at a time); moto takes ~17 s to complete it, past s3fs's 15 s
read timeout, and botocore's retry of the completion finds the upload gone ("The
specified upload does not exist"): the client options come from
``skyrl_toolkit.s3server.client_options``, whose read timeout is long enough (``delta``
never uploads in parts: each payload object is at most 64 MiB of tensor bytes, one PUT).
moto moves ~60-80 MB/s, so a full 1 GiB write + read takes ~35 s there: on ``s3`` the
full path runs in ``--s3-full-rounds`` rounds only (default 2, spread
over the run; 0: every round), pooled over the fractions (its cost does not depend on
them), and its ratios are ratios of medians (``full_paired: false``). The S3 server runs
on the same 2 cores as the benchmark: it slows the delta path's encoding too.

Reported per target and fraction (medians over ``--repeats`` rounds, after one warm-up
round at the first fraction and a keyframe that is reported apart):

- ``bytes``: what each path writes and reads (delta: payloads + manifest + LATEST; full:
  the safetensors object), ``bytes_ratio_delta_vs_full``;
- ``encode_gb_s``: full bytes (the model's bf16 size) / encode seconds (delta:
  ``sync_encode_s`` of publish, the bytes conversion, XOR, sparse encoding, zstd and
  checksums, no I/O; full: ``safetensors.torch.save``);
- ``decode_apply_gb_s``: full bytes / the seconds from having the payloads in memory to
  the engine holding the new weights (delta: ``apply``, after ``fetch``; full:
  ``safetensors.torch.load`` + the engine update), engine copy included;
- ``wall_s``: publish (or save + write) + fetch (or read) + apply, end to end through the
  target, and ``wall_ratio_full_vs_delta`` (median of the per-round ratios; > 1: delta faster);
- ``links``: at 1, 10 and 100 Gbit/s (``--links``), the transfer time of each path's bytes
  and ``est_s`` = encode + transfer + decode/apply (no overlap assumed);
- ``checks``: at 1% changed, whether ``delta`` moves <= 2% of the full bytes, encodes at
  >= 2 GB/s and decodes + applies at >= 3 GB/s.

The real run (``real_run``; ``--real-steps``, default 20, 0 skips it; ~1.5 min): what a
real RL run changes per step. ``skyrl run`` of an ``rl`` job (GRPO, 4 chat word problems
from examples/data rendered through the chat template x 4 samples, 16 new tokens) on the
real-shaped Qwen3 checkpoint (``skyrl_models.checkpoints.build_checkpoint``, kind qwen3:
Qwen3-0.6B's widths, 2 layers, 40M parameters, random weights) with fp32 AdamW master
weights at ``--real-lr`` (default 1e-6, as large-model RL uses) and ``[weight_sync]
transport = "delta"`` (bf16 wire, ``keyframe_every = 0``) on a ``file://`` URL. Per step,
from the job's metrics.jsonl (the sender's own statistics) and its files:
``bytes_ratio`` = the files the version wrote (payloads + manifest + LATEST) / the served
weights' bf16 bytes, ``changed_fraction`` = ``sync_changed_words / sync_words`` (bf16
words that differ from the last version), ``bytes_per_changed_word``; medians, min and max
over the steps. The reward is ``alnum_share`` (below): random weights never answer a word
problem right, and an all-zero reward moves no weight.

The sharded section (``sharded``; ``--sharded-gib``, default 0.5, 0 skips it): three
processes in one gloo world, on this machine's DRAM. Trainer ranks 0 and 1 hold a
Qwen-like bf16 model of ``--sharded-gib`` GiB as FSDP2 does, each tensor a ``DTensor``
sharded ``Shard(0)`` over the two ranks; the third process is an engine (the same
copying ``Engine`` as above). Per round (``--sharded-repeats``, after a warm-up round;
the order rotates), with the real transport classes:

- ``nixl``: ``NixlSender.publish`` on both ranks (each copies its own shards into its
  registered buffers), then ``NixlReceiver.sync`` in the engine process (shard (0, 1)):
  the version headers, one batched READ per rank, the headers again (``read_s``), then
  the engine's copy (``apply_s``); ``e2e_s`` from the start of the publishes to the end;
- ``raw_nixl``: the baseline, one NIXL READ of one registered buffer holding the same
  bytes, trainer rank 0 -> engine, one descriptor (NIXL and UCX as they come);
- ``broadcast``: ``BroadcastSender.publish`` of the full weights on trainer rank 0 and
  ``BroadcastReceiver.sync`` (64 MiB buckets over gloo), engine copy included.

Reported: medians, GB/s of model bytes, ``ratio_nixl_read_vs_raw`` (median over rounds of
raw seconds / nixl read seconds: nixl's share of the raw bandwidth; the issue expects >=
0.7) and ``ratio_broadcast_vs_nixl_e2e``. Afterwards each path runs once more into a
zeroed engine (or buffer) and is compared with the model (``received_equal``). One torch
thread per process.

``--compare-rev REV`` runs the ``delta`` of another commit too (its ``skyrl_weightsync/_delta/``
package, or ``_delta.py`` at commits before that was split, taken with ``git show``; same
on-disk format), interleaved, as ``delta@REV``: the before/after of a change to the delta
implementation in one run (one more sender and receiver: ~3 more GiB at 1 GiB).
``other_cores`` is how many cores other processes took meanwhile (/proc/stat minus this
process and the S3 server): the machine is shared, seconds move, ratios much less.
Every path's result is checked against the trainer's weights (``torch.equal`` of every
tensor) in the warm-up round and the last round of each fraction. Progress goes to
stderr, one JSON object to stdout. A default run takes ~4 minutes and peaks at ~7 GiB
(``peak_rss_gib``: this process; moto holds up to ~5 GiB more while it completes the full
path's upload), then ~1.5 min for the real run and ~40 s for the sharded section (its three
processes hold ~4 GiB together); ``--targets`` with no value runs only the sharded
section (and the real run); ``--quick`` (8 MiB, one round per fraction, a few seconds) is the smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any, Callable

import fsspec
import numpy as np
import safetensors.torch
import torch

from skyrl_toolkit.s3server import client_options, local_s3_server
from skyrl_weightsync import delta

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[weight_sync {time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# -- the model and its updates ------------------------------------------------------


def model_shapes(size_gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen-like bf16 weights summing to at least ``size_gib`` GiB."""
    if size_gib >= 0.25:
        hidden, heads, kv_heads, head_dim, ffn, vocab = 2048, 16, 8, 128, 6144, 32768
    else:
        hidden, heads, kv_heads, head_dim, ffn, vocab = 256, 2, 1, 128, 768, 4096
    per_layer = [
        ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
        ("self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
        ("self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
        ("self_attn.o_proj.weight", (hidden, heads * head_dim)),
        ("self_attn.q_norm.weight", (head_dim,)),
        ("self_attn.k_norm.weight", (head_dim,)),
        ("mlp.gate_proj.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", (hidden, ffn)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    ends = [("model.embed_tokens.weight", (vocab, hidden)), ("model.norm.weight", (hidden,)),
            ("lm_head.weight", (vocab, hidden))]
    target = size_gib * 2**30 / 2
    layer_n = sum(math.prod(s) for _, s in per_layer)
    layers = max(1, math.ceil((target - sum(math.prod(s) for _, s in ends)) / layer_n))
    shapes = [ends[0]]
    for i in range(layers):
        shapes += [(f"model.layers.{i}.{n}", s) for n, s in per_layer]
    return shapes + ends[1:]


def build_weights(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes:
        t = torch.randn(shape, generator=g)
        out[name] = (t.mul_(0.01).add_(1.0) if len(shape) == 1 else t.mul_(0.02)).bfloat16()
    return out


# Steps in ulps by a uniform byte: +-1 (192 of 256 values: 75%), +-2 (52: ~20%), +-3..8 (12: ~5%).
STEPS = np.repeat(np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int16), [96, 26, 1, 1, 1, 1, 1, 1])
STEPS = np.concatenate([STEPS, -STEPS])
assert STEPS.size == 256


def perturb(weights: dict[str, torch.Tensor], fraction: float, rng: np.random.Generator) -> int:
    """Move ``fraction`` of the elements of every tensor by a few bf16 ulps; returns how many moved."""
    changed = 0
    for t in weights.values():
        words = t.view(torch.int16).numpy().reshape(-1)
        n = words.size
        # A Bernoulli(fraction) process over the positions: geometric gaps.
        k = n * fraction
        pos = np.cumsum(rng.geometric(fraction, size=int(k + 6 * math.sqrt(k) + 16))) - 1
        while pos[-1] < n:
            pos = np.concatenate([pos, pos[-1] + np.cumsum(rng.geometric(fraction, size=int(k // 10 + 16)))])
        pos = pos[: np.searchsorted(pos, n)]
        step = STEPS[rng.integers(0, 256, size=pos.size, dtype=np.uint8)]
        old = words[pos]
        near0 = (old & 0x7FFF) < 16
        step[near0] = np.abs(step[near0])  # away from 0: no sign flip into NaN
        words[pos] = old + step
        changed += pos.size
    return changed


class Engine:
    """Preallocated bf16 parameters; ``update_weights`` copies into them (``param.copy_``)."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]):
        self.params = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes}
        self.version = -1
        self.copy_s = 0.0

    def update_weights(self, named, version) -> None:
        t0 = time.perf_counter()
        seen = 0
        for name, tensor in named:
            self.params[name].copy_(tensor)
            seen += 1
        if seen != len(self.params):
            raise ValueError(f"update_weights: {seen} tensors, the engine has {len(self.params)}")
        self.version = version
        self.copy_s = time.perf_counter() - t0

    def matches(self, weights: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(self.params[k], v) for k, v in weights.items())


# -- measurement helpers -----------------------------------------------------------


class CpuMeter:
    """Cores that other processes took over an interval: /proc/stat busy time minus our own
    (and ``child``'s) CPU time; None where /proc cannot be read."""

    tick = os.sysconf("SC_CLK_TCK")

    def __init__(self) -> None:
        self.child: int | None = None

    def _own(self) -> float:
        t = os.times()
        own = t.user + t.system
        if self.child is not None:
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{self.child}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                own += (int(fields[11]) + int(fields[12])) / self.tick
        return own

    def sample(self) -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except OSError:
            return None
        return (sum(v) - v[3] - v[4]) / self.tick, self._own(), time.perf_counter()

    @staticmethod
    def others(a, b) -> float | None:
        if a is None or b is None or b[2] <= a[2]:
            return None
        return round(max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2])), 2)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def load_delta_rev(rev: str, tmp: str) -> types.ModuleType:
    """The delta implementation as of commit ``rev``, imported under another name: a module
    with its ``DeltaSender``, ``DeltaReceiver`` and ``version_dir``. From the ``_delta/``
    package (its modules import each other relatively, so the copy is a package of its
    own), or from ``_delta.py`` at commits before the package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    where = "plugins/weightsync/skyrl_weightsync/_delta"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], check=True, capture_output=True, text=True).stdout

    name = "_delta_" + re.sub(r"\W", "_", rev)
    kind = subprocess.run(["git", "-C", root, "cat-file", "-t", f"{rev}:{where}"], capture_output=True,
                          text=True).stdout.strip()
    if kind != "tree":  # one file
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(git("show", f"{rev}:{where}.py"))
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod
    pkg = os.path.join(tmp, name)
    os.makedirs(pkg)
    for file in git("ls-tree", "--name-only", f"{rev}:{where}").split():
        if file.endswith(".py"):
            with open(os.path.join(pkg, file), "w") as f:
                f.write(git("show", f"{rev}:{where}/{file}"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    package = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = package  # its modules' relative imports find it here
    spec.loader.exec_module(package)  # type: ignore[union-attr]
    mod = types.ModuleType(f"{name}.face")
    mod.DeltaSender = importlib.import_module(f"{name}.sender").DeltaSender  # type: ignore[attr-defined]
    mod.DeltaReceiver = importlib.import_module(f"{name}.receiver").DeltaReceiver  # type: ignore[attr-defined]
    mod.version_dir = importlib.import_module(f"{name}.store").version_dir  # type: ignore[attr-defined]
    return mod


# -- the two paths -------------------------------------------------------------------


class DeltaPath:
    """One ``delta`` implementation (module) over one URL."""

    def __init__(self, name: str, mod: types.ModuleType, uri: str, options: dict | None, args: argparse.Namespace):
        self.name, self.mod, self.uri, self.options = name, mod, uri, options
        self.sender = mod.DeltaSender(uri, storage_options=options, keyframe_every=0, level=args.level,
                                      threads=args.threads)
        self.receiver = mod.DeltaReceiver(uri, storage_options=options)

    def bytes_of(self, version: int) -> int:
        store = self.sender.store
        rel = self.mod.version_dir(self.sender.epoch, version)
        return int(store.fs.du(store.path(rel))) + len(store.read("LATEST"))

    def step(self, version: int, weights: dict[str, torch.Tensor], engine: Engine) -> dict[str, float]:
        stats = self.sender.publish(version, weights.items())
        fetch_s, got = timed(self.receiver.fetch)
        assert got == version, (got, version)
        apply_s, _ = timed(lambda: self.receiver.apply(engine))
        assert engine.version == version
        return {
            "encode_s": stats["sync_encode_s"], "publish_s": stats["sync_publish_s"], "fetch_s": fetch_s,
            "decode_apply_s": apply_s, "engine_copy_s": engine.copy_s,
            "wall_s": stats["sync_publish_s"] + fetch_s + apply_s,
            "bytes": float(self.bytes_of(version)), "keyframe": stats["sync_keyframe"],
        }


class FullPath:
    """The baseline: the whole model as one safetensors object, written and read back."""

    name = "full"

    def __init__(self, uri: str, options: dict | None):
        self.fs, root = fsspec.core.url_to_fs(uri, **dict(options or {}))
        self.path = root.rstrip("/") + "/model.safetensors"
        if "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)):
            os.makedirs(root, exist_ok=True)

    def step(self, version: int, weights: dict[str, torch.Tensor], engine: Engine) -> dict[str, float]:
        serialize_s, write_s, nbytes = self._publish(weights)  # the bytes are freed before the read
        t0 = time.perf_counter()
        data = self.fs.cat_file(self.path)
        read_s = time.perf_counter() - t0
        assert len(data) == nbytes
        t0 = time.perf_counter()
        engine.update_weights(safetensors.torch.load(data).items(), version)
        apply_s = time.perf_counter() - t0
        return {
            "encode_s": serialize_s, "publish_s": serialize_s + write_s, "fetch_s": read_s,
            "decode_apply_s": apply_s, "engine_copy_s": engine.copy_s,
            "wall_s": serialize_s + write_s + read_s + apply_s, "bytes": float(nbytes),
        }

    def _publish(self, weights: dict[str, torch.Tensor]) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        data = safetensors.torch.save(weights)
        t1 = time.perf_counter()
        self.fs.pipe_file(self.path, data)
        return t1 - t0, time.perf_counter() - t1, len(data)


# -- a target --------------------------------------------------------------------------


def run_target(target: str, base_uri: str, options: dict | None, weights: dict[str, torch.Tensor],
               engine: Engine, full_bytes: int, args: argparse.Namespace, mods: dict[str, types.ModuleType],
               meter: CpuMeter, rng: np.random.Generator, full_rounds: int | None) -> dict[str, Any]:
    paths: list[Any] = [DeltaPath(name, mod, f"{base_uri}/{name.replace('@', '_')}", options, args)
                        for name, mod in mods.items()]
    paths.append(FullPath(f"{base_uri}/full", options))
    version = 0
    out: dict[str, Any] = {"keyframe": {}, "fractions": {}}
    # The keyframe (every delta path's first version), reported apart.
    for p in paths[:-1]:
        r = p.step(version, weights, engine)
        assert r["keyframe"] == 1.0 and engine.matches(weights), p.name
        out["keyframe"][p.name] = {"bytes": int(r["bytes"]), "bytes_ratio_vs_full": round(r["bytes"] / full_bytes, 3),
                                   "publish_s": round(r["publish_s"], 3), "fetch_s": round(r["fetch_s"], 3),
                                   "decode_apply_s": round(r["decode_apply_s"], 3), "wall_s": round(r["wall_s"], 3)}
        log(f"{target}: {p.name} keyframe {r['bytes'] / 2**20:.0f} MiB, wall {r['wall_s']:.2f} s")
    rounds = [(args.fractions[0], True)] + [(f, False) for f in args.fractions for _ in range(args.repeats)]
    measured = len(rounds) - 1
    # Rounds with the full path: all of them, or (--full-rounds k) k spread over the measured rounds
    # (the full path's cost does not depend on the fraction: it is then pooled over all fractions).
    k = measured if full_rounds is None else min(full_rounds, measured)
    if k == measured:
        with_full = set(range(len(rounds)))
    else:
        with_full = {1 + round(j * (measured - 1) / max(1, k - 1)) for j in range(k)}
    results: dict[float, dict[str, list[dict[str, float]]]] = {}
    full_all: list[dict[str, float]] = []
    changed: dict[float, list[int]] = {}
    a = meter.sample()
    for i, (fraction, warmup) in enumerate(rounds):
        n = perturb(weights, fraction, rng)
        version += 1
        here = [p for p in paths if p.name != "full" or i in with_full]
        order = here[i % len(here):] + here[:i % len(here)]
        last_of_fraction = i + 1 == len(rounds) or rounds[i + 1][0] != fraction
        for p in order:
            r = p.step(version, weights, engine)
            if warmup or last_of_fraction or p.name == "full":
                assert engine.matches(weights), f"{target}: {p.name} did not give the published weights"
            if not warmup:
                results.setdefault(fraction, {}).setdefault(p.name, []).append(r)
                if p.name == "full":
                    full_all.append(r)
        if not warmup:
            changed.setdefault(fraction, []).append(n)
        log(f"{target}: f={fraction:g}{' (warm-up)' if warmup else ''} "
            + ", ".join(f"{p.name} {results[fraction][p.name][-1]['wall_s']:.2f} s" for p in here if not warmup))
    out["other_cores"] = CpuMeter.others(a, meter.sample())
    out["full_rounds"] = len(full_all)
    out["full_paired"] = k == measured
    for fraction, by_path in results.items():
        if k != measured:
            by_path["full"] = full_all
        out["fractions"][f"{fraction:g}"] = summarize(by_path, full_bytes, args.links,
                                                      med(changed[fraction]) / (full_bytes / 2), paired=k == measured)
    one = out["fractions"].get("0.01", {}).get("delta")
    if one:
        out["checks"] = {"f=0.01": {"bytes_le_2pct": one["bytes_ratio_delta_vs_full"] <= 0.02,
                                    "encode_ge_2gb_s": one["encode_gb_s"] >= 2.0,
                                    "decode_apply_ge_3gb_s": one["decode_apply_gb_s"] >= 3.0}}
    return out


def summarize(by_path: dict[str, list[dict[str, float]]], full_bytes: int, links: list[float],
              changed: float, paired: bool) -> dict[str, Any]:
    s: dict[str, Any] = {"changed_fraction": round(changed, 5)}
    full = by_path["full"]
    for name, rs in by_path.items():
        m = {k: med([r[k] for r in rs]) for k in ("encode_s", "publish_s", "fetch_s", "decode_apply_s",
                                                     "engine_copy_s", "wall_s", "bytes")}
        d: dict[str, Any] = {
            "bytes": int(m["bytes"]),
            "encode_s": round(m["encode_s"], 4), "encode_gb_s": round(full_bytes / m["encode_s"] / 1e9, 2),
            "publish_s": round(m["publish_s"], 4), "fetch_s": round(m["fetch_s"], 4),
            "decode_apply_s": round(m["decode_apply_s"], 4),
            "decode_apply_gb_s": round(full_bytes / m["decode_apply_s"] / 1e9, 2),
            "engine_copy_s": round(m["engine_copy_s"], 4), "wall_s": round(m["wall_s"], 3),
            "links": {f"{g:g}gbit": {"transfer_s": round(m["bytes"] * 8 / (g * 1e9), 4),
                                     "est_s": round(m["encode_s"] + m["bytes"] * 8 / (g * 1e9) + m["decode_apply_s"],
                                                    4)}
                      for g in links},
        }
        if name != "full":
            d["bytes_ratio_delta_vs_full"] = round(m["bytes"] / med([r["bytes"] for r in full]), 5)

            def ratio(fn: Callable[[dict[str, float]], float]) -> float:
                if paired:  # the median of the per-round ratios
                    return round(med([fn(f) / fn(r) for f, r in zip(full, rs)]), 2)
                return round(med([fn(f) for f in full]) / med([fn(r) for r in rs]), 2)

            d["wall_ratio_full_vs_delta"] = ratio(lambda r: r["wall_s"])
            d["links_ratio_full_vs_delta"] = {
                f"{g:g}gbit": ratio(lambda r, g=g: r["encode_s"] + r["bytes"] * 8 / (g * 1e9) + r["decode_apply_s"])
                for g in links}
        s[name] = d
    # --compare-rev: the other commit's delta against this tree's, median of per-round ratios (> 1: this tree faster)
    for name in [k for k in by_path if k.startswith("delta@")]:
        s[f"ratio_{name}_vs_delta"] = {
            k: round(med([o[k] / r[k] for o, r in zip(by_path[name], by_path["delta"])]), 2)
            for k in ("encode_s", "decode_apply_s", "wall_s")}
    return s


# -- a real RL run: what a step changes -----------------------------------------------------

REAL_JOB = """\
[job]
kind = "rl"
seed = {seed}
steps = {steps}
batch_size = {batch}
n_samples = {samples}
max_new_tokens = {new_tokens}
threads = {threads}
output_dir = "{out}"

[model]
family = "qwen"
path = "{checkpoint}"

[dataset]
name = "jsonl"
path = "{data}"
system_prompt = "You are a careful math tutor. Think step by step."
reward = "weight_sync:alnum_share"
shuffle = true

[engine]
name = "embedded"
dtype = "bfloat16"

[sampler]
name = "top_p"
top_p = 0.95
temperature = 1.0

[algorithm]
name = "grpo"

[backend]
name = "torch"
lr = {lr}

[weight_sync]
transport = "delta"
uri = "{uri}"
dtype = "bfloat16"
keyframe_every = 0
"""


def alnum_share(task: Any, completion: str) -> float:
    """The real run's reward (``reward = "weight_sync:alnum_share"``): the share of the
    response's characters that are letters or digits. Random weights never write a correct
    answer, so math-verify would score every sample 0, every advantage would be 0 and no
    weight would move; this dense reward differs between the samples of every group, so
    every step has a policy gradient, as a real run's batch of many groups has."""
    text = completion.strip()
    return sum(c.isalnum() for c in text) / len(text) if text else 0.0


def run_real(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """``skyrl run`` of an rl job on the real-shaped Qwen3 checkpoint with ``delta`` through
    a folder; each step's delta as the sender reported it (metrics.jsonl) and as written."""
    from skyrl_models.checkpoints import build_checkpoint

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.join(tmp, "real")
    checkpoint = build_checkpoint(os.path.join(root, "checkpoint"), "qwen3", seed=args.seed)
    store = os.path.join(root, "weights")
    job = os.path.join(root, "job.toml")
    shape = {"seed": args.seed, "steps": args.real_steps, "batch": 4, "samples": 4, "new_tokens": 16,
             "threads": args.torch_threads, "lr": args.real_lr}
    with open(job, "w") as f:
        f.write(REAL_JOB.format(**shape, out=os.path.join(root, "out"), checkpoint=checkpoint, uri=f"file://{store}",
                                data=os.path.join(os.path.dirname(here), "examples", "data",
                                                  "math_word_problems.jsonl")))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])  # alnum_share
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", "import sys; from skyrl_host.cli import main; sys.exit(main())",
                          "run", job], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode:
        raise SystemExit(f"the real run failed (rc {run.returncode}):\n{run.stderr[-3000:]}")
    with open(os.path.join(root, "out", "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "step" in r and "event" not in r]
    latest = os.path.getsize(os.path.join(store, "LATEST"))
    steps = []
    for r in rows:
        assert not r["sync_keyframe"], r  # keyframe_every = 0: version 0 (the start) is the only keyframe
        folder = os.path.join(store, delta.version_dir(int(r["sync_epoch"]), int(r["sync_version"])))
        wire = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)) + latest
        steps.append({
            "step": r["step"], "wire_bytes": wire, "bytes_ratio": round(wire / r["sync_full_bytes"], 6),
            "payload_bytes": int(r["sync_bytes"]),
            "changed_fraction": round(r["sync_changed_words"] / r["sync_words"], 6),
            "bytes_per_changed_word": round(wire / r["sync_changed_words"], 3) if r["sync_changed_words"] else None,
            "encode_s": round(r["sync_encode_s"], 4), "apply_s": round(r["sync_apply_s"], 4),
            "grad_norm": round(r["grad_norm"], 4), "reward_mean": round(r["reward_mean"], 4),
        })

    def spread(key: str) -> dict[str, float]:
        xs = [x[key] for x in steps if x[key] is not None]
        return {"median": round(med(xs), 6), "min": min(xs), "max": max(xs)}

    return {
        "what": "skyrl run of an rl job (GRPO) on the real-shaped qwen3 checkpoint (skyrl_models.checkpoints: "
                "Qwen3-0.6B's widths, 2 layers, random weights), fp32 AdamW master weights, [weight_sync] transport = "
                "'delta' (bf16 wire, keyframe_every = 0) on a file:// URL; per step: the files its version wrote "
                "(payloads + manifest + LATEST) / the bf16 bytes of the served weights, and the changed 16-bit "
                "words / all (the sender's sync_changed_words / sync_words in metrics.jsonl)",
        "job": {**shape, "lr": args.real_lr,
                "reward": "weight_sync:alnum_share (letters' and digits' share of the response)",
                "dataset": "examples/data/math_word_problems.jsonl (chats, rendered with the chat template)"},
        "full_bytes": int(rows[0]["sync_full_bytes"]), "words": int(rows[0]["sync_words"]),
        "bytes_ratio": spread("bytes_ratio"), "changed_fraction": spread("changed_fraction"),
        "bytes_per_changed_word": spread("bytes_per_changed_word"),
        "steps": steps, "job_wall_s": round(wall, 1),
    }


# -- sharded: nixl (2 trainer ranks -> 1 engine) vs broadcast vs raw NIXL ----------------


def _sharded_tensor(i: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Tensor ``i`` of the model, the same in every process (bf16)."""
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    return (torch.randn(shape, generator=g) * 0.02).bfloat16()


def sharded_worker(rank: int, store: str, args: argparse.Namespace) -> None:
    """One of 3 processes: ranks 0 and 1 are trainer ranks holding FSDP2-style shards
    (``DTensor``, ``Shard(0)`` over a 2-rank mesh), rank 2 the engine process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from skyrl_weightsync.broadcast import BroadcastReceiver, BroadcastSender
    from skyrl_weightsync.nixl import NixlReceiver, NixlSender, Poller, make_agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 3), rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=600))
    mesh = DeviceMesh("cpu", [0, 1])  # the trainer ranks (every rank takes part in making it)
    bgroup = dist.new_group([0, 2])  # broadcast: trainer rank 0 -> the engine process
    shapes = model_shapes(args.sharded_gib)
    total = sum(math.prod(s) for _, s in shapes) * 2
    bucket = 64 << 20
    info: dict[str, Any] = {}
    if rank < 2:
        full: dict[str, torch.Tensor] = {}
        local = []
        for i, (name, shape) in enumerate(shapes):
            t = _sharded_tensor(i, shape, args.seed)
            part = t.chunk(2)[rank].clone()  # torch.chunk: how Shard(0) cuts
            local.append((name, DTensor.from_local(part, mesh, [Shard(0)], shape=t.shape, stride=t.stride(),
                                                   run_check=False)))
            if rank == 0:
                full[name] = t
        sender = NixlSender(rank=rank, world=2)
        sender.publish(0, local)
        info["nixl"] = sender.endpoint()
        if rank == 0:  # raw: the same bytes as one registered buffer, read in one descriptor
            raw = torch.empty(total, dtype=torch.uint8)
            at = 0
            for t in full.values():
                n = t.numel() * 2
                raw[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
                at += n
            raw_agent = make_agent(f"raw-src-{os.getpid()}", polled=True)
            raw_agent.register_memory(raw)
            poller = Poller(raw_agent)
            poller.start()
            info["raw"] = (raw_agent.get_agent_metadata(), raw.data_ptr(), total)
            bsender = BroadcastSender(group=bgroup, src=0, bucket_bytes=bucket)
    infos: list[Any] = [None] * 3
    dist.all_gather_object(infos, info)
    if rank == 2:
        engine = Engine(shapes)
        receiver = NixlReceiver(shard=(0, 1))
        receiver.connect([infos[0]["nixl"], infos[1]["nixl"]])
        breceiver = BroadcastReceiver(group=bgroup, src=0, bucket_bytes=bucket)
        raw_agent = make_agent(f"raw-dst-{os.getpid()}")
        dst = torch.zeros(total, dtype=torch.uint8)
        raw_agent.register_memory(dst)
        md, addr, _ = infos[0]["raw"]
        peer = raw_agent.add_remote_agent(md)
        remote = raw_agent.prep_xfer_dlist(peer, [(addr, total, 0)], "DRAM")
        mine = raw_agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.data_ptr(), total, 0)], "DRAM")
        raw_read = raw_agent.make_prepped_xfer("READ", mine, [0], remote, [0])

        def read_raw() -> None:
            state = raw_agent.transfer(raw_read)
            while state == "PROC":
                state = raw_agent.check_xfer_state(raw_read)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL read: {state}")

    times: dict[str, list[dict[str, float]]] = {"raw": [], "nixl": [], "broadcast": []}
    version = 0
    methods = ["nixl", "raw", "broadcast"]
    for r in range(args.sharded_repeats + 1):  # round 0 warms up (connections, first touch)
        for method in methods[r % 3:] + methods[: r % 3]:
            version += 1
            dist.barrier()
            t0 = time.perf_counter()
            if method == "nixl":
                if rank < 2:
                    sender.publish(version, local)
                dist.barrier()  # every rank has published: the engine reads
                if rank == 2:
                    t1 = time.perf_counter()
                    st = receiver.sync(engine, target=version)
                    t2 = time.perf_counter()
                    rec = {"publish_s": t1 - t0, "read_s": st["sync_seconds"] - st["sync_apply_s"],
                           "apply_s": st["sync_apply_s"], "e2e_s": t2 - t0}
            elif method == "raw":
                if rank == 2:
                    read_raw()
                    rec = {"read_s": time.perf_counter() - t0}
            else:
                if rank == 0:
                    bsender.publish(version, full.items())
                elif rank == 2:
                    breceiver.sync(engine)
                    rec = {"e2e_s": time.perf_counter() - t0}
            if rank == 2 and r > 0:
                times[method].append(rec)
    # Each path once more, into a zeroed engine (a zeroed buffer), compared with the model.
    checks: dict[str, bool] = {}
    if rank == 2:
        want = {name: _sharded_tensor(i, shape, args.seed) for i, (name, shape) in enumerate(shapes)}
        for p in engine.params.values():
            p.zero_()
    version += 1
    dist.barrier()
    if rank < 2:
        sender.publish(version, local)
    dist.barrier()
    if rank == 2:
        receiver.sync(engine, target=version)
        checks["nixl"] = engine.matches(want)
        dst.zero_()
        read_raw()
        checks["raw"] = torch.equal(dst, torch.cat([t.reshape(-1).view(torch.uint8) for t in want.values()]))
        for p in engine.params.values():
            p.zero_()
    version += 1
    dist.barrier()
    if rank == 0:
        bsender.publish(version, full.items())
    elif rank == 2:
        breceiver.sync(engine)
        checks["broadcast"] = engine.matches(want)
    dist.barrier()
    if rank == 2:
        print(json.dumps({"bytes": total, "tensors": len(shapes), "times": times, "checks": checks,
                          "descriptors": receiver.descriptors,
                          "transfers": sum(len(p.reads) for p in receiver._peers)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def run_sharded(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    from skyrl_weightsync.nixl import INSTALL_HINT, nixl_installed

    if not nixl_installed():
        return {"skipped": f"needs NIXL: {INSTALL_HINT}"}
    store = os.path.join(tmp, "sharded_store")
    cmd = [sys.executable, os.path.abspath(__file__), "--sharded-gib", str(args.sharded_gib), "--sharded-repeats",
           str(args.sharded_repeats), "--seed", str(args.seed), "--sharded-store", store]
    procs = [subprocess.Popen(cmd + ["--sharded-rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(3)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a sharded-section process failed: {[p.returncode for p in procs]}")
    res = json.loads(outs[2].strip().splitlines()[-1])
    t, total = res["times"], res["bytes"]

    def m(method: str, key: str) -> float:
        return med([x[key] for x in t[method]])

    def gbs(seconds: float) -> float:
        return round(total / seconds / 1e9, 2)

    nixl = {k: round(m("nixl", k), 4) for k in ("publish_s", "read_s", "apply_s", "e2e_s")}
    out = {
        "bytes": total, "tensors": res["tensors"], "trainer_ranks": 2, "engine_ranks": 1,
        "repeats": args.sharded_repeats, "torch_threads": 1,
        "raw_nixl": {"read_s": round(m("raw", "read_s"), 4), "gb_s": gbs(m("raw", "read_s")),
                     "what": "one NIXL READ of one registered buffer of the same bytes, trainer rank 0 -> engine"},
        "nixl": {**nixl, "read_gb_s": gbs(m("nixl", "read_s")), "e2e_gb_s": gbs(m("nixl", "e2e_s")),
                 "descriptors": res["descriptors"], "transfers": res["transfers"],
                 "what": "NixlSender.publish on both trainer ranks (their shards into the registered buffers), "
                         "then NixlReceiver.sync: headers, the batched READs from both ranks, headers again "
                         "(read_s), the engine's copy (apply_s)"},
        "broadcast": {"e2e_s": round(m("broadcast", "e2e_s"), 4), "gb_s": gbs(m("broadcast", "e2e_s")),
                      "bucket_mib": 64,
                      "what": "BroadcastSender.publish on trainer rank 0 (the full weights) + BroadcastReceiver.sync "
                              "over gloo, engine copy included"},
        # per round: raw seconds / nixl seconds = nixl's bandwidth / raw bandwidth
        "ratio_nixl_read_vs_raw": round(med([r["read_s"] / n["read_s"] for n, r in zip(t["nixl"], t["raw"])]), 3),
        "ratio_broadcast_vs_nixl_e2e": round(med([b["e2e_s"] / n["e2e_s"] for n, b in zip(t["nixl"], t["broadcast"])]),
                                             2),
        "received_equal": res["checks"],
        "seconds_all": t,
    }
    out["checks"] = {"nixl_read_ge_70pct_of_raw": out["ratio_nixl_read_vs_raw"] >= 0.7}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="the model's bf16 size (at least this)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.03, 0.1],
                    help="fraction of elements changed per step")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds per fraction, after one warm-up")
    ap.add_argument("--targets", nargs="*", default=["file", "s3"], choices=["file", "s3"],
                    help="where the delta section runs (none: only the sharded section)")
    ap.add_argument("--level", type=int, default=1, help="zstd level of the delta sender")
    ap.add_argument("--threads", type=int, default=2, help="zstd threads of the delta sender")
    ap.add_argument("--links", type=float, nargs="+", default=[1, 10, 100], help="link speeds, Gbit/s")
    ap.add_argument("--s3-full-rounds", type=int, default=2,
                    help="rounds with the full path on S3 (0: every round; ~35 s each at 1 GiB on moto)")
    ap.add_argument("--compare-rev", default=None, help="also run the delta transport of this git commit")
    ap.add_argument("--tmp-dir", default=None, help="where the file target and temp files go")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharded-gib", type=float, default=0.5,
                    help="model size of the sharded section (nixl vs broadcast vs raw NIXL); 0: skip it")
    ap.add_argument("--sharded-repeats", type=int, default=5, help="measured rounds of the sharded section")
    ap.add_argument("--real-steps", type=int, default=20,
                    help="steps of the real RL run (the real-shaped qwen3 checkpoint, delta per step); 0: skip it")
    ap.add_argument("--real-lr", type=float, default=1e-6, help="learning rate of the real RL run")
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 MiB, one round per fraction")
    ap.add_argument("--sharded-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--sharded-store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size_gib, args.repeats = 1 / 128, 1
        args.sharded_gib, args.sharded_repeats = min(args.sharded_gib, 1 / 128), 1
        args.real_steps = min(args.real_steps, 2)
    if args.sharded_rank is not None:
        sharded_worker(args.sharded_rank, args.sharded_store, args)
        return
    torch.set_num_threads(args.torch_threads)
    tmp = tempfile.mkdtemp(prefix="weight_sync_", dir=args.tmp_dir)
    try:
        mods = {"delta": delta}
        if args.compare_rev:
            mods[f"delta@{args.compare_rev}"] = load_delta_rev(args.compare_rev, tmp)
        shapes = model_shapes(args.size_gib)
        if args.targets:
            log(f"building {len(shapes)} tensors")
        weights = build_weights(shapes if args.targets else [], args.seed)
        full_bytes = sum(t.numel() * 2 for t in weights.values())
        engine = Engine(shapes if args.targets else [])
        rng = np.random.default_rng(args.seed)
        meter = CpuMeter()
        out: dict[str, Any] = {
            "config": {
                "size_gib": round(full_bytes / 2**30, 3), "full_bytes": full_bytes, "tensors": len(shapes),
                "parameters": full_bytes // 2, "fractions": args.fractions, "repeats": args.repeats,
                "zstd_level": args.level, "zstd_threads": args.threads, "links_gbit_s": args.links,
                "ulp_steps": {"+-1": 0.75, "+-2": 0.203, "+-3..8": 0.047},
                "compare_rev": args.compare_rev, "python": platform.python_version(), "torch": torch.__version__,
                "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(),
            },
            "targets": {},
        }
        for target in args.targets:
            if target == "file":
                out["targets"]["file"] = run_target("file", f"file://{tmp}/store", None, weights, engine, full_bytes,
                                                    args, mods, meter, rng, None)
            else:
                try:
                    import moto.server  # noqa: F401 - moto_server
                    import s3fs
                except ImportError as exc:
                    out["targets"]["s3"] = {"skipped": f"needs moto[server] and s3fs ({exc})"}
                    continue
                with local_s3_server() as (url, pid):
                    meter.child = pid
                    options = client_options(url)  # moto takes ~17 s to complete a 1 GiB multipart upload
                    fs = s3fs.S3FileSystem(**options)
                    fs.mkdir("bench")
                    out["targets"]["s3"] = run_target("s3", "s3://bench/run", options, weights, engine, full_bytes,
                                                      args, mods, meter, rng, args.s3_full_rounds or None)
                    out["targets"]["s3"]["server"] = "moto_server on 127.0.0.1 (s3fs)"
                    meter.child = None
        if args.real_steps > 0:
            log(f"real run: {args.real_steps} RL steps of the real-shaped qwen3 checkpoint, lr {args.real_lr:g}")
            out["real_run"] = run_real(args, tmp)
            rr = out["real_run"]
            log(f"real run: bytes {100 * rr['bytes_ratio']['median']:.3f}% of bf16, words changed "
                f"{100 * rr['changed_fraction']['median']:.3f}% (medians over steps), {rr['job_wall_s']} s")
        if args.sharded_gib > 0:
            log(f"sharded: nixl vs broadcast vs raw NIXL, {args.sharded_gib:g} GiB, 3 processes")
            out["sharded"] = run_sharded(args, tmp)
        out["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
        out["wall_s"] = round(time.perf_counter() - T0, 1)
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
