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


def test_a_dirty_copy_whose_git_is_not_its_history_records_the_named_commit(tmp_path, monkeypatch):
    """The GPU device's copy of the working tree carries the session's first commit as .git: dirty at that HEAD, it
    recorded "427456b2+dirty" for code at 822dc4a, which the window names ($FLATBNN_COMMIT from .device/COMMIT)."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "train.py").write_text("lr = 0.1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    head = git("rev-parse", "HEAD").strip()
    monkeypatch.setattr(provenance, "REPO_DIR", tmp_path)
    monkeypatch.setenv("FLATBNN_COMMIT", "822dc4a0")
    assert provenance.git_commit() == {"commit": head, "dirty": False}     # clean: HEAD's code, whatever is named
    (tmp_path / "train.py").write_text("lr = 0.2\n")                       # the tree moved on; its .git did not
    assert provenance.git_commit() == {"commit": "822dc4a0", "dirty": None}
    monkeypatch.setenv("FLATBNN_COMMIT", head[:8])                          # named = HEAD: the checkout's own state
    assert provenance.git_commit() == {"commit": head, "dirty": True}
    monkeypatch.delenv("FLATBNN_COMMIT")
    assert provenance.git_commit() == {"commit": head, "dirty": True}
