"""Write tests/file_seconds.json (the conftest's heaviest-first order) from a run's junit XML.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python tests/file_seconds.py /tmp/junit.xml

Seconds per test file: the sum of its tests' times (setup, call and teardown, as junit records them),
module fixtures included, so a file that trains a workdir once for all its tests weighs what it costs.
The files the run measured take its figures, the others keep the table's (`merged`): `make test`, which the
table orders for CI, leaves the `heavy` tests out, so files of heavy tests alone are not in its report
and keep what `make test-all` measured (they start first in `make test-all` either way).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_seconds(junit: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").split(".")
        # classname is the dotted module path (tests.test_x or tests.test_x.TestClass)
        module = next((i for i, part in enumerate(path) if part.startswith("test_")), None)
        if module is None:
            continue
        seconds["/".join(path[:module + 1]) + ".py"] += float(case.get("time", 0.0))
    return dict(sorted(((name, round(value, 1)) for name, value in seconds.items()), key=lambda kv: -kv[1]))


def merged(table: dict, measured: dict[str, float], source: str) -> dict:
    """`table` (a file_seconds.json) with `measured`'s files replaced, heaviest first; `_source` says which."""
    kept = {name: value for name, value in table.items() if not name.startswith("_") and name not in measured}
    rows = sorted({**kept, **measured}.items(), key=lambda kv: -kv[1])
    note = f"measured by tests/file_seconds.py from {source}"
    if kept:
        note += f"; {len(kept)} file(s) it did not run keep their earlier figures"
    return {"_source": note, **dict(rows)}


if __name__ == "__main__":
    out = Path(__file__).with_name("file_seconds.json")
    before = json.loads(out.read_text()) if out.is_file() else {}
    table = merged(before, file_seconds(Path(sys.argv[1])), Path(sys.argv[1]).name)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{out}: {len(table) - 1} files")
