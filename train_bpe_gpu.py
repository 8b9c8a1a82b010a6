"""
Train a byte-level BPE tokenizer, merging on a GPU: the same merges as train_bpe_cpu.py and rustbpe.

    python train_bpe_gpu.py -v 1000 -n 1048576              # on a CUDA GPU
    python train_bpe_gpu.py -v 300 -n 65536 --device cpu    # no GPU: Triton's interpreter (tests)

Flags and outputs are train_bpe_cpu.py's, the readable reference. This file shows how a sequential
algorithm gets fast on a GPU: merge k needs merge k-1's counts, yet a merge's work runs in parallel,
as do merges of pairs sharing no token, and the host stays out of the way: it launches 16 rounds of
four Triton kernels (a CUDA graph), then reads once.
"""

import argparse, atexit, base64, codecs, ctypes, fcntl, json, multiprocessing, os, queue, resource
import signal, socket, sys, sysconfig, time
import urllib.parse
from collections import Counter
from pathlib import Path

import numpy as np
import regex
import torch
from tqdm import tqdm

# read when triton is imported
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
try:
    import triton
    import triton.language as tl
except ImportError:
    sys.exit("error: train_bpe_gpu.py needs triton (pip install triton)")

# === plumbing: a fix for Triton's interpreter
if os.environ["TRITON_INTERPRET"] == "1":
    # Triton 3.6's interpreter (CUDA torch 2.11's) takes a loop bound as int() of a 1-element array,
    # which NumPy 2.4 refuses (triton-lang/triton#9171)
    from triton.runtime import interpreter

    def patch_tensor(tensor, *scope, patch=interpreter._patch_lang_tensor):
        patch(tensor, *scope)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())
    interpreter._patch_lang_tensor = patch_tensor

# === settings: defaults, each overridable from the command line
vocab_size = 1000  # byte tokens (256) + merges; <|endoftext|> gets the next id
num_chars = 1048576  # train on the first 2^20 characters of the stream
data = "fineweb"  # fineweb | fineweb-edu | a .txt/.jsonl/.parquet file | a directory of them
out = None  # output directory; default tokenizers/<source>_v<vocab_size>
device = None  # cuda, or cpu: Triton's interpreter (exact, slow, for tests)
# merges a round at most (1: one). Rounds fall 4.0x at 8, 5.0x at 32 (enwiki, V=65534); a pick
# costs a few dependent reads: 8
max_batch = 8
# GPT-4's split pattern (train_bpe_cpu.py explains it)
pattern = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
EOT = "<|endoftext|>"
# programs; positions a block; dirty rows a refresh item; block keys choose_batch reads at once;
# rows a block key
INTERPRETER_SHAPE = dict(programs=1, block=1024, rows=64, choose_block=1024, key_block=16)
ROUNDS_PER_READ = 16
PARALLEL_CHARS = 1 << 24  # from this many characters on, all cores pre-tokenize
# ---


# --- the lesson: a round of BPE merges as four steps
# The distinct chunks lie in flat arrays, one slot per byte (a "position"), as in train_bpe_cpu.py:
#   tokens[p]: DEAD once merged away; -1 on the spare slots END and END+1 (END is real: a lane may
#     read the token after any position unmasked)
#   next_pos[p]: the next live position of p's chunk, or END; prev_pos[p] likewise. A merge unlinks
#     a pair's right half: tokens never move, positions stay valid names.
#   weight[p]: how often p's chunk occurs in the corpus
#   counts[l*V+r]: the weighted count of pair (l, r): a dense V x V matrix
#   list_buffer[list_start[t]:list_start[t] + list_len[t]]: the positions holding token t: merging
#     (a, b) visits only a's positions.
# Choosing must not scan V^2 counts. A pair's key is count << 20 | (2^20 - 1 - r) (counts to 2^43);
# row_keys[2l] is row l's largest (ties to the smallest r; across rows, the smallest l), [2l+1] the
# next. A falling count spoils them only if it was one: the row is "dirty" (rare), recomputed into
# zeroed fresh_keys; the next choice copies them and remakes its block_key (the largest of KEY_BLOCK
# rows): a pick reads V/KEY_BLOCK block keys and one block's row keys.
# A round merges a batch (merge_batch says which pairs, and why exactly): a merge costs its
# kernels' latency, not their work (the median visits 132 positions); a batch shares it.
# Grids are known before the data (programs stride over blocks): CUDA records rounds. No kernel
# needs a lock (each docstring says why); atomics are relaxed (acq_rel fences the device around
# each): the stream orders the kernels.
# `state` (int32, as the kernels' ids and counts: fewer registers than int64): NEXT, the next id
# (256 + the merges made: the columns in use); DONE, 1 once no pair is left or V is reached (then
# every kernel does nothing); DIRTY, dirty_rows' length; PAIRS, BLOCKS: the round's pairs (pair i
# makes NEXT - PAIRS + i) and blocks of positions
NEXT, DONE, DIRTY, PAIRS, BLOCKS = (tl.constexpr(i) for i in range(5))
# `batch` (int64: START, OFFSET reach 2 x positions): pair i in slot i of each field: (A, B), a's
# list (START, LENGTH), its first block and scratch region (FIRST_BLOCK, OFFSET), how many
# positions stay a (SURVIVORS) and merge (MERGED)
A, B, START, LENGTH, FIRST_BLOCK, OFFSET, SURVIVORS, MERGED = (tl.constexpr(i) for i in range(8))
DEAD = tl.constexpr(-2)
ID_BITS = tl.constexpr(20)
LOW = tl.constexpr((1 << 20) - 1)


