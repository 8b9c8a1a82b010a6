"""
Turn text into token shards for train.py: fast, in flat memory, and resumable.

    python prepare_data.py --tokenizer tokenizers/stdlib_v1000
    python prepare_data.py --tokenizer gpt2 --data fineweb-edu --max_tokens 1000000000
    python prepare_data.py --tokenizer char --data ../shared/corpora/tinyshakespeare.txt

It writes DIR/val_000000.npy, ..., DIR/train_000000.npy, ... and, last, DIR/meta.json (DIR: data/<source>_<tokenizer>
unless --out), as the README describes. Killed and run again with the same arguments, it resumes where it stopped.
"""

import argparse
import base64
import codecs
import hashlib
import itertools
import json
import os
import socket
import sys
import sysconfig
import time
import urllib.parse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import regex
import tiktoken
from tqdm import tqdm

# -----------------------------------------------------------------------------
# defaults, each overridable from the command line
data = "fineweb"  # fineweb | fineweb-edu | openwebtext | tinystories | a .txt/.jsonl/.parquet file | a directory
tokenizer = None  # a directory from train_bpe_*.py | a tiktoken name (gpt2, o200k_base) | char: one id per character
out = None  # default data/<source>_<tokenizer> (data/fineweb_gpt2), or data/<tokenizer> if named after its source
num_chars = None  # read only the first N characters of the stream (default: all of it)
max_tokens = None  # stop after N tokens, train + val (default: no limit)
shard_size = 100_000_000  # tokens per shard: 200 MB of uint16, as in build-nanogpt
val_tokens = 1_000_000  # the validation split: the first documents, until they hold this many tokens
workers = os.cpu_count()  # tokenizer threads
batch_chars = 1 << 20  # characters per batch handed to a thread: big enough to amortize, small for memory
HUB_DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),  # (repository, config, parquet files)
                "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None),
                "openwebtext": ("Skylion007/openwebtext", None, "data/train-*.parquet"),
                "tinystories": ("roneneldan/TinyStories", None, None)}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- step 1: encode documents in parallel threads
# tiktoken's Rust core releases the GIL while it encodes, so threads use every core without a process pool's cost
# (pickling documents to workers and tokens back); encode_to_numpy builds no list of ints. See bench/RESULTS.md.
def encode_batch(texts, encoder, dtype):
    """Each document's ids: <|endoftext|> (none at char level), then its text's, where "<|endoftext|>" is plain text."""
    eot = np.array([] if encoder.eot_token is None else [encoder.eot_token], dtype)
    try:
        return [np.concatenate([eot, encoder.encode_to_numpy(text, allowed_special=set(), disallowed_special=())],
                               dtype=dtype) for text in texts]
    except ValueError as error:  # tiktoken's regex gives up on a run of a million spaces (its backtracking limit)
        raise UserError(f"tiktoken can't split a document ({error}); shorten its runs of whitespace")


def encode_in_threads(texts, encode, workers):
    """(tokens, number of characters) of each text, in order. Threads encode batches of about batch_chars
    characters while this one reads ahead, at most 2 per thread: memory stays flat on any stream."""
    pool, in_flight, batch, size = ThreadPoolExecutor(workers), deque(), [], 0
    try:
        for text in itertools.chain(texts, [None]):  # None: the end, collect the rest
            if text is not None:
                batch.append(text)
                size += len(text)
            if batch and (text is None or size >= batch_chars):
                in_flight.append((batch, pool.submit(encode, batch)))
                batch, size = [], 0
            while in_flight and (text is None or len(in_flight) > 2 * workers):
                done, future = in_flight.popleft()
                yield from zip(future.result(), map(len, done))
    finally:  # also when stopped early (--max_tokens, an error, Ctrl-C): drop the batches not yet begun
        pool.shutdown(cancel_futures=True)


