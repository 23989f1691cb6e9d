"""VFlash recipe JSON (seed 004, "Recipe Format"): each field rule with a passing and a failing entry."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from data_pipeline.formats.errors import FormatError, Problem
from data_pipeline.formats.recipe import RecipeEntry, VisualAug, read_recipe, read_recipe_records

ROW = {
    "image": "a.png",
    "conversations": [
        {"from": "human", "value": "<image>cup"},
        {"from": "gpt", "value": "<point><1><2></point>"},
    ],
}

# The seed's example recipe, verbatim.
SEED_RECIPE = """{
  "robot3d_demo": {
    "annotation": ["data/robot3d/part_000.jsonl", "data/robot3d/part_001.jsonl"],
    "root": "data/media",
    "repeat_time": 1.0,
    "data_augment": false,
    "video_reader_backend": "pyav",
    "visual_aug": {
      "prob": 0.3,
      "views": "all",
      "ops": ["motion_blur", "gaussian_blur", "zoom_blur", "fog", "glass_blur", "light"],
      "severity": [1, 10],
      "zoom_max_severity": 5
    }
  },
  "boxes_demo": {
    "annotation": "data/boxes/multiturn.jsonl",
    "root": "data/media",
    "repeat_time": 2.0,
    "data_augment": false,
    "video_reader_backend": "pyav"
  }
}
"""
AUG = {"prob": 0.5, "views": [0, 1], "ops": ["fog"], "severity": [2, 4]}


@pytest.fixture
def data(tmp_path, make_png) -> Path:
    """tmp_path holding the seed's files: three JSONL files (one row each) and a media folder."""
    make_png("data/media/a.png")
    for rel in ("data/robot3d/part_000.jsonl", "data/robot3d/part_001.jsonl", "data/boxes/multiturn.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(ROW) + "\n")
    return tmp_path


def write_recipe(folder: Path, recipe: dict | str) -> Path:
    path = folder / "recipe.json"
    path.write_text(recipe if isinstance(recipe, str) else json.dumps(recipe, indent=2))
    return path


def entry(**fields: object) -> dict:
    return {"annotation": "data/boxes/multiturn.jsonl", **fields}


def problems_of(path: Path) -> list[Problem]:
    with pytest.raises(FormatError) as info:
        read_recipe(path)
    return list(info.value.problems)


def fields_of(folder: Path, **fields: object) -> list[str]:
    return [p.field for p in problems_of(write_recipe(folder, {"e": entry(**fields)}))]


def test_seed_recipe_reads_in_file_order(data, monkeypatch, tmp_path_factory):
    path = write_recipe(data, SEED_RECIPE)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # paths resolve against the recipe, not the cwd
    robot, boxes = read_recipe(path)
    assert robot == RecipeEntry(
        name="robot3d_demo",
        annotation=(data / "data/robot3d/part_000.jsonl", data / "data/robot3d/part_001.jsonl"),
        root=data / "data/media",
        repeat_time=1.0,
        data_augment=False,
        length=None,
        video_reader_backend="pyav",
        visual_aug=VisualAug(
            0.3,
            "all",
            ("motion_blur", "gaussian_blur", "zoom_blur", "fog", "glass_blur", "light"),
            (1, 10),
            5,
        ),
    )
    assert boxes.name == "boxes_demo" and boxes.repeat_time == 2.0 and boxes.visual_aug is None


def test_defaults(data):
    (e,) = read_recipe(write_recipe(data, {"only": {"annotation": "data/boxes/multiturn.jsonl"}}))
    assert (e.root, e.repeat_time, e.data_augment, e.length, e.video_reader_backend, e.visual_aug) == (
        data.resolve(),
        1.0,
        False,
        None,
        None,
        None,
    )


def test_whole_file_problems(tmp_path):
    assert problems_of(tmp_path / "none.json") == [
        Problem(str(tmp_path / "none.json"), 0, "file", "no such file")
    ]
    (bad,) = problems_of(write_recipe(tmp_path, '{\n  "a": {\n    "annotation": "x",\n  }\n}'))
    assert (bad.line, bad.field) == (4, "recipe") and bad.message.startswith("invalid JSON")
    assert problems_of(write_recipe(tmp_path, "{}"))[0].field == "recipe"
    assert problems_of(write_recipe(tmp_path, "[]"))[0].field == "recipe"
    assert (
        "an entry must be a JSON object" in problems_of(write_recipe(tmp_path, '{"a": "x.jsonl"}'))[0].message
    )


def test_annotation_rules(data):
    read_recipe(write_recipe(data, {"e": {"annotation": ["data/robot3d/part_000.jsonl"]}}))
    assert fields_of(data, annotation=[]) == ["e.annotation"]
    assert fields_of(data, annotation="data/nope.jsonl") == ["e.annotation"]
    assert fields_of(data, annotation=["data/boxes/multiturn.jsonl", 3, "s3://b/x.jsonl"]) == [
        "e.annotation[1]",
        "e.annotation[2]",
    ]
    assert fields_of(
        data, annotation=["data/boxes/multiturn.jsonl", "data/boxes/../boxes/multiturn.jsonl"]
    ) == ["e.annotation[1]"]
    assert [p.field for p in problems_of(write_recipe(data, {"e": {"root": ""}}))] == ["e.annotation"]


def test_root_rules(data):
    (e,) = read_recipe(write_recipe(data, {"e": entry(root="data/media")}))
    assert e.root == (data / "data/media").resolve()
    assert fields_of(data, root="data/absent") == ["e.root"]
    assert fields_of(data, root=5) == ["e.root"]


@pytest.mark.parametrize("good", [0.25, 1, 3.0])
def test_repeat_time_positive_finite(data, good):
    assert read_recipe(write_recipe(data, {"e": entry(repeat_time=good)}))[0].repeat_time == float(good)


@pytest.mark.parametrize("bad", [0, -1.0, True, "2", None])
def test_repeat_time_refused(data, bad):
    assert fields_of(data, repeat_time=bad) == ["e.repeat_time"]


def test_repeat_time_infinity_refused(data):
    text = '{"e": {"annotation": "data/boxes/multiturn.jsonl", "repeat_time": 1e999}}'
    assert [p.field for p in problems_of(write_recipe(data, text))] == ["e.repeat_time"]


def test_data_augment_bool(data):
    assert read_recipe(write_recipe(data, {"e": entry(data_augment=True)}))[0].data_augment is True
    assert fields_of(data, data_augment="yes") == ["e.data_augment"]


def test_length_rules(data):
    assert read_recipe(write_recipe(data, {"e": entry(length=0)}))[0].length == 0
    assert (
        read_recipe(write_recipe(data, {"e": entry(annotation=["data/boxes/multiturn.jsonl"], length=1)}))[
            0
        ].length
        == 1
    )
    assert fields_of(data, length=-1) == ["e.length"]
    assert fields_of(data, length=1.5) == ["e.length"]
    two = ["data/robot3d/part_000.jsonl", "data/robot3d/part_001.jsonl"]
    (problem,) = problems_of(write_recipe(data, {"e": entry(annotation=two, length=2)}))
    assert problem.field == "e.length" and "single-file entry" in problem.message


def test_video_reader_backend(data):
    for backend in ("decord", "pyav", "torchvision"):
        assert (
            read_recipe(write_recipe(data, {"e": entry(video_reader_backend=backend)}))[
                0
            ].video_reader_backend
            == backend
        )
    assert fields_of(data, video_reader_backend="opencv") == ["e.video_reader_backend"]


def test_visual_aug_passes(data):
    (e,) = read_recipe(write_recipe(data, {"e": entry(visual_aug=AUG)}))
    assert e.visual_aug == VisualAug(0.5, (0, 1), ("fog",), (2, 4), None)
    (e,) = read_recipe(write_recipe(data, {"e": entry(visual_aug={**AUG, "prob": 0, "severity": [10, 10]})}))
    assert e.visual_aug.prob == 0.0 and e.visual_aug.severity == (10, 10)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"prob": 1.5}, "prob"),
        ({"prob": -0.1}, "prob"),
        ({"prob": "0.3"}, "prob"),
        ({"views": "some"}, "views"),
        ({"views": [-1]}, "views"),
        ({"views": []}, "views"),
        ({"views": [0, 0]}, "views"),
        ({"ops": []}, "ops"),
        ({"ops": ["blur"]}, "ops"),
        ({"ops": ["fog", "fog"]}, "ops"),
        ({"severity": [0, 3]}, "severity"),
        ({"severity": [5, 3]}, "severity"),
        ({"severity": [1, 11]}, "severity"),
        ({"severity": [1]}, "severity"),
        ({"zoom_max_severity": 11}, "zoom_max_severity"),
        ({"zoom_max_severity": 0}, "zoom_max_severity"),
        ({"strength": 2}, "strength"),
    ],
)
def test_visual_aug_refused(data, change, field):
    assert fields_of(data, visual_aug={**AUG, **change}) == [f"e.visual_aug.{field}"]


