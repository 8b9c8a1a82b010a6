"""
Train a byte-level BPE tokenizer on many GPUs (or CPU processes) at once: exact, one tokenizer for all ranks.

    torchrun --standalone --nproc_per_node=8 train_bpe_multigpu.py -v 65534 -n 1073741824
    torchrun --standalone --nproc_per_node=2 train_bpe_multigpu.py --device cpu -v 1000 -n 1048576
    python train_bpe_multigpu.py --device cpu          # world size 1, no torchrun needed

The tokenizer is rustbpe's (and train_bpe_gpu.py's), byte for byte, trained on the documents that the ranks read
taken together: BPE depends only on the multiset of chunks. With -n past the end of the data, that is all of it,
whatever the world size. Output: tokenizers/<source>_v<vocab_size>/tokenizer.tiktoken, and tokenizer.json, which
records what each rank read.

This is not data-parallel training: a merge chosen from one rank's counts would be wrong. The ranks split
1. the text: each rank reads only its own part of the source, about n / W characters, documents whole;
2. the chunks: each rank pre-tokenizes its part and merges in its own distinct chunks, on its device;
3. the [V, V] pair-count matrix: rank r owns the rows `left` with left % W == r. A merge sends each count
   change to the owner of its pair (all_to_all), and one all_reduce(MAX) gives every rank the next pair.
"""

import argparse
import base64
import codecs
import contextlib
import datetime
import hashlib
import io
import json
import multiprocessing
import os
import resource
import signal
import socket
import sys
import sysconfig
import tempfile
import time
import urllib.parse
from collections import Counter, deque
from itertools import accumulate
from pathlib import Path

import numpy as np
import regex
import torch
import torch.distributed as dist
from tqdm import tqdm

# -----------------------------------------------------------------------------
# defaults, each overridable from the command line
vocab_size = 65534  # byte tokens (256) + merges; <|endoftext|> gets the next id (65534 keeps ids in uint16)
num_chars = 2**27  # characters to train on, all ranks together (about n / W each)
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory; default tokenizers/<source>_v<vocab_size>
device = "cuda" if torch.cuda.is_available() else "cpu"  # cuda -> NCCL, cpu -> gloo
cache_dir = "tokenizers/.cache"  # per-rank counted chunks, keyed by data/n/pattern/world size
workers = 0  # pre-tokenizing processes per rank; 0 = this rank's share of the cores when its part is big
timeout = 1800  # seconds a rank waits in a collective before giving up (reading a big part takes a while)
# GPT-4's split pattern: letters with their leading space, numbers in groups of up to 3, punctuation runs,
# and whitespace, so that merges never glue a word to the punctuation or the space after it.
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
HUB_DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),
                "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None)}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
CACHE_VERSION = 2
LANES = 256  # count changes a rank receives per all_to_all, LANES / W from each rank (more: a second round)
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- the merge loop, split across ranks
# Each rank holds its distinct chunks as flattened positions with linked-list neighbours (train_bpe_gpu.py's
# layout), so a merge never moves a token: tokens[pos] is an id (-1 at the spare slots END = L and DUMP = L + 1,
# DEAD once merged away), next_pos / prev_pos the live neighbours in the chunk (or END), weight[pos] how often
# this rank's text holds the chunk. Lanes that don't apply write to DUMP: every step is whole-tensor, with no
# filtering whose size the host would have to wait for.
DEAD = -2


def chunks_to_tensors(blob, lengths, counts, count_dtype, device):
    L = blob.size
    tokens = torch.full((L + 2,), -1, dtype=torch.int64, device=device)
    tokens[:L] = torch.from_numpy(np.array(blob)).to(device)  # copied as bytes, small beside the int64 tensors
    lengths, counts = (torch.from_numpy(np.array(array)).to(device) for array in (lengths, counts))
    next_pos, prev_pos = torch.arange(1, L + 3, device=device), torch.arange(-1, L + 1, device=device)
    ends = torch.cumsum(lengths, 0)
    next_pos[ends - 1], prev_pos[ends - lengths] = L, L
    next_pos[L:], prev_pos[L:] = L, L
    weight = torch.zeros(L + 2, dtype=count_dtype, device=device)
    weight[:L] = torch.repeat_interleave(counts, lengths).to(count_dtype)
    return tokens, next_pos, prev_pos, weight


