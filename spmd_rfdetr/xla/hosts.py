"""What the hosts of a multi-host run (a pod slice: one process per TPU VM) agree on, and which rows each one loads.

Under SPMD every device tensor is global, so the step, the stats and the eval need no collective. What differs per
process is host state: a SIGTERM reaches one VM, a dataset listing is read from each VM's disk. Those agreements go
through ``torch.distributed._functional_collectives`` on small CPU tensors over gloo (in place of rfdetr's pickled
``all_gather``). With one process (one host, and every mesh in this repository's tests) nothing is communicated.

The group is joined with torch_xla's ``xla://`` rendezvous: ranks are the runtime's process indices and the coordinator
(process 0) is found from the TPU metadata (or ``MASTER_ADDR``/``MASTER_PORT``).

What ``fit`` does with several processes: host-level agreement (the stop flag, the dataset size, the data check,
which host 0 runs for all) goes over this group; no ``torch.distributed`` call of rfdetr's reaches the compiled step
(the loss normaliser is the global batch's box count, computed on the device). Each host loads only its contiguous
rows of every global batch, train and eval alike (the same global batches as on one host, so resume stays exact), and
torch_xla builds the global array from the hosts' slices (``ShardingSpec(minibatch=True)``). In evaluation
(``EvalBatches``) the image ids are every host's, gathered over gloo in host order and put in the global array's row
order (:func:`global_row_order`: on slices whose devices are numbered by chip coordinates a host's rows are not one
run), so padding rows (id -1) are dropped the same way on every host. The hosts compare their number of usable train
images (and of eval images) before anything compiles and stop with one message if they differ. A SIGTERM reaching any host stops every host after the same step, with one
checkpoint: written by all hosts (each its own shards), then published by host 0's rename after a barrier. Host 0
alone writes ``metrics.jsonl``, the logger files, ``config.yaml``, ``last.pth``/``best.pth`` (every host builds the
CPU state dict, so a gather runs on all of them), the eval files, ``predict``'s output, and new entries of a shared
persistent compilation cache (the other hosts open it read-only).

``trainer.output_dir`` must be one directory every host writes (:func:`shared_by_all_hosts`, checked before ``fit``
resumes or builds anything): on each VM's own disk, host 0's checkpoints would lack the other hosts' shards.

Tested (``tests/test_hosts.py``): two real processes in one gloo group each run ``fit`` (the loop model, 4 steps, an
eval at the end, one output directory) with the losses of the one-process run bit for bit, one replayed program,
every eval image scored once, host 0 writing the run's files and both hosts' shards in the published checkpoint; two
processes agree on the stop flag after a real SIGTERM to one of them, refuse different dataset sizes and an
output directory of each host's own, and their row slices put together are the one-host batches (train and eval). Not
tested, and what is left for a real pod slice: one mesh over several processes. torch_xla 2.9 cannot run one SPMD mesh
across CPU processes (its PJRT CPU client has no distributed key-value store), so in the test each process's runtime
drives its own whole mesh and loads every row; the assembly of a global array from two hosts' slices, the gathers
behind ``last.pth`` with ``fsdp`` shards on another host and the read-only cache were not run.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def process_count() -> int:
    """How many host processes drive the mesh (the joined group's size; else the XLA runtime's process count)."""
    if dist.is_initialized():
        return dist.get_world_size()
    # lazy: xla.runtime and the CLI import this module before choose_device: torch_xla starts on import
    import torch_xla.runtime as xr

    return xr.process_count()


def process_index() -> int:
    """This host's index, 0 for the coordinator."""
    if dist.is_initialized():
        return dist.get_rank()
    # lazy: xla.runtime and the CLI import this module before choose_device: torch_xla starts on import
    import torch_xla.runtime as xr

    return xr.process_index()


def is_coordinator() -> bool:
    """Whether this process publishes shared files (checkpoints, weights, metrics)."""
    return process_index() == 0


def this_host() -> tuple[int, int]:
    """``(process_index(), process_count())``: this host among those that agree over gloo."""
    return process_index(), process_count()


def batch_share() -> tuple[int, int]:
    """``(index, count)``: this process loads slice ``index`` of ``count`` of every global batch (:func:`host_rows`).

    The XLA runtime's processes, not the gloo group's: the global array is assembled from every runtime process's
    slice (``ShardingSpec(minibatch=True)`` scales dim 0 by global/addressable devices). On a pod slice the two are
    the same; a process whose runtime drives the whole mesh (one host, or each XLA CPU process of a test) loads every
    row even when it has joined a group with others.
    """
    # lazy: xla.runtime and the CLI import this module before choose_device: torch_xla starts on import
    import torch_xla.runtime as xr

    return xr.process_index(), xr.process_count()


def gather_rows(rows: torch.Tensor, share: tuple[int, int] | None = None) -> torch.Tensor:
    """Every process's rows of a global batch (CPU tensors of one shape) in process order: the rows of the global
    array torch_xla assembles from the processes' slices (``share``, default :func:`batch_share`; one: ``rows``)."""
    if (share or batch_share())[1] == 1:
        return rows
    return funcol.wait_tensor(funcol.all_gather_tensor(rows.contiguous(), 0, dist.group.WORLD))


