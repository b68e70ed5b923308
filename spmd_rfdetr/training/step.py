"""The training step: forward, rfdetr's set criterion, backward, clipping and AdamW, compiled as one XLA program.

Two ways to run it (``trainer.step_mode``):
- ``replay`` (default): the step's Python is traced once per batch signature (one, or one per multi-scale bucket),
  then its compiled program is replayed every step (:mod:`spmd_rfdetr.xla.replay`), so the host does almost nothing per
  step. The first step that repeats a signature (step 2 with one) is traced once more and compared with that
  signature's first trace; a difference (a per-step Python value baked into the graph) falls back to ``trace``.
- ``trace``: ``torch_xla.compile`` (lazy tracing) re-runs the step's Python every step and finds the program in the
  compilation cache.
In both, execution is disallowed while tracing, so a stray host sync (an ``.item()``, a CPU fallback) raises instead
of silently cutting the graph. A third mode:
- ``openxla`` (``trainer.compile_backend=openxla``): ``torch.compile(backend="openxla")`` with the bridge fix of
  :mod:`spmd_rfdetr.xla.openxla_fix` (without it torch_xla 2.9 gives stale weight gradients under SPMD). Dynamo splits the
  step at ``backward()`` and wherever it cannot trace, so it runs several programs per step.

Whatever changes per step lives on the device, so one replayed program serves every step: the AdamW step count
(capturable AdamW, its state created on the device before the first step, so a fresh ``fit`` compiles the step once),
the learning rates and the schedule's position (``DeviceLRSchedule``: warm-up + cosine computed on the device), the
EMA's update counter, the RNG seed (advanced per replay, as the dynamo bridge does). With multi-scale buckets compiled
before step 1 (:mod:`spmd_rfdetr.data.batches`), the replay check runs at step 1. ``trainer.matcher=scipy`` always traces (its
solve goes through the host).

Why replay and not ``openxla`` by default: dynamo cuts the step at ``backward()`` and around the device matcher's
``While`` loop, so a step runs about 30 programs on the tiny CPU config instead of 1 (``benchmarks/README.md``), and
without :mod:`spmd_rfdetr.xla.openxla_fix` it returns stale weight gradients under SPMD (pytorch/xla#4824). Evaluation uses
``openxla``, where inference is correct without the fix. With ``openxla`` training, the EMA update and the non-finite
guard run as one small lazy graph after dynamo's graphs: inside dynamo's post-optimizer graph torch_xla 2.9 failed at
step 1 with "async operation in flight" on the EMA tensors. ``tests/test_openxla.py``: gradients equal eager; RF-DETR's
``fit`` gives the replay run's losses.

Non-finite steps: a step whose loss or gradient norm is NaN/inf changes no weight and no optimizer state, selected on
the device (no host read); the loop sees it at the next log or checkpoint point (:mod:`spmd_rfdetr.training.loop`).

Gradient accumulation (``optim.accumulate=K``): the global batch runs as K micro-batches one after another inside the
one program; each micro-batch takes the same rows of every device's shard, so nothing moves between devices, and the
activation memory is that of one micro-batch. Every micro-batch's losses are normalised by the whole batch's box
count, so the update is exactly the whole batch's (tested: loss, gradient norm, gradients and weights equal to 1e-5
with K = 2): K changes the memory, not the update. rfdetr 1.11.2 differs: its detection models use Lightning's
automatic optimisation, where each micro-batch is normalised by its own box count and the sum divided by K, so a
micro-batch with few boxes weighs as much as one with many (only its keypoint models take the whole window's count).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, ContextManager, Literal

import torch
import torch_xla

from spmd_rfdetr.data.pixels import normalize_images
from spmd_rfdetr.model.inputs import as_samples
from spmd_rfdetr.model.loss import total_loss
from spmd_rfdetr.xla.lowering import Lowered
from spmd_rfdetr.xla.openxla_fix import apply_bridge_fix
from spmd_rfdetr.xla.parallelize import init_optimizer_state
from spmd_rfdetr.xla.lazy_state import hold_as_device_data, replicate_unannotated
from spmd_rfdetr.xla.replay import Replayer, ReplayUnsafe

log = logging.getLogger(__name__)

#: The final layer's loss terms each log point records (the mask terms only for the seg variants, the keypoint terms
#: only for the keypoint model).
LOGGED_LOSSES = ("loss_ce", "loss_bbox", "loss_giou", "loss_mask_ce", "loss_mask_dice", "loss_keypoints_l1",
                 "loss_keypoints_findable", "loss_keypoints_visible", "loss_keypoints_nll")

StepMode = Literal["replay", "trace", "openxla"]


def forward_loss(
    model: torch.nn.Module,
    criterion: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    num_boxes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward + criterion: (weighted total loss, rfdetr's loss dict). The loss is computed in fp32.

    ``criterion(outputs, batch)`` takes the static batch itself (:class:`~spmd_rfdetr.model.loss.StaticSetCriterion`);
    its uint8 ``images`` are normalised here, in float32 (:func:`~spmd_rfdetr.data.pixels.normalize_images`);
    ``num_boxes``: rfdetr's loss normaliser, when it is not this batch's own box count (accumulation)."""
    samples = as_samples(normalize_images(batch["images"]))
    with autocast():
        outputs = model(samples)
    outputs = _to_float(outputs)
    extra = {} if num_boxes is None else {"num_boxes": num_boxes}  # a criterion without rfdetr's override works too
    loss_dict = criterion(outputs, batch, **extra)
    return total_loss(loss_dict, criterion.weight_dict), loss_dict


