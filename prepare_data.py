"""
Turn text into token shards for train.py: fast, in flat memory, and resumable.

    python prepare_data.py --tokenizer tokenizers/stdlib_v1000
    python prepare_data.py --tokenizer gpt2 --data fineweb-edu --max_tokens 1000000000
    python prepare_data.py --tokenizer char --data ../shared/corpora/tinyshakespeare.txt

It writes DIR/val_000000.npy, ..., DIR/train_000000.npy, ... and, last, DIR/meta.json (default DIR:
data/<source>_<tokenizer>/). Each shard is a 1-D numpy .npy array (uint16 when every id fits, else
uint32) that train.py memory-maps. Every document is preceded by <|endoftext|>, and documents run
across shard boundaries. The README describes the format.

--tokenizer takes one of three kinds:
- a directory written by train_bpe_*.py (tokenizer.tiktoken + tokenizer.json), copied into DIR;
- a tiktoken name (gpt2, cl100k_base, o200k_base), which tiktoken downloads once and caches;
- char: one id per distinct character of the data, in sorted order (nanoGPT's shakespeare_char). That
  vocabulary must be known before the first id is written, so the data is read twice: once for the
  characters, once to encode. There is no <|endoftext|> at this level.

The validation split is the first documents of the stream, until it holds --val_tokens tokens (at
least one document; the last document always goes to train). A source that is one single document
(a .txt file) gives its last 10% of tokens to val instead, as nanoGPT does for Shakespeare.

Killed at any moment (Ctrl-C, kill -9, a full disk) and started again with the same arguments, it skips
the finished shards and ends with files identical to an uninterrupted run. It
refuses to mix in a changed source (local files: their paths, sizes and times) and checks the shards it
finished before; a missing or cut one is reported with how to rebuild.
"""

import argparse
import base64
import codecs
import hashlib
import itertools
import json
import os
import shutil
import socket
import struct
import sys
import sysconfig
import time
import urllib.parse
from collections import deque, namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

# -----------------------------------------------------------------------------
# defaults, each overridable from the command line
data = "fineweb"  # fineweb | fineweb-edu | openwebtext | tinystories | a .txt/.jsonl/.parquet file | a directory
tokenizer = None  # a BPE directory | a tiktoken name | char (required)
out = None  # output directory; default data/<source>_<tokenizer name>
num_chars = None  # read only the first N characters of the stream (default: all of it)
max_tokens = None  # stop after N tokens, train + val (default: no limit)
shard_size = 100_000_000  # tokens per shard: 200 MB of uint16, as in build-nanogpt
val_tokens = 1_000_000  # the validation split: the first documents, until they hold this many tokens
workers = os.cpu_count()  # tokenizer threads
batch_chars = 1 << 20  # characters per batch handed to a thread: big enough to amortize, small for memory
EOT = "<|endoftext|>"
# The Hub datasets: (repository, config, parquet files). `datasets` 4+ no longer runs loading scripts, and
# OpenWebText's repository may still carry its old script beside the parquet shards it was re-uploaded as:
# naming the shards themselves (hf://...) reads them with the plain parquet reader, never the script.
HUB_DATASETS = {
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None),
    "openwebtext": ("Skylion007/openwebtext", None, "data/train-*.parquet"),
    "tinystories": ("roneneldan/TinyStories", None, None),
}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- step 1: the tokenizer

Tokenizer = namedtuple("Tokenizer", "kind encoder vocab_size eot meta name")


