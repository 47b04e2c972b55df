"""skyrl-backends: training backends (torch, megatron).

Each feature is one module here with its own ``skyrl`` entry point: ``torch``
(``skyrl_backends.torch``) and ``megatron`` (``skyrl_backends.megatron``). Feature
modules import no heavy module at import time; the implementation is imported by the
factory. Code outside this distribution that needs the implementation itself (tests,
tools) imports the public ``skyrl_backends.torch_backend`` or
``skyrl_backends.megatron_backend`` (they import torch), never a ``_private`` module.
"""
