"""Generate every assistant answer of a VFlash, chat or vakforge data file with a trained workdir (KV-cache
decoding); needs nothing but the workdir.

    python -m valen_jax.generate --workdir=runs/vflash-smoke --data=data/smoke/vflash/eval.jsonl \
        --output=runs/vflash-smoke/answers.jsonl [--max-new-tokens=64] [--temperature=0.7 --top-p=0.9 --seed=1]

Prompts are every turn before each trained assistant answer, as evaluation builds them (reference
turns included). One JSON line per answer, in data order (`valen_jax.evaluation.answers`): the record's
index, source line and id, the answer index, the generated text, its finish reason ("stop" |
"length") and token count; for VFlash the parsed primitives with coordinates dequantised to seed 004's
ranges (or the parse error), for chat and vakforge the parsed tool calls. Greedy unless `--temperature`
> 0; then `--top-k`/`--top-p` narrow the choice and `--seed` (default 0) fixes the draws: the same seed
gives the same file, on any number of processes. Valen data is scored, not generated: use
`python -m valen_jax.predict`. Model, tokenizer and defaults (`eval.max_new_tokens`, `eval.batch_size`,
`data.eval_format`) come from the checkpoint (the latest step unless `--step`).

In a notebook, `generate` runs an nnx Transformer on token-id prompts, or on strings and chat messages
with a tokenizer:

    from valen_jax.generate import generate
    texts = generate(model, ["What is 4 plus 23?"], tokenizer=tokenizer, max_new_tokens=16)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from data_pipeline.cli_flags import add_flag
from data_pipeline.cli_paths import exit_on_bad_paths
from data_pipeline.format_registry import FORMATS
from data_pipeline.tokenizer import end_of_turn_id
from valen_jax.cli import distributed
from valen_jax.cli import log_setup as cli_logging
from valen_jax.cli.boundary import error_boundary
from valen_jax.data.references import resolve_cli_data
from valen_jax.decoding.engine import generate_ids
from valen_jax.decoding.sampling import Sampling
from valen_jax.errors import EvaluationError
from valen_jax.evaluation import answers
from valen_jax.evaluation import workdir as eval_workdir
from valen_jax.run import decoding_layout, restore_model
from valen_jax.training import checkpoint


def generate_workdir(workdir: str | Path, data: str | Path, step: int | None = None, fmt: str | None = None, *,
                     max_new_tokens: int | None = None, sampling: Sampling = answers.GREEDY, seed: int = 0,
                     batch_size: int | None = None) -> list[dict]:
    """The answer lines of the workdir's checkpoint (latest unless `step`) on `data`, in data order."""
    restored = decoding_layout(restore_model(workdir, step))
    fmt, options = eval_workdir.data_format(restored, fmt)
    answers.refuse_family(FORMATS[fmt].family, str(data))  # before the data is converted
    with jax.set_mesh(restored.mesh):
        examples, family, _ = eval_workdir.load_examples(
            fmt, data, restored.workdir, checkpoint.tokenizer_dir(restored.workdir), restored.fingerprint, options)
        answers.refuse_family(family, str(data))  # a shard directory says its own format
        if not examples:
            raise EvaluationError(f"{data}: no records")
        return answers.generate_answers(restored, examples, family,
                                        max_new_tokens=int(max_new_tokens or restored.config.eval.max_new_tokens),
                                        sampling=sampling, seed=seed, batch_size=batch_size)


def _is_text(prompt) -> bool:
    """A string, or a list of chat messages (dicts with role and content)."""
    return isinstance(prompt, str) or (isinstance(prompt, list | tuple) and bool(prompt)
                                       and isinstance(prompt[0], dict))


def _prompt_ids(prompt, tokenizer, where: str) -> np.ndarray:
    """One library prompt as token ids: ids as given; a string as one user message; a message list
    through the tokenizer's chat template with the generation prompt."""
    if _is_text(prompt):
        if tokenizer is None:
            raise ValueError(f"{where}: text and chat-message prompts need tokenizer=")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return np.asarray(ids, np.int32)
    ids = np.asarray(prompt)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"{where}: a prompt is a non-empty list of token ids, a string or a list of chat "
                         f"messages; got {type(prompt).__name__} of shape {ids.shape}")
    return ids.astype(np.int32)


