"""skyrl-backends: backends (torch, megatron).

Each feature is one module here with its own ``skyrl`` entry point.
"""
