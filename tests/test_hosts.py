"""Several hosts: host-level agreement over a real 2-process gloo group (functional collectives on CPU tensors), and
each host's rows of the global batch.

torch_xla 2.9 cannot run one SPMD mesh across processes on the CPU: its PJRT CPU client is created without a
distributed key-value store (``GetTfrtCpuClient(async, cpu_device_count)`` in ``pjrt_registry.cc``), so every CPU
process is its own single-process runtime. The global array built from two hosts' slices is therefore checked as far
as one process allows: the two hosts' rows, in host order, are exactly the one-host batch, and the loader's
``minibatch`` path gives the same global array as the global path here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support.models import TRACE_STEPS
from support.runs import read_metrics
from jobs import JobInputs, job_fixture
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.xla.replay import DONATE_ON_CPU_ENV
from spmd_rfdetr.data.batches import TrainBatches

ROOT = Path(__file__).resolve().parents[1]

HOST = r"""
import json, os, signal, sys
import torch.distributed as dist
rank, count, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=count)
from spmd_rfdetr.xla import hosts
from spmd_rfdetr.data.batches import TrainBatches
from spmd_rfdetr.training.stops import Preemption
out = {"host": list(hosts.this_host()), "coordinator": hosts.is_coordinator(), "joined_again": None}
hosts.join_hosts()  # a group exists: nothing happens
out["any_on_host_1"] = hosts.any_host(rank == 1)
out["any_on_none"] = hosts.any_host(False)
with Preemption() as preemption:  # what fit does every step: a SIGTERM on one host stops all of them
    preemption.first_step_done()  # (before it, SIGTERM would end the process at once)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    out["sigterm_here"] = preemption.requested
    out["stop"] = hosts.any_host(preemption.requested)
hosts.check_same_on_all_hosts("train images", 32)
try:
    hosts.check_same_on_all_hosts("train images", 32 + rank)
    out["mismatch"] = None
except ValueError as error:
    out["mismatch"] = str(error)
batches = iter(TrainBatches(32, 8, seed=3, start_step=2, host=(rank, count)))
out["rows"] = [next(batches) for _ in range(6)]
import torch
out["gathered"] = hosts.gather_rows(torch.tensor([10 * rank, 10 * rank + 1]), share=(rank, count)).tolist()
import pathlib
from spmd_rfdetr.xla.hosts import shared_by_all_hosts
cache = pathlib.Path(sys.argv[5])
(cache / "shared").mkdir(parents=True, exist_ok=True)
(cache / f"own{rank}").mkdir(parents=True)
out["cache_shared"] = [shared_by_all_hosts(cache / "shared"), shared_by_all_hosts(cache / f"own{rank}")]
from spmd_rfdetr.config.options import ConfigError
from spmd_rfdetr.training.setup import check_output_dir_shared
out["output_dir_errors"] = []
for output_dir in (cache / "out-shared", cache / f"out-own{rank}"):  # what fit checks before it resumes or builds
    try:
        check_output_dir_shared(output_dir)
        out["output_dir_errors"].append(None)
    except ConfigError as error:
        out["output_dir_errors"].append(str(error))
