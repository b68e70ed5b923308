"""The recipes ship with the package: ``fit --config v5e.yaml`` from any directory, from a checkout (an editable
install) and from a wheel installed without the checkout (a real ``pip wheel`` in a subprocess, then
``pip install --target``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_in_the_wheel_list() -> None:
    """``pyproject.toml`` lists the packages (so ``configs/`` can ship as ``spmd_rfdetr/recipes``): a new
    subpackage missing from the list would be missing from every wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "spmd_rfdetr").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    assert "spmd_rfdetr.recipes" in listed


@pytest.mark.slow
def test_a_recipe_by_name_from_another_directory(tmp_path: Path) -> None:
    """In the checkout's own install, from a directory that has no ``configs/``: a bare name, the README's
    ``configs/`` spelling and a name without ``.yaml`` read the shipped recipe; a file that exists wins; an unknown
    name is one message listing the recipes, exit 2."""
    own = tmp_path / "v5e.yaml"
    own.write_text("trainer:\n  output_dir: mine\n")
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    for name, out in (("v5e", "output/v5e"), ("configs/v5e.yaml", "output/v5e"), ("v5e.yaml", "mine")):
        result = subprocess.run([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", name, "--print_config"],
                                cwd=tmp_path, env=env, text=True, capture_output=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert yaml.safe_load(result.stdout)["trainer"]["output_dir"] == out, name
    result = subprocess.run([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", "v5x.yaml"], cwd=tmp_path,
                            env=env, text=True, capture_output=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "--config v5x.yaml: no such file, and not a shipped recipe (cpu-keypoints.yaml" in result.stderr


@pytest.mark.slow
def test_the_wheel_carries_the_recipes_and_fit_reads_them_by_name(tmp_path: Path) -> None:
    """``pip wheel`` of a copy of the project, installed with ``pip install --target`` and put first on the path
    (the checkout is not): ``recipes`` lists the wheel's own copies, and ``fit --config v5e.yaml --print_config``
    from another directory prints the v5e recipe, which counts in epochs and evaluates inside ``fit``."""
    source = tmp_path / "source"  # a copy: pip builds in the tree, and the checkout stays clean
    source.mkdir()
    for part in ("pyproject.toml", "README.md", "spmd_rfdetr", "configs"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, source / part, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                           if (ROOT / part).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(source)],
                           text=True, capture_output=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("spmd_rfdetr-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"spmd_rfdetr/recipes/{p.name}" for p in (ROOT / "configs").glob("*.yaml")} <= set(names)
    site = tmp_path / "site"
    installed = subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel)], text=True,
                               capture_output=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PJRT_DEVICE": "CPU"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "spmd_rfdetr", *args], cwd=elsewhere, env=env, text=True,
                              capture_output=True, timeout=120)

    listing = cli("recipes")
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert f"(in {site / 'spmd_rfdetr' / 'recipes'};" in listing.stdout  # the wheel's, not the checkout's
    assert "v5e.yaml" in listing.stdout and "Colab v5e-1" in listing.stdout
    printed = cli("fit", "--config", "v5e.yaml", "--print_config")
    assert printed.returncode == 0, printed.stderr[-2000:]
    recipe = yaml.safe_load(printed.stdout)
    assert recipe["model"]["resolution"] == 384 and recipe["trainer"]["epochs"] == 100
    assert recipe["eval"]["every_epochs"] == 1 and recipe["optim"]["warmup_epochs"] == 1
