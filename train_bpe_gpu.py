"""
Train a byte-level BPE tokenizer with the merge loop on a GPU: the same merges as train_bpe_cpu.py and rustbpe.

    python train_bpe_gpu.py -v 1000 -n 1048576                      # cuda when torch sees a GPU, else cpu
    python train_bpe_gpu.py --data ../shared/corpora/enwiki.jsonl -v 65534 -n 134217728
    python train_bpe_gpu.py -v 1000 --device cpu                    # no GPU: the same tensor program, slower

The flags, the output (tokenizers/<source>_v<vocab_size>/tokenizer.tiktoken and tokenizer.json) and the
algorithm are train_bpe_cpu.py's; only --device is new. Steps 1-2 (reading, pre-tokenizing, deduplicating) run
on the CPU, on every core for large n. Steps 3-4 are the lesson of this file: the incremental merge loop, which
is a sequence of tiny data-dependent decisions on the CPU, rewritten as a few whole-tensor operations per merge
with a single host-device sync, so that a GPU can run it. Read the comments of step 3 and step 4.

How it works, in four steps:
1. Read the first n characters of a document stream (FineWeb by default, or local files).
2. Split every document into chunks with a regex, and count each distinct chunk once.
3. Lay the distinct chunks out as flat device tensors: token ids, linked-list neighbours, chunk weights.
4. Repeatedly merge the most frequent pair (ties: the smallest (left, right)), left to right without overlap,
   updating a dense pair-count matrix by deltas around the occurrences of the merged pair only.
"""

