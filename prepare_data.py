"""
Turn text into token shards for train.py: fast, in flat memory, and resumable.

    python prepare_data.py --tokenizer tokenizers/stdlib_v1000
    python prepare_data.py --tokenizer gpt2 --data fineweb-edu --max_tokens 1000000000
    python prepare_data.py --tokenizer char --data ../shared/corpora/tinyshakespeare.txt

It writes --out/val_000000.npy, ..., train_000000.npy, ... and, last, meta.json.
Killed and rerun, it resumes. On many machines: --part K/N on each, then --merge N.
"""

import argparse, base64, codecs, fcntl, hashlib, itertools, json, os, signal, socket, stat, sys
import platform, sysconfig, time, urllib.parse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import regex
import tiktoken
from tqdm import tqdm

# === the settings, each overridable from the command line
data = "fineweb"  # fineweb(-edu) | openwebtext | tinystories | a .txt/.jsonl/.parquet file or dir
tokenizer = None  # a train_bpe_*.py directory | a tiktoken name (gpt2) | char
out = None  # data/<source>_<tokenizer>, or data/<tokenizer> if named after its source
num_chars = None  # read only the first N characters
max_tokens = None  # stop after N tokens, train + val
shard_size = 100_000_000  # tokens per shard: 200 MB of uint16, as in build-nanogpt
val_tokens = 1_000_000  # val: the first documents, up to this many tokens
workers = os.cpu_count()  # tokenizer threads
batch_chars = 1 << 20  # characters a thread encodes at once: enough to amortize, little memory
part = None  # K/N: only part K (0..N-1) of the files, into --out/part-K-of-N
merge = None  # N: link the N parts' shards into --out, in stream order
HUB_DATASETS = {  # name: (repository, config, parquet files)
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None),
    "openwebtext": ("Skylion007/openwebtext", None, "data/train-*.parquet"),
    "tinystories": ("roneneldan/TinyStories", None, None)}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")


# === step 1: tokenize the documents, in threads
# tiktoken's Rust core releases the GIL: threads use every core without a process pool's cost
# (pickling documents and tokens); encode_to_numpy builds no list of ints.
def encode_batch(texts, encoder, dtype, token_lengths):
    """Per text: ids (<|endoftext|>, none at char level, then its own), characters, UTF-8 bytes, and
    the bytes its ids spell (fewer if the split pattern left some unmatched)"""
    eot = np.array([] if encoder.eot_token is None else [encoder.eot_token], dtype)
    encoded = []
    for text in texts:
        try:  # "<|endoftext|>" in a text is plain text
            ids = encoder.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except ValueError as error:  # tiktoken's regex gives up on a million spaces
            raise UserError(f"tiktoken can't split a document ({error}); "
                            "shorten its runs of whitespace")
        ids = np.concatenate([eot, ids], dtype=dtype)
        text_bytes = len(text.encode("utf-8", "surrogatepass"))
        kept = text_bytes if token_lengths is None else int(token_lengths[ids].sum())
        encoded.append((ids, len(text), text_bytes, kept))
    return encoded


def encode_in_threads(texts, encode, workers):
    """encode's results, in order: threads encode batches of batch_chars characters while this one
    reads ahead, 2 per thread at most: flat memory."""
    pool, in_flight, batch, size = ThreadPoolExecutor(workers), deque(), [], 0
    try:
        for text in itertools.chain(texts, [None]):  # None: the end
            if text is not None:
                batch.append(text)
                size += len(text)
            if batch and (text is None or size >= batch_chars):
                in_flight.append(pool.submit(encode, batch))
                batch, size = [], 0
            while in_flight and (text is None or len(in_flight) > 2 * workers):
                yield from in_flight.popleft().result()
    finally:  # stopped early too: drop batches not begun
        pool.shutdown(cancel_futures=True)


class CharEncoder:
    """tiktoken's interface at char level: a character's id, its rank in the data's characters."""
    def __init__(self, chars):
        self.n_vocab, self.eot_token = len(chars), None
        self.ids = np.full(0x110000, len(chars), np.uint32)  # len(chars): not in the vocab
        self.ids[[ord(c) for c in chars]] = np.arange(len(chars))

    def encode_to_numpy(self, text, **_):
        ids = self.ids[np.frombuffer(text.encode("utf-32-le"), np.uint32)]
        if (ids == self.n_vocab).any():
            raise UserError("the data changed between the two passes (a new character); run again")
        return ids


