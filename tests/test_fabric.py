"""Fabric on the 4-device CPU SPMD mesh (real torch_xla runtime, set up in conftest.py): no mocks."""

import copy
import os
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.runtime as xr
from lightning_fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, Dataset

from spmd_rfdetr.xla.fabric import SPMDAccelerator, SPMDDataLoader, SPMDPrecision, SPMDStrategy, spmd_fabric
from spmd_rfdetr.xla.mesh import build_mesh, data_axis_size

N = 4  # devices in the mesh (conftest: CPU_NUM_DEVICES=4)


def spec(t: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_sharding_spec(t)


def hlo(*tensors: torch.Tensor) -> str:
    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


class Detections(Dataset):
    """RF-DETR-like samples: image, padded targets with a `valid` mask, ids, sizes and a file name."""

    def __init__(self, n: int = 16, targets: int = 5, size: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, size, size, generator=g)
        self.boxes = torch.rand(n, targets, 4, generator=g)
        self.labels = torch.randint(0, 3, (n, targets), generator=g)
        self.valid = torch.rand(n, targets, generator=g) > 0.5

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return {"images": self.images[i], "boxes": self.boxes[i], "labels": self.labels[i],
                "valid": self.valid[i], "image_id": torch.tensor(i), "orig_size": torch.tensor([480, 640]),
                "file_name": f"{i:04d}.jpg"}


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before BatchNorm has ~0 grads: AdamW amplifies noise
    return nn.Sequential(conv, nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3))


# --- mesh -------------------------------------------------------------------------------------------------------------
def test_build_mesh_uses_every_device():
    assert xr.global_runtime_device_count() == N
    for mesh in (build_mesh(), build_mesh(data=N)):
        assert mesh.axis_names == ("data", "fsdp") and mesh.size() == N and data_axis_size(mesh) == N


@pytest.mark.parametrize(("data", "words"), [(3, ["mesh.data=3", "does not divide", "4"]),
                                             (2, ["mesh.data=2", "2 of the 4", "mesh.data=-1"]),
                                             (0, ["mesh.data=0", "-1"])])
def test_build_mesh_errors_are_clear(data, words):
    with pytest.raises(ValueError) as err:
        build_mesh(data=data)
    assert all(w in str(err.value) for w in words), str(err.value)


# --- Fabric wiring ----------------------------------------------------------------------------------------------------
def test_one_process_drives_the_mesh():
    fabric = spmd_fabric()
    assert isinstance(fabric.accelerator, SPMDAccelerator) and isinstance(fabric.strategy, SPMDStrategy)
    assert fabric.world_size == 1 and fabric.global_rank == 0 and fabric.is_global_zero
    assert fabric.accelerator.mesh is fabric.strategy.mesh and data_axis_size(fabric.accelerator.mesh) == N
    assert fabric.device.type == "xla" and fabric.strategy.launcher is None
    x = torch.arange(8.0, device=fabric.device)
    assert fabric.all_reduce(x) is x and fabric.all_gather(x) is x and fabric.broadcast(x) is x
    fabric.barrier()


def test_connector_accepts_the_plugins():
    mesh = build_mesh()
    precision = SPMDPrecision("bf16-mixed")
    fabric = Fabric(accelerator=SPMDAccelerator(), strategy=SPMDStrategy(mesh), plugins=precision)
    assert fabric.strategy.precision is precision
    fabric = Fabric(accelerator=SPMDAccelerator(), strategy=SPMDStrategy(mesh), precision="32-true")
    assert isinstance(fabric.strategy.precision, SPMDPrecision)  # Fabric's XLAPrecision string is converted
    with pytest.raises(TypeError, match="SPMDAccelerator"):
        Fabric(accelerator="cpu", strategy=SPMDStrategy(mesh))
    with pytest.raises(ValueError, match="one process drives the whole mesh"):
        Fabric(accelerator=SPMDAccelerator(), strategy=SPMDStrategy(mesh), devices=4)
    with pytest.raises(ValueError, match="SPMDPrecision supports"):
        SPMDPrecision("16-mixed")


