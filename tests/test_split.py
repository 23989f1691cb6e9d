"""data_pipeline.split: deterministic leak-free splits (issue 17): Valen by group_id, vakforge by
conversation with speakers kept in one split (splits.json with the seed), chat/VFlash by row with
rows sharing an image (by content) kept together; bad fractions refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from data_pipeline import split as splitter
from data_pipeline.formats.vakforge import read_vakforge
from tests.train_runs import run_module

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "data" / "smoke"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("text, message", [
    ("train=0.8,eval=0.3", "sums to 1.1"),
    ("train=0.8", "sums to 0.8"),
    ("train=1.2,eval=-0.2", "must be in (0, 1]"),
    ("train=0.5,train=0.5", "named twice"),
    ("train=x,eval=0.5", "not a number"),
    ("train0.8,eval=0.2", "not NAME=FRACTION"),
    ("train=nan,eval=0.2", "must be in (0, 1]"),
])
def test_bad_fractions_are_refused_naming_the_problem(text, message):
    with pytest.raises(splitter.SplitError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        splitter.parse_fractions(text)


def _valen_variants(tmp_path: Path) -> Path:
    """The 6 smoke records, each group twice more (a variant of the same material), next to their assets."""
    folder = tmp_path / "valen"
    shutil.copytree(SMOKE / "valen" / "assets", folder / "assets")
    records = _jsonl(SMOKE / "valen" / "train.jsonl")
    variants = []
    for copy in range(3):
        for record in records:
            variants.append(dict(record, meta=dict(record["meta"], record_id=f"{record['meta']['record_id']}-{copy}")))
    (folder / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in variants), encoding="utf-8")
    return folder / "all.jsonl"


def test_valen_splits_by_group_id_deterministically(tmp_path, capsys):
    source = _valen_variants(tmp_path)
    args = ["--format=valen", f"--input={source}", f"--output-dir={source.parent}",
            "--fractions=train=0.5,eval=0.5", "--prefix=a."]
    assert splitter.main([*args, "--seed=7"]) == 0
    out = capsys.readouterr().out
    assert "18 rows in 6 group_id/media groups, seed 7" in out and "train: 9 rows, 3 groups" in out
    train, held = (source.parent / "a.train.jsonl").read_bytes(), (source.parent / "a.eval.jsonl").read_bytes()
    groups = [{r["group_id"] for r in _jsonl(source.parent / f"a.{name}.jsonl")} for name in ("train", "eval")]
    assert groups[0] and groups[1] and not groups[0] & groups[1]
    # Every row lands in exactly one split, with its bytes and in input order.
    lines = source.read_text().splitlines(keepends=True)
    assert sorted(train.decode().splitlines(keepends=True) + held.decode().splitlines(keepends=True)) == sorted(lines)
    assert train.decode().splitlines(keepends=True) == [line for line in lines if line in train.decode()]
    # Same seed: byte-identical files; the summary is the same for another prefix.
    assert splitter.main([*args[:-1], "--prefix=b.", "--seed=7"]) == 0
    assert (source.parent / "b.train.jsonl").read_bytes() == train
    assert (source.parent / "b.eval.jsonl").read_bytes() == held
    outcomes = {splitter.split("valen", source, source.parent, {"train": 0.5, "eval": 0.5}, seed, "x.")
                ["files"] and (source.parent / "x.eval.jsonl").read_bytes() for seed in range(6)}
    assert len(outcomes) > 1  # the seed matters


def _chat_rows_sharing_an_image(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """Ten text rows and six image rows; two files hold the same picture under other names."""
    folder = tmp_path / "chat"
    (folder / "images").mkdir(parents=True)
    # Four pictures of distinct content (the smoke set repeats some under other names).
    by_digest = {hashlib.sha256(p.read_bytes()).digest(): p for p in sorted((SMOKE / "chat" / "images").glob("*.png"))}
    pictures = sorted(by_digest.values())[:4]
    for i, picture in enumerate(pictures):
        shutil.copy(picture, folder / "images" / f"p{i}.png")
    shutil.copy(pictures[0], folder / "images" / "same_as_p0.png")
    shutil.copy(pictures[1], folder / "images" / "same_as_p1.png")
    rows = []
    for i in range(10):
        rows.append({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                  {"role": "assistant", "content": str(i + 1)}]})
    for name in ("p0", "same_as_p0", "p1", "same_as_p1", "p2", "p3"):
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Which shape is this?"},
                                         {"type": "image", "path": f"images/{name}.png"}]},
            {"role": "assistant", "content": "A shape."}]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    digests = {f"images/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in (folder / "images").iterdir()}
    return path, digests


def test_chat_rows_sharing_an_image_by_content_stay_in_one_split(tmp_path):
    source, digests = _chat_rows_sharing_an_image(tmp_path)
    for seed in range(8):
        summary = splitter.split("chat", source, source.parent, {"train": 0.75, "eval": 0.25}, seed, f"{seed}.")
        assert summary["rows"] == 16 and summary["groups"] == 14  # two pairs share a picture
        seen: dict[str, str] = {}
        for name in ("train", "eval"):
            for row in _jsonl(source.parent / f"{seed}.{name}.jsonl"):
                for part in row["messages"][0]["content"] if isinstance(row["messages"][0]["content"], list) else []:
                    if part["type"] == "image":
                        assert seen.setdefault(digests[part["path"]], name) == name, (seed, part)


def test_rows_naming_media_relatively_are_not_written_elsewhere(tmp_path):
    source, _ = _chat_rows_sharing_an_image(tmp_path)
    with pytest.raises(splitter.SplitError, match="name media relative to"):
        splitter.split("chat", source, tmp_path / "elsewhere", {"train": 0.5, "eval": 0.5}, 0)
    with pytest.raises(splitter.SplitError, match="would overwrite --input"):
        splitter.split("chat", source, source.parent, {"rows": 0.5, "eval": 0.5}, 0)
    with pytest.raises(splitter.SplitError, match="takes valen, vakforge, chat, vflash"):
        splitter.split("recipe", SMOKE / "vflash" / "recipe.json", tmp_path, {"train": 1.0}, 0)


def test_vflash_rows_split_by_row_with_their_images(tmp_path):
    folder = tmp_path / "vflash"
    shutil.copytree(SMOKE / "vflash" / "images", folder / "images")
    shutil.copy(SMOKE / "vflash" / "points.jsonl", folder / "points.jsonl")
    summary = splitter.split("vflash", folder / "points.jsonl", folder, {"train": 0.8, "eval": 0.2}, 3)
    assert summary["splits"]["train"]["rows"] + summary["splits"]["eval"]["rows"] == summary["rows"] == 28
    def names(row):
        items = row["image"] if isinstance(row["image"], list) else [row["image"]]
        return [item["file"] if isinstance(item, dict) else item for item in items]

    images = [{name for r in _jsonl(folder / f"{split}.jsonl") for name in names(r)} for split in ("train", "eval")]
    digest = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in images[0] | images[1]}
    assert not {digest[n] for n in images[0]} & {digest[n] for n in images[1]}


def _vakforge_without_splits(tmp_path: Path) -> Path:
    """The smoke manifest with meta.split removed (the split decides), conv 3's agent voiced as conv 1's."""
    folder = tmp_path / "vakforge"
    shutil.copytree(SMOKE / "vakforge", folder)
    records = _jsonl(folder / "vakforge.jsonl")
    for record in records:
        record["meta"].pop("split", None)
    records[2]["meta"]["speakers"]["agent"] = records[0]["meta"]["speakers"]["agent"]
    (folder / "vakforge.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                           encoding="utf-8")
    (folder / "splits.json").unlink()
    return folder / "vakforge.jsonl"


def test_vakforge_splits_by_conversation_with_speakers_in_one_split(tmp_path):
    manifest = _vakforge_without_splits(tmp_path)
    records = _jsonl(manifest)
    firsts = []
    for seed in range(6):
        summary = splitter.split("vakforge", manifest, manifest.parent, {"train": 0.6, "test": 0.4}, seed)
        written = json.loads((manifest.parent / "splits.json").read_text())
        assert written["seed"] == seed and summary["groups"] == 4
        where = {cid: name for name, ids in written["splits"].items() for cid in ids}
        assert sorted(where) == sorted(r["id"] for r in records)
        assert where[records[0]["id"]] == where[records[2]["id"]]  # one agent voice
        read_vakforge(manifest, check_media=False)  # the reader's own leak check passes
        firsts.append(json.dumps(written))
    again = splitter.split("vakforge", manifest, manifest.parent, {"train": 0.6, "test": 0.4}, 0)
    assert again["files"] and json.dumps(json.loads((manifest.parent / "splits.json").read_text())) == firsts[0]


def test_vakforge_conversations_stating_another_split_are_refused_and_nothing_written(tmp_path):
    folder = tmp_path / "vk"
    shutil.copytree(SMOKE / "vakforge", folder)
    before = (folder / "splits.json").read_bytes()
    with pytest.raises(splitter.SplitError, match=r"vakforge.jsonl:3: id=conv_en_gb_0003: meta.split: 'dev' is not "
                                                  r"one of --fractions \(train, eval\)"):
        splitter.split("vakforge", folder / "vakforge.jsonl", folder, {"train": 0.5, "eval": 0.5}, 1)
    assert (folder / "splits.json").read_bytes() == before
    assert not (folder / "splits.json.tmp").exists()
    with pytest.raises(splitter.SplitError):  # a refused split into a new folder leaves no folder
        splitter.split("vakforge", folder / "vakforge.jsonl", tmp_path / "new" / "out", {"train": 0.5, "eval": 0.5}, 1)
    assert not (tmp_path / "new").exists()


def test_vakforge_split_of_the_smoke_manifest_honours_meta_split_as_vakforge_split_does(tmp_path):
    """Issue 27: `--format=vakforge` on the smoke manifest (every conversation states meta.split) failed with
    "meta.split: 'train' but .../splits.json.tmp assigns it to 'eval'"; it now keeps each stated split."""
    from data_pipeline.vakforge.split import split_manifest

    manifest = SMOKE / "vakforge" / "vakforge.jsonl"
    fractions = {"train": 0.6, "dev": 0.2, "test": 0.2}
    result = run_module("data_pipeline.split", "--format=vakforge", f"--input={manifest}",
                        f"--output-dir={tmp_path / 'generic'}", "--fractions=train=0.6,dev=0.2,test=0.2",
                        "--seed=20260916", timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    generic = json.loads((tmp_path / "generic" / "splits.json").read_text())
    stated = {r["id"]: r["meta"]["split"] for r in _jsonl(manifest)}
    assert {cid: name for name, ids in generic["splits"].items() for cid in ids} == stated
    split_manifest(manifest, fractions, 20260916, tmp_path / "own")
    assert (tmp_path / "own" / "splits.json").read_bytes() == (tmp_path / "generic" / "splits.json").read_bytes()
