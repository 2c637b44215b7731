"""A worker runs only the commit its deployment names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from datagen.app.codeversion import check_code_version, code_version
from datagen.errors import CodeVersionError


def _repo(path: Path) -> Path:
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    path.mkdir()
    subprocess.run([*git, "init", "-q"], check=True)
    (path / "a.txt").write_text("one\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    return path


def test_a_deployed_commit_passes_and_another_is_refused_with_the_update_commands(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "clone")
    deployed = code_version(repo)
    assert deployed is not None and deployed.startswith("git-") and not deployed.endswith("-dirty")
    assert check_code_version(deployed, repo) == deployed

    (repo / "a.txt").write_text("two\n")
    assert code_version(repo) == deployed + "-dirty"  # same commit, local edits: still that commit
    assert check_code_version(deployed, repo) == deployed + "-dirty"

    with pytest.raises(CodeVersionError, match=r"git -C .* checkout 0123456789ab"):
        check_code_version("git-0123456789abcdef0123456789abcdef01234567", repo)


def test_versions_not_set_by_datagen_deploy_are_not_checked(tmp_path: Path) -> None:
    assert check_code_version(None, tmp_path) is None
    assert check_code_version("3f2a9c1", tmp_path) is None
    with pytest.raises(CodeVersionError, match="no git commit"):
        check_code_version("git-0123456789abcdef0123456789abcdef01234567", tmp_path)
