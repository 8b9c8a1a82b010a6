"""
Train a byte-level BPE tokenizer on the CPU: exact, and fast enough for real data.

    python train_bpe_cpu.py -v 1000 -n 1048576
    python train_bpe_cpu.py --data ../shared/corpora/enwiki.jsonl -v 8192 -n 16777216

On the first n characters of FineWeb, or of local files, it
1. splits the text into chunks with a regex and counts each distinct chunk once,
2. counts adjacent token pairs, each weighted by its chunk's count,
3. merges the most frequent pair, again and again, visiting only where it occurs,
and writes tokenizer.tiktoken (tiktoken's ranks) and tokenizer.json (pattern, special tokens)
to tokenizers/<source>_v<vocab_size>.
"""

import argparse, atexit, base64, codecs, fcntl, heapq, json, os, signal, socket, sys, sysconfig
import time, urllib.parse
from collections import Counter, defaultdict
from pathlib import Path

import regex
from tqdm import tqdm

# ---
# defaults, each overridable from the command line
vocab_size = 1000  # 256 byte tokens + merges; <|endoftext|> gets the next id
num_chars = 1048576  # train on the first 2^20 characters
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory
# GPT-4's split pattern: letters with their leading space, up to 3 digits, punctuation runs,
# whitespace; no merge glues a word to what follows it.
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
# ---


# --- step 1: count distinct chunks
# All later work is on distinct chunks, 9x fewer than chunks at 2^20 enwiki characters, 24x at 2^24.

def count_chunks(documents, split_pattern, num_chars):
    """The documents' chunks, each distinct one counted (none spans 2 documents)."""
    chunk_counts, chars_read = Counter(), 0
    with tqdm(total=num_chars, unit="char", unit_scale=True, desc="reading") as bar:
        for number, document in enumerate(documents, 1):
            chunk_counts.update(split_in_time(split_pattern, document, number))
            chars_read += len(document)
            bar.update(len(document))
    return chunk_counts, chars_read


# --- step 2: count pairs
# The distinct chunks lie in one flat list of token ids, linked: next_pos[i] is the position after
# i in its chunk (-1 at its end), prev_pos[i] the one before. Merging the pair at i is O(1): a merge
# costs its occurrences only.

def build_symbols(chunk_counts):
    """The distinct chunks as (ids, prev_pos, next_pos, weight), one entry per UTF-8 byte."""
    ids, prev_pos, next_pos, weight = [], [], [], []
    for chunk, count in chunk_counts.items():
        start, chunk_bytes = len(ids), chunk.encode("utf-8")
        ids.extend(chunk_bytes)
        prev_pos.extend([-1, *range(start, len(ids) - 1)])
        next_pos.extend([*range(start + 1, len(ids)), -1])
        weight.extend([count] * len(chunk_bytes))
    return ids, prev_pos, next_pos, weight


def count_pairs(ids, next_pos, weight):
    """pair_counts[(a, b)]: weighted occurrences; pair_positions[(a, b)]: their starts."""
    pair_counts, pair_positions = Counter(), defaultdict(list)
    for position, right in enumerate(next_pos):
        if right != -1:
            pair = (ids[position], ids[right])
            pair_counts[pair] += weight[position]
            pair_positions[pair].append(position)
    return pair_counts, pair_positions


# --- step 3: the merge loop

