"""Record what each test took in a run (`uv run python -m scripts.test_durations JUNIT.xml`), for the
suite's ordering of its parallel groups (tests/conftest.py, ``longest_first``): the costliest groups
go to the test processes first, so none is left running alone at the end.

Reads the JUnit XML of a run (`uv run pytest --junitxml=FILE`) and writes tests/durations.json: the
seconds of every test that took at least MIN_S (call, setup and teardown together), by test id
without the ``@group`` suffix the parallel run adds. Tests not listed cost the conftest's estimate.
A stale file only orders the groups less well; it changes no result.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
MIN_S = 1.0


def without_group(name: str) -> str:
    """A test's name without the group the parallel run adds (tests/conftest.py, ``in_group``):
    ``test_x@group`` and, with parameters, ``test_x[p]@group]`` (a parameter may hold ``@``)."""
    if name.endswith("]") and "]@" in name:
        return name[: name.rfind("]@") + 1]
    if "[" not in name and "@" in name:
        return name[: name.rfind("@")]
    return name


def durations(junit: Path) -> dict[str, float]:
    found: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = case.get("name", "")
        name = without_group(name)
        if not module or not name:
            continue
        # classname is the dotted module path, plus the class for a test in a class.
        parts = module.split("/")
        path, cls = parts, list[str]()
        while path and not Path(*path).with_suffix(".py").exists():
            cls.insert(0, path.pop())
        if not path:
            continue
        test_id = "::".join([str(Path(*path).with_suffix(".py")), *cls, name])
        seconds = float(case.get("time", "0") or 0)
        if seconds >= MIN_S:
            found[test_id] = round(found.get(test_id, 0.0) + seconds, 1)
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m scripts.test_durations JUNIT.xml", file=sys.stderr)
        return 2
    found = durations(Path(argv[0]))
    OUT.write_text(json.dumps(dict(sorted(found.items())), indent=0) + "\n")
    print(f"{len(found)} tests of at least {MIN_S:g} s, {sum(found.values()) / 60:.1f} min, in {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
