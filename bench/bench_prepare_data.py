"""
Benchmark prepare_data.py end to end against raw tiktoken encode_ordinary_batch on every core, over the
same documents, in one run. Prints tokens/s, the ratio (target: 80% or more) and peak memory.

    python bench/bench_prepare_data.py                       # all of enwiki.jsonl (~56 M characters)
    python bench/bench_prepare_data.py -n 8000000 --repeats 5

The tokenizer is a BPE trained here with rustbpe on the first documents (gpt2 would need a download).
Routes, each over the same documents:
- raw: encode_ordinary_batch(docs, num_threads=cores) on documents already in memory. It does no reading,
  no writing and keeps Python lists of ints; the speed of tokenizing alone, the reference.
- threads + encode_to_numpy: what prepare_data.py does inside, without reading or writing.
- process pool: batches of documents pickled to one process per core, encode_ordinary there, numpy back.
- prepare_data.py: the script in a subprocess, from reading the .jsonl to the last shard and meta.json,
  interpreter start-up included. Its peak RSS is the kernel's high-water mark (VmHWM) of that process.
Besides wall time it prints CPU seconds (all threads and child processes): on a machine shared with
other jobs, tokens per CPU second is the steadier figure of the two.
"""
import argparse
import base64
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import rustbpe
import tiktoken

REPO = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"))
parser.add_argument("-n", "--num_chars", type=int, default=None, help="only the first N characters (default all)")
parser.add_argument("-v", "--vocab_size", type=int, default=8192)
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
cores = os.cpu_count()

# --- the documents: the same ones prepare_data.py reads (first N characters, the last document cut)
documents, remaining = [], args.num_chars or sys.maxsize
with open(args.corpus, encoding="utf-8") as f:
    for line in f:
        if remaining <= 0:
            break
        text = json.loads(line)["text"][:remaining]
        remaining -= len(text)
        documents.append(text)
documents = [doc for doc in documents if doc]  # prepare_data.py skips empty documents
num_chars = sum(map(len, documents))

# --- a tokenizer directory, as train_bpe_cpu.py writes it
work = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
t = time.time()
trainer = rustbpe.Tokenizer()
trainer.train_from_iterator(documents[:3000], args.vocab_size)
ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
tok_dir = work / "tokenizer"
tok_dir.mkdir()
with open(tok_dir / "tokenizer.tiktoken", "w") as f:
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        f.write(f"{base64.b64encode(token).decode()} {rank}\n")
(tok_dir / "tokenizer.json").write_text(json.dumps({
    "pattern": trainer.get_pattern(), "special_tokens": {"<|endoftext|>": len(ranks)}, "vocab_size": len(ranks) + 1,
    "num_merges": len(ranks) - 256, "source": args.corpus, "trainer": "rustbpe"}))
encoder = tiktoken.Encoding(name="bench", pat_str=trainer.get_pattern(), mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
print(f"{len(documents):,} documents, {num_chars:,} characters; rustbpe vocab {args.vocab_size} in {time.time() - t:.1f}s; "
      f"{cores} cores")


def raw():
    return sum(map(len, encoder.encode_ordinary_batch(documents, num_threads=cores)))


def batches(size=1 << 20):
    batch, chars = [], 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if chars >= size:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_numpy(batch):
    return [encoder.encode_to_numpy(doc, disallowed_special=()).astype(np.uint16) for doc in batch]


def encode_lists(batch):  # in a worker process: encoder comes with the fork
    return [np.array(encoder.encode_ordinary(doc), dtype=np.uint16) for doc in batch]


def threads_numpy():
    with ThreadPoolExecutor(cores) as pool:
        return sum(len(a) for arrays in pool.map(encode_numpy, batches()) for a in arrays)


def process_pool():
    with ProcessPoolExecutor(cores, mp_context=get_context("fork")) as pool:
        return sum(len(a) for arrays in pool.map(encode_lists, batches()) for a in arrays)


def prepare():
    out_dir = work / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    command = [sys.executable, str(REPO / "prepare_data.py"), "--tokenizer", str(tok_dir), "--data", args.corpus,
               "--out", str(out_dir)] + (["-n", str(args.num_chars)] if args.num_chars else [])
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Peak memory: the kernel's high-water mark of the process's own memory (VmHWM), read until it exits.
    # Not ru_maxrss from wait4: that also counts the pages of this big benchmark process that the child
    # shares between fork and exec.
    peak_kib = 0
    while process.poll() is None:
        try:
            status = Path(f"/proc/{process.pid}/status").read_text()
            peak_kib = max(peak_kib, int(status.split("VmHWM:")[1].split()[0]))
        except (OSError, IndexError):
            pass
        time.sleep(0.02)
    assert process.returncode == 0, " ".join(command)
    meta = json.loads((out_dir / "meta.json").read_text())
    prepare.peak_rss.append(peak_kib / 1024)
    return meta["tokens"]["train"] + meta["tokens"]["val"] - len(documents)  # minus one EOT per document


prepare.peak_rss = []
routes = {"raw encode_ordinary_batch": raw, "threads + encode_to_numpy": threads_numpy,
          "process pool": process_pool, "prepare_data.py end to end": prepare}
seconds = {name: [] for name in routes}
cpu_seconds = {name: [] for name in routes}
tokens = {}


def cpu_time():
    """CPU seconds of this process (all threads) plus its finished children (pool workers, the script)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


for repeat in range(args.repeats):  # interleaved, so that drift in the machine's load hits every route
    for name, route in routes.items():
        t, c = time.perf_counter(), cpu_time()
        tokens[name] = route()
        seconds[name].append(time.perf_counter() - t)
        cpu_seconds[name].append(cpu_time() - c)
assert len(set(tokens.values())) == 1, f"the routes disagree on the number of tokens: {tokens}"
num_tokens = tokens["raw encode_ordinary_batch"]

reference = num_tokens / statistics.median(seconds["raw encode_ordinary_batch"])
print(f"\n{num_tokens:,} tokens (+{len(documents):,} EOT), vocab {args.vocab_size}, median of {args.repeats}\n")
# On a shared machine wall time depends on what else runs; CPU seconds per token much less so.
reference_cpu = num_tokens / statistics.median(cpu_seconds["raw encode_ordinary_batch"])
print("| route | median s | tokens/s | vs raw | median CPU s | tokens per CPU s | vs raw |")
print("|---|---|---|---|---|---|---|")
for name in routes:
    median, median_cpu = statistics.median(seconds[name]), statistics.median(cpu_seconds[name])
    print(f"| {name} | {median:.2f} | {num_tokens / median:,.0f} | {num_tokens / median / reference:.0%} "
          f"| {median_cpu:.2f} | {num_tokens / median_cpu:,.0f} | {num_tokens / median_cpu / reference_cpu:.0%} |")
print(f"\nprepare_data.py peak RSS: {max(prepare.peak_rss):.0f} MiB (runs: {', '.join(f'{r:.0f}' for r in prepare.peak_rss)})")
shutil.rmtree(work, ignore_errors=True)
