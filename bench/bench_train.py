"""
train.py on the CPU with nanoGPT's small Shakespeare recipe, side by side with nanoGPT itself.

    python bench/bench_train.py --nanogpt .nanogpt --repeats 3              # this CPU as it is
    python bench/bench_train.py --nanogpt .nanogpt --repeats 3 --isa avx2   # as an AVX2-only CPU (no AVX-512, no bf16)

The recipe (nanoGPT's README, CPU section): char-level tinyshakespeare, a 4-layer 128-wide model, 12 x 64 tokens a
step, 2000 steps: RECIPE below, on top of config/shakespeare_char.py for us and config/train_shakespeare_char.py
for nanoGPT. The target: val loss <= 1.60 in no more wall time than nanoGPT's. The wall time is the whole
command, startup and evals included, as a user sees it. The two alternate run by run (the order flips each
repeat), so both see the same load on a shared machine; the medians and their ratio are printed.

nanoGPT can't be pip-installed: --nanogpt names a directory with its train.py, model.py, configurator.py,
config/train_shakespeare_char.py and data/shakespeare_char/prepare.py (github.com/karpathy/nanoGPT; this repo
ignores .nanogpt/). Without it, ours runs alone against the figures recorded in bench/RESULTS.md.

--isa avx2 caps torch's kernels and oneDNN at AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2): bfloat16
matmuls are then emulated, as on most laptops, and ~27x slower than float32.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORDED_NANOGPT = {"val_loss": 1.886, "seconds": 101.0}  # bench/RESULTS.md, issue #7: AVX-512 EPYC, quiet
TARGET_VAL_LOSS = 1.60
RECIPE = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
          "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
          "--lr_decay_iters=2000", "--dropout=0.0"]
NANOGPT_FILES = ["train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py"]

parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
parser.add_argument("--nanogpt", default=None, help="directory holding nanoGPT's scripts (see above)")
parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "corpora" / "tinyshakespeare.txt"))
parser.add_argument("--repeats", type=int, default=1)
parser.add_argument("--isa", choices=["native", "avx2"], default="native", help="avx2: behave as an AVX2-only CPU")
parser.add_argument("--max_iters", type=int, default=2000, help="fewer steps for a quick timing (the loss is then not the recipe's)")
parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: torch's, one per core)")
parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="more --key=value settings for our train.py (tuning); last: it takes the rest of the line")
args = parser.parse_args()
if not os.path.exists(args.corpus):
    sys.exit(f"error: no {args.corpus}; pass --corpus path/to/tinyshakespeare.txt")
if args.nanogpt and not all((Path(args.nanogpt) / name).is_file() for name in NANOGPT_FILES):
    sys.exit(f"error: {args.nanogpt} lacks some of nanoGPT's {', '.join(NANOGPT_FILES)}")

env = dict(os.environ)
if args.threads:
    env["OMP_NUM_THREADS"] = str(args.threads)
if args.isa == "avx2":
    env.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
recipe = [f"--max_iters={args.max_iters}", f"--lr_decay_iters={args.max_iters}"] + \
         [flag for flag in RECIPE if not flag.startswith(("--max_iters", "--lr_decay_iters"))]

lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
model_name = re.search(r"Model name:\s*(.+)", lscpu).group(1).strip() if "Model name" in lscpu else "unknown"
flags = set(re.search(r"Flags:\s*(.+)", lscpu).group(1).split()) if "Flags:" in lscpu else set()
print(f"CPU: {model_name}, {os.cpu_count()} cores; flags: " +
      ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")))
print(f"kernels: {args.isa}" + (" (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: bf16 emulated)" if args.isa == "avx2" else ""))

work = Path(tempfile.mkdtemp(prefix="bench_train_"))
subprocess.run([sys.executable, str(REPO / "prepare_data.py"), "--tokenizer", "char", "--data", args.corpus,
                "--out", str(work / "shakespeare_char")], check=True, capture_output=True)
ours = [sys.executable, str(REPO / "train.py"), str(REPO / "config" / "shakespeare_char.py"), *recipe,
        f"--dataset={work / 'shakespeare_char'}", f"--out_dir={work / 'out'}", *args.extra]
commands = {"lilLM": (ours, work)}
if args.nanogpt:  # nanoGPT reads data/ and configurator.py from its working directory: a copy of it
    nanogpt_dir = work / "nanogpt"
    shutil.copytree(args.nanogpt, nanogpt_dir, ignore=shutil.ignore_patterns("out*", "*.bin", "*.pkl"))
    shutil.copy(args.corpus, nanogpt_dir / "data" / "shakespeare_char" / "input.txt")  # so it downloads nothing
    subprocess.run([sys.executable, "data/shakespeare_char/prepare.py"], cwd=nanogpt_dir, check=True,
                   stdout=subprocess.DEVNULL)
    commands["nanoGPT"] = ([sys.executable, "train.py", "config/train_shakespeare_char.py", *recipe], nanogpt_dir)
else:
    print(f"nanoGPT: not given (--nanogpt DIR), so ours is compared with its recorded figures: "
          f"val loss {RECORDED_NANOGPT['val_loss']}, {RECORDED_NANOGPT['seconds']:.0f} s")
for name, (command, cwd) in commands.items():
    print(f"{name}: (cd {cwd} && {' '.join(['python'] + command[1:])})")


def final_val_loss(name, stdout):
    if name == "nanoGPT":  # "step 2000: train loss 1.7, val loss 1.8"
        return float(re.findall(r"step \d+: train loss [\d.]+, val loss ([\d.]+)", stdout)[-1])
    evals = [json.loads(line) for line in (work / "out" / "log.jsonl").read_text().splitlines()]
    return [record for record in evals if "val_loss" in record][-1]["val_loss"]


results = {name: {"val_loss": [], "seconds": []} for name in commands}
for repeat in range(args.repeats):
    for name in (list(commands) if repeat % 2 == 0 else list(commands)[::-1]):
        command, cwd = commands[name]
        shutil.rmtree(work / "out", ignore_errors=True)
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"error: {name} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
        results[name]["val_loss"].append(final_val_loss(name, result.stdout))
        results[name]["seconds"].append(seconds)
        print(f"run {repeat + 1} {name:<8}: val loss {results[name]['val_loss'][-1]:.4f} at iter {args.max_iters}, "
              f"{seconds:.1f} s wall (load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after)", flush=True)

medians = {name: {key: statistics.median(values) for key, values in result.items()} for name, result in results.items()}
nanogpt = medians.get("nanoGPT", RECORDED_NANOGPT)
for name, median in medians.items():
    print(f"{name:<8}: val loss {median['val_loss']:.4f}, {median['seconds']:.1f} s (median of {args.repeats})")
if "nanoGPT" not in medians:
    print(f"nanoGPT : val loss {nanogpt['val_loss']:.3f}, {nanogpt['seconds']:.0f} s (recorded, not run here)")
ratio = medians["lilLM"]["seconds"] / nanogpt["seconds"]
loss_met = medians["lilLM"]["val_loss"] <= TARGET_VAL_LOSS
print(f"time ratio lilLM / nanoGPT: {ratio:.2f} ({'met' if ratio <= 1 else 'NOT met'}: <= 1); val loss target <= "
      f"{TARGET_VAL_LOSS}: {'met' if loss_met else 'NOT met'}" + ("" if args.max_iters == 2000 else
      f" (only {args.max_iters} steps: the loss is not the recipe's)"))
