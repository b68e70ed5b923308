"""The README's own Fabric script runs as written (a subprocess on the 4-device CPU mesh)."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_fabric_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- fabric-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return block


def test_readme_fabric_script_is_short() -> None:
    lines = [line for line in readme_fabric_example().splitlines() if line.strip()]
    assert len(lines) <= 22, len(lines)


@pytest.mark.slow
def test_readme_fabric_script_trains(synth_dir: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_fabric_example())
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    result = subprocess.run([sys.executable, str(script), synth_dir], cwd=tmp_path, env=env, text=True,
                            capture_output=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [ast.literal_eval(line) for line in result.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(printed) == 2, result.stdout  # steps 0 and 2 of the 4
    assert all(math.isfinite(p["loss"]) and p["loss"] > 0 and p["nonfinite_steps"] == 0 for p in printed), printed
    assert printed[0]["loss"] != printed[1]["loss"], printed  # two different batches, trained
    assert (tmp_path / "last.pth").exists()
