"""``reward_model``: a local sequence-classification model (a Hugging Face
``AutoModelForSequenceClassification`` folder: a trained reward model) scores each prompt
and response.

The pair is rendered as the model was trained to read it: a chat prompt with the
model's chat template, the response as the assistant's turn (``add_generation_prompt``
off); a plain prompt as prompt + response. Batched (``batch_size``), truncated to
``max_length`` tokens from the left (the response's end is kept), on ``device``. The
score is the logit ``label`` (0 for a one-output reward model), optionally passed through
a sigmoid (``sigmoid = true``: a score in (0, 1)). The model is made once per process and
never trained."""

from __future__ import annotations

import os
from typing import Any, Literal, Sequence

import attrs

from skyrl_host import hookimpl
from skyrl_host.errors import Problem, UserError
from skyrl_host.interfaces import Task
from skyrl_host.options import ge, gt, option


def _check_folder(_inst: Any, _attr: Any, value: str) -> None:
    folder = os.path.expanduser(value)
    if not os.path.isdir(folder):
        raise ValueError(f"expected a local folder holding a sequence-classification model, found nothing at {value!r}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"{value!r} holds no config.json: not a Hugging Face model folder")


@attrs.frozen
class RewardModelConfig:
    path: str = option(help="a local AutoModelForSequenceClassification folder (with its tokenizer)",
                       validator=_check_folder)
    weight: float = option(1.0, help="this part's share of the job's reward")
    label: int = option(0, help="the logit that is the score (0 for a one-output reward model)", validator=ge(0))
    sigmoid: bool = option(False, help="pass the logit through a sigmoid (a score in (0, 1))")
    batch_size: int = option(16, help="pairs per forward", validator=gt(0))
    max_length: int = option(2048, help="tokens per pair at most (the start is cut)", validator=gt(0))
    device: str = option("cpu", help="where the model runs: cpu, cuda, cuda:1, ...")
    dtype: Literal["float32", "bfloat16"] = option("float32", help="the dtype it computes in")


class RewardModel:
    def __init__(self, config: RewardModelConfig, dataset: Any = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.config, self.weight = config, config.weight
        folder = os.path.expanduser(config.path)
        where = {"key": "reward.reward_model.path"}
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(Problem(f"device {config.device!r}: this machine has no CUDA device",
                                    key="reward.reward_model.device"))
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.classifier = AutoModelForSequenceClassification.from_pretrained(folder, dtype=getattr(torch, config.dtype))
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(Problem(f"cannot load a sequence-classification model from {config.path!r}: "
                                    f"{' '.join(str(exc).split())[:300]}", **where)) from None
        labels = int(self.classifier.config.num_labels)
        if config.label >= labels:
            raise UserError(Problem(f"label {config.label}: the model has {labels} output(s)",
                                    key="reward.reward_model.label"))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.classifier.config.pad_token_id is None:  # the classifier reads the last token before the padding
            self.classifier.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.classifier.to(config.device).eval()

    def text(self, task: Task, completion: str) -> str:
        if task.messages is not None and self.tokenizer.chat_template:
            turns = [dict(m) for m in task.messages] + [{"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
        return task.prompt + completion

    def score(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        import torch

        texts = [self.text(t, c) for t, c in zip(tasks, completions)]
        out: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.config.batch_size):
                enc = self.tokenizer(texts[start : start + self.config.batch_size], padding=True, truncation=True,
                                     max_length=self.config.max_length, return_tensors="pt").to(self.config.device)
                logits = self.classifier(**enc).logits[:, self.config.label].float()
                if self.config.sigmoid:
                    logits = torch.sigmoid(logits)
                out += logits.cpu().tolist()
        return out


@hookimpl
def skyrl_register_rewards(register: Any) -> None:
    register("reward_model", RewardModel, config=RewardModelConfig,
             description="A local sequence-classification reward model scoring prompt + response")
