"""The order test files are handed out in, for the README's `pytest -n 2 --dist loadfile`.

xdist gives each worker a whole file at a time. Handed out in collection order (the
``--no-loadscope-reorder`` in pyproject.toml; by default xdist puts the files with the most
tests first, which left the slowest single-test files, minutes each, for the very end),
the longest files go first and the many short ones fill in at the end, so the two workers
finish together. The vLLM files come after the first few long ones: by then the vLLM
environment the engine tests make in the background (minutes on a fresh machine) is ready,
and no worker waits for it. Durations: the slowest files of a CI run (``--durations``),
longest first; a file not listed keeps its place after them.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "tests/test_device_kit.py",
    "plugins/backends/tests/test_megatron.py",
    "plugins/launchers/tests/test_ray_launcher.py",
    "tests/test_real_model_example.py",
    "plugins/engines/tests/test_vllm_rl.py",
    "plugins/engines/tests/test_vllm.py",
    "plugins/backends/tests/test_megatron_job.py",
    "plugins/launchers/tests/test_ray_cluster.py",
    "plugins/launchers/tests/test_ray_netns.py",
    "plugins/launchers/tests/test_async_ray.py",
    "plugins/precisions/tests/test_precision_job.py",
    "plugins/backends/tests/test_real_model.py",
    "plugins/environments/tests/test_multiturn_job.py",
    "tests/test_quickstart.py",
    "plugins/engines/tests/test_vllm_teacher.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # A stable sort: each file's tests keep their order (and their module fixtures).
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST)))
