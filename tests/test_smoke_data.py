"""Checks of the committed smoke data (`data/smoke`) and smoke tokenizer (`data/tokenizer`).

Both are made by `data/make_smoke.py` and `data/make_tokenizer.py`; these tests also re-run the
generators into a temporary folder and require byte-identical output.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from data_pipeline import vocabulary

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "data" / "smoke"
VFLASH = SMOKE / "vflash"
VALEN = SMOKE / "valen"
TOKENIZER = REPO / "data" / "tokenizer"
VFLASH_FILES = ("points.jsonl", "boxes.jsonl", "robot2d.jsonl", "robot3d.jsonl", "drive.jsonl")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"smoke_{name}", REPO / "data" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass (make_vision_tasks.Task) looks its module up while it is made
    spec.loader.exec_module(module)
    return module


make_smoke = _load_script("make_smoke")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _tree_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


# --------------------------------------------------------------------------- quantiser


def test_round_half_up():
    assert make_smoke.round_half_up(0.5) == 1
    assert make_smoke.round_half_up(1.5) == 2
    assert make_smoke.round_half_up(2.5) == 3
    assert make_smoke.round_half_up(2.4999) == 2
    assert make_smoke.round_half_up(-0.5) == 0
    assert make_smoke.round_half_up(0) == 0


def test_quantise_half_up_and_edges():
    q = make_smoke.quantise
    assert q(0, 0, 1) == 0 and q(1, 0, 1) == 1000
    assert q(Fraction(1, 2000), 0, 1) == 1  # 0.5 -> 1
    assert q(Fraction(5, 2000), 0, 1) == 3  # 2.5 -> 3 (banker's rounding would give 2)
    assert q(8, 0, 128) == 63  # 62.5 exactly, in image pixels
    assert q(64, 0, 128) == 500 and q(128, 0, 128) == 1000
    assert q(-5, -5, 5) == 0 and q(0, -5, 5) == 500 and q(5, -5, 5) == 1000
    assert q(-math.pi, -math.pi, math.pi) == 0 and q(math.pi, -math.pi, math.pi) == 1000
    assert q(-10, -10, 250) == 0 and q(250, -10, 250) == 1000
    assert q(-1, 0, 1) == 0 and q(2, 0, 1) == 1000  # clamped
    # A written half that is a hair below it in binary: half-up as written, the way training and
    # evaluation read tokens back (one quantiser: a copy rounding the binary value would give 0).
    assert q(-4.995, -5, 5) == 1 and q(-4.985, -5, 5) == 2
    with pytest.raises(ValueError):
        q(0.5, 1, 1)


# --------------------------------------------------------------------------- Valen


def _is_labeled(targets: dict, qid: str) -> bool:
    target = targets.get(qid)
    return target is not None and target.get("probabilities") is not None


def _label_keys(question: dict) -> set[str]:
    if question["type"] == "noul":
        return {"true", "false"}
    if question["type"] == "score":
        return {str(k) for k in range(len(question["criteria"]))}
    return set(question["criteria"])


def _media_urls(state) -> list[tuple[str, str]]:
    if isinstance(state, str):
        return []
    urls = []
    for message in state["messages"]:
        if isinstance(message["content"], list):
            for part in message["content"]:
                if part["type"] in ("image_url", "video_url"):
                    urls.append((part["type"], part[part["type"]]["url"]))
    return urls


def test_valen_counts_and_labels():
    records = _read_jsonl(VALEN / "train.jsonl")
    assert len(records) == 6
    n_questions = n_labeled = 0
    unlabeled_forms = set()
    types, soft = set(), 0
    for record in records:
        assert record["group_id"]
        questions = record["request"]["questions"]
        targets = record.get("targets") or {}
        assert set(targets) <= set(questions)
        for qid, question in questions.items():
            n_questions += 1
            types.add(question["type"])
            assert question["instructions"]
            if question["type"] == "score":
                assert 2 <= len(question["criteria"]) <= 10
            if not _is_labeled(targets, qid):
                unlabeled_forms.add("null" if qid in targets else "omitted")
                continue
            n_labeled += 1
            probs = targets[qid]["probabilities"]
            assert set(probs) == _label_keys(question)
            assert all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in probs.values())
            assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-6)
            soft += sorted(probs.values())[-1] < 1.0
        meta = record["meta"]
        assert {"record_id", "domain", "modality", "language_bucket"} <= set(meta)
    assert (n_questions, n_labeled) == (15, 13)
    assert types == {"choice", "noul", "score"}
    assert soft >= 1
    assert unlabeled_forms == {"null", "omitted"}


def test_valen_media_and_assets():
    records = _read_jsonl(VALEN / "train.jsonl")
    kinds = {}
    for record in records:
        urls = _media_urls(record["request"]["state"])
        modality = record["meta"]["modality"]
        assert modality == ({"image_url": "image", "video_url": "video"}[urls[0][0]] if urls else "text")
        for kind, url in urls:
            assert "://" not in url and (VALEN / url).is_file()
            kinds[kind] = url
        for asset in record.get("assets", []):
            assert hashlib.sha256((VALEN / asset["path"]).read_bytes()).hexdigest() == asset["sha256"]
    assert set(kinds) == {"image_url", "video_url"}
    assert any(a["path"] == kinds["image_url"] for r in records for a in r.get("assets", []))


def test_valen_text_subset_is_byte_identical():
    lines = (VALEN / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    text_lines = [line for line in lines if json.loads(line)["meta"]["modality"] == "text"
                  and isinstance(json.loads(line)["request"]["state"], str)]
    assert (VALEN / "text.jsonl").read_text(encoding="utf-8").splitlines(keepends=True) == text_lines
    assert len(text_lines) == 4


# --------------------------------------------------------------------------- VFlash

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>")
ATOM = re.compile(r"<(robot_single_2d|robot_single|robot_left_2d|robot_right_2d|robot_left|robot_right|drive|dense)>"
                  r"((?:<\d+>)*)</(robot|drive|dense)>")
POINT = re.compile(r"<point>((?:<\d+>)*)</point>")
BOX = re.compile(r"<box>((?:<\d+>)*)</box>")
NUMBER = re.compile(r"<(\d+)>")
COORDS_PER_STEP = {"robot_single_2d": 2, "robot_single": 3, "drive": 3}


def _media_items(image) -> list:
    return image if isinstance(image, list) else [image]


def _media_path(item) -> str:
    if isinstance(item, str):
        return item
    return item.get("file") or item["video"]


def _primitives(answer: str) -> list[tuple[str, list[int]]]:
    """(kind, coordinate values) of every primitive in an answer, in order."""
    found = []
    for pattern, kind in ((ATOM, None), (POINT, "point"), (BOX, "box")):
        for m in pattern.finditer(answer):
            body = m.group(2) if kind is None else m.group(1)
            found.append((m.start(), kind or m.group(1), [int(v) for v in NUMBER.findall(body)]))
    return [(kind, values) for _, kind, values in sorted(found)]


def _all_vflash_rows() -> list[tuple[str, dict]]:
    return [(name, row) for name in (*VFLASH_FILES, "eval.jsonl") for row in _read_jsonl(VFLASH / name)]


def test_vflash_row_counts_and_recipe():
    counts = {name: len(_read_jsonl(VFLASH / name)) for name in VFLASH_FILES}
    assert 90 <= sum(counts.values()) <= 100
    assert 12 <= len(_read_jsonl(VFLASH / "eval.jsonl")) <= 20
    recipe = json.loads((VFLASH / "recipe.json").read_text())
    seen = set()
    for entry in recipe.values():
        assert entry["root"] == "." and entry["data_augment"] is False and entry["video_reader_backend"] == "pyav"
        files = entry["annotation"] if isinstance(entry["annotation"], list) else [entry["annotation"]]
        seen.update(files)
        if isinstance(entry["annotation"], str):
            assert entry["length"] == counts[entry["annotation"]]
        if "visual_aug" in entry:
            aug = entry["visual_aug"]
            assert set(aug) == {"prob", "views", "ops", "severity", "zoom_max_severity"}
    assert seen == set(VFLASH_FILES)
    assert sorted(e["repeat_time"] for e in recipe.values()) == [1.0] * (len(recipe) - 1) + [2.0]
    assert sum("visual_aug" in e for e in recipe.values()) == 1


def test_vflash_media_placeholders_and_forms():
    forms = set()
    train_media, eval_media = set(), set()
    for name, row in _all_vflash_rows():
        items = _media_items(row["image"])
        forms.add("list" if isinstance(row["image"], list) else type(row["image"]).__name__)
        n_placeholders = sum(t["value"].count("<image>") for t in row["conversations"] if t["from"] == "human")
        assert n_placeholders == len(items), row
        assert all(t["value"].count("<image>") == 0 for t in row["conversations"] if t["from"] == "gpt")
        for item in items:
            if isinstance(item, dict):
                forms.add("video" if "video" in item else "dict")
                if "resize" in item:
                    assert len(item["resize"]) == 2
            assert (VFLASH / _media_path(item)).is_file()
            (eval_media if name == "eval.jsonl" else train_media).add(_media_path(item))
        human_words = [len(t["value"].replace("<image>", " ").split()) for t in row["conversations"]
                       if t["from"] == "human"]
        assert max(human_words) <= 40
        assert [t["from"] for t in row["conversations"]] == ["human", "gpt"] * (len(row["conversations"]) // 2)
    assert {"str", "list", "dict", "video"} <= forms
    assert not train_media & eval_media


def test_vflash_answers_block_size_and_masks():
    masked = 0
    for name, row in _all_vflash_rows():
        primitives = []
        for turn in row["conversations"]:
            if turn["from"] != "gpt":
                continue
            answer = turn["value"]
            prims = _primitives(answer)
            primitives += prims
            for _, values in prims:
                assert all(0 <= v <= vocabulary.NUMBER_MAX for v in values)
            calls = TOOL_CALL.findall(answer)
            atoms = list(ATOM.finditer(answer))
            assert len(calls) == len(atoms)
            for call, atom in zip(calls, atoms, strict=True):
                data = json.loads(call)
                assert data["name"] == "atomic_decoding"
                kind, n_coords = atom.group(1), len(NUMBER.findall(atom.group(2)))
                steps, rem = divmod(n_coords, COORDS_PER_STEP[kind])
                assert rem == 0 and steps > 0
                # table of seed 004: 2P + 2 (robot 2D), 3P + 2 (robot 3D, driving) = all tokens of the atom
                assert data["arguments"]["block_size"] == COORDS_PER_STEP[kind] * steps + 2 == n_coords + 2
                assert data["arguments"].get("count", steps) == steps
            if answer.startswith("<ref>"):
                assert re.fullmatch(r"<ref>[a-z]+</ref><objects>(None|(<box>(<\d+>){4}</box>)+)</objects>", answer)
                for _, (x1, y1, x2, y2) in (p for p in prims if p[0] == "box"):
                    assert x1 < x2 and y1 < y2
            if answer.startswith("<point>"):
                assert re.fullmatch(r"<point><\d+><\d+></point>", answer)
        if name == "boxes.jsonl":
            assert all(t["value"].startswith("<ref>") for t in row["conversations"] if t["from"] == "gpt")
        if "atom_loss_masks" in row:
            masked += 1
            masks = row["atom_loss_masks"]
            assert len(masks) == len(primitives)
            for mask, (_, values) in zip(masks, primitives, strict=True):
                assert set(mask) <= {"0", "1"} and len(mask) == len(values)
    assert masked >= 3


def test_vflash_absent_category_rows():
    answers = [t["value"] for row in _read_jsonl(VFLASH / "boxes.jsonl") for t in row["conversations"]
               if t["from"] == "gpt"]
    assert any(a.endswith("<objects>None</objects>") for a in answers)
    assert any("</box><box>" in a for a in answers)


# --------------------------------------------------------------------------- determinism


def test_regenerated_smoke_data_is_byte_identical(tmp_path):
    make_smoke.main(["--out", str(tmp_path / "smoke")], log=lambda _: None)
    # Other formats' smoke sets (vakforge/ …) have their own generators and determinism tests.
    ours = {k: v for k, v in _tree_digests(SMOKE).items() if k.split("/")[0] in ("vflash", "valen")}
    assert _tree_digests(tmp_path / "smoke") == ours


def test_regenerated_smoke_scenes_are_byte_identical_and_make_train_reads_every_smoke_entry(tmp_path):
    """`make train`'s data (configs/vflash.py's default variant, issue 25): the grid scenes and the two
    recipes beside the smoke recipe, regenerated bit for bit; its recipe holds each smoke entry unchanged
    but for its paths, so the smoke recipe stays the one home of them."""
    make_vision_tasks = _load_script("make_vision_tasks")
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "vflash").symlink_to(VFLASH, target_is_directory=True)
    make_vision_tasks.make_smoke_scenes(tmp_path / "smoke" / "scenes", tmp_path / "smoke" / "vflash")
    assert _tree_digests(tmp_path / "smoke" / "scenes") == _tree_digests(SMOKE / "scenes")
    smoke = json.loads((VFLASH / "recipe.json").read_text())
    recipe = json.loads((SMOKE / "scenes" / "recipe.json").read_text())
    assert list(recipe) == [*smoke, "smoke_scenes"] and recipe["smoke_scenes"]["length"] == 400
    for name, entry in smoke.items():
        ours = recipe[name]
        assert {k: v for k, v in ours.items() if k not in ("annotation", "root")} == \
            {k: v for k, v in entry.items() if k not in ("annotation", "root")}
        assert (SMOKE / "scenes" / ours["root"]).resolve() == VFLASH.resolve()
    answers = {json.loads(line)["conversations"][1]["value"]
               for line in (SMOKE / "scenes" / "train.jsonl").read_text().splitlines()}
    assert len(answers) > 300  # nine places, each jittered: no answer a model could learn by heart


def test_regenerated_tokenizer_is_byte_identical(tmp_path):
    make_tokenizer = _load_script("make_tokenizer")
    make_tokenizer.main(["--data", str(SMOKE), "--out", str(tmp_path / "tok")])
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
    assert _tree_digests(tmp_path / "tok") == _tree_digests(TOKENIZER)


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    assert (TOKENIZER / "tokenizer.json").is_file() and (TOKENIZER / "tokenizer_config.json").is_file()
    return AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)


@pytest.mark.parametrize("token", ["<0>", "<1000>", "<robot_single_2d>", "</robot>", "<|image_pad|>",
                                   "<|im_start|>", "<|im_end|>", "<|endoftext|>"])
def test_tokenizer_single_tokens(tok, token):
    assert len(tok.encode(token, add_special_tokens=False)) == 1


def test_tokenizer_special_tokens(tok):
    assert tok.eos_token == vocabulary.IM_END and tok.pad_token == vocabulary.END_OF_TEXT
    assert tok.pad_token_id != tok.eos_token_id


@pytest.mark.parametrize("text", [
    "Point to the red ball. Tokens <0> to <1000> span the image.",
    "  two spaces, a tab\t and a newline\n<point><12><999></point>",
    "窗外乌云密布 — héllo wörld <|im_end|>x<0>y",
])
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_tokenizer_chat_template_assistant_mask(tok):
    conv = [
        {"role": "user", "content": "<|image_pad|>\nPoint to the red ball."},
        {"role": "assistant", "content": "<point><500><250></point>"},
    ]
    out = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask) and any(mask)
    im_end = tok.convert_tokens_to_ids(vocabulary.IM_END)
    last_end = max(i for i, t in enumerate(ids) if t == im_end)
    assert mask[last_end] == 1
    supervised = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(supervised, skip_special_tokens=False) == "<point><500><250></point><|im_end|>"
