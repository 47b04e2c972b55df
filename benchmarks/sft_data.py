"""SFT data path: the sft job's own sampling + packing on a 1B-token corpus, vs Hugging Face ``datasets``.

    python benchmarks/sft_data.py [--tokens 1e9] [--small-tokens 1e7] [--sample-tokens 2e8]
        [--hf-tokens 5e7] [--hf-sample-tokens 3e7] [--tokens-per-step 16384] [--max-seq-len 4096]
        [--strategy shuffled] [--repeats 5] [--opens 5] [--cold-tokens 2e7] [--tmp-dir /tmp]
        [--keep] [--seed 0] [--quick]

The corpus. ``--tokens`` synthetic token ids (uniform in a 50,257-id vocabulary, so
``uint16``) in documents whose lengths are log-normal (median ~600, mean ~900, clipped to
[8, 32,768]), with a loss mask (the first 10-40% of each document, its "prompt", is 0), written
by ``CorpusWriter`` under ``--tmp-dir`` (1B tokens: 2 GB of tokens + 1 GB of mask + the index;
removed at the end unless ``--keep``). A second, ``--small-tokens`` corpus is written the same
way to show that opening does not depend on the size.

Measured, each in a fresh Python process (so its RSS is its own), after one unmeasured run of
each kind:

- ``open_s``: ``open_corpus(prefix)`` alone (the imports excluded), median of ``--opens``
  processes, for the small and the large corpus.
- ``job``: **the sft job's data path itself**: the corpus opened by the job's default
  ``[corpus]`` reader (``skyrl_datasets.pretokenized.PretokenizedReader``), the ``[data]``
  strategy's class (``--strategy``: ``shuffled``, a new permutation of all documents, or
  ``sequential``), and ``skyrl_host.jobs.sft.PackedSteps``, the object the driver calls once
  per step (``next_batch``: draw documents, cut them into pieces of at most ``--max-seq-len``
  tokens (split, overlapping by one token), take whole pieces while they fit
  ``--tokens-per-step``, pack them into the step's RolloutBatch through the corpus's
  ``read_pieces_into``), step after step until ``--sample-tokens`` tokens are packed.
  ``tokens_per_s`` = packed tokens / seconds spent in ``next_batch`` (no model; the checksum
  of each batch is computed off the clock).
- ``job_views``: the same ``PackedSteps`` with the corpus's ``CorpusPieces`` capability
  turned off (``fast = [False]``): every piece copied from the ``tokens(i)`` / ``mask(i)``
  views, the path every corpus took before ``read_pieces_into`` (and a third party's corpus
  without the capability still takes); the views' mappings are released past 128 MiB of
  file-backed RSS.
- ``read_into_ceiling``: the documents the job draws (drawn before the clock starts), each
  copied whole by ``Corpus.read_into`` into a staging buffer widened to int32 per
  ``--tokens-per-step`` tokens: no strategy, no pieces, no batch; what the corpus alone
  reaches.
- the **baselines**, Hugging Face ``datasets`` on a subset: the first ``--hf-tokens`` tokens'
  documents of the corpus, written both as an Arrow dataset (``input_ids``: ``list<uint16>``,
  ``loss_mask``: ``list<uint8>``, built zero-copy with pyarrow, ``save_to_disk``, loaded with
  ``load_from_disk``, memory-mapped) and as one of our corpora (the same bytes). ``job`` runs on
  our copy; the baselines pack **the same pieces** (drawn by the same ``PackedSteps`` before the
  clock starts: the baselines are not charged for sampling) into the same int32/uint8
  buffers: ``hf_rows`` reads each row with ``ds.with_format("numpy")[i]``; ``hf_batched``
  reads each step's documents with one ``ds.with_format("arrow")[indices]`` call (a C++ take)
  and copies the pieces out of the flattened columns. The checksums of the packed tokens and
  masks must agree between ``job``, ``job_views`` and both baselines.
- ``cold``: ``job`` and ``job_views`` once each with the corpus's pages dropped from the page
  cache first (``posix_fadvise(DONTNEED)``), ``--cold-tokens`` tokens: every read from the disk.
- ``rss``: each process's peak RSS (``VmHWM``) and, at the end, ``RssAnon`` (memory the process
  allocated) and ``RssFile`` (pages of memory-mapped files it touched: page cache shared with
  every reader, reclaimable), from ``/proc/self/status``.

The compared runs alternate (``job``, ``job_views``, ``read_into_ceiling``, ``job``, ... on the
full corpus; ``job``, ``hf_rows``, ``hf_batched``, ``job``, ... on the subset), ``--repeats``
rounds; each round gives a ratio and the JSON quotes the median of the ratios with their range,
and the median tokens/s. JSON keys: ``config``, ``build``, ``open``, ``full``, ``subset``,
``cold``, ``ratios``, ``expectations`` (each claim with its measured value and whether it held).
Needs ``pip install -e "./plugins/datasets[benchmark]"`` (Hugging Face ``datasets``) and Linux
(``/proc/self/status``).
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


def build_subset(prefix: str, n_tokens: int, ours: str, hf_dir: str) -> dict[str, Any]:
    """The first documents of the corpus holding >= n_tokens tokens, as one of our corpora at
    ``ours`` and as a `datasets` Arrow dataset at ``hf_dir`` (the same bytes)."""
    import datasets
    import pyarrow as pa

    from skyrl_datasets.corpus import CorpusWriter, open_corpus

    t = time.perf_counter()
    c = open_corpus(prefix)
    lengths = np.asarray(c.lengths, dtype=np.int64)
    n_docs = min(int(np.searchsorted(np.cumsum(lengths), n_tokens)) + 1, c.n_docs)
    end = int(lengths[:n_docs].sum())
    offsets = np.zeros(n_docs + 1, np.int32)
    np.cumsum(lengths[:n_docs], out=offsets[1:])
    # the same bytes, in order, mapped through the documented layout of the files
    tokens = np.memmap(prefix + ".tokens", dtype=c.dtype, mode="r", shape=(end,))
    mask = np.memmap(prefix + ".mask", dtype=np.uint8, mode="r", shape=(end,))
    with CorpusWriter(ours, vocab_size=VOCAB, eos_id=VOCAB - 1, tokenizer="synthetic", with_mask=True) as w:
        w.add_batch(tokens, lengths[:n_docs], mask)
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
        }
    )
    datasets.Dataset(table).save_to_disk(hf_dir)
    c.close()
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


def job_data(spec: dict[str, Any]) -> Any:
    """The sft job's data path, built as the driver builds it (SFTDriver.build): the default
    corpus reader's corpus, the strategy's class bound to its lengths and the seed, PackedSteps."""
    from skyrl_datasets.pretokenized import PretokenizedReader
    from skyrl_datasets.sequential import Sequential
    from skyrl_datasets.shuffled import Shuffled
    from skyrl_host.jobs.sft import PackedSteps

    corpus = PretokenizedReader().open(spec["prefix"])
    strategy = {"shuffled": Shuffled, "sequential": Sequential}[spec["strategy"]]()
    strategy.bind([corpus.lengths], spec["seed"])
    return PackedSteps([corpus], strategy, tokens_per_step=spec["tokens_per_step"], max_seq_len=spec["max_seq_len"],
                       long_documents="split")


def checksum(tokens: np.ndarray, mask: np.ndarray) -> int:
    return int(tokens.sum(dtype=np.int64)) * 3 + int(mask.sum(dtype=np.int64))


def run_job(data: Any, target: int) -> dict[str, Any]:
    """PackedSteps.next_batch, step after step, until ``target`` tokens are packed."""
    total = steps = pieces = check = 0
    seconds = 0.0
    clock = time.perf_counter
    while total < target:
        steps += 1
        t = clock()
        taken, batch = data.next_batch(steps)
        seconds += clock() - t  # the checksum below is off the clock
        total += batch.n_tokens
        pieces += len(taken)
        check += checksum(batch.tokens, batch.loss_mask)
    return {"tokens": total, "steps": steps, "pieces": pieces, "seconds": round(seconds, 3),
            "tokens_per_s": round(total / seconds), "checksum": check}


def predraw(data: Any, target: int) -> list[list[list[int]]]:
    """The pieces of the steps ``run_job`` would pack (drawn here, off the clock)."""
    steps: list[list[list[int]]] = []
    total = 0
    while total < target:
        taken = data.take_pieces(len(steps) + 1)
        steps.append(taken)
        total += sum(b - a for _, _, a, b in taken)
    return steps


def run_read_into(corpus: Any, steps: list[list[list[int]]], budget: int) -> dict[str, Any]:
    """The ceiling: each drawn document copied whole by Corpus.read_into, widened per ``budget`` tokens."""
    docs: list[int] = []
    for taken in steps:
        for _, i, a, _ in taken:
            if a == 0:  # a document's first piece: the document (each drawn once)
                docs.append(i)
    lengths = np.asarray(corpus.lengths)
    longest = int(lengths[docs].max())
    stage = np.empty(budget + longest, corpus.dtype)
    mask = np.empty(budget + longest, np.uint8)
    fill = total = 0
    t = time.perf_counter()
    for i in docs:
        fill += corpus.read_into(i, stage[fill:], mask[fill:])
        if fill >= budget:
            stage[:fill].astype(np.int32)
            total += fill
            fill = 0
    stage[:fill].astype(np.int32)
    total += fill
    seconds = time.perf_counter() - t
    return {"tokens": total, "documents": len(docs), "seconds": round(seconds, 3), "tokens_per_s": round(total / seconds)}


def run_hf(ds: Any, steps: list[list[list[int]]], batched: bool) -> dict[str, Any]:
    """The same pieces through Hugging Face datasets, packed into the same buffers."""
    total = check = 0
    seconds = 0.0
    clock = time.perf_counter
    for taken in steps:
        t = clock()
        lens = [b - a for _, _, a, b in taken]
        n = sum(lens)
        tokens = np.empty(n, np.int32)
        mask = np.empty(n, np.uint8)
        cu = np.zeros(len(taken) + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        if batched:  # one take per step
            table = ds[[i for _, i, _, _ in taken]]
            ids, lm = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
            flat_ids, flat_mask = ids.flatten().to_numpy(), lm.flatten().to_numpy()
            offs = ids.offsets.to_numpy()
            offs = offs - offs[0]
            if all(a == 0 and b - a == offs[k + 1] - offs[k] for k, (_, _, a, b) in enumerate(taken)):
                tokens[:] = flat_ids  # whole documents only: the columns are the step
                mask[:] = flat_mask
            else:
                for k, (_, _, a, b) in enumerate(taken):
                    o = int(offs[k])
                    tokens[cu[k] : cu[k + 1]] = flat_ids[o + a : o + b]
                    mask[cu[k] : cu[k + 1]] = flat_mask[o + a : o + b]
        else:
            last, row = -1, None
            for k, (_, i, a, b) in enumerate(taken):
                if i != last:  # the pieces of a split document: one row
                    row, last = ds[i], i
                tokens[cu[k] : cu[k + 1]] = row["input_ids"][a:b]
                mask[cu[k] : cu[k + 1]] = row["loss_mask"][a:b]
        seconds += clock() - t  # the checksum below is off the clock
        total += n
        check += checksum(tokens, mask)
    return {"tokens": total, "steps": len(steps), "seconds": round(seconds, 3), "tokens_per_s": round(total / seconds),
            "checksum": check}


def drop_page_cache(prefix: str) -> None:
    for s in (".tokens", ".mask"):
        fd = os.open(prefix + s, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    kind = spec["kind"]
    if kind == "open":
        from skyrl_datasets.corpus import open_corpus

        t = time.perf_counter()
        c = open_corpus(spec["prefix"])
        seconds = time.perf_counter() - t
        return {"open_s": seconds, "n_tokens": c.n_tokens}
    if spec.get("cold"):
        drop_page_cache(spec["prefix"])
    data = job_data(spec)
    if kind in ("job", "job_views"):
        if kind == "job_views":
            data.fast = [False]  # pack from the views, piece by piece
        result = run_job(data, spec["target"])
    elif kind == "read_into_ceiling":
        result = run_read_into(data.corpora[0], predraw(data, spec["target"]), spec["tokens_per_step"])
    elif kind in ("hf_rows", "hf_batched"):
        import datasets

        steps = predraw(data, spec["target"])
        ds = datasets.load_from_disk(spec["hf"]).with_format("arrow" if kind == "hf_batched" else "numpy")
        result = run_hf(ds, steps, batched=kind == "hf_batched")
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


def alternate(specs: dict[str, dict[str, Any]], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Each kind once unmeasured (imports, page cache), then ``repeats`` rounds of A B C ..."""
    for name, spec in specs.items():
        log(f"  warm-up: {name}")
        run_worker({**spec, "target": min(spec["target"], 2_000_000)})
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in specs}
    for r in range(repeats):
        for name, spec in specs.items():
            runs[name].append(run_worker(spec))
            log(f"  round {r + 1}: {name} {runs[name][-1]['tokens_per_s'] / 1e6:.1f}M tokens/s, "
                f"peak RSS {runs[name][-1]['peak_rss_mib']:.0f} MiB")
    return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["tokens_per_s"] for r in runs]
    keep = ("tokens", "steps", "pieces", "documents", "checksum")
    out = {k: runs[0][k] for k in keep if k in runs[0]}
    out.update({
        "tokens_per_s_median": round(median(rates)),
        "tokens_per_s_runs": rates,
        "peak_rss_mib_max": max(r["peak_rss_mib"] for r in runs),
        "rss_anon_mib": runs[-1]["rss_anon_mib"],
        "rss_file_mib": runs[-1]["rss_file_mib"],
    })
    return out


