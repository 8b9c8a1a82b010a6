"""
Train a byte-level BPE tokenizer on many GPUs (or CPU processes) at once: exact, one tokenizer for all ranks.

    torchrun --standalone --nproc_per_node=8 train_bpe_multigpu.py -v 65534 -n 1073741824
    torchrun --standalone --nproc_per_node=2 train_bpe_multigpu.py --device cpu -v 1000 -n 1048576
    python train_bpe_multigpu.py --device cpu          # world size 1, no torchrun needed

The result is byte-identical to train_bpe_cpu.py, train_bpe_gpu.py and rustbpe on the same first n characters,
and the output files are theirs: tokenizers/<source>_v<vocab_size>/tokenizer.tiktoken and tokenizer.json.

Why this is not data-parallel training: the ranks hold different text, so what they would exchange (pair
counts) has a different shape on each rank, and a merge chosen from one rank's counts is wrong. The steps:
1. Sharding. Every rank streams the same document stream and keeps the documents that START inside its
   contiguous slice of the first n characters (rank r: offsets [r n / W, (r+1) n / W)). Documents are never
   cut (except the last one of the stream, cut at n exactly as the other trainers do), so no false pairs
   appear at seams, and the chunk counts summed over ranks are the single-process ones.
2. Each rank splits its documents into chunks, counts the distinct ones, and caches them on disk
   (--cache_dir): a rerun with the same data, n, pattern and world size skips reading and pre-tokenizing.
3. Each rank holds its distinct chunks on its device as flat token tensors, and a full copy of the GLOBAL
   pair-count matrix. One all-reduce builds it at the start.
4. Every merge: every rank picks the same best pair from its identical copy (no communication), merges it in
   its own chunks, sums the count deltas that merge caused locally per pair, and the ranks all_gather them:
   one 4 KiB packet per rank (the sizes and the first 256 deltas), and, only when a rank has more, the rest,
   padded. Each rank adds all deltas to its copy, so the copies stay identical and exact (integer sums, no
   float), and the next choice agrees everywhere. Step 4 below says why this exchange and not another.
"""

import argparse
import base64
import codecs
import datetime
import hashlib
import json
import multiprocessing
import os
import resource
import socket
import sys
import sysconfig
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np
import regex
import torch
import torch.distributed as dist
from tqdm import tqdm

# -----------------------------------------------------------------------------
# defaults, each overridable from the command line
vocab_size = 65534  # byte tokens (256) + merges; <|endoftext|> gets the next id (65534 keeps ids in uint16)
num_chars = 2**27  # train on the first 2^27 characters of the stream, all ranks together
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory; default tokenizers/<source>_v<vocab_size>
device = "cuda" if torch.cuda.is_available() else "cpu"  # cuda -> NCCL, cpu -> gloo
cache_dir = "tokenizers/.cache"  # per-rank counted chunks, keyed by data/n/pattern/world size
workers = 0  # pre-tokenizing processes per rank; 0 = this rank's share of the CPU cores when its share is big
timeout = 1800  # seconds a rank waits in a collective before giving up (reading a big share takes a while)
# GPT-4's split pattern: letters with their leading space, numbers in groups of up to 3, punctuation runs,
# and whitespace, so that merges never glue a word to the punctuation or the space after it.
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
HUB_DATASETS = {"fineweb": "HuggingFaceFW/fineweb", "fineweb-edu": "HuggingFaceFW/fineweb-edu"}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
CACHE_VERSION = 1
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
        say(f"can't reach the Hugging Face Hub for {data}: using the offline corpus, the Python standard library's source")
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




# ---------------------------------------------------------------- step 1b: this rank's share of the stream
#
# Three ways to split a stream of documents exactly were on the table:
#  - rank 0 reads and sends documents to the others: one reader is the bottleneck, and sending text needs
#    point-to-point messages of strings, which NCCL does not do;
#  - round-robin (document i to rank i % W): balanced by count, not by characters, and every rank must read
#    the whole stream;
#  - contiguous character ranges (chosen): document d, starting at offset s_d of the first n characters,
#    belongs to rank floor(s_d W / n). Rank r stops reading as soon as a document starts past its range, so
#    rank 0 reads 1/W of the stream and only the last rank reads it all; the shares are balanced in
#    characters up to one document. Reading (JSON decoding) is cheap next to pre-tokenizing (the regex),
#    which each rank does only for its own documents.
# A document longer than a share simply belongs whole to the rank where it starts, and the ranks it
# overlaps get less or nothing. With fewer documents than ranks, some ranks have nothing. Both are exact; a
# rank with no text still takes part in every collective, with zero deltas.


