"""Train the small, deterministic byte-level BPE smoke tokenizer on the text of `data/smoke`.

Run from the repository root after `data/make_smoke.py` (re-running gives a byte-identical
`tokenizer.json`):

    .venv/bin/python data/make_tokenizer.py                  # reads data/smoke, writes data/tokenizer
    .venv/bin/python data/make_tokenizer.py --data data/smoke --out /tmp/tokenizer

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained("data/tokenizer")
    >>> tok.convert_ids_to_tokens(tok.encode("<robot_single_2d><0><1000></robot>"))
    ['<robot_single_2d>', '<0>', '<1000>', '</robot>']

Training text: every VFlash `human`/`gpt` turn with the number tokens `<0>`…`<1000>`, the
primitive tags, the media placeholder and the vision tokens removed (they become added tokens,
never BPE merges) and the ChatML role line of each turn (`user`/`assistant`), plus the Valen
state text, question instructions and criteria (candidate names and descriptions). The model is byte-level BPE (ByteLevel pre-tokenizer, decoder and
post-processor without offset trimming), so `decode(encode(text)) == text` for any string.

The result is a `transformers.PreTrainedTokenizerFast` with `<|endoftext|>` (pad),
`<|im_start|>` and `<|im_end|>` (eos) as special tokens, the primitive and vision tokens from
`data_pipeline.tokenizer.add_primitive_tokens`, and the ChatML training template with
`{% generation %}` markers (`data_pipeline.chat_templates.CHATML`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from data_pipeline import vocabulary  # noqa: E402
from data_pipeline.chat_templates import CHATML  # noqa: E402
from data_pipeline.tokenizer import add_primitive_tokens  # noqa: E402

VOCAB_SIZE = 1200  # BPE vocabulary before the added primitive/vision tokens (specials included)
MODEL_MAX_LENGTH = 32768
CHATML_ROLES = {"human": "user\n", "gpt": "assistant\n"}

_REMOVED = re.compile(
    "|".join(re.escape(t) for t in (vocabulary.IMAGE_PLACEHOLDER, *vocabulary.PRIMITIVE_TAGS,
                                     *vocabulary.VISION_TOKENS, *vocabulary.CHATML_SPECIAL_TOKENS))
    + r"|<\d+>"
)


def strip_primitives(text: str) -> str:
    """Drop number tokens, primitive tags and media/vision/control tokens from training text."""
    return _REMOVED.sub("", text)


def _message_texts(state: object) -> Iterator[str]:
    if isinstance(state, str):
        yield state
        return
    if isinstance(state, dict):
        for message in state.get("messages", []):
            content = message.get("content")
            if isinstance(content, str):
                yield content
            elif isinstance(content, list):
                for part in content:
                    if part.get("type") == "text":
                        yield part["text"]


def corpus(data_dir: Path) -> list[str]:
    """All training text of the smoke sets, in a fixed order (sorted file names, file order)."""
    texts: list[str] = []
    for path in sorted((data_dir / "vflash").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                for turn in json.loads(line)["conversations"]:
                    # the role line the ChatML template writes before each turn, then the turn text
                    texts.append(CHATML_ROLES[turn["from"]])
                    texts.append(strip_primitives(turn["value"]))
    for line in (data_dir / "valen" / "train.jsonl").read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        request = json.loads(line)["request"]
        texts.append("system\n")
        texts.extend(_message_texts(request["state"]))
        for question in request["questions"].values():
            texts.append(question["instructions"])
            criteria = question.get("criteria")
            if isinstance(criteria, dict):
                texts.extend(f"{name}: {description}" for name, description in criteria.items())
            elif isinstance(criteria, list):
                texts.extend(criteria)
    return [t for t in texts if t.strip()]


def train_backend(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel(add_prefix_space=False)
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(vocabulary.CHATML_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return backend


def build(data_dir: Path) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_backend(corpus(data_dir)),
        eos_token=vocabulary.IM_END,
        pad_token=vocabulary.END_OF_TEXT,
        additional_special_tokens=[vocabulary.IM_START],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    add_primitive_tokens(tok)
    tok.chat_template = CHATML
    return tok


def main(argv: list[str] | None = None) -> PreTrainedTokenizerFast:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/smoke", help="smoke data folder (from data/make_smoke.py)")
    parser.add_argument("--out", default="data/tokenizer", help="output folder for save_pretrained")
    args = parser.parse_args(argv)
    tok = build(Path(args.data))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    print(f"{out}: {len(tok)} tokens ({tok.backend_tokenizer.get_vocab_size(with_added_tokens=False)} BPE)")
    return tok


if __name__ == "__main__":
    main()