@triton.jit
def append(length, buffer, values, keep):
    """Appends the values where keep to a list: one atomic add reserves the block's slots."""
    ones = keep.to(tl.int32)
    slot = tl.atomic_add(length, tl.sum(ones, axis=0), sem="relaxed") + tl.cumsum(ones, axis=0) - 1
    tl.store(buffer + slot, values, mask=keep)


@triton.jit
def choose_batch(state, batch, row_keys, block_key, fresh_keys, dirty_flag, dirty_rows, list_start,
                 list_len, merge_log, V, max_batch, BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr,
                 POSITIONS: tl.constexpr, SLOTS: tl.constexpr):
    """Step 1, one program: the round's pairs (batch, merge_log, the new lists' start), or DONE."""
    if tl.load(state + DONE) != 0:
        return
    dirty = tl.load(state + DIRTY)
    for first in range(0, dirty, BLOCK):
        i = first + tl.arange(0, BLOCK)
        rows = tl.load(dirty_rows + i, mask=i < dirty, other=0)
        both, copy = 2 * rows[:, None] + tl.arange(0, 2)[None, :], (i < dirty)[:, None]
        tl.store(row_keys + both, tl.load(fresh_keys + both, mask=copy), mask=copy)
        tl.store(fresh_keys + both, 0, mask=copy)
        tl.store(dirty_flag + rows, 0, mask=i < dirty)
    # barriers (Triton orders memory only within a thread) around each dirty row's block key (twice
    # for two rows of a block, alike)
    tl.debug_barrier()
    for first in range(0, dirty, 4):  # one wait per 4 rows
        i = first + tl.arange(0, 4)
        blocks = tl.load(dirty_rows + i, mask=i < dirty, other=0) // KEY_BLOCK
        rows = blocks[:, None] * KEY_BLOCK + tl.arange(0, KEY_BLOCK)[None, :]
        keys = tl.load(row_keys + 2 * rows, mask=(i < dirty)[:, None] & (rows < V), other=0)
        tl.store(block_key + blocks, tl.max(keys, axis=1), mask=i < dirty)
    tl.store(batch + SURVIVORS * SLOTS + tl.arange(0, 2 * SLOTS), 0)  # and MERGED's
    tl.debug_barrier()
    # A pick: the largest key of the rows not chosen (the first block, then row, with the largest
    # count). The exact order's next pair is that or a chosen row's second key (sharing a token):
    # the batch ends where that ranks above (count, then row), or at a shared token.
    first_new, slots = tl.load(state + NEXT), tl.arange(0, SLOTS)
    chosen_a, chosen_b = slots * 0 - 1, slots * 0 - 1
    hidden_count, hidden_row, offset = tl.zeros((), tl.int64), dirty * 0 + V, tl.zeros((), tl.int64)
    dirty, pairs, blocks = dirty * 0, dirty * 0, dirty * 0
    going = first_new < V
    while going:
        keyed = tl.arange(0, BLOCK)
        count = tl.load(block_key + keyed, mask=keyed * KEY_BLOCK < first_new, other=0) >> ID_BITS
        best_count = tl.max(count, axis=0)
        best_block = tl.min(tl.where(count == best_count, keyed, BLOCK), axis=0)
        rows = best_block * KEY_BLOCK + tl.arange(0, KEY_BLOCK)
        keys = tl.load(row_keys + 2 * rows, mask=rows < first_new, other=0)
        a = tl.min(tl.where(keys >> ID_BITS == best_count, rows, V), axis=0)
        b = LOW - (tl.max(tl.where(rows == a, keys, 0), axis=0) & LOW).to(tl.int32)
        shared = (chosen_a == a) | (chosen_b == a) | (chosen_a == b) | (chosen_b == b)
        hidden = (hidden_count > best_count) | ((hidden_count == best_count) & (hidden_row < a))
        going = (best_count > 0) & (tl.max(shared.to(tl.int32), axis=0) == 0) & ~hidden
        if going:
            new, length = first_new + pairs, tl.load(list_len + a)
            tl.store(batch + A * SLOTS + pairs, a)
            tl.store(batch + B * SLOTS + pairs, b)
            tl.store(batch + START * SLOTS + pairs, tl.load(list_start + a))
            tl.store(batch + LENGTH * SLOTS + pairs, length)
            tl.store(batch + FIRST_BLOCK * SLOTS + pairs, blocks)
            tl.store(batch + OFFSET * SLOTS + pairs, offset)
            tl.store(merge_log + 2 * (new - 256), a)
            tl.store(merge_log + 2 * (new - 256) + 1, b)
            # row a leaves the picks (key zeroed, its block's without it); rows a, new are dirty
            tl.store(row_keys + 2 * a, 0)
            tl.store(block_key + best_block, tl.max(tl.where(rows == a, 0, keys), axis=0))
            a_new = tl.where(tl.arange(0, 2) == 0, a, new)
            tl.store(dirty_flag + a_new, 1)
            tl.store(dirty_rows + dirty + tl.arange(0, 2), a_new)
            second = tl.load(row_keys + 2 * a + 1) >> ID_BITS
            above = (second > hidden_count) | ((second == hidden_count) & (a < hidden_row))
            hidden_count, hidden_row = tl.where(above, second, hidden_count), tl.where(above, a, hidden_row)
            chosen_a, chosen_b = tl.where(slots == pairs, a, chosen_a), tl.where(slots == pairs, b, chosen_b)
            dirty, pairs, offset = dirty + 2, pairs + 1, offset + 2 * length
            blocks += tl.cdiv(length, POSITIONS).to(tl.int32)
            going = (pairs < max_batch) & (new + 1 < V) & (a != b)
            tl.debug_barrier()  # the next pick reads the keys just written
    tl.store(state + DIRTY, dirty)
    tl.store(state + PAIRS, pairs)
    tl.store(state + BLOCKS, blocks)
    tl.store(state + NEXT, first_new + pairs)
    tl.store(state + DONE, pairs == 0)
    # the new lists go after first_new - 1's (the bytes' for 256)
    end = tl.load(list_start + first_new - 1) + tl.load(list_len + first_new - 1)
    tl.store(list_start + first_new, end, mask=pairs > 0)


