"""Train RF-DETR on TPUs with one process driving the whole SPMD device mesh (Lightning Fabric + torch_xla)."""

__version__ = "0.1.0"
