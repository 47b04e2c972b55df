"""skyrl-backends: training backends (torch; megatron planned).

Each feature is one module here with its own ``skyrl`` entry point:
``torch`` (``skyrl_backends.torch``). Feature modules import no heavy module at
import time; the implementation is imported by the factory.
"""