def ratio(runs: dict[str, list[dict[str, Any]]], a: str, b: str) -> dict[str, Any]:
    """Median (and range) of the per-round ratios a / b of tokens/s."""
    per_round = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b])]
    return {"median": round(median(per_round), 2), "min": round(min(per_round), 2), "max": round(max(per_round), 2),
            "rounds": [round(x, 2) for x in per_round]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=1e9, help="tokens of the large corpus")
    ap.add_argument("--small-tokens", type=float, default=1e7, help="tokens of the small corpus (open time)")
    ap.add_argument("--sample-tokens", type=float, default=2e8, help="tokens packed per run on the large corpus")
    ap.add_argument("--hf-tokens", type=float, default=5e7, help="tokens of the subset (Hugging Face datasets and ours)")
    ap.add_argument("--hf-sample-tokens", type=float, default=3e7, help="tokens packed per run on the subset")
    ap.add_argument("--cold-tokens", type=float, default=2e7, help="tokens packed with the page cache dropped")
    ap.add_argument("--tokens-per-step", type=int, default=16_384, help="the job's tokens_per_step")
    ap.add_argument("--max-seq-len", type=int, default=4096, help="the job's max_seq_len (longer documents are split)")
    ap.add_argument("--strategy", choices=("shuffled", "sequential"), default="shuffled", help="the job's [data] strategy")
    ap.add_argument("--opens", type=int, default=5, help="processes timing open_corpus, per corpus")
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds of the compared runs")
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
        args.tokens, args.small_tokens, args.sample_tokens, args.hf_tokens, args.hf_sample_tokens = 2e7, 1e6, 5e6, 2e6, 2e6
        args.cold_tokens, args.opens, args.repeats = 1e6, 3, 2
    if args.tokens_per_step < args.max_seq_len:
        print(f"error: --tokens-per-step ({args.tokens_per_step}) must be at least --max-seq-len ({args.max_seq_len})",
              file=sys.stderr)
        sys.exit(2)
    try:
        import datasets  # noqa: F401 - the baseline, checked before writing gigabytes
    except ImportError:
        print('error: the baseline needs Hugging Face datasets: .venv/bin/pip install -e "./plugins/datasets[benchmark]"',
              file=sys.stderr)
        sys.exit(2)
    need = int(args.tokens * 3.1 + args.small_tokens * 3.1 + args.hf_tokens * 6.3)
    free = shutil.disk_usage(args.tmp_dir).free
    if free < need * 1.2:
        print(f"error: --tmp-dir {args.tmp_dir} has {free / 1e9:.1f} GB free; this run needs ~{need / 1e9:.1f} GB",
              file=sys.stderr)
        sys.exit(2)
    tmp = tempfile.mkdtemp(prefix="sft_data_", dir=args.tmp_dir)
    try:
        large, small, sub, hf_dir = f"{tmp}/large", f"{tmp}/small", f"{tmp}/subset", f"{tmp}/hf"
        log(f"writing {args.tokens:.3g} tokens to {large}")
        build = {"large": build_corpus(large, int(args.tokens), args.seed)}
        log(f"wrote {build['large']}")
        build["small"] = build_corpus(small, int(args.small_tokens), args.seed + 1)
        log(f"building the subset ({args.hf_tokens:.3g} tokens), ours and datasets'")
        build["subset"] = build_subset(large, int(args.hf_tokens), sub, hf_dir)

        log("open times")
        opens = {}
        for name, prefix in (("small", small), ("large", large)):
            run_worker({"kind": "open", "prefix": prefix})  # warm-up
            times = [run_worker({"kind": "open", "prefix": prefix})["open_s"] for _ in range(args.opens)]
            opens[name] = {"tokens": build[name]["tokens"], "open_s_median": round(median(times), 5), "open_s_max": round(max(times), 5)}

        common = {"seed": args.seed, "strategy": args.strategy, "tokens_per_step": args.tokens_per_step,
                  "max_seq_len": args.max_seq_len}
        n_full, n_sub = int(args.sample_tokens), int(args.hf_sample_tokens)
        log(f"full corpus, {args.strategy}: job / job_views / read_into_ceiling, {n_full:.3g} tokens each")
        full_runs = alternate({kind: {**common, "kind": kind, "prefix": large, "target": n_full}
                               for kind in ("job", "job_views", "read_into_ceiling")}, args.repeats)
        log(f"subset: job / hf_rows / hf_batched, {n_sub:.3g} tokens each")
        sub_runs = alternate({kind: {**common, "kind": kind, "prefix": sub, "hf": hf_dir, "target": n_sub}
                              for kind in ("job", "hf_rows", "hf_batched")}, args.repeats)
        sums = {("full", k): {r["checksum"] for r in v} for k, v in full_runs.items() if k != "read_into_ceiling"}
        sums.update({("subset", k): {r["checksum"] for r in v} for k, v in sub_runs.items()})
        if len({c for (where, _), s in sums.items() if where == "full" for c in s}) != 1 or \
                len({c for (where, _), s in sums.items() if where == "subset" for c in s}) != 1:
            raise SystemExit(f"checksums differ: the paths did not pack the same data ({sums})")
        cold = {}
        for kind in ("job", "job_views"):
            log(f"cold page cache, {kind}: {args.cold_tokens:.3g} tokens")
            cold[kind] = run_worker({**common, "kind": kind, "prefix": large, "target": int(args.cold_tokens),
                                     "cold": True, "seed": args.seed + 7})

        full = {k: summary(v) for k, v in full_runs.items()}
        subset = {k: summary(v) for k, v in sub_runs.items()}
        ratios = {
            "job_vs_job_views": ratio(full_runs, "job", "job_views"),
            "job_vs_read_into_ceiling": ratio(full_runs, "job", "read_into_ceiling"),
            "job_vs_hf_rows": ratio(sub_runs, "job", "hf_rows"),
            "job_vs_hf_batched": ratio(sub_runs, "job", "hf_batched"),
        }
        expectations = {
            "open_s_below_0.1": {"value": opens["large"]["open_s_median"], "held": opens["large"]["open_s_max"] < 0.1},
            "open_time_size_independent": {
                "value": round(opens["large"]["open_s_median"] / max(opens["small"]["open_s_median"], 1e-9), 2),
                "note": f"large/small open time at {opens['large']['tokens'] / opens['small']['tokens']:.0f}x the tokens",
                "held": opens["large"]["open_s_median"] < 3 * opens["small"]["open_s_median"] + 0.005,
            },
            "job_tokens_per_s_at_least_50M": {"value": full["job"]["tokens_per_s_median"],
                                              "held": full["job"]["tokens_per_s_median"] >= 50e6},
            "job_peak_rss_below_300_mib": {"value": full["job"]["peak_rss_mib_max"], "held": full["job"]["peak_rss_mib_max"] < 300},
            "job_faster_than_its_views_path": {"value": ratios["job_vs_job_views"]["median"],
                                               "held": ratios["job_vs_job_views"]["median"] > 1},
            "job_faster_than_hf_batched": {"value": ratios["job_vs_hf_batched"]["median"],
                                           "held": ratios["job_vs_hf_batched"]["median"] > 1},
        }
        out = {
            "config": {
                "tokens": build["large"]["tokens"], "vocab": VOCAB, "dtype": "uint16", "strategy": args.strategy,
                "tokens_per_step": args.tokens_per_step, "max_seq_len": args.max_seq_len, "long_documents": "split",
                "sample_tokens": n_full, "subset_tokens": build["subset"]["tokens"], "subset_sample_tokens": n_sub,
                "cold_tokens": int(args.cold_tokens), "repeats": args.repeats, "tmp_dir": args.tmp_dir,
                "python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                "date": datetime.date.today().isoformat(), "quick": args.quick,
            },
            "build": build,
            "open": opens,
            "full": full,
            "subset": subset,
            "cold": cold,
            "ratios": ratios,
            "expectations": expectations,
            "wall_s": round(time.perf_counter() - T0, 1),
        }
        if args.keep:
            out["kept"] = {"large": large, "small": small, "subset": sub, "hf": hf_dir}
        print(json.dumps(out, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
