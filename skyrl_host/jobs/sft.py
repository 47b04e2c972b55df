"""``kind = "sft"``: supervised fine-tuning on pretokenized corpora.

Each step takes documents from the ``[data]`` strategy (a plugin: ``sequential``,
``shuffled``, ``mix``, ``curriculum``, or a third party's) until the step's token
budget (``tokens_per_step``) is full, packs them end to end into a RolloutBatch
(no padding; every document its own sequence, so positions restart at 0 and
attention never crosses a document boundary), and trains the backend on the mean
negative log-likelihood of the tokens the corpus's loss mask marks.

- A document longer than ``max_seq_len`` is cut into pieces of at most
  ``max_seq_len`` tokens that overlap by one token, so every token after the
  document's first is predicted exactly once (``long_documents = "split"``), or
  cut to its first ``max_seq_len`` tokens (``"truncate"``).
- Pieces are never split across steps: a piece that does not fit the rest of the
  budget opens the next step. The pieces of a document still waiting, the
  strategy's position and the backend's state are in every checkpoint, so after
  ``skyrl run --resume`` no document is repeated or skipped.

The corpora are opened by the ``[corpus]`` reader (a plugin; the default,
``pretokenized`` of skyrl-datasets, reads local prefixes or fsspec URLs lazily through a
local cache, in its own format or Megatron's .bin/.idx).
"""

from __future__ import annotations

import json
import pathlib
import random
import time
from typing import Any, Literal, Mapping, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.checkpoints import CheckpointWriter, load_backend_state, read_state, save_backend_state
from skyrl_host.contracts import has
from skyrl_host.errors import UserError
from skyrl_host.interfaces import CorpusPieces, PlacementRequest
from skyrl_host.jobs.common import restore_rng, run_steps, save_rng
from skyrl_host.options import OptionError, ge, gt, option

SLOTS = {"model": None, "backend": "torch", "data": "sequential", "precision": "bf16", "corpus": "pretokenized"}
SAMPLES_FILE = "samples.jsonl"


def _paths(_inst: Any, _attr: Any, value: Sequence[str]) -> None:
    if not value:
        raise ValueError("expected at least one path, found an empty array")


_paths.__doc__ = "at least one"


@attrs.frozen
class SFTConfig:
    """The ``sft`` kind's keys of ``[job]``."""

    data_paths: list[str] = option(
        help="pretokenized corpora: path prefixes or fsspec URLs (skyrl data tokenize, or Megatron .bin/.idx)",
        validator=_paths,
    )
    tokens_per_step: int = option(8192, help="token budget of one step (packed, no padding)", validator=gt(0))
    max_seq_len: int = option(1024, help="longest sequence trained on; longer documents are split or truncated", validator=ge(2))
    long_documents: Literal["split", "truncate"] = option(
        "split", help="'split': pieces of max_seq_len overlapping by one token; 'truncate': keep the first max_seq_len tokens"
    )
    alphabet: str | None = option(
        None, help="characters of a preset model's character-level tokenizer (a model loaded from a path brings its own)"
    )
    cache_dir: str | None = option(None, help="local cache of remote corpora (default: $SKYRL_CACHE_DIR/corpora)")
    storage_options: dict[str, Any] = option(
        factory=dict, help="fsspec options for remote data_paths, e.g. {anon = true} or {client_kwargs = {endpoint_url = \"...\"}}"
    )
    checkpoint_every: int = option(50, help="steps between checkpoints (0: only at the end)", validator=ge(0))
    keep_checkpoints: int = option(2, help="checkpoints kept on disk", validator=gt(0))
    save_final: bool = option(True, help="write the final model as a Hugging Face folder in <output_dir>/final")
    record_samples: bool = option(
        False, help="write each step's (dataset, document, first token) to <output_dir>/samples.jsonl (an audit trail)"
    )
    threads: int | None = option(None, help="torch threads (default: leave torch's choice)", validator=gt(0))

    def __attrs_post_init__(self) -> None:
        if self.tokens_per_step < self.max_seq_len:
            raise OptionError(
                "tokens_per_step", f"expected at least max_seq_len ({self.max_seq_len}), found {self.tokens_per_step}"
            )


