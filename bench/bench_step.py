"""
One training step of a preset's model on random tokens, as train.py runs it (bf16 autocast and torch.compile on
CUDA, fused AdamW), timed, then profiled with torch.profiler: where a step's time goes, and how busy the device is.

    python bench/bench_step.py config/gpt2_124m.py                 # tokens/s, MFU, busy, then the top kernels
    python bench/bench_step.py config/lillm.py --batch_size 64 --trace out/trace.json
    python bench/bench_step.py config/quickstart.py --device cpu --compile 1 --vocab_size 1024

Two losses, each step in turn (same run, same weights): "plain", model.py's forward before issue 36 (the logits
returned with their graph: the compiled backward fills a zero gradient for them), and "detached", today's; each
under every torch.compile mode of --modes (a model and optimizer a loss, shared by its modes). Busy is
the profiled step's device time over its wall time (CUDA; the profiler's own overhead makes it a lower bound).
tokens/s and MFU count one micro-step (forward, backward) plus the optimizer step, so they are a little above what
train.py prints with accumulation (there the optimizer step is shared by every micro-step). The data is random: a
step's cost doesn't depend on which ids it sees.
"""
import argparse
import statistics
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
parser.add_argument("--vocab_size", type=int, default=None, help="default: the preset's, else GPTConfig's")
parser.add_argument("--steps", type=int, default=20, help="timed steps of each loss, after 5 warm-up steps")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--compile", type=int, default=None, help="default: 1 on CUDA, 0 on the CPU (as train.py)")
parser.add_argument("--losses", default="plain,detached", help="which of the two losses to time")
parser.add_argument("--modes", default="default", help="torch.compile modes to time, each with each loss: e.g. "
                    "default,reduce-overhead (CUDA graphs: the host's launches gone) or max-autotune-no-cudagraphs")
parser.add_argument("--trace", default=None, help="write the profiled steps as Chrome traces here (a prefix)")
args = parser.parse_args()

preset = {}
exec(Path(args.config).read_text(), preset)  # a preset is Python: the same trust as train.py gives it
settings = {f.name: preset[f.name] for f in fields(GPTConfig) if f.name in preset}
if args.vocab_size:
    settings["vocab_size"] = args.vocab_size
model_config = GPTConfig(**settings)
batch_size = args.batch_size or preset["batch_size"]
device, cuda = args.device, args.device.startswith("cuda")
dtype = torch.bfloat16 if cuda else torch.float32  # train.py's "auto": no bf16 on a CPU
compile = cuda if args.compile is None else bool(args.compile)
torch.set_float32_matmul_precision("high")
shape = (batch_size, model_config.block_size)
inputs = torch.randint(0, model_config.vocab_size, shape, device=device)
targets = torch.randint(0, model_config.vocab_size, shape, device=device)


def model_and_optimizer():
    torch.manual_seed(0)
    model = GPT(model_config).to(device)
    return model, model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.split(":")[0], verbose=False)


# the plain loss: a model of its own whose forward returns lm_head's output, the logits with their graph, as
# model.py's forward did before issue 36 (its own weights: a step costs the same whatever they are)
plain_model, plain_optimizer = model_and_optimizer()
kept = {}
plain_model.lm_head.register_forward_hook(lambda module, inputs, output: kept.update(logits=output))


def plain(idx, targets):
    _, loss = plain_model(idx, targets)
    return kept["logits"], loss


detached_model, detached_optimizer = model_and_optimizer()
paths = {"plain": (plain, plain_model, plain_optimizer),
         "detached": (detached_model, detached_model, detached_optimizer)}
runs = {}  # "loss" or "loss/mode" -> (forward, model, optimizer, mode)
modes = args.modes.split(",") if compile else ["default"]
for loss_name in args.losses.split(","):
    for mode in modes:
        forward, raw_model, optimizer = paths[loss_name]
        run_name = loss_name if mode == "default" else f"{loss_name}/{mode}"
        compiled = torch.compile(forward, mode=None if mode == "default" else mode) if compile else forward
        runs[run_name] = (compiled, raw_model, optimizer, mode)


def sync():
    if cuda:
        torch.cuda.synchronize()


def step(forward, raw_model, optimizer, mode):
    if mode in ("reduce-overhead", "max-autotune"):  # the modes that capture CUDA graphs
        torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs may be overwritten
    with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        _, loss = forward(inputs, targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


name = torch.cuda.get_device_name(device) if cuda else f"cpu, {torch.get_num_threads()} threads"
print(f"{args.config}: {raw_model.get_num_params() / 1e6:.1f}M parameters, vocab {model_config.vocab_size}, batch "
      f"{batch_size} x {model_config.block_size}, {str(dtype)[6:]}, compile {compile}, {name}")
for loss_name, run in runs.items():
    started = time.perf_counter()
    for _ in range(5):  # the first compiles
        step(*run)
    sync()
    print(f"{loss_name}: warm-up (compilation included): {time.perf_counter() - started:.1f} s")
seconds, memory = {n: [] for n in runs}, {}
for _ in range(args.steps):
    for loss_name, run in runs.items():  # in turn: a load that comes and goes falls on both
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        step(*run)
        sync()
        seconds[loss_name].append(time.perf_counter() - started)
        memory[loss_name] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None

activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
for loss_name, run in runs.items():
    median = statistics.median(seconds[loss_name])
    tokens_per_sec = batch_size * model_config.block_size / median
    mfu = raw_model.estimate_mfu(batch_size, median)
    with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
        started = time.perf_counter()
        step(*run)
        sync()
        profiled = time.perf_counter() - started
    device_seconds = sum(e.self_device_time_total for e in profiler.key_averages()) / 1e6 if cuda else None
    busy = f"{device_seconds * 1000:.1f} ms of {profiled * 1000:.1f} ({device_seconds / profiled:.0%})" if cuda \
        else "n/a on a CPU"
    peak = f", peak memory {memory[loss_name]:.1f} GiB" if cuda else ""
    logits_shape = [batch_size, model_config.block_size, model_config.vocab_size]
    zero_fills = sum(1 for e in profiler.events() if e.name in ("aten::zero_", "aten::fill_")
                     and logits_shape in e.input_shapes)
    print(f"{loss_name}: median {median * 1000:.1f} ms of {args.steps} steps ({min(seconds[loss_name]) * 1000:.1f}-"
          f"{max(seconds[loss_name]) * 1000:.1f}), {tokens_per_sec:,.0f} tokens/s, MFU "
          f"{'n/a' if mfu != mfu else f'{mfu * 100:.1f}%'}{peak}; the profiled step's device busy: {busy}; "
          f"zero fills of B x T x vocab: {zero_fills}")
    if args.trace:
        profiler.export_chrome_trace(f"{args.trace}.{loss_name.replace('/', '-')}.json")  # not a directory
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(profiler.key_averages().table(sort_by=sort_by, row_limit=15, max_name_column_width=60))
