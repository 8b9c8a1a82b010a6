"""
One training step of a preset's model on random tokens, as train.py runs it (bf16 autocast, torch.compile,
fused AdamW), timed, then profiled with torch.profiler: where a step's time goes on a GPU.

    python bench/bench_step.py config/gpt2_124m.py                 # tokens/s, MFU, then the top kernels
    python bench/bench_step.py config/lillm.py --batch_size 64 --trace out/trace.json

tokens/s and MFU count one micro-step (forward, backward) plus the optimizer step, so they are a little
above what train.py prints with accumulation (there the optimizer step is shared by every micro-step).
The data is random: a step's cost doesn't depend on which ids it sees.
"""
import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("config", help="a preset of config/, read for its model and batch settings")
parser.add_argument("--batch_size", type=int, default=None, help="per micro-step (default: the preset's)")
parser.add_argument("--steps", type=int, default=20, help="timed steps, after 5 warm-up steps")
parser.add_argument("--compile", type=int, default=1)
parser.add_argument("--trace", default=None, help="write the profiled step as a Chrome trace here")
args = parser.parse_args()

preset = {}
exec(Path(args.config).read_text(), preset)  # a preset is Python: the same trust as train.py gives it
settings = {f.name: preset[f.name] for f in fields(GPTConfig) if f.name in preset}
model_config = GPTConfig(**settings)
batch_size = args.batch_size or preset["batch_size"]
device = "cuda"
torch.manual_seed(0)
torch.set_float32_matmul_precision("high")
raw_model = GPT(model_config).to(device)
model = torch.compile(raw_model) if args.compile else raw_model
optimizer = raw_model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device)
shape = (batch_size, model_config.block_size)
inputs = torch.randint(0, model_config.vocab_size, shape, device=device)
targets = torch.randint(0, model_config.vocab_size, shape, device=device)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(inputs, targets=targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


print(f"{args.config}: {raw_model.get_num_params() / 1e6:.1f}M parameters, batch {batch_size} x "
      f"{model_config.block_size}, compile {bool(args.compile)}, {torch.cuda.get_device_name()}")
started = time.perf_counter()
for _ in range(5):  # the first compiles
    step()
torch.cuda.synchronize()
print(f"warm-up (compilation included): {time.perf_counter() - started:.1f} s")
seconds = []
for _ in range(args.steps):
    started = time.perf_counter()
    step()
    torch.cuda.synchronize()
    seconds.append(time.perf_counter() - started)
median = sorted(seconds)[len(seconds) // 2]
tokens_per_sec = batch_size * model_config.block_size / median
mfu = raw_model.estimate_mfu(batch_size, median)
memory = torch.cuda.max_memory_allocated() / 2**30
print(f"step: median {median * 1000:.1f} ms of {args.steps}, {tokens_per_sec:,.0f} tokens/s, "
      f"MFU {mfu * 100:.1f}%, peak memory {memory:.1f} GiB")

activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=activities) as profiler:
    step()
    torch.cuda.synchronize()
if args.trace:
    profiler.export_chrome_trace(args.trace)
print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
