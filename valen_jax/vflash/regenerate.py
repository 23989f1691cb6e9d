"""Rewrite a VFlash dataset with the target's own answers, as drafter training data (DFlash/EAGLE style):
the library of `python -m valen_jax.regenerate` (the command's flags and examples are in its docstring).

    regen = Regenerator("runs/vflash-smoke", max_new_tokens=96, batch_size=16, sampling=GREEDY, seed=0)
    report = regenerate(regen, Path("data/smoke/vflash/recipe.json"), Path("runs/vflash-regen"), samples=0)
    print("\n".join(report.lines()))

A block drafter must predict what the TARGET writes, not the reference answer: on new scenes the target
writes its own coordinates, and a drafter fitted to the references proposes the wrong ones. So every
trained assistant answer of `--data` (a recipe or a VFlash JSONL) is replaced by the target's greedy
continuation of the turns before it, built exactly as `valen_jax.generate` and evaluation build prompts
(`evaluation.answers.prompts_for`, decoded by `decoding.engine.generate_ids`); with `--samples=N`, N more
records per source record hold answers sampled at `--temperature`/`--top-k`/`--top-p` from `--seed`.

Multi-turn records are regenerated turn by turn (chained): answer k is generated from the turns before it
with answers 0..k-1 ALREADY regenerated, so every answer of the output is the target's continuation of
exactly the conversation it follows there (running `generate` on the output gives its answers back).
Human turns and images are kept. For k >= 1 this differs from `generate` on the source data, whose prompts
hold the reference answers.

Output, written to a temporary sibling folder and renamed to `--output` at the end (nothing half-written;
an existing `--output` is refused): one `ENTRY.jsonl` per recipe entry (a plain JSONL input is one entry
named after the file), the greedy record then its sampled variants in source order; `recipe.json` with
the source entries' options and weights (`repeat_time`, `visual_aug`, `dense_scale`, ...), each `annotation`
its new file, `root` the source entry's media folder as an absolute path (images are referenced there,
not copied: move the output together with the source media), `length` the records written; and
`regenerate.json`: target workdir, step and params digest, the options, counts and every skip.

Skipped, counted per reason with the source file:line (the whole record: its later answers would follow
one that is not there): an answer without the end-of-turn token within `--max-new-tokens`; one the
VFlash reader refuses (`data_pipeline.formats.vflash`: it does not parse as primitives, an
`atomic_decoding` block_size does not count the primitive's tokens, ...); one the renderer refuses; one
whose text does not tokenise back to the generated tokens (the drafter would learn other tokens than the
target's). `atom_loss_masks` are dropped: every token of a regenerated answer is the target's own, a
right drafter target (how many records had masks is reported). Valen, chat and vakforge data are refused
(Valen questions are scored, not generated: `python -m valen_jax.predict`). One process.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import jax

from data_pipeline.formats.errors import FormatError, ProblemLog
from data_pipeline.formats.jsonl import iter_jsonl_objects
from data_pipeline.formats.limits import read_file_capped
from data_pipeline.formats.recipe import read_recipe
from data_pipeline.formats.vflash import VFlashRecord, read_vflash
from data_pipeline.render.common import RenderError
from data_pipeline.render.vflash import VFlashRenderer
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.decoding.engine import GREEDY, generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.errors import UserError
from valen_jax.evaluation import answers, prompts, tokens
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.run import decoding_layout, restore_model

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One output recipe entry: the source entry's options, its media folder and its rows."""

    name: str
    options: dict  # the source recipe entry as written (annotation/root/length are rewritten)
    root: Path
    dense_scale: float | None
    file: str = ""  # the output JSONL's name
    rows: list[Row] = field(default_factory=list)


@dataclass
class Row:
    """One output record: a source record (greedy, variant 0) or one of its sampled variants."""

    entry: Entry
    source: str  # the source record's file and line, for every message about it
    variant: int
    obj: dict  # the record as it will be written, answers replaced as they are generated
    record: VFlashRecord  # `obj` as the VFlash reader reads it
    example: Example  # `record` rendered: the next answer's prompt comes from it
    answers: int
    skipped: str | None = None

    def answer_turn(self, k: int) -> dict:
        return self.obj["conversations"][2 * k + 1]  # turns alternate human, gpt (the reader checks it)


@dataclass
class Skip:
    source: str
    variant: int
    answer: int
    reason: str  # the count key: the message with its numbers written N
    message: str