def rank_of(offset, num_chars, world_size):
    return offset * world_size // num_chars


def my_share(documents, num_chars, rank, world_size):
    """Yields this rank's documents, whole (the stream's last one cut at num_chars, as everywhere)."""
    offset, bad_before = 0, BadUTF8.count
    for document in first_chars(documents, num_chars):
        owner = rank_of(offset, num_chars, world_size)
        if owner != rank:  # an earlier rank's document: its invalid bytes are that rank's to report
            BadUTF8.count = bad_before
        offset += len(document)
        if owner == rank:
            yield document
        if rank_of(offset, num_chars, world_size) > rank:
            return  # the next document starts in a later rank's range: don't even read it
        bad_before = BadUTF8.count


# ---------------------------------------------------------------- step 2: pre-tokenize, deduplicate, cache


# The regex is the slow part of reading (a few million characters per second per core), so a big share is
# split by worker processes: batches of whole documents go out, Counters come back and are summed (counts add
# up the same in any order). At most two batches per worker are in flight, so RAM stays bounded however fast
# the reading is. The workers are forked early in run(), before the process group starts its threads.
BATCH_CHARS = 1 << 20
WORKER_PATTERN = None


def start_worker(pattern_text):
    global WORKER_PATTERN
    WORKER_PATTERN = regex.compile(pattern_text)


def count_batch(documents):
    return Counter(chunk for document in documents for chunk in WORKER_PATTERN.findall(document))


def batches(documents):
    batch, batch_chars = [], 0
    for document in documents:
        batch.append(document)
        batch_chars += len(document)
        if batch_chars >= BATCH_CHARS:
            yield batch, batch_chars
            batch, batch_chars = [], 0
    if batch:
        yield batch, batch_chars


def count_chunks(documents, split_pattern, share_chars, show_progress, pool=None, workers=1):
    """Split each document with the pattern and count distinct chunks. Chunks never cross documents."""
    chunk_counts = Counter()
    chars_read = 0
    # A context manager closes the bar even when reading fails, so an error line starts on a line of its own.
    with tqdm(total=share_chars, unit="char", unit_scale=True, desc="reading (rank 0's share)",
              mininterval=0.5, disable=not show_progress) as progress:
        if pool is None:
            for document in documents:
                chunk_counts.update(split_pattern.findall(document))
                chars_read += len(document)
                progress.update(len(document))
        else:
            pending = deque()
            for batch, batch_chars in batches(documents):
                pending.append(pool.apply_async(count_batch, (batch,)))
                chars_read += batch_chars
                progress.update(batch_chars)
                while len(pending) > 2 * workers:
                    chunk_counts.update(pending.popleft().get())
            for result in pending:
                chunk_counts.update(result.get())
    return chunk_counts, chars_read


# The cache holds what the merge loop needs and nothing else, as plain .npy arrays (no pickle: loading a cache
# file can't run code): the UTF-8 bytes of this rank's distinct chunks of 2+ bytes, concatenated (uint8), the
# byte length of each and how often it occurs (int64). Single-byte chunks hold no pair and are only counted
# in the statistics. The .json is written last, so a cache without it is incomplete and ignored.


def cache_key(args, source, files, world_size):
    """Changes whenever the counted chunks could: other data (or the same files changed), n, pattern, W."""
    stamp = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    if source.startswith("Python standard library"):
        stamp = [sys.version]
    key = json.dumps([CACHE_VERSION, source, stamp, args.num_chars, args.pattern, world_size])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def save_array(path, array):
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        np.save(f, array)
    os.replace(temporary, path)


def write_cache(prefix, chunk_counts, chars_read):
    chunks = [chunk.encode("utf-8") for chunk in chunk_counts]
    lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
    counts = np.fromiter(chunk_counts.values(), np.int64, len(chunks))
    keep = lengths >= 2
    blob = np.frombuffer(b"".join(chunk for chunk, kept in zip(chunks, keep) if kept), np.uint8)
    stats = {"chars": chars_read, "chunks": int(counts.sum()), "distinct": len(chunks),
             "total_bytes": int((lengths * counts).sum()),  # tokens of the text before any merge
             "total_pairs": int(((lengths - 1) * counts).sum()), "bad_utf8": BadUTF8.count,
             "pair_bytes": blob.size, "pair_chunks": int(keep.sum())}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    save_array(prefix.with_suffix(".bytes.npy"), blob)
    save_array(prefix.with_suffix(".lengths.npy"), lengths[keep])
    save_array(prefix.with_suffix(".counts.npy"), counts[keep])
    temporary = prefix.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(stats))
    os.replace(temporary, prefix.with_suffix(".json"))


