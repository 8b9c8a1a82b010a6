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
the finished shards and ends with files identical to an uninterrupted run (the README's "Resuming").
"""

import argparse
import base64
import codecs
import hashlib
import json
import os
import shutil
import socket
import struct
import sys
import sysconfig
import time
from collections import deque
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
TIKTOKEN_NAMES = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- reading text (the same in every script)


def hub_reachable(timeout=3.0):
    """`datasets` retries an unreachable Hub for ~25 s with a screenful of warnings; a socket says it in 3."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def stream_hub(name):
    """A Hub dataset, streamed: documents arrive as we read them, nothing is downloaded whole."""
    import datasets

    repository, config, files = HUB_DATASETS[name]
    try:
        if files:
            rows = datasets.load_dataset("parquet", data_files=f"hf://datasets/{repository}/{files}", split="train",
                                         streaming=True)
        else:
            rows = datasets.load_dataset(repository, name=config, split="train", streaming=True)
    except Exception as error:  # the Hub answered, but not with the dataset: say why in one line
        raise UserError(f"can't open {repository} ({type(error).__name__}: {str(error).splitlines()[0]}); "
                        "use local files: --data path/to/files")
    for row in rows:
        yield row["text"]


def stdlib_documents():
    """The offline corpus: every .py file of the standard library, one document each, in sorted order.
    Several MB of real, human-written code and docstrings, on every machine that runs this script."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        yield path.read_text(encoding="utf-8", errors="replace")


class BadUTF8:
    """Counts the invalid UTF-8 sequences replaced with U+FFFD, so we can warn once at the end."""
    count = 0


def decode_utf8(raw, decoder=None, final=True):
    """Decode, replacing invalid bytes. A real U+FFFD in the input is not counted as a replacement."""
    text = decoder.decode(raw, final) if decoder else raw.decode("utf-8", errors="replace")
    if "\ufffd" in text:
        BadUTF8.count += text.count("\ufffd") - raw.count("\ufffd".encode())
    return text


def read_txt(path, budget):
    """A .txt file is one document; read no more of it than the character budget needs."""
    # An incremental decoder holds back a multi-byte character cut at the end of a block instead of
    # replacing it; only truly invalid bytes become U+FFFD.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces, have = [], 0
    with open(path, "rb") as f:
        while have < budget:
            block = f.read(1 << 24)
            pieces.append(decode_utf8(block, decoder, final=not block))
            have += len(pieces[-1])
            if not block:
                break
    yield "".join(pieces)[:budget]


def read_jsonl(path):
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(decode_utf8(line))
                yield record["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{path}:{line_number} is not a JSON object with a \"text\" field; "
                                "each line of a .jsonl file must look like {\"text\": \"...\"}")


def read_parquet(path):
    """Parquet goes through `datasets`, the same streaming code that reads FineWeb from the Hub."""
    import datasets

    rows = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
    for row in rows:
        if "text" not in row:
            raise UserError(f"{path} has no \"text\" column (columns: {', '.join(row)})")
        yield row["text"]


def local_files(path):
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"{path} holds no .txt, .jsonl or .parquet files; point --data at text files")
        return files
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(f"--data {path}: unknown file type; use a .txt, .jsonl or .parquet file, a directory, "
                        f"or one of {', '.join(HUB_DATASETS)}")
    return [path]


def open_source(data, data_was_named):
    """Returns (documents, name, description). `documents(budget)` yields documents as strings."""
    if data in HUB_DATASETS:
        if hub_reachable():
            repository, config, _ = HUB_DATASETS[data]
            return (lambda budget: stream_hub(data)), data, f"{repository} {config or ''}".strip()
        if data_was_named:
            raise UserError(f"can't reach the Hugging Face Hub for --data {data}; "
                            "use local files instead: --data path/to/files")
        print(f"can't reach the Hugging Face Hub for {data}: using the offline corpus, the Python standard library's source")
        return (lambda budget: stdlib_documents()), "stdlib", "Python standard library source (offline fallback)"
    if not Path(data).exists():
        raise UserError(f"--data {data}: no such file or directory; give a .txt/.jsonl/.parquet path, "
                        f"a directory of them, or one of {', '.join(HUB_DATASETS)}")
    files = local_files(data)
    readers = {".txt": read_txt, ".jsonl": lambda path, budget: read_jsonl(path),
               ".parquet": lambda path, budget: read_parquet(path)}

    def documents(budget):
        for path in files:
            yield from readers[path.suffix](path, budget)

    return documents, Path(data).stem, str(data)


def first_chars(documents, num_chars):
    """The first num_chars characters of the stream, document by document; the last one is cut to fit."""
    remaining = num_chars
    for document in documents(num_chars):
        document = document[:remaining]
        remaining -= len(document)
        yield document
        if remaining == 0:
            return  # before the source is asked for one more document: it may be slow to fetch, or malformed


# ---------------------------------------------------------------- the tokenizer


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_bpe_dir(directory):
    """A directory from train_bpe_*.py -> (tiktoken.Encoding, vocab_size, eot id). Read fresh every time."""
    import tiktoken

    ranks_path, info_path = Path(directory, "tokenizer.tiktoken"), Path(directory, "tokenizer.json")
    for path in (ranks_path, info_path):
        if not path.is_file():
            raise UserError(f"--tokenizer {directory}: {path.name} is missing; give a directory written by "
                            "train_bpe_cpu.py, a tiktoken name (gpt2, cl100k_base, o200k_base) or char")
    try:
        with open(info_path) as f:
            info = json.load(f)
        with open(ranks_path, "rb") as f:
            ranks = {base64.b64decode(token, validate=True): int(rank)
                     for token, rank in (line.split() for line in f if line.strip())}
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError("ranks are not 0..V-1, each once")
        encoder = tiktoken.Encoding(name=str(directory), pat_str=info["pattern"], mergeable_ranks=ranks,
                                    special_tokens=info["special_tokens"])
        eot = info["special_tokens"][EOT]
        if info.get("vocab_size", encoder.n_vocab) != encoder.n_vocab:
            raise ValueError(f"vocab_size {info['vocab_size']} but the files hold {encoder.n_vocab} ids")
    except Exception as error:  # any broken file: say which directory, and why, in one line
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"--tokenizer {directory} is broken ({reason}); re-run train_bpe_cpu.py to rewrite it")
    return encoder, encoder.n_vocab, eot


def load_tiktoken_name(name):
    """tiktoken's own encodings. The first use downloads the ranks (a few MB) and caches them."""
    import tiktoken

    try:
        known = tiktoken.list_encoding_names()
    except Exception:
        known = list(TIKTOKEN_NAMES)
    if name not in known:
        raise UserError(f"--tokenizer {name}: not a directory, not char, and not a tiktoken encoding "
                        f"({', '.join(known)}); check the spelling or the path")
    try:
        encoder = tiktoken.get_encoding(name)
    except Exception as error:  # requests' connection errors and friends: the download failed
        reason = f"{type(error).__name__}".splitlines()[0]
        raise UserError(f"--tokenizer {name}: tiktoken could not download its ranks ({reason}); this needs "
                        "internet once (then it is cached), or use a BPE directory from train_bpe_cpu.py")
    return encoder, encoder.n_vocab, encoder.eot_token


# ---------------------------------------------------------------- encoding, in parallel threads
#
# tiktoken's Rust core releases the GIL while it encodes, so threads run on every core without the cost of
# a process pool (pickling every document to a worker and every token array back). encode_to_numpy hands
# back the Rust buffer as a numpy array, so no Python list of ints is ever built. bench/bench_prepare_data.py
# measured both on enwiki (2 cores): threads + encode_to_numpy spent 9-15% less CPU per token than
# encode_ordinary_batch itself, and a process pool 8% more.


def encode_batch(texts, encoder, eot, char_codes, dtype, vocab_size):
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
            pieces.append(np.array([eot], dtype=np.uint32))
            pieces.append(encoder.encode_to_numpy(text, allowed_special=set(), disallowed_special=()))
        lengths.append(len(pieces[-1]) + (char_codes is None))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint32)
    # Never overflow silently: every id must fit the vocabulary, and the vocabulary the dtype.
    assert len(tokens) == 0 or int(tokens.max()) < vocab_size <= np.iinfo(dtype).max + 1, "token id overflow"
    return tokens.astype(dtype), lengths


