"""
Train a byte-level BPE tokenizer with the merge loop on a GPU: the same merges as train_bpe_cpu.py and rustbpe.

    python train_bpe_gpu.py -v 1000 -n 1048576                      # on a CUDA GPU
    python train_bpe_gpu.py --data ../shared/corpora/enwiki.jsonl -v 65534 -n 134217728
    python train_bpe_gpu.py -v 300 -n 65536 --device cpu            # no GPU: Triton's interpreter, for testing

Flags and outputs are train_bpe_cpu.py's, the readable reference of the algorithm. This file shows how a
sequential algorithm gets fast on a GPU: merge k needs the counts left by merge k-1, so merges can't run in
parallel, but the work inside a merge can, and the host must stay out of the way. A merge is four small Triton
kernels; the host launches them (on CUDA, 16 merges as one CUDA graph) and reads one flag per 16 merges: "done?".
--device cpu runs the same kernels in Triton's interpreter (TRITON_INTERPRET=1): exact, slow, for the tests.
"""

import argparse
import base64
import codecs
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
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import torch
from tqdm import tqdm

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")  # read when triton is imported
try:
    import triton
    import triton.language as tl
except ImportError:
    sys.exit("error: train_bpe_gpu.py needs triton (pip install triton; CUDA builds of torch bring it). "
             "Without a GPU, train_bpe_cpu.py is the better choice.")

# -----------------------------------------------------------------------------
# defaults, each overridable from the command line
vocab_size = 1000  # byte tokens (256) + merges; <|endoftext|> gets the next id
num_chars = 1048576  # train on the first 2^20 characters of the stream
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory; default tokenizers/<source>_v<vocab_size>
device = None  # cuda; without a GPU say --device cpu (Triton's interpreter: exact, slow, for testing)
# GPT-4's split pattern: letters with their leading space, numbers in groups of up to 3, punctuation runs,
# and whitespace, so that merges never glue a word to the punctuation or the space after it.
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
HUB_DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),  # (repository, config, parquet files)
                "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", None)}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
TOKENIZER_FILES = ("tokenizer.tiktoken", "tokenizer.json", "tokenizer.tiktoken.tmp", "tokenizer.json.tmp")
INTERPRETER_SHAPE = (1, 1024, 64, 1024)  # programs, block of positions, of dirty rows, of choose_pair's rows
MERGES_PER_READ = 16  # merges launched (on CUDA: one graph replay) per host read of the "done" flag
PARALLEL_CHARS = 1 << 24  # from this many characters on, worker processes pre-tokenize .jsonl files
RANGE_BYTES = 1 << 23  # the bytes of a .jsonl file that one worker reads at a time
MAX_POSITIONS = 2**31 - 2  # positions are int32 (half the memory of int64): the distinct chunks' bytes + 2 spare slots
# -----------------------------------------------------------------------------


class UserError(Exception):
    """A mistake in the input: printed as one line, never as a traceback."""


# ---------------------------------------------------------------- the lesson: one BPE merge as four kernels
# The distinct chunks lie in flat arrays, one slot per byte (a "position"), as in train_bpe_cpu.py:
#   tokens[p]      the token at p; -1 on the spare slots END and END+1, DEAD once p was a merged right half
#   next_pos[p]    the next live position of p's chunk, or END; prev_pos[p] likewise. A merge unlinks the right
#                  half of a pair, as in a linked list: tokens never move, so positions stay valid names.
#   weight[p]      how often p's chunk occurs in the corpus
#   counts[l*V+r]  the weighted count of pair (l, r): a dense V x V matrix, so a count is one address
#   lists          the positions holding each token, one region of list_buffer per id: merging (a, b) visits
#                  only a's positions, never whole chunks.
# Choosing must not scan V^2 counts. A pair's key is count << 20 | (2^20 - 1 - r), and row_key[l] is the largest
# key of row l: its largest count, ties to the smallest r; across rows, the smallest l wins a tie. (One key per
# pair would make the choice a single max, but cap counts at 2^31: per-row keys keep them exact to 2^43.) Only
# pairs with the new token grow: atomic_max raises their row's key. A count that shrinks leaves its row's key too
# high only if it was the row's maximum: that row is "dirty" (rare) and recomputed from the matrix.
# The host never reads the loop's state (a, b, list bounds): it lives in the device tensor `state`. A kernel's
# programs loop over blocks with a stride, so each grid has a size known before the data: that is what lets
# CUDA record 16 merges as one graph. No kernel needs a lock; each docstring says why, from who writes what.

