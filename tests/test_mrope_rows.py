"""Loader rows for imported Qwen-VL models equal what transformers gives the same data: the token ids of
the HF processor's text expansion (`replace_image_token` / `replace_video_token` / the pad-only
replacement of `get_text_with_replacements`; the video processor itself needs torchvision, which is not
installed, so the grids are ours, held to HF's by tests/test_processor_parity.py), and the M-RoPE
positions of `get_rope_index` on those ids, for each family: images and a video in one token row,
packed rows (each segment as its own sequence), and Valen rows (each branch as state + that branch)."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from data_pipeline.formats.valen import read_valen  # noqa: E402
from data_pipeline.render.valen import ValenRenderer  # noqa: E402
from data_pipeline.shards import Example  # noqa: E402
from data_pipeline.tokenizer import load_tokenizer  # noqa: E402
from tests.train_runs import ROOT  # noqa: E402
from tests.vl_checkpoints import FAMILIES  # noqa: E402
from valen_jax.data.assemble import RowSpec, assemble, expand_media_slots, load_media  # noqa: E402
from valen_jax.data.packing import piece_of, row_of  # noqa: E402
from valen_jax.data.valen_rows import QuestionSpec, valen_row  # noqa: E402
from valen_jax.data.vision_processor import resolve_media_kwargs  # noqa: E402
from valen_jax.models import hf_vl  # noqa: E402

# A 3.5 s clip at 6 fps: fps 2 would sample 7 frames, max_frames 4 keeps linspace(0, 20, 4).round().
CLIP_FRAMES, CLIP_FPS, CLIP_INDICES = 21, 6, (0, 7, 13, 20)
SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_SLOT = "<|vision_start|><|video_pad|><|vision_end|>"
PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _mp4(path) -> bytes:
    import av

    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=CLIP_FPS)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.options = {"preset": "ultrafast", "threads": "1"}
        for index in range(CLIP_FRAMES):
            frame = np.full((48, 64, 3), 10 * index, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path.read_bytes()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, vl_checkpoint, tmp_path_factory):  # noqa: F811
    """(family, tokenizer, RowSpec, HF model, checkpoint info, clip bytes) of a tiny checkpoint."""
    directory, info = vl_checkpoint(request.param)
    tokenizer = load_tokenizer(directory)
    cfg = hf_vl.config_from_hf(json.loads((directory / "config.json").read_text()))
    media_kwargs = resolve_media_kwargs({}, directory)[0]  # the checkpoint's own processor settings
    spec = RowSpec.of(512, 1024, tokenizer, cfg, media_kwargs)
    model = getattr(transformers, info["model_class"]).from_pretrained(directory).eval()
    clip = _mp4(tmp_path_factory.mktemp("clip") / "clip.mp4")
    return SimpleNamespace(name=request.param, tokenizer=tokenizer, spec=spec, model=model, info=info, clip=clip)


def _example(f, text: str, media: list[tuple[str, bytes]], line: int = 1) -> Example:
    arrays = {"input_ids": np.asarray(f.tokenizer(text)["input_ids"], np.int32)}
    arrays["target_weights"] = np.ones(len(arrays["input_ids"]), np.float32)
    headers = []
    for index, (kind, data) in enumerate(media):
        arrays[f"media_{index}"] = np.frombuffer(data, np.uint8)
        headers.append({"kind": kind, "path": f"m{index}", "sha256": "x", "frame_index": None, "resize": None})
    return Example(arrays, {"source": "rows.jsonl", "line": line, "media": headers})


def _mixed(f, line: int = 1) -> tuple[Example, str]:
    """Text, an image, the clip, a second image of another aspect; and the same prompt as the HF chat template
    writes it (the shard holds one image pad per slot; the template writes a video's as <|video_pad|>)."""
    parts = ["Look at this", SLOT, "then the clip", SLOT, "and this one", SLOT, "What changed?"]
    example = _example(f, " ".join(parts), [("path", _png(64, 48, line)), ("video", f.clip),
                                            ("path", _png(40, 80, line + 1))], line)
    parts[3] = VIDEO_SLOT
    return example, " ".join(parts)


def _metadata(info):
    from transformers.video_utils import VideoMetadata

    # What HF's PyAV reader and frame sampling report for the clip (stated, not read back from our loader).
    assert (info.frame_indices, info.total_frames, info.video_fps) == (CLIP_INDICES, CLIP_FRAMES, CLIP_FPS)
    return VideoMetadata(total_num_frames=CLIP_FRAMES, fps=float(CLIP_FPS), frames_indices=list(CLIP_INDICES))


def _hf_ids(f, text: str, image_grids, video_grids, metadata) -> np.ndarray:
    """The HF processor's input_ids for `text`: its own replacement strings, substituted for the image and
    video pad tokens only (as `ProcessorMixin.get_text_with_replacements` does), then its tokenizer."""
    processor = getattr(transformers, PROCESSORS[f.name])
    geometry = SimpleNamespace(merge_size=f.info["merge_size"], temporal_patch_size=f.info["temporal_patch_size"])
    this = SimpleNamespace(image_processor=geometry, video_processor=geometry, image_token="<|image_pad|>",
                           video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                           vision_end_token="<|vision_end|>",
                           all_special_multimodal_tokens=["<|image_pad|>", "<|video_pad|>"])
    this._calculate_timestamps = lambda *args: processor._calculate_timestamps(this, *args)
    images = [processor.replace_image_token(this, {"image_grid_thw": np.asarray(image_grids)}, i)
              for i in range(len(image_grids))]
    videos = [processor.replace_video_token(this, {"video_grid_thw": np.asarray(video_grids),
                                                   "video_metadata": metadata}, i) for i in range(len(video_grids))]
    (expanded,), _ = transformers.ProcessorMixin.get_text_with_replacements(this, [text], images, videos)
    return np.asarray(f.tokenizer(expanded)["input_ids"])


def _hf_positions(f, ids, image_grids, video_grids, metadata) -> np.ndarray:
    """transformers' get_rope_index on one sequence → [T, 3]."""
    kind = np.where(ids == f.info["image_token_id"], 1, np.where(ids == f.info["video_token_id"], 2, 0))
    extra = {}
    if f.name == "qwen2_5_vl" and video_grids:
        # Qwen2_5_VLProcessor._process_videos: temporal_patch_size / sampled_fps, a float32 tensor.
        extra["second_per_grid_ts"] = torch.tensor([f.info["temporal_patch_size"] / m.sampled_fps for m in metadata])
    image_thw, video_thw = (torch.tensor(grids) if grids else None for grids in (image_grids, video_grids))
    positions, _ = f.model.model.get_rope_index(torch.tensor(ids[None]), torch.tensor(kind[None]), image_thw,
                                                video_thw, **extra)
    return positions[:, 0].numpy().T


def _grids(media, videos):
    images = [list(m.grid) for m, video in zip(media, videos, strict=True) if not video]
    return images, [list(m.grid) for m, video in zip(media, videos, strict=True) if video]


def test_token_row_ids_and_positions_equal_the_hf_processor_and_rope_index(family):
    f = family
    example, hf_text = _mixed(f)
    expanded = expand_media_slots(example, f.spec)
    image_grids, video_grids = _grids(expanded.media, [False, True, False])
    metadata = [_metadata(expanded.media_info[1])]
    expected_ids = _hf_ids(f, hf_text, image_grids, video_grids, metadata)
    np.testing.assert_array_equal(expanded.ids, expected_ids)
    video_pads = int((expanded.ids == f.info["video_token_id"]).sum())
    assert video_pads == np.prod(video_grids[0]) // 4 and video_grids[0][0] == 2  # two temporal patches
    if f.name == "qwen3_vl":  # one timestamp and its own start/end per temporal patch, inside the template's pair
        assert f.tokenizer.decode(expanded.ids).count(" seconds>") == 2

    expected = _hf_positions(f, expected_ids, image_grids, video_grids, metadata)
    row = assemble(example, f.spec)
    length = len(expected_ids) - 1
    assert row["positions"].shape == (f.spec.seq_len, 3)
    np.testing.assert_array_equal(row["tokens"][:length], expected_ids[:-1])
    np.testing.assert_array_equal(row["positions"][:length], expected[:-1])
    assert not row["positions"][length:].any()
    if f.name == "qwen2_5_vl":  # the frames' time positions are 3 apart (int(3.5)), not 1 as in Qwen2-VL
        video = expected[expected_ids == f.info["video_token_id"]]
        assert sorted(set(video[:, 0] - video[:, 0].min())) == [0, 3]


def test_packed_segments_each_get_their_own_sequence_positions(family):
    f = family
    first, first_text = _mixed(f, line=1)
    second = _example(f, f"Only an image {SLOT} here", [("path", _png(48, 48, 9))], line=2)
    row = row_of([piece_of(first, f.spec), piece_of(second, f.spec)], f.spec)
    for segment, (example, text, videos) in enumerate(
            [(first, first_text, [False, True, False]), (second, f"Only an image {SLOT} here", [False])], start=1):
        expanded = expand_media_slots(example, f.spec)
        image_grids, video_grids = _grids(expanded.media, videos)
        metadata = [_metadata(expanded.media_info[1])] if any(videos) else []
        ids = _hf_ids(f, text, image_grids, video_grids, metadata)
        members = row["segment_ids"] == segment
        np.testing.assert_array_equal(row["tokens"][members], ids[:-1])
        np.testing.assert_array_equal(row["positions"][members],
                                      _hf_positions(f, ids, image_grids, video_grids, metadata)[:-1])


@pytest.mark.parametrize("mode", ["question", "shared_state"])
def test_valen_rows_equal_rope_index_of_state_plus_each_branch(family, mode):
    """Smoke records 2 (an image in the state) and 4 (a clip in the state): in question mode each branch's
    positions are those of state + that branch alone; shared_state is one sequence."""
    f = family
    renderer = ValenRenderer(f.tokenizer)
    records = list(read_valen(ROOT / "data/smoke/valen/train.jsonl"))
    for index in (2, 4):
        example = renderer.render(records[index], "train")
        media, infos = load_media(example, f.spec)
        videos = [h["kind"] == "video" for h in example.meta["media"]]
        assert any(videos) == (index == 4)
        image_grids, video_grids = _grids(media, videos)
        if any(videos):
            from transformers.video_utils import VideoMetadata

            info = infos[videos.index(True)]
            metadata = [VideoMetadata(total_num_frames=info.total_frames, fps=info.video_fps,
                                      frames_indices=list(info.frame_indices))]
        else:
            metadata = []
        row = valen_row(example, f.spec, QuestionSpec(mode, 8, 8, training=False), None)
        length = int(row["segment_ids"].sum())
        tokens, positions, branches = row["tokens"][:length], row["positions"][:length], row["branch_ids"][:length]
        if mode == "shared_state":
            np.testing.assert_array_equal(positions, _hf_positions(f, tokens, image_grids, video_grids, metadata))
            continue
        state = int(np.argmax(branches > 0))
        for branch in range(1, int(branches.max()) + 1):
            members = np.flatnonzero(branches == branch)
            sequence = np.concatenate([tokens[:state], tokens[members]])
            expected = _hf_positions(f, sequence, image_grids, video_grids, metadata)
            np.testing.assert_array_equal(np.concatenate([positions[:state], positions[members]]), expected)


def test_batch_shapes_and_padding_rows_take_three_position_axes(family):
    """The step compiles from `batch_shapes_of` before the first batch: it must describe the rows built."""
    from valen_jax.data.assemble import batch_shapes_of
    from valen_jax.evaluation.tokens import _empty_row

    example, _ = _mixed(family)
    row, shapes = assemble(example, family.spec), batch_shapes_of(family.spec, 2)
    assert row.keys() == shapes.keys()
    for key, value in row.items():
        assert (2, *value.shape) == shapes[key].shape and value.dtype == shapes[key].dtype, key
    assert {k: v.shape for k, v in _empty_row(family.spec).items()} == {k: v.shape for k, v in row.items()}


def test_the_row_spec_travels_to_loader_workers(family):
    """Grain workers get the RowSpec pickled: the Qwen3-VL timestamp encoder (a tokenizer) comes back whole."""
    import pickle

    example, _ = _mixed(family)
    travelled = pickle.loads(pickle.dumps(family.spec))
    assert travelled == family.spec
    np.testing.assert_array_equal(expand_media_slots(example, travelled).ids,
                                  expand_media_slots(example, family.spec).ids)


@pytest.mark.slow
def test_greedy_decoding_equals_transformers_generate(family):
    """Prompt positions from rope_index, each new token at the largest position + 1: the tokens HF's generate
    picks (its rope deltas) for the same ids, pixels and grids, with our import of the same checkpoint."""
    import jax
    from flax import nnx

    from valen_jax.evaluation import prompts, tokens
    from valen_jax.models import hf, sharding

    f = family
    example, hf_text = _mixed(f)
    expanded = expand_media_slots(example, f.spec)
    model, cfg = hf.from_pretrained(f.info["directory"])
    graphdef, params = nnx.split(model)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    prompt = prompts.prompt_before(expanded, len(expanded.ids), f.spec, "rows.jsonl:1")
    (ours,) = tokens.greedy(params, graphdef, [prompt], f.spec, mesh, 1, 1, max_new_tokens=4, stop_id=-1,
                            vocab=f.info["vocab_size"])

    videos = [False, True, False]
    image_grids, video_grids = _grids(expanded.media, videos)
    metadata = [_metadata(expanded.media_info[1])]
    ids = _hf_ids(f, hf_text, image_grids, video_grids, metadata)
    kind = np.where(ids == f.info["image_token_id"], 1, np.where(ids == f.info["video_token_id"], 2, 0))
    extra = ({"second_per_grid_ts": torch.tensor([f.info["temporal_patch_size"] / metadata[0].sampled_fps])}
             if f.name == "qwen2_5_vl" else {})
    with torch.no_grad():
        out = f.model.generate(
            input_ids=torch.tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            mm_token_type_ids=torch.tensor(kind[None]),
            pixel_values=torch.tensor(np.concatenate([expanded.media[0].patches, expanded.media[2].patches])),
            image_grid_thw=torch.tensor(image_grids), video_grid_thw=torch.tensor(video_grids),
            pixel_values_videos=torch.tensor(expanded.media[1].patches), max_new_tokens=4, do_sample=False,
            **extra)
    assert ours == out[0, len(ids):].tolist()


def test_models_without_mrope_keep_one_dimensional_rows_and_image_pads(family):
    """A from-scratch model (no mrope_section, no video token): every media item, clips included, fills
    image pads, and positions are 0, 1, 2, … exactly as before M-RoPE rows existed."""
    import dataclasses

    from valen_jax.data.positions import PositionScheme
    from valen_jax.data.vision_processor import tokens_of

    spec = dataclasses.replace(family.spec, positions=PositionScheme(), video=None)
    example, _ = _mixed(family)
    expanded = expand_media_slots(example, spec)
    ids = example.arrays["input_ids"]
    repeat = np.ones(len(ids), np.int64)
    repeat[ids == spec.image_pad_id] = [tokens_of(m, spec.vision) for m in expanded.media]
    np.testing.assert_array_equal(expanded.ids, np.repeat(ids, repeat))
    row = assemble(example, spec)
    length = len(expanded.ids) - 1
    np.testing.assert_array_equal(row["positions"], np.pad(np.arange(length, dtype=np.int32), (0, spec.seq_len - length)))
