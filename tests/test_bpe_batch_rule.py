"""train_bpe_gpu.merge_batch, the batch rule, against rustbpe over whole trainings.

The rule: take the longest prefix p1..pk of the exact order (count descending, ties to the smallest pair) whose pairs
share no token, a pair (a, a) only last; merged in one step, p1..pk are the next k sequential merges. Why: merging
pi = (ai, bi) changes only the counts of pairs that hold ai or bi, so the later pj keep their counts and their order.
A pair it creates, (x, new_i), counts at most what (x, ai) counted, and (x, ai), sharing ai with pi, is outside the
prefix: it ranks below every pj, and new_i, the largest id so far, loses every tie that ai lost. (new_i, y) likewise,
against (bi, y). (a, a) breaks the bound: in "aaa" its merge makes (AA, a), whose "before" pair is (a, a) itself, and
which can count up to half of (a, a)'s count: more than the next pair. So (a, a) ends a batch.

A small CPU trainer here counts every pair of the words at each step, ranks them exactly, asks the rule for the
batch, and merges the batch's pairs one after another. If the rule is right, its merges are rustbpe's, merge for
merge, at any batch limit. The rule broken on purpose (a shared token allowed, or (a, a) not last) gives other merges:
the comparison can fail.
"""
import heapq
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import regex
import rustbpe
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")  # before triton's import
pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu  # noqa: E402
import train_bpe_gpu as bpe  # noqa: E402

BATCH_LIMITS = [1, 2, 8, 64]


