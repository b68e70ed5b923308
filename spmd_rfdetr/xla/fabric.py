"""Lightning Fabric plugins that drive a whole torch_xla SPMD mesh from ONE process.

Fabric has no SPMD strategy: its ``XLAStrategy`` spawns one process per device. Here a single process owns every
device; tensors are global arrays, sharded by annotation, and GSPMD inserts the collectives. So::

    fabric = spmd_fabric(build_mesh(), precision="bf16-mixed")  # launched; SPMD switched on
    model, optimizer = fabric.setup(model, optimizer)             # params on the device, replicated
    loader = fabric.setup_dataloaders(loader)                     # batches arrive sharded on the `data` axis

By hand: ``Fabric(accelerator=SPMDAccelerator(), strategy=SPMDStrategy(mesh), plugins=SPMDPrecision(...))`` and
``fabric.launch()``. Pass ``SPMDPrecision`` as a plugin: Fabric's connector refuses ``Fabric(precision="bf16-mixed")``
for any XLA strategy; the strings "32-true" and "bf16-true" are converted.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union

import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from lightning_fabric import Fabric
from lightning_fabric.accelerators.xla import XLAAccelerator
from lightning_fabric.plugins import Precision, XLAPrecision
from lightning_fabric.strategies import Strategy, XLAStrategy
from lightning_fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.utils.data import DataLoader

from spmd_rfdetr.xla.loader import SPMDDataLoader  # also imported from here by existing code
from spmd_rfdetr.xla.mesh import build_mesh

_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


class SPMDAccelerator(XLAAccelerator):
    """XLA accelerator on any PJRT device (TPU, CPU, ...). Fabric sees ONE device: the whole mesh."""

    mesh: Optional[xs.Mesh] = None  # set by SPMDStrategy

    @staticmethod
    def is_available() -> bool:
        return xr.device_type() is not None

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Union[int, str, list[int]]) -> int:
        if str(devices) not in ("auto", "1", "-1"):
            raise ValueError(
                f"Fabric(devices={devices!r}) is not used with SPMD: one process drives the whole mesh. "
                "Leave devices='auto' and size the mesh with build_mesh(data=...)."
            )
        return 1

    @staticmethod
    def get_parallel_devices(devices: Union[int, list[int]]) -> list[torch.device]:
        return [torch.device("xla", 0)]


class SPMDPrecision(XLAPrecision):
    """"32-true", "bf16-mixed" (autocast to bf16 around forward; fp32 weights) or "bf16-true" (``XLA_USE_BF16``).

    Args:
        sync_on_step: call ``torch_xla.sync()`` after ``optimizer.step()`` to cut the lazy graph there (as Fabric's
            ``XLAPrecision`` does); skipped inside ``torch_xla.compile(full_graph=True)``, whose exit syncs.
    """

    def __init__(self, precision: str = "32-true", sync_on_step: bool = True) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"SPMDPrecision supports {_PRECISIONS}, got precision={precision!r}.")
        self.precision = precision  # type: ignore[assignment]
        self.sync_on_step = sync_on_step
        self._desired_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
        if precision == "bf16-true":
            _enable_xla_bf16()

    def forward_context(self) -> AbstractContextManager:
        """Autocast XLA ops to bf16 under "bf16-mixed"; nothing otherwise."""
        if self.precision == "bf16-mixed":
            return torch.autocast("xla", dtype=torch.bfloat16)
        return nullcontext()

    def convert_output(self, data: Any) -> Any:
        """Under "bf16-mixed", hand fp32 outputs to the loss (as Fabric's MixedPrecision does)."""
        if self.precision != "bf16-mixed":
            return data
        return apply_to_collection(data, Tensor, lambda t: t.float() if t.is_floating_point() else t)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()``; no gradient all-reduce: under SPMD the gradients are already global."""
        out = optimizer.step(**kwargs)
        # not inside torch_xla.compile: its exit syncs anyway, with full_graph=True a sync raises, and without it a sync
        # only cuts the step in two (the scipy-matcher step segfaulted in that sync on a CI run, torch_xla 2.9)
        inside_compile = bool(torch_xla._XLAC._get_current_graph_name())
        if self.sync_on_step and torch_xla._XLAC._get_allow_execution() and not inside_compile:
            torch_xla.sync()
        return out

    def teardown(self) -> None:
        """Nothing to undo (``XLA_USE_BF16`` is latched by torch_xla at the first device tensor)."""


def _enable_xla_bf16() -> None:
    """Set ``XLA_USE_BF16=1`` and prove it took effect; torch_xla ignores it once a device tensor exists."""
    if not xr.is_spmd():
        raise RuntimeError("Call torch_xla.runtime.use_spmd() (or spmd_fabric()) before SPMDPrecision('bf16-true').")
    previous = os.environ.get("XLA_USE_BF16")
    os.environ["XLA_USE_BF16"] = "1"
    probe = torch.zeros(1, device=torch_xla.device())
    if "bf16" not in torch_xla._XLAC._get_xla_tensors_hlo([probe]):
        if previous is None:
            del os.environ["XLA_USE_BF16"]
        raise RuntimeError(
            "precision='bf16-true' needs XLA_USE_BF16=1 before the first XLA tensor of this process exists; one "
            "already did, so it would silently compute in fp32. Create the Fabric before any XLA tensor, export "
            "XLA_USE_BF16=1 before starting Python, or use precision='bf16-mixed'."
        )


def replicate_parameters(module: Module, mesh: xs.Mesh) -> int:
    """Annotate every unannotated XLA parameter and buffer of ``module`` replicated over ``mesh``; returns how many.

    An unannotated tensor is replicated already, but the first ``torch.compile(backend="openxla")`` execution (eval)
    annotates its inputs ``{replicated}`` explicitly, which changes the hash of the training step's graph: the first
    step after an in-fit eval would compile the step again. Annotating up front keeps one training graph.
    """
    count = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "xla" and tensor.dim() and not torch_xla._XLAC._get_xla_sharding_spec(tensor):
            xs.mark_sharding(tensor, mesh, (None,) * tensor.dim())
            count += 1
    return count


class SPMDStrategy(XLAStrategy):
    """One process, every device of ``mesh``: no launcher, world_size 1, rank 0.

    Collectives under SPMD: a tensor is already the global value (GSPMD reduces across shards inside the compiled
    graph), so ``all_reduce`` / ``all_gather`` / ``broadcast`` return their input and ``barrier`` does nothing.
    Parameters are replicated on every device; batches are sharded on dim 0 (see ``SPMDDataLoader``).

    ``prefetch``: batches each loader from ``process_dataloader`` (``fabric.setup_dataloaders``) loads ahead in a
    background thread (0: synchronously); set ``fabric.strategy.prefetch`` before setting the loaders up, and
    ``sync_each_batch`` (default True: ``torch_xla.sync()`` after each batch) to False where the step syncs itself.
    """

    def __init__(self, mesh: Optional[xs.Mesh] = None, accelerator: Optional[SPMDAccelerator] = None,
                 precision: Optional[XLAPrecision] = None, checkpoint_io: Any = None, prefetch: int = 2) -> None:
        self.mesh = mesh if mesh is not None else build_mesh()
        self.prefetch = prefetch
        self.sync_each_batch = True
        super().__init__(parallel_devices=[torch.device("xla", 0)], checkpoint_io=checkpoint_io,
                         precision=precision, sync_module_states=False)
        self.accelerator = accelerator

    @property
    def accelerator(self) -> Optional[SPMDAccelerator]:
        return self._accelerator  # type: ignore[return-value]

    @accelerator.setter
    def accelerator(self, accelerator: Optional[Any]) -> None:
        if accelerator is not None and not isinstance(accelerator, SPMDAccelerator):
            raise TypeError(
                f"SPMDStrategy needs SPMDAccelerator, got {type(accelerator).__name__}: "
                "Fabric(accelerator=SPMDAccelerator(), strategy=SPMDStrategy(mesh), ...)."
            )
        if accelerator is not None:
            accelerator.mesh = self.mesh
        self._accelerator = accelerator

    @property
    def precision(self) -> SPMDPrecision:
        return self._precision if self._precision is not None else SPMDPrecision()  # type: ignore[return-value]

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None and not isinstance(precision, SPMDPrecision):
            if not isinstance(precision, XLAPrecision) or precision.precision not in _PRECISIONS:
                os.environ.pop("XLA_USE_F16", None)  # set by Fabric's XLAPrecision("16-true")
                raise TypeError(f"SPMDStrategy needs SPMDPrecision{_PRECISIONS}, got {precision!r}.")
            precision = SPMDPrecision(precision.precision)
        self._precision = precision

    @property
    def root_device(self) -> torch.device:
        return torch_xla.device()

    # One process: the ranks and sizes Fabric sees, whatever the mesh size.
    global_rank = local_rank = node_rank = property(lambda self: 0)
    world_size = num_processes = property(lambda self: 1)

    @property
    def distributed_sampler_kwargs(self) -> None:
        """No DistributedSampler: the one process reads the whole global batch."""
        return None

    def _configure_launcher(self) -> None:
        self._launcher = None  # nothing to spawn

    def setup_environment(self) -> None:
        """Check SPMD is on and make ``mesh`` the global mesh (no ">1 device" check, nothing to spawn)."""
        if not xr.is_spmd():
            raise RuntimeError("SPMD is off: call torch_xla.runtime.use_spmd() before any XLA tensor exists.")
        self._launched = True
        rank_zero_only.rank = 0
        xs.set_global_mesh(self.mesh)
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)

    def setup_module(self, module: Module) -> Module:
        """Parameters were moved by ``module_to_device``; annotate them replicated on the mesh (see below)."""
        replicate_parameters(module, self.mesh)
        return module

    def process_dataloader(self, dataloader: DataLoader) -> SPMDDataLoader:
        """Wrap ``dataloader`` so batches arrive sharded on the mesh's batch axes."""
        if isinstance(dataloader, SPMDDataLoader):
            return dataloader
        return SPMDDataLoader(dataloader, self.mesh, self.root_device, prefetch=self.prefetch,
                              sync_each_batch=self.sync_each_batch)

    def all_reduce(self, output: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Identity: an SPMD tensor is already global; reduce over a dimension with ``.sum()``/``.mean()``."""
        return output

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Identity: the tensor already holds every shard's values (no leading world_size dim, as world_size is 1)."""
        return tensor

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Identity: there is one process, so every "rank" already has ``obj``."""
        return obj

    def barrier(self, name: Optional[str] = None, *args: Any, **kwargs: Any) -> None:
        """No-op: one process has nobody to wait for (use ``torch_xla.sync()`` to flush pending work)."""

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Identity: one process decides alone."""
        return decision

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        """Flush pending work, then write a plain torch checkpoint (global values as CPU tensors) from this process."""
        torch_xla.sync()
        Strategy.save_checkpoint(self, path, state, storage_options=storage_options, filter=filter)


def spmd_fabric(mesh: Optional[xs.Mesh] = None, precision: str = "32-true", **fabric_kwargs: Any) -> Fabric:
    """A launched Fabric driving ``mesh`` (default: all devices on the ``data`` axis) from this process.

    Turns SPMD on if needed; call it before any XLA tensor exists (SPMD, like "bf16-true", is process-global).
    """
    if not xr.is_spmd():
        xr.use_spmd()
    strategy = SPMDStrategy(mesh if mesh is not None else build_mesh())
    fabric = Fabric(accelerator=SPMDAccelerator(), strategy=strategy, plugins=[SPMDPrecision(precision)],
                    **fabric_kwargs)
    if not getattr(fabric, "_launched", False):  # already launched under the `fabric run` CLI
        fabric.launch()
    return fabric
