"""skyrl-host: a small plugin host for RL post-training of open LLMs.

Plugin authors need only ``hookimpl`` from here, plus ``skyrl_host.options`` for
documented options and validators and ``skyrl_host.interfaces`` for the contracts
(docs/writing-plugins.md lists the whole public face). Importing this package imports no heavy module.
"""

from skyrl_host.hookspecs import hookimpl

__all__ = ["hookimpl"]
