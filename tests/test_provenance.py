"""Where a number came from: the commit a run records, inside and outside a git checkout."""

import re

from flatbnn.engine import provenance


def test_inside_the_checkout_the_commit_is_heads_sha():
    git = provenance.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}", git["commit"]) and isinstance(git["dirty"], bool)


def test_outside_a_checkout_the_commit_is_unknown_or_named_and_never_claims_clean(tmp_path, monkeypatch):
    # Code copied without .git (rsync to a cluster, a GPU box): `git status` there prints nothing,
    # which must not be recorded as a clean tree of some commit.
    monkeypatch.setattr(provenance, "REPO_DIR", tmp_path)
    monkeypatch.delenv("FLATBNN_COMMIT", raising=False)
    assert provenance.git_commit() == {"commit": "unknown", "dirty": None}
    monkeypatch.setenv("FLATBNN_COMMIT", "1169f6a0")
    assert provenance.git_commit(untracked=True) == {"commit": "1169f6a0", "dirty": None}


def test_dirty_means_changed_code_not_a_regenerated_results_file(tmp_path, monkeypatch):
    """A run resumed right after `reproduce.py status` rewrote results/STATUS.md trained committed code."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "STATUS.md").write_text("board\n")
    (tmp_path / "train.py").write_text("lr = 0.1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(provenance, "REPO_DIR", tmp_path)
    assert provenance.git_commit()["dirty"] is False
    (tmp_path / "results" / "STATUS.md").write_text("board, regenerated\n")
    (tmp_path / "results" / "new.md").write_text("a new comparison\n")
    assert provenance.git_commit()["dirty"] is False and provenance.git_commit(untracked=True)["dirty"] is False
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert provenance.git_commit()["dirty"] is False and provenance.git_commit(untracked=True)["dirty"] is True
    (tmp_path / "train.py").write_text("lr = 0.2\n")
    assert provenance.git_commit()["dirty"] is True