# === step 2: write the shards
# Shard k of a split holds its tokens [k * shard_size, (k + 1) * shard_size): boundaries depend on
# the data alone. A .npy file is a 128-byte header and the raw array: tokens stream into NAME.tmp
# behind a placeholder header, the true one goes in when the shard is full, then it becomes NAME.
# Each finished shard saves progress.json: the meta.json to be, and where a rerun resumes.
class Shards:
    def __init__(self, out_dir, state, shard_size):
        self.out_dir, self.state, self.shard_size = out_dir, state, shard_size
        self.split, self.file, self.filled = None, None, 0

    def write(self, split, tokens, start, end, index):  # tokens[start:end] of document `index`
        if split != self.split:
            self.finish(index, start)
            self.split = split
        while start < end:
            if self.file is None:
                if not (self.out_dir / "progress.json").exists():
                    write_json(self.out_dir / "progress.json", self.state)
                name = f"{split}_{len(self.state['shards'][split]):06d}.npy"
                self.file = open(self.out_dir / f"{name}.tmp", "wb")
                self.file.write(bytes(128))
            chunk = tokens[start:min(end, start + self.shard_size - self.filled)]
            self.file.write(chunk)
            self.filled, start = self.filled + len(chunk), start + len(chunk)
            self.state["tokens"][split] += len(chunk)
            self.state["max_token_id"] = max(self.state["max_token_id"], int(chunk.max()))
            if self.filled == self.shard_size:
                self.finish(index, start)

    def finish(self, document, offset):
        """Close the open shard, if any; a rerun resumes at `document`'s token `offset`."""
        self.state["resume"].update(document=document, offset=offset)
        if self.file is None:
            return
        self.file.seek(0)
        header = {"descr": np.dtype(self.state["dtype"]).str, "fortran_order": False,
                  "shape": (self.filled,)}
        np.lib.format.write_array_header_1_0(self.file, header)
        self.file.flush()
        os.fsync(self.file.fileno())  # on disk before its name says it is whole
        self.file.close()
        self.state["shards"][self.split].append(Path(self.file.name).stem)
        os.replace(self.file.name, self.out_dir / Path(self.file.name).stem)
        write_json(self.out_dir / "progress.json", self.state)
        self.file, self.filled = None, 0


def write_json(path, obj):  # never half a file
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


# === step 3: the val split
# Val takes the first documents until it holds val_tokens (one at least); train takes the rest, and
# always the last. A lone document trains on its first 90% and validates on the rest, as in nanoGPT.
def val_split(first, size, skip, is_last, written, val_tokens):
    """Where a document's tokens [skip, size) go, as (split, start, end); `written`: each split's
    tokens, the first `skip` included (a resumed run's)."""
    if is_last and first:
        cut = size * 9 // 10  # below size: val gets a token
        return [("train", skip, cut), ("val", max(skip, cut), size)]
    val = not is_last and written["train"] == 0 and written["val"] - skip < val_tokens
    return [("val" if val else "train", skip, size)]


# === step 4: meta.json, last
def complete(out_dir, tokenizer_files, meta=None):
    """The BPE tokenizer's files (the dataset stands alone); meta.json, last: it says the dataset
    is complete; then no progress.json, nor a *.tmp of a killed run."""
    for name, content in tokenizer_files.items():
        (out_dir / f"{name}.tmp").write_bytes(content)
        os.replace(out_dir / f"{name}.tmp", out_dir / name)
    if meta:
        write_json(out_dir / "meta.json", meta)
    for leftover in [out_dir / "progress.json", *out_dir.glob("*.tmp")]:
        leftover.unlink(missing_ok=True)


