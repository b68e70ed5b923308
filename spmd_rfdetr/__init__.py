"""Train RF-DETR on TPUs with one process driving the whole SPMD device mesh (Lightning Fabric + torch_xla).

``spmd_rfdetr.train(variant="nano", dataset_dir=..., epochs=..., batch_size=...)`` is the one-call API
(:mod:`spmd_rfdetr.api`); ``python -m spmd_rfdetr fit --config ...`` the CLI.
"""

__version__ = "0.1.0"


def train(*args, **kwargs):  # type: ignore[no-untyped-def]
    """:func:`spmd_rfdetr.api.train` (imported on first use: ``import spmd_rfdetr`` stays light)."""
    from spmd_rfdetr.api import train as _train

    return _train(*args, **kwargs)
