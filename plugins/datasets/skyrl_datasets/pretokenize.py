"""pretokenize: JSONL / Parquet records -> a pretokenized corpus (``skyrl data tokenize``).

The inputs are cut into **chunks** planned up front from the files alone: a JSON-lines
file into byte ranges of ``chunk_bytes`` (a chunk owns the lines that *start* in its
range), a Parquet file into slices of at most ``chunk_rows`` rows of one row group.
Worker processes (``workers``, default: every core) tokenize chunks in any order; each
writes its result to ``PREFIX.parts/NNNNNN.npz`` (a temporary file renamed into place, so
a part file that exists is complete). When every chunk is done, the parts are
concatenated in chunk order (= input order) by :class:`~skyrl_datasets.corpus.CorpusWriter`
into the corpus, whose header is written last; then ``PREFIX.parts`` is removed.

``resume``: an interrupted run (killed, out of disk, ...) left ``PREFIX.parts`` with the
finished chunks and a ``manifest.json`` of the plan; resuming checks that the inputs
(names, sizes, modification times), the tokenizer and the options are the same, tokenizes
only the missing chunks and merges. The result is byte-identical to an uninterrupted run:
every chunk's part is a pure function of its bytes, and the merge is a pure function of
the parts.

Records:

- **text** (``text_key``, default ``"text"``): ``tokenizer(text)`` (with the tokenizer's own
  special tokens, e.g. BOS), then EOS appended; every token trains (no mask file).
- **chat** (``messages_key`` set): a list of ``{"role", "content"}`` messages rendered with
  the tokenizer's chat template; the loss mask is 1 on assistant turns only (their content
  and the template's end-of-turn text, not the ``<|im_start|>assistant`` header). The
  assistant spans are found by rendering prefixes: turn ``k`` spans from the end of
  ``render(messages[:k], add_generation_prompt=True)`` to the end of
  ``render(messages[:k+1])``, in characters of the full rendering, mapped to tokens with
  the tokenizer's offsets (a token trains if it overlaps a span). A template whose earlier
  turns change when later ones are added (this breaks the prefix property) is handled by
  transformers' ``return_assistant_tokens_mask`` if the template marks assistant text
  with ``{% generation %}``; otherwise the record is reported.
"""

from __future__ import annotations

import functools
import itertools
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import time
from typing import Any, Callable, Iterable, Sequence

import attrs
import numpy as np

from skyrl_datasets.corpus import HEADER_SUFFIX, INDEX_SUFFIX, MASK_SUFFIX, TOKENS_SUFFIX, CorpusWriter
from skyrl_host.errors import Problem, UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_CHUNK_ROWS = 20_000
PARTS_SUFFIX = ".parts"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
MAX_PROBLEMS = 20


@attrs.frozen
class Chunk:
    """One unit of work: records of one input file."""

    index: int
    file: int  # position in the inputs
    kind: str  # "jsonl" (start, stop = byte range) or "parquet" (row group, start/stop rows within it)
    start: int
    stop: int
    row_group: int = 0
    weight: int = 0  # input bytes it covers (progress)


@attrs.frozen
class Options:
    inputs: tuple[str, ...]
    tokenizer: str
    out: str
    text_key: str = "text"
    messages_key: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    chunk_rows: int = DEFAULT_CHUNK_ROWS

    @property
    def chat(self) -> bool:
        return self.messages_key is not None

    @property
    def key(self) -> str:
        return self.messages_key if self.messages_key is not None else self.text_key


class RecordError(Exception):
    """A record that cannot be tokenized (a user error located by file and line/row)."""


# -- planning -------------------------------------------------------------------------------


def input_kind(path: str) -> str:
    low = path.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise UserError(
        Problem(
            f"unknown input type; expected JSON lines ({', '.join(JSONL_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)})",
            file=path,
        )
    )


def check_inputs(inputs: Sequence[str]) -> None:
    problems = []
    for path in inputs:
        p = pathlib.Path(path)
        if p.is_dir():
            problems.append(Problem("is a folder; expected a JSONL or Parquet file", file=path))
        elif not p.exists():
            problems.append(Problem("no such file", file=path))
        elif not os.access(p, os.R_OK):
            problems.append(Problem("not readable (permission denied)", file=path))
    if problems:
        raise UserError(problems)
    for path in inputs:
        input_kind(path)


