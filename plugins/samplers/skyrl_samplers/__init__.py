"""skyrl-samplers: samplers (temperature, top_p, top_k, min_p).

Each feature is one module here with its own ``skyrl`` entry point.
"""
