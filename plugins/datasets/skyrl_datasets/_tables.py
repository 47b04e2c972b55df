"""Rows of prompt files, read a block at a time: Parquet (a block is a row group),
Hugging Face ``datasets`` folders (``save_to_disk``: Arrow stream files, a block is a
record batch) and JSON lines (a block is 1,024 lines, found through an index of line
offsets). Local paths or fsspec URLs, one file, a glob, or a folder of files.

Opening reads only what locates the blocks (Parquet's footer, the Arrow files' batch
headers through a memory map, one pass over a JSON-lines file for its newlines), so a
large file opens fast and what stays in memory is the blocks in use, not the file.
No pickle anywhere: a ``datasets`` folder's JSON files are read as JSON, its data as
Arrow.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from skyrl_host.errors import Problem, UserError

JSONL_BLOCK = 1024  # lines per block of a JSON-lines file
SCAN_CHUNK = 16 << 20  # bytes read at a time while indexing a JSON-lines file
MAX_STATE_BYTES = 1 << 20  # a datasets folder's state.json / dataset_dict.json
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
ARROW_SUFFIXES = (".arrow",)


class RowError(ValueError):
    """A row that cannot be used: the message names the field; the caller adds the file and row."""


def field(row: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of ``row`` (``reward_model.ground_truth``), or
    :data:`MISSING` when a part is absent or not a mapping."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


class Table(abc.ABC):
    """One file's rows in blocks. ``where``: the path or URL, for messages; ``unit``:
    how messages count rows (``row`` from 0, or ``line`` from 1)."""

    where: str
    unit: str = "row"
    block_rows: list[int]

    @abc.abstractmethod
    def read(self, block: int) -> list[tuple[int, Any]]:
        """Block ``block``'s rows as (row number, the row: a dict, or a RowError) pairs."""

    def close(self) -> None:
        pass


def _is_remote(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return not isinstance(fs, LocalFileSystem)


class ParquetTable(Table):
    def __init__(self, fs: Any, path: str, where: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.where = where
        self._handle = fs.open(path, "rb") if _is_remote(fs) else None
        try:
            self._file = pq.ParquetFile(self._handle if self._handle is not None else path)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            self.close()
            raise UserError(Problem(f"not a Parquet file: {' '.join(str(exc).split())}", file=where)) from None
        md = self._file.metadata
        self.block_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]

    def read(self, block: int) -> list[tuple[int, Any]]:
        import pyarrow as pa

        first = sum(self.block_rows[:block])
        try:
            rows = self._file.read_row_group(block).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise UserError(Problem(f"row group {block} cannot be read: {' '.join(str(exc).split())}",
                                    file=self.where)) from None
        return list(enumerate(rows, first))

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class ArrowTable(Table):
    """One Arrow stream file of a ``datasets`` folder (``data-00000-of-00001.arrow``):
    memory-mapped when local, read whole when remote."""

    def __init__(self, fs: Any, path: str, where: str) -> None:
        import pyarrow as pa

        self.where = where
        try:
            if _is_remote(fs):
                with fs.open(path, "rb") as f:
                    source: Any = pa.BufferReader(f.read())
            else:
                source = pa.memory_map(path)
            try:
                self._batches = pa.ipc.open_stream(source).read_all().to_batches()
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowException, OSError) as exc:
            raise UserError(Problem(f"not an Arrow file: {' '.join(str(exc).split())}", file=where)) from None
        self.block_rows = [b.num_rows for b in self._batches]

    def read(self, block: int) -> list[tuple[int, Any]]:
        first = sum(self.block_rows[:block])
        return list(enumerate(self._batches[block].to_pylist(), first))