def test_visual_aug_required_fields(data):
    assert fields_of(data, visual_aug={"prob": 0.1}) == [
        "e.visual_aug.views",
        "e.visual_aug.ops",
        "e.visual_aug.severity",
    ]
    assert fields_of(data, visual_aug=[AUG]) == ["e.visual_aug"]


def test_unknown_entry_key_and_line_numbers(data):
    path = write_recipe(
        data, SEED_RECIPE.replace('"repeat_time": 2.0,', '"repeat_time": 2.0,\n    "weight": 3,')
    )
    (problem,) = problems_of(path)
    assert str(problem) == f"{path}:20: boxes_demo.weight: unknown key; an entry has " + (
        "annotation, root, repeat_time, data_augment, length, video_reader_backend, visual_aug, dense_scale"
    )
    path = write_recipe(data, SEED_RECIPE.replace('"prob": 0.3', '"prob": 3'))
    (problem,) = problems_of(path)
    # nested fields point at the line of their entry field (`"visual_aug": {`)
    assert (problem.line, problem.field) == (8, "robot3d_demo.visual_aug.prob")


def test_all_entries_reported(data):
    path = write_recipe(data, {"a": entry(repeat_time=0), "b": entry(), "c": entry(length="x")})
    assert [(p.line, p.field) for p in problems_of(path)] == [(4, "a.repeat_time"), (11, "c.length")]