NEXT, NEW, A, B, DONE, START, LENGTH, SURVIVORS, DIRTY = (tl.constexpr(i) for i in range(9))  # slots of `state`
DEAD = tl.constexpr(-2)  # the token of an unlinked position (the right half of a merged pair)
ID_BITS = tl.constexpr(20)  # a key's low bits hold 2^20 - 1 - right id
LOW = tl.constexpr((1 << 20) - 1)


@triton.jit
def append(length, buffer, values, keep):
    """Appends the lanes' values where keep to a list: one atomic add reserves the block's slots, one per lane."""
    slot = tl.atomic_add(length, tl.sum(keep.to(tl.int32), axis=0)) + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(buffer + slot, values, mask=keep)


@triton.jit
def choose_pair(state, row_key, fresh_key, dirty_flag, dirty_rows, list_start, list_len, merges, V,
                BLOCK: tl.constexpr):
    """Picks the pair with the largest key and writes the merge's state (a, b, new id, list bounds). One program,
    alone on the device (kernels run in order), so it may read and write anything."""
    if tl.load(state + DONE) == 0:
        # The rows refresh_rows recomputed (their maxima are in fresh_key) become exact again.
        dirty = tl.load(state + DIRTY)
        for first in range(0, dirty, BLOCK):
            i = first + tl.arange(0, BLOCK)
            rows = tl.load(dirty_rows + i, mask=i < dirty, other=0)
            tl.store(row_key + rows, tl.load(fresh_key + rows, mask=i < dirty), mask=i < dirty)
            tl.store(fresh_key + rows, 0, mask=i < dirty)
            tl.store(dirty_flag + rows, 0, mask=i < dirty)
        # A row copied by one thread may be read below by another, and Triton orders global memory only within
        # a thread: a barrier, or a thread could scan a dirty row's stale key (or read DIRTY after it is reset).
        tl.debug_barrier()
        tl.store(state + DIRTY, 0)
        # The largest count over all rows; blocks go in increasing row order, and the first row wins a tie.
        new = tl.load(state + NEXT)
        best_count, best_row = tl.full((), 0, tl.int64), tl.full((), 0, tl.int64)
        for first in range(0, new, BLOCK):
            rows = first + tl.arange(0, BLOCK)
            count = tl.load(row_key + rows, mask=rows < new, other=0) >> ID_BITS
            block_best = tl.max(count, axis=0)
            block_row = tl.min(tl.where(count == block_best, rows, new), axis=0).to(tl.int64)
            best_row = tl.where(block_best > best_count, block_row, best_row)
            best_count = tl.maximum(block_best, best_count)
        if (best_count == 0) | (new >= V):
            tl.store(state + DONE, 1)
        else:
            right = LOW - (tl.load(row_key + best_row) & LOW)
            tl.store(merges + 2 * (new - 256), best_row)
            tl.store(merges + 2 * (new - 256) + 1, right)
            tl.store(state + NEW, new)
            tl.store(state + NEXT, new + 1)
            tl.store(state + A, best_row)
            tl.store(state + B, right)
            tl.store(state + START, tl.load(list_start + best_row))
            tl.store(state + LENGTH, tl.load(list_len + best_row))
            tl.store(state + SURVIVORS, 0)
            # The new token's list goes after the last list made, which is new - 1's (the bytes' for 256).
            tl.store(list_start + new, tl.load(list_start + new - 1) + tl.load(list_len + new - 1))
            tl.store(list_len + new, 0)


