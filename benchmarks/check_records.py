"""Checks that every file under ``benchmarks/results/`` is what a script wrote; writes the index.

    python3 benchmarks/check_records.py            # exit 1, naming each problem, if any
    python3 benchmarks/check_records.py --index    # rewrite benchmarks/results/README.md

A record is a JSON file whose ``command`` names the script that wrote it (``benchmarks/*.py``
or ``scripts/*.sh``). The checker derives what that script writes from its source, as it was at
the record's ``commit`` (and as it is now, for a record of an uncommitted tree or of an unknown
commit): every string constant that is a name (``"time_us"``) and every keyword argument of a
call (``dict(k=...)``, ``make_record(..., k=...)``), in the script and in the benchmark modules
it imports. A record passes when:

- its ``commit`` is 7-40 hex digits (a commit of this repository) or ``"unknown"``, and its
  ``dirty_diff_sha256``, if present, is None, ``"unknown"`` or 64 hex digits
  (``benchmarks/tree_state.py``);
- its keys, and the keys of every object in a list at its top level (the per-case records),
  are names its script writes: a key added by hand (a ``note`` before scripts wrote one, a
  figure computed afterwards) fails;
- every file it names under ``plots`` exists.

Other files under ``benchmarks/results/``: the index (``README.md``, generated here from the
records, so it must match them) and the plots that records name. Standard library only; needs
git (the CPU test, ``tests/test_records.py``, skips without the repository's history).
"""

from __future__ import annotations

