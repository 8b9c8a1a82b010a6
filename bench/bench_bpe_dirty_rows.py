"""
How much a round of train_bpe_gpu.py's merge loop gives refresh_rows to recompute: the dirty rows a round, and
what reading them costs at a GPU's shape. The figure that decides whether a third key level (per row, the maximum of
each 256 columns: issue 37) can pay: it would spare reading the dirty rows that are not new, and cost a pass more.

    python bench/bench_bpe_dirty_rows.py                                    # enwiki, 2^22 characters, V=8192: ~9 min
    python bench/bench_bpe_dirty_rows.py --num_chars 200000 --vocab_size 512     # ~20 s

The very kernels run in Triton's interpreter on the CPU (no GPU needed); `state`'s DIRTY is read before each
choose_batch, which lists then the rows the previous round's refresh recomputed: two a pair (its left row, whose key
was zeroed, and the new token's row) and each row whose best or second-best pair lost count. "Items" and bytes are
what refresh_rows would read at the CUDA shape (4 rows x 256 columns an item, int32 counts), by quarter of the rounds.
"""
import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import regex

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["TRITON_INTERPRET"] = "1"  # before triton's import: the kernels run on the CPU
import train_bpe_gpu as gpu  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"))
parser.add_argument("--num_chars", type=int, default=1 << 22)
parser.add_argument("--vocab_size", type=int, default=8192)
parser.add_argument("--max_batch", type=int, default=gpu.max_batch)
args = parser.parse_args()

documents, num_chars = [], 0
with open(args.corpus, encoding="utf-8") as f:
    for line in f:
        text = json.loads(line)["text"][:args.num_chars - num_chars]
        documents.append(text)
        num_chars += len(text)
        if num_chars >= args.num_chars:
            break
split = regex.compile(gpu.pattern)
chunk_counts = Counter(chunk for text in documents for chunk in split.findall(text))
arrays = gpu.chunks_to_arrays(chunk_counts, args.vocab_size)

rounds = []  # (columns in use, dirty rows listed, pairs chosen), one per choose_batch launch
choose = gpu.choose_batch


class ReadState:
    def __getitem__(self, grid):
        def launch(state, *rest, **options):
            columns, dirty = int(state[gpu.NEXT.value]), int(state[gpu.DIRTY.value])
            choose[grid](state, *rest, **options)
            rounds.append((columns, dirty, int(state[gpu.NEXT.value]) - columns))
        return launch


gpu.choose_batch = ReadState()
started = time.time()
merges, _, _ = gpu.merge_on_device(arrays, args.vocab_size, "cpu", max_batch=args.max_batch)
print(f"{num_chars:,} characters, V={args.vocab_size}, max_batch {args.max_batch}: {len(merges)} merges in "
      f"{time.time() - started:.0f} s")
# round i's refresh is what the choose of round i + 1 finds listed
refreshed = [(columns, rounds[i + 1][1], pairs) for i, (columns, _, pairs) in enumerate(rounds[:-1]) if pairs]
itemsize = arrays["weight"].itemsize
print("quarter of the rounds | merges a round | dirty rows a round (median, mean, max) | of them not new (mean) "
      "| refresh items a round (mean) | MB read a round (mean)")
for quarter in range(4):
    part = refreshed[quarter * len(refreshed) // 4:(quarter + 1) * len(refreshed) // 4]
    dirty = [rows for _, rows, _ in part]
    items = [-(-rows // 4) * -(-columns // 256) for columns, rows, _ in part]
    megabytes = [rows * columns * itemsize / 1e6 for columns, rows, _ in part]
    print(f"{quarter + 1} | {statistics.mean(p for _, _, p in part):.2f} | {statistics.median(dirty):.0f}, "
          f"{statistics.mean(dirty):.1f}, {max(dirty)} | {statistics.mean(r - p for _, r, p in part):.1f} | "
          f"{statistics.mean(items):.0f} | {statistics.mean(megabytes):.2f}")
