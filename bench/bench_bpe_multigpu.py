"""
Benchmark train_bpe_multigpu.py: time, host reads and peak memory per rank as the number of ranks grows, and
whether each result equals rustbpe trained on the documents that the ranks read. Prints a Markdown table for
bench/RESULTS.md.

    python bench/bench_bpe_multigpu.py                      # CPU + gloo at 1, 2, 4 ranks; enwiki, 2^11 chars, v 8192
    python bench/bench_bpe_multigpu.py --procs 1 2 -n 65536 -v 1000
    python bench/bench_bpe_multigpu.py --device cuda --procs 1 -n 1048576   # world size 1 (NCCL) vs train_bpe_gpu.py
    python bench/bench_bpe_multigpu.py --rerun --procs 1 -n 16777216 -v 260 --repeats 3   # what the cache saves

Each configuration runs --repeats times without the cache; the median is reported. --rerun instead times a
rerun that loads the counted chunks from the cache against one that counts them again (--no_cache), the two
alternating after a first run that fills the cache: the script's own reading phase and the whole command. The wall time includes
starting torchrun and importing torch. On the CPU the ranks share the machine's cores: with more ranks than
free cores they take turns, so the CPU rows show the protocol's overhead and the memory split, not a speedup.
On the CPU the merge loop's kernels run in Triton's interpreter (~10 ms a kernel): keep -n small there; the
count matrix, which is what the memory column measures, has the same size at any -n.
"""
import argparse
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rustbpe
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_multigpu as mg  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"), help="a .jsonl file")
parser.add_argument("-n", "--num_chars", type=int, default=2**11)
parser.add_argument("-v", "--vocab_size", type=int, default=8192)
parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
parser.add_argument("--repeats", type=int, default=1)
parser.add_argument("--device", default="cpu")
parser.add_argument("--rerun", action="store_true", help="a rerun with the cache against one without")
args = parser.parse_args()
if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit("error: --device cuda: no CUDA GPU here")

work = Path(tempfile.mkdtemp(prefix="bench_bpe_multigpu_"))
env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRITON_INTERPRET="1" if args.device == "cpu" else "0")


def documents_read(info):
    """The documents the ranks read, from tokenizer.json's record: each rank's first documents whose first
    byte lies in its range, the last one cut to its share."""
    starts, position = [], 0
    with open(args.corpus, "rb") as f:
        for line in f:
            if line.strip():
                starts.append((position, json.loads(line)["text"]))
            position += len(line)
    docs = []
    for part in info["read"]:
        mine = [text for first, text in starts if part["bytes"][0] <= first < part["bytes"][1]][:part["documents"]]
        left = part["chars"]
        for text in mine:
            docs.append(text[:left])
            left -= len(docs[-1])
    return docs


def rustbpe_file(docs):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), args.vocab_size, pattern=mg.pattern)
    vocab = [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]
    return "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(vocab)).encode()


def run(procs, name, cache=False):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
               str(REPO / "train_bpe_multigpu.py"), "--device", args.device, "--data", args.corpus, "-n",
               str(args.num_chars), "-v", str(args.vocab_size), "--out", str(work / name), "--cache_dir",
               str(work / f"cache{procs}"), *([] if cache else ["--no_cache"])]
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"train_bpe_multigpu.py failed on {procs} ranks:\n{result.stdout}\n{result.stderr[-3000:]}")
    out = result.stdout
    per_merge = re.search(r"per merge: ([\d.]+) collectives \(([\d,.]+) KiB\), ([\d.]+) host reads", out)
    return {"wall": wall, "merge": float(re.search(r"merging ([\d.]+)s", out).group(1)),
            "read": float(re.search(r"(?:reading \+ pre-tokenizing|loading the cache) ([\d.]+)s", out).group(1)),
            "total": float(re.search(r"\| total ([\d.]+)s", out).group(1)),
            "rate": re.search(r"\(([\d,]+) merges/s\)", out).group(1), "collectives": per_merge.group(1),
            "kib": per_merge.group(2), "reads": per_merge.group(3),
            "memory": re.findall(r"([\d,]+) MiB", out.split("per rank:")[-1].splitlines()[0]),
            "info": json.loads((work / name / "tokenizer.json").read_text()),
            "tiktoken": (work / name / "tokenizer.tiktoken").read_bytes()}


print(f"# {args.corpus}, -n {args.num_chars:,} -v {args.vocab_size}, {os.cpu_count()} CPU cores, device {args.device}")
if args.rerun:
    print("\n| ranks | rerun | reading s (median) | script total s | wall s | wall s of each run |")
    print("|---|---|---|---|---|---|")
    for procs in args.procs:
        run(procs, f"fill{procs}", cache=True)  # a first run fills the cache
        timed = {False: [], True: []}
        for r in range(args.repeats):
            for cache in (False, True):
                timed[cache].append(run(procs, f"rerun{procs}", cache=cache))
        for cache, label in ((False, "counts again (--no_cache)"), (True, "loads the cache")):
            runs = timed[cache]
            walls = " ".join(f"{r['wall']:.1f}" for r in runs)
            print(f"| {procs} | {label} | {statistics.median(r['read'] for r in runs):.2f} | "
                  f"{statistics.median(r['total'] for r in runs):.2f} | {statistics.median(r['wall'] for r in runs):.2f} "
                  f"| {walls} |", flush=True)
    sys.exit(0)
print("\n| ranks | wall s | merge s | merges/s | collectives / merge | KiB sent / merge | host reads / merge "
      "| peak memory per rank (MiB) | same as rustbpe on the documents read |")
print("|---|---|---|---|---|---|---|---|---|")
for procs in args.procs:
    runs = [run(procs, f"w{procs}_{r}") for r in range(args.repeats)]
    same = all(r["tiktoken"] == rustbpe_file(documents_read(r["info"])) for r in runs[:1])
    first = runs[0]
    print(f"| {procs} | {statistics.median(r['wall'] for r in runs):.1f} | {statistics.median(r['merge'] for r in runs):.1f} "
          f"| {first['rate']} | {first['collectives']} | {first['kib']} | {first['reads']} | {'/'.join(first['memory'])} "
          f"| {'yes' if same else 'NO'} |", flush=True)

if args.device == "cuda":  # issue 16's target: world size 1 within 20% of the one-GPU trainer
    command = [sys.executable, str(REPO / "train_bpe_gpu.py"), "--device", "cuda", "--data", args.corpus, "-n",
               str(args.num_chars), "-v", str(args.vocab_size), "--out", str(work / "gpu")]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    found = re.search(r"merging ([\d.]+)s", result.stdout)
    print(f"train_bpe_gpu.py merge s: {found.group(1) if found else 'not found: ' + result.stderr[-500:]}")
