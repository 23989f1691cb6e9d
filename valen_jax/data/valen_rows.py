"""Valen Example pieces → one row in `question` or `shared_state` mode (seed 000; DESIGN).

question mode: the state once, then one branch per candidate (instructions + candidate +
suffix); `branch_ids` let each branch attend to the prefix and itself only, and positions
restart after the prefix, so a branch's score equals that of the separate sequence
prefix + branch. The state's positions are those of the state as a sequence (M-RoPE: rope_index over
its media); every token after it is text, so it continues from the state's largest position + 1
(`positions.text_after`), which is what rope_index gives the state followed by that text alone. In training, unlabeled questions are skipped and a record without labels is
skipped whole (before its media is read).
shared_state mode: the state, then every question's instructions followed by all its
candidates in one causal sequence; each candidate is scored at its last token in one forward
pass. Unlabeled questions stay as context with no loss.
Training shuffles choice candidates together with their labels (a fresh order per epoch from
the rng); inference keeps the input order (seed 000 table).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from data_pipeline import examples as contract  # the Example fields (one declaration)
from data_pipeline.shards import Example
from valen_jax.data.assemble import (
    AssemblyError,
    RowSpec,
    batch_shapes_of,
    expand_slots,
    load_media,
    pad_positions,
    videos_of,
    vision_arrays,
)
from valen_jax.data.media_log import MediaLog, media_records
from valen_jax.data.packing import PackingSpec
from valen_jax.data.positions import text_after
from valen_jax.data.sources import Sources, mixture_of
from valen_jax.errors import ConfigError

MODES = ("question", "shared_state")
_CHOICE = 0


@dataclass(frozen=True)
class QuestionSpec:
    mode: str
    max_questions: int
    max_candidates: int
    training: bool

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"valen mode {self.mode!r}; choose one of {MODES}")

    @classmethod
    def from_config(cls, config, training: bool) -> QuestionSpec:
        data = config.data
        if data.valen_mode not in MODES:
            raise ConfigError(f"config.data.valen_mode={data.valen_mode!r}; choose one of {', '.join(MODES)}")
        for key in ("max_questions", "max_candidates"):
            if int(data[key]) < 1:
                raise ConfigError(f"config.data.{key}={data[key]} must be ≥ 1")
        return cls(data.valen_mode, int(data.max_questions), int(data.max_candidates), training)


def _pieces(ids: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _where(example: Example) -> str:
    return contract.where(example)


def has_labels(example: Example) -> bool:
    return bool(example.arrays["labeled"].any())


@dataclass(frozen=True)
class RowNeeds:
    """What one record's row needs: tokens, questions, candidates of its largest question, vision patches."""

    seq_len: int
    questions: int
    candidates: int
    patches: int

    def exceeded(self, spec: RowSpec, qspec: QuestionSpec) -> list[str]:
        """The limits this row exceeds, each as `data.KEY=VALUE < NEEDED`."""
        limits = (("seq_len", self.seq_len, spec.seq_len), ("max_questions", self.questions, qspec.max_questions),
                  ("max_candidates", self.candidates, qspec.max_candidates),
                  ("max_patches", self.patches, spec.max_patches))
        return [f"data.{key}={limit} < {needed}" for key, needed, limit in limits if needed > limit]


@dataclass(frozen=True)
class _Layout:
    """A record's row before padding: token pieces and each scored candidate's place."""

    tokens: list[np.ndarray]
    positions: list[np.ndarray]
    branch_ids: list[np.ndarray]
    questions: list[int]  # record question index of each row slot
    scored: list[tuple[int, int, int, int]]  # (slot, k, score position, candidate index in the record)
    media: list
    needs: RowNeeds