class SFTLoss:
    """The :class:`skyrl_host.interfaces.Algorithm` of SFT: the mean negative
    log-likelihood over every loss token of the step (all micro-batches, all ranks).
    Advantages are the loss mask; the loss ignores them."""

    needs_reference = False
    dynamic_sampling = False
    max_refill_rounds = 0

    def shape_rewards(self, batch: Any, max_new_tokens: int) -> Any:
        import numpy as np

        return np.zeros(batch.n_sequences, dtype=np.float32)

    def keep(self, batch: Any, rewards: Any) -> Any:
        import numpy as np

        return np.ones(batch.n_sequences, dtype=bool)

    def advantages(self, batch: Any, rewards: Any) -> Any:
        import numpy as np

        return np.asarray(batch.loss_mask, dtype=np.float32)

    def loss(self, inputs: Any) -> tuple[Any, Mapping[str, Any]]:
        # This micro-batch's share: summing the shares gives sum(-logprob) / all loss tokens of the step.
        nll = -(inputs.logprobs * inputs.mask).sum()
        return nll / max(float(inputs.global_tokens), 1.0), {}


def pieces_of(length: int, max_seq_len: int, long_documents: str) -> list[tuple[int, int]]:
    """The (start, end) token ranges a document of ``length`` tokens trains as. With
    "split", consecutive pieces overlap by one token (a piece's first token is only
    context), so every token but the document's first is predicted exactly once.
    Documents of fewer than two tokens predict nothing and give no piece."""
    if length < 2:
        return []
    if length <= max_seq_len or long_documents == "truncate":
        return [(0, min(length, max_seq_len))]
    stride = max_seq_len - 1
    out = []
    start = 0
    while start + 1 < length:
        out.append((start, min(start + max_seq_len, length)))
        start += stride
    return out


def pack_documents(corpora: Sequence[Any], pieces: Sequence[Sequence[int]], fast: Sequence[bool] | None = None) -> Any:
    """A RolloutBatch of ``pieces`` ((dataset, document, start, end) each), end to
    end: one sequence per piece, no prompt, the corpus's loss mask (all ones when
    the corpus has none), zero engine logprobs.

    The pieces of a corpus with the :class:`~skyrl_host.interfaces.CorpusPieces`
    capability are copied by one ``read_pieces_into`` call per corpus and step into a
    staging buffer of its token dtype, widened to int32 once; the others' from their
    views, piece by piece (as :func:`pack_documents_views`: the same batch). ``fast[d]``:
    whether corpus ``d`` has the capability (default: asked here)."""
    import numpy as np

    k = len(pieces)
    p = np.asarray(pieces, dtype=np.int64).reshape(k, 4)
    cu = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(p[:, 3] - p[:, 2], out=cu[1:])
    n = int(cu[-1])
    if fast is None:
        fast = [has(c, CorpusPieces) for c in corpora]
    used = sorted({piece[0] for piece in pieces})
    mask = np.empty(n, dtype=np.uint8)
    tokens = None
    by_dtype: dict[Any, list[int]] = {}
    for d in used:
        if fast[d]:
            by_dtype.setdefault(np.dtype(corpora[d].dtype), []).append(d)
    for dtype, group in by_dtype.items():
        stage = np.empty(n, dtype=dtype)
        for d in group:
            if len(used) == 1:
                corpora[d].read_pieces_into(p[:, 1], p[:, 2], p[:, 3], cu[:-1], stage, mask)
            else:
                sel = p[:, 0] == d
                corpora[d].read_pieces_into(p[sel, 1], p[sel, 2], p[sel, 3], cu[:-1][sel], stage, mask)
        if tokens is None:
            tokens = stage.astype(np.int32, copy=False)  # one widening copy (none for int32 corpora)
        else:  # corpora of another token dtype in the same step: their pieces, one by one
            rows = np.flatnonzero(np.isin(p[:, 0], group))
            for a, b in zip(cu[rows].tolist(), cu[rows + 1].tolist()):
                tokens[a:b] = stage[a:b]
    if tokens is None:
        tokens = np.empty(n, dtype=np.int32)
    if not all(fast[d] for d in used):
        for row, (d, i, start, end) in enumerate(pieces):
            if not fast[d]:
                _copy_views(corpora[d], i, start, end, tokens, mask, int(cu[row]))
    return _rollout(tokens, cu, mask)


