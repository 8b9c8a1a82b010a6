"""
Train a byte-level BPE tokenizer on many GPUs (or CPU processes) at once: one tokenizer, exact.

    torchrun --standalone --nproc_per_node=8 train_bpe_multigpu.py -v 65534 -n 1073741824
    torchrun --standalone --nproc_per_node=2 train_bpe_multigpu.py --device cpu -v 300 -n 65536
    python train_bpe_multigpu.py --device cpu -v 300 -n 65536   # world size 1, no torchrun needed

The tokenizer is rustbpe's and train_bpe_gpu.py's, byte for byte, on the text the ranks read
together (a rank reads at most n / W of its part: all of it if n >= W x its length): BPE depends
only on the multiset of chunks.

Not data-parallel training: a merge chosen from one rank's counts would be wrong. The ranks split
the text, the distinct chunks (each merges its own) and the [V, V] pair-count matrix (each owns 1/W
of its rows); collectives make every merge the same on every rank. Read train_bpe_gpu.py first:
this file teaches what changes on W GPUs.
"""

import argparse, atexit, base64, codecs, ctypes, datetime, fcntl, hashlib, json, multiprocessing
import os, queue, resource, signal, socket, sys, sysconfig, time, urllib.parse
from collections import Counter
from itertools import accumulate
from pathlib import Path

import numpy as np
import regex
import torch
import torch.distributed as dist
from tqdm import tqdm

# read when triton is imported
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
try:
    import triton
    import triton.language as tl
except ImportError:
    sys.exit("error: train_bpe_multigpu.py needs triton (pip install triton)")

# === plumbing: train_bpe_gpu.py's interpreter fix
if os.environ["TRITON_INTERPRET"] == "1":
    # Triton 3.6's interpreter (CUDA torch 2.11's) takes a loop bound as int() of a 1-element array,
    # which NumPy 2.4 refuses (triton-lang/triton#9171)
    from triton.runtime import interpreter

    def patch_tensor(tensor, *scope, patch=interpreter._patch_lang_tensor):
        patch(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())
    interpreter._patch_lang_tensor = patch_tensor

# === defaults, each overridable from the command line
vocab_size = 65534  # 256 bytes + merges; <|endoftext|> gets the next id (ids fit a uint16)
num_chars = 2**27  # characters to train on, all ranks together
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory; default tokenizers/<source>_v<vocab_size>
device = "cuda"  # cuda: NCCL; cpu: gloo and Triton's interpreter
cache_dir = "tokenizers/.cache"  # per-rank counted chunks
workers = 0  # pre-tokenizing processes per rank; 0: its share of the node's cores
timeout = 1800  # seconds a rank waits for the others (reading a big part is slow)
# GPT-4's split pattern
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
HUB_DATASETS = {"fineweb": ("HuggingFaceFW/fineweb", "sample-10BT"),
                "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT")}
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
CACHE_VERSION = 3
# train_bpe_gpu.py's shapes (CUDA's is in merge_on_device)
INTERPRETER_SHAPE = dict(programs=1, block=1024, rows=64, choose_block=1024, key_block=16)
MERGES_PER_READ = 16  # merges launched per host read of the "done" flag
MAX_POSITIONS = 2**31 - 2  # positions are int32: a rank's distinct chunks' bytes + 2 spare slots
PARALLEL_CHARS = 1 << 24  # from a part this long on, the rank's cores pre-tokenize (below: one)
BATCH_CHARS = 1 << 20  # characters of documents a batch
# ---


class UserError(Exception):
    """A mistake in the input: one line, never a traceback."""


# === the merge loop, split across ranks
# train_bpe_gpu.py's layout, keys and kernel bodies, on this rank's distinct chunks.
# Its choose (one pair here) and apply_merges are each split around a collective: best_pair, then
# find_occurrences; apply_merges, then apply_owned.
# Rank r owns the rows l with l % W == r, kept at l // W, and their row keys. A merge (a, b) -> new
# changes only (a, b) and pairs in columns a and new, rows b and new: with x and y an occurrence's
# neighbours (y' = new if y merged too), (x, a) and (b, y) lose, (x, new) and (new, y') gain. Each
# rank sums its changes into `delta`: delta[0] is (a, b), delta[1 + 3j + k] id j in part k = 0, 1, 2
# (x, y, y'), as apply_owned's table shows; no id past `new` has a pair yet, so only the first
# 1 + 3 (new + 1) can be non-zero. One all_reduce(SUM) of that prefix sums them; each owner applies
# the part in its rows. The next pair is one all_reduce(MAX) of the ranks' best keys (two, if a
# count and both ids don't fit one int64). Two collectives a merge is the least: the next pick needs
# the owners' refreshed rows, which need every rank's changes, which need the pick. No deadlock, no
# divergence: every rank calls the same collectives in the same order (a rank with no text sends
# zeros), and decides (the pair, "done") from the REDUCED values. Exact: counts are integers, each
# with one owner. No kernel needs a lock (each docstring says why); every atomic is relaxed.

# `state`'s slots and the constants, as in train_bpe_gpu.py
NEXT, NEW, A, B, DONE, START, LENGTH, SURVIVORS, DIRTY = (tl.constexpr(i) for i in range(9))
DEAD = tl.constexpr(-2)
ID_BITS = tl.constexpr(20)
LOW = tl.constexpr((1 << 20) - 1)


# === plumbing: append (train_bpe_gpu.py's, taught there), pick_pair
@triton.jit
def append(length, buffer, values, keep):
    """Appends the values where keep to a list: one atomic add reserves the block's slots."""
    ones = keep.to(tl.int32)
    slot = tl.atomic_add(length, tl.sum(ones, axis=0), sem="relaxed") + tl.cumsum(ones, axis=0) - 1
    tl.store(buffer + slot, values, mask=keep)