def read_cache(prefix):
    """(bytes, lengths, counts, stats) memory-mapped, or None. Mapped arrays cost no RAM until read."""
    try:
        stats = json.loads(prefix.with_suffix(".json").read_text())
        arrays = [np.load(prefix.with_suffix(f".{part}.npy"), mmap_mode="r", allow_pickle=False)
                  for part in ("bytes", "lengths", "counts")]
    except (OSError, ValueError):
        return None
    if arrays[0].size != stats["pair_bytes"] or arrays[1].size != stats["pair_chunks"]:
        return None  # a cache from an interrupted write or another version: count again
    return (*arrays, stats)


# ---------------------------------------------------------------- step 3: the distinct chunks as device tensors
#
# The layout of train_bpe_gpu.py, per rank: positions of the flattened distinct chunks, with linked-list
# neighbours, so that merging never moves tokens and positions stay valid names for the whole run.
#
#   tokens[pos]    the token id at a position (-1 at the two spare positions; int64 like the positions: ids
#                  index the count matrix directly, with no conversion op per merge)
#   next_pos[pos]  the position of the next live token of the same chunk, or END; prev_pos likewise
#   weight[pos]    how often the chunk that holds pos occurs in this rank's share
#
# END = L behaves like "no neighbour" (its token is -1, so it matches nothing), and DUMP = L + 1 is a scratch
# slot that absorbs the masked writes of lanes that don't apply. Memory per position: ~40 B (tokens 4, links
# 16, weight 4-8, position lists up to 16), plus the [V, V] pair-count matrix (4 or 8 V^2 bytes, every rank).

DEAD = -2  # the token id of an unlinked position (the right half of a merged pair)
PIECE = 1 << 26  # bytes copied host -> device at a time, so that loading the cache keeps CPU RAM bounded


def chunks_to_tensors(blob, lengths, counts, count_dtype, device):
    L = blob.size
    END, DUMP = L, L + 1
    tokens = torch.full((L + 2,), -1, dtype=torch.int64, device=device)
    for start in range(0, L, PIECE):  # a memory-mapped cache is read piece by piece, never whole
        tokens[start:min(start + PIECE, L)] = torch.from_numpy(np.array(blob[start:start + PIECE])).to(device)
    lengths = torch.from_numpy(np.array(lengths)).to(device)
    counts = torch.from_numpy(np.array(counts)).to(device)
    ends = torch.cumsum(lengths, 0)  # one past each chunk's last byte
    next_pos = torch.arange(1, L + 3, dtype=torch.int64, device=device)
    next_pos[ends - 1] = END
    next_pos[L:] = END
    prev_pos = torch.arange(-1, L + 1, dtype=torch.int64, device=device)
    prev_pos[ends - lengths] = END
    prev_pos[L:] = END
    weight = torch.zeros(L + 2, dtype=count_dtype, device=device)
    weight[:L] = torch.repeat_interleave(counts, lengths).to(count_dtype)
    return tokens, next_pos, prev_pos, weight