def global_row_order(tile_devices: Sequence[int], host_devices: Sequence[Sequence[int]],
                     rows_per_device: int) -> np.ndarray | None:
    """Where each row of a batch-sharded global array comes from, as an index into the hosts' rows gathered in host
    order (``None``: host order itself, as on one host).

    With several processes torch_xla assembles the global array from each host's slice (``ShardingSpec(minibatch=
    True)``): host ``h`` cuts its rows into equal blocks, block ``k`` for its ``k``-th device (``host_devices[h]``:
    its devices' global ordinals in its runtime's order; ``ShardingUtil::GetShardIndicesForMinibatchTensor``), and
    position ``p`` of the batch dimension holds device ``tile_devices[p]``'s block (the sharding's tile assignment:
    the mesh's devices in batch-axis order). Where a host's devices are not one run of positions (TPU slices of 16+
    chips number devices by chip coordinates) that is not host order.
    """
    owner = {device: (h, k) for h, devices in enumerate(host_devices) for k, device in enumerate(devices)}
    per_host = len(host_devices[0])
    if any(len(devices) != per_host for devices in host_devices) or sorted(owner) != sorted(tile_devices):
        raise ValueError(f"the hosts' devices {list(map(list, host_devices))} are not the mesh's {list(tile_devices)}")
    blocks = np.asarray([owner[device][0] * per_host + owner[device][1] for device in tile_devices])
    if (blocks == np.arange(len(blocks))).all():
        return None
    return (blocks[:, None] * rows_per_device + np.arange(rows_per_device)[None, :]).reshape(-1)


def mesh_row_order(mesh: Any, global_batch_size: int) -> np.ndarray | None:
    """:func:`global_row_order` of a global batch of ``global_batch_size`` sharded on ``mesh``'s batch axes, from
    every host's devices (gathered over gloo). Call it on every host (it is a collective)."""
    # lazy: torch_xla (xla.mesh imports it) starts on import: xla.runtime and the CLI import this module first
    import torch_xla

    from spmd_rfdetr.xla.mesh import BATCH_AXES

    share = batch_share()
    if share[1] == 1:  # one host sends whole batches (no minibatch assembly): the rows stay in their order
        return None
    names = list(mesh.axis_names)
    if len(BATCH_AXES) != len(names):  # a mesh axis the batch is not split over would replicate the blocks
        raise NotImplementedError(f"row order of a mesh {names} whose batch axes are {BATCH_AXES}")
    axes = [names.index(a) for a in BATCH_AXES]
    tile_devices = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape).transpose(axes).reshape(-1).tolist()
    local = [int(name.split(":")[-1]) for name in torch_xla._XLAC._xla_get_runtime_devices()]
    gathered = gather_rows(torch.tensor(local, dtype=torch.int64), share).tolist()
    per_host = len(gathered) // share[1]
    host_devices = [gathered[h * per_host:(h + 1) * per_host] for h in range(share[1])]
    return global_row_order(tile_devices, host_devices, global_batch_size // len(tile_devices))


def join_hosts() -> None:
    """Join the gloo group of all host processes (a no-op on one host or when a group already exists)."""
    if dist.is_initialized() or process_count() == 1:
        return
    # lazy: xla.runtime and the CLI import this module before choose_device: torch_xla starts on import
    import torch_xla.distributed.xla_backend  # noqa: F401  registers the xla:// rendezvous

    dist.init_process_group("gloo", init_method="xla://")


def leave_hosts() -> None:
    """Leave the gloo group at the end of a run (without it, gloo sometimes aborts the process at exit)."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


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


def from_coordinator(make: Callable[[], bytes]) -> bytes:
    """``make()`` run on host 0 only, its bytes sent to every host over the gloo group (one host: just ``make()``).

    For work every host needs the result of but one host suffices to do (the data check). Should ``make`` raise on
    host 0, the others raise ``RuntimeError`` instead of waiting for bytes that never come.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make()
    payload, failed = b"", None
    if dist.get_rank() == 0:
        try:
            payload = make()
        except BaseException as error:  # tell the others (length -1), then raise here
            failed = error
    size = torch.tensor([-1 if failed else len(payload)], dtype=torch.int64)
    size = int(funcol.wait_tensor(funcol.broadcast(size, 0, dist.group.WORLD))[0])
    if failed is not None:
        raise failed
    if size < 0:
        raise RuntimeError("host 0 failed at what it does for every host (see its log)")
    if size == 0:
        return b""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(size, dtype=torch.uint8)
    return funcol.wait_tensor(funcol.broadcast(data, 0, dist.group.WORLD)).numpy().tobytes()


def shared_by_all_hosts(path: Path) -> bool:
    """Whether every host sees host 0's ``path`` (a shared mount) rather than a directory of its own: host 0 writes
    a marker named by a token it sends to all, every host looks for it (a collective; one host: ``True``)."""
    if process_count() == 1:
        return True
    token = from_coordinator(lambda: uuid.uuid4().hex.encode()).decode()
    marker = path / f".spmd_rfdetr-host0-{token}"
    if is_coordinator():
        marker.write_text(token)
    barrier()
    shared = not any_host(not marker.exists())
    barrier()
    if is_coordinator():
        marker.unlink(missing_ok=True)
    return shared