# === the run: steps 1 to 4, in order
def run(argv):
    args, t0 = parse_args(argv), time.time()
    documents, source_name, source = open_source(args.data or data, args.data is not None, args.part)
    encoder, tokenizer_meta, tokenizer_files = load_tokenizer(args.tokenizer)
    (K, N), out_dir = args.part, output_dir(args, source_name)
    settings = run_args(args, source, tokenizer_meta)
    if args.merge:
        merged = merge_parts(out_dir, args.merge, settings, encoder, tokenizer_files)
        return warn(args, merged, 0, 0)
    if N > 1:  # its own dataset, merged later
        out_dir = out_dir / f"part-{K}-of-{N}"
    # char level: a token is a character; both passes read max_tokens characters
    budget = args.num_chars or sys.maxsize
    if encoder is None and args.max_tokens:
        budget = min(budget, args.max_tokens)

    def texts():  # an empty text is no document
        return (text for text in first_chars(documents, budget) if text)

    state = {"version": 1, "max_token_id": -1, "tokenizer": tokenizer_meta, "source": source,
             "num_chars": 0, "tokens": {"val": 0, "train": 0}, "shards": {"val": [], "train": []},
             "args": settings, "resume": {"document": 0, "offset": 0}}
    with writing_to(out_dir):
        state = resume_state(out_dir, state, encoder)
        if "resume" not in state:  # a meta.json
            complete(out_dir, tokenizer_files)
            return print(f"{out_dir} is already complete with these arguments; nothing to do")

        if encoder is None:  # char level: pass 1 finds the vocabulary, the characters used
            if "chars" not in state:
                state["chars"] = sorted(set(itertools.chain.from_iterable(
                    tqdm(texts(), unit=" docs", desc="pass 1: characters"))))
                BadUTF8.count = 0  # pass 2 reads (and counts) it again
            encoder = CharEncoder(state["chars"])
        # uint16 holds ids up to 65535: half uint32's disk and bandwidth
        dtype = np.uint16 if encoder.n_vocab <= 1 << 16 else np.uint32
        state.update(vocab_size=encoder.n_vocab, eot_token=encoder.eot_token,
                     dtype=np.dtype(dtype).name)
        token_lengths = None if args.tokenizer == "char" else token_byte_lengths(encoder)

        # steps 3 and 2 a document late: only the next one's arrival says it is not the last
        shards, limit = Shards(out_dir, state, args.shard_size), args.max_tokens or sys.maxsize
        start, offset = state["resume"]["document"], state["resume"]["offset"]
        total = start_total = sum(state["tokens"].values()) - offset  # those before `start`
        stream = encode_in_threads(itertools.islice(texts(), start, None) if total < limit else (),
                                   lambda batch: encode_batch(batch, encoder, dtype, token_lengths),
                                   args.workers)

        # val is part 0's, which must hold all of val
        def route(index, tokens, chars, skip, is_last):  # step 3, then step 2
            for split, begin, end in val_split(K == index == 0, len(tokens), skip,
                                               is_last and K == N - 1, state["tokens"],
                                               args.val_tokens if K == 0 else 0):
                shards.write(split, tokens, begin, end, index)
            state["num_chars"] += chars

        pending, bytes_read, bytes_kept, t1 = None, 0, 0, time.time()
        with tqdm(unit="tok", unit_scale=True, desc="tokenizing", initial=total,
                  total=args.max_tokens) as bar:
            for index, (tokens, chars, text_bytes, kept_bytes) in enumerate(stream, start):
                if pending:
                    route(*pending, is_last=False)
                pending = (index, tokens[:limit - total], chars, offset if index == start else 0)
                total += len(pending[1])
                bytes_read, bytes_kept = bytes_read + text_bytes, bytes_kept + kept_bytes
                bar.update(len(pending[1]))
                if total == limit:
                    break
        if N == 1 and start == 0 and (pending is None or (pending[0] == 0 and len(pending[1]) < 2)):
            raise UserError(f"the dataset {source} is empty or one token; point --data at text")
        if pending:  # (else a resumed run's shards were done)
            route(*pending, is_last=True)
            shards.finish(pending[0] + 1, 0)
        tokens = state["tokens"]
        if K == 0 < N - 1 and tokens["train"] == 0 and tokens["val"] < args.val_tokens:
            raise UserError("part 0 holds fewer tokens than --val_tokens: use fewer parts")
        t2 = time.time()
        complete(out_dir, tokenizer_files, {key: state[key] for key in state if key != "resume"})

    warn(args, state, bytes_read, bytes_kept)
    names = state["shards"]
    print(f"wrote {out_dir}: {tokens['train']:,} train tokens in {len(names['train'])} "
          f"shards, {tokens['val']:,} val tokens in {len(names['val'])}, {state['dtype']}, "
          f"from {state['resume']['document']:,} documents")
    tokens_per_second = (total - start_total) / max(t2 - t1, 1e-9)
    print(f"tokenizing {t2 - t1:.2f}s ({tokens_per_second:,.0f} tokens/s) | total {t2 - t0:.2f}s")
    if N > 1:
        print(f"then, all {N} parts done: --merge {N}")


