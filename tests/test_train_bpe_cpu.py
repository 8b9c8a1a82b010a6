"""train_bpe_cpu.py against rustbpe (the oracle), tiktoken (the consumer), and the command line contract."""
import base64
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import regex
import rustbpe
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu as bpe  # noqa: E402
from conftest import assert_one_error_line  # noqa: E402

SCRIPT = REPO / "train_bpe_cpu.py"


def our_vocab(docs, vocab_size, pattern=bpe.pattern):
    """Our tokens in rank order, read back from the rank file that save_tokenizer writes."""
    chunk_counts = Counter()
    for doc in docs:
        chunk_counts.update(regex.findall(pattern, doc))
    merges, _ = bpe.train(chunk_counts, vocab_size)
    with tempfile.TemporaryDirectory() as directory:
        bpe.save_tokenizer(Path(directory), merges, {})
        lines = (Path(directory) / "tokenizer.tiktoken").read_text().splitlines()
    assert [int(line.split()[1]) for line in lines] == list(range(len(lines)))
    return [base64.b64decode(line.split()[0]) for line in lines]


def rustbpe_vocab(docs, vocab_size, pattern=bpe.pattern):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=pattern)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def start_cli(*args, cwd):
    """train_bpe_cpu.py as a program, offline, in the background."""
    return subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_cli(*args, cwd):
    process = start_cli(*args, cwd=cwd)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def load_encoding(directory):
    """The README's loading snippet: the rank file and the sidecar into a tiktoken Encoding."""
    info = json.loads((directory / "tokenizer.json").read_text())
    with open(directory / "tokenizer.tiktoken", "rb") as f:
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line.strip())}
    return tiktoken.Encoding(name=str(directory), pat_str=info["pattern"], mergeable_ranks=ranks,
                             special_tokens=info["special_tokens"]), info


# ---------------------------------------------------------------- the algorithm equals rustbpe's

EDGE_CASES = {
    "aaaa": ["aaaa"],
    "long run of one byte": ["a" * 3000, "aaa aaaaa aaaaaaa " * 20],
    "crlf": ["line one\r\nline two\r\n\r\n  indented\r\n" * 10],
    "whitespace only": ["   \n\t  \n\n     \t\t  "],
    "emoji and joiners": ["😀😀 👩‍👩‍👧 🇫🇷🇫🇷 hi😀 ok" * 10],
    "long unspaced cjk chunk": ["人人生而自由在尊严和权利上一律平等他们赋有理性和良心并应以兄弟关系的精神相对待" * 30],
    "empty documents among others": ["", "abc abc", "", "abcabc"],
    # U+0C5C is a letter from Unicode 17 on: rustbpe and tiktoken (Unicode 16) split words there
    "a letter new in unicode 17": ["ab\u0c5cab ab\u0c5cab x\u0c5c \u0c5c\u0c5c " * 20],
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
@pytest.mark.parametrize("vocab_size", [257, 300, 600])
def test_edge_cases_equal_rustbpe(name, vocab_size):
    docs = EDGE_CASES[name]
    assert our_vocab(docs, vocab_size) == rustbpe_vocab(docs, vocab_size)


def test_generated_corpus_equals_rustbpe():
    import random
    rng = random.Random(1234)
    words = ["".join(rng.choice("abcdeéfghij ") for _ in range(rng.randrange(1, 9))) for _ in range(300)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(5, 200))) for _ in range(200)]
    assert our_vocab(docs, 1200) == rustbpe_vocab(docs, 1200)


