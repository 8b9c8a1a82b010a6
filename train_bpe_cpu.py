"""
Train a byte-level BPE tokenizer on the CPU: exact, and fast enough for real data.

    python train_bpe_cpu.py -v 1000 -n 1048576
    python train_bpe_cpu.py --data ../shared/corpora/enwiki.jsonl -v 8192 -n 16777216

It writes tokenizers/<source>_v<vocab_size>/tokenizer.tiktoken (tiktoken's rank file) and tokenizer.json
(pattern and special tokens), which the README loads into tiktoken. It reads the first n characters of a
document stream (FineWeb by default, or local files: the "reading text" section near the end), then:
1. Split every document into chunks with a regex, and count each distinct chunk once. A corpus of a
   million words has only tens of thousands of distinct words, so all later work shrinks by 10-100x.
2. Count adjacent token pairs inside the distinct chunks, weighted by chunk frequency.
3. Repeatedly merge the most frequent pair. The naive way recounts every pair after every merge; here each
   merge only visits the places where the merged pair occurs, and a heap finds the next best pair.
"""

import argparse
import base64
import codecs
import heapq
import json
import os
import signal
import socket
import sys
import sysconfig
import time
import urllib.parse
from collections import Counter, defaultdict
from pathlib import Path

import regex
from tqdm import tqdm

# -----------------------------------------------------------------------------
# defaults, each overridable from the command line
vocab_size = 1000  # byte tokens (256) + merges; <|endoftext|> gets the next id
num_chars = 1048576  # train on the first 2^20 characters of the stream
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory; default tokenizers/<source>_v<vocab_size>
# GPT-4's split pattern: letters with their leading space, numbers in groups of up to 3, punctuation runs,
# and whitespace, so that merges never glue a word to the punctuation or the space after it.
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
HUB_DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),  # (repository, config, parquet files)
                "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None)}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKENIZER_FILES = ("tokenizer.tiktoken", "tokenizer.json", "tokenizer.tiktoken.tmp", "tokenizer.json.tmp")
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- step 1: pre-tokenize and deduplicate

def time_is_up(signum, frame):
    raise TimeoutError


def count_chunks(documents, split_pattern, num_chars):
    """Split each document with the pattern and count distinct chunks. Chunks never cross documents."""
    signal.signal(signal.SIGPROF, time_is_up)
    chunk_counts, chars_read = Counter(), 0
    with tqdm(total=num_chars, unit="char", unit_scale=True, desc="reading", mininterval=0.5) as progress:
        for number, document in enumerate(documents, 1):
            # A CPU-time alarm stops a pattern that backtracks catastrophically ((a|a)+b on a run of a's): 1 s
            # plus 10 s per million characters (GPT-4's needs 0.3 s). regex's own timeout= slows every match 3x.
            signal.setitimer(signal.ITIMER_PROF, 1 + len(document) / 1e5)
            try:
                chunk_counts.update(split_pattern.findall(document))
            except TimeoutError:
                raise UserError(f"--pattern {split_pattern.pattern!r} backtracks catastrophically: it ran past the "
                                f"time limit on document {number} ({document[:30]!r}...); simplify the pattern")
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
            chars_read += len(document)
            progress.update(len(document))
    if "" in chunk_counts:  # a pattern like \b matches nothing in some places only: BPE needs whole chunks
        raise UserError(f"--pattern {split_pattern.pattern!r} matches the empty string; every match must take at "
                        "least one character (x+, not x*)")
    return chunk_counts, chars_read


# ---------------------------------------------------------------- step 2: pair counts over distinct chunks
# All distinct chunks live in one flat list of token ids, as doubly linked lists: next_pos[i] is the position
# of the token after i in the same chunk (-1 at the chunk's end), prev_pos[i] the one before. Merging a pair
# at position i then takes O(1): the right token is unlinked, i takes the new id, and nothing is shifted.
# That is what lets the cost of a merge follow the occurrences of the pair, not the length of the chunks
# (a 500-character Chinese chunk is not rescanned on every merge that touches it).

def build_symbols(chunk_counts):
    """Flatten the distinct chunks into (ids, prev_pos, next_pos, weight): one entry per UTF-8 byte."""
    ids, prev_pos, next_pos, weight = [], [], [], []
    for chunk, count in chunk_counts.items():
        start, chunk_bytes = len(ids), chunk.encode("utf-8")
        ids.extend(chunk_bytes)
        prev_pos.extend([-1, *range(start, len(ids) - 1)])  # -1: no token before the chunk's first
        next_pos.extend([*range(start + 1, len(ids)), -1])  # nor after its last
        weight.extend([count] * len(chunk_bytes))
    return ids, prev_pos, next_pos, weight


