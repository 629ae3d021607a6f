"""Every file under benchmarks/results/ is what a script wrote (benchmarks/check_records.py): a
key added by hand, a commit that is no commit, a stray file or a stale index fails here."""

import importlib.util
import json
import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Loaded from its file, with sys.path left alone: the other benchmark modules the tests import
# come from tests/bench_scripts.py's copy of the tree, this one must read this repository.
_spec = importlib.util.spec_from_file_location(
    "check_records", os.path.join(REPO, "benchmarks", "check_records.py"))
check_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_records)

pytestmark = pytest.mark.skipif(not check_records.git_history(),
                                reason="needs the repository's git history (record commits)")


def test_every_record_is_what_its_script_wrote():
    assert check_records.records(), "no records under benchmarks/results/"
    assert check_records.problems() == []


def test_the_index_lists_every_record_with_its_command():
    with open(os.path.join(check_records.RESULTS, check_records.INDEX)) as f:
        index = f.read()
    for path in check_records.records():
        with open(path) as f:
            command = json.load(f)["command"]
        assert f"`{os.path.basename(path)}`" in index
        assert command.replace("|", "\\|").replace("`", "'") in index


@pytest.fixture
def results(tmp_path):
    """A copy of two records of different scripts, with an index that matches them."""
    for name in ("1xH200-step-bare.json", "1xH200-launch_floor.json"):
        shutil.copy(os.path.join(check_records.RESULTS, name), tmp_path)
    (tmp_path / check_records.INDEX).write_text(check_records.index_text(str(tmp_path)))
    assert check_records.problems(str(tmp_path)) == []
    return tmp_path


def _edit(path, change):
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("change, expected", [
    # a key its script did not write at that commit (a note before scripts wrote one)
    (lambda r: r.update(note="measured after the suite"), "keys benchmarks/bench_step.py does not"),
    # a figure computed afterwards and added to a per-case record
    (lambda r: r["records"][0].update(per_layer_us_8_16=20.1), "records[0] has keys"),
    # a commit that is no commit
    (lambda r: r.update(commit="02c9868+aot3"), "is no commit"),
    (lambda r: r.update(commit="0123456"), "not a commit of this repository"),
    (lambda r: r.update(dirty_diff_sha256="patched"), "is no SHA-256"),
    # runs wrapped together by hand
    (lambda r: r.update(variants={"v0": {}}, change="v0"), "does not write: ['change', 'va"),
    (lambda r: r.update(command="one device call: profile_ops, then bench_step"), "names no"),
])
def test_a_hand_edit_fails(results, change, expected):
    path = results / "1xH200-step-bare.json"
    _edit(path, change)
    (results / check_records.INDEX).write_text(check_records.index_text(str(results)))
    found = check_records.problems(str(results))
    assert any(expected in line for line in found), found


def test_a_stray_file_or_a_stale_index_fails(results):
    (results / "1xH200-sanitizers.txt").write_text("memcheck: 0 errors\n")
    _edit(results / "1xH200-launch_floor.json", lambda r: r.update(date="2026-12-03"))
    found = check_records.problems(str(results))
    assert any(line.startswith("1xH200-sanitizers.txt: no script wrote it") for line in found)
    assert any(line.startswith("README.md: out of date") for line in found), found
