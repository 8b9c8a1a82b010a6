"""
Benchmark train_bpe_multigpu.py: how time and per-rank memory change with the number of ranks, next to
train_bpe_cpu.py and rustbpe on the same documents, in one run. Prints a Markdown table for bench/RESULTS.md.

    python bench/bench_bpe_multigpu.py                      # CPU + gloo at 1, 2, 4 ranks; enwiki, 2^22 chars, v 2048
    python bench/bench_bpe_multigpu.py --procs 1 2 -n 1048576 -v 1000
    python bench/bench_bpe_multigpu.py --gpu                # on a GPU machine: world size 1 with NCCL vs train_bpe_gpu.py

Each configuration runs --repeats times and the median is reported. Two timings per run: "count" is a run
without the cache (reading + pre-tokenizing + merging), "cached" a rerun that loads the counted chunks from
the cache. "merge" is the merge loop alone, and "exchange" the part of it spent in the one or two all_gathers per
merge, waiting for the slowest rank included. The wall time includes starting torchrun and importing torch.
On the CPU the ranks share the machine's cores: with more ranks than cores they take turns, so the CPU rows
show the overhead of the protocol, not a speedup.
"""
import argparse
import base64
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
import train_bpe_cpu as cpu_bpe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"))
parser.add_argument("-n", "--num_chars", type=int, default=2**22)
parser.add_argument("-v", "--vocab_size", type=int, default=2048)
parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--gpu", action="store_true", help="also compare world size 1 (NCCL) with train_bpe_gpu.py")
args = parser.parse_args()

work = Path(tempfile.mkdtemp(prefix="bench_bpe_multigpu_"))
env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
common = ["--data", args.corpus, "-n", str(args.num_chars), "-v", str(args.vocab_size)]


def seconds_in(pattern, text):
    found = re.search(pattern, text)
    return float(found.group(1)) if found else float("nan")


def run_multigpu(procs, device, name, use_cache):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
               str(REPO / "train_bpe_multigpu.py"), "--device", device, *common, "--out", str(work / name),
               "--cache_dir", str(work / f"cache_{device}")]
    if not use_cache:
        command.append("--no_cache")
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"train_bpe_multigpu.py failed on {procs} ranks:\n{result.stdout}\n{result.stderr[-3000:]}")
    out = result.stdout
    exchange = re.search(r"slowest rank included\): ([\d., ]+)", out).group(1)
    return {
        "wall": wall,
        "total": seconds_in(r"total ([\d.]+)s", out),
        "merge": seconds_in(r"merging ([\d.]+)s", out),
        "exchange": max(float(s) for s in exchange.split(",")),
        "memory": [float(m.replace(",", "")) for m in re.findall(r"([\d,]+) MiB", out.split("per rank:")[-1])],
        "kib_per_merge": seconds_in(r"communication: ([\d.]+) KiB", out),
        "distinct": re.search(r"([\d,]+) distinct per rank summed", out).group(1),
        "tiktoken": (work / name / "tokenizer.tiktoken").read_bytes(),
    }


def median_of(runs, key):
    return statistics.median(run[key] for run in runs)


print(f"# {args.corpus}, -n {args.num_chars:,} -v {args.vocab_size}, {os.cpu_count()} CPU cores, torch {torch.__version__}")

# --- the references, on the same documents
docs = list(cpu_bpe.first_chars(lambda budget: cpu_bpe.read_jsonl(args.corpus), args.num_chars))
start = time.perf_counter()
tokenizer = rustbpe.Tokenizer()
tokenizer.train_from_iterator(iter(docs), args.vocab_size, pattern=cpu_bpe.pattern)
rustbpe_seconds = time.perf_counter() - start
rust_vocab = [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]
rust_file = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(rust_vocab)).encode()
start = time.perf_counter()
cpu_run = subprocess.run([sys.executable, str(REPO / "train_bpe_cpu.py"), *common, "--out", str(work / "cpu")],
                         env=env, capture_output=True, text=True)
cpu_wall = time.perf_counter() - start
cpu_same = (work / "cpu" / "tokenizer.tiktoken").read_bytes() == rust_file

cpu_total, cpu_merge = seconds_in(r"total ([\d.]+)s", cpu_run.stdout), seconds_in(r"merging ([\d.]+)s", cpu_run.stdout)
rows = [f"| rustbpe (in process, all cores) | 1 | {rustbpe_seconds:.2f} | | | | | | | reference |",
        f"| train_bpe_cpu.py | 1 | {cpu_wall:.2f} | {cpu_total:.2f} | | {cpu_merge:.2f} | | | | {'yes' if cpu_same else 'NO'} |"]

# --- the multi-rank trainer on the CPU with gloo
for procs in args.procs:
    counted = [run_multigpu(procs, "cpu", f"cpu{procs}_count{r}", use_cache=False) for r in range(args.repeats)]
    cached = [run_multigpu(procs, "cpu", f"cpu{procs}_cached{r}", use_cache=True) for r in range(args.repeats)]
    same = all(run["tiktoken"] == rust_file for run in counted + cached)
    memory = "/".join(f"{m:.0f}" for m in counted[0]["memory"])
    rows.append(f"| train_bpe_multigpu.py gloo | {procs} | {median_of(counted, 'wall'):.2f} | {median_of(counted, 'total'):.2f} "
                f"| {median_of(cached, 'total'):.2f} | {median_of(counted, 'merge'):.2f} | {median_of(counted, 'exchange'):.2f} "
                f"| {counted[0]['kib_per_merge']:.1f} | {memory} | {'yes' if same else 'NO'} |")
    print(f"done: {procs} rank(s), distinct chunks summed over ranks {counted[0]['distinct']}", file=sys.stderr)

# --- one GPU: the distributed version at world size 1 (NCCL) against the single-GPU trainer
if args.gpu and torch.cuda.is_available():
    gpu_runs = [run_multigpu(1, "cuda", f"cuda1_{r}", use_cache=True) for r in range(args.repeats)]
    single = []
    for r in range(args.repeats):
        result = subprocess.run([sys.executable, str(REPO / "train_bpe_gpu.py"), *common, "--device", "cuda",
                                 "--out", str(work / f"gpu_{r}")], env=env, capture_output=True, text=True)
        single.append(seconds_in(r"merging ([\d.]+)s", result.stdout))
    rows.append(f"| train_bpe_multigpu.py NCCL | 1 | {median_of(gpu_runs, 'wall'):.2f} | {median_of(gpu_runs, 'total'):.2f} | | "
                f"{median_of(gpu_runs, 'merge'):.2f} | {median_of(gpu_runs, 'exchange'):.2f} | | "
                f"{gpu_runs[0]['memory'][0]:.0f} | {'yes' if gpu_runs[0]['tiktoken'] == rust_file else 'NO'} |")
    rows.append(f"| train_bpe_gpu.py | 1 | | | | {statistics.median(single):.2f} | | | | |")
    print(f"NCCL world size 1 merge loop / train_bpe_gpu.py merge loop: "
          f"{median_of(gpu_runs, 'merge') / statistics.median(single):.2f}x")
else:
    print("(world size 1 with NCCL against train_bpe_gpu.py: still to come, run with --gpu on a GPU machine)")

print("\n| trainer | ranks | wall s | total s (count) | total s (cached) | merge s | exchange s | KiB/merge in | peak RSS MiB per rank | same as rustbpe |")
print("|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
