"""train_bpe_multigpu.py under torchrun on the CPU (gloo): the same tokenizer as train_bpe_cpu.py, train_bpe_gpu.py
and rustbpe.

Every test launches real processes (`python -m torch.distributed.run --standalone`), so the sharding, the
exchange of count deltas and the error paths run exactly as on a GPU node, only with gloo instead of NCCL.
"""
import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import regex
import rustbpe
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu as cpu_bpe  # noqa: E402
import train_bpe_gpu as gpu_bpe  # noqa: E402

SCRIPT = REPO / "train_bpe_multigpu.py"


def torchrun(nproc, *args, cwd, device="cpu"):
    """Launch the script on nproc CPU ranks. The timeout makes a hang fail the test instead of blocking CI."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(SCRIPT), "--device", device, "--timeout", "60", "--cache_dir", str(cwd / "cache"), *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def cpu_vocab(docs, vocab_size):
    """train_bpe_cpu.py's trainer in this process, on the same documents."""
    chunk_counts = Counter()
    for doc in docs:
        chunk_counts.update(regex.findall(cpu_bpe.pattern, doc))
    merges, _ = cpu_bpe.train(chunk_counts, vocab_size)
    return cpu_bpe.token_bytes(merges)


def gpu_vocab(docs, vocab_size):
    """train_bpe_gpu.py's single-device engine (on the CPU device here), on the same documents."""
    chunk_counts = Counter()
    for doc in docs:
        chunk_counts.update(regex.findall(gpu_bpe.pattern, doc))
    merges, _ = gpu_bpe.train(chunk_counts, vocab_size, device="cpu")
    return gpu_bpe.token_bytes(merges)


def rustbpe_vocab(docs, vocab_size):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=cpu_bpe.pattern)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def tiktoken_file(vocab):
    """The exact bytes train_bpe_cpu.py writes for this vocabulary."""
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(vocab)).encode()


def first_chars(docs, num_chars):
    kept = []
    for doc in docs:
        if num_chars <= 0:
            break
        kept.append(doc[:num_chars])
        num_chars -= len(kept[-1])
    return kept


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs), encoding="utf-8")
    return path


def check_equal_to_references(result, out_dir, docs, vocab_size):
    assert result.returncode == 0, result.stdout + result.stderr
    expected = cpu_vocab(docs, vocab_size)
    # the three references agree with each other first
    assert expected == rustbpe_vocab(docs, vocab_size) == gpu_vocab(docs, vocab_size)
    assert (out_dir / "tokenizer.tiktoken").read_bytes() == tiktoken_file(expected)
    info = json.loads((out_dir / "tokenizer.json").read_text())
    assert info["special_tokens"] == {"<|endoftext|>": len(expected)} and info["vocab_size"] == len(expected) + 1
    assert info["num_chars"] == sum(map(len, docs)) and info["trainer"] == "train_bpe_multigpu.py"


# ---------------------------------------------------------------- byte-identical to the references


