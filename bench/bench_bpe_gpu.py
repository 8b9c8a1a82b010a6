"""
train_bpe_gpu.py against rustbpe (and train_bpe_cpu.py at small sizes) on the same documents, in one run.

    python bench/bench_bpe_gpu.py                                    # -n 1048576 -v 1000, default device
    python bench/bench_bpe_gpu.py --device cpu --repeats 1           # no GPU: the kernels in Triton's interpreter
    python bench/bench_bpe_gpu.py -n 134217728 -v 65534 --repeats 1  # the big target (on a GPU machine)
    python bench/bench_bpe_gpu.py --pack .corpora/enwiki_64M.jsonl.xz -n 67108864   # a small copy to carry to a GPU box
    python bench/bench_bpe_gpu.py --host_side -n 33554432    # the host side per format (.jsonl, .txt, .parquet)

--data takes a .jsonl file, optionally compressed (.jsonl.gz or .jsonl.xz: enwiki's first 2^26 characters
shrink about 4x under xz, small enough to copy to a GPU machine). The first n characters are cut exactly as
the trainers' -n does and written to one temporary .jsonl, which both of our scripts read through their
command line, so their times are end to end (interpreter start, reading, pre-tokenizing, merging, writing).
rustbpe gets the same documents from memory, so its time leaves out reading the file: a small edge for it.
Every run's merges are compared with rustbpe's, byte for byte. We print medians over --repeats.
--count_reads also runs the merge loop once in this process with every host read and kernel counted (the tests' counters),
and --profile once under torch.profiler: each kernel's device time a merge made and a round, and the rest (gaps, host
reads), then once more reading "done?" after every round to count the rounds (steps) and merges per round.
--max_batch goes to train_bpe_gpu.py (1: one merge a round, the sequential path).
"""

import argparse
import base64
import gzip
import json
import lzma
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from train_bpe_gpu import pattern as GPT4_PATTERN  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", default=str(REPO.parent / "shared" / "corpora" / "enwiki.jsonl"))
parser.add_argument("-n", "--num_chars", type=int, default=1048576)
parser.add_argument("-v", "--vocab_size", type=int, default=1000)
parser.add_argument("--device", default=None, help="passed to train_bpe_gpu.py (default: its own default)")
parser.add_argument("--max_batch", type=int, default=None, help="passed to train_bpe_gpu.py (default: its own)")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--cpu_trainer", choices=["auto", "yes", "no"], default="auto",
                    help="also run train_bpe_cpu.py (auto: when n <= 2^24)")
parser.add_argument("--count_reads", action="store_true", help="count host reads per merge (one more merge loop)")
parser.add_argument("--profile", action="store_true",
                    help="each kernel's device time a merge, from torch.profiler (one more merge loop)")
parser.add_argument("--pack", default=None, help="write the first n characters to this .jsonl.xz / .jsonl.gz and exit")
parser.add_argument("--host_side", action="store_true",
                    help="time what a GPU run pays before its merge loop, per format, against rustbpe's whole run")
args = parser.parse_args()
if args.max_batch is not None and args.max_batch < 1:
    sys.exit(f"error: --max_batch {args.max_batch}: must be 1 (a merge a round) or more")
if args.pack and not args.pack.endswith((".jsonl.xz", ".jsonl.gz")):
    sys.exit(f"error: --pack {args.pack}: name it .jsonl.xz or .jsonl.gz (the compression follows the name)")


def open_text(path):
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def first_documents(path, num_chars):
    """The first num_chars characters of a .jsonl stream, the last document cut: the trainers' -n."""
    docs, remaining = [], num_chars
    with open_text(path) as f:
        for line in f:
            if remaining <= 0:
                break
            if line.strip():
                text = json.loads(line)["text"][:remaining]
                docs.append(text)
                remaining -= len(text)
    return docs


docs = first_documents(args.data, args.num_chars)
num_chars = sum(map(len, docs))
if num_chars < args.num_chars:
    print(f"note: {args.data} holds only {num_chars:,} characters (asked for {args.num_chars:,}); using them all")