def encoded_documents(documents, start, encode, pool, max_in_flight):
    """Yield (index, tokens, num_chars) for each document from `start` on, in order. Batches are encoded by
    the thread pool while this thread reads ahead; at most max_in_flight batches wait, so memory stays flat
    however long the stream is."""
    in_flight = deque()
    batch, batch_size = [], 0
    index = -1

    def collect():
        first_index, texts_chars, future = in_flight.popleft()
        tokens, lengths = future.result()
        offsets = np.cumsum([0] + lengths)
        for k, length in enumerate(lengths):
            yield first_index + k, tokens[offsets[k]:offsets[k + 1]], texts_chars[k]

    for index, text in enumerate(documents):
        if index < start:  # resuming: these documents are in finished shards already
            continue
        batch.append(text)
        batch_size += len(text)
        if batch_size >= batch_chars:
            in_flight.append((index - len(batch) + 1, [len(t) for t in batch], pool.submit(encode, batch)))
            batch, batch_size = [], 0
            while len(in_flight) > max_in_flight:
                yield from collect()
    if batch:
        in_flight.append((index - len(batch) + 1, [len(t) for t in batch], pool.submit(encode, batch)))
    while in_flight:
        yield from collect()


# ---------------------------------------------------------------- shards
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


def write_json(path, obj):
    """Write JSON under a temporary name, then rename: readers never see half a file."""
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- the run