@triton.jit
def find_occurrences(state, list_buffer, tokens, next_pos, prev_pos, mark, END, BLOCK: tl.constexpr):
    """Marks the occurrences that merge: mark[p] = 2 new, mark[next_pos[p]] = 2 new + 1 (an earlier merge's marks
    never match: none is cleared). Reads only, except these two marks of its own merging p, which differ for
    different p: merged occurrences never share a position (no overlap), and next_pos is one-to-one."""
    if tl.load(state + DONE) == 0:
        a, b, new = tl.load(state + A), tl.load(state + B), tl.load(state + NEW)
        start, length = tl.load(state + START), tl.load(state + LENGTH)
        for first in range(tl.program_id(0) * BLOCK, length, tl.num_programs(0) * BLOCK):
            i = first + tl.arange(0, BLOCK)
            p = tl.load(list_buffer + start + i, mask=i < length, other=END)
            right = tl.load(next_pos + p)
            merge = (tl.load(tokens + p) == a) & (tl.load(tokens + right) == b)
            # A run "aaaa" of (a, a) merges left to right without overlap: the 1st, 3rd... of the run. So p
            # merges when an even number of a's come before it in its run (found by walking prev_pos).
            if a == b:
                odd = merge & False
                q = tl.load(prev_pos + p)
                walking = merge & (tl.load(tokens + q) == a)
                while tl.max(walking.to(tl.int32), axis=0) > 0:  # as many steps as the longest run in the block
                    odd = odd ^ walking
                    q = tl.load(prev_pos + q, mask=walking, other=END)
                    walking = walking & (tl.load(tokens + q) == a)
                merge = merge & ~odd
            tl.store(mark + p, 2 * new, mask=merge)
            tl.store(mark + right, 2 * new + 1, mask=merge)


@triton.jit
def apply_merges(state, list_buffer, scratch, list_start, list_len, tokens, next_pos, prev_pos, mark, weight,
                 counts, row_key, dirty_flag, dirty_rows, V, END, BLOCK: tl.constexpr):
    """Merges the marked occurrences. The lane of (p, right) writes only what it owns: tokens, next_pos and
    prev_pos of p and right, and prev_pos of the position after right unless that one merges too (its own lane
    links it then). It reads a neighbour's token only where the marks say no lane writes it. Counts change by
    atomic adds, which commute, so their order can't matter."""
    if tl.load(state + DONE) == 0:
        a, b, new = tl.load(state + A), tl.load(state + B), tl.load(state + NEW)
        start, length = tl.load(state + START), tl.load(state + LENGTH)
        new_list = list_buffer + tl.load(list_start + new)
        for first in range(tl.program_id(0) * BLOCK, length, tl.num_programs(0) * BLOCK):
            i = first + tl.arange(0, BLOCK)
            p = tl.load(list_buffer + start + i, mask=i < length, other=END)
            mark_p = tl.load(mark + p)
            merged = (i < length) & (mark_p == 2 * new)
            # a's list keeps the positions that still hold a; the merged ones join the new token's list.
            unmarked = (i < length) & (mark_p != 2 * new) & (mark_p != 2 * new + 1)
            survives = unmarked & (tl.load(tokens + p, mask=unmarked, other=-1) == a)
            append(state + SURVIVORS, scratch, p, survives)
            append(list_len + new, new_list, p, merged)
            right = tl.load(next_pos + p, mask=merged, other=END)
            before = tl.load(prev_pos + p, mask=merged, other=END)
            after = tl.load(next_pos + right, mask=merged, other=END)
            w = tl.load(weight + p, mask=merged, other=0)
            before_merged = merged & (tl.load(mark + before, mask=merged, other=0) == 2 * new + 1)
            after_merged = merged & (tl.load(mark + after, mask=merged, other=0) == 2 * new)
            # The neighbours' tokens before this merge. x = -1 means none: the chunk's start, or the right half
            # of the previous merged occurrence, whose lane already counts the pair between the two.
            x = tl.load(tokens + before, mask=merged & ~before_merged, other=-1)
            y = tl.where(after_merged, a, tl.load(tokens + after, mask=merged & ~after_merged, other=-1))
            y_new = tl.where(after_merged, new, y)
            has_x, has_y = merged & (x >= 0), merged & (y >= 0)
            tl.store(tokens + p, new, mask=merged)
            tl.store(tokens + right, DEAD, mask=merged)
            tl.store(next_pos + p, after, mask=merged)
            tl.store(prev_pos + after, p, mask=has_y & ~after_merged)
            tl.store(prev_pos + p, tl.load(prev_pos + before, mask=before_merged, other=END), mask=before_merged)
            # (a, b), (x, a) and (b, y) lose w. A row whose maximum that pair was is listed as dirty, once: by the
            # lane that flips dirty_flag. Reading row_key while other lanes raise it is safe: a raised key is a
            # pair with the new token, above all the row held, so the test gives the same answer.
            zero = 0 * x.to(tl.int64)  # a scalar made a block, for the pairs that are the same in every lane
            for k in tl.static_range(3):
                if k == 0:
                    row, col, lose = a + zero, b + zero, merged
                elif k == 1:
                    row, col, lose = x.to(tl.int64), a + zero, has_x
                else:
                    row, col, lose = b + zero, y.to(tl.int64), has_y
                tl.atomic_add(counts + row * V + col, -w, mask=lose)
                was_max = lose & ((tl.load(row_key + row, mask=lose, other=0) & LOW) == LOW - col)
                first = was_max & (tl.atomic_xchg(dirty_flag + row, 1, mask=was_max) == 0)
                append(state + DIRTY, dirty_rows, row.to(tl.int32), first)
            # (x, new) and (new, y_new) gain w. The lane whose add comes last sees the final count, so the atomic
            # max of every lane's key is the final key, whatever the order.
            for k in tl.static_range(2):
                if k == 0:
                    row, col, gain = x.to(tl.int64), new + zero, has_x
                else:
                    row, col, gain = new + zero, y_new.to(tl.int64), has_y
                total = tl.atomic_add(counts + row * V + col, w, mask=gain) + w
                tl.atomic_max(row_key + row, (total.to(tl.int64) << ID_BITS) | (LOW - col), mask=gain)


