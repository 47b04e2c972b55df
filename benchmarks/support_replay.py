"""Peak memory and time of support replay's logprobs against full-vocabulary logits (forward + backward).

    python benchmarks/support_replay.py [--tokens 4096] [--hidden 1024] [--vocab 151936]
                                        [--repeats 2] [--threads 2] [--max-gib 16] [--chunk 16384]
                                        [--token-chunk 512] [--methods support chunked full] [--quick]

The problem: ``K`` scored tokens (``--tokens``), each with a final hidden state [H]
(``--hidden``) and a kept candidate set (the ids the sampler could draw from under
top-p 0.9), an output head ``weight`` [V, H] with V = 151,936 (Qwen's vocabulary), no
bias, temperature 1, float32. Kept-set sizes are log-normal with median 30 and
sigma 1.5, rounded and clipped to [1, 4096] (mean ~90, p90 ~210, p99 ~1,000, the
largest of 4,096 near 4,000); the ids of a set are distinct and uniform over the
vocabulary; the target is a uniform member of its set. ``hidden`` ~ N(0, 1),
``weight`` ~ N(0, 1/H). The loss is ``sum(logprobs * c)``, c ~ N(0, 1) (like
advantages); backward goes to ``hidden`` and ``weight``. Methods, each timed forward +
backward:

- ``support``: ``support_logprobs(hidden, weight, None, targets, offsets, ids,
  chunk=--chunk)``, the candidate: reads only the kept rows of the head, never forms
  [K, V]; its working memory is mostly two gathered [chunk, H] float32 blocks, so
  ``--chunk`` (default: the module's 16,384 pairs) trades memory for per-chunk overhead;
- ``masked``: ``logits = hidden @ weight.T``, then ``masked_logprobs`` (log-softmax over
  the kept ids: the naive way to the same numbers);
- ``full``: ``logits = hidden @ weight.T``, ``logits.gather(targets) - logsumexp(logits)``
  over the whole vocabulary: what the torch backend's trainer does without support
  replay (``_Trainer._logprobs``), the real memory baseline (other numbers: not
  normalised over the kept set). ``--methods`` can add ``full_log_softmax``:
  ``log_softmax(logits).gather(targets)``, the same quantity the textbook way;
- ``chunked``: the same full-vocabulary logprobs the way a careful engineer writes them
  first, bounded by a chunk of tokens: ``--token-chunk`` tokens at a time through the head
  (``h[a:b] @ weight.T``), log-sum-exp and gather, keeping only each token's log-sum-exp;
  backward (a custom ``torch.autograd.Function``) recomputes each chunk's logits and
  forms that chunk's gradients at once (``softmax - onehot``, times the incoming
  gradient: ``grad_h[a:b] = G @ W``, ``grad_W += G.T @ h[a:b]``), so one ``[chunk, V]``
  block (plus a temporary) is alive at a time, forward or backward;
- ``chunked_checkpoint`` (not in the default set): each chunk's head product +
  ``log_softmax`` + gather under ``torch.utils.checkpoint`` (plain autograd, recomputed
  in backward).

  Before the timed runs, both chunked forms are checked against ``full`` on
  ``--check-tokens`` tokens with the chunk cut below that (so they really chunk): the
  logprobs and both gradients must agree to 1e-4 of each tensor's largest value, or the
  script exits with an error; ``numerics.chunked_vs_full`` also gives each one's (and
  ``full``'s) difference from a float64 computation.

Hidden size. The default is 1024 (Qwen3-0.6B: H 1024, V 151,936). H changes the cost of
the [K, H] x [H, V] products and the size of the [V, H] head gradient, while the
unchunked baselines' memory is [K, V] tensors (independent of H); ``--hidden 512`` runs
faster.

Memory. Torch's CPU tensors are malloc'd outside Python (tracemalloc does not see
them), and glibc serves every allocation above 32 MiB with its own mmap, unmapped again
on free, so the process's resident set follows the live big tensors. Each (method, K)
runs in its own fresh subprocess (``--worker``) that builds the inputs, warms up on 16
tokens, resets the kernel's high-water mark of the resident set (writes "5" to
``/proc/self/clear_refs``: VmHWM := VmRSS; if the kernel refuses, a thread samples VmRSS
every millisecond instead; ``memory_method`` says which), reads VmRSS, runs the timed
forward + backward once and reports ``peak_gib = VmHWM - VmRSS before``: what the
computation touched at its worst moment, inputs excluded. Of that, ``grads_gib`` is
the gradients the step leaves (hidden and the [V, H] head: every method must produce
them) and ``transient_gib = peak - grads`` the rest: the loss's own working memory.
Allocated but never touched pages take no memory and do not count.

Limit. Before the first run of a (method, K), the worker measures the peak the same
way on the first K_cal/2 and K_cal tokens (``--calibration-tokens``, default max(512, H):
with fewer than H tokens the line under-predicts) and extrapolates the line to K (the big
tensors are [K, V]; the prediction was within 0.1% of the measured peak for both unchunked
baselines at K = 4096; the chunked ones' peak stops growing once K passes a chunk, so their
prediction is an upper bound). A run predicted
above ``--max-gib`` (default 16) or above MemAvailable - 1 GiB is skipped and reported
with its prediction only (``measured: false``; ratios ``peak_memory_predicted``). At
V = 151,936 one [K, V] float32 tensor is 2.3 GiB at K = 4096 and 4.6 GiB at K = 8192;
``full`` peaks with ~3.9 of them alive, ``masked`` with ~6.4, so at K = 8192 neither
fits in 16 GiB (predicted 18.6 and 30 GiB) and only ``support`` runs there.

Time. ``--repeats`` rounds; each round runs every (K, method) once, each in a fresh
process, in the order of ``--methods`` in even rounds and reversed in odd ones (A B C,
C B A). Reported: the median seconds and the median of the per-round ratios ``baseline
/ support``. The default (2 rounds of support, chunked, full at K 4096, H 1024) takes
~5 minutes here; ``masked`` (~80 s a run at H 1024) is left out unless asked for.

Numerics. In this process, on ``--check-tokens`` tokens (default 512) of the same kind
of problem at the full vocabulary: the largest absolute differences between
``support`` and ``masked`` of logprobs, entropy and both gradients (float32; tolerance
1e-5).

``--quick``: H 64, K 128, one round, a 32-token check: a smoke test of ~10 seconds.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from skyrl_replay.support_math import DEFAULT_CHUNK, masked_logprobs, support_logprobs

GIB = 1 << 30
LEN_MEDIAN, LEN_SIGMA, LEN_MAX = 30.0, 1.5, 4096
METHODS = ("support", "masked", "full", "full_log_softmax", "chunked", "chunked_checkpoint")


# ---------------------------------------------------------------- the problem


def kept_sets(k: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(targets [K], offsets [K + 1], ids [M]): log-normal set sizes, distinct ids, target inside."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.rint(np.exp(rng.normal(np.log(LEN_MEDIAN), LEN_SIGMA, k))), 1, min(LEN_MAX, vocab))
    lens = lens.astype(np.int64)
    ids = np.concatenate([rng.choice(vocab, int(n), replace=False) for n in lens])
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    targets = ids[offsets[:-1] + rng.integers(0, lens)]
    return torch.from_numpy(targets), torch.from_numpy(offsets), torch.from_numpy(ids)


def problem(k: int, hidden: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    targets, offsets, ids = kept_sets(k, vocab, seed)
    return {
        "hidden": torch.randn(k, hidden, generator=g),
        "weight": torch.randn(vocab, hidden, generator=g) / hidden**0.5,
        "coef": torch.randn(k, generator=g),
        "targets": targets, "offsets": offsets, "ids": ids,
    }


def first(p: dict, k: int) -> dict:
    """The problem restricted to its first k scored tokens (same head)."""
    end = int(p["offsets"][k])
    return {"hidden": p["hidden"][:k].clone(), "weight": p["weight"], "coef": p["coef"][:k],
            "targets": p["targets"][:k], "offsets": p["offsets"][: k + 1], "ids": p["ids"][:end]}


class ChunkedLogprobs(torch.autograd.Function):
    """Full-vocabulary logprobs of ``targets`` through the head ``weight``, ``chunk`` tokens
    at a time: forward keeps only each token's log-sum-exp; backward recomputes every
    chunk's logits and turns them into that chunk's gradients at once (softmax minus the
    one-hot target, scaled by the incoming gradient), so no more than one chunk's
    ``[chunk, V]`` logits (plus a temporary) is ever alive, forward or backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int) -> torch.Tensor:
        out = torch.empty(h.shape[0], dtype=h.dtype)
        lse = torch.empty(h.shape[0], dtype=h.dtype)
        for a in range(0, h.shape[0], chunk):
            b = min(a + chunk, h.shape[0])
            logits = h[a:b] @ w.T
            if temperature != 1.0:
                logits.div_(temperature)
            lse[a:b] = torch.logsumexp(logits, dim=-1)
            out[a:b] = logits.gather(-1, targets[a:b, None]).squeeze(-1) - lse[a:b]
            del logits
        ctx.save_for_backward(h, w, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, w, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        for a in range(0, h.shape[0], chunk):
            b = min(a + chunk, h.shape[0])
            g = grad_out[a:b]
            logits = h[a:b] @ w.T
            if temperature != 1.0:
                logits.div_(temperature)
            # d lp / d logits = onehot(target) - softmax; times g, over the temperature.
            probs = logits.sub_(lse[a:b, None]).exp_().mul_(-(g / temperature)[:, None])
            probs.scatter_add_(-1, targets[a:b, None], (g / temperature)[:, None])
            if grad_h is not None:
                torch.mm(probs, w, out=grad_h[a:b])
            if grad_w is not None:
                grad_w.addmm_(probs.T, h[a:b])
            del logits, probs
        return grad_h, grad_w, None, None, None


def chunked_checkpoint_logprobs(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, temperature: float,
                                chunk: int) -> torch.Tensor:
    """The same with plain autograd: each chunk's head product + log_softmax + gather under
    ``torch.utils.checkpoint`` (its activations recomputed in backward, not kept)."""
    from torch.utils.checkpoint import checkpoint

    def piece(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        logits = hc @ w.T
        if temperature != 1.0:
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, tc[:, None]).squeeze(-1)

    return torch.cat([checkpoint(piece, h[a : a + chunk], targets[a : a + chunk], use_reentrant=False)
                      for a in range(0, h.shape[0], chunk)])


def logprobs(method: str, h: torch.Tensor, w: torch.Tensor, p: dict, temperature: float, chunk: int,
             token_chunk: int = 512) -> torch.Tensor:
    t, off, ids = p["targets"], p["offsets"], p["ids"]
    if method == "support":
        return support_logprobs(h, w, None, t, off, ids, temperature=temperature, chunk=chunk)[0]
    if method == "chunked":
        return ChunkedLogprobs.apply(h, w, t, temperature, token_chunk)
    if method == "chunked_checkpoint":
        return chunked_checkpoint_logprobs(h, w, t, temperature, token_chunk)
    logits = h @ w.T
    if method == "masked":
        return masked_logprobs(logits, t, off, ids, temperature=temperature)[0]
    if temperature != 1.0:
        logits = logits / temperature
    if method == "full":  # the trainer's way (_Trainer._logprobs)
        return logits.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if method == "full_log_softmax":
        return torch.log_softmax(logits, dim=-1).gather(-1, t[:, None]).squeeze(-1)
    raise ValueError(method)


def step(method: str, p: dict, temperature: float, chunk: int = DEFAULT_CHUNK,
         token_chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of sum(logprobs * coef); returns (grad hidden, grad weight)."""
    h = p["hidden"].detach().requires_grad_()
    w = p["weight"].detach().requires_grad_()
    (logprobs(method, h, w, p, temperature, chunk, token_chunk) * p["coef"]).sum().backward()
    return h.grad, w.grad


# ---------------------------------------------------------------- memory


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class PeakRSS:
    """Peak resident-set increase over a block: VmHWM after resetting it through
    /proc/self/clear_refs, or, if that is refused, VmRSS sampled every millisecond."""

    def __enter__(self) -> PeakRSS:
        gc.collect()
        self.method = "VmHWM after clear_refs=5"
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status("VmRSS")
            if _status("VmHWM") > self.base + (4 << 20):
                raise OSError("VmHWM was not reset")
            self._thread = None
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self.base = _status("VmRSS")
            self._max, self._stop = self.base, threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, _status("VmRSS"))
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.after = _status("VmRSS") - self.base
        if self._thread is None:
            self.peak = _status("VmHWM") - self.base
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self._max, self.after + self.base) - self.base


def worker(args: argparse.Namespace) -> None:
    """One (method, K) in this fresh process: warm up, calibrate (optional), predict, run, measure."""
    torch.set_num_threads(args.threads)
    method, k = args.worker, args.worker_tokens
    p = problem(k, args.hidden, args.vocab, seed=args.seed)
    step(method, first(p, min(16, k)), args.temperature, args.chunk, args.token_chunk)  # warm-up
    out = {"method": method, "tokens": k, "kept_ids": int(p["ids"].numel())}
    if args.calibrate:
        k2 = min(args.calibration_tokens, k)
        k1 = max(k2 // 2, 1)
        peaks = []
        for kc in (k1, k2):
            with PeakRSS() as cal:
                step(method, first(p, kc), args.temperature, args.chunk, args.token_chunk)
            peaks.append(cal.peak)
        slope = (peaks[1] - peaks[0]) / (k2 - k1) if k2 > k1 else peaks[1] / k2
        predicted = peaks[1] + slope * (k - k2)
        out.update(calibration_tokens=[k1, k2], calibration_peak_gib=[x / GIB for x in peaks],
                   predicted_peak_gib=predicted / GIB)
        avail = _status_meminfo("MemAvailable")
        if predicted > args.max_gib * GIB:
            out.update(measured=False, skipped=f"predicted peak {predicted / GIB:.1f} GiB > --max-gib {args.max_gib:g}")
        elif predicted > avail - GIB:
            out.update(measured=False,
                       skipped=f"predicted peak {predicted / GIB:.1f} GiB > MemAvailable {avail / GIB:.1f} GiB - 1 GiB")
        if "skipped" in out:
            print(json.dumps(out))
            return
    with PeakRSS() as m:
        t0 = time.perf_counter()
        gh, gw = step(method, p, args.temperature, args.chunk, args.token_chunk)
        seconds = time.perf_counter() - t0
    ok = bool(torch.isfinite(gh).all() and torch.isfinite(gw).all())
    grads = gh.numel() * gh.element_size() + gw.numel() * gw.element_size()  # what the step leaves behind
    out.update(measured=True, seconds=seconds, peak_gib=m.peak / GIB, grads_gib=grads / GIB,
               transient_gib=(m.peak - grads) / GIB, rss_after_gib=m.after / GIB, grads_finite=ok,
               memory_method=m.method)
    print(json.dumps(out))


def _status_meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_worker(args: argparse.Namespace, method: str, k: int, calibrate: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", method, "--worker-tokens", str(k), "--hidden", str(args.hidden),
           "--vocab", str(args.vocab), "--threads", str(args.threads), "--max-gib", str(args.max_gib),
           "--temperature", str(args.temperature), "--seed", str(args.seed), "--chunk", str(args.chunk),
           "--token-chunk", str(args.token_chunk),
           "--calibration-tokens", str(args.calibration_tokens)] + (["--calibrate"] if calibrate else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"method": method, "tokens": k, "measured": False,
                "skipped": f"worker failed (exit {res.returncode}): {res.stderr.strip()[-500:]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- numerics


def check(k: int, hidden: int, vocab: int, temperature: float, seed: int, chunk: int) -> dict:
    """Largest |support - masked| of logprobs, entropy and gradients on a k-token problem."""
    p = problem(k, hidden, vocab, seed=seed + 1)
    res = {}
    for method in ("support", "masked"):
        h = p["hidden"].detach().requires_grad_()
        w = p["weight"].detach().requires_grad_()
        if method == "support":
            lp, ent = support_logprobs(h, w, None, p["targets"], p["offsets"], p["ids"], temperature=temperature,
                                       chunk=chunk)
        else:
            lp, ent = masked_logprobs(h @ w.T, p["targets"], p["offsets"], p["ids"], temperature=temperature)
        (lp * p["coef"]).sum().backward()
        res[method] = {"logprobs": lp.detach(), "entropy": ent.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}
    diffs = {name: float((res["support"][name] - res["masked"][name]).abs().max()) for name in res["support"]}
    scale = {name: float(res["masked"][name].abs().max()) for name in res["masked"]}
    return {"tokens": k, "kept_ids": int(p["ids"].numel()), "dtype": "float32", "temperature": temperature,
            "max_abs_diff": diffs, "max_abs_value": scale, "tolerance": 1e-5,
            "within_tolerance": all(d <= 1e-5 for d in diffs.values())}


def check_chunked(k: int, hidden: int, vocab: int, temperature: float, seed: int, token_chunk: int,
                  methods: list[str], tolerance: float = 1e-4) -> dict:
    """The chunked baselines against the unchunked ``full`` on a k-token problem: logprobs
    and both gradients must agree to ``tolerance`` relative to each tensor's largest value
    (float32 rounding: a chunk's [chunk, V] x [V, H] product sums its 151,936 terms in
    another order than the [K, V] one); exits with an error otherwise. Both are also
    compared with a float64 computation (``vs_float64``), so either's rounding shows.
    The chunk is cut below k so that the check really chunks."""
    p = problem(k, hidden, vocab, seed=seed + 2)
    c = min(token_chunk, max(1, k // 3))
    res = {}
    for method in ["full", *methods]:
        h = p["hidden"].detach().requires_grad_()
        w = p["weight"].detach().requires_grad_()
        lp = logprobs(method, h, w, p, temperature, DEFAULT_CHUNK, c)
        (lp * p["coef"]).sum().backward()
        res[method] = {"logprobs": lp.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}
    h = p["hidden"].double().requires_grad_()
    w = p["weight"].double().requires_grad_()
    logits = (h @ w.T) / temperature
    lp = logits.gather(-1, p["targets"][:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    (lp * p["coef"].double()).sum().backward()
    exact = {"logprobs": lp.detach(), "grad_hidden": h.grad, "grad_weight": w.grad}
    del logits, h, w, lp

    def rel(a: dict, b: dict) -> dict:
        return {n: float(f"{float((a[n].double() - b[n].double()).abs().max() / b[n].abs().max()):.3g}") for n in b}

    out = {"tokens": k, "token_chunk": c, "tolerance_relative_to_max": tolerance,
           "full_vs_float64": rel(res["full"], exact)}
    for method in methods:
        diffs = rel(res[method], res["full"])
        bad = [n for n, d in diffs.items() if not d <= tolerance]
        if bad:
            raise SystemExit(f"support_replay.py: {method} differs from full in {', '.join(bad)} "
                             f"(largest |diff| / largest |value|: {diffs}; tolerance {tolerance:g})")
        out[method] = {"vs_full": diffs, "vs_float64": rel(res[method], exact), "equal_within_tolerance": True}
    return out


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096], help="scored tokens K")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--methods", nargs="+", default=["support", "chunked", "full"], choices=METHODS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-gib", type=float, default=16.0, help="skip runs predicted to need more")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--check-tokens", type=int, default=512)
    ap.add_argument("--calibration-tokens", type=int, help="default max(512, --hidden)")
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="support_logprobs' pairs per chunk")
    ap.add_argument("--token-chunk", type=int, default=512, help="tokens per chunk of the chunked baselines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (H 64, K 128, one round)")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.calibration_tokens is None:
        args.calibration_tokens = max(512, args.hidden)
    if min(args.tokens + [args.hidden, args.vocab, args.repeats, args.chunk, args.token_chunk, args.threads,
                          args.check_tokens, args.calibration_tokens]) < 1:
        ap.error("--tokens, --hidden, --vocab, --repeats, --chunk, --token-chunk, --threads, --check-tokens and "
                 "--calibration-tokens must be >= 1")
    if args.quick:
        args.tokens, args.hidden, args.repeats, args.check_tokens, args.calibration_tokens = [128], 64, 1, 32, 64
    if "support" not in args.methods:
        args.methods = ["support", *args.methods]
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    numerics = check(args.check_tokens, args.hidden, args.vocab, args.temperature, args.seed, args.chunk)
    chunked = [m for m in args.methods if m.startswith("chunked")]
    if chunked:
        numerics["chunked_vs_full"] = check_chunked(args.check_tokens, args.hidden, args.vocab, args.temperature,
                                                    args.seed, args.token_chunk, chunked)
    gc.collect()

    runs: dict[tuple[int, str], list[dict]] = {(k, m): [] for k in args.tokens for m in args.methods}
    for r in range(args.repeats):
        for k in args.tokens:
            for m in args.methods if r % 2 == 0 else args.methods[::-1]:  # A B C, then C B A
                prior = runs[(k, m)]
                if prior and not prior[0]["measured"]:  # skipped once (memory): skip in every round
                    continue
                runs[(k, m)].append(run_worker(args, m, k, calibrate=not prior))

    results = {}
    for k in args.tokens:
        _, offsets, _ = kept_sets(k, args.vocab, args.seed)
        lens = (offsets[1:] - offsets[:-1]).numpy()
        pct = {q: round(float(np.percentile(lens, q)), 1) for q in (90, 99)}
        entry = {"kept_ids": int(lens.sum()),
                 "kept_set_size": {"median": float(np.median(lens)), "mean": round(float(lens.mean()), 1),
                                   "p90": pct[90], "p99": pct[99], "max": int(lens.max())},
                 "logits_fp32_gib": k * args.vocab * 4 / GIB, "methods": {}, "ratios": {}}
        for m in args.methods:
            rs = [r for r in runs[(k, m)] if r.get("measured")]
            r0 = runs[(k, m)][0]
            if not rs:
                entry["methods"][m] = {"measured": False, "skipped": r0.get("skipped"),
                                       "predicted_peak_gib": round(r0.get("predicted_peak_gib", float("nan")), 2)}
                continue
            entry["methods"][m] = {
                "measured": True, "runs": len(rs),
                "seconds_median": round(statistics.median(r["seconds"] for r in rs), 3),
                "seconds_all": [round(r["seconds"], 3) for r in rs],
                "peak_gib": round(statistics.median(r["peak_gib"] for r in rs), 3),
                "peak_gib_range": [round(min(r["peak_gib"] for r in rs), 3), round(max(r["peak_gib"] for r in rs), 3)],
                "transient_gib": round(statistics.median(r["transient_gib"] for r in rs), 3),
                "grads_gib": round(rs[0]["grads_gib"], 3),
                "predicted_peak_gib": round(r0["predicted_peak_gib"], 2),
                "grads_finite": all(r["grads_finite"] for r in rs),
                "memory_method": rs[0]["memory_method"],
            }
        sup = entry["methods"]["support"]
        for m in args.methods:
            if m == "support" or not sup.get("measured"):
                continue
            e = entry["methods"][m]
            if e["measured"]:
                per_round = [b["seconds"] / s["seconds"] for s, b in zip(runs[(k, "support")], runs[(k, m)])
                             if s.get("measured") and b.get("measured")]
                entry["ratios"][m] = {
                    "peak_memory": round(e["peak_gib"] / sup["peak_gib"], 2),
                    "transient_memory": (round(e["transient_gib"] / sup["transient_gib"], 1)
                                         if sup["transient_gib"] > 0 else None),
                    "time": round(statistics.median(per_round), 2),
                    "time_per_round": [round(x, 2) for x in per_round],
                }
            else:
                entry["ratios"][m] = {
                    "peak_memory_predicted": round(e["predicted_peak_gib"] / sup["peak_gib"], 1), "time": None,
                    "note": "baseline not run (memory limit): predicted peak / measured support peak"}
        results[str(k)] = entry

    out = {
        "config": {"vocab": args.vocab, "hidden": args.hidden, "dtype": "float32", "temperature": args.temperature,
                   "kept_set_sizes": f"lognormal median {LEN_MEDIAN:g} sigma {LEN_SIGMA:g}, clipped [1, {LEN_MAX}]",
                   "methods": args.methods, "chunk": args.chunk, "token_chunk": args.token_chunk, "repeats": args.repeats, "threads": args.threads,
                   "max_gib": args.max_gib, "head_grad_gib": round(args.vocab * args.hidden * 4 / GIB, 3),
                   "torch": torch.__version__, "quick": args.quick},
        "numerics": numerics,
        "tokens": results,
        "ratio_meaning": "baseline / support: >1 means support uses less memory / time",
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