def load_tokenizer(name):
    """--tokenizer: a directory from train_bpe_*.py, a tiktoken name, or char (its vocabulary comes later,
    from the data). `meta` goes into meta.json; `name` into the default output directory."""
    if name == "char":
        return Tokenizer("char", None, None, None, {"kind": "char"}, "char")
    if os.sep in name or name.startswith(".") or Path(name).exists():
        if not Path(name).is_dir():
            raise UserError(f"--tokenizer {name}: no such directory; give a directory written by "
                            "train_bpe_cpu.py, a tiktoken name (gpt2, cl100k_base, o200k_base) or char")
        encoder, eot = load_bpe_dir(name)
        sha256 = hashlib.sha256(Path(name, "tokenizer.tiktoken").read_bytes()).hexdigest()
        return Tokenizer("bpe", encoder, encoder.n_vocab, eot, {"kind": "bpe", "path": name, "sha256": sha256},
                         Path(name).resolve().name)
    import tiktoken

    known = tiktoken.list_encoding_names()
    if name not in known:
        raise UserError(f"--tokenizer {name}: not a directory, not char, and not a tiktoken encoding "
                        f"({', '.join(known)}); check the spelling or the path")
    try:  # the first use downloads the ranks (a few MB) and caches them
        encoder = tiktoken.get_encoding(name)
    except Exception as error:  # requests' connection errors and friends: the download failed
        raise UserError(f"--tokenizer {name}: tiktoken could not download its ranks ({type(error).__name__}); this "
                        "needs internet once (then it is cached), or use a BPE directory from train_bpe_cpu.py")
    return Tokenizer("tiktoken", encoder, encoder.n_vocab, encoder.eot_token, {"kind": "tiktoken", "name": name}, name)


def load_bpe_dir(directory):
    """A directory from train_bpe_*.py -> (tiktoken.Encoding, eot id). Any broken file is one line."""
    import regex
    import tiktoken

    for file in ("tokenizer.tiktoken", "tokenizer.json"):
        if not Path(directory, file).is_file():
            raise UserError(f"--tokenizer {directory}: {file} is missing; give a directory written by "
                            "train_bpe_cpu.py, a tiktoken name (gpt2, cl100k_base, o200k_base) or char")
    try:
        info = json.loads(Path(directory, "tokenizer.json").read_text())
        with open(Path(directory, "tokenizer.tiktoken"), "rb") as f:
            ranks = {base64.b64decode(token, validate=True): int(rank)
                     for token, rank in (line.split() for line in f if line.strip())}
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError("ranks are not 0..V-1, each once")
        if regex.compile(info["pattern"]).fullmatch(""):  # tiktoken would panic on its empty chunks
            raise ValueError(f"its pattern {info['pattern']!r} matches the empty string")
        encoder = tiktoken.Encoding(name=str(directory), pat_str=info["pattern"], mergeable_ranks=ranks,
                                    special_tokens=info["special_tokens"])
        if info.get("vocab_size", encoder.n_vocab) != encoder.n_vocab:
            raise ValueError(f"vocab_size {info['vocab_size']} but the files hold {encoder.n_vocab} ids")
        return encoder, info["special_tokens"][EOT]
    except Exception as error:  # any broken file: say which directory, and why, in one line
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"--tokenizer {directory} is broken ({reason}); re-run train_bpe_cpu.py to rewrite it")


# ---------------------------------------------------------------- step 2: encoding, in parallel threads
#
# tiktoken's Rust core releases the GIL while it encodes, so threads run on every core without the cost of
# a process pool (pickling every document to a worker and every token array back). encode_to_numpy hands
# back the Rust buffer as a numpy array, so no Python list of ints is ever built. bench/bench_prepare_data.py
# measured both on enwiki (2 cores): threads + encode_to_numpy spent 9-15% less CPU per token than
# encode_ordinary_batch itself, and a process pool 8% more.


def encode_batch(texts, tok, char_codes, dtype):
    """Encode documents -> (all tokens, one array, EOT before each document; per-document lengths)."""
    pieces, lengths = [], []
    for text in texts:
        if char_codes is not None:  # char level: each code point's rank among the vocabulary's
            codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
            ids = np.searchsorted(char_codes, codes)
            if len(codes) and (ids.max() >= len(char_codes) or not np.array_equal(char_codes[ids], codes)):
                raise UserError("the data changed between the two passes (a character is missing from the "
                                "vocabulary); run again on data that does not change")
            pieces.append(ids)
        else:
            # allowed_special=set() and disallowed_special=() make this encode_ordinary: "<|endoftext|>"
            # written in a document is plain text, never the special token.
            pieces.append(np.array([tok.eot], dtype=np.uint32))
            pieces.append(tok.encoder.encode_to_numpy(text, allowed_special=set(), disallowed_special=()))
        lengths.append(len(pieces[-1]) + (char_codes is None))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)
    # Never overflow silently: every id must fit the vocabulary, and the vocabulary the dtype.
    vocab_size = len(char_codes) if char_codes is not None else tok.vocab_size
    assert len(tokens) == 0 or int(tokens.max()) < vocab_size <= np.iinfo(dtype).max + 1, "token id overflow"
    return tokens.astype(dtype), lengths


