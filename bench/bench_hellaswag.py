"""
HellaSwag scoring as train.py's eval runs it, timed: one example (4 rows) a forward against hellaswag_batch
examples a forward, on the same machine in the same run, the paths taking turns (a shared machine's load falls on
both). Examples/s are medians; the counts of every path must be equal (the scores' argmins do not depend on how
the rows are batched). The data is random ids with HellaSwag-like lengths (a forward's cost depends on the
lengths, not on the ids), the weights fresh.

    python bench/bench_hellaswag.py config/quickstart.py --vocab_size=1024 --batches 1,8,32    # CPU
    python bench/bench_hellaswag.py config/gpt2_124m.py --device cuda --examples 2000 --batches 1,32,64

Lengths: a context of 20-100 tokens and 4 endings of 10-40 tokens each, drawn uniformly: an assumption, not
HellaSwag's measured lengths (its contexts are a sentence or two, its endings one). On CUDA each line ends with the
time one eval of HellaSwag's 10,042 examples would take at that rate.
"""
import argparse
import random
import statistics
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("config", help="a preset of config/, read for its model's shape")
parser.add_argument("--vocab_size", type=int, default=None, help="default: the preset's, else GPTConfig's")
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
parser.add_argument("--examples", type=int, default=64, help="examples scored by each path, each repeat")
parser.add_argument("--batches", default="1,8,32", help="examples a forward, one path each (1: the old path)")
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()

preset = {}
exec(Path(args.config).read_text(), preset)  # a preset is Python: the same trust as train.py gives it
settings = {f.name: preset[f.name] for f in fields(GPTConfig) if f.name in preset}
if args.vocab_size:
    settings["vocab_size"] = args.vocab_size
config = GPTConfig(**settings)
dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
device_type = args.device.split(":")[0]
torch.manual_seed(0)
torch.set_float32_matmul_precision("high")
model = GPT(config).to(args.device).eval()
autocast = torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != "float32")

rng = random.Random(0)


def ids(n):
    return [rng.randrange(config.vocab_size) for _ in range(n)]


examples = [(ids(rng.randint(20, 100)), [ids(rng.randint(10, 40)) for _ in range(4)], rng.randrange(4))
            for _ in range(args.examples)]
examples.sort(key=lambda example: len(example[0]) + max(map(len, example[1])))  # as train.py sorts them


def score(batch_size):
    """train.py's HellaSwag loop over all the examples: (examples, right by mean, right by sum), seconds."""
    totals = torch.zeros(3, device=args.device)
    started = time.perf_counter()
    for batch in [examples[i:i + batch_size] for i in range(0, len(examples), batch_size)]:
        contexts = [context for context, endings, _ in batch for _ in endings]
        all_endings = [ending for _, endings, _ in batch for ending in endings]
        with torch.no_grad(), autocast:
            summed, mean = model.continuation_losses(contexts, all_endings)
        labels = torch.tensor([label for _, _, label in batch], device=args.device)
        right = [(losses.view(-1, 4).argmin(1) == labels).sum() for losses in (mean, summed)]
        totals += torch.stack([torch.tensor(len(batch), device=args.device), *right])
    counts = totals.tolist()  # waits for the device
    return counts, time.perf_counter() - started


def padded_share(batch_size):
    """The share of the scored positions that are padding, at this many examples a forward."""
    widths = [min(len(context) + len(ending), config.block_size + 1) - 1
              for context, endings, _ in examples for ending in endings]
    batches = [widths[i:i + 4 * batch_size] for i in range(0, len(widths), 4 * batch_size)]
    return 1 - sum(widths) / sum(len(batch) * max(batch) for batch in batches)


batch_sizes = [int(b) for b in args.batches.split(",")]
rows = 4 * len(examples)
tokens = sum(min(len(context) + len(ending), config.block_size + 1) - 1
             for context, endings, _ in examples for ending in endings)
name = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
print(f"{args.config}: {model.get_num_params() / 1e6:.1f}M parameters, vocab {config.vocab_size}, {dtype} on "
      f"{name} ({torch.get_num_threads()} threads); {len(examples)} examples, {rows} rows, {tokens:,} tokens")
score(max(batch_sizes))  # warm-up: the allocator, cuDNN's choices
seconds = {b: [] for b in batch_sizes}
counts = {}
for _ in range(args.repeats):
    for b in batch_sizes:  # in turn: a load that comes and goes falls on every path alike
        counts[b], elapsed = score(b)
        seconds[b].append(elapsed)
base = statistics.median(seconds[batch_sizes[0]])
for b in batch_sizes:
    median = statistics.median(seconds[b])
    rate = len(examples) / median
    full = f", one eval of 10,042 examples ~{10042 / rate:.1f} s" if device_type == "cuda" else ""
    print(f"hellaswag_batch={b}: median {median:.3f} s ({', '.join(f'{s:.3f}' for s in seconds[b])}), "
          f"{rate:,.1f} examples/s, {base / median:.2f}x batch {batch_sizes[0]}, padding "
          f"{padded_share(b):.1%}{full}; counts {counts[b]}")
if len({tuple(c) for c in counts.values()}) != 1:
    sys.exit("error: the paths counted differently")
