"""An exponential moving average of the weights, updated inside the compiled training step.

The semantics of upstream's trainer (``RFDETREMACallback``: torch's ``AveragedModel`` with rfdetr's average): the
first update copies the weights, update ``n`` >= 2 (1-based) uses the decay ``decay * (1 - exp(-n / tau))``
(``decay`` when ``tau`` is 0) and every floating-point parameter and buffer becomes ``decay * ema + (1 - decay) *
weight``. (rfdetr's legacy ``ModelEma`` differs in the first update only: it averages the initial weights in.)
Here the update counter is a device tensor and the update runs in the step's graph: no host value changes per step,
so the replayed program keeps updating it, and nothing is read back.

Tested against upstream's own ``AveragedModel`` with its callback's average, to 1e-6.
"""

from __future__ import annotations

import copy

import torch


class DeviceEMA:
    """The averaged copy of a model (:attr:`module`, in eval mode) and its device update counter.

    The copy's parameters and buffers are deep copies of the model's XLA tensors, with the same shardings; evaluate or
    save :attr:`module` to use the averaged weights.
    """

    def __init__(self, model: torch.nn.Module, decay: float, tau: int) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self.tau = decay, tau
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self._model = model
        device = next(model.parameters()).device
        self.updates = torch.ones((), dtype=torch.float32, device=device)  # the number of the next update
        self._pairs = [
            (averaged, live)
            for averaged, live in zip(_state_tensors(self.module), _state_tensors(model), strict=True)
        ]

    @torch.no_grad()
    def update(self) -> None:
        """One EMA update from the model's current weights (in-place device ops: part of the caller's graph)."""
        if self.tau > 0:
            decay = self.decay * (1 - torch.exp(-self.updates / self.tau))
        else:
            decay = torch.full_like(self.updates, self.decay)
        decay = torch.where(self.updates > 1, decay, torch.zeros_like(decay))  # AveragedModel: update 1 copies
        for averaged, live in self._pairs:
            if averaged.is_floating_point():
                averaged.copy_(decay * averaged + (1.0 - decay) * live)
            else:
                averaged.copy_(live)
        self.updates.add_(1)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors :meth:`update` writes (part of the training step's state)."""
        return [averaged for averaged, _ in self._pairs] + [self.updates]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, keyed as the model's own ``state_dict``."""
        return self.module.state_dict()


def _state_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers in ``state_dict`` order (the live objects, so in-place updates reach them)."""
    return [*module.parameters(), *module.buffers()]
