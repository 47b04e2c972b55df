"""corpus: pretokenized, memory-mapped corpora for SFT: our format, Megatron's, local or remote.

:func:`open_corpus` opens either format, detected from the files at the prefix:

- **ours** (``skyrl data tokenize`` and :class:`CorpusWriter` write it), four files beside
  each other:

  ``PREFIX.json``
      the header (JSON, a few hundred bytes), written last and atomically (a temporary
      file renamed over the name), so a dataset whose header exists is complete. It
      names the format and version, the token dtype, the counts, the tokenizer's
      vocabulary size, EOS id and name, and the size and CRC-32 of each other file;
      opening checks the sizes, so a truncated or half-rewritten file is refused.
  ``PREFIX.tokens``
      every document's token ids end to end: ``uint16`` when the vocabulary has at most
      65,536 ids, else ``int32``; little-endian, no header.
  ``PREFIX.index``
      ``int64[n_docs + 1]`` offsets (in tokens: document ``i`` is
      ``tokens[offsets[i]:offsets[i+1]]``), then ``int32[n_docs]`` lengths.
  ``PREFIX.mask`` (optional)
      the loss mask, one ``uint8`` per token (1 = the token is trained on), aligned with
      ``PREFIX.tokens``. Absent when every token trains (plain text). One byte per token,
      not one bit: a document's mask is then a zero-copy view like its tokens.

- **Megatron's indexed dataset** (``PREFIX.bin`` + ``PREFIX.idx``, as megatron-core's
  ``IndexedDatasetBuilder`` writes them; read here with numpy alone). A document of the
  corpus is one Megatron *sequence* (one ``add_item``, what ``IndexedDataset[i]`` returns
  and what Megatron's GPT dataset samples from); the Megatron document count is in
  ``meta["megatron_documents"]``. Megatron corpora have no loss mask.

Opening costs O(1) in the corpus size: the header is read, every other file is
memory-mapped, nothing is loaded. ``Corpus.tokens(i)`` and ``Corpus.mask(i)`` are
zero-copy, read-only views of the mapped files. Pages a process touches in a mapping count
in its RSS (shared, reclaimable page cache, but counted); so that random reads over a huge
corpus do not grow the RSS towards the corpus's size, the mappings are released from the
process's page tables (``madvise(MADV_DONTNEED)``: the page cache keeps them, a later read
maps them again) whenever the process's file-backed RSS has grown by ``max_resident_bytes``
(128 MiB; checked every 32 reads from ``/proc/self/statm``).

**Remote corpora** (any fsspec URL: ``s3://``, ``gs://``, ``memory://``, ...; ``file://`` and
plain paths are read in place) are read through a local cache: opening downloads the
header and the index (small next to the tokens); the tokens and the mask are fetched
lazily, by aligned blocks (1 MiB by default), the first time a document touching them is
read, into sparse local files of the full size beside a ``.blocks`` map (one byte per
block, set once the block's bytes are written), so a corpus is never downloaded whole
before training starts and a block is fetched once per machine. The cache folder is
``cache_dir`` (default ``$SKYRL_CACHE_DIR/corpora``, else ``~/.cache/skyrl/corpora``), one
subfolder per dataset version (a hash of the URL and the header, or of the Megatron
files' sizes and ETags/mtimes). Several processes may share it: blocks are written with
positioned writes of the same bytes, so concurrent fetches of one block are harmless.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import operator
import os
import pathlib
import struct
import weakref
import zlib
from types import MappingProxyType
from typing import Any, BinaryIO, Mapping

import numpy as np

from skyrl_host.errors import Problem, UserError

FORMAT = "skyrl-corpus"
VERSION = 1
HEADER_SUFFIX = ".json"
TOKENS_SUFFIX = ".tokens"
INDEX_SUFFIX = ".index"
MASK_SUFFIX = ".mask"
MEGATRON_BIN = ".bin"
MEGATRON_IDX = ".idx"
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py).
MEGATRON_DTYPES: Mapping[int, Any] = MappingProxyType(
    {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
)
TOKEN_DTYPES = ("uint16", "int32")
DEFAULT_BLOCK_SIZE = 1 << 20
# Pages of the mapped files that a process has touched count in its RSS (as shared, clean,
# reclaimable page cache). Reading documents at random touches a whole corpus in time (and a
# fault on a cached file maps far more than the page read: fault-around, large folios), so
# every CHECK_EVERY reads the process's file-backed resident memory is read from
# /proc/self/statm, and when it has grown by more than max_resident_bytes the open corpora's (of one ResidentBudget)
# mappings are dropped from the process's page tables (madvise MADV_DONTNEED: the pages stay
# in the page cache, a later read maps them again). The RSS stays flat whatever the size.
DEFAULT_RESIDENT_BYTES = 128 << 20
CHECK_EVERY = 32


def _shared_resident_bytes() -> int | None:
    """This process's resident file-backed (shared) memory, from /proc/self/statm; None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return int(fields[2]) * mmap.PAGESIZE


