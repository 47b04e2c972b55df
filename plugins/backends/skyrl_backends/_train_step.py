"""The torch backend's optimizer step: :meth:`TrainStep.train_step` over one RolloutBatch.

1. lay the batch out as mini-batches of packed micro-batches (``skyrl_backends._packing``);
2. all-reduce the normalisers (loss tokens, training sequences) of every
   mini-batch and the number of micro-batches (ranks with fewer run empty ones so
   every rank calls the same collectives);
3. before the first update, in a no-grad pass: the reference logprobs when the
   algorithm needs them, and the old logprobs when there is more than one update;
4. per micro-batch: the forward (through ``PackedLM``: the base transformer,
   then the output head on the positions that predict a loss token only), logprobs
   of the temperature-scaled distribution, LossInputs, the algorithm's loss,
   backward (times the world size: DDP and FSDP2 average gradients over ranks, the
   algorithm's loss is already normalised by global counts); then clip, AdamW step,
   scheduler step;
5. the metrics, reduced over ranks.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from skyrl_backends._packing import MicroBatch
from skyrl_host.interfaces import LossInputs
from skyrl_toolkit.kl import kl_estimate

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").numpy()
    return np.asarray(x)


def _to_float(v: Any) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean())
    return float(v)


def _reduce_metrics(
    sums: Mapping[str, torch.Tensor], algo_sums: Mapping[str, torch.Tensor], maxes: Mapping[str, torch.Tensor],
    world: int, group: Any = None,
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The step's metrics over the ``world`` ranks of ``group`` (default: every rank; a
    collective when ``world > 1``): the sums and the algorithm's sums added, the maxima
    maxed. (The key sets may differ between ranks: they are gathered, not all-reduced.)"""
    local_metrics = {
        "sums": {k: float(v) for k, v in sums.items()},
        "algo": {k: float(v) for k, v in algo_sums.items()},
        "max": {k: float(v) for k, v in maxes.items()},
    }
    gathered = [local_metrics]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local_metrics, group=group)
    tot: dict[str, float] = {}
    algo: dict[str, float] = {}
    mx: dict[str, float] = {}
    for g in gathered:
        for k, v in g["sums"].items():
            tot[k] = tot.get(k, 0.0) + v
        for k, v in g["algo"].items():
            algo[k] = algo.get(k, 0.0) + v
        for k, v in g["max"].items():
            mx[k] = max(mx.get(k, 0.0), v)
    return tot, algo, mx