@triton.jit
def refresh_rows(state, list_buffer, scratch, list_len, counts, fresh_key, dirty_rows, V, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Copies a's surviving positions back from scratch, one slot per lane. Then recomputes the dirty rows' maxima
    into fresh_key, in work items of ROWS rows by BLOCK columns spread over the programs (one dirty row of 65534
    columns still fills the GPU). It reads counts, which nothing writes now; atomic_max makes the order free."""
    if tl.load(state + DONE) == 0:
        if tl.load(state + NEW) >= 256:
            a, survivors = tl.load(state + A), tl.load(state + SURVIVORS)
            a_list = list_buffer + tl.load(state + START)
            for first in range(tl.program_id(0) * BLOCK, survivors, tl.num_programs(0) * BLOCK):
                i = first + tl.arange(0, BLOCK)
                tl.store(a_list + i, tl.load(scratch + i, mask=i < survivors), mask=i < survivors)
            if tl.program_id(0) == 0:
                tl.store(list_len + a, survivors)
        columns, dirty = tl.load(state + NEXT), tl.load(state + DIRTY)
        slices = tl.cdiv(columns, BLOCK)
        for item in range(tl.program_id(0), tl.cdiv(dirty, ROWS) * slices, tl.num_programs(0)):
            i = (item // slices) * ROWS + tl.arange(0, ROWS)
            row = tl.load(dirty_rows + i, mask=i < dirty, other=0).to(tl.int64)
            col = (item % slices) * BLOCK + tl.arange(0, BLOCK)
            count = tl.load(counts + row[:, None] * V + col[None, :], mask=(i < dirty)[:, None] & (col < columns)[None, :],
                            other=0).to(tl.int64)
            key = tl.where(count > 0, (count << ID_BITS) | (LOW - col[None, :]), 0)
            tl.atomic_max(fresh_key + row, tl.max(key, axis=1), mask=i < dirty)


def chunks_to_arrays(chunk_counts, vocab_size):
    """The distinct chunks (2+ bytes: a single byte has no pair) as the flat arrays above, built in numpy."""
    chunks = [chunk.encode("utf-8") for chunk in chunk_counts]
    lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
    counts = np.fromiter(chunk_counts.values(), np.int64, len(chunks))
    total_bytes = int((lengths * counts).sum())  # tokens of the training text before any merge
    keep = lengths >= 2
    chunks, lengths, counts = [c for c, k in zip(chunks, keep) if k], lengths[keep], counts[keep]
    L = END = int(lengths.sum())
    if L + 2 > MAX_POSITIONS:
        raise UserError(f"the distinct chunks hold {L:,} bytes, more than int32 positions can name (2^31 - 4); "
                        "lower -n, or spread the text over ranks with train_bpe_multigpu.py")
    ends = np.cumsum(lengths)
    tokens = np.full(L + 2, -1, np.int32)
    tokens[:L] = np.frombuffer(b"".join(chunks), np.uint8)
    next_pos, prev_pos = np.arange(1, L + 3, dtype=np.int32), np.arange(-1, L + 1, dtype=np.int32)
    next_pos[ends - 1], prev_pos[ends - lengths] = END, END
    next_pos[L:], prev_pos[L:] = END, END
    # Counts are sums of weights: int32 holds them, and halves the matrix, below 2^31 pairs of text.
    count_dtype = np.int32 if int(((lengths - 1) * counts).sum()) < 2**31 else np.int64
    weight = np.zeros(L + 2, count_dtype)
    weight[:L] = np.repeat(counts, lengths)
    left = np.flatnonzero(next_pos[:L] != END)  # every position with a right neighbour starts a pair
    order = np.argsort(tokens[left], kind="stable")  # the 256 byte lists, one after another
    list_buffer = np.zeros(2 * len(left) + 1, np.int32)  # each merge appends as many positions as it kills
    list_buffer[:len(left)] = left[order]
    list_len = np.zeros(vocab_size, np.int64)
    list_len[:256] = np.bincount(tokens[left], minlength=256)
    list_start = np.zeros(vocab_size, np.int64)
    list_start[1:256] = np.cumsum(list_len[:255])
    pairs = tokens[left].astype(np.int64) * vocab_size + tokens[left + 1]
    return dict(tokens=tokens, next_pos=next_pos, prev_pos=prev_pos, weight=weight, list_buffer=list_buffer,
                list_start=list_start, list_len=list_len, pairs=pairs, pair_weights=weight[left],
                total_bytes=total_bytes)


def merge_on_device(arrays, vocab_size, device):
    """The merge loop, MERGES_PER_READ merges per host read. Returns the merges and the token count after them."""
    V, device = vocab_size, torch.device(device)
    upload = lambda name: torch.from_numpy(arrays[name]).to(device)  # noqa: E731
    tokens, next_pos, prev_pos, weight, list_buffer, list_start, list_len = map(upload, (
        "tokens", "next_pos", "prev_pos", "weight", "list_buffer", "list_start", "list_len"))
    counts = torch.zeros(V * V, dtype=weight.dtype, device=device).index_add_(0, upload("pairs"), upload("pair_weights"))
    END = len(tokens) - 2
    zeros = lambda size, dtype=torch.int64: torch.zeros(size, dtype=dtype, device=device)  # noqa: E731
    mark, scratch, row_key, fresh_key = zeros(END + 2, torch.int32), torch.empty_like(list_buffer), zeros(V), zeros(V)
    dirty_flag, dirty_rows, state, merges = zeros(V, torch.int32), zeros(V, torch.int32), zeros(16), zeros(2 * V)
    dirty_flag[:256], dirty_rows[:256] = 1, torch.arange(256, device=device)  # the first refresh makes all rows' keys
    state[NEXT.value], state[DIRTY.value] = 256, 256
    # A GPU: a few programs per SM. The interpreter runs programs one after another: one with wide blocks is fastest.
    programs, block, rows, choose_block = INTERPRETER_SHAPE if device.type == "cpu" else \
        (4 * torch.cuda.get_device_properties(device).multi_processor_count, 256, 4, 4096)
    grid = (programs,)

    def refresh():
        refresh_rows[grid](state, list_buffer, scratch, list_len, counts, fresh_key, dirty_rows, V, ROWS=rows, BLOCK=block)

    def merge_group():  # past the last merge, choose_pair sets DONE and every kernel does nothing
        for _ in range(MERGES_PER_READ):
            choose_pair[(1,)](state, row_key, fresh_key, dirty_flag, dirty_rows, list_start, list_len, merges, V,
                              BLOCK=choose_block)
            find_occurrences[grid](state, list_buffer, tokens, next_pos, prev_pos, mark, END, BLOCK=block)
            apply_merges[grid](state, list_buffer, scratch, list_start, list_len, tokens, next_pos, prev_pos, mark,
                               weight, counts, row_key, dirty_flag, dirty_rows, V, END, BLOCK=block)
            refresh()

    refresh()
    graph = None
    with tqdm(total=V - 256, unit="merge", desc="merging", mininterval=0.5) as progress:
        for group in range(0, V - 256, MERGES_PER_READ):
            if group > 0 and graph is None and device.type == "cuda":  # compiled by now: record a group once
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    merge_group()
            if graph is None:
                merge_group()
            else:
                graph.replay()
            progress.update(min(MERGES_PER_READ, V - 256 - group))
            if merges_done(state):
                break
    num_merges = int(state[NEXT.value]) - 256
    merged_pairs = merges[:2 * num_merges].view(-1, 2).tolist()
    saved = int(weight[tokens == DEAD.value].sum())  # a merged occurrence saves one token per use of its chunk
    return [((left, right), 256 + i) for i, (left, right) in enumerate(merged_pairs)], arrays["total_bytes"] - saved


def merges_done(state):
    """The one host read of a group of merges: here, and only here, the host waits for the device."""
    return bool(state[DONE.value].item())


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

# ---------------------------------------------------------------- pre-tokenizing, on every core


def time_is_up(signum, frame):
    raise TimeoutError


def split_documents(documents, pattern_text, progress=None):
    """The distinct chunks' counts, and the characters read. A CPU-time alarm (a second plus 10 s per million
    characters; GPT-4's pattern needs 0.3 s) stops a pattern that backtracks catastrophically, (a|a)+b on aaaa..."""
    split_pattern, chunk_counts, chars = regex.compile(pattern_text), Counter(), 0
    signal.signal(signal.SIGPROF, time_is_up)
    for number, document in enumerate(documents, 1):
        signal.setitimer(signal.ITIMER_PROF, 1 + len(document) / 1e5)
        try:
            chunk_counts.update(split_pattern.findall(document))
        except TimeoutError:
            raise UserError(f"--pattern {pattern_text!r} backtracks catastrophically: it ran past the time limit on "
                            f"document {number} ({document[:30]!r}...); simplify the pattern")
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        chars += len(document)
        if progress:
            progress.update(len(document))
    return chunk_counts, chars


def split_byte_range(job):
    """The chunks of the .jsonl lines starting in [start, end), read where this runs: the parent sends no text."""
    pattern_text, path, start, end, budget = job
    BadUTF8.count = 0
    try:
        chunk_counts, chars = split_documents(first_chars(lambda _: read_jsonl(path, start, end), budget), pattern_text)
    except (UserError if multiprocessing.parent_process() else ()):  # a worker's; the parent's own call catches none
        return Counter(), float("inf"), 0  # the bad line may lie past the budget: the parent redoes the range if needed
    return chunk_counts, chars, BadUTF8.count


def count_chunks(documents, files, pattern_text, num_chars):
    """The chunk counts of the first num_chars characters. Large .jsonl inputs go to worker processes (the regex
    holds the GIL), a byte range each; the parent adds their Counters in file order, and redoes the range where
    the budget runs out, or a bad line stopped a worker, with the exact remainder."""
    with tqdm(total=num_chars, unit="char", unit_scale=True, desc="reading", mininterval=0.5) as progress:
        if num_chars < PARALLEL_CHARS or not files or any(path.suffix != ".jsonl" for path in files):
            chunk_counts, chars = split_documents(first_chars(documents, num_chars), pattern_text, progress)
        else:
            jobs = [(pattern_text, path, start, start + RANGE_BYTES, num_chars) for path in files
                    for start in range(0, os.path.getsize(path), RANGE_BYTES)]
            chunk_counts, chars, bad_utf8 = Counter(), 0, 0
            # fork starts a worker in milliseconds (spawn would import torch again); macOS can't fork safely.
            with multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool() as pool:
                for job, (counts, range_chars, bad) in zip(jobs, pool.imap(split_byte_range, jobs)):
                    if chars + range_chars > num_chars:
                        counts, range_chars, bad = split_byte_range(job[:4] + (num_chars - chars,))
                    chunk_counts.update(counts)
                    chars, bad_utf8 = chars + range_chars, bad_utf8 + bad
                    progress.update(range_chars)
                    if chars == num_chars:
                        break
            BadUTF8.count = bad_utf8
    if "" in chunk_counts:  # a pattern like \b matches nothing in some places only: BPE needs whole chunks
        raise UserError(f"--pattern {pattern_text!r} matches the empty string; every match must take at least one "
                        "character (x+, not x*)")
    return chunk_counts, chars


# ---------------------------------------------------------------- output


def save_tokenizer(out_dir, merges, info):
    """tiktoken's rank file of every token's bytes, and the settings. Each file is written under a temporary name,
    then renamed: a crash never leaves half of one."""
    vocab = [bytes([i]) for i in range(256)]  # the bytes are themselves; a merge is its two halves glued
    for (left, right), _ in merges:
        vocab.append(vocab[left] + vocab[right])
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(vocab))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in [("tokenizer.tiktoken", ranks), ("tokenizer.json", json.dumps(info, indent=2, ensure_ascii=False) + "\n")]:
        (out_dir / f"{name}.tmp").write_text(text, encoding="utf-8")
        os.replace(out_dir / f"{name}.tmp", out_dir / name)