@triton.jit
def pair_block(state, batch, list_buffer, block, END, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """The round's lists in blocks of one pair each: block `block`'s pair i, indexes j into a_i's
    list, positions p (END past it), a, b, new, and its scratch region."""
    slots, pairs = tl.arange(0, SLOTS), tl.load(state + PAIRS)
    firsts = tl.load(batch + FIRST_BLOCK * SLOTS + slots, mask=slots < pairs, other=block + 1)
    i = tl.sum((firsts <= block).to(tl.int32), axis=0) - 1
    j = (block - tl.load(batch + FIRST_BLOCK * SLOTS + i)) * BLOCK + tl.arange(0, BLOCK)
    a, b = tl.load(batch + A * SLOTS + i).to(tl.int32), tl.load(batch + B * SLOTS + i).to(tl.int32)
    length = tl.load(batch + LENGTH * SLOTS + i)
    p = tl.load(list_buffer + tl.load(batch + START * SLOTS + i) + j, mask=j < length, other=END)
    return i, j, p, a, b, tl.load(state + NEXT) - pairs + i, length, tl.load(batch + OFFSET * SLOTS + i)


@triton.jit
def find_occurrences(state, batch, list_buffer, tokens, next_pos, prev_pos, mark, END,
                     BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """Step 2: marks the occurrences that merge: mark[p] = 2 new, mark[next_pos[p]] = 2 new + 1 (marks
    below the round's first are older: none is cleared). A lane writes only its two marks: merging
    occurrences share no position, and next_pos is one-to-one."""
    if tl.load(state + DONE) != 0:
        return
    for block in range(tl.program_id(0), tl.load(state + BLOCKS), tl.num_programs(0)):
        _, _, p, a, b, new, _, _ = pair_block(state, batch, list_buffer, block, END, BLOCK, SLOTS)
        second = tl.load(next_pos + p)
        merge = (tl.load(tokens + p) == a) & (tl.load(tokens + second) == b)
        # a run "aaaa" merges left to right: p merges after an even number of a's in its run
        # (walking prev_pos, as far as the block's longest run)
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


@triton.jit
def apply_merges(state, batch, list_buffer, scratch, tokens, next_pos, prev_pos, mark, weight,
                 counts, row_keys, dirty_flag, dirty_rows, merge_log, V, END, BLOCK: tl.constexpr,
                 SLOTS: tl.constexpr):
    """Step 3: merges the marked occurrences. The lane of (p, second) writes only what it owns: the
    tokens and links of p and second, and prev_pos of the position after second unless that one
    merges too (its lane links it). It reads a neighbour's token only where no lane writes it (the
    marks say). Counts change by atomic adds, which commute; no key changes."""
    if tl.load(state + DONE) != 0:
        return
    for block in range(tl.program_id(0), tl.load(state + BLOCKS), tl.num_programs(0)):
        i, j, p, a, b, new, length, offset = pair_block(
            state, batch, list_buffer, block, END, BLOCK, SLOTS)
        mark_p = tl.load(mark + p)
        merged = (j < length) & (mark_p == 2 * new)
        # survivors (still a) and merged ones wait in the pair's scratch regions for refresh
        unmarked = (j < length) & (mark_p != 2 * new) & (mark_p != 2 * new + 1)
        survives = unmarked & (tl.load(tokens + p, mask=unmarked, other=-1) == a)
        append(batch + SURVIVORS * SLOTS + i, scratch + offset, p, survives)
        append(batch + MERGED * SLOTS + i, scratch + offset + length, p, merged)
        second = tl.load(next_pos + p, mask=merged, other=END)
        before = tl.load(prev_pos + p, mask=merged, other=END)
        after = tl.load(next_pos + second, mask=merged, other=END)
        w = tl.load(weight + p, mask=merged, other=0)
        # A neighbour merged this round (by pair j) has its mark: odd before, even after. x = -1:
        # none (the chunk's start), or one merged before, whose lane counts the pair between as
        # (new_j, new); after: y = a_j, from merge_log (its lane writes tokens[after]), y_new = new_j
        mark_before = tl.load(mark + before, mask=merged, other=0)
        mark_after = tl.load(mark + after, mask=merged, other=0)
        before_merged = merged & (mark_before >= 2 * (new - i)) & (mark_before % 2 == 1)
        after_merged = merged & (mark_after >= 2 * (new - i)) & (mark_after % 2 == 0)
        x = tl.load(tokens + before, mask=merged & ~before_merged, other=-1)
        y_new = tl.where(after_merged, mark_after // 2,
                         tl.load(tokens + after, mask=merged & ~after_merged, other=-1))
        y = tl.where(after_merged, tl.load(merge_log + 2 * (y_new - 256), mask=after_merged), y_new)
        has_x, has_y = merged & (x >= 0), merged & (y >= 0)
        tl.store(tokens + p, new, mask=merged)
        tl.store(tokens + second, DEAD, mask=merged)
        tl.store(next_pos + p, after, mask=merged)
        tl.store(prev_pos + after, p, mask=has_y & ~after_merged)
        tl.store(prev_pos + p, tl.load(prev_pos + before, mask=before_merged, other=END),
                 mask=before_merged)
        # a, b broadcast by adding a zero block; int64: row * V + col > 2^31
        x, y, y_new, new = x.to(tl.int64), y.to(tl.int64), y_new.to(tl.int64), new.to(tl.int64)
        zero = 0 * x
        lose_pair(state, counts, row_keys, dirty_flag, dirty_rows, V, a + zero, b + zero, w, merged)
        lose_pair(state, counts, row_keys, dirty_flag, dirty_rows, V, x, a + zero, w, has_x)
        lose_pair(state, counts, row_keys, dirty_flag, dirty_rows, V, b + zero, y, w, has_y)
        # Only pairs with a new token gain (rows new are dirty). Row x's keys can't rise: (x, new)
        # ends below (x, a) before, one of row x's two (x is dirty then) or below them.
        tl.atomic_add(counts + x * V + new, w, mask=has_x, sem="relaxed")
        tl.atomic_add(counts + new * V + y_new, w, mask=has_y, sem="relaxed")


@triton.jit
def lose_pair(state, counts, row_keys, dirty_flag, dirty_rows, V, row, col, w, lose):
    """Pair (row, col) of old tokens loses w where lose: (a, b), (x, a) and (b, y). The one lane
    that flips dirty_flag lists a row whose key it was dirty."""
    tl.atomic_add(counts + row * V + col, -w, mask=lose, sem="relaxed")
    first = tl.load(row_keys + 2 * row, mask=lose, other=0) & LOW
    second = tl.load(row_keys + 2 * row + 1, mask=lose, other=0) & LOW
    was_key = lose & ((first == LOW - col) | (second == LOW - col))
    flipped = was_key & (tl.atomic_xchg(dirty_flag + row, 1, mask=was_key, sem="relaxed") == 0)
    # rare: an atomic per row listed (append's one a block would run in every block)
    slot = tl.atomic_add(state + DIRTY + 0 * row, 1, mask=flipped, sem="relaxed")
    tl.store(dirty_rows + slot, row, mask=flipped)


@triton.jit
def refresh_rows(state, batch, list_buffer, scratch, list_start, list_len, counts, fresh_keys,
                 dirty_rows, V, ROWS: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr):
    """Step 4: moves a_i's survivors back to its list, the merged positions to new_i's, after
    new_(i-1)'s. Then the dirty rows' two keys into fresh_keys, in items of ROWS rows x BLOCK
    columns, in any order (atomic_max)."""
    if tl.load(state + DONE) != 0:
        return
    program, programs = tl.program_id(0), tl.num_programs(0)
    pairs, slots = tl.load(state + PAIRS), tl.arange(0, SLOTS)
    first_new = tl.load(state + NEXT) - pairs
    merged = tl.load(batch + MERGED * SLOTS + slots, mask=slots < pairs, other=0)
    new_start = tl.load(list_start + first_new) + tl.cumsum(merged, axis=0) - merged
    for block in range(program, tl.load(state + BLOCKS), programs):
        i, j, _, _, _, _, length, offset = pair_block(state, batch, list_buffer, block, 0, BLOCK, SLOTS)
        kept, made = tl.load(batch + SURVIVORS * SLOTS + i), tl.load(batch + MERGED * SLOTS + i)
        a_list = list_buffer + tl.load(batch + START * SLOTS + i)
        new_list = list_buffer + tl.sum(tl.where(slots == i, new_start, 0), axis=0)
        tl.store(a_list + j, tl.load(scratch + offset + j, mask=j < kept), mask=j < kept)
        tl.store(new_list + j, tl.load(scratch + offset + length + j, mask=j < made), mask=j < made)
    if program == 0:
        a = tl.load(batch + A * SLOTS + slots, mask=slots < pairs, other=0)
        tl.store(list_len + a, tl.load(batch + SURVIVORS * SLOTS + slots), mask=slots < pairs)
        tl.store(list_start + first_new + slots, new_start, mask=slots < pairs)
        tl.store(list_len + first_new + slots, merged, mask=slots < pairs)
    columns, dirty = tl.load(state + NEXT), tl.load(state + DIRTY)
    slices = tl.cdiv(columns, BLOCK)
    # num_stages=3 loads the next two items (cp.async) while this one is reduced
    for item in tl.range(program, tl.cdiv(dirty, ROWS) * slices, programs, num_stages=3):
        i = (item // slices) * ROWS + tl.arange(0, ROWS)
        row = tl.load(dirty_rows + i, mask=i < dirty, other=0).to(tl.int64)
        col = (item % slices) * BLOCK + tl.arange(0, BLOCK)
        inside = (i < dirty)[:, None] & (col < columns)[None, :]
        count = tl.load(counts + row[:, None] * V + col[None, :], mask=inside, other=0)
        # the item's two largest keys (0: none), int64 only for them: half the registers
        most = tl.max(count, axis=1)
        first_col = tl.min(tl.where(count == most[:, None], col[None, :], columns), axis=1)
        rest = tl.where(col[None, :] == first_col[:, None], 0, count)
        next_most = tl.max(rest, axis=1)
        next_col = tl.min(tl.where(rest == next_most[:, None], col[None, :], columns), axis=1)
        key = tl.where(most > 0, (most.to(tl.int64) << ID_BITS) | (LOW - first_col), 0)
        second = tl.where(next_most > 0, (next_most.to(tl.int64) << ID_BITS) | (LOW - next_col), 0)
        # A row's first key by atomic max; its second, the largest of the items' seconds and of the
        # smaller of each first and the key it met (inserted one by one, the second largest is the
        # smaller of two at some insertion)
        met = tl.atomic_max(fresh_keys + 2 * row, key, mask=i < dirty, sem="relaxed")
        tl.atomic_max(fresh_keys + 2 * row + 1, tl.maximum(second, tl.minimum(met, key)),
                      mask=i < dirty, sem="relaxed")


def chunks_to_arrays(chunk_counts, vocab_size):
    """The distinct chunks of 2+ bytes (one has no pair) as the arrays above."""
    chunks = [chunk.encode("utf-8") for chunk in chunk_counts]
    lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
    occurrences = np.fromiter(chunk_counts.values(), np.int64, len(chunks))
    total_bytes = int((lengths * occurrences).sum())  # the text's tokens before any merge
    keep = lengths >= 2
    chunks = [chunk for chunk, kept in zip(chunks, keep) if kept]
    lengths, occurrences = lengths[keep], occurrences[keep]
    L = END = int(lengths.sum())
    check_positions(L)
    ends = np.cumsum(lengths)
    tokens = np.full(L + 2, -1, np.int32)
    tokens[:L] = np.frombuffer(b"".join(chunks), np.uint8)
    next_pos, prev_pos = np.arange(1, L + 3, dtype=np.int32), np.arange(-1, L + 1, dtype=np.int32)
    next_pos[ends - 1], prev_pos[ends - lengths] = END, END
    next_pos[L:], prev_pos[L:] = END, END
    # int32 counts (half the matrix) below 2^31 pairs of text
    total_pairs = int(((lengths - 1) * occurrences).sum())
    count_dtype = np.int32 if total_pairs < 2**31 else np.int64
    weight = np.zeros(L + 2, count_dtype)
    weight[:L] = np.repeat(occurrences, lengths)
    left = np.flatnonzero(next_pos[:L] != END)
    # the 256 byte lists in turn: on uint8, numpy's stable sort is a linear radix sort
    order = np.argsort(tokens[left].astype(np.uint8), kind="stable")
    # the byte lists, then the new tokens': a merge appends as many positions as it kills
    list_buffer = np.zeros(2 * len(left) + 1, np.int32)
    list_buffer[:len(left)] = left[order]
    list_len = np.zeros(vocab_size, np.int64)
    list_len[:256] = np.bincount(tokens[left], minlength=256)
    list_start = np.zeros(vocab_size, np.int64)
    list_start[1:256] = np.cumsum(list_len[:255])
    pairs = tokens[left].astype(np.int64) * vocab_size + tokens[left + 1]
    return dict(tokens=tokens, next_pos=next_pos, prev_pos=prev_pos, weight=weight,
                list_buffer=list_buffer, list_start=list_start, list_len=list_len, pairs=pairs,
                pair_weights=weight[left], total_bytes=total_bytes)


def merge_on_device(arrays, vocab_size, device, max_batch=max_batch):
    """The merges, the token count, and the seconds of the setup (uploads, zeros, compiling,
    recording) and of the loop."""
    V, device = vocab_size, torch.device(device)
    started = time.time()
    if device.type == "cuda":
        # kernels launch, and graphs record, on the current GPU
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    upload = lambda name: torch.from_numpy(arrays[name]).to(device)  # noqa
    zeros = lambda size, dtype=torch.int64: torch.zeros(size, dtype=dtype, device=device)  # noqa
    tokens, next_pos, prev_pos, weight, list_buffer, list_start, list_len = map(upload, (
        "tokens", "next_pos", "prev_pos", "weight", "list_buffer", "list_start", "list_len"))
    counts = zeros(V * V, weight.dtype).index_add_(0, upload("pairs"), upload("pair_weights"))
    END = len(tokens) - 2
    mark, scratch = zeros(END + 2, torch.int32), torch.empty_like(list_buffer)
    # a GPU runs a few programs per SM; the interpreter, in turn: one wide is fastest
    shape = INTERPRETER_SHAPE
    if device.type == "cuda":
        shape = dict(programs=4 * torch.cuda.get_device_properties(device).multi_processor_count,
                     block=256, rows=4, choose_block=256, key_block=256)
    programs, block, rows = shape["programs"], shape["block"], shape["rows"]
    # choose_batch reads all block keys at once: choose_block x key_block rows must cover V
    key_block = max(shape["key_block"], triton.next_power_of_2(triton.cdiv(V, shape["choose_block"])))
    choose_block = max(shape["choose_block"], key_block)
    slots = triton.next_power_of_2(max_batch)
    row_keys, fresh_keys, batch = zeros(2 * V), zeros(2 * V), zeros(8 * slots)
    merge_log, block_key = zeros(2 * V), zeros(triton.cdiv(V, key_block))
    dirty_flag, dirty_rows = zeros(V, torch.int32), zeros(V, torch.int32)
    state = zeros(5, torch.int32)
    # the first refresh makes every row's keys
    dirty_flag[:256], dirty_rows[:256] = 1, torch.arange(256, device=device)
    state[NEXT.value], state[DIRTY.value] = 256, 256
    grid = (programs,)

    def launch_refresh():
        refresh_rows[grid](state, batch, list_buffer, scratch, list_start, list_len, counts,
                           fresh_keys, dirty_rows, V, ROWS=rows, BLOCK=block, SLOTS=slots)

    def merge_group():
        for _ in range(ROUNDS_PER_READ):
            choose_batch[(1,)](state, batch, row_keys, block_key, fresh_keys, dirty_flag, dirty_rows,
                               list_start, list_len, merge_log, V, max_batch, BLOCK=choose_block,
                               KEY_BLOCK=key_block, POSITIONS=block, SLOTS=slots)
            find_occurrences[grid](state, batch, list_buffer, tokens, next_pos, prev_pos, mark,
                                   END, BLOCK=block, SLOTS=slots)
            apply_merges[grid](state, batch, list_buffer, scratch, tokens, next_pos, prev_pos,
                               mark, weight, counts, row_keys, dirty_flag, dirty_rows, merge_log,
                               V, END, BLOCK=block, SLOTS=slots)
            launch_refresh()

    launch_refresh()
    # the setup compiles every kernel (a group with DONE set) and, on CUDA, records a group
    state[DONE.value] = 1
    merge_group()
    state[DONE.value] = 0
    graph = None
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            merge_group()
        torch.cuda.synchronize(device)
    loop_started = time.time()
    with tqdm(total=V - 256, unit="merge", desc="merging", mininterval=0.5) as progress:
        done, merges_made, in_flight = False, 0, None
        while not done and merges_made < V - 256:
            if graph is None:
                merge_group()
            else:
                graph.replay()
            # group k's NEXT and DONE are read while k + 1 runs (else the GPU idles through the
            # read and the launch): one spare group after DONE. Pinned: an async copy
            copy = torch.empty(2, dtype=torch.int32, pin_memory=graph is not None)
            copy.copy_(state[:2], non_blocking=True)
            arrived = None if graph is None else torch.cuda.current_stream().record_event()
            previous, in_flight = in_flight, (copy, arrived)
            if previous is not None:
                done, merges_made = merges_done(*previous)
                progress.update(merges_made - progress.n)
    seconds = dict(setup=loop_started - started, loop=time.time() - loop_started)
    merged_pairs = merge_log[:2 * merges_made].view(-1, 2).tolist()
    # a merged occurrence saves a token per use of its chunk
    tokens_saved = int(weight[tokens == DEAD.value].sum())
    merges = [((left, right), 256 + i) for i, (left, right) in enumerate(merged_pairs)]
    return merges, arrays["total_bytes"] - tokens_saved, seconds


def merges_done(copy, arrived):
    """Whether the merges are done, and how many: a group's one wait and read."""
    if arrived is not None:
        arrived.synchronize()
    next_id, done = copy.tolist()
    return bool(done), next_id - 256


# === the batch rule: several merges a round, exactly the sequential ones
def merge_batch(ranked_pairs, max_batch):
    """The pairs a round merges: the longest prefix of ranked_pairs (largest count first, ties to
    the smallest (l, r)) sharing no token, (a, a) only last, at most max_batch: what sequential
    merges make. Merging (a_i, b_i) changes only pairs holding a_i or b_i: later pairs keep their
    counts, and those it makes rank below them ((x, new_i) counts at most what (x, a_i) did, not in
    the batch, and new_i, the largest id yet, loses ties; likewise (new_i, y))."""
    batch = []
    for left, right in ranked_pairs[:max_batch]:
        if any(left in pair or right in pair for pair in batch):
            break
        batch.append((left, right))
        if left == right:  # (AA, a) of "aaa" can count half as much: it may come next
            break
    return batch


# === plumbing: pre-tokenizing on every core, the same in both GPU trainers (counting chunks is
# train_bpe_cpu.py's lesson). The regex, the slow part, holds the GIL: workers count batches of
# documents in any order (BPE sees only the multiset of chunks), then sum disjoint shares
# (hash(chunk) % workers: forked, they hash alike).
BATCH_CHARS = 1 << 20  # characters of documents a batch
# A long document (a .txt file) is cut, for GPT-4's pattern, before a line break after a letter or
# digit. No match holds both: letter and digit runs stop at the break, and the alternatives that
# take one need whitespace or punctuation before it ("end.\n" is one chunk). A match begun before
# the break stops there as at the text's end; with no lookbehind or anchor, those after it see
# nothing before it. No other --pattern is ever cut.
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


# === plumbing: the tokenizer's files, the settings' and --out's checks
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


class UserError(Exception):
    """A mistake in the input: one line, never a traceback."""


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


def check_launcher():  # built in C at the first launch, after the reading: now
    try:
        triton.runtime.driver.active.utils
    except Exception as error:
        raise UserError(f"Triton can't build its CUDA launcher ({str(error).splitlines()[0]}); "
                        "install gcc and python3-dev, or set CC")


def validate(args):
    """The settings, checked before any work -> the device to train on."""
    try:
        split_pattern = regex.compile(args.pattern)
    except regex.error as error:
        raise UserError(f"--pattern does not compile ({error}); fix it, or leave it out")
    chosen = args.device or "cuda"  # never cpu by default: the interpreter is ~1,000x slower
    try:
        parsed = torch.device(chosen)
        kind, index = parsed.type, parsed.index
    except RuntimeError:  # not a device's name at all
        kind, index = None, None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems = [
        (not 256 <= args.vocab_size <= 2**20,
         f"-v {args.vocab_size}: vocab_size must be between 256 (the bytes) and 2^20"),
        (args.num_chars <= 0, f"-n {args.num_chars}: must be positive"),
        (not 0 < args.max_batch <= 1024, f"--max_batch {args.max_batch}: must be 1 (a merge a round) to 1024"),
        (split_pattern.fullmatch(""), f"--pattern {args.pattern!r} matches the empty string; each "
         "match must take a character (x+, not x*)"),
        (split_pattern.groups, f"--pattern {args.pattern!r} has a capturing group; use (?:...)"),
        (kind not in ("cpu", "cuda"),
         f"--device {chosen}: not supported (Triton runs on CUDA GPUs); use cuda (or cpu to test)"),
        (kind == "cuda" and gpus == 0,
         f"--device {chosen}: no CUDA GPU here; --device cpu runs the kernels in Triton's "
         "interpreter (slow, for tests), or use train_bpe_cpu.py"),
        (kind == "cuda" and index is not None and index >= gpus,
         f"--device {chosen}: this machine has {gpus} CUDA GPU(s), cuda:0 to cuda:{gpus - 1}"),
        ((kind == "cpu") != bool(triton.knobs.runtime.interpret),
         f"--device {chosen} with TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}: set it to 1 "
         "for cpu, 0 for cuda"),
    ]
    for failed, message in problems:
        if failed:
            raise UserError(message)
    if kind == "cuda":
        check_launcher()
    check_memory(args.vocab_size, 4, parsed)
    return parsed


def check_text(args, source, chunk_counts, chars_read):
    if chars_read == 0:
        raise UserError(f"the corpus {source} is empty; point --data at text")
    if BadUTF8.count:
        print(f"warning: {BadUTF8.count} invalid UTF-8 sequences were replaced with U+FFFD",
              file=sys.stderr)
    matched = sum(len(chunk) * count for chunk, count in chunk_counts.items())
    if matched < chars_read:
        share = 1 - matched / chars_read
        print(f"warning: the split pattern matched {matched:,} of {chars_read:,} characters; "
              f"the other {share:.1%} are dropped (tiktoken drops them too)", file=sys.stderr)
    if chars_read < args.num_chars:
        print(f"the source ran out after {chars_read:,} characters (asked for {args.num_chars:,}); "
              "training on those")


def check_memory(vocab_size, itemsize, device):
    """The V x V count matrix is the budget (16 GiB at V = 65534), not the ~40 bytes a position."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = itemsize * vocab_size**2
    if need > 0.8 * total:
        raise UserError(f"-v {vocab_size} needs a {need / 2**30:.1f} GiB pair-count matrix, more "
                        f"than {device} can spare ({total / 2**30:.1f} GiB); use a smaller -v, or "
                        "train_bpe_cpu.py")


MAX_POSITIONS = 2**31 - 2  # int32 positions: the distinct chunks' bytes + 2 spare slots


def check_positions(L):
    if L + 2 > MAX_POSITIONS:
        raise UserError(f"the distinct chunks hold {L:,} bytes, more than int32 positions can name "
                        "(2^31 - 4); lower -n, or use train_bpe_multigpu.py")


def peak_memory(device):
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (device)"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return f"{kib / 2**20:.2f} GiB (process resident)"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--vocab_size", type=int, default=vocab_size)
    parser.add_argument("-n", "--num_chars", type=int, default=num_chars)
    parser.add_argument("--data", help=f"fineweb, fineweb-edu, or local files (default {data})")
    parser.add_argument("--out", default=out, help="default tokenizers/<source>_v<vocab_size>")
    parser.add_argument("--pattern", default=pattern, help="the split regex (default GPT-4's)")
    parser.add_argument("--device", default=device, help="cuda, or cpu (Triton's interpreter)")
    parser.add_argument("--max_batch", type=int, default=max_batch, help="merges a round at most")
    return parser.parse_args(argv)


# === the run: read, pre-tokenize, lay out, merge, write
def run(argv):
    args = parse_args(argv)
    train_device = validate(args)
    documents, source_name, source = open_source(args.data or data, args.data is not None)
    out_dir = Path(args.out or f"tokenizers/{source_name}_v{args.vocab_size}")
    out_lock = check_out_dir(out_dir)

    t0 = time.time()
    workers = len(os.sched_getaffinity(0)) if args.num_chars >= PARALLEL_CHARS else 1
    chunk_counts, read = count_chunks(
        documents(args.num_chars), args.num_chars, args.pattern, workers, "reading")
    chars_read = read["chars"]
    t1 = time.time()
    check_text(args, source, chunk_counts, chars_read)
    print(f"read {chars_read:,} characters: {sum(chunk_counts.values()):,} chunks, "
          f"{len(chunk_counts):,} distinct")
    arrays = chunks_to_arrays(chunk_counts, args.vocab_size)
    # int64 counts past 2^31 pairs: twice what validate() checked
    check_memory(args.vocab_size, arrays["weight"].itemsize, train_device)
    print(f"{len(arrays['tokens']) - 2:,} token positions in the distinct chunks, on {train_device}")
    t_layout = time.time()
    merges, total_tokens, seconds = merge_on_device(
        arrays, args.vocab_size, train_device, args.max_batch)
    t2 = time.time()

    num_merges, eot_id = len(merges), 256 + len(merges)
    stop_reason = "vocab_size reached" if eot_id == args.vocab_size else "no pairs left to merge"
    if eot_id < args.vocab_size:
        print(f"stopped early after {num_merges} merges: {stop_reason} "
              f"(vocab {eot_id} < {args.vocab_size})")
    save_tokenizer(out_dir, merges, {
        "pattern": args.pattern, "special_tokens": {EOT: eot_id}, "vocab_size": eot_id + 1,
        "num_merges": num_merges, "num_chars": chars_read, "source": source,
        "trainer": "train_bpe_gpu.py", "device": str(train_device), "seconds": round(t2 - t0, 3),
        "stop_reason": stop_reason})
    # over the loop alone: the setup compiles
    merges_per_second = num_merges / max(seconds["loop"], 1e-9)
    print(f"reading + pre-tokenizing {t1 - t0:.2f}s | layout {t_layout - t1:.2f}s | setup "
          f"{seconds['setup']:.2f}s | merging {seconds['loop']:.2f}s ({merges_per_second:,.0f} "
          f"merges/s) | total {t2 - t0:.2f}s")
    print(f"peak memory: {peak_memory(train_device)}")
    total_bytes = arrays["total_bytes"]
    print(f"compression on the training text: {total_bytes / max(total_tokens, 1):.3f} bytes/token "
          f"({total_bytes:,} bytes -> {total_tokens:,} tokens)")
    print(f"wrote {out_dir}/tokenizer.tiktoken and tokenizer.json ({EOT} = {eot_id}, "
          f"vocab_size {eot_id + 1})")
    os.close(out_lock)


# === plumbing: reading text, train_bpe_cpu.py's functions
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

# === the command line: run, and each mistake in one line
if __name__ == "__main__":
    try:
        run(sys.argv[1:])
    except (UserError, OSError) as error:  # OSError: an unreadable file, a full disk
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
