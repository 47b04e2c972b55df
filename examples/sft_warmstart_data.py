"""Build the SFT corpus of examples/sft_warmstart.toml: reverse_digits solved.

    python examples/sft_warmstart_data.py            # -> runs/data/reverse_digits_sft.*

Each document is a prompt of the ``reverse_digits`` task (digits only, as in
examples/quickstart.toml: ``"4071:"``) followed by its answer and the end token
(``"1704</s>"``), tokenized with the character-level tokenizer the ``qwen`` family
builds for the task's alphabet (so the ids are the ones the SFT model and the RL job
after it use). The loss mask is 0 on the prompt and 1 on the answer and the end
token: the model learns to answer, not to ask.

For text in JSONL or Parquet and a Hugging Face tokenizer, use ``skyrl data tokenize``
instead; this script writes through the same :class:`skyrl_datasets.corpus.CorpusWriter`.
"""

from __future__ import annotations

import argparse
import pathlib

ALPHABET = "0123456789:"  # reverse_digits with prefix = "": every character of a prompt or an answer
DEFAULT_PREFIX = "runs/data/reverse_digits_sft"


def build(prefix: str | pathlib.Path, *, documents: int = 4000, seed: int = 1234, min_len: int = 3, max_len: int = 5) -> dict:
    """Write the corpus at ``prefix``; returns the writer's summary (the header)."""
    from skyrl_host.plugins import build_host

    from skyrl_datasets.corpus import CorpusWriter
    from skyrl_datasets.reverse_digits import ReverseDigits, ReverseDigitsConfig
    from skyrl_models.qwen import QwenConfig

    tasks = ReverseDigits(ReverseDigitsConfig(min_len=min_len, max_len=max_len, prefix=""), seed=seed)
    assert set(tasks.alphabet) == set(ALPHABET)
    # The tokenizer the SFT job's model gets: the qwen family's preset for this alphabet.
    family = build_host().get("models", "qwen").create(QwenConfig(preset="tiny"))
    tokenizer = family.load(alphabet=ALPHABET, seed=0).tokenizer
    eos = tokenizer.eos_token_id
    with CorpusWriter(prefix, vocab_size=len(tokenizer), eos_id=eos, tokenizer=f"qwen tiny preset, alphabet {ALPHABET!r}",
                      with_mask=True) as writer:
        step = 1
        while writer.n_docs < documents:
            for task in tasks.batch(step, min(256, documents - writer.n_docs)):
                prompt = tokenizer.encode(task.prompt)
                answer = tokenizer.encode(task.answer) + [eos]
                writer.add(prompt + answer, [0] * len(prompt) + [1] * len(answer))
            step += 1
    return {"prefix": str(prefix), "documents": documents, "vocab_size": len(tokenizer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_PREFIX, help=f"corpus prefix (default {DEFAULT_PREFIX})")
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    print(build(args.out, documents=args.documents, seed=args.seed))


if __name__ == "__main__":
    main()
