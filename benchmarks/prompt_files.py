"""Claim: the `files` dataset opens a large Parquet prompt file and serves its first
batches in a fraction of a second with memory independent of the file's size, where the
usual route (Hugging Face `datasets.load_dataset("parquet")`, what verl's and SkyRL's
prompt datasets call) first converts the whole file to its Arrow cache.

Writes a Parquet file of ``--gb`` GB in verl's GSM8K row format (chat prompt,
``reward_model.ground_truth``, ``extra_info``; row groups of ``--group`` rows, as
``datasets.to_parquet`` writes them), then alternates A (files: open, 4 batches of 64)
and B (datasets: load_dataset, the same 4 batches by index), each in a fresh process, and
prints JSON: medians of seconds to the first batch and of peak RSS, and their ratios.

    .venv/bin/python benchmarks/prompt_files.py --gb 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROW_TEXT = "Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. " * 4


def _rows(start: int, n: int) -> list[dict]:
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": ROW_TEXT.format(i=i) + " Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"split": "train", "index": i, "answer": f"#### {i}"},
    } for i in range(start, start + n)]


def write(path: pathlib.Path, gb: float, group: int) -> int:
    """About ``gb`` GB of rows (the size of one row group, measured first, sets the count)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sample = path.with_suffix(".sample")
    pq.write_table(pa.Table.from_pylist(_rows(0, group)), sample, compression="snappy")
    groups = max(1, round(gb * (1 << 30) / sample.stat().st_size))
    sample.unlink()
    with pq.ParquetWriter(path, pa.Table.from_pylist(_rows(0, 1)).schema, compression="snappy") as writer:
        for g in range(groups):
            writer.write_table(pa.Table.from_pylist(_rows(g * group, group)), row_group_size=group)
    return groups * group


CHILD_FILES = """
import sys, time, resource
t0 = time.perf_counter()
from skyrl_datasets.files import Files, FilesConfig
ds = Files(FilesConfig(path=sys.argv[1]), seed=0)
for step in range(1, 5):
    batch = ds.batch(step, 64)
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(ds), batch[0].answer)
"""

CHILD_DATASETS = """
import sys, time, resource, random
t0 = time.perf_counter()
import datasets
datasets.disable_progress_bars()
ds = datasets.load_dataset("parquet", data_files=sys.argv[1], split="train", cache_dir=sys.argv[2])
order = random.Random(0).sample(range(len(ds)), 4 * 64)
for step in range(4):
    batch = [ds[i] for i in order[step * 64:(step + 1) * 64]]
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(ds), batch[0]["reward_model"]["ground_truth"])
"""


def measure(code: str, *args: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    seconds, rss_kb, *_ = out.stdout.split()
    return float(seconds), int(rss_kb) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--group", type=int, default=2000, help="rows per row group")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the file (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = pathlib.Path(tmp) / "train.parquet"
        t0 = time.perf_counter()
        rows = write(path, args.gb, args.group)
        write_s = time.perf_counter() - t0
        a, b = [], []
        for r in range(args.rounds):
            a.append(measure(CHILD_FILES, str(path)))
            cache = pathlib.Path(tmp) / f"hf-cache-{r}"
            b.append(measure(CHILD_DATASETS, str(path), str(cache)))
            subprocess.run(["rm", "-rf", str(cache)], check=True)
        med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
        print(json.dumps({
            "claim": "files opens a large Parquet prompt file and serves batches without converting it",
            "file_bytes": path.stat().st_size, "rows": rows, "row_group_rows": args.group, "write_s": round(write_s, 1),
            "files_first_batches_s": round(med(a, 0), 3), "datasets_first_batches_s": round(med(b, 0), 3),
            "time_ratio": round(med(b, 0) / med(a, 0), 1),
            "files_peak_rss_mib": round(med(a, 1)), "datasets_peak_rss_mib": round(med(b, 1)),
            "rounds": {"files": a, "datasets": b},
        }, indent=2))


if __name__ == "__main__":
    main()
