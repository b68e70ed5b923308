"""Trace a training step once, then replay its compiled XLA program: the step's Python runs once per input signature.

Lazy tracing (``torch_xla.compile``) re-runs the whole step in Python every step to rebuild the graph before it finds
the compiled program in its cache: about 0.6 s of host time per Nano step, while a TPU chip executes it in tens of
milliseconds. :class:`Replayer` traces ``fn`` once, compiles the graph without executing it, then runs the cached
program with ``torch_xla._XLAC._run_cached_graph`` (what torch_xla's dynamo bridge does) and swaps each result into the
tensor it updates with ``_replace_xla_tensor`` (``copy_`` would leave pending IR under SPMD).

Rules the traced function must follow (checked where they can be):
- Everything it updates in place (parameters, gradients, optimizer state, device LRs) is listed by ``state()``; a
  live tensor it leaves pending outside that list makes the trace refuse replay (:class:`ReplayUnsafe`, after which
  ``torch_xla.sync()`` runs that step's lazy trace).
- Every per-step value is a device tensor. A Python number becomes a graph constant frozen at trace time;
  :meth:`Replayer.check` traces a second step and compares the graph hash and every constant's value.
- The RNG seed is a graph input advanced per replay, as the dynamo bridge does.
The state tensors a program updates are donated to it (XLA input/output aliasing): each is updated in place, so the
weights, AdamW moments, EMA, learning rates and counters do not exist twice while the step runs. A donated buffer is
gone after the replay; the state tensors hold the results, so only an outside reference to the old data (a
``.detach()`` taken before the step) would notice.
A batch with another signature (shapes, dtypes, shardings) is traced and compiled as a new program, never run on the
wrong one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

from spmd_rfdetr.xla.lazy_state import device_data, replicate_unannotated, stray_pending
from spmd_rfdetr.xla.lowering import Lowered, lower

log = logging.getLogger(__name__)
_X = torch_xla._XLAC

Signature = tuple[tuple[str, tuple[int, ...], torch.dtype, str], ...]


class ReplayUnsafe(RuntimeError):
    """The traced step cannot be replayed faithfully (the message says why); run it with lazy tracing instead.

    ``result`` is the step's lazily traced result: ``torch_xla.sync()`` runs that trace, so the step is not lost.
    """

    def __init__(self, message: str, result: torch.Tensor | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class Program:
    """One compiled step: where each graph input comes from and which tensors its outputs replace."""

    graph_hash: Any
    slots: list[tuple[str, Any]]  # per graph input: ("batch", name) | ("state", t) | ("seed", device) | ("const", t)
    targets: list[torch.Tensor | None]  # per graph output: the tensor it replaces; None = nothing (e.g. the result)
    result_index: int  # which output is the step's result
    text: str  # the traced IR, to compare traces (the hash also covers sharding metadata that replays change)

    def __post_init__(self) -> None:
        # per replay only the batch and the seed change: the rest of the input list is built once
        self.fixed = [value if kind in ("state", "const") else None for kind, value in self.slots]
        self.batch_slots = [(i, value) for i, (kind, value) in enumerate(self.slots) if kind == "batch"]
        self.seed_slots = [(i, value) for i, (kind, value) in enumerate(self.slots) if kind == "seed"]

    def constants(self) -> list[torch.Tensor]:
        return [value for kind, value in self.slots if kind == "const"]

    def donated(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The graph inputs whose buffers the program may reuse for its outputs: the state tensors it updates."""
        return [value for value, _ in self.donated_to(inputs)]

    def donated_to(self, inputs: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
        """:meth:`donated`, each with the index of the output that updates the same tensor."""
        output_of = {id(t): i for i, t in enumerate(self.targets) if t is not None}
        return [(value, output_of[id(tensor)]) for (kind, tensor), value in zip(self.slots, inputs)
                if kind == "state" and id(tensor) in output_of]

    def inputs(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """This replay's graph inputs: the state as it is now, the batch, a fresh RNG seed."""
        inputs = list(self.fixed)
        for i, name in self.batch_slots:
            inputs[i] = batch[name]
        for i, device in self.seed_slots:  # a fresh seed per replay, advanced as torch_xla.sync() would
            inputs[i] = _X._get_base_seed_as_tensor(device)
            xm.set_rng_state((1012031 + _X._xla_get_rng_seed() * 7012063) % 18446744073709551615, device)
        return inputs


def signature(batch: dict[str, torch.Tensor]) -> Signature:
    """Shapes, dtypes and shardings of a batch: one compiled program per signature."""
    return tuple(
        (name, tuple(t.shape), t.dtype, _X._get_xla_sharding_spec(t)) for name, t in sorted(batch.items())
    )


class Replayer:
    """``fn(batch) -> tensor`` traced once per batch signature, then replayed as one cached XLA program per call.

    Args:
        fn: the step; it updates ``state()`` in place and returns one tensor (e.g. a stats vector).
        state: the tensors ``fn`` reads and updates (called before and after the trace).
    """

    def __init__(self, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                 state: Callable[[], list[torch.Tensor]]) -> None:
        self.fn, self.state = fn, state
        self.programs: dict[Signature, Program] = {}
        self.traces = 0  # how many times fn's Python ran (first call per signature, plus checks)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        program = self.programs.get(signature(batch))
        if program is None:
            program, inputs = self._trace_and_compile(batch)
        else:
            inputs = program.inputs(batch)
        return self._run_or_retrace(program, inputs, batch)

    def _run_or_retrace(self, program: Program, inputs: list[torch.Tensor], batch: dict[str, torch.Tensor],
                        ) -> torch.Tensor:
        """Run the program; if torch_xla's compilation cache (an LRU of ``XLA_COMPILATION_CACHE_SIZE`` programs)
        dropped it, trace and compile it again (nothing ran: the failed lookup changes no state)."""
        try:
            return self._run(program, inputs)
        except RuntimeError as error:
            if not _evicted(error):
                raise
        log.info("the step's program left torch_xla's compilation cache (XLA_COMPILATION_CACHE_SIZE): compiling again")
        program, inputs = self._trace_and_compile(batch)
        return self._run(program, inputs)

    def seen(self, batch: dict[str, torch.Tensor]) -> bool:
        """Whether a program for this batch's signature exists."""
        return signature(batch) in self.programs

    def check(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
        """Trace this step again instead of replaying it; returns (result, problem), where ``problem`` says how the
        graph or one of its constants differs from the first trace's ('' if not: a per-step Python value was baked
        into the program). Either way this step runs what its own trace says."""
        key = signature(batch)
        first = self.programs.get(key)
        if first is None:
            return self(batch), ""
        second, inputs, outputs = self.trace(batch)
        problem = _difference(first, second)
        if problem:
            _compile(second, inputs, outputs)
            self.programs[key] = second
            return self._run(second, inputs), problem
        # The same graph: the compiled program, with this trace's inputs and output tensors (its gradients are new).
        # Its hash may differ (torch_xla also hashes the outputs' sharding metadata, which replayed results carry
        # differently), so it is not compiled again.
        program = Program(first.graph_hash, second.slots, second.targets, second.result_index, first.text)
        try:
            result = self._run(program, inputs)
        except RuntimeError as error:
            if not _evicted(error):
                raise
            _compile(second, inputs, outputs)  # the first program left the cache: compile this trace's
            program, result = second, self._run(second, inputs)
        self.programs[key] = program
        return result, ""

    def check_aside(self, batch: dict[str, torch.Tensor]) -> str:
        """:meth:`check` without running the step: trace this batch's step on the state as it is, compare it with the
        signature's program, then put the state back (see :meth:`_trace_aside`); returns the problem ('' if none)."""
        first = self.programs[signature(batch)]
        problems: list[str] = []
        self._trace_aside(batch, lambda program, inputs, outputs: problems.append(_difference(first, program)))
        return problems[0]

    def precompile(self, batch: dict[str, torch.Tensor]) -> bool:
        """Compile the program for this batch's signature now without running it, and leave the state as it was
        (a multi-scale run compiles every bucket before step 1). False if the signature has a program already."""
        key = signature(batch)
        if key in self.programs:
            return False
        self.programs[key] = self._trace_aside(batch, _compile)
        return True

    def lower(self, batch: dict[str, torch.Tensor], name: str = "train_step") -> Lowered:
        """This batch's program as torch_xla would compile it (see :func:`lower`), for an ahead-of-time compiler;
        nothing compiles or runs and the state is left as it was."""
        lowered: list[Lowered] = []
        self._trace_aside(batch, lambda program, inputs, outputs: lowered.append(
            lower(outputs, program.donated_to(inputs), name)))
        return lowered[0]

    def _trace_aside(self, batch: dict[str, torch.Tensor],
                     use: Callable[[Program, list[torch.Tensor], list[torch.Tensor]], None]) -> Program:
        """Trace the step, hand (program, inputs, outputs) to ``use``, then put the state back as it was before.

        The trace writes pending results into the state; afterwards each state tensor gets its pre-trace device data
        back (wrapped before the trace: tensors the step only writes, such as the learning rates, are no graph input
        to take it from) and the RNG seed its value. Outputs that are no state tensor (e.g. gradients the trace
        created) are not kept: replaying this program leaves them out."""
        torch_xla.sync()
        before = list({id(t): t for t in self.state()}.values())
        replicate_unannotated(before)
        device = next(iter(batch.values())).device
        seed = xm.get_rng_state(device)
        snapshot = [(t, device_data(t)) for t in before]
        restore = {id(t): (t, w) for t, w in snapshot}
        try:
            # wrapping relabelled each tensor's device data with its wrapper's id: the trace finds the state by those
            program, inputs, outputs = self.trace(batch, {_X._xla_get_tensor_id(w): t for t, w in snapshot})
            # ... and the trace wrapped the inputs it writes once more: that wrapper now names their data
            for (kind, tensor), value in zip(program.slots, inputs):
                if kind == "state" and _X._xla_get_tensor_id(value) != _X._xla_get_tensor_id(tensor):
                    restore[id(tensor)] = (tensor, value)
            use(program, inputs, outputs)
        finally:
            for tensor, data in restore.values():
                tensor.data = data
            xm.set_rng_state(seed, device)
        kept = {id(t) for t in before}
        program.targets = [t if t is not None and id(t) in kept else None for t in program.targets]
        return program

    def _trace_and_compile(self, batch: dict[str, torch.Tensor]) -> tuple[Program, list[torch.Tensor]]:
        program, inputs, outputs = self.trace(batch)
        _compile(program, inputs, outputs)
        self.programs[signature(batch)] = program
        return program, inputs

    def trace(self, batch: dict[str, torch.Tensor], aliases: dict[int, torch.Tensor] | None = None,
              ) -> tuple[Program, list[torch.Tensor], list[torch.Tensor]]:
        """Run ``fn`` lazily (execution disallowed); returns its program (not compiled yet), this step's inputs (the
        pre-step data of everything the graph reads) and the graph's output tensors (still pending). ``aliases``:
        more data ids of state tensors (see :meth:`precompile`)."""
        torch_xla.sync()
        xm.wait_device_ops()
        names = sorted(batch)
        before = self.state()
        replicate_unannotated(before)
        slot_of = {_X._xla_get_tensor_id(batch[n]): ("batch", n) for n in names}
        slot_of.update({_X._xla_get_tensor_id(t): ("state", t) for t in before})
        slot_of.update({data_id: ("state", t) for data_id, t in (aliases or {}).items()})
        allowed = _X._get_allow_execution()
        _X._set_allow_execution(False)  # a host sync inside fn raises instead of silently cutting the graph
        try:
            result = self.fn(batch)
        finally:
            _X._set_allow_execution(allowed)
        self.traces += 1
        candidates = [*self.state(), result]
        pending = _X._check_tensor_need_materialization(candidates)
        outputs = [t for t, p in zip(candidates, pending) if p]
        stray = stray_pending(outputs)
        if stray:  # the lazy trace is left pending: a sync runs this step as trace mode would
            raise ReplayUnsafe(
                f"the step left {len(stray)} tensor(s) with pending work outside its state (parameters, gradients, "
                f"optimizer state, schedule), shapes {[tuple(t.shape) for t in stray[:5]]}: a replay would not "
                "update them", result,
            )
        # Inputs the step only reads are passed as "uncloned": torch_xla then hands them back as they are instead of
        # wrapping their data in a new tensor, which under SPMD relabels the data with the wrapper's id (the openxla
        # bridge bug of openxla_fix.py) and would hide them from the next trace's matching.
        written = {id(t) for t in outputs}
        read_only = [batch[n] for n in names] + [t for t in before if id(t) not in written]
        seed_ids = {_X._get_seed_info_id()}
        outputs, ids, values = _in_input_order(outputs, result, slot_of, seed_ids, read_only)
        slots: list[tuple[str, Any]] = []
        for tensor_id, value in zip(ids, values):
            if tensor_id in seed_ids:
                slots.append(("seed", str(value.device)))
            else:
                slots.append(slot_of.get(tensor_id, ("const", value)))
        del before, slot_of  # keep only the inputs the graph reads alive (not e.g. last step's gradients)
        targets = [None if t is result else t for t in outputs]
        program = Program(_X._get_graph_hash(outputs), slots, targets, targets.index(None),
                          _X._get_xla_tensors_text(outputs))
        return program, list(values), outputs

    @staticmethod
    def _run(program: Program, inputs: list[torch.Tensor]) -> torch.Tensor:
        results = _X._run_cached_graph(program.graph_hash, inputs)  # asynchronous: placeholders until it finishes
        for target, value in zip(program.targets, results):
            if target is not None:
                target.data = value  # not _replace_xla_tensor: that keeps the old tensor id, and the data's own id
                # would no longer match it in a later trace
        return results[program.result_index]


def _compile(program: Program, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Compile the traced graph (or find it in the cache) without running it, donating the state it updates.

    torch_xla aliases buffers only at a full ``torch_xla.sync()`` on its own; for a compile-only warm-up it does so
    for inputs marked for donation while its buffer-donor config is on (what its dynamo bridge does). The donors are
    part of the graph hash, so the program's hash is taken again under the same config. Every execution of the
    compiled program then donates those inputs (PJRT follows the executable's aliasing).

    On XLA's CPU client only when asked (:func:`donates_at_runtime`): there a donated program's results are not
    deterministic on every CPU. Measured 2026-12-07 on a 2-core AMD EPYC (AVX2, no AVX-512), the loop fit of
    tests/test_replay.py: donated, two runs of the same config parted at step 2-4 and by up to 0.09 in the loss at
    step 5 (7 of 7 runs failed the comparison with trace mode; also with a wait for the device before and after every
    replayed run, and with every state tensor copied into fresh buffers first); undonated, runs were equal bit for
    bit to each other and to trace mode. On the Intel machines of 2026-12-06, donated runs were equal to undonated
    ones bit for bit (10 of 10). A TPU has its own runtime: ``pytest -m tpu`` resumes a preempted, donating fit bit
    for bit on the chip. The suite's donated arm is one host of the two-host fit (tests/test_hosts.py
    ``test_donated_replay_trains_as_the_undonated_one``)."""
    donated = program.donated(inputs) if donates_at_runtime() else []
    for value in donated:
        _X._set_buffer_donation(value, True)
    try:  # not donating: torch_xla's own compile path, no aliasing config at all
        with alias_with_buffer_donor_config() if donated else contextlib.nullcontext():
            program.graph_hash = _X._get_graph_hash(outputs)
            _X._xla_warm_up_cache(outputs, [])  # nothing executes
    finally:  # the program donates them now; marked, a later torch_xla.sync() reading them would donate them too
        for value in donated:
            _X._set_buffer_donation(value, False)


#: ``1`` donates the training state on XLA's CPU client too, as a TPU always does (off by default there: its donated
#: results are not deterministic on every CPU, see :func:`_compile`).
DONATE_ON_CPU_ENV = "SPMD_RFDETR_DONATE_ON_CPU"


def donates_at_runtime() -> bool:
    """Whether the replayed program reuses the state's buffers for its outputs on this backend (a TPU: always)."""
    return xr.device_type() != "CPU" or os.environ.get(DONATE_ON_CPU_ENV, "0") == "1"


def _in_input_order(outputs: list[torch.Tensor], result: torch.Tensor, slot_of: dict[int, tuple[str, Any]],
                    seed_ids: set[int], read_only: list[torch.Tensor],
                    ) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """``outputs`` reordered: the state tensors the program reads first, in the order of their inputs, then the rest,
    the result last; with the graph's inputs in that order (``_get_tensors_xla_device_data_node``: their data ids and
    tensors, ``read_only`` ones passed through as they are).

    XLA pairs donated inputs with outputs by byte size alone (``OptimizeInputOutputBufferAlias``: within a size, the
    k-th donated parameter with the k-th output), and torch_xla numbers parameters in the post-order of the outputs'
    graph. In another order, a weight's update is written into another same-sized tensor's buffer (another weight's
    moment, say), and the TPU compiler copies buffers around it (``aot`` reports ``updated_in_own_buffer``; the
    lazily traced modes cannot order their outputs and keep that cost). The post-order depends on the order of the
    outputs, so this repeats until it holds. Each look wraps the inputs not in ``read_only`` anew, which under SPMD
    renames their data: ``slot_of`` (the state's) and ``seed_ids`` (the RNG seed's) learn the new names."""
    for _ in range(4):
        ids, values = _X._get_tensors_xla_device_data_node(outputs, read_only)
        position = {}
        for index, (tensor_id, value) in enumerate(zip(ids, values)):
            if tensor_id in seed_ids:
                seed_ids.add(_X._xla_get_tensor_id(value))
            kind, tensor = slot_of.get(tensor_id, ("", None))
            if kind == "state":
                position[id(tensor)] = index
                slot_of[_X._xla_get_tensor_id(value)] = (kind, tensor)
        reads = [t for t in outputs if id(t) in position]
        ordered = sorted(reads, key=lambda t: position[id(t)])
        if [id(t) for t in outputs[:len(ordered)]] == [id(t) for t in ordered] and outputs[-1] is result:
            return outputs, ids, values
        outputs = ordered + [t for t in outputs if id(t) not in position and t is not result] + [result]
    log.debug("the step's outputs did not settle in the order of their inputs: XLA may copy some donated buffers")
    ids, values = _X._get_tensors_xla_device_data_node(outputs, read_only)
    return outputs, ids, values


def _evicted(error: RuntimeError) -> bool:
    """Whether ``_run_cached_graph`` failed because the program left torch_xla's LRU compilation cache."""
    return "kicked out of the LRU cache" in str(error)


def _difference(first: Program, second: Program) -> str:
    """Why two traces of the same step differ ('' if they do not): the graph, or the value of a constant input."""
    if first.text != second.text:
        return "the second step traced a different graph than the first (a Python value changed its operations)"
    a, b = first.constants(), second.constants()
    if len(a) != len(b):
        return f"the second step's graph has {len(b)} constant inputs, the first's {len(a)}"
    if any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b)):
        return "the second step's graph has constant inputs of other shapes than the first's"
    host = _X._xla_get_cpu_tensors(a + b)  # one batched read, once per run
    changed = [i for i in range(len(a)) if not torch.equal(host[i], host[len(a) + i])]
    if changed:
        shapes = ", ".join(str(tuple(a[i].shape)) for i in changed[:5])
        return (f"{len(changed)} constant input(s) of the step changed value between steps (shapes {shapes}): a "
                "Python number that changes per step is baked into the program")
    return ""