def test_setup_replicates_params_and_the_optimizer_follows():
    fabric = spmd_fabric()
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    params = list(model.parameters())
    assert all(p.device.type == "xla" and spec(p) in ("", "{replicated}") for p in params)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in params]
    before = [p.detach().cpu().clone() for p in params]
    fabric.backward(model(torch.randn(8, 4, device=fabric.device)).square().mean())
    optimizer.step()
    assert all(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, params))


# --- data -------------------------------------------------------------------------------------------------------------
def test_loader_shards_every_tensor_on_dim0():
    fabric = spmd_fabric()
    loader = fabric.setup_dataloaders(DataLoader(Detections(), batch_size=8))
    assert len(loader) == 2
    batch = next(iter(loader))
    expected = {"images": "{devices=[4,1,1,1]0,1,2,3}", "boxes": "{devices=[4,1,1]0,1,2,3}",
                "labels": "{devices=[4,1]0,1,2,3}", "valid": "{devices=[4,1]0,1,2,3}",
                "image_id": "{devices=[4]0,1,2,3}", "orig_size": "{devices=[4,1]0,1,2,3}"}
    assert {k: spec(batch[k]) for k in expected} == expected
    assert batch["valid"].dtype == torch.bool and batch["labels"].dtype == torch.int64
    assert batch["file_name"] == [f"{i:04d}.jpg" for i in range(8)]  # non-tensors pass through
    assert torch.equal(batch["valid"].cpu(), Detections().valid[:8])
    assert torch.equal(batch["images"].cpu(), Detections().images[:8])


def test_loader_shards_nested_batches_and_replicates_scalars():
    batches = [(torch.zeros(4, 2), [torch.ones(4)], torch.tensor(3.0), "x")]
    loader = SPMDDataLoader(batches, build_mesh(), torch_xla.device())
    (a, (b,), scalar, name), = list(loader)
    assert spec(a) == "{devices=[4,1]0,1,2,3}" and spec(b) == "{devices=[4]0,1,2,3}" and name == "x"
    assert spec(scalar) in ("", "{replicated}") and scalar.item() == 3.0


def test_indivisible_batch_is_a_clear_error():
    fabric = spmd_fabric()
    loader = fabric.setup_dataloaders(DataLoader(Detections(n=6), batch_size=6))
    with pytest.raises(ValueError, match=r"Batch size 6 .* size 4"):
        next(iter(loader))


# --- prefetch ---------------------------------------------------------------------------------------------------------
def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "SPMDDataLoader-prefetch"}


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class Slow(Dataset):
    """Each item is a whole batch that takes `load_s` to load; records when each load ran and how many started."""

    def __init__(self, n: int, load_s: float = 0.0, fail_at: int = -1) -> None:
        self.n, self.load_s, self.fail_at = n, load_s, fail_at
        self.loads: dict[int, tuple[float, float]] = {}
        self.started = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.started += 1
        if i == self.fail_at:
            raise RuntimeError(f"corrupt image {i}")
        start = time.monotonic()
        time.sleep(self.load_s)
        self.loads[i] = (start, time.monotonic())
        return torch.full((4, 3, 8, 8), float(i))