class TrainStep:
    """The forward passes and the optimizer step of
    :class:`skyrl_backends._trainer.TorchBackend` (a base class of it: these methods
    use the state its ``start()`` sets up: ``config``, ``device``, ``module``, ``_lm``,
    ``_ref_lm``, ``reference``, ``optimizer``, ``scheduler``, ``replay``,
    ``precision``, the data-parallel handles, and its ``_plan`` / ``_dummy`` /
    ``_all_reduce``)."""

    _compute_copy: Any = None  # a ComputeCopy when the update computes through bf16 copies (torch backend)

    def _autocast(self) -> Any:
        if self.config.compute_dtype == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _view(self, mb: MicroBatch) -> Any:
        from skyrl_host.interfaces import ReplayView

        return ReplayView(batch=mb.batch, slot_tokens=mb.slot_tokens, scored_tokens=mb.batch_idx, device=self.device)

    def _replaying(self, mb: MicroBatch) -> Any:
        """The replay strategies' contexts for one policy forward (and its backward)."""
        if not self.replay or mb.dummy or mb.batch is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        view = self._view(mb)
        for strategy in self.replay:
            stack.enter_context(strategy.replaying(view))
        return stack

    def _logprobs(self, module: Any, mb: MicroBatch, temperature: float, entropy: bool = False) -> tuple[Any, Any, Any]:
        """(logprobs [K], entropy [K] or None, logits): logprobs of the loss tokens under
        ``log_softmax(logits / temperature)``, from logits computed at ``keep`` only; or,
        with a scoring replay strategy (``support``), as that strategy normalises them
        (then the third item is the logprobs, not logits)."""
        keep = mb.keep if mb.n_loss else torch.zeros(1, dtype=torch.long, device=self.device)
        strategy = self._scorer_strategy
        if strategy is not None and mb.n_loss and mb.batch is not None:
            view = self._view(mb)

            def scorer(**kw: Any) -> Any:
                return strategy.score(view, mb.targets, temperature, **kw)

            with self._autocast():
                lp, ent = module(mb.ids, mb.pos, keep, scorer, **mb.model_kwargs)
            return lp, (ent.detach() if entropy else None), lp
        with self._autocast():
            logits = module(mb.ids, mb.pos, keep, **mb.model_kwargs)
        if logits.dtype in LOW_PRECISION:
            logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        if not mb.n_loss:
            return None, None, logits
        lse = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, mb.targets[:, None]).squeeze(-1) - lse
        ent = None
        if entropy:
            with torch.no_grad():
                z = logits.detach()
                ent = lse.detach() - (torch.softmax(z, dim=-1) * z).sum(-1)
        return lp, ent, logits


    def _teacher_share(self, mb: Any) -> torch.Tensor | None:
        """The micro-batch's share of the batch's ``teacher_logprobs`` side channel (the
        [teacher]'s logprob of each loss token), or None when the batch has none."""
        if mb.teacher is None and mb.batch is not None:
            teacher = mb.batch.side_channels.get("teacher_logprobs")
            if teacher is not None:
                mb.teacher = torch.as_tensor(np.asarray(teacher, dtype=np.float32)[mb.batch_idx], device=self.device)
        return mb.teacher

    def _teacher_topk(self, mb: Any, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """With the batch's ``teacher_topk_ids`` side channel (an algorithm's
        ``teacher_kl_topk``): the teacher's top-k logprobs of each loss token's position
        (``teacher_topk_logprobs`` [K, k]) and the policy's logprobs of the same ids under the
        same temperature (``topk_logprobs``, with their gradient), for LossInputs."""
        side = mb.batch.side_channels if mb.batch is not None else {}
        ids = side.get("teacher_topk_ids")
        if ids is None:
            return {}
        if self._scorer_strategy is not None:
            from skyrl_host.errors import UserError

            raise UserError("[algorithm] teacher_kl_topk needs the policy's logits over the whole vocabulary; the "
                            "replay strategy 'support' scores without them (drop one of the two)")
        top_ids = torch.as_tensor(np.asarray(ids)[mb.batch_idx].astype(np.int64), device=self.device)
        top_t = torch.as_tensor(np.asarray(side["teacher_topk_logprobs"], dtype=np.float32)[mb.batch_idx],
                                device=self.device)
        top_s = logits.gather(-1, top_ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
        return {"teacher_topk_logprobs": top_t, "topk_logprobs": top_s}

    def _loss_scale(self) -> float:
        """What each micro-batch's loss is multiplied by before its backward: the world size
        under data parallel (DDP and FSDP2 average gradients over ranks; the algorithm's loss
        is already normalised by global counts, so the sum is wanted)."""
        return float(self.world) if self._dp else 1.0

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to the global norm ``max_norm``; returns the norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    def train_step(
        self, batch: Any, advantages: Any, algorithm: Any, *, temperature: float, max_new_tokens: int
    ) -> Mapping[str, float]:
        if self.module is None:
            raise RuntimeError("train_step before start()")
        cfg = self.config
        t0 = time.perf_counter()
        needs_ref = bool(algorithm.needs_reference)
        if needs_ref and self.reference is None:
            raise RuntimeError("the algorithm needs a reference model, but the backend was started with reference=False")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampler's), found {temperature!r}")
        adv = _as_numpy(advantages).astype(np.float32, copy=False)
        if adv.shape != (batch.n_tokens,):
            raise ValueError(f"advantages must have one entry per token ({batch.n_tokens}), found shape {adv.shape}")

        plan = self._plan(batch, adv)
        n_mini = len(plan)
        # Normalisers of each mini-batch over all ranks, and the micro-batch counts to match.
        local = torch.tensor(
            [[sum(m.n_loss for m in micros), sum(m.n_seqs for m in micros), sum(m.n_tokens for m in micros),
              sum(m.n_sequences for m in micros)] for micros in plan],
            dtype=torch.float64,
        )
        totals = self._all_reduce(local)
        counts = self._all_reduce(torch.tensor([len(m) for m in plan], dtype=torch.int64), dist.ReduceOp.MAX if self._dp else None)
        for j, micros in enumerate(plan):
            micros.extend(self._dummy() for _ in range(int(counts[j]) - len(micros)))
        active = [j for j in range(n_mini) if totals[j, 0] > 0]  # a mini-batch without loss tokens does no update

        # The no-grad pass before the first update.
        copies = self._compute_copy
        if needs_ref or cfg.mini_batches > 1:
            with torch.no_grad(), (copies.forward_only() if copies is not None else contextlib.nullcontext()):
                for j in active:
                    for mb in plan[j]:
                        if cfg.mini_batches > 1:
                            with self._replaying(mb):
                                mb.old = self._logprobs(self._lm, mb, temperature)[0]
                        if needs_ref:
                            mb.ref = self._logprobs(self._ref_lm, mb, temperature)[0]

        sums: dict[str, torch.Tensor] = {}  # token-weighted sums, reduced over ranks at the end
        algo_sums: dict[str, torch.Tensor] = {}
        maxes: dict[str, torch.Tensor] = {}
        zero = torch.zeros((), dtype=torch.float64, device=self.device)

        def add(d: dict, key: str, value: torch.Tensor) -> None:
            d[key] = d.get(key, zero) + value.detach().to(torch.float64)

        grad_norms, lr = [], self.optimizer.param_groups[0]["lr"]
        scale = self._loss_scale()
        module = self._train_module
        for j in active:
            micros = plan[j]
            global_tokens, global_seqs = float(totals[j, 0]), float(totals[j, 1])
            self.optimizer.zero_grad(set_to_none=True)
            with copies.update() if copies is not None else contextlib.nullcontext():
                for i, mb in enumerate(micros):
                    sync = i == len(micros) - 1
                    ctx = self._ddp.no_sync() if (self._ddp is not None and not sync) else contextlib.nullcontext()
                    with ctx, self._replaying(mb):
                        lp, ent, logits = self._logprobs(module, mb, temperature, entropy=True)
                        if lp is None:
                            loss = logits.sum() * 0.0  # no loss token: a zero gradient that still reaches every parameter
                        else:
                            old = lp.detach() if mb.old is None else mb.old
                            inputs = LossInputs(
                                logprobs=lp, old_logprobs=old, engine_logprobs=mb.engine_lp, advantages=mb.adv,
                                mask=torch.ones_like(mb.adv), seq_ids=mb.seq_ids, n_seqs=mb.n_seqs,
                                global_tokens=global_tokens, global_seqs=global_seqs, ref_logprobs=mb.ref,
                                teacher_logprobs=self._teacher_share(mb), **self._teacher_topk(mb, logits),
                                max_response_len=max_new_tokens,
                            )
                            loss, metrics = algorithm.loss(inputs)
                            w = float(mb.n_loss)
                            for k, v in (metrics or {}).items():
                                add(algo_sums, k, torch.as_tensor(_to_float(v) * w, device=self.device))
                            add(sums, "entropy", ent.sum())
                            # The trainer's pre-update logprob against the engine's.
                            diff = (old.detach() - mb.engine_lp).abs()
                            add(sums, "logprob_diff", diff.sum())
                            maxes["logprob_diff_max"] = torch.maximum(maxes.get("logprob_diff_max", zero), diff.max().double())
                            if mb.ref is not None:  # the k3 estimate of KL(policy || reference), as a metric
                                add(sums, "kl", kl_estimate(old.detach(), mb.ref, "k3").sum())
                        add(sums, "loss", loss)
                        (loss * scale if scale != 1.0 else loss).backward()
                    if copies is not None:
                        copies.collect()  # the bf16 gradient into the float32 accumulator
            norm = self._clip_gradients(cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
            grad_norms.append(norm.detach().double())
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            if self.precision is not None:
                self.precision.invalidate()  # the next forward quantizes the new weights
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # free the gradients until the next step
        self.steps += 1

        tot, algo, mx = _reduce_metrics(sums, algo_sums, maxes, self.world if self._dp else 1, self._dp_group)
        n_loss = float(totals[active, 0].sum()) if active else 0.0
        per_tok = max(n_loss, 1.0)
        elapsed = time.perf_counter() - t0
        all_tokens = float(totals[:, 2].sum())
        out: dict[str, float] = {}
        for k, v in algo.items():
            out[k] = v / per_tok
        own = {
            "loss": tot.get("loss", 0.0) / max(1, len(active)),
            "entropy": tot.get("entropy", 0.0) / per_tok,
            "logprob_diff_mean": tot.get("logprob_diff", 0.0) / per_tok,
            "logprob_diff_max": mx.get("logprob_diff_max", 0.0),
            "grad_norm": float(torch.stack(grad_norms).mean()) if grad_norms else 0.0,
            "lr": float(lr),
            "updates": float(len(active)),
            "tokens": all_tokens,
            "loss_tokens": n_loss,
            "sequences": float(totals[:, 3].sum()),
            "tokens_per_s": all_tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
        }
        if needs_ref:
            own["kl"] = tot.get("kl", 0.0) / per_tok
        for k, v in own.items():
            if k in out:
                out[f"algorithm_{k}"] = out.pop(k)
            out[k] = v
        return out

    def reference_logprobs(self, batch: Any, *, temperature: float) -> np.ndarray:
        """float32 [T]: the frozen reference policy's logprobs of the batch's loss
        tokens (0 elsewhere), for KL penalties applied to rewards."""
        if self._ref_lm is None:
            raise RuntimeError("reference_logprobs needs start(..., reference=True)")
        out = np.zeros(batch.n_tokens, dtype=np.float32)
        plan = self._plan(batch, np.zeros(batch.n_tokens, dtype=np.float32))
        with torch.no_grad():
            for micros in plan:
                for mb in micros:
                    if mb.n_loss:
                        lp = self._logprobs(self._ref_lm, mb, temperature)[0]
                        out[mb.batch_idx] = lp.float().cpu().numpy()
        return out