def merge_pair(pair, new_id, ids, prev_pos, next_pos, weight, pair_counts, pair_positions):
    """Replace each occurrence of `pair` by `new_id`, left to right, updating the pair counts ->
    the pairs whose counts changed, the (weighted) tokens saved."""
    left, right = pair
    # the neighbours' deltas: (x, left) -> (x, new), (right, y) -> (new, y)
    changed, tokens_saved = Counter(), 0
    # Positions may be stale or repeated: checking ids is cheaper than exact sets. Sorted, a chunk's
    # occurrences go left to right: "aaa" becomes [aa, a].
    for position in sorted(set(pair_positions.pop(pair))):
        second = next_pos[position]
        if ids[position] != left or second == -1 or ids[second] != right:
            continue  # stale, or the right half of one just merged ("aaa")
        count = weight[position]
        before, after = prev_pos[position], next_pos[second]
        if before != -1:
            changed[(ids[before], left)] -= count
            changed[(ids[before], new_id)] += count
            pair_positions[(ids[before], new_id)].append(before)
        if after != -1:
            changed[(right, ids[after])] -= count
            changed[(new_id, ids[after])] += count
            pair_positions[(new_id, ids[after])].append(position)
            prev_pos[after] = position
        ids[position], ids[second], next_pos[position] = new_id, -1, after  # unlink the right token
        tokens_saved += count
    # The pair is gone (none adjacent is left), and so are its deltas ("aaaa": the middle (a, a)).
    del pair_counts[pair]
    changed.pop(pair, None)
    changed = {other: delta for other, delta in changed.items() if delta}
    pair_counts.update(changed)  # a Counter adds the deltas
    return list(changed), tokens_saved


def train(chunk_counts, vocab_size):
    """The merges, ((left, right), new id) in order, and the text's tokens after them."""
    ids, prev_pos, next_pos, weight = build_symbols(chunk_counts)
    total_tokens = sum(weight)  # before any merge: the text's UTF-8 bytes
    pair_counts, pair_positions = count_pairs(ids, next_pos, weight)
    # A heap of (-count, pair) pops the highest count, ties to the smallest pair. A changed count is
    # pushed anew; an entry that no longer matches is skipped when popped ("lazy deletion").
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    with tqdm(total=vocab_size - 256, unit="merge", desc="merging") as bar:
        while 256 + len(merges) < vocab_size and heap:
            negative_count, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) != -negative_count:
                continue  # stale
            new_id = 256 + len(merges)
            merges.append((pair, new_id))
            changed, tokens_saved = merge_pair(pair, new_id, ids, prev_pos, next_pos, weight,
                                               pair_counts, pair_positions)
            total_tokens -= tokens_saved
            for other in changed:
                if pair_counts[other] > 0:
                    heapq.heappush(heap, (-pair_counts[other], other))
                else:  # no occurrence left
                    del pair_counts[other]
                    pair_positions.pop(other, None)
            bar.update(1)
    return merges, total_tokens


# --- output

def vocab_bytes(merges):
    """Every token's bytes, in rank order: 0-255 are the bytes, a merge is its two halves glued."""
    vocab = [bytes([byte]) for byte in range(256)]
    for (left, right), _ in merges:
        vocab.append(vocab[left] + vocab[right])
    return vocab


def save_tokenizer(out_dir, merges, info):
    """The ranks in tokenizer.tiktoken, `info` in tokenizer.json, renamed from whole .tmp files."""
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                    for rank, token in enumerate(vocab_bytes(merges)))
    settings = json.dumps(info, indent=2, ensure_ascii=False) + "\n"
    tmps = {out_dir / "tokenizer.tiktoken.tmp": ranks, out_dir / "tokenizer.json.tmp": settings}
    try:
        for tmp, text in tmps.items():
            tmp.write_text(text, encoding="utf-8")
        for tmp in tmps:
            tmp.replace(tmp.with_suffix(""))
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)


# --- the run

