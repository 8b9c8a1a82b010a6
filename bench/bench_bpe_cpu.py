"""
Benchmark train_bpe_cpu.py against rustbpe, HF tokenizers' BpeTrainer and a naive minbpe-style loop,
on the same documents in one run. Prints a Markdown table for bench/RESULTS.md.

    python bench/bench_bpe_cpu.py                         # enwiki: 2^20 chars / 1000, then 2^24 / 8192; CJK
    python bench/bench_bpe_cpu.py --quick                 # 2^20 / 1000 only
    python bench/bench_bpe_cpu.py --corpus path/to/file.jsonl

"Same" means the same tokens in the same order as rustbpe (byte-identical tokenizer files). HF tokenizers
learns the same set of tokens but breaks ties between equally frequent pairs its own way, so its order
differs: it is timed, not expected to match.
The naive loop recounts every pair of every chunk after every merge, as minbpe does; it runs for
--naive_seconds and its full time is projected from its merges/s.
"""
import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import regex
import rustbpe

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu as bpe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"))
parser.add_argument("--udhr", default=str(REPO.parent / "shared" / "corpora" / "udhr.jsonl"))
parser.add_argument("--quick", action="store_true")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--naive_seconds", type=float, default=20.0)
args = parser.parse_args()


def load_docs(path, num_chars):
    reader = bpe.read_jsonl if path.endswith(".jsonl") else (lambda p: bpe.read_txt(p, num_chars))
    return list(bpe.first_chars(lambda budget: reader(path), num_chars))


def ours(docs, vocab_size):
    chunk_counts, _ = bpe.count_chunks(iter(docs), regex.compile(bpe.pattern), sum(map(len, docs)))
    merges, _ = bpe.train(chunk_counts, vocab_size)
    return bpe.vocab_bytes(merges)


def with_rustbpe(docs, vocab_size):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=bpe.pattern)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def with_hf_tokenizers(docs, vocab_size):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    # The same split pattern, then HF's byte-level alphabet (bytes shown as printable characters).
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(bpe.pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=0)
    tokenizer.train_from_iterator(docs, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    byte_of = {char: byte for byte, char in enumerate(byte_level_chars())}
    to_bytes = lambda piece: bytes(byte_of[c] for c in piece)
    vocab = [bytes([i]) for i in range(256)]
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        vocab.append(to_bytes(left) + to_bytes(right))
    return vocab


def byte_level_chars():
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (HF's ByteLevel alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def naive(docs, vocab_size, seconds):
    """minbpe's loop: no deduplication, and a full recount of every pair after every merge."""
    start = time.time()
    chunks = [list(chunk.encode("utf-8")) for doc in docs for chunk in regex.findall(bpe.pattern, doc)]
    vocab = [bytes([i]) for i in range(256)]
    while len(vocab) < vocab_size and time.time() - start < seconds:
        pair_counts = Counter()
        for ids in chunks:
            pair_counts.update(zip(ids, ids[1:]))
        if not pair_counts:
            break
        pair = max(pair_counts, key=lambda p: (pair_counts[p], -p[0], -p[1]))  # our tie-break
        new_id = len(vocab)
        vocab.append(vocab[pair[0]] + vocab[pair[1]])
        for k, ids in enumerate(chunks):
            merged, i = [], 0
            while i < len(ids):
                if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
                    merged.append(new_id)
                    i += 2
                else:
                    merged.append(ids[i])
                    i += 1
            chunks[k] = merged
    return vocab, time.time() - start


def timed(fn, docs, vocab_size, repeats):
    times, vocab = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        vocab = fn(docs, vocab_size)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), vocab


def cjk_docs(num_chars):
    """Real Chinese and Japanese letters from the UDHR, with punctuation and spaces removed, so that chunks
    run 50-800 characters: the case that makes a rescan-the-whole-chunk merge slow."""
    with open(args.udhr, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    cjk = [d for d in docs if sum("\u4e00" <= c <= "\u9fff" or "\u3040" <= c <= "\u30ff" for c in d) > 0.3 * len(d)]
    letters = "".join(c for d in cjk for c in d if regex.match(r"\p{L}", c))
    rng, pieces, total = random.Random(0), [], 0
    while total < num_chars:
        start = rng.randrange(len(letters) - 1000)
        pieces.append(letters[start:start + rng.randrange(50, 800)])
        total += len(pieces[-1])
    return [" ".join(pieces[i:i + 50]) for i in range(0, len(pieces), 50)]


def bench(name, docs, vocab_size, repeats, run_naive):
    num_chars = sum(map(len, docs))
    rust_time, reference = timed(with_rustbpe, docs, vocab_size, repeats)
    rows = [("rustbpe", rust_time, reference)]
    rows.append(("train_bpe_cpu.py",) + timed(ours, docs, vocab_size, repeats))
    rows.append(("HF tokenizers BpeTrainer",) + timed(with_hf_tokenizers, docs, vocab_size, repeats))
    for trainer, seconds, vocab in rows:
        merges = len(vocab) - 256
        print(f"| {name} | {num_chars:,} | {vocab_size} | {trainer} | {seconds:.2f} s | {merges / seconds:,.0f} "
              f"| {seconds / rust_time:.1f}x | {'yes' if vocab == reference else 'no'} |", flush=True)
    if run_naive:
        vocab, seconds = naive(docs, vocab_size, args.naive_seconds)
        merges = len(vocab) - 256
        projected = seconds * (vocab_size - 256) / max(merges, 1)
        same = vocab == reference[:len(vocab)]
        print(f"| {name} | {num_chars:,} | {vocab_size} | naive full recount (minbpe-style) | {projected:,.0f} s projected "
              f"({merges} merges in {seconds:.0f} s) | {merges / seconds:,.1f} | {projected / rust_time:,.0f}x "
              f"| {'yes (prefix)' if same else 'no'} |", flush=True)


def peak_memory(num_chars):
    """Peak RSS of the real command line, in its own process, with its reading streamed from the file.
    VmHWM, not ru_maxrss: on Linux a child's ru_maxrss starts from its parent's, this script's docs included."""
    code = ("import re, runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__'); "
            "print('maxrss', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1), file=sys.stderr)")
    out = f"/tmp/bench_bpe_cpu_{num_chars}"
    result = subprocess.run([sys.executable, "-c", code, str(REPO / "train_bpe_cpu.py"), "--data", args.corpus,
                             "-n", str(num_chars), "-v", "1000", "--out", out], capture_output=True, text=True)
    rss_mb = int(result.stderr.split("maxrss")[-1]) / 1024
    chunks_line = next(line for line in result.stdout.splitlines() if line.startswith("read "))
    return rss_mb, chunks_line


print("| corpus | chars | vocab | trainer | time (median) | merges/s | vs rustbpe | same as rustbpe |")
print("|---|---|---|---|---|---|---|---|")
corpus_name = Path(args.corpus).stem
bench(corpus_name, load_docs(args.corpus, 2**20), 1000, args.repeats, run_naive=True)
if not args.quick:
    bench(corpus_name, load_docs(args.corpus, 2**24), 8192, 1, run_naive=False)
    bench("udhr CJK, unspaced", cjk_docs(2**20), 4000, args.repeats, run_naive=False)
    print("\n| -n | peak RSS of train_bpe_cpu.py | chunks |")
    print("|---|---|---|")
    for num_chars in (2**20, 2**22, 2**24):
        rss_mb, chunks_line = peak_memory(num_chars)
        print(f"| {num_chars:,} | {rss_mb:,.0f} MB | {chunks_line} |", flush=True)