def count_pairs(ids, next_pos, weight):
    """pair_counts[(a, b)]: weighted occurrences; pair_positions[(a, b)]: where each occurrence starts."""
    pair_counts, pair_positions = Counter(), defaultdict(list)
    for position, right in enumerate(next_pos):
        if right != -1:
            pair = (ids[position], ids[right])
            pair_counts[pair] += weight[position]
            pair_positions[pair].append(position)
    return pair_counts, pair_positions


# ---------------------------------------------------------------- step 3: the merge loop

def merge_pair(pair, new_id, ids, prev_pos, next_pos, weight, pair_counts, pair_positions):
    """Replace every occurrence of `pair` by `new_id`, left to right, and update the pair counts in place.
    Returns the pairs whose counts changed and the number of tokens saved (weighted)."""
    left, right = pair
    changed, tokens_saved = Counter(), 0  # count deltas of the neighbours: (x, left) -> (x, new), (right, y) -> (new, y)
    # Positions are appended as pairs appear, so a list can hold stale entries (the pair was merged away
    # since) and duplicates; checking the ids at use time is cheaper than keeping exact sets. Sorted order
    # puts each chunk's occurrences left to right, which is what makes "aaa" become [aa, a].
    for position in sorted(set(pair_positions.pop(pair))):
        if ids[position] != left:
            continue  # stale, or the right half of an occurrence merged a moment ago ("aaa")
        second = next_pos[position]
        if second == -1 or ids[second] != right:
            continue
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
        # unlink the right token: the chunk is one token shorter, nothing else moves
        ids[position], ids[second] = new_id, -1
        next_pos[position] = after
        if after != -1:
            prev_pos[after] = position
        tokens_saved += count
    # The merged pair itself is gone everywhere (left-to-right merging leaves no adjacent occurrence), so the
    # deltas that touched it ("aaaa": the middle (a, a)) are dropped along with its count.
    del pair_counts[pair]
    changed.pop(pair, None)
    changed = {other: delta for other, delta in changed.items() if delta}
    pair_counts.update(changed)  # a Counter adds the deltas
    return list(changed), tokens_saved


def train(chunk_counts, vocab_size):
    """The BPE merges, in order: a list of ((left id, right id), new id)."""
    ids, prev_pos, next_pos, weight = build_symbols(chunk_counts)
    total_tokens = sum(weight)  # tokens of the training text before any merge: its UTF-8 bytes
    pair_counts, pair_positions = count_pairs(ids, next_pos, weight)
    # A max-heap of (-count, (left, right)): the smallest (left, right) comes first among equal counts, which
    # is exactly our tie-break. Counts change after every merge; rather than finding and fixing old entries,
    # we push the new count and skip entries that no longer match when they come out ("lazy deletion").
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    with tqdm(total=vocab_size - 256, unit="merge", desc="merging", mininterval=0.5) as progress:
        while 256 + len(merges) < vocab_size and heap:
            negative_count, pair = heapq.heappop(heap)
            if pair_counts.get(pair, 0) != -negative_count:
                continue  # stale: the pair's count has changed since this entry was pushed
            new_id = 256 + len(merges)
            merges.append((pair, new_id))
            changed, tokens_saved = merge_pair(pair, new_id, ids, prev_pos, next_pos, weight, pair_counts, pair_positions)
            total_tokens -= tokens_saved
            for other in changed:
                count = pair_counts[other]
                if count > 0:
                    heapq.heappush(heap, (-count, other))
                else:  # no occurrence left: forget the pair and its (now all stale) positions
                    del pair_counts[other]
                    pair_positions.pop(other, None)
            progress.update(1)
    return merges, total_tokens


# ---------------------------------------------------------------- output

def token_bytes(merges):
    """The bytes of every token: 0..255 are themselves, a merge is its two halves glued."""
    vocab = [bytes([i]) for i in range(256)]
    for (left, right), _ in merges:
        vocab.append(vocab[left] + vocab[right])
    return vocab


def save_tokenizer(out_dir, merges, info):
    """Each file is written under a temporary name, then renamed: a crash never leaves half a file behind."""
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(token_bytes(merges)))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in [("tokenizer.tiktoken", ranks), ("tokenizer.json", json.dumps(info, indent=2, ensure_ascii=False) + "\n")]:
        (out_dir / f"{name}.tmp").write_text(text, encoding="utf-8")
        os.replace(out_dir / f"{name}.tmp", out_dir / name)


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