# === plumbing: the command line, its checks, the warnings
class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=tokenizer, help="BPE dir, tiktoken name or char")
    parser.add_argument("--data", help=f"{' | '.join(HUB_DATASETS)} | a file or directory ({data})")
    parser.add_argument("--out", default=out, help="default data/<source>_<tokenizer>")
    parser.add_argument("--part", default=part, help="K/N")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="read N characters")
    for name, meaning in [("max_tokens", "stop after N tokens"), ("shard_size", "tokens per shard"),
                          ("val_tokens", "tokens for val"), ("workers", "tokenizer threads"),
                          ("merge", "merge N parts")]:
        default = globals()[name]
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{meaning} ({default})")
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        raise UserError("--tokenizer is required: a BPE directory, a tiktoken name or char")
    for flag, value in vars(args).items():
        if isinstance(value, int) and value <= 0:
            raise UserError(f"--{flag} {value}: must be a positive number")
        if isinstance(value, str) and regex.search("[\ud800-\udfff]", value):  # bad UTF-8
            raise UserError(f"--{flag} {value!r}: not valid UTF-8")
    env = os.environ  # a SLURM job array's task is a part
    try:
        if args.part is None and "SLURM_ARRAY_TASK_ID" in env and not args.merge:
            K = int(env["SLURM_ARRAY_TASK_ID"]) - int(env["SLURM_ARRAY_TASK_MIN"])
            args.part = f"{K}/{env['SLURM_ARRAY_TASK_COUNT']}"
        K, N = map(int, (args.part or "0/1").split("/"))
    except (ValueError, KeyError):
        K = N = 0
    if not 0 <= K < N:
        raise UserError(f"--part {args.part}: must be K/N, 0 <= K < N")
    args.part = (K, N)
    if args.merge == 1:
        raise UserError("--merge 1: one part is the whole run, already in --out; drop --merge")
    if (N > 1 or args.merge) and (args.tokenizer == "char" or args.max_tokens or args.num_chars):
        raise UserError("--part cuts the whole source: no --max_tokens, -n, nor char level")
    return args


def output_dir(args, source_name):
    name = Path(args.tokenizer).resolve().name
    name = name if name.startswith(source_name + "_") else f"{source_name}_{name}"
    return Path(args.out or Path("data", name))


def warn(args, state, bytes_read, bytes_kept):
    tokens, unmatched = state["tokens"], 1 - bytes_kept / max(bytes_read, 1)
    for failed, warning in [
            (BadUTF8.count, f"{BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD"),
            (bytes_kept < bytes_read, f"the split pattern matched {bytes_kept:,} of {bytes_read:,} "
             f"bytes; the other {unmatched:.1%} are not in the shards (tiktoken drops them)"),
            (tokens["val"] > tokens["train"] and args.part[1] == 1, f"val holds {tokens['val']:,} of "
             f"{sum(tokens.values()):,} tokens; lower --val_tokens")]:
        if failed:
            print(f"warning: {warning}", file=sys.stderr)
    if args.num_chars and state["num_chars"] < args.num_chars and not args.max_tokens:
        print(f"the source ran out after {state['num_chars']:,} of {args.num_chars:,} characters")