def test_prefetched_batches_equal_synchronous_ones():
    before = prefetch_threads()
    data = DataLoader(Detections(n=24), batch_size=8)
    sync, ahead = (SPMDDataLoader(data, build_mesh(), torch_xla.device(), prefetch=p) for p in (0, 2))
    for _ in range(2):  # two epochs: each ends at the loader's end
        got, want = list(ahead), list(sync)
        assert len(got) == len(want) == 3
        for a, b in zip(got, want):
            assert a["file_name"] == b["file_name"]
            for key in ("images", "boxes", "labels", "valid", "image_id", "orig_size"):
                assert spec(a[key]) == spec(b[key]) and torch.equal(a[key].cpu(), b[key].cpu()), key
    assert spec(got[0]["images"]) == "{devices=[4,1,1,1]0,1,2,3}" and spec(got[0]["labels"]) == "{devices=[4,1]0,1,2,3}"
    assert ahead.batches == sync.batches == 6 and ahead.wait_s > 0 and sync.wait_s > 0
    assert prefetch_threads() == before  # each epoch's thread ended with it

    fabric = spmd_fabric()
    assert fabric.strategy.prefetch == 2
    fabric.strategy.prefetch = 3
    loader = fabric.setup_dataloaders(data)
    assert loader._dataloader.prefetch == 3 and len(list(loader)) == 3
    # Fabric's wrapper copied the loader's __dict__ once: the counters are read on the SPMDDataLoader it wraps
    assert loader._dataloader.batches == 3 and not hasattr(loader, "wait_s")
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        SPMDDataLoader(data, build_mesh(), torch_xla.device(), prefetch=-1)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loading_error_reaches_the_consumer(prefetch):
    before = prefetch_threads()
    loader = SPMDDataLoader(DataLoader(Slow(8, fail_at=5), batch_size=None), build_mesh(), torch_xla.device(),
                            prefetch=prefetch)
    got = []
    with pytest.raises(RuntimeError, match="corrupt image 5") as err:
        for batch in loader:
            got.append(batch)
    assert len(got) == loader.batches == 5
    assert "__getitem__" in [frame.name for frame in traceback.extract_tb(err.value.__traceback__)]  # its traceback
    assert prefetch_threads() == before


def test_prefetch_loads_the_next_batches_while_the_consumer_holds_one():
    """Counted by events, not timed: while the consumer holds batch k (computing), a prefetching loader has loaded
    batches k+1 and k+2 (the queue of 2) and no further; a synchronous one has loaded nothing after batch k."""
    n, prefetch = 6, 2

    def loaded_while_holding(ahead: int) -> list[int]:
        data = Gated(n)
        loader = SPMDDataLoader(DataLoader(data, batch_size=None), build_mesh(), torch_xla.device(), prefetch=ahead)
        seen = []
        for k, batch in enumerate(loader):
            assert int(batch[0, 0, 0, 0].cpu()) == k
            if ahead:  # the loading thread fills the queue behind the consumer's back (it never blocks on the GPU)
                want = min(n, k + 1 + ahead + 1)  # batch k, the queued ones, and one in the thread's hand
                assert data.wait_for(want), (k, data.finished)
                time.sleep(0.05)  # would a further load start? (it must not: the queue is full)
            seen.append(data.finished)
        assert loader.batches == n
        return seen

    assert loaded_while_holding(0) == [k + 1 for k in range(n)]
    assert loaded_while_holding(prefetch) == [min(n, k + 1 + prefetch + 1) for k in range(n)]


class Gated(Dataset):
    """Batches that count how many finished loading (a condition the test can wait on)."""

    def __init__(self, n: int) -> None:
        self.n, self.finished, self._changed = n, 0, threading.Condition()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with self._changed:
            self.finished += 1
            self._changed.notify_all()
        return torch.full((4, 3, 8, 8), float(i))

    def wait_for(self, count: int, timeout: float = 30) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.finished >= count, timeout)


def test_stopping_early_stops_the_thread():
    def forever(loader):  # an endless batch source, as fit's train loader is
        while True:
            yield from loader

    def stopped(thread: threading.Thread) -> bool:
        deadline = time.monotonic() + 5
        while thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not thread.is_alive()

    data = Slow(1000)
    loader = SPMDDataLoader(DataLoader(data, batch_size=None), build_mesh(), torch_xla.device(), prefetch=2)
    before = prefetch_threads()
    batches = iter(loader)
    next(batches), next(batches)
    (thread,) = prefetch_threads() - before
    time.sleep(0.3)
    assert thread.daemon and thread.is_alive() and data.started <= 2 + 2 + 1  # 2 taken, 2 queued, 1 in hand
    batches.close()
    assert stopped(thread)

    for i, _ in enumerate(loader):
        if i == 1:
            (thread,) = prefetch_threads() - before
            break
    assert stopped(thread)  # `break` dropped the iteration

    batches = forever(loader)
    next(batches)
    (thread,) = prefetch_threads() - before
    del batches  # abandoned (as when `fit` returns): the generators are closed
    assert stopped(thread) and loader.batches == 5


