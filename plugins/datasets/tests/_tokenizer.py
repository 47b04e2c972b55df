"""A tiny tokenizer for the corpus and `skyrl data` tests, built here (no hub): loaded by
path by conftest.py as the module ``skyrl_datasets_tests_tokenizer``."""

from __future__ import annotations

import pathlib

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, with the assistant text marked for transformers' return_assistant_tokens_mask,
# so the tests can compare our loss mask with transformers' own.
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "What is 7 times 6? The answer is 42.",
    "user assistant system: hello, how are you today? I am fine, thank you.",
    "Pack documents into micro-batches without padding; the loss mask marks assistant turns.",
]


def build_tokenizer(folder: pathlib.Path, *, chat_template: str | None = CHATML, vocab: int = 600) -> pathlib.Path:
    """A byte-level BPE tokenizer trained on a few sentences, saved as a Hugging Face folder:
    real merges (tokens span several characters, offsets matter), special tokens, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAINING_TEXT * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", chat_template=chat_template)
    tok.save_pretrained(folder)
    return folder
