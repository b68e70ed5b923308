"""Make ``torch.compile(backend="openxla")`` train correctly under SPMD (torch_xla 2.9.0 only).

Root cause (torch_xla 2.9.0 C++): the dynamo bridge's ``_get_tensors_xla_device_data_node`` wraps every graph input's
device data in a new ``XLATensor``; under SPMD that constructor calls ``SetShardingSpec`` -> ``CreateTensorNode``,
which relabels the data with the wrapper's tensor id. Graphs traced later (the backward, retraces) then cannot match
those inputs to the call's arguments and bake call 0's tensors in as constants: weight gradients go stale from the
second call on (pytorch/xla#4824). The fix hands the bridge the call's own arguments as "uncloned" tensors, so they are
not rewrapped. One eager backward on the device is also needed once per process before the first compiled backward
under SPMD (else autograd's engine asserts ``device_ready_queues_``).

Only applied for the torch_xla versions it was verified on
(:data:`~spmd_rfdetr.config.resolve.VERIFIED_TORCH_XLA`, checked where the config is validated); other versions keep
``trainer.compile_backend=openxla`` refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmd_rfdetr.config.resolve import VERIFIED_TORCH_XLA, fix_available

def apply_bridge_fix() -> Callable[[], None]:
    """Patch torch_xla's dynamo bridge (idempotent); returns a function that undoes the patch."""
    # lazy: torch_xla starts on import: only when openxla training applies the fix, after setup_runtime
    import torch
    import torch_xla
    import torch_xla._dynamo.dynamo_bridge as bridge

    if not fix_available():
        raise RuntimeError(f"the openxla SPMD training fix is verified for torch_xla {VERIFIED_TORCH_XLA} only, "
                           f"this is {torch_xla.__version__}")
    xlac = torch_xla._XLAC
    if getattr(bridge.extract_graph_helper, "_spmd_rfdetr_fix", False):
        return lambda: None
    original_get, original_extract = xlac._get_tensors_xla_device_data_node, bridge.extract_graph_helper
    current_args: list[Any] = []

    def get_device_data(outputs: list[Any], uncloned: Any = ()) -> Any:
        return original_get(outputs, list(uncloned) + current_args)

    def extract_graph_helper(xla_model: Any, cache: Any) -> Any:
        current_args[:] = [a for a in xla_model.xla_args if isinstance(a, torch.Tensor)]
        try:
            return original_extract(xla_model, cache)
        finally:
            current_args.clear()

    extract_graph_helper._spmd_rfdetr_fix = True  # type: ignore[attr-defined]
    xlac._get_tensors_xla_device_data_node = get_device_data
    bridge.extract_graph_helper = extract_graph_helper
    _eager_backward_once()

    def undo() -> None:
        xlac._get_tensors_xla_device_data_node = original_get
        bridge.extract_graph_helper = original_extract

    return undo


def _eager_backward_once() -> None:
    """One tiny eager backward on the XLA device: starts autograd's device thread before a compiled backward."""
    # lazy: torch_xla starts on import: only from apply_bridge_fix, after setup_runtime
    import torch
    import torch_xla

    probe = torch.ones(2, device=torch_xla.device(), requires_grad=True)
    (probe * 2).sum().backward()
    torch_xla.sync()
