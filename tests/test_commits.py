"""Commit subjects of at most 72 characters, over every commit since the hook came in
(.githooks/commit-msg holds the line locally; this holds it in CI, for commits made without it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the last commit before the rule: its subjects and those before it are history, kept as they are
BASE = "10fc094bfc070874ddc34a9de093dd460ac0fd27"
BASE_TIME = 1796134407  # its committer time (2026-12-01T14:13:27Z): the bound in a shallow clone
LIMIT = 72


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def _since_base() -> list[tuple[str, str]]:
    """(hash, subject) of the non-merge commits after BASE, newest first; in a shallow clone
    without BASE, those committed after it."""
    out = []
    for line in _git("log", "--no-merges", "--format=%H%x00%ct%x00%s", "HEAD").splitlines():
        sha, when, subject = line.split("\0", 2)
        if sha == BASE or int(when) <= BASE_TIME:
            break
        out.append((sha, subject))
    return out


def test_commit_subjects_fit_on_a_line() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    long = [f"{sha[:10]} ({len(s)} chars): {s[:80]}" for sha, s in _since_base() if len(s) > LIMIT]
    assert not long, "commit subjects over 72 characters:\n" + "\n".join(long)


def test_the_hook_refuses_a_long_subject(tmp_path: Path) -> None:
    hook = ROOT / ".githooks" / "commit-msg"
    msg = tmp_path / "MSG"
    msg.write_text("x" * 73 + "\n\nbody\n")
    refused = subprocess.run([str(hook), str(msg)], capture_output=True, text=True)
    assert refused.returncode == 1 and "73 characters" in refused.stderr
    msg.write_text("# a comment line git strips\n" + "x" * 72 + "\n\n" + "y" * 300 + "\n")
    assert subprocess.run([str(hook), str(msg)]).returncode == 0
