"""
Benchmark model.py: generation by its routes (the decode step in CUDA graphs on a GPU, the plain step with the static KV
cache, and recomputing the whole context every token, as nanoGPT's generate does), and the forward+backward time of a
training step for each preset.

    python bench/bench_model.py                                   # CPU: both parts, tiny and lilLM presets
    python bench/bench_model.py --part generate --presets tiny,lillm,gpt2_124m --repeats 5
    python bench/bench_model.py --part train --device cuda --dtype bfloat16 --compile   # on a GPU
    python bench/bench_model.py --part generate --device cuda --dtype bfloat16 --new_tokens 1024

Medians over --repeats runs, after one warm-up run (the graphed route compiles in it); the routes alternate, run by
run. Generation is greedy, batch 1 and 8 (--batch_size: one), a 16-token random prompt and 256 new tokens; the routes
must give the same tokens while the context fits in block_size (checked; in bfloat16 rounding may part them).
--dtype bfloat16 casts the weights to bf16 for generation, as sample.py does (no autocast), and on CUDA times beside
it the "autocast" route: the graphed step under autocast over float32 weights (sample.py before); float16 runs autocast
over float32 weights. Beside tokens/s: the share of the memory-bandwidth limit, where each step moves every weight once
(batch B makes B tokens of it): 4 bytes a parameter in float32, 2 cast to bf16, 8 under float16 autocast (it reads the
float32 weight, writes its cast, and the matmul reads that); the KV cache's reads are left out. GPUs by name, a CPU
with --bandwidth (GB/s), else n/a.
The training step is one forward+backward (no optimizer step) at block_size tokens per row, under autocast over
float32 weights (as train.py) unless float32.
"""
import argparse
import copy
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from model import GPT, GPTConfig, peak_flops  # noqa: E402

# HBM bandwidth in GB/s from data sheets; the first key in the GPU's name wins (as model.py's PEAK_FLOPS).
BANDWIDTH = {"GB200": 8000, "B200": 8000, "GH200": 4000, "H200": 4800, "H100 PCIe": 2000, "H100 NVL": 3900,
             "H100": 3350, "H800": 3350, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555, "A100": 2039,
             "L40S": 864, "L40": 864, "L4": 300, "A10G": 600, "A10": 600, "A6000": 768, "4090": 1008,
             "3090": 936, "V100": 900, "T4": 320}

# The presets of config/ (shakespeare_char.py, lillm.py, gpt2_124m.py), as model dimensions.
PRESETS = {
    "tiny": GPTConfig(vocab_size=65, n_embd=384, n_layer=6, n_head=6, n_kv_head=2, block_size=256),
    "lillm": GPTConfig(),
    "gpt2_124m": GPTConfig(vocab_size=50304, n_embd=768, n_layer=12, n_head=12, n_kv_head=12, block_size=1024),
}

parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
parser.add_argument("--part", choices=["generate", "train", "all"], default="all")
parser.add_argument("--presets", default=None, help="comma-separated (default: generate tiny,lillm; train all three)")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--new_tokens", type=int, default=256)
parser.add_argument("--prompt_tokens", type=int, default=16)
parser.add_argument("--batch_size", type=int, default=None,
                    help="rows: generated at once (default 1), or per training step (default: 4 tiny, 1 others on CPU)")
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
parser.add_argument("--compile", action="store_true", help="torch.compile the training step")
parser.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (default: by GPU name)")
parser.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice). On a machine shared with other jobs, 1 thread "
                         "avoids threads spinning while they wait for a core, which made 2 threads 10x slower here")
args = parser.parse_args()
if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
    sys.exit(f"error: --device {args.device}: no CUDA GPU here")
if args.threads:
    torch.set_num_threads(args.threads)
device_type = torch.device(args.device).type
autocast = nullcontext() if args.dtype == "float32" else torch.autocast(device_type, dtype=getattr(torch, args.dtype))


def synchronize():
    if device_type == "cuda":
        torch.cuda.synchronize()


def timed(function):
    synchronize()
    start = time.perf_counter()
    result = function()
    synchronize()
    return time.perf_counter() - start, result


print(f"torch {torch.__version__}, device {args.device} ({peak_flops(args.device)[1]}), {args.dtype}, "
      f"{torch.get_num_threads()} CPU threads")

