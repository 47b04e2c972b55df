"""Real-shaped checkpoints built locally, for tests: the folder a downloaded model has.

:func:`build_checkpoint` writes a Hugging Face folder that ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained`` load like a downloaded checkpoint, with the shapes of a
real model family scaled to a CPU and random weights from a seed:

``"qwen3"``
    Qwen3-0.6B's widths (hidden 1024, 16 heads, 8 KV heads, head_dim 128, intermediate
    3072, tied embeddings) with 2 layers.
``"qwen3_moe"``
    Qwen3-30B-A3B's style (hidden 1024, 16 heads, 4 KV heads, head_dim 128) with 2 MoE
    layers of 8 experts of width 256, top-2, renormalised.
``"glm4_moe"``
    GLM-4.5's style (partial rotary, q/k/v bias, a dense first layer, sigmoid routing with a
    correction bias and a shared expert), 2 layers, 8 small experts.
``"deepseek_v3"``
    Kimi K2's architecture (DeepSeek-V3: multi-head latent attention, a dense first layer,
    group-limited sigmoid routing, a shared expert), 2 layers, 8 small experts.

Every folder holds the same tokenizer (:func:`build_tokenizer`): a byte-level BPE with
Qwen's pre-tokenizer split (digits one by one), about 8k tokens, trained here on a
generated corpus (English words, digits, math word problems); Qwen's special tokens
``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS, the end of a turn) and a
Qwen3-style ChatML chat template (:data:`CHAT_TEMPLATE`). As in Qwen3's own folders the
config's ``eos_token_id`` is ``<|im_end|>``, the generation config's is
``[<|im_end|>, <|endoftext|>]``, and the embedding rows are padded past the tokenizer's
length (to a multiple of 128). Weights are saved in bfloat16, as released checkpoints are.

Training the tokenizer takes about a second; pass ``tokenizer=`` (a folder that
:func:`build_tokenizer` wrote) to reuse one. The ``skyrl_real_checkpoint`` fixture
(:mod:`skyrl_models.testing`) does, once per test session.

Imports torch and transformers when called (not when imported).
"""

from __future__ import annotations

import os
import pathlib
import random
from typing import Any, Iterator

KINDS = ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")

FAMILY = {"qwen3": "qwen", "qwen3_moe": "qwen", "glm4_moe": "glm", "deepseek_v3": "kimi"}
"""The ``[model] family`` that loads each kind."""

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
THINK_TOKENS = ("<think>", "</think>")  # added (not special) tokens, as in Qwen3's vocabulary

VOCAB_SIZE = 8192  # what the BPE trainer aims at
PAD_MULTIPLE = 128  # the embedding rows are the tokenizer's length rounded up to this

# Qwen2/Qwen3's pre-tokenizer pattern: words with their leading space, digits one at a time.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's ChatML layout: an optional system turn first, then ``<|im_start|>role\\ncontent<|im_end|>\\n``
per message; ``add_generation_prompt`` opens the assistant's turn (with an empty think block
when ``enable_thinking=False``, as Qwen3's template does)."""

_WORDS = tuple((
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their "
    "time if will way about many then them write would like so these her long make thing see him two has look "
    "more day could go come did number sound no most people my over know water than call first who may down "
    "side been now find any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air well also play "
    "small end put home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build self earth "
    "father head stand own page should country found answer school grow study still learn plant cover food sun "
    "four between state keep eye never last let thought city tree cross farm hard start might story saw far sea "
    "draw left late run while press close night real life few north open seem together next white children begin "
    "got walk example ease paper group always music those both mark often letter until mile river car feet care "
    "second book carry took science eat room friend began idea fish mountain stop once base hear horse cut sure "
    "watch color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon "
    "body dog family direct pose leave song measure door product black short numeral class wind question happen "
    "complete ship area half rock order fire south problem piece told knew pass since top whole king space heard "
    "best hour better true during hundred five remember step early hold west ground interest reach fast verb sing "
    "listen six table travel less morning ten simple several vowel toward war lay against pattern slow center love "
    "person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly "
    "fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty drive "
    "stood contain front teach week final gave green oh quick develop ocean warm free minute strong special mind "
    "behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide "
    "surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder laugh "
    "thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant fill east paint "
    "language among apple apples orange oranges marble marbles coin coins pencil pencils cookie cookies dollar "
    "dollars cent cents total sum difference product quotient twice half third quarter altogether left remaining "
    "each every more fewer than how many much buys sells gives gets shares equally between among friends bought "
    "sold cost costs price spent saves earns per hours minutes days weeks times plus minus divided multiplied equals "
    "reverse digits calculate compute solve explain step think final answer result user assistant system hello "
    "please thank thanks sorry yes no maybe true false because therefore first second third next finally"
).split())
_NAMES = tuple("Alice Bob Carol Dave Emma Frank Grace Henry Ivy Jack Kate Liam Mia Noah Olivia Paul Quinn Ruth Sam Tom".split())
_ONSETS = ("b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "cl", "dr", "fl", "gr", "pl", "st", "tr", "sh", "ch", "th", "qu", "sp", "str")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "sh", "x")


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 4)))