class ResidentBudget:
    """The corpora that share one budget of file-backed resident memory: when the
    process's file-backed RSS has grown by a corpus's ``max_resident_bytes`` since the
    last release (or the first check), every open corpus of the budget releases its
    pages (:meth:`Corpus.release_pages`).

    :func:`open_corpus` gives each corpus a budget of its own; a reader that opens
    several corpora for one job (:class:`skyrl_datasets.pretokenized.PretokenizedReader`)
    opens them through one budget (:meth:`open`), so reads of any of them release all.
    The budget holds its corpora weakly and lives as long as they or its owner do."""

    def __init__(self) -> None:
        self._corpora: "weakref.WeakSet[Corpus]" = weakref.WeakSet()
        self._baseline: int | None = None  # file-backed resident bytes after the last release

    def open(
        self,
        prefix_or_url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_resident_bytes: int | None = DEFAULT_RESIDENT_BYTES,
    ) -> "Corpus":
        """:func:`open_corpus`, the corpus sharing this budget."""
        corpus = _open(str(prefix_or_url), storage_options, cache_dir, block_size)
        corpus.max_resident_bytes = max_resident_bytes
        corpus._join(self)
        return corpus

    def add(self, corpus: "Corpus") -> None:
        self._corpora.add(corpus)

    def discard(self, corpus: "Corpus") -> None:
        self._corpora.discard(corpus)

    def __len__(self) -> int:
        return len(self._corpora)

    def check(self, limit: int) -> None:
        """Release every corpus's pages if the file-backed RSS grew by more than ``limit``."""
        shared = _shared_resident_bytes()
        if shared is None:
            return
        if self._baseline is None:
            self._baseline = shared
        if shared - self._baseline > limit:
            for corpus in list(self._corpora):
                corpus.release_pages()
            # what is still resident is not the corpora's (libraries, other mappings)
            self._baseline = _shared_resident_bytes() or 0


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The smallest token dtype of our format that holds ids below ``vocab_size``."""
    if vocab_size is not None and vocab_size <= 1 << 16:
        return np.dtype("<u2")
    return np.dtype("<i4")


def default_cache_dir() -> pathlib.Path:
    root = os.environ.get("SKYRL_CACHE_DIR")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "skyrl"
    return base / "corpora"


def strip_suffix(prefix: str) -> str:
    """``data/c.json`` / ``data/c.idx`` / ``data/c.bin`` ... -> ``data/c``: users may name any part."""
    for suffix in (HEADER_SUFFIX, TOKENS_SUFFIX, INDEX_SUFFIX, MASK_SUFFIX, MEGATRON_BIN, MEGATRON_IDX):
        if prefix.endswith(suffix):
            return prefix[: -len(suffix)]
    return prefix


# -- mapped files ----------------------------------------------------------------------


def _map(path: str | os.PathLike, dtype: np.dtype, offset: int = 0, count: int = -1) -> np.ndarray:
    """A read-only ndarray over ``path`` (memory-mapped; no bytes read)."""
    size = os.path.getsize(path)
    if size == 0 or count == 0:
        return np.empty(0, dtype=dtype)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


class _LazyRemoteFile:
    """A remote file mirrored into a sparse local file, block by block, on demand."""

    def __init__(self, fs: Any, path: str, size: int, local: pathlib.Path, block_size: int):
        self.fs, self.path, self.size, self.local, self.block_size = fs, path, size, local, block_size
        self.n_blocks = -(-size // block_size)
        self.fetched_bytes = 0  # downloaded by this process
        if not local.exists() or local.stat().st_size != size:
            with open(local, "ab") as f:
                f.truncate(size)  # sparse: no disk used until written
        blocks = local.with_name(local.name + ".blocks")
        if not blocks.exists() or blocks.stat().st_size != self.n_blocks:
            with open(blocks, "ab") as f:
                f.truncate(self.n_blocks)
        self._fd = os.open(local, os.O_RDWR)
        self._present = np.memmap(blocks, dtype=np.uint8, mode="r+") if self.n_blocks else np.ones(0, np.uint8)

    def ensure(self, start: int, end: int) -> None:
        """Make bytes ``[start, end)`` present in the local file."""
        if end <= start:
            return
        b0, b1 = start // self.block_size, -(-end // self.block_size)
        present = self._present[b0:b1]
        if present.all():
            return
        missing = np.flatnonzero(present == 0) + b0
        # Fetch runs of consecutive missing blocks with one range request each.
        breaks = np.flatnonzero(np.diff(missing) != 1) + 1
        for run in np.split(missing, breaks):
            lo = int(run[0]) * self.block_size
            hi = min(self.size, (int(run[-1]) + 1) * self.block_size)
            data = self.fs.cat_file(self.path, start=lo, end=hi)
            if len(data) != hi - lo:
                raise OSError(f"short read of {self.path!r} bytes [{lo}, {hi}): got {len(data)} bytes")
            os.pwrite(self._fd, data, lo)
            self.fetched_bytes += len(data)
            self._present[int(run[0]) : int(run[-1]) + 1] = 1  # only after the bytes are written

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if isinstance(self._present, np.memmap):
            self._present.flush()


# -- the reader --------------------------------------------------------------------------


def _mmap_of(arr: np.ndarray | None) -> mmap.mmap | None:
    base: Any = arr
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


class Corpus:
    """A pretokenized corpus: ``n_docs`` documents of token ids, each with an optional loss mask.

    Build one with :func:`open_corpus`. Attributes: ``n_docs``, ``n_tokens``, ``lengths``
    (one per document, a memory-mapped ``int32`` view), ``meta`` (format, version, dtype,
    vocab_size, eos_id, tokenizer, ...). ``tokens(i)`` / ``mask(i)`` are zero-copy views.
    Usable as a context manager; ``close()`` releases the files (views already taken stay
    valid).
    """

    def __init__(
        self,
        *,
        tokens: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        mask: np.ndarray | None,
        meta: dict[str, Any],
        start_scale: int = 1,
        remote: dict[str, _LazyRemoteFile] | None = None,
        location: str = "",
        files: dict[str, str] | None = None,
    ):
        self._files = files or {}  # local paths of the tokens and mask files, for read_into
        self._fds: dict[str, int] = {}
        self._maps = [m for m in {id(m): m for m in map(_mmap_of, (tokens, mask, starts, lengths)) if m is not None}.values()]
        self.max_resident_bytes: int | None = DEFAULT_RESIDENT_BYTES
        self._reads = 0
        self._budget = ResidentBudget()  # its own, until it joins a reader's (_join)
        self._budget.add(self)
        self._tokens = tokens
        self._starts = starts  # int64; document i starts at element starts[i] // start_scale
        self._scale = start_scale
        self._mask = mask
        self._remote = remote or {}
        self.lengths = lengths
        self.n_docs = int(lengths.shape[0])
        self.n_tokens = int(meta["n_tokens"])
        self.meta = meta
        self.location = location

    # -- documents -----------------------------------------------------------------

    def _span(self, i: int) -> tuple[int, int]:
        i = operator.index(i)
        if i < 0:
            i += self.n_docs
        if not 0 <= i < self.n_docs:
            raise IndexError(f"document {i} out of range: the corpus has {self.n_docs} documents")
        start = int(self._starts[i]) // self._scale
        return start, start + int(self.lengths[i])

    def tokens(self, i: int) -> np.ndarray:
        """Document ``i``'s token ids: a read-only, zero-copy view of the mapped tokens file."""
        a, b = self._span(i)
        isz = self._tokens.dtype.itemsize
        if self._remote:
            self._remote["tokens"].ensure(a * isz, b * isz)
        self._touch()
        return self._tokens[a:b]

    def mask(self, i: int) -> np.ndarray | None:
        """Document ``i``'s loss mask (``uint8``, 1 = trains), or None when every token trains."""
        if self._mask is None:
            return None
        a, b = self._span(i)
        if "mask" in self._remote:
            self._remote["mask"].ensure(a, b)
        self._touch()
        return self._mask[a:b]

    def read_into(self, i: int, tokens_out: np.ndarray, mask_out: np.ndarray | None = None) -> int:
        """Copy document ``i``'s ids into ``tokens_out[:n]`` (and its mask into ``mask_out[:n]``,
        ones when the corpus has none) with ``pread``; returns ``n``. No page of the corpus is
        mapped into the process (its RSS does not grow), at the cost of one copy. ``tokens_out``
        must be a C-contiguous array of the corpus's token dtype (``meta["dtype"]``), ``mask_out``
        of ``uint8``."""
        a, b = self._span(i)
        n = b - a
        isz = self._tokens.dtype.itemsize
        if tokens_out.dtype != self._tokens.dtype:
            raise TypeError(f"tokens_out has dtype {tokens_out.dtype}, the corpus's tokens are {self._tokens.dtype}")
        if self._remote:
            self._remote["tokens"].ensure(a * isz, b * isz)
        self._pread("tokens", tokens_out[:n], a * isz)
        if mask_out is not None:
            if self._mask is None:
                mask_out[:n] = 1
            else:
                if "mask" in self._remote:
                    self._remote["mask"].ensure(a, b)
                self._pread("mask", mask_out[:n], a)
        return n

    def read_pieces_into(
        self, docs: Any, starts: Any, ends: Any, at: Any, tokens_out: np.ndarray, mask_out: np.ndarray | None = None
    ) -> int:
        """Copy many pieces with ``pread``, as :meth:`read_into` copies one document: for
        every ``k``, tokens ``starts[k]:ends[k]`` of document ``docs[k]`` into
        ``tokens_out[at[k]:at[k] + ends[k] - starts[k]]`` (and the mask's same range into
        ``mask_out``, ones when the corpus has none); returns the tokens copied. Pieces that
        follow each other both in the corpus and in the output (documents read in order)
        are copied by one read. ``tokens_out``: a C-contiguous array of the corpus's token
        dtype; ``mask_out``: ``uint8``. The ``sft`` job packs its steps through this (the
        :class:`skyrl_host.interfaces.CorpusPieces` capability)."""
        docs = np.asarray(docs, dtype=np.int64).reshape(-1)
        k = docs.shape[0]
        if not len(starts) == len(ends) == len(at) == k:
            raise ValueError(f"docs, starts, ends and at differ in length: {k}, {len(starts)}, {len(ends)}, {len(at)}")
        if tokens_out.dtype != self._tokens.dtype:
            raise TypeError(f"tokens_out has dtype {tokens_out.dtype}, the corpus's tokens are {self._tokens.dtype}")
        if k == 0:
            return 0
        try:
            lengths = self.lengths.take(docs, mode="raise").tolist()
            firsts = self._starts.take(docs, mode="raise").tolist()
        except IndexError:
            lengths = firsts = []
        docs_l = docs.tolist()
        if len(lengths) != k or min(docs_l) < 0:
            bad = next(d for d in docs_l if not 0 <= d < self.n_docs)
            raise IndexError(f"document {bad} out of range: the corpus has {self.n_docs} documents")
        size = min(tokens_out.shape[0], tokens_out.shape[0] if mask_out is None else mask_out.shape[0])
        scale = self._scale
        # (source, destination, count) runs, in tokens; a piece that continues the previous
        # one both in the corpus and in the output joins its run (documents read in order)
        runs: list[list[int]] = []
        total = 0
        for j, (a, b, o, length, first) in enumerate(zip(np.asarray(starts).tolist(), np.asarray(ends).tolist(),
                                                          np.asarray(at).tolist(), lengths, firsts)):
            if not 0 <= a <= b <= length:
                raise ValueError(f"piece {j}: tokens [{a}, {b}) of document {docs_l[j]}, which has {length}")
            m = b - a
            if o < 0 or o + m > size:
                raise ValueError(f"piece {j}: output [{o}, {o + m}) falls outside tokens_out or mask_out ({size})")
            src = first // scale + a
            total += m
            if runs:
                last = runs[-1]
                if last[0] + last[2] == src and last[1] + last[2] == o:
                    last[2] += m
                    continue
            runs.append([src, o, m])
        isz = self._tokens.dtype.itemsize
        if self._remote:
            for src, _, m in runs:
                self._remote["tokens"].ensure(src * isz, (src + m) * isz)
        self._pread_runs("tokens", tokens_out, runs, isz)
        if mask_out is not None:
            if self._mask is None:
                for _, o, m in runs:
                    mask_out[o : o + m] = 1
            else:
                if "mask" in self._remote:
                    for src, _, m in runs:
                        self._remote["mask"].ensure(src, src + m)
                self._pread_runs("mask", mask_out, runs, 1)
        return total

    def _pread_runs(self, part: str, out: np.ndarray, runs: list[list[int]], isz: int) -> None:
        """``out[o:o+m] = part's elements [s, s+m)`` for every run (s, o, m), by ``preadv``."""
        fd = self._fds.get(part)
        if fd is None:
            fd = self._fds[part] = os.open(self._files[part], os.O_RDONLY)
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("the output array is read-only")
        preadv = os.preadv
        for s, o, m in runs:
            want = m * isz
            got = preadv(fd, [view[o * isz : o * isz + want]], s * isz)
            if got != want:  # a short read (a signal, a huge run): read the run again, to the end
                self._pread(part, out[o : o + m], s * isz)

    def _pread(self, part: str, out: np.ndarray, offset: int) -> None:
        fd = self._fds.get(part)
        if fd is None:
            fd = self._fds[part] = os.open(self._files[part], os.O_RDONLY)
        view = memoryview(out).cast("B")
        if view.readonly:
            raise ValueError("the output array is read-only")
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"short read of {self._files[part]!r} at byte {offset + done}")
            done += got

    def _touch(self) -> None:
        self._reads += 1
        if self._reads >= CHECK_EVERY and self.max_resident_bytes is not None:
            self._reads = 0
            self._budget.check(self.max_resident_bytes)

    def _join(self, budget: ResidentBudget) -> None:
        """Share ``budget`` (its pages are released with the other corpora's of it)."""
        self._budget.discard(self)
        self._budget = budget
        budget.add(self)

    def release_pages(self) -> None:
        """Drop the mapped files' pages from this process's page tables (its RSS); views stay
        valid and map their pages again when read. Done when the process's file-backed RSS
        grew by ``max_resident_bytes`` (None: never)."""
        for m in self._maps:
            if hasattr(m, "madvise") and not m.closed:
                m.madvise(mmap.MADV_DONTNEED)

    def __len__(self) -> int:
        return self.n_docs

    @property
    def dtype(self) -> np.dtype:
        """The token dtype (``uint16`` or ``int32`` for ours; Megatron's may be others)."""
        return self._tokens.dtype

    @property
    def has_mask(self) -> bool:
        return self._mask is not None

    @property
    def eos_id(self) -> int | None:
        return self.meta.get("eos_id")

    @property
    def fetched_bytes(self) -> int:
        """Bytes this process downloaded lazily (tokens and mask) for a remote corpus; 0 if local."""
        return sum(f.fetched_bytes for f in self._remote.values())

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        self._budget.discard(self)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        for f in self._remote.values():
            f.close()
        self._remote = {}

    def __enter__(self) -> "Corpus":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Corpus({self.location!r}, format={self.meta.get('format')!r}, n_docs={self.n_docs}, n_tokens={self.n_tokens})"


