"""The training log: one JSON object per line in RUN/log.jsonl, appended (a resumed run
continues the same file). Written by the loop, read by `transduce plot`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from transduce.errors import TransduceError

LOG_NAME = "log.jsonl"


class TrainingLog:
    """Appends records to a run's log; a no-op on every process but the first."""

    def __init__(self, run: Path, enabled: bool = True):
        self.path, self.enabled = run / LOG_NAME, enabled

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"time": time.time(), **record}) + "\n")


def set_aside_earlier_log(run: Path) -> Path | None:
    """A new run's log starts empty: a log an earlier run left in its directory (one that
    saved no checkpoint, or the new run could not start there) is renamed
    log.jsonl.previous, replacing an older one. Returns its new path, if there was one."""
    path = run / LOG_NAME
    if not path.is_file():
        return None
    return path.replace(path.with_name(LOG_NAME + ".previous"))


def read_log(run: Path) -> list[dict]:
    """Every record of a run's log, oldest first."""
    path = run / LOG_NAME
    if not path.is_file():
        raise TransduceError(f"{path}: no training log (is {run} a run directory?)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TransduceError(f"{path}:{number}: not a JSON record ({error})") from None
        if not isinstance(record, dict):
            raise TransduceError(f"{path}:{number}: not a JSON record (an object), but "
                                 f"{type(record).__name__} {line.strip()[:40]}")
        records.append(record)
    return records