class JsonlTable(Table):
    """A JSON-lines file: one pass finds the start and end of every non-blank line; a
    block's lines are then read by their byte range."""

    unit = "line"

    def __init__(self, fs: Any, path: str, where: str) -> None:
        self.where = where
        self._fs, self._path = fs, path
        self._starts, self._ends, self._lines = self._index()
        starts = self._starts
        self.block_rows = [min(JSONL_BLOCK, len(starts) - i) for i in range(0, len(starts), JSONL_BLOCK)]

    def _open(self) -> Any:
        return self._fs.open(self._path, "rb")

    def _index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(start, end, 1-based line number) of every non-blank line."""
        newlines: list[np.ndarray] = []
        size = 0
        with self._open() as f:
            head = f.read(3)
            bom = 3 if head == b"\xef\xbb\xbf" else 0
            f.seek(0)
            while chunk := f.read(SCAN_CHUNK):
                newlines.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x0A) + size)
                size += len(chunk)
        nl = np.concatenate(newlines) if newlines else np.zeros(0, dtype=np.int64)
        starts = np.concatenate([[bom], nl + 1]).astype(np.int64)
        ends = np.concatenate([nl, [size]]).astype(np.int64)
        numbers = np.arange(1, len(starts) + 1, dtype=np.int64)
        keep = ends - starts > 1  # lines of 0 bytes, or of one ("\r"), may be blank
        short = np.flatnonzero((ends - starts <= 64) & keep)
        if len(short) or not keep.all():
            keep = keep.copy()
            with self._open() as f:
                for i in short:  # few: whitespace-only lines are blank too
                    f.seek(int(starts[i]))
                    if not f.read(int(ends[i] - starts[i])).strip():
                        keep[i] = False
                for i in np.flatnonzero(ends - starts == 1):
                    f.seek(int(starts[i]))
                    keep[i] = bool(f.read(1).strip())
        return starts[keep], ends[keep], numbers[keep]

    def read(self, block: int) -> list[tuple[int, Any]]:
        lo = block * JSONL_BLOCK
        hi = lo + self.block_rows[block]
        with self._open() as f:
            f.seek(int(self._starts[lo]))
            raw = f.read(int(self._ends[hi - 1] - self._starts[lo]))
        base = int(self._starts[lo])
        out: list[tuple[int, Any]] = []
        for i in range(lo, hi):
            line = raw[int(self._starts[i]) - base : int(self._ends[i]) - base]
            number = int(self._lines[i])
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as exc:
                out.append((number, RowError(f"not UTF-8 text: {exc}")))
                continue
            except json.JSONDecodeError as exc:
                out.append((number, RowError(f"invalid JSON: {exc.msg} (column {exc.colno})")))
                continue
            if not isinstance(record, dict):
                out.append((number, RowError(f"expected a JSON object, found {type(record).__name__}")))
                continue
            out.append((number, record))
        return out


# -- finding the files ---------------------------------------------------------------------


def _read_json(fs: Any, path: str, where: str) -> Any:
    with fs.open(path, "rb") as f:
        raw = f.read(MAX_STATE_BYTES + 1)
    if len(raw) > MAX_STATE_BYTES:
        raise UserError(Problem(f"larger than {MAX_STATE_BYTES} bytes: not a datasets folder's JSON file", file=where))
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(Problem(f"invalid JSON: {exc}", file=where)) from None


def _datasets_folder(fs: Any, path: str, where: str) -> list[Table] | None:
    """The Arrow files of a ``save_to_disk`` folder (from its state.json), or None if the
    folder is not one. A DatasetDict folder is an error naming its splits."""
    join = lambda name: path.rstrip("/") + "/" + name  # noqa: E731
    if fs.exists(join("dataset_dict.json")):
        info = _read_json(fs, join("dataset_dict.json"), f"{where}/dataset_dict.json")
        splits = info.get("splits") if isinstance(info, dict) else None
        names = ", ".join(repr(s) for s in splits) if isinstance(splits, list) else "?"
        first = splits[0] if isinstance(splits, list) and splits and isinstance(splits[0], str) else "train"
        raise UserError(Problem(f"a DatasetDict folder (splits {names}): name one split's folder, "
                                f"e.g. {where.rstrip('/')}/{first}", file=where))
    if not fs.exists(join("state.json")):
        return None
    state = _read_json(fs, join("state.json"), f"{where}/state.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files:
        raise UserError(Problem("state.json lists no _data_files: not a datasets save_to_disk folder", file=where))
    tables: list[Table] = []
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        # Names from the folder are untrusted: a plain file name, nothing that leaves the folder.
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") \
                or not name.endswith(ARROW_SUFFIXES):
            raise UserError(Problem(f"state.json names a data file {name!r}: expected a plain *.arrow file name",
                                    file=where))
        if not fs.exists(join(name)):
            raise UserError(Problem(f"state.json names {name!r}, which is not in the folder", file=where))
        tables.append(ArrowTable(fs, join(name), f"{where.rstrip('/')}/{name}"))
    return tables


def _one_file(fs: Any, path: str, where: str) -> Table:
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return ParquetTable(fs, path, where)
    if lower.endswith(JSONL_SUFFIXES):
        return JsonlTable(fs, path, where)
    if lower.endswith(ARROW_SUFFIXES):
        return ArrowTable(fs, path, where)
    with fs.open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"PAR1":
        return ParquetTable(fs, path, where)
    raise UserError(Problem("cannot tell the format: expected a .parquet, .jsonl or .arrow file, or a datasets "
                            "save_to_disk folder", file=where))


def open_tables(spec: str, storage_options: Mapping[str, Any] | None = None) -> list[Table]:
    """The tables at ``spec``: a file, a glob (sorted), or a folder (a ``datasets``
    folder, else its .parquet / .jsonl / .arrow files, sorted); a local path or an
    fsspec URL. A UserError names ``spec`` when nothing is there."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(os.path.expanduser(spec), **dict(storage_options or {}))
    except (ValueError, ImportError) as exc:
        raise UserError(Problem(f"cannot open: {exc}", file=spec)) from None
    remote = _is_remote(fs)
    try:
        return _open(fs, path, spec)
    except UserError:
        raise
    except FileNotFoundError:
        if remote and "/" in path.strip("/") and not fs.exists(path.strip("/").split("/")[0]):
            bucket = path.strip("/").split("/")[0]
            raise UserError(Problem(f"the bucket {bucket!r} does not exist (or these credentials cannot see it)",
                                    file=spec)) from None
        raise UserError(Problem("no such file or folder" + ("" if remote or os.path.isabs(path) else
                                f" (relative to the current folder {os.getcwd()!r})"), file=spec)) from None
    except Exception as exc:  # noqa: BLE001 - the remote's own errors: credentials, endpoints, buckets
        if remote:
            from skyrl_toolkit.remote_errors import endpoint_of, remote_message

            message = remote_message(spec, exc, options="[dataset] storage_options",
                                     endpoint=endpoint_of(dict(storage_options or {})))
            if message is not None:
                raise UserError(Problem(message)) from None
        if isinstance(exc, OSError):
            raise UserError(Problem(f"cannot read: {exc.strerror or exc}", file=spec)) from None
        raise


