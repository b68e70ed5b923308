"""A W&B run's ``.wandb`` file read back: wandb 0.31 has no Python reader of its own any more (its
``wandb.sdk.internal.datastore`` went with the Python backend; wandb-core, in Go, writes the file)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The file's header (wandb-core's store.go): ``:W&B``, magic 0xBEE1, version 0.
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
#: LevelDB's log format, as the file uses it: 32 KiB blocks of chunks, each with a 7-byte header (CRC-32C, length,
#: type); a record too long for the rest of a block continues in FIRST, MIDDLE ..., LAST chunks.
BLOCK, CHUNK_HEADER, FULL, LAST = 32768, 7, 1, 4


def records(path: Path) -> Iterator[Any]:
    """The run's records (``wandb_internal_pb2.Record``) in the order written."""
    from wandb.proto import wandb_internal_pb2  # lazy: the test that reads a W&B run imports wandb

    data = path.read_bytes()
    assert data[:len(HEADER)] == HEADER, f"{path}: not a .wandb file ({data[:7]!r})"
    pos, parts = len(HEADER), b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        parts += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def history(path: Path) -> list[dict[str, Any]]:
    """Every ``run.log(...)`` row of the run, its values as logged."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def run_and_config(path: Path) -> tuple[Any, dict[str, Any]]:
    """The run record (project, display name ...) and the run's config as the last update left it."""
    run, config = None, {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            config.update({item.key: json.loads(item.value_json) for item in r.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in r.config.update})
    return run, config
