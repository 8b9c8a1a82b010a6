"""prepare_data.py: the shards decode back to the documents, the split and limits follow their rules,
a run killed with SIGKILL resumes to identical files, bad input gets one line, one run at a time writes
to an --out, and what the split pattern drops is counted.

The datasets are made as a user makes them, in a subprocess, on small generated corpora; the refusals run
in this process (run() raises the UserError that the command line prints), with one command line check
that it reaches the user as a single `error:` line."""
import base64
import hashlib
import json
import os
import platform
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import regex
import rustbpe
import tiktoken
from conftest import SCRIPT_RUNNER, assert_one_error_line

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import prepare_data  # noqa: E402

SCRIPT = REPO / "prepare_data.py"
EOT = "<|endoftext|>"

WORDS = ["the", "cat", "sat", "on", "a", "mat", "naïve", "café", "日本語", "テキスト", "🎉", "emoji👍🏽",
         "3.14159", "2026", "don't", "WE'LL", "\r\n", "\t", "  ", "\n\n", "x" * 40, "Ω≈ç√", "<|endoftext|>"]


def make_docs(count, seed=0, max_words=60):
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(count)]
    docs[3] = ""  # an empty document: skipped, it holds no text
    docs[5] = "a literal <|endoftext|> in the text is plain text, not the special token"
    return docs


