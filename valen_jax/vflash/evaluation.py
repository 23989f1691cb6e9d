"""Evaluation of a `vflash` workdir (issue 16): its block drafter and the frozen target it was trained
against, decoding every example's last trained answer target-only and speculatively (greedy).

    python -m valen_jax.evaluate --workdir=runs/vflash-drafter --data=data/smoke/vflash/eval.jsonl \
        --output=runs/vflash-drafter/eval/report.json

The drafter's checkpoint names its target (meta.drafter.target: workdir, step, params_identity); that step
of that workdir is restored and its params' identity must be the recorded one (`valen_jax.run`): a
target retrained or replaced since is refused, naming both. The report holds
- `ar`: the target's own VFlash report (teacher-forced loss/accuracy, greedy generation, geometry per
  recipe entry), exactly what evaluating the target workdir on the same data gives
  (`evaluation.vflash`, engine greedy decoding);
- `speculative`: the same generation and geometry metrics from the speculative outputs, `identical` (the
  fraction of answers equal to the target-only greedy answer token for token: 1.0 under greedy, anything
  else is a bug and the evaluation fails), and per recipe entry and overall the block metrics of
  `metrics.speculative.BlockSums`: tau (its convention in `tau_convention`: the bonus token included),
  per-position acceptance 1..B, the histogram of accepted draft tokens 0..B over verify passes, and
  ms/token of whole answers target-only (the compiled engine, each answer alone) vs speculative (the
  decode loop with the drafter, each answer alone) with their ratio, timed in this run after an untimed
  warm-up pass over every answer (compilation).
`from_call=True` (`--from-call`) also decodes, beside the target's own answers, prompts that run to the
reference answer's `atomic_decoding` call, so every reference block is drafted whatever the target
writes before it (`speculative.from_call`: blocks and identity only; a target that never writes the call
itself, e.g. a short smoke run, has no block to draft otherwise).

Runs in one process: rows are decoded one at a time (`SpeculativeDecoder.generate`, one compiled loop
per answer; batching rows is `generate_batch`, not used here so that each answer is timed alone), on
one device; the sums are nonetheless `GroupedSums` added across processes. Cost: the
decoding runs twice (warm-up, timed); on CPU, the 16-answer smoke eval set with a 400-step target and
a B = 16 drafter took about 4 minutes at --max-new-tokens=160 with --from-call.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import numpy as np

from data_pipeline import examples as contract
from data_pipeline.primitives import AtomicCalls
from data_pipeline.shards import Example
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.decoding.engine import GREEDY, generate_ids
from valen_jax.decoding.speculative import BlockStats, CachedDrafter, SpeculativeDecoder
from valen_jax.errors import EvaluationError
from valen_jax.evaluation import hosts, prompts, tokens, vflash
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.evaluation.options import Options
from valen_jax.evaluation.workdir import local_batch_size
from valen_jax.run import DrafterRun, ModelRun, decoding_layout, restore_drafter
from valen_jax.training import checkpoint
from valen_jax.vflash.metrics import TAU_CONVENTION, BlockSums

log = logging.getLogger(__name__)


class LossyDecoding(RuntimeError):
    """Greedy speculative output differs from target-only greedy: a decoder bug, never a metric."""


# -- prompts -------------------------------------------------------------------------------------------

@dataclass
class Answer:
    index: int  # into the data's examples
    entry: str | None
    prompt: dict  # prompts.Prompts.prompt: ids, positions, vision


def own_prompts(examples: list[Example], mine: list[int], target: ModelRun) -> list[Answer]:
    """The prompts `vflash.greedy_answers` continues (each example's last answer, from the turns before it)."""
    eot = end_of_turn_id(target.tokenizer)
    found = []
    for i in mine:
        built = prompts.Prompts(examples[i], i, target.spec, eot)
        found.append(Answer(i, contract.meta_of(examples[i]).entry, built.prompt(built.last())))
    return found


def call_prompts(examples: list[Example], mine: list[int], target: ModelRun, calls: AtomicCalls) -> list[Answer]:
    """Prompts through the reference's first `atomic_decoding` call in each example's last answer; an
    answer that announces no block has nothing to draft and is left out (counted by the caller)."""
    eot = end_of_turn_id(target.tokenizer)
    found = []
    for i in mine:
        built = prompts.Prompts(examples[i], i, target.spec, eot)
        prompt = built.prompt(built.last(), calls)
        if prompt is not None:
            found.append(Answer(i, contract.meta_of(examples[i]).entry, prompt))
    return found


# -- decoding ------------------------------------------------------------------------------------------

@dataclass
class Decoded:
    target_only: list[int]
    speculative: list[int]
    blocks: BlockStats
    target_only_block_tokens: int
    target_only_seconds: float  # the whole answer, prompt to end, by the engine
    speculative_seconds: float  # the same answer by the speculative decode loop (one program per answer)


class PairDecoder:
    """Decodes one prompt target-only and speculatively with the run's drafter, greedy.

    Target-only: `engine.generate_ids` on the prompt alone (the decode loop without a drafter).
    Speculative: `decoding.speculative` (`CachedDrafter`: the drafter's context cached), the same loop
    with the drafter: the whole answer in one program, so both are timed prompt to end."""

    def __init__(self, run: DrafterRun):
        target = run.target
        self.vocab, self.eot = len(target.tokenizer), end_of_turn_id(target.tokenizer)
        self.calls = AtomicCalls(target.tokenizer)
        self.target = target
        self.drafter = CachedDrafter(run.graphdef, run.params, self.vocab)

    def _engine(self, prompt: dict, max_new_tokens: int) -> tuple[list[int], float]:
        started = time.perf_counter()  # generate_ids reads its result back: the time is the device's too
        out = generate_ids(self.target.params, self.target.graphdef, [prompt], max_new_tokens=max_new_tokens,
                           stop_ids=(self.eot,), vocab=self.vocab)[0]
        return [int(t) for t in out], time.perf_counter() - started

    def decode(self, prompt: dict, max_new_tokens: int) -> Decoded:
        target = self.target
        target_only, whole = self._engine(prompt, max_new_tokens)
        spans = self.calls.announced_spans(prompt["ids"], target_only)
        inside = sum(min(stop, len(target_only)) - start for start, stop, _ in spans)  # block tokens written
        speculative = SpeculativeDecoder(target.graphdef, target.params, calls=self.calls, vocab=self.vocab,
                                         stop_ids=(self.eot,), sampling=GREEDY)
        drafted = speculative.generate(dict(prompt), self.drafter, max_new_tokens=max_new_tokens)
        return Decoded(target_only, drafted, speculative.stats, inside, whole, speculative.timing.seconds)


def decode_all(decoder: PairDecoder, answers: list[Answer], room: list[int], max_new_tokens: int) -> list[Decoded]:
    """Every answer decoded twice: an untimed warm-up pass (it compiles each shape the timed pass meets),
    then the timed pass, whose outputs must repeat the warm-up's (greedy is deterministic)."""
    budgets = [min(int(max_new_tokens), r) for r in room]
    warm = [decoder.decode(a.prompt, b) for a, b in zip(answers, budgets, strict=True)]
    timed = [decoder.decode(a.prompt, b) for a, b in zip(answers, budgets, strict=True)]
    for answer, first, second in zip(answers, warm, timed, strict=True):
        if (first.target_only, first.speculative) != (second.target_only, second.speculative):
            raise LossyDecoding(f"example {answer.index}: a second greedy decoding gave other tokens")
    return timed


# -- the report ----------------------------------------------------------------------------------------

def _rooms(answers: list[Answer], target: ModelRun) -> list[int]:
    # As tokens.greedy: a row stops where prompt + generated reach the row length.
    return [target.spec.seq_len - len(a.prompt["ids"]) for a in answers]


def _block_report(run: DrafterRun, answers: list[Answer], references: list[list[int]], decoded: list[Decoded]
                  ) -> tuple[dict, list[str]]:
    """(block metrics and identity, summed over processes; the answers whose outputs differ)."""
    stats = BlockSums(run.cfg.block_size)
    lossy = []
    for answer, reference, d in zip(answers, references, decoded, strict=True):
        reference = [int(t) for t in reference]
        identical = d.speculative == reference
        if not identical or d.target_only != reference:
            lossy.append(f"example {answer.index}: engine greedy {reference}, the engine on it alone {d.target_only}, "
                         f"speculative {d.speculative}")
        stats.add(d.blocks, identical=identical, target_only_block_tokens=d.target_only_block_tokens,
                  answer_tokens=len(d.target_only), target_only_seconds=d.target_only_seconds,
                  speculative_seconds=d.speculative_seconds, entry=answer.entry)
    return hosts.sum_stats(stats).report(), lossy


def evaluate(run: DrafterRun, examples: list[Example], options: Options, *, from_call: bool = False) -> dict:
    """The report's `ar` and `speculative` parts (module docstring); call inside `jax.set_mesh(run.target.mesh)`.
    Raises LossyDecoding when a speculative answer differs from target-only greedy."""
    if jax.process_count() > 1:
        raise ValueError("speculative evaluation runs in one process (rows are decoded one at a time, by programs "
                         f"that {jax.process_count()} processes could not enter together)")
    target = run.target
    mine = hosts.local_indices(len(examples))
    forced = tokens.teacher_forced(target.params, target.graphdef, examples, target.spec, target.mesh,
                                   options.batch_size)
    engine = vflash.greedy_answers(target, examples, options)
    ar = {**forced, **vflash.answers_report(target, examples, engine, options)}

    decoder = PairDecoder(run)
    answers = own_prompts(examples, mine, target)
    started = time.perf_counter()
    decoded = decode_all(decoder, answers, _rooms(answers, target), options.max_new_tokens)
    blocks, lossy = _block_report(run, answers, engine, decoded)
    log.info("decoded %d answers target-only and speculatively twice (warm-up, timed) in %.1f s", len(answers),
             time.perf_counter() - started)
    speculative = {**vflash.answers_report(target, examples, [d.speculative for d in decoded], options),
                   "identical": blocks["overall"]["identical"], "tau_convention": TAU_CONVENTION, "blocks": blocks}
    if from_call:
        speculative["from_call"], more = _from_call(run, decoder, examples, mine, options)
        lossy += more
    if lossy:
        raise LossyDecoding(f"{len(lossy)} greedy answer(s) differ from target-only greedy decoding (a decoder "
                            "bug: greedy speculative decoding is exact):\n" + "\n".join(lossy[:5]))
    return {"ar": ar, "speculative": speculative}


def _from_call(run: DrafterRun, decoder: PairDecoder, examples: list[Example], mine: list[int], options: Options
               ) -> tuple[dict, list[str]]:
    """Blocks and identity on prompts through the reference's atomic_decoding call (module docstring)."""
    target = run.target
    answers = call_prompts(examples, mine, target, decoder.calls)
    local_batch = local_batch_size(options.batch_size, target.mesh)
    engine = tokens.greedy(target.params, target.graphdef, [a.prompt for a in answers], target.spec, target.mesh,
                           local_batch, hosts.batch_count(len(answers), local_batch), options.max_new_tokens,
                           decoder.eot, decoder.vocab)
    decoded = decode_all(decoder, answers, _rooms(answers, target), options.max_new_tokens)
    blocks, lossy = _block_report(run, answers, engine, decoded)
    without = int(hosts.sum_array(np.asarray([len(mine) - len(answers)]))[0])
    return {"answers_without_call": without, "identical": blocks["overall"]["identical"], "blocks": blocks}, lossy


def evaluate_workdir(workdir: str | Path, data: str | Path, step: int | None = None, fmt: str | None = None, *,
                     mode: str | None = None, max_examples: int | None = None, batch_size: int | None = None,
                     max_new_tokens: int | None = None, samples: int | None = 8, from_call: bool = False) -> dict:
    """The report of a vflash workdir's drafter (latest step unless `step`) on `data`, options as
    `evaluate.run`'s; the data's format and the decoding defaults are the target's, so `ar` is exactly the
    target workdir's own report."""
    run = restore_drafter(workdir, step)
    target = decoding_layout(run.target)
    run = replace(run, target=target)
    fmt, converter_options = eval_workdir.data_format(target, fmt)
    with jax.set_mesh(target.mesh):
        examples, family, available = eval_workdir.load_examples(
            fmt, data, run.workdir, checkpoint.tokenizer_dir(run.workdir), target.fingerprint, converter_options,
            max_examples)
        if family != "vflash":
            raise EvaluationError(f"{data}: {family} data; a drafter (vflash workdir {run.workdir}) is evaluated on "
                             "VFlash data, whose answers announce primitive blocks")
        if not examples:
            raise EvaluationError(f"{data}: no examples to evaluate")
        eval_cfg = target.config.eval
        options = Options(batch_size=int(batch_size or eval_cfg.batch_size),
                          max_new_tokens=int(max_new_tokens or eval_cfg.max_new_tokens), mode=mode, samples=samples)
        parts = evaluate(run, examples, options, from_call=from_call)
    return {"data": str(data), "format": family, "task": target.config.task, "step": run.step,
            "examples": len(examples), "examples_in_data": available,
            "drafter": {"workdir": str(run.workdir), "step": run.step, "block_size": run.cfg.block_size,
                        "target": run.record},
            **parts}


def summary(report: dict) -> str:
    blocks = report["speculative"]["blocks"]["overall"]
    tau, speedup = blocks["tau"], blocks["speedup"]
    return (f"identical {report['speculative']['identical']:.3f}, tau {'n/a' if tau is None else f'{tau:.2f}'} "
            f"over {blocks['passes']} verify passes, speed-up in blocks "
            f"{'n/a' if speedup is None else f'{speedup:.2f}x'}; target: {vflash.summary(report['ar'])}")
