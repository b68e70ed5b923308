"""The shipped recipes (``configs/*.yaml``) by name: ``fit --config v5e.yaml`` from any directory.

The recipes live in the checkout's ``configs/``; a wheel carries the same files as ``spmd_rfdetr/recipes/``
(``pyproject.toml`` maps one onto the other). ``--config NAME`` reads a file that exists as given; otherwise a bare
name (``v5e.yaml``, ``v5e``, or ``configs/v5e.yaml`` as the README writes it) is the shipped recipe of that name.
"""

from __future__ import annotations

from pathlib import Path

from spmd_rfdetr.config.options import ConfigError

_PACKAGE = Path(__file__).resolve().parents[1]
#: Where the recipes are: inside an installed wheel, then beside the package in a checkout (an editable install).
RECIPE_DIRS = (_PACKAGE / "recipes", _PACKAGE.parent / "configs")


def recipe_dir() -> Path | None:
    """The folder this install's recipes are in (``None``: this install has none)."""
    return next((d for d in RECIPE_DIRS if d.is_dir() and any(d.glob("*.yaml"))), None)


def recipes() -> dict[str, Path]:
    """Every shipped recipe by file name (``v5e.yaml`` ...)."""
    folder = recipe_dir()
    return {p.name: p for p in sorted(folder.glob("*.yaml"))} if folder else {}


def describe(path: Path) -> str:
    """A recipe's first comment line (what it trains, on what)."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def find_recipe(name: str) -> Path:
    """``name`` as ``--config`` reads it: an existing file as given, else the shipped recipe of that name (with or
    without ``.yaml``, with or without a leading ``configs/``). Raises :class:`ConfigError` listing the recipes."""
    if Path(name).is_file() or any(c in name for c in "{:\n"):  # a file, or YAML given inline (jsonargparse)
        return Path(name)
    stem = Path(name).name if Path(name).parent in (Path("."), Path("configs")) else None
    shipped = recipes()
    for candidate in (stem, f"{stem}.yaml") if stem else ():
        if candidate in shipped:
            return shipped[candidate]
    listed = ", ".join(shipped) or "none in this install"
    raise ConfigError(f"--config {name}: no such file, and not a shipped recipe ({listed}); "
                      "`python -m spmd_rfdetr recipes` lists them with what each trains")


def with_recipe_paths(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config NAME`` (or ``--config=NAME``) that names a shipped recipe made its path."""
    out, given = [], iter(argv)
    for arg in given:
        if arg == "--config":
            value = next(given, None)
            out += [arg] if value is None else [arg, str(find_recipe(value))]
        elif arg.startswith("--config="):
            out.append(f"--config={find_recipe(arg.split('=', 1)[1])}")
        else:
            out.append(arg)
    return out


def listing() -> str:
    """What ``python -m spmd_rfdetr recipes`` prints: each recipe's name and first comment line, and the folder."""
    shipped = recipes()
    if not shipped:
        return "no recipes in this install"
    width = max(map(len, shipped))
    lines = [f"{name:<{width}}  {describe(path)}" for name, path in shipped.items()]
    return "\n".join(lines + [f"(in {recipe_dir()}; use one as --config NAME, or copy it and edit)"])
