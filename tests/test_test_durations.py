"""scripts/test_durations.py reads a parallel run's JUnit XML into the ids tests/conftest.py orders
groups by (``longest_first``): without the group suffix the run adds, with the class of a test in a
class, only tests of at least a second."""

from __future__ import annotations

from pathlib import Path

from scripts.test_durations import durations, without_group


def test_the_group_suffix_goes_and_a_parameter_keeps_its_at() -> None:
    assert without_group("test_x@tests/e2e/test_y.py") == "test_x"
    assert without_group("test_x[process]@tests/e2e/test_y.py]") == "test_x[process]"
    assert without_group("test_x[alice@allowed.example-True]@ray]") == "test_x[alice@allowed.example-True]"
    assert without_group("test_x[alice@allowed.example-True]") == "test_x[alice@allowed.example-True]"
    assert without_group("test_x") == "test_x"


def test_a_junit_file_gives_the_conftest_s_ids(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    here, group = "tests.test_test_durations", "@tests/test_test_durations.py"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        f'<testcase classname="{here}" name="test_a{group}" time="2.5"/>'
        f'<testcase classname="{here}" name="test_b[p]@ray]" time="0.2"/>'
        f'<testcase classname="{here}.TestC" name="test_d{group}" time="1"/>'
        "</testsuite></testsuites>"
    )
    assert durations(junit) == {
        "tests/test_test_durations.py::test_a": 2.5,
        "tests/test_test_durations.py::TestC::test_d": 1.0,
    }