# === plumbing: the tokenizer and its checks
def load_tokenizer(name):
    """--tokenizer -> (tiktoken's encoder, None at char level; meta.json's entry; its files)"""
    if name == "char":
        return None, {"kind": "char"}, {}
    if not Path(name).exists():
        if name not in tiktoken.list_encoding_names():
            raise UserError(f"--tokenizer {name}: no such directory, and not a tiktoken encoding "
                            f"({', '.join(tiktoken.list_encoding_names())}) or char")
        try:  # the first use downloads and caches the ranks
            return tiktoken.get_encoding(name), {"kind": "tiktoken", "name": name}, {}
        except Exception as error:  # requests' connection errors
            raise UserError(f"--tokenizer {name}: tiktoken could not download its ranks "
                            f"({type(error).__name__}); it needs internet once")
    try:
        files = {f: read_whole(Path(name, f), 2**26) for f in ("tokenizer.tiktoken", "tokenizer.json")}
        info = json.loads(files["tokenizer.json"])
        lines = [line.split() for line in files["tokenizer.tiktoken"].splitlines() if line.strip()]
        ranks = {base64.b64decode(token, validate=True): int(rank) for token, rank in lines}
        pattern, special_tokens = info["pattern"], info["special_tokens"]
        problem = tokenizer_problem(ranks, special_tokens)
        if problem is None:
            vocab_size = max([len(ranks) - 1, *special_tokens.values()]) + 1
            checks = [("<|endoftext|>" not in special_tokens, "it has no <|endoftext|>"),
                      (regex.compile(pattern).fullmatch("") is not None,  # else tiktoken panics
                       f"its pattern {pattern!r} matches the empty string"),
                      (info.get("vocab_size", vocab_size) != vocab_size,
                       f"its vocab_size is {info.get('vocab_size')!r}; its ids make {vocab_size}")]
            problem = next((message for failed, message in checks if failed), None)
        if problem is None:  # Rust's regex refuses some of regex's (\X)
            encoder = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks,
                                        special_tokens=special_tokens)
    except FileNotFoundError as error:
        problem = f"{Path(error.filename).name} is missing"
    except Exception as error:  # not JSON, not base64, no "pattern"
        problem = f"it can't be read ({type(error).__name__}: {error})".splitlines()[0]
    if problem is not None:
        raise UserError(f"--tokenizer {name}: {problem}; use one from train_bpe_cpu.py")
    sha256 = hashlib.sha256(files["tokenizer.tiktoken"]).hexdigest()
    return encoder, {"kind": "bpe", "path": name, "sha256": sha256, "pattern": pattern,
                     "special_tokens": special_tokens}, files


def tokenizer_problem(ranks, special_tokens):
    """Why BPE ranks (token bytes -> id) and special tokens (name -> id) can't be a tokenizer, or None."""
    size = len(ranks)
    if sorted(ranks.values()) != list(range(size)):
        return f"its ranks are not 0..{size - 1}, each exactly once"
    if sorted(token for token, rank in ranks.items() if rank < 256) != [bytes([b]) for b in range(256)]:
        return "its ranks 0-255 are not the 256 single bytes"
    for name, token_id in special_tokens.items():
        if type(token_id) is not int or token_id < size:
            return f"special token {name!r} has id {token_id!r}; special tokens take the ids from {size} up"
    return None


def token_byte_lengths(encoder):  # each id's bytes; 0 for special tokens
    lengths = np.zeros(encoder.n_vocab, np.uint32)
    for token in encoder.token_byte_values():
        lengths[encoder.encode_single_token(token)] = len(token)
    return lengths


# === plumbing: resuming, and the lock on --out
def run_args(args, source, tokenizer_meta):  # what decides the shards
    files = None  # a local source is its files: edited ones don't resume
    if (args.data or data) not in HUB_DATASETS:
        files = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in local_files(args.data)]
    return {"source": source, "tokenizer": tokenizer_meta, "num_chars": args.num_chars,
            "part": list(args.part) if args.part[1] > 1 else None, "max_tokens": args.max_tokens,
            "shard_size": args.shard_size, "val_tokens": args.val_tokens, "files": files}