# --- training ---------------------------------------------------------------------------------------------------------
def test_training_on_the_mesh_matches_eager_cpu():
    data = Detections(n=24)
    reference = tiny_net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    fabric = spmd_fabric()
    net = copy.deepcopy(reference)
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=8))
    for i, batch in enumerate(loader):
        target = data.labels[8 * i: 8 * i + 8, 0]
        ref_loss = F.cross_entropy(reference(data.images[8 * i: 8 * i + 8]), target)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        loss = F.cross_entropy(model(batch["images"]), batch["labels"][:, 0])
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    for (name, ref), got in zip(reference.state_dict().items(), model.state_dict().values()):
        # torch_xla (with or without SPMD) updates BatchNorm's running_var with the biased batch variance, eager torch
        # with the unbiased one (x n/(n-1), n = 8*8*8 here): a 2e-4 relative gap that is not the mesh's doing.
        tol = 1e-3 if name.endswith("running_var") else 1e-5
        torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=tol, msg=name)


def test_fabric_optimizer_step_inside_torch_xla_compile_full_graph():
    import torch_xla.debug.metrics as met

    fabric = spmd_fabric()
    net = nn.Linear(4, 2)
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    loader = fabric.setup_dataloaders(DataLoader(torch.randn(24, 4), batch_size=8))

    @torch_xla.compile(full_graph=True)  # raises if anything (e.g. a sync in optimizer.step) cuts the graph
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        return loss

    before = model.weight.detach().cpu().clone()
    met.clear_all()
    losses = [step(x) for x in loader]
    assert met.metric_data("ExecuteReplicatedTime")[0] == len(losses) == 3  # one program per step
    assert not torch.equal(before, model.weight.detach().cpu())


def test_bf16_mixed_computes_in_bf16_with_fp32_params():
    fabric = spmd_fabric(precision="bf16-mixed")
    model = fabric.setup(nn.Linear(16, 8))
    x = torch.randn(8, 16, device=fabric.device)
    with fabric.autocast():
        raw = model.module(x)
    assert "bf16" in hlo(raw) and raw.dtype == torch.bfloat16
    out = model(x)  # the Fabric wrapper autocasts, then hands fp32 to the loss
    assert "bf16" in hlo(out) and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "bf16" not in hlo(spmd_fabric().setup(nn.Linear(16, 8))(x))  # 32-true stays fp32


def test_bf16_true_is_refused_once_a_tensor_exists():
    torch.zeros(1, device=torch_xla.device())
    had = os.environ.get("XLA_USE_BF16")
    with pytest.raises(RuntimeError, match="before the first XLA tensor"):
        SPMDPrecision("bf16-true")
    assert os.environ.get("XLA_USE_BF16") == had


@pytest.mark.slow
def test_bf16_true_works_in_a_fresh_process():
    script = textwrap.dedent("""
        import torch, torch_xla
        from torch import nn
        from spmd_rfdetr.xla.fabric import spmd_fabric
        fabric = spmd_fabric(precision="bf16-true")
        model = fabric.setup(nn.Linear(16, 8))
        out = model(torch.randn(8, 16).to(fabric.device))
        assert "bf16" in torch_xla._XLAC._get_xla_tensors_hlo([out]), "no bf16 in the HLO"
        print("OK")
    """)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(N)}
    env.pop("XLA_USE_BF16", None)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


# --- checkpoints ------------------------------------------------------------------------------------------------------
def test_save_and_load_round_trip(tmp_path):
    fabric = spmd_fabric()
    net = tiny_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    batch = next(iter(fabric.setup_dataloaders(DataLoader(Detections(n=8), batch_size=8))))
    fabric.backward(F.cross_entropy(model(batch["images"]), batch["labels"][:, 0]))
    optimizer.step()
    path = tmp_path / "ckpt.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})

    raw = torch.load(path, weights_only=True)  # a plain torch checkpoint with CPU tensors
    assert raw["step"] == 1 and all(t.device.type == "cpu" for t in raw["model"].values())
    torch.testing.assert_close(raw["model"]["4.weight"], model.state_dict()["4.weight"].cpu())

    net2 = tiny_net()
    model2, optimizer2 = fabric.setup(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2))
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 1
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a.cpu(), msg=name)
    assert optimizer2.state_dict()["state"][0]["step"].item() == 1
