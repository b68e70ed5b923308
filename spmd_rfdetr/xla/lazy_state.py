"""The lazy tensors around a replayed program: their sharding annotations, the IR they hold, and what is left pending.

torch_xla hashes a graph over the IR its inputs hold, not over their values: a state tensor must look the same at
every trace (annotated, a ``device_data`` node) for a replayed step to find its compiled program again, and a tensor
left pending outside the step's declared state would be lost by a replay (:mod:`spmd_rfdetr.xla.replay`).
"""

from __future__ import annotations

import gc

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs

_X = torch_xla._XLAC


def replicate_unannotated(tensors: list[torch.Tensor]) -> None:
    """Annotate unannotated state tensors (0-dim ones: learning rates, step counts) replicated on the global mesh.

    Replayed results come back annotated ``{replicated}``; an input left unannotated at the first trace would make the
    second trace differ from it (pytorch/xla#9755 is the same mismatch in the dynamo bridge).
    """
    mesh = xs.get_global_mesh()
    if mesh is None:
        return
    for t in tensors:
        if t.device.type == "xla" and not _X._get_xla_sharding_spec(t):
            xs.mark_sharding(t, mesh, (None,) * t.dim())


def hold_as_device_data(tensors: list[torch.Tensor]) -> None:
    """Give each materialized XLA tensor a ``device_data`` IR node over its own buffer, as replayed outputs and loaded
    checkpoints have.

    A fresh run's state holds bare buffers (the outputs of a sync); torch_xla hashes a graph over bare buffers apart
    from the same graph over ``device_data`` nodes, so without this the first step compiles again at its next trace
    (trace mode's step 2, a resume in the same process) and a resumed process misses the persistent compile cache
    (checked 2026-12-07 with each process's cache entries, named by hash: a fresh fit and its resume from step 2 wrote
    the step under two names before, one after).
    """
    torch_xla.sync()
    xm.wait_device_ops()  # a result still in flight has no shards yet: wrapping it crashes the process
    tensors = [t for t in tensors if t.device.type == "xla"]
    pending = _X._check_tensor_need_materialization(tensors) if tensors else []
    for tensor, is_pending in zip(tensors, pending):
        if not is_pending:
            tensor.data = device_data(tensor)


def device_data(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor whose IR is a ``device_data`` node over ``tensor``'s buffer (materialized, nothing pending)."""
    return _X._get_tensors_xla_device_data_node([tensor], [])[1][0]


def stray_pending(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Python-reachable XLA tensors with pending work that are not among ``outputs`` (one scan, at trace time; a full
    ``gc.collect`` only when the scan finds some: garbage in reference cycles may hold them, and a collection costs
    a big process, e.g. the test session, ~0.4 s a trace)."""
    known = {id(t) for t in outputs}
    if not _pending_tensors(known):
        return []
    gc.collect()
    return _pending_tensors(known)


def _pending_tensors(known: set[int]) -> list[torch.Tensor]:
    """The XLA tensors the garbage collector tracks, other than ``known`` ids, that have pending work."""
    tensor_types = (torch.Tensor, torch.nn.Parameter)
    candidates = [o for o in gc.get_objects() if type(o) in tensor_types and id(o) not in known and _on_xla(o)]
    pending = _X._check_tensor_need_materialization(candidates) if candidates else []
    return [t for t, p in zip(candidates, pending) if p]


def _on_xla(tensor: torch.Tensor) -> bool:
    try:
        return tensor.device.type == "xla"
    except RuntimeError:  # e.g. a tensor without storage left by another library ("tensor does not have a device")
        return False
