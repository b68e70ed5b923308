"""What the hosts of a multi-host run (a pod slice: one process per TPU VM) agree on, and which rows each one loads.

Under SPMD every device tensor is global, so the step, the stats and the eval need no collective. What differs per
process is host state: a SIGTERM reaches one VM, a dataset listing is read from each VM's disk. Those agreements go
through ``torch.distributed._functional_collectives`` on small CPU tensors over gloo (in place of rfdetr's pickled
``all_gather``). With one process (one host, and every mesh in this repository's tests) nothing is communicated.

The group is joined with torch_xla's ``xla://`` rendezvous: ranks are the runtime's process indices and the coordinator
(process 0) is found from the TPU metadata (or ``MASTER_ADDR``/``MASTER_PORT``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def process_count() -> int:
    """How many host processes drive the mesh (the joined group's size; else the XLA runtime's process count)."""
    if dist.is_initialized():
        return dist.get_world_size()
    import torch_xla.runtime as xr

    return xr.process_count()


def process_index() -> int:
    """This host's index, 0 for the coordinator."""
    if dist.is_initialized():
        return dist.get_rank()
    import torch_xla.runtime as xr

    return xr.process_index()


def is_coordinator() -> bool:
    """Whether this process publishes shared files (checkpoints, weights, metrics)."""
    return process_index() == 0


def this_host() -> tuple[int, int]:
    """``(process_index(), process_count())``."""
    return process_index(), process_count()


def join_hosts() -> None:
    """Join the gloo group of all host processes (a no-op on one host or when a group already exists)."""
    if dist.is_initialized() or process_count() == 1:
        return
    import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

    dist.init_process_group("gloo", init_method="xla://")


def _reduce(values: list[int], op: str) -> list[int]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    reduced = funcol.all_reduce(torch.tensor(values, dtype=torch.int64), op, dist.group.WORLD)
    return funcol.wait_tensor(reduced).tolist()


def any_host(flag: bool) -> bool:
    """True on every host when it is true on one (a preemption notice, a stop request)."""
    return bool(_reduce([int(flag)], "max")[0])


def check_same_on_all_hosts(what: str, value: int) -> None:
    """Raise ``ValueError`` on every host unless all hosts hold the same ``value`` (e.g. the train split's size: each
    host indexes the same global batches, so a different file listing on one VM would silently mix samples)."""
    low, high = _reduce([-value, value], "max")
    if -low != high:
        raise ValueError(f"{what} differs between the hosts of this run (from {-low} to {high}; this host: {value}). "
                         "Every host must see the same dataset: copy it identically to each VM or use shared storage.")


def barrier() -> None:
    """Wait until every host gets here (a no-op on one host)."""
    _reduce([0], "max")


def host_rows(batch: list, index: int, count: int) -> list:
    """This host's contiguous slice of one global batch: host ``index`` of ``count`` loads rows
    ``[index * n, (index + 1) * n)``, ``n = len(batch) / count``, the rows of the devices it drives on the mesh's
    batch axis (torch_xla assembles the global array from them: ``ShardingSpec(minibatch=True)``)."""
    if len(batch) % count:
        raise ValueError(f"a global batch of {len(batch)} does not split over {count} hosts")
    rows = len(batch) // count
    return batch[index * rows:(index + 1) * rows]
