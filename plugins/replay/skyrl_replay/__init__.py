"""skyrl-replay: replay strategies (r3, support).

Each feature is one module here with its own ``skyrl`` entry point.
"""