if args.part in ("generate", "all"):
    names = (args.presets or "tiny,lillm").split(",")
    bandwidth = args.bandwidth
    if bandwidth is None and device_type == "cuda":
        gpu = torch.cuda.get_device_name(args.device)
        bandwidth = next((gbs for key, gbs in BANDWIDTH.items() if key in gpu), None)
    routes = {"graphed": dict(compile_decode=None), "cache": dict(compile_decode=False),
              "recompute": dict(use_cache=False)}
    if device_type != "cuda":  # CUDA graphs only replay on a GPU
        routes.pop("graphed")
    print(f"\ngeneration: {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, greedy; median of "
          f"{args.repeats}; bandwidth {f'{bandwidth:,.0f} GB/s' if bandwidth else 'unknown (n/a)'}")
    for name in names:
        config = PRESETS[name]
        torch.manual_seed(0)
        model = GPT(config).to(args.device).eval()
        # route -> (model, context, generate's options, bytes a parameter a step)
        runs = {route: (model, autocast, options, {"float32": 4, "float16": 8}.get(args.dtype))
                for route, options in routes.items()}
        if args.dtype == "bfloat16":  # as sample.py: weights cast once, no autocast
            if "graphed" in routes:  # beside: the graph under autocast over float32 weights (8 bytes:
                # each replay reads the float32 weight, writes its cast, and the matmul reads that)
                float32_model = copy.deepcopy(model)
                runs = {"autocast": (float32_model, autocast, routes["graphed"], 8), **runs}
            model.cast_weights(torch.bfloat16)
            runs.update({route: (model, nullcontext(), options, 2) for route, options in routes.items()})
        if name == names[0]:
            columns = "".join(f" {route + ' tok/s':>16} {'of BW':>6}" for route in runs)
            print(f"{'preset':<10} {'params':>8} {'batch':>5}{columns}  same tokens")
        for batch_size in [args.batch_size] if args.batch_size else [1, 8]:
            prompt = torch.randint(0, config.vocab_size, (batch_size, args.prompt_tokens), device=args.device)
            # The routes alternate within each repeat, so that all see the same load on a shared machine.
            times, outputs = {route: [] for route in runs}, {}
            for route, (route_model, context, options, _) in runs.items():  # warm-up: allocator, compiling
                with context:
                    timed(lambda: route_model.generate(prompt, 8, temperature=0, **options))
            for _ in range(args.repeats):
                for route, (route_model, context, options, _) in runs.items():
                    with context:
                        elapsed, outputs[route] = timed(
                            lambda: route_model.generate(prompt, args.new_tokens, temperature=0, **options))
                    times[route].append(elapsed)
            row = f"{name:<10} {model.get_num_params() / 1e6:>7.1f}M {batch_size:>5}"
            for route, route_times in times.items():
                rate = batch_size * args.new_tokens / statistics.median(route_times)  # over the whole batch
                weight_bytes_per_step = model.get_num_params() * runs[route][3]
                limit = bandwidth * 1e9 / weight_bytes_per_step * batch_size if bandwidth else None
                row += f" {rate:>16.1f} {f'{rate / limit:.1%}' if limit else 'n/a':>6}"
            fits = args.prompt_tokens + args.new_tokens <= config.block_size
            differ = [route for route in routes if not torch.equal(outputs[route], outputs["recompute"])]
            same = ("yes" if not differ else f"NO: {', '.join(differ)}") if fits else "n/a (past block_size)"
            print(f"{row}  {same}", flush=True)
        del model, runs

if args.part in ("train", "all"):
    names = (args.presets or "tiny,lillm,gpt2_124m").split(",")
    print(f"\ntraining step (forward+backward, no optimizer step), median of {args.repeats}"
          f"{', compiled' if args.compile else ''}")
    print(f"{'preset':<10} {'params':>8} {'batch x T':>11} {'ms/step':>10} {'tokens/s':>10} {'MFU':>7}")
    for name in names:
        config = PRESETS[name]
        batch_size = args.batch_size or (4 if name == "tiny" or device_type != "cpu" else 1)
        torch.manual_seed(0)
        model = GPT(config).to(args.device).train()
        step_model = torch.compile(model) if args.compile else model
        inputs = torch.randint(0, config.vocab_size, (batch_size, config.block_size), device=args.device)
        targets = torch.randint(0, config.vocab_size, (batch_size, config.block_size), device=args.device)

        def train_step():
            with autocast:
                _, loss = step_model(inputs, targets)
            loss.backward()
            model.zero_grad(set_to_none=True)

        timed(train_step)  # warm-up (and compilation)
        step_seconds = statistics.median(timed(train_step)[0] for _ in range(args.repeats))
        mfu = model.estimate_mfu(batch_size, step_seconds)
        print(f"{name:<10} {model.get_num_params() / 1e6:>7.1f}M {batch_size:>4} x {config.block_size:<4} "
              f"{step_seconds * 1000:>10.1f} {batch_size * config.block_size / step_seconds:>10,.0f} "
              f"{'n/a' if mfu != mfu else f'{mfu * 100:.1f}%':>7}", flush=True)
        del model, step_model
