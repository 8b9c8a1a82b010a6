"""train_bpe_multigpu.py under torchrun on the CPU (gloo): the tokenizer rustbpe trains on the documents the
ranks read, whatever the world size; each rank reads only its part; errors and hangs end in one line.

Every run launches real processes, one a rank, so the split of the text, the all_reduce of count changes and
the error paths run as on a GPU node, only with gloo instead of NCCL. The merge loop's Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1), as in test_train_bpe_gpu.py. Runs are slow on a small machine, so
each is shared by several tests (module-scoped fixtures), and most ranks are forked from conftest's warm script
runner (torch imported once, not per rank); the tests of what torchrun does (a rank's bad line, the offline
default, a rank that hangs or dies) launch real torchrun (`python -m torch.distributed.run --standalone`).
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
from types import SimpleNamespace

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import rustbpe
import torch
from conftest import SCRIPT_RUNNER, child_with_env, freeze_rank_1

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu as cpu_bpe  # noqa: E402
import train_bpe_multigpu as mg  # noqa: E402

SCRIPT = REPO / "train_bpe_multigpu.py"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRITON_INTERPRET="1")  # the CPU runs: interpreted
# In this process the kernels run as imported: compiled where a GPU is (on it), else in the interpreter.
DEVICE, BACKEND = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")


def torchrun(nproc, *args, cwd, timeout=60):
    """The script on nproc CPU ranks under real torchrun. A hang fails the test instead of blocking CI."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(SCRIPT), "--device", "cpu", "--timeout", str(timeout), "--cache_dir", str(cwd / "cache"),
               *map(str, args)]
    return subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=240)


def start_ranks(nproc, *args, cwd, timeout=60):
    """The script on nproc CPU ranks (a world of one for 1), each forked from the warm script runner with the
    variables torchrun gives a rank; this process hosts the group's store, as torchrun's agent does. finish_ranks
    waits for them."""
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--timeout", str(timeout), "--cache_dir",
               str(cwd / "cache"), *map(str, args)]
    if nproc == 1:  # plain python
        return command, None, [SCRIPT_RUNNER.start(command, cwd, ENV)]
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [SCRIPT_RUNNER.start(command, cwd, ENV, environ=dict(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True"))
        for rank in range(nproc)]
    return command, store, ranks


def finish_ranks(started):
    """One result, as torchrun's: the ranks' output in rank order, the first non-zero status."""
    command, store, ranks = started
    results = [SCRIPT_RUNNER.finish(rank, timeout=240) for rank in ranks]
    status = next((result.returncode for result in results if result.returncode), 0)
    return subprocess.CompletedProcess(command, status, "".join(result.stdout for result in results),
                                       "".join(result.stderr for result in results))


def run_ranks(nproc, *args, cwd, timeout=60):
    return finish_ranks(start_ranks(nproc, *args, cwd=cwd, timeout=timeout))


def rustbpe_file(docs, vocab_size):
    """The exact tokenizer.tiktoken bytes for rustbpe trained on these documents."""
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=mg.pattern)
    vocab = [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(vocab)).encode()


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs), encoding="utf-8")
    return path


def jsonl_docs_by_first_byte(path):
    """(first byte, text) of each document of a .jsonl file, found independently of the script."""
    docs, position = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        if line.strip():
            docs.append((position, json.loads(line)["text"]))
        position += len(line)
    return docs


def words(seed, count):
    """Made-up text with enough distinct pairs for thousands of merges: common words, rare letters."""
    rng = np.random.default_rng(seed)
    vocabulary = ["the", "über", "naïve", "résumé", "zebra", "日本語", "données", "1234", "\r\n", "  ", "don't", "!!"]
    letters = "etaoinshrdlucmfwypvbgkjqxzéüß"
    made_up = ["".join(rng.choice(list(letters), rng.integers(1, 9))) for _ in range(count)]
    return " ".join(word if rng.random() < 0.6 else rng.choice(vocabulary) for word in made_up)


# 114 letters around "ab": merging (a, b) changes ~450 distinct neighbouring pairs, in the rows of every owner.
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
    [chr(c) for c in range(0xC0, 0x100) if chr(c).isalpha()]
MANY_NEIGHBOURS = " ".join(x + "ab" + LETTERS[(7 * i + 3) % len(LETTERS)] for i, x in enumerate(LETTERS)) * 6
EDGE_CASES = [MANY_NEIGHBOURS, "aaaa", "a" * 300, "aaa aaaaa aaaaaaa " * 20, "", "abc abc",
              "line one\r\nline two\r\n\r\n  indented\r\n" * 10, "   \n\t  \n\n     \t\t  ",
              "😀😀 👩‍👩‍👧 🇫🇷🇫🇷 hi😀 ok" * 10, "人人生而自由在尊严和权利上一律平等他们赋有理性和良心并应以兄弟关系的精神相对待" * 30, "abcabc"]


