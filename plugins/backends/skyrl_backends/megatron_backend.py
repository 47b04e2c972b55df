"""The megatron backend's implementation, for other distributions' code, tests and tools.

Importing this imports torch and megatron-core (unlike ``skyrl_backends.megatron``, the
registered module, which only declares the options and the factory). A job gets the
backend through the registry (``[backend] name = "megatron"``); these names are for code
that needs it directly:

- :class:`MegatronBackend`: a :class:`skyrl_host.interfaces.Backend` (build it from a
  ``skyrl_backends.megatron.MegatronBackendConfig``);
- :class:`MegatronLM`: a megatron-core ``GPTModel`` called on packed rows;
- :func:`describe` / :class:`NotExpressible`: how a Hugging Face config maps onto
  megatron-core, or what it lacks;
- :func:`hf_to_mcore` / :func:`mcore_to_hf`: weights in the other naming scheme;
- :func:`release_parallel_state`: megatron-core's groups (and the one-process
  torch.distributed group the backend started) torn down, for a process that goes on
  without the backend.
"""

from __future__ import annotations

from skyrl_backends._mcore_arch import NotExpressible, describe
from skyrl_backends._mcore_model import MegatronLM, hf_to_mcore, mcore_to_hf, release_parallel_state
from skyrl_backends._mcore_trainer import MegatronBackend

__all__ = ["MegatronBackend", "MegatronLM", "NotExpressible", "describe", "hf_to_mcore", "mcore_to_hf",
           "release_parallel_state"]
