"""skyrl-engines: engines (embedded, vllm).

Each feature is one module here with its own ``skyrl`` entry point.
"""
