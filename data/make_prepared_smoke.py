"""Write the prepared-rows smoke set (seed 003, "Prepared token rows") from the chat smoke set.

    python data/make_prepared_smoke.py [--out data/smoke/prepared]

Each text-only conversation of data/smoke/chat/{train,eval}.jsonl is tokenised with the smoke
tokenizer AS SHIPPED (data/tokenizer: its own chat template, `{% generation %}` marking the
assistant tokens), giving `input_ids` and `loss_mask`; the rows go to a Parquet file, described
and zipped by `data_pipeline.prepared.describe` into `train.zip` and `eval.zip`. Rows with images
are left out: prepared rows hold token ids only, and an image placeholder without its media
would be refused by the loader.

data/tokenizer is a plain folder, so the descriptor records a stand-in repository
(`valen/smoke-tokenizer`) and commit (the SHA-1 of its tokenizer.json): a run on these rows
checks the tokenizer digests, and cannot check repository or commit (it says so).

Deterministic: the same command writes byte-identical zips (fixed zip timestamps, same Parquet
writer).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from data_pipeline.formats.prepared import write_prepared_zip  # noqa: E402
from data_pipeline.prepared import describe, load_shipped_tokenizer  # noqa: E402

TOKENIZER = ROOT / "data/tokenizer"
REPOSITORY = "valen/smoke-tokenizer"


def rows_of(chat_file: Path, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    ids, masks = [], []
    for line in chat_file.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if not all(isinstance(m.get("content"), str | None) for m in record["messages"]):
            continue  # image parts: see the module docstring
        out = tokenizer.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        mask = list(out["assistant_masks"])
        mask[0] = 0  # seed 003: the first token is never marked (no token predicts it)
        if not any(mask):
            raise SystemExit(f"{chat_file}: a row with no assistant token; the template lost its markers")
        ids.append(list(out["input_ids"]))
        masks.append(mask)
    return ids, masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "data/smoke/prepared")
    args = parser.parse_args()
    tokenizer = load_shipped_tokenizer(str(TOKENIZER), None)
    commit = hashlib.sha1((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for split in ("train", "eval"):
            ids, masks = rows_of(ROOT / f"data/smoke/chat/{split}.jsonl", tokenizer)
            parquet = Path(scratch) / f"{split}.parquet"
            table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int32())),
                              "loss_mask": pa.array(masks, pa.list_(pa.int8()))})
            pq.write_table(table, parquet)
            descriptor, problems = describe([parquet], str(TOKENIZER), REPOSITORY, commit)
            if problems:
                raise SystemExit("\n".join(str(p) for p in problems))
            write_prepared_zip(descriptor, [parquet], args.out / f"{split}.zip")
            stats = descriptor.files[0].stats.to_json()
            print(f"{args.out / f'{split}.zip'}: {json.dumps(stats)}")


if __name__ == "__main__":
    main()
