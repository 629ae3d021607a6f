"""The tree state a benchmark record carries: the commit, and a hash of the uncommitted changes.

    export $(python3 benchmarks/tree_state.py)   # before copying the tree to another machine

prints ``JAX_EP_COMMIT=<commit>`` and ``JAX_EP_DIFF_SHA256=<sha256 of git diff HEAD, or clean>``.
A copied tree may carry no ``.git`` or a stale one; with these two variables set, the records
written there name the tree they ran (``bench_records.result_header``). Standard library only, so
it runs before anything is installed.

A record's ``commit`` is 7 to 40 hex digits or ``"unknown"`` (no git and no ``JAX_EP_COMMIT``);
its ``dirty_diff_sha256`` is ``None`` for a clean tree, the SHA-256 of ``git diff HEAD --binary``
(tracked files only: untracked files are not covered) for a dirty one, or ``"unknown"`` when it
cannot tell (``JAX_EP_COMMIT`` names another commit than the checkout's and
``JAX_EP_DIFF_SHA256`` is unset).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

COMMIT_RE = re.compile(r"^[0-9a-f]{7,40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
CLEAN = "clean"
UNKNOWN = "unknown"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(root: str, *args: str) -> bytes | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _same_commit(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a)


def tree_state(root: str = REPO_ROOT, environ=None) -> tuple[str, str | None]:
    """``(commit, dirty_diff_sha256)`` of the tree at ``root`` (see the module docstring).

    Raises:
      ValueError: ``JAX_EP_COMMIT`` is set but is no commit (7-40 hex digits), or
        ``JAX_EP_DIFF_SHA256`` is set but is neither ``clean`` nor 64 hex digits.
    """
    environ = os.environ if environ is None else environ
    head_out = _git(root, "rev-parse", "HEAD")
    head = head_out.decode().strip() if head_out else None
    commit = environ.get("JAX_EP_COMMIT", "").strip()
    if commit:
        if not COMMIT_RE.match(commit):
            raise ValueError(f"JAX_EP_COMMIT={commit!r} is not a commit: set it to "
                             "`git rev-parse --short HEAD` of the tree that runs")
    else:
        commit = head[:7] if head else UNKNOWN
    diff = environ.get("JAX_EP_DIFF_SHA256", "").strip()
    if diff:
        if diff != CLEAN and not SHA256_RE.match(diff):
            raise ValueError(f"JAX_EP_DIFF_SHA256={diff!r}: expected 'clean' or the 64 hex "
                             "digits of `git diff HEAD --binary | sha256sum`")
        return commit, None if diff == CLEAN else diff
    if head is None or commit == UNKNOWN or not _same_commit(head, commit):
        return commit, UNKNOWN
    raw = _git(root, "diff", "HEAD", "--binary")
    if raw is None:
        return commit, UNKNOWN
    return commit, hashlib.sha256(raw).hexdigest() if raw else None


def main() -> None:
    commit, diff = tree_state(REPO_ROOT, {})
    if commit == UNKNOWN or diff == UNKNOWN:
        raise SystemExit(f"{REPO_ROOT} is not a git checkout: no tree state to print")
    print(f"JAX_EP_COMMIT={commit}")
    print(f"JAX_EP_DIFF_SHA256={diff or CLEAN}")


if __name__ == "__main__":
    sys.exit(main())