def batches(documents, start):
    """(index of its first document, texts): about batch_chars characters each, from document `start` on."""
    batch, size = [], 0
    for index, text in enumerate(documents):
        if index >= start:  # resuming: the documents before `start` are in finished shards already
            batch.append(text)
            size += len(text)
            if size >= batch_chars:
                yield index - len(batch) + 1, batch
                batch, size = [], 0
    if batch:
        yield index - len(batch) + 1, batch


def encoded_documents(documents, start, encode, pool, max_in_flight):
    """(index, tokens, num_chars) of each document from `start` on, in order. The pool encodes batches while
    this thread reads ahead, at most max_in_flight batches: memory stays flat however long the stream is."""
    in_flight = deque()
    for batch in itertools.chain(batches(documents, start), [None]):  # None: the end, collect the rest
        if batch is not None:
            first, texts = batch
            in_flight.append((first, [len(text) for text in texts], pool.submit(encode, texts)))
        while in_flight and (batch is None or len(in_flight) > max_in_flight):
            first, chars, future = in_flight.popleft()
            tokens, lengths = future.result()
            offsets = np.cumsum([0, *lengths])
            for k, count in enumerate(chars):
                yield first + k, tokens[offsets[k]:offsets[k + 1]], count


# ---------------------------------------------------------------- step 3: shards
#
# A .npy file is a short header (magic, version, a Python dict literal with dtype and shape) and then the
# raw array. We write a fixed 128-byte header slot first, stream the tokens after it as they come (no
# 200 MB buffer in memory), and fill in the true header when the shard is complete. The file is written
# under a temporary name and renamed: a shard with its final name is always whole.

NPY_HEADER_BYTES = 128


def npy_header(dtype, length):
    """The .npy version 1.0 header for a 1-D array, padded to exactly NPY_HEADER_BYTES bytes."""
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (np.dtype(dtype).str, length)
    prefix = np.lib.format.magic(1, 0)
    header = header.ljust(NPY_HEADER_BYTES - len(prefix) - 2 - 1) + "\n"
    return prefix + struct.pack("<H", len(header)) + header.encode("latin1")


class ShardWriter:
    """Appends tokens to train_000000.npy, train_000001.npy, ...; shard k holds tokens
    [k * shard_size, (k + 1) * shard_size) of its split, so the boundaries depend on nothing but the data."""

    def __init__(self, out_dir, split, dtype, shard_size, progress):
        self.out_dir, self.split, self.dtype, self.shard_size = out_dir, split, dtype, shard_size
        self.progress = progress  # the resume state; finished shards are recorded in it
        self.file, self.filled, self.max_id = None, 0, -1

    def add(self, tokens, document, offset, on_finish):
        """Append `tokens`: those of `document` from token `offset` on. on_finish(position) runs after each
        finished shard, with the (document, offset) of the first token that is not in it."""
        done = 0
        while done < len(tokens):
            if self.file is None:
                self.name = f"{self.split}_{len(self.progress['shards'][self.split]):06d}.npy"
                self.file = open(self.out_dir / (self.name + ".tmp"), "wb")
                self.file.write(b"\0" * NPY_HEADER_BYTES)
            chunk = tokens[done:done + self.shard_size - self.filled]
            self.file.write(chunk.tobytes())
            self.max_id = max(self.max_id, int(chunk.max()))
            self.filled += len(chunk)
            done += len(chunk)
            if self.filled == self.shard_size:
                self.finish((document, offset + done), on_finish)

    def finish(self, position, on_finish):
        """Close the current shard (if any), rename it into place, and record it."""
        if self.file is None:
            return
        self.file.seek(0)
        self.file.write(npy_header(self.dtype, self.filled))
        self.file.flush()
        os.fsync(self.file.fileno())  # the data is on disk before the name says the shard is whole
        self.file.close()
        os.replace(self.out_dir / (self.name + ".tmp"), self.out_dir / self.name)
        self.progress["shards"][self.split].append(self.name)
        self.progress["tokens"][self.split] += self.filled
        self.progress["max_token_id"] = max(self.progress["max_token_id"], self.max_id)
        self.file, self.filled, self.max_id = None, 0, -1
        on_finish(position)


