"""The corpus reader and writer: our format, Megatron's (written by megatron-core itself),
torn writes, and remote corpora read lazily through the local cache (fsspec memory://
and a real S3 API: moto's server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from skyrl_datasets.corpus import CorpusWriter, open_corpus
from skyrl_host.errors import UserError


def random_docs(n: int, vocab: int, seed: int = 0, max_len: int = 60) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(n)]
    masks = [rng.integers(0, 2, d.shape[0]).astype(np.uint8) for d in docs]
    return docs, masks


def write(prefix: pathlib.Path, docs, masks=None, vocab: int = 1000, **kw) -> dict:
    with CorpusWriter(prefix, vocab_size=vocab, eos_id=1, tokenizer="tiny", **kw) as w:
        half = len(docs) // 2
        for i in range(half):  # one by one, then the rest as one batch
            w.add(docs[i], None if masks is None else masks[i])
        if len(docs) > half:
            w.add_batch(
                np.concatenate(docs[half:]),
                [d.shape[0] for d in docs[half:]],
                None if masks is None else np.concatenate(masks[half:]),
            )
    return json.loads(pathlib.Path(f"{prefix}.json").read_text())


def test_round_trip_ids_masks_and_meta(tmp_path) -> None:
    docs, masks = random_docs(200, 1000)
    write(tmp_path / "c", docs, masks)
    with open_corpus(str(tmp_path / "c")) as c:
        assert (c.n_docs, c.n_tokens) == (200, sum(d.shape[0] for d in docs))
        assert c.lengths.tolist() == [d.shape[0] for d in docs]
        for i in range(200):
            assert c.tokens(i).tolist() == docs[i].tolist()
            assert c.mask(i).tolist() == masks[i].tolist()
        assert c.tokens(-1).tolist() == docs[-1].tolist()
        assert c.meta["format"] == "skyrl-corpus" and c.meta["version"] == 1
        assert (c.meta["dtype"], c.meta["vocab_size"], c.meta["eos_id"], c.meta["tokenizer"]) == ("uint16", 1000, 1, "tiny")
        with pytest.raises(IndexError):
            c.tokens(200)
    # any of the files' names opens it too
    assert open_corpus(str(tmp_path / "c.json")).n_docs == 200


def test_views_are_zero_copy_and_read_only(tmp_path) -> None:
    docs, masks = random_docs(20, 1000)
    write(tmp_path / "c", docs, masks)
    c = open_corpus(str(tmp_path / "c"))
    t = c.tokens(3)
    assert not t.flags.owndata and not t.flags.writeable
    base = t
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert not isinstance(base, (bytes, bytearray))  # a mapping, not a copy read into memory
    with pytest.raises(ValueError):
        t[0] = 5


def test_no_mask_means_every_token_trains(tmp_path) -> None:
    docs, _ = random_docs(10, 1000)
    header = write(tmp_path / "c", docs)
    assert header["mask"] is None and not (tmp_path / "c.mask").exists()
    c = open_corpus(str(tmp_path / "c"))
    assert c.mask(0) is None and not c.has_mask


def test_a_mask_given_later_marks_earlier_documents_as_training(tmp_path) -> None:
    docs, masks = random_docs(6, 1000)
    with CorpusWriter(tmp_path / "c", vocab_size=1000) as w:
        w.add(docs[0])
        w.add(docs[1], masks[1])
    c = open_corpus(str(tmp_path / "c"))
    assert c.mask(0).tolist() == [1] * docs[0].shape[0] and c.mask(1).tolist() == masks[1].tolist()


def test_large_vocabulary_uses_int32(tmp_path) -> None:
    docs = [np.array([0, 65535, 65536, 151_000]), np.array([7])]
    header = write(tmp_path / "c", docs, vocab=152_000)
    assert header["dtype"] == "int32"
    c = open_corpus(str(tmp_path / "c"))
    assert c.tokens(0).dtype == np.int32 and c.tokens(0).tolist() == [0, 65535, 65536, 151_000]


def test_writer_refuses_ids_outside_the_vocabulary(tmp_path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        with CorpusWriter(tmp_path / "c", vocab_size=100) as w:
            w.add([5, 100])
    assert not (tmp_path / "c.json").exists()


def test_empty_documents_and_empty_corpus(tmp_path) -> None:
    write(tmp_path / "e", [np.array([], np.int64), np.array([3, 4]), np.array([], np.int64)])
    c = open_corpus(str(tmp_path / "e"))
    assert c.lengths.tolist() == [0, 2, 0] and c.tokens(0).shape == (0,) and c.tokens(1).tolist() == [3, 4]
    write(tmp_path / "z", [])
    z = open_corpus(str(tmp_path / "z"))
    assert (z.n_docs, z.n_tokens) == (0, 0)


def test_torn_write_is_never_a_dataset(tmp_path) -> None:
    docs, masks = random_docs(30, 1000)
    w = CorpusWriter(tmp_path / "c", vocab_size=1000)
    for d, m in zip(docs, masks):
        w.add(d, m)
    # the writer died before close(): data files exist, no header
    with pytest.raises(UserError, match="unfinished write"):
        open_corpus(str(tmp_path / "c"))
    w.close()
    assert open_corpus(str(tmp_path / "c")).n_docs == 30
    # rewriting removes the old header first: a crash mid-rewrite leaves no stale header
    w2 = CorpusWriter(tmp_path / "c", vocab_size=1000)
    w2.add(docs[0])
    assert not (tmp_path / "c.json").exists()
    w2.abort()
    # a truncated tokens file under a complete header is refused by its size
    write(tmp_path / "d", docs, masks)
    with open(tmp_path / "d.tokens", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UserError, match="truncated or rewritten"):
        open_corpus(str(tmp_path / "d"))


def test_missing_corpus_is_a_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match="no corpus at this prefix"):
        open_corpus(str(tmp_path / "nothing"))
    (tmp_path / "half.idx").write_bytes(b"")
    with pytest.raises(UserError, match="in pairs"):
        open_corpus(str(tmp_path / "half"))


def test_open_is_constant_time(tmp_path) -> None:
    # 20M tokens; opening maps files and reads a few hundred bytes
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 2000, 20_000)
    with CorpusWriter(tmp_path / "big", vocab_size=50_000) as w:
        w.add_batch(rng.integers(0, 50_000, int(lens.sum()), dtype=np.uint16), lens)
    t = time.perf_counter()
    c = open_corpus(str(tmp_path / "big"))
    assert time.perf_counter() - t < 0.1
    assert c.tokens(19_999).shape[0] == lens[-1]


def read_all(c) -> tuple[list[list[int]], list[list[int]]]:
    """Every document through read_into (pread into caller buffers)."""
    longest = int(np.max(c.lengths)) if c.n_docs else 0
    tok, mask = np.empty(longest + 3, c.dtype), np.empty(longest + 3, np.uint8)
    ids, masks = [], []
    for i in range(c.n_docs):
        n = c.read_into(i, tok, mask)
        ids.append(tok[:n].tolist())
        masks.append(mask[:n].tolist())
    return ids, masks


def test_read_into_copies_what_the_views_show(tmp_path) -> None:
    docs, masks = random_docs(300, 60_000, max_len=200)
    write(tmp_path / "c", docs, masks, vocab=60_000)
    c = open_corpus(str(tmp_path / "c"))
    assert read_all(c) == ([d.tolist() for d in docs], [m.tolist() for m in masks])
    with pytest.raises(TypeError, match="dtype"):
        c.read_into(0, np.empty(500, np.int32))
    write(tmp_path / "nomask", docs[:5], vocab=60_000)
    assert read_all(open_corpus(str(tmp_path / "nomask")))[1] == [[1] * d.shape[0] for d in docs[:5]]


def pieces_for(c, rng, k: int):
    """Random pieces of ``c``, some whole documents read in order (one run), some ranges."""
    docs = rng.integers(0, c.n_docs, k)
    docs[k // 2 : k // 2 + 5] = np.arange(5) + 10  # consecutive documents: joined into one read
    lengths = np.asarray(c.lengths)[docs]
    starts = np.where(rng.random(k) < 0.5, 0, (rng.random(k) * lengths).astype(np.int64))
    ends = np.where(rng.random(k) < 0.5, lengths, starts + ((lengths - starts) * rng.random(k)).astype(np.int64))
    starts[k // 2 : k // 2 + 5], ends[k // 2 : k // 2 + 5] = 0, lengths[k // 2 : k // 2 + 5]
    at = np.zeros(k, np.int64)
    np.cumsum((ends - starts)[:-1], out=at[1:])
    return docs, starts, ends, at


def expected_pieces(c, docs, starts, ends):
    toks = np.concatenate([c.tokens(int(d))[a:b] for d, a, b in zip(docs, starts, ends)])
    masks = [c.mask(int(d)) for d in docs]
    mask = np.concatenate([np.ones(b - a, np.uint8) if m is None else m[a:b] for m, a, b in zip(masks, starts, ends)])
    return toks, mask


@pytest.mark.parametrize("vocab,with_mask", [(60_000, True), (100_000, False)])
def test_read_pieces_into_copies_what_the_views_show(tmp_path, vocab, with_mask) -> None:
    docs, masks = random_docs(300, vocab, max_len=200)
    write(tmp_path / "c", docs, masks if with_mask else None, vocab=vocab)
    c = open_corpus(str(tmp_path / "c"))
    rng = np.random.default_rng(1)
    d, a, b, at = pieces_for(c, rng, 60)
    n = int((b - a).sum())
    tok, mask = np.full(n, 7, c.dtype), np.full(n, 7, np.uint8)
    assert c.read_pieces_into(d, a, b, at, tok, mask) == n
    want_tok, want_mask = expected_pieces(c, d, a, b)
    assert tok.tolist() == want_tok.tolist() and mask.tolist() == want_mask.tolist()
    assert c.read_pieces_into([], [], [], [], tok, mask) == 0
    with pytest.raises(TypeError, match="dtype"):
        c.read_pieces_into(d, a, b, at, np.empty(n, np.int64), mask)
    with pytest.raises(IndexError, match="document 300 out of range"):
        c.read_pieces_into([300], [0], [1], [0], tok, mask)
    with pytest.raises(IndexError, match="document -1 out of range"):
        c.read_pieces_into([-1], [0], [1], [0], tok, mask)
    with pytest.raises(ValueError, match="piece 0: tokens"):
        c.read_pieces_into([0], [0], [int(c.lengths[0]) + 1], [0], tok, mask)
    with pytest.raises(ValueError, match="falls outside"):
        c.read_pieces_into([0], [0], [int(c.lengths[0])], [n], tok, mask)


def rss_file_mib() -> float:
    if not sys.platform.startswith("linux"):
        pytest.skip("RssFile of /proc/self/status is Linux's")  # the OS, not a missing component
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    pytest.fail("no RssFile in /proc/self/status (Linux has it since 4.5)")


@pytest.mark.parametrize("limit", [4 << 20, None])
def test_reading_everything_keeps_the_rss_flat(tmp_path, limit) -> None:
    # 48 MiB of tokens and 24 MiB of mask, read whole: the mapped pages this process holds
    # stay near the limit when it is set, and grow to the corpus's size when it is not.
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 4000, 12_000)
    n = int(lens.sum())
    with CorpusWriter(tmp_path / "c", vocab_size=60_000) as w:
        w.add_batch(rng.integers(0, 60_000, n, dtype=np.uint16), lens, rng.integers(0, 2, n, dtype=np.uint8))
    size_mib = n * 3 / 2**20
    c = open_corpus(str(tmp_path / "c"), max_resident_bytes=limit)
    before = rss_file_mib()
    total = 0
    for i in range(c.n_docs):
        total += int(c.tokens(i)[-1]) + int(c.mask(i)[0])
    grown = rss_file_mib() - before
    if limit is None:
        assert grown > 0.8 * size_mib
    else:
        assert grown < 16, f"{grown:.1f} MiB mapped after reading {size_mib:.0f} MiB"
    assert c.tokens(5).tolist() == c.tokens(5).tolist()  # views stay readable after a release


# -- Megatron's indexed dataset, written by megatron-core's own builder ----------------------


MEGATRON_DOCS = {"uint16": random_docs(40, 60_000, seed=3)[0], "int32": random_docs(40, 200_000, seed=4)[0]}


def megatron_expected(dtype: str) -> list[np.ndarray]:
    """What the corpus holds: Megatron sequences; document 3 was added as two sequences."""
    docs = MEGATRON_DOCS[dtype]
    return docs[:3] + [docs[3], docs[3]] + docs[4:]


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory) -> pathlib.Path:
    """Megatron corpora written by megatron-core's own IndexedDatasetBuilder, and what its own
    IndexedDataset reads back, made in one subprocess (megatron-core imports torch and takes
    seconds to import; the reader under test never imports it)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        pytest.fail("megatron-core is not installed: pip install -e 'plugins/datasets[test]' (in the test requirements)")
    folder = tmp_path_factory.mktemp("megatron")
    for dtype, docs in MEGATRON_DOCS.items():
        np.save(folder / f"{dtype}.npy", np.array(docs, dtype=object), allow_pickle=True)
    code = f"""
import json, warnings
import numpy as np, torch
warnings.simplefilter("ignore")
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
folder = {str(folder)!r}
reads = {{}}
for dtype in ("uint16", "int32"):
    docs = np.load(f"{{folder}}/{{dtype}}.npy", allow_pickle=True)
    b = IndexedDatasetBuilder(f"{{folder}}/{{dtype}}.bin", dtype=getattr(np, dtype))
    for i, d in enumerate(docs):
        if i == 3:  # one document of two sequences
            b.add_document(torch.tensor(np.concatenate([d, d])), [len(d), len(d)])
        else:
            b.add_item(torch.tensor(d))
            b.end_document()
    b.finalize(f"{{folder}}/{{dtype}}.idx")
    ds = IndexedDataset(f"{{folder}}/{{dtype}}")
    reads[dtype] = [ds[i].tolist() for i in range(len(ds))]
json.dump(reads, open(f"{{folder}}/reads.json", "w"))
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return folder


def megatron_copy(megatron_dir: pathlib.Path, dtype: str, prefix: pathlib.Path) -> None:
    for suffix in (".bin", ".idx"):
        shutil.copy(megatron_dir / f"{dtype}{suffix}", f"{prefix}{suffix}")


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_reads_megatron_core_indexed_dataset(megatron_dir, dtype) -> None:
    c = open_corpus(str(megatron_dir / dtype))
    expected = megatron_expected(dtype)
    assert c.meta["format"] == "megatron" and c.meta["dtype"] == dtype
    assert c.meta["megatron_documents"] == 40
    assert (c.n_docs, c.n_tokens) == (41, sum(d.shape[0] for d in expected))
    assert c.lengths.tolist() == [d.shape[0] for d in expected]
    for i, d in enumerate(expected):
        assert c.tokens(i).tolist() == d.tolist()
    assert c.mask(0) is None
    # the same as megatron's own reader, sequence by sequence
    reads = json.loads((megatron_dir / "reads.json").read_text())[dtype]
    assert reads == [c.tokens(i).tolist() for i in range(c.n_docs)]
    assert read_all(c)[0] == reads


def test_megatron_reader_needs_neither_megatron_nor_torch(megatron_dir) -> None:
    probe = (
        "import sys; from skyrl_datasets.corpus import open_corpus; "
        f"c = open_corpus({str(megatron_dir / 'uint16')!r}); c.tokens(0); "
        "assert 'megatron' not in sys.modules and 'torch' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_truncated_megatron_bin_is_refused(megatron_dir, tmp_path) -> None:
    megatron_copy(megatron_dir, "uint16", tmp_path / "m")
    with open(tmp_path / "m.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(UserError, match="truncated"):
        open_corpus(str(tmp_path / "m"))


# -- remote corpora -----------------------------------------------------------------------


def upload(fs, local_prefix: pathlib.Path, remote_prefix: str) -> None:
    for f in sorted(local_prefix.parent.iterdir()):
        if f.name.startswith(local_prefix.name + "."):
            fs.pipe_file(remote_prefix + f.name[len(local_prefix.name) :], f.read_bytes())


def test_memory_url_reads_lazily_through_the_cache(tmp_path) -> None:
    import fsspec

    docs, masks = random_docs(2000, 60_000, max_len=400)
    write(tmp_path / "c", docs, masks, vocab=60_000)
    fs = fsspec.filesystem("memory")
    upload(fs, tmp_path / "c", f"/lazy-{os.getpid()}/c")
    url = f"memory://lazy-{os.getpid()}/c"
    tokens_bytes = (tmp_path / "c.tokens").stat().st_size
    try:
        with open_corpus(url, cache_dir=tmp_path / "cache", block_size=4096) as c:
            assert c.fetched_bytes == 0  # opening fetched the header and the index only
            for i in (5, 1500, 1999):
                assert c.tokens(i).tolist() == docs[i].tolist()
                assert c.mask(i).tolist() == masks[i].tolist()
            # a few documents: a few blocks of tokens and mask, not the files
            assert 0 < c.fetched_bytes <= 3 * 2 * 2 * 4096 < tokens_bytes / 10
            again = c.fetched_bytes
            assert c.tokens(5).tolist() == docs[5].tolist() and c.fetched_bytes == again
        # a second open (another process, or the next run) reuses the cached blocks
        with open_corpus(url, cache_dir=tmp_path / "cache", block_size=4096) as c2:
            assert c2.tokens(1500).tolist() == docs[1500].tolist() and c2.fetched_bytes == 0
            tok, mask = np.empty(400, c2.dtype), np.empty(400, np.uint8)
            n = c2.read_into(700, tok, mask)  # not fetched yet: read_into fetches it too
            assert tok[:n].tolist() == docs[700].tolist() and mask[:n].tolist() == masks[700].tolist()
            assert c2.fetched_bytes > 0
            before = c2.fetched_bytes
            picks = [900, 1300, 1301, 1302]  # not fetched yet: read_pieces_into fetches them too
            n = sum(docs[i].shape[0] for i in picks)
            at = np.cumsum([0] + [docs[i].shape[0] for i in picks[:-1]])
            tok, mask = np.empty(n, c2.dtype), np.empty(n, np.uint8)
            assert c2.read_pieces_into(picks, [0] * 4, [docs[i].shape[0] for i in picks], at, tok, mask) == n
            assert tok.tolist() == np.concatenate([docs[i] for i in picks]).tolist()
            assert mask.tolist() == np.concatenate([masks[i] for i in picks]).tolist()
            assert c2.fetched_bytes > before
            for i in range(c2.n_docs):
                assert c2.tokens(i).tolist() == docs[i].tolist() and c2.mask(i).tolist() == masks[i].tolist()
        cached = next((tmp_path / "cache").iterdir())
        assert (cached / "tokens").read_bytes() == (tmp_path / "c.tokens").read_bytes()
    finally:
        fs.rm(f"/lazy-{os.getpid()}", recursive=True)


def test_file_url_is_read_in_place(tmp_path) -> None:
    docs, masks = random_docs(10, 1000)
    write(tmp_path / "c", docs, masks)
    c = open_corpus(f"file://{tmp_path}/c", cache_dir=tmp_path / "cache")
    assert c.tokens(4).tolist() == docs[4].tolist() and not (tmp_path / "cache").exists()


def test_memory_url_megatron_and_missing(megatron_dir, tmp_path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/meg-{os.getpid()}"
    fs.pipe_file(f"{root}/m.bin", (megatron_dir / "uint16.bin").read_bytes())
    fs.pipe_file(f"{root}/m.idx", (megatron_dir / "uint16.idx").read_bytes())
    try:
        c = open_corpus(f"memory:/{root}/m", cache_dir=tmp_path / "cache", block_size=64)
        assert [c.tokens(i).tolist() for i in range(c.n_docs)] == [d.tolist() for d in megatron_expected("uint16")]
        with pytest.raises(UserError, match="no corpus"):
            open_corpus(f"memory:/{root}/other", cache_dir=tmp_path / "cache")
    finally:
        fs.rm(root, recursive=True)


def test_s3_corpus_fetches_only_the_blocks_it_reads(tmp_path, skyrl_s3_server) -> None:
    import s3fs

    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": skyrl_s3_server}}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"corpus-{os.getpid()}"
    fs.mkdir(bucket)
    docs, masks = random_docs(3000, 60_000, max_len=500)
    write(tmp_path / "c", docs, masks, vocab=60_000)
    for f in tmp_path.iterdir():
        if f.name.startswith("c."):
            fs.put_file(str(f), f"{bucket}/data/{f.name}")
    tokens_bytes = (tmp_path / "c.tokens").stat().st_size
    try:
        with open_corpus(f"s3://{bucket}/data/c", storage_options=options, cache_dir=tmp_path / "cache", block_size=8192) as c:
            assert c.n_docs == 3000 and c.fetched_bytes == 0
            rng = np.random.default_rng(1)
            for i in rng.integers(0, 3000, 5):
                assert c.tokens(int(i)).tolist() == docs[i].tolist()
                assert c.mask(int(i)).tolist() == masks[i].tolist()
            assert 0 < c.fetched_bytes < tokens_bytes / 5
    finally:
        fs.rm(bucket, recursive=True)
