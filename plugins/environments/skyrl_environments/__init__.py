"""skyrl-environments: multi-turn and tool-using environments (``[environment] name``).

Each feature is one module here with its own ``skyrl`` entry point. An environment
implements :class:`skyrl_host.interfaces.Environment`: ``episode(task, seed=...)`` makes
one :class:`skyrl_host.interfaces.Episode` per trajectory (``reset``, ``step``,
``close``); docs/environments.md describes the contract.
"""
