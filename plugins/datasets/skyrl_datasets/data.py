"""data: the ``skyrl data`` commands: ``tokenize`` (JSONL/Parquet -> a pretokenized corpus)
and ``info`` (a corpus's counts and length histogram).

This module imports neither transformers nor pyarrow: the hook runs on every ``skyrl``
call; the commands import what they need when they run.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from skyrl_host import hookimpl

HIST_BINS = 12
DEFAULT_CHUNK_MB = 8.0  # = pretokenize.DEFAULT_CHUNK_BYTES (not imported: this module stays light)
DEFAULT_CHUNK_ROWS = 20_000
BAR_WIDTH = 40


def length_histogram(lengths: Any, bins: int = HIST_BINS) -> list[dict[str, int]]:
    """Counts of documents by length, in ``bins`` log-spaced bins (powers of two when they fit)."""
    import numpy as np

    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return []
    lo, hi = int(lengths.min()), int(lengths.max())
    if hi - lo < bins:
        edges = np.arange(lo, hi + 2)
    else:
        edges = np.unique(np.geomspace(max(lo, 1), hi + 1, bins + 1).round().astype(np.int64))
        edges[0] = lo
        edges[-1] = hi + 1
    counts = np.histogram(lengths, bins=edges)[0]
    return [{"min": int(a), "max": int(b) - 1, "count": int(c)} for a, b, c in zip(edges[:-1], edges[1:], counts)]


def corpus_info(prefix: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``skyrl data info`` prints: counts, length statistics and the histogram."""
    import numpy as np

    from skyrl_datasets.corpus import open_corpus

    with open_corpus(prefix, storage_options=storage_options) as c:
        lengths = np.asarray(c.lengths)
        info: dict[str, Any] = {
            "prefix": prefix,
            "format": c.meta.get("format"),
            "dtype": c.meta.get("dtype"),
            "documents": c.n_docs,
            "tokens": c.n_tokens,
            "mean_length": float(lengths.mean()) if c.n_docs else 0.0,
            "min_length": int(lengths.min()) if c.n_docs else 0,
            "max_length": int(lengths.max()) if c.n_docs else 0,
            "vocab_size": c.meta.get("vocab_size"),
            "eos_id": c.meta.get("eos_id"),
            "tokenizer": c.meta.get("tokenizer"),
            "loss_mask": c.has_mask,
            "histogram": length_histogram(lengths),
        }
    return info


def _print_info(info: dict[str, Any]) -> None:
    rows = [
        ("format", f"{info['format']} ({info['dtype']})"),
        ("documents", f"{info['documents']:,}"),
        ("tokens", f"{info['tokens']:,}"),
        ("length", f"mean {info['mean_length']:.1f}, min {info['min_length']:,}, max {info['max_length']:,}"),
        ("loss mask", "yes" if info["loss_mask"] else "no (every token trains)"),
    ]
    for key in ("tokenizer", "vocab_size", "eos_id"):
        if info.get(key) is not None:
            rows.append((key.replace("_", " "), str(info[key])))
    click.echo(info["prefix"])
    for k, v in rows:
        click.echo(f"  {k + ':':<12} {v}")
    hist = info["histogram"]
    if not hist:
        return
    click.echo("  length histogram (documents):")
    top = max(h["count"] for h in hist) or 1
    w = max(len(f"{h['min']:,}-{h['max']:,}") for h in hist)
    for h in hist:
        label = f"{h['min']:,}-{h['max']:,}" if h["max"] != h["min"] else f"{h['min']:,}"
        bar = "#" * round(BAR_WIDTH * h["count"] / top)
        click.echo(f"    {label:>{w}} | {bar:<{BAR_WIDTH}} {h['count']:,}")