def merge_word(word, pair, new_id):
    """The word's tokens with each occurrence of pair, left to right, replaced by new_id ("aaa" -> [aa, a])."""
    if pair[0] not in word:
        return word  # most words: checked at C speed
    merged, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(new_id)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def train_in_batches(docs, vocab_size, max_batch, rule=bpe.merge_batch):
    """The merges, ((left, right), new id) in order, and the size of each step's batch."""
    chunk_counts = Counter(chunk for doc in docs for chunk in regex.findall(bpe.pattern, doc))
    words = [(list(chunk.encode("utf-8")), count) for chunk, count in chunk_counts.items()]
    merges, batch_sizes = [], []
    while 256 + len(merges) < vocab_size:
        pair_counts = Counter()
        for word, count in words:
            for pair in zip(word, word[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break  # no pairs left: the vocabulary stops early
        limit = min(max_batch, vocab_size - 256 - len(merges))
        # the exact order's first `limit` pairs: all that a batch of at most `limit` can use
        ranked = heapq.nsmallest(limit, pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        batch = rule(ranked, limit)
        assert 1 <= len(batch) <= limit
        for pair in batch:
            new_id = 256 + len(merges)
            merges.append((pair, new_id))
            words = [(merge_word(word, pair, new_id), count) for word, count in words if len(word) > 1]
        batch_sizes.append(len(batch))
    return merges, batch_sizes


def rustbpe_vocab(docs, vocab_size):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=bpe.pattern)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def assert_equals_rustbpe_at_every_limit(docs, vocab_size):
    """The batch trainer's vocabulary is rustbpe's at each batch limit; returns the batch sizes per limit."""
    expected = rustbpe_vocab(docs, vocab_size)
    sizes = {}
    for max_batch in BATCH_LIMITS:
        merges, sizes[max_batch] = train_in_batches(docs, vocab_size, max_batch)
        vocab = train_bpe_cpu.vocab_bytes(merges)
        first_difference = next((i for i, (a, b) in enumerate(zip(vocab, expected)) if a != b), None)
        assert vocab == expected, (max_batch, len(vocab), len(expected), first_difference)
        assert sum(sizes[max_batch]) == len(merges) and max(sizes[max_batch]) <= max_batch
    assert set(sizes[1]) == {1}
    return sizes


def enwiki_docs(corpus, num_chars):
    docs = []
    with open(corpus("enwiki.jsonl"), encoding="utf-8") as f:
        for line in f:
            docs.append(json.loads(line)["text"])
            num_chars -= len(docs[-1])
            if num_chars <= 0:
                return docs
    return docs


# ---------------------------------------------------------------- the rule itself, on ranked lists

def test_the_rule_takes_the_longest_prefix_without_a_shared_token():
    assert bpe.merge_batch([(1, 2), (3, 4), (5, 6)], 8) == [(1, 2), (3, 4), (5, 6)]
    assert bpe.merge_batch([(1, 2), (3, 4), (5, 6)], 2) == [(1, 2), (3, 4)]  # the limit
    assert bpe.merge_batch([(1, 2), (3, 4), (2, 7), (8, 9)], 8) == [(1, 2), (3, 4)]  # (8, 9) is after a break
    assert bpe.merge_batch([(1, 2), (3, 1)], 8) == [(1, 2)]  # a left id seen as a right one
    assert bpe.merge_batch([(1, 2), (3, 3), (4, 5)], 8) == [(1, 2), (3, 3)]  # (a, a) ends the batch
    assert bpe.merge_batch([(3, 3), (4, 5)], 8) == [(3, 3)]
    assert bpe.merge_batch([(3, 3)], 1) == [(3, 3)]


# ---------------------------------------------------------------- whole trainings equal rustbpe's

OVERLAPPING = {  # texts whose top pairs share tokens, or are (a, a)
    "runs of a": ["a" * length for length in range(1, 70)] + ["aaa " * 30],
    "runs beside other pairs": ["aaa bbb aaaa cdcd xyxy aaaaa bc bc bc de de " * 5, "qrqrqr " * 7 + "b" * 9],
    "abab": ["abababab " * 10, "ab aba abab ababa bababa ba", "xyxyxyxyxyxy"],
    "repeated cjk": ["人" * 200 + " " + "中文中文中文" * 10, "人人生而自由在尊严和权利上一律平等" * 20, "中中中中中"],
}


@pytest.mark.parametrize("name", list(OVERLAPPING))
def test_overlapping_top_pairs_equal_rustbpe_and_stop_early(name):
    docs = OVERLAPPING[name]
    sizes = assert_equals_rustbpe_at_every_limit(docs, 500)
    assert sum(sizes[1]) < 500 - 256, "the vocabulary should stop early: no pairs left"


def test_enwiki_equals_rustbpe_with_batches(corpus):
    sizes = assert_equals_rustbpe_at_every_limit(enwiki_docs(corpus, 20_000), 420)
    # batches happen, else the comparison proves nothing about them
    assert max(sizes[2]) == 2 and max(sizes[8]) > 4 and max(sizes[64]) > 8, sizes
    assert len(sizes[64]) <= len(sizes[8]) < len(sizes[2]) < len(sizes[1]) == 420 - 256


def test_udhr_non_latin_scripts_equal_rustbpe_with_batches(corpus):
    languages = ("Mandarin (Simplified)", "Japanese", "Korean", "Russian", "Arabic", "Hindi", "Greek")
    docs = []
    with open(corpus("udhr.jsonl"), encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            if any(language in text.split("\n", 1)[0] for language in languages):
                docs.append(text[:1000])
    assert len(docs) >= 6
    sizes = assert_equals_rustbpe_at_every_limit(docs, 400)
    assert max(sizes[8]) > 4 and max(sizes[64]) > 8, sizes


# ---------------------------------------------------------------- the rule broken on purpose: the test can fail

def shared_tokens_allowed(ranked_pairs, max_batch):
    """The top max_batch pairs, overlapping or not."""
    return ranked_pairs[:max_batch]


def pair_of_one_token_anywhere(ranked_pairs, max_batch):
    """The rule without "(a, a) only last"."""
    batch = []
    for left, right in ranked_pairs[:max_batch]:
        if any(left in pair or right in pair for pair in batch):
            break
        batch.append((left, right))
    return batch


@pytest.mark.parametrize("broken_rule, docs", [
    (shared_tokens_allowed, OVERLAPPING["abab"]),
    # (a, a) merged makes (aa, a) of "aaa", 30; sequentially it goes before (b, c), 20
    (pair_of_one_token_anywhere, ["aaa"] * 30 + ["bc"] * 20)])
def test_a_broken_rule_gives_other_merges_than_rustbpe(broken_rule, docs):
    merges, _ = train_in_batches(docs, 300, 8)
    broken, _ = train_in_batches(docs, 300, 8, rule=broken_rule)
    assert train_bpe_cpu.vocab_bytes(merges) == rustbpe_vocab(docs, 300)
    assert train_bpe_cpu.vocab_bytes(broken) != rustbpe_vocab(docs, 300)