def test_records_read_with_entry_root(data):
    path = write_recipe(data, SEED_RECIPE)
    (robot, robot_rows), (boxes, box_rows) = read_recipe_records(path)
    assert (robot.name, len(robot_rows), boxes.name, len(box_rows)) == ("robot3d_demo", 2, "boxes_demo", 1)
    assert box_rows[0].media[0].path == (data / "data/media/a.png").resolve()


def test_records_problems_from_every_file_and_length_warning(data, caplog):
    (data / "data/robot3d/part_001.jsonl").write_text('{"conversations": []}\n')
    (data / "data/boxes/multiturn.jsonl").write_text("\n")
    with pytest.raises(FormatError) as info:
        read_recipe_records(write_recipe(data, SEED_RECIPE))
    assert [(Path(p.path).name, p.line, p.field) for p in info.value.problems] == [
        ("part_001.jsonl", 1, "conversations"),
        ("multiturn.jsonl", 0, "file"),
    ]
    (data / "data/boxes/multiturn.jsonl").write_text(json.dumps(ROW) + "\n")
    with caplog.at_level(logging.WARNING, logger="data_pipeline.formats.recipe"):
        read_recipe_records(write_recipe(data, {"e": entry(length=5, root="data/media")}))
    assert "expects length=5" in caplog.text and "has 1 records" in caplog.text
    caplog.clear()
    read_recipe_records(write_recipe(data, {"e": entry(length=1, root="data/media")}))
    assert caplog.text == ""
    # check_media=False: media under the wrong root are not looked up
    read_recipe_records(write_recipe(data, {"e": entry()}), check_media=False)