def test_two_ranks_multilingual_equal_cpu_and_rustbpe_and_rerun_uses_the_cache(corpus, tmp_path):
    udhr = corpus("udhr.jsonl")
    num_chars, vocab_size = 150_000, 500
    with open(udhr, encoding="utf-8") as f:
        docs = first_chars((json.loads(line)["text"] for line in f if line.strip()), num_chars)
    # --workers 2: each rank pre-tokenizes with two worker processes, as it does by default on big shares
    first = torchrun(2, "--data", udhr, "-n", num_chars, "-v", vocab_size, "--out", tmp_path / "first", "--workers", 2,
                     cwd=tmp_path)
    check_equal_to_references(first, tmp_path / "first", docs, vocab_size)
    assert "cache:" not in first.stdout
    assert len(list((tmp_path / "cache").glob("*/rank*.json"))) == 2  # one counted share per rank
    second = torchrun(2, "--data", udhr, "-n", num_chars, "-v", vocab_size, "--out", tmp_path / "second", cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "cache: 2 of 2 ranks reused their counted chunks" in second.stdout
    assert "reading (rank 0's share)" not in second.stderr  # nothing was read or pre-tokenized again
    assert (tmp_path / "second/tokenizer.tiktoken").read_bytes() == (tmp_path / "first/tokenizer.tiktoken").read_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: the NCCL path runs on GPU machines only")
def test_nccl_on_the_gpus_equals_cpu_and_rustbpe(corpus, tmp_path):
    udhr = corpus("udhr.jsonl")
    with open(udhr, encoding="utf-8") as f:
        docs = first_chars((json.loads(line)["text"] for line in f if line.strip()), 150_000)
    nproc = min(torch.cuda.device_count(), 2)
    result = torchrun(nproc, "--data", udhr, "-n", 150_000, "-v", 500, "--out", tmp_path / "tok", cwd=tmp_path,
                      device="cuda")
    check_equal_to_references(result, tmp_path / "tok", docs, 500)
    assert "backend nccl" in result.stdout


# 114 letters (ASCII, and accented ones whose second UTF-8 byte varies) around "ab": merging (a, b) changes the
# counts of ~450 distinct neighbouring pairs on the rank that holds them, more than the 256 that fit in the
# packet, so the second all_gather runs (the test checks that it did).
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [chr(c) for c in range(0xC0, 0x100) if chr(c).isalpha()]
MANY_NEIGHBOURS = " ".join(x + "ab" + LETTERS[(7 * i + 3) % len(LETTERS)] for i, x in enumerate(LETTERS)) * 6

EDGE_CASES = [  # in this order, -n at their total length puts text on each of 3 ranks
    MANY_NEIGHBOURS,
    "aaaa",
    "a" * 3000,
    "aaa aaaaa aaaaaaa " * 20,
    "",
    "abc abc",
    "line one\r\nline two\r\n\r\n  indented\r\n" * 10,
    "   \n\t  \n\n     \t\t  ",
    "",
    "😀😀 👩‍👩‍👧 🇫🇷🇫🇷 hi😀 ok" * 10,
    "人人生而自由在尊严和权利上一律平等他们赋有理性和良心并应以兄弟关系的精神相对待" * 30,
    "abcabc",
]


def test_three_ranks_edge_cases_equal_cpu_and_rustbpe(tmp_path):
    """Many distinct neighbours of one pair (the exchange overflows its packet), runs of one byte (the
    overlapping-merge case), CRLF, whitespace only, emoji, a 1200-character CJK chunk and
    empty documents, spread over three ranks; the vocabulary is larger than the merges possible, so the run also
    stops early on every rank at once."""
    path = write_jsonl(tmp_path / "edge.jsonl", EDGE_CASES)
    result = torchrun(3, "--data", path, "-n", sum(map(len, EDGE_CASES)), "-v", 900, "--out", tmp_path / "tok",
                      cwd=tmp_path)
    check_equal_to_references(result, tmp_path / "tok", EDGE_CASES, 900)
    shares = re.search(r"per-rank share \(characters, distinct chunks\): (.*)", result.stdout).group(1).split(", ")
    assert len(shares) == 3 and not any(share.startswith("0/") for share in shares), shares
    assert "stopped early" in result.stdout
    assert not re.search(r" 0 of \d+ merges needed a second all_gather", result.stdout), result.stdout


def test_fewer_documents_than_ranks_and_a_document_longer_than_a_share(tmp_path):
    """Two documents on three ranks: the first is longer than a whole share (it stays whole on rank 0), the second
    starts inside rank 2's range, and rank 1 gets nothing. -n cuts the second document."""
    long_doc = " ".join(f"word{i % 97} ünïcödé {i % 13}" for i in range(400))
    docs = [long_doc, "a short second document, cut by -n before its end"]
    num_chars = len(long_doc) + 20
    path = write_jsonl(tmp_path / "two.jsonl", docs)
    result = torchrun(3, "--data", path, "-n", num_chars, "-v", 400, "--out", tmp_path / "tok", cwd=tmp_path)
    check_equal_to_references(result, tmp_path / "tok", first_chars(docs, num_chars), 400)
    assert f"per-rank share (characters, distinct chunks): {len(long_doc):,}/" in result.stdout
    assert ", 0/0, 20/" in result.stdout  # rank 1 is empty and still takes part in every merge


# ---------------------------------------------------------------- bad input under torchrun


def make_bad_inputs(tmp_path):
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    (tmp_path / "EMPTY.txt").write_text("")
    # The bad line lies in rank 1's share only: rank 0 stops reading before it, so rank 1 must pass the error on.
    write_jsonl(tmp_path / "BAD.jsonl", ["x" * 100])
    with open(tmp_path / "BAD.jsonl", "a") as f:
        f.write("[1, 2]\n")


# Two checks made before the process group exists (every rank reaches the verdict alone), one after reading on
# all ranks (an all-reduce of the character counts) and one on a single rank (shared with all_gather_object).
# The other checks of train_bpe_cpu.py (-n, --pattern, ...) take the first path, as the vocabulary check does.
BAD_INPUTS = {
    "vocab too small": (["-v", "255"], "vocab_size must be between 256"),
    "missing path": (["--data", "no/such/file.txt"], "no such file or directory"),
    "empty corpus": (["--data", "EMPTY.txt"], "is empty"),
    "bad jsonl line on rank 1 only": (["--data", "BAD.jsonl", "-n", "150"], "is not a JSON object with a \"text\" field"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_from_rank_0_and_no_rank_hangs(tmp_path, case):
    args, message = BAD_INPUTS[case]
    make_bad_inputs(tmp_path)
    if "--data" not in args:
        args = args + ["--data", "ok.txt"]
    result = torchrun(2, *args, "--out", tmp_path / "out", cwd=tmp_path)  # a hang would raise TimeoutExpired
    assert result.returncode != 0
    output = result.stdout + result.stderr
    error_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], output
    # torchrun adds its own failure summary after our line; no traceback comes from the script itself
    assert "train_bpe_multigpu.py\", line" not in output and "[rank" not in output, output
    assert not (tmp_path / "out").exists()


def test_plain_python_is_a_world_of_one(tmp_path):
    """Without torchrun the script sets up a process group of one rank on its own."""
    text = "the quick brown fox jumps over the lazy dog; the dog sleeps. " * 40 + "aaaaaaa bbb aaaa"
    (tmp_path / "one.txt").write_text(text)
    command = [sys.executable, SCRIPT, "--device", "cpu", "--data", tmp_path / "one.txt", "-v", 320,
               "--out", tmp_path / "tok", "--cache_dir", tmp_path / "cache"]
    result = subprocess.run(list(map(str, command)), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    check_equal_to_references(result, tmp_path / "tok", [text], 320)
    assert "1 rank(s), backend gloo" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: --device cuda is valid here")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    (tmp_path / "ok.txt").write_text("some text " * 10)
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--data", tmp_path / "ok.txt",
                             "--out", tmp_path / "out"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: --device cuda: no CUDA GPU is visible here; use --device cpu (gloo) instead"]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds rank 1's process through Linux's /proc")
def test_a_hung_rank_stops_the_others_after_the_timeout(corpus, tmp_path):
    """Rank 1 is frozen (SIGSTOP) once it has counted its share, i.e. in the merge loop: rank 0 must give up
    after --timeout seconds with one clear line, instead of waiting forever."""
    udhr = corpus("udhr.jsonl")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
               "--device", "cpu", "--timeout", "5", "--cache_dir", str(tmp_path / "cache"), "--data", str(udhr),
               "-n", "400000", "-v", "3000", "--out", str(tmp_path / "tok")]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    frozen = None
    try:
        for _ in range(600):  # wait (up to 60 s) for rank 1 to finish counting: it is merging from then on
            if list((tmp_path / "cache").glob("*/rank1.json")):
                break
            time.sleep(0.1)
        for stat in Path("/proc").glob("[0-9]*/stat"):  # torchrun's children, and among them rank 1
            try:
                parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                if parent == launcher.pid and b"\0RANK=1\0" in b"\0" + (stat.parent / "environ").read_bytes():
                    frozen = int(stat.parent.name)
            except (OSError, IndexError, ValueError):
                continue  # a process that ended meanwhile, or not ours to read
        assert frozen is not None, "rank 1's process not found"
        time.sleep(0.5)
        os.kill(frozen, signal.SIGSTOP)
        started = time.time()
        time.sleep(10)  # twice --timeout: rank 0 has given up by now
        os.kill(frozen, signal.SIGCONT)  # so that torchrun's SIGTERM ends it at once
        stdout, stderr = launcher.communicate(timeout=90)
    finally:
        if frozen is not None:  # let torchrun's SIGTERM through, or clean up if the test failed
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0 and time.time() - started < 60
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert any(line.startswith("error: rank 0 lost contact with the other ranks") for line in errors), stdout + stderr
    assert not (tmp_path / "tok").exists()
