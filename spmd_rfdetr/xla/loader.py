"""CPU batches onto the SPMD mesh, sharded on the batch axes, loaded ahead of the step in a background thread."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from spmd_rfdetr.xla.hosts import batch_share
from spmd_rfdetr.xla.mesh import BATCH_AXES, batch_shard_count

log = logging.getLogger(__name__)
_END = object()  # the wrapped loader is exhausted
_JOIN_S = 5.0  # how long closing an iteration waits for the thread to finish its in-flight batch
_POLL_S = 0.1  # how often a thread blocked on a full queue checks whether the consumer stopped
#: Fault injection for tests: the N-th batch this process loads gets NaN boxes (a real non-finite step in a real run).
NAN_BATCH_ENV = "SPMD_RFDETR_TEST_NAN_BATCH"


class _Failure:
    """An exception raised in the loading thread, carried to the consumer (its ``__traceback__`` goes with it)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class SPMDDataLoader:
    """Iterates a CPU loader and puts every batch tensor on the XLA device, sharded along dim 0 on the batch axes.

    Works on any nesting of dicts/lists/tuples; 0-dim tensors are replicated and non-tensors pass through unchanged.
    Checks the batch size before XLA sees it, and cuts the lazy graph (``torch_xla.sync()``) between batches, as
    torch_xla's ``MpDeviceLoader`` does, unless ``sync_each_batch=False`` (``fit``: its compiled step runs its own
    programs, and a sync per batch is host time the step does not need). With ``prefetch > 0`` a background thread reads the wrapped loader and
    transfers its batches into a queue of that depth while the consumer computes; an error there is raised in the
    consumer, and the thread stops when the iteration ends, fails or is closed (``break`` then garbage collection,
    or ``.close()``). ``prefetch=0`` loads and transfers in ``next()``. Single host: the wrapped loader yields the
    GLOBAL batch; on several hosts each host's loader yields its rows of it (:func:`~spmd_rfdetr.xla.hosts.host_rows`)
    and torch_xla assembles the global array from the hosts' slices (``ShardingSpec(minibatch=True)``).

    ``wait_s`` and ``batches`` count, over every iteration, the seconds the consumer was blocked in ``next()`` waiting
    for a batch and the batches it got. They are properties: Fabric's ``_FabricDataLoader`` copies the instance
    ``__dict__`` once, so read them on this object (``fabric_loader._dataloader``), not on Fabric's wrapper.
    """

    def __init__(self, loader: Any, mesh: xs.Mesh, device: torch.device, prefetch: int = 2,
                 sync_each_batch: bool = True) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 (0: load synchronously), got {prefetch}.")
        self._loader, self.mesh, self.device, self.prefetch = loader, mesh, device, prefetch
        self.sync_each_batch = sync_each_batch
        self.dataset = getattr(loader, "dataset", None)
        self.sampler = getattr(loader, "sampler", None)
        self.batch_sampler = getattr(loader, "batch_sampler", None)
        self._specs: dict[int, xs.ShardingSpec] = {}  # one spec per tensor rank
        self._wait_s, self._batches, self._loaded = 0.0, 0, 0
        self._nan_batch = int(os.environ.get(NAN_BATCH_ENV, 0))

    @property
    def wait_s(self) -> float:
        """Seconds the consumer spent blocked in ``next()`` waiting for a batch (cumulative)."""
        return self._wait_s

    @property
    def batches(self) -> int:
        """Batches handed to the consumer (cumulative)."""
        return self._batches

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        stop = threading.Event()
        thread: Optional[threading.Thread] = None
        get: Callable[[], Any]
        if self.prefetch:
            ready: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
            thread = threading.Thread(target=_fill, args=(iter(self._loader), self.to_device, ready, stop),
                                      name="SPMDDataLoader-prefetch", daemon=True)
            thread.start()
            get = ready.get
        else:
            get = partial(self._load, iter(self._loader))
        try:
            while True:
                start = time.perf_counter()
                item = get()
                self._wait_s += time.perf_counter() - start
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                self._batches += 1
                yield item
                if self.sync_each_batch:
                    torch_xla.sync()  # cut the graph the consumer built on this batch
        finally:
            stop.set()
            # wait for the in-flight batch, so two iterations never read the wrapped loader at once; a generator
            # collected by the GC in the loading thread itself must not join it
            if thread is not None and thread is not threading.current_thread():
                thread.join(_JOIN_S)

    def _load(self, cpu_batches: Iterator[Any]) -> Any:
        """The next batch on the device, or ``_END`` (synchronous mode)."""
        batch = next(cpu_batches, _END)
        return batch if batch is _END else self.to_device(batch)

    def to_device(self, batch: Any) -> Any:
        """Move one loaded CPU batch to the mesh, every tensor sharded on dim 0 (counted: see ``NAN_BATCH_ENV``)."""
        self._loaded += 1
        if self._loaded == self._nan_batch and isinstance(batch, dict) and "boxes" in batch:
            # NaN target boxes, a NaN loss: the images are uint8 (no NaN), and a float image batch would compile anew
            log.warning("%s=%d: this batch's boxes are NaN (fault injection)", NAN_BATCH_ENV, self._nan_batch)
            batch = {**batch, "boxes": torch.full_like(batch["boxes"], float("nan"))}
        return self.place(batch)

    def place(self, batch: Any) -> Any:
        """Move any CPU batch to the mesh as the loaded ones go (e.g. a blank batch to compile a program with)."""
        return apply_to_collection(batch, Tensor, self._send)

    def _send(self, tensor: Tensor) -> Tensor:
        if tensor.dim() == 0:
            return tensor.as_subclass(Tensor).to(self.device)
        shards, hosts = batch_shard_count(self.mesh), batch_share()[1]
        if tensor.shape[0] * hosts % shards:  # several hosts: this is the host's slice of the global batch
            raise ValueError(
                f"Batch size {tensor.shape[0] * hosts} (a tensor of shape {tuple(tensor.shape)}) is not divisible by the "
                f"mesh's {'x'.join(BATCH_AXES)} axis of size {shards}. Use a batch size that is a multiple of "
                f"{shards} and drop_last=True (static shapes also avoid recompiles)."
            )
        spec = self._specs.get(tensor.dim())
        if spec is None:
            batch_axis = BATCH_AXES[0] if len(BATCH_AXES) == 1 else BATCH_AXES
            spec = self._specs[tensor.dim()] = xs.ShardingSpec(
                self.mesh, (batch_axis,) + (None,) * (tensor.dim() - 1), minibatch=hosts > 1)  # host slices -> global
        # plain CPU tensors only: torch_xla skips Tensor subclasses (e.g. tv_tensors) without a word
        return xm.send_cpu_data_to_device(tensor.cpu().as_subclass(Tensor), self.device, spec)[0]


def _fill(cpu_batches: Iterator[Any], to_device: Callable[[Any], Any], ready: queue.Queue[Any],
          stop: threading.Event) -> None:
    """Thread body: transfer every batch into ``ready``, then ``_END`` or a ``_Failure``; return early on ``stop``.

    It holds no reference to the consumer's generator, so an abandoned iteration is garbage collected (which stops it).
    """
    try:
        for batch in cpu_batches:
            if not _put(ready, to_device(batch), stop):
                return
        item: Any = _END
    except BaseException as error:  # noqa: BLE001  (anything, even SystemExit, must reach the consumer)
        item = _Failure(error)
    _put(ready, item, stop)


def _put(ready: queue.Queue[Any], item: Any, stop: threading.Event) -> bool:
    """Put ``item`` unless the consumer stops first; blocks in short slices to notice it. False if stopped."""
    while not stop.is_set():
        try:
            ready.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False