# ---------------------------------------------------------------- step 2: shards, val first, then train
# Shard k of a split holds its tokens [k * shard_size, (k + 1) * shard_size): the boundaries depend on the data alone.
# A .npy file is a 128-byte header and the raw array: tokens stream into NAME.tmp behind a placeholder header, the
# true header goes in when the shard is full, and only then is it renamed NAME. Each finished shard saves
# progress.json: the meta.json to be, and where a resumed run starts (the first token not in a finished shard).
class Shards:
    def __init__(self, out_dir, state, args):
        self.out_dir, self.state, self.args = out_dir, state, args
        self.split, self.file, self.filled = None, None, 0

    def route(self, index, tokens, chars, skip, is_last):
        """Val takes the first documents until it holds val_tokens (at least one document); train takes the rest,
        and always the last. A source of a single document trains on its first 90%, as nanoGPT does."""
        if is_last and index == 0:
            if len(tokens) < 2:
                raise UserError(f"the dataset {self.state['source']} is a single token: too little for train and val")
            cut = min(len(tokens) - 1, len(tokens) * 9 // 10)
            self.write("train", tokens, skip, cut, index)
            self.write("val", tokens, max(skip, cut), len(tokens), index)
        else:  # the shards hold the documents before this one, and its first `skip` tokens
            written = self.state["tokens"]
            val = not is_last and written["train"] == 0 and written["val"] - skip < self.args.val_tokens
            self.write("val" if val else "train", tokens, skip, len(tokens), index)
        self.state["num_chars"] += chars

    def write(self, split, tokens, start, end, index):
        if split != self.split:
            self.finish(index, start)
            self.split = split
        while start < end:
            if self.file is None:  # the directory appears with the first shard: an empty source leaves none
                if not (self.out_dir / "progress.json").exists():  # before any shard: a run killed now resumes
                    self.out_dir.mkdir(parents=True, exist_ok=True)
                    write_json(self.out_dir / "progress.json", self.state)
                self.file = open(self.out_dir / f"{split}_{len(self.state['shards'][split]):06d}.npy.tmp", "wb")
                self.file.write(bytes(128))
            chunk = tokens[start:min(end, start + self.args.shard_size - self.filled)]
            self.file.write(chunk.tobytes())
            self.filled, start = self.filled + len(chunk), start + len(chunk)
            self.state["tokens"][split] += len(chunk)
            self.state["max_token_id"] = max(self.state["max_token_id"], int(chunk.max()))
            if self.filled == self.args.shard_size:
                self.finish(index, start)

    def finish(self, document, offset):
        """Close the open shard, if any, and save that a resumed run starts at token `offset` of `document`."""
        self.state["resume"].update(document=document, offset=offset)
        if self.file is None:
            return
        self.file.seek(0)
        header = {"descr": np.dtype(self.state["dtype"]).str, "fortran_order": False, "shape": (self.filled,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        self.file.flush()
        os.fsync(self.file.fileno())  # the data is on disk before the name says the shard is whole
        self.file.close()
        self.state["shards"][self.split].append(Path(self.file.name).stem)
        os.replace(self.file.name, self.out_dir / Path(self.file.name).stem)
        write_json(self.out_dir / "progress.json", self.state)
        self.file, self.filled = None, 0


def write_json(path, obj):  # under a temporary name, then renamed: readers never see half a file
    with open(f"{path}.tmp", "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


# ---------------------------------------------------------------- the tokenizer, and the output directory
def load_tokenizer(name):
    """--tokenizer -> (a tiktoken encoder, None for char; its entry in meta.json)."""
    if name == "char":  # the vocabulary comes later, from the data
        return None, {"kind": "char"}
    if not Path(name).exists():  # a tiktoken name
        if name not in tiktoken.list_encoding_names():
            raise UserError(f"--tokenizer {name}: no such directory, and not a tiktoken encoding "
                            f"({', '.join(tiktoken.list_encoding_names())}) or char")
        try:  # the first use downloads the ranks (a few MB) and caches them
            return tiktoken.get_encoding(name), {"kind": "tiktoken", "name": name}
        except Exception as error:  # requests' connection errors and friends
            raise UserError(f"--tokenizer {name}: tiktoken could not download its ranks ({type(error).__name__}); this "
                            "needs internet once (then it is cached), or use a BPE directory from train_bpe_cpu.py")
    for file in ("tokenizer.tiktoken", "tokenizer.json"):
        if not Path(name, file).is_file():
            raise UserError(f"--tokenizer {name}: {file} is missing; give a directory written by train_bpe_cpu.py")
    try:  # any broken file: say which directory, and why, in one line
        info = json.loads(Path(name, "tokenizer.json").read_text())
        ranks_file = Path(name, "tokenizer.tiktoken").read_bytes()
        ranks = {base64.b64decode(token, validate=True): int(rank)
                 for token, rank in (line.split() for line in ranks_file.splitlines() if line.strip())}
        if sorted(ranks.values()) != list(range(len(ranks))) or "<|endoftext|>" not in info["special_tokens"]:
            raise ValueError("its ranks are not 0..V-1, each once, or it has no <|endoftext|>")
        if regex.compile(info["pattern"]).fullmatch(""):  # tiktoken would panic on its empty chunks
            raise ValueError(f"its pattern {info['pattern']!r} matches the empty string")
        encoder = tiktoken.Encoding(name, pat_str=info["pattern"], mergeable_ranks=ranks,
                                    special_tokens=info["special_tokens"])
        if info.get("vocab_size", encoder.n_vocab) != encoder.n_vocab:
            raise ValueError(f"vocab_size {info['vocab_size']} but the files hold {encoder.n_vocab} ids")
    except Exception as error:
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"--tokenizer {name} is broken ({reason}); re-run train_bpe_cpu.py to rewrite it")
    return encoder, {"kind": "bpe", "path": name, "sha256": hashlib.sha256(ranks_file).hexdigest()}


class CharEncoder:
    """tiktoken's interface at char level: a character's id is its rank among the data's distinct characters."""
    def __init__(self, chars):
        self.n_vocab, self.eot_token, self.ids = len(chars), None, np.full(0x110000, len(chars), np.uint32)
        self.ids[[ord(c) for c in chars]] = np.arange(len(chars))  # (len(chars): not in the vocabulary)

    def encode_to_numpy(self, text, **_):
        ids = self.ids[np.frombuffer(text.encode("utf-32-le"), np.uint32)]
        if (ids == self.n_vocab).any():
            raise UserError("the data changed between the two passes (a new character); run again once it no longer changes")
        return ids


def resume_state(out_dir, run_args):
    """Fresh for a new directory; the saved state for a run of the same arguments (the tokenizer's path aside) on
    the same source files (paths, sizes, times), after checking its shards; None for a dataset already complete."""
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"--out {out_dir}: {parent} is a file, not a directory; give a directory path")
    saved_path = next((path for path in (out_dir / "meta.json", out_dir / "progress.json") if path.exists()), None)
    if saved_path is None:
        if out_dir.exists() and any(not path.name.endswith(".tmp") for path in out_dir.iterdir()):
            raise UserError(f"--out {out_dir} is not empty and was not made by prepare_data.py; give a new directory")
        return {"version": 1, "max_token_id": -1, "tokenizer": run_args["tokenizer"], "source": run_args["source"],
                "num_chars": 0, "tokens": {"val": 0, "train": 0}, "shards": {"val": [], "train": []},
                "args": run_args, "resume": {"document": 0, "offset": 0}}
    shard_deciding = lambda args: {**args, "tokenizer": {k: v for k, v in args["tokenizer"].items() if k != "path"}}
    start_over = f"delete {out_dir} to start over"
    try:
        saved = json.loads(saved_path.read_text())
        previous = shard_deciding(saved["args"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"--out {out_dir}: {saved_path.name} is unreadable; {start_over}")
    for key, value in shard_deciding(run_args).items():
        if value != previous.get(key):
            why = ("from other source files or another version of them (their sizes or times differ)" if key == "files"
                   else f"with other arguments ({key}: {previous.get(key)!r}, now {value!r})")
            raise UserError(f"--out {out_dir} was made {why}; use another --out, or {start_over}")
    if saved_path.name == "progress.json" and "resume" not in saved:  # an older prepare_data.py counted otherwise
        raise UserError(f"--out {out_dir}: progress.json is from an older prepare_data.py; {start_over}")
    for split, names in saved["shards"].items():  # each shard but a split's last holds shard_size tokens
        for k, name in enumerate(names):
            try:
                length = len(np.load(out_dir / name, mmap_mode="r")) if Path(name).name == name else -1
            except (OSError, ValueError):
                length = -1
            if length != min(run_args["shard_size"], saved["tokens"][split] - k * run_args["shard_size"]):
                raise UserError(f"--out {out_dir}: the shard {name} is missing or damaged; {start_over}")
    if saved_path.name == "meta.json":
        return None
    print(f"resuming {out_dir}: {len(saved['shards']['val'])} val and {len(saved['shards']['train'])} train shards "
          f"are finished; skipping {saved['resume']['document']:,} documents")
    return {**saved, "tokenizer": run_args["tokenizer"], "args": run_args}  # the same, but for the tokenizer's path


# ---------------------------------------------------------------- reading text (the same in every script)
# .txt and .jsonl are read with the standard library: `datasets`' loaders would turn CRLF into LF (no longer
# byte-identical to rustbpe), stop at invalid UTF-8, and take seconds to start. The Hub and parquet use `datasets`.

def hub_problem(timeout=3.0):  # None if the Hub can be used, else why not: a 3 s probe, where `datasets` would retry for ~25 s
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE"):  # huggingface_hub's own rule
            return f"the Hugging Face Hub is off ({name}={os.environ[name]})"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")  # a mirror, if set
    try:
        url = urllib.parse.urlsplit(endpoint)
        socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except (OSError, ValueError):
        return f"can't reach the Hugging Face Hub at {endpoint}"

def datasets_texts(where, node=None, **load):  # each row's "text", streamed; node=(rank, world_size): that rank's share
    import datasets.distributed  # here, not at the top: it takes seconds, and .txt/.jsonl never need it
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line
    try:
        rows = datasets.load_dataset(split="train", streaming=True, **load)
        for number, row in enumerate(datasets.distributed.split_dataset_by_node(rows, *node) if node else rows, 1):
            if not isinstance(text := row.get("text"), str):
                raise UserError(f"{where}, row {number}: \"text\" is {text!r:.20}, not a string (columns: {', '.join(row)})")
            yield text
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
    pieces, block = [], None
    with open(path, "rb") as f:
        while sum(map(len, pieces)) < budget and block != b"":
            block = f.read(1 << 24)
            pieces.append(decode_utf8(block, decoder, final=not block))  # the empty read at the end flushes
    yield "".join(pieces)[:budget]

def read_jsonl(path, start=0, end=None):  # the "text" of each line that starts in bytes [start, end)
    with open(path, "rb") as f:
        if start > 0:  # the range before owns the line holding byte start-1: tiling ranges read each line once
            f.seek(start - 1)
            f.readline()
        position = f.tell()
        for number, line in enumerate(f, 1):
            if end is not None and position >= end:
                return
            position += len(line)
            if not line.strip():
                continue
            try:
                text = json.loads(decode_utf8(line).lstrip("\ufeff"))["text"]  # a BOM, as Windows tools write
            except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, no "text", not an object, too deep
                text = None
            if not isinstance(text, str):
                where = f"{path}:{number}" if start == 0 else f"{path} (the line at byte {position - len(line)})"
                raise UserError(f"{where} is not a JSON object with a string \"text\" field; "
                                "each line of a .jsonl file must look like {\"text\": \"...\"}")
            if not text.isascii() and b"\xed" in text.encode("utf-8", "surrogatepass"):  # U+D000-DFFF: a lone "\ud800"?
                fixed = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")  # json joined real pairs
                BadUTF8.count, text = BadUTF8.count + fixed.count("\ufffd") - text.count("\ufffd"), fixed  # it has no UTF-8
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

def open_source(data, data_was_named):  # (documents, name, description); documents(budget) yields strings
    if data not in HUB_DATASETS:
        files = local_files(data)
        # parquet in batches of our own size: `datasets`' default, a row group's rows, is 0 in a file of no rows
        readers = {".txt": read_txt, ".jsonl": lambda path, budget: read_jsonl(path),
                   ".parquet": lambda p, _: datasets_texts(p, path="parquet", data_files=str(p), batch_size=1024)}
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
def complete(out_dir, tokenizer_meta, meta=None):
    """A copy of the BPE tokenizer, so that the dataset stands on its own; meta.json, last, as its presence says the
    dataset is complete; then no progress.json, nor a *.tmp that a killed run began and this one finished."""
    for name in ("tokenizer.tiktoken", "tokenizer.json") if tokenizer_meta["kind"] == "bpe" else ():
        (out_dir / f"{name}.tmp").write_bytes(Path(tokenizer_meta["path"], name).read_bytes())
        os.replace(out_dir / f"{name}.tmp", out_dir / name)  # train.py never reads half a tokenizer
    if meta:
        write_json(out_dir / "meta.json", meta)
    for leftover in [out_dir / "progress.json", *out_dir.glob("*.tmp")]:
        leftover.unlink(missing_ok=True)


def run(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=tokenizer, help="a BPE directory, a tiktoken name, or char")
    parser.add_argument("--data", default=None, help=f"{' | '.join(HUB_DATASETS)} | a file or directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default data/<source>_<tokenizer>)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="read only the first N characters")
    parser.add_argument("--max_tokens", type=int, default=max_tokens, help="stop after N tokens (train + val)")
    parser.add_argument("--shard_size", type=int, default=shard_size, help=f"tokens per shard (default {shard_size:,})")
    parser.add_argument("--val_tokens", type=int, default=val_tokens, help=f"tokens for val (default {val_tokens:,})")
    parser.add_argument("--workers", type=int, default=workers, help="tokenizer threads (default: every core)")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        raise UserError("--tokenizer is required: a directory from train_bpe_cpu.py, a tiktoken name (gpt2) or char")
    for flag, value in vars(args).items():
        if isinstance(value, int) and value <= 0:
            raise UserError(f"--{flag} {value}: must be a positive number")

    t0 = time.time()
    documents, source_name, source = open_source(args.data or data, args.data is not None)
    encoder, tokenizer_meta = load_tokenizer(args.tokenizer)
    # at char level a token is a character: both passes then read the same first max_tokens characters
    budget = min(args.num_chars or sys.maxsize, encoder is None and args.max_tokens or sys.maxsize)
    texts = lambda: (text for text in first_chars(documents, budget) if text)  # noqa: E731 (empty: not a document)
    tokenizer_name = Path(args.tokenizer).resolve().name
    name = tokenizer_name if tokenizer_name.startswith(source_name + "_") else f"{source_name}_{tokenizer_name}"
    out_dir = Path(args.out or Path("data", name))
    files = None if (args.data or data) in HUB_DATASETS else [  # a local source is known by its files
        [str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in local_files(args.data)]
    run_args = {"source": source, "tokenizer": tokenizer_meta, "num_chars": args.num_chars, "max_tokens": args.max_tokens,
                "shard_size": args.shard_size, "val_tokens": args.val_tokens, "files": files}
    state = resume_state(out_dir, run_args)
    if state is None:  # a rerun puts back the tokenizer files, and clears what a run killed after meta.json left
        complete(out_dir, tokenizer_meta)
        return print(f"{out_dir} is already complete with these arguments; nothing to do")

    if encoder is None:  # char level: pass 1 finds the vocabulary, every distinct character (progress.json keeps it)
        if "chars" not in state:
            state["chars"] = sorted(set(itertools.chain.from_iterable(
                tqdm(texts(), unit=" docs", desc="pass 1: characters", mininterval=0.5))))
            BadUTF8.count = 0  # pass 2 reads the same text again, and counts it again
        encoder = CharEncoder(state["chars"])
    # uint16 holds ids up to 65535, half the disk and memory bandwidth of uint32, which bigger vocabularies need
    dtype = np.uint16 if encoder.n_vocab <= 1 << 16 else np.uint32
    state.update(vocab_size=encoder.n_vocab, eot_token=encoder.eot_token, dtype=np.dtype(dtype).name)

    # encode in threads, and route to the shards one document late: the last one always trains
    shards, limit = Shards(out_dir, state, args), args.max_tokens or sys.maxsize
    start, offset = state["resume"]["document"], state["resume"]["offset"]
    total = start_total = sum(state["tokens"].values()) - offset  # the tokens before the resume point count
    stream = encode_in_threads(itertools.islice(texts(), start, None) if total < limit else (),
                               lambda batch: encode_batch(batch, encoder, dtype), args.workers)
    pending, t1 = None, time.time()
    with tqdm(unit="tok", unit_scale=True, desc="tokenizing", mininterval=0.5, initial=total, total=args.max_tokens) as bar:
        for index, (tokens, chars) in enumerate(stream, start):
            if pending:
                shards.route(*pending, is_last=False)
            pending = (index, tokens[:limit - total], chars, offset if index == start else 0)
            total += len(pending[1])
            bar.update(len(pending[1]))
            if total == limit:
                break
    if pending is None and start == 0:
        raise UserError(f"the dataset {source} is empty: no text to tokenize; point --data at files with text in them")
    if pending:  # (else: a resumed run whose every shard was finished)
        shards.route(*pending, is_last=True)
        shards.finish(pending[0] + 1, 0)
    t2 = time.time()
    complete(out_dir, tokenizer_meta, {key: value for key, value in state.items() if key != "resume"})

    tokens, shard_names = state["tokens"], state["shards"]
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD", file=sys.stderr)
    if args.num_chars and state["num_chars"] < args.num_chars and not args.max_tokens:
        print(f"the source ran out after {state['num_chars']:,} characters (asked for {args.num_chars:,})")
    if tokens["val"] > tokens["train"]:
        print(f"warning: val holds {tokens['val']:,} of {sum(tokens.values()):,} tokens; lower --val_tokens", file=sys.stderr)
    print(f"wrote {out_dir}: {tokens['train']:,} train tokens in {len(shard_names['train'])} shards, {tokens['val']:,} "
          f"val tokens in {len(shard_names['val'])}, {state['dtype']}, from {state['resume']['document']:,} documents")
    print(f"tokenizing {t2 - t1:.2f}s ({(total - start_total) / max(t2 - t1, 1e-9):,.0f} tokens/s) | total {t2 - t0:.2f}s")


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume; finished shards are kept", file=sys.stderr)
        sys.exit(130)
    except (UserError, OSError) as error:  # OSError: a full disk, a lost mount; the finished shards are safe
        advice = "; fix it and run the same command again to resume" if isinstance(error, OSError) else ""
        sys.exit(f"error: {error}{advice}")  # printed to stderr, exit status 1