@triton.jit
def pick_pair(state, row_key, block_key, fresh_key, dirty_flag, dirty_rows, V, BLOCK: tl.constexpr,
              KEY_BLOCK: tl.constexpr):
    """The pair with the largest count (ties: the smallest left id, then right id), as (count, left
    row); count 0: none. Makes the dirty rows' keys exact first: a second pick with no merge
    between picks the same. One program, with its threads: it may read and write anything."""
    dirty = tl.load(state + DIRTY)  # the dirty rows take the keys refresh recomputed
    for first in range(0, dirty, BLOCK):
        i = first + tl.arange(0, BLOCK)
        rows = tl.load(dirty_rows + i, mask=i < dirty, other=0)
        tl.store(row_key + rows, tl.load(fresh_key + rows, mask=i < dirty), mask=i < dirty)
        tl.store(fresh_key + rows, 0, mask=i < dirty)
        tl.store(dirty_flag + rows, 0, mask=i < dirty)
    # a barrier, or a thread could scan a key before its copy (or read DIRTY after its reset)
    tl.debug_barrier()
    tl.store(state + DIRTY, 0)
    # a dirty row's key may have dropped: its block key is recomputed (twice for two dirty rows of a
    # block, alike), then a barrier before the scan
    tl.static_assert(BLOCK >= KEY_BLOCK)
    for first in range(0, dirty, BLOCK // KEY_BLOCK):
        i = first + tl.arange(0, BLOCK // KEY_BLOCK)
        blocks = tl.load(dirty_rows + i, mask=i < dirty, other=0) // KEY_BLOCK
        rows = blocks[:, None] * KEY_BLOCK + tl.arange(0, KEY_BLOCK)[None, :]
        keys = tl.load(row_key + rows, mask=(i < dirty)[:, None] & (rows < V), other=0)
        tl.store(block_key + blocks, tl.max(keys, axis=1), mask=i < dirty)
    tl.debug_barrier()
    # the first block with the largest count, then its first row with it: the first row of all
    new = tl.load(state + NEXT)
    best_count, best_block = tl.full((), 0, tl.int64), tl.full((), 0, tl.int64)
    for first in range(0, tl.cdiv(new, KEY_BLOCK), BLOCK):
        blocks = first + tl.arange(0, BLOCK)
        count = tl.load(block_key + blocks, mask=blocks * KEY_BLOCK < new, other=0) >> ID_BITS
        most = tl.max(count, axis=0)
        first_most = tl.min(tl.where(count == most, blocks, new), axis=0).to(tl.int64)
        best_block = tl.where(most > best_count, first_most, best_block)
        best_count = tl.maximum(most, best_count)
    rows = best_block * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
    count = tl.load(row_key + rows, mask=rows < new, other=0) >> ID_BITS
    best_row = tl.min(tl.where(count == best_count, rows, new), axis=0).to(tl.int64)
    return best_count, best_row


# === the merge loop's kernels, on every rank
@triton.jit
def best_pair(state, row_key, block_key, fresh_key, dirty_flag, dirty_rows, V, best,
              BITS: tl.constexpr, ONE_KEY: tl.constexpr, BLOCK: tl.constexpr,
              KEY_BLOCK: tl.constexpr):
    """This rank's best pair as a key that orders pairs across ranks: with BITS bits an id and
    M = 2^BITS - 1, count << 2 BITS | (M - left) << BITS | (M - right) is largest for the pair BPE
    takes, tie-break included; a count past 63 - 2 BITS bits gives best = [count, tie, count], for
    two reductions. One program, alone on the device."""
    if tl.load(state + DONE) == 0:
        # rows this rank doesn't own have key 0: the pick is among its own
        best_count, best_row = pick_pair(state, row_key, block_key, fresh_key, dirty_flag,
                                         dirty_rows, V, BLOCK, KEY_BLOCK)
        right = LOW - (tl.load(row_key + best_row) & LOW)
        id_max = (1 << BITS) - 1
        tie = tl.where(best_count > 0, (id_max - best_row) << BITS | (id_max - right), 0)
        packed = best_count << (2 * BITS) | tie
        tl.store(best, packed if ONE_KEY else best_count)
        tl.store(best + 1, tie)
        tl.store(best + 2, best_count)


@triton.jit
def find_occurrences(state, best, list_start, list_len, merge_log, list_buffer, tokens, next_pos,
                     prev_pos, mark, V, END, BITS: tl.constexpr, ONE_KEY: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Decodes the reduced key, the same on every rank: the pair to merge. Each program decodes it,
    so none waits on program 0, which writes the merge's state for the next kernels (apply_owned
    moves NEXT on). Then marks this rank's occurrences, as train_bpe_gpu.py does."""
    count, tie, new = tl.load(best), tl.load(best + 1), tl.load(state + NEXT)
    if ONE_KEY:
        count, tie = count >> (2 * BITS), count & ((1 << (2 * BITS)) - 1)
    if (tl.load(state + DONE) == 0) & (count > 0) & (new < V):
        id_max = (1 << BITS) - 1
        a = id_max - (tie >> BITS)
        b = id_max - (tie & id_max)
        start, length = tl.load(list_start + a), tl.load(list_len + a)
        if tl.program_id(0) == 0:
            tl.store(merge_log + 2 * (new - 256), a)
            tl.store(merge_log + 2 * (new - 256) + 1, b)
            tl.store(state + NEW, new)
            tl.store(state + A, a)
            tl.store(state + B, b)
            tl.store(state + START, start)
            tl.store(state + LENGTH, length)
            tl.store(state + SURVIVORS, 0)
            tl.store(list_start + new, tl.load(list_start + new - 1) + tl.load(list_len + new - 1))
            tl.store(list_len + new, 0)
        for first in range(tl.program_id(0) * BLOCK, length, tl.num_programs(0) * BLOCK):
            i = first + tl.arange(0, BLOCK)
            p = tl.load(list_buffer + start + i, mask=i < length, other=END)
            second = tl.load(next_pos + p)
            merge = (tl.load(tokens + p) == a) & (tl.load(tokens + second) == b)
            if a == b:
                odd = merge & False
                q = tl.load(prev_pos + p)
                walking = merge & (tl.load(tokens + q) == a)
                while tl.max(walking.to(tl.int32), axis=0) > 0:
                    odd = odd ^ walking
                    q = tl.load(prev_pos + q, mask=walking, other=END)
                    walking = walking & (tl.load(tokens + q) == a)
                merge = merge & ~odd
            tl.store(mark + p, 2 * new, mask=merge)
            tl.store(mark + second, 2 * new + 1, mask=merge)
    elif tl.program_id(0) == 0:
        # no pair left on any rank, or V reached: every kernel does nothing from now on
        tl.store(state + DONE, 1)


@triton.jit
def apply_merges(state, list_buffer, scratch, list_start, list_len, tokens, next_pos, prev_pos,
                 mark, weight, delta, V, END, BLOCK: tl.constexpr):
    """As train_bpe_gpu.py's apply_merges, on this rank's occurrences; count changes go to delta."""
    if tl.load(state + DONE) == 0:
        a, new = tl.load(state + A), tl.load(state + NEW)
        start, length = tl.load(state + START), tl.load(state + LENGTH)
        new_list = list_buffer + tl.load(list_start + new)
        for first in range(tl.program_id(0) * BLOCK, length, tl.num_programs(0) * BLOCK):
            i = first + tl.arange(0, BLOCK)
            p = tl.load(list_buffer + start + i, mask=i < length, other=END)
            mark_p = tl.load(mark + p)
            merged = (i < length) & (mark_p == 2 * new)
            unmarked = (i < length) & (mark_p != 2 * new) & (mark_p != 2 * new + 1)
            survives = unmarked & (tl.load(tokens + p, mask=unmarked, other=-1) == a)
            append(state + SURVIVORS, scratch, p, survives)
            append(list_len + new, new_list, p, merged)
            second = tl.load(next_pos + p, mask=merged, other=END)
            before = tl.load(prev_pos + p, mask=merged, other=END)
            after = tl.load(next_pos + second, mask=merged, other=END)
            w = tl.load(weight + p, mask=merged, other=0)
            before_merged = merged & (tl.load(mark + before, mask=merged, other=0) == 2 * new + 1)
            after_merged = merged & (tl.load(mark + after, mask=merged, other=0) == 2 * new)
            x = tl.load(tokens + before, mask=merged & ~before_merged, other=-1)
            y = tl.where(after_merged, a,
                         tl.load(tokens + after, mask=merged & ~after_merged, other=-1))
            y_new = tl.where(after_merged, new, y)
            has_x, has_y = merged & (x >= 0), merged & (y >= 0)
            tl.store(tokens + p, new, mask=merged)
            tl.store(tokens + second, DEAD, mask=merged)
            tl.store(next_pos + p, after, mask=merged)
            tl.store(prev_pos + after, p, mask=has_y & ~after_merged)
            tl.store(prev_pos + p, tl.load(prev_pos + before, mask=before_merged, other=END),
                     mask=before_merged)
            tl.atomic_add(delta + 1 + 3 * x, w, mask=has_x, sem="relaxed")
            tl.atomic_add(delta + 2 + 3 * y, w, mask=has_y, sem="relaxed")
            tl.atomic_add(delta + 3 + 3 * y_new, w, mask=has_y, sem="relaxed")
            tl.atomic_add(delta, tl.sum(w, axis=0), sem="relaxed")


@triton.jit
def apply_owned(state, delta, counts, row_key, block_key, dirty_flag, dirty_rows, V, RANK, WORLD,
                BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr):
    """Adds every rank's summed changes (delta, after the all_reduce) to this rank's rows, and
    zeroes delta for the next merge. Lane i owns delta[i]; a gained count has one lane, whose atomic
    add returns the final count. Only row new's key can rise: (x, new) gains what (x, a) loses, and
    stays below row x's key. A lost pair that a row key names makes the row dirty, once (the lane
    that flips dirty_flag); no key of a row that loses is written here, so the test is stable."""
    if tl.load(state + DONE) == 0:
        a, b, new = tl.load(state + A), tl.load(state + B), tl.load(state + NEW)
        if tl.program_id(0) == 0:
            tl.store(state + NEXT, new + 1)  # nothing here reads NEXT
        live = 1 + 3 * (new + 1)
        for first in range(tl.program_id(0) * BLOCK, live, tl.num_programs(0) * BLOCK):
            i = first + tl.arange(0, BLOCK)
            change = tl.load(delta + i, mask=i < live, other=0).to(tl.int64)
            tl.store(delta + i, 0, mask=change != 0)  # most lanes hold 0 already: no write
            # part  row   loses at  gains at
            #   0   j     a         new        (x = j, a) -> (j, new)
            #   1   b     j         -          (b, y = j)
            #   2   new   -         j          (new, y' = j)
            #   3   a     b         -          (a, b): lane 0
            part = tl.where(i == 0, 3, (i - 1) % 3)
            j = tl.where(i == 0, 0, (i - 1) // 3).to(tl.int64)
            row = tl.where(part == 0, j, tl.where(part == 1, b, tl.where(part == 2, new, a)))
            lose_column = tl.where(part == 0, a, tl.where(part == 1, j, b))
            gain_column = tl.where(part == 0, new, j)
            owned = (change != 0) & (row % WORLD == RANK)
            lose = owned & (part != 2)
            gain = owned & (part % 2 == 0)
            row_counts = counts + (row // WORLD) * V
            amount = change.to(counts.dtype.element_ty)
            tl.atomic_add(row_counts + lose_column, -amount, mask=lose, sem="relaxed")
            key_column = LOW - (tl.load(row_key + row, mask=lose, other=0) & LOW)
            was_max = lose & (key_column == lose_column)
            flag = tl.atomic_xchg(dirty_flag + row, 1, mask=was_max, sem="relaxed")
            flipped = was_max & (flag == 0)
            append(state + DIRTY, dirty_rows, row.to(tl.int32), flipped)
            total = tl.atomic_add(row_counts + gain_column, amount, mask=gain, sem="relaxed")
            key = ((total.to(tl.int64) + change) << ID_BITS) | (LOW - gain_column)
            rises = gain & (part == 2)
            tl.atomic_max(row_key + row, key, mask=rises, sem="relaxed")
            tl.atomic_max(block_key + row // KEY_BLOCK, key, mask=rises, sem="relaxed")


@triton.jit
def refresh_rows(state, list_buffer, scratch, list_len, counts, fresh_key, dirty_rows, V, WORLD,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """train_bpe_gpu.py's refresh_rows, on this rank's rows (row l at l // WORLD)."""
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
        for item in tl.range(tl.program_id(0), tl.cdiv(dirty, ROWS) * slices, tl.num_programs(0),
                             num_stages=3):
            i = (item // slices) * ROWS + tl.arange(0, ROWS)
            row = tl.load(dirty_rows + i, mask=i < dirty, other=0).to(tl.int64)
            col = (item % slices) * BLOCK + tl.arange(0, BLOCK)
            inside = (i < dirty)[:, None] & (col < columns)[None, :]
            row_counts = counts + (row // WORLD)[:, None] * V
            count = tl.load(row_counts + col[None, :], mask=inside, other=0)
            most = tl.max(count, axis=1)
            first_col = tl.min(tl.where(count == most[:, None], col[None, :], columns), axis=1)
            key = tl.where(most > 0, (most.to(tl.int64) << ID_BITS) | (LOW - first_col), 0)
            tl.atomic_max(fresh_key + row, key, mask=i < dirty, sem="relaxed")


# === the merge loop on the host
def chunks_to_arrays(blob, lengths, occurrences, count_dtype):
    """This rank's distinct chunks (from the cache) as train_bpe_gpu.py's flat arrays."""
    L = END = blob.size
    tokens = np.full(L + 2, -1, np.int32)
    tokens[:L] = blob
    ends = np.cumsum(lengths)
    next_pos, prev_pos = np.arange(1, L + 3, dtype=np.int32), np.arange(-1, L + 1, dtype=np.int32)
    next_pos[ends - 1], prev_pos[ends - lengths] = END, END
    next_pos[L:], prev_pos[L:] = END, END
    weight = np.zeros(L + 2, count_dtype)
    weight[:L] = np.repeat(occurrences, lengths)
    left = np.flatnonzero(next_pos[:L] != END)
    order = np.argsort(tokens[left].astype(np.uint8), kind="stable")
    list_buffer = np.zeros(2 * len(left) + 1, np.int32)
    list_buffer[:len(left)] = left[order]
    list_len = np.bincount(tokens[left], minlength=256).astype(np.int64)
    byte_pairs = tokens[left].astype(np.int64) * 256 + tokens[left + 1]
    return dict(tokens=tokens, next_pos=next_pos, prev_pos=prev_pos, weight=weight,
                list_buffer=list_buffer, list_len=list_len,
                list_start=np.cumsum(list_len) - list_len, byte_pairs=byte_pairs,
                pair_weights=weight[left])


def merge_on_device(arrays, vocab_size, total_pairs, device, show_progress):
    """The merges, this rank's tokens saved, the loop's counts of collectives and host reads, and
    the seconds of the setup (uploads, zeros, compiling) and of the loop."""
    V, rank, W = vocab_size, dist.get_rank(), dist.get_world_size()
    started = time.time()
    upload = lambda name: torch.from_numpy(arrays[name]).to(device)  # noqa
    zeros = lambda size, dtype=torch.int64: torch.zeros(size, dtype=dtype, device=device)  # noqa
    tokens, next_pos, prev_pos, weight, list_buffer = map(upload, (
        "tokens", "next_pos", "prev_pos", "weight", "list_buffer"))
    list_len, list_start = zeros(V), zeros(V)
    list_len[:256], list_start[:256] = upload("list_len"), upload("list_start")
    END, bits, loop_counts = len(tokens) - 2, max(1, (V - 1).bit_length()), Counter()
    one_key = total_pairs < 2 ** (63 - 2 * bits)
    # only byte pairs exist at first: one all_reduce of 256 x 256, then each owner keeps its rows
    byte_pairs = zeros(256 * 256).index_add_(0, upload("byte_pairs"), upload("pair_weights").long())
    dist.all_reduce(byte_pairs)
    counts = zeros(((V - 1 - rank) // W + 1) * V, weight.dtype)
    owned_byte_rows = byte_pairs.view(256, 256)[rank::W]
    counts.view(-1, V)[:len(owned_byte_rows), :256] = owned_byte_rows.to(weight.dtype)
    mark, scratch = zeros(END + 2, torch.int32), torch.empty_like(list_buffer)
    row_key, fresh_key, state, merge_log = zeros(V), zeros(V), zeros(9), zeros(2 * V)
    dirty_flag, dirty_rows = zeros(V, torch.int32), zeros(V, torch.int32)
    delta, best = zeros(3 * V + 1, weight.dtype), zeros(3)
    owned_bytes = torch.arange(rank, 256, W, device=device)  # the first refresh makes their keys
    dirty_flag[owned_bytes], dirty_rows[:len(owned_bytes)] = 1, owned_bytes.int()
    state[NEXT.value], state[DIRTY.value] = 256, len(owned_bytes)
    shape = INTERPRETER_SHAPE
    if device.type == "cuda":
        shape = dict(programs=4 * torch.cuda.get_device_properties(device).multi_processor_count,
                     block=256, rows=4, choose_block=4096, key_block=256)
    programs, block, rows = shape["programs"], shape["block"], shape["rows"]
    choose_block, key_block = shape["choose_block"], shape["key_block"]
    block_key, grid = zeros(triton.cdiv(V, key_block)), (programs,)

    def launch_refresh():
        refresh_rows[grid](state, list_buffer, scratch, list_len, counts, fresh_key, dirty_rows, V,
                           W, ROWS=rows, BLOCK=block)

    # One merge: five kernels, the host's collectives between them.
    # Merge m makes id 256 + m at most: the prefix of delta it sends.
    def merge(m):
        best_pair[(1,)](state, row_key, block_key, fresh_key, dirty_flag, dirty_rows, V, best,
                        BITS=bits, ONE_KEY=one_key, BLOCK=choose_block, KEY_BLOCK=key_block)
        dist.all_reduce(best[:1], op=dist.ReduceOp.MAX)
        # the tie-break among the ranks with the best count
        if not one_key:
            best[1:2] = torch.where(best[2:] == best[:1], best[1:2], -1)
            dist.all_reduce(best[1:2], op=dist.ReduceOp.MAX)
        find_occurrences[grid](state, best, list_start, list_len, merge_log, list_buffer, tokens,
                               next_pos, prev_pos, mark, V, END, BITS=bits, ONE_KEY=one_key,
                               BLOCK=block)
        apply_merges[grid](state, list_buffer, scratch, list_start, list_len, tokens, next_pos,
                           prev_pos, mark, weight, delta, V, END, BLOCK=block)
        prefix = 1 + 3 * (256 + m + 1)
        dist.all_reduce(delta[:prefix])
        apply_owned[grid](state, delta, counts, row_key, block_key, dirty_flag, dirty_rows, V,
                          rank, W, BLOCK=block, KEY_BLOCK=key_block)
        launch_refresh()
        loop_counts.update(collectives=2 + (not one_key), collective_bytes=(
            8 * (1 + (not one_key)) + prefix * delta.itemsize))

    launch_refresh()
    # as in train_bpe_gpu.py, the setup compiles every kernel: a merge with DONE set (adding zeros)
    state[DONE.value] = 1
    merge(0)
    state[DONE.value] = 0
    loop_counts.clear()
    loop_started = time.time()
    with tqdm(total=V - 256, unit="merge", desc="merging", mininterval=0.5,
              disable=not show_progress) as progress:
        for group in range(0, V - 256, MERGES_PER_READ):
            for m in range(group, min(group + MERGES_PER_READ, V - 256)):
                merge(m)
            progress.update(m + 1 - group)
            loop_counts.update(host_reads=1)  # the host launches ahead, and waits only here
            if state[DONE.value].item():
                break
        num_merges = int(state[NEXT.value]) - 256
        progress.n = num_merges
    seconds = dict(setup=loop_started - started, loop=time.time() - loop_started)
    merged_pairs = merge_log[:2 * num_merges].view(-1, 2).tolist()
    tokens_saved = int(weight[tokens == DEAD.value].sum())
    merges = [((left, right), 256 + i) for i, (left, right) in enumerate(merged_pairs)]
    return merges, tokens_saved, loop_counts, seconds


# === this rank's part of the text
# Local files lie end to end; rank r gets bytes [r S / W, (r + 1) S / W). A document (a .jsonl line,
# a .txt file, a parquet row group, placed at its share of the file's bytes) belongs to the range
# holding its first byte: one rank reads it whole, seeking straight to its range.


def rank_documents(name, files, budget):
    """This rank's documents (a generator: nothing is read yet) and its part's byte range (None
    from the Hub, whose stream `datasets` splits)."""
    if not files:
        repository, config = HUB_DATASETS[name]
        return datasets_texts(repository, node=(RANK, WORLD), path=repository, name=config), None
    sizes = [path.stat().st_size for path in files]
    lo, hi = sum(sizes) * RANK // WORLD, sum(sizes) * (RANK + 1) // WORLD
    part_files = []
    for path, first, size in zip(files, accumulate([0] + sizes), sizes):
        # a file that starts before lo is ours too where it is split: by lines, or by row groups
        split_into_ours = first < lo < first + size and path.suffix in (".jsonl", ".parquet")
        empty_parquet = not size and path.suffix == ".parquet"  # in no range: every rank's
        if size and (lo <= first < hi or split_into_ours) or empty_parquet:
            part_files.append((path, first))
    return read_part(part_files, lo, hi, budget), [lo, hi]


def read_part(part_files, lo, hi, budget):
    for path, first in part_files:
        if path.suffix == ".jsonl":
            yield from read_jsonl(path, max(lo - first, 0), hi - first)
        elif path.suffix == ".parquet":
            yield from read_parquet(path, lo - first, hi - first)
        else:
            yield from read_txt(path, budget + 1)  # + 1: a cut shows


# === the run
# torchrun sets them; LOCAL_RANK is this rank's GPU on its node
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
LOCAL_WORLD = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def say(*args, **kwargs):  # rank 0 alone speaks
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def run(argv):
    args = parse_args(argv)
    source, files, out_dir = validate(args)
    t0 = time.time()
    # --- this rank's part: n / W characters from its own byte range, counted before the process
    # group exists (a fork copies none of gloo's or NCCL's locks), or loaded from the cache
    share = args.num_chars * (RANK + 1) // WORLD - args.num_chars * RANK // WORLD
    documents, byte_range = rank_documents(args.data or data, files, share)
    cached, cache_status, prefix, error = count_part(args, source, files, documents, share,
                                                     byte_range)

    # --- the process group. Its timeout bounds each wait for the others (joining, collectives): a
    # hung rank becomes an error on the others (a dead one sooner: its sockets close).
    if args.device == "cuda":
        torch.cuda.set_device(LOCAL_RANK)
    # small ops: waking OpenMP threads for each costs more than it saves
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    # torchrun's environment says where the others are; plain python: a world of one
    group_options = {} if "RANK" in os.environ else dict(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout), **group_options)
    say(f"{WORLD} rank(s), backend {dist.get_backend()}, device {args.device}")
    rank_stats = [None] * WORLD  # a reading error is one rank's: shared, all stop, rank 0 says it
    dist.all_gather_object(rank_stats, error or {**cached[3], "cache": cache_status, "source": source,
                                                 "memory": device_memory(args.device)})
    errors = [stats for stats in rank_stats if isinstance(stats, str)]
    if errors:
        raise UserError(errors[0])
    if len({stats["source"] for stats in rank_stats}) > 1:  # each rank asked the Hub
        raise UserError("only some ranks reached the Hugging Face Hub; run again, or name --data")
    total = {key: sum(stats[key] for stats in rank_stats)
             for key in ("chunks", "total_bytes", "total_pairs", "bad_utf8", "matched")}
    parts = [stats["part"] for stats in rank_stats]
    chars = sum(part["chars"] for part in parts)
    cache_statuses = [stats["cache"] for stats in rank_stats]
    t1 = time.time()
    check_text(args, source, total, parts, cache_statuses, prefix)
    # no count exceeds the total: int32 below 2^31 pairs, else int64
    count_dtype = np.dtype(np.int32 if total["total_pairs"] < 2**31 else np.int64)
    check_count_rows(args.vocab_size, count_dtype.itemsize,
                     min(stats["memory"] for stats in rank_stats), args.device)
    say(f"read {chars:,} characters, {total['chunks']:,} chunks; per-rank part (characters, "
        "distinct chunks): "
        + ", ".join(f"{stats['part']['chars']:,}/{stats['distinct']:,}" for stats in rank_stats))

    # --- the merges, each rank in its own chunks and rows
    arrays = chunks_to_arrays(*cached[:3], count_dtype)
    t2 = time.time()
    run_device = torch.device("cuda", LOCAL_RANK) if args.device == "cuda" else torch.device("cpu")
    merges, tokens_saved, loop_counts, seconds = merge_on_device(
        arrays, args.vocab_size, total["total_pairs"], run_device, show_progress=RANK == 0)
    t3 = time.time()
    if args.device == "cuda":
        peak = torch.cuda.max_memory_allocated(run_device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    saved_and_peak = [None] * WORLD
    dist.all_gather_object(saved_and_peak, (tokens_saved, peak / 2**20))
    num_merges, eot_id = len(merges), 256 + len(merges)
    stop_reason = "vocab_size reached" if eot_id == args.vocab_size else "no pairs left to merge"
    if eot_id < args.vocab_size:
        say(f"stopped early after {num_merges} merges: {stop_reason} "
            f"(vocab {eot_id} < {args.vocab_size})")
    if RANK == 0:
        save_tokenizer(out_dir, merges, {
            "pattern": args.pattern, "special_tokens": {EOT: eot_id}, "vocab_size": eot_id + 1,
            "num_merges": num_merges, "num_chars": chars, "source": source,
            "trainer": "train_bpe_multigpu.py", "world_size": WORLD, "seconds": round(t3 - t0, 3),
            "stop_reason": stop_reason, "read": parts})
    tokens_left = total["total_bytes"] - sum(saved for saved, _ in saved_and_peak)
    reading = "loading the cache" if {*cache_statuses} == {"reused"} else "reading + pre-tokenizing"
    merges_per_second = num_merges / max(seconds["loop"], 1e-9)
    say(f"{reading} {t1 - t0:.2f}s | layout {t2 - t1:.2f}s | setup {seconds['setup']:.2f}s | "
        f"merging {seconds['loop']:.2f}s ({merges_per_second:,.0f} merges/s) | total {t3 - t0:.2f}s")
    if num_merges:
        say(f"per merge: {loop_counts['collectives'] / num_merges:.2f} collectives "
            f"({loop_counts['collective_bytes'] / num_merges / 1024:,.1f} KiB), "
            f"{loop_counts['host_reads'] / num_merges:.2f} host reads")
    peak_kind = "peak device memory" if args.device == "cuda" else "peak RSS"
    say(f"{peak_kind} per rank: " + ", ".join(f"{peak:,.0f} MiB" for _, peak in saved_and_peak))
    say(f"compression: {total['total_bytes'] / max(tokens_left, 1):.3f} bytes/token; wrote "
        f"{out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, "
        f"vocab_size {eot_id + 1})")
    dist.barrier()  # nobody tears the group down while rank 0 still writes


# === plumbing: pre-tokenizing on every core, train_bpe_gpu.py's own and taught there
SAFE_CUTS = {pattern: regex.compile(r"[\p{L}\p{N}](?=[\r\n])")}  # the cut: the match's end


def time_is_up(signum, frame):
    raise TimeoutError


def count_batch(documents, pattern_text, chunk_counts):
    split_pattern = regex.compile(pattern_text)
    signal.signal(signal.SIGPROF, time_is_up)
    for document in documents:
        try:
            signal.setitimer(signal.ITIMER_PROF, 1 + len(document) / 1e5)
            chunk_counts.update(split_pattern.findall(document))
        except TimeoutError:
            raise UserError(f"--pattern {pattern_text!r} backtracks catastrophically (out of time "
                            f"on the document {document[:30]!r}...); simplify it")
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    # a pattern matching the empty string in places (\b): chunks of no bytes to merge
    if "" in chunk_counts:
        raise UserError(f"--pattern {pattern_text!r} matches the empty string; each match must "
                        "take a character (x+, not x*)")


def count_worker(number, batches, inboxes, results, pattern_text):
    """Counts batches until None, then sums its share of all the workers' counts onto `results`.
    After an error (put there at once) it drains the queue, still sending its shares: none waits
    forever."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with its parent
    if os.getppid() != multiprocessing.parent_process().pid:  # died before: don't hold its lock
        os._exit(1)
    chunk_counts, error = Counter(), None
    for batch in iter(batches.get, None):
        try:
            if error is None:
                count_batch(batch, pattern_text, chunk_counts)
        except UserError as batch_error:
            error = batch_error
            results.put(error)
    shares = [Counter() for _ in inboxes]
    for chunk, count in chunk_counts.items():
        shares[hash(chunk) % len(inboxes)][chunk] = count
    del chunk_counts  # its memory back before the others' shares come in
    for other, inbox in enumerate(inboxes):
        if other != number:
            inbox.put(shares[other])
    chunk_sums = shares[number]
    del shares  # each sent share goes once it is pickled
    for _ in range(len(inboxes) - 1):
        chunk_sums.update(inboxes[number].get())
    if error is None:
        results.put(chunk_sums)


def count_chunks(documents, budget, pattern_text, workers, label):
    """The chunk counts of the documents' first `budget` characters (the last one cut to fit; no
    more is asked of the source), and what was read, under a progress bar `label` (None: none).
    The workers fork before tqdm starts its thread."""
    fork = multiprocessing.get_context("fork")
    # at most two batches a worker wait in the queue: the parent reads no further ahead
    batches, results = fork.Queue(2 * workers), fork.Queue()
    inboxes = [fork.Queue() for _ in range(workers)]  # worker i's: the shares it adds up
    processes = [fork.Process(target=count_worker, daemon=True,
                              args=(number, batches, inboxes, results, pattern_text))
                 for number in range(workers)]
    for process in processes:
        process.start()

    def check_workers():  # a worker killed (out of memory, say) never answers: say so, don't wait
        for process in processes:
            if process.exitcode not in (None, 0):
                died = process.exitcode
                cause = f"signal {signal.Signals(-died).name}" if died < 0 else f"exit status {died}"
                raise UserError(f"a pre-tokenizing worker died ({cause}; out of memory?): lower -n, "
                                "or free memory")

    def waiting(operation, *args):  # a queue's put or get, checking the workers every second
        while True:
            try:
                return operation(*args, timeout=1)
            except (queue.Full, queue.Empty):
                check_workers()

    batch, batch_chars, chunk_counts = [], 0, Counter()
    read = dict(documents=0, chars=0, cut=False)
    try:
        with tqdm(total=budget, unit="char", unit_scale=True, desc=label, disable=label is None,
                  mininterval=0.5) as progress:
            for text in documents if budget > 0 else ():
                kept = text[:budget - read["chars"]]
                read["documents"] += 1
                read["chars"] += len(kept)
                read["cut"] = len(kept) < len(text)
                progress.update(len(kept))
                for piece in document_pieces(kept, pattern_text):
                    batch.append(piece)
                    batch_chars += len(piece)
                    if batch_chars >= BATCH_CHARS:
                        waiting(batches.put, batch)
                        batch, batch_chars = [], 0
                    if not results.empty():  # before the end, only a worker's error is put there
                        raise results.get()
                if read["chars"] == budget:
                    break
            for last in [batch] + [None] * workers:
                waiting(batches.put, last)
            for chunk_sums in [waiting(results.get) for _ in processes]:
                if isinstance(chunk_sums, UserError):
                    raise chunk_sums
                dict.update(chunk_counts, chunk_sums)  # disjoint sums: joined in C
    finally:
        batches.cancel_join_thread()  # a batch left in a pipe would make exit wait for ever
        for process in processes:
            process.kill()
            process.join()
    return chunk_counts, read


def document_pieces(document, pattern_text):
    """The document in pieces of about BATCH_CHARS characters or more, cut only where SAFE_CUTS
    says the pattern can't match across: their chunks are the document's."""
    safe_cut = SAFE_CUTS.get(pattern_text)
    start = 0
    while safe_cut is not None and len(document) - start > BATCH_CHARS:
        cut = safe_cut.search(document, start + BATCH_CHARS)
        if cut is None:
            break
        yield document[start:cut.end()]
        start = cut.end()
    yield document[start:]


# === plumbing: the cache of counted chunks: a rerun with other -v skips reading and pre-tokenizing.
# .npy files (no pickle: loading can't run code) hold this rank's distinct chunks of 2+ bytes, their
# lengths and counts; the .json, written last, the statistics and a sha256 of all: a cache that
# fails it is counted again. Each file is renamed over the old: a run mapping the old keeps it.


def count_part(args, source, files, documents, share, byte_range):
    """This rank's part, counted or cached -> (arrays and stats, cache status, prefix, error or
    None: run() shares it)."""
    prefix = Path(args.cache_dir) / cache_key(args, source, files, WORLD) / f"rank{RANK}"
    cache_status, cached = ("missing", None) if args.no_cache else read_cache(prefix)
    error = None
    if cache_status != "reused":
        cores = len(os.sched_getaffinity(0)) // LOCAL_WORLD
        num_workers = args.workers or (1 if share < PARALLEL_CHARS else max(cores, 1))
        label = "reading (rank 0's part)" if RANK == 0 else None
        try:
            chunk_counts, read = count_chunks(documents, share, args.pattern, num_workers, label)
            # not read back: another run may rewrite it
            cached = write_cache(prefix, chunk_counts, {"rank": RANK, "bytes": byte_range, **read})
        except UserError as user_error:
            error = str(user_error)
        except OSError as os_error:  # the cache's disk, or a file gone mid-read
            error = (f"{os_error.filename or prefix.parent}: {os_error.strerror or os_error}; "
                     "check it (--cache_dir says where the cache goes)")
    elif WORLD > 1:
        say("cache: rank 0's counts are loaded; waiting for the others")
    if error is None and cached[0].size + 2 > MAX_POSITIONS:
        error = (f"rank {RANK}'s distinct chunks hold {cached[0].size:,} bytes, more than int32 "
                 "positions can name (2^31 - 4); use more ranks, or a smaller -n")
    return cached, cache_status, prefix, error


def cache_key(args, source, files, world_size):
    """Changes whenever the counted chunks could: other data (or files changed), n, pattern, W."""
    stamp = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
    key = json.dumps([CACHE_VERSION, source, stamp, args.num_chars, args.pattern, world_size])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def checksum(arrays, stats):
    digest = hashlib.sha256(json.dumps(stats, sort_keys=True).encode())
    for array in arrays:
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def write_cache(prefix, chunk_counts, part):
    chunks = [chunk.encode("utf-8") for chunk in chunk_counts]
    lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
    counts = np.fromiter(chunk_counts.values(), np.int64, len(chunks))
    keep = lengths >= 2  # single-byte chunks hold no pair
    blob = np.frombuffer(b"".join(chunk for chunk, kept in zip(chunks, keep) if kept), np.uint8)
    arrays = [blob, lengths[keep], counts[keep]]
    stats = {"chunks": int(counts.sum()), "distinct": len(chunks), "part": part,
             "total_bytes": int((lengths * counts).sum()),
             "total_pairs": int(((lengths - 1) * counts).sum()), "bad_utf8": BadUTF8.count,
             "matched": sum(len(chunk) * count for chunk, count in chunk_counts.items())}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").unlink(missing_ok=True)
    tmp = prefix.with_suffix(f".{os.getpid()}.tmp")
    try:
        for name, array in zip(("bytes", "lengths", "counts"), arrays):
            with open(tmp, "wb") as f:
                np.save(f, array)
            os.replace(tmp, prefix.with_suffix(f".{name}.npy"))
        tmp.write_text(json.dumps({**stats, "sha256": checksum(arrays, stats)}))
        os.replace(tmp, prefix.with_suffix(".json"))
    finally:
        tmp.unlink(missing_ok=True)
    return (*arrays, stats)


def read_cache(prefix):
    try:
        stats = json.loads(prefix.with_suffix(".json").read_text())
        arrays = [np.load(prefix.with_suffix(f".{name}.npy"), mmap_mode="r")
                  for name in ("bytes", "lengths", "counts")]
        expected = stats.pop("sha256")
    except (OSError, ValueError, KeyError, AttributeError):
        return "missing", None
    if checksum(arrays, stats) != expected:
        return "tampered", None
    return "reused", (*arrays, stats)


# === plumbing: the command line, the checks
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size)
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars, help="all ranks together")
    parser.add_argument("--data", help=f"fineweb, fineweb-edu, or local files (default {data})")
    parser.add_argument("--out", default=out, help="default tokenizers/<source>_v<vocab_size>")
    parser.add_argument("--pattern", default=pattern, help="the split regex (default GPT-4's)")
    parser.add_argument("--device", default=device, choices=["cuda", "cpu"],
                        help="cuda (NCCL), or cpu (gloo; Triton's interpreter)")
    parser.add_argument("--cache_dir", default=cache_dir, help="each rank's counted chunks")
    parser.add_argument("--no_cache", action="store_true", help="count again, refresh the cache")
    parser.add_argument("--workers", type=int, default=workers,
                        help="pre-tokenizing processes per rank (0: automatic)")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds to wait for ranks")
    return parser.parse_args(argv)


def validate(args):
    """Every check that needs no text, on every rank BEFORE the process group exists: all exit
    alike, none waits in a collective (the Hub may answer only some: run() compares). Rank 0 alone
    checks and writes --out: when it exits, torchrun stops the others."""
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); fix it, or leave it out")
    problems = [
        (not 256 <= args.vocab_size <= 65536,
         f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes) and 65536"),
        (args.num_chars <= 0, f"-n {args.num_chars}: must be positive"),
        (args.workers < 0 or not 0 < args.timeout < 2**31, f"--workers {args.workers} --timeout "
         f"{args.timeout}: workers must be 0 (automatic) or more, the timeout in (0, 2^31) s"),
        (split_pattern.fullmatch(""), f"--pattern {args.pattern!r} matches the empty string; each "
         "match must take a character (x+, not x*)"),
        (split_pattern.groups, f"--pattern {args.pattern!r} has a capturing group; use (?:...)"),
        (args.device == "cuda" and not torch.cuda.is_available(),
         "--device cuda: no CUDA GPU here; --device cpu runs the kernels in Triton's "
         "interpreter (slow, for tests), or use train_bpe_cpu.py"),
        (args.device == "cuda" and torch.cuda.device_count() < LOCAL_WORLD, f"--device cuda: "
         f"{LOCAL_WORLD} ranks on this node, {torch.cuda.device_count()} GPU(s): one rank per GPU"),
        ((args.device == "cpu") != bool(triton.knobs.runtime.interpret),
         f"--device {args.device} with TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}: set "
         "it to 1 for cpu, 0 for cuda"),
    ]
    for failed, message in problems:
        if failed:
            raise UserError(message)
    if args.device == "cuda":
        check_launcher()
    check_count_rows(args.vocab_size, 4, device_memory(args.device), args.device)  # int32
    source_name, source, files = find_source(args.data or data, args.data is not None)
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    if RANK == 0:
        check_out_dir(out_dir)
    return source, files, out_dir


def check_launcher():  # built in C at the first launch, after the reading: now
    try:
        triton.runtime.driver.active.utils
    except Exception as error:
        raise UserError(f"Triton can't build its CUDA launcher ({str(error).splitlines()[0]}); "
                        "install gcc and python3-dev, or set CC")


def device_memory(device_name):
    if device_name == "cuda":
        return torch.cuda.get_device_properties(LOCAL_RANK).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_count_rows(V, itemsize, memory, device_name):
    """Rank 0 holds the most rows, (V - 1) // W + 1: every rank checks those, for one verdict."""
    need = itemsize * V * ((V - 1) // WORLD + 1)
    if need > 0.8 * memory:
        raise UserError(f"-v {V} on {WORLD} rank(s) needs {need / 2**30:.1f} GiB of pair counts "
                        f"per rank ({itemsize}-byte counts), more than its {device_name} can spare "
                        f"({memory / 2**30:.1f} GiB); use more ranks or a smaller -v")


def check_text(args, source, total, parts, cache_statuses, prefix):
    chars, n = sum(part["chars"] for part in parts), args.num_chars
    if chars == 0:
        raise UserError(f"the corpus {source} is empty; point --data at text")
    if total["total_pairs"] >= 2**43:
        raise UserError(f"{total['total_pairs']:,} pairs of text: more than 2^43, the most the row "
                        "keys hold; lower -n")
    if "tampered" in cache_statuses:
        say("warning: a cached part did not match its checksum: counted again", file=sys.stderr)
    if "reused" in cache_statuses:
        say(f"cache: {cache_statuses.count('reused')} of {WORLD} ranks reused their counted chunks "
            f"from {prefix.parent} (--no_cache counts again)")
    if total["bad_utf8"]:
        say(f"warning: {total['bad_utf8']} invalid UTF-8 sequences were replaced with U+FFFD",
            file=sys.stderr)
    if total["matched"] < chars:
        say(f"warning: the split pattern matched {total['matched']:,} of {chars:,} characters; the "
            f"other {1 - total['matched'] / chars:.1%} are dropped (tiktoken drops them too)",
            file=sys.stderr)
    if chars < n:
        full = [r for r, part in enumerate(parts)
                if part["chars"] == n * (r + 1) // WORLD - n * r // WORLD]
        why = f"rank(s) {full} stopped at n / W of their part: raise -n" if full else "all the text"
        say(f"read {chars:,} characters, fewer than -n {n:,}: {why}")


# === plumbing: the output directory and its files
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


# === plumbing: reading text, as in train_bpe_cpu.py; byte ranges and Hub shares are this file's own
def find_source(data, data_was_named):  # (name, description, files); no files: a Hub dataset
    if data not in HUB_DATASETS:
        return Path(data).stem, str(data), local_files(data)
    problem = hub_problem()
    if problem is None:
        return data, " ".join(HUB_DATASETS[data]), []
    if data_was_named:
        raise UserError(f"{problem}, needed for --data {data}; use --data path/to/files instead")
    say(f"warning: {problem}: using the offline corpus, Python's stdlib", file=sys.stderr)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in sorted(stdlib.rglob("*.py")) if "site-packages" not in path.parts]
    return "stdlib", "Python standard library source (offline fallback)", files

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

def datasets_texts(where, node, **load):  # rows' "text"; node=(rank, world_size): its share
    import datasets.distributed
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        rows = datasets.load_dataset(split="train", streaming=True, **load)
        rows = datasets.distributed.split_dataset_by_node(rows, *node)
        for number, row in enumerate(rows, 1):
            if not isinstance(row.get("text"), str):
                raise ValueError(f'row {number} has no string "text": {row!r:.50}')
            yield row["text"]
    except Exception as error:
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

# === plumbing: errors: a user's mistake or a lost rank is one line
def stopped(signum, frame):  # torchrun stops the others so when one fails; SLURM at its limit
    say(f"\nerror: stopped by {signal.Signals(signum).name}", file=sys.stderr)
    sys.exit(1)  # as on an error: atexit removes a half-made --out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stopped)
    try:
        run(sys.argv[1:])
    except (UserError, OSError) as error:  # OSError: an unreadable file, a full disk
        say(f"error: {error}", file=sys.stderr)
        if RANK != 0:  # exiting first, it could get rank 0 stopped before it speaks
            time.sleep(5)
        sys.exit(1)
    # gloo's timeout or closed socket is a RuntimeError, NCCL's (joining) a DistError (its
    # collective timing out: its watchdog ends the process)
    except RuntimeError as error:
        transport = regex.search(r"gloo|nccl|timed? ?out|connection|peer", str(error), regex.I)
        if not isinstance(error, dist.DistError) and not transport:
            raise  # not the transport: a bug, with its traceback
        text = (str(error).strip() or type(error).__name__).splitlines()[0][:200]
        print(f"\nerror: rank {RANK} lost contact with the other ranks ({text}); one died, hangs "
              "or never started (see above; --timeout sets the wait)", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:  # leaving: a SIGTERM from now on would be a traceback in a __del__ or atexit
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:  # a group whose peer died may fail to close
                pass