def run(argv):
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
    t0 = time.time()

    if args.tokenizer is None:
        raise UserError("--tokenizer is required: a directory from train_bpe_cpu.py (e.g. tokenizers/stdlib_v1000), "
                        "a tiktoken name (gpt2) or char")
    for flag in ("num_chars", "max_tokens", "shard_size", "val_tokens", "workers"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag} {value}: must be a positive number")

    # --- the source, and the tokenizer
    documents, source_name, source = open_source(args.data or data, args.data is not None)
    budget = args.num_chars or sys.maxsize

    def text_stream():
        return first_chars(documents, budget)

    token_kind = "char" if args.tokenizer == "char" else "bpe" if (
        os.sep in args.tokenizer or args.tokenizer.startswith(".") or Path(args.tokenizer).exists()) else "tiktoken"
    if token_kind == "bpe" and not Path(args.tokenizer).is_dir():
        raise UserError(f"--tokenizer {args.tokenizer}: no such directory; give a directory written by "
                        "train_bpe_cpu.py, a tiktoken name (gpt2, cl100k_base, o200k_base) or char")
    if token_kind == "bpe":
        encoder, vocab_size, eot = load_bpe_dir(args.tokenizer)
        tokenizer_meta = {"kind": "bpe", "path": str(args.tokenizer),
                          "sha256": sha256_of(Path(args.tokenizer, "tokenizer.tiktoken"))}
        tokenizer_name = Path(args.tokenizer).resolve().name
    elif token_kind == "tiktoken":
        encoder, vocab_size, eot = load_tiktoken_name(args.tokenizer)
        tokenizer_meta, tokenizer_name = {"kind": "tiktoken", "name": args.tokenizer}, args.tokenizer
    else:
        encoder, eot, vocab_size = None, None, None  # the vocabulary comes from the data, below
        tokenizer_meta, tokenizer_name = {"kind": "char"}, "char"

    # --- the output directory: new, or a run of the very same arguments to finish
    # data/tinyshakespeare_char, data/fineweb_gpt2; a tokenizer named after its source (stdlib_v1000) keeps
    # its name alone rather than data/stdlib_stdlib_v1000.
    default_name = tokenizer_name if tokenizer_name.startswith(source_name + "_") else f"{source_name}_{tokenizer_name}"
    out_dir = Path(args.out or Path("data", default_name))
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"--out {out_dir}: {parent} is a file, not a directory; give a directory path")
    # Everything that decides the bytes of the shards. Worker count and batch size don't.
    run_args = {"source": source, "tokenizer": tokenizer_meta, "num_chars": args.num_chars,
                "max_tokens": args.max_tokens, "shard_size": args.shard_size, "val_tokens": args.val_tokens}
    comparable = {**run_args, "tokenizer": {k: v for k, v in tokenizer_meta.items() if k != "path"}}
    meta_path, progress_path = out_dir / "meta.json", out_dir / "progress.json"
    previous = None
    for path in (meta_path, progress_path):
        if previous is None and path.exists():
            try:
                with open(path) as f:
                    previous = json.load(f)["args"]
            except (OSError, ValueError, KeyError):
                raise UserError(f"--out {out_dir}: {path.name} is unreadable; delete {out_dir} to start over")
    if previous is not None:
        previous_comparable = {**previous, "tokenizer": {k: v for k, v in previous["tokenizer"].items() if k != "path"}}
        differences = [key for key in comparable if comparable[key] != previous_comparable.get(key)]
        if differences:
            key = differences[0]
            raise UserError(f"--out {out_dir} was made with other arguments ({key}: {previous_comparable.get(key)!r}, "
                            f"now {comparable[key]!r}); use another --out, or delete it to start over")
        if meta_path.exists():
            print(f"{out_dir} is already complete with these arguments; nothing to do")
            return
    elif out_dir.exists() and any(not path.name.endswith(".tmp") for path in out_dir.iterdir()):
        raise UserError(f"--out {out_dir} is not empty and was not made by prepare_data.py; give a new directory")

    if progress_path.exists():
        with open(progress_path) as f:
            progress = json.load(f)
        print(f"resuming {out_dir}: {len(progress['shards']['val'])} val and {len(progress['shards']['train'])} "
              f"train shards are finished; skipping {progress['document']:,} documents")
    else:
        progress = {"args": run_args, "chars": None, "document": 0, "offset": 0,
                    "tokens_before": 0, "chars_before": 0, "documents_before": 0,
                    "val_count": 0, "val_documents": 0, "val_closed": False,
                    "shards": {"val": [], "train": []}, "tokens": {"val": 0, "train": 0}, "max_token_id": -1}
    created_out = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(progress_path, progress)  # first, so that a directory with anything in it is recognized as ours
    if token_kind == "bpe":  # the dataset carries its tokenizer, so it stays usable on its own
        for name in ("tokenizer.tiktoken", "tokenizer.json"):
            shutil.copyfile(Path(args.tokenizer, name), out_dir / (name + ".tmp"))
            os.replace(out_dir / (name + ".tmp"), out_dir / name)

    def give_up(message):
        """Nothing useful was written: leave no directory that looks like a dataset behind."""
        for path in out_dir.iterdir():
            if path.name.startswith(("progress.json", "tokenizer.", "train_", "val_")):
                path.unlink()
        if created_out:
            out_dir.rmdir()
        raise UserError(message)

    # --- char level: a first pass over the data finds the vocabulary (saved, so a resume skips it)
    char_codes = None
    if token_kind == "char":
        if progress["chars"] is None:
            distinct, seen = set(), 0
            for text in tqdm(text_stream(), unit=" docs", desc="pass 1: characters", mininterval=0.5):
                distinct.update(text)
                seen += len(text)
                if args.max_tokens and seen >= args.max_tokens:  # a char is a token: the rest is not needed
                    break
            progress["chars"] = sorted(distinct)
        if not progress["chars"]:
            give_up(f"the dataset {source} is empty: no text to tokenize; point --data at files with text in them")
        char_codes = np.array([ord(c) for c in progress["chars"]], dtype=np.uint32)
        vocab_size = len(char_codes)
    # uint16 holds ids up to 65535, half the disk and memory bandwidth of uint32; bigger vocabularies
    # (o200k_base, or a char vocabulary of a multilingual corpus) switch to uint32.
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    write_json(progress_path, progress)

    # --- encode, route each document to val or train, write shards
    writers = {split: ShardWriter(out_dir, split, dtype, args.shard_size, progress) for split in ("val", "train")}
    resume_document, resume_offset = progress["document"], progress["offset"]
    # Counters as they stood before the document being routed: with them a resumed run makes the same choices.
    counters = {key: progress[key] for key in ("tokens_before", "chars_before", "documents_before",
                                                 "val_count", "val_documents", "val_closed")}

    def save_progress(position):
        progress["document"], progress["offset"] = position
        progress.update(counters)
        write_json(progress_path, progress)

    def route(index, tokens, chars, is_last):
        """Send one document's tokens to val or train. Runs one document late, so it knows the last one."""
        skip = resume_offset if index == resume_document else 0
        if is_last and counters["documents_before"] == 0:
            # One single document (tinyshakespeare): its last 10% of tokens are the validation split.
            cut = min(len(tokens) - 1, len(tokens) * 9 // 10)
            writers["train"].add(tokens[skip:cut], index, skip, save_progress)
            writers["train"].finish((index, cut), save_progress)
            start = max(skip, cut)
            writers["val"].add(tokens[start:], index, start, save_progress)
        elif not counters["val_closed"] and not is_last and (
                counters["val_documents"] == 0 or counters["val_count"] < args.val_tokens):
            writers["val"].add(tokens[skip:], index, skip, save_progress)
            counters["val_count"] += len(tokens)
            counters["val_documents"] += 1
        else:
            if not counters["val_closed"]:
                counters["val_closed"] = True
                writers["val"].finish((index, 0), save_progress)
            writers["train"].add(tokens[skip:], index, skip, save_progress)
        counters["tokens_before"] += len(tokens)
        counters["chars_before"] += chars
        counters["documents_before"] += 1

    def encode(texts):
        return encode_batch(texts, encoder, eot, char_codes, dtype, vocab_size)

    pending = None
    total = counters["tokens_before"]  # tokens of the documents before the resume point, for --max_tokens
    t1 = time.time()
    progress_bar = tqdm(unit=" docs", desc="tokenizing", mininterval=0.5, initial=resume_document)
    new_tokens = 0
    with ThreadPoolExecutor(args.workers) as pool:
        try:
            # A resumed run that had reached --max_tokens only lacked meta.json: don't read on.
            reached_max = bool(args.max_tokens) and total >= args.max_tokens
            stream = () if reached_max else encoded_documents(text_stream(), resume_document, encode, pool,
                                                              max_in_flight=2 * args.workers)
            for index, tokens, chars in stream:
                progress_bar.update(1)
                if chars == 0:  # an empty document holds no text: it is skipped, with no EOT of its own
                    continue
                last = bool(args.max_tokens) and total + len(tokens) >= args.max_tokens
                if last:
                    tokens = tokens[:args.max_tokens - total]
                total += len(tokens)
                new_tokens += len(tokens)
                if pending is not None:
                    route(*pending, is_last=False)
                pending = (index, tokens, chars)
                if progress_bar.n % 64 == 0:
                    progress_bar.set_postfix_str(f"{new_tokens / max(time.time() - t1, 1e-9):,.0f} tokens/s", refresh=False)
                if last:
                    break
            progress_bar.set_postfix_str(f"{new_tokens / max(time.time() - t1, 1e-9):,.0f} tokens/s")
        finally:
            progress_bar.close()
            pool.shutdown(cancel_futures=True)
    if pending is not None:
        if counters["documents_before"] == 0 and len(pending[1]) < 2:
            give_up(f"the dataset {source} is a single character: too little to split into train and val")
        route(*pending, is_last=True)
        # The last, partial shard of each split. The counters now include the last document, so the
        # position saved with them is the start of the next one.
        for split in ("train", "val"):
            writers[split].finish((pending[0] + 1, 0), save_progress)
    elif counters["documents_before"] == 0:
        give_up(f"the dataset {source} is empty: no text to tokenize; point --data at files with text in them")
    # (else: a resumed run whose every shard was finished; only meta.json was missing)
    t2 = time.time()

    # --- meta.json, last: its presence says the dataset is complete
    meta = {
        "version": 1,
        "vocab_size": vocab_size,
        "eot_token": eot,
        "dtype": np.dtype(dtype).name,
        "max_token_id": progress["max_token_id"],
        "tokenizer": tokenizer_meta,
        "source": source,
        "num_chars": counters["chars_before"],
        "tokens": progress["tokens"],
        "shards": progress["shards"],
        "args": run_args,
    }
    if token_kind == "char":
        meta["chars"] = progress["chars"]
    write_json(meta_path, meta)
    progress_path.unlink()
    for leftover in out_dir.glob("*.tmp"):  # a shard a killed run had begun and this one finished
        leftover.unlink()
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD")
    if args.num_chars and counters["chars_before"] < args.num_chars and not args.max_tokens:
        print(f"the source ran out after {counters['chars_before']:,} characters (asked for {args.num_chars:,})")
    tokens_total = progress["tokens"]["train"] + progress["tokens"]["val"]
    if progress["tokens"]["val"] > tokens_total / 2:
        print(f"warning: val holds {progress['tokens']['val']:,} of {tokens_total:,} tokens; lower --val_tokens")
    print(f"wrote {out_dir}: {progress['tokens']['train']:,} train tokens in {len(progress['shards']['train'])} shards, "
          f"{progress['tokens']['val']:,} val tokens in {len(progress['shards']['val'])}, {np.dtype(dtype).name}, "
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