def test_multilingual_udhr_equals_rustbpe(corpus):
    with open(corpus("udhr.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f][::4]  # ~110 languages, every script family
    assert our_vocab(docs, 2000) == rustbpe_vocab(docs, 2000)


def test_other_pattern_equals_rustbpe(corpus):
    gpt2_pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    text = corpus("tinyshakespeare.txt").read_text()[:100_000]
    assert our_vocab([text], 700, gpt2_pattern) == rustbpe_vocab([text], 700, gpt2_pattern)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(st.text(alphabet=st.sampled_from("aab  \n\r.,1é中😀"), max_size=40), max_size=6),
       vocab_size=st.integers(256, 320))
def test_random_corpora_equal_rustbpe(docs, vocab_size):
    assert our_vocab(docs, vocab_size) == rustbpe_vocab(docs, vocab_size)


def test_overlapping_pairs_count_and_merge_left_to_right():
    # "aaa" holds (a, a) twice, so it beats (b, c) which occurs once...
    merges, total_tokens = bpe.train(Counter({"aaa": 1, "bc": 1}), 259)
    assert merges[0] == ((97, 97), 256)
    # ...merging it left to right leaves [aa, a]: (aa, a) and (b, c) now tie at 1, and the tie goes to the
    # smaller pair; then (aa, a) makes "aaa" one token.
    assert merges[1:] == [((98, 99), 257), ((256, 97), 258)]
    assert total_tokens == 2


# ---------------------------------------------------------------- the command line, end to end


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """One CLI run on real text, shared by the round-trip tests."""
    path = corpus("tinyshakespeare.txt")
    out = tmp_path_factory.mktemp("tok")
    result = run_cli("--data", path, "-v", 700, "-n", 200_000, "--out", out, cwd=out)
    assert result.returncode == 0, result.stderr
    return out, path, result, load_encoding(out)[0]


def test_cli_output_equals_rustbpe_and_loads_in_tiktoken(trained):
    out, path, result, _ = trained
    encoding, info = load_encoding(out)
    text = path.read_text()[:200_000]
    assert [encoding.decode_single_token_bytes(rank) for rank in range(700)] == rustbpe_vocab([text], 700)
    assert info["special_tokens"] == {"<|endoftext|>": 700} and info["vocab_size"] == encoding.n_vocab == 701
    assert info["num_chars"] == 200_000 and info["stop_reason"] == "vocab_size reached"
    assert encoding.encode("hi<|endoftext|>", allowed_special="all")[-1] == 700
    assert "split pattern matched" not in result.stderr  # GPT-4's pattern matches every character
    # The printed compression must agree with what tiktoken makes of the same text.
    tokens = len(encoding.encode_ordinary(text))
    assert f"-> {tokens:,} tokens" in result.stdout
    assert not list(out.glob("*.tmp"))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_tiktoken_round_trips_any_unicode(trained, text):
    encoding = trained[3]
    assert encoding.decode(encoding.encode_ordinary(text)) == text


def test_num_chars_cuts_the_stream_exactly(tmp_path):
    docs = ["abc", "defg", "hi"]
    stream = lambda budget: iter(docs)
    assert list(bpe.first_chars(stream, 5)) == ["abc", "de"]
    assert list(bpe.first_chars(stream, 7)) == ["abc", "defg"]
    assert list(bpe.first_chars(stream, 100)) == docs
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    result = run_cli("--data", tmp_path / "d.jsonl", "-v", 260, "-n", 5, "--out", tmp_path / "a", cwd=tmp_path)
    assert json.loads((tmp_path / "a" / "tokenizer.json").read_text())["num_chars"] == 5
    result = run_cli("--data", tmp_path / "d.jsonl", "-v", 260, "-n", 100, "--out", tmp_path / "b", cwd=tmp_path)
    assert result.returncode == 0 and "ran out after 9 characters" in result.stdout
    # -n ending exactly at a document's end reads no further: a malformed line after it is never seen.
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": "abc"}) + "\nnot json\n")
    result = run_cli("--data", tmp_path / "e.jsonl", "-v", 260, "-n", 3, "--out", tmp_path / "c", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_cli_on_a_directory_equals_rustbpe_on_its_documents(tmp_path):
    """The reader's documents (test_reader.py) reach the trainer unchanged: CRLF and all, file by file."""
    docs = ["First document,\r\nwith CRLF.\r\n" * 5, "Second one, with ünïcode 中文 😀. " * 5, "third third third"]
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_bytes(docs[0].encode())
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs[1:]))
    result = run_cli("--data", folder, "-v", 300, "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    encoding, _ = load_encoding(tmp_path / "tok")
    assert [encoding.decode_single_token_bytes(r) for r in range(encoding.n_vocab - 1)] == rustbpe_vocab(docs, 300)[:encoding.n_vocab - 1]


def test_offline_fallback_is_the_standard_library(tmp_path):
    result = run_cli("-v", 300, "-n", 50_000, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "using the offline corpus" in result.stderr
    out = tmp_path / "tokenizers" / "stdlib_v300"
    info = json.loads((out / "tokenizer.json").read_text())
    assert info["num_chars"] == 50_000 and "standard library" in info["source"]
    # The same first 50,000 characters, gathered independently, give the same tokenizer.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    docs, remaining = [], 50_000
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")[:remaining]
        docs.append(text)
        remaining -= len(text)
        if not remaining:
            break
    encoding, _ = load_encoding(out)
    assert [encoding.decode_single_token_bytes(r) for r in range(300)] == rustbpe_vocab(docs, 300)


def test_invalid_utf8_is_replaced_with_a_warning(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good text \xff\xfe and \xe2\x82 more " * 3 + "ok \ufffd".encode())
    result = run_cli("--data", tmp_path / "bad.txt", "-v", 270, "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warning: 9 invalid UTF-8 sequences were replaced with U+FFFD" in result.stderr


def test_what_the_pattern_leaves_out_is_a_warning(tmp_path):
    """tiktoken drops what the split pattern does not match, and so does the trainer: never silently."""
    small = write_small_corpus(tmp_path)  # "some text to train on " * 10: 220 characters, 170 of them letters
    result = run_cli("--data", small, "-v", 260, "--pattern", r"\w+", "--out", tmp_path / "tok", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("warning: the split pattern matched 170 of 220 characters; the other 22.7% are dropped "
            "(tiktoken drops them too)") in result.stderr.splitlines()


def holds_flock(directory):
    """Whether some process holds a flock on `directory`, seen in Linux's /proc/locks (taking one ourselves
    to find out would race with the run)."""
    if not directory.exists():
        return False
    inode = f":{directory.stat().st_ino}"
    with open("/proc/locks") as locks:
        return any(line.split()[1] == "FLOCK" and line.split()[5].endswith(inode) for line in locks)


def test_one_writer_per_out(tmp_path, corpus):
    """Of two runs started together into one --out, one writes what a lone run writes; the other refuses in
    one line that names the directory. (Each holds the lock about a second.) And a run killed with -9
    leaves no stale lock: the next run into its directory goes ahead."""
    args = ["--data", corpus("tinyshakespeare.txt"), "-v", 4000]
    racers = [start_cli(*args, "--out", tmp_path / "tok", cwd=tmp_path) for _ in range(2)]
    results = []
    for process in racers:
        stdout, stderr = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    winner, loser = sorted(results, key=lambda result: result.returncode)
    assert winner.returncode == 0, winner.stderr
    assert_one_error_line(loser, f"error: {tmp_path / 'tok'}: another run is writing there")
    assert sorted(os.listdir(tmp_path / "tok")) == ["tokenizer.json", "tokenizer.tiktoken"]

    killed = start_cli(*args, "--out", tmp_path / "alone", cwd=tmp_path)
    deadline = time.time() + 60
    while not holds_flock(tmp_path / "alone"):
        assert killed.poll() is None and time.time() < deadline, "the run never held its lock"
        time.sleep(0.01)
    killed.kill()
    killed.communicate()
    assert os.listdir(tmp_path / "alone") == []  # killed while it held the lock, before it wrote a file
    result = run_cli(*args, "--out", tmp_path / "alone", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    raced_info, alone_info = (load_encoding(tmp_path / name)[1] for name in ("tok", "alone"))
    assert {**raced_info, "seconds": 0} == {**alone_info, "seconds": 0}
    assert (tmp_path / "tok/tokenizer.tiktoken").read_bytes() == (tmp_path / "alone/tokenizer.tiktoken").read_bytes()


# ---------------------------------------------------------------- bad input: one line, non-zero exit, nothing written


def write_small_corpus(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("some text to train on " * 10)
    return path


BAD_INPUTS = {  # the reader's own bad input (files, lines, the Hub) is tested once, in test_reader.py
    "vocab too small": (["-v", "255"], "vocab_size must be between 256"),
    "vocab too large": (["-v", str(2**31)], "vocab_size must be between 256"),
    "n zero": (["-n", "0"], "must be positive"),
    "n negative": (["-n", "-5"], "must be positive"),
    "bad pattern": (["--pattern", "(unclosed"], "--pattern does not compile"),
    # up front: before the reader meets the bad line of BAD.jsonl
    "empty pattern": (["--pattern", "", "--data", "BAD.jsonl"], "matches the empty string"),
    "pattern matching empty": (["--pattern", "x*", "--data", "BAD.jsonl"], "matches the empty string"),
    "pattern matching empty in places": (["--pattern", r"\b|\w+"], "matches the empty string"),
    "pattern with a group": (["--pattern", r"(\w+) ?"], "has a capturing group; use (?:...)"),
    "catastrophic pattern": (["--pattern", r"(?:a|a)+b|\s", "--data", "RUNS.txt"],
                             "backtracks catastrophically: it ran past the time limit on document 1 ('aaaa"),
    "empty corpus": (["--data", "EMPTY.txt"], "is empty"),
    "unreadable data": (["--data", "x" * 300 + ".txt"], "File name too long"),  # an OSError, like a permission denied
    "out is a file": (["--out", "SMALL.md"], "SMALL.md is a file, not a directory"),
    "out under a file": (["--out", "SMALL.md/tok"], "SMALL.md is a file, not a directory"),
    "out in /proc": (["--out", "/proc/tok"], "--out /proc/tok can't be written"),
    "out is a dataset": (["--out", "DATASET"], "--out DATASET is a dataset directory (it holds meta.json)"),
    "out holds other files": (["--out", "FOREIGN"], "--out FOREIGN is not a tokenizer directory (it holds notes.txt)"),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every bad input, each in a directory of its own, all run at once: start-up is most of a run, and the
    catastrophic pattern waits for its 1 s alarm. Per case: (directory, its files before, (stdout, stderr), exit status)."""
    runs = {}
    for case, (args, _) in BAD_INPUTS.items():
        directory = tmp_path_factory.mktemp("bad")
        small = write_small_corpus(directory)
        (directory / "SMALL.md").write_text("text")
        (directory / "EMPTY.txt").write_text("")
        (directory / "RUNS.txt").write_text("a" * 40 + " x")
        (directory / "BAD.jsonl").write_text('{"text": 42}\n')
        for folder, names in {"DATASET": ["meta.json", "train_000000.npy", "tokenizer.json"], "FOREIGN": ["notes.txt"]}.items():
            (directory / folder).mkdir()
            for name in names:
                (directory / folder / name).write_text(name)
        before = {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}
        args = args + ([] if "--data" in args else ["--data", str(small)]) + ([] if "--out" in args else ["--out", "out"])
        runs[case] = directory, before, start_cli(*args, cwd=directory)
    return {case: (directory, before, process.communicate(timeout=300), process.returncode)
            for case, (directory, before, process) in runs.items()}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_line(bad_input_runs, case):
    directory, before, (stdout, stderr), returncode = bad_input_runs[case]
    assert returncode == 1
    # One line saying what is wrong (progress bars may precede it on stderr), and no traceback.
    error_lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and BAD_INPUTS[case][1] in error_lines[0], stderr
    assert "Traceback" not in stderr
    # Nothing written, nothing destroyed: the same files, byte for byte, and no new directory.
    assert {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()} == before
    assert not (directory / "out").exists() and not (directory / "SMALL.md" / "tok").exists()


def test_out_may_be_a_tokenizer_directory_to_overwrite(tmp_path):
    small = write_small_corpus(tmp_path)
    for vocab_size in (256, 270):  # 256: the bytes alone, no merge; the second run overwrites the first one's files
        result = run_cli("--data", small, "-v", vocab_size, "--out", tmp_path / "tok", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["vocab_size"] == vocab_size + 1
    # A full disk (a 1,000-byte file size limit here) while writing is one line, the old files stay, no .tmp.
    before = {path.name: path.read_bytes() for path in (tmp_path / "tok").iterdir()}
    full_disk = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # noqa: E731
    result = subprocess.run([sys.executable, SCRIPT, "--data", small, "-v", "280", "--out", tmp_path / "tok"],
                            preexec_fn=full_disk, capture_output=True, text=True, cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # after the bars
    assert result.returncode == 1 and errors == ["error: [Errno 27] File too large"], result.stderr
    assert {path.name: path.read_bytes() for path in (tmp_path / "tok").iterdir()} == before
    # The disk fills after the rank file (~2.3 KB at -v 256), at tokenizer.json (a long pattern: ~5 KB): the
    # old pair stays, not the new ranks beside the old json (prepare_data.py would load that pair: EOT 270).
    long_pattern = r"\S+|\s+" + "|x" * 2500
    full_disk = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))  # noqa: E731
    result = subprocess.run([sys.executable, SCRIPT, "--data", small, "-v", "256", "--out", tmp_path / "tok",
                             "--pattern", long_pattern], preexec_fn=full_disk, capture_output=True, text=True)
    assert result.returncode == 1 and "error: [Errno 27] File too large" in result.stderr, result.stderr
    assert {path.name: path.read_bytes() for path in (tmp_path / "tok").iterdir()} == before


def test_a_filesystem_without_flock_is_a_warning(tmp_path, monkeypatch, capsys):
    """Lustre mounted noflock, or NFS without lockd, refuse flock with an OSError: the run goes on, warned."""
    def no_flock(descriptor, operation):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(bpe.fcntl, "flock", no_flock)
    descriptor = bpe.check_out_dir(tmp_path / "out")
    os.close(descriptor)
    assert "can't lock it (Function not implemented)" in capsys.readouterr().err