# ---------------------------------------------------------------- step 4: the merge loop, across ranks
#
# Per rank, the structures of train_bpe_gpu.py:
#  - pair_counts: a dense [V, V] matrix, the GLOBAL count of pair (left, right) at [left, right], the same on
#    every rank. Deltas are added with one index_add_ over flat indices left * V + right.
#  - row_bound[left]: the largest count in row `left`, or more: a lazy heap. Growing counts (only pairs with
#    the new token grow) raise it with scatter_reduce("amax"), which keeps it exact; a row where a count shrank
#    keeps its old bound, too high, and is flagged inexact (row_exact). To choose: recompute the few inexact
#    rows with the highest bounds, then take the argmax of all bounds; if the winning row is exact, no other
#    row can beat it, and argmax's first-index rule gives the smallest (left, right) among ties. If not,
#    repeat (rare; each round makes more rows exact, so it ends).
#  - Position lists, one per token id, in one flat buffer: the positions of THIS rank's chunks that hold the
#    id, in increasing order. A merge of (a, b) reads a's list: its cost follows the occurrences of a.
#
# What is communicated each merge, and why:
#  - nothing to choose: every rank holds the same matrix and runs the same deterministic argmax;
#  - one all_gather of a fixed packet per rank: how many deltas the rank has, the pair it chose (checked equal
#    on every rank: a divergence would be a bug, and stops the run at the first wrong merge), and its first
#    INLINE deltas (flat pair index, count delta; padded with (0, +0), which changes nothing);
#  - only when some rank has more than INLINE deltas (the early merges), a second all_gather of the rest,
#    padded to the longest: sizes first (they came in the packet), then padded tensors.
#  Each rank first sums its deltas per pair (torch.unique + index_add_): an early merge like (" ", "t") moves
#  counts at a million positions but only of a few hundred distinct pairs, so the volume follows the distinct
#  pairs touched (tens to a few thousand: kilobytes), not the occurrences. At kilobytes, a collective's
#  latency (tens of microseconds on NVLink) costs more than its bytes, which is why the packet carries the
#  first deltas with the header: most merges need ONE collective. Bytes in per rank per merge:
#  W (24 + 16 INLINE), plus 16 W (k_max - INLINE) when some rank overflows.
#  - Why not all_to_all by pair owner (rank r owns rows left % W)? It would send each delta to one rank instead
#    of all, and divide the matrix memory by W, but choosing would then need a third collective (each owner's
#    best pair) and a bucketing sort every merge. The bytes it saves are kilobytes; its memory saving matters
#    only when V^2 counts don't fit a GPU (4 B x 65534^2 = 16 GiB, 32 GiB in int64): that is the design to
#    switch to on 24 GB cards.
#  - Counts are integers end to end (int64 deltas, int32 or int64 matrix), so sums are exact whatever the
#    order they arrive in (the float32 counts of the trainer this repo replaces were exact only to 2^24).


INLINE = 256  # deltas per rank that travel with the header (4 KiB): enough for most merges


def exchange(pair_index, delta, chosen, device):
    """all_gather every rank's (pair index, delta) lanes, and check that every rank chose the same pair."""
    world_size, count = dist.get_world_size(), pair_index.numel()
    inline = min(count, INLINE)
    packet = torch.zeros(3 + 2 * INLINE, dtype=torch.int64, device=device)
    packet[0] = count
    packet[1], packet[2] = chosen
    packet[3:3 + inline] = pair_index[:inline]
    packet[3 + INLINE:3 + INLINE + inline] = delta[:inline]
    packets = [torch.empty_like(packet) for _ in range(world_size)]
    dist.all_gather(packets, packet)
    packets = torch.stack(packets)
    headers = packets[:, :3].tolist()
    if any(header[1:] != list(chosen) for header in headers):
        raise RuntimeError(f"ranks chose different merges {[tuple(h[1:]) for h in headers]}: they must agree")
    pairs, deltas = [packets[:, 3:3 + INLINE].reshape(-1)], [packets[:, 3 + INLINE:].reshape(-1)]
    bytes_in = packet.numel() * 8 * world_size
    width = max(header[0] for header in headers) - INLINE
    if width > 0:  # the overflow: sizes are known from the packets, so pad to the longest and gather again
        padded = torch.zeros(2, width, dtype=torch.int64, device=device)
        padded[0, :count - inline] = pair_index[inline:]
        padded[1, :count - inline] = delta[inline:]
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded)
        overflow = torch.cat(gathered, dim=1)
        pairs.append(overflow[0])
        deltas.append(overflow[1])
        bytes_in += padded.numel() * 8 * world_size
    return torch.cat(pairs), torch.cat(deltas), bytes_in, width > 0