def check_out_dir(out_dir):
    """Find a bad --out before any work: a file on the way, no permission, or a directory of other files."""
    for path in [out_dir, *out_dir.parents]:
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {out_dir}: {path} is a file, not a directory; give a directory path")
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in TOKENIZER_FILES) if out_dir.is_dir() else []
    if others:  # a dataset from prepare_data.py, say: its tokenizer files would be overwritten
        what = "a dataset directory" if {"meta.json", "progress.json"} & set(others) else "not a tokenizer directory"
        raise UserError(f"--out {out_dir} is {what} (it holds {others[0]}); give a new or a tokenizer directory")
    created = [p for p in [out_dir, *out_dir.parents] if not p.exists()]
    try:  # write and remove a probe file: the only sure test (root passes os.access checks on /proc)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tokenizer.json.tmp").write_text("")
        (out_dir / "tokenizer.json.tmp").unlink()
    except OSError as error:
        raise UserError(f"--out {out_dir} can't be written ({error.strerror or error}); give a directory you can write")
    finally:  # leave nothing behind: the tokenizer is written only once it exists
        for path in filter(Path.is_dir, created):
            path.rmdir()


def run(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size, help="tokens before <|endoftext|> (256 bytes + merges)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="train on the first N characters")
    parser.add_argument("--data", default=None, help=f"fineweb | fineweb-edu | path to .txt/.jsonl/.parquet or a directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default tokenizers/<source>_v<vocab_size>)")
    parser.add_argument("--pattern", default=pattern, help="the pre-tokenizer regex (default GPT-4's)")
    args = parser.parse_args(argv)
    if not 256 <= args.vocab_size <= 2**31 - 1:
        raise UserError(f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes alone) and 2^31-1; try -v 1000")
    if args.num_chars <= 0:
        raise UserError(f"-n {args.num_chars}: the number of characters must be positive; try -n 1048576")
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); check the regex, or leave --pattern out for GPT-4's")
    if split_pattern.fullmatch(""):  # '' or 'x*' would give empty chunks, which hold no bytes to merge
        raise UserError(f"--pattern {args.pattern!r} matches the empty string; every match must take at least one "
                        "character (x+, not x*)")
    documents, source_name, source = open_source(args.data or data, data_was_named=args.data is not None)
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    check_out_dir(out_dir)

    t0 = time.time()
    chunk_counts, chars_read = count_chunks(first_chars(documents, args.num_chars), split_pattern, args.num_chars)
    t1 = time.time()
    if chars_read == 0:
        raise UserError(f"the corpus {source} is empty: no text to train on; point --data at files with text in them")
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD", file=sys.stderr)
    if chars_read < args.num_chars:
        print(f"the source ran out after {chars_read:,} characters (asked for {args.num_chars:,}); training on those")
    print(f"read {chars_read:,} characters: {sum(chunk_counts.values()):,} chunks, {len(chunk_counts):,} distinct")

    merges, total_tokens = train(chunk_counts, args.vocab_size)
    t2 = time.time()
    num_merges, eot_id = len(merges), 256 + len(merges)  # <|endoftext|> takes the first id after the merges
    if eot_id < args.vocab_size:
        print(f"stopped early after {num_merges} merges: no pairs left to merge (vocab {eot_id} < {args.vocab_size})")
    info = {"pattern": args.pattern, "special_tokens": {EOT: eot_id}, "vocab_size": eot_id + 1, "num_merges": num_merges,
            "num_chars": chars_read, "source": source, "trainer": "train_bpe_cpu.py", "seconds": round(t2 - t0, 3),
            "stop_reason": "vocab_size reached" if eot_id == args.vocab_size else "no pairs left to merge"}
    save_tokenizer(out_dir, merges, info)
    total_bytes = sum(len(chunk.encode("utf-8")) * count for chunk, count in chunk_counts.items())
    print(f"reading + pre-tokenizing {t1 - t0:.2f}s | merging {t2 - t1:.2f}s ({num_merges / max(t2 - t1, 1e-9):,.0f} merges/s) "
          f"| total {t2 - t0:.2f}s")
    print(f"compression on the training text: {total_bytes / max(total_tokens, 1):.3f} bytes/token "
          f"({total_bytes:,} bytes -> {total_tokens:,} tokens)")
    print(f"wrote {out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, vocab_size {eot_id + 1})")


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except (UserError, OSError) as error:  # OSError: an unreadable file, a full disk
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
