"""Reading and driving runs: metrics records, the noise a quiet run must not print, SIGTERM, CLI subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[2]  # the repository


def cli(*args: str, env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    """``python -m spmd_rfdetr *args`` from the repository with ``env``, its output captured."""
    return subprocess.run([sys.executable, "-m", "spmd_rfdetr", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


def read_metrics(out: Path) -> list[dict]:
    """A run's metrics.jsonl records (a line still being written is left out)."""
    path = out / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


#: What a default (not ``--verbose``) run of ours must not print (``spmd_rfdetr.quiet``): XLA's GSPMD deprecation
#: notice (at every compile; here at most once), any Python warning (``file:line: SomeWarning: ...``: torch's TF32
#: notice, rfdetr's augmentation notice), rfdetr's DINOv2 notes and pycocotools' progress prints.
NOISE = {
    "GSPMD notice": r"GSPMD sharding propagation is going to be deprecated",
    "Python warning": r"^\S+:\d+: \w*Warning: ",
    "DINOv2 note": r"which means we're not loading DINOv2 backbone weights",
    "pycocotools print": r"^(loading annotations into memory\.\.\.|index created!)$",
}


#: The one line a quiet run prints instead of XLA's warnings (``quiet.xla_note``).
XLA_NOTE = "XLA's C++ warnings are hidden"


def noise(log: str) -> dict[str, list[str]]:
    """The lines of ``log`` that :data:`NOISE` names, by kind (kinds with none left out)."""
    import re

    found = {kind: [line for line in log.splitlines() if re.search(pattern, line)] for kind, pattern in NOISE.items()}
    return {kind: lines for kind, lines in found.items() if lines}


def assert_quiet(log: str) -> None:
    """A default run's output: no :data:`NOISE` beyond one GSPMD notice, and :data:`XLA_NOTE` once (unless the session
    set a ``TF_CPP_MIN_LOG_LEVEL`` of its own: this process's torch_xla import set 1, which runs override)."""
    found = noise(log)
    gspmd = found.pop("GSPMD notice", [])
    assert len(gspmd) <= 1 and not found, {"GSPMD notice": gspmd, **found}
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
        assert log.count(XLA_NOTE) == 1, log[-3000:]


def sigterm_after(out: Path, step: int) -> contextlib.AbstractContextManager[None]:
    """A real SIGTERM to this process once ``out``'s metrics have logged ``step``: an in-process ``fit`` finishes the
    step in flight, saves the training state and returns, as on a preempted VM. ``step`` must come well before the
    run's last step (after ``fit`` returns, SIGTERM would end pytest)."""
    return sigterm_when(lambda: any(r["step"] >= step for r in read_metrics(out)))


@contextlib.contextmanager
def sigterm_when(condition: Callable[[], bool]) -> Iterator[None]:
    """A real SIGTERM to this process, sent once by a watcher thread as soon as ``condition()`` holds."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            if condition():
                os.kill(os.getpid(), signal.SIGTERM)
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def start_fit(config: Path, *extra: str, env: dict[str, str]) -> subprocess.Popen:
    """``python -m spmd_rfdetr fit --config CONFIG`` on 4 virtual devices, as a user starts it, in ``env`` (a job's
    :attr:`JobInputs.env`: the environment as the session started, whatever an in-process test sets meanwhile)."""
    env = {**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    return subprocess.Popen([sys.executable, "-m", "spmd_rfdetr", "fit", "--config", str(config), *extra], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"fit exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class PreemptedRun:
    """The loop fit's config trained by the CLI in three processes (:func:`preempted_run`)."""

    out: Path
    stopped: int
    """The step the SIGTERM stopped the first process after."""
    first: tuple[int, str, str]
    """The first process's exit code, stdout and stderr."""
    sigterm_checkpoint: bool
    """Whether the first process left a checkpoint of its last step (and no last.pth)."""
    partial: Path
    """The half-written save the second process was killed inside."""
    killed_records: dict[int, float]
    """Step -> loss as logged by the first two processes."""
    last: tuple[int, str, str]
    """The last process's exit code, stdout and stderr."""


def upstream_coco_eval(weights: Path, iou_types: list[str]) -> Any:
    """Upstream rfdetr on the CPU, eager, scoring a ``fit`` weight file: its model with the file's weights, its
    ``PostProcess`` and its ``CocoEvaluator`` (``iou_types``, rfdetr's default maxDets) on the valid split as rfdetr
    builds it; returns the accumulated evaluator (``coco_eval[iou_type].stats``, ``coco_results``)."""
    import torch
    from rfdetr.config import TrainConfig
    from rfdetr.datasets import get_coco_api_from_dataset
    from rfdetr.evaluation.coco_eval import CocoEvaluator

    from spmd_rfdetr.data.splits import upstream_split
    from spmd_rfdetr.model.inputs import as_samples
    from spmd_rfdetr.model.upstream import build_upstream_criterion
    from support.models import eager_model

    net, cfgs = eager_model(weights)
    postprocess = build_upstream_criterion(cfgs)[1]
    dataset = upstream_split(cfgs, "valid")
    evaluator = CocoEvaluator(get_coco_api_from_dataset(dataset), iou_types,
                              max_dets=TrainConfig.model_fields["eval_max_dets"].default, log_summary=False)
    with torch.no_grad():
        for start in range(0, len(dataset), 8):
            items = [dataset[i] for i in range(start, min(start + 8, len(dataset)))]
            outputs = net(as_samples(torch.stack([image for image, _ in items])))
            sizes = torch.stack([target["orig_size"] for _, target in items])
            evaluator.update({int(t["image_id"]): r for (_, t), r in zip(items, postprocess(outputs, sizes))})
    evaluator.synchronize_between_processes()
    evaluator.accumulate()
    return evaluator