@dataclass
class Report:
    output: Path
    records: int  # source records
    written: int
    skips: list[Skip]
    masks_dropped: int
    empty_entries: list[str]

    def lines(self) -> list[str]:
        out = [f"{self.output}: {self.written} records written from {self.records} source records, "
               f"{len(self.skips)} skipped"]
        for reason, count in Counter(s.reason for s in self.skips).most_common():
            out.append(f"  skipped {count}: {reason}")
        out += [f"    {s.source} answer {s.answer}{f' (sample {s.variant})' if s.variant else ''}: {s.message}"
                for s in self.skips]
        if self.masks_dropped:
            out.append(f"  atom_loss_masks dropped on {self.masks_dropped} record(s) (regenerated tokens are all "
                       "the target's own)")
        out += [f"  entry {name}: every record skipped; left out of recipe.json" for name in self.empty_entries]
        return out


class NothingRegenerated(UserError):
    """Every record was skipped. Its one line counts the skips by reason; `report` has them all (issue 27:
    "nothing to write (96 skips)" said neither why nor which)."""

    def __init__(self, data: Path, report: Report):
        reasons = "; ".join(f"{count} {reason}" for reason, count in
                            Counter(s.reason for s in report.skips).most_common())
        super().__init__(f"{str(data)!r}: every record was skipped, nothing to write ({len(report.skips)} skips: "
                         f"{reasons})")
        self.report = report


class Regenerator:
    """The target of one workdir and what it needs to render records and decode their answers."""

    def __init__(self, workdir: str | Path, *, max_new_tokens: int | None, batch_size: int | None,
                 sampling: Sampling, seed: int):
        if jax.process_count() > 1:
            raise SystemExit("regenerate runs in one process; split the data and run one per part")
        self.target = decoding_layout(restore_model(workdir))
        config = self.target.config
        if config.train.mode != "ar":
            raise SystemExit(f"--workdir={workdir}: a {config.train.mode!r} run; regenerate needs the ar target "
                             "(pass the workdir named by its model.target_from)")
        if config.task != "vflash":
            raise SystemExit(f"--workdir={workdir}: a {config.task!r} model; regenerate writes VFlash drafter "
                             "data and needs a VFlash (configs/vflash.py) target")
        self.tokenizer = self.target.tokenizer
        self.renderer = VFlashRenderer(self.tokenizer)
        self.eot = end_of_turn_id(self.tokenizer)
        self.max_new_tokens = int(max_new_tokens or config.eval.max_new_tokens)
        self.local_batch = eval_workdir.local_batch_size(int(batch_size or config.eval.batch_size),
                                                          self.target.mesh)
        self.sampling, self.seed = sampling, int(seed)

    def render(self, record: VFlashRecord, entry: str) -> Example:
        return self.renderer.render(record, entry)

    def decode(self, rows: list[Row], k: int, sampling: Sampling, first_index: int) -> list[list[int]]:
        """Answer k of each row, continued from the turns before it (the generate/evaluation prompt)."""
        if not rows:
            return []
        prompts = answers.prompts_for([r.example for r in rows], [(i, k) for i in range(len(rows))],
                                      self.target.spec, self.eot)
        with jax.set_mesh(self.target.mesh):
            return generate_ids(self.target.params, self.target.graphdef, prompts,
                                max_new_tokens=self.max_new_tokens, stop_ids=(self.eot,), vocab=len(self.tokenizer),
                                sampling=sampling, seed=self.seed, mesh=self.target.mesh,
                                local_batch=self.local_batch, first_index=first_index)

    def answer_ids(self, example: Example, k: int) -> list[int]:
        built = prompts.Prompts(example, 0, self.target.spec, self.eot)
        return built.answer_ids(built.answers[k])


# -- reading the source ------------------------------------------------------------------------------------

def refuse_other_data(data: Path) -> None:
    """Valen, chat and vakforge records say so by their keys; refuse them with what to use instead."""
    problems = ProblemLog(str(data))
    first = next(iter_jsonl_objects(data, str(data), problems), None)
    if first is None or not isinstance(first[1], dict):
        return  # the VFlash reader reports it with its line
    keys = set(first[1])
    if {"questions", "request"} & keys:
        answers.refuse_family("valen", str(data))  # NotGenerated: scored, not generated; use predict
    if "messages" in keys or "turns" in keys:
        raise SystemExit(f"{data}: chat or vakforge records (keys {sorted(keys)}); regenerate rewrites VFlash "
                         "data for a block drafter; generate other answers with python -m valen_jax.generate")