def _layout(example: Example, spec: RowSpec, qspec: QuestionSpec, rng: np.random.Generator | None,
            media: tuple[list, tuple] | None = None) -> _Layout:
    arrays = example.arrays
    where = _where(example)
    instructions = _pieces(arrays["instruction_ids"], arrays["instruction_offsets"])
    candidates = _pieces(arrays["candidate_ids"], arrays["candidate_offsets"])
    owner = arrays["candidate_question"]
    questions = [q for q in range(len(instructions))
                 if not (qspec.training and qspec.mode == "question" and not arrays["labeled"][q])]
    # Every media read of a Valen row goes through load_media (tests spy on it: seed 000's unread media).
    processed, infos = load_media(example, spec) if media is None else media
    state, _, runs = expand_slots(arrays["state_ids"], np.zeros(len(arrays["state_ids"]), np.float32), processed,
                                  spec, where, infos, videos_of(example))
    state_positions = spec.positions_of(state, runs)

    def after_state(start: int, count: int) -> np.ndarray:
        """Positions of `count` text tokens from row offset `start` (≥ len(state))."""
        return text_after(state_positions, start - len(state) + np.arange(count), spec.positions)

    suffix = arrays["suffix_ids"]
    tokens, positions, branch_ids = [state], [state_positions], [np.zeros(len(state), np.int32)]
    length = len(state)
    scored = []
    most = 0
    branch = 0
    for slot, q in enumerate(questions):
        members = np.flatnonzero(owner == q)
        most = max(most, len(members))
        if qspec.training and arrays["question_type"][q] == _CHOICE and rng is not None:
            members = rng.permutation(members)
        if qspec.mode == "shared_state":
            tokens.append(instructions[q])
            positions.append(after_state(length, len(instructions[q])))
            branch_ids.append(np.zeros(len(instructions[q]), np.int32))
            length += len(instructions[q])
        for k, c in enumerate(members):
            if qspec.mode == "question":
                branch += 1
                piece = np.concatenate([instructions[q], candidates[c], suffix])
                positions.append(after_state(len(state), len(piece)))
                branch_ids.append(np.full(len(piece), branch, np.int32))
            else:
                piece = candidates[c]
                positions.append(after_state(length, len(piece)))
                branch_ids.append(np.zeros(len(piece), np.int32))
            tokens.append(piece)
            length += len(piece)
            scored.append((slot, k, length - 1, int(c)))
    if qspec.mode == "shared_state":
        tokens.append(suffix)
        positions.append(after_state(length, len(suffix)))
        branch_ids.append(np.zeros(len(suffix), np.int32))
        length += len(suffix)
    needs = RowNeeds(length, len(questions), most, sum(m.num_tokens for m in processed))
    return _Layout(tokens, positions, branch_ids, questions, scored, processed, needs)


def row_needs(example: Example, spec: RowSpec, qspec: QuestionSpec) -> RowNeeds:
    """What `valen_row` would need for `example` (its media processed, as the row would be)."""
    return _layout(example, spec, qspec, None).needs


def valen_row(example: Example, spec: RowSpec, qspec: QuestionSpec, rng: np.random.Generator | None,
              media_log: MediaLog | None = None, overlong: str = "error") -> dict | None:
    """The padded row; a row that does not fit raises AssemblyError, or with `overlong="skip"` is None."""
    arrays = example.arrays
    where = _where(example)
    if qspec.training and not has_labels(example):
        raise AssemblyError(f"{where}: no labeled question; filter such records before assembly")
    loaded = load_media(example, spec)
    layout = _layout(example, spec, qspec, rng, loaded)
    exceeded = layout.needs.exceeded(spec, qspec)
    if exceeded:
        if overlong == "skip":
            return None
        raise AssemblyError(f"{where}: the {qspec.mode}-mode row does not fit: {'; '.join(exceeded)} "
                            "(a training run checks its whole set at start-up: valen_fit)")
    if media_log is not None and loaded[0]:
        media_log.write(media_records(where, contract.media_headers(example), loaded[0], loaded[1],
                                      spec.vision.merge_size, contract.meta_of(example).entry))
    length = layout.needs.seq_len
    shape = (qspec.max_questions, qspec.max_candidates)
    score_positions = np.zeros(shape, np.int32)
    branch_mask = np.zeros(shape, bool)
    labels = np.zeros(shape, np.float32)
    order_out = np.full(shape, -1, np.int32)  # candidate index in the record, for predictions
    for slot, k, position, c in layout.scored:
        score_positions[slot, k] = position
        branch_mask[slot, k] = True
        labels[slot, k] = arrays["labels"][c]
        order_out[slot, k] = c
    pad = spec.seq_len - length
    ids = np.concatenate(layout.tokens).astype(np.int32)
    questions = layout.questions
    labeled = np.zeros(qspec.max_questions, bool)
    labeled[: len(questions)] = arrays["labeled"][questions]
    return {
        "tokens": np.pad(ids, (0, pad), constant_values=spec.pad_id),
        # Valen trains the branch head only: no token is a language-model target.
        "targets": np.full(spec.seq_len, spec.pad_id, np.int32),
        "target_weights": np.zeros(spec.seq_len, np.float32),
        "positions": pad_positions(np.concatenate(layout.positions), spec.seq_len),
        "segment_ids": np.pad(np.ones(length, np.int32), (0, pad)),
        "branch_ids": np.pad(np.concatenate(layout.branch_ids), (0, pad)),
        "score_positions": score_positions, "branch_mask": branch_mask, "labels": labels, "labeled": labeled,
        "candidate_index": order_out,
        **vision_arrays(layout.media, spec, where),
    }


