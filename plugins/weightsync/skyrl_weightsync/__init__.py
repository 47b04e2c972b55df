"""skyrl-weightsync: weight transports (inproc, broadcast, delta, nixl, lora).

Each feature is one module here with its own ``skyrl`` entry point.
"""