def micro_batches(batch: dict[str, torch.Tensor], count: int, shards: int) -> list[dict[str, torch.Tensor]]:
    """Split a batch sharded ``shards`` ways on dim 0 into ``count`` micro-batches, each taking the same rows of every
    shard (a local slice on each device: no data moves between devices)."""
    size = next(iter(batch.values())).shape[0]
    if size % (shards * count):
        raise ValueError(f"a batch of {size} does not split into {count} micro-batches on {shards} shards")
    rows = size // (shards * count)

    def take(tensor: torch.Tensor, i: int) -> torch.Tensor:
        grouped = tensor.reshape(shards, count, rows, *tensor.shape[1:])
        return grouped[:, i].reshape(shards * rows, *tensor.shape[1:])

    return [{k: take(v, i) for k, v in batch.items()} for i in range(count)]


def _to_float(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.float() if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _to_float(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_float(v) for v in tree]
    return tree


class TrainStep:
    """One optimizer step as one compiled program; returns device tensors only (read them at log points).

    Args:
        schedule: stepped inside the program (e.g. :class:`~spmd_rfdetr.training.optim.DeviceLRSchedule`); its
            ``tensors()`` are part of the step's state.
        ema: updated inside the program after the optimizer (:class:`~spmd_rfdetr.training.ema.DeviceEMA`), or ``None``.
        accumulate: micro-batches per optimizer step, run one after the other inside the program (gradients add up;
            every micro-batch's losses are normalised by the whole batch's box count, so the update equals one step
            on the whole batch; rfdetr's detectors normalise each micro-batch by its own count, then divide by K). The batch must divide into ``batch_shards`` x this.
        batch_shards: how many shards the batch dimension is split into on the mesh; micro-batch ``i`` takes rows
            ``i`` of every shard, so splitting never moves data between devices.
        full_graph: ``False`` allows host syncs inside the step (``trainer.matcher=scipy``); it implies ``trace``.
        mode: ``replay``, ``trace`` or ``openxla`` (module docstring).

    A step whose loss or gradient norm is not finite does not change the weights or the optimizer state (each updated
    tensor is selected on the device: no host read); the stats count such steps (``nonfinite_steps``, cumulative) and
    name the first one (``first_nonfinite_step``, -1 while there is none), for the loop to act on at a log point.

    The gradients live inside the step only: it ends with every ``.grad`` set to ``None``. As outputs they cost more
    than their own bytes: the TPU compiler then writes each clipped gradient out of the pass that updates the weight
    and its EMA, and updates the AdamW moments in a second pass that reads it back (AdamW + guard + EMA 8.5x a weight's
    bytes without them, 12.5x with: ``benchmarks/README.md``); they would also hold HBM between steps. What a first step
    applied can be read back from AdamW's first moment (``exp_avg = (1 - beta1) * grad`` after one step; the tests do).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        criterion: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        clip_max_norm: float,
        autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
        full_graph: bool = True,
        schedule: Any = None,
        ema: Any = None,
        accumulate: int = 1,
        batch_shards: int = 1,
        mode: StepMode = "replay",
    ) -> None:
        self.model, self.criterion, self.optimizer, self.schedule, self.ema = model, criterion, optimizer, schedule, ema
        self.accumulate, self.batch_shards = accumulate, batch_shards
        self.clip_max_norm = clip_max_norm
        self.autocast = autocast
        self.mode: StepMode = mode if full_graph else "trace"
        self.fallback_reason = ""  # why replay was given up for this run ('' if it was not)
        self.calls = 0
        self._checked = False  # the first repeat of a batch signature is traced again and compared (Replayer.check)
        self._lazy_traces = 0  # calls run by lazy tracing (trace mode, or after a fallback)
        device = next(model.parameters()).device
        self.steps_done = torch.zeros((), dtype=torch.float32, device=device)
        self.nonfinite_steps = torch.zeros((), dtype=torch.float32, device=device)
        self.first_nonfinite = torch.full((), -1.0, dtype=torch.float32, device=device)
        init_optimizer_state(optimizer)  # the first trace is already the steady-state graph (this syncs)
        replicate_unannotated(self.state())  # ... with the input shardings the step's own outputs will have
        hold_as_device_data(self.state())  # ... and hashed as every later trace is (one compile, a cache hit on resume)
        self._replayer = Replayer(self._step, self.state)
        self._compiled = torch_xla.compile(self._step, full_graph=full_graph, name="train_step")
        if self.mode == "openxla":
            apply_bridge_fix()
            self._compiled = torch.compile(self._step, backend="openxla")

    def state(self) -> list[torch.Tensor]:
        """Every device tensor the step reads or updates besides the batch."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.criterion.buffers()]
        for group in self.optimizer.param_groups:
            tensors += [v for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor)]
        for per_param in self.optimizer.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        if self.schedule is not None:
            tensors += self.schedule.tensors()
        if self.ema is not None:
            tensors += self.ema.tensors()
        tensors += self.counters()
        return [t for t in tensors if t.device.type == "xla"]

    def counters(self) -> list[torch.Tensor]:
        """The step's own device counters: steps done, non-finite steps, the first non-finite step."""
        return [self.steps_done, self.nonfinite_steps, self.first_nonfinite]

    def _updated_by_optimizer(self) -> list[torch.Tensor]:
        tensors = [p for group in self.optimizer.param_groups for p in group["params"]]
        for per_param in self.optimizer.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        return tensors

    def _step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        matcher = self.criterion.matcher
        solver_stats = getattr(matcher, "pop_stats", dict)
        solver_stats()  # counters a previous trace left
        loss, loss_dict = self._forward_backward(batch)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.clip_max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip_max_norm)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        lr = self.optimizer.param_groups[0]["lr"]
        lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else torch.tensor(lr)  # this step's, not the next
        # openxla: the guard runs around dynamo's graphs, in __call__ (inside the post-optimizer graph it fails as the
        # EMA update did: "Trying to access XLA data ... while an async operation is in flight: UNKNOWN_SCALAR[]")
        guard = self.mode != "openxla"
        if guard:
            updated, before = self._snapshot()
        self.optimizer.step()
        with torch.no_grad():
            self.steps_done.add_(1)
        if guard:
            self._keep_if_finite(_finite(loss.detach()) & _finite(grad_norm.detach()), updated, before)
        if self.schedule is not None:
            self.schedule.step()  # next step's learning rates, inside this graph
        if self.ema is not None and self.mode != "openxla":
            self.ema.update()
        stats = {"loss": loss.detach(), "grad_norm": grad_norm.detach(), "lr": lr.to(loss.device),
                 "nonfinite_steps": self.nonfinite_steps.clone(), "first_nonfinite_step": self.first_nonfinite.clone()}
        stats.update({k: v.detach() for k, v in loss_dict.items() if k in LOGGED_LOSSES})
        stats.update(solver_stats())  # the device matcher's unconverged problems and search rounds
        self.stat_names = list(stats)
        for param in params:  # the gradients end with the step (class docstring)
            param.grad = None
        return torch.stack([v.float() for v in stats.values()])  # one tensor: one transfer at a log point

    @torch.no_grad()
    def _snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tensors the optimizer updates, and copies of them as they are before the update."""
        updated = self._updated_by_optimizer()
        return updated, [t.detach().clone() for t in updated]

    @torch.no_grad()
    def _keep_if_finite(self, finite: torch.Tensor, updated: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        """A non-finite step changes nothing (each updated tensor is selected on the device) and is counted."""
        for tensor, old in zip(updated, before):
            tensor.copy_(torch.where(finite, tensor, old))
        self.first_nonfinite.copy_(
            torch.where((self.first_nonfinite < 0) & ~finite, self.steps_done, self.first_nonfinite)
        )
        self.nonfinite_steps.add_((~finite).float())

    def _openxla(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """openxla mode: dynamo's graphs for the step, then the non-finite guard and the EMA update as one lazy graph
        (inside dynamo's post-optimizer graph torch_xla 2.9 fails to read these tensors: "Trying to access XLA data
        ... while an async operation is in flight"). Costs one more graph per step: the pre-update copies."""
        updated, before = self._snapshot()
        torch_xla.sync()  # the copies exist before dynamo's graph updates (and may donate) the originals
        stats = self._compiled(batch)
        names = self.stat_names
        finite = _finite(stats[names.index("loss")]) & _finite(stats[names.index("grad_norm")])
        self._keep_if_finite(finite, updated, before)
        stats = stats.clone()
        stats[names.index("nonfinite_steps")] = self.nonfinite_steps
        stats[names.index("first_nonfinite_step")] = self.first_nonfinite
        if self.ema is not None:
            self.ema.update()
        torch_xla.sync()
        return stats

    def _forward_backward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.accumulate == 1:
            loss, loss_dict = forward_loss(self.model, self.criterion, batch, self.autocast)
            loss.backward()
            return loss, loss_dict
        num_boxes = self.criterion.num_boxes(batch)
        loss, loss_dict = torch.zeros((), device=batch["boxes"].device), {}
        for micro in micro_batches(batch, self.accumulate, self.batch_shards):
            part, part_dict = forward_loss(self.model, self.criterion, micro, self.autocast, num_boxes=num_boxes)
            part.backward()
            loss = loss + part.detach()
            loss_dict = {k: loss_dict.get(k, 0) + v.detach() for k, v in part_dict.items()}
        return loss, loss_dict

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns the stats vector named by :attr:`stat_names` (still on the device)."""
        self.calls += 1
        if self.mode == "openxla":
            return self._openxla(batch)
        if self.mode == "trace":
            return self._trace(batch)
        try:
            if self._checked or not self._replayer.seen(batch):
                return self._replayer(batch)
            self._checked = True
            stats, problem = self._replayer.check(batch)
        except ReplayUnsafe as error:  # refused at trace time: this step's lazy trace is still pending
            self._fall_back(str(error))
            torch_xla.sync()  # run it, as trace mode would have
            return error.result
        if problem:
            self._fall_back(problem)
        return stats

    @property
    def check_pending(self) -> bool:
        """Replay's check has not run yet (it traces the second step once more and compares: :meth:`Replayer.check`)."""
        return self.mode == "replay" and not self._checked

    def check_ahead(self, batch: dict[str, torch.Tensor]) -> None:
        """Run replay's check now on the next step's batch, without running that step (the weights, optimizer state
        and gradients stay as they are), so that the next step replays or, if the check fails, traces.

        For a loop that evaluates right after a run's first step: a trace after an openxla evaluation differs from one
        before it (torch.compile's bridge keeps references to the evaluated weights), so the check must come first."""
        if not self.check_pending or not self._replayer.seen(batch):
            return
        self._checked = True
        with self._gradients_kept():
            try:
                problem = self._replayer.check_aside(batch)
            except ReplayUnsafe as error:  # refused at trace time; the state was put back
                problem = str(error)
        if problem:
            self._fall_back(problem)

    def precompile(self, batch: dict[str, torch.Tensor]) -> bool:
        """Compile the program for this batch's signature before its first step (replay mode); the weights, optimizer
        state, schedule and gradients stay as they were. False if nothing was compiled (known signature, another
        mode, or replay refused, which then falls back to trace mode as a refused first step would)."""
        if self.mode != "replay":
            return False
        with self._gradients_kept():
            try:
                return self._replayer.precompile(batch)
            except ReplayUnsafe as error:
                self._fall_back(str(error))
                return False

    def lower(self, batch: dict[str, torch.Tensor]) -> Lowered:
        """The replayed program for this batch's signature as HLO for an ahead-of-time compiler (``aot`` verb), with
        its donated parameters; nothing compiles or runs, the weights and optimizer state stay as they were."""
        with self._gradients_kept():
            return self._replayer.lower(batch)

    @contextlib.contextmanager
    def _gradients_kept(self) -> Iterator[None]:
        """Every parameter's ``.grad`` put back afterwards: a trace aside of the step (check, precompile, lower)
        leaves its own gradients there, which are not the model's."""
        grads = [(p, p.grad) for p in self.model.parameters()]
        try:
            yield
        finally:
            for param, grad in grads:
                param.grad = grad

    @property
    def traces(self) -> int:
        """How many times the step's Python has run (replay: once per batch signature, plus the check)."""
        return self._replayer.traces + self._lazy_traces

    def _trace(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self._lazy_traces += 1
        return self._compiled(batch)

    def _fall_back(self, reason: str) -> None:
        self.mode, self.fallback_reason = "trace", reason
        log.warning(
            "trainer.step_mode=replay is NOT safe for this step and is turned off for the rest of the run: %s. "
            "Training continues correctly with lazy tracing (trace mode: the step's Python runs every step). Keep "
            "every per-step value a device tensor to get replay back.", reason,
        )

    def read(self, stats: torch.Tensor) -> dict[str, float]:
        """Bring a step's stats to the host (one device->host transfer; only at log points)."""
        return dict(zip(self.stat_names, stats.cpu().tolist()))


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite(x)``: ``x - x`` is 0 unless ``x`` is inf or NaN. torch_xla compares with an f64 infinity
    passed in as a graph input (TPUs have no f64)."""
    return (x - x) == 0
