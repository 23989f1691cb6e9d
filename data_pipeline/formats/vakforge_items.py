"""Vakforge conversations as conversion reads them: validated, with their line, split and dataset hash.

`split=` (convert `--split`) keeps only the conversations splits.json assigns to that split.
`manifest_hash` (seed 002: adapters "must write a manifest_hash into their output") is computed
over the whole dataset, whatever the split; conversion writes it to manifest.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_pipeline.formats.errors import ProblemLog
from data_pipeline.formats.jsonl import iter_jsonl_objects
from data_pipeline.formats.limits import read_file_capped
from data_pipeline.formats.vakforge import VakforgeConversation, VakforgeSplits, manifest_hash, read_vakforge
from data_pipeline.formats.vakforge_splits import SPLITS_FILE


@dataclass(frozen=True)
class VakforgeItem:
    conversation: VakforgeConversation
    source: str  # the manifest
    line: int
    split: str  # from splits.json
    manifest_hash: str  # of the whole dataset


def read_vakforge_items(path: str | Path, split: str | None = None) -> list[VakforgeItem]:
    """The validated conversations of a manifest (of one split when `split` is given), in file order."""
    path = Path(path)
    conversations = read_vakforge(path)
    digest = manifest_hash(path, conversations)
    splits_path = path.parent / SPLITS_FILE
    splits = VakforgeSplits.model_validate_json(read_file_capped(splits_path), strict=True)
    if split is not None and split not in splits.splits:
        raise ValueError(f"--split={split}: {splits_path} has the splits {', '.join(sorted(splits.splits))}")
    assigned = {cid: name for name, ids in splits.splits.items() for cid in ids}
    # read_vakforge returns records only; their lines come from a second, validated-clean pass.
    lines = {obj["id"]: number for number, obj in iter_jsonl_objects(path, str(path), ProblemLog(str(path)))}
    return [VakforgeItem(conv, str(path), lines[conv.id], assigned[conv.id], digest)
            for conv in conversations if split is None or assigned[conv.id] == split]
