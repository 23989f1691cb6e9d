"""Write tests/file_seconds.json (the conftest's heaviest-first order) from a run's junit XML.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python tests/file_seconds.py /tmp/junit.xml

Seconds per test file: the sum of its tests' times (setup, call and teardown, as junit records them),
module fixtures included, so a file that trains a workdir once for all its tests weighs what it costs.
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


if __name__ == "__main__":
    out = Path(__file__).with_name("file_seconds.json")
    measured = {"_source": f"measured by tests/file_seconds.py from {Path(sys.argv[1]).name}",
                **file_seconds(Path(sys.argv[1]))}
    out.write_text(json.dumps(measured, indent=1) + "\n")
    print(f"{out}: {len(measured) - 1} files")
