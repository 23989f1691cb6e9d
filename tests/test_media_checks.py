"""Media are decoded at `validate` and `convert`, as the training loader decodes them (issue 54, failure 5).

A file named `.png` that is not an image used to pass both commands and stop training at its first
batch, after compiling. Now each format that carries images (vflash, recipe, chat, valen) reports it
as one `PATH:LINE: field: message` line naming the file, `convert` refuses before writing anything,
and each distinct content is decoded once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest
from PIL import Image

from data_pipeline import convert as convert_cli
from data_pipeline import validate as validate_cli
from data_pipeline.formats import media_decode
from data_pipeline.render.lmdb_media import close_all

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = str(REPO / "data" / "tokenizer")
NOT_AN_IMAGE = b"<html>a saved web page, not an image</html>\n"


def vflash(image: object) -> dict:
    placeholders = "<image>" * (len(image) if isinstance(image, list) else 1)
    return {"image": image, "conversations": [{"from": "human", "value": f"{placeholders}Where is the cup?"},
                                              {"from": "gpt", "value": "<point><1><2></point>"}]}


def chat(path: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "path": path},
                                                      {"type": "text", "text": "What is shown?"}]},
                         {"role": "assistant", "content": "A red square."}]}


def valen(url: str) -> dict:
    return {"group_id": "g", "request": {
        "state": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                            {"type": "text", "text": "The light."}]}]},
        "questions": {"go": {"type": "noul", "instructions": "May one cross?"}}},
        "targets": {"go": {"probabilities": {"true": 1.0, "false": 0.0}}}}


def write_jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(autouse=True)
def fresh_decode_cache(monkeypatch):
    # Decoding is remembered per content for the whole process; each test starts without that memory.
    monkeypatch.setattr(media_decode, "_decoded", {})


@pytest.fixture
def folder(tmp_path, make_png) -> Path:
    make_png("good.png")
    (tmp_path / "bad.png").write_bytes(NOT_AN_IMAGE)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "noise.png")  # incompressible: the pixel data is most of the file
    data = (tmp_path / "noise.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[:len(data) // 2])
    return tmp_path


def validate(capsys, fmt: str, *paths: Path) -> tuple[int, list[str]]:
    code = validate_cli.main([f"--format={fmt}", *map(str, paths)])
    return code, capsys.readouterr().err.splitlines()


def refusal(path: Path, line: int, field: str, media: Path) -> str:
    return (f"{path}:{line}: {field}: {media.resolve()} is not an image Pillow can decode "
            f"(cannot identify image file); the training loader would stop on it")


def test_validate_vflash_decodes_every_image_and_names_the_bad_file(folder, capsys):
    data = write_jsonl(folder / "data.jsonl", vflash("good.png"), vflash("bad.png"),
                       vflash(["good.png", {"file": "bad.png"}]))
    code, lines = validate(capsys, "vflash", data)
    assert code == 1
    assert lines == [refusal(data, 2, "image", folder / "bad.png"),
                     refusal(data, 3, "image[1].file", folder / "bad.png")]


def test_validate_refuses_a_truncated_image(folder, capsys):
    data = write_jsonl(folder / "data.jsonl", vflash("cut.png"))
    code, lines = validate(capsys, "vflash", data)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"{data}:1: image: {(folder / 'cut.png').resolve()} is not an image Pillow can decode (")


def test_validate_recipe_names_the_annotation_line(folder, capsys):
    write_jsonl(folder / "data.jsonl", vflash("good.png"), vflash("bad.png"))
    recipe = folder / "recipe.json"
    recipe.write_text(json.dumps({"cups": {"annotation": "data.jsonl"}}))
    code, lines = validate(capsys, "recipe", recipe)
    assert code == 1 and lines == [refusal(folder / "data.jsonl", 2, "image", folder / "bad.png")]


def test_validate_chat(folder, capsys):
    data = write_jsonl(folder / "chat.jsonl", chat("good.png"), chat("bad.png"))
    code, lines = validate(capsys, "chat", data)
    assert code == 1 and lines == [refusal(data, 2, "messages[0].content[0].path", folder / "bad.png")]


def test_validate_valen_with_media(folder, capsys):
    data = write_jsonl(folder / "valen.jsonl", valen("good.png"), valen("bad.png"))
    code, lines = validate(capsys, "valen", data)
    field = "request.state.messages[0].content[0].image_url.url"
    assert code == 1 and lines == [refusal(data, 2, field, folder / "bad.png")]


def test_convert_refuses_and_keeps_what_was_written(folder, capsys):
    data = write_jsonl(folder / "data.jsonl", vflash("good.png"), vflash("bad.png"))
    output = folder / "shards"
    output.mkdir()
    (output / "manifest.json").write_text("the user's earlier shards")
    for workers in (1, 2):
        code = convert_cli.main(["--format=vflash", f"--input={data}", f"--output={output}",
                                 f"--tokenizer={TOKENIZER}", f"--workers={workers}", "--overwrite"])
        assert code == 1
        assert capsys.readouterr().err.splitlines() == [refusal(data, 2, "image", folder / "bad.png")]
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith((".shards", "shards"))) == ["shards"]
        assert [p.name for p in output.iterdir()] == ["manifest.json"]
        assert (output / "manifest.json").read_text() == "the user's earlier shards"


def test_convert_without_an_output_leaves_none(folder, capsys):
    data = write_jsonl(folder / "chat.jsonl", chat("bad.png"))
    code = convert_cli.main(["--format=chat", f"--input={data}", f"--output={folder / 'out'}",
                             f"--tokenizer={TOKENIZER}"])
    assert code == 1 and not (folder / "out").exists()
    assert capsys.readouterr().err.splitlines() == [refusal(data, 1, "messages[0].content[0].path",
                                                            folder / "bad.png")]


def test_each_distinct_content_is_decoded_once(folder, monkeypatch):
    shutil.copy(folder / "good.png", folder / "same.png")  # another name, the same bytes
    (folder / "sub").mkdir()
    shutil.copy(folder / "good.png", folder / "sub" / "good.png")
    decoded = []
    real = media_decode.decode_image
    monkeypatch.setattr(media_decode, "decode_image", lambda data: decoded.append(len(data)) or real(data))
    data = write_jsonl(folder / "data.jsonl", *[vflash(name) for name in ("good.png", "same.png", "sub/good.png")] * 5)
    manifest = convert_cli.convert("vflash", data, folder / "out", TOKENIZER, progress=False)
    assert manifest.data["counts"]["records"] == 15
    assert len(decoded) == 1


def test_an_lmdb_value_that_is_not_an_image_is_refused_at_convert(folder, capsys):
    env = lmdb.open(str(folder / "frames.lmdb"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"good", (folder / "good.png").read_bytes())
        txn.put(b"bad", NOT_AN_IMAGE)
    env.close()
    data = write_jsonl(folder / "data.jsonl", vflash({"lmdb_file": "frames.lmdb", "lmdb_key": "good"}),
                       vflash({"lmdb_file": "frames.lmdb", "lmdb_key": "bad"}))
    try:
        code = convert_cli.main(["--format=vflash", f"--input={data}", f"--output={folder / 'out'}",
                                 f"--tokenizer={TOKENIZER}"])
    finally:
        close_all()
    assert code == 1 and not (folder / "out").exists()
    # The refusal comes while rendering, where the value is read: on a line of its own, after the progress bar's.
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {data}:2: image: {(folder / 'frames.lmdb').resolve()}: the value of LMDB key 'bad' is not an "
        "image Pillow can decode (cannot identify image file); the training loader would stop on it")


def test_the_loader_and_the_server_decode_with_the_same_decoder():
    from valen_jax.data import media
    from valen_jax.serving import images

    assert media.decode_image is media_decode.decode_image
    assert images.decode_image is media_decode.decode_image


@pytest.mark.slow
def test_train_refuses_a_bad_image_before_anything_is_compiled(folder):
    # The case: training converts the user's JSONL itself; it stopped at the first batch, after compiling.
    import importlib.util

    from data_pipeline.formats.errors import FormatError
    from valen_jax.train import run

    spec = importlib.util.spec_from_file_location("chat_config", REPO / "configs" / "chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("tiny")
    data = write_jsonl(folder / "chat.jsonl", chat("good.png"), chat("bad.png"))
    config.data.train = str(data)
    config.data.eval = None  # own training data beside the bundled eval set is refused before the media check
    workdir = folder / "run"
    with pytest.raises(FormatError) as refused:
        run(config, workdir)
    assert [str(p) for p in refused.value.problems] == [refusal(data, 2, "messages[0].content[0].path",
                                                                folder / "bad.png")]
    assert not workdir.exists()  # a refused start-up leaves no workdir behind
