"""Valen validation speed against plain `json.loads`, and its peak memory at two file sizes.

Run from the repository root:

    python benchmarks/validate.py            # 100k records (and 20k for the memory comparison)
    python benchmarks/validate.py --records=20000

Writes a deterministic Valen JSONL file (text records, with every 20th record referencing one of 16
small images listed in `assets`) to a temporary folder, then times, in this process and best of
`--repeat` runs each:

- validation as `python -m data_pipeline.validate --format=valen PATH` does it
  (`data_pipeline.validate.validate`), media checks included;
- reading every line and `json.loads` of it, nothing else;
- for reference, the strict JSON reading validation starts with (`jsonl.iter_jsonl_objects`: UTF-8
  checks, repeated keys and NaN refused), whose duplicate-key hook is most of the gap.

Peak RSS of validation is measured in a fresh subprocess for the full size and for a fifth of it:
validation streams, so the two should be about equal. The last line is
`validate_ratio_vs_json=X peak_rss_mb=Y` with X = json time / validate time (goal >= 0.5) and Y the
peak RSS of the full-size run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_pipeline.formats.jsonl import iter_jsonl_objects  # noqa: E402
from data_pipeline.validate import validate  # noqa: E402

WORDS = (
    "the a light green red car pedestrian street crossing signal stove pot handle child kitchen floor "
    "review headphones sound cracked support weather rain cloud umbrella table ball cup shapes left right "
    "moves quickly slowly near far behind under above"
).split()
IMAGES = 16
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360606060000000050001a5f645400000000049454e44ae426082"
)


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def probabilities(rng: random.Random, keys: list[str]) -> dict[str, float]:
    if rng.random() < 0.8:  # mostly hard labels, as in real data
        hot = rng.randrange(len(keys))
        return {k: 1.0 if i == hot else 0.0 for i, k in enumerate(keys)}
    weights = [rng.randint(1, 4) for _ in keys]
    return {k: w / sum(weights) for k, w in zip(keys, weights, strict=True)}


def record(rng: random.Random, n: int) -> dict:
    questions, targets = {}, {}
    for q in range(rng.randint(2, 4)):
        kind = ("choice", "noul", "score")[q % 3]
        qid = f"q{q}_{kind}"
        question: dict = {"type": kind, "instructions": sentence(rng, 8)}
        if kind == "choice":
            names = rng.sample(WORDS, rng.randint(2, 5))
            question["criteria"] = {name: sentence(rng, 3) for name in names}
            keys = names
        elif kind == "score":
            question["criteria"] = [sentence(rng, 4) for _ in range(rng.randint(2, 5))]
            keys = [str(k) for k in range(len(question["criteria"]))]
        else:
            keys = ["true", "false"]
        questions[qid] = question
        if rng.random() < 0.9:
            targets[qid] = {"probabilities": probabilities(rng, keys)}
    state: object = sentence(rng, rng.randint(10, 40))
    assets = []
    if n % 20 == 0:
        image = f"images/{n % IMAGES:02d}.png"
        state = {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": state},
                        {"type": "image_url", "image_url": {"url": image}},
                    ],
                }
            ]
        }
        assets = [{"path": image, "sha256": hashlib.sha256(PNG + bytes([n % IMAGES])).hexdigest()}]
    return {
        "group_id": f"group-{n // 3:06d}",
        "request": {"state": state, "questions": questions},
        "targets": targets,
        "assets": assets,
        "meta": {
            "record_id": f"bench-{n:06d}",
            "domain": "bench",
            "modality": "text",
            "language_bucket": "en",
        },
    }


def write_file(folder: Path, records: int) -> Path:
    (folder / "images").mkdir(exist_ok=True)
    for i in range(IMAGES):
        (folder / "images" / f"{i:02d}.png").write_bytes(PNG + bytes([i]))
    path = folder / f"bench_{records}.jsonl"
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as out:
        for n in range(records):
            out.write(json.dumps(record(rng, n), ensure_ascii=False) + "\n")
    return path


def time_json(path: Path) -> float:
    start = time.perf_counter()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            json.loads(line)
    return time.perf_counter() - start


def time_strict_json(path: Path) -> float:
    start = time.perf_counter()
    for _ in iter_jsonl_objects(path, str(path), []):
        pass
    return time.perf_counter() - start


def time_validate(path: Path) -> float:
    start = time.perf_counter()
    summaries, problems = validate("valen", [str(path)])
    elapsed = time.perf_counter() - start
    if problems:
        raise SystemExit(f"benchmark file did not validate: {problems[0]}")
    return elapsed


PEAK_RSS = """
import resource, sys
sys.path.insert(0, sys.argv[2])
from data_pipeline.validate import validate
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
summaries, problems = validate("valen", [sys.argv[1]])
assert not problems, problems[:3]
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak_rss_mb(path: Path) -> tuple[float, float]:
    """(peak RSS after the imports, peak RSS after validating `path`) of a fresh process, in MB."""
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(path), str(REPO)], capture_output=True, text=True, check=True
    )
    before, after = out.stdout.split()[-2:]
    return int(before) / 1024, int(after) / 1024  # Linux reports ru_maxrss in KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        big = write_file(folder, args.records)
        small = write_file(folder, args.records // 5)
        size_mb = big.stat().st_size / 1e6
        print(f"file: {args.records} records, {size_mb:.1f} MB")
        json_s = strict_s = validate_s = float("inf")
        for _ in range(args.repeat):  # interleaved, best of each: a busy neighbour slows all alike
            json_s = min(json_s, time_json(big))
            strict_s = min(strict_s, time_strict_json(big))
            validate_s = min(validate_s, time_validate(big))
        print(f"json.loads per line: {json_s:.3f} s ({size_mb / json_s:.1f} MB/s)")
        print(
            f"strict JSON lines only (UTF-8, duplicate keys, NaN): {strict_s:.3f} s ({json_s / strict_s:.2f}x)"
        )
        print(f"validate --format=valen: {validate_s:.3f} s ({size_mb / validate_s:.1f} MB/s)")
        (imports, rss_big), (_, rss_small) = peak_rss_mb(big), peak_rss_mb(small)
        print(
            f"peak RSS of validation: {rss_small:.1f} MB at {args.records // 5} records, "
            f"{rss_big:.1f} MB at {args.records} records ({imports:.1f} MB after imports alone)"
        )
        print(f"validate_ratio_vs_json={json_s / validate_s:.2f} peak_rss_mb={rss_big:.1f}")


if __name__ == "__main__":
    main()