def run(argv):
    args = parse_args(argv)
    split_pattern = validate(args)
    documents, source_name, source = open_source(args.data or data, args.data is not None)
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    out_lock = check_out_dir(out_dir)  # held to the end: one run per out_dir

    t0 = time.time()
    first_documents = first_chars(documents, args.num_chars)
    chunk_counts, chars_read = count_chunks(first_documents, split_pattern, args.num_chars)
    t1 = time.time()
    check_text(args, source, chunk_counts, chars_read)
    print(f"read {chars_read:,} characters: {sum(chunk_counts.values()):,} chunks, "
          f"{len(chunk_counts):,} distinct")
    merges, total_tokens = train(chunk_counts, args.vocab_size)
    t2 = time.time()

    num_merges, eot_id = len(merges), 256 + len(merges)  # <|endoftext|>: the next id
    stop_reason = "vocab_size reached" if eot_id == args.vocab_size else "no pairs left to merge"
    if eot_id < args.vocab_size:
        print(f"stopped early after {num_merges} merges: {stop_reason} "
              f"(vocab {eot_id} < {args.vocab_size})")
    save_tokenizer(out_dir, merges, {
        "pattern": args.pattern, "special_tokens": {EOT: eot_id}, "vocab_size": eot_id + 1,
        "num_merges": num_merges, "num_chars": chars_read, "source": source,
        "trainer": "train_bpe_cpu.py", "seconds": round(t2 - t0, 3), "stop_reason": stop_reason})
    total_bytes = sum(len(chunk.encode("utf-8")) * count for chunk, count in chunk_counts.items())
    print(f"reading + pre-tokenizing {t1 - t0:.2f}s | merging {t2 - t1:.2f}s "
          f"({num_merges / max(t2 - t1, 1e-9):,.0f} merges/s) | total {t2 - t0:.2f}s")
    print(f"compression on the training text: {total_bytes / max(total_tokens, 1):.3f} bytes/token "
          f"({total_bytes:,} bytes -> {total_tokens:,} tokens)")
    print(f"wrote {out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, "
          f"vocab_size {eot_id + 1})")
    os.close(out_lock)


# === plumbing: the checks, one line per bad input


class UserError(Exception):
    """A mistake in the input: one line, never a traceback."""


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size)
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars)
    parser.add_argument("--data", help=f"fineweb, fineweb-edu, or local files (default {data})")
    parser.add_argument("--out", default=out, help="default tokenizers/<source>_v<vocab_size>")
    parser.add_argument("--pattern", default=pattern, help="the split regex (default GPT-4's)")
    return parser.parse_args(argv)


def validate(args):
    """The settings, checked before any work -> the compiled pattern."""
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); fix it, or leave it out")
    if split_pattern.groups:
        raise UserError(f"--pattern {args.pattern!r} has a capturing group; use (?:...)")
    if not 256 <= args.vocab_size < 2**31:
        raise UserError(f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes) and 2^31-1")
    if args.num_chars <= 0:
        raise UserError(f"-n {args.num_chars}: must be positive")
    split_in_time(split_pattern, "", 0)  # '' or 'x*': refused before any reading
    return split_pattern


def time_is_up(signum, frame):
    raise TimeoutError


def split_in_time(split_pattern, document, number):
    """The document's chunks, under a CPU-time alarm (1 s + 10 s per million characters; GPT-4's:
    0.3 s) against a pattern backtracking without end ((a|a)+b); regex's timeout= is 3x slower."""
    signal.signal(signal.SIGPROF, time_is_up)
    signal.setitimer(signal.ITIMER_PROF, 1 + len(document) / 1e5)
    try:
        chunks = split_pattern.findall(document)
    except TimeoutError:
        raise UserError(f"--pattern {split_pattern.pattern!r} backtracks catastrophically: "
                        f"it ran past the time limit on document {number} ({document[:30]!r}...); "
                        "simplify it")
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    if "" in chunks:  # an empty chunk holds no bytes to merge
        raise UserError(f"--pattern {split_pattern.pattern!r} matches the empty string; "
                        "each match must take a character (x+, not x*)")
    return chunks


def check_text(args, source, chunk_counts, chars_read):
    """No text is an error; bytes not UTF-8, or text the pattern skips, a warning."""
    if chars_read == 0:
        raise UserError(f"the corpus {source} is empty; point --data at text")
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD",
              file=sys.stderr)
    matched = sum(len(chunk) * count for chunk, count in chunk_counts.items())
    if matched < chars_read:
        print(f"warning: the split pattern matched {matched:,} of {chars_read:,} characters; "
              f"the other {1 - matched / chars_read:.1%} are dropped (tiktoken drops them too)",
              file=sys.stderr)
    if chars_read < args.num_chars:
        print(f"the source ran out after {chars_read:,} characters (asked for {args.num_chars:,}); "
              "training on those")


