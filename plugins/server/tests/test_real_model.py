"""The official tinker SDK against ``skyrl serve`` serving a real pretrained model:
SmolLM2-135M-Instruct from its folder (``[models."NAME"] path = ...``, no family: the
folder's config.json picks the generic family ``hf``). Sampling and a LoRA training
step through the SDK alone."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

KEY = "tml-real-model"
BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served(skyrl_smollm2, tmp_path_factory):
    from skyrl_server.testing import serving

    folder = tmp_path_factory.mktemp("serve-real")
    with serving(folder, f"""
[server]
api_keys = ["{KEY}"]
storage = "{folder / 'storage'}"
max_lora_rank = 8

[models."{BASE}"]
path = "{skyrl_smollm2}"
""") as s:
        client = tinker.ServiceClient(base_url=s.url, api_key=KEY)
        yield s, client
        client.close("completed")


def chat(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_the_sdk_samples_a_real_models_answers(served) -> None:
    s, service = served
    base = s.service.bases[BASE]
    assert base.loaded.family == "hf" and type(base.loaded.model).__name__ == "LlamaForCausalLM"
    tok = base.loaded.tokenizer
    sampler = service.create_sampling_client(base_model=BASE).result()
    answers = {}
    for q in ("What is 7 + 5?", "What is the capital of France?"):
        res = sampler.sample(prompt=types.ModelInput.from_ints(chat(tok, q)), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=24, temperature=0.0)).result()
        seq = res.sequences[0]
        answers[q] = tok.decode(seq.tokens)
        assert len(seq.logprobs) == len(seq.tokens) and all(lp <= 0 for lp in seq.logprobs)
    assert "12" in answers["What is 7 + 5?"] and "Paris" in answers["What is the capital of France?"], answers


def test_a_lora_step_through_the_sdk_lowers_the_loss_on_a_real_model(served) -> None:
    s, service = served
    tok = s.service.bases[BASE].loaded.tokenizer
    training = service.create_lora_training_client(base_model=BASE, rank=8)
    prompt = chat(tok, "What is 7 + 5? Answer with just the number.")
    answer = tok.encode("12", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                        "weights": np.asarray(weights, dtype=np.float32)})
    losses = []
    for _ in range(3):
        fb = training.forward_backward([datum], loss_fn="cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.metrics["loss:sum"])
    assert losses[-1] < losses[0], losses
