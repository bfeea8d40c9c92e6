"""Read back what wandb wrote offline: the records of a run's `.wandb` file, for tests.

The file is a LevelDB-style log (wandb's transaction log): a 7-byte header (":W&B", magic, version),
then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: full, first, middle,
last); a record is one protobuf `Record` of wandb's own schema, split over chunks. wandb no longer
ships a Python reader (its core is in Go), so the tests read the file with this one.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        chunk = body if kind in (FULL, FIRST) else chunk + body
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """Every logged row ({key: value}, wandb's own _step/_runtime/_timestamp included)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def run_info(path: Path) -> dict:
    """The run record: id, display name, project, group, and the config as {key: value}."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            return {"id": run.run_id, "name": run.display_name, "project": run.project, "group": run.run_group,
                    "config": {item.key: json.loads(item.value_json) for item in run.config.update}}
    raise AssertionError(f"{path} holds no run record")
