"""skyrl-models: model families (qwen, glm, kimi, nemotron).

Each feature is one module here with its own ``skyrl`` entry point.
"""