def plan_chunks(opts: Options) -> list[Chunk]:
    """Every chunk of every input, in input order: a pure function of the files' sizes and
    Parquet metadata and of the chunk sizes."""
    chunks: list[Chunk] = []
    for f, path in enumerate(opts.inputs):
        if input_kind(path) == "jsonl":
            size = os.path.getsize(path)
            for start in range(0, size, opts.chunk_bytes):
                stop = min(size, start + opts.chunk_bytes)
                chunks.append(Chunk(len(chunks), f, "jsonl", start, stop, weight=stop - start))
        else:
            meta = _parquet_file(path).metadata
            for rg in range(meta.num_row_groups):
                rows = meta.row_group(rg).num_rows
                nbytes = meta.row_group(rg).total_byte_size
                for start in range(0, rows, opts.chunk_rows):
                    stop = min(rows, start + opts.chunk_rows)
                    weight = max(1, nbytes * (stop - start) // max(rows, 1))
                    chunks.append(Chunk(len(chunks), f, "parquet", start, stop, row_group=rg, weight=weight))
    return chunks


def _parquet_file(path: str) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise UserError(Problem(f"not a readable Parquet file: {exc}", file=path)) from None


# -- the tokenizer -------------------------------------------------------------------------


def load_tokenizer(path: str, chat: bool) -> Any:
    """The transformers tokenizer at ``path`` (a local folder, or a hub name when online)."""
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - from_pretrained raises OSError, ValueError, KeyError...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(Problem(f"cannot load a tokenizer from {path!r}: {first}", key="--tokenizer")) from None
    if chat:
        if not getattr(tok, "chat_template", None):
            raise UserError(Problem(f"the tokenizer at {path!r} has no chat template (needed for --messages-key)", key="--tokenizer"))
        if not tok.is_fast:
            raise UserError(Problem(f"the tokenizer at {path!r} is not a fast tokenizer (token offsets are needed for the loss mask)", key="--tokenizer"))
    return tok


def vocab_size(tok: Any) -> int:
    return len(tok)


# -- records -> tokens ------------------------------------------------------------------------


def text_ids(tok: Any, texts: list[str]) -> list[list[int]]:
    ids = tok(texts, add_special_tokens=True)["input_ids"] if texts else []
    eos = tok.eos_token_id
    return [x + [eos] for x in ids] if eos is not None else ids


def chat_ids_and_mask(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The chat template's ids for ``messages`` and the loss mask (1 on assistant turns)."""
    full = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    incremental = True
    for k, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True) if k else ""
        through = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            incremental = False
            break
        spans.append((len(before), len(through)))
    if not incremental:
        return _generation_mask(tok, messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        if b > a and any(a < e and b > s for s, e in spans):
            mask[j] = 1
    return ids, mask


def _generation_mask(tok: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    if not _GENERATION_TAG.search(tok.chat_template or ""):
        raise RecordError(
            "the chat template renders earlier turns differently once later turns are added, so the assistant "
            "turns cannot be located by rendering prefixes; mark assistant text in the template with "
            "{% generation %}...{% endgeneration %}"
        )
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    mask = [int(x) for x in out["assistant_masks"]]
    if not any(mask) and any(m["role"] == "assistant" and m["content"] for m in messages):
        raise RecordError("the chat template's {% generation %} blocks marked no token of the assistant turns")
    return list(out["input_ids"]), mask


def _check_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RecordError(f"expected a non-empty list of messages, found {json.dumps(value)[:80]}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RecordError(f"message {i}: expected {{\"role\": str, \"content\": str}}, found {json.dumps(m)[:80]}")
    return value


# -- one chunk ---------------------------------------------------------------------------------

def _records(opts: Options, chunk: Chunk) -> Iterable[tuple[Any, Callable[[], str]]]:
    """(value of the key, where) for each record of ``chunk``; ``where()`` locates the record
    for an error message (a JSONL line number is counted only then)."""
    path = opts.inputs[chunk.file]
    key = opts.key
    if chunk.kind == "jsonl":
        with open(path, "rb") as f:
            if chunk.start:
                f.seek(chunk.start - 1)
                f.readline()  # the line holding byte start-1 belongs to the previous chunk
            while f.tell() < chunk.stop:
                pos = f.tell()
                line = f.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                where = functools.partial(_at, path, pos)
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise RecordError(f"{where()}: invalid JSON: {exc}") from None
                if not isinstance(record, dict):
                    raise RecordError(f"{where()}: expected a JSON object, found {type(record).__name__}")
                if key not in record:
                    raise RecordError(f"{where()}: no key {key!r}; keys: {', '.join(map(repr, record)) or '(none)'}")
                yield record[key], where
    else:
        pf = _parquet_file(path)
        table = pf.read_row_group(chunk.row_group, columns=[key]).slice(chunk.start, chunk.stop - chunk.start)
        first_row = sum(pf.metadata.row_group(g).num_rows for g in range(chunk.row_group)) + chunk.start
        for r, value in enumerate(table.column(key).to_pylist()):
            yield value, functools.partial(str, f"{path}: row {first_row + r}")


def _line_number(path: str, pos: int) -> int:
    n = 1
    with open(path, "rb") as f:
        left = pos
        while left > 0:
            data = f.read(min(left, 1 << 20))
            n += data.count(b"\n")
            left -= len(data)
    return n


def _at(path: str, pos: int) -> str:
    return f"{path}:{_line_number(path, pos)}"


class ChunkTokenizer:
    """Tokenizes chunks into their part files: the tokenizer and options of one run, held
    by the process doing the work (the run's own, or each worker process of its pool,
    on its ``multiprocessing`` process object: :func:`_init_worker`)."""

    def __init__(self, tok: Any, opts: Options, parts: pathlib.Path):
        self.tok, self.opts, self.parts = tok, opts, parts

    def __call__(self, chunk: Chunk) -> tuple[str, Any]:
        """``("ok", tokenize(chunk))``, or ``("record", message)`` for a malformed record."""
        try:
            return "ok", self.tokenize(chunk)
        except RecordError as exc:
            return "record", str(exc)

    def tokenize(self, chunk: Chunk) -> tuple[int, int, int, int]:
        """Tokenize ``chunk`` into its part file; returns (index, documents, tokens, trained tokens)."""
        return tokenize_chunk(self.tok, self.opts, self.parts, chunk)


def tokenize_chunk(tok: Any, opts: Options, parts: pathlib.Path, chunk: Chunk) -> tuple[int, int, int, int]:
    """Tokenize ``chunk`` of ``opts``' inputs with ``tok`` into its part file in ``parts``;
    returns (index, documents, tokens, trained tokens)."""
    docs: list[list[int]] = []
    masks: list[list[int]] = []
    batch: list[str] = []
    for value, where_fn in _records(opts, chunk):
        if opts.chat:
            try:
                ids, mask = chat_ids_and_mask(tok, _check_messages(value))
            except RecordError as exc:
                raise RecordError(f"{where_fn()}: {opts.key!r}: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - a template error (jinja) is the record's problem
                raise RecordError(f"{where_fn()}: {opts.key!r}: the chat template failed: {type(exc).__name__}: {exc}") from None
            docs.append(ids)
            masks.append(mask)
        else:
            if not isinstance(value, str):
                raise RecordError(f"{where_fn()}: expected {opts.key!r} to be a string, found {json.dumps(value)[:80]}")
            batch.append(value)
            if len(batch) >= 512:
                docs.extend(text_ids(tok, batch))
                batch = []
    docs.extend(text_ids(tok, batch))
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lengths.sum()))
    arrays = {"tokens": tokens, "lengths": lengths}
    trained = int(tokens.shape[0])
    if opts.chat:
        arrays["mask"] = np.fromiter(itertools.chain.from_iterable(masks), dtype=np.uint8, count=int(lengths.sum()))
        trained = int(arrays["mask"].sum())
    final = parts / f"{chunk.index:06d}.npz"
    tmp = parts / f"{chunk.index:06d}.{os.getpid()}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, final)
    return chunk.index, int(lengths.shape[0]), int(tokens.shape[0]), trained


def _init_worker(worker: ChunkTokenizer) -> None:
    """A pool worker's start: it keeps ``worker`` on its own process object (as long as
    the worker process lives; nothing at module level)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    multiprocessing.current_process().chunk_tokenizer = worker  # type: ignore[attr-defined]


def _pool_task(chunk: Chunk) -> tuple[str, Any]:
    """One chunk in a pool worker, by the worker's :class:`ChunkTokenizer`."""
    return multiprocessing.current_process().chunk_tokenizer(chunk)  # type: ignore[attr-defined]


# -- the run -----------------------------------------------------------------------------------


def _input_fingerprint(opts: Options) -> list[dict[str, Any]]:
    out = []
    for path in opts.inputs:
        st = os.stat(path)
        out.append({"path": path, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _manifest(opts: Options, chunks: list[Chunk]) -> dict[str, Any]:
    return {
        "inputs": _input_fingerprint(opts),
        "tokenizer": opts.tokenizer,
        "text_key": None if opts.chat else opts.text_key,
        "messages_key": opts.messages_key,
        "chunk_bytes": opts.chunk_bytes,
        "chunk_rows": opts.chunk_rows,
        "chunks": len(chunks),
    }


def output_files(out: str) -> list[str]:
    return [out + s for s in (HEADER_SUFFIX, TOKENS_SUFFIX, INDEX_SUFFIX, MASK_SUFFIX, PARTS_SUFFIX)]


@attrs.frozen
class Progress:
    """What the caller's progress display is told after each chunk."""

    done_weight: int
    total_weight: int
    documents: int
    tokens: int


def tokenize(
    opts: Options,
    *,
    workers: int | None = None,
    resume: bool = False,
    force: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    on_start: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the whole pipeline; returns the corpus header plus ``trained_tokens``, ``chunks``
    and ``resumed_chunks``. User mistakes raise :class:`UserError`."""
    check_inputs(opts.inputs)
    out = opts.out
    parts = pathlib.Path(out + PARTS_SUFFIX)
    header = pathlib.Path(out + HEADER_SUFFIX)
    if force:
        shutil.rmtree(parts, ignore_errors=True)
        for f in output_files(out)[:4]:
            pathlib.Path(f).unlink(missing_ok=True)
    elif not resume:
        if header.exists():
            raise UserError(Problem("a corpus already exists here; add --force to replace it", file=str(header)))
        if parts.exists():
            raise UserError(
                Problem("an interrupted run left its finished chunks here; add --resume to continue it or --force to start over", file=str(parts))
            )
    elif header.exists() and not parts.exists():
        raise UserError(Problem("the corpus is already complete (nothing to resume); add --force to rebuild it", file=str(header)))
    out_dir = pathlib.Path(out).parent
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(Problem("is not a folder (from --out)", file=str(out_dir)))
    tok = load_tokenizer(opts.tokenizer, opts.chat)
    if not opts.chat and tok.eos_token_id is None:
        raise UserError(Problem(f"the tokenizer at {opts.tokenizer!r} has no EOS token to end plain-text documents with", key="--tokenizer"))
    _check_keys(opts)
    chunks = plan_chunks(opts)
    manifest = _manifest(opts, chunks)
    manifest_path = parts / "manifest.json"
    if parts.exists() and resume:
        try:
            old = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old != manifest:
            raise UserError(
                Problem(
                    "cannot resume: the inputs, tokenizer or options differ from the interrupted run's "
                    f"({_manifest_diff(old, manifest)}); use --force to start over",
                    file=str(manifest_path),
                )
            )
    else:
        try:
            parts.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(Problem(f"cannot create the output folder: {exc.strerror or exc}", file=str(parts))) from None
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, manifest_path)
    done = {c.index for c in chunks if (parts / f"{c.index:06d}.npz").exists()}
    for stray in parts.glob("*.tmp.npz"):
        stray.unlink(missing_ok=True)
    todo = [c for c in chunks if c.index not in done]
    total_weight = sum(c.weight for c in chunks) or 1
    n_workers = max(1, min(workers or _cores(), len(todo) or 1))
    if on_start is not None:
        on_start(len(chunks), len(done), total_weight)
    done_weight = sum(c.weight for c in chunks if c.index in done)
    stats = {"documents": 0, "tokens": 0}
    worker = ChunkTokenizer(tok, opts, parts)
    problems: list[str] = []

    def finished(result: tuple[str, Any]) -> None:
        nonlocal done_weight
        status, value = result
        if status != "ok":
            problems.append(value)
            return
        index, n_docs, n_tokens, _ = value
        done_weight += chunks[index].weight
        stats["documents"] += n_docs
        stats["tokens"] += n_tokens
        if on_progress is not None:
            on_progress(Progress(done_weight, total_weight, stats["documents"], stats["tokens"]))

    if n_workers == 1 or len(todo) <= 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, as for a worker
        for c in todo:
            finished(worker(c))
            if problems:
                break
    else:
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        with ctx.Pool(n_workers, initializer=_init_worker, initargs=(worker,)) as pool:
            for result in pool.imap_unordered(_pool_task, todo):
                finished(result)
                if problems:
                    pool.terminate()
                    break
    if not problems and stats["documents"] == 0 and not done:
        problems.append("the inputs hold no records (" + ", ".join(opts.inputs) + ")")
    if problems:
        # Fixing the input changes its fingerprint, so these parts could never be resumed.
        shutil.rmtree(parts, ignore_errors=True)
        raise UserError([Problem(p) for p in problems[:MAX_PROBLEMS]])
    result = merge(opts, chunks, parts, tok)
    result.update(chunks=len(chunks), resumed_chunks=len(done))
    return result


def merge(opts: Options, chunks: list[Chunk], parts: pathlib.Path, tok: Any) -> dict[str, Any]:
    """Concatenate the parts in chunk order into the corpus, header last; remove the parts."""
    extra = {"source": {"inputs": list(opts.inputs), "text_key": None if opts.chat else opts.text_key, "messages_key": opts.messages_key}}
    trained = 0
    with CorpusWriter(
        opts.out,
        vocab_size=vocab_size(tok),
        eos_id=tok.eos_token_id,
        tokenizer=opts.tokenizer,
        with_mask=opts.chat,
        extra=extra,
    ) as writer:
        for c in chunks:
            with np.load(parts / f"{c.index:06d}.npz") as part:
                mask = part["mask"] if opts.chat else None
                writer.add_batch(part["tokens"], part["lengths"], mask)
                trained += int(mask.sum()) if mask is not None else int(part["tokens"].shape[0])
    shutil.rmtree(parts)
    header = json.loads(pathlib.Path(opts.out + HEADER_SUFFIX).read_text())
    header["trained_tokens"] = trained
    return header


def _check_keys(opts: Options) -> None:
    """The key must be in the first record of each input: one clear message before any work."""
    for path in opts.inputs:
        if input_kind(path) == "parquet":
            names = _parquet_file(path).schema_arrow.names
            if opts.key not in names:
                raise UserError(Problem(f"no column {opts.key!r}; columns: {', '.join(map(repr, names))}{_key_hint(opts)}", file=path))
            continue
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    break
            else:
                continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(Problem(f"invalid JSON: {exc}", file=path, line=n)) from None
        if not isinstance(record, dict):
            raise UserError(Problem(f"expected a JSON object per line, found {type(record).__name__}", file=path, line=n))
        if opts.key not in record:
            keys = ", ".join(map(repr, record)) or "(none)"
            raise UserError(Problem(f"no key {opts.key!r}; keys: {keys}{_key_hint(opts)}", file=path, line=n))


def _key_hint(opts: Options) -> str:
    flag = "--messages-key" if opts.chat else "--text-key"
    return f" (set {flag})"


def _manifest_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    if old is None:
        return "its manifest is missing or unreadable"
    changed = [k for k in new if old.get(k) != new.get(k)]
    return "changed: " + ", ".join(changed)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