@pytest.fixture(scope="module")
def several_files(tmp_path_factory):
    """a.jsonl (~45% of the bytes), b.txt (one document, ~35%), c.parquet (3 row groups, ~20%). At 4 ranks
    a.jsonl is split inside, rank 1 also gets b.txt, rank 2's range lies inside b.txt (nothing to read), and
    rank 3 gets the row groups."""
    root = tmp_path_factory.mktemp("several")
    a_docs = EDGE_CASES + [words(i, 300) for i in range(18)]
    write_jsonl(root / "a.jsonl", a_docs)
    b_doc = words(100, 6000)
    (root / "b.txt").write_bytes(b_doc.encode())
    c_docs = [words(200 + i, 90) for i in range(30)]
    table = pyarrow.table({"text": c_docs, "id": list(range(30))})
    pyarrow.parquet.write_table(table, root / "c.parquet", row_group_size=10, compression="NONE")
    started = {w: start_ranks(w, "--data", root, "-n", 10**9, "-v", 280, "--out", root / f"tok{w}", cwd=root)
               for w in (1, 2, 3, 4)}  # all at once: one's waits overlap the others' work
    runs = {w: finish_ranks(ranks) for w, ranks in started.items()}
    return SimpleNamespace(root=root, docs=a_docs + [b_doc] + c_docs, runs=runs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_of_several_files_equals_rustbpe_at_any_world_size(several_files, world_size):
    result = several_files.runs[world_size]
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning:" not in result.stderr  # GPT-4's pattern matches every character
    assert "fewer than -n 1,000,000,000: all the text" in result.stdout  # -n is W times past the end
    out = several_files.root / f"tok{world_size}"
    assert (out / "tokenizer.tiktoken").read_bytes() == rustbpe_file(several_files.docs, 280)
    info = json.loads((out / "tokenizer.json").read_text())
    assert info["num_chars"] == sum(map(len, several_files.docs)) and info["world_size"] == world_size
    assert info["special_tokens"] == {"<|endoftext|>": 280} and info["trainer"] == "train_bpe_multigpu.py"


def test_the_parts_partition_the_files_and_a_rank_can_have_nothing(several_files):
    """Each document is read by exactly one rank: the one whose byte range holds its first byte."""
    root = several_files.root
    sizes = {name: (root / name).stat().st_size for name in ("a.jsonl", "b.txt", "c.parquet")}
    starts = {"a.jsonl": 0, "b.txt": sizes["a.jsonl"], "c.parquet": sizes["a.jsonl"] + sizes["b.txt"]}
    firsts = [first for first, _ in jsonl_docs_by_first_byte(root / "a.jsonl")] + [starts["b.txt"]] + \
        [starts["c.parquet"] + sizes["c.parquet"] * group // 3 for group in range(3) for _ in range(10)]
    total = sum(sizes.values())
    for world_size in (2, 3, 4):
        read = json.loads((root / f"tok{world_size}" / "tokenizer.json").read_text())["read"]
        ranges = [(total * r // world_size, total * (r + 1) // world_size) for r in range(world_size)]
        assert [part["bytes"] for part in read] == [list(r) for r in ranges]
        expected = [sum(lo <= first < hi for first in firsts) for lo, hi in ranges]
        assert [part["documents"] for part in read] == expected, (world_size, read)
        assert not any(part["cut"] for part in read)
    read4 = json.loads((root / "tok4" / "tokenizer.json").read_text())["read"]
    assert read4[2]["documents"] == 0 and read4[0]["documents"] and read4[1]["documents"]  # a.jsonl split inside
    assert "per-rank part (characters, distinct chunks): " in several_files.runs[4].stdout
    assert ", 0/0, " in several_files.runs[4].stdout  # rank 2 read nothing, and took part in every merge


# ---------------------------------------------------------------- -n inside the data, and the cache


@pytest.fixture(scope="module")
def one_file_part(tmp_path_factory):
    """-n at 60% of one .jsonl file on 2 ranks: each rank takes n/2 characters from its own byte range. Then
    the same run again: rank 0 reuses its cache, and rank 1 finds its own edited."""
    root = tmp_path_factory.mktemp("one")
    docs = [words(300 + i, 40 + 7 * i) for i in range(40)]
    path = write_jsonl(root / "one.jsonl", docs)
    num_chars = sum(map(len, docs)) * 6 // 10
    run = lambda name: run_ranks(2, "--data", path, "-n", num_chars, "-v", 280, "--out", root / name, cwd=root)
    first = run("first")
    counts_file = next((root / "cache").glob("*/rank1.counts.npy"))
    counts = np.load(counts_file)
    counts[0] += 1000  # a cache that was edited: the run must not train on it
    np.save(counts_file, counts)
    return SimpleNamespace(root=root, path=path, num_chars=num_chars, first=first, second=run("second"))


def test_n_inside_one_file_is_n_over_w_from_each_rank_part(one_file_part):
    result, root = one_file_part.first, one_file_part.root
    assert result.returncode == 0, result.stdout + result.stderr
    read = json.loads((root / "first" / "tokenizer.json").read_text())["read"]
    by_first = jsonl_docs_by_first_byte(one_file_part.path)
    taken, n = [], one_file_part.num_chars
    for part, rank in zip(read, range(2)):
        share = n * (rank + 1) // 2 - n * rank // 2
        in_range = [text for first, text in by_first if part["bytes"][0] <= first < part["bytes"][1]]
        kept, left = [], share
        for text in in_range:  # the first documents of its range, the last one cut to fit its share
            if left == 0:
                break
            kept.append(text[:left])
            left -= len(kept[-1])
        assert part["documents"] == len(kept) and part["chars"] == share - left, (rank, part)
        taken += kept
    assert sum(map(len, taken)) == n
    assert (root / "first" / "tokenizer.tiktoken").read_bytes() == rustbpe_file(taken, 280)


def test_a_rerun_reuses_the_cache_and_an_edited_cache_is_counted_again(one_file_part):
    first, second = one_file_part.first, one_file_part.second
    assert "cache:" not in first.stdout and "did not match" not in first.stderr
    assert second.returncode == 0, second.stdout + second.stderr
    assert "cache: 1 of 2 ranks reused their counted chunks" in second.stdout  # rank 0's
    assert "reading (rank 0's part)" not in second.stderr  # rank 0 read nothing, and says why it waits
    assert "cache: rank 0's counts are loaded; waiting for the others" in second.stdout, second.stdout
    assert "waiting" not in first.stdout
    assert "did not match its checksum" in second.stderr  # rank 1's, counted again
    tiktoken = [(one_file_part.root / name / "tokenizer.tiktoken").read_bytes() for name in ("first", "second")]
    assert tiktoken[0] == tiktoken[1]


def test_counts_past_2_to_the_31_and_past_one_int64_key(tmp_path):
    """Chunk counts past 2^39, written as a cache that both ranks load: at -v 2048 (11 bits an id) the counts
    and the tie-break no longer fit one int64 key, so the choice takes two reductions (3 collectives a merge)."""
    path = write_jsonl(tmp_path / "tiny.jsonl", ["ab"])
    args = SimpleNamespace(num_chars=100, pattern=mg.pattern)
    huge = 2**39 + 5
    parts = [Counter({"abab": huge + 3, " ba": huge + 3, "xyz": 2**31 + 1, "aa": 5}),
             Counter({"abc": huge, " ba": 2, "yzx": 2**31, "ab": 7})]
    for rank, chunk_counts in enumerate(parts):
        prefix = tmp_path / "cache" / mg.cache_key(args, str(path), [path], 2) / f"rank{rank}"
        mg.write_cache(prefix, chunk_counts, {"rank": rank, "bytes": [0, 0], "documents": 1, "chars": 1, "cut": False})
    result = run_ranks(2, "--data", path, "-n", 100, "-v", 2048, "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "cache: 2 of 2 ranks reused" in result.stdout and "| setup " in result.stdout
    merges, _ = cpu_bpe.train(parts[0] + parts[1], 2048)  # Python integers: exact at any size
    # the pairs run out inside a group of 16 merges: the bar ends at the merges made, not at the group's end
    bar_end = re.findall(r"merging: .*?(\d+)/1792 \[", result.stderr)[-1]
    assert len(merges) < mg.MERGES_PER_READ and bar_end == str(len(merges)), result.stderr
    # the same line as the other trainers', the vocabulary asked for beside the one made
    assert f"stopped early after {len(merges)} merges: no pairs left to merge (vocab {256 + len(merges)} < 2048)" \
        in result.stdout, result.stdout
    # 3 collectives a merge, counted as called: also in the group's no-op merges past the last
    groups = -(-len(merges) // mg.MERGES_PER_READ)
    collectives = float(result.stdout.split("per merge: ")[1].split()[0])
    assert collectives == round(3 * mg.MERGES_PER_READ * groups / len(merges), 2), result.stdout
    # the bytes: two 8-byte keys, and delta's prefix up to the id merge m can make, 256 + m (int64 counts)
    sent = sum(16 + 8 * min(1 + 3 * (256 + m + 1), 3 * 2048 + 1) for m in range(mg.MERGES_PER_READ * groups))
    assert f"collectives ({sent / len(merges) / 1024:,.1f} KiB)" in result.stdout, result.stdout
    expected = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(cpu_bpe.vocab_bytes(merges)))
    assert (tmp_path / "tok" / "tokenizer.tiktoken").read_text() == expected


def test_v_256_makes_no_merge_and_says_so_without_a_traceback(tmp_path):
    """-v 256 is the bytes alone: the loop never runs, and its per-merge figures (of no merge) are left out."""
    path = write_jsonl(tmp_path / "tiny.jsonl", ["abab abab"])
    result = run_ranks(1, "--data", path, "-n", 100, "-v", 256, "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "per merge" not in result.stdout and "merges/s) | total" in result.stdout, result.stdout
    assert len((tmp_path / "tok" / "tokenizer.tiktoken").read_text().splitlines()) == 256


def test_n_past_the_end_reads_a_big_part_only_to_n_over_w_and_says_which(tmp_path):
    """-n past the text's end, but rank 0's part (one .txt document) is longer than n / W: rank 0 stops at
    n / W, so not all is read; its "read" says the document was cut, and the warning says which rank stopped.
    And a vocabulary of one merge is one merge's collectives."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("ab " * 500)
    write_jsonl(tmp_path / "d" / "b.jsonl", ["cd cd cd "])
    result = run_ranks(2, "--data", tmp_path / "d", "-n", 2000, "-v", 257, "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    read = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["read"]
    assert [(part["chars"], part["cut"]) for part in read] == [(1000, True), (9, False)], read
    assert "read 1,009 characters, fewer than -n 2,000" in result.stdout
    assert "rank(s) [0] stopped at n / W" in result.stdout, result.stdout
    # -v 257: one merge, and the loop calls no merge past the vocabulary: 2 collectives, not a group's 32
    assert "per merge: 2.00 collectives" in result.stdout, result.stdout


# ---------------------------------------------------------------- errors between ranks


def test_a_bad_line_in_rank_1s_part_is_one_line_from_rank_0(tmp_path):
    """Rank 1 alone reads the bad line; rank 0 says it, and every rank exits non-zero."""
    write_jsonl(tmp_path / "bad.jsonl", ["x" * 100, "y" * 100])
    with open(tmp_path / "bad.jsonl", "a") as f:
        f.write('{"text": 42}\n')
    result = torchrun(2, "--data", tmp_path / "bad.jsonl", "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    bad_at = len((tmp_path / "bad.jsonl").read_bytes()) - len('{"text": 42}\n')
    assert len(errors) == 1 and f"bad.jsonl (the line at byte {bad_at})" in errors[0], output
    # torchrun adds its own failure summary after our line; no traceback comes from the script itself
    assert "train_bpe_multigpu.py\", line" not in output and not (tmp_path / "out").exists()


def test_an_empty_parquet_file_is_refused_by_every_rank_as_train_bpe_cpu_refuses_it(tmp_path, monkeypatch):
    """A 0-byte .parquet (an interrupted download) lies in no rank's byte range: it was skipped in silence. Last,
    after a file of text, every rank of 1 to 3 worlds must refuse it as it reads, in train_bpe_cpu.py's words."""
    files = [write_jsonl(tmp_path / "a.jsonl", ["some text"] * 10), tmp_path / "b.parquet"]
    files[1].write_bytes(b"")
    with pytest.raises(cpu_bpe.UserError) as cpu_error:
        list(cpu_bpe.local_texts(files, 10**6))
    assert "b.parquet" in str(cpu_error.value)
    for world in (1, 2, 3):
        for rank in range(world):
            monkeypatch.setattr(mg, "RANK", rank)
            monkeypatch.setattr(mg, "WORLD", world)
            with pytest.raises(mg.UserError) as error:
                list(mg.rank_documents("files", files, 10**6)[0])
            assert str(error.value) == str(cpu_error.value)


def test_offline_the_default_source_is_the_standard_library_split_between_the_ranks(tmp_path):
    """No --data and no Hub (HF_HUB_OFFLINE=1): Python's own .py files, a document each, in byte ranges like
    any local files; one warning, rank 0's."""
    result = torchrun(2, "-n", 20000, "-v", 260, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.count("warning: the Hugging Face Hub is off") == 1, result.stderr
    info = json.loads((tmp_path / "tokenizers" / "stdlib_v260" / "tokenizer.json").read_text())
    assert info["source"] == "Python standard library source (offline fallback)" and info["num_chars"] == 20000
    assert [part["chars"] for part in info["read"]] == [10000, 10000] and info["read"][1]["bytes"][0] > 0


def test_ranks_that_find_different_sources_stop_with_one_line(tmp_path):
    """Each rank asks whether the Hub answers: one that gets no answer would read the offline corpus while the
    others read FineWeb, into one tokenizer. Here rank 0 "reaches the Hub" (HF_ENDPOINT: the store's listening
    port) and finds its FineWeb part cached, so it reads nothing; rank 1 is offline."""
    args = SimpleNamespace(num_chars=1000, pattern=mg.pattern)
    prefix = tmp_path / "cache" / mg.cache_key(args, "HuggingFaceFW/fineweb sample-10BT", [], 2) / "rank0"
    mg.write_cache(prefix, Counter({"fine web": 3}), {"rank": 0, "documents": 1, "chars": 24, "cut": False})
    command = [sys.executable, str(SCRIPT), "--device", "cpu", "--timeout", "60", "--cache_dir", str(tmp_path / "cache"),
               "-n", "1000", "-v", "257", "--out", str(tmp_path / "tok")]
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = [SCRIPT_RUNNER.start(command, tmp_path, ENV, environ=dict(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
        **({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{store.port}"} if rank == 0 else {})))
        for rank in range(2)]
    result = finish_ranks((command, store, ranks))
    assert result.returncode == 1 and "error: only some ranks reached the Hugging Face Hub" in result.stderr, \
        result.stdout + result.stderr
    assert not (tmp_path / "tok").exists()


def test_characters_the_pattern_leaves_out_are_one_warning_over_all_ranks(tmp_path):
    """\\w+ leaves the spaces and punctuation out, on both ranks' parts: tiktoken drops them from the
    encoding too, so the run goes on, and rank 0 says how many, counted over all the text. Likewise the bytes
    that are not UTF-8 (one in each rank's part), read as U+FFFD."""
    docs = [words(400 + i, 150) for i in range(6)]
    bad = {1, 5}  # these end with a byte that is not UTF-8: one in each rank's part
    path = write_jsonl(tmp_path / "w.jsonl", [doc + "@" if i in bad else doc for i, doc in enumerate(docs)])
    path.write_bytes(path.read_bytes().replace(b"@", b"\xff"))
    docs = [doc + "\ufffd" if i in bad else doc for i, doc in enumerate(docs)]  # as read
    result = run_ranks(2, "--data", path, "-v", 257, "--pattern", r"\w+", "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    chars = sum(map(len, docs))
    matched = sum(len(match) for doc in docs for match in mg.regex.findall(r"\w+", doc))
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: 2 invalid UTF-8 sequences were replaced with U+FFFD",
                        f"warning: the split pattern matched {matched:,} of {chars:,} characters; the other "
                        f"{1 - matched / chars:.1%} are dropped (tiktoken drops them too)"], result.stderr
    read = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["read"]
    assert [part["documents"] for part in read] == [3, 3]  # docs 0-2 and 3-5: the counts are the two added


@pytest.mark.parametrize("argv, message", [
    (["--pattern", "x*"], "matches the empty string"),
    (["--pattern", ""], "matches the empty string"),
    (["--pattern", r"(\w+) ?"], "has a capturing group; use (?:...)"),
    (["-v", "255"], "vocab_size must be between 256"),
    # not a traceback from the process group's timedelta, once the text is read
    (["--timeout", "inf"], "the timeout in (0, 2^31) s"),
    (["--timeout", "nan"], "the timeout in (0, 2^31) s"),
    (["--out", "DATASET"], "is a dataset directory"),
    (["--out", "FILE/under"], "is a file, not a directory"),
    (["--out", "/proc/tok"], "can't be written"),
    (["--data", "fineweb"], "the Hugging Face Hub is off (HF_HUB_OFFLINE=1), needed for --data fineweb"),
])
def test_checks_before_any_work(tmp_path, monkeypatch, argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    (tmp_path / "DATASET").mkdir()
    (tmp_path / "DATASET" / "meta.json").write_text("{}")
    (tmp_path / "FILE").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(mg.UserError, match=re.escape(message)):
        mg.validate(mg.parse_args(["--data", "ok.txt", "--device", "cpu", *argv]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DATASET", "FILE", "ok.txt"]


def test_the_device_and_the_interpreter_must_agree(tmp_path, monkeypatch):
    """cpu runs the kernels in Triton's interpreter and cuda compiled: the other way round is one line, not a
    traceback from inside a kernel launch."""
    monkeypatch.setattr(mg.triton.knobs.runtime, "interpret", not mg.triton.knobs.runtime.interpret)
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    with pytest.raises(mg.UserError, match=f"--device {DEVICE} with TRITON_INTERPRET=.*set it to 1 for cpu, 0 for cuda"):
        mg.validate(mg.parse_args(["--data", str(tmp_path / "ok.txt"), "--device", DEVICE]))


def test_more_ranks_on_a_node_than_its_gpus_is_one_line(tmp_path, monkeypatch):
    """torchrun --nproc_per_node=2 on a 1-GPU node: each rank of the node says so alike (rank 0 speaks), not
    rank 1's AssertionError from get_device_properties(1). No CI machine has the GPUs: their count is mocked."""
    monkeypatch.setattr(mg.triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(mg.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mg.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(mg, "LOCAL_WORLD", 2)  # torchrun's LOCAL_WORLD_SIZE
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    with pytest.raises(mg.UserError, match=re.escape("--device cuda: 2 ranks on this node, 1 GPU(s)")):
        mg.validate(mg.parse_args(["--data", str(tmp_path / "ok.txt"), "--device", "cuda"]))


def test_no_c_compiler_is_one_line_on_every_rank_before_the_text_is_read(tmp_path, monkeypatch):
    """Docker's CUDA runtime images have no gcc: Triton's CUDA launcher, built in C at the first kernel launch
    (after the reading), was a traceback on every rank. As test_train_bpe_gpu.py's fixture makes that machine:
    Triton's CUDA driver forced, a stub libcuda, no compiler on PATH, CC unset, a cold cache; a GPU mocked."""
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime import build
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "_create_driver", nvidia.CudaDriver)
    monkeypatch.setattr(mg.triton.runtime.driver, "_default", None)
    monkeypatch.setattr(mg.triton.runtime.driver, "_active", None)
    (tmp_path / "libcuda.so.1").write_bytes(b"")
    for name, value in [("TRITON_LIBCUDA_PATH", str(tmp_path)), ("TRITON_CACHE_DIR", str(tmp_path / "cache")),
                        ("PATH", "")]:
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(mg.triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(mg.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mg.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(mg.torch.cuda, "get_device_properties", lambda rank: SimpleNamespace(total_memory=2**37))
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    monkeypatch.chdir(tmp_path)  # a run that is not refused makes its --out here
    remembered = [build._find_compiler, nvidia.libcuda_dirs, nvidia.library_dirs]  # functools caches
    try:
        for function in remembered:
            function.cache_clear()
        with pytest.raises(mg.UserError, match=re.escape("Triton can't build its CUDA launcher (Failed to find C "
                                                         "compiler.")) as error:
            mg.validate(mg.parse_args(["--data", str(tmp_path / "ok.txt"), "--device", "cuda"]))
    finally:
        for function in remembered:
            function.cache_clear()
    assert str(error.value).endswith("; install gcc and python3-dev, or set CC")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: cuda is the right default")
def test_no_gpu_and_no_device_is_refused_rather_than_interpreted_slowly(tmp_path):
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    with pytest.raises(mg.UserError, match="no CUDA GPU here; --device cpu runs the kernels in Triton's"):
        mg.validate(mg.parse_args(["--data", str(tmp_path / "ok.txt")]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's memory; a GPU's is checked alike")
def test_count_rows_that_do_not_fit_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    monkeypatch.setattr(mg.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 2**14}[name])  # 64 MiB
    mg.validate(mg.parse_args(["--data", str(tmp_path / "ok.txt"), "--device", "cpu", "-v", "3000"]))  # 34 MiB
    with pytest.raises(mg.UserError, match=r"-v 4096 on 1 rank\(s\) needs 0.1 GiB of pair counts per rank"):
        mg.validate(mg.parse_args(["--data", str(tmp_path / "ok.txt"), "--device", "cpu", "-v", "4096"]))  # 64 MiB


def run_patched(patch, *args, cwd):
    """The script's run() in a world of one, in a process of its own (it starts a process group), after the Python
    statement `patch` changed the imported module: a limit, or what the machine seems to have. Its UserError ends
    as a traceback, whose last line the tests read."""
    argv = [*map(str, args), "--device", "cpu", "--cache_dir", "cache"]
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import train_bpe_multigpu as mg; {patch}; mg.run({argv!r})"
    (cwd / "patched.py").write_text(code)
    return SCRIPT_RUNNER.run([[sys.executable, "patched.py"]], cwd=cwd, env=ENV, timeout=120)[0]


def test_distinct_chunks_past_int32_positions_are_a_user_error(tmp_path):
    # A rank's error joins the reading errors that the ranks share (tested with 2 ranks above). Here a world of one,
    # the script imported and its limit lowered from 2^31 - 2 to 15: the 14 bytes of distinct chunks + 2 don't fit.
    (tmp_path / "few.txt").write_text("abcd efgh abcd")  # distinct chunks of 2+ bytes: "abcd", " efgh", " abcd"
    result = run_patched("mg.MAX_POSITIONS = 15", "--data", "few.txt", "-v", 260, cwd=tmp_path)
    assert "UserError: rank 0's distinct chunks hold 14 bytes, more than int32 positions" in result.stderr, result.stderr
    assert not (tmp_path / "tokenizers").exists()


def test_a_cache_that_another_run_rewrites_meanwhile_is_not_read_back(tmp_path, monkeypatch):
    """Two runs on the same text and cache (a sweep of -v, say) count and write the same cache files at once; the
    other's write starts (removing the .json) just after this one's ends. This run trains on the counts it wrote:
    read back, they were a None and a TypeError traceback (seen in two real concurrent runs)."""
    write_cache = mg.write_cache

    def then_another_run_writes(prefix, *rest):
        written = write_cache(prefix, *rest)
        prefix.with_suffix(".json").unlink()  # what the other run's write_cache does first
        return written

    monkeypatch.setattr(mg, "write_cache", then_another_run_writes)
    args = SimpleNamespace(cache_dir=tmp_path, no_cache=True, workers=1, pattern=mg.pattern, num_chars=100)
    cached, _, _, error = mg.count_part(args, "text", [], iter(["abab cd"]), 100, [0, 7])
    assert error is None and bytes(cached[0]) == b"abab cd" and list(cached[2]) == [1, 1]
    assert cached[3]["chunks"] == 2 and cached[3]["part"]["chars"] == 7


def test_a_cache_rewritten_while_a_run_reads_it_leaves_that_run_s_memory_map_as_it_was(tmp_path):
    """A run reusing the cache memory-maps its files (rank 0, say, waiting for the others); another run (--no_cache,
    or one with the same settings) rewrites them. Written in place, the reader's map showed the new bytes (or, the
    file shorter, SIGBUS); written to a new file and renamed, the reader keeps the old one. No temp file stays."""
    part = {"rank": 0, "documents": 1, "chars": 9, "cut": False}
    mg.write_cache(tmp_path / "rank0", Counter({"abab": 3, " cd": 1}), part)
    status, (blob, lengths, counts, _) = mg.read_cache(tmp_path / "rank0")
    assert status == "reused" and isinstance(blob, np.memmap)
    mg.write_cache(tmp_path / "rank0", Counter({"wxyz": 5, " uv": 2}), part)  # same sizes: no SIGBUS here
    assert bytes(blob) == b"abab cd" and list(lengths) == [4, 3] and list(counts) == [3, 1]
    assert bytes(mg.read_cache(tmp_path / "rank0")[1][0]) == b"wxyz uv"  # a new reader: the new cache
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "rank0.bytes.npy", "rank0.counts.npy", "rank0.json", "rank0.lengths.npy"]


def test_a_pattern_that_does_not_compile_and_an_empty_corpus_are_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(mg.UserError, match=re.escape("--pattern does not compile (missing ) at position 2); fix it")):
        mg.validate(mg.parse_args(["--data", str(tmp_path / "empty.txt"), "--device", "cpu", "--pattern", "(a"]))
    result = run_patched("pass", "--data", "empty.txt", "-v", 260, cwd=tmp_path)
    assert "UserError: the corpus empty.txt is empty; point --data at text" in result.stderr, result.stderr
    assert not (tmp_path / "tokenizers").exists()


def test_int64_count_rows_that_do_not_fit_are_one_line_once_the_text_is_counted(tmp_path):
    # Before reading, only int32 rows can be checked: at -v 2048 they take 16 MiB, 32 MiB as int64 (2^31+ pairs).
    # The machine is made to have 30 MiB (80%: 24 MiB): the int32 check passes, and the one after counting refuses.
    path = write_jsonl(tmp_path / "tiny.jsonl", ["ab"])
    prefix = tmp_path / "cache" / mg.cache_key(SimpleNamespace(num_chars=100, pattern=mg.pattern), str(path), [path], 1)
    mg.write_cache(prefix / "rank0", Counter({"abab": 2**31, "xyz": 5}), {"rank": 0, "bytes": [0, 0], "documents": 1,
                                                                           "chars": 1, "cut": False})
    machine_of_30_mib = "mg.os.sysconf = lambda name: {'SC_PAGE_SIZE': 4096, 'SC_PHYS_PAGES': 30 * 256}[name]"
    result = run_patched(machine_of_30_mib, "--data", path, "-n", 100, "-v", 2048, cwd=tmp_path)
    assert "-v 2048 on 1 rank(s) needs 0.0 GiB of pair counts per rank (8-byte counts)" in result.stderr, result.stderr
    assert not (tmp_path / "tokenizers").exists()


def test_a_cache_that_cannot_be_written_and_a_file_that_cannot_be_read_are_one_line(tmp_path):
    path = write_jsonl(tmp_path / "tiny.jsonl", ["some text to train on"])
    (tmp_path / "cache").write_text("a file where the cache directory should be")
    result = run_ranks(1, "--data", path, "-v", 260, "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {tmp_path / 'cache'}/"), result.stderr
    assert errors[0].endswith(": Not a directory; check it (--cache_dir says where the cache goes)"), result.stderr
    result = run_ranks(1, "--data", "x" * 300 + ".txt", "-v", 260, cwd=tmp_path)  # an OSError before any work
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "error: [Errno 36] File name too long" in result.stderr, result.stderr


def test_a_pattern_that_backtracks_or_matches_empty_in_context_is_one_error():
    started = time.process_time()
    with pytest.raises(mg.UserError, match="backtracks catastrophically"):
        mg.count_batch(["ok", "a" * 60], r"(?:a|a)+b|\s", Counter())
    assert time.process_time() - started < 5
    with pytest.raises(mg.UserError, match="matches the empty string"):
        mg.count_batch(["two words"], r"\b|\w+", Counter())


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds rank 1's process through Linux's /proc")
@pytest.mark.parametrize("fate", ["hangs", "dies"])
def test_a_rank_that_hangs_or_dies_stops_the_others_with_one_line(tmp_path, fate):
    """Rank 1 is frozen (SIGSTOP) or killed (SIGKILL) half a second after it has counted its part: by then it has
    joined the group and is merging (were it still joining, the wait would end alike). Rank 0 must stop within
    --timeout seconds with one clear line and a non-zero status, not wait forever or print a traceback."""
    path = write_jsonl(tmp_path / "long.jsonl", [words(i, 2000) for i in range(8)])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
               "--device", "cpu", "--timeout", "3", "--cache_dir", str(tmp_path / "cache"), "--data", str(path),
               "-v", "4000", "--out", str(tmp_path / "tok")]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def counted():  # wait (up to 60 s) for rank 1 to finish counting: it is merging from then on
        for _ in range(600):
            if list((tmp_path / "cache").glob("*/rank1.json")):
                break
            time.sleep(0.1)
        time.sleep(0.5)

    if fate == "hangs":
        stdout, stderr, seconds = freeze_rank_1(launcher, counted)
    else:
        try:
            counted()
            os.kill(child_with_env(launcher.pid, "RANK=1"), signal.SIGKILL)
            started = time.time()
            stdout, stderr = launcher.communicate(timeout=90)
            seconds = time.time() - started
        finally:
            launcher.kill()
            launcher.wait()
    output = stdout + stderr
    assert launcher.returncode != 0 and seconds < 60, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    # A dead rank: torchrun sees it die and may stop rank 0 before rank 0 sees the lost peer (seen on a loaded
    # machine), so rank 0's line is asked for only of a rank that hangs, where torchrun sees nothing.
    if fate == "hangs":
        assert [line for line in errors if line.startswith("error: rank 0 lost contact with the other ranks")], output
    # torchrun adds its own failure summary after our line; no traceback comes from the script itself
    assert "train_bpe_multigpu.py\", line" not in output and not (tmp_path / "tok").exists(), output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: the NCCL path runs on GPU machines only")
def test_nccl_on_one_gpu_equals_rustbpe(tmp_path):
    docs = [words(i, 500) for i in range(20)]
    path = write_jsonl(tmp_path / "g.jsonl", docs)
    command = [sys.executable, str(SCRIPT), "--device", "cuda", "--data", str(path), "-v", "500", "--out",
               str(tmp_path / "tok"), "--cache_dir", str(tmp_path / "cache")]
    result = subprocess.run(command, cwd=tmp_path, env=dict(ENV, TRITON_INTERPRET="0"), capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0 and "backend nccl" in result.stdout, result.stdout + result.stderr
    assert (tmp_path / "tok" / "tokenizer.tiktoken").read_bytes() == rustbpe_file(docs, 500)


def merge_in_a_world_of_one(chunk_counts, vocab_size):
    """merge_on_device on these chunks in this process, a world of one: (merges, loop counts, seconds)."""
    chunks = [chunk.encode() for chunk in chunk_counts]
    arrays = mg.chunks_to_arrays(np.frombuffer(b"".join(chunks), np.uint8), np.array([len(c) for c in chunks]),
                                 np.array(list(chunk_counts.values())), np.int32)
    torch.distributed.init_process_group(BACKEND, store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        merges, _, loop, seconds = mg.merge_on_device(arrays, vocab_size, 10**6, torch.device(DEVICE), False)
    finally:
        torch.distributed.destroy_process_group()
    return merges, loop, seconds


@pytest.fixture(scope="module")
def watched_merges():
    """One merge loop (32 merges) watched two ways. Every read of a tensor's value by the host is counted, whether
    .item(), .tolist(), int(), bool(), float() or a 0-dim tensor used as an index (all but .tolist() dispatch
    _local_scalar_dense; .tolist() is counted by wrapping it). And each all_reduce of delta is kept with the
    number of nonzero lanes past the prefix it sends, and its prefix's last lane (read after the loop)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountReads.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    vocab_size, tolist, all_reduce, sent = 288, torch.Tensor.tolist, mg.dist.all_reduce, []

    def kept(tensor, *args, **kwargs):
        whole = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(tensor.untyped_storage())
        if tensor.storage_offset() == 0 and whole.numel() == 3 * vocab_size + 1:  # delta[:prefix]
            sent.append((whole[tensor.numel():].count_nonzero(), tensor[-1].clone()))  # no read: ops
        return all_reduce(tensor, *args, **kwargs)

    chunk_counts = Counter(regex_chunk for doc in EDGE_CASES[:4] + [words(i, 100) for i in range(2)]
                           for regex_chunk in mg.regex.findall(mg.pattern, doc))
    with pytest.MonkeyPatch.context() as patch, CountReads():
        patch.setattr(torch.Tensor, "tolist", lambda self: (setattr(CountReads, "reads", CountReads.reads + 1),
                                                             tolist(self))[1])
        patch.setattr(mg.dist, "all_reduce", kept)
        merges, loop, _ = merge_in_a_world_of_one(chunk_counts, vocab_size)
    return SimpleNamespace(merges=merges, loop=loop, reads=CountReads.reads, expected=cpu_bpe.train(chunk_counts,
                           vocab_size)[0], sent=[(int(unsent), int(last)) for unsent, last in sent])


def test_the_merge_loop_reads_the_device_once_per_16_merges_counting_every_kind(watched_merges):
    """In this process, a world of one: every read of a tensor's value by the host is counted, whatever its kind
    (see watched_merges). The loop may read once per 16 merges."""
    merges, loop, reads = watched_merges.merges, watched_merges.loop, watched_merges.reads
    assert len(merges) == 288 - 256
    # one "done?" per 16 merges, then three after the loop: the merge count, the merges, the tokens saved
    assert loop["host_reads"] == 2 and reads == loop["host_reads"] + 3, (reads, loop)
    assert merges == watched_merges.expected


def test_each_merge_sends_every_number_of_delta_it_can_write(watched_merges):
    """The all_reduce of the count changes sends a prefix of delta: merge m writes ids up to 256 + m, each at
    1 + 3 id + 2 at most. A prefix one short drops the last lane, (new, new) after a run "aaaa" merges, which the
    exactness runs catch only when another rank owns that row: here every all_reduce of delta, in a world of one,
    must leave nothing unsent, and the prefix's last lane must have been written at least once."""
    merges, sent = watched_merges.merges, watched_merges.sent
    assert merges == watched_merges.expected
    assert len(sent) > len(merges) and all(unsent == 0 for unsent, _ in sent), sent
    assert any(last != 0 for _, last in sent), sent  # the edge itself was crossed


def test_many_programs_and_small_blocks_give_the_same_merges(monkeypatch):
    """On a GPU the kernels run many programs over small blocks; here the same stride loops, several programs
    and blocks of a few lanes, in a world of one. And merges/s times the loop alone: a first launch made 0.5 s
    slow, as compiling makes it, must end before the loop's clock starts."""
    monkeypatch.setattr(mg, "INTERPRETER_SHAPE", dict(programs=3, block=64, rows=2, choose_block=64, key_block=4))
    best_pair, launches = mg.best_pair, []

    class SlowFirstLaunch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if not launches:
                    time.sleep(0.5)
                launches.append(time.time())
                return best_pair[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(mg, "best_pair", SlowFirstLaunch())
    chunk_counts = Counter(regex_chunk for doc in [EDGE_CASES[1], EDGE_CASES[3], words(7, 60)]
                           for regex_chunk in mg.regex.findall(mg.pattern, doc))
    merges, _, seconds = merge_in_a_world_of_one(chunk_counts, 272)
    returned = time.time()
    assert len(merges) == 16 and merges == cpu_bpe.train(chunk_counts, 272)[0]
    # the loop started at the latest its own seconds before the return
    assert seconds["setup"] >= 0.5 and launches[0] <= returned - seconds["loop"], (seconds, launches, returned)


COMPILE_FOR_A_GPU = """
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
import triton
import train_bpe_multigpu as mg
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
barriers = lambda ttir: [found.start() for found in re.finditer(r'(gpu|ttg)[.]barrier', ttir)]  # 3.6: gpu.barrier

INT64 = {"state", "row_key", "block_key", "fresh_key", "list_start", "list_len", "merge_log", "best"}
CONSTANTS = {"BLOCK": 256, "ROWS": 4, "BITS": 11, "KEY_BLOCK": 256}
kernels = (mg.best_pair, mg.find_occurrences, mg.apply_merges, mg.apply_owned, mg.refresh_rows)
assert INT64 | set(CONSTANTS) <= {name for kernel in kernels for name in kernel.arg_names}  # no stale name
for arch in (90, 80):  # an H100's, an A100's
    for counts in ("*i32", "*i64"):
        for kernel in kernels:
            names = kernel.arg_names
            signature = {name: "constexpr" if name in (*CONSTANTS, "ONE_KEY") else "i32" if name in ("V", "END", "RANK", "WORLD")
                         else counts if name in ("counts", "weight", "delta") else "*i64" if name in INT64 else "*i32"
                         for name in names}
            shape = dict(CONSTANTS, BLOCK=4096) if kernel is mg.best_pair else CONSTANTS  # a CUDA run's
            constexprs = {(names.index(name),): value for name, value in shape.items() if name in names}
            if "ONE_KEY" in names:
                constexprs[(names.index("ONE_KEY"),)] = counts == "*i32"
            asm = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32)).asm
            ttir, atomics = asm["ttir"], re.findall(r"\\batom[.][\\w.]+", asm["ptx"])
            print(kernel.fn.__name__, counts, "compiled;", len(atomics), "atomics;", "fenced:", sorted(
                {atomic for atomic in atomics if ".relaxed" not in atomic}))
            if kernel is mg.best_pair:  # the dirty rows' keys are copied (stores), a barrier, their blocks' keys
                # recomputed (reduce, store), a barrier, then the blocks scanned (reduce)
                first, second = barriers(ttir)
                block_keys = ttir.index("tt.reduce", first) < ttir.rindex("tt.store", first, second)
                print("barriers between copy, blocks and scan:",
                      ttir.index("tt.store") < first and block_keys and "tt.reduce" in ttir[second:])
            if kernel is mg.refresh_rows:  # the next items' loads in flight (cp.async)
                print("refresh_rows pipelined:", "cp.async" in asm["ptx"])
"""


def test_the_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter accepts some constructs that the GPU compiler rejects: compile each kernel for an H100
    (sm_90) and an A100 (sm_80) with Triton's own compiler, which needs no GPU."""
    (tmp_path / "compile_for_a_gpu.py").write_text(COMPILE_FOR_A_GPU)
    result = SCRIPT_RUNNER.run([[sys.executable, "compile_for_a_gpu.py", str(REPO)]], cwd=tmp_path, env=ENV,
                               timeout=300)[0]
    assert result.returncode == 0 and result.stdout.count("compiled") == 20, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("barriers between copy, blocks and scan: True") == 4, result.stdout  # a GPU race
    assert result.stdout.count("refresh_rows pipelined: True") == 4, result.stdout
    # Every atomic relaxed (acq_rel puts a device-wide fence around each, on the merge's critical path), and
    # the atomics are there to be checked: the PTX is what the GPU's compiler gets.
    assert result.stdout.count("fenced: []") == 20, result.stdout
    assert sum(int(count) for count in re.findall(r"compiled; (\d+) atomics", result.stdout)) > 0, result.stdout
