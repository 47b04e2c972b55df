"""RolloutBatch: the one contract between the engine and the trainer.

Packed, never padded: all sequences end to end in one token array, with
``cu_seqlens`` offsets. Every array is a plain numpy buffer, so a batch crosses
processes (Ray object store, shared memory) as zero-copy views. Imports numpy
only.

Per-token arrays (length ``T = n_tokens``) are aligned with ``tokens``:
``logprobs[t]`` is the engine's log-probability of ``tokens[t]`` given the tokens
before it in its sequence (0 for prompt tokens), ``loss_mask[t]`` is 1 for tokens
the policy generated and that train. Per-sequence arrays have length
``S = n_sequences``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import attrs
import numpy as np

TOKEN_ARRAYS = ("tokens", "logprobs", "loss_mask")
SEQUENCE_ARRAYS = ("prompt_lens", "group_ids", "versions", "truncated", "rewards")


@attrs.define(eq=False)
class CSR:
    """A ragged side channel: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

    In a RolloutBatch, rows follow the generated tokens (``loss_mask == 1``) in order,
    e.g. ``sample_support``: the candidate ids the sampler kept for each token."""

    offsets: np.ndarray  # int64 [n_rows + 1], offsets[0] == 0
    values: np.ndarray  # [offsets[-1]]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]] | Sequence[np.ndarray], dtype: Any = np.int32) -> "CSR":
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        values = np.concatenate([np.asarray(r, dtype=dtype) for r in rows]) if rows else np.zeros(0, dtype=dtype)
        return cls(offsets, values.astype(dtype, copy=False))

    @property
    def n_rows(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def take(self, rows: np.ndarray) -> "CSR":
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lens = ends - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        # Gather every selected row's values in one vectorised index.
        idx = np.repeat(starts - offsets[:-1], lens) + np.arange(int(offsets[-1]), dtype=np.int64)
        return CSR(offsets, self.values[idx])

    @staticmethod
    def concat(parts: Sequence["CSR"]) -> "CSR":
        shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]).astype(np.int64)
        return CSR(offsets, np.concatenate([p.values for p in parts]))

    def validate(self, n_rows: int, name: str) -> None:
        if self.n_rows != n_rows:
            raise ValueError(f"side channel {name!r} has {self.n_rows} rows, expected one per generated token ({n_rows})")
        if self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0) or self.offsets[-1] != len(self.values):
            raise ValueError(f"side channel {name!r}: offsets must start at 0, never decrease and end at len(values)")


@attrs.define(eq=False)
class RolloutBatch:
    tokens: np.ndarray  # int32 [T]
    cu_seqlens: np.ndarray  # int64 [S + 1]; cu_seqlens[0] == 0, cu_seqlens[-1] == T
    prompt_lens: np.ndarray  # int32 [S]
    logprobs: np.ndarray  # float32 [T]; engine logprob of each token, 0 for prompt tokens
    loss_mask: np.ndarray  # uint8 [T]; 1 where the policy generated the token and it trains
    group_ids: np.ndarray  # int64 [S]; samples of the same prompt share an id (GRPO groups)
    versions: np.ndarray  # int64 [S]; weight version that generated each sequence
    truncated: np.ndarray  # bool [S]; hit the new-token limit without a stop token
    rewards: np.ndarray  # float32 [S]; NaN until scored
    # Packed extras: numpy arrays with one row per token (routed experts [T, layers, top_k]),
    # or CSR with one row per generated token (sample support sets).
    side_channels: dict[str, Any] = attrs.field(factory=dict)

    # -- construction --------------------------------------------------------

    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        response_logprobs: Sequence[Sequence[float]],
        *,
        group_ids: Sequence[int],
        versions: Sequence[int] | int = 0,
        truncated: Sequence[bool] | None = None,
    ) -> "RolloutBatch":
        """Pack (prompt, response) pairs; mostly for tests and simple engines."""
        if not (len(prompts) == len(responses) == len(response_logprobs) == len(group_ids)):
            raise ValueError("prompts, responses, response_logprobs and group_ids must have one entry per sequence")
        lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
        cu = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        tokens = np.empty(int(cu[-1]), dtype=np.int32)
        logprobs = np.zeros(int(cu[-1]), dtype=np.float32)
        mask = np.zeros(int(cu[-1]), dtype=np.uint8)
        for i, (p, r, lp) in enumerate(zip(prompts, responses, response_logprobs)):
            if len(lp) != len(r):
                raise ValueError(f"sequence {i}: {len(r)} response tokens but {len(lp)} logprobs")
            s = int(cu[i])
            tokens[s : s + len(p)] = p
            tokens[s + len(p) : s + len(p) + len(r)] = r
            logprobs[s + len(p) : s + len(p) + len(r)] = lp
            mask[s + len(p) : s + len(p) + len(r)] = 1
        n = len(lens)
        batch = cls(
            tokens=tokens,
            cu_seqlens=cu,
            prompt_lens=np.asarray([len(p) for p in prompts], dtype=np.int32),
            logprobs=logprobs,
            loss_mask=mask,
            group_ids=np.asarray(group_ids, dtype=np.int64),
            versions=np.broadcast_to(np.asarray(versions, dtype=np.int64), (n,)).copy(),
            truncated=np.zeros(n, dtype=bool) if truncated is None else np.asarray(truncated, dtype=bool),
            rewards=np.full(n, np.nan, dtype=np.float32),
        )
        batch.validate()
        return batch

    # -- shape ---------------------------------------------------------------

    @property
    def n_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def seq_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens)

    @property
    def response_lens(self) -> np.ndarray:
        return self.seq_lens - self.prompt_lens

    def seq_ids(self) -> np.ndarray:
        """int64 [T]: the sequence index of every token."""
        return np.repeat(np.arange(self.n_sequences, dtype=np.int64), self.seq_lens)

    def positions(self) -> np.ndarray:
        """int64 [T]: each token's position within its own sequence."""
        return np.arange(self.n_tokens, dtype=np.int64) - np.repeat(self.cu_seqlens[:-1], self.seq_lens)

    def last_tokens(self) -> np.ndarray:
        """bool [T]: True at the last token of every non-empty sequence (the token the
        engine sampled last and never fed back, so it has no recorded route)."""
        last = np.zeros(self.n_tokens, dtype=bool)
        last[self.cu_seqlens[1:][self.seq_lens > 0] - 1] = True
        return last

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.cu_seqlens[i] : self.cu_seqlens[i + 1]]

    def prompt(self, i: int) -> np.ndarray:
        start = int(self.cu_seqlens[i])
        return self.tokens[start : start + int(self.prompt_lens[i])]

    def response(self, i: int) -> np.ndarray:
        return self.tokens[int(self.cu_seqlens[i]) + int(self.prompt_lens[i]) : int(self.cu_seqlens[i + 1])]

    def response_logprobs(self, i: int) -> np.ndarray:
        return self.logprobs[int(self.cu_seqlens[i]) + int(self.prompt_lens[i]) : int(self.cu_seqlens[i + 1])]

    # -- checks and transforms -----------------------------------------------

    def validate(self) -> None:
        """Raise ValueError if the arrays do not describe one consistent batch."""
        S, T = self.n_sequences, self.n_tokens
        if self.cu_seqlens.dtype != np.int64 or self.cu_seqlens[0] != 0 or np.any(np.diff(self.cu_seqlens) < 0):
            raise ValueError("cu_seqlens must be int64, start at 0 and never decrease")
        for name in TOKEN_ARRAYS:
            if len(getattr(self, name)) != T:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected one per token ({T})")
        for name in SEQUENCE_ARRAYS:
            if len(getattr(self, name)) != S:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, expected one per sequence ({S})")
        if np.any(self.prompt_lens < 0) or np.any(self.prompt_lens > self.seq_lens):
            raise ValueError("prompt_lens must lie within each sequence")
        for name, channel in self.side_channels.items():
            if isinstance(channel, CSR):
                channel.validate(int(np.count_nonzero(self.loss_mask)), name)
            elif len(channel) != T:
                raise ValueError(f"side channel {name!r} has {len(channel)} rows, expected one per token ({T})")

    def select(self, indices: Sequence[int] | np.ndarray) -> "RolloutBatch":
        """A new batch with the given sequences, in the given order (side channels
        aligned with tokens are selected too)."""
        idx = np.asarray(indices, dtype=np.int64)
        starts, ends = self.cu_seqlens[idx], self.cu_seqlens[idx + 1]
        token_idx = (
            np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if len(idx) else np.zeros(0, np.int64)
        )
        cu = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(ends - starts, out=cu[1:])
        return RolloutBatch(
            tokens=self.tokens[token_idx],
            cu_seqlens=cu,
            logprobs=self.logprobs[token_idx],
            loss_mask=self.loss_mask[token_idx],
            **{name: getattr(self, name)[idx] for name in SEQUENCE_ARRAYS},
            side_channels=self._select_side_channels(token_idx),
        )

    def _select_side_channels(self, token_idx: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {}
        generated_rank = np.cumsum(self.loss_mask != 0) - 1  # row of each generated token in a CSR channel
        gen_rows = generated_rank[token_idx][self.loss_mask[token_idx] != 0]
        for name, channel in self.side_channels.items():
            out[name] = channel.take(gen_rows) if isinstance(channel, CSR) else channel[token_idx]
        return out

    @staticmethod
    def concat(batches: Iterable["RolloutBatch"]) -> "RolloutBatch":
        batches = list(batches)
        if not batches:
            raise ValueError("nothing to concatenate")
        offsets = np.cumsum([0] + [b.n_tokens for b in batches[:-1]])
        cu = np.concatenate([[0]] + [b.cu_seqlens[1:] + off for b, off in zip(batches, offsets)]).astype(np.int64)
        keys = set(batches[0].side_channels)
        return RolloutBatch(
            cu_seqlens=cu,
            **{name: np.concatenate([getattr(b, name) for b in batches]) for name in TOKEN_ARRAYS + SEQUENCE_ARRAYS},
            side_channels={k: _concat_channel([b.side_channels.get(k) for b in batches], k) for k in keys},
        )

    def append_turn(self, segment: "RolloutBatch") -> "RolloutBatch":
        """The conversations of this batch, each continued by the same sequence of
        ``segment`` (an engine's ``continue_turn`` output): its first token is this
        sequence's last one (checked, so a segment can only extend the conversation
        it was generated for), then the new turn's tokens.

        Token-aligned side channels take the segment's row for the overlapping token
        (the engine only routed that token when the conversation continued: the earlier
        row is a placeholder); CSR channels (one row per generated token) are joined.
        ``versions`` keep the oldest weights that produced a token; ``truncated`` is the
        segment's; rewards start over (NaN)."""
        S = self.n_sequences
        if segment.n_sequences != S:
            raise ValueError(f"append_turn: the segment has {segment.n_sequences} sequences, the conversations {S}")
        if np.any(segment.seq_lens < 1):
            raise ValueError("append_turn: every segment sequence starts with the conversation's last token")
        last = self.tokens[self.cu_seqlens[1:] - 1] if S else np.zeros(0, self.tokens.dtype)
        first = segment.tokens[segment.cu_seqlens[:-1]] if S else np.zeros(0, segment.tokens.dtype)
        wrong = np.flatnonzero((self.seq_lens < 1) | (last != first))
        if len(wrong):
            raise ValueError(
                f"append_turn: segment sequence {int(wrong[0])} does not continue conversation {int(wrong[0])} "
                "(its first token must be the conversation's last)"
            )
        if set(segment.side_channels) != set(self.side_channels):
            raise ValueError(
                f"append_turn: side channels differ: conversations have {sorted(self.side_channels)}, "
                f"the segment {sorted(segment.side_channels)}"
            )
        hl, sl = self.seq_lens, segment.seq_lens
        new_lens = hl + sl - 1
        cu = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(new_lens, out=cu[1:])
        T = int(cu[-1])
        # Each output token's source in concat(self arrays, segment arrays).
        src = np.empty(T, dtype=np.int64)
        within = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], new_lens)
        from_hist = within < np.repeat(hl, new_lens)
        seq = np.repeat(np.arange(S), new_lens)
        src[from_hist] = self.cu_seqlens[seq[from_hist]] + within[from_hist]
        seg_pos = within[~from_hist] - hl[seq[~from_hist]] + 1
        src[~from_hist] = self.n_tokens + segment.cu_seqlens[seq[~from_hist]] + seg_pos
        # Token-aligned side channels: the overlapping token's row comes from the segment.
        src_side = src.copy()
        ends = cu[1:][hl > 0] - sl[hl > 0]  # output index of each conversation's former last token
        src_side[ends] = self.n_tokens + segment.cu_seqlens[:-1][hl > 0]

        def joined(a: np.ndarray, b: np.ndarray, index: np.ndarray) -> np.ndarray:
            return np.concatenate([a, b])[index]

        side: dict[str, Any] = {}
        for k, v in self.side_channels.items():
            w = segment.side_channels[k]
            if isinstance(v, CSR) != isinstance(w, CSR):
                raise ValueError(f"side channel {k!r} is CSR on one side only")
            if isinstance(v, CSR):
                gen_src = src[np.concatenate([self.loss_mask, segment.loss_mask])[src] != 0]
                rank = np.cumsum(np.concatenate([self.loss_mask, segment.loss_mask]) != 0) - 1
                side[k] = CSR.concat([v, w]).take(rank[gen_src])
            else:
                side[k] = joined(v, w, src_side)
        out = RolloutBatch(
            tokens=joined(self.tokens, segment.tokens, src),
            cu_seqlens=cu,
            prompt_lens=self.prompt_lens.copy(),
            logprobs=joined(self.logprobs, segment.logprobs, src),
            loss_mask=joined(self.loss_mask, segment.loss_mask, src),
            group_ids=self.group_ids.copy(),
            versions=np.minimum(self.versions, segment.versions),
            truncated=segment.truncated.copy(),
            rewards=np.full(S, np.nan, dtype=np.float32),
            side_channels=side,
        )
        out.validate()
        return out

    def to_arrays(self) -> Mapping[str, np.ndarray]:
        """Every array by name, for transports: side channels as ``side.NAME``, or
        ``side.NAME.offsets`` and ``side.NAME.values`` for CSR ones."""
        out = {name: getattr(self, name) for name in ("cu_seqlens",) + TOKEN_ARRAYS + SEQUENCE_ARRAYS}
        for k, v in self.side_channels.items():
            if isinstance(v, CSR):
                out[f"side.{k}.offsets"], out[f"side.{k}.values"] = v.offsets, v.values
            else:
                out[f"side.{k}"] = v
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> "RolloutBatch":
        side: dict[str, Any] = {}
        for k, v in arrays.items():
            if not k.startswith("side."):
                continue
            name = k[5:]
            if name.endswith(".offsets"):
                side[name[:-8]] = CSR(v, arrays[f"side.{name[:-8]}.values"])
            elif not name.endswith(".values"):
                side[name] = v
        plain = {k: v for k, v in arrays.items() if not k.startswith("side.")}
        batch = cls(**plain, side_channels=side)
        batch.validate()
        return batch


def _concat_channel(parts: list[Any], name: str) -> Any:
    if any(p is None for p in parts):
        raise ValueError(f"side channel {name!r} is missing from some of the batches")
    if all(isinstance(p, CSR) for p in parts):
        return CSR.concat(parts)
    if any(isinstance(p, CSR) for p in parts):
        raise ValueError(f"side channel {name!r} is CSR in some batches and dense in others")
    return np.concatenate(parts)
