"""The README's own Fabric script runs as written (a subprocess on the 4-device CPU mesh)."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import JobInputs, job_fixture

ROOT = Path(__file__).resolve().parents[1]


def readme_fabric_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- fabric-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    return block


@job_fixture
def readme_script(inputs: JobInputs, out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The README's Fabric script run on the session dataset, XLA dumping the modules it compiles into ``out/hlo``."""
    script = out / "train.py"
    script.write_text(readme_fabric_example())
    dump = out / "hlo"
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4",
           "XLA_FLAGS": f"{inputs.env.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text "
                        "--xla_dump_hlo_pass_re=^$"}
    result = subprocess.run([sys.executable, str(script), inputs.synth_dir], cwd=out, env=env, text=True,
                            capture_output=True, timeout=900)
    return result, out


@pytest.mark.slow
def test_readme_fabric_script_trains(readme_script: tuple) -> None:
    """The README's script as written: it trains in bf16 (``precision="bf16-mixed"``, the TPU recipes' precision),
    finite, and its training step's program (XLA's dump of the module torch_xla compiles) has its convolutions and
    matrix products in bf16 while the weights stay fp32."""
    result, out = readme_script
    dump = out / "hlo"
    assert result.returncode == 0, result.stderr[-3000:]
    printed = [ast.literal_eval(line) for line in result.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(printed) == 2, result.stdout  # steps 0 and 2 of the 4
    assert all(math.isfinite(p["loss"]) and p["loss"] > 0 and p["nonfinite_steps"] == 0 for p in printed), printed
    assert printed[0]["loss"] != printed[1]["loss"], printed  # two different batches, trained
    assert (out / "last.pth").exists()
    step = max(dump.glob("*before_optimizations.txt"), key=lambda f: f.stat().st_size).read_text()  # the step
    matmuls = re.findall(r"= (\w+)\[[^\]]*\]\S* (?:convolution|dot)\(", step)
    assert matmuls.count("bf16") >= 0.9 * len(matmuls) > 50, (len(matmuls), matmuls.count("bf16"))
    inputs = re.findall(r"= (\w+\[[^\]]*\])\S* parameter\(", step.split("\nENTRY", 1)[1])
    tensors = [i for i in inputs if not i.endswith("[]")]  # scalars are constants torch_xla feeds, not weights
    bf16 = [i for i in tensors if i.startswith("bf16")]
    assert sum(i.startswith("f32") for i in tensors) > 100 and not bf16, (len(tensors), bf16)