def _corrupt(where: str, message: str) -> UserError:
    return UserError(Problem(message, file=where))


def _parse_header(raw: bytes, where: str) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _corrupt(where, f"not a corpus header (invalid JSON: {exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise _corrupt(where, f"not a {FORMAT} header (no \"format\": {FORMAT!r})")
    if header.get("version") != VERSION:
        raise _corrupt(where, f"format version {header.get('version')!r}; this reader reads version {VERSION}")
    if header.get("dtype") not in TOKEN_DTYPES:
        raise _corrupt(where, f"unknown token dtype {header.get('dtype')!r}; expected one of {TOKEN_DTYPES}")
    return header


def _expected_sizes(header: dict[str, Any]) -> dict[str, int]:
    n, t = int(header["n_docs"]), int(header["n_tokens"])
    sizes = {"tokens": t * np.dtype(header["dtype"]).itemsize, "index": 8 * (n + 1) + 4 * n}
    if header.get("mask"):
        sizes["mask"] = t
    return sizes


def _check_sizes(header: dict[str, Any], actual: dict[str, int | None], prefix: str) -> None:
    for part, want in _expected_sizes(header).items():
        got = actual.get(part)
        suffix = {"tokens": TOKENS_SUFFIX, "index": INDEX_SUFFIX, "mask": MASK_SUFFIX}[part]
        if got is None:
            raise _corrupt(prefix + suffix, "missing (the header names it; the dataset is incomplete)")
        if got != want:
            raise _corrupt(
                prefix + suffix,
                f"holds {got} bytes, the header says {want}: truncated or rewritten since the header was written",
            )


def _our_corpus(header: dict[str, Any], tokens: str, index: str, mask: str | None, where: str, **kw: Any) -> Corpus:
    n = int(header["n_docs"])
    dtype = np.dtype(header["dtype"]).newbyteorder("<")
    starts = _map(index, np.dtype("<i8"), 0, n + 1)
    lengths = _map(index, np.dtype("<i4"), 8 * (n + 1), n) if n else np.empty(0, np.int32)
    meta = {k: v for k, v in header.items() if k != "files"}
    meta["has_mask"] = bool(header.get("mask"))
    return Corpus(
        tokens=_map(tokens, dtype),
        starts=starts,
        lengths=lengths,
        mask=_map(mask, np.dtype(np.uint8)) if mask else None,
        meta=meta,
        location=where,
        files={"tokens": tokens, **({"mask": mask} if mask else {})},
        **kw,
    )


def _megatron_header(raw: bytes, where: str) -> tuple[np.dtype, int, int, int]:
    """(dtype, sequence count, document count, byte offset of the arrays) from a .idx's first 34 bytes."""
    if len(raw) < 34 or raw[:9] != MEGATRON_MAGIC:
        raise _corrupt(where, "not a Megatron index (.idx): bad magic bytes")
    (version,) = struct.unpack("<Q", raw[9:17])
    if version != 1:
        raise _corrupt(where, f"Megatron index version {version}; this reader reads version 1")
    code = raw[17]
    if code not in MEGATRON_DTYPES:
        raise _corrupt(where, f"unknown Megatron dtype code {code}")
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    return np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<"), n_seq, n_doc, 34


def _megatron_corpus(idx: str, bin_: str, where: str, **kw: Any) -> Corpus:
    with open(idx, "rb") as f:
        dtype, n_seq, n_doc, off = _megatron_header(f.read(34), idx)
    need = off + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if os.path.getsize(idx) < need:
        raise _corrupt(idx, f"holds {os.path.getsize(idx)} bytes, its counts need {need}: truncated")
    lengths = _map(idx, np.dtype("<i4"), off, n_seq) if n_seq else np.empty(0, np.int32)
    pointers = _map(idx, np.dtype("<i8"), off + 4 * n_seq, n_seq) if n_seq else np.empty(0, np.int64)
    tokens = _map(bin_, dtype)
    # The last sequence's end bounds the token count: O(1), no pass over the lengths.
    n_tokens = (int(pointers[-1]) // dtype.itemsize + int(lengths[-1])) if n_seq else 0
    if n_tokens > tokens.shape[0]:
        raise _corrupt(bin_, f"holds {tokens.shape[0]} tokens, the index needs {n_tokens}: truncated")
    meta = {
        "format": "megatron",
        "version": 1,
        "dtype": dtype.name,
        "n_docs": n_seq,
        "n_tokens": n_tokens,
        "megatron_documents": max(n_doc - 1, 0),
        "vocab_size": None,
        "eos_id": None,
        "tokenizer": None,
        "mask": None,
        "has_mask": False,
    }
    return Corpus(
        tokens=tokens,
        starts=pointers,
        lengths=lengths,
        mask=None,
        meta=meta,
        start_scale=dtype.itemsize,
        location=where,
        files={"tokens": bin_},
        **kw,
    )


def open_corpus(
    prefix_or_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_resident_bytes: int | None = DEFAULT_RESIDENT_BYTES,
) -> Corpus:
    """Open the corpus at ``prefix_or_url`` (a path prefix or an fsspec URL; any of its files'
    names works too), in our format or Megatron's, whichever is there.

    A remote corpus is read through a local cache (see the module docstring):
    ``storage_options`` go to fsspec, ``cache_dir`` holds the cached parts, ``block_size``
    is the unit of lazy fetches. ``max_resident_bytes``: how much may be read between two
    :meth:`Corpus.release_pages` (None: never release). Missing or inconsistent files raise
    :class:`UserError`. The corpus has a :class:`ResidentBudget` of its own; open
    several through one budget (``ResidentBudget().open(...)``) to release them together.
    """
    return ResidentBudget().open(
        prefix_or_url, storage_options=storage_options, cache_dir=cache_dir, block_size=block_size,
        max_resident_bytes=max_resident_bytes,
    )


def _open(prefix_or_url: str, storage_options: dict[str, Any] | None, cache_dir: Any, block_size: int) -> Corpus:
    prefix = strip_suffix(prefix_or_url)
    if "://" in prefix or "::" in prefix:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        fs, path = fsspec.core.url_to_fs(prefix, **(storage_options or {}))
        if not isinstance(fs, LocalFileSystem):
            try:
                return _open_remote(fs, path, prefix, cache_dir, block_size)
            except UserError:
                raise
            except Exception as exc:  # no or wrong credentials, an endpoint that does not answer, ...
                _raise_remote_error(prefix, exc, storage_options)
                raise
        prefix = path
    return _open_local(prefix)


def _open_local(prefix: str) -> Corpus:
    header_path = prefix + HEADER_SUFFIX
    if os.path.exists(header_path):
        with open(header_path, "rb") as f:
            header = _parse_header(f.read(), header_path)
        parts = {"tokens": prefix + TOKENS_SUFFIX, "index": prefix + INDEX_SUFFIX, "mask": prefix + MASK_SUFFIX}
        _check_sizes(header, {k: os.path.getsize(p) if os.path.exists(p) else None for k, p in parts.items()}, prefix)
        return _our_corpus(header, parts["tokens"], parts["index"], parts["mask"] if header.get("mask") else None, prefix)
    idx, bin_ = prefix + MEGATRON_IDX, prefix + MEGATRON_BIN
    if os.path.exists(idx) and os.path.exists(bin_):
        return _megatron_corpus(idx, bin_, prefix)
    raise _not_found(prefix, [p for p in (idx, bin_) if os.path.exists(p)], os.path.exists(prefix + TOKENS_SUFFIX))


def _not_found(prefix: str, megatron_parts: list[str], torn: bool) -> UserError:
    if torn:
        msg = f"{prefix}{TOKENS_SUFFIX} exists but {prefix}{HEADER_SUFFIX} does not: an unfinished write (run it again)"
    elif megatron_parts:
        msg = f"found {megatron_parts[0]} but not its partner ({MEGATRON_IDX} and {MEGATRON_BIN} come in pairs)"
    else:
        msg = (
            f"no corpus at this prefix: expected {prefix}{HEADER_SUFFIX} (skyrl data tokenize) "
            f"or {prefix}{MEGATRON_IDX} + {prefix}{MEGATRON_BIN} (Megatron)"
        )
    return UserError(Problem(msg, file=prefix))


def _fetch_whole(fs: Any, path: str, local: pathlib.Path, size: int) -> None:
    """Download ``path`` to ``local`` unless a complete copy is there (renamed into place)."""
    if local.exists() and local.stat().st_size == size:
        return
    tmp = local.with_name(f"{local.name}.{os.getpid()}.tmp")
    with fs.open(path, "rb") as src, open(tmp, "wb") as dst:
        while chunk := src.read(16 << 20):
            dst.write(chunk)
    if tmp.stat().st_size != size:
        tmp.unlink()
        raise OSError(f"downloaded {path!r}: expected {size} bytes")
    os.replace(tmp, local)


def _raise_remote_error(url: str, exc: BaseException, storage_options: Mapping[str, Any] | None = None) -> None:
    """Raise the user's mistake behind ``exc`` (see :mod:`skyrl_toolkit.remote_errors`: no or
    wrong credentials, a missing bucket, an unreachable endpoint, an option the filesystem
    does not take) as one line naming ``url`` and the fix; return if it is none of those."""
    from skyrl_toolkit.remote_errors import endpoint_of, remote_message

    if isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc):  # s3fs: on first use
        message = f"the filesystem of {url} refuses these storage_options: {' '.join(str(exc).split())}"
    else:
        message = remote_message(url, exc, endpoint=endpoint_of(dict(storage_options or {})))
    if message is not None:
        raise UserError(Problem(message)) from None  # the message names the URL


def _remote_size(fs: Any, path: str) -> int | None:
    try:
        return int(fs.info(path)["size"])
    except FileNotFoundError:
        return None


def _open_remote(fs: Any, path: str, url: str, cache_dir: Any, block_size: int) -> Corpus:
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        raw = fs.cat_file(path + HEADER_SUFFIX)
    except FileNotFoundError as exc:
        _raise_remote_error(url, exc)  # a missing bucket is a FileNotFoundError too
        raw = None
    if raw is not None:
        header = _parse_header(raw, url + HEADER_SUFFIX)
        sizes = {k: _remote_size(fs, path + s) for k, s in (("tokens", TOKENS_SUFFIX), ("index", INDEX_SUFFIX), ("mask", MASK_SUFFIX))}
        _check_sizes(header, sizes, url)
        key = hashlib.sha256(url.encode() + b"\0" + raw).hexdigest()[:20]
        local = root / key
        local.mkdir(parents=True, exist_ok=True)
        _fetch_whole(fs, path + INDEX_SUFFIX, local / "index", int(sizes["index"]))  # type: ignore[arg-type]
        remote = {"tokens": _LazyRemoteFile(fs, path + TOKENS_SUFFIX, int(sizes["tokens"]), local / "tokens", block_size)}  # type: ignore[arg-type]
        if header.get("mask"):
            remote["mask"] = _LazyRemoteFile(fs, path + MASK_SUFFIX, int(sizes["mask"]), local / "mask", block_size)  # type: ignore[arg-type]
        return _our_corpus(
            header, str(local / "tokens"), str(local / "index"), str(local / "mask") if "mask" in remote else None, url, remote=remote
        )
    try:
        idx_info, bin_info = fs.info(path + MEGATRON_IDX), fs.info(path + MEGATRON_BIN)
    except FileNotFoundError:
        raise _not_found(url, [], False) from None
    version = json.dumps([url, _version_tag(idx_info), _version_tag(bin_info)], sort_keys=True, default=str)
    local = root / hashlib.sha256(version.encode()).hexdigest()[:20]
    local.mkdir(parents=True, exist_ok=True)
    _fetch_whole(fs, path + MEGATRON_IDX, local / "idx", int(idx_info["size"]))
    lazy = _LazyRemoteFile(fs, path + MEGATRON_BIN, int(bin_info["size"]), local / "bin", block_size)
    return _megatron_corpus(str(local / "idx"), str(local / "bin"), url, remote={"tokens": lazy})


def _version_tag(info: dict[str, Any]) -> list[Any]:
    """What identifies one version of a remote file: its size and whatever the store reports."""
    return [info.get("size")] + [info.get(k) for k in ("ETag", "etag", "mtime", "LastModified", "created") if k in info]


# -- the writer -------------------------------------------------------------------------


class CorpusWriter:
    """Writes a corpus in our format, document by document or in batches, streaming.

    ::

        with CorpusWriter("data/c", vocab_size=len(tok), eos_id=tok.eos_token_id, tokenizer="Qwen/Qwen3-8B") as w:
            w.add(ids, mask)            # one document
            w.add_batch(flat, lengths)  # many documents at once
        # the header is written on a clean exit of the block; an exception leaves no header

    ``with_mask``: whether the corpus has a loss mask (default: it has one if ``add`` is ever
    given a mask; set it up front to avoid writing a mask of ones for earlier documents).
    Existing files at the prefix are replaced (the old header is removed first, so a crash
    never leaves an old header over new data). Nothing but the document lengths of the
    current batch is held in memory.
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        *,
        vocab_size: int | None,
        eos_id: int | None = None,
        tokenizer: str | None = None,
        with_mask: bool | None = None,
        dtype: str | np.dtype | None = None,
        extra: dict[str, Any] | None = None,
    ):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<") if dtype is not None else token_dtype(vocab_size)
        if self.dtype.name not in TOKEN_DTYPES:
            raise ValueError(f"token dtype must be one of {TOKEN_DTYPES}, got {self.dtype.name}")
        self.vocab_size, self.eos_id, self.tokenizer = vocab_size, eos_id, tokenizer
        self.extra = dict(extra or {})
        self.with_mask = with_mask
        header = pathlib.Path(self.prefix + HEADER_SUFFIX)
        header.parent.mkdir(parents=True, exist_ok=True)
        header.unlink(missing_ok=True)
        self._tokens = open(self.prefix + TOKENS_SUFFIX, "wb")
        self._lengths = open(self.prefix + INDEX_SUFFIX + ".lengths.tmp", "wb")
        self._mask: BinaryIO | None = open(self.prefix + MASK_SUFFIX, "wb") if with_mask else None
        if not with_mask:
            pathlib.Path(self.prefix + MASK_SUFFIX).unlink(missing_ok=True)
        self._crc = {"tokens": 0, "mask": 0}
        self.n_docs = 0
        self.n_tokens = 0
        self._closed = False

    def add(self, tokens: Any, mask: Any = None) -> None:
        """Append one document (``tokens``: ids; ``mask``: 0/1 per token or None = all train)."""
        arr = np.asarray(tokens)
        self.add_batch(arr, np.array([arr.shape[0]], np.int64), None if mask is None else np.asarray(mask))

    def add_batch(self, tokens: Any, lengths: Any, mask: Any = None) -> None:
        """Append ``len(lengths)`` documents whose ids lie end to end in ``tokens``."""
        ids = np.asarray(tokens)
        lens = np.asarray(lengths, dtype=np.int64)
        if ids.ndim != 1 or lens.ndim != 1:
            raise ValueError("tokens and lengths must be 1-D")
        if int(lens.sum()) != ids.shape[0] or (lens < 0).any():
            raise ValueError(f"lengths sum to {int(lens.sum())}, but {ids.shape[0]} tokens were given")
        if ids.shape[0] and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids out of range for {self.dtype.name}: [{int(ids.min())}, {int(ids.max())}]")
        if self.vocab_size is not None and ids.shape[0] and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(ids.max())} >= vocab_size {self.vocab_size}")
        if mask is not None and self._mask is None:
            if self.with_mask is False:
                raise ValueError("this writer was made with with_mask=False, but a mask was given")
            self._start_mask()
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._tokens.write(data)
        self._crc["tokens"] = zlib.crc32(data, self._crc["tokens"])
        self._lengths.write(lens.astype("<i4").tobytes())
        if self._mask is not None:
            m = np.ones(ids.shape[0], np.uint8) if mask is None else np.asarray(mask)
            if m.shape != ids.shape:
                raise ValueError(f"mask has shape {m.shape}, tokens {ids.shape}")
            mb = (m != 0).astype(np.uint8).tobytes()
            self._mask.write(mb)
            self._crc["mask"] = zlib.crc32(mb, self._crc["mask"])
        self.n_docs += lens.shape[0]
        self.n_tokens += ids.shape[0]

    def _start_mask(self) -> None:
        self._mask = open(self.prefix + MASK_SUFFIX, "wb")
        ones = np.ones(min(self.n_tokens, 1 << 24), np.uint8).tobytes()
        left = self.n_tokens
        while left:  # earlier documents trained on every token
            chunk = ones[: min(left, len(ones))]
            self._mask.write(chunk)
            self._crc["mask"] = zlib.crc32(chunk, self._crc["mask"])
            left -= len(chunk)

    def close(self) -> dict[str, Any]:
        """Finish: write the index, sync the data, then the header (atomically). Returns the header."""
        if self._closed:
            raise RuntimeError("this writer is closed")
        self._closed = True
        lengths_tmp = self._lengths.name
        self._lengths.close()
        index_path = self.prefix + INDEX_SUFFIX
        with open(index_path, "wb") as index:
            total = 0
            index.write(np.zeros(1, "<i8").tobytes())
            for lens in _chunks(lengths_tmp, np.dtype("<i4")):
                offs = np.cumsum(lens, dtype=np.int64) + total
                total = int(offs[-1])
                index.write(offs.astype("<i8").tobytes())
            with open(lengths_tmp, "rb") as src:
                while chunk := src.read(16 << 20):
                    index.write(chunk)
            index.flush()
            os.fsync(index.fileno())
        os.unlink(lengths_tmp)
        files: dict[str, Any] = {}
        for part, f in (("tokens", self._tokens), ("mask", self._mask)):
            if f is None:
                continue
            f.flush()
            os.fsync(f.fileno())
            f.close()
            files[part] = {"bytes": os.path.getsize(f.name), "crc32": self._crc[part]}
        files["index"] = {"bytes": os.path.getsize(index_path)}
        header = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "n_docs": self.n_docs,
            "n_tokens": self.n_tokens,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer": self.tokenizer,
            "mask": "uint8" if self._mask is not None else None,
            **self.extra,
            "files": files,
        }
        write_atomically(self.prefix + HEADER_SUFFIX, (json.dumps(header, indent=1) + "\n").encode())
        return header

    def abort(self) -> None:
        """Stop without a header (the partial files stay; they are never read as a corpus)."""
        if not self._closed:
            self._closed = True
            for f in (self._tokens, self._lengths, self._mask):
                if f is not None:
                    f.close()

    def __enter__(self) -> "CorpusWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _chunks(path: str, dtype: np.dtype, n: int = 1 << 22) -> Any:
    with open(path, "rb") as f:
        while data := f.read(n * dtype.itemsize):
            yield np.frombuffer(data, dtype=dtype)


def write_atomically(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