def pack_documents_views(corpora: Sequence[Any], pieces: Sequence[Sequence[int]]) -> Any:
    """:func:`pack_documents` through the views alone (``tokens(i)`` / ``mask(i)``), piece
    by piece: the path of corpora without the ``CorpusPieces`` capability (and, before
    it, of every corpus)."""
    import numpy as np

    lens = np.asarray([end - start for _, _, start, end in pieces], dtype=np.int64)
    cu = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    n = int(cu[-1])
    tokens = np.empty(n, dtype=np.int32)
    mask = np.empty(n, dtype=np.uint8)
    for k, (d, i, start, end) in enumerate(pieces):
        _copy_views(corpora[d], i, start, end, tokens, mask, int(cu[k]))
    return _rollout(tokens, cu, mask)


def _copy_views(corpus: Any, i: int, start: int, end: int, tokens: Any, mask: Any, at: int) -> None:
    b = at + end - start
    tokens[at:b] = corpus.tokens(i)[start:end]
    m = corpus.mask(i)
    if m is None:
        mask[at:b] = 1
    else:
        mask[at:b] = m[start:end]


def _rollout(tokens: Any, cu: Any, mask: Any) -> Any:
    import numpy as np

    from skyrl_host.rollout import RolloutBatch

    n, s = int(tokens.shape[0]), int(cu.shape[0]) - 1
    return RolloutBatch(
        tokens=tokens,
        cu_seqlens=cu,
        prompt_lens=np.zeros(s, dtype=np.int32),
        logprobs=np.zeros(n, dtype=np.float32),
        loss_mask=mask,
        group_ids=np.arange(s, dtype=np.int64),
        versions=np.zeros(s, dtype=np.int64),
        truncated=np.zeros(s, dtype=bool),
        rewards=np.zeros(s, dtype=np.float32),
    )


class NothingToTrain(ValueError):
    """Every document drawn in a whole pass had fewer than two tokens."""


class PackedSteps:
    """The data half of the ``sft`` job: draws documents from the strategy, cuts them
    into pieces (:func:`pieces_of`), takes whole pieces while they fit
    ``tokens_per_step``, and packs them (:func:`pack_documents`). The driver calls
    :meth:`next_batch` once per step; :meth:`state_dict` (the strategy's position, the
    pieces of the last drawn document not trained yet, the documents drawn per
    dataset) goes into every checkpoint. ``benchmarks/sft_data.py`` times this class."""

    def __init__(self, corpora: Sequence[Any], strategy: Any, *, tokens_per_step: int, max_seq_len: int,
                 long_documents: str = "split"):
        self.corpora = list(corpora)
        self.strategy = strategy
        self.tokens_per_step, self.max_seq_len, self.long_documents = tokens_per_step, max_seq_len, long_documents
        self.n_docs = [c.n_docs for c in self.corpora]
        self.pending: list[list[int]] = []  # pieces of the last drawn document not trained yet
        self.drawn = [0] * len(self.corpora)  # documents drawn per dataset
        # per corpus: packed through read_pieces_into (CorpusPieces), else from its views
        self.fast = [has(c, CorpusPieces) for c in self.corpora]

    def take_pieces(self, step: int) -> list[list[int]]:
        """The pieces of step ``step``: whole pieces, in the strategy's order, while
        they fit ``tokens_per_step``."""
        budget, max_len, how = self.tokens_per_step, self.max_seq_len, self.long_documents
        draw, drawn, lengths = self.strategy.draw, self.drawn, [c.lengths for c in self.corpora]
        pending = self.pending
        taken: list[list[int]] = []
        used = 0
        barren = 0  # draws in a row that gave nothing to train on
        try:
            while True:
                if not pending:
                    d, i = draw(step)
                    drawn[d] += 1
                    length = int(lengths[d][i])
                    if 2 <= length <= max_len:
                        pending = [[d, i, 0, length]]
                    else:
                        pending = [[d, i, a, b] for a, b in pieces_of(length, max_len, how)]
                    barren = 0 if pending else barren + 1
                    if barren > sum(self.n_docs):
                        raise NothingToTrain("no document has two or more tokens: nothing to train on")
                    continue
                piece = pending[0]
                n = piece[3] - piece[2]
                if used + n > budget:
                    return taken
                taken.append(pending.pop(0))
                used += n
                if used == budget:
                    return taken
        finally:
            self.pending = pending

    def pack(self, pieces: Sequence[Sequence[int]]) -> Any:
        """The RolloutBatch of ``pieces`` (:func:`pack_documents`)."""
        return pack_documents(self.corpora, pieces, self.fast)

    def next_batch(self, step: int) -> tuple[list[list[int]], Any]:
        """Step ``step``'s pieces and their packed RolloutBatch."""
        pieces = self.take_pieces(step)
        return pieces, self.pack(pieces)

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": dict(self.strategy.state_dict()), "pending": self.pending, "drawn": self.drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.strategy.load_state_dict(state["strategy"])
        self.pending = [list(map(int, p)) for p in state["pending"]]
        self.drawn = [int(x) for x in state["drawn"]]


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


