"""The pieces of ``benchmarks/run.py`` (the CLI stays there; ``python benchmarks/run.py --help``).

- :mod:`.config`: the run config (a ``fit`` YAML plus command-line overrides) and the step modes of our side.
- :mod:`.children`: each side in its own interpreter (``run.py --_child ...``): environment, spawn, JSON back.
- :mod:`.sides`: what runs inside a child: our step, upstream rfdetr's XLA path, the matcher micro-benchmark.
- :mod:`.measure`: timing, torch_xla counters, per-run statistics, device, FLOPs, memory and environment.
- :mod:`.report`: markdown tables, plots, output names and JSON.
- :mod:`.commands`: the parent side of each benchmark (compare, scaling, matcher).
- :mod:`.loader`: the input pipeline alone (rfdetr's dataset + transforms), images/s per DataLoader worker count.

Nothing here imports torch or torch_xla at module level: the parent process never starts an XLA runtime.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_SCRIPT = ROOT / "benchmarks" / "run.py"
RESULTS = ROOT / "benchmarks" / "results"
