"""The README's ahead-of-time table: Qwen2.5 shapes x TPU slices x tokens per row, one
`python -m valen_jax.compile` per row (a subprocess each: a crash or an out-of-memory refusal is that
row's result, not the table's end), written to a JSON file after every row, so a run can be stopped and
resumed; rows already in the file are skipped.

    python benchmarks/compile_table.py --output=benchmarks/compile_table.json                 # every row
    python benchmarks/compile_table.py --output=benchmarks/compile_table.json --rows=7b/v5p-64/8192
    python benchmarks/compile_table.py --output=benchmarks/compile_table.json --markdown      # print the table

Each row: full fine-tuning (f32 master weights, AdamW, remat=full, scanned layers, bf16 compute: the
`:hf` variant), pure FSDP over the slice (`mesh.fsdp=-1`), one row per chip, `attention=auto` (splash on
TPU); the model's shape from `benchmarks/shapes/NAME/config.json` (no weights). Only the train step is
compiled (`--programs=train_step`): the other programs take several times longer on a CPU host and the
memory and roofline goals are the train step's. Rows are listed biggest risk first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "benchmarks" / "shapes"
MODELS = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b", "vl-3b": "qwen2.5-vl-3b",
          "vl-7b": "qwen2.5-vl-7b"}
SLICES = ("v5e-8", "v5p-8", "v5p-64", "v6e-8")
LENGTHS = (4096, 32768)
# The goals first (issue 28: 7B at 8k on v5p-64 with >= 10% spare; 1.5B at 4k on v5p-8 with MFU bound
# >= 50%), then the 7B rows (the ones that may not fit), then the rest.
FIRST = ("7b/v5p-64/8192", "1.5b/v5p-8/4096", "vl-7b/v5p-64/8192")


def all_rows() -> list[str]:
    rows = list(FIRST)
    for model in ("7b", "1.5b", "0.5b", "vl-7b", "vl-3b"):
        for name in SLICES:
            for length in LENGTHS:
                row = f"{model}/{name}/{length}"
                if row not in rows:
                    rows.append(row)
    return rows


def command(row: str, output: Path) -> list[str]:
    model, topology, length = row.split("/")
    vl = model.startswith("vl-")
    config = "configs/vflash.py:hf" if vl else "configs/prepared.py:hf"
    args = [f"--config={config}", f"--config.model.init_from=benchmarks/shapes/{MODELS[model]}",
            f"--topology={topology}", "--config.mesh.data=1", "--config.mesh.fsdp=-1",
            f"--config.data.seq_len={length}", "--config.model.attention=auto", "--programs=train_step",
            f"--output={output}"]
    if vl:
        # 4 images of 448x448 per row: 4 x 32 x 32 patches of 14 px before the 2x2 merge.
        args.append("--config.data.max_patches=4096")
    return ["-m", "valen_jax.compile", *args]


def batch_of(topology: str) -> int:
    """One row per chip: the chips of the slice (v4/v5p names count TensorCores, two per chip)."""
    generation, count = topology.split("-")
    return int(count) // 2 if generation in ("v4", "v5p") else int(count)


def run_row(row: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "report.json"
        args = command(row, output)
        args.insert(-1, f"--config.data.global_batch={batch_of(row.split('/')[1])}")
        started = time.perf_counter()
        done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        seconds = time.perf_counter() - started
        shown = "python " + " ".join(args[:-1])  # without the temporary --output
        lines = (done.stdout.strip().splitlines() or [""])
        result = {"row": row, "command": shown, "returncode": done.returncode, "seconds": seconds,
                  "last_line": lines[-1], "error": (done.stderr.strip().splitlines() or [""])[-1]
                  if done.returncode else None}
        if output.is_file():
            report = json.loads(output.read_text())
            program = report["programs"][0]
            result.update(fits=program["fits"], gib_per_chip=program["gib_per_chip"],
                          spare_fraction=program["spare_fraction"], mfu_bound=program["mfu_bound"],
                          bound_by=program["bound_by"], collectives=program["collectives"],
                          attention=report["attention"]["chosen"], mesh=report["mesh"])
        elif done.returncode == 1 and result["error"].startswith("DoesNotFit"):
            result.update(fits=False)  # refused by the TPU compiler itself (RESOURCE_EXHAUSTED)
        return result


def census(collectives: dict) -> str:
    parts = []
    for name, short in (("all-gather", "AG"), ("reduce-scatter", "RS"), ("all-reduce", "AR"),
                        ("all-to-all", "A2A"), ("collective-permute", "CP")):
        c = collectives.get(name, {})
        if c.get("count"):
            parts.append(f"{short} {c['count']} ({c['bytes'] / 2 ** 30:.1f} GiB, {c['inside_loops']['count']} in loop)")
    return ", ".join(parts) or "none"


def markdown(results: dict) -> str:
    lines = ["| model | slice | tokens/row | fits | GiB/chip (spare) | MFU bound | collectives per step per chip |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in all_rows():
        r = results.get(row)
        model, topology, length = row.split("/")
        if r is None:
            lines.append(f"| {MODELS[model]} | {topology} | {length} | not computed | | | |")
        elif "gib_per_chip" in r:
            mfu = f"{r['mfu_bound']:.2f} ({r['bound_by']})" if r["mfu_bound"] is not None else ""
            lines.append(f"| {MODELS[model]} | {topology} | {length} | {r['fits']} | "
                         f"{r['gib_per_chip']['total']:.1f} ({100 * r['spare_fraction']:.0f}%) | {mfu} | "
                         f"{census(r['collectives'])} |")
        else:
            error = r["error"] or ""
            # The TPU compiler's own refusal names the temporaries it needed and the HBM it had.
            found = re.search(r"HLO temporaries \((\S+)\) exceeds available HBM \((\S+)\)", error)
            shown = f"temp {found.group(1)} > {found.group(2)} HBM (compiler)" if found else error[:160]
            lines.append(f"| {MODELS[model]} | {topology} | {length} | {r.get('fits', 'error')} | {shown} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--rows", default="", help="comma-separated model/slice/length (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print the table from --output and stop")
    args = parser.parse_args()
    results = json.loads(args.output.read_text()) if args.output.is_file() else {}
    if args.markdown:
        print(markdown(results))
        return
    for row in [r for r in args.rows.split(",") if r] or all_rows():
        if row in results:
            continue
        result = run_row(row)
        results[row] = result
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(f"{row}: {result['last_line'] if result['returncode'] == 0 else result['error']} "
              f"({result['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