def check_sft_job(spec: Any) -> list[tuple[str, str]]:
    """Job-level checks (``skyrl validate``): one process, a preset model has its
    alphabet, local corpora exist and open, and the data strategy's per-dataset
    ``weights`` (when it has them) match the paths."""
    problems: list[tuple[str, str]] = []
    cfg = spec.kind_config
    backend = spec.plugins["backend"].traits
    if backend.data_parallel and spec.cluster.launcher != "ray":
        option = backend.switches.get("data_parallel", "name")
        problems.append((f"backend.{option}", f"[backend] {option} trains across backend ranks: set "
                         "[cluster] launcher = \"ray\" and trainer_ranks"))
    if spec.plugins["model"].traits.key == "model.preset" and cfg.alphabet is None:
        problems.append((
            "model.preset",
            "a preset model builds a character-level tokenizer: set job.alphabet to the characters the corpus was "
            "tokenized with, or load a model with path",
        ))
    reader = spec.plugins["corpus"].create()
    for i, path in enumerate(cfg.data_paths):
        if _is_url(path):
            continue  # opened (and its errors reported) when the job starts, not by validate
        try:
            reader.open(path).close()
        except UserError as exc:
            problems.append(("job.data_paths", f"[{i}] {path!r}: " + "; ".join(p.message for p in exc.problems)))
    data = spec.plugins.get("data")
    weights = getattr(getattr(data, "config", None), "weights", None)
    if weights is not None and len(weights) != len(cfg.data_paths):
        problems.append(
            ("data.weights", f"has {len(weights)} entries, expected one per path of job.data_paths ({len(cfg.data_paths)})")
        )
    return problems