def write_bpe_dir(directory, ranks, pattern):
    """A tokenizer directory as train_bpe_cpu.py writes it (the README's contract)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "tokenizer.tiktoken", "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    info = {"pattern": pattern, "special_tokens": {EOT: len(ranks)}, "vocab_size": len(ranks) + 1,
            "num_merges": len(ranks) - 256, "num_chars": 0, "source": "test", "trainer": "rustbpe",
            "seconds": 0.0, "stop_reason": "vocab_size reached"}
    (directory / "tokenizer.json").write_text(json.dumps(info))
    return directory


def load_encoding(directory):
    info = json.loads((directory / "tokenizer.json").read_text())
    with open(directory / "tokenizer.tiktoken", "rb") as f:
        ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in f if line.strip())}
    return tiktoken.Encoding(name=str(directory), pat_str=info["pattern"], mergeable_ranks=ranks,
                             special_tokens=info["special_tokens"])


@pytest.fixture(scope="module")
def docs():
    return make_docs(400)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, docs):
    """A 300-token BPE trained by rustbpe (the trainers' oracle) on the test documents."""
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(docs, 300)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    return write_bpe_dir(tmp_path_factory.mktemp("tok") / "bpe300", ranks, trainer.get_pattern())


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return path


def prepare(*args, cwd, env=None, check=True):
    result = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True,
                            text=True, timeout=300, env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stderr
    return result


def refused(*args):
    """run() in this process (the current directory is the test's): the one-line message it refuses with."""
    with pytest.raises(prepare_data.UserError) as error:
        prepare_data.run(list(map(str, args)))
    assert "\n" not in str(error.value)
    return str(error.value)


def read_dataset(out_dir):
    """meta.json, and the tokens of val and of train, each split's shards concatenated in order."""
    meta = json.loads((out_dir / "meta.json").read_text())
    splits = {}
    for split in ("val", "train"):
        arrays = [np.load(out_dir / name, mmap_mode="r") for name in meta["shards"][split]]
        assert all(array.dtype == np.dtype(meta["dtype"]) and array.ndim == 1 for array in arrays)
        splits[split] = np.concatenate(arrays) if arrays else np.zeros(0, dtype=meta["dtype"])
        assert len(splits[split]) == meta["tokens"][split]
        if not isinstance(meta["args"]["part"], int):  # one run's (not merged parts'): shard_size each, the last less
            shard_size = meta["args"]["shard_size"]
            assert all(len(array) == shard_size for array in arrays[:-1]), (split, [len(a) for a in arrays])
            assert not arrays or 0 < len(arrays[-1]) <= shard_size
    if meta["tokens"]["val"] + meta["tokens"]["train"]:  # train.py checks the model's vocabulary against it
        assert meta["max_token_id"] == int(max(split.max(initial=0) for split in splits.values()))
    return meta, splits["val"], splits["train"]


def expected_val_documents(token_counts, val_tokens):
    """The rule: the first documents until val holds val_tokens tokens, at least one, never the last."""
    count, total = 0, 0
    while count < len(token_counts) - 1 and (count == 0 or total < val_tokens):
        total += token_counts[count]
        count += 1
    return count


# ---------------------------------------------------------------- decoding gives back the documents


def test_bpe_dir_shards_decode_to_the_documents(tmp_path, docs, bpe_dir):
    write_jsonl(tmp_path / "docs.jsonl", docs)
    result = prepare("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds", "--shard_size", 700,
                     "--val_tokens", 1500, cwd=tmp_path)
    assert "warning" not in result.stderr  # rustbpe's pattern matches every character
    out_dir = tmp_path / "ds"
    meta, val, train = read_dataset(out_dir)
    enc = load_encoding(bpe_dir)
    kept = [doc for doc in docs if doc]
    assert enc.decode(np.concatenate([val, train]).tolist()) == "".join(EOT + doc for doc in kept)
    # The literal "<|endoftext|>" inside documents stays text: the EOT id appears once per document.
    assert int((val == enc.eot_token).sum() + (train == enc.eot_token).sum()) == len(kept)
    # An independent route to the split: encode each document here, apply the documented rule.
    counts = [1 + len(enc.encode_ordinary(doc)) for doc in kept]
    assert len(val) == sum(counts[:expected_val_documents(counts, 1500)])
    # Shard boundaries are every shard_size tokens of a split: documents run across them.
    for split in ("val", "train"):
        lengths = [len(np.load(out_dir / name, mmap_mode="r")) for name in meta["shards"][split]]
        assert lengths[:-1] == [700] * (len(lengths) - 1) and 0 < lengths[-1] <= 700
    assert meta["shards"]["train"][:2] == ["train_000000.npy", "train_000001.npy"]
    assert meta["version"] == 1 and meta["vocab_size"] == 301 and meta["eot_token"] == 300
    assert meta["dtype"] == "uint16" and meta["max_token_id"] == int(max(val.max(), train.max()))
    assert meta["num_chars"] == sum(len(doc) for doc in docs)
    info = json.loads((bpe_dir / "tokenizer.json").read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["pattern"] == info["pattern"]
    assert meta["tokenizer"]["special_tokens"] == info["special_tokens"] == {EOT: 300}
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((bpe_dir / "tokenizer.tiktoken").read_bytes()).hexdigest()
    for name in ("tokenizer.tiktoken", "tokenizer.json"):  # the dataset carries its tokenizer
        assert (out_dir / name).read_bytes() == (bpe_dir / name).read_bytes()
    assert not list(out_dir.glob("*.tmp")) and not (out_dir / "progress.json").exists()


def test_char_level_single_document_gives_its_last_tenth_to_val(tmp_path):
    """Run in an ASCII locale: meta.json, which holds the characters, is UTF-8 whatever the locale."""
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 40 + "Ünïcödé ✓ 🎉"
    (tmp_path / "play.txt").write_text(text, encoding="utf-8")
    ascii_locale = {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    prepare("--tokenizer", "char", "--data", "play.txt", "--shard_size", 512, cwd=tmp_path, env=ascii_locale)
    meta, val, train = read_dataset(tmp_path / "data" / "play_char")  # the default: data/<source>_<tokenizer>
    assert meta["chars"] == sorted(set(text)) and meta["vocab_size"] == len(set(text))
    assert meta["eot_token"] is None and meta["tokenizer"] == {"kind": "char"}
    assert len(train) == len(text) * 9 // 10  # nanoGPT's split: the first 90% trains
    chars = meta["chars"]
    assert "".join(chars[i] for i in train) + "".join(chars[i] for i in val) == text


def test_char_level_documents_val_first(tmp_path, docs):
    write_jsonl(tmp_path / "docs.jsonl", docs)
    # A document ends one token before a shard boundary (char level: a character is a token): that shard still
    # fills up to shard_size (read_dataset checks every shard's length).
    shard_size = sum(len(doc) for doc in docs[:7]) + 1
    prepare("--tokenizer", "char", "--data", "docs.jsonl", "--out", "ds", "--val_tokens", 2000,
            "--shard_size", shard_size, cwd=tmp_path)
    meta, val, train = read_dataset(tmp_path / "ds")
    assert len(val) > shard_size
    chars = meta["chars"]
    assert "".join(chars[i] for i in np.concatenate([val, train])) == "".join(docs)  # no EOT at char level
    kept = [doc for doc in docs if doc]
    assert len(val) == sum(len(doc) for doc in kept[:expected_val_documents([len(d) for d in kept], 2000)])
    # --max_tokens at char level: the first N characters, and the vocabulary is theirs (a character met only
    # past the cut is not in it, and is no "the data changed" error either).
    write_jsonl(tmp_path / "more.jsonl", docs + ["met only after the cut: \u00b6"])
    prepare("--tokenizer", "char", "--data", "more.jsonl", "--out", "cut", "--max_tokens", 3001, cwd=tmp_path)
    meta, val, train = read_dataset(tmp_path / "cut")
    assert "".join(meta["chars"][i] for i in np.concatenate([val, train])) == "".join(docs)[:3001]
    assert meta["chars"] == sorted(set("".join(docs)[:3001]))


def test_char_ids_are_ranks_and_an_unseen_character_is_refused():
    """Pass 2 of char level reads the data again: a character that pass 1 did not see means the data changed."""
    encoder = prepare_data.CharEncoder(sorted("ab🎉"))
    assert encoder.encode_to_numpy("🎉ba").tolist() == [2, 1, 0] and encoder.n_vocab == 3
    with pytest.raises(prepare_data.UserError, match="the data changed between the two passes"):
        encoder.encode_to_numpy("abc")


@pytest.mark.parametrize("index, size, skip, is_last, written, pieces", [
    (0, 50, 0, False, {"val": 0, "train": 0}, [("val", 0, 50)]),  # the first document: val
    (1, 50, 0, False, {"val": 99, "train": 0}, [("val", 0, 50)]),  # val short of 100: still val
    (2, 50, 0, False, {"val": 100, "train": 0}, [("train", 0, 50)]),  # val full: train from now on
    (3, 50, 0, False, {"val": 40, "train": 10}, [("train", 0, 50)]),  # train begun: train
    (1, 50, 0, True, {"val": 0, "train": 0}, [("train", 0, 50)]),  # the last document always trains
    # resumed at token 30 of a document: `written` holds those 30, which don't make val full
    (4, 50, 30, False, {"val": 120, "train": 0}, [("val", 30, 50)]),
    (4, 50, 30, False, {"val": 100, "train": 30}, [("train", 30, 50)]),
    (0, 50, 0, True, {"val": 0, "train": 0}, [("train", 0, 45), ("val", 45, 50)]),  # alone: 90/10
    (0, 2, 0, True, {"val": 0, "train": 0}, [("train", 0, 1), ("val", 1, 2)]),  # val: one at least
])
def test_the_val_split_rule(index, size, skip, is_last, written, pieces):
    """Step 3 on its own: where each piece of a document goes, with val_tokens = 100."""
    assert prepare_data.val_split(index == 0, size, skip, is_last, written, 100) == pieces


def test_tiktoken_name_path_with_a_local_encoding(tmp_path, docs, bpe_dir):
    """The tiktoken-name route (tiktoken.get_encoding) for real, on an encoding that tiktoken finds through its
    plugin mechanism (a tiktoken_ext module on PYTHONPATH) and builds from local ranks: gpt2 & co. would need
    a download, which this machine can't make. Only the download is left untested."""
    plugin = tmp_path / "plugin" / "tiktoken_ext"
    plugin.mkdir(parents=True)
    (plugin / "lillm_test_local.py").write_text(
        "import base64, json, os\n"
        "def local():\n"
        "    d = os.environ['LILLM_TEST_RANKS']\n"
        "    info = json.load(open(os.path.join(d, 'tokenizer.json')))\n"
        "    lines = open(os.path.join(d, 'tokenizer.tiktoken'), 'rb').read().split(b'\\n')\n"
        "    ranks = {base64.b64decode(t): int(r) for t, r in (l.split() for l in lines if l.strip())}\n"
        "    return dict(name='lillm_test', pat_str=info['pattern'], mergeable_ranks=ranks,\n"
        "                special_tokens=info['special_tokens'])\n"
        "ENCODING_CONSTRUCTORS = {'lillm_test': local}\n")
    env = {"PYTHONPATH": str(plugin.parent), "LILLM_TEST_RANKS": str(bpe_dir)}
    write_jsonl(tmp_path / "docs.jsonl", docs)
    prepare("--tokenizer", "lillm_test", "--data", "docs.jsonl", "--out", "ds", "--shard_size", 1000,
            cwd=tmp_path, env=env)
    meta, val, train = read_dataset(tmp_path / "ds")
    assert meta["tokenizer"] == {"kind": "tiktoken", "name": "lillm_test"}
    enc = load_encoding(bpe_dir)
    assert meta["eot_token"] == enc.eot_token and meta["vocab_size"] == enc.n_vocab
    assert enc.decode(np.concatenate([val, train]).tolist()) == "".join(EOT + doc for doc in docs if doc)
    assert not (tmp_path / "ds" / "tokenizer.tiktoken").exists()  # tiktoken names are found by name


# ---------------------------------------------------------------- uint32 when an id doesn't fit 16 bits


def test_bpe_vocabulary_over_65536_switches_to_uint32(tmp_path):
    """65,536 two-byte merges on top of the bytes. Pairs starting with '`' get the top ranks (65,536..65,791),
    so '`a' in the text must come out as an id above 65,535 and survive the trip through the shards."""
    ranks = {bytes([b]): b for b in range(256)}
    for first in range(256):
        for second in range(256):
            ranks[bytes([first, second])] = 256 + ((first - ord("a")) % 256) * 256 + second
    tok = write_bpe_dir(tmp_path / "big", ranks, r"[\s\S]{1,2}")
    docs = ["`a`b plain text ``", "another `z document", "`q and the last one"]
    write_jsonl(tmp_path / "docs.jsonl", docs)
    prepare("--tokenizer", tok, "--data", "docs.jsonl", "--out", "ds", cwd=tmp_path)
    meta, val, train = read_dataset(tmp_path / "ds")
    tokens = np.concatenate([val, train])
    assert meta["dtype"] == "uint32" and tokens.dtype == np.uint32 and meta["vocab_size"] == 65793
    assert tokens.max() > 65535 and meta["max_token_id"] == int(tokens.max())
    assert load_encoding(tok).decode(tokens.tolist()) == "".join(EOT + doc for doc in docs)


def test_exactly_65536_ids_stay_uint16(tmp_path, monkeypatch, capsys):
    """65,535 ranks and <|endoftext|> as id 65,535: the largest id fits 16 bits, so uint16 (run in this process)."""
    ranks = {bytes([b]): b for b in range(256)}
    for pair in range(65_535 - 256):  # two-byte tokens, those starting with 'a' first
        ranks[bytes([(ord("a") + pair // 256) % 256, pair % 256])] = 256 + pair
    tok = write_bpe_dir(tmp_path / "edge", ranks, r"[\s\S]{1,2}")
    docs = ["ab cd plain text", "another document"]
    write_jsonl(tmp_path / "docs.jsonl", docs)
    monkeypatch.chdir(tmp_path)
    prepare_data.run(["--tokenizer", str(tok), "--data", "docs.jsonl", "--out", "ds"])
    capsys.readouterr()
    meta, val, train = read_dataset(tmp_path / "ds")
    assert meta["vocab_size"] == 65_536 and meta["eot_token"] == meta["max_token_id"] == 65_535
    assert meta["dtype"] == "uint16" and val.dtype == np.uint16
    assert load_encoding(tok).decode(np.concatenate([val, train]).tolist()) == "".join(EOT + doc for doc in docs)


def test_char_vocabulary_over_65536_switches_to_uint32(tmp_path):
    code_points = [c for c in range(0x21, 0x21 + 70_000 + 2048) if not 0xD800 <= c <= 0xDFFF][:70_000]
    text = "".join(map(chr, code_points))
    docs = [text[:35_000], text[35_000:]]
    write_jsonl(tmp_path / "docs.jsonl", docs)
    prepare("--tokenizer", "char", "--data", "docs.jsonl", "--out", "ds", cwd=tmp_path)
    meta, val, train = read_dataset(tmp_path / "ds")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000 and meta["max_token_id"] == 69_999
    chars = meta["chars"]
    assert "".join(chars[i] for i in np.concatenate([val, train])) == text


# ---------------------------------------------------------------- sources and limits


def test_num_chars_and_max_tokens_cut_the_stream(tmp_path, docs, bpe_dir):
    write_jsonl(tmp_path / "docs.jsonl", docs)
    enc = load_encoding(bpe_dir)
    # -n: the first N characters of the document stream, the last document cut to fit.
    prepare("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "n", "-n", 5000, cwd=tmp_path)
    meta, val, train = read_dataset(tmp_path / "n")
    expected, remaining = [], 5000
    for doc in docs:
        if remaining == 0:
            break
        expected.append(doc[:remaining])
        remaining -= len(expected[-1])
    assert remaining == 0 and len(expected) < len(docs)
    text = enc.decode(np.concatenate([val, train]).tolist())
    assert text == "".join(EOT + doc for doc in expected if doc) and meta["num_chars"] == 5000
    # --max_tokens: exactly that many tokens, the same as the first tokens of a run without the limit.
    prepare("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "full", "--val_tokens", 500, cwd=tmp_path)
    prepare("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "cut", "--val_tokens", 500,
            "--max_tokens", 3001, "--shard_size", 1000, cwd=tmp_path)
    _, full_val, full_train = read_dataset(tmp_path / "full")
    meta, val, train = read_dataset(tmp_path / "cut")
    assert meta["tokens"]["val"] + meta["tokens"]["train"] == 3001
    assert np.array_equal(np.concatenate([val, train]), np.concatenate([full_val, full_train])[:3001])
    assert np.array_equal(val, full_val)


# ---------------------------------------------------------------- resume after kill -9, for real


def files_of(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_a_full_disk_is_one_line_and_the_same_command_then_finishes(tmp_path, bpe_dir):
    # Files of at most 30,000 bytes, and a write past that fails with EFBIG (as on a full disk) rather than SIGXFSZ
    # killing the process: a shard of 20,000 uint16 ids can't be written. Run again with room, the same command
    # finishes the dataset a run with room from the start makes.
    def full_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))
    write_jsonl(tmp_path / "docs.jsonl", make_docs(600, seed=2, max_words=200))
    args = [str(SCRIPT), "--tokenizer", str(bpe_dir), "--data", "docs.jsonl", "--shard_size", "20000"]
    result = subprocess.run([sys.executable, *args, "--out", "full"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, preexec_fn=full_disk)
    last_line = result.stderr.splitlines()[-1]  # after the progress bar's
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert last_line == "error: [Errno 27] File too large; fix it and run the same command again to resume"
    prepare(*args[1:], "--out", "full", cwd=tmp_path)
    prepare(*args[1:], "--out", "roomy", cwd=tmp_path)
    assert files_of(tmp_path / "full") == files_of(tmp_path / "roomy")


def test_resume_after_sigkill_gives_identical_shards(tmp_path, bpe_dir):
    big_docs = make_docs(6000, seed=1, max_words=200)
    write_jsonl(tmp_path / "docs.jsonl", big_docs)
    args = ["--tokenizer", bpe_dir, "--data", "docs.jsonl", "--shard_size", 20_000, "--val_tokens", 50_000,
            "--workers", 2]
    prepare(*args, "--out", "reference", cwd=tmp_path)
    reference = files_of(tmp_path / "reference")
    assert len(reference) > 40  # many shards, so the kills land mid-run

    out_dir = tmp_path / "killed"
    progress_path = out_dir / "progress.json"
    finished_before = {}
    # Kill it three times: as soon as it has started, and after 3 and 12 finished shards in all.
    for shards_wanted in (0, 3, 12):
        process = subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args), "--out", "killed"], cwd=tmp_path,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            try:
                progress = json.loads(progress_path.read_text())
            except (OSError, ValueError):
                progress = None
            if progress is not None and len(progress["shards"]["val"] + progress["shards"]["train"]) >= shards_wanted:
                break
            time.sleep(0.002)
        assert process.poll() is None, "the run ended before it could be killed: give it more data"
        process.send_signal(signal.SIGKILL)
        process.communicate()
        progress = json.loads(progress_path.read_text())
        finished_before = {name: (out_dir / name).stat().st_ino
                           for name in progress["shards"]["val"] + progress["shards"]["train"]}
    assert len(finished_before) >= 12 and not (out_dir / "meta.json").exists()

    result = prepare(*args, "--out", "killed", cwd=tmp_path)
    assert "resuming" in result.stdout
    assert files_of(out_dir) == reference  # byte for byte, meta.json included
    # The finished shards were skipped, not rewritten: the same files (inodes) are still there.
    assert {name: (out_dir / name).stat().st_ino for name in finished_before} == finished_before


# ---------------------------------------------------------------- bad input: one line, nothing left behind


def one_line_error(result):
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    return errors[0]


def reachable(host):
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


def test_bad_tokenizers(tmp_path, docs, bpe_dir, monkeypatch):
    write_jsonl(tmp_path / "docs.jsonl", docs[:20])
    broken_json = tmp_path / "broken_json"
    broken_json.mkdir()
    (broken_json / "tokenizer.tiktoken").write_bytes((bpe_dir / "tokenizer.tiktoken").read_bytes())
    (broken_json / "tokenizer.json").write_text('{"pattern": ')
    broken_ranks = tmp_path / "broken_ranks"
    broken_ranks.mkdir()
    (broken_ranks / "tokenizer.tiktoken").write_text("!!!not-base64!!! zero\n")
    (broken_ranks / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    empty_pattern = write_bpe_dir(tmp_path / "empty_pattern", {bytes([i]): i for i in range(256)}, "x*")
    rust_refuses = write_bpe_dir(tmp_path / "rust_refuses", {bytes([i]): i for i in range(256)}, r"\X|\s+")
    gap = write_bpe_dir(tmp_path / "gap", {bytes([i]): i + (i > 100) for i in range(256)}, r"\S+")  # rank 101 unused
    (tmp_path / "empty_dir").mkdir()
    half = tmp_path / "half"
    half.mkdir()
    (half / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    ranks = {bytes([i]): i for i in range(256)}
    eot_on_a_byte = write_bpe_dir(tmp_path / "eot_on_a_byte", ranks, r"\S+")
    info = json.loads((eot_on_a_byte / "tokenizer.json").read_text())
    (eot_on_a_byte / "tokenizer.json").write_text(json.dumps({**info, "special_tokens": {EOT: 5}, "vocab_size": 256}))
    replaced_65 = {(b"zz" if rank == 65 else token): rank for token, rank in ranks.items()}  # no "A" left
    no_byte_65 = write_bpe_dir(tmp_path / "no_byte_65", replaced_65, r"\S+")
    no_eot = write_bpe_dir(tmp_path / "no_eot", ranks, r"\S+")
    (no_eot / "tokenizer.json").write_text(json.dumps({**info, "special_tokens": {}}))
    wrong_size = write_bpe_dir(tmp_path / "wrong_size", ranks, r"\S+")
    (wrong_size / "tokenizer.json").write_text(json.dumps({**info, "vocab_size": 300}))
    cases = {
        "tokenizers/missing_v1000": "no such directory",
        str(broken_json): "it can't be read (JSONDecodeError: ",
        str(broken_ranks): "it can't be read (",
        str(half): "tokenizer.tiktoken is missing",
        str(tmp_path / "empty_dir"): "tokenizer.tiktoken is missing",
        str(empty_pattern): "matches the empty string",
        # Python's regex takes \X (a grapheme), tiktoken's Rust regex does not: no traceback from there
        str(rust_refuses): "it can't be read (ValueError: Parsing error at position 0: Invalid escape: \\X)",
        str(gap): "its ranks are not 0..255, each exactly once",
        str(eot_on_a_byte): "special token '<|endoftext|>' has id 5; special tokens take the ids from 256 up",
        str(no_byte_65): "its ranks 0-255 are not the 256 single bytes",
        str(no_eot): "it has no <|endoftext|>",
        str(wrong_size): "its vocab_size is 300; its ids make 257",
        "gpt5": "not a tiktoken encoding",
    }
    monkeypatch.chdir(tmp_path)
    for tokenizer, message in cases.items():
        assert message in refused("--tokenizer", tokenizer, "--data", "docs.jsonl", "--out", "ds"), tokenizer
        assert not (tmp_path / "ds").exists()
    assert "required" in refused("--data", "docs.jsonl")
    assert "--shard_size 0: must be a positive number" in refused("--tokenizer", "char", "--shard_size", 0)
    # through the command line: one `error:` line, exit status 1
    assert "no such directory" in one_line_error(prepare("--tokenizer", "tokenizers/missing_v1000", "--data",
                                                         "docs.jsonl", cwd=tmp_path, check=False))
    # tiktoken would panic on the "A", in 86 lines from Rust: the check comes first
    (tmp_path / "a.txt").write_text("A text with an A")
    assert_one_error_line(prepare("--tokenizer", no_byte_65, "--data", "a.txt", cwd=tmp_path, check=False),
                          "its ranks 0-255 are not the 256 single bytes")


@pytest.mark.skipif(reachable("openaipublic.blob.core.windows.net"), reason="online: tiktoken can download gpt2")
def test_tiktoken_name_offline_says_so(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("hello")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    assert "could not download" in refused("--tokenizer", "gpt2", "--data", "a.txt")


def test_empty_datasets_leave_nothing_behind(tmp_path, bpe_dir, monkeypatch):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    write_jsonl(tmp_path / "blank_docs.jsonl", ["", "", ""])
    (tmp_path / "one.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    for source in ("empty.txt", "empty.jsonl", "blank_docs.jsonl"):
        for tokenizer in (bpe_dir, "char"):
            assert "is empty" in refused("--tokenizer", tokenizer, "--data", source, "--out", "ds")
            assert not (tmp_path / "ds").exists()
    assert "is empty or one token" in refused("--tokenizer", "char", "--data", "one.txt", "--out", "ds")
    assert not (tmp_path / "ds").exists()
    # a 0-byte .parquet is no Parquet file: refused as the tokenizer trainers refuse it, whichever part it is in
    (tmp_path / "files").mkdir()
    write_jsonl(tmp_path / "files" / "a.jsonl", ["some text"] * 50)
    (tmp_path / "files" / "b.parquet").write_bytes(b"")
    for part in ("0/1", "0/2", "1/2"):
        error = refused("--tokenizer", bpe_dir, "--data", "files", "--out", "ds", "--part", part)
        assert "b.parquet (ArrowInvalid: Parquet file size is 0 bytes)" in error and not (tmp_path / "ds").exists()
    # through the command line, after the progress bar: still one `error:` line
    result = prepare("--tokenizer", bpe_dir, "--data", "blank_docs.jsonl", "--out", "ds", cwd=tmp_path, check=False)
    assert "is empty" in one_line_error(result) and not (tmp_path / "ds").exists()


def test_a_document_past_tiktokens_backtracking_limit_is_one_line(tmp_path, bpe_dir, monkeypatch):
    write_jsonl(tmp_path / "spaces.jsonl", ["x", " " * 1_000_000 + "x"])  # \s+(?!\S) backtracks a million times
    monkeypatch.chdir(tmp_path)
    assert "shorten its runs of whitespace" in refused("--tokenizer", bpe_dir, "--data", "spaces.jsonl", "--out", "ds")


def test_out_into_a_file_and_foreign_or_mismatched_out(tmp_path, docs, bpe_dir, monkeypatch, capsys):
    write_jsonl(tmp_path / "docs.jsonl", docs[:50])
    (tmp_path / "a_file").write_text("x")
    monkeypatch.chdir(tmp_path)
    for out in ("a_file", "a_file/sub"):
        assert "a_file is a file" in refused("--tokenizer", "char", "--data", "docs.jsonl", "--out", out)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "precious.txt").write_text("keep me")
    assert "not made by prepare_data.py" in refused("--tokenizer", "char", "--data", "docs.jsonl", "--out", "foreign")

    prepare("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds", cwd=tmp_path)
    before = files_of(tmp_path / "ds")
    prepare_data.run(["--tokenizer", str(bpe_dir), "--data", "docs.jsonl", "--out", "ds"])
    assert "already complete" in capsys.readouterr().out
    for other in (["--shard_size", 123], ["-n", 100], ["--tokenizer", "char"]):
        assert "made with other arguments" in refused("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds", *other)
    assert files_of(tmp_path / "ds") == before
    # the same ranks (their sha256 decides), but another <|endoftext|> id: the shards' ids would be wrong
    other_eot = shutil.copytree(bpe_dir, tmp_path / "other_eot")
    info = json.loads((other_eot / "tokenizer.json").read_text())
    info.update(special_tokens={EOT: 301}, vocab_size=302)
    (other_eot / "tokenizer.json").write_text(json.dumps(info))
    assert "with other arguments (vocab_size: 301, now 302)" in refused(
        "--tokenizer", other_eot, "--data", "docs.jsonl", "--out", "ds")
    assert files_of(tmp_path / "ds") == before
    # the same ranks, another split pattern: a killed run's shards and its rerun's would be cut by two patterns
    other_pattern = shutil.copytree(bpe_dir, tmp_path / "other_pattern")
    info = json.loads((bpe_dir / "tokenizer.json").read_text())
    (other_pattern / "tokenizer.json").write_text(json.dumps(dict(info, pattern=r"\S+|\s+")))
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    progress = json.dumps(dict(meta, resume={"document": 10, "offset": 0}))  # as a killed run's
    (tmp_path / "ds" / "meta.json").rename(tmp_path / "ds" / "progress.json")
    (tmp_path / "ds" / "progress.json").write_text(progress)
    assert "with other arguments (tokenizer's pattern: " in refused(
        "--tokenizer", other_pattern, "--data", "docs.jsonl", "--out", "ds")
    assert (tmp_path / "ds" / "progress.json").read_text() == progress
    (tmp_path / "ds" / "progress.json").write_bytes(before["meta.json"])
    (tmp_path / "ds" / "progress.json").rename(tmp_path / "ds" / "meta.json")
    # a dataset of the prepare_data.py before the tokenizer's pattern was in meta.json: said so, not "other arguments"
    older = {key: value for key, value in meta["tokenizer"].items() if key not in ("pattern", "special_tokens")}
    older_args = dict(meta["args"], tokenizer=older)
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(dict(meta, tokenizer=older, args=older_args)))
    assert "ds: made with an older prepare_data.py; use another --out, or delete" in refused(
        "--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds")
    (tmp_path / "ds" / "meta.json").write_bytes(before["meta.json"])
    (tmp_path / "ds" / "meta.json").rename(tmp_path / "ds" / "progress.json")  # as an older run's: no "resume"
    assert "progress.json is unreadable" in refused("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds")
    (tmp_path / "ds" / "progress.json").rename(tmp_path / "ds" / "meta.json")
    (tmp_path / "ds" / "meta.json").write_text("{")
    assert "meta.json is unreadable" in refused("--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds")



def test_a_progress_json_of_wrong_types_is_one_line(tmp_path, docs, bpe_dir, monkeypatch):
    """A hand-edited or corrupted progress.json (a string for a number, a list for a dict, a number for a shard's
    name or a character) is refused as unreadable, in one line, as one that is not JSON."""
    write_jsonl(tmp_path / "docs.jsonl", docs[:50])
    monkeypatch.chdir(tmp_path)
    for tokenizer, out in ((bpe_dir, "ds"), ("char", "ds_char")):
        prepare_data.run(["--tokenizer", str(tokenizer), "--data", "docs.jsonl", "--out", out])
        meta = json.loads((tmp_path / out / "meta.json").read_text())
        (tmp_path / out / "meta.json").unlink()
        good = dict(meta, resume={"document": 10, "offset": 0})
        cases = [{"resume": {"document": "10", "offset": 0}}, {"resume": {"document": 10, "offset": None}},
                 {"resume": {"document": -1, "offset": 0}}, {"resume": [10, 0]},
                 {"tokens": dict(meta["tokens"], val=str(meta["tokens"]["val"]))}, {"max_token_id": "300"},
                 {"num_chars": [1]}, {"shards": dict(meta["shards"], val=[7])}]
        if tokenizer == "char":
            cases += [{"chars": [*meta["chars"][:-1], 65]}, {"chars": ["ab", *meta["chars"][1:]]}]
        for case in cases:
            (tmp_path / out / "progress.json").write_text(json.dumps(dict(good, **case)))
            assert f"{out}: progress.json is unreadable; delete {out}" in refused(
                "--tokenizer", tokenizer, "--data", "docs.jsonl", "--out", out), case

META_JSON = "str(path).endswith('meta.json')"
FIRST_SHARD = "str(path).endswith('progress.json') and obj['shards']['val'] + obj['shards']['train']"


@pytest.mark.parametrize("extra, dies_at", [([], META_JSON), (["--max_tokens", 4321], META_JSON),
                                            (["-n", 6000], META_JSON), (["--tokenizer", "char"], META_JSON),
                                            (["--data", "one_document.txt"], META_JSON), ([], FIRST_SHARD),
                                            (["--tokenizer", "char"], FIRST_SHARD)])
def test_resume_when_killed_just_before_meta_json(tmp_path, docs, bpe_dir, extra, dies_at):
    """The narrowest windows: every shard finished, meta.json not yet written; or the first shard renamed, its
    progress not yet saved. The process dies there for certain (os._exit, as abrupt as SIGKILL, in place of the
    write); the next run must resume and end with the same files."""
    write_jsonl(tmp_path / "docs.jsonl", docs)
    (tmp_path / "one_document.txt").write_text("".join(docs), encoding="utf-8")
    args = ["--tokenizer", bpe_dir, "--data", "docs.jsonl", "--shard_size", 900, "--val_tokens", 800, *extra]
    prepare(*args, "--out", "reference", cwd=tmp_path)
    died = run_dying_at(dies_at, *args, "--out", "killed", cwd=tmp_path)
    assert died.returncode == 9 and not (tmp_path / "killed" / "meta.json").exists(), died.stderr
    assert "resuming" in prepare(*args, "--out", "killed", cwd=tmp_path).stdout
    assert files_of(tmp_path / "killed") == files_of(tmp_path / "reference")


def run_dying_at(dies_at, *args, cwd, after_the_write=False):
    """prepare_data.py, dying for certain (os._exit, as abrupt as SIGKILL) in place of, or just after, the first
    write_json(path, obj) for which the expression dies_at is true."""
    die = "        os._exit(9)\n"
    script = (
        "import os, runpy, sys\n"
        f"script = runpy.run_path({str(SCRIPT)!r}, run_name='prepare_data')\n"
        "namespace = script['run'].__globals__  # the functions' own globals (run_path returns a copy)\n"
        "write_json = namespace['write_json']\n"
        "def dying_write_json(path, obj):\n"
        f"    if not {after_the_write} and {dies_at}:\n" + die +
        "    write_json(path, obj)\n"
        f"    if {after_the_write} and {dies_at}:\n" + die +
        "namespace['write_json'] = dying_write_json\n"
        "script['run'](sys.argv[1:])\n")
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_a_run_killed_just_after_meta_json_leaves_no_progress_json_on_rerun(tmp_path, docs, bpe_dir):
    """meta.json written, progress.json and *.tmp not yet deleted: the rerun finds the dataset complete, removes
    the leftovers, and ends with the files of a run never killed."""
    write_jsonl(tmp_path / "docs.jsonl", docs)
    args = ["--tokenizer", bpe_dir, "--data", "docs.jsonl", "--shard_size", 900, "--val_tokens", 800]
    prepare(*args, "--out", "reference", cwd=tmp_path)
    died = run_dying_at(META_JSON, *args, "--out", "killed", cwd=tmp_path, after_the_write=True)
    assert died.returncode == 9 and (tmp_path / "killed" / "progress.json").exists(), died.stderr
    (tmp_path / "killed" / "train_000000.npy.tmp").write_bytes(b"")  # as a shard an earlier killed run began
    assert "already complete" in prepare(*args, "--out", "killed", cwd=tmp_path).stdout
    assert files_of(tmp_path / "killed") == files_of(tmp_path / "reference")


def test_invalid_utf8_is_replaced_with_a_warning(tmp_path, bpe_dir):
    (tmp_path / "bad.txt").write_bytes(b"caf\xc3\xa9 ok, then bad bytes: \xff\xfe and \xc3 end")
    result = prepare("--tokenizer", bpe_dir, "--data", "bad.txt", "--out", "ds", cwd=tmp_path)
    assert "warning: 3 invalid UTF-8 sequences were replaced" in result.stderr
    # char level reads the source twice (the vocabulary first): still 3
    result = prepare("--tokenizer", "char", "--data", "bad.txt", "--out", "ds_char", cwd=tmp_path)
    assert "warning: 3 invalid UTF-8 sequences were replaced" in result.stderr, result.stderr
    meta, val, train = read_dataset(tmp_path / "ds")
    text = load_encoding(bpe_dir).decode(np.concatenate([train, val]).tolist())
    assert text == EOT + "café ok, then bad bytes: \ufffd\ufffd and \ufffd end"


def test_a_changed_source_is_never_mixed_in(tmp_path, docs, bpe_dir, monkeypatch):
    """Resuming, or rerunning a complete dataset, over an edited source refuses in one line, files untouched."""
    write_jsonl(tmp_path / "docs.jsonl", docs[:50])
    args = ["--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds"]
    prepare(*args, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    before = files_of(tmp_path / "ds")
    write_jsonl(tmp_path / "docs.jsonl", docs[:60])  # edited: other size and time
    assert "other source files" in refused(*args)
    assert files_of(tmp_path / "ds") == before
    # mid-run: a killed run leaves progress.json, which carries the same arguments, in place of meta.json
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    (tmp_path / "ds" / "meta.json").rename(tmp_path / "ds" / "progress.json")
    (tmp_path / "ds" / "progress.json").write_text(json.dumps(dict(meta, resume={"document": 10, "offset": 0})))
    before = files_of(tmp_path / "ds")
    assert "other source files" in refused(*args)
    assert files_of(tmp_path / "ds") == before


def test_the_offline_corpus_resumes_only_under_the_same_python(tmp_path, bpe_dir, monkeypatch, capsys):
    """The offline corpus is the running Python's stdlib, which differs between versions: a run stopped (Ctrl-C once
    a shard is saved) is refused when its progress.json records another version, as a run under an older Python
    records it, and resumes under the same one to a stopless run's files."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--tokenizer", str(bpe_dir), "-n", "30000", "--shard_size", "2000", "--val_tokens", "2000"]
    prepare_data.run([*args, "--out", "reference"])
    write_json = prepare_data.write_json

    def write_json_then_stop(path, obj):
        write_json(path, obj)
        if path.name == "progress.json" and obj["shards"]["val"]:
            raise KeyboardInterrupt
    monkeypatch.setattr(prepare_data, "write_json", write_json_then_stop)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.run([*args, "--out", "ds"])
    monkeypatch.setattr(prepare_data, "write_json", write_json)
    progress_path = tmp_path / "ds" / "progress.json"
    progress = progress_path.read_text()
    version = platform.python_version()
    assert f"Python {version} stdlib" in json.loads(progress)["args"]["source"]
    progress_path.write_text(progress.replace(f"Python {version} ", "Python 3.9.18 "))
    message = refused(*args, "--out", "ds")
    assert "ds: made with other arguments (source: 'Python 3.9.18 stdlib" in message
    progress_path.write_text(progress)
    prepare_data.run([*args, "--out", "ds"])
    assert "resuming ds" in capsys.readouterr().out
    assert files_of(tmp_path / "ds") == files_of(tmp_path / "reference")


def test_a_deleted_or_cut_shard_is_found_on_rerun(tmp_path, docs, bpe_dir, monkeypatch):
    """train.py says "run prepare_data.py again" for a missing shard: that run must not answer "nothing to do"."""
    write_jsonl(tmp_path / "docs.jsonl", docs)
    args = ["--tokenizer", bpe_dir, "--data", "docs.jsonl", "--out", "ds", "--shard_size", 900, "--val_tokens", 800]
    prepare(*args, cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert len(meta["shards"]["train"]) > 2
    shard = tmp_path / "ds" / meta["shards"]["train"][1]
    shard.write_bytes(shard.read_bytes()[:-2])  # cut
    assert f"the shard {shard.name} is missing or damaged; delete ds" in refused(*args)
    shard.write_bytes(b"")  # emptied: np.load raises EOFError
    assert f"the shard {shard.name} is missing or damaged" in refused(*args)
    shard.unlink()
    assert f"the shard {shard.name} is missing or damaged" in refused(*args)
    os.mkfifo(shard)  # a named pipe: np.load would wait on it forever
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a read hung"))
    signal.alarm(20)
    try:
        assert f"the shard {shard.name} is missing or damaged" in refused(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    # the advice works: delete the directory, run again, and the dataset is whole
    shutil.rmtree(tmp_path / "ds")
    prepare(*args, cwd=tmp_path)
    assert read_dataset(tmp_path / "ds")[0]["shards"] == meta["shards"]
    # train.py's advice for a dataset that lacks its tokenizer files works too: the rerun puts them back
    (tmp_path / "ds" / "tokenizer.tiktoken").unlink()
    assert "already complete" in prepare(*args, cwd=tmp_path).stdout
    assert (tmp_path / "ds" / "tokenizer.tiktoken").read_bytes() == (bpe_dir / "tokenizer.tiktoken").read_bytes()


# ---------------------------------------------------------------- one writer per --out; nothing dropped silently


def test_two_runs_into_one_out_at_once(tmp_path, corpus, bpe_dir):
    """Two runs of different sources into one --out, started together: one writes what a lone run writes,
    byte for byte; the other refuses in one line that names the directory."""
    sources = {"udhr": corpus("udhr.jsonl"), "enwiki": corpus("enwiki.jsonl")}
    # about a second of work each, on one thread: the two runs overlap however late the second one starts
    common = ["--tokenizer", bpe_dir, "-n", 6_000_000, "--workers", 1, "--shard_size", 1_000_000]
    runs = {name: subprocess.Popen([sys.executable, str(SCRIPT), "--data", path, *map(str, common), "--out", "ds"],
                                   cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, path in sources.items()}
    outputs = {name: process.communicate(timeout=300) for name, process in runs.items()}
    results = {name: subprocess.CompletedProcess(runs[name].args, runs[name].returncode, *output)
               for name, output in outputs.items()}
    assert sorted(result.returncode for result in results.values()) == [0, 1], results
    winner = next(name for name, result in results.items() if result.returncode == 0)
    loser = next(name for name in results if name != winner)
    assert_one_error_line(results[loser], "ds: another run is writing there")
    prepare("--data", sources[winner], *common, "--out", "alone", cwd=tmp_path)
    assert files_of(tmp_path / "ds") == files_of(tmp_path / "alone")


def test_characters_the_split_pattern_leaves_unmatched_are_counted(tmp_path, corpus):
    """tiktoken drops what the split pattern does not match (\\w+ here: spaces, punctuation): one warning says
    how many bytes, counted here independently with `regex` on real multilingual text."""
    words = write_bpe_dir(tmp_path / "words", {bytes([b]): b for b in range(256)}, r"\w+")
    result = prepare("--tokenizer", words, "--data", corpus("udhr.jsonl"), "-n", 100_000, "--val_tokens", 10_000,
                     "--out", "ds", cwd=tmp_path)
    meta, val, train = read_dataset(tmp_path / "ds")
    documents, budget = [], 100_000
    with open(corpus("udhr.jsonl"), encoding="utf-8") as f:
        while budget:
            documents.append(json.loads(next(f))["text"][:budget])
            budget -= len(documents[-1])
    kept = sum(len(match.encode()) for doc in documents for match in regex.findall(r"\w+", doc))
    read = sum(len(doc.encode()) for doc in documents)
    assert 0 < kept < read and len(np.concatenate([val, train])) == kept + len(documents)  # + the EOTs
    message = (f"warning: the split pattern matched {kept:,} of {read:,} bytes; "
               f"the other {1 - kept / read:.1%} are not in the shards (tiktoken drops them)")
    assert [line for line in result.stderr.splitlines() if line.startswith("warning")] == [message]


# ---------------------------------------------------------------- --part K/N and --merge N: equal to one run


@pytest.fixture(scope="module")
def parts_source(tmp_path_factory, bpe_dir, corpus):
    """Real text in all three kinds (a .jsonl, a .parquet of many row groups, a .txt), so that parts cut inside
    files by lines and by row groups; and one run's dataset on it, the reference."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    corpora = corpus("enwiki.jsonl").parent
    root = tmp_path_factory.mktemp("parts")
    source = root / "source"
    source.mkdir()
    with open(corpora / "enwiki.jsonl", "rb") as f:  # whole lines, about 3 MB
        (source / "a.jsonl").write_bytes(b"".join(f.readline() for _ in range(1500)))
    with open(corpora / "udhr.jsonl", encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(300)]
    pq.write_table(pa.table({"text": texts}), source / "b.parquet", row_group_size=20)
    (source / "c.txt").write_bytes((corpora / "tinyshakespeare.txt").read_bytes()[:200_000])
    common = ["--tokenizer", bpe_dir, "--data", source, "--shard_size", 50_000, "--val_tokens", 150_000,
              "--workers", 1]
    prepare(*common, "--out", "one", cwd=root)
    return root, common


def merged_equals_one_run(root, out_dir):
    meta, val, train = read_dataset(root / out_dir)
    one_meta, one_val, one_train = read_dataset(root / "one")
    assert np.array_equal(val, one_val) and np.array_equal(train, one_train)
    assert len(one_meta["shards"]["val"]) > 1 and len(meta["shards"]["train"]) > 10  # val: several documents
    assert (meta["tokens"], meta["vocab_size"], meta["max_token_id"], meta["num_chars"]) == (
        one_meta["tokens"], one_meta["vocab_size"], one_meta["max_token_id"], one_meta["num_chars"])
    assert (root / out_dir / "tokenizer.tiktoken").exists() and not list((root / out_dir).glob("*.tmp"))
    names = meta["shards"]["val"] + meta["shards"]["train"]  # train.py takes plain file names only
    assert all(name == Path(name).name and (root / out_dir / name).is_file() for name in names)


def test_parts_in_any_order_or_at_once_merge_to_one_runs_ids(parts_source):
    """N = 2 in reverse order with --part, N = 3 all at once from SLURM's array variables (an array 1-3), N = 5
    in a shuffled order: each merged dataset's val and train ids are one run's; train.py's checks accept it."""
    root, common = parts_source
    for count, order in [(2, [1, 0]), (5, [3, 0, 4, 2, 1])]:
        for k in order:
            prepare(*common, "--out", f"n{count}", "--part", f"{k}/{count}", cwd=root)
        assert f"merged {count} parts" in prepare(*common, "--out", f"n{count}", "--merge", count, cwd=root).stdout
        merged_equals_one_run(root, f"n{count}")
    tasks = [subprocess.Popen([sys.executable, str(SCRIPT), *map(str, common), "--out", "n3"], cwd=root,
                              env={**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": "1",
                                   "SLURM_ARRAY_TASK_COUNT": "3"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for task in (3, 1, 2)]
    assert all(task.wait(timeout=300) == 0 for task in tasks)
    assert sorted(path.name for path in (root / "n3").iterdir()) == ["part-0-of-3", "part-1-of-3", "part-2-of-3"]
    prepare(*common, "--out", "n3", "--merge", 3, cwd=root, env={"SLURM_ARRAY_TASK_ID": "1"})  # ignored there
    merged_equals_one_run(root, "n3")
    # merging again changes nothing; train.py's start-up (the checks on meta.json and each shard) accepts it
    def top_level():
        return {path.name: (path.read_bytes(), path.suffix == ".npy" and path.stat().st_ino)
                for path in (root / "n3").glob("*.*")}
    before = top_level()
    prepare(*common, "--out", "n3", "--merge", 3, cwd=root)
    assert top_level() == before
    # train.py's start-up (meta.json, each shard's size) accepts it, though a part's last train shard is short
    train_names = read_dataset(root / "n3")[0]["shards"]["train"]
    assert min(len(np.load(root / "n3" / name, mmap_mode="r")) for name in train_names[:-1]) < 50_000
    command = [sys.executable, str(REPO / "train.py"), f"--dataset={root / 'n3'}", f"--out_dir={root / 'n3_out'}",
               "--device=cpu", "--max_iters=0"]
    result = SCRIPT_RUNNER.run([command], cwd=root)[0]
    assert result.returncode == 0 and "nothing to train" in result.stdout, result.stderr


def test_parts_in_which_no_document_starts_are_empty_and_merge_to_one_runs_ids(tmp_path, bpe_dir, corpus,
                                                                                  monkeypatch, capsys):
    # A .txt file is one document, read whole by the part its first byte falls in: of 4 parts over two files,
    # parts 1 and 3 start none. Val (a.txt) outweighs train (b.txt): the merge warns as one run does, and no
    # part does (part 0 holds val, and little or no train, whatever the whole holds).
    text = corpus("tinyshakespeare.txt").read_text()
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "a.txt").write_text(text[:20_000])
    (tmp_path / "source" / "b.txt").write_text(text[20_000:30_000])
    monkeypatch.chdir(tmp_path)
    common = ["--tokenizer", str(bpe_dir), "--data", "source", "--shard_size", "3000", "--val_tokens", "10"]
    for k in range(4):
        prepare_data.run([*common, "--out", "parts", "--part", f"{k}/4"])
        assert "val holds" not in capsys.readouterr().err
    prepare_data.run([*common, "--out", "parts", "--merge", "4"])
    merge_warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    prepare_data.run([*common, "--out", "one"])
    one_warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(merge_warnings) == 1 and "val holds" in merge_warnings[0] and merge_warnings == one_warnings
    empty_part = json.loads((tmp_path / "parts" / "part-1-of-4" / "meta.json").read_text())
    assert empty_part["tokens"] == {"val": 0, "train": 0}
    meta, val, train = read_dataset(tmp_path / "parts")
    one_meta, one_val, one_train = read_dataset(tmp_path / "one")
    assert np.array_equal(val, one_val) and np.array_equal(train, one_train) and meta["tokens"] == one_meta["tokens"]


def test_parts_that_cannot_equal_one_run_are_refused_in_one_line(tmp_path, bpe_dir, corpus, monkeypatch, capsys):
    """A lone .txt falls whole in part 0, which can't know it holds the last document: all of it goes to val,
    where one run gives train 90%. The merge refuses rather than write a dataset with no train. And a part 0 in
    which no document starts (its lines' texts empty) is not called an empty dataset: it holds too little val."""
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / "a.txt").write_text(corpus("tinyshakespeare.txt").read_text()[:3000])
    monkeypatch.chdir(tmp_path)
    common = ["--tokenizer", str(bpe_dir), "--data", "lone", "--val_tokens", "10"]
    for k in range(2):
        prepare_data.run([*common, "--out", "parts", "--part", f"{k}/2"])
    assert "--merge 2: part 0 holds all documents, in val" in refused(*common, "--out", "parts", "--merge", 2)
    assert not (tmp_path / "parts" / "meta.json").exists()
    prepare_data.run([*common, "--out", "one"])  # one run: 90% train
    assert read_dataset(tmp_path / "one")[0]["tokens"]["train"] > 0
    write_jsonl(tmp_path / "late.jsonl", [""] * 500 + ["some text to tokenize"] * 50)
    assert "part 0 holds fewer tokens than --val_tokens" in refused(
        "--tokenizer", bpe_dir, "--data", "late.jsonl", "--out", "late", "--part", "0/4")
    capsys.readouterr()


def test_a_merge_of_fewer_shards_leaves_only_its_own(tmp_path, docs, bpe_dir, monkeypatch, capsys):
    """Merged again after the source shrank (its parts deleted and run again), --out holds the shards meta.json
    names and no stale link of the earlier merge (which would hold the deleted parts' disk, and feed a reader that
    globs train_*.npy); files that are not named as shards are left alone."""
    (tmp_path / "source").mkdir()
    write_jsonl(tmp_path / "source" / "a.jsonl", docs)
    monkeypatch.chdir(tmp_path)
    common = ["--tokenizer", str(bpe_dir), "--data", "source", "--shard_size", "500", "--val_tokens", "500"]
    shard_counts = []
    for source_docs in (docs, docs[:150]):
        write_jsonl(tmp_path / "source" / "a.jsonl", source_docs)
        for k in range(2):
            shutil.rmtree(tmp_path / "merged" / f"part-{k}-of-2", ignore_errors=True)
            prepare_data.run([*common, "--out", "merged", "--part", f"{k}/2"])
        for name in ("train_000999.npy.old", "train_old.npy", "val_00001.npy", "notes.txt"):  # not shard names
            (tmp_path / "merged" / name).write_text("keep me")
        prepare_data.run([*common, "--out", "merged", "--merge", "2"])
        meta = read_dataset(tmp_path / "merged")[0]
        shard_counts.append(len(meta["shards"]["train"]))
    capsys.readouterr()
    assert shard_counts[1] < shard_counts[0]
    shards = sorted(path.name for path in (tmp_path / "merged").glob("*_*.npy"))
    assert shards == sorted(meta["shards"]["val"] + meta["shards"]["train"] + ["train_old.npy", "val_00001.npy"])
    assert (tmp_path / "merged" / "train_000999.npy.old").exists() and (tmp_path / "merged" / "notes.txt").exists()


def test_a_part_stopped_by_sigterm_says_so_and_resumes_to_one_runs_ids(parts_source):
    """SIGTERM (scancel, SLURM's time limit) mid-part: one line saying so, exit 143, progress kept; rerun, the part
    resumes, and the merge still equals one run."""
    root, common = parts_source
    args = [sys.executable, str(SCRIPT), *map(str, common), "--out", "killed", "--part", "1/2"]
    process = subprocess.Popen(args, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress_path, deadline = root / "killed" / "part-1-of-2" / "progress.json", time.time() + 120
    while time.time() < deadline and process.poll() is None:
        try:
            if json.loads(progress_path.read_text())["shards"]["train"]:
                break
        except (OSError, ValueError):
            time.sleep(0.002)
    assert process.poll() is None, "the part ended before it could be stopped: give it more data"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == ("stopped by SIGTERM: run the same command again to resume; "
                                               "finished shards are kept")
    assert progress_path.exists() and not (progress_path.parent / "meta.json").exists()
    assert "resuming" in prepare(*common, "--out", "killed", "--part", "1/2", cwd=root).stdout
    prepare(*common, "--out", "killed", "--part", "0/2", cwd=root)
    prepare(*common, "--out", "killed", "--merge", 2, cwd=root)
    merged_equals_one_run(root, "killed")


def test_part_and_merge_mistakes_are_one_line_each(parts_source, monkeypatch, tmp_path):
    """A missing part, an unfinished one, one made with other settings, a bad K/N, a Hub source, settings a part
    can't honour, val too big for part 0: each refused in one line naming it."""
    root, common = parts_source
    monkeypatch.chdir(root)
    assert "--part 2/2: must be K/N" in refused(*common, "--part", "2/2")
    assert "--part x: must be K/N" in refused(*common, "--part", "x")
    # --part 0/1 is a whole run, written into --out: there is no part-0-of-1 to merge
    assert "--merge 1: one part is the whole run, already in --out; drop --merge" in refused(*common, "--merge", 1)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")  # a task of an array 1-3? no such part
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert "--part 3/3: must be K/N" in refused(*common)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    assert "no --max_tokens" in refused(*common, "--part", "0/2", "--max_tokens", 1000)
    assert "no --max_tokens, -n, nor char level" in refused(*common[2:], "--tokenizer", "char", "--part", "0/2")
    assert "download fineweb's files" in refused(*common[:2], "--data", "fineweb", "--part", "0/2")
    # the Hub off: a Hub dataset named is refused, the default source falls back to the offline corpus
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "Hub is off (HF_HUB_OFFLINE=1), needed for --data openwebtext" in refused(
        *common[:2], "--data", "openwebtext")
    assert prepare_data.open_source("fineweb", False, (0, 1))[1:] == (
        "stdlib", f"Python {platform.python_version()} stdlib (offline fallback)")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    # part 0 of 40 holds less than val_tokens: val would go on into part 1, which can't know it
    assert "part 0 holds fewer tokens than --val_tokens" in refused(*common, "--part", "0/40", "--out", "n40")
    # parts: one finished, one with other settings, one unfinished (its progress.json), one never run
    prepare(*common, "--out", "mixed", "--part", "0/4", cwd=root)
    prepare(*common[:-4], "--val_tokens", 140_000, "--workers", 1, "--out", "mixed", "--part", "1/4", cwd=root)
    (root / "mixed" / "part-2-of-4").mkdir()
    shutil.copy(root / "mixed" / "part-0-of-4" / "meta.json", root / "mixed" / "part-2-of-4" / "progress.json")
    message = refused(*common, "--out", "mixed", "--merge", 4)
    assert "--merge 4: part-2-of-4, part-3-of-4 missing or unfinished" in message
    for k in (2, 3):
        shutil.rmtree(root / "mixed" / f"part-{k}-of-4", ignore_errors=True)
        prepare(*common, "--out", "mixed", "--part", f"{k}/4", cwd=root)
    message = refused(*common, "--out", "mixed", "--merge", 4)
    assert "mixed/part-1-of-4: made with other arguments (val_tokens: 140000, now 150000)" in message
    assert not (root / "mixed" / "meta.json").exists()


# ---------------------------------------------------------------- every value and file read is checked first


def test_invalid_utf8_in_a_command_line_value_is_one_line(tmp_path, bpe_dir):
    """A path with invalid UTF-8 (Python reads it as lone surrogates) can't go into meta.json: refused at once."""
    bad_name = b"docs\xff.jsonl"
    write_jsonl(tmp_path / os.fsdecode(bad_name), ["some text", "more text"])
    result = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer", str(bpe_dir), "--data", bad_name,
                             "--out", "ds"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert_one_error_line(result, "--data 'docs\\udcff.jsonl': not valid UTF-8")
    assert not (tmp_path / "ds").exists()


def test_files_read_whole_are_read_bounded(tmp_path, bpe_dir, monkeypatch):
    """A tokenizer file or a progress.json that is a named pipe (which a plain open() waits on forever) or a file
    over 64 MB: one line each, at once."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a read hung"))
    signal.alarm(20)
    try:
        piped = shutil.copytree(bpe_dir, tmp_path / "piped")
        (piped / "tokenizer.json").unlink()
        os.mkfifo(piped / "tokenizer.json")
        assert "tokenizer.json: not a regular file of at most 67,108,864 bytes" in refused("--tokenizer", piped,
                                                                                 "--data", "a.txt")
        (tmp_path / "ds").mkdir()
        os.mkfifo(tmp_path / "ds" / "progress.json")
        assert "progress.json: not a regular file" in refused("--tokenizer", bpe_dir, "--data", "a.txt",
                                                                "--out", "ds")
        os.unlink(tmp_path / "ds" / "progress.json")
        with open(tmp_path / "ds" / "meta.json", "wb") as f:
            f.truncate(65 << 20)  # sparse: no disk
        assert "meta.json: not a regular file of at most 67,108,864 bytes" in refused("--tokenizer", bpe_dir, "--data",
                                                                             "a.txt", "--out", "ds")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