def test_seed_style_recipe_relative_to_the_working_directory_says_where_it_looked(data, monkeypatch):
    # Seed 004's example writes `data/robot3d/…` as the launcher's working directory sees it; a
    # recipe kept in another folder than that directory resolves against its own folder instead.
    (data / "configs").mkdir()
    path = write_recipe(data / "configs", SEED_RECIPE)
    monkeypatch.chdir(data)
    problems = problems_of(path)
    assert [p.field for p in problems] == [
        "robot3d_demo.annotation[0]", "robot3d_demo.annotation[1]", "robot3d_demo.root",
        "boxes_demo.annotation", "boxes_demo.root",
    ]
    first = problems[0].message
    assert str((data / "configs/data/robot3d/part_000.jsonl").resolve()) in first  # where it looked
    assert f"relative paths resolve against the recipe's folder {(data / 'configs').resolve()}" in first
    assert "exists relative to the working directory" in first and '"../data/robot3d/part_000.jsonl"' in first
    assert '"../data/media"' in problems[2].message
    # Nothing to suggest when the working directory does not have it either.
    monkeypatch.chdir(data / "configs")
    assert "working directory" not in problems_of(path)[0].message


def _dense_row(steps: int = 2) -> dict:
    call = {"name": "atomic_decoding", "arguments": {"block_size": 3 * steps + 2}}
    motion = "<dense>" + "<500>" * (3 * steps) + "</dense>"
    return {"conversations": [{"from": "human", "value": "where does the point go?"},
                              {"from": "gpt", "value": f"<tool_call>{json.dumps(call)}</tool_call>{motion}"}]}


def test_dense_scale_is_per_entry_and_required_for_dense_motion(data):
    (data / "dense.jsonl").write_text(json.dumps(_dense_row()) + "\n")
    ((e, rows),) = read_recipe_records(write_recipe(data, {"e": {"annotation": "dense.jsonl", "dense_scale": 0.5}}))
    assert e.dense_scale == 0.5 and [r.dense_scale for r in rows] == [0.5]
    with pytest.raises(FormatError) as info:
        read_recipe_records(write_recipe(data, {"e": {"annotation": "dense.jsonl"}}))
    (problem,) = info.value.problems
    assert (problem.line, problem.field) == (2, "e.dense_scale") and "dense.jsonl:1" in problem.message
    assert fields_of(data, dense_scale=0) == ["e.dense_scale"]
    assert fields_of(data, dense_scale="2m") == ["e.dense_scale"]
    # Entries without dense answers need no scale.
    ((_, rows),) = read_recipe_records(write_recipe(data, {"e": entry(root="data/media")}))
    assert rows[0].dense_scale is None


def test_video_reader_backend_the_loader_cannot_serve_is_refused_for_video_entries(data):
    (data / "data/media/clip.mp4").write_bytes(b"not decoded at validation")
    row = {"image": [{"video": "clip.mp4", "frame_index": 0}], "conversations": ROW["conversations"]}
    (data / "video.jsonl").write_text(json.dumps(row) + "\n")
    video = {"annotation": "video.jsonl", "root": "data/media"}
    read_recipe_records(write_recipe(data, {"v": {**video, "video_reader_backend": "pyav"}}))
    read_recipe_records(write_recipe(data, {"v": video}))
    with pytest.raises(FormatError) as info:
        read_recipe_records(write_recipe(data, {"v": {**video, "video_reader_backend": "decord"}}))
    (problem,) = info.value.problems
    assert (problem.line, problem.field) == (5, "v.video_reader_backend")
    assert "video.jsonl:1" in problem.message and '"pyav"' in problem.message
    # An image-only entry never opens a video reader: any of the seed's backends may be named.
    read_recipe_records(write_recipe(data, {"e": entry(root="data/media", video_reader_backend="torchvision")}))