# ---------------------------------------------------------------- the run


def check_out_dir(out_dir):
    """A bad --out, found before any work: a file on the way, no permission, or a directory holding other files."""
    for path in [out_dir, *out_dir.parents]:
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {out_dir}: {path} is a file, not a directory; give a directory path")
    others = sorted(p.name for p in out_dir.iterdir() if p.name not in TOKENIZER_FILES) if out_dir.is_dir() else []
    if others:
        what = "a dataset directory" if {"meta.json", "progress.json"} & set(others) else "not a tokenizer directory"
        raise UserError(f"--out {out_dir} is {what} (it holds {others[0]}); give a new or a tokenizer directory")
    try:  # a probe directory in the deepest one that exists: the only sure test (root passes os.access on /proc)
        tempfile.TemporaryDirectory(dir=next(p for p in [out_dir, *out_dir.parents] if p.exists())).cleanup()
    except OSError as error:
        raise UserError(f"--out {out_dir} can't be written ({error.strerror or error}); give a directory you can write")


def pick_device(name):
    """cuda runs the kernels compiled; cpu runs them in Triton's interpreter (numpy), for testing."""
    chosen, interpreted = name or "cuda", triton.knobs.runtime.interpret
    if name is None and not torch.cuda.is_available():  # the interpreter is ~1,000x slower: never a silent default
        problem = "no CUDA GPU here; --device cpu runs the kernels in Triton's interpreter, for testing (slow)"
    elif chosen != "cpu" and not chosen.startswith("cuda"):
        problem = "not supported (Triton runs on CUDA GPUs); use cuda, or cpu for testing"
    elif chosen == "cpu" and not interpreted:
        problem = "runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 (slow)"
    elif chosen != "cpu" and (interpreted or not torch.cuda.is_available()):
        problem = "no CUDA GPU here (or TRITON_INTERPRET=1 is set); use --device cpu"
    else:
        return torch.device(chosen)
    raise UserError(f"--device {chosen}: {problem}, or train_bpe_cpu.py, the better choice on a CPU")


