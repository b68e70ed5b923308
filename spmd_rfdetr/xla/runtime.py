"""Process set-up shared by every verb (``fit``, ``validate``, ``predict``): the PJRT device, SPMD, the persistent
compilation cache, precision names.

The persistent compilation cache (``trainer.compile_cache_dir``, default ``~/.cache/spmd_rfdetr/xla``) is on for TPUs:
a restarted or resumed run loads its graphs instead of compiling them (``xla_cache_loads``/``xla_cache_misses`` in
``metrics.jsonl``; ``pytest -m tpu`` checks a second run misses nothing). It is off on the XLA CPU backend, where
torch_xla 2.9 cannot read its own entries back (``PersistentCacheDeserializeFailure``). With several hosts and a
directory they all mount, host 0 writes new entries and the others open it read-only; a directory that is each VM's
own (the default, on its local disk) is written by every host, with a warning
(:func:`~spmd_rfdetr.xla.hosts.shared_by_all_hosts`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from spmd_rfdetr.config.options import MeshOptions
from spmd_rfdetr.quiet import xla_note
from spmd_rfdetr.xla.hosts import is_coordinator, join_hosts, process_count, shared_by_all_hosts

log = logging.getLogger(__name__)

#: ``trainer.precision`` -> the Fabric precision plugin's name.
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}


def choose_device(mesh: MeshOptions) -> None:
    """``mesh.cpu_devices`` virtual CPU devices unless ``PJRT_DEVICE`` is set; call before anything imports torch_xla
    (rfdetr's modules do), or torch_xla starts on its default: one CPU device."""
    if mesh.cpu_devices is not None and "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "CPU"
        os.environ["CPU_NUM_DEVICES"] = str(mesh.cpu_devices)


def setup_runtime(mesh: MeshOptions, compile_cache_dir: str | None = None) -> str | None:
    """Choose the PJRT device (before the XLA runtime starts), switch the process to SPMD and turn on the persistent
    compilation cache where it works; returns the cache directory (``None``: off)."""
    choose_device(mesh)
    xla_note()  # once: the XLA warnings quiet.configure hid (GSPMD's deprecation notice, at every compile)
    # lazy: torch_xla starts on import: only after choose_device above (the CLI imports this module first)
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()
    join_hosts()  # several hosts (a pod slice): their gloo group for host-level agreement
    return _compile_cache(compile_cache_dir, writer=is_coordinator())


def _compile_cache(cache_dir: str | None, writer: bool) -> str | None:
    """Open the persistent cache (before the first compile); ``writer``: this host writes new entries (host 0 only: on
    a shared directory every host would otherwise write the same entries at once; the others read them)."""
    # lazy: torch_xla starts on import: called from setup_runtime, after choose_device
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():  # a second verb in this process: it is set already
        return os.environ.get("XLA_PERSISTENT_CACHE_PATH") or None
    if xr.device_type() == "CPU":
        log.info("persistent XLA compilation cache: off on the XLA CPU backend (torch_xla 2.9 cannot read its own CPU "
                 "entries back: PersistentCacheDeserializeFailure); every run compiles its graphs")
        return None
    path = cache_dir or str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spmd_rfdetr" / "xla")
    Path(path).mkdir(parents=True, exist_ok=True)
    shared = shared_by_all_hosts(Path(path))
    if not shared:  # each VM's own disk: read-only, it would never get an entry and every restart would compile
        writer = True
        if is_coordinator():
            log.warning("persistent XLA compilation cache: %s is not one directory of all %d hosts (each VM has its "
                        "own): every host compiles and keeps its own entries. Set trainer.compile_cache_dir to a "
                        "directory every host mounts (NFS, gcsfuse) and host 0 compiles once for all.", path,
                        process_count())
    xr.initialize_cache(path, readonly=not writer)
    log.info("persistent XLA compilation cache: %s (a run with the same graphs loads them instead of compiling%s)", path,
             "" if writer else "; read-only on this host, host 0 writes")
    return path