def _plot(info: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = info["histogram"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{h['min']}-{h['max']}" if h["max"] != h["min"] else str(h["min"]) for h in hist]
    ax.bar(range(len(hist)), [h["count"] for h in hist])
    ax.set_xticks(range(len(hist)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"{info['prefix']}: {info['documents']:,} documents, {info['tokens']:,} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _storage_options(raw: str | None) -> dict[str, Any] | None:
    from skyrl_host.errors import UserError

    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(f"--storage-options: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise UserError("--storage-options: expected a JSON object")
    return value


@hookimpl
def skyrl_register_commands(cli: click.Group) -> None:
    @cli.group(name="data")
    def data() -> None:
        """Pretokenized corpora for SFT: tokenize JSONL/Parquet, inspect a corpus."""

    @data.command(name="info")
    @click.argument("prefix")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    @click.option("--plot", "plot", metavar="FILE.png", help="Also draw the length histogram to FILE.png.")
    @click.option("--storage-options", metavar="JSON", help="fsspec options for a remote PREFIX, as a JSON object.")
    def info_cmd(prefix: str, as_json: bool, plot: str | None, storage_options: str | None) -> None:
        """Documents, tokens, lengths and a length histogram of the corpus at PREFIX (ours, or
        Megatron's PREFIX.bin/.idx; a path or an fsspec URL)."""
        info = corpus_info(prefix, _storage_options(storage_options))
        if as_json:
            click.echo(json.dumps(info, indent=2))
        else:
            _print_info(info)
        if plot:
            _plot(info, plot)
            click.echo(f"histogram written to {plot}", err=True)

    @data.command(name="tokenize")
    @click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
    @click.option("--tokenizer", "tokenizer", required=True, metavar="PATH", help="A Hugging Face tokenizer folder (or hub name).")
    @click.option("--out", "out", required=True, metavar="PREFIX", help="Write PREFIX.json, PREFIX.tokens, PREFIX.index (and PREFIX.mask).")
    @click.option("--text-key", default="text", show_default=True, help="Plain-text records: the field holding the text (EOS is appended).")
    @click.option("--messages-key", default=None, help="Chat records: the field holding the messages; the loss mask covers assistant turns only.")
    @click.option("--workers", type=click.IntRange(min=1), default=None, help="Worker processes [default: every core].")
    @click.option("--resume", is_flag=True, help="Continue an interrupted run: keep its finished chunks.")
    @click.option("--force", is_flag=True, help="Replace an existing corpus (or an interrupted run) at PREFIX.")
    @click.option("--chunk-mb", type=click.FloatRange(min=0.001), default=DEFAULT_CHUNK_MB, show_default=True, help="JSONL chunk size (the unit of work and of --resume).")
    @click.option("--chunk-rows", type=click.IntRange(min=1), default=DEFAULT_CHUNK_ROWS, show_default=True, help="Parquet chunk size in rows.")
    @click.option("--quiet", is_flag=True, help="No progress bar.")
    def tokenize_cmd(
        inputs: tuple[str, ...],
        tokenizer: str,
        out: str,
        text_key: str,
        messages_key: str | None,
        workers: int | None,
        resume: bool,
        force: bool,
        chunk_mb: float,
        chunk_rows: int,
        quiet: bool,
    ) -> None:
        """Tokenize JSONL or Parquet INPUT files into a pretokenized corpus at PREFIX.

        Plain text (--text-key): the tokenizer's ids plus EOS, every token trains. Chat
        (--messages-key): the chat template's ids, loss on assistant turns only. Documents
        keep the input order. Uses every core; --resume continues an interrupted run and
        gives the same bytes as an uninterrupted one.
        """
        from skyrl_datasets.pretokenize import Options, tokenize

        if resume and force:
            raise click.UsageError("--resume and --force exclude each other")
        opts = Options(
            inputs=tuple(inputs),
            tokenizer=tokenizer,
            out=out,
            text_key=text_key,
            messages_key=messages_key,
            chunk_bytes=max(1, int(chunk_mb * (1 << 20))),
            chunk_rows=chunk_rows,
        )
        start = time.monotonic()
        with _TokenizeProgress(disable=quiet) as bar:
            result = tokenize(opts, workers=workers, resume=resume, force=force, on_start=bar.start, on_progress=bar.update)
        seconds = time.monotonic() - start
        resumed = f" ({result['resumed_chunks']} of {result['chunks']} chunks kept from the interrupted run)" if result["resumed_chunks"] else ""
        click.echo(
            f"wrote {out}: {result['n_docs']:,} documents, {result['n_tokens']:,} tokens "
            f"({result['trained_tokens']:,} trained), {result['dtype']}, in {seconds:.1f} s{resumed}",
            err=True,
        )


class _TokenizeProgress:
    """A rich progress bar over the input bytes, with tokens, tokens/s and ETA."""

    def __init__(self, disable: bool):
        self.disable = disable
        self.progress: Any = None
        self.task: Any = None
        self.t0 = time.monotonic()
        self.tokens0 = 0

    def __enter__(self) -> "_TokenizeProgress":
        return self

    def start(self, n_chunks: int, n_done: int, total_weight: int) -> None:
        """Show the bar once the inputs and the tokenizer are checked (a user error prints alone)."""
        self.t0 = time.monotonic()
        if self.disable:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("tokenizing"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[docs]} docs, {task.fields[tokens]} tokens, {task.fields[rate]} tokens/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self.progress.start()
        self.task = self.progress.add_task("tokenize", total=total_weight, completed=0, docs="0", tokens="0", rate="-")
        if n_done:
            self.progress.console.print(f"resuming: {n_done} of {n_chunks} chunks are done")

    def update(self, p: Any) -> None:
        if self.progress is None or self.task is None:
            return
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        self.progress.update(
            self.task,
            completed=p.done_weight,
            docs=_human(p.documents),
            tokens=_human(p.tokens),
            rate=_human(p.tokens / elapsed),
        )

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
