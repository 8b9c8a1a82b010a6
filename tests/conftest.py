"""Shared by the tests: the test environment, where the real-text corpora are, the one-line error contract, and
the frozen-rank drill of the distributed scripts."""
import os
import signal
import time
from pathlib import Path

import pytest

# One OpenMP thread, here and in every script the tests start (they inherit the environment): the tests' models are
# tiny, and two threads that wait for each other on a busy 2-core machine made their steps 10x slower. It is set
# before any test module imports torch. An OMP_NUM_THREADS of your own is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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


def assert_one_error_line(result, *fragments):
    """A user mistake's contract: exit status 1, nothing but one `error: ...` line on stderr (no traceback)."""
    assert result.returncode == 1, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def child_with_env(parent_pid, entry):
    """The pid of a child of parent_pid whose environment holds entry (e.g. "RANK=1"), found through Linux's /proc;
    None if there is none yet."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == parent_pid and b"\0" + entry.encode() + b"\0" in b"\0" + (stat.parent / "environ").read_bytes():
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile, or not ours to read
    return None


def freeze_rank_1(launcher, ready, seconds=6):
    """The frozen-rank drill on a torchrun launcher: once ready() returns, stop rank 1 (SIGSTOP) for `seconds`
    (twice --timeout: rank 0 has given up by then), then continue it so that torchrun's SIGTERM ends it at once.
    Returns (stdout, stderr, seconds from the freeze to the launcher's exit); the processes never outlive the test."""
    frozen = None
    try:
        ready()
        frozen = child_with_env(launcher.pid, "RANK=1")
        assert frozen is not None, "rank 1's process not found"
        os.kill(frozen, signal.SIGSTOP)
        started = time.time()
        time.sleep(seconds)
        os.kill(frozen, signal.SIGCONT)
        stdout, stderr = launcher.communicate(timeout=90)
        return stdout, stderr, time.time() - started
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
