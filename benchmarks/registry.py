"""Registering a 100k-row chat file with 2,000 distinct images, then a second version with changed text.

Run from the repository root:

    python benchmarks/registry.py                 # 100k rows, 2,000 images
    python benchmarks/registry.py --rows=20000 --images=400

Writes, in a temporary folder, `--images` distinct small PNGs and a deterministic chat JSONL of
`--rows` rows (a user message with text and one image part, image i mod N, and an assistant
answer), then registers it into a fresh local registry (`Registry.register`: chat validation,
hashing every image once, rewriting image paths to sha256, writing the blobs, one SQLite
transaction). Version 2 corrects the assistant text of 1% of the rows (one block of them): it
should upload no image and only the chunks of examples holding those rows. For reference,
version 3 changes every 10th row, which touches every chunk (its whole text is uploaded).

The last line is `register_rows_per_s=X second_version_upload_bytes=Y` with X the rows per second of
the first registration (images uploaded included) and Y the bytes version 2 wrote to the blob store.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from PIL import Image  # noqa: E402

from data_pipeline.registry import open_registry  # noqa: E402


def write_dataset(folder: Path, name: str, rows: int, images: int, changed) -> Path:
    path = folder / name
    with path.open("w") as out:
        for i in range(rows):
            answer = f'{{"total": {i % 9973}}}' + (" (checked)" if changed(i) else "")
            row = {"messages": [
                {"role": "system", "content": "Extract the invoice total as JSON."},
                {"role": "user", "content": [{"type": "text", "text": f"Invoice {i}: read the total."},
                                             {"type": "image", "path": f"images/invoice-{i % images:05d}.png"}]},
                {"role": "assistant", "content": answer},
            ]}
            out.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--images", type=int, default=2_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        (folder / "images").mkdir(parents=True)
        image_bytes = 0
        for i in range(args.images):
            path = folder / "images" / f"invoice-{i:05d}.png"
            Image.new("RGB", (16, 12), (i % 256, (i // 256) % 256, 77)).save(path)
            image_bytes += path.stat().st_size
        block = range(args.rows // 2, args.rows // 2 + args.rows // 100)
        first = write_dataset(folder, "v1.jsonl", args.rows, args.images, lambda i: False)
        second = write_dataset(folder, "v2.jsonl", args.rows, args.images, block.__contains__)
        third = write_dataset(folder, "v3.jsonl", args.rows, args.images, lambda i: i % 10 == 0)
        print(f"{args.rows} rows ({first.stat().st_size / 1e6:.1f} MB), {args.images} images ({image_bytes / 1e6:.2f} MB)")

        registry = open_registry(str(Path(tmp) / "registry"))
        start = time.perf_counter()
        v1 = registry.register("bench/invoices", first, "chat")
        first_s = time.perf_counter() - start
        first_bytes = registry.blobs.uploaded_bytes
        print(f"{v1.reference}: {first_s:.2f} s, {args.rows / first_s:.0f} rows/s, uploaded {first_bytes} bytes")

        start = time.perf_counter()
        v2 = registry.register("bench/invoices", second, "chat")
        second_s = time.perf_counter() - start
        second_bytes = registry.blobs.uploaded_bytes - first_bytes
        manifest = json.loads(registry.index.read("SELECT manifest FROM versions WHERE version=2")[0][0])
        text_bytes = sum(len(registry.blobs.get(h)) for h in manifest["examples"])
        print(f"{v2.reference} ({len(block)} rows changed): {second_s:.2f} s, uploaded {second_bytes} bytes "
              f"of its {text_bytes} bytes of examples in {len(manifest['examples'])} chunks; no image again")
        written = registry.blobs.uploaded_bytes
        v3 = registry.register("bench/invoices", third, "chat")
        print(f"{v3.reference} (every 10th row changed): uploaded {registry.blobs.uploaded_bytes - written} bytes")
        start = time.perf_counter()
        registry.resolve("bench/invoices:v1")
        print(f"materialising v1 for the converters (already written at register): {time.perf_counter() - start:.3f} s")
        print(f"register_rows_per_s={args.rows / first_s:.0f} second_version_upload_bytes={second_bytes}")


if __name__ == "__main__":
    main()
