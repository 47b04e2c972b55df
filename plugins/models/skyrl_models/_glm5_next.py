"""GLM-5.3-Flash's text model as a causal LM (imports torch and transformers).

transformers (5.24) ships ``glm5_next`` as the vision-language
``Glm5NextForConditionalGeneration`` and the bare decoder ``Glm5NextTextModel``
(``model_type = "glm5_next_text"``), with no causal-LM head for the decoder alone and
no ``AutoModelForCausalLM`` mapping. :class:`Glm5NextTextForCausalLM` is that head:
the decoder under ``model`` and an output projection ``lm_head`` (tied to the input
embedding when the config says so), so a checkpoint of it has the layout of every
other causal LM (``model.*`` + ``lm_head.weight``, saved with ``glm5_next_text`` as
its model type). Importing this module registers it with ``AutoModelForCausalLM``
for that model type unless transformers already maps one.

The decoder's layers (``config.layer_types``): Kimi-style delta-rule linear attention
with a per-channel forget gate (``"linear_attention"``: a short convolution state and a
recurrent state in the cache) and multi-head latent attention without rotary
embeddings whose keys a DeepSeek-style sparse-attention indexer picks
(``"indexed_attention"``; ``config.indexer_types`` says which layers run their own
indexer and which reuse the previous layer's choice); hyper-connections (``hc_mult``
residual streams) around every attention and MLP block; dense MLPs and DeepSeek-V3
MoE layers (``config.mlp_layer_types``).

:func:`text_model_from_vlm_folder` loads only the language model of a
``glm5_next`` (vision-language) folder into this class: the ``model.language_model.*``
weights and ``lm_head``; the vision tower's weights are never read.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.masking_utils import create_recurrent_attention_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig, Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextPreTrainedModel, Glm5NextTextModel
from transformers.utils import can_return_tuple

MODEL_TYPE = Glm5NextTextConfig.model_type  # "glm5_next_text": what a saved folder says
VLM_MODEL_TYPE = Glm5NextConfig.model_type  # "glm5_next": the published checkpoints

# The language model's weights in a glm5_next (vision-language) checkpoint, and
# where they go in the causal LM; the vision tower's are left unread.
_VLM_KEY_MAPPING = {r"^model\.language_model\.": "model."}


class Glm5NextTextForCausalLM(Glm5NextPreTrainedModel, GenerationMixin):
    """``Glm5NextTextModel`` + ``lm_head``: next-token logits of GLM-5.3-Flash's text model.

    ``forward`` takes what transformers' causal LMs take (``input_ids`` or
    ``inputs_embeds``, a 2-D ``attention_mask`` of real tokens, ``cache`` or its old
    name ``past_key_values``, ``use_cache``, ``labels``, ``logits_to_keep``). Position
    ids are accepted and unused: the attention has no rotary part and the linear
    attention is ordered by the sequence itself, so rows are left-padded (the mask
    zeroes the padding before the recurrent layers and the indexer starts its key
    pools at each row's first real token) and never packed."""

    config_class = Glm5NextTextConfig
    config: Glm5NextTextConfig
    base_model_prefix = "model"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _no_split_modules = ["Glm5NextTextDecoderLayer"]
    # a multi-token-prediction layer, shared heads, and the vision tower of a VLM folder
    _keys_to_ignore_on_load_unexpected = [
        *Glm5NextPreTrainedModel._keys_to_ignore_on_load_unexpected,
        r"^model\.visual\.",
    ]

    def __init__(self, config: Glm5NextTextConfig):
        super().__init__(config)
        self.model = Glm5NextTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_decoder(self) -> nn.Module:
        return self.model

    def set_decoder(self, decoder: nn.Module) -> None:
        self.model = decoder

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        else:
            kwargs.pop("past_key_values", None)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = slice_logits_to_keep(out.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=out.cache,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    @staticmethod
    def create_masks_for_generate(config: Any, inputs_embeds: Any, attention_mask: Any, cache: Any = None, **_: Any):
        """The masks ``generate`` hands the decoder when it prepares them itself (compilable
        caches): the 2-D mask of real tokens for both layer kinds, since the indexer
        builds its sparse mask from it and the linear attention zeroes padding with it."""
        mask = create_recurrent_attention_mask(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache
        )
        if mask is None:
            mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.bool, device=inputs_embeds.device)
        mask = mask.bool()
        return {"indexed_attention": mask, "linear_attention": mask}


def text_config_of_vlm(config: Glm5NextConfig) -> Glm5NextTextConfig:
    """The text config of a ``glm5_next`` config, as the causal LM's own: whether the
    output head is tied is the VLM's top-level ``tie_word_embeddings``."""
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def text_model_from_vlm_folder(path: str, *, dtype: torch.dtype, attn_implementation: str) -> Glm5NextTextForCausalLM:
    """The language model of a ``glm5_next`` folder as a :class:`Glm5NextTextForCausalLM`
    (only ``model.language_model.*`` and ``lm_head`` are read), in eval mode."""
    vlm_config = Glm5NextConfig.from_pretrained(path)
    text = text_config_of_vlm(vlm_config)
    model = Glm5NextTextForCausalLM.from_pretrained(
        path,
        config=text,
        key_mapping=dict(_VLM_KEY_MAPPING),
        dtype=dtype,
        attn_implementation=attn_implementation,
    )
    # transformers keeps the renamings a load used and reverts them when the model is
    # saved; this one must not be: the text model saves under its own names (model.*).
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [
            c for c in conversions if list(getattr(c, "source_patterns", ())) != list(_VLM_KEY_MAPPING)
        ]
    return model.eval()


def _register() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if Glm5NextTextConfig not in MODEL_FOR_CAUSAL_LM_MAPPING:
        # exist_ok: transformers otherwise skips (silently) a custom class for one of its own configs
        AutoModelForCausalLM.register(Glm5NextTextConfig, Glm5NextTextForCausalLM, exist_ok=True)


_register()
