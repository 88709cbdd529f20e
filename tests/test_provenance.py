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
