"""Result files of the benchmarks: where they go, the header that says what ran (machine, date,
tree state, command), and the JSON writer.

By default a script writes into ``benchmarks/out/`` (``DEFAULT_OUT``), which git ignores; a
record is kept in the tracked ``benchmarks/results/`` only when ``--out benchmarks/results``
asks for it (then ``python3 benchmarks/check_records.py --index`` lists it).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import bench_mesh as bm
import jax
import tree_state  # benchmarks/ is on sys.path wherever the benchmark modules import

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "benchmarks", "out")  # ignored by git (.gitignore)
RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")  # the tracked records


def machine_name() -> str:
    """``"<count>x<GPU>"`` from nvidia-smi (e.g. ``"2xH200"``), else ``"<count>x<platform>"``."""
    count = jax.device_count()
    if bm.on_gpu() and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout
            names = [line.strip() for line in out.splitlines() if line.strip()]
            if names:
                words = [w for w in names[0].split() if w.upper() != "NVIDIA"]
                return f"{count}x{words[0] if words else names[0]}"
        except (OSError, subprocess.SubprocessError):
            pass
    if bm.on_gpu():
        kind = jax.devices()[0].device_kind.replace("NVIDIA", "").split()
        return f"{count}x{kind[0] if kind else 'gpu'}"
    return f"{count}x{jax.default_backend()}"


def git_commit() -> str:
    """The commit the records name (``tree_state.tree_state``: ``$JAX_EP_COMMIT`` when set, for a
    tree that travelled to a GPU machine whose copy may carry a stale ``.git``; else the
    checkout's; ``"unknown"`` without either)."""
    return tree_state.tree_state(REPO_ROOT)[0]


def today() -> str:
    return datetime.date.today().isoformat()


def add_note_argument(parser) -> None:
    """``--note TEXT``: free text stored in the record (what the run is for, what was special)."""
    parser.add_argument("--note", help="free text stored in the result file's 'note'")


def add_out_argument(parser, what: str = "folder of the result file") -> None:
    """``--out``: where the script writes (default ``DEFAULT_OUT``, untracked); a record goes
    into the tracked ``benchmarks/results/`` only when named there."""
    parser.add_argument(
        "--out", default=DEFAULT_OUT,
        help=f"{what} (default benchmarks/out/, which git ignores; --out benchmarks/results "
             "keeps a record in the tracked tree: then run benchmarks/check_records.py --index)")


def tree_header(argv: Sequence[str], note: str | None = None,
                script: str | None = None) -> dict[str, Any]:
    """The part of a record's header that says what ran: ``commit``, ``dirty_diff_sha256``
    (``benchmarks/tree_state.py``: None for a clean tree), ``note`` and ``command`` (``script``,
    the running script's ``__file__``, else ``sys.argv[0]``, then ``argv``)."""
    commit, diff = tree_state.tree_state(REPO_ROOT)
    program = os.path.relpath(script or sys.argv[0], REPO_ROOT)
    return {"commit": commit, "dirty_diff_sha256": diff, "note": note,
            "command": shlex.join([program, *argv])}


def result_header(argv: Sequence[str], note: str | None = None,
                  script: str | None = None) -> dict[str, Any]:
    """A record's header: machine, date, the tree state and command (``tree_header``), JAX."""
    return {
        "machine": machine_name(),
        "date": today(),
        **tree_header(argv, note, script),
        "jax_version": jax.__version__,
        "platform": jax.default_backend(),
        "processes": jax.process_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def result_path(out: str, header: dict[str, Any], *parts: str | None) -> str:
    """The JSON file a script writes: ``out`` itself when it ends in ``.json``, else
    ``<out>/<machine>-<date>[-<part>...].json`` (parts that are None left out); its folder is
    created."""
    if out.endswith(".json"):
        path = out
    else:
        name = "-".join([header["machine"], header["date"], *(p for p in parts if p)])
        path = os.path.join(out, name + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