def valen_batch_shapes(spec: RowSpec, qspec: QuestionSpec, global_batch: int) -> dict:
    shapes = batch_shapes_of(spec, global_batch)
    grid = (global_batch, qspec.max_questions, qspec.max_candidates)
    per_question = (global_batch, qspec.max_questions)
    shapes.update({
        "branch_ids": jax.ShapeDtypeStruct((global_batch, spec.seq_len), np.int32),
        "score_positions": jax.ShapeDtypeStruct(grid, np.int32),
        "branch_mask": jax.ShapeDtypeStruct(grid, np.bool_),
        "labels": jax.ShapeDtypeStruct(grid, np.float32),
        "candidate_index": jax.ShapeDtypeStruct(grid, np.int32),
        "labeled": jax.ShapeDtypeStruct(per_question, np.bool_),
    })
    return shapes


def is_valen(sources: Sources) -> bool:
    formats = {shard_set.manifest.data["format"] for shard_set, _ in mixture_of(sources)}
    if "valen" in formats and len(formats) > 1:
        raise ValueError(f"a run mixes Valen with {sorted(formats - {'valen'})} shards; "
                         "mixing scored questions with token formats in one run is not supported")
    return formats == {"valen"}


@dataclass(frozen=True)
class ValenAssembly:
    """The Valen row assembly of `pipeline.build_dataset`: one row per record, never packed.

    In training a record with no labeled question is dropped before its media is read (seed 000:
    "its media is never read"). A record whose row does not fit is an error, or with
    `data.overlong=skip` dropped; the run reports both once at start-up (`valen_fit`), so the
    loader only applies that decision. Candidates are shuffled with the pipeline's per-example rng
    keyed by (seed, record, epoch), so a resumed run sees the same order as an uninterrupted one.
    """

    qspec: QuestionSpec
    overlong: str = "error"

    @classmethod
    def from_config(cls, config, training: bool) -> ValenAssembly:
        """Refuses (ConfigError naming the key) what Valen rows cannot honour, instead of ignoring it."""
        packing = PackingSpec.from_config(config)  # the values are checked as for any run
        if packing.packing != "none":
            # A question-mode row is one state with all its branches; packing states would need
            # branch ids and score slots per segment, which the model and loss do not have.
            raise ConfigError(f"config.data.packing={packing.packing!r}: Valen rows are never packed "
                              "(one record per row); set data.packing=none")
        if float(config.loss.z_loss) > 0:
            # z-loss regularises the token softmax; Valen rows have no token targets (seed 000).
            raise ConfigError(f"config.loss.z_loss={config.loss.z_loss}: Valen trains the branch head only and has "
                              "no token softmax to regularise; set loss.z_loss=0")
        if float(config.loss.weights.tokens) > 0:
            raise ConfigError(f"config.loss.weights.tokens={config.loss.weights.tokens}: Valen rows have no "
                              "token targets; set it to 0")
        # data.max_segments is honoured as is: every Valen row is one segment, within any cap ≥ 1.
        return cls(QuestionSpec.from_config(config, training), packing.overlong)

    def item(self, example, spec, *, training, rng, entry, media_log):
        if self.qspec.training and not has_labels(example):
            return None
        # A row that does not fit is None with overlong=skip: counted and reported once, at start-up (valen_fit).
        return valen_row(example, spec, self.qspec, rng if self.qspec.training else None, media_log, self.overlong)

    def rows(self, items, spec):
        return items

    def batch_shapes(self, spec, global_batch):
        return valen_batch_shapes(spec, self.qspec, global_batch)