from spmd_rfdetr.eval.coco import CocoMetrics
from spmd_rfdetr.eval.evaluator import EvalResult, save_result
metrics = CocoMetrics({"mAP": 0.5}, [], num_images=1, num_detections=1)
result = EvalResult(metrics, [{"image_id": 1}], [1], 1)  # every host holds the same
save_result(result, sys.argv[4], stem=f"host{rank}_")  # only host 0's files may appear
hosts.leave_hosts()
print("RESULT", json.dumps(out))
"""


#: One host of two: ``python -m spmd_rfdetr fit`` (its ``main``) in a process that has joined a gloo default group, as
#: ``fit`` joins one on a pod slice. Its own XLA runtime drives the whole 4-device CPU mesh (torch_xla's CPU client
#: cannot span processes), so it must load every row of each global batch and train as one host does: the rows a host
#: loads follow the XLA runtime's processes, not the gloo group's (on a pod they are the same). No ``torch.distributed``
#: call of rfdetr's may reach the traced step (gloo has no XLA backend; rfdetr would also divide the box count by the
#: host count). Every record the loop writes is printed, host 1's too (it writes no file).
HOST_FIT = r"""
import json, sys
import torch.distributed as dist
rank, count, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=count)
from spmd_rfdetr.training import metrics
from spmd_rfdetr.cli import main
records, write = [], metrics.MetricsLog.write
metrics.MetricsLog.write = lambda self, record: (records.append(record), write(self, record))[1]
world = dist.get_world_size()
main(["fit", *sys.argv[4:]])  # leaves the group at the end
import torch_xla.debug.metrics as met  # InputOutputAliasCount: inputs each compiled program donates, one per compile
aliases = [int(count) for _, count in (met.metric_data("InputOutputAliasCount") or (0, 0, []))[2]]
print("RESULT", json.dumps({"records": records, "world": world, "left": not dist.is_initialized(), "aliases": aliases}))
"""
#: The two-host fit's steps: inside the loop fit's warm-up, where the LR does not depend on ``max_steps``.
HOST_FIT_STEPS = 4


def host_result(stdout: str) -> dict:
    """What a host child printed after ``RESULT``."""
    return json.loads(stdout.split("RESULT", 1)[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_hosts_agree_on_stop_and_sizes_and_split_the_global_batch(tmp_path):
    port, count = free_port(), 2
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    procs = [subprocess.Popen([sys.executable, "-c", HOST, str(rank), str(count), str(port), str(tmp_path),
                               str(tmp_path.parent / f"{tmp_path.name}-cache")], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(count)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(host_result(stdout))
    assert [r["host"] for r in results] == [[0, 2], [1, 2]]
    assert [r["coordinator"] for r in results] == [True, False]
    assert [r["gathered"] for r in results] == [[0, 1, 10, 11]] * 2  # eval's image ids of the global array
    # the compile cache: a directory both hosts mount vs each VM's own (the default ~/.cache): then every host writes
    assert [r["cache_shared"] for r in results] == [[True, False]] * 2
    assert not [p for p in (tmp_path.parent / f"{tmp_path.name}-cache").rglob(".spmd_rfdetr-host0-*")]  # cleaned up
    # trainer.output_dir: one every host writes, or a ConfigError on every host naming it (a checkpoint written to
    # each VM's own disk is incomplete on host 0's)
    for rank, r in enumerate(results):
        shared, own = r["output_dir_errors"]
        assert shared is None and own.startswith(f"trainer.output_dir: {tmp_path.parent / f'{tmp_path.name}-cache'}"
                                                  f"/out-own{rank} is not one directory of all 2 hosts"), own
    assert [r["any_on_host_1"] for r in results] == [True, True]
    assert [r["any_on_none"] for r in results] == [False, False]
    assert [r["sigterm_here"] for r in results] == [False, True]  # the real signal reached host 1 only ...
    assert [r["stop"] for r in results] == [True, True]  # ... and both stop at the same step
    for r in results:  # every host raises, naming the value and the range
        assert "train images differs between the hosts" in r["mismatch"] and "from 32 to 33" in r["mismatch"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host0_coco_eval.json", "host0_detections.json"]
    one_host = iter(TrainBatches(32, 8, seed=3, start_step=2))
    for step, (rows0, rows1) in enumerate(zip(results[0]["rows"], results[1]["rows"])):
        assert len(rows0) == len(rows1) == 4
        assert [tuple(k) for k in rows0 + rows1] == next(one_host), step  # host order = the global batch's rows


def test_the_minibatch_path_builds_the_global_batch_as_the_global_path():
    """One process: ``ShardingSpec(minibatch=True)`` (what each host's loader uses on several hosts) assembles the
    same global array, with the same sharding, as the single-host path."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    from spmd_rfdetr.xla.mesh import build_mesh

    mesh = build_mesh()
    batch = torch.arange(8 * 3 * 2, dtype=torch.float32).reshape(8, 3, 2)
    device = torch_xla.device()
    tensors = {}
    for minibatch in (False, True):
        spec = xs.ShardingSpec(mesh, ("data", None, None), minibatch=minibatch)
        tensors[minibatch] = xm.send_cpu_data_to_device(batch, device, spec)[0]
    spec = torch_xla._XLAC._get_xla_sharding_spec
    assert spec(tensors[True]) == spec(tensors[False]) and "devices=[4,1,1]" in spec(tensors[False])
    assert torch.equal(tensors[True].cpu(), batch) and torch.equal(tensors[False].cpu(), batch)


@job_fixture
def two_hosts_fit(inputs: JobInputs, out: Path) -> tuple[list[subprocess.CompletedProcess[str]], Path]:
    """:data:`HOST_FIT` in two processes of one gloo group: the loop fit's config for :data:`HOST_FIT_STEPS` steps,
    evaluated at the end, into one output directory (as on a pod: a directory every host mounts). Host 0 donates the
    replayed step's state, as every TPU does; host 1 does not (``SPMD_RFDETR_DONATE_ON_CPU=0``): the suite's
    undonated arm, at no extra cost."""
    port, count = free_port(), 2
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    donating = [{**env, DONATE_ON_CPU_ENV: "1"}, {**env, DONATE_ON_CPU_ENV: "0"}]
    shared = out / "run"
    procs = [subprocess.Popen([sys.executable, "-c", HOST_FIT, str(rank), str(count), str(port), "--config",
                               str(inputs.loop_config), "--trainer.output_dir", str(shared),
                               "--trainer.max_steps", str(HOST_FIT_STEPS), "--eval.every_steps", str(HOST_FIT_STEPS)],
                              cwd=ROOT, env=donating[rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for rank in range(count)]
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done, shared


@pytest.mark.slow
def test_two_hosts_fit_and_evaluate_as_one_host_with_a_gloo_default_group(two_hosts_fit, loop_run, synth_dir):
    """Each of two hosts in one gloo group trains the loop fit's first steps in one replayed program, host 1 (not
    donating, as the one-host fit) with the losses of the one-host fit (conftest's ``loop_run``, the same config, mesh
    and batches) bit for bit (host 0 donates: :func:`test_donated_replay_trains_as_the_undonated_one`); both evaluate
    every image of the split once, with the same result; host 0 writes the run's files, each host its shards of the
    final checkpoint, which host 0 publishes whole. Fails when a host loads only its gloo share of the rows (half the
    batch here), or when a collective of rfdetr's reaches the traced step."""
    procs, shared = two_hosts_fit
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(host_result(proc.stdout))
    reference = [r["loss"] for r in read_metrics(loop_run)[:HOST_FIT_STEPS]]
    evals = []
    for rank, r in enumerate(results):
        assert r["world"] == 2 and r["left"]
        records = r["records"]
        assert len(records) == HOST_FIT_STEPS and (rank == 0 or [x["loss"] for x in records] == reference), (
            records, reference)
        assert {x["step_mode"] for x in records} == {"replay"} and records[-1]["step_traces"] == 2
        evals.append({k: v for k, v in records[-1].items() if k.startswith("eval/")})
    assert evals[0] == evals[1] and evals[0]["eval/mAP"] >= 0, evals
    summary = json.loads(next((shared / "eval").glob("*coco_eval.json")).read_text())
    valid = json.loads((Path(synth_dir) / "valid" / "_annotations.coco.json").read_text())
    assert summary["num_images"] == len(valid["images"]), summary  # every image once, no padding row scored
    assert (shared / "last.pth").is_file() and [r["step"] for r in read_metrics(shared)] == [1, 2, 3, 4]  # once each
    final = shared / "checkpoints" / f"step_{HOST_FIT_STEPS:08d}"  # each host wrote its shards, host 0 published it
    files = sorted(p.name for p in final.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"], files  # __<host>_<writer>
    assert not list((shared / "checkpoints").glob(".*partial"))


@pytest.mark.slow
def test_donated_replay_trains_as_the_undonated_one(two_hosts_fit, loop_run, trace_fit_run, loop_tiny):
    """What every TPU runs, the replayed step donating its state (XLA input/output aliasing), trains as the undonated
    replay does: host 0 of the two-host fit donates (``SPMD_RFDETR_DONATE_ON_CPU=1``), host 1 does not. Step 1's loss
    (before any donated update) bit for bit, the :data:`HOST_FIT_STEPS` losses to 1e-3: XLA's CPU client does not give
    donated programs bit-equal results on every CPU (``replay._compile``: on a 2-core AMD EPYC the loop fit's donated
    runs parted at step 2-4, the loss at step 4 by up to 5e-7, at step 5 by 9e-3; on Intel, bit for bit). The
    session's loop fit (replay, undonated, in this process) and its trace-mode fit give the same loss at each of the
    first :data:`TRACE_STEPS` steps, and host 1 the loop fit's, bit for bit.

    And the arms are what they say: torch_xla's ``InputOutputAliasCount`` shows host 0 compiling a program that
    donates at least the weights and both AdamW moments (measured: 576 inputs for 113 trainable parameters), and
    host 1 none that does."""
    donated, undonated = (host_result(proc.stdout) for proc in two_hosts_fit[0])
    replay, trace = ([r["loss"] for r in read_metrics(run)[:TRACE_STEPS]] for run in (loop_run, trace_fit_run))
    assert len(replay) == len(trace) == TRACE_STEPS and replay == trace, (replay, trace)
    donated_losses, undonated_losses = ([r["loss"] for r in host["records"]] for host in (donated, undonated))
    assert undonated_losses == replay[:HOST_FIT_STEPS], (undonated_losses, replay)
    assert donated_losses[0] == replay[0] and donated_losses == pytest.approx(replay[:HOST_FIT_STEPS], rel=1e-3), (
        donated_losses, replay)
    state = 3 * sum(p.requires_grad for p in loop_tiny.model().parameters())  # weights, exp_avg, exp_avg_sq
    assert max(donated["aliases"]) >= state and max(undonated["aliases"], default=0) < state, (
        donated["aliases"], undonated["aliases"], state)


def assembled_rows(tile_devices: list[int], host_devices: list[list[int]], host_rows: list[list[int]]) -> list[int]:
    """The global array torch_xla builds from each host's rows with ``ShardingSpec(minibatch=True)``, as its
    ``ShardTensor`` does: host ``h``'s rows cut into one block per local device, block ``k`` to ``host_devices[h][k]``,
    and batch position ``p`` holding device ``tile_devices[p]``'s block."""
    per_device = len(host_rows[0]) // len(host_devices[0])
    block = {device: host_rows[h][k * per_device:(k + 1) * per_device]
             for h, devices in enumerate(host_devices) for k, device in enumerate(devices)}
    return [row for device in tile_devices for row in block[device]]


def test_eval_ids_follow_the_global_arrays_rows_on_interleaved_hosts():
    """A v5e/v6e slice of 16+ chips numbers devices by chip coordinates: with 2 hosts of 4 chips on a 2x4 slice host 0
    drives devices {0, 1, 4, 5} and host 1 {2, 3, 6, 7}. The global array's rows are then not host 0's rows followed by
    host 1's: every image id must still be paired with its own detections."""
    from spmd_rfdetr.xla.hosts import global_row_order

    tile = list(range(8))  # the mesh's devices in batch order (build_mesh: np.arange)
    host_devices = [[0, 1, 4, 5], [2, 3, 6, 7]]
    ids = list(range(100, 116))  # a global eval batch of 16 images, 2 per device
    host_rows = [hosts.host_rows(ids, h, 2) for h in range(2)]  # what each host loads (EvalBatches)
    detections = [image_id * 10 for image_id in assembled_rows(tile, host_devices, host_rows)]  # the program's rows
    gathered = np.asarray(host_rows[0] + host_rows[1])  # image ids gathered over gloo in host order
    order = global_row_order(tile, host_devices, rows_per_device=2)
    assert order is not None and [i * 10 for i in gathered[order]] == detections
    assert [i * 10 for i in gathered] != detections  # host order (what eval assumed) pairs ids with others' rows
    assert global_row_order(tile, [[0, 1, 2, 3], [4, 5, 6, 7]], rows_per_device=2) is None  # contiguous: host order


def test_the_minibatch_assembly_follows_the_tile_assignment():
    """The rule :func:`~spmd_rfdetr.xla.hosts.global_row_order` encodes, checked on torch_xla itself: one process,
    ``minibatch=True`` and a mesh whose devices are not in ordinal order (as a host's positions on an interleaved
    slice): the global array's rows are the process's blocks placed by device, not its rows in order."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    from spmd_rfdetr.xla.hosts import global_row_order

    tile = [2, 0, 3, 1]
    mesh = xs.Mesh(np.asarray(tile), (4, 1), ("data", "fsdp"))
    rows = torch.arange(8)
    placed = xm.send_cpu_data_to_device(rows, torch_xla.device(), xs.ShardingSpec(mesh, (("data", "fsdp"),),
                                                                                 minibatch=True))[0]
    local = [int(name.split(":")[-1]) for name in torch_xla._XLAC._xla_get_runtime_devices()]
    order = global_row_order(tile, [local], rows_per_device=2)
    assert placed.cpu().tolist() == rows[order].tolist() != rows.tolist()
