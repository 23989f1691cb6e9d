"""The README's ahead-of-time table: Qwen2.5 shapes x TPU slices x tokens per row, one
`python -m valen_jax.compile` per row (a subprocess each: a crash or an out-of-memory refusal is that
row's result, not the table's end), written to a JSON file after every row, so a run can be stopped and
resumed; rows already in the file are skipped.

    python benchmarks/compile_table.py --output=benchmarks/compile_table.json                 # every row
    python benchmarks/compile_table.py --output=benchmarks/compile_table.json --rows=7b/v5p-64/8192
    python benchmarks/compile_table.py --output=benchmarks/compile_table.json --markdown      # print the table
    python benchmarks/compile_table.py --output=benchmarks/compile_table.json --longest=7b    # longest row per slice

Each row: full fine-tuning (f32 master weights, AdamW, remat=full, scanned layers, bf16 compute: the
`:hf` variant), pure FSDP over the slice (`mesh.fsdp=-1`), one row per chip, `attention=auto` (splash on
TPU); the model's shape from `benchmarks/shapes/NAME/config.json` (no weights). Only the train step is
compiled (`--programs=train_step`): the other programs take several times longer on a CPU host and the
memory and roofline goals are the train step's. Rows are listed biggest risk first.

`--longest=MODEL` searches, per slice, the longest row (a multiple of 1024 tokens) whose train step fits:
it starts from the rows already in the file, probes where a straight line through the two nearest
measured totals meets the chip's HBM (memory grows about linearly in the row with remat and flash
attention), and bisects the bracket until it is 1024 wide or --probes compiles were spent; every probe
is a row of the file, so the search resumes too. A bracket left wider is reported as such.
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


GRANULE = 1024  # the longest-row search's step in tokens per row


def _row_gib(result: dict) -> float | None:
    """The per-chip GiB a measured row needed: the tool's total, or the temporaries the TPU compiler said it
    needed when it refused the program itself (arguments then unknown: a lower bound)."""
    if "gib_per_chip" in result:
        return result["gib_per_chip"]["total"]
    found = re.search(r"HLO temporaries \((\S+?)G\)", result.get("error") or "")
    return float(found.group(1)) if found else None


def bracket(model: str, topology: str, results: dict) -> tuple[int | None, int | None]:
    """(longest measured row that fits, shortest measured row that does not) of `model` on `topology`."""
    fit, unfit = None, None
    for row, result in results.items():
        m, t, length = row.split("/")
        if (m, t) != (model, topology) or "fits" not in result:
            continue
        if result["fits"]:
            fit = max(fit or 0, int(length))
        else:
            unfit = min(unfit or 10 ** 9, int(length))
    return fit, unfit


def next_probe(model: str, topology: str, results: dict, hbm_gib: float) -> int | None:
    """The next row length to compile in the longest-row search, or None when the bracket is one granule."""
    fit, unfit = bracket(model, topology, results)
    if fit is None and unfit is None:
        return LENGTHS[0]
    if fit is None:  # nothing fits yet: halve
        return unfit // 2 if unfit // 2 >= GRANULE else None
    if unfit is None:  # everything fits so far: extrapolate, at least doubling
        return 2 * fit
    if unfit - fit <= GRANULE:
        return None
    g_fit = _row_gib(results[f"{model}/{topology}/{fit}"])
    g_unfit = _row_gib(results[f"{model}/{topology}/{unfit}"])
    guess = (fit + unfit) // 2
    if g_fit is not None and g_unfit is not None and g_unfit > g_fit:
        guess = int(fit + (hbm_gib - g_fit) * (unfit - fit) / (g_unfit - g_fit))
    guess = guess // GRANULE * GRANULE
    return min(max(guess, fit + GRANULE), unfit - GRANULE)


def search_longest(model: str, results: dict, output: Path, probes: int) -> None:
    from valen_jax.tasks.aot import HBM_PER_CHIP

    for topology in SLICES:
        hbm_gib = HBM_PER_CHIP[topology.split("-")[0]] / 2 ** 30
        for _ in range(probes):
            length = next_probe(model, topology, results, hbm_gib)
            if length is None:
                break
            row = f"{model}/{topology}/{length}"
            results[row] = run_row(row)
            output.write_text(json.dumps(results, indent=2) + "\n")
            print(f"{row}: fits={results[row].get('fits')} ({results[row]['seconds']:.0f} s)", flush=True)
        fit, unfit = bracket(model, topology, results)
        print(f"longest {model}/{topology}: fits at {fit}, not at {unfit}", flush=True)


def longest_lines(results: dict) -> list[str]:
    """One line per model and slice searched: the longest fitting row measured and the shortest that is not."""
    lines = []
    for model in MODELS:
        for topology in SLICES:
            lengths = {int(row.split("/")[2]) for row in results if row.startswith(f"{model}/{topology}/")}
            if not lengths - set(LENGTHS) - {8192}:
                continue  # not searched
            fit, unfit = bracket(model, topology, results)
            found = f"the longest row that fits is {fit} tokens" if fit else "no row fits"
            lines.append(f"- {MODELS[model]} on {topology}: {found}"
                         + (f" ({unfit} does not)" if unfit else " (no longer row was compiled)"))
    return lines


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
    parser.add_argument("--longest", choices=tuple(MODELS), help="search the longest row that fits, per slice")
    parser.add_argument("--probes", type=int, default=4, help="compiles per slice for --longest")
    args = parser.parse_args()
    results = json.loads(args.output.read_text()) if args.output.is_file() else {}
    if args.markdown:
        print("\n".join([markdown(results), "", *longest_lines(results)]))
        return
    if args.longest:
        search_longest(args.longest, results, args.output, args.probes)
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
