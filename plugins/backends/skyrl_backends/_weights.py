"""Weights and checkpoints of the torch backend: what the engine serves (full, per-rank
shards, quantized payloads, LoRA adapters), the adapter files, and the backend's
state (model, optimizer, scheduler, steps) to save and restore.

Names are always the model's own (Hugging Face) names; with LoRA, named/serving
weights are the merged weights under the plain names, and checkpoints hold the
adapters only (the frozen base is rebuilt from the model family).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def _copy_containers(obj: Any) -> Any:
    """dicts and lists copied, tensors and other leaves shared."""
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


class WeightsAndCheckpoints:
    """The weight, adapter and checkpoint methods of
    :class:`skyrl_backends._trainer.TorchBackend` (a base class of it: these methods
    use the state its ``start()`` sets up: ``config``, ``module``, ``optimizer``,
    ``scheduler``, ``steps``, ``lora``, ``precision``, ``rank``, ``world``, ``_dp``)."""

    def _fsdp(self) -> bool:
        return self._dp and self.config.data_parallel == "fsdp2"

    def serving_weights(self, local: bool = False) -> Iterator[tuple[str, Any]]:
        """What the engine must serve: :meth:`named_weights` (``local``: this rank's
        :meth:`local_weights`), with every weight the precision quantizes as its payload
        plus its scales (``precision.pack``; a rank's shard quantized by itself, as a
        shard of the whole payload), so the engine computes with exactly the numbers the
        trainer's forward used. Without a precision, the weights as they are."""
        weights = self.local_weights() if local else self.named_weights()
        return weights if self.precision is None else self.precision.pack(weights)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """The model's state as (name, tensor) pairs, with Hugging Face names.
        Under FSDP2 this is a collective (every rank calls it) and only rank 0
        gets the full tensors (on CPU); the other ranks get none."""
        if self.module is None:
            raise RuntimeError("named_weights before start()")
        if self._fsdp():
            sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = {k: v.detach() for k, v in self.module.state_dict().items()}
        if self.lora is not None:
            sd = self.lora.merge(sd)  # what a model without adapters holds: plain names, merged weights
        return iter(list(sd.items()))

    def local_weights(self) -> Iterator[tuple[str, Any]]:
        """This rank's part of the model's state, with Hugging Face names, gathering
        nothing (never a collective): under FSDP2 each value is the parameter's
        ``DTensor`` (``.to_local()`` is this rank's shard, ``.placements`` and
        ``.shape`` say where it sits in the full tensor); otherwise the full tensors.
        For sharded transports (``nixl``), where each rank serves its own shards."""
        if self.module is None:
            raise RuntimeError("local_weights before start()")
        if self.lora is not None:
            if self._fsdp():
                raise RuntimeError(
                    "local_weights: a LoRA model under FSDP2 has no per-rank shards of its merged weights; "
                    "publish the adapters (transport = \"lora\") or the gathered weights (named_weights) instead"
                )
            return self.named_weights()
        return iter([(k, v.detach()) for k, v in self.module.state_dict().items()])

    # -- LoRA adapters --------------------------------------------------------------

    def adapter_config(self) -> dict[str, Any] | None:
        """``{"rank", "alpha", "targets"}`` of the trained adapters (None without LoRA):
        what a receiver needs to apply :meth:`named_adapters`. The adapters' output is
        scaled by ``alpha / rank``; ``targets`` are the adapted Linear modules' last name
        components."""
        return None if self.lora is None else self.lora.config()

    def named_adapters(self) -> Iterator[tuple[str, Any]]:
        """Only the adapter tensors, ``(<module path>.lora_A [rank, in], <module
        path>.lora_B [out, rank])`` for every adapted module in module order, e.g.
        ``model.layers.0.self_attn.q_proj.lora_A``. Under FSDP2 a collective (every
        rank calls it; every rank gets the full tensors). Views of the live parameters:
        copy them to keep a version."""
        if self.module is None:
            raise RuntimeError("named_adapters before start()")
        if self.lora is None:
            raise RuntimeError("named_adapters: this backend trains every weight ([backend] lora_rank = 0), it has no adapters")
        params = dict(self.module.named_parameters())
        out = []
        for name in self.lora.parameter_names():
            p = params[name].detach()
            if hasattr(p, "full_tensor"):
                p = p.full_tensor()
            out.append((name, p))
        return iter(out)

    def save_adapters(self, path: str, *, base_model: str | None = None) -> None:
        """Write the adapters into the folder ``path`` as a PEFT LoRA adapter, which
        ``peft.PeftModel.from_pretrained(base, path)`` and vLLM load:

        - ``adapter_model.safetensors``: every tensor of :meth:`named_adapters` (float32)
          under PEFT's name, ``base_model.model.<module path>.lora_A.weight`` ``[rank, in]``
          and ``...lora_B.weight`` ``[out, rank]``;
        - ``adapter_config.json``: ``peft_type = "LORA"``, ``task_type = "CAUSAL_LM"``,
          ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``use_rslora = false``
          (PEFT then scales by ``lora_alpha / r``, as :mod:`skyrl_backends._lora` does),
          ``bias = "none"`` and ``base_model_name_or_path`` = ``base_model`` (the folder of
          the frozen base the adapters were trained on; None when not given).

        ``target_modules`` are the adapted modules' last name components (what the
        ``lora_targets`` option takes), unless PEFT's rule (a module whose name ends in a
        target) would pick modules this backend did not adapt: then the adapted modules'
        full paths. Under DDP/FSDP2 a collective (every rank calls it); rank 0 writes.
        Not beside a merged model in one folder: transformers takes a folder holding
        ``adapter_config.json`` for a PEFT adapter (the final save uses ``final/adapter/``)."""
        import json
        import pathlib

        from safetensors.torch import save_file

        if self.lora is None:
            raise RuntimeError("save_adapters: this backend has no adapters ([backend] lora_rank = 0)")
        tensors = {
            f"base_model.model.{k}.weight": v.detach().to("cpu", torch.float32).contiguous()
            for k, v in self.named_adapters()
        }
        if self._dp and self.rank != 0:
            return
        folder = pathlib.Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = self.lora.peft_config(self.module, base_model)
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def state_dict(self) -> Mapping[str, Any]:
        """Model, optimizer (keyed by parameter name), scheduler and step counts, on CPU.
        Under DDP/FSDP2 every rank calls it; rank 0 gets the full state."""
        if self.module is None:
            raise RuntimeError("state_dict before start()")
        # With LoRA only the adapters: the frozen base is rebuilt from the model family.
        model_sd, optim_sd = get_state_dict(
            self.module, self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.lora is not None),
        )
        if self.lora is not None:  # (ignore_frozen_params still lists a tied alias of a frozen weight)
            model_sd = {k: v for k, v in model_sd.items() if self.lora.is_adapter(k)}
        state = {
            "format": 1,
            "model": _clone_tree(model_sd),
            "optimizer": _clone_tree(optim_sd),
            "scheduler": _clone_tree(self.scheduler.state_dict()),
            "steps": self.steps,
        }
        if self.lora is not None:
            state["lora"] = self.adapter_config()  # load_state_dict checks it against its own
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a started backend. Under DDP/FSDP2 every
        rank calls it and rank 0's state is broadcast (the others may pass ``{}``)."""
        if self.module is None:
            raise RuntimeError("load_state_dict before start(): start the backend, then load")
        distributed = self._dp and self.world > 1
        meta = [{"scheduler": state.get("scheduler"), "steps": state.get("steps"), "lora": state.get("lora")}]
        if distributed:
            dist.broadcast_object_list(meta, src=0)
        if meta[0]["steps"] is None:
            raise ValueError("not a torch backend state: no 'steps'")
        if meta[0]["lora"] != self.adapter_config():
            def what(c: Any) -> str:
                return "full fine-tuning (lora_rank = 0)" if c is None else f"LoRA {c}"

            raise ValueError(
                f"the checkpoint was written by {what(meta[0]['lora'])}, but this backend runs {what(self.adapter_config())}: "
                "[backend] lora_rank, lora_alpha and lora_targets must match the run being resumed"
            )
        # Two calls: set_state_dict skips the model on ranks given an empty model state.
        # With LoRA the state holds the adapters only (strict=False: the frozen base stays).
        options = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=distributed, strict=self.lora is None
        )
        # (Copies of the containers: torch writes into the dicts it is given.)
        set_model_state_dict(self.module, _copy_containers(state.get("model", {})), options=options)
        set_optimizer_state_dict(self.module, self.optimizer, _copy_containers(state.get("optimizer", {})), options=options)
        if self._compute_copy is not None:
            self._compute_copy.forget()  # frozen weights may have changed: cast them again
        self.scheduler.load_state_dict(meta[0]["scheduler"])
        self.steps = int(meta[0]["steps"])
        if self.precision is not None:
            self.precision.invalidate()
