"""benchmarks/common.py's record of the code a result came from."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import common

REPO = Path(__file__).resolve().parents[2]


def _git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_git_commit_flags_modified_code_and_takes_the_environment(tmp_path, monkeypatch):
    # a clone with benchmarks/common.py in it: HEAD alone, then flagged once the code changes
    monkeypatch.delenv("FP8LINEAR_GIT_COMMIT", raising=False)
    repo = tmp_path / "r"
    for d in ("benchmarks", "fp8linear"):
        (repo / d).mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "common.py", repo / "benchmarks" / "common.py")
    (repo / "fp8linear" / "ops.py").write_text("x = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = _git(repo, "rev-parse", "HEAD")
    monkeypatch.setattr(common, "__file__", str(repo / "benchmarks" / "common.py"))
    assert common.git_commit() == head
    (repo / "benchmarks" / "notes.txt").write_text("untracked files do not count\n")
    assert common.git_commit() == head
    (repo / "fp8linear" / "ops.py").write_text("x = 2\n")
    assert common.git_commit() == (
        head + " (fp8linear/, integrations/ or csrc/ modified in the work tree)")
    monkeypatch.setenv("FP8LINEAR_GIT_COMMIT", "abc1234")
    assert common.git_commit() == "abc1234"


def test_new_folder_replaces_whole_or_not_at_all(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="half written"):
        with common.new_folder(out) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("half written")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary folder left
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    with common.new_folder(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert (out.stat().st_mode & 0o777, (out / "new.txt").stat().st_mode & 0o777) == (0o755, 0o644)
