"""SFT data path: a 1B-token pretokenized corpus (``skyrl_datasets.corpus``) vs Hugging Face ``datasets`` (Arrow).

    python benchmarks/sft_data.py [--tokens 1e9] [--small-tokens 1e7] [--sample-tokens 2e8]
        [--hf-tokens 5e7] [--budget 16384] [--opens 5] [--cold-tokens 2e7] [--tmp-dir /tmp]
        [--keep] [--seed 0] [--quick]

The corpus. ``--tokens`` synthetic token ids (uniform in a 50,257-id vocabulary, so
``uint16``) in documents whose lengths are log-normal (median ~600, mean ~1,000, clipped to
[8, 32,768]), with a loss mask (the first 10-40% of each document, its "prompt", is 0), written
by ``CorpusWriter`` under ``--tmp-dir`` (1B tokens: 2 GB of tokens + 1 GB of mask + the index;
removed at the end unless ``--keep``). A second, ``--small-tokens`` corpus is written the same
way to show that opening does not depend on the size.

Measured, each in a fresh Python process (so its RSS is its own), after one unmeasured run:

- ``open_s``: ``open_corpus(prefix)`` alone (the imports excluded), median of ``--opens``
  processes, for the small and the large corpus.
- the **data path**: documents drawn uniformly at random (with replacement, seeded), packed
  greedily into micro-batches of ``--budget`` tokens (no padding: each document's tokens, loss
  mask and position ids 0..n-1 copied into preallocated int32/uint8 buffers, with
  ``cu_seqlens`` of the document boundaries; a document longer than the budget is cut), until
  ``--sample-tokens`` tokens are packed. ``tokens_per_s`` = packed tokens / seconds (the loop
  only: no model). Three ways to read a document: ``views`` (``tokens(i)`` / ``mask(i)``,
  zero-copy views, with the default ``max_resident_bytes``: the mappings are released past
  128 MiB of file-backed RSS), ``views_no_release`` (``max_resident_bytes=None``) and
  ``read_into`` (``pread`` into the micro-batch's staging buffers, widened to int32 once per
  micro-batch). Both the warm case (the files in the page cache, as after the first epoch,
  or on a machine whose RAM holds the corpus) and the cold case (``posix_fadvise(DONTNEED)``
  drops the corpus's pages from the page cache first, so every document is read from the disk;
  ``--cold-tokens`` tokens) are reported.
- ``rss``: the process's peak RSS (``VmHWM``) and, at the end, ``RssAnon`` (memory the
  process allocated: the interpreter, numpy, the buffers) and ``RssFile`` (pages of the
  memory-mapped corpus that the process touched: page cache shared with every reader,
  reclaimed by the kernel under pressure, never allocated by the process), from
  ``/proc/self/status``.
- the **baseline**: the same sampling and packing through Hugging Face ``datasets``: the first
  ``--hf-tokens`` tokens' documents of the same corpus, as an Arrow dataset (``input_ids``:
  ``list<uint16>``, ``loss_mask``: ``list<uint8>``; built zero-copy from our arrays with
  pyarrow and saved with ``save_to_disk``), loaded with ``load_from_disk`` (memory-mapped) and
  read with ``ds.with_format("numpy")[i]`` (each row's columns as numpy arrays). Converting all 1B tokens to Arrow is not needed to
  compare per-document reads, so the baseline uses a subset; our reader runs on **the same
  subset, the same document order** in the same run (``ratio_vs_hf``), and the packed tokens'
  checksums must agree (every path reads the same data).

JSON keys: ``config``, ``build``, ``open``, ``data_path`` (``full`` / ``subset`` / ``cold``, each
by reading mode), ``hf``, ``ratio_vs_hf`` (by mode), ``expectations`` (each claim with its
measured value and whether it held). Needs ``pip install -e "./plugins/datasets[benchmark]"``
(Hugging Face ``datasets``) and Linux (``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.perf_counter()
VOCAB = 50_257
BATCH_DOCS = 1 << 13  # documents per write batch (~8M tokens: the int64 temporaries stay ~64 MB each)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# -- building ---------------------------------------------------------------------------


def build_corpus(prefix: str, n_tokens: int, seed: int) -> dict[str, Any]:
    """Write >= n_tokens synthetic tokens; returns counts, bytes and seconds."""
    from skyrl_datasets.corpus import CorpusWriter

    rng = np.random.default_rng(seed)
    t = time.perf_counter()
    written = 0
    with CorpusWriter(prefix, vocab_size=VOCAB, eos_id=VOCAB - 1, tokenizer="synthetic", with_mask=True) as w:
        while written < n_tokens:
            lens = np.clip(rng.lognormal(np.log(600), 0.9, BATCH_DOCS), 8, 32_768).astype(np.int64)
            ends = np.cumsum(lens)
            k = min(int(np.searchsorted(ends, n_tokens - written)) + 1, lens.shape[0])  # enough to reach n_tokens
            lens = lens[:k]
            total = int(lens.sum())
            ids = rng.integers(0, VOCAB, total, dtype=np.uint16)
            # mask: 0 on each document's first 10-40% ("prompt"), 1 after
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            pos = np.arange(total, dtype=np.int64) - starts
            prompt = np.repeat((lens * rng.uniform(0.1, 0.4, k)).astype(np.int64), lens)
            w.add_batch(ids, lens, (pos >= prompt).view(np.uint8))
            written += total
    seconds = time.perf_counter() - t
    size = sum(os.path.getsize(prefix + s) for s in (".json", ".tokens", ".index", ".mask"))
    return {"tokens": written, "documents": w.n_docs, "bytes": size, "write_s": round(seconds, 2)}


def build_hf_subset(prefix: str, n_tokens: int, out_dir: str) -> dict[str, Any]:
    """The first documents of the corpus holding >= n_tokens tokens, as a `datasets` Arrow dataset."""
    import datasets
    import pyarrow as pa

    from skyrl_datasets.corpus import open_corpus

    t = time.perf_counter()
    c = open_corpus(prefix)
    lengths = np.asarray(c.lengths, dtype=np.int64)
    n_docs = int(np.searchsorted(np.cumsum(lengths), n_tokens)) + 1
    n_docs = min(n_docs, c.n_docs)
    end = int(lengths[:n_docs].sum())
    offsets = np.zeros(n_docs + 1, np.int32)
    np.cumsum(lengths[:n_docs], out=offsets[1:])
    # the same bytes, in order, mapped through the documented layout of the files
    tokens = np.memmap(prefix + ".tokens", dtype=c.dtype, mode="r", shape=(end,))
    mask = np.memmap(prefix + ".mask", dtype=np.uint8, mode="r", shape=(end,))
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
        }
    )
    datasets.Dataset(table).save_to_disk(out_dir)
    return {"documents": n_docs, "tokens": end, "build_s": round(time.perf_counter() - t, 2), "datasets": datasets.__version__}


# -- measuring (in fresh processes) ----------------------------------------------------------


def rss() -> dict[str, float]:
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                status[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return {
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork + exec
        "peak_rss_mib": round(status.get("VmHWM", 0), 1),
        "rss_mib": round(status.get("VmRSS", 0), 1),
        "rss_anon_mib": round(status.get("RssAnon", 0), 1),
        "rss_file_mib": round(status.get("RssFile", 0), 1),
    }


def pack(get, order: np.ndarray, budget: int, target: int) -> dict[str, Any]:
    """Greedy packing of documents ``order`` into micro-batches of ``budget`` tokens."""
    tok_buf = np.empty(budget, np.int32)
    mask_buf = np.empty(budget, np.uint8)
    pos_buf = np.empty(budget, np.int32)
    arange = np.arange(budget, dtype=np.int32)
    cu = np.zeros(budget + 1, np.int64)
    fill = n_in = total = batches = 0
    checksum = 0
    t = time.perf_counter()
    for i in order:
        ids, mask = get(int(i))
        n = ids.shape[0]
        if n > budget:
            ids, mask, n = ids[:budget], mask[:budget], budget
        if fill + n > budget:  # the micro-batch is full: hand it over (here: checksum it)
            checksum += int(tok_buf[:fill].sum(dtype=np.int64)) + int(mask_buf[:fill].sum(dtype=np.int64))
            batches += 1
            fill = n_in = 0
        tok_buf[fill : fill + n] = ids
        mask_buf[fill : fill + n] = mask
        pos_buf[fill : fill + n] = arange[:n]
        fill += n
        n_in += 1
        cu[n_in] = fill
        total += n
        if total >= target:
            break
    checksum += int(tok_buf[:fill].sum(dtype=np.int64)) + int(mask_buf[:fill].sum(dtype=np.int64))
    seconds = time.perf_counter() - t
    return {
        "tokens": total,
        "micro_batches": batches + 1,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(total / seconds),
        "checksum": checksum,
    }


def pack_read_into(c: Any, order: np.ndarray, budget: int, target: int) -> dict[str, Any]:
    """``pack`` through ``Corpus.read_into``: each document pread straight into the micro-batch's
    staging buffers (corpus dtype), widened to int32 once per micro-batch."""
    lengths = c.lengths
    stage = np.empty(budget, c.dtype)
    tok_buf = np.empty(budget, np.int32)
    mask_buf = np.empty(budget, np.uint8)
    pos_buf = np.empty(budget, np.int32)
    arange = np.arange(budget, dtype=np.int32)
    cu = np.zeros(budget + 1, np.int64)
    long_tok = np.empty(int(np.max(lengths)), c.dtype)
    long_mask = np.empty(long_tok.shape[0], np.uint8)
    fill = n_in = total = batches = 0
    checksum = 0

    def flush() -> int:
        tok_buf[:fill] = stage[:fill]
        return int(tok_buf[:fill].sum(dtype=np.int64)) + int(mask_buf[:fill].sum(dtype=np.int64))

    t = time.perf_counter()
    for i in order:
        i = int(i)
        n = int(lengths[i])
        if fill + min(n, budget) > budget:
            checksum += flush()
            batches += 1
            fill = n_in = 0
        if n > budget:  # cut: read whole, keep the budget's worth
            c.read_into(i, long_tok, long_mask)
            stage[:budget], mask_buf[:budget], n = long_tok[:budget], long_mask[:budget], budget
        else:
            c.read_into(i, stage[fill : fill + n], mask_buf[fill : fill + n])
        pos_buf[fill : fill + n] = arange[:n]
        fill += n
        n_in += 1
        cu[n_in] = fill
        total += n
        if total >= target:
            break
    checksum += flush()
    seconds = time.perf_counter() - t
    return {"tokens": total, "micro_batches": batches + 1, "seconds": round(seconds, 3), "tokens_per_s": round(total / seconds), "checksum": checksum}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    kind = spec["kind"]
    if kind == "open":
        from skyrl_datasets.corpus import open_corpus

        t = time.perf_counter()
        c = open_corpus(spec["prefix"])
        seconds = time.perf_counter() - t
        return {"open_s": seconds, "n_tokens": c.n_tokens}
    rng = np.random.default_rng(spec["seed"])
    if kind == "ours":
        from skyrl_datasets.corpus import DEFAULT_RESIDENT_BYTES, open_corpus

        if spec.get("cold"):
            for s in (".tokens", ".mask"):
                fd = os.open(spec["prefix"] + s, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        mode = spec.get("mode", "views")
        c = open_corpus(spec["prefix"], max_resident_bytes=None if mode == "views_no_release" else DEFAULT_RESIDENT_BYTES)
        n_docs = spec.get("n_docs") or c.n_docs
        order = rng.integers(0, n_docs, spec["max_docs"])
        if mode == "read_into":
            result = pack_read_into(c, order, spec["budget"], spec["target"])
        else:
            result = pack(lambda i: (c.tokens(i), c.mask(i)), order, spec["budget"], spec["target"])
    elif kind == "hf":
        import datasets

        ds = datasets.load_from_disk(spec["path"]).with_format("numpy")
        order = rng.integers(0, len(ds), spec["max_docs"])

        def get(i: int) -> tuple[np.ndarray, np.ndarray]:
            row = ds[i]
            return row["input_ids"], row["loss_mask"]

        result = pack(get, order, spec["budget"], spec["target"])
    else:
        raise ValueError(kind)
    result.update(rss())
    return result


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(xs: list[float]) -> float:
    return float(np.median(xs))


def data_path(spec: dict[str, Any], repeats: int = 1) -> dict[str, Any]:
    run_worker({**spec, "target": min(spec["target"], 2_000_000)})  # warm-up: imports, page cache for the header
    runs = [run_worker(spec) for _ in range(repeats)]
    best = max(runs, key=lambda r: r["tokens_per_s"])
    best["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=1e9, help="tokens of the large corpus")
    ap.add_argument("--small-tokens", type=float, default=1e7, help="tokens of the small corpus (open time)")
    ap.add_argument("--sample-tokens", type=float, default=2e8, help="tokens packed per data-path run")
    ap.add_argument("--hf-tokens", type=float, default=5e7, help="tokens of the Hugging Face datasets subset")
    ap.add_argument("--cold-tokens", type=float, default=2e7, help="tokens packed with the page cache dropped")
    ap.add_argument("--budget", type=int, default=16_384, help="tokens per micro-batch")
    ap.add_argument("--opens", type=int, default=5, help="processes timing open_corpus, per corpus")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each warm data-path measurement (best reported)")
    ap.add_argument("--tmp-dir", default="/tmp", help="where the corpora are written (needs ~3.1 GB per 1B tokens)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora (printed paths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke test: 2e7 tokens, small samples")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.quick:
        args.tokens, args.small_tokens, args.sample_tokens, args.hf_tokens, args.cold_tokens = 2e7, 1e6, 5e6, 2e6, 1e6
        args.opens, args.repeats = 3, 1
    try:
        import datasets  # noqa: F401 - the baseline, checked before writing gigabytes
    except ImportError:
        sys.exit('the baseline needs Hugging Face datasets: .venv/bin/pip install -e "./plugins/datasets[benchmark]"')
    need = int(args.tokens * 3.1 + args.small_tokens * 3.1 + args.hf_tokens * 3.2)
    free = shutil.disk_usage(args.tmp_dir).free
    if free < need * 1.2:
        sys.exit(f"--tmp-dir {args.tmp_dir} has {free / 1e9:.1f} GB free; this run needs ~{need / 1e9:.1f} GB")
    tmp = tempfile.mkdtemp(prefix="sft_data_", dir=args.tmp_dir)
    try:
        large, small, hf_dir = f"{tmp}/large", f"{tmp}/small", f"{tmp}/hf"
        log(f"writing {args.tokens:.3g} tokens to {large}")
        build = {"large": build_corpus(large, int(args.tokens), args.seed)}
        log(f"wrote {build['large']}")
        build["small"] = build_corpus(small, int(args.small_tokens), args.seed + 1)
        log(f"building the datasets subset ({args.hf_tokens:.3g} tokens)")
        build["hf_subset"] = build_hf_subset(large, int(args.hf_tokens), hf_dir)

        log("open times")
        opens = {}
        for name, prefix in (("small", small), ("large", large)):
            run_worker({"kind": "open", "prefix": prefix})  # warm-up
            times = [run_worker({"kind": "open", "prefix": prefix})["open_s"] for _ in range(args.opens)]
            opens[name] = {"tokens": build[name]["tokens"], "open_s_median": round(median(times), 5), "open_s_max": round(max(times), 5)}

        common = {"budget": args.budget, "seed": args.seed}
        n_full = int(args.sample_tokens)
        max_docs = lambda target: int(target / 300) + 1000  # noqa: E731 - more documents than the target needs
        modes = ("views", "views_no_release", "read_into")
        full, subset_ours, cold = {}, {}, {}
        for mode in modes:
            log(f"data path, full corpus, {mode}: {n_full:.3g} tokens")
            full[mode] = data_path({**common, "kind": "ours", "mode": mode, "prefix": large, "target": n_full, "max_docs": max_docs(n_full)}, args.repeats)
        hf_n = int(min(args.sample_tokens, build["hf_subset"]["tokens"] * 2))
        sub = {**common, "target": hf_n, "max_docs": max_docs(hf_n)}
        log(f"data path, subset: ours and datasets, {hf_n:.3g} tokens each")
        for mode in ("views", "read_into"):
            subset_ours[mode] = data_path({**sub, "kind": "ours", "mode": mode, "prefix": large, "n_docs": build["hf_subset"]["documents"]}, args.repeats)
        subset_hf = data_path({**sub, "kind": "hf", "path": hf_dir}, args.repeats)
        checksums = {r["checksum"] for r in (*subset_ours.values(), subset_hf)} | {r["checksum"] for r in full.values()} - {None}
        if len({r["checksum"] for r in (*subset_ours.values(), subset_hf)}) != 1 or len({r["checksum"] for r in full.values()}) != 1:
            raise SystemExit(f"checksums differ: the paths did not read the same data ({checksums})")
        cold_n = int(args.cold_tokens)
        for k, mode in enumerate(("views", "read_into")):
            log(f"data path, cold page cache, {mode}: {cold_n:.3g} tokens")
            cold[mode] = run_worker({**common, "kind": "ours", "mode": mode, "prefix": large, "target": cold_n, "max_docs": max_docs(cold_n), "cold": True, "seed": args.seed + 7 + k})

        ratio = {mode: round(subset_ours[mode]["tokens_per_s"] / subset_hf["tokens_per_s"], 2) for mode in subset_ours}
        expectations = {
            "open_s_below_0.1": {"value": opens["large"]["open_s_median"], "held": opens["large"]["open_s_max"] < 0.1},
            "open_time_size_independent": {
                "value": round(opens["large"]["open_s_median"] / max(opens["small"]["open_s_median"], 1e-9), 2),
                "note": f"large/small open time at {opens['large']['tokens'] / opens['small']['tokens']:.0f}x the tokens",
                "held": opens["large"]["open_s_median"] < 3 * opens["small"]["open_s_median"] + 0.005,
            },
            "peak_rss_below_300_mib": {mode: {"value": full[mode]["peak_rss_mib"], "held": full[mode]["peak_rss_mib"] < 300} for mode in modes},
            "tokens_per_s_at_least_50M": {mode: {"value": full[mode]["tokens_per_s"], "held": full[mode]["tokens_per_s"] >= 50e6} for mode in modes},
        }
        out = {
            "config": {
                "tokens": build["large"]["tokens"], "vocab": VOCAB, "dtype": "uint16", "budget": args.budget,
                "sample_tokens": n_full, "hf_tokens": build["hf_subset"]["tokens"], "cold_tokens": cold_n,
                "tmp_dir": args.tmp_dir, "python": platform.python_version(), "numpy": np.__version__,
                "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(), "quick": args.quick,
            },
            "build": build,
            "open": opens,
            "data_path": {"full": full, "subset": subset_ours, "cold": cold},
            "hf": subset_hf,
            "ratio_vs_hf": ratio,
            "expectations": expectations,
            "wall_s": round(time.perf_counter() - T0, 1),
        }
        if args.keep:
            out["kept"] = {"large": large, "small": small, "hf": hf_dir}
        print(json.dumps(out, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