class OwnedRows:
    """This rank's rows of the pair-count matrix: row `left` for each left % W == rank, stored at left // W.
    Their maximum is kept exact in two levels (each block of ~sqrt(V) columns, then each row), so a changed
    count costs one block and one row. max and argmax return the FIRST maximal index, so among equal counts
    the smallest right wins in a row, and the smallest left across rows: BPE's tie-break, for free."""

    def __init__(self, vocab_size, rank, world_size, count_dtype, device):
        self.rank, self.world_size = rank, world_size
        self.bits = max(1, (vocab_size - 1).bit_length())  # bits of a token id, for the int64 key
        self.block = 1 << ((self.bits + 1) // 2)
        self.width = -(-vocab_size // self.block) * self.block
        rows = (vocab_size - 1 - rank) // world_size + 1
        self.counts = torch.zeros(rows, self.width, dtype=count_dtype, device=device)

    def refresh_all(self):
        self.block_max, self.block_arg = self.counts.view(len(self.counts), -1, self.block).max(dim=2)
        self.row_max, block = self.block_max.max(dim=1)
        self.row_arg = block * self.block + self.block_arg.gather(1, block[:, None]).squeeze(1)

    def apply(self, received):
        """Add (flat local index, delta) lanes, then refresh the block and the row of each. Lanes that repeat a
        block compute the same values from the same counts, so their duplicate writes agree."""
        flat, delta = received[:, 0], received[:, 1]
        self.counts.view(-1).index_add_(0, flat, delta.to(self.counts.dtype))
        rows, blocks = flat // self.width, flat % self.width // self.block
        columns = (blocks * self.block)[:, None] + torch.arange(self.block, device=flat.device)
        values, where = self.counts[rows[:, None], columns].max(dim=1)
        self.block_max[rows, blocks], self.block_arg[rows, blocks] = values, where
        values, block = self.block_max[rows].max(dim=1)
        self.row_max[rows], self.row_arg[rows] = values, block * self.block + self.block_arg[rows, block]

    def best(self):  # (count, left, right) of this rank's best pair, as device tensors: no host read
        row = torch.argmax(self.row_max).view(1)  # a 1-element index: a 0-dim one would be read by the host
        return self.row_max[row][0].long(), (row * self.world_size + self.rank)[0], self.row_arg[row][0]


def choose(owned, count, left, right, overflow, one_key):
    """Every rank gets the same next pair. With B bits an id and M = 2^B - 1, the key
    count << 2B | (M - left) << B | (M - right) is largest for the pair BPE takes, tie-break included, so one
    all_reduce(MAX) chooses. It also carries the overflow: the most changes a rank could not send to one owner
    in the last all_to_all. Counts past 63 - 2B bits are reduced before the tie-break (2 collectives)."""
    B, M = owned.bits, (1 << owned.bits) - 1
    tie = (M - left) << B | (M - right)
    packed = torch.stack([count << 2 * B | tie if one_key else count, overflow])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    if one_key:
        count, tie = packed[0] >> 2 * B, packed[0] & ((1 << 2 * B) - 1)
    else:
        count, tie = packed[0], torch.where(count == packed[0], tie, -1)
        dist.all_reduce(tie, op=dist.ReduceOp.MAX)
    return count, M - (tie >> B), M - (tie & M), packed[1]


def sum_by_owner(pair_index, delta, owned, V):
    """Sum this rank's count changes per pair in fixed-size tensors (no size for the host to read): sort the
    lanes by (owner, pair), add up each run of one pair, and number the nonzero sums within each owner."""
    W, span = owned.world_size, owned.counts.numel() + owned.width  # span > any flat local index
    left = pair_index // V
    keys, order = torch.sort(left % W * span + left // W * owned.width + pair_index % V)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    run = torch.cumsum(first, 0) - 1
    summed = torch.zeros_like(keys).index_add_(0, run, delta[order])
    run_key = torch.zeros_like(keys).scatter_(0, run, keys)  # every lane of a run writes the same key
    live, owner = summed != 0, run_key // span
    per_owner = torch.zeros(W, dtype=torch.int64, device=keys.device).index_add_(0, owner, live.long())
    slot = torch.cumsum(live, 0) - 1 - (torch.cumsum(per_owner, 0) - per_owner)[owner]
    return run_key % span, summed, owner, slot, live, per_owner.max()


def exchange(sums, skip, width, device):
    """One all_to_all of `width` lanes per owner: its sums numbered skip .. skip + width - 1. Unused lanes are
    (0, 0): adding 0 to the owner's first count changes nothing. Fixed sizes: no sizes to send first."""
    flat, summed, owner, slot, live, _ = sums
    W = dist.get_world_size()
    send = torch.zeros(W * width + 1, 2, dtype=torch.int64, device=device)  # the last lane is a dump
    sent = live & (slot >= skip) & (slot < skip + width)
    send[torch.where(sent, owner * width + slot - skip, W * width)] = torch.stack([flat, summed], dim=1)
    if W == 1:
        return send[:-1]  # a world of one sends to itself: gloo would spend ~1 ms on the copy
    received = torch.empty(W * width, 2, dtype=torch.int64, device=device)
    dist.all_to_all_single(received, send[:-1])
    return received


# Why this cannot deadlock or diverge: every branch of the loop below depends only on the REDUCED values that
# choose() returns, the same on every rank: the pair, its count (0 everywhere at once when no pair is left, so
# all stop together), and the overflow that calls a second all_to_all. So every rank runs the same collectives
# in the same order; a rank with no text sends padding and takes part all the same. Exact: counts are
# integers, and each pair has one owner that adds all its changes, in any order, to the same sum.


def train(tokens, next_pos, prev_pos, weight, vocab_size, total_pairs, device, show_progress):
    """The merges in order, [((left, right), new_id)]; this rank's tokens saved; per-run counters."""
    L, V, DUMP = tokens.numel() - 2, vocab_size, tokens.numel() - 1
    rank, W = dist.get_rank(), dist.get_world_size()
    owned = OwnedRows(V, rank, W, weight.dtype, device)
    one_key, cap = total_pairs < 2 ** (63 - 2 * owned.bits), max(LANES // W, 16)
    # Only byte pairs exist at first: one all_reduce of a 256 x 256 block, then each owner keeps its rows.
    lefts = torch.nonzero(next_pos[:L] != L).squeeze(1)
    byte_pairs = torch.zeros(256 * 256, dtype=torch.int64, device=device)
    byte_pairs.index_add_(0, tokens[lefts] * 256 + tokens[next_pos[lefts]], weight[lefts].long())
    dist.all_reduce(byte_pairs)
    mine = byte_pairs.view(256, 256)[rank::W]
    owned.counts[:len(mine), :256] = mine.to(weight.dtype)
    owned.refresh_all()
    # Position lists in one flat buffer: for each id, this rank's positions that hold it, in order, so a merge
    # of (a, b) visits only a's. A merge appends as many positions as it kills: twice the start size suffices.
    list_buffer = torch.zeros(2 * len(lefts) + 1, dtype=torch.int64, device=device)
    byte_ids, order = torch.sort(tokens[lefts], stable=True)
    list_buffer[:len(order)] = lefts[order]
    list_len = torch.bincount(byte_ids, minlength=V)
    list_start, append_at = torch.cumsum(list_len, 0) - list_len, list_len.sum()

    merges, sums, overflow, stats = [], None, torch.zeros((), dtype=torch.int64, device=device), Counter()
    progress = tqdm(total=V - 256, unit="merge", desc="merging", mininterval=0.5, disable=not show_progress)
    while len(merges) < V - 256:
        count, a, b, most = choose(owned, *owned.best(), overflow, one_key)
        # The one host read of a merge, right after the collective's own wait: the pair, and where a's
        # positions are on this rank (the sizes of this merge's tensors).
        at = a.view(1)
        count, a, b, most, start, length = torch.stack([count, a, b, most, list_start[at][0], list_len[at][0]]).tolist()
        stats.update(collectives=1 + (not one_key), host_reads=1)
        if most > cap:  # a rank had more changes for one owner than a round carries: send the rest, choose again
            owned.apply(exchange(sums, cap, most - cap, device))
            overflow = torch.zeros_like(overflow)
            stats.update(collectives=1, second_rounds=1)
            continue
        if count == 0:
            break  # no pair left on any rank
        new_id = 256 + len(merges)
        merges.append(((a, b), new_id))

        # --- this rank's occurrences: positions that hold a, followed by b
        candidates = list_buffer[start:start + length].clone()
        right = next_pos[candidates]
        match = (tokens[candidates] == a) & (tokens[right] == b)
        if a == b:  # inside a run of adjacent matches ("aaaa"), take every other one, starting with the first
            chained = match & (tokens[prev_pos[candidates]] == a)
            match_number = torch.cumsum(match, 0)
            run_first = torch.cummax(torch.where(match & ~chained, match_number, 0), 0).values
            selected = match & ((match_number - run_first) % 2 == 0)
        else:
            selected = match
        before, after = prev_pos[candidates], next_pos[right]
        token_before, token_after = tokens[before], tokens[after]
        count_here = torch.where(selected, weight[candidates], 0).long()
        # Unlink the right halves first: then a left neighbour that is DEAD is the right half of the previous
        # occurrence ("abab", or a run "aaaa"), whose pair that occurrence already accounts for.
        tokens.index_fill_(0, torch.where(selected, right, DUMP), DEAD)
        count_before = torch.where(selected & (tokens[before] >= 0), count_here, 0)
        has_after = selected & (after != L)
        count_after = torch.where(has_after, count_here, 0)
        left_halves = torch.where(selected, candidates, DUMP)
        tokens.index_fill_(0, left_halves, new_id)
        next_pos[left_halves] = after
        prev_pos[torch.where(has_after, after, DUMP)] = candidates
        # The changes: (x, a), (a, b), (b, y) lose, (x, new) and (new, y) gain. y is read again: it is new_id
        # itself when the next occurrence starts right after this one.
        pair_index = torch.cat([token_before * V + a, torch.full_like(candidates, a * V + b),
                                b * V + token_after, token_before * V + new_id, new_id * V + tokens[after]])
        delta = torch.cat([-count_before, -count_here, -count_after, count_before, count_after])
        sums = sum_by_owner(torch.where(delta != 0, pair_index, 0), delta, owned, V)
        owned.apply(exchange(sums, 0, cap, device))
        overflow = sums[-1]
        stats.update(collectives=1)

        # --- the position lists: a's keeps the positions that still hold a, new_id's gets the merged ones
        still_a = tokens[candidates] == a
        list_buffer[torch.where(still_a, torch.cumsum(still_a, 0) + (start - 1), -1)] = candidates
        list_len[a] = still_a.sum()
        list_buffer[torch.where(selected, torch.cumsum(selected, 0) + (append_at - 1), -1)] = candidates
        list_start[new_id] = append_at
        list_len[new_id] = selected.sum()
        append_at += list_len[new_id]
        progress.update(1)
    progress.close()
    tokens_saved = int(weight[tokens == DEAD].sum())  # one token saved per merged occurrence, times its weight
    return merges, tokens_saved, stats


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
            except (ValueError, KeyError, TypeError, RecursionError):  # not JSON, no "text", not an object, too deep
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

# ---------------------------------------------------------------- this rank's part of the text, counted
#
# Local files are laid end to end, and rank r gets bytes [r S / W, (r + 1) S / W). A document belongs to the
# range that holds its first byte: a .jsonl line, a whole .txt file, a parquet row group (placed at its share
# of the file's bytes). So each is read whole, by one rank, and a rank seeks straight to its range.


def my_documents(name, source, rank, world_size, budget, record):
    """This rank's documents (a generator: nothing is read yet), and the files they come from."""
    if name in HUB_DATASETS and not source.startswith("Python standard library"):  # `datasets` splits a stream
        repository, config, _ = HUB_DATASETS[name]
        return datasets_texts(repository, node=(rank, world_size), path=repository, name=config), []
    files = local_files(name) if name not in HUB_DATASETS else [  # or the offline corpus, a .py file a document
        path for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")) if "site-packages" not in path.parts]
    sizes = [path.stat().st_size for path in files]
    lo, hi = record["bytes"] = [sum(sizes) * rank // world_size, sum(sizes) * (rank + 1) // world_size]
    mine = [(path, first, size) for path, first, size in zip(files, accumulate([0] + sizes), sizes)
            if size and first < hi and (lo <= first or first + size > lo and path.suffix in (".jsonl", ".parquet"))]
    return part_documents(mine, lo, hi, budget), files


def part_documents(files, lo, hi, budget):
    for path, first, size in files:
        if path.suffix == ".jsonl":
            yield from read_jsonl(path, max(lo - first, 0), hi - first if hi < first + size else None)
        elif path.suffix == ".parquet":
            yield from parquet_row_groups(path, first, size, lo, hi)
        else:
            yield from read_txt(path, budget)


def parquet_row_groups(path, first, size, lo, hi):
    import pyarrow.parquet
    try:
        parquet = pyarrow.parquet.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            if lo <= first + size * group // parquet.num_row_groups < hi:
                for text in parquet.read_row_group(group, columns=["text"]).column(0).to_pylist():
                    if not isinstance(text, str):
                        raise UserError(f"{path}, row group {group}: \"text\" is {type(text).__name__}, not a "
                                        "string; it must be a column of strings")
                    yield text
    except UserError:
        raise
    except Exception as error:  # not parquet, corrupt, no "text" column
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UserError(f"can't read {path} ({reason}); check it, or use other files: --data path/to/files")


# The regex is the slow part, so worker processes count batches of whole documents, at most two per worker in
# flight (RAM stays bounded). A CPU-time alarm per document (1 s + 10 us a character) turns a pattern that
# backtracks catastrophically into one line instead of a hang.
SPLIT = None  # the compiled pattern, in each worker


def time_is_up(signum, frame):
    raise TimeoutError


def start_worker(pattern_text):
    global SPLIT
    SPLIT = regex.compile(pattern_text)
    signal.signal(signal.SIGPROF, time_is_up)


def count_batch(documents):
    counts = Counter()
    for document in documents:
        try:
            signal.setitimer(signal.ITIMER_PROF, 1 + len(document) / 1e5)
            counts.update(SPLIT.findall(document))
        except TimeoutError:
            raise UserError(f"--pattern {SPLIT.pattern!r} backtracks catastrophically: it ran past the time limit "
                            f"on the document that starts {document[:30]!r}; simplify the pattern")
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    if "" in counts:  # a pattern that matches empty only in context, like \b
        raise UserError(f"--pattern {SPLIT.pattern!r} matches the empty string; every match must take at least "
                        "one character (x+, not x*)")
    return counts


def count_chunks(documents, budget, record, show_progress, pool, workers):
    """The documents up to this rank's share of -n, the last one cut to fit (and never one more asked of the
    source), counted by the pool in batches of a MiB of characters."""
    chunk_counts, pending, batch = Counter(), deque(), []
    record.update(documents=0, chars=0, cut=False)
    with tqdm(total=budget, unit="char", unit_scale=True, desc="reading (rank 0's part)", mininterval=0.5,
              disable=not show_progress) as progress:
        for text in documents if budget > 0 else ():
            kept = text[:budget - record["chars"]]
            record.update(documents=record["documents"] + 1, chars=record["chars"] + len(kept), cut=len(kept) < len(text))
            progress.update(len(kept))
            batch.append(kept)
            if record["chars"] // 2**20 > (record["chars"] - len(kept)) // 2**20:
                pending.append(pool.apply_async(count_batch, (batch,)))
                batch = []
            while len(pending) > 2 * workers:
                chunk_counts.update(pending.popleft().get())
            if record["chars"] == budget:
                break
        for result in [*pending, pool.apply_async(count_batch, (batch,))]:
            chunk_counts.update(result.get())
    return chunk_counts


# The cache is what the merge loop needs, as .npy files (no pickle: loading one can't run code): the UTF-8
# bytes of this rank's distinct chunks of 2+ bytes, and the length and count of each. The .json, written last,
# holds the statistics, what was read, and a sha256 of it all: a cache that fails it is counted again.


def cache_key(args, source, files, world_size):
    """Changes whenever the counted chunks could: other data (or the same files changed), n, pattern, W."""
    stamp = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    key = json.dumps([CACHE_VERSION, source, stamp, args.num_chars, args.pattern, world_size])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def checksum(arrays, stats):
    digest = hashlib.sha256(json.dumps(stats, sort_keys=True).encode())
    for array in arrays:
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def write_cache(prefix, chunk_counts, record):
    chunks = [chunk.encode("utf-8") for chunk in chunk_counts]
    lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
    counts = np.fromiter(chunk_counts.values(), np.int64, len(chunks))
    keep = lengths >= 2  # single-byte chunks hold no pair: they only count in the statistics
    arrays = [np.frombuffer(b"".join(c for c, kept in zip(chunks, keep) if kept), np.uint8), lengths[keep], counts[keep]]
    stats = {"chunks": int(counts.sum()), "distinct": len(chunks), "total_bytes": int((lengths * counts).sum()),
             "total_pairs": int(((lengths - 1) * counts).sum()), "bad_utf8": BadUTF8.count, "part": record}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").unlink(missing_ok=True)  # until it is written again, the cache is incomplete
    for name, array in zip(("bytes", "lengths", "counts"), arrays):
        np.save(prefix.with_suffix(f".{name}.npy"), array)
    write_atomically(prefix.with_suffix(".json"), json.dumps({**stats, "sha256": checksum(arrays, stats)}))


def read_cache(prefix):
    """(bytes, lengths, counts, stats) memory-mapped; None when absent, "tampered" when it fails its checksum."""
    try:
        stats = json.loads(prefix.with_suffix(".json").read_text())
        arrays = [np.load(prefix.with_suffix(f".{name}.npy"), mmap_mode="r") for name in ("bytes", "lengths", "counts")]
        expected = stats.pop("sha256")
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return (*arrays, stats) if checksum(arrays, stats) == expected else "tampered"


def write_atomically(path, text):
    """Write to a temporary name and rename: a crash never leaves a half-written file behind."""
    path.with_name(path.name + ".tmp").write_text(text, encoding="utf-8")
    os.replace(path.with_name(path.name + ".tmp"), path)


# ---------------------------------------------------------------- the run

RANK = int(os.environ.get("RANK", "0"))  # torchrun sets it before we start: rank 0 alone speaks
OUR_FILES = {"tokenizer.tiktoken", "tokenizer.json", "tokenizer.tiktoken.tmp", "tokenizer.json.tmp"}


def say(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size, help="tokens before <|endoftext|> (256 bytes + merges)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="characters to train on, all ranks together")
    parser.add_argument("--data", default=None, help=f"fineweb | fineweb-edu | path to .txt/.jsonl/.parquet or a directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default tokenizers/<source>_v<vocab_size>)")
    parser.add_argument("--pattern", default=pattern, help="the pre-tokenizer regex (default GPT-4's)")
    parser.add_argument("--device", default=device, choices=["cuda", "cpu"], help=f"cuda (NCCL) or cpu (gloo) (default {device})")
    parser.add_argument("--cache_dir", default=cache_dir, help=f"where each rank caches its counted chunks (default {cache_dir})")
    parser.add_argument("--no_cache", action="store_true", help="count again even if a cache exists (and refresh it)")
    parser.add_argument("--workers", type=int, default=workers, help="pre-tokenizing processes per rank (default: "
                        "the node's cores / ranks on the node, for parts of 2^24+ characters; 1 below)")
    parser.add_argument("--timeout", type=float, default=timeout, help=f"seconds to wait for the other ranks (default {timeout})")
    return parser.parse_args(argv)


def validate(args):
    """Every check that needs no text runs on every rank BEFORE the process group exists: each rank reaches
    the same verdict on its own, exits, and nobody is left waiting in a collective."""
    if not 256 <= args.vocab_size <= 65536:
        raise UserError(f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes alone) and 65536; try -v 1000")
    if args.num_chars <= 0:
        raise UserError(f"-n {args.num_chars}: the number of characters must be positive; try -n 1048576")
    if args.workers < 0 or args.timeout <= 0:
        raise UserError(f"--workers {args.workers} --timeout {args.timeout}: workers must be 0 (automatic) or more, "
                        "and the timeout a positive number of seconds; try --workers 4 --timeout 1800")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA GPU is visible here; use --device cpu (gloo) instead")
    try:
        empty_match = regex.compile(args.pattern).fullmatch("") is not None
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); check the regex, or leave --pattern out for GPT-4's")
    if empty_match:
        raise UserError(f"--pattern {args.pattern!r} matches the empty string; every match must take at least one "
                        "character (x+, not x*)")
    with contextlib.redirect_stderr(io.StringIO()) if RANK else contextlib.nullcontext():  # one warning, rank 0's
        _, source_name, source = open_source(args.data or data, data_was_named=args.data is not None)
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    for path in [out_dir, *out_dir.parents]:
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {out_dir}: {path} is a file, not a directory")
    others = sorted({path.name for path in out_dir.iterdir()} - OUR_FILES) if out_dir.is_dir() else []
    if others:  # a dataset's tokenizer would be replaced
        what = "a dataset directory (it holds meta.json)" if {"meta.json", "progress.json"} & set(others) else \
            f"not a tokenizer directory (it holds {others[0]})"
        raise UserError(f"--out {out_dir} is {what}; give a new or a tokenizer directory")
    try:  # rank 0 writes a probe (root passes os.access even on /proc): in out_dir, a name that the other ranks'
        if RANK == 0 and out_dir.is_dir():  # listing above ignores; else a directory in the deepest one that exists
            (out_dir / "tokenizer.json.tmp").write_text("")
            (out_dir / "tokenizer.json.tmp").unlink()
        elif RANK == 0:
            tempfile.TemporaryDirectory(dir=next(p for p in out_dir.parents if p.exists())).cleanup()
    except OSError as error:
        raise UserError(f"--out {out_dir} can't be written ({error.strerror}); give a directory you can write")
    return source, out_dir


def run(argv):
    args = parse_args(argv)
    source, out_dir = validate(args)

    # --- this rank's part, pre-tokenized and counted, or the counts cached by an earlier run
    t0 = time.time()
    world_size, record = int(os.environ.get("WORLD_SIZE", "1")), {"rank": RANK}
    share_chars = args.num_chars * (RANK + 1) // world_size - args.num_chars * RANK // world_size
    documents, files = my_documents(args.data or data, source, RANK, world_size, share_chars, record)
    prefix = Path(args.cache_dir) / cache_key(args, source, files, world_size) / f"rank{RANK}"
    cached = None if args.no_cache else read_cache(prefix)
    state = "reused" if isinstance(cached, tuple) else cached or "counted"
    cores = len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    num_workers = args.workers or (max(cores, 1) if share_chars >= 2**24 else 1)
    # The workers are forked before the process group starts its threads: a fork copies only the calling
    # thread, and could copy a lock that another thread holds, held forever.
    pool = None if state == "reused" else multiprocessing.get_context("fork").Pool(num_workers, start_worker, (args.pattern,))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "OMP_NUM_THREADS" not in os.environ:  # small ops: waking OpenMP threads for each costs more than it saves
        torch.set_num_threads(1)
    # The timeout bounds every collective: a rank that hangs turns into an error on the others after it (one
    # that dies is noticed sooner: its sockets close). Run with plain python, this is a world of one.
    alone = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=args.timeout), **alone)
    run_device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    say(f"{world_size} rank(s), backend {dist.get_backend()}, device {args.device}")
    error = None
    try:
        if pool:
            write_cache(prefix, count_chunks(documents, share_chars, record, RANK == 0, pool, num_workers), record)
            cached = read_cache(prefix)
    except UserError as user_error:
        error = str(user_error)
    except OSError as os_error:
        error = f"can't write the cache in {prefix.parent} ({os_error.strerror}); give a writable --cache_dir"
    finally:
        if pool:
            pool.terminate()
    # A reading error happens on one rank (the one whose part holds the bad line): share it, so that every
    # rank stops together and rank 0 reports it, instead of the others waiting for the lost rank.
    parts = [None] * world_size
    dist.all_gather_object(parts, error or (cached[3], state))
    if any(isinstance(part, str) for part in parts):
        raise UserError(next(part for part in parts if isinstance(part, str)))
    total = {key: sum(stats[key] for stats, _ in parts) for key in ("chunks", "total_bytes", "total_pairs", "bad_utf8")}
    total["chars"], states = sum(stats["part"]["chars"] for stats, _ in parts), [state for _, state in parts]
    t1 = time.time()
    if total["chars"] == 0:
        raise UserError(f"the corpus {source} is empty: no text to train on; point --data at files with text in them")
    if "tampered" in states:
        say("warning: a cached part did not match its checksum (edited or half-copied): counted again", file=sys.stderr)
    if "reused" in states:
        say(f"cache: {states.count('reused')} of {world_size} ranks reused their counted chunks from {prefix.parent} "
            "(skipped reading and pre-tokenizing; --no_cache counts again)")
    if total["bad_utf8"]:
        say(f"warning: {total['bad_utf8']} invalid UTF-8 sequences were replaced with U+FFFD", file=sys.stderr)
    if total["chars"] < args.num_chars:
        say(f"read {total['chars']:,} characters, fewer than -n {args.num_chars:,}: each rank reads at most n / W from "
            "its own part, and some parts ran out; training on those")
    say(f"read {total['chars']:,} characters, {total['chunks']:,} chunks; per-rank part (characters, distinct chunks): "
        + ", ".join(f"{stats['part']['chars']:,}/{stats['distinct']:,}" for stats, _ in parts))

    # --- the merges, each rank in its own chunks and its own rows of the count matrix
    count_dtype = torch.int32 if total["total_pairs"] < 2**31 else torch.int64  # no count exceeds the total
    tokens, next_pos, prev_pos, weight = chunks_to_tensors(*cached[:3], count_dtype, run_device)
    if run_device.type == "cuda":
        torch.cuda.synchronize(run_device)  # CUDA copies are queued: wait, or their time lands in the merge phase
    t2 = time.time()
    merges, tokens_saved, loop = train(tokens, next_pos, prev_pos, weight, args.vocab_size, total["total_pairs"],
                                       run_device, show_progress=RANK == 0)
    t3 = time.time()
    peak = torch.cuda.max_memory_allocated(run_device) if args.device == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    ends = [None] * world_size
    dist.all_gather_object(ends, (tokens_saved, peak / 2**20))
    num_merges, eot_id = len(merges), 256 + len(merges)
    stop_reason = "vocab_size reached" if eot_id == args.vocab_size else "no pairs left to merge"
    if stop_reason != "vocab_size reached":
        say(f"stopped early after {num_merges} merges: no pairs left to merge (vocab {eot_id} < {args.vocab_size})")
    if RANK == 0:
        vocab = [bytes([i]) for i in range(256)]  # the bytes themselves, then each merge's two halves glued
        for (left, right), _ in merges:
            vocab.append(vocab[left] + vocab[right])
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(out_dir / "tokenizer.tiktoken", "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                                                                for rank, token in enumerate(vocab)))
        write_atomically(out_dir / "tokenizer.json", json.dumps({
            "pattern": args.pattern, "special_tokens": {EOT: eot_id}, "vocab_size": eot_id + 1, "num_merges": num_merges,
            "num_chars": total["chars"], "source": source, "trainer": "train_bpe_multigpu.py", "world_size": world_size,
            "seconds": round(t3 - t0, 3), "stop_reason": stop_reason, "read": [stats["part"] for stats, _ in parts]},
            indent=2, ensure_ascii=False) + "\n")
    tokens_left = total["total_bytes"] - sum(saved for saved, _ in ends)
    say(f"{'loading the cache' if states.count('reused') == world_size else 'reading + pre-tokenizing'} "
        f"{t1 - t0:.2f}s | to {args.device} {t2 - t1:.2f}s | merging {t3 - t2:.2f}s "
        f"({num_merges / max(t3 - t2, 1e-9):,.0f} merges/s) | total {t3 - t0:.2f}s")
    say(f"per merge: {loop['collectives'] / max(num_merges, 1):.2f} collectives, {loop['host_reads'] / max(num_merges, 1):.2f} "
        f"host reads; {loop['second_rounds']} merges needed a second all_to_all")
    say(f"{'peak device memory' if args.device == 'cuda' else 'peak RSS'} per rank: "
        + ", ".join(f"{peak:,.0f} MiB" for _, peak in ends))
    say(f"compression: {total['total_bytes'] / max(tokens_left, 1):.3f} bytes/token; wrote {out_dir}/tokenizer.tiktoken"
        f" and tokenizer.json ({EOT} = {eot_id}, vocab_size {eot_id + 1})")
    dist.barrier()  # nobody leaves (and tears the group down) while rank 0 still writes


if __name__ == "__main__":
    exit_code = 0
    try:
        run(sys.argv[1:])
    except UserError as error:
        say(f"error: {error}", file=sys.stderr)
        exit_code = 1
        if RANK != 0:  # only rank 0 speaks; were this rank to exit first, torchrun could stop rank 0 before it does
            time.sleep(5)
    except RuntimeError as error:  # gloo says a timeout or a closed socket as a RuntimeError, NCCL as a DistError
        if not isinstance(error, dist.DistError) and not regex.search(r"gloo|nccl|timed? ?out|connection|peer", str(error), regex.I):
            raise  # not the transport: a bug, with its traceback
        text = (str(error).strip() or type(error).__name__).splitlines()[0][:200]
        print(f"\nerror: rank {RANK} lost contact with the other ranks ({text}); one of them died, hangs, or was "
              "never started: see its messages above, and --timeout for how long a rank waits", file=sys.stderr, flush=True)
        exit_code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(exit_code)
