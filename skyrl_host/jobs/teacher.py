"""The ``[teacher]`` of a distilling ``rl`` job: a model this project loads (any model
family, a preset or a folder), scoring the student's sampled tokens in the driver's
process (:class:`Teacher`), or the same model served by vLLM (``base_url``:
:class:`ServedTeacher`, its prompt logprobs).

:meth:`Teacher.logprobs` gives, for every token of a packed rollout batch, the
teacher's log-probability of that token after the ones before it, at the job's sampling
temperature (float32 [T]; 0 at each sequence's first token). Sequences are sorted by
length and padded into forwards of at most ``batch_tokens`` tokens. The student and the
teacher must share a tokenizer: ``skyrl validate`` compares them (families that load a
tokenizer alone), and the driver again once both are loaded.
"""

from __future__ import annotations

from typing import Any

from skyrl_host.errors import UserError


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """What is wrong when the two tokenizers do not map every token to the same id
    (naming both), else None."""
    if student.get_vocab() == teacher.get_vocab():
        return None
    name = lambda t: repr(str(t.name_or_path or "a preset's character tokenizer"))  # noqa: E731
    return (
        f"the teacher's tokenizer ({name(teacher)}, {len(teacher.get_vocab())} tokens) is not the student's "
        f"({name(student)}, {len(student.get_vocab())} tokens); the teacher scores the student's own tokens, so both "
        "must share one tokenizer"
    )


def check_same_tokenizer(student: Any, teacher: Any) -> None:
    """A UserError unless the two tokenizers map every token to the same id."""
    problem = tokenizer_mismatch(student, teacher)
    if problem is not None:
        raise UserError(f"[teacher]: {problem}")


#: The top-k logprob of a position the teacher does not score (each sequence's first token).
NO_LOGPROB = -1.0e4


def empty_topk(n_tokens: int, k: int) -> tuple[Any, Any]:
    """Top-k arrays for ``n_tokens`` tokens before any is scored: ids 0, logprobs NO_LOGPROB."""
    import numpy as np

    return np.zeros((n_tokens, k), dtype=np.int32), np.full((n_tokens, k), NO_LOGPROB, dtype=np.float32)


class Teacher:
    def __init__(self, loaded: Any, options: Any, *, temperature: float) -> None:
        import torch

        if options.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"[teacher] device {options.device!r}: this machine has no CUDA device")
        self.model = loaded.model.to(device=options.device, dtype=getattr(torch, options.dtype)).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.device, self.batch_tokens = options.device, int(options.batch_tokens)
        self.temperature = float(temperature) if temperature and temperature > 0 else 1.0
        self.pad_id = int(getattr(loaded.tokenizer, "pad_token_id", None) or 0)
        self.counters: dict[str, float] = {}  # what the step's metrics gain

    def logprobs(self, batch: Any) -> Any:
        return self.score(batch, 0)[0]

    def score(self, batch: Any, k: int) -> tuple[Any, Any, Any]:
        """(logprobs [T], top-k ids [T, k] int32, top-k logprobs [T, k]): the teacher's
        logprob of each token after the ones before it, and (``k`` > 0) its ``k`` most
        likely tokens at that position with their logprobs, most likely first (None, None
        when ``k`` is 0). Each sequence's first token has none: 0, and ids 0 with logprob
        :data:`NO_LOGPROB`."""
        import numpy as np
        import torch

        out = np.zeros(batch.n_tokens, dtype=np.float32)
        top_ids, top_lps = empty_topk(batch.n_tokens, k)
        cu = batch.cu_seqlens
        lens = np.diff(cu)
        order = np.argsort(-lens, kind="stable")
        start = 0
        with torch.inference_mode():
            while start < len(order):
                longest = int(lens[order[start]])
                count = max(1, self.batch_tokens // max(longest, 1))
                chunk = order[start : start + count]
                start += len(chunk)
                ids = torch.full((len(chunk), longest), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), longest), dtype=torch.long)
                for row, s in enumerate(chunk):
                    n = int(lens[s])
                    ids[row, :n] = torch.from_numpy(batch.tokens[cu[s] : cu[s + 1]].astype(np.int64))
                    mask[row, :n] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float() / self.temperature
                lsm = torch.log_softmax(logits[:, :-1], dim=-1)
                picked = lsm.gather(-1, ids[:, 1:, None])[..., 0].cpu().numpy()
                if k:
                    values, indices = lsm.topk(k, dim=-1)
                    values, indices = values.cpu().numpy(), indices.cpu().numpy()
                for row, s in enumerate(chunk):
                    n = int(lens[s])
                    out[cu[s] + 1 : cu[s + 1]] = picked[row, : n - 1]
                    if k:
                        top_ids[cu[s] + 1 : cu[s + 1]] = indices[row, : n - 1]
                        top_lps[cu[s] + 1 : cu[s + 1]] = values[row, : n - 1]
        return out, (top_ids if k else None), (top_lps if k else None)


