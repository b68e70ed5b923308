"""``examples/train_on_tpu.ipynb``, the free-TPU notebook (Colab, Kaggle), executed top to bottom by a Jupyter kernel
as a user runs it, with CI's parameters: the CPU recipe, no install, the synthetic fallback (no Roboflow key) and the
loop model (``support.models.LOOP_MODEL``) trained for one step, evaluated once after it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from jobs import JobInputs, job_fixture
from support.models import LOOP_MODEL
from support.runs import ROOT, read_metrics

NOTEBOOK = ROOT / "examples" / "train_on_tpu.ipynb"

#: The synthetic set the notebook writes (``synth``'s defaults): 256 train images, 8 per step on cpu.yaml.
SYNTH_TRAIN_IMAGES, CPU_BATCH = 256, 8

#: CI's parameters cell, in place of the notebook's (the same names: :func:`test_the_notebook_is_clean_and_in_order`).
#: One step (1/32 of an epoch), evaluated once after it (cpu.yaml's ``eval.every_steps`` 50 > 1: only after the
#: last step), the loop model with one decoder layer and one DINOv2 block at 64 px, no loader workers.
CI_PARAMETERS = {
    "RECIPE": "cpu.yaml",
    "EPOCHS": 1 / (SYNTH_TRAIN_IMAGES // CPU_BATCH),
    "DATASET_DIR": "data/dataset",
    "ROBOFLOW_API_KEY": "",
    "ROBOFLOW_WORKSPACE": "your-workspace",
    "ROBOFLOW_PROJECT": "your-project",
    "ROBOFLOW_VERSION": 1,
    "OUTPUT_DIR": "output/notebook",
    "INSTALL": False,
    "REPO_URL": "https://github.com/spmd-rfdetr/spmd_rfdetr",
    "THRESHOLD": 0.5,
    "EXTRA_OPTIONS": ["--model.resolution", str(LOOP_MODEL.resolution),
                      "--model.backbone_blocks", str(LOOP_MODEL.backbone_blocks),
                      "--model.dec_layers", str(LOOP_MODEL.dec_layers),
                      "--model.num_queries", str(LOOP_MODEL.num_queries),
                      "--model.group_detr", str(LOOP_MODEL.group_detr),
                      "--data.num_workers", "0", "--trainer.log_every", "1"],
}

#: Executes a notebook in a ``python3`` kernel that runs this interpreter (a kernelspec of its own in a temporary
#: folder, whatever Jupyter kernels the machine has), with this process's environment and working directory; writes
#: the executed notebook (outputs, errors) whether or not a cell failed.
EXECUTE = r"""
import json, sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

notebook, executed, kernels = sys.argv[1:4]
spec = Path(kernels) / "python3"
spec.mkdir(parents=True)
(spec / "kernel.json").write_text(json.dumps({
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "Python 3", "language": "python"}))
nb = nbformat.read(notebook, as_version=4)
km = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernels]))
client = NotebookClient(nb, km=km, timeout=1200, resources={"metadata": {"path": "."}})
try:
    client.execute()
finally:
    nbformat.write(nb, executed)
"""


def parameters_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    tagged = [cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code", "one code cell tagged `parameters` (papermill's)"
    return tagged[0]


def assigned_names(source: str) -> list[str]:
    return [target.id for node in ast.parse(source).body if isinstance(node, ast.Assign) for target in node.targets]


@job_fixture
def notebook_run(inputs: JobInputs, out: Path) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """The notebook with CI's parameters cell, executed by a kernel whose working directory is ``out/work`` and whose
    environment is the session's, on 4 virtual CPU devices."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    parameters_cell(nb).source = "\n".join(f"{name} = {value!r}" for name, value in CI_PARAMETERS.items())
    ci_notebook, executed, work = out / "ci.ipynb", out / "executed.ipynb", out / "work"
    nbformat.write(nb, ci_notebook)
    work.mkdir()
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    proc = subprocess.run([sys.executable, "-c", EXECUTE, str(ci_notebook), str(executed), str(out / "kernels")],
                          cwd=work, env=env, text=True, capture_output=True, timeout=1800)
    return proc, executed, work


def test_the_notebook_is_clean_and_in_order():
    """The committed notebook: valid nbformat 4, a ``python3`` kernelspec, no outputs, one ``parameters`` cell with
    CI's names, and the steps in order, each code cell after a markdown line saying what it does."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4 and nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), "outputs must be cleared"
    assert assigned_names(parameters_cell(nb).source) == list(CI_PARAMETERS)
    pairs = zip(nb.cells, nb.cells[1:])
    assert all(before.cell_type == "markdown" for before, cell in pairs if cell.cell_type == "code")
    steps = ["if INSTALL:", "Roboflow(api_key=", '"check-data"', 'run("fit"', "plt.subplots", 'run("predict"',
             'run("export"']
    assert [next(i for i, cell in enumerate(code) if step in cell.source) for step in steps] == list(range(1, 8))


@pytest.mark.slow
def test_every_cell_runs(notebook_run):
    """Top to bottom without an error, every code cell executed; the run's output reached the cells (the compile
    notice of ``fit``, the plot as an image)."""
    proc, executed, _ = notebook_run
    assert proc.returncode == 0, proc.stderr[-5000:]
    nb = nbformat.read(executed, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    errors = [output for cell in code for output in cell.outputs if output.output_type == "error"]
    assert not errors, errors
    assert all(cell.execution_count for cell in code)
    fit = next(cell for cell in code if 'run("fit"' in cell.source)
    assert "compil" in "".join(o.get("text", "") for o in fit.outputs if o.output_type == "stream")
    plot = next(cell for cell in code if "plt.subplots" in cell.source)
    assert any("image/png" in o.get("data", {}) for o in plot.outputs)


@pytest.mark.slow
def test_the_fit_evaluated_and_kept_the_best_weights(notebook_run):
    proc, _, work = notebook_run
    out = work / CI_PARAMETERS["OUTPUT_DIR"]
    records = read_metrics(out)
    assert [r["step"] for r in records if "eval/mAP" in r] == [1], (records, proc.stderr[-3000:])
    assert (out / "best.pth").is_file()


@pytest.mark.slow
def test_predict_drew_every_valid_image(notebook_run):
    proc, executed, work = notebook_run
    valid = work / CI_PARAMETERS["DATASET_DIR"] / "valid"
    drawn = work / CI_PARAMETERS["OUTPUT_DIR"] / "drawn"
    images = sorted(p.name for p in valid.glob("*.jpg"))
    assert drawn.is_dir(), proc.stderr[-3000:]
    assert images and sorted(p.name for p in drawn.iterdir()) == images
    predict = next(cell for cell in nbformat.read(executed, as_version=4).cells if 'run("predict"' in cell.source)
    assert sum("image/jpeg" in o.get("data", {}) for o in predict.outputs) == 4
    assert isinstance(json.loads((work / CI_PARAMETERS["OUTPUT_DIR"] / "predictions.json").read_text()), list)


@pytest.mark.slow
def test_export_wrote_a_non_empty_onnx_file(notebook_run):
    proc, _, work = notebook_run
    onnx = work / CI_PARAMETERS["OUTPUT_DIR"] / "best.onnx"
    assert onnx.is_file() and onnx.stat().st_size > 0, proc.stderr[-3000:]