def _problem(rng: random.Random) -> str:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    name, other = rng.sample(_NAMES, 2)
    thing = rng.choice(("apples", "marbles", "coins", "pencils", "cookies", "books", "dollars"))
    kind = rng.randrange(4)
    if kind == 0:
        return f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have? {name} has {a + b} {thing}."
    if kind == 1:
        return f"{name} had {a + b} {thing} and gave {b} to {other}. How many are left? {a + b} - {b} = {a}."
    if kind == 2:
        return f"Each box holds {b} {thing}. How many {thing} are in {a} boxes? {a} * {b} = {a * b}."
    return f"{name} shares {a * b} {thing} equally among {b} friends. Each friend gets {a * b} / {b} = {a}."


def corpus(seed: int = 0, n: int = 6000) -> Iterator[str]:
    """The tokenizer's training text: English sentences, pseudo-words, numbers, math word
    problems and ChatML turns, a pure function of ``seed``."""
    rng = random.Random(seed)
    for i in range(n):
        r = i % 5
        if r == 0:
            yield _problem(rng)
        elif r == 1:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 16))]
            yield " ".join(words).capitalize() + rng.choice((".", "?", "!", ","))
        elif r == 2:
            yield " ".join(_pseudo_word(rng) for _ in range(rng.randint(4, 12))) + "."
        elif r == 3:
            yield " ".join(str(rng.randint(0, 10 ** rng.randint(1, 8))) for _ in range(rng.randint(2, 8)))
        else:
            yield (f"{IM_START}user\n{_problem(rng)}{IM_END}\n{IM_START}assistant\n"
                   f"The answer is {rng.randint(0, 9999)}.{IM_END}\n")


def build_tokenizer(path: str | os.PathLike[str], *, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> pathlib.Path:
    """Train the byte-level BPE tokenizer on :func:`corpus` and save it (with
    :data:`CHAT_TEMPLATE`) as a Hugging Face tokenizer folder at ``path``; returns the path."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(seed), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=40960,
        padding_side="left",
    )
    tokenizer.add_tokens(list(THINK_TOKENS))
    out = pathlib.Path(path)
    tokenizer.save_pretrained(out)
    return out


def _padded(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def model_config(kind: str, tokenizer: Any) -> Any:
    """The transformers config of ``kind`` (see the module's docstring) for ``tokenizer``."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    ids = {
        "vocab_size": _padded(len(tokenizer)),
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "max_position_embeddings": 40960,
    }
    if kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(
            hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
            intermediate_size=3072, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True, **ids,
        )
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            intermediate_size=3072, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
            rope_theta=1_000_000.0, tie_word_embeddings=False, **ids,
        )
    if kind == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(
            hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, intermediate_size=1024,
            moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            tie_word_embeddings=False, **ids,
        )
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        hidden_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, intermediate_size=1024,
        moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        tie_word_embeddings=False, **ids,
    )


def build_checkpoint(
    path: str | os.PathLike[str],
    kind: str = "qwen3",
    seed: int = 0,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
) -> pathlib.Path:
    """Write a real-shaped checkpoint of ``kind`` (one of :data:`KINDS`) with random weights
    from ``seed`` at ``path`` (a new or empty folder); returns the path. ``tokenizer``: a
    folder written by :func:`build_tokenizer` to reuse (else one is trained into ``path``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        tokenizer = build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    config = model_config(kind, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=None, pad_token_id=config.pad_token_id, eos_token_id=[config.eos_token_id, config.pad_token_id],
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.to(torch.bfloat16).save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tok.save_pretrained(out)
    return out