class ServedTeacher:
    """A teacher behind an OpenAI-compatible vLLM server (``[teacher] base_url``): each
    sequence is sent as token ids to ``/completions`` with ``prompt_logprobs = k`` (the
    logprob of each prompt token after the ones before it, and its k most likely there;
    one token generated and dropped), in requests of at most ``batch_tokens`` tokens, ``concurrency`` at a time.

    The answer is untrusted: read up to a size fixed by the request, and every sequence
    must come back with one entry per token holding the token it was sent. vLLM's prompt
    logprobs are of the untempered distribution, so the job must sample at temperature 1."""

    def __init__(self, options: Any, *, temperature: float) -> None:
        import os

        if temperature != 1.0:
            raise UserError(
                f"[teacher] base_url: a vLLM server's prompt logprobs are of the model's untempered distribution, "
                f"but the job samples at temperature {temperature:g}; sample at temperature 1, or score the "
                "teacher in the driver's process (no base_url)"
            )
        self.options = options
        self.base = options.base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if options.api_key_env is not None:
            key = os.environ.get(options.api_key_env)
            if not key:
                raise UserError(f"[teacher] api_key_env: the environment variable {options.api_key_env!r} is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        import threading

        self.counters = {"teacher_requests": 0.0, "teacher_retries": 0.0}  # since the start; in the step's metrics
        self._lock = threading.Lock()  # the counters, from the request threads
        self.model = options.served_model or self._only_model()

    # -- HTTP ---------------------------------------------------------------------------

    def _call(self, method: str, route: str, body: Any, limit: int) -> Any:
        """One request with retries (connection errors, timeouts, 429 and 5xx); the JSON
        answer, read up to ``limit`` bytes."""
        import json
        import time
        import urllib.error
        import urllib.request

        url = f"{self.base}{route}"
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.options.retries + 1):
            with self._lock:
                self.counters["teacher_requests"] += 1
                self.counters["teacher_retries"] += attempt > 0
            if attempt:
                time.sleep(2.0 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, headers=self.headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.options.timeout) as reply:
                    raw = reply.read(limit + 1)
            except urllib.error.HTTPError as exc:
                detail = exc.read(2000).decode(errors="replace")
                if exc.code == 429 or exc.code >= 500:
                    last = f"HTTP {exc.code}: {detail[:300]}"
                    continue
                raise UserError(f"[teacher] base_url: {method} {url} answered HTTP {exc.code}: {detail[:500]}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                last = str(getattr(exc, "reason", None) or exc)
                continue
            if len(raw) > limit:
                raise UserError(f"[teacher] base_url: {url} answered more than {limit} bytes; refused")
            try:
                return json.loads(raw)
            except ValueError:
                raise UserError(f"[teacher] base_url: {url} answered something that is not JSON: {raw[:200]!r}") from None
        raise UserError(f"[teacher] base_url: {method} {url} failed {self.options.retries + 1} times; last: {last}")

    def _only_model(self) -> str:
        listed = self._call("GET", "/models", None, 1 << 20)
        ids = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)] if isinstance(listed, dict) else []
        ids = [i for i in ids if isinstance(i, str)]
        if len(ids) != 1:
            raise UserError(f"[teacher] base_url {self.base} serves {ids or 'no model'}; name one with served_model")
        return ids[0]

    # -- scoring ------------------------------------------------------------------------

    def _score(self, seqs: list[Any], k: int) -> list[tuple[Any, Any, Any]]:
        import numpy as np

        prompts = [[int(t) for t in s] for s in seqs]
        body = {"model": self.model, "prompt": prompts, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}
        limit = (1 << 20) + 400 * (k + 1) * sum(len(p) for p in prompts)
        answer = self._call("POST", "/completions", body, limit)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != len(prompts):
            raise UserError(f"[teacher] base_url: expected {len(prompts)} choices from /completions, found "
                            f"{len(choices) if isinstance(choices, list) else type(choices).__name__}")
        out: list[Any] = [None] * len(prompts)
        for choice in choices:
            index = choice.get("index") if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(prompts) or out[index] is not None:
                raise UserError(f"[teacher] base_url: a choice with a bad index {index!r}")
            ids, entries = prompts[index], choice.get("prompt_logprobs")
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise UserError(f"[teacher] base_url: sequence {index} of {len(ids)} tokens came back with "
                                f"{len(entries) if isinstance(entries, list) else 'no'} prompt logprobs (is it vLLM?)")
            values = np.zeros(len(ids), dtype=np.float32)
            top_ids, top_lps = empty_topk(len(ids), k)
            for t in range(1, len(ids)):
                entry = entries[t].get(str(ids[t])) if isinstance(entries[t], dict) else None
                value = entry.get("logprob") if isinstance(entry, dict) else None
                if not _is_logprob(value):
                    raise UserError(f"[teacher] base_url: sequence {index}, token {t} (id {ids[t]}): no logprob of "
                                    f"that token in the answer ({str(entries[t])[:200]})")
                values[t] = value
                if k:
                    top_ids[t], top_lps[t] = _top(entries[t], k, index, t)
            out[index] = (values, top_ids, top_lps)
        return out

    def logprobs(self, batch: Any) -> Any:
        return self.score(batch, 0)[0]

    def score(self, batch: Any, k: int) -> tuple[Any, Any, Any]:
        """As :meth:`Teacher.score`, from the server's prompt logprobs (``prompt_logprobs =
        k``: its k most likely tokens at each position, and the token sent)."""
        import concurrent.futures

        import numpy as np

        out = np.zeros(batch.n_tokens, dtype=np.float32)
        top_ids, top_lps = empty_topk(batch.n_tokens, k)
        cu = batch.cu_seqlens
        requests, current, used = [], [], 0
        for s in range(batch.n_sequences):
            n = int(cu[s + 1] - cu[s])
            if current and used + n > self.options.batch_tokens:
                requests.append(current)
                current, used = [], 0
            current.append(s)
            used += n
        if current:
            requests.append(current)
        with concurrent.futures.ThreadPoolExecutor(self.options.concurrency) as pool:
            scored = pool.map(lambda group: self._score([batch.tokens[cu[s]:cu[s + 1]] for s in group], k), requests)
            for group, values in zip(requests, scored):
                for s, (v, ids, lps) in zip(group, values):
                    out[cu[s]:cu[s + 1]] = v
                    top_ids[cu[s]:cu[s + 1]], top_lps[cu[s]:cu[s + 1]] = ids, lps
        out[cu[:-1]] = 0.0  # each sequence's first token has no context
        return out, (top_ids if k else None), (top_lps if k else None)


def _is_logprob(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value <= 0


def _top(entry: Any, k: int, index: int, t: int) -> tuple[list[int], list[float]]:
    """The k most likely tokens of one position of a vLLM answer (``{"id": {"logprob":
    ...}}``: its top k and the token sent), most likely first; checked."""
    found = []
    for key, item in entry.items():
        value = item.get("logprob") if isinstance(item, dict) else None
        if not (key.isdigit() and _is_logprob(value)):
            raise UserError(f"[teacher] base_url: sequence {index}, token {t}: a top-k entry {key!r}: {str(item)[:100]}")
        found.append((float(value), int(key)))
    if len(found) < k:
        raise UserError(f"[teacher] base_url: sequence {index}, token {t}: {len(found)} top-k entries, expected "
                        f"{k} (does the server allow --max-logprobs {k}?)")
    found.sort(key=lambda pair: -pair[0])
    return [i for _, i in found[:k]], [v for v, _ in found[:k]]
