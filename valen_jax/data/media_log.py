"""The media log: one JSON line per processed media item (seed 000, "Images and video": "Media logs
record the path, digest, vision grid and number of vision tokens, plus the frame indices,
timestamps and other information returned by the processor").

Line: `example` (source:line), `entry`, `media` (index in the record), `kind`, `path`, `sha256`,
`resize`, `grid` [t, h, w] in patches, `vision_tokens` (after the merger), `frame_indices`,
`timestamps` (seconds), `augment` (training augmentation applied, or null).

Where the lines go. The loader runs in Grain worker processes (`mp_prefetch`), on every host.
Carrying lines inside the batch would put strings into arrays that are sharded onto devices, so
each process instead appends to its own file, `WORKDIR/media_log.{process_index}.{pid}.jsonl`:
no locks, no interleaved lines, nothing to send between processes. A `MediaLog` pickles to a
worker without its file, and opens that worker's own file on first use (the pid is read at write
time, so a fork gets a new file). Each example's lines go out in one unbuffered `write` to an
O_APPEND descriptor, so a killed run loses at most the example being written.
`merge_media_logs` gathers the per-process files into `WORKDIR/media_log.jsonl`.

The log records what the loader produced, which with prefetching runs ahead of the train step:
items logged but not yet trained on when a run stops appear again after a resume.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from data_pipeline import examples as contract  # the Example fields (one declaration)
from valen_jax.data.media import MediaInfo
from valen_jax.data.vision_processor import ProcessedMedia

if TYPE_CHECKING:
    from data_pipeline.shards import Example
    from valen_jax.data.assemble import ExpandedExample, RowSpec

MERGED_NAME = "media_log.jsonl"
PART_GLOB = "media_log.*.*.jsonl"


def media_records(where: str, headers: Sequence[Mapping], media: Sequence[ProcessedMedia],
                  infos: Sequence[MediaInfo], merge_size: int, entry: str | None = None) -> list[dict]:
    """The log lines of one example's media items, in record order."""
    if not len(headers) == len(media) == len(infos):
        raise ValueError(f"{where}: {len(headers)} media headers, {len(media)} processed, {len(infos)} infos")
    return [{
        "example": where, "entry": entry, "media": index, "kind": header.get("kind"), "path": header.get("path"),
        "sha256": header.get("sha256"), "resize": header.get("resize"), "grid": list(item.grid),
        "vision_tokens": item.num_tokens // merge_size ** 2, "frame_indices": list(info.frame_indices),
        "timestamps": [round(t, 6) for t in info.timestamps], "augment": info.augment,
    } for index, (header, item, info) in enumerate(zip(headers, media, infos, strict=True))]


class MediaLog:
    """Appends media log lines to this process's own file under `workdir` (see the module doc)."""

    def __init__(self, workdir: str | os.PathLike, process_index: int = 0):
        self.workdir = Path(workdir)
        self.process_index = int(process_index)
        self._fd: int | None = None
        self._pid: int | None = None

    def __getstate__(self) -> dict:
        # A descriptor must not travel to a worker: each process opens its own file.
        return {"workdir": self.workdir, "process_index": self.process_index, "_fd": None, "_pid": None}

    @property
    def path(self) -> Path:
        return self.workdir / f"media_log.{self.process_index}.{os.getpid()}.jsonl"

    def write(self, records: Iterable[Mapping]) -> None:
        data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
        if not data:
            return
        if self._fd is None or self._pid != os.getpid():
            self.workdir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        os.write(self._fd, data)

    def log_expanded(self, example: Example, expanded: ExpandedExample, spec: RowSpec) -> None:
        """What the loader calls after `expand_media_slots`: one line per media item of the example."""
        headers = contract.media_headers(example)
        if not headers:
            return
        where = contract.where(example)
        self.write(media_records(where, headers, expanded.media, expanded.media_info, spec.vision.merge_size,
                                 contract.meta_of(example).entry))

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = self._pid = None


def part_files(workdir: str | os.PathLike) -> list[Path]:
    return sorted(Path(workdir).glob(PART_GLOB))


def read_media_log(workdir: str | os.PathLike) -> list[dict]:
    """Every line of every process's file (process by process, each in write order)."""
    return [json.loads(line) for part in part_files(workdir)
            for line in part.read_text(encoding="utf-8").splitlines() if line]


def merge_media_logs(workdir: str | os.PathLike) -> Path:
    """Gather the per-process files into WORKDIR/media_log.jsonl (rewritten whole each time).

    Call it on one process after the loader's workers have stopped, e.g. at the end of training;
    on hosts without a shared workdir, each host merges the files it has.
    """
    target = Path(workdir) / MERGED_NAME
    tmp = target.with_suffix(".jsonl.tmp")
    with tmp.open("wb") as out:
        for part in part_files(workdir):
            out.write(part.read_bytes())
    tmp.replace(target)
    return target