import argparse
import base64
import codecs
import collections
import contextlib
import itertools
import multiprocessing
import json
import os
import resource
import socket
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import torch
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
HUB_DATASETS = {"fineweb": "HuggingFaceFW/fineweb", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
device = None  # cuda when torch sees a GPU, else cpu (same result, slower); mps is accepted, untested so far
PARALLEL_CHARS = 1 << 24  # from this many characters on, pre-tokenize on every core
PARALLEL_BATCH_CHARS = 1 << 22  # characters per batch sent to a pre-tokenizing worker
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- step 1: reading text


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
    """FineWeb's sample-10BT, streamed: documents arrive as we read them, nothing is downloaded whole."""
    import datasets

    try:
        rows = datasets.load_dataset(HUB_DATASETS[name], name="sample-10BT", split="train", streaming=True)
    except Exception as error:  # the Hub answered, but not with the dataset: say why in one line
        raise UserError(f"can't open {HUB_DATASETS[name]} ({type(error).__name__}: {str(error).splitlines()[0]}); "
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
                        "or fineweb / fineweb-edu")
    return [path]


def open_source(data, data_was_named):
    """Returns (documents, name, description). `documents(budget)` yields documents as strings."""
    if data in HUB_DATASETS:
        if hub_reachable():
            return (lambda budget: stream_hub(data)), data, f"{HUB_DATASETS[data]} sample-10BT"
        if data_was_named:
            raise UserError(f"can't reach the Hugging Face Hub for --data {data}; "
                            "train on local files instead: --data path/to/files")
        print(f"can't reach the Hugging Face Hub for {data}: using the offline corpus, the Python standard library's source")
        return (lambda budget: stdlib_documents()), "stdlib", "Python standard library source (offline fallback)"
    if not Path(data).exists():
        raise UserError(f"--data {data}: no such file or directory; give a .txt/.jsonl/.parquet path, "
                        "a directory of them, or fineweb / fineweb-edu")
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


# ---------------------------------------------------------------- step 2: pre-tokenize and deduplicate


def count_batch(pattern_text, documents):
    """Runs in a worker process: the distinct chunks of a batch of documents, with their counts."""
    split_pattern = regex.compile(pattern_text)  # regex caches compiled patterns, so this is paid once
    chunk_counts = Counter()
    for document in documents:
        chunk_counts.update(split_pattern.findall(document))
    return chunk_counts


def count_chunks(documents, split_pattern, num_chars, workers=1):
    """Split each document with the pattern and count distinct chunks. Chunks never cross documents.

    With workers > 1, batches of ~PARALLEL_BATCH_CHARS characters go to a pool of processes (the regex holds
    the GIL, so threads would not help), and their Counters are added up here. At most two batches per worker
    are in flight, so memory stays bounded however long the stream is: the reader waits for the counters."""
    chunk_counts = Counter()
    chars_read = 0
    # A context manager closes the bar even when reading fails, so an error line starts on a line of its own.
    with tqdm(total=num_chars, unit="char", unit_scale=True, desc="reading", mininterval=0.5) as progress:
        if workers <= 1:
            for document in documents:
                chunk_counts.update(split_pattern.findall(document))
                chars_read += len(document)
                progress.update(len(document))
            return chunk_counts, chars_read
        # fork starts a worker in milliseconds (spawn re-imports torch in each). A forked child could not use CUDA,
        # but these only run the regex. macOS can't fork safely, so it spawns.
        with multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool(workers) as pool:
            in_flight = collections.deque()

            def collect_oldest():
                counts, batch_chars = in_flight.popleft()
                chunk_counts.update(counts.get())
                progress.update(batch_chars)

            batch, batch_chars = [], 0
            for document in itertools.chain(documents, [None]):
                if document is not None:
                    batch.append(document)
                    batch_chars += len(document)
                    chars_read += len(document)
                if batch and (document is None or batch_chars >= PARALLEL_BATCH_CHARS):
                    in_flight.append((pool.apply_async(count_batch, (split_pattern.pattern, batch)), batch_chars))
                    batch, batch_chars = [], 0
                    while len(in_flight) > 2 * workers:
                        collect_oldest()
            while in_flight:
                collect_oldest()
    return chunk_counts, chars_read


# ---------------------------------------------------------------- step 3: the distinct chunks as device tensors
#
# The CPU trainer walks Python lists one occurrence at a time. A GPU is fast only when one operation touches
# many elements at once, and slow (microseconds per launch, and more per host-device sync) when the host
# decides every small step. So every step below is shaped as a few whole-tensor operations, and the host
# learns only one small thing per merge: which pair won. The layout is the CPU trainer's, as tensors:
#
#   tokens[pos]    the token id at a position of the flattened distinct chunks (-1 past a chunk's end)
#   next_pos[pos]  the position of the next live token of the same chunk, or END; prev_pos likewise
#   weight[pos]    how often the chunk that holds pos occurs in the corpus
#
# Merging never moves tokens: the right half of a pair is unlinked, as in a linked list, so no compaction of
# the token tensor is ever needed and positions stay valid as names. Two spare positions at the end make the
# masked ("branch-free") writes below possible: END = L behaves like "no neighbour" (its token is -1, so it
# matches nothing), and DUMP = L + 1 is a scratch slot that absorbs the writes of lanes that don't apply.
#
# The memory budget. Per position of the distinct chunks: tokens, next_pos and prev_pos 8 B each (int64,
# torch's index type: ids index the count matrix and positions index the tensors with no conversion op),
# weight 4 B, position lists up to 16 B: about 45 B. Deduplication makes the positions few: all of enwiki
# (56 M characters) has 2.5 M, so ~0.1 GB. The dense pair-count matrix (below) costs 4 V^2 bytes: 4 MB at
# V = 1000, 16 GiB at V = 65534. That matrix is the budget. Squeezing tokens into int16 (with a zig-zag map to
# reach 65534 ids, as the seed did) would save 6 B of ~45 per position, ~15 MB on all of enwiki, and cost a
# conversion on every access: it does not pay.

DEAD = -2  # the token id of an unlinked position (the right half of a merged pair)


def chunks_to_tensors(chunk_counts, device):
    """Flatten the distinct chunks (only those with 2+ bytes: a single byte has no pair) into device tensors."""
    chunks = [chunk.encode("utf-8") for chunk in chunk_counts]
    lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
    counts = np.fromiter(chunk_counts.values(), np.int64, len(chunks))
    total_bytes = int((lengths * counts).sum())  # tokens of the training text before any merge
    keep = lengths >= 2
    chunks = [chunk for chunk, kept in zip(chunks, keep) if kept]
    lengths, counts = lengths[keep], counts[keep]
    L = int(lengths.sum())
    END, DUMP = L, L + 1
    tokens = np.full(L + 2, -1, np.int64)
    tokens[:L] = np.frombuffer(b"".join(chunks), np.uint8)
    ends = np.cumsum(lengths)  # one past each chunk's last byte
    next_pos = np.arange(1, L + 3, dtype=np.int64)
    next_pos[ends - 1] = END
    next_pos[L:] = END
    prev_pos = np.arange(-1, L + 1, dtype=np.int64)
    prev_pos[ends - lengths] = END
    prev_pos[L:] = END
    weight = np.zeros(L + 2, np.int64)
    weight[:L] = np.repeat(counts, lengths)
    # Pair counts are sums of weights: int32 holds them (and halves the matrix) unless the corpus has 2^31
    # pairs or more, about 2^29 characters of text.
    total_pairs = int(((lengths - 1) * counts).sum())
    count_dtype = torch.int32 if total_pairs < 2**31 else torch.int64
    as_tensor = lambda array, dtype: torch.from_numpy(array).to(device=device, dtype=dtype)
    return (as_tensor(tokens, torch.int64), as_tensor(next_pos, torch.int64), as_tensor(prev_pos, torch.int64),
            as_tensor(weight, count_dtype), total_bytes)


# ---------------------------------------------------------------- step 4: the merge loop, on the device
#
# Three structures replace the CPU trainer's dict of pair counts, dict of pair positions and heap:
#
# 1. pair_counts: a dense [V, V] matrix, count of pair (left, right) at [left, right]. Adding deltas for a whole
#    merge is then one index_add_ over flat indices left * V + right (duplicates accumulate), with no hashing.
#
# 2. row_bound[left]: the largest count in row `left`, or more: a lazy heap. Counts that grow (only pairs with
#    the new token grow) raise the bound with one scatter_reduce("amax"), which keeps it exact. A row where a
#    count shrank keeps its old bound, now too high, and is flagged inexact (row_exact). To choose a pair,
#    recompute the few inexact rows with the highest bounds, then take the argmax over all bounds: if the
#    winning row is exact, every other row's true maximum is at most its bound, so the winner is the true
#    best. If not, repeat (rare; each round makes more rows exact, so it ends). torch.argmax returns the first
#    index among equal values, so the smallest left id wins a tie between rows, and inside the row the
#    smallest right id: the tie-break comes for free.
#
# 3. Position lists, one per token id, in one flat buffer (list_start, list_len per id): the positions that
#    hold that id, in increasing order. A merge of (a, b) reads the list of a: its cost follows the
#    occurrences of a, never the length of the chunks. Entries go stale (the position now holds another id,
#    or is dead) and are filtered when read; the list of a is then rewritten without them, so it only shrinks.
#    The positions of the new token are appended at the end of the buffer. Each merge kills as many positions
#    as it appends, so a buffer of 2 L always suffices.
#
# Everything a merge does runs over the candidate list with masks (`selected` lanes do the work, the others
# write to DUMP or add 0), so the host never needs the number of matches: one .tolist() per merge fetches the
# winning pair, its count and where its list lies, and the rest is queued on the device without waiting.
#
# Runs of one token ("aaaa") are where naive parallel merging goes wrong: every position of the run matches
# (a, a), but left to right without overlap takes the 1st, 3rd, 5th... of each maximal run of adjacent
# matches. Two scans find that parity for all runs at once: cumsum numbers the matches, cummax carries the
# number of the run's first match forward, and a match is taken when its distance from that first match is
# even.


@contextlib.contextmanager
def one_thread_on_cpu(device):
    """A merge is ~50 small tensor operations: on the CPU, worker threads cost more to wake than they save,
    and on a busy machine their spin-waiting made the merge loop 25x slower (measured). So: one thread."""
    threads = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train(chunk_counts, vocab_size, device="cpu"):
    """The BPE merges, in order: a list of ((left id, right id), new id); and the token count after them."""
    with one_thread_on_cpu(device):
        return merge_on_device(chunks_to_tensors(chunk_counts, device), vocab_size)


def merge_on_device(layout, vocab_size, rows_to_verify=8):
    tokens, next_pos, prev_pos, weight, total_bytes = layout
    device = tokens.device
    L = tokens.numel() - 2
    END, DUMP = L, L + 1
    V = vocab_size
    count_dtype = weight.dtype
    # Initial pair counts: every left position whose right neighbour is in the same chunk.
    left_positions = torch.nonzero(next_pos[:L] != END).squeeze(1)
    pair_counts = torch.zeros(V * V, dtype=count_dtype, device=device)
    pair_index = tokens[left_positions] * V + tokens[next_pos[left_positions]]
    pair_counts.index_add_(0, pair_index, weight[left_positions])
    pair_counts_2d = pair_counts.view(V, V)
    row_bound = torch.zeros(V, dtype=count_dtype, device=device)
    row_bound[:256] = pair_counts_2d[:256, :256].max(dim=1).values
    row_exact = torch.ones(V + 1, dtype=torch.bool, device=device)  # [V] is a dump slot for masked lanes
    # Position lists of the 256 byte ids, built with one stable sort; a position at a chunk's end can never
    # be the left half of a pair, and stays at the end forever, so it needs no list.
    list_buffer = torch.zeros(2 * left_positions.numel() + 1, dtype=torch.int64, device=device)
    BUFFER_DUMP = list_buffer.numel() - 1
    byte_ids, order = torch.sort(tokens[left_positions], stable=True)
    list_buffer[:order.numel()] = left_positions[order]
    list_len = torch.zeros(V, dtype=torch.int64, device=device)
    list_len[:256] = torch.bincount(byte_ids, minlength=256)
    list_start = torch.zeros(V, dtype=torch.int64, device=device)
    list_start[1:256] = torch.cumsum(list_len[:255], 0)
    append_at = torch.tensor(order.numel(), dtype=torch.int64, device=device)

    merges = []
    progress = tqdm(total=V - 256, unit="merge", desc="merging", mininterval=0.5)
    for new_id in range(256, V):
        # --- choose: verify the rows with the highest bounds, then take the argmax of all bounds
        while True:
            inexact_bounds = torch.where(row_exact[:new_id], -1, row_bound[:new_id])
            verified = torch.topk(inexact_bounds, min(rows_to_verify, new_id)).indices
            row_bound[verified] = pair_counts_2d[verified, :new_id].max(dim=1).values
            row_exact.index_fill_(0, verified, True)
            best_row = torch.argmax(row_bound[:new_id])
            best_col = torch.argmax(pair_counts_2d[best_row, :new_id])
            stats = torch.stack([best_row, best_col, pair_counts_2d[best_row, best_col].long(),
                                 row_exact[best_row].long(), list_start[best_row], list_len[best_row]])
            a, b, best_count, exact, start, length = stats.tolist()  # the one host-device sync of a merge
            if exact:
                break
        if best_count == 0:
            break  # no pair left anywhere
        merges.append(((a, b), new_id))

        # --- find the occurrences: candidates are the positions that held `a`; keep those followed by `b`
        candidates = list_buffer[start:start + length].clone()
        right = next_pos[candidates]
        match = (tokens[candidates] == a) & (tokens[right] == b)
        if a == b:  # inside a run of adjacent matches, take every other one, starting with the first
            chained = match & (tokens[prev_pos[candidates]] == a)  # the previous position is a match too
            match_number = torch.cumsum(match, 0)
            run_first = torch.cummax(torch.where(match & ~chained, match_number, 0), 0).values
            selected = match & ((match_number - run_first) % 2 == 0)
        else:  # (a, b) can't overlap itself when a != b
            selected = match

        # --- the neighbours, read before anything changes
        before, after = prev_pos[candidates], next_pos[right]
        token_before, token_after = tokens[before], tokens[after]
        count = torch.where(selected, weight[candidates], 0)
        # Unlink the right halves first: then a left neighbour that is DEAD is the right half of the previous
        # occurrence ("abab", or a run "aaaa"), whose pair that occurrence already accounts for.
        tokens.index_fill_(0, torch.where(selected, right, DUMP), DEAD)
        has_before = selected & (tokens[before] >= 0)  # not past the chunk's start (-1), not DEAD
        has_after = selected & (after != END)
        count_before = torch.where(has_before, count, 0)
        count_after = torch.where(has_after, count, 0)
        # Remove the old pairs: (x, a) before, (a, b) itself, (b, y) after.
        row_exact.index_fill_(0, torch.where(has_before, token_before, V), False)
        row_exact[a] = row_exact[b] = False  # fills through views: a list index would be copied from the host
        pair_counts.index_add_(0, torch.cat([torch.where(has_before, token_before * V + a, 0),
                                             torch.full_like(candidates, a * V + b),
                                             torch.where(has_after, b * V + token_after, 0)]),
                               -torch.cat([count_before, count, count_after]))
        # Merge: the left half becomes new_id and links to the token after the right half.
        left_halves = torch.where(selected, candidates, DUMP)
        tokens.index_fill_(0, left_halves, new_id)
        next_pos[left_halves] = after
        prev_pos[torch.where(has_after, after, DUMP)] = candidates
        # Add the new pairs: (x, new) before and (new, y) after. y is read again: it is new_id itself when the
        # next occurrence starts right after this one.
        new_pairs = torch.cat([torch.where(has_before, token_before * V + new_id, 0),
                               torch.where(has_after, new_id * V + tokens[after], 0)])
        pair_counts.index_add_(0, new_pairs, torch.cat([count_before, count_after]))
        # Only pairs with new_id grew: raising their rows' bounds keeps every bound an upper bound, and an exact
        # one exact. (Masked lanes point at pair (0, 0), whose count can't exceed row 0's bound: a no-op.)
        row_bound.scatter_reduce_(0, new_pairs // V, pair_counts[new_pairs], "amax")

        # --- the position lists: a's list loses the positions that no longer hold a, new_id's gets the merged
        # positions (in increasing order, as cumsum keeps the order of the lanes)
        still_a = tokens[candidates] == a
        list_buffer[torch.where(still_a, torch.cumsum(still_a, 0) + (start - 1), BUFFER_DUMP)] = candidates
        list_len[a] = still_a.sum()
        list_buffer[torch.where(selected, torch.cumsum(selected, 0) + (append_at - 1), BUFFER_DUMP)] = candidates
        list_start[new_id] = append_at
        num_selected = selected.sum()
        list_len[new_id] = num_selected
        append_at += num_selected
        progress.update(1)
    progress.close()
    # Each merged occurrence saved one token per occurrence of its chunk: the DEAD positions' weights.
    return merges, total_bytes - int(weight[tokens == DEAD].sum())


# ---------------------------------------------------------------- output


def token_bytes(merges):
    """The bytes of every token: 0..255 are themselves, a merge is its two halves glued."""
    vocab = [bytes([i]) for i in range(256)]
    for (left, right), _ in merges:
        vocab.append(vocab[left] + vocab[right])
    return vocab


def write_atomically(path, text):
    """Write to a temporary name and rename: a crash never leaves a half-written file behind."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def save_tokenizer(out_dir, merges, info):
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = token_bytes(merges)
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(vocab))
    write_atomically(out_dir / "tokenizer.tiktoken", ranks)
    write_atomically(out_dir / "tokenizer.json", json.dumps(info, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- the run


def pick_device(name):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: unknown device; use cuda, cpu or mps")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: torch sees no CUDA GPU on this machine; use --device cpu (same result, slower)")
    if chosen.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: MPS (Apple GPU) is not available here; use --device cpu (same result, slower)")
    if chosen.type not in ("cuda", "cpu", "mps"):
        raise UserError(f"--device {name}: not supported; use cuda, cpu or mps")
    return chosen


def device_memory(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # cpu, and mps's unified memory


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def peak_memory(device):
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB on {torch.cuda.get_device_name(device)}"
    if device.type == "mps":
        return f"{torch.mps.driver_allocated_memory() / 2**30:.2f} GiB held by the MPS driver at the end"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (the process's peak resident memory)"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size, help="tokens before <|endoftext|> (256 bytes + merges)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="train on the first N characters")
    parser.add_argument("--data", default=None, help=f"fineweb | fineweb-edu | path to .txt/.jsonl/.parquet or a directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default tokenizers/<source>_v<vocab_size>)")
    parser.add_argument("--pattern", default=pattern, help="the pre-tokenizer regex (default GPT-4's)")
    parser.add_argument("--device", default=device, help="cuda | cpu | mps (default: cuda when available, else cpu)")
    return parser.parse_args(argv)


def run(argv):
    args = parse_args(argv)
    if not 256 <= args.vocab_size <= 2**31 - 1:
        raise UserError(f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes alone) and 2^31-1; try -v 1000")
    if args.num_chars <= 0:
        raise UserError(f"-n {args.num_chars}: the number of characters must be positive; try -n 1048576")
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); check the regex, or leave --pattern out for GPT-4's")
    train_device = pick_device(args.device)
    # The dense [V, V] pair-count matrix must fit (int32 here; int64, twice as big, past 2^31 pairs of text).
    matrix_bytes = 4 * args.vocab_size**2
    if matrix_bytes > 0.8 * device_memory(train_device):
        raise UserError(f"-v {args.vocab_size} needs a {matrix_bytes / 2**30:.1f} GiB pair-count matrix (4 V^2 bytes), "
                        f"more than {train_device} can spare ({device_memory(train_device) / 2**30:.1f} GiB); "
                        "use a smaller -v, or train_bpe_cpu.py")
    documents, source_name, source = open_source(args.data or data, data_was_named=args.data is not None)
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; give a directory")

    t0 = time.time()
    workers = os.cpu_count() if args.num_chars >= PARALLEL_CHARS else 1
    chunk_counts, chars_read = count_chunks(first_chars(documents, args.num_chars), split_pattern, args.num_chars,
                                            workers)
    t1 = time.time()
    if chars_read == 0:
        raise UserError(f"the corpus {source} is empty: no text to train on; point --data at files with text in them")
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD")
    if chars_read < args.num_chars:
        print(f"the source ran out after {chars_read:,} characters (asked for {args.num_chars:,}); training on those")
    print(f"read {chars_read:,} characters: {sum(chunk_counts.values()):,} chunks, {len(chunk_counts):,} distinct")

    with one_thread_on_cpu(train_device):
        layout = chunks_to_tensors(chunk_counts, train_device)
        synchronize(train_device)
        t_layout = time.time()
        print(f"{layout[0].numel() - 2:,} token positions in the distinct chunks, on {train_device}")
        merges, total_tokens = merge_on_device(layout, args.vocab_size)
        del layout
    t2 = time.time()
    num_merges = len(merges)
    stop_reason = "vocab_size reached" if 256 + num_merges == args.vocab_size else "no pairs left to merge"
    if stop_reason != "vocab_size reached":
        print(f"stopped early after {num_merges} merges: no pairs left to merge (vocab {256 + num_merges} < {args.vocab_size})")

    eot_id = 256 + num_merges
    info = {
        "pattern": args.pattern,
        "special_tokens": {EOT: eot_id},
        "vocab_size": eot_id + 1,
        "num_merges": num_merges,
        "num_chars": chars_read,
        "source": source,
        "trainer": "train_bpe_gpu.py",
        "device": str(train_device),
        "seconds": round(t2 - t0, 3),
        "stop_reason": stop_reason,
    }
    save_tokenizer(out_dir, merges, info)
    total_bytes = sum(len(chunk.encode("utf-8")) * count for chunk, count in chunk_counts.items())
    print(f"reading + pre-tokenizing {t1 - t0:.2f}s ({workers} process{'es' * (workers > 1)}) | to {train_device} "
          f"{t_layout - t1:.2f}s | merging {t2 - t_layout:.2f}s ({num_merges / max(t2 - t_layout, 1e-9):,.0f} merges/s) "
          f"| total {t2 - t0:.2f}s")
    print(f"peak memory: {peak_memory(train_device)}")
    print(f"compression on the training text: {total_bytes / max(total_tokens, 1):.3f} bytes/token "
          f"({total_bytes:,} bytes -> {total_tokens:,} tokens)")
    print(f"wrote {out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, vocab_size {eot_id + 1})")


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