if args.pack:
    opener = lzma.open if args.pack.endswith(".xz") else gzip.open
    os.makedirs(os.path.dirname(args.pack) or ".", exist_ok=True)  # .corpora/ is git-ignored: carry it to a GPU
    with opener(args.pack, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    print(f"wrote {num_chars:,} characters in {len(docs):,} documents to {args.pack} ({os.path.getsize(args.pack) / 2**20:.1f} MiB)")
    sys.exit(0)


def host_side():
    """Our host side (the printed "reading + pre-tokenizing" plus "layout": what a GPU run pays before its merge loop,
    here at -v 256, no merge) against rustbpe's whole run at -v 257 on the same documents from memory, per format:
    .jsonl, .parquet (row groups of 1,024 rows) and .txt (the documents joined by newlines: one document)."""
    import pyarrow
    import pyarrow.parquet
    import rustbpe

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = re.search(r"Model name:\s*(.+)", lscpu)
    print(f"{num_chars:,} characters; {cpu.group(1).strip() if cpu else 'CPU model unknown'}, "
          f"{len(os.sched_getaffinity(0))} cores for both")
    with tempfile.TemporaryDirectory() as scratch:
        paths = {suffix: os.path.join(scratch, "docs" + suffix) for suffix in (".jsonl", ".txt", ".parquet")}
        with open(paths[".jsonl"], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs)
        with open(paths[".txt"], "w", encoding="utf-8", newline="") as f:
            f.write("\n".join(docs))
        pyarrow.parquet.write_table(pyarrow.table({"text": docs}), paths[".parquet"], row_group_size=1024)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET="1")
        print("| format | ours: reading + pre-tokenizing + layout, median s | rustbpe, median s | ratio |")
        print("|---|---|---|---|")
        for suffix, path in paths.items():
            documents = ["\n".join(docs)[:num_chars]] if suffix == ".txt" else docs  # what -n lets us read
            ours, theirs = [], []
            for repeat in range(args.repeats):
                command = [sys.executable, str(REPO / "train_bpe_gpu.py"), "--data", path, "-n", str(num_chars),
                           "-v", "256", "--device", "cpu", "--out", os.path.join(scratch, f"out{repeat}{suffix}")]
                result = subprocess.run(command, capture_output=True, text=True, env=env)
                phases = re.search(r"reading \+ pre-tokenizing ([\d.]+)s \| layout ([\d.]+)s", result.stdout)
                if phases is None:
                    sys.exit(f"train_bpe_gpu.py failed on {suffix}:\n{result.stderr[-2000:]}")
                ours.append(float(phases.group(1)) + float(phases.group(2)))
                start = time.perf_counter()
                rustbpe.Tokenizer().train_from_iterator(iter(documents), 257, pattern=GPT4_PATTERN)
                theirs.append(time.perf_counter() - start)
            ratio = statistics.median(ours) / statistics.median(theirs)
            print(f"| {suffix} | {statistics.median(ours):.2f} | {statistics.median(theirs):.2f} | {ratio:.2f}x |")


if args.host_side:
    host_side()
    sys.exit(0)
print(f"{num_chars:,} characters in {len(docs):,} documents of {args.data}; -v {args.vocab_size}, {args.repeats} repeats, "
      f"{os.cpu_count()} CPU cores")


