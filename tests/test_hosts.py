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

import pytest
import torch

from jobs import JobInputs, job_fixture
from spmd_rfdetr.data import TrainBatches

ROOT = Path(__file__).resolve().parents[1]

HOST = r"""
import json, os, signal, sys
import torch.distributed as dist
rank, count, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=count)
from spmd_rfdetr import hosts
from spmd_rfdetr.data import TrainBatches
from spmd_rfdetr.loop import Preemption
out = {"host": list(hosts.this_host()), "coordinator": hosts.is_coordinator(), "joined_again": None}
hosts.join_hosts()  # a group exists: nothing happens
out["any_on_host_1"] = hosts.any_host(rank == 1)
out["any_on_none"] = hosts.any_host(False)
with Preemption() as preemption:  # what fit does every step: a SIGTERM on one host stops all of them
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
from spmd_rfdetr.coco import CocoMetrics
from spmd_rfdetr.evaluate import EvalResult, save_result
metrics = CocoMetrics({"mAP": 0.5}, [], num_images=1, num_detections=1)
result = EvalResult(metrics, [{"image_id": 1}], [1], 1)  # every host holds the same
save_result(result, sys.argv[4], stem=f"host{rank}_")  # only host 0's files may appear
hosts.barrier()
print("RESULT", json.dumps(out))
"""


#: One host of two, on its own 2-device XLA CPU mesh: the loop model's replayed step on two batches, before and after
#: the default gloo group exists (``fit`` joins one on several hosts; rfdetr's criterion would then all-reduce the XLA
#: box count inside the traced step and divide by the host count, while under SPMD the count is already global).
HOST_STEP = r"""
import json, sys, torch
import torch.distributed as dist
import torch_xla.runtime as xr
xr.use_spmd()
from spmd_rfdetr.build import build_trainer
from spmd_rfdetr.fabric import spmd_fabric
from spmd_rfdetr.mesh import build_mesh
from spmd_rfdetr.model import build_model, upstream_configs
rank, count, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
saved = torch.load(sys.argv[4], weights_only=False)
cfg = saved["cfg"]
cfgs = upstream_configs(cfg.model, cfg.data, cfg.optim, num_classes=3)
fabric = spmd_fabric(build_mesh(), precision="32-true")
loader = fabric.strategy.process_dataloader(torch.utils.data.DataLoader(saved["batches"], batch_size=None))
def steps():
    net = build_model(cfgs)
    net.load_state_dict(saved["init_state"])
    trainer = build_trainer(fabric, cfgs, cfg.optim, cfg.trainer, model=net.train(), ema=cfg.model)
    stats = [trainer.step.read(trainer.step(loader.to_device(b))) for b in saved["batches"]]
    return {"losses": [s["loss"] for s in stats], "mode": trainer.step.mode}
out = {"alone": steps()}
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=count)
out["joined"] = steps()
out["world"] = dist.get_world_size()
print("RESULT", json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_hosts_agree_on_stop_and_sizes_and_split_the_global_batch(tmp_path):
    port, count = free_port(), 2
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    procs = [subprocess.Popen([sys.executable, "-c", HOST, str(rank), str(count), str(port), str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(count)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.split("RESULT", 1)[1]))
    assert [r["host"] for r in results] == [[0, 2], [1, 2]]
    assert [r["coordinator"] for r in results] == [True, False]
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

    from spmd_rfdetr.mesh import build_mesh

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
def two_hosts_step(inputs: JobInputs, out: Path) -> list[subprocess.CompletedProcess[str]]:
    """:data:`HOST_STEP` in two processes of one gloo group, on the loop model's first two batches."""
    tiny = inputs.loop_tiny
    torch.save({"cfg": tiny.cfg, "init_state": tiny.init_state, "batches": tiny.batches[:2]}, out / "loop.pt")
    port, count = free_port(), 2
    env = {**inputs.env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", HOST_STEP, str(rank), str(count), str(port), str(out / "loop.pt")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(count)]
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


@pytest.mark.slow
def test_the_replayed_step_runs_as_one_host_with_a_gloo_default_group(two_hosts_step):
    """Each of two hosts replays the loop model's compiled step after joining the gloo group exactly as before it:
    the same losses bit for bit (no collective of rfdetr's in the traced step, no loss scaled by the host count) and
    still one replayed program."""
    results = []
    for proc in two_hosts_step:
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(proc.stdout.split("RESULT", 1)[1]))
    for r in results:
        assert r["world"] == 2 and r["alone"]["mode"] == r["joined"]["mode"] == "replay", r
        assert r["joined"]["losses"] == r["alone"]["losses"] and len(set(r["alone"]["losses"])) == 2, r
    assert results[0]["alone"]["losses"] == results[1]["alone"]["losses"]  # the same batches on both hosts