def train(tokens, next_pos, prev_pos, weight, vocab_size, device, show_progress):
    """The BPE merges, in order: a list of ((left id, right id), new id); this rank's tokens saved; bytes
    received, seconds spent in the exchange (waiting for the slowest rank included) and merges that needed
    the second all_gather."""
    L = tokens.numel() - 2
    END, DUMP = L, L + 1
    V = vocab_size
    count_dtype = weight.dtype
    # Initial pair counts: only byte pairs exist yet, so one all-reduce of a 256 x 256 block makes them global.
    left_positions = torch.nonzero(next_pos[:L] != END).squeeze(1)
    byte_pairs = torch.zeros(256 * 256, dtype=torch.int64, device=device)
    byte_pairs.index_add_(0, tokens[left_positions] * 256 + tokens[next_pos[left_positions]],
                          weight[left_positions].long())
    dist.all_reduce(byte_pairs)
    pair_counts = torch.zeros(V * V, dtype=count_dtype, device=device)
    pair_counts_2d = pair_counts.view(V, V)
    pair_counts_2d[:256, :256] = byte_pairs.view(256, 256).to(count_dtype)
    row_bound = torch.zeros(V, dtype=count_dtype, device=device)
    row_bound[:256] = pair_counts_2d[:256, :256].max(dim=1).values
    row_exact = torch.ones(V + 1, dtype=torch.bool, device=device)  # [V] is a dump slot for masked lanes
    # Position lists of the 256 byte ids, built with one stable sort; a position at a chunk's end can never
    # be the left half of a pair, and stays at the end forever, so it needs no list. Each merge kills as many
    # positions as it appends to the new token's list, so twice the initial size always suffices.
    list_buffer = torch.zeros(2 * left_positions.numel() + 1, dtype=torch.int64, device=device)
    BUFFER_DUMP = list_buffer.numel() - 1
    byte_ids, order = torch.sort(tokens[left_positions], stable=True)
    list_buffer[:order.numel()] = left_positions[order]
    list_len = torch.zeros(V, dtype=torch.int64, device=device)
    list_len[:256] = torch.bincount(byte_ids, minlength=256)
    list_start = torch.zeros(V, dtype=torch.int64, device=device)
    list_start[1:256] = torch.cumsum(list_len[:255], 0)
    append_at = torch.tensor(order.numel(), dtype=torch.int64, device=device)
    bytes_received, exchange_seconds, overflow_merges = 0, 0.0, 0

    merges = []
    progress = tqdm(total=V - 256, unit="merge", desc="merging", mininterval=0.5, disable=not show_progress)
    for new_id in range(256, V):
        # --- choose, the same on every rank: verify the inexact rows with the highest bounds, take the argmax
        while True:
            inexact_bounds = torch.where(row_exact[:new_id], -1, row_bound[:new_id])
            verified = torch.topk(inexact_bounds, min(8, new_id)).indices
            row_bound[verified] = pair_counts_2d[verified, :new_id].max(dim=1).values
            row_exact.index_fill_(0, verified, True)
            best_row = torch.argmax(row_bound[:new_id])
            best_col = torch.argmax(pair_counts_2d[best_row, :new_id])
            stats = torch.stack([best_row, best_col, pair_counts_2d[best_row, best_col].long(),
                                 row_exact[best_row].long(), list_start[best_row], list_len[best_row]])
            a, b, count_ab, exact, start, length = stats.tolist()  # the host learns the winner: one sync
            if exact:
                break
        if count_ab == 0:
            break  # no pair left on any rank
        merges.append(((a, b), new_id))

        # --- find this rank's occurrences: positions that held `a`, followed by `b`
        candidates = list_buffer[start:start + length].clone()
        right = next_pos[candidates]
        match = (tokens[candidates] == a) & (tokens[right] == b)
        if a == b:  # inside a run of adjacent matches ("aaaa"), take every other one, starting with the first
            chained = match & (tokens[prev_pos[candidates]] == a)  # the previous position is a match too
            match_number = torch.cumsum(match, 0)
            run_first = torch.cummax(torch.where(match & ~chained, match_number, 0), 0).values
            selected = match & ((match_number - run_first) % 2 == 0)
        else:  # (a, b) can't overlap itself when a != b
            selected = match

        # --- the neighbours, read before anything changes
        before, after = prev_pos[candidates], next_pos[right]
        token_before, token_after = tokens[before], tokens[after]
        count = torch.where(selected, weight[candidates], 0).long()
        # Unlink the right halves first: then a left neighbour that is DEAD is the right half of the previous
        # occurrence ("abab", or a run "aaaa"), whose pair that occurrence already accounts for.
        tokens.index_fill_(0, torch.where(selected, right, DUMP), DEAD)  # index_fill_: no scalar copied from the host
        has_before = selected & (tokens[before] >= 0)  # not past the chunk's start (-1), not DEAD
        has_after = selected & (after != END)
        count_before = torch.where(has_before, count, 0)
        count_after = torch.where(has_after, count, 0)
        # Merge: the left half becomes new_id and links to the token after the right half.
        left_halves = torch.where(selected, candidates, DUMP)
        tokens.index_fill_(0, left_halves, new_id)
        next_pos[left_halves] = after
        prev_pos[torch.where(has_after, after, DUMP)] = candidates
        # The deltas: the old pairs (x, a), (a, b), (b, y) lose, the new (x, new) and (new, y) gain. y is read
        # again: it is new_id itself when the next occurrence starts right after this one.
        pair_index = torch.cat([token_before * V + a, torch.full_like(candidates, a * V + b), b * V + token_after,
                                token_before * V + new_id, new_id * V + tokens[after]])
        delta = torch.cat([-count_before, -count, -count_after, count_before, count_after])
        # Sum per pair. Lanes that change nothing are pointed at pair 0 with delta 0 rather than filtered out:
        # a boolean filter would make the host wait for its size, and torch.unique already costs one such wait.
        pair_index = torch.where(delta != 0, pair_index, 0)
        pairs, inverse = torch.unique(pair_index, return_inverse=True)
        summed = torch.zeros(pairs.numel(), dtype=torch.int64, device=device).index_add_(0, inverse, delta)
        exchange_start = time.perf_counter()
        all_pairs, all_deltas, received, overflowed = exchange(pairs, summed, (a, b), device)
        exchange_seconds += time.perf_counter() - exchange_start
        bytes_received += received
        overflow_merges += overflowed
        pair_counts.index_add_(0, all_pairs, all_deltas.to(count_dtype))
        # Raising a bound to a true count keeps it an upper bound (and exact, if the row was), so the rows of
        # every touched pair may be raised; rows where some count shrank are flagged inexact.
        row_bound.scatter_reduce_(0, all_pairs // V, pair_counts[all_pairs], "amax")
        row_exact.index_fill_(0, torch.where(all_deltas < 0, all_pairs // V, V), False)

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
    # Each merged occurrence saved one token per occurrence of its chunk: the weights of the DEAD positions.
    tokens_saved = int(weight[tokens == DEAD].sum())
    return merges, tokens_saved, (bytes_received, exchange_seconds, overflow_merges)


# ---------------------------------------------------------------- output (rank 0 only)


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

RANK = int(os.environ.get("RANK", "0"))  # torchrun sets it before we start: rank 0 alone speaks


def say(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size, help="tokens before <|endoftext|> (256 bytes + merges)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="train on the first N characters (all ranks together)")
    parser.add_argument("--data", default=None, help=f"fineweb | fineweb-edu | path to .txt/.jsonl/.parquet or a directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default tokenizers/<source>_v<vocab_size>)")
    parser.add_argument("--pattern", default=pattern, help="the pre-tokenizer regex (default GPT-4's)")
    parser.add_argument("--device", default=device, choices=["cuda", "cpu"], help=f"cuda (NCCL) or cpu (gloo) (default {device})")
    parser.add_argument("--cache_dir", default=cache_dir, help=f"where each rank caches its counted chunks (default {cache_dir})")
    parser.add_argument("--no_cache", action="store_true", help="count again even if a cache exists (and refresh it)")
    parser.add_argument("--workers", type=int, default=workers, help="pre-tokenizing processes per rank (default: "
                        "the node's cores / ranks on the node, for shares of 2^24+ characters; 1 below)")
    parser.add_argument("--timeout", type=float, default=timeout, help=f"seconds to wait for the other ranks (default {timeout})")
    return parser.parse_args(argv)


def validate(args):
    """Every check that needs no text runs on every rank BEFORE the process group exists: each rank reaches
    the same verdict on its own, exits, and nobody is left waiting in a collective."""
    if not 256 <= args.vocab_size <= 2**31 - 1:
        raise UserError(f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes alone) and 2^31-1; try -v 1000")
    if args.num_chars <= 0:
        raise UserError(f"-n {args.num_chars}: the number of characters must be positive; try -n 1048576")
    if args.workers < 0:
        raise UserError(f"--workers {args.workers}: must be 0 (automatic) or a number of processes; try --workers 4")
    if args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout}: must be a positive number of seconds; try --timeout 1800")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here; use --device cpu (gloo) instead")
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); check the regex, or leave --pattern out for GPT-4's")
    documents, source_name, source = open_source(args.data or data, data_was_named=args.data is not None)
    files = local_files(args.data) if Path(args.data or data).exists() else []
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; give a directory")
    return split_pattern, documents, source, files, out_dir


def setup_process_group(device_name, timeout_s):
    """torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) or, run with plain python, a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_name == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        run_device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        run_device, backend = torch.device("cpu"), "gloo"
        # A merge is ~100 small tensor ops: waking OpenMP threads for each costs more than it saves
        # (10x slower on a busy machine). torchrun sets this already; plain python does not.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
    # The timeout bounds every collective: a rank that hangs (or a peer that never arrives) turns into an
    # error on the others after timeout_s instead of a silent wait. A rank that DIES is noticed sooner: its
    # sockets close, and torchrun stops the remaining workers of the group.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), run_device


def peak_memory_mb(run_device):
    if run_device.type == "cuda":
        return torch.cuda.max_memory_allocated(run_device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(argv):
    args = parse_args(argv)
    split_pattern, documents, source, files, out_dir = validate(args)

    # --- steps 1-2: this rank's share, pre-tokenized and counted, or the counts cached by an earlier run
    t0 = time.time()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    prefix = Path(args.cache_dir) / cache_key(args, source, files, world_size) / f"rank{rank}"
    cached = None if args.no_cache else read_cache(prefix)
    from_cache = cached is not None
    first_offset = lambda r: -(-args.num_chars * r // world_size)  # ceil(r n / W): where rank r's range starts
    share_chars = first_offset(rank + 1) - first_offset(rank)
    cores = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    num_workers = args.workers or (max(cores, 1) if share_chars >= 2**24 else 1)
    # Pre-tokenizing workers are forked now, before the process group and CUDA start their threads: a fork
    # copies only the calling thread, so forking later could copy a lock another thread holds, forever held.
    # Forking (not "spawn") also spares every worker a fresh import of torch.
    pool = None
    if cached is None and num_workers > 1:
        pool = multiprocessing.get_context("fork").Pool(num_workers, start_worker, (args.pattern,))
    rank, world_size, run_device = setup_process_group(args.device, args.timeout)
    say(f"{world_size} rank(s), backend {dist.get_backend()}, device {args.device}")
    error = None
    if cached is None:
        try:
            chunk_counts, chars_read = count_chunks(my_share(documents, args.num_chars, rank, world_size), split_pattern,
                                                    share_chars, show_progress=rank == 0, pool=pool, workers=num_workers)
            try:
                write_cache(prefix, chunk_counts, chars_read)
            except OSError as os_error:
                raise UserError(f"can't write the cache in {prefix.parent} ({os_error.strerror}); "
                                "give a writable folder: --cache_dir path/to/folder")
            del chunk_counts
            cached = read_cache(prefix)
        except UserError as user_error:
            error = str(user_error)
        finally:
            if pool is not None:
                pool.terminate()
    # A reading error happens on one rank (the one whose documents hold the bad line); share it so that
    # every rank stops together and rank 0 reports it, instead of the others waiting for the lost rank.
    errors = [None] * world_size
    dist.all_gather_object(errors, error)
    if any(errors):
        raise UserError(next(e for e in errors if e))
    blob, lengths, counts, stats = cached
    keys = ["chars", "chunks", "distinct", "total_bytes", "total_pairs", "bad_utf8"]
    totals = torch.tensor([stats[key] for key in keys] + [int(from_cache)], dtype=torch.int64, device=run_device)
    dist.all_reduce(totals)
    total = dict(zip(keys + ["ranks_from_cache"], totals.tolist()))
    t1 = time.time()
    if total["chars"] == 0:
        raise UserError(f"the corpus {source} is empty: no text to train on; point --data at files with text in them")
    if total["ranks_from_cache"]:
        say(f"cache: {total['ranks_from_cache']} of {world_size} ranks reused their counted chunks from "
            f"{prefix.parent} (skipped reading and pre-tokenizing; --no_cache counts again)")
    if total["bad_utf8"]:
        say(f"warning: {total['bad_utf8']} invalid UTF-8 sequences were replaced with U+FFFD")
    if total["chars"] < args.num_chars:
        say(f"the source ran out after {total['chars']:,} characters (asked for {args.num_chars:,}); training on those")
    say(f"read {total['chars']:,} characters: {total['chunks']:,} chunks, {total['distinct']:,} distinct per rank summed")
    shares = [None] * world_size
    dist.all_gather_object(shares, (stats["chars"], stats["distinct"]))
    say("per-rank share (characters, distinct chunks): " + ", ".join(f"{c:,}/{d:,}" for c, d in shares))

    # --- steps 3-4: device tensors, then the merges
    # int32 counts halve the [V, V] matrix; they are exact while the whole corpus (all ranks) has < 2^31 pairs.
    count_dtype = torch.int32 if total["total_pairs"] < 2**31 else torch.int64
    tokens, next_pos, prev_pos, weight = chunks_to_tensors(blob, lengths, counts, count_dtype, run_device)
    del blob, lengths, counts
    if run_device.type == "cuda":
        torch.cuda.synchronize(run_device)  # CUDA copies are queued: wait, or their time lands in the merge phase
    t2 = time.time()
    merges, tokens_saved, (bytes_received, exchange_seconds, overflow_merges) = train(
        tokens, next_pos, prev_pos, weight, args.vocab_size, run_device, show_progress=rank == 0)
    saved = torch.tensor([tokens_saved], dtype=torch.int64, device=run_device)
    dist.all_reduce(saved)
    t3 = time.time()
    peaks = [None] * world_size
    dist.all_gather_object(peaks, (peak_memory_mb(run_device), exchange_seconds))
    num_merges = len(merges)
    stop_reason = "vocab_size reached" if 256 + num_merges == args.vocab_size else "no pairs left to merge"
    if stop_reason != "vocab_size reached":
        say(f"stopped early after {num_merges} merges: no pairs left to merge (vocab {256 + num_merges} < {args.vocab_size})")
    if rank == 0:
        eot_id = 256 + num_merges
        info = {
            "pattern": args.pattern,
            "special_tokens": {EOT: eot_id},
            "vocab_size": eot_id + 1,
            "num_merges": num_merges,
            "num_chars": total["chars"],
            "source": source,
            "trainer": "train_bpe_multigpu.py",
            "world_size": world_size,
            "seconds": round(t3 - t0, 3),
            "stop_reason": stop_reason,
        }
        save_tokenizer(out_dir, merges, info)
        total_tokens = total["total_bytes"] - int(saved)
        read_phase = "loading the cache" if total["ranks_from_cache"] == world_size else "reading + pre-tokenizing"
        say(f"{read_phase} {t1 - t0:.2f}s | to {args.device} {t2 - t1:.2f}s | merging {t3 - t2:.2f}s "
            f"({num_merges / max(t3 - t2, 1e-9):,.0f} merges/s) | total {t3 - t0:.2f}s")
        say(f"communication: {bytes_received / max(num_merges, 1) / 1024:,.1f} KiB received per rank per merge; "
            f"{overflow_merges} of {num_merges} merges needed a second all_gather; seconds in the exchange per rank "
            f"(waiting for the slowest rank included): " + ", ".join(f"{seconds:.2f}" for _, seconds in peaks))
        memory = "peak device memory" if args.device == "cuda" else "peak RSS"
        say(f"{memory} per rank: " + ", ".join(f"{peak:,.0f} MiB" for peak, _ in peaks))
        say(f"compression on the training text: {total['total_bytes'] / max(total_tokens, 1):.3f} bytes/token "
            f"({total['total_bytes']:,} bytes -> {total_tokens:,} tokens)")
        say(f"wrote {out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, vocab_size {eot_id + 1})")
    dist.barrier()  # nobody leaves (and tears the group down) while rank 0 still writes


def lost_contact(error):
    """A collective failed: a peer died, hangs past --timeout, or could not be reached."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"rank {RANK} lost contact with the other ranks ({text[:200]}); one of them died, hangs, or was never "
            "started: see its messages above, and --timeout for how long a rank waits")


if __name__ == "__main__":
    exit_code = 0
    try:
        run(sys.argv[1:])
    except UserError as error:
        say(f"error: {error}", file=sys.stderr)
        exit_code = 1
        if RANK != 0:
            # Every rank stops on the same error, but only rank 0 says it. torchrun stops all ranks as soon as one
            # fails: were this rank first, rank 0 could be stopped before printing (seen once under load).
            time.sleep(5)
    except RuntimeError as error:
        # gloo reports a timeout or a closed socket as a plain RuntimeError, NCCL as a DistError: both name
        # their transport. Anything else is a bug, and keeps its traceback.
        from_transport = regex.search(r"gloo|nccl|timed? ?out|connection|peer", str(error), regex.IGNORECASE)
        if not isinstance(error, dist.DistError) and not from_transport:
            raise
        print(f"\nerror: {lost_contact(error)}", file=sys.stderr, flush=True)  # \n: off the progress bar's line
        exit_code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(exit_code)
