"""The ``[teacher]`` of a distilling ``rl`` job: a model this project loads (any model
family, a preset or a folder), scoring the student's sampled tokens in the driver's
process.

:meth:`Teacher.logprobs` gives, for every token of a packed rollout batch, the
teacher's log-probability of that token after the ones before it, at the job's sampling
temperature (float32 [T]; 0 at each sequence's first token). Sequences are sorted by
length and padded into forwards of at most ``batch_tokens`` tokens. The student and the
teacher must share a tokenizer: the driver checks it before the first step.
"""

from __future__ import annotations

from typing import Any

from skyrl_host.errors import UserError


def check_same_tokenizer(student: Any, teacher: Any) -> None:
    """A UserError unless the two tokenizers map every token to the same id."""
    if student.get_vocab() == teacher.get_vocab():
        return
    name = lambda t: repr(str(t.name_or_path or "a preset's character tokenizer"))  # noqa: E731
    raise UserError(
        f"[teacher]: its tokenizer ({name(teacher)}, {len(teacher.get_vocab())} tokens) is not the student's "
        f"({name(student)}, {len(student.get_vocab())} tokens); the teacher scores the student's own tokens, so both "
        "must share one tokenizer"
    )


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

    def logprobs(self, batch: Any) -> Any:
        import numpy as np
        import torch

        out = np.zeros(batch.n_tokens, dtype=np.float32)
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
                picked = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0].cpu().numpy()
                for row, s in enumerate(chunk):
                    n = int(lens[s])
                    out[cu[s] + 1 : cu[s + 1]] = picked[row, : n - 1]
        return out
