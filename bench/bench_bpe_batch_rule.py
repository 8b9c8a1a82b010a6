"""
Replay BPE by the batch rule (train_bpe_gpu.merge_batch) and count its sequential steps: how many merges a step
makes at each batch limit, and whether the merges are still the sequential ones.

    python bench/bench_bpe_batch_rule.py                                  # enwiki, 2^22 characters, V=4096
    python bench/bench_bpe_batch_rule.py --num_chars 1048576 --vocab_size 2048 --limits 1 2 8 64
    python bench/bench_bpe_batch_rule.py --num_chars 1000000000 --vocab_size 65534   # all of enwiki: ~6 min
    python bench/bench_bpe_batch_rule.py --rule wider --keys_per_row 3 --limits 8 32       # a rule the kernels lack

Each step takes the first `limit` pairs of the exact order (count descending, ties to the smallest pair) off
train_bpe_cpu.py's heap, asks merge_batch for the batch, merges its pairs one after another with
train_bpe_cpu.merge_pair, and puts the other pairs back. Before each merge it checks that no pair left on the heap
outranks it (a "violation": the batch would not be the sequential merges). The merges are also compared with
train_bpe_cpu.train's, the sequential reference. Pure Python on the CPU: no GPU, no Triton kernel runs.
"""
import argparse
import heapq
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import regex

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRITON_INTERPRET", "1")  # train_bpe_gpu imports triton; merge_batch needs no GPU
import train_bpe_cpu as cpu  # noqa: E402
import train_bpe_gpu as gpu  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"))
parser.add_argument("--num_chars", type=int, default=1 << 22)
parser.add_argument("--vocab_size", type=int, default=4096)
parser.add_argument("--limits", type=int, nargs="+", default=[1, 2, 8, 64])
parser.add_argument("--rule", choices=["spec", "wider"], default="spec")  # spec: train_bpe_gpu.merge_batch
parser.add_argument("--keys_per_row", type=int, default=0)  # wider: a row's pairs a batch at most (0: any)
parser.add_argument("--same_left", type=int, default=1)  # wider: 0 ends the batch at a left seen before
args = parser.parse_args()


def wider_batch(ranked_pairs, max_batch):
    """The longest prefix in which no token is both a left and a right, (a, a) only alone and last."""
    lefts, rights, batch = Counter(), set(), []
    for left, right in ranked_pairs[:max_batch]:
        if left in rights or right in lefts or (left == right and (left in lefts or right in rights)):
            break
        if left in lefts and not args.same_left:
            break
        batch.append((left, right))
        lefts[left] += 1
        rights.add(right)
        if left == right or lefts[left] == args.keys_per_row:
            break
    return batch


rule = gpu.merge_batch if args.rule == "spec" else wider_batch


def first_documents(path, num_chars):
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"][:num_chars]
            yield text
            num_chars -= len(text)
            if num_chars == 0:
                return


def valid_top(heap, pair_counts):
    """The heap's best entry whose count is current (stale ones dropped), or None; left on the heap."""
    while heap and pair_counts.get(heap[0][1], 0) != -heap[0][0]:
        heapq.heappop(heap)
    return heap[0] if heap else None


def replay(chunk_counts, vocab_size, limit):
    """train_bpe_cpu.train's loop, a batch per step. Returns the merges, the steps and the violations."""
    ids, prev_pos, next_pos, weight = cpu.build_symbols(chunk_counts)
    pair_counts, pair_positions = cpu.count_pairs(ids, next_pos, weight)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges, steps, violations = [], 0, 0
    while 256 + len(merges) < vocab_size and valid_top(heap, pair_counts):
        ranked = []  # the exact order's first pairs, each once
        while len(ranked) < min(limit, vocab_size - 256 - len(merges)) and valid_top(heap, pair_counts):
            _, pair = heapq.heappop(heap)
            if pair not in ranked:
                ranked.append(pair)
        batch = rule(ranked, limit)
        for pair in ranked[len(batch):]:
            heapq.heappush(heap, (-pair_counts[pair], pair))
        steps += 1
        for pair in batch:
            top = valid_top(heap, pair_counts)
            if pair not in pair_counts or (top and top < (-pair_counts[pair], pair)):
                violations += 1
                if pair not in pair_counts:
                    continue  # merged away by the batch's earlier pairs (only a broken rule gets here)
            new_id = 256 + len(merges)
            merges.append((pair, new_id))
            changed, _ = cpu.merge_pair(pair, new_id, ids, prev_pos, next_pos, weight, pair_counts,
                                        pair_positions)
            for other in changed:
                if pair_counts[other] > 0:
                    heapq.heappush(heap, (-pair_counts[other], other))
                else:
                    del pair_counts[other]
                    pair_positions.pop(other, None)
    return merges, steps, violations


start, chars_read = time.time(), 0
chunk_counts = Counter()
for document in first_documents(args.corpus, args.num_chars):
    chunk_counts.update(regex.findall(gpu.pattern, document))
    chars_read += len(document)
print(f"{Path(args.corpus).name}: {chars_read:,} characters, {len(chunk_counts):,} distinct chunks, "
      f"V={args.vocab_size} ({time.time() - start:.1f} s to pre-tokenize)")
start = time.time()
reference, _ = cpu.train(chunk_counts, args.vocab_size)
print(f"train_bpe_cpu.train (sequential): {len(reference)} merges in {time.time() - start:.1f} s")
print(f"rule: {args.rule}, keys a row {args.keys_per_row or 'any'}, same left {'yes' if args.same_left else 'no'}")
print("| batch limit | merges | steps | merges per step | steps per merge | violations | same merges |")
print("|---|---|---|---|---|---|---|")
for limit in args.limits:
    merges, steps, violations = replay(chunk_counts, args.vocab_size, limit)
    print(f"| {limit} | {len(merges)} | {steps} | {len(merges) / steps:.2f} | {steps / len(merges):.3f} "
          f"| {violations} | {merges == reference} |", flush=True)
