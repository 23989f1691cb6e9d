"""Chat conversion speed: our converter against HF `datasets` `.map(apply_chat_template)`, same run.

Run from the repository root (needs the benchmark-only extra: `pip install 'valen-jax[bench]'`,
which brings `datasets`):

    python benchmarks/convert.py               # 20k rows
    python benchmarks/convert.py --rows=2000   # a quick run

Writes a deterministic tool-calling chat JSONL file to a temporary folder (system prompt, user
question, an assistant message with one or two tool calls, one tool message per call, a final
assistant answer; each row declares 1-3 of 10 tools, so tool lists vary and repeat as in real data),
then times, each end to end in a fresh process (interpreter start, imports and tokenizer load
included), on the smoke tokenizer `data/tokenizer` and its training template (`chatml`, with
`{% generation %}` markers):

- our CLI, `python -m data_pipeline.convert --format=chat --input=F --output=D
  --tokenizer=data/tokenizer --workers=N` for N = 1 and 2: validation, rendering with assistant
  masks and every refusal check, ArrayRecord shards and manifest;
- HF `datasets`: `load_dataset("text", ...)`, then `.map` (one process) of `json.loads` and
  `tokenizer.apply_chat_template(messages, tools=tools, return_dict=True,
  return_assistant_tokens_mask=True)` on the same tokenizer (loaded by `data_pipeline.tokenizer`,
  so the template and added tokens are the same), writing its Arrow cache file.

The text column keeps the rows exactly as written: reading them with `load_dataset("json")` would
merge every row's tool schemas and arguments into one Arrow struct type, and the template would then
render keys as `null` that the row never had. After timing, the token ids and assistant masks of
both outputs are compared row by row (they must be equal, or the comparison would be meaningless).

The last line is `convert_ratio_vs_datasets=X worker_scaling=Y`: X = our records/s with 1 worker /
`datasets` records/s (both one process; goal >= 3), Y = our records/s with 2 workers / with 1.
Wall time is what the figures are; on a shared machine they move with the load, so each line also
gives the CPU seconds the command and its waited-for children used (the load average is printed).

Measured on the 2-core development machine (shared with other work, load average 1.4-4.9), three
runs of 20k rows: ours 473-673 records/s with 1 worker, 337-1141 with 2; `datasets` 510-592;
X = 0.86-1.24 (per CPU-second 1.02-1.12), Y = 0.71-1.70 (the high figure in the quietest run, the
low ones when other work took the second core). X >= 3 is out of
reach for one process: after the schema-check cache and the turn cache, a row costs about 0.9 ms of
CPU, of which tokenizing the text only this row has (~0.45 ms) and the Jinja render (~0.2 ms) are
work `apply_chat_template` does too; `datasets` spends about 1.3 ms. Before this benchmark existed
the same CLI was 2x slower per CPU-second (jsonschema's meta-schema check of every row's tools).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer"

_S = {"type": "string"}
_I = {"type": "integer"}
# name: (description, {argument: schema}, required); arguments are written in this order.
TOOLS = {
    "get_weather": ("Look up the current weather for a city",
                    {"city": _S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "search_flights": ("Search direct flights between two airports on a date",
                       {"origin": _S, "destination": _S, "date": {"type": "string", "format": "date"},
                        "passengers": _I}, ["origin", "destination", "date"]),
    "convert_currency": ("Convert an amount between two currencies at today's rate",
                         {"amount": {"type": "number"}, "from": _S, "to": _S}, ["amount", "from", "to"]),
    "lookup_order": ("Find an order by its number", {"order_id": _S}, ["order_id"]),
    "create_event": ("Add an event to the user's calendar",
                     {"title": _S, "start": _S, "minutes": _I,
                      "attendees": {"type": "array", "items": _S}}, ["title", "start"]),
    "translate": ("Translate a text into another language",
                  {"text": _S, "target_language": _S}, ["text", "target_language"]),
    "stock_price": ("The latest trading price of a stock ticker", {"ticker": _S}, ["ticker"]),
    "send_email": ("Send an email on the user's behalf", {"to": _S, "subject": _S, "body": _S},
                   ["to", "subject", "body"]),
    "distance": ("Driving distance in kilometres between two places", {"from": _S, "to": _S}, ["from", "to"]),
    "define_word": ("A dictionary definition of an English word", {"word": _S}, ["word"]),
}
CITIES = ("Wellington", "Oslo", "Lima", "Nairobi", "Osaka", "Quito", "Lisbon", "Hanoi", "Tunis", "Perth")
WORDS = ("quarterly report budget meeting invoice shipment delay refund review launch plan team "
         "schedule travel visa hotel deadline draft contract summary weekly update").split()
SYSTEMS = ("You are a helpful assistant with access to tools.",
           "You are a travel and office assistant. Call a tool when it helps; answer briefly.",
           "Answer the user's question. Use the provided functions for anything you cannot know.")


def tool_schema(name: str) -> dict:
    description, properties, required = TOOLS[name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def arguments(rng: random.Random, name: str) -> dict:
    out = {}
    for key, schema in TOOLS[name][1].items():
        kind = schema["type"]
        if "enum" in schema:
            out[key] = rng.choice(schema["enum"])
        elif kind == "integer":
            out[key] = rng.randint(1, 120)
        elif kind == "number":
            out[key] = round(rng.uniform(1, 5000), 2)
        elif kind == "array":
            out[key] = [f"{rng.choice(WORDS)}@example.com" for _ in range(rng.randint(1, 3))]
        elif key in ("city", "origin", "destination", "from", "to"):
            out[key] = rng.choice(CITIES)
        else:
            out[key] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    return out


def chat_row(rng: random.Random, index: int) -> dict:
    """system + user + assistant tool calls + tool results + final assistant; 1-3 declared tools."""
    declared = rng.sample(sorted(TOOLS), rng.randint(1, 3))
    called = rng.sample(declared, min(len(declared), rng.choice((1, 1, 2))))
    calls = [{"id": f"call_{index}_{k}", "type": "function",
              "function": {"name": name, "arguments": arguments(rng, name)}} for k, name in enumerate(called)]
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 24)))
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)},
                {"role": "user", "content": f"Please help: {question}?"},
                {"role": "assistant", "content": "", "tool_calls": calls}]
    for call in calls:
        result = {"status": "ok", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15)))}
        messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                         "content": json.dumps(result)})
    answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
    messages.append({"role": "assistant", "content": f"Done. {answer.capitalize()}."})
    return {"tools": [tool_schema(name) for name in declared], "messages": messages}


def write_chat_file(path: Path, rows: int, seed: int = 12) -> None:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(chat_row(rng, i), ensure_ascii=False) + "\n" for i in range(rows)),
                    encoding="utf-8")


# -- the datasets side, run in its own process (--datasets-pass) ------------------------------------

def datasets_pass(jsonl: Path, out_dir: Path) -> None:
    import datasets

    sys.path.insert(0, str(REPO))
    from data_pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER)
    datasets.disable_progress_bars()

    def encode(row: dict) -> dict:
        chat = json.loads(row["text"])
        out = tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    rows = datasets.load_dataset("text", data_files=str(jsonl), split="train", cache_dir=str(out_dir / "cache"))
    rows.map(encode, remove_columns=["text"], cache_file_name=str(out_dir / "encoded.arrow"))


# -- timing and the comparison ----------------------------------------------------------------------

def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and the children it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def compare_outputs(shard_dir: Path, arrow: Path, rows: int) -> None:
    """Same ids, and weights exactly where datasets' assistant mask is 1, for every row."""
    import datasets
    import numpy as np

    sys.path.insert(0, str(REPO))
    from data_pipeline import shards

    manifest = shards.Manifest.read(shard_dir)
    ours = [e for path in manifest.shard_paths for e in shards.read_shard(shard_dir / path)]
    theirs = datasets.Dataset.from_file(str(arrow))
    if len(ours) != rows or len(theirs) != rows:
        raise SystemExit(f"row counts differ: ours {len(ours)}, datasets {len(theirs)}, file {rows}")
    for index, (example, row) in enumerate(zip(ours, theirs, strict=True)):
        same_ids = np.array_equal(example.arrays["input_ids"], np.asarray(row["input_ids"], dtype=np.int32))
        same_mask = np.array_equal(example.arrays["target_weights"] > 0, np.asarray(row["assistant_masks"]) > 0)
        if not (same_ids and same_mask):
            raise SystemExit(f"row {index}: our tokens or weights differ from apply_chat_template's")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--datasets-pass", nargs=2, metavar=("JSONL", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.datasets_pass:
        datasets_pass(Path(args.datasets_pass[0]), Path(args.datasets_pass[1]))
        return
    with tempfile.TemporaryDirectory(prefix="bench_convert.") as tmp:
        tmp = Path(tmp)
        jsonl = tmp / "chat.jsonl"
        write_chat_file(jsonl, args.rows)
        size_mb = jsonl.stat().st_size / 1e6
        print(f"{args.rows} tool-calling chat rows, {size_mb:.1f} MB; load average {os.getloadavg()[0]:.2f}")
        rates, cpu_rates = {}, {}
        for workers in (1, 2):
            out = tmp / f"shards_{workers}"
            seconds, cpu = timed([sys.executable, "-m", "data_pipeline.convert", "--format=chat", f"--input={jsonl}",
                                  f"--output={out}", f"--tokenizer={TOKENIZER}", f"--workers={workers}"])
            rates[workers], cpu_rates[workers] = args.rows / seconds, args.rows / cpu
            print(f"ours, CLI --workers={workers}: {seconds:7.2f} s  {rates[workers]:6.0f} records/s  "
                  f"(CPU {cpu:6.2f} s, {cpu_rates[workers]:6.0f} records per CPU-second)")
        seconds, cpu = timed([sys.executable, __file__, "--datasets-pass", str(jsonl), str(tmp / "datasets")])
        rates["datasets"], cpu_rates["datasets"] = args.rows / seconds, args.rows / cpu
        print(f"datasets .map(apply_chat_template): {seconds:7.2f} s  {rates['datasets']:6.0f} records/s  "
              f"(CPU {cpu:6.2f} s, {cpu_rates['datasets']:6.0f} records per CPU-second)")
        compare_outputs(tmp / "shards_1", tmp / "datasets" / "encoded.arrow", args.rows)
        if (tmp / "shards_1" / "manifest.json").read_text() != (tmp / "shards_2" / "manifest.json").read_text():
            raise SystemExit("1 and 2 workers wrote different shards")
        print("outputs: same token ids and assistant masks as apply_chat_template; 1 and 2 workers identical")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        print(f"per CPU-second: ours (1 worker) / datasets = {cpu_rates[1] / cpu_rates['datasets']:.2f}; "
              f"ours with 2 workers / datasets = {rates[2] / rates['datasets']:.2f} (records/s)")
    print(f"convert_ratio_vs_datasets={rates[1] / rates['datasets']:.2f} worker_scaling={rates[2] / rates[1]:.2f}")


if __name__ == "__main__":
    main()