def source_entries(data: Path, fmt: str) -> list[tuple[Entry, list[Path]]]:
    if fmt == "recipe":
        recipe = read_recipe(data)  # first: it refuses a file that is no bounded, valid recipe
        written = json.loads(read_file_capped(data).decode("utf-8-sig"))
        return [(Entry(e.name, dict(written[e.name]), e.root, e.dense_scale), list(e.annotation))
                for e in recipe]
    refuse_other_data(data)
    folder = data.parent.resolve()
    return [(Entry(data.stem, {"repeat_time": 1.0}, folder, None), [data.resolve()])]


def first_rows(regen: Regenerator, entry: Entry, annotation: Path, samples: int) -> tuple[list[Row], int]:
    """The rows of one annotation file (each record and its variants) and how many records had masks."""
    records = read_vflash(annotation, media_root=entry.root, dense_scale=entry.dense_scale)
    problems = ProblemLog(str(annotation))
    objects = dict(iter_jsonl_objects(annotation, str(annotation), problems))
    rows, masks = [], 0
    for record in records:
        obj = copy.deepcopy(objects[record.line])
        masks += obj.pop("atom_loss_masks", None) is not None
        record = replace(record, atom_loss_masks=None)
        example = regen.render(record, entry.name)  # the source itself: an error here is the data's
        count = len(prompts.answers(example, 0, regen.eot))
        if count != len(record.turns) // 2:
            raise SystemExit(f"{record.source}:{record.line}: {count} trained answers for {len(record.turns) // 2} "
                             "gpt turns")
        for variant in range(samples + 1):
            copied = copy.deepcopy(obj)
            if variant and "id" in copied:
                copied["id"] = f"{copied['id']}/sample-{variant}"
            rows.append(Row(entry, f"{record.source}:{record.line}", variant, copied, record, example, count))
    return rows, masks


# -- one round: answer k of every row that has one ---------------------------------------------------------

# A reason is counted by its wording: where it is (field, char offset), numbers and quoted text left out.
_PLACE = re.compile(r"^conversations\[\d+\]\.value: (at char \d+: )?")
_QUOTED = re.compile(r"'[^']*'")
_NUMBER = re.compile(r"\b\d+\b")


def skip(row: Row, k: int, kind: str, message: str, skips: list[Skip]) -> None:
    row.skipped = message
    reason = _NUMBER.sub("N", _QUOTED.sub("'…'", _PLACE.sub("", message)))
    skips.append(Skip(row.source, row.variant, k, f"{kind}: {reason}", message))


def regenerate_round(regen: Regenerator, rows: list[Row], k: int, scratch: Path, skips: list[Skip]) -> None:
    active = [r for r in rows if r.skipped is None and r.answers > k]
    greedy = [r for r in active if r.variant == 0]
    sampled = [r for r in active if r.variant > 0]
    generated = dict(zip(map(id, greedy), regen.decode(greedy, k, GREEDY, 0), strict=True))
    # Each round draws from its own streams: prompt g of round k is index k * len(rows) + g.
    generated.update(zip(map(id, sampled), regen.decode(sampled, k, regen.sampling, k * len(rows)), strict=True))
    changed = []
    for row in active:
        ids = generated[id(row)]
        if not ids or ids[-1] != regen.eot:
            skip(row, k, "unfinished", f"no end-of-turn within --max-new-tokens={regen.max_new_tokens}", skips)
            continue
        row.answer_turn(k)["value"] = tokens.decode(regen.tokenizer, ids, regen.eot)
        changed.append((row, ids))
    for entry in {id(r.entry): r.entry for r, _ in changed}.values():
        mine = [(r, ids) for r, ids in changed if r.entry is entry]
        for (row, ids), record in zip(mine, reread(entry, [r for r, _ in mine], k, scratch, skips), strict=True):
            if record is None:
                continue
            try:
                example = regen.render(record, entry.name)
            except RenderError as error:
                skip(row, k, "refused by the renderer", f"{error.field}: {error.message}", skips)
                continue
            if regen.answer_ids(example, k) != ids:
                skip(row, k, "retokenised", "the answer's text does not tokenise back to the generated tokens",
                     skips)
                continue
            row.record, row.example = record, example


