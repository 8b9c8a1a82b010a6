"""
Muon's batching by shape (model.py's MuonAdamW orthogonalizes the matrices of one shape together) against the
simpler path, one matrix at a time, as whole training steps (forward, backward, optimizer) of a preset, in turn.

    python bench/bench_muon.py                       # the CPU recipe: 4 x 128, batch 12 x 64
    python bench/bench_muon.py --n_layer 6 --n_embd 384 --n_head 6 --block_size 256 --batch_size 4

Both optimizers start from the same weights and see the same batch; the medians and their ratio are printed.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from model import GPT, GPTConfig, MuonAdamW  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
parser.add_argument("--n_layer", type=int, default=4)
parser.add_argument("--n_head", type=int, default=4)
parser.add_argument("--n_embd", type=int, default=128)
parser.add_argument("--block_size", type=int, default=64)
parser.add_argument("--batch_size", type=int, default=12)
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()


class OneByOne(MuonAdamW):
    """The simpler path: each matrix orthogonalized on its own."""
    def _muon_step(self, group, params):
        for p in params:
            super()._muon_step(group, [p])


config = GPTConfig(vocab_size=65, n_layer=args.n_layer, n_head=args.n_head, n_kv_head=2, n_embd=args.n_embd,
                   block_size=args.block_size, ffn_ratio=1.0)  # config/shakespeare_char.py's shape
runs = {}
for name in ("batched by shape", "one by one"):
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu", "muon", verbose=False)
    if name == "one by one":
        optimizer.__class__ = OneByOne
    runs[name] = model, optimizer
x = torch.randint(0, config.vocab_size, (args.batch_size, args.block_size))
times = {name: [] for name in runs}
for _ in range(args.steps):
    for name, (model, optimizer) in runs.items():  # in turn: a loaded machine slows both alike
        start = time.perf_counter()
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times[name].append(time.perf_counter() - start)
medians = {name: statistics.median(seconds) * 1000 for name, seconds in times.items()}
print(f"{args.n_layer} x {args.n_embd}, batch {args.batch_size} x {args.block_size}, {torch.get_num_threads()} "
      f"threads, median of {args.steps} steps: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in medians.items())
      + f"; one by one / batched {medians['one by one'] / medians['batched by shape']:.2f}x")
