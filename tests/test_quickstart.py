"""The README's quickstart meets its bar: RL takes the mean reward from <= 0.3 at the
first step to >= 0.8 (mean of the last 5 steps), in under 10 minutes on 2 cores."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKYRL = str(pathlib.Path(sys.executable).parent / "skyrl")


def test_quickstart_learns(tmp_path) -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [SKYRL, "run", str(ROOT / "examples" / "quickstart.toml")],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "runs" / "quickstart"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert len(steps) == 1000
    first, last5 = steps[0]["reward_mean"], sum(r["reward_mean"] for r in steps[-5:]) / 5
    print(f"quickstart: reward {first:.3f} -> {last5:.3f} (last 5), {elapsed:.0f} s")
    assert first <= 0.3
    assert last5 >= 0.8
    assert elapsed < 600
    assert (out / "plot.png").stat().st_size > 10_000
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "qwen3"
