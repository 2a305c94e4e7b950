"""A snapshot of this working tree as a git repository, for the CI pipeline's end-to-end test and
its benchmark (bench/ci_pipeline.py): the pipeline clones from a "remote" as it would from GitHub."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IDENTITY = ["-c", "user.name=dev", "-c", "user.email=dev@example.com"]


def git(*args: str, cwd: Path) -> str:
    """``git args`` in ``cwd`` with a fixed committer; its stdout. Raises CalledProcessError."""
    return subprocess.run(["git", *IDENTITY, *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def snapshot(root: Path, source: Path = REPO) -> tuple[Path, Path, str]:
    """``source``'s tracked files, as they are on disk (uncommitted edits included, untracked files
    not), committed on ``main`` of a new repository ``root/src`` whose remote ``origin`` is a bare
    clone ``root/origin.git``; returns (src, bare, sha)."""
    src = root / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached"], cwd=source, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (source / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, src / rel)
    git("init", "-q", "-b", "main", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "base", cwd=src)
    bare = root / "origin.git"
    git("clone", "-q", "--bare", str(src), str(bare), cwd=root)
    git("remote", "add", "origin", str(bare), cwd=src)
    return src, bare, git("rev-parse", "HEAD", cwd=src)