def check_memory(vocab_size, itemsize, device):
    """The V x V count matrix is the budget: 16 GiB at V = 65534. The ~40 bytes per position of the distinct chunks
    are little beside it (2.5 M positions for all of enwiki's 56 M characters)."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if itemsize * vocab_size**2 > 0.8 * total:
        raise UserError(f"-v {vocab_size} needs a {itemsize * vocab_size**2 / 2**30:.1f} GiB pair-count matrix "
                        f"({itemsize} V^2 bytes), more than {device} can spare ({total / 2**30:.1f} GiB); use a "
                        "smaller -v, or train_bpe_cpu.py")


def run(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size, help="tokens before <|endoftext|> (256 bytes + merges)")
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="train on the first N characters")
    parser.add_argument("--data", default=None, help=f"fineweb | fineweb-edu | path to .txt/.jsonl/.parquet or a directory (default {data})")
    parser.add_argument("--out", default=out, help="output directory (default tokenizers/<source>_v<vocab_size>)")
    parser.add_argument("--pattern", default=pattern, help="the pre-tokenizer regex (default GPT-4's)")
    parser.add_argument("--device", default=device, help="cuda | cpu (Triton's interpreter; default: cuda)")
    args = parser.parse_args(argv)
    if not 256 <= args.vocab_size <= 2**20:
        raise UserError(f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes alone) and 2^20; try -v 1000")
    if args.num_chars <= 0:
        raise UserError(f"-n {args.num_chars}: the number of characters must be positive; try -n 1048576")
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); check the regex, or leave --pattern out for GPT-4's")
    if split_pattern.fullmatch(""):  # '' or 'x*' would give empty chunks, which hold no bytes to merge
        raise UserError(f"--pattern {args.pattern!r} matches the empty string; every match must take at least one "
                        "character (x+, not x*)")
    train_device = pick_device(args.device)
    check_memory(args.vocab_size, 4, train_device)
    documents, source_name, source = open_source(args.data or data, data_was_named=args.data is not None)
    files = local_files(args.data) if args.data and Path(args.data).exists() else []
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    check_out_dir(out_dir)

    t0 = time.time()
    chunk_counts, chars_read = count_chunks(documents, files, args.pattern, args.num_chars)
    t1 = time.time()
    if chars_read == 0:
        raise UserError(f"the corpus {source} is empty: no text to train on; point --data at files with text in them")
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD", file=sys.stderr)
    if chars_read < args.num_chars:
        print(f"the source ran out after {chars_read:,} characters (asked for {args.num_chars:,}); training on those")
    print(f"read {chars_read:,} characters: {sum(chunk_counts.values()):,} chunks, {len(chunk_counts):,} distinct")
    arrays = chunks_to_arrays(chunk_counts, args.vocab_size)
    check_memory(args.vocab_size, arrays["weight"].itemsize, train_device)  # int64 counts past 2^31 pairs
    print(f"{len(arrays['tokens']) - 2:,} token positions in the distinct chunks, on {train_device}")
    t_layout = time.time()  # merging includes compiling the kernels on a machine's first run (then cached)
    merges, total_tokens = merge_on_device(arrays, args.vocab_size, train_device)
    t2 = time.time()
    num_merges, eot_id = len(merges), 256 + len(merges)
    stop_reason = "vocab_size reached" if eot_id == args.vocab_size else "no pairs left to merge"
    if stop_reason != "vocab_size reached":
        print(f"stopped early after {num_merges} merges: no pairs left to merge (vocab {eot_id} < {args.vocab_size})")
    save_tokenizer(out_dir, merges, {
        "pattern": args.pattern, "special_tokens": {EOT: eot_id}, "vocab_size": eot_id + 1, "num_merges": num_merges,
        "num_chars": chars_read, "source": source, "trainer": "train_bpe_gpu.py", "device": str(train_device),
        "seconds": round(t2 - t0, 3), "stop_reason": stop_reason})
    print(f"reading + pre-tokenizing {t1 - t0:.2f}s | layout {t_layout - t1:.2f}s | merging {t2 - t_layout:.2f}s "
          f"({num_merges / max(t2 - t_layout, 1e-9):,.0f} merges/s) | total {t2 - t0:.2f}s")
    peak = torch.cuda.max_memory_allocated(train_device) if train_device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak memory: {peak / 2**30:.2f} GiB ({'device' if train_device.type == 'cuda' else 'process resident'})")
    total_bytes = arrays["total_bytes"]
    print(f"compression on the training text: {total_bytes / max(total_tokens, 1):.3f} bytes/token "
          f"({total_bytes:,} bytes -> {total_tokens:,} tokens)")
    print(f"wrote {out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, vocab_size {eot_id + 1})")


if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except (UserError, OSError) as error:  # OSError: an unreadable file, a full disk
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