def generate(model, prompts: Sequence, *, tokenizer=None, max_new_tokens: int, sampling: Sampling | None = None,
             seed: int = 0, stop_ids: Sequence[int] | None = None) -> list:
    """Continue each prompt with `model` (an nnx Transformer) by KV-cache decoding.

    `prompts`: token-id lists, or with `tokenizer`, strings (one user message each) and chat message
    lists (`[{"role": "user", "content": "..."}]`), rendered by the tokenizer's chat template with the
    generation prompt. Greedy unless `sampling` says otherwise (`Sampling(temperature=0.7, top_p=0.9)`,
    drawn from `seed`). Stops at any of `stop_ids` (default: the template's end-of-turn token with a
    tokenizer, none without) or after `max_new_tokens`. Returns the texts (with a tokenizer; the stop
    token not written) or the generated id lists (the stop token kept).

        from flax import nnx
        from valen_jax.run import restore_model
        from valen_jax.generate import generate

        run = restore_model("runs/chat-smoke")  # python -m valen_jax.train --config=configs/chat.py:tiny --workdir=runs/chat-smoke
        model = nnx.merge(run.graphdef, run.params)
        print(generate(model, ["What is 4 plus 23?", [{"role": "user", "content": "And doubled?"}]],
                       tokenizer=run.tokenizer, max_new_tokens=16))
        print(generate(model, [[1, 2, 3]], max_new_tokens=4))  # token ids in, id lists out
    """
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    ids = [{"ids": (row := _prompt_ids(p, tokenizer, f"prompts[{i}]")),
            "positions": np.arange(len(row), dtype=np.int32)} for i, p in enumerate(prompts)]
    if stop_ids is None:
        stop_ids = (end_of_turn_id(tokenizer),) if tokenizer is not None else ()
    vocab = len(tokenizer) if tokenizer is not None else int(model.cfg.vocab_size)
    if vocab > int(model.cfg.vocab_size):
        raise ValueError(f"the tokenizer has {vocab} tokens, the model's embedding {model.cfg.vocab_size} rows: "
                         "not this model's tokenizer")
    out = generate_ids(params, graphdef, ids, max_new_tokens=int(max_new_tokens), stop_ids=tuple(stop_ids),
                       vocab=vocab, sampling=sampling or Sampling(), seed=int(seed))
    if tokenizer is None:
        return [list(map(int, row)) for row in out]
    stops = set(stop_ids)
    return [tokenizer.decode([t for t in row if t not in stops], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False) for row in out]


def sampling_of(args: argparse.Namespace) -> Sampling:
    """The sampling flags as one Sampling; a refused value names its flag."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens={args.max_new_tokens}: must be >= 1")
    try:
        return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        flags = f"--temperature={args.temperature} --top-k={args.top_k} --top-p={args.top_p}"
        raise SystemExit(f"{flags}: {error}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`; multi-word flags through `add_flag` (`--max-new-tokens`, or `--max_new_tokens`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--data", required=True,
                        help="VFlash/recipe, chat or vakforge JSONL, shard directory or registry reference")
    parser.add_argument("--output", required=True, help="answers.jsonl to write")
    parser.add_argument("--format", default=None, choices=sorted(FORMATS),
                        help="converter format of --data (default: the checkpoint's data.eval_format)")
    add_flag(parser, "--max-new-tokens", type=int, default=None,
             help="generation budget per answer (default: the checkpoint's eval.max_new_tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    add_flag(parser, "--top-k", type=int, default=0, help="0 (default): no limit")
    add_flag(parser, "--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_flag(parser, "--batch-size", type=int, default=None,
             help="default: the checkpoint's eval.batch_size")
    parser.add_argument("--registry", default=None,
                        help="registry URL for a --data reference (default: $VALEN_REGISTRY or the user cache)")
    parser.add_argument("--namespace", default=None, help="namespace of a --data reference written without one")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    sampling = sampling_of(args)
    exit_on_bad_paths(workdir=args.workdir, data=args.data, output=args.output)
    cli_logging.configure()
    with error_boundary("valen_jax.generate", paths=(args.workdir, args.data, args.output)):
        return _generate(args, sampling)


def _generate(args: argparse.Namespace, sampling: Sampling) -> int:
    """`main` after the flags were checked: generate, write, summarise."""
    distributed.initialize()  # a multi-process job (launch/): before any JAX backend use; else nothing
    data, _ = resolve_cli_data(args.data, args.registry, args.namespace)  # seed 003 references
    try:
        lines = generate_workdir(args.workdir, data, args.step, args.format, max_new_tokens=args.max_new_tokens,
                                 sampling=sampling, seed=args.seed, batch_size=args.batch_size)
    except answers.NotGenerated as error:  # Valen or prepared data: one line saying what to use instead
        print(f"error: {error}", file=sys.stderr)
        return 2
    answers.write_answers(lines, args.output)
    records = len({line["index"] for line in lines})
    stopped = sum(line["finish_reason"] == "stop" for line in lines)
    print(f"{args.output}: {len(lines)} answers of {records} records generated ({stopped} stopped, "
          f"{len(lines) - stopped} at the token limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