def rustbpe_vocab():
    import rustbpe

    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), args.vocab_size, pattern=GPT4_PATTERN)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def run_script(script, corpus, out_dir, extra):
    command = [sys.executable, str(REPO / script), "--data", corpus, "-n", str(num_chars), "-v", str(args.vocab_size),
               "--out", out_dir, *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if result.returncode != 0:
        sys.exit(f"{script} failed:\n{result.stderr[-2000:]}")
    with open(Path(out_dir) / "tokenizer.tiktoken", "rb") as f:
        vocab = [base64.b64decode(line.split()[0]) for line in f if line.strip()]
    return vocab, result.stdout


rows = {}  # name -> list of (seconds, merges per second or None, note, seconds by the script's own clock or None)
reference = None
with tempfile.TemporaryDirectory() as scratch:
    corpus = os.path.join(scratch, "docs.jsonl")
    with open(corpus, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    run_cpu_trainer = args.cpu_trainer == "yes" or (args.cpu_trainer == "auto" and num_chars <= 2**24)
    for repeat in range(args.repeats):
        start = time.perf_counter()
        reference = rustbpe_vocab()
        rust_seconds = time.perf_counter() - start
        rows.setdefault("rustbpe", []).append((rust_seconds, None, "oracle", rust_seconds))

        start = time.perf_counter()
        vocab, stdout = run_script("train_bpe_gpu.py", corpus, os.path.join(scratch, "gpu"),
                                   (["--device", args.device] if args.device else [])
                                   + (["--max_batch", str(args.max_batch)] if args.max_batch else []))
        seconds = time.perf_counter() - start
        merges_per_second = float(re.search(r"\(([\d,]+) merges/s\)", stdout).group(1).replace(",", ""))
        phases = re.search(r"reading \+ pre-tokenizing.*", stdout).group(0)
        memory = re.search(r"peak memory: (.*)", stdout).group(1)
        peak_memory = memory
        positions = re.search(r"([\d,]+) token positions", stdout).group(1)
        same = "same merges" if vocab == reference else "DIFFERENT MERGES"
        own_total = float(re.search(r"\| total ([\d.]+)s", stdout).group(1))
        rows.setdefault("train_bpe_gpu.py", []).append((seconds, merges_per_second, same, own_total))
        print(f"  repeat {repeat + 1}: train_bpe_gpu.py {phases}; {positions} token positions; peak memory {memory}; {same}")

        if run_cpu_trainer:
            start = time.perf_counter()
            vocab, stdout = run_script("train_bpe_cpu.py", corpus, os.path.join(scratch, "cpu"), [])
            seconds = time.perf_counter() - start
            merges_per_second = float(re.search(r"\(([\d,]+) merges/s\)", stdout).group(1).replace(",", ""))
            same = "same merges" if vocab == reference else "DIFFERENT MERGES"
            own_total = float(re.search(r"\| total ([\d.]+)s", stdout).group(1))
            rows.setdefault("train_bpe_cpu.py", []).append((seconds, merges_per_second, same, own_total))

# "process" is the wall time of the whole command (interpreter start and `import torch` included); "script" is
# the script's own total, from reading the first document to the last merge.
rust_seconds = statistics.median(run[0] for run in rows["rustbpe"])
print("\n| trainer | median seconds, process | median seconds, script | merges/s (merge loop) | / rustbpe (process) | / rustbpe (script) | merges |")
print("|---|---|---|---|---|---|---|")
for name, runs in rows.items():
    seconds = statistics.median(run[0] for run in runs)
    own = statistics.median(run[3] for run in runs)
    rates = [run[1] for run in runs if run[1] is not None]
    rate = f"{statistics.median(rates):,.0f}" if rates else "-"
    notes = sorted({run[2] for run in runs})
    print(f"| {name} | {seconds:.2f} | {own:.2f} | {rate} | {seconds / rust_seconds:.2f}x | {own / rust_seconds:.2f}x | {', '.join(notes)} |")
print(f"\ntrain_bpe_gpu.py peak memory: {peak_memory}")
if args.count_reads or args.profile:  # in this process, after the timed runs
    import train_bpe_gpu as bpe

    workers = len(os.sched_getaffinity(0))  # the script's own pre-tokenizer, on every core
    chunk_counts, _ = bpe.count_chunks(iter(docs), num_chars, GPT4_PATTERN, workers, None)
    arrays = bpe.chunks_to_arrays(chunk_counts, args.vocab_size)
    device = args.device or ("cuda" if bpe.torch.cuda.is_available() else "cpu")
    max_batch = args.max_batch or bpe.max_batch

    def merge_loop():  # on the CPU the kernels work in the arrays themselves (no upload copies them): a copy a run
        fresh = {name: value.copy() if hasattr(value, "copy") else value for name, value in arrays.items()}
        return bpe.merge_on_device(fresh, args.vocab_size, device, max_batch)

    def count_rounds():
        """One more merge loop, a group of one round between reads: the rounds that merged (a round past the last
        merge does nothing)."""
        made, merges_done, rounds_per_read = [], bpe.merges_done, bpe.ROUNDS_PER_READ
        bpe.merges_done = lambda *copy: made.append(merges_done(*copy)) or made[-1]
        bpe.ROUNDS_PER_READ = 1
        try:
            merge_loop()
        finally:
            bpe.merges_done, bpe.ROUNDS_PER_READ = merges_done, rounds_per_read
        return sum(after > before for (_, before), (_, after) in zip([(False, 0)] + made, made))
if args.profile:
    # The kernels' own device time (CUPTI traces kernels inside graph replays too), a merge: what the cost
    # model in RESULTS estimates per kernel. The loop's wall time a merge less their sum is the gaps between
    # kernels and the host's reads. The setup's launches (DONE set: they return at once) and the last group's
    # surplus ones count too: a small overestimate.
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * device.startswith("cuda")
    with profile(activities=activities) as profiler:
        merges, _, seconds = merge_loop()
    kernels = {event.key: event for event in profiler.key_averages()
               if event.key in ("choose_batch", "find_occurrences", "apply_merges", "refresh_rows")}
    loop_us = seconds["loop"] / len(merges) * 1e6
    rounds = count_rounds()
    print(f"\nprofiled merge loop: {len(merges)} merges in {rounds} rounds (steps), {len(merges) / rounds:.2f} merges "
          f"a round at --max_batch {max_batch}; {loop_us:.1f} us a merge (wall, under the profiler)")
    for kernel, event in kernels.items():  # every merge is made by the four kernels: divided by the merges made
        print(f"  {kernel}: {event.device_time_total / len(merges):.1f} us a merge made on the device, "
              f"{event.device_time_total / rounds:.1f} us a round, {event.count} launches")
    if kernels:
        device_us = sum(event.device_time_total for event in kernels.values()) / len(merges)
        print(f"  the kernels: {device_us:.1f} us a merge; gaps and host reads: {loop_us - device_us:.1f} us")
    else:
        print("  no kernel events: on the CPU the kernels are Python (the interpreter), not device kernels")
if args.count_reads:  # the counting modes slow every tensor operation
    sys.path.insert(0, str(REPO / "tests"))
    import pytest
    from test_train_bpe_gpu import CountHostReads, CountLaunches

    with pytest.MonkeyPatch.context() as patch:
        launches = CountLaunches(patch)
        with CountHostReads() as reads:
            merges, _, _ = merge_loop()
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(reads.counts.items()))
    print(f"host reads in the merge loop: {max(reads.counts.values()) / len(merges):.3f} per merge, the largest kind "
          f"({kinds}) over {len(merges)} merges")
    print(f"kernels in the merge loop: {launches.loop_kernels() / len(merges):.2f} per merge (4 a round, whole "
          f"groups of {bpe.ROUNDS_PER_READ} rounds, the spare one after the last read included, {launches.replays} "
          "graph replays); block barriers: 2 in "
          "choose_batch, and one a pick")
if any("DIFFERENT" in run[2] for runs in rows.values() for run in runs):
    sys.exit("some trainer's merges differ from rustbpe's")
