"""Shared pytest fixtures: where the repo and the real-text corpora are."""
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# CI puts the shared corpora beside the checkout; a fresh clone without them still passes (tests skip).
CORPORA = Path(os.environ.get("CORPORA_DIR", REPO.parent / "shared" / "corpora"))


@pytest.fixture(scope="session")
def corpus():
    """corpus("udhr.jsonl") -> its path, or a skip with the reason when the shared corpora are absent."""
    def find(name):
        path = CORPORA / name
        if not path.exists():
            pytest.skip(f"{path} not found: the shared real-text corpora are not beside this checkout")
        return path
    return find