def check_shards(out_dir, saved, shard_size):
    """The shards that meta.json or progress.json lists are all there, whole: each but a split's last holds
    shard_size tokens. A deleted or cut shard can't be rebuilt alone, so say how to rebuild it all."""
    for split in ("val", "train"):
        for k, name in enumerate(saved["shards"][split]):
            try:
                whole = Path(name).name == name and len(np.load(out_dir / name, mmap_mode="r")) == min(
                    shard_size, saved["tokens"][split] - k * shard_size)
            except (OSError, ValueError):
                whole = False
            if not whole:
                raise UserError(f"--out {out_dir}: the shard {name} is missing or damaged; delete {out_dir} and run "
                                "the same command again to rebuild it")


def write_json(path, obj):
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- step 4: val first, then train
#
# The split follows the rule of the docstring. The splitter runs one document late, so it knows which one
# is last, and keeps the counters that decide the split in the resume state: a resumed run makes the same choices.

COUNTERS = ("tokens_before", "chars_before", "documents_before", "val_count", "val_documents", "val_closed")


class Splitter:
    def __init__(self, out_dir, dtype, progress, args):
        self.writers = {split: ShardWriter(out_dir, split, dtype, args.shard_size, progress) for split in ("val", "train")}
        self.progress, self.progress_path, self.val_tokens = progress, out_dir / "progress.json", args.val_tokens
        self.resume = (progress["document"], progress["offset"])
        # Counters as they stood before the document being routed: saved with each finished shard.
        self.counters = {key: progress[key] for key in COUNTERS}

    def save(self, position):
        self.progress["document"], self.progress["offset"] = position
        self.progress.update(self.counters)
        write_json(self.progress_path, self.progress)

    def route(self, index, tokens, chars, is_last):
        """Send one document's tokens to val or train (from the resume offset, for the document resumed in)."""
        counters, val, train = self.counters, self.writers["val"], self.writers["train"]
        skip = self.resume[1] if index == self.resume[0] else 0
        if is_last and counters["documents_before"] == 0:  # one single document (tinyshakespeare)
            cut = min(len(tokens) - 1, len(tokens) * 9 // 10)
            train.add(tokens[skip:cut], index, skip, self.save)
            train.finish((index, cut), self.save)
            val.add(tokens[max(skip, cut):], index, max(skip, cut), self.save)
        elif not counters["val_closed"] and not is_last and (
                counters["val_documents"] == 0 or counters["val_count"] < self.val_tokens):
            val.add(tokens[skip:], index, skip, self.save)
            counters["val_count"] += len(tokens)
            counters["val_documents"] += 1
        else:
            if not counters["val_closed"]:
                counters["val_closed"] = True
                val.finish((index, 0), self.save)
            train.add(tokens[skip:], index, skip, self.save)
        counters["tokens_before"] += len(tokens)
        counters["chars_before"] += chars
        counters["documents_before"] += 1

    def finish(self, next_document):
        """The last, partial shard of each split, saved with the position of the document after the last."""
        for split in ("train", "val"):
            self.writers[split].finish((next_document, 0), self.save)


# ---------------------------------------------------------------- reading text (the same in every script)
# .txt and .jsonl are read with the standard library: `datasets`' loaders would turn CRLF into LF (no longer
# byte-identical to rustbpe), stop at invalid UTF-8, and take seconds to start. The Hub and parquet use `datasets`.

def hub_problem(timeout=3.0):
    """None if the Hub can be used, else why not: a 3 s probe, where `datasets` would retry for ~25 s."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):  # huggingface_hub's own rule
            return f"the Hugging Face Hub is off ({name}={os.environ[name]})"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")  # a mirror, if set
    try:
        url = urllib.parse.urlsplit(endpoint)
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except (OSError, ValueError):
        return f"can't reach the Hugging Face Hub at {endpoint}"

def datasets_texts(where, node=None, **load):
    """The "text" of each row of load_dataset(**load), streamed; node=(rank, world_size) keeps that rank's share."""
    import datasets.distributed  # here, not at the top: it takes seconds, and .txt/.jsonl never need it
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line
    try:
        rows = datasets.load_dataset(split="train", streaming=True, **load)
        for number, row in enumerate(datasets.distributed.split_dataset_by_node(rows, *node) if node else rows, 1):
            if not isinstance(row.get("text"), str):
                raise UserError(f"{where}, row {number}: \"text\" is {row.get('text')!r:.20}, not a string "
                                f"(columns: {', '.join(row)})")
            yield row["text"]
    except UserError:
        raise
    except Exception as error:  # no such dataset, a corrupt file (ArrowInvalid), a dropped connection
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"can't read {where} ({reason}); check it, or use other files: --data path/to/files")