def check_out_dir(out_dir):
    """Refuse a bad --out before any work, make it, and return its lock (held while we run)."""
    for path in [out_dir, *out_dir.parents]:
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {out_dir}: {path} is a file, not a directory; give a directory")
    ours = {"tokenizer.tiktoken", "tokenizer.json", "tokenizer.tiktoken.tmp", "tokenizer.json.tmp"}
    others = sorted(set(os.listdir(out_dir)) - ours) if out_dir.is_dir() else []
    if others:  # a dataset's, say: don't overwrite its tokenizer
        dataset = {"meta.json", "progress.json"} & set(others)
        what = "a dataset directory" if dataset else "not a tokenizer directory"
        raise UserError(f"--out {out_dir} is {what} (it holds {others[0]}); "
                        "give a new or a tokenizer directory")
    made = [path for path in [out_dir, *out_dir.parents] if not path.exists()]

    def remove_made():  # deepest first; rmdir refuses a directory with files (a finished run)
        for path in made:
            try:
                path.rmdir()
            except OSError:
                return

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        descriptor = lock_directory(out_dir)
        atexit.register(remove_made)  # a failed run leaves nothing; only the lock's holder removes
        # a probe, the one sure test (root passes os.access even on /proc)
        (out_dir / "tokenizer.json.tmp").write_text("")
        (out_dir / "tokenizer.json.tmp").unlink()
    except OSError as error:
        remove_made()
        raise UserError(f"--out {out_dir} can't be written ({error.strerror or error}); "
                        "give a directory you can write")
    return descriptor


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


# === plumbing: reading text (each function the same in every script it stands in). .txt and
# .jsonl are read with the standard library: `datasets` would turn CRLF into LF (no longer
# rustbpe's bytes), stop at invalid UTF-8, and start slowly.
HUB_DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "sample-10BT"),  # (repository, config)
                "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT")}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")

def open_source(data, data_was_named):  # (documents, name, description); documents(budget) -> texts
    if data not in HUB_DATASETS:
        files = local_files(data)
        return (lambda budget: local_texts(files, budget)), Path(data).stem, str(data)
    repository, config = HUB_DATASETS[data]
    problem = hub_problem()
    if problem is None:
        texts = lambda budget: datasets_texts(repository, path=repository, name=config)  # noqa
        return texts, data, f"{repository} {config}"
    if data_was_named:  # the default source falls back to the offline corpus; a named one refuses
        raise UserError(f"{problem}, needed for --data {data}; use --data path/to/files instead")
    print(f"warning: {problem}: using the offline corpus, Python's stdlib", file=sys.stderr)
    return stdlib_documents, "stdlib", "Python standard library source (offline fallback)"

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

def local_texts(files, budget):  # a document is a .txt file, a .jsonl line, a .parquet row
    for path in files:
        if path.suffix == ".parquet":
            yield from read_parquet(path)
        else:
            yield from read_txt(path, budget) if path.suffix == ".txt" else read_jsonl(path)

def read_parquet(path):  # the "text" of each row
    import pyarrow.parquet  # here, as .txt and .jsonl never need it; 10x less CPU than `datasets`
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        if "text" not in parquet.schema_arrow.names:
            raise ValueError('no "text" column')
        for batch in parquet.iter_batches(1024, columns=["text"]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise ValueError(f'a row\'s "text" is {text!r:.50}, not a string')
                yield text
    except Exception as error:  # not parquet, corrupt, no "text" column, a "text" not a string
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"can't read {path} ({reason}); check it, or use other files")

def read_txt(path, budget):  # one document, CRLF kept, read as far as the budget needs
    with open(path, encoding="utf-8", errors=BadUTF8.errors, newline="") as f:
        yield f.read(budget if budget < os.path.getsize(path) else -1)  # N bytes: <= N characters

def read_jsonl(path):  # the "text" of each line
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:  # a BOM, as Windows tools write it, is no part of the JSON
                text = json.loads(line.decode("utf-8", BadUTF8.errors).lstrip("\ufeff"))["text"]
            except (ValueError, KeyError, TypeError, RecursionError):
                text = None
            if not isinstance(text, str):
                raise UserError(f'{path}:{number} is not a JSON object with a string "text" field')
            if not text.isascii():  # "\ud800" is valid JSON, but a lone surrogate has no UTF-8
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

# === the command line: run, and each mistake in one line
if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except (UserError, OSError) as error:  # OSError: an unreadable file, a full disk
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