def resume_state(out_dir, state, encoder):
    """`state` for a new dataset, or, if the same settings made it and its shards are whole, a
    complete one's meta.json, or a killed run's state."""
    saved_path = next((path for path in [out_dir / "meta.json", out_dir / "progress.json"]
                       if path.exists()), None)
    if saved_path is None:
        if any(not path.name.endswith(".tmp") for path in out_dir.iterdir()):
            raise UserError(f"--out {out_dir} is not empty and was not made by prepare_data.py")
        return state
    vocabulary = {}  # the ids decide the shards too (char level: the data's)
    if encoder is not None:
        vocabulary = {"vocab_size": encoder.n_vocab, "eot_token": encoder.eot_token}
    start_over = f"delete {out_dir} to start over"
    try:
        saved = json.loads(read_whole(saved_path, 2**26))
        numbers = [saved["max_token_id"] + 1, saved["num_chars"], *saved["tokens"].values(),
                   *map(ord, saved.get("chars", []))]
        if saved_path.name == "progress.json":  # (an older one's has no "resume")
            numbers += saved["resume"].values()
        if any(type(n) is not int or n < 0 for n in numbers):
            raise ValueError
        before = shard_settings(saved["args"], {key: saved[key] for key in vocabulary})
        damaged = damaged_shard(out_dir, saved, state["args"]["shard_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"--out {out_dir}: {saved_path.name} is unreadable; {start_over}")
    now = shard_settings(state["args"], vocabulary)
    changed = next((key for key in now if now[key] != before.get(key)), None)
    why = f"other arguments ({changed}: {before.get(changed)!r}, now {now.get(changed)!r})"
    if changed == "files":
        why = "other source files, or edited ones"
    elif changed not in before:
        why = "an older prepare_data.py"
    if changed is not None:
        raise UserError(f"--out {out_dir}: made with {why}; use another --out, or {start_over}")
    if damaged is not None:
        raise UserError(f"--out {out_dir}: the shard {damaged} is missing or damaged; {start_over}")
    if saved_path.name == "meta.json":
        return saved
    print(f"resuming {out_dir} at document {saved['resume']['document']:,}")
    return {**saved, "tokenizer": state["tokenizer"], "args": state["args"]}  # today's path


def shard_settings(run_args, vocabulary):  # all but the tokenizer's path
    settings = {**run_args, **vocabulary}
    for key, value in settings.pop("tokenizer").items():
        settings[f"tokenizer's {key}"] = value if key != "path" else None
    return settings


def damaged_shard(out_dir, saved, shard_size):  # a missing or cut shard, or None
    for split, names in saved["shards"].items():
        for k, name in enumerate(names):
            path = out_dir / name
            try:  # (a name with a directory is no shard, nor a pipe: np.load would wait)
                shard = path.parent == out_dir and path.is_file()
                length = len(np.load(path, mmap_mode="r")) if shard else -1
            except (OSError, ValueError, EOFError):
                length = -1
            if length != min(shard_size, saved["tokens"][split] - k * shard_size):
                return name
    return None


def read_whole(path, limit):  # a device or FIFO may not end, a huge file fill memory
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:  # (a FIFO's open waits)
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode) or status.st_size > limit:
            raise UserError(f"{path}: not a regular file of at most {limit:,} bytes")
        return file.read(limit)


def merge_parts(out_dir, count, now, encoder, tokenizer_files):
    """The parts' shards hard-linked into out_dir as one run names them, then meta.json."""
    parts = [out_dir / f"part-{k}-of-{count}" for k in range(count)]
    missing = [path.name for path in parts if not (path / "meta.json").exists()]
    if missing:
        raise UserError(f"--merge {count}: {', '.join(missing)} missing or unfinished; run them")
    metas = [resume_state(path, {"args": {**now, "part": [k, count]}}, encoder)  # or an error line
             for k, path in enumerate(parts)]
    tokens = {split: sum(meta["tokens"][split] for meta in metas) for split in ("val", "train")}
    if tokens["train"] == 0:  # part 0 can't know it has the last document, which trains
        raise UserError(f"--merge {count}: part 0 holds all documents, in val; run once, into another --out")
    merged = {**metas[0], "args": {**now, "part": count}, "shards": {"val": [], "train": []},
              "tokens": tokens, "num_chars": sum(m["num_chars"] for m in metas),
              "max_token_id": max(m["max_token_id"] for m in metas)}
    with writing_to(out_dir):
        (out_dir / "meta.json").unlink(missing_ok=True)  # complete once it is back
        for path in out_dir.iterdir():  # an earlier merge's, maybe more
            if regex.fullmatch("(val|train)_[0-9]{6,}[.]npy", path.name):
                path.unlink()
        for path, meta in zip(parts, metas):
            for split, names in meta["shards"].items():
                for name in names:
                    link = out_dir / f"{split}_{len(merged['shards'][split]):06d}.npy"
                    os.link(path / name, link)
                    merged["shards"][split].append(link.name)
        complete(out_dir, tokenizer_files, merged)
    print(f"merged {count} parts into {out_dir}")
    return merged


@contextmanager
def writing_to(out_dir):
    """Make out_dir and lock it; a failed run removes the empty directories it made."""
    made = [path for path in [out_dir, *out_dir.parents] if not path.is_dir()]
    for path in made:
        if path.exists():
            raise UserError(f"--out {out_dir}: {path} is a file, not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_directory(out_dir)
    try:
        yield
    except BaseException:
        for path in made:
            if not any(path.iterdir()):
                path.rmdir()
        raise
    finally:
        os.close(lock)


def lock_directory(path):
    """One writer per directory: an OS lock on `path`, held while this process lives (the kernel
    drops it even after kill -9: no stale lock)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise UserError(f"{path}: another run is writing there; wait for it to end, "
                        "or choose another directory")
    except OSError as error:  # no flock (some Lustre, NFS mounts)
        print(f"warning: {path}: can't lock it ({error.strerror}); make sure that one run at a time "
              "writes there", file=sys.stderr)
    return descriptor  # keep it open: closing it unlocks


# === plumbing: reading text
def open_source(data, data_was_named, part):  # (documents(budget) -> texts, name, description)
    if data not in HUB_DATASETS:
        files = local_files(data)
        return (lambda budget: part_texts(files, part, budget)), Path(data).stem, str(data)
    if part[1] > 1:  # a Hub stream can't be cut in order; files can
        raise UserError(f"--part: download {data}'s files; use --data on them")
    repository, config, parquet_files = HUB_DATASETS[data]
    load = dict(path=repository, name=config)
    if parquet_files:  # by path: `datasets` then never runs an old loading script
        load = dict(path="parquet", data_files=f"hf://datasets/{repository}/{parquet_files}")
    problem = hub_problem()
    if problem is None:
        description = f"{repository} {config}" if config else repository
        return (lambda budget: datasets_texts(repository, **load)), data, description
    if data_was_named:
        raise UserError(f"{problem}, needed for --data {data}; use --data path/to/files instead")
    print(f"warning: {problem}: using the offline corpus, Python's stdlib", file=sys.stderr)
    version = platform.python_version()  # each one's stdlib differs: a resume compares it
    return stdlib_documents, "stdlib", f"Python {version} stdlib (offline fallback)"

def hub_problem(timeout=3.0):  # None, or why the Hub can't be used, in 3 s
    for switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(switch, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"the Hugging Face Hub is off ({switch}={os.environ[switch]})"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        url = urllib.parse.urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname or "", port), timeout).close()
    except (OSError, ValueError):
        return f"can't reach the Hugging Face Hub at {endpoint}"

def stdlib_documents(budget=None):  # the offline corpus, real text on every machine
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    files = [file for file in files if "site-packages" not in file.parts]
    return (next(read_txt(file, sys.maxsize)) for file in files)

def datasets_texts(where, **load):  # the rows' "text", streamed
    import datasets  # here: seconds to import; local files never need it
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as ours
    try:
        rows = datasets.load_dataset(split="train", streaming=True, **load)
        for number, row in enumerate(rows, 1):
            if not isinstance(row.get("text"), str):
                raise ValueError(f'row {number} has no string "text": {row!r:.50}')
            yield row["text"]
    except Exception as error:  # a bad row, no such dataset, a corrupt file, a lost link
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"can't read {where} ({reason}); check it, or use other files")

def local_files(data):  # the file, or a directory's files, sorted; regular files only (a pipe
    path = Path(data)  # may never end)
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    files = [file for file in files if file.suffix in LOCAL_SUFFIXES and file.is_file()]
    if not files:
        kinds = f"a .txt, .jsonl or .parquet file, a directory of them, {', '.join(HUB_DATASETS)}"
        raise UserError(f"--data {data} is none of: {kinds}")
    return files

def part_texts(files, part, budget):  # part K/N: the documents starting in bytes [K S/N, (K+1)
    # S/N) of the files' S bytes end to end (as train_bpe_multigpu.py's ranks)
    sizes = [path.stat().st_size for path in files]
    lo, hi = sum(sizes) * part[0] // part[1], sum(sizes) * (part[0] + 1) // part[1]
    for path, first, size in zip(files, itertools.accumulate([0] + sizes), sizes):
        if path.suffix == ".txt" and lo <= first < hi:
            yield from read_txt(path, budget)
        elif path.suffix != ".txt" and (first < hi and lo < first + size or not size):
            read = read_jsonl if path.suffix == ".jsonl" else read_parquet
            yield from read(path, max(lo - first, 0), hi - first)

def read_parquet(path, start, end):  # the "text" of each row group placed in bytes [start, end)
    import pyarrow.parquet
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        if "text" not in parquet.schema_arrow.names:
            raise ValueError('no "text" column')
        # a group sits at its share of the bytes: ranges tile them
        size, groups = os.path.getsize(path), parquet.num_row_groups
        ours = [group for group in range(groups) if start <= size * group // groups < end]
        for batch in parquet.iter_batches(1024, ours, columns=["text"]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise ValueError(f'a row\'s "text" is {text!r:.50}, not a string')
                yield text
    except Exception as error:
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"can't read {path} ({reason}); check it, or use other files")

def read_txt(path, budget):  # one document, CRLF kept, read as far as the budget needs
    with open(path, encoding="utf-8", errors=BadUTF8.errors, newline="") as f:
        yield f.read(budget if budget < os.path.getsize(path) else -1)  # N bytes: <= N characters

def read_jsonl(path, start, end):  # the "text" of each line starting in bytes [start, end)
    with open(path, "rb") as f:
        if start > 0:  # the line holding byte start-1 is the range's before: ranges tile the file
            f.seek(start - 1)
            f.readline()
        line_end = f.tell()
        for number, line in enumerate(f, 1):
            line_start, line_end = line_end, line_end + len(line)
            if line_start >= end:
                return
            if not line.strip():
                continue
            try:
                text = json.loads(line.decode("utf-8", BadUTF8.errors).lstrip("\ufeff"))["text"]
            except (ValueError, KeyError, TypeError, RecursionError):
                text = None
            if not isinstance(text, str):
                where = f"{path} (the line at byte {line_start})" if start else f"{path}:{number}"
                raise UserError(f'{where} is not a JSON object with a string "text" field')
            if not text.isascii():
                text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", BadUTF8.errors)
            yield text

class BadUTF8:  # invalid UTF-8 and lone surrogates: each read as U+FFFD, and counted
    count = 0

    def replace(error):  # a codec error handler: errors="replace", counted
        BadUTF8.count += 1
        return "\ufffd", error.end

BadUTF8.errors = f"replace and count {id(BadUTF8)}"  # its own name: a process may load two scripts
codecs.register_error(BadUTF8.errors, BadUTF8.replace)

def first_chars(documents, num_chars):  # the last document is cut to fit
    for document in documents(num_chars):
        yield document[:num_chars]
        num_chars -= min(len(document), num_chars)
        if num_chars == 0:
            return  # before the source is asked for one more document: it may be slow, or malformed

# === plumbing: the command line runs run(); an error is one line
def stopped(signum, frame):  # kill, scancel, SLURM's time limit: as Ctrl-C
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stopped)
    try:
        run(sys.argv[1:])
    except KeyboardInterrupt as stop:
        print(f"\n{str(stop) or 'interrupted'}: run the same command again to resume; finished "
              "shards are kept", file=sys.stderr)
        sys.exit(143 if str(stop) else 130)
    except UserError as error:
        sys.exit(f"error: {error}")  # to stderr, exit status 1
    except OSError as error:  # a full disk, a lost mount
        sys.exit(f"error: {error}; fix it and run the same command again to resume")
