"""Module paths in the HLO op names of a traced program, for :mod:`spmd_rfdetr.aot.components`.

With ``XLA_HLO_DEBUG=1`` torch_xla writes each op's innermost Python frame into its metadata, which is often
``torch/nn/functional.py`` or ``torch/nn/modules/linear.py``: a linear layer of the backbone and one of the decoder
look the same. :func:`module_labels` (a context manager around the trace) prefixes op names with the path of the
``nn.Module`` that ran them (``transformer.decoder.layers.0.self_attn/aten__mm``), through torch_xla's
``_set_xla_custom_op_name_prefix``, which labels a tensor's op *and every unlabelled op it depends on*. So labels
are set from the inside out: when a module returns, its outputs take its path (claiming the ops inside it that no
submodule claimed); before a module runs, its inputs take its parent's path (the parent's own ops before the call).
Functions that are not a module's forward (the matcher's cost and solver, the mask losses) are labelled the same way
by ``scopes``. Autograd's backward ops are labelled ``backward/<path>`` by a hook on each autograd node the forward
labels reach (the gradients a node returns are its backward ops' results).

Nothing else changes: ``nn.Module.__call__`` is wrapped for the trace, not hooked (rfdetr's two-stage selection
takes a slower per-group path when any module has forward hooks, and a ``TorchFunctionMode`` changed the traced
program as well), no op is intercepted or re-run, and the autograd hooks return nothing: the traced module has the
same instructions with and without labels (checked on the tiny config: 24,754). Ops outside every module and scope
(AdamW, the EMA, clipping) keep their plain op names and are told apart by their source files.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_KEY = "spmd_rfdetr_label"
#: torch_xla writes ``min(depth, frames)`` frames and names the innermost of them as the op's source line: all.
_ALL_FRAMES = 1 << 20


def _label(tensor: Any, label: str) -> None:
    # lazy: torch_xla starts on import; labels are set only inside trace_programs, after setup_runtime
    import torch_xla

    if isinstance(tensor, torch.Tensor) and tensor.device.type == "xla":
        try:
            torch_xla._XLAC._set_xla_custom_op_name_prefix(tensor, label + "/", _ALL_FRAMES)
        except RuntimeError:  # a tensor without an IR value of its own: nothing to label
            pass


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _mark_backward(node: Any, label: str) -> None:
    """Label the backward of ``node`` and of the unlabelled autograd nodes behind it."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n is None or _KEY in n.metadata:
            continue
        n.metadata[_KEY] = label
        todo.extend(f for f, _ in n.next_functions)
        if "AccumulateGrad" in n.name():  # no op of its own; a hook there changes how .grad accumulates
            continue

        def hook(grad_inputs: Any, grad_outputs: Any, _label_: str = "backward/" + label) -> None:
            for g in _tensors(grad_inputs):
                _label(g, _label_)

        n.register_hook(hook)


def _claim(value: Any, label: str | None) -> None:
    if not label:
        return
    for t in _tensors(value):
        _label(t, label)
        if t.grad_fn is not None:
            _mark_backward(t.grad_fn, label)


def _scoped(function: Callable[..., Any], label: str, stack: list[str]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _claim((args, kwargs), stack[-1] if stack else None)
        stack.append(label)
        try:
            out = function(*args, **kwargs)
        finally:
            stack.pop()
        _claim(out, label)
        return out

    return wrapped


@contextlib.contextmanager
def module_labels(roots: dict[str, torch.nn.Module],
                  scopes: list[tuple[str, Any, str]] = ()) -> Iterator[None]:
    """Label the ops of the modules under ``roots`` (``{prefix: module}``; ``""``: the module's own names) while
    tracing, and those of each ``(label, owner, attribute)`` of ``scopes`` (a function or method that returns the
    tensors it computes) with ``label``."""
    names: dict[int, str] = {}
    for prefix, root in roots.items():
        for name, module in root.named_modules():
            path = ".".join(p for p in (prefix, name) if p)
            names.setdefault(id(module), path or type(root).__name__)
    stack: list[str] = []

    original_call = torch.nn.Module.__call__

    def call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        _claim((args, kwargs), stack[-1] if stack else None)
        label = names.get(id(module), f"{stack[-1] if stack else ''}.{type(module).__name__}".lstrip("."))
        stack.append(label)
        try:
            output = original_call(module, *args, **kwargs)
        finally:
            stack.pop()
        _claim(output, label)
        return output

    patched = []
    for label, owner, attribute in scopes:
        if owner is None or not hasattr(owner, attribute):
            continue
        own = attribute in vars(owner) if hasattr(owner, "__dict__") else True
        original = getattr(owner, attribute)
        patched.append((owner, attribute, original if own else None))
        setattr(owner, attribute, _scoped(original, label, stack))
    torch.nn.Module.__call__ = call  # not a forward hook: rfdetr takes another path when a module has hooks
    try:
        yield
    finally:
        torch.nn.Module.__call__ = original_call
        for owner, attribute, original in reversed(patched):
            if original is None:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