def stdlib_documents():  # the offline corpus: real code and prose, on every machine
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    return (path.read_text(encoding="utf-8", errors="replace") for path in paths if "site-packages" not in path.parts)

class BadUTF8:
    count = 0  # invalid UTF-8 sequences replaced with U+FFFD, for one warning at the end

def decode_utf8(raw, decoder=None, final=True):
    text = decoder.decode(raw, final) if decoder else raw.decode("utf-8", errors="replace")
    BadUTF8.count += text.count("\ufffd") - raw.count("\ufffd".encode())  # a U+FFFD in the input is no error
    return text

def read_txt(path, budget):  # one document, CRLF kept, read only as far as the budget of characters needs
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds a character cut between blocks
    pieces, have, block = [], 0, None
    with open(path, "rb") as f:
        while have < budget and block != b"":
            block = f.read(1 << 24)
            pieces.append(decode_utf8(block, decoder, final=not block))  # the empty read at the end flushes
            have += len(pieces[-1])
    yield "".join(pieces)[:budget]

def read_jsonl(path, start=0, end=None):
    """The "text" of each line; with a byte range, the lines that start in it: ranges tiling a file read each line once."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the line holding byte start-1 began before start: the previous range reads it
        position = f.tell()
        for number, line in enumerate(f, 1):
            if end is not None and position >= end:
                return
            position += len(line)
            if not line.strip():
                continue
            try:
                text = json.loads(decode_utf8(line))["text"]
            except (ValueError, KeyError, TypeError):  # not JSON, no "text", not an object
                text = None
            if not isinstance(text, str):
                where = f"{path}:{number}" if start == 0 else f"{path} (the line at byte {position - len(line)})"
                raise UserError(f"{where} is not a JSON object with a string \"text\" field; "
                                "each line of a .jsonl file must look like {\"text\": \"...\"}")
            yield text

def local_files(data):  # the file itself, or a directory's text files in sorted order
    path, hub = Path(data), ", ".join(HUB_DATASETS)
    if not path.exists():
        raise UserError(f"--data {data}: no such file or directory; give a .txt/.jsonl/.parquet path, "
                        f"a directory of them, or one of {hub}")
    if not path.is_dir() and path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"--data {path}: unknown file type; use a .txt, .jsonl or .parquet file, a directory, or one of {hub}")
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise UserError(f"{path} holds no .txt, .jsonl or .parquet files; point --data at text files")
    return files

def open_source(data, data_was_named):
    """(documents, name, description), where documents(budget) yields the documents as strings."""
    if data not in HUB_DATASETS:
        files = local_files(data)
        readers = {".txt": read_txt, ".jsonl": lambda path, budget: read_jsonl(path),
                   ".parquet": lambda path, budget: datasets_texts(path, path="parquet", data_files=str(path))}
        return (lambda budget: (doc for p in files for doc in readers[p.suffix](p, budget))), Path(data).stem, str(data)
    repository, config, files = HUB_DATASETS[data]
    if (problem := hub_problem()) is None:  # parquet files by path: `datasets` then never runs an old loading script
        load = (dict(path="parquet", data_files=f"hf://datasets/{repository}/{files}") if files
                else dict(path=repository, name=config))
        return (lambda budget: datasets_texts(repository, **load)), data, f"{repository} {config or ''}".strip()
    if data_was_named:  # a source the user named refuses; the default one falls back to the offline corpus
        raise UserError(f"{problem}, needed for --data {data}; use local files instead: --data path/to/files")
    print(f"warning: {problem}: using the offline corpus, the Python standard library's source", file=sys.stderr)
    return (lambda budget: stdlib_documents()), "stdlib", "Python standard library source (offline fallback)"

def first_chars(documents, num_chars):  # the last document is cut to fit
    for document in documents(num_chars):
        yield document[:num_chars]
        num_chars -= min(len(document), num_chars)
        if num_chars == 0:
            return  # before the source is asked for one more document: it may be slow to fetch, or malformed

# ---------------------------------------------------------------- the run


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=tokenizer, help="a BPE directory from train_bpe_*.py, a tiktoken name (gpt2, cl100k_base, o200k_base), or char")
    parser.add_argument("--data", default=None, help=f"{' | '.join(HUB_DATASETS)} | path to .txt/.jsonl/.parquet or a directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default data/<source>_<tokenizer>)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="read only the first N characters")
    parser.add_argument("--max_tokens", type=int, default=max_tokens, help="stop after N tokens (train + val)")
    parser.add_argument("--shard_size", type=int, default=shard_size, help=f"tokens per shard (default {shard_size:,})")
    parser.add_argument("--val_tokens", type=int, default=val_tokens, help=f"tokens of the first documents kept for validation (default {val_tokens:,})")
    parser.add_argument("--workers", type=int, default=workers, help="tokenizer threads (default: every core)")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        raise UserError("--tokenizer is required: a directory from train_bpe_cpu.py (e.g. tokenizers/stdlib_v1000), "
                        "a tiktoken name (gpt2) or char")
    for flag in ("num_chars", "max_tokens", "shard_size", "val_tokens", "workers"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise UserError(f"--{flag} {getattr(args, flag)}: must be a positive number")
    return args


def open_out_dir(out_dir, run_args):
    """The resume state: fresh for a new directory, the saved one for a run of the very same arguments on the
    same source files, None for a dataset that is already complete."""
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"--out {out_dir}: {parent} is a file, not a directory; give a directory path")
    saved = None
    for path in (out_dir / "meta.json", out_dir / "progress.json"):
        if saved is None and path.exists():
            try:
                saved = json.loads(path.read_text())
                previous = {**saved["args"], "tokenizer": {k: v for k, v in saved["args"]["tokenizer"].items() if k != "path"}}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise UserError(f"--out {out_dir}: {path.name} is unreadable; delete {out_dir} to start over")
    if saved is None:
        if out_dir.exists() and any(not path.name.endswith(".tmp") for path in out_dir.iterdir()):
            raise UserError(f"--out {out_dir} is not empty and was not made by prepare_data.py; give a new directory")
        return {"args": run_args, "chars": None, "document": 0, "offset": 0, **{key: 0 for key in COUNTERS},
                "val_closed": False, "shards": {"val": [], "train": []}, "tokens": {"val": 0, "train": 0}, "max_token_id": -1}
    # Everything that decides the bytes of the shards must match (worker count and batch size don't).
    now = {**run_args, "tokenizer": {k: v for k, v in run_args["tokenizer"].items() if k != "path"}}
    for key in now:
        if key == "files" and now[key] != previous.get(key):
            raise UserError(f"--out {out_dir} was made from other source files or another version of them (their "
                            f"sizes or times differ); delete {out_dir} to start over, or use another --out")
        if now[key] != previous.get(key):
            raise UserError(f"--out {out_dir} was made with other arguments ({key}: {previous.get(key)!r}, "
                            f"now {now[key]!r}); use another --out, or delete it to start over")
    check_shards(out_dir, saved, run_args["shard_size"])
    if (out_dir / "meta.json").exists():
        return None
    print(f"resuming {out_dir}: {len(saved['shards']['val'])} val and {len(saved['shards']['train'])} train shards "
          f"are finished; skipping {saved['document']:,} documents")
    return saved


def give_up(out_dir, created_out, message):
    """Nothing useful was written: leave no directory that looks like a dataset behind."""
    for path in out_dir.iterdir():
        if path.name.startswith(("progress.json", "tokenizer.", "train_", "val_")):
            path.unlink()
    if created_out:
        out_dir.rmdir()
    raise UserError(message)


def char_vocabulary(text_stream, max_tokens):
    """char level, pass 1: every distinct character of the data, sorted (a char is a token: stop at max_tokens)."""
    distinct, seen = set(), 0
    for text in tqdm(text_stream(), unit=" docs", desc="pass 1: characters", mininterval=0.5):
        distinct.update(text)
        seen += len(text)
        if max_tokens and seen >= max_tokens:
            break
    return sorted(distinct)


def run(argv):
    args = parse_args(argv)
    t0 = time.time()
    # --- the source, the tokenizer, and the output directory: new, or a run of the same arguments to finish
    documents, source_name, source = open_source(args.data or data, args.data is not None)
    tok = load_tokenizer(args.tokenizer)
    # data/tinyshakespeare_char, data/fineweb_gpt2; a tokenizer named after its source (stdlib_v1000) keeps
    # its name alone rather than data/stdlib_stdlib_v1000.
    out_dir = Path(args.out or Path("data", tok.name if tok.name.startswith(source_name + "_") else f"{source_name}_{tok.name}"))
    # What identifies a local source is its files' paths, sizes and times: a changed source is never mixed in.
    files = None if (args.data or data) in HUB_DATASETS else [
        [str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in local_files(args.data)]
    run_args = {"source": source, "tokenizer": tok.meta, "num_chars": args.num_chars, "max_tokens": args.max_tokens,
                "shard_size": args.shard_size, "val_tokens": args.val_tokens, "files": files}
    progress = open_out_dir(out_dir, run_args)
    created_out = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    if tok.kind == "bpe":  # the dataset carries its tokenizer, so it stays usable on its own
        for name in ("tokenizer.tiktoken", "tokenizer.json"):
            shutil.copyfile(Path(args.tokenizer, name), out_dir / (name + ".tmp"))
            os.replace(out_dir / (name + ".tmp"), out_dir / name)
    if progress is None:
        print(f"{out_dir} is already complete with these arguments; nothing to do")
        return
    write_json(out_dir / "progress.json", progress)  # early, so that a directory with anything in it is ours
    text_stream = lambda: first_chars(documents, args.num_chars or sys.maxsize)  # noqa: E731

    # --- char level: a first pass over the data finds the vocabulary (saved, so a resume skips it)
    char_codes, vocab_size = None, tok.vocab_size
    if tok.kind == "char":
        if progress["chars"] is None:
            progress["chars"] = char_vocabulary(text_stream, args.max_tokens)
            write_json(out_dir / "progress.json", progress)
        if not progress["chars"]:
            give_up(out_dir, created_out, f"the dataset {source} is empty: no text to tokenize; point --data at files with text in them")
        char_codes = np.array([ord(c) for c in progress["chars"]], dtype=np.uint32)
        vocab_size = len(char_codes)
    # uint16 holds ids up to 65535, half the disk and memory bandwidth of uint32; bigger vocabularies
    # (o200k_base, or a char vocabulary of a multilingual corpus) switch to uint32.
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32

    # --- encode in the pool's threads, route each document to val or train, write shards
    splitter = Splitter(out_dir, dtype, progress, args)
    total = progress["tokens_before"]  # tokens of the documents before the resume point, for --max_tokens
    pending, new_tokens, t1 = None, 0, time.time()
    bar = tqdm(unit=" docs", desc="tokenizing", mininterval=0.5, initial=progress["document"])
    with ThreadPoolExecutor(args.workers) as pool:
        try:
            # A resumed run that had reached --max_tokens only lacked meta.json: don't read on.
            reached_max = bool(args.max_tokens) and total >= args.max_tokens
            stream = () if reached_max else encoded_documents(
                text_stream(), progress["document"], lambda texts: encode_batch(texts, tok, char_codes, dtype), pool,
                max_in_flight=2 * args.workers)
            for index, tokens, chars in stream:
                bar.update(1)
                if chars == 0:  # an empty document holds no text: it is skipped, with no EOT of its own
                    continue
                last = bool(args.max_tokens) and total + len(tokens) >= args.max_tokens
                tokens = tokens[:args.max_tokens - total] if last else tokens
                total += len(tokens)
                new_tokens += len(tokens)
                if pending is not None:
                    splitter.route(*pending, is_last=False)
                pending = (index, tokens, chars)
                if bar.n % 64 == 0:
                    bar.set_postfix_str(f"{new_tokens / max(time.time() - t1, 1e-9):,.0f} tokens/s", refresh=False)
                if last:
                    break
        finally:
            bar.close()
            pool.shutdown(cancel_futures=True)
    if pending is not None:
        if splitter.counters["documents_before"] == 0 and len(pending[1]) < 2:
            give_up(out_dir, created_out, f"the dataset {source} is a single character: too little to split into train and val")
        splitter.route(*pending, is_last=True)
        splitter.finish(pending[0] + 1)
    elif splitter.counters["documents_before"] == 0:
        give_up(out_dir, created_out, f"the dataset {source} is empty: no text to tokenize; point --data at files with text in them")
    # (else: a resumed run whose every shard was finished; only meta.json was missing)
    t2 = time.time()

    # --- meta.json, last: its presence says the dataset is complete
    counters, tokens = splitter.counters, progress["tokens"]
    meta = {"version": 1, "vocab_size": vocab_size, "eot_token": tok.eot, "dtype": np.dtype(dtype).name,
            "max_token_id": progress["max_token_id"], "tokenizer": tok.meta, "source": source,
            "num_chars": counters["chars_before"], "tokens": tokens, "shards": progress["shards"], "args": run_args}
    if tok.kind == "char":
        meta["chars"] = progress["chars"]
    write_json(out_dir / "meta.json", meta)
    (out_dir / "progress.json").unlink()
    for leftover in out_dir.glob("*.tmp"):  # a shard a killed run had begun and this one finished
        leftover.unlink()
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD", file=sys.stderr)
    if args.num_chars and counters["chars_before"] < args.num_chars and not args.max_tokens:
        print(f"the source ran out after {counters['chars_before']:,} characters (asked for {args.num_chars:,})")
    if tokens["val"] > (tokens["train"] + tokens["val"]) / 2:
        print(f"warning: val holds {tokens['val']:,} of {tokens['train'] + tokens['val']:,} tokens; lower --val_tokens",
              file=sys.stderr)
    print(f"wrote {out_dir}: {tokens['train']:,} train tokens in {len(progress['shards']['train'])} shards, "
          f"{tokens['val']:,} val tokens in {len(progress['shards']['val'])}, {np.dtype(dtype).name}, "
          f"from {counters['documents_before']:,} documents")
    print(f"tokenizing {t2 - t1:.2f}s ({new_tokens / max(t2 - t1, 1e-9):,.0f} tokens/s) | total {t2 - t0:.2f}s")


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume; finished shards are kept", file=sys.stderr)
        sys.exit(130)
    except OSError as error:  # a full disk, a lost mount: the finished shards are safe, so say how to go on
        print(f"error: {error}; fix it and run the same command again to resume", file=sys.stderr)
        sys.exit(1)
