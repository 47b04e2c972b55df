"""skyrl-datasets: datasets (verifiable tasks, jsonl, pretokenized, mixing).

Each feature is one module here with its own ``skyrl`` entry point.
"""
