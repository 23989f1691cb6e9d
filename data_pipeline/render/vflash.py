"""VFlash record → Example (seed 004, "Data Format").

Arrays of the Example:
- `input_ids` int32 [T]: the templated conversation; each `<image>` becomes
  `<|vision_start|><|image_pad|><|vision_end|>`, one pad token per media slot, which the
  loader expands to the processor's vision-token count (DESIGN: assemble at load time).
- `target_weights` float32 [T]: loss weight of token t as a prediction target: 1 on assistant
  tokens (end-of-turn included), 0 elsewhere, 0 on coordinates that `atom_loss_masks` removes.
- `primitive_spans` int32 [N, 3]: (kind id, first token, one past last token) of every
  primitive with coordinates, start and end tags included (the drafter's blocks).
- `primitive_blocks` int32 [N, 3]: per primitive of `primitive_spans`, the `atomic_decoding` call
  that announces it (index within the record, -1 for none: points and boxes), that call's
  `block_size` and its `count` (0 when absent); a dual-arm pair shares one call and one block.
- `media_{i}` uint8: original bytes of the i-th media item; digests in the header.
Meta `dense_scale`: the dataset's dense-motion scale `s` (m), present when the record's dataset
states one; a record with `<dense>` answers and no scale is refused. The fields, dtypes and
encodings (PRIMITIVE_KINDS) are declared in `data_pipeline.examples` (kind `tokens`).
"""

from __future__ import annotations

import hashlib

import numpy as np
from transformers import PreTrainedTokenizerBase

from data_pipeline import examples, vocabulary
from data_pipeline.examples import PRIMITIVE_KINDS
from data_pipeline.formats.media_decode import bytes_problem
from data_pipeline.formats.vflash import VFlashRecord
from data_pipeline.render.common import (
    ChatTemplater,
    ControlTokenGuard,
    MediaBlob,
    RenderError,
    mask_runs,
    read_media,
    render_chat,
)
from data_pipeline.render.lmdb_media import LmdbMediaError, read_lmdb_value
from data_pipeline.shards import Example
from data_pipeline.tokenizer import token_id

_START_TAG_KIND = {
    "<point>": "point", "<box>": "box", "<drive>": "drive", "<dense>": "dense",
    **{tag: tag[1:-1] for tag in vocabulary.ROBOT_START_TAGS},
}
_END_TAGS = ("</point>", "</box>", "</robot>", "</drive>", "</dense>")
_MEDIA_SLOT = vocabulary.VISION_START + vocabulary.IMAGE_PAD + vocabulary.VISION_END


class VFlashRenderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.start_kind = {token_id(tokenizer, tag): kind for tag, kind in _START_TAG_KIND.items()}
        self.end_ids = {token_id(tokenizer, tag) for tag in _END_TAGS}
        numbers = [token_id(tokenizer, t) for t in vocabulary.NUMBER_TOKENS]
        self.number_ids = np.asarray(numbers, dtype=np.int32)
        self.image_pad_id = token_id(tokenizer, vocabulary.IMAGE_PAD)
        # Answers write the atomic_decoding call as ordinary text (seed 004); nothing else structural.
        self._guard = ControlTokenGuard(tokenizer, allowed=frozenset({"<tool_call>", "</tool_call>"}))

    def render(self, record: VFlashRecord, entry: str) -> Example:
        for i, turn in enumerate(record.turns):
            self._guard.refuse(record.source, record.line, f"conversations[{i}].value", turn.text)
        messages = [
            {"role": "user" if turn.role == "human" else "assistant",
             "content": turn.text.replace(vocabulary.IMAGE_PLACEHOLDER, _MEDIA_SLOT)}
            for turn in record.turns
        ]
        chat = render_chat(self.tokenizer, messages, record.source, record.line)
        self._guard.refuse_formed(record.source, record.line, messages, chat.text,
                                  lambda fenced: ChatTemplater(self.tokenizer).render_text(fenced),
                                  lambda i: f"conversations[{i}].value")
        ids = chat.input_ids
        slots = int((ids == self.image_pad_id).sum())
        if slots != len(record.media):
            raise RenderError(record.source, record.line, "image",
                              f"{slots} media slots after templating, {len(record.media)} media items")
        weights = chat.assistant_mask.astype(np.float32)
        spans = self._primitive_spans(ids, chat.assistant_mask, record)
        self._apply_atom_masks(ids, weights, spans, record)
        media = [self._media(m, record) for m in record.media]
        arrays = {
            "input_ids": ids,
            "target_weights": weights,
            "primitive_spans": np.asarray([(PRIMITIVE_KINDS.index(k), s, e) for k, s, e, _ in spans],
                                          dtype=np.int32).reshape(-1, 3),
            "primitive_blocks": _primitive_blocks(record),
        }
        arrays.update(examples.media_arrays([blob.data for blob in media]))
        if record.dense_scale is None and any(p.kind == "dense" for turn in record.primitives for p in turn):
            # Dense tokens mean metres only for a stated scale s (seed 004); evaluation needs it.
            raise RenderError(record.source, record.line, "conversations",
                              "<dense> motion needs the dataset's scale s in metres: set dense_scale in the "
                              "recipe entry, or the converter option dense_scale for a plain VFlash file")
        return examples.build(examples.TOKENS, arrays, format="vflash", source=record.source, line=record.line,
                              entry=entry, media=[blob.header() for blob in media],
                              answers=[t.text for t in record.turns if t.role == "gpt"],
                              dense_scale=record.dense_scale, record_id=record.record_id)

    @staticmethod
    def _media(ref, record) -> MediaBlob:
        if ref.kind != "lmdb":
            return read_media(ref.path, ref.kind, ref.frame_index, ref.resize, ref.written)
        # The value's bytes travel in the shard like any image: shards never point back at the LMDB.
        try:
            data = read_lmdb_value(ref.path, ref.lmdb_key)
        except LmdbMediaError as err:
            raise RenderError(record.source, record.line, "image", str(err)) from err
        digest = hashlib.sha256(data).hexdigest()
        # The value is the image the loader decodes; validation checks image files, the values only here.
        why = bytes_problem(data, digest)
        if why is not None:
            raise RenderError(record.source, record.line, "image",
                              f"{ref.path}: the value of LMDB key {ref.lmdb_key!r} is not an image Pillow can "
                              f"decode ({why}); the training loader would stop on it")
        return MediaBlob(data, digest, "lmdb", f"{ref.written}#{ref.lmdb_key}", None, ref.resize,
                         lmdb_key=ref.lmdb_key)

    def _primitive_spans(self, ids, assistant_mask, record) -> list[tuple[str, int, int, np.ndarray]]:
        """Find every primitive in the assistant tokens; they must match the parsed answer."""
        spans = []
        for start, stop in mask_runs(assistant_mask):
            position = start
            while position < stop:
                kind = self.start_kind.get(int(ids[position]))
                if kind is None:
                    position += 1
                    continue
                end = position + 1
                while end < stop and int(ids[end]) not in self.end_ids:
                    end += 1
                if end == stop:
                    raise RenderError(record.source, record.line, "conversations",
                                      f"primitive <{kind}> is not closed within its assistant turn")
                inner = np.arange(position + 1, end)
                numbers = inner[np.isin(ids[inner], self.number_ids)]
                spans.append((kind, position, end + 1, numbers))
                position = end + 1
        expected = [p.kind for turn in record.primitives for p in turn if p.values]
        found = [kind for kind, *_ in spans]
        if found != expected:
            raise RenderError(record.source, record.line, "conversations",
                              f"tokenised primitives {found} differ from the parsed answer {expected}; "
                              "is every number token and tag a single token?")
        return spans

    def _apply_atom_masks(self, ids, weights, spans, record) -> None:
        if record.atom_loss_masks is None:
            return
        # Seed 004: one mask string per primitive, one 0/1 per coordinate token; 0 drops the loss.
        for index, ((_, _, _, numbers), mask) in enumerate(zip(spans, record.atom_loss_masks, strict=True)):
            if len(mask) != len(numbers):
                raise RenderError(record.source, record.line, f"atom_loss_masks[{index}]",
                                  f"{len(mask)} flags for {len(numbers)} coordinate tokens")
            keep = np.frombuffer(mask.encode("ascii"), dtype=np.uint8) == ord("1")
            weights[numbers[~keep]] = 0.0


def _primitive_blocks(record: VFlashRecord) -> np.ndarray:
    """(call index, block_size, count) for each primitive with coordinates, in answer order."""
    rows = []
    call_index = 0
    for primitives, calls in zip(record.primitives, record.calls or [()] * len(record.primitives), strict=True):
        announced = {}
        for call in calls:
            for covered in call.covers:
                announced[covered] = (call_index, call.block_size, call.count or 0)
            call_index += 1
        rows.extend(announced.get(i, (-1, 0, 0)) for i, primitive in enumerate(primitives) if primitive.values)
    return np.asarray(rows, dtype=np.int32).reshape(-1, 3)