def _open(fs: Any, path: str, spec: str) -> list[Table]:
    if any(c in path for c in "*?["):
        found = sorted(p for p in fs.glob(path) if fs.isfile(p))
        if not found:
            raise UserError(Problem("the pattern matches no file", file=spec))
        return [_one_file(fs, p, _where(spec, path, p)) for p in found]
    if fs.isdir(path):
        tables = _datasets_folder(fs, path, spec)
        if tables is not None:
            return tables
        suffixes = PARQUET_SUFFIXES + JSONL_SUFFIXES + ARROW_SUFFIXES
        found = sorted(p for p in fs.ls(path, detail=False) if p.lower().endswith(suffixes) and fs.isfile(p))
        if not found:
            raise UserError(Problem("a folder with no .parquet, .jsonl or .arrow file, and not a datasets "
                                    "save_to_disk folder", file=spec))
        return [_one_file(fs, p, _where(spec, path, p)) for p in found]
    if not fs.exists(path):
        raise FileNotFoundError(path)
    return [_one_file(fs, path, spec)]


def _where(spec: str, path: str, found: str) -> str:
    """How messages name ``found``, a file under ``spec``: the spec's own form (URL or path)."""
    if found.startswith(path.rstrip("/") + "/"):
        return spec.rstrip("/") + found[len(path.rstrip("/")):]
    if "://" in spec:
        return spec.split("://", 1)[0] + "://" + found
    return found


class Rows:
    """The rows of several tables as one numbered sequence of blocks, read through a
    small cache of blocks (the order walks a block's rows before the next block's)."""

    def __init__(self, tables: Sequence[Table], cache_blocks: int = 4) -> None:
        self.tables = list(tables)
        self.blocks = [(t, b) for t, table in enumerate(self.tables) for b in range(len(table.block_rows))]
        self.sizes = np.array([self.tables[t].block_rows[b] for t, b in self.blocks], dtype=np.int64)
        self._cache: dict[int, list[tuple[int, Any]]] = {}
        self._cache_blocks = cache_blocks

    def __len__(self) -> int:
        return int(self.sizes.sum())

    def block(self, i: int) -> list[tuple[int, Any]]:
        rows = self._cache.get(i)
        if rows is None:
            t, b = self.blocks[i]
            rows = self.tables[t].read(b)
            if len(self._cache) >= self._cache_blocks:
                self._cache.pop(next(iter(self._cache)))
            self._cache[i] = rows
        return rows

    def where(self, i: int, number: int) -> tuple[str, str]:
        """(file, ``row N`` / ``line N``) of row ``number`` of block ``i``."""
        table = self.tables[self.blocks[i][0]]
        return table.where, f"{table.unit} {number}"

    def close(self) -> None:
        for t in self.tables:
            t.close()
        self._cache.clear()

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        for i in range(len(self.blocks)):
            for number, row in self.block(i):
                yield i, number, row
