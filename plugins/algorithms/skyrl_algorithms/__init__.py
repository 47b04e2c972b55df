"""skyrl-algorithms: algorithms (grpo, dapo, dr_grpo, gspo, rloo).

Each feature is one module here with its own ``skyrl`` entry point.
"""