def reread(entry: Entry, rows: list[Row], k: int, scratch: Path, skips: list[Skip]) -> list[VFlashRecord | None]:
    """Each row's rewritten record as the VFlash reader reads it, or None (skipped) where it refuses it."""
    path = scratch / f"{entry.file}-answer{k}.jsonl"
    path.write_text("".join(json.dumps(r.obj, ensure_ascii=False) + "\n" for r in rows))
    refused: dict[int, str] = {}
    try:
        records = read_vflash(path, media_root=entry.root, dense_scale=entry.dense_scale)
    except FormatError as error:
        for problem in error.problems:
            refused.setdefault(problem.line, f"{problem.field}: {problem.message}")
        if 0 in refused:
            raise SystemExit(f"{path}: {refused[0]}") from error
        kept = [r for n, r in enumerate(rows, 1) if n not in refused]
        path.write_text("".join(json.dumps(r.obj, ensure_ascii=False) + "\n" for r in kept))
        records = read_vflash(path, media_root=entry.root, dense_scale=entry.dense_scale) if kept else []
    out, read = [], iter(records)
    for line, row in enumerate(rows, 1):
        if line in refused:
            skip(row, k, "refused by the VFlash reader", refused[line], skips)
            out.append(None)
        else:
            out.append(next(read))
    return out


# -- the whole data ----------------------------------------------------------------------------------------

def regenerate(regen: Regenerator, data: Path, output: Path, *, samples: int = 0, fmt: str | None = None) -> Report:
    """Write the regenerated dataset of `data` to `output` (module docstring); the report of what was done."""
    data, output = Path(data).resolve(), Path(output).resolve()
    if output.exists():
        raise SystemExit(f"--output={output}: already exists; choose a new folder (nothing is overwritten)")
    fmt = fmt or ("recipe" if data.suffix == ".json" else "vflash")
    if fmt not in ("recipe", "vflash"):
        answers.refuse_family(fmt, str(data))  # valen gets its pointer; chat and vakforge their own line
        raise SystemExit(f"--format={fmt}: regenerate reads VFlash data (vflash or recipe)")
    entries, rows, masks, names = [], [], 0, set()
    for entry, files in source_entries(data, fmt):
        entry.file = _file_name(entry.name, names)
        for annotation in files:
            found, masked = first_rows(regen, entry, annotation, samples)
            entry.rows += found
            masks += masked
        entries.append(entry)
        rows += entry.rows
    skips: list[Skip] = []
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="regenerate-") as scratch:
            for k in range(max((r.answers for r in rows), default=0)):
                regenerate_round(regen, rows, k, Path(scratch), skips)
                log.info("answer %d regenerated: %d rows, %d skipped so far", k, len(rows), len(skips))
        if not any(r.skipped is None for r in rows):
            # Every record skipped: the reasons are the whole answer, so they are reported as on success.
            raise NothingRegenerated(data, Report(output, len(rows) // (samples + 1), 0, skips, masks,
                                                  [e.name for e in entries]))
        empty = write_dataset(staging, entries, regen, data, samples, skips)
        os.rename(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    written = sum(r.skipped is None for r in rows)
    return Report(output, len(rows) // (samples + 1), written, skips, masks, empty)


def _file_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^\w.-]", "_", name) or "entry"
    stem, n = base, 1
    while stem in taken:
        n += 1
        stem = f"{base}-{n}"
    taken.add(stem)
    return stem


def write_dataset(folder: Path, entries: list[Entry], regen: Regenerator, data: Path, samples: int,
                  skips: list[Skip]) -> list[str]:
    recipe, empty = {}, []
    for entry in entries:
        kept = [r for r in entry.rows if r.skipped is None]
        if not kept:
            empty.append(entry.name)
            continue
        name = f"{entry.file}.jsonl"
        (folder / name).write_text("".join(json.dumps(r.obj, ensure_ascii=False) + "\n" for r in kept))
        options = dict(entry.options, annotation=name, root=str(entry.root))
        if options.get("length") is not None:
            options["length"] = len(kept)
        recipe[entry.name] = options
    if not recipe:  # regenerate refuses this case before (NothingRegenerated)
        raise AssertionError(f"{data}: no entry kept a record")
    (folder / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    target = regen.target
    (folder / "regenerate.json").write_text(json.dumps({
        "data": str(data),
        "target": {"workdir": str(target.workdir), "step": target.step,
                   "params_identity": target.identity},
        "max_new_tokens": regen.max_new_tokens, "samples": samples,
        "sampling": {"temperature": regen.sampling.temperature, "top_k": regen.sampling.top_k,
                     "top_p": regen.sampling.top_p, "seed": regen.seed},
        "written": {e.name: sum(r.skipped is None for r in e.rows) for e in entries},
        "skipped": [s.__dict__ for s in skips],
    }, indent=2) + "\n")
    return empty