class SFTDriver:
    def __init__(self, run: Any):
        self.run_ = run
        self.cfg: SFTConfig = run.spec.kind_config
        self.seed = run.spec.job.seed
        self.corpora: list[Any] = []
        self.samples: Any = None
        self.placement: Any = None

    # -- errors located in the job file ---------------------------------------------

    def _problem(self, key: str, message: str) -> UserError:
        return self.run_.spec.error(key, message)

    # -- set-up ----------------------------------------------------------------

    def build(self) -> None:
        import torch

        run, cfg = self.run_, self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(self.seed)
        random.seed(self.seed)
        reader = run.plugin("corpus").create()
        for i, path in enumerate(cfg.data_paths):
            try:
                self.corpora.append(reader.open(path, storage_options=cfg.storage_options or None, cache_dir=cfg.cache_dir))
            except UserError as exc:
                raise self._problem("job.data_paths", f"[{i}] {path!r}: " + "; ".join(p.message for p in exc.problems)) from None
        self.loss = SFTLoss()
        request = PlacementRequest(
            model=run.plugin("model"), backend=run.plugin("backend"), precision=run.plugin("precision"),
            alphabet=cfg.alphabet, seed=self.seed, total_steps=run.total_steps, algorithm=self.loss, threads=cfg.threads,
        )
        self.placement = run.launcher().place(request)
        self.backend = self.placement.backend
        self.vocab_size = self.placement.vocab_size
        for i, corpus in enumerate(self.corpora):
            v = corpus.meta.get("vocab_size")
            if v is not None and int(v) > self.vocab_size:
                raise self._problem(
                    "job.data_paths",
                    f"[{i}] {cfg.data_paths[i]!r} was tokenized for {int(v)} ids, the model has {self.vocab_size}: "
                    "tokenize with the model's tokenizer",
                )
        self.strategy = run.plugin("data").create()
        try:
            self.strategy.bind([c.lengths for c in self.corpora], self.seed)
        except ValueError as exc:
            raise self._problem("data", f"strategy {run.plugin('data').name!r}: {exc}") from None
        self.data = PackedSteps(self.corpora, self.strategy, tokens_per_step=cfg.tokens_per_step,
                                max_seq_len=cfg.max_seq_len, long_documents=cfg.long_documents)
        self.n_docs = self.data.n_docs
        self.start_step = 1
        if run.resume_path is not None:
            self._load_checkpoint(run.resume_path)
            self.start_step = run.resume_step + 1
        if cfg.record_samples:
            self._open_samples()

    def _open_samples(self) -> None:
        path = self.run_.output_dir / SAMPLES_FILE
        kept = []
        if self.run_.resuming and path.exists():  # the steps a resumed run will not train again
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] < self.start_step]
        self.samples = open(path, "w", encoding="utf-8")
        self.samples.writelines(line + "\n" for line in kept)
        self.samples.flush()

    def close(self) -> None:
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.close()
        if self.samples is not None:
            self.samples.close()
            self.samples = None
        for c in self.corpora:
            c.close()
        self.corpora = []

    # -- one step ----------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        try:
            pieces, batch = self.data.next_batch(step)
        except NothingToTrain as exc:
            raise self._problem("job.data_paths", str(exc)) from None
        top = int(batch.tokens.max()) if batch.n_tokens else 0
        if top >= self.vocab_size:
            d, i = next((p[0], p[1]) for p in pieces if int(self.corpora[p[0]].tokens(p[1]).max()) >= self.vocab_size)
            raise self._problem(
                "job.data_paths",
                f"[{d}] {self.cfg.data_paths[d]!r}: document {i} holds token id {top}, the model has {self.vocab_size} ids",
            )
        data_time = time.perf_counter() - t0
        if self.samples is not None:
            self.samples.write(json.dumps({"step": step, "docs": [[d, i, a] for d, i, a, _ in pieces]}) + "\n")
            self.samples.flush()
        train = self.backend.train_step(
            batch, self.loss.advantages(batch, None), self.loss, temperature=1.0, max_new_tokens=self.cfg.max_seq_len
        )
        elapsed = time.perf_counter() - t0
        skip = ("tokens_per_s", "step_time_s", "logprob_diff_mean", "logprob_diff_max")
        metrics = {k: float(v) for k, v in train.items() if k not in skip}
        metrics["tokens_per_s"] = batch.n_tokens / max(elapsed, 1e-9)
        metrics["documents"] = float(len({(d, i) for d, i, _, _ in pieces}))
        metrics["data_time_s"] = data_time
        metrics["step_time"] = elapsed
        for d, n in enumerate(self.n_docs):
            metrics[f"epoch_{d}"] = self.data.drawn[d] / n if n else 0.0
        return metrics

    # -- checkpoints ----------------------------------------------------------------

    def _driver_state(self, step: int) -> dict[str, Any]:
        return {"step": step, **self.data.state_dict(), "data_paths": list(self.cfg.data_paths)}

    def save_checkpoint(self, step: int) -> None:
        with CheckpointWriter(self.run_.output_dir, step, keep=self.cfg.keep_checkpoints) as folder:
            save_backend_state(folder, self.backend)
            save_rng(folder / "rng.safetensors")
            (folder / "driver.json").write_text(json.dumps(self._driver_state(step)))

    def _load_checkpoint(self, folder: pathlib.Path) -> None:
        rng = read_state(folder, "rng")
        try:
            driver = json.loads((folder / "driver.json").read_text())
        except (OSError, RuntimeError, ValueError) as exc:
            raise UserError(f"--resume: cannot read checkpoint {folder}: {exc}") from None
        if driver.get("data_paths") != list(self.cfg.data_paths):
            raise self._problem(
                "job.data_paths", f"--resume: the checkpoint was trained on {driver.get('data_paths')!r}, not these paths"
            )
        load_backend_state(folder, self.backend)
        self.data.load_state_dict(driver)
        restore_rng(rng, folder)

    def save_final(self) -> None:
        self.placement.save_final(str(self.run_.output_dir / "final"))

    # -- the loop ------------------------------------------------------------------

    def run(self) -> None:
        self.run_.headline = ["loss", "tokens_per_s", "grad_norm"]
        run_steps(self)


@hookimpl
def skyrl_register_jobs(register: Any) -> None:
    register(
        "sft",
        SFTDriver,
        config=SFTConfig,
        description="Supervised fine-tuning on pretokenized corpora: packed, masked, mixed, resumable",
        slots=SLOTS,
        check=check_sft_job,
    )
