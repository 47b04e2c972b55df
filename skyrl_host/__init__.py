"""skyrl-host: a small plugin host for RL post-training of open LLMs.

Plugin authors need only ``hookimpl`` from here, plus ``skyrl_host.config`` for
documented options and validators. Importing this package imports no heavy module.
"""

from skyrl_host.hookspecs import hookimpl

__all__ = ["hookimpl"]