import argparse
import ast
import functools
import glob
import json
import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
INDEX = "README.md"
COMMIT_RE = re.compile(r"^[0-9a-f]{7,40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SCRIPT_RE = re.compile(r"(?:^|[\s/=])((?:benchmarks|scripts)/[\w.-]+\.(?:py|sh))\b")
QUOTED_NAME_RE = re.compile(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_history() -> bool:
    """Whether the repository's full history is here (the commit and source checks need it)."""
    return (_git("rev-parse", "--is-shallow-repository") or "").strip() == "false"


@functools.cache
def _source(path: str, commit: str | None) -> str | None:
    """``path`` (repository-relative) at ``commit``, or in the working tree for None."""
    if commit is None:
        full = os.path.join(REPO_ROOT, path)
        return open(full).read() if os.path.isfile(full) else None
    return _git("show", f"{commit}:{path}")


@functools.cache
def _benchmark_modules(commit: str | None) -> frozenset[str]:
    """The modules of ``benchmarks/`` (``bench_records``, ...) at ``commit``, or in the working
    tree for None: a record's script imported those of its own commit."""
    if commit is None:
        paths = glob.glob(os.path.join(REPO_ROOT, "benchmarks", "*.py"))
        return frozenset(os.path.basename(p)[:-3] for p in paths)
    listed = _git("ls-tree", "--name-only", f"{commit}:benchmarks") or ""
    return frozenset(name[:-3] for name in listed.split() if name.endswith(".py"))


def _names_in_python(text: str) -> tuple[set[str], set[str]]:
    """(names a Python source writes as keys, modules it imports)."""
    names, imports = set(), set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if NAME_RE.match(node.value):
                names.add(node.value)
        elif isinstance(node, ast.Call):  # dict(k=...), rec.update(k=...), make_record(k=...)
            names.update(k.arg for k in node.keywords if k.arg)
        elif isinstance(node, ast.Import):
            imports.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imports.add(node.module)
    return names, imports


@functools.cache
def _names_at(path: str, commit: str | None) -> frozenset[str]:
    """The key names that ``path`` and the benchmark modules it imports write, at ``commit``."""
    text = _source(path, commit)
    if text is None:
        return frozenset()
    if path.endswith(".py"):
        try:
            names, imports = _names_in_python(text)
        except SyntaxError:
            return frozenset()
    else:  # a shell script with Python inline: quoted names, and the modules it imports
        names = set(QUOTED_NAME_RE.findall(text))
        imports = set(re.findall(r"\bimport (\w+)", text))
    for module in imports & _benchmark_modules(commit):
        if f"benchmarks/{module}.py" != path:
            names |= _names_at(f"benchmarks/{module}.py", commit)
    return frozenset(names)


def script_of(command: str) -> str | None:
    """The repository-relative script a record's ``command`` ran, or None."""
    match = SCRIPT_RE.search(command or "")
    return match.group(1) if match else None


def record_problems(path: str, check_history: bool = True) -> list[str]:
    """What is wrong with one record (empty: it is what its script wrote)."""
    name = os.path.basename(path)
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        return [f"{name}: not JSON ({e})"]
    if not isinstance(record, dict):
        return [f"{name}: not a JSON object"]
    problems = []
    script = script_of(record.get("command", ""))
    if script is None:
        return [f"{name}: its command {record.get('command')!r} names no script "
                "(benchmarks/*.py or scripts/*.sh)"]
    commit = record.get("commit")
    if not (isinstance(commit, str) and (COMMIT_RE.match(commit) or commit == "unknown")):
        problems.append(f"{name}: commit {commit!r} is no commit (7-40 hex digits or 'unknown')")
        commit = None
    elif commit == "unknown":
        commit = None
    elif check_history and _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        problems.append(f"{name}: commit {commit} is not a commit of this repository")
        commit = None
    if "dirty_diff_sha256" in record:
        diff = record["dirty_diff_sha256"]
        if not (diff is None or diff == "unknown" or
                (isinstance(diff, str) and SHA256_RE.match(diff))):
            problems.append(f"{name}: dirty_diff_sha256 {diff!r} is no SHA-256")
    # The script as it was at the record's commit; as it is now too when the tree was dirty
    # or the commit is unknown (the record may come from edits committed since).
    written = _names_at(script, commit) if commit else frozenset()
    if commit is None or record.get("dirty_diff_sha256") is not None:
        written |= _names_at(script, None)
    if not written:
        return problems + [f"{name}: {script} is not in this repository"]
    extra = sorted(set(record) - written)
    if extra:
        problems.append(f"{name}: keys {script} does not write: {extra}")
    for key, value in record.items():
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict) and set(item) - written:
                    problems.append(f"{name}: {key}[{i}] has keys {script} does not write: "
                                    f"{sorted(set(item) - written)}")
    for plot in record.get("plots") or []:
        if not os.path.isfile(os.path.join(os.path.dirname(path), plot)):
            problems.append(f"{name}: its plot {plot} is missing")
    return problems


def records(results: str = RESULTS) -> list[str]:
    return sorted(glob.glob(os.path.join(results, "*.json")))


def index_text(results: str = RESULTS) -> str:
    """The index: one row per record, with its script, machine, date, commit and command."""
    lines = ["# Benchmark records", "",
             "Generated by `python3 benchmarks/check_records.py --index` from the records",
             "themselves. Each file is what the script of its command wrote, as that check",
             "(run by the CPU tests, `tests/test_records.py`) verifies; a run's date, commit",
             "(and `dirty_diff_sha256` for an uncommitted tree), command and note are inside",
             "its file. The README and `docs/` cite these files for every figure they give.", "",
             "| file | machine | date | commit | command |", "| --- | --- | --- | --- | --- |"]
    for path in records(results):
        with open(path) as f:
            record = json.load(f)
        command = (record.get("command") or "").replace("|", "\\|").replace("`", "'")
        lines.append(f"| `{os.path.basename(path)}` | {record.get('machine', '-')} | "
                     f"{record.get('date', '-')} | {record.get('commit', '-')} | "
                     f"`{command}` |")
        if record.get("note"):
            lines.append(f"| | | | | note: {record['note']} |")
    return "\n".join(lines) + "\n"


def problems(results: str = RESULTS, check_history: bool = True) -> list[str]:
    """Every problem of the folder: its records, stray files, and a stale index."""
    found = []
    plots = set()
    for path in records(results):
        found += record_problems(path, check_history)
        try:
            with open(path) as f:
                plots.update((json.load(f) or {}).get("plots") or [])
        except (OSError, ValueError, AttributeError):
            pass
    for path in sorted(glob.glob(os.path.join(results, "*"))):
        name = os.path.basename(path)
        if not name.endswith(".json") and name != INDEX and name not in plots:
            found.append(f"{name}: no script wrote it (neither a record nor a record's plot)")
    index = os.path.join(results, INDEX)
    current = open(index).read() if os.path.isfile(index) else None
    if current != index_text(results):
        found.append(f"{INDEX}: out of date: run python3 benchmarks/check_records.py --index")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", action="store_true", help=f"rewrite {INDEX} from the records")
    p.add_argument("--results", default=RESULTS, help="the folder of records")
    args = p.parse_args(argv)
    if args.index:
        with open(os.path.join(args.results, INDEX), "w") as f:
            f.write(index_text(args.results))
    found = problems(args.results, check_history=git_history())
    for line in found:
        print(line)
    print(f"{len(records(args.results))} records, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
