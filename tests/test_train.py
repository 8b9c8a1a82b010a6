"""train.py end to end on the CPU, each run a real subprocess on a tiny model and a char-level dataset written
here to the shard contract (tinyshakespeare when the shared corpora are present, generated text otherwise).

The checks compare independent routes to the same numbers: two processes (torchrun, or SLURM's variables)
against one process with the same global batch; a run stopped and resumed against one that never stopped."""
import ast
import base64
import hashlib
import importlib.util
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CORPORA, SCRIPT_RUNNER, assert_one_error_line, freeze_rank_1
from test_copies import function_source

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(REPO / "train.py")
# 2 layers of 32 wide, 4 x 32-token sequences a micro-step: a step takes a few milliseconds.
TINY = ["--device=cpu", "--compile=False", "--batch_size=4", "--block_size=32", "--n_layer=2", "--n_head=2",
        "--n_kv_head=1", "--n_embd=32", "--eval_iters=4", "--log_interval=1", "--warmup_iters=2",
        "--learning_rate=3e-3", "--min_lr=3e-4"]
# One thread per process: two processes on a 2-core machine shared with other jobs stay reasonable.
ENV = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS")},
       "OMP_NUM_THREADS": "1"}


def write_char_dataset(directory, text):
    """Shards and meta.json as prepare_data.py writes them: ids are the sorted characters, val the last 10%."""
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.uint16)
    split = int(len(ids) * 0.9)
    directory.mkdir(parents=True, exist_ok=True)
    # Two train shards, so that windows are drawn across shards.
    np.save(directory / "train_000000.npy", ids[:split // 2])
    np.save(directory / "train_000001.npy", ids[split // 2:split])
    np.save(directory / "val_000000.npy", ids[split:])
    meta = {"version": 1, "vocab_size": len(chars), "eot_token": None, "dtype": "uint16",
            "max_token_id": int(ids.max()), "tokenizer": {"kind": "char"}, "source": "test", "num_chars": len(text),
            "tokens": {"train": split, "val": len(ids) - split},
            "shards": {"train": ["train_000000.npy", "train_000001.npy"], "val": ["val_000000.npy"]},
            "chars": chars}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = CORPORA / "tinyshakespeare.txt"
    if path.exists():
        text = path.read_text(encoding="utf-8")[:200_000]
    else:  # no shared corpora: the offline corpus of the scripts, the standard library's source (~100 characters)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        pieces, length = [], 0
        for file in sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts):
            pieces.append(file.read_text(encoding="utf-8", errors="replace"))
            length += len(pieces[-1])
            if length >= 200_000:
                break
        text = "".join(pieces)[:200_000]
    return write_char_dataset(tmp_path_factory.mktemp("data") / "chars", text)


def start_train(dataset, out_dir, *args, env=ENV):
    """Start train.py on the tiny model in a fresh interpreter, for the tests of signals (runs that don't depend on
    each other go at once: the machine has 2 cores)."""
    return subprocess.Popen([sys.executable, TRAIN, f"--dataset={dataset}", f"--out_dir={out_dir}", *TINY, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=out_dir.parent)


def fork_train(dataset, out_dir, *args, environ=None):
    """Start train.py on the tiny model, forked from conftest.py's warm script runner (no torch import of its
    own); environ: the run's own variables (a rank's RANK, MASTER_PORT). Waited for by finish() or outcome()."""
    command = [sys.executable, TRAIN, f"--dataset={dataset}", f"--out_dir={out_dir}", *TINY, *args]
    return SCRIPT_RUNNER.start(command, out_dir.parent, ENV, environ=environ)


def outcome(run, timeout=240):
    """The result of a run of start_train (a process) or fork_train, whatever its exit status."""
    if isinstance(run, dict):
        return SCRIPT_RUNNER.finish(run, timeout=timeout)
    stdout, stderr = run.communicate(timeout=timeout)
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


def finish(run, timeout=240):
    """Wait for a run of start_train or fork_train; fail the test with its output if it failed."""
    result = outcome(run, timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def train(dataset, out_dir, *args):
    """Run train.py on the tiny model; fail the test with its output if it fails. Forked from the process that
    imported torch once (conftest.py's script runner); start_train's real processes are for signals."""
    command = [sys.executable, TRAIN, f"--dataset={dataset}", f"--out_dir={out_dir}", *TINY, *args]
    result = SCRIPT_RUNNER.run([command], cwd=out_dir.parent, env=ENV, timeout=240)[0]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def run_train(dataset, out_dir, *args, timeout=120):
    """Run train.py on the tiny model, expecting nothing: the test looks at the result. For refusals and other
    short runs: forked from the process that imported torch once (conftest.py's script runner)."""
    command = [sys.executable, TRAIN, f"--dataset={dataset}", f"--out_dir={out_dir}", *TINY, *args]
    return SCRIPT_RUNNER.run([command], cwd=out_dir.parent, env=ENV, timeout=timeout)[0]


def read_log(out_dir):
    """(step losses by iteration, (train, val) eval losses by iteration) from log.jsonl; a later line wins."""
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    steps = {r["iter"]: r["loss"] for r in records if "loss" in r}
    evals = {r["iter"]: (r["train_loss"], r["val_loss"]) for r in records if "val_loss" in r}
    return steps, evals


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun_task(task, port, local_id=None):
    """What srun gives task `task` of 2 (on one node unless local_id says), with the sbatch script's MASTER_*."""
    local_id = task if local_id is None else local_id
    return {"SLURM_PROCID": str(task), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(local_id),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


# -----------------------------------------------------------------------------------------------------
# a short real run: the loss falls, and the checkpoint follows the contract

@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("trained") / "out"
    train(dataset, out_dir, "--max_iters=40", "--eval_interval=20", "--learning_rate=1e-2", "--total_batch_size=None",
          "--lr_decay_iters=40")
    return out_dir


def test_loss_falls_on_a_tiny_dataset(trained):
    steps, evals = read_log(trained)
    assert sorted(evals) == [0, 20, 40]
    # Uniform guessing over 60-100 characters is 4.1-4.6; the character frequencies alone give ~3.3.
    assert evals[0][1] > 3.9
    assert evals[40][1] < evals[0][1] - 0.6
    assert steps[40] < steps[1] - 0.6


def test_a_finished_run_leaves_a_checkpoint_even_when_val_loss_rose(dataset, tmp_path):
    # A learning rate of 1 takes the loss far above the initial weights' in 2 steps. Those weights are never saved,
    # so their eval sets no best to beat: the run still ends with a checkpoint to sample from or to resume.
    out_dir = tmp_path / "out"
    train(dataset, out_dir, "--max_iters=2", "--eval_interval=2", "--learning_rate=1.0", "--min_lr=0", "--warmup_iters=0",
          "--grad_clip=0", "--total_batch_size=None")
    evals = read_log(out_dir)[1]
    assert evals[2][1] > evals[0][1] + 1  # the premise: val loss rose
    checkpoint = load(out_dir / "ckpt.pt")
    assert checkpoint["iter_num"] == 2 and checkpoint["best_val_loss"] == evals[2][1]


def test_checkpoint_holds_what_sample_py_needs(trained, dataset):
    checkpoint = load(trained / "ckpt.pt")
    meta = json.loads((dataset / "meta.json").read_text())
    assert checkpoint["version"] == 1 and checkpoint["iter_num"] == 40
    assert checkpoint["tokenizer"] == {"kind": "char", "chars": meta["chars"]}
    assert checkpoint["dataset"] == meta
    assert checkpoint["model_config"]["vocab_size"] == meta["vocab_size"]
    assert checkpoint["model_config"]["n_embd"] == 32
    # The merged config: preset defaults and command-line overrides, with "auto" resolved.
    assert checkpoint["train_config"]["batch_size"] == 4
    assert checkpoint["train_config"]["learning_rate"] == 1e-2
    assert checkpoint["train_config"]["device"] == "cpu" and checkpoint["train_config"]["dtype"] == "float32"
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in checkpoint["model"])
    assert checkpoint["best_val_loss"] == read_log(trained)[1][40][1]


@pytest.mark.skipif(not (REPO / "sample.py").exists(), reason="sample.py is not in this checkout yet")
def test_sample_py_reads_the_checkpoint(trained):
    result = subprocess.run([sys.executable, str(REPO / "sample.py"), f"--out_dir={trained}", "--device=cpu",
                             "--num_samples=1", "--max_new_tokens=40", "--start=ROMEO:", "--seed=1"],
                            capture_output=True, text=True, env=ENV, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ROMEO:" in result.stdout and len(result.stdout) > 40


def test_bpe_dataset_embeds_its_tokenizer_in_the_checkpoint(dataset, tmp_path):
    # A byte-level "BPE" of 256 byte tokens and no merges, plus <|endoftext|> = 256: the shard ids are the bytes.
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    text = "to be or not to be, that is the question. " * 400
    ids = np.array([256] + list(text.encode()), dtype=np.uint16)
    np.save(bpe / "train_000000.npy", ids[:15000])
    np.save(bpe / "val_000000.npy", ids[15000:])
    ranks = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    (bpe / "tokenizer.tiktoken").write_text(ranks)
    info = {"pattern": r"\S+|\s+", "special_tokens": {"<|endoftext|>": 256}, "vocab_size": 257, "num_merges": 0}
    (bpe / "tokenizer.json").write_text(json.dumps(info))
    meta = {"version": 1, "vocab_size": 257, "eot_token": 256, "dtype": "uint16", "max_token_id": 256,
            "tokenizer": {"kind": "bpe", "path": "elsewhere", "sha256": hashlib.sha256(ranks.encode()).hexdigest()},
            "source": "test",
            "num_chars": len(text), "tokens": {"train": 15000, "val": len(ids) - 15000},
            "shards": {"train": ["train_000000.npy"], "val": ["val_000000.npy"]}}
    (bpe / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "out").mkdir()  # the log of a run that saved no checkpoint goes: it is no run's history
    (tmp_path / "out" / "log.jsonl").write_text(json.dumps({"iter": 7, "loss": 9.9}) + "\n")
    train(bpe, tmp_path / "out", "--max_iters=1", "--eval_interval=1", "--total_batch_size=None")
    assert list(read_log(tmp_path / "out")[0]) == [1]  # this run's step alone
    checkpoint = load(tmp_path / "out" / "ckpt.pt")
    assert checkpoint["tokenizer"] == {"kind": "bpe", "ranks": ranks, "pattern": info["pattern"],
                                       "special_tokens": info["special_tokens"]}
    assert checkpoint["model_config"]["vocab_size"] == 257
    saved = (tmp_path / "out" / "ckpt.pt").read_bytes()
    # Resuming onto another dataset's tokenizer (here char-level) is refused, and the checkpoint stays as it was.
    result = run_train(dataset, tmp_path / "out", "--init_from=resume", "--max_iters=2")
    assert_one_error_line(result, f"{dataset}'s tokenizer is not the one", f"was trained with (on {bpe})")
    assert (tmp_path / "out" / "ckpt.pt").read_bytes() == saved
    # A tokenizer.tiktoken replaced after the shards were made (a BPE trainer's --out pointed here) is refused.
    (bpe / "tokenizer.tiktoken").write_text(ranks + "IQ== 257\n")
    result = run_train(bpe, tmp_path / "other", "--max_iters=1")
    assert_one_error_line(result, "tokenizer.tiktoken is not the tokenizer the shards were made with")
    assert not (tmp_path / "other").exists()
    # Tokenizer files that agree with meta.json's sha256 but can't be a tokenizer, or whose size isn't
    # meta.json's vocab_size: one line each, before anything is written.
    byte_65 = base64.b64encode(b"A").decode()
    cases = [(ranks.replace(f"{byte_65} 65\n", f"{base64.b64encode(b'AB').decode()} 65\n"), info, meta,
              "its ranks 0-255 are not the 256 single bytes"),
             (ranks, dict(info, special_tokens={"<|endoftext|>": 5}), meta, "special token '<|endoftext|>' has id 5"),
             (ranks, info, dict(meta, vocab_size=300), "says vocab_size 300, but its tokenizer has 257 ids")]
    for case_ranks, case_info, case_meta, message in cases:
        (bpe / "tokenizer.tiktoken").write_text(case_ranks)
        (bpe / "tokenizer.json").write_text(json.dumps(case_info))
        sha256 = hashlib.sha256(case_ranks.encode()).hexdigest()
        (bpe / "meta.json").write_text(json.dumps(dict(case_meta, tokenizer=dict(meta["tokenizer"], sha256=sha256))))
        assert_one_error_line(run_train(bpe, tmp_path / "other", "--max_iters=1"), message)
        assert not (tmp_path / "other").exists()
    (bpe / "tokenizer.json").unlink()  # a copy that lost a file
    assert_one_error_line(run_train(bpe, tmp_path / "other", "--max_iters=1"), "lacks readable tokenizer files")
    # A tiktoken name (GPT-2's, offline) is loaded only for samples and HellaSwag: one that can't be loaded is a
    # note, and the run trains and saves the name.
    tiktoken_meta = dict(meta, tokenizer={"kind": "tiktoken", "name": "lillm_no_such_encoding"})
    (bpe / "meta.json").write_text(json.dumps(tiktoken_meta))
    result = train(bpe, tmp_path / "named", "--max_iters=1", "--eval_interval=1", "--total_batch_size=None",
                   "--sample_prompt=to be")
    assert "note: no HellaSwag figures or samples: the tokenizer can't be loaded (" in result.stdout, result.stdout
    assert load(tmp_path / "named" / "ckpt.pt")["tokenizer"] == tiktoken_meta["tokenizer"]


# -----------------------------------------------------------------------------------------------------
# several processes = one process with the same global batch

# 8 steps of 256 tokens: one process accumulates 2 micro-steps of 4 x 32 tokens, two processes do one each.
SAME_GLOBAL_BATCH = ["--total_batch_size=256", "--max_iters=8", "--eval_interval=4", "--lr_decay_iters=8",
                     "--always_save_checkpoint=True"]
# The processes sum their gradients in another order than the accumulation does, so the weights differ by
# float32 rounding (~1e-7 relative), which grows a little over the steps: 1e-4 on the losses is far below
# what a wrong batch or a missing gradient average would give (>1e-2).
TOLERANCE = 1e-4


def assert_same_losses(out_dir, one_process):
    steps, evals = read_log(out_dir)
    reference_steps, reference_evals = one_process
    assert sorted(steps) == sorted(reference_steps) == list(range(1, 9))
    assert sorted(evals) == sorted(reference_evals) == [0, 4, 8]
    for it in steps:
        assert steps[it] == pytest.approx(reference_steps[it], abs=TOLERANCE), it
    for it in evals:
        assert evals[it] == pytest.approx(reference_evals[it], abs=TOLERANCE), it
    # Only rank 0 writes: one line per iteration in the log, nothing but the checkpoint and the log.
    lines = (out_dir / "log.jsonl").read_text().splitlines()
    assert len(lines) == len(steps) + len(evals)
    assert sorted(p.name for p in out_dir.iterdir()) == ["ckpt.pt", "log.jsonl"]
    assert load(out_dir / "ckpt.pt")["iter_num"] == 8


def telling_python_exit(tmp_path):
    """ENV, plus a sitecustomize whose atexit handler prints "a rank in Python exit" in a torchrun rank.

    A rank must not end in Python's exit: a gloo thread of DDP's, freeing a finished collective's tensors there,
    took the GIL and aborted the rank (seen in CI; gdb on a core: ~AsyncAllgatherWork in runLoop, take_gil ->
    pthread_exit -> terminate; ~1 run in 40 with two runs side by side on 2 cores). The race is rare; whether a
    rank skipped the exit is certain."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, os\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        "    atexit.register(print, 'a rank in Python exit', flush=True)\n")
    return {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), ENV.get("PYTHONPATH")]))}


def test_torchrun_two_processes_equal_one_with_muon(dataset, tmp_path):
    # Every rank runs the same Muon step on the same all-reduced gradients (measured: 2e-7 apart at most, the
    # same float32 rounding as with AdamW; the bfloat16 Newton-Schulz steps do not amplify it). AdamW across
    # processes is the SLURM test's: the same DDP code, reached through the other launcher's variables.
    one = fork_train(dataset, tmp_path / "one", *SAME_GLOBAL_BATCH, "--muon=True")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             TRAIN, f"--dataset={dataset}", f"--out_dir={tmp_path / 'two'}", *TINY, *SAME_GLOBAL_BATCH,
                             "--muon=True"], capture_output=True, text=True, env=telling_python_exit(tmp_path),
                            timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a rank in Python exit" not in result.stdout
    one = finish(one)
    assert "2 process(es)" in result.stdout
    # Rank 1 prints nothing: the lines of both ranks together are one process's.
    assert result.stdout.count("eval iter 8:") == 1
    assert result.stdout.count("optimizer:") == one.stdout.count("optimizer:") > 0
    assert_same_losses(tmp_path / "two", read_log(tmp_path / "one"))


def test_slurm_variables_two_processes_equal_one(dataset, tmp_path):
    # What srun gives each task, plus MASTER_ADDR/MASTER_PORT from the sbatch script; no torchrun variables.
    # Each task is forked from the warm script runner: real processes and gloo, no torch import each.
    one = fork_train(dataset, tmp_path / "one", *SAME_GLOBAL_BATCH)
    port = free_port()
    tasks = [fork_train(dataset, tmp_path / "two", *SAME_GLOBAL_BATCH, environ=srun_task(task, port))
             for task in range(2)]
    outputs = [finish(task) for task in tasks]
    finish(one)
    assert "2 process(es)" in outputs[0].stdout and "eval iter" not in outputs[1].stdout
    assert_same_losses(tmp_path / "two", read_log(tmp_path / "one"))


# -----------------------------------------------------------------------------------------------------
# resume and preemption

@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(dataset, tmp_path, optimizer):
    # Dropout and 2 micro-steps, so the torch RNG and both data generators must come back as they were; with
    # Muon, its momentum buffers and the AdamW moments of the other tensors too.
    args = ["--dropout=0.1", "--total_batch_size=256", "--eval_interval=4", "--lr_decay_iters=12",
            "--always_save_checkpoint=True", f"--muon={optimizer == 'muon'}"]
    whole = fork_train(dataset, tmp_path / "whole", *args, "--max_iters=12", "--milestones=[4,10]")
    first_half = train(dataset, tmp_path / "halves", *args, "--max_iters=6")
    # the first half stops mid-cosine, and says so; the whole run decays to min_lr, and says nothing
    assert "note: lr_decay_iters=12 is past max_iters=6: the lr ends above min_lr" in first_half.stdout
    assert "lr_decay_iters" not in finish(whole).stdout.replace("lr_decay_iters=12,", "")
    assert load(tmp_path / "halves" / "ckpt.pt")["iter_num"] == 6
    result = train(dataset, tmp_path / "halves", *args, "--max_iters=12", "--init_from=resume")
    assert "resuming at iter 6" in result.stdout
    whole_steps, whole_evals = read_log(tmp_path / "whole")
    halves_steps, halves_evals = read_log(tmp_path / "halves")
    assert halves_steps == whole_steps  # bit for bit: equal floats, not approximately
    assert halves_evals.pop(6) and halves_evals == whole_evals  # the first half's last eval is extra
    whole, halves = load(tmp_path / "whole" / "ckpt.pt"), load(tmp_path / "halves" / "ckpt.pt")
    assert whole["iter_num"] == halves["iter_num"] == 12
    assert all(torch.equal(whole["model"][k], halves["model"][k]) for k in whole["model"])
    # Milestone copies, kept beside ckpt.pt at the iterations asked for.
    assert [load(tmp_path / "whole" / f"ckpt_{it}.pt")["iter_num"] for it in (4, 10)] == [4, 10]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: the CPU runs cover the same loop")
def test_cuda_bf16_compiled_run_resumes_and_samples(dataset, tmp_path):
    # What CI can't run: CUDA, bf16 autocast, torch.compile, fused AdamW, pinned batches. CUDA's backward
    # (atomic adds) need not be bit for bit the same from run to run: the resumed losses are compared closely.
    args = ["--device=cuda", "--dtype=bfloat16", "--compile=True", "--total_batch_size=256",
            "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True"]
    whole = start_train(dataset, tmp_path / "whole", *args, "--max_iters=8")
    train(dataset, tmp_path / "halves", *args, "--max_iters=4")
    result = train(dataset, tmp_path / "halves", *args, "--max_iters=8", "--init_from=resume")
    assert "resuming at iter 4" in result.stdout
    finish(whole)
    whole_steps, _ = read_log(tmp_path / "whole")
    halves_steps, _ = read_log(tmp_path / "halves")
    assert whole_steps[max(whole_steps)] < whole_steps[min(whole_steps)] and set(halves_steps) == set(whole_steps)
    assert all(abs(halves_steps[i] - whole_steps[i]) < 2e-2 for i in whole_steps), (halves_steps, whole_steps)
    checkpoint = load(tmp_path / "halves" / "ckpt.pt")
    assert checkpoint["train_config"]["device"].startswith("cuda") and checkpoint["iter_num"] == 8
    sample = subprocess.run([sys.executable, str(REPO / "sample.py"), f"--out_dir={tmp_path / 'halves'}",
                             "--device=cuda", "--num_samples=1", "--max_new_tokens=40", "--start=ROMEO:"],
                            capture_output=True, text=True, env=ENV, timeout=120)
    assert sample.returncode == 0 and "bfloat16" in sample.stderr, sample.stdout + sample.stderr


def test_compile_without_a_c_compiler_trains_uncompiled_and_says_so(dataset, tmp_path):
    # A GPU machine without gcc or clang (Docker's CUDA runtime images): Triton can't build the launchers of
    # torch.compile's kernels, and the first step would end in a traceback. torch.compile on the CPU needs a compiler
    # too: a run with none on its PATH goes the same way, noted, then trained uncompiled.
    run = fork_train(dataset, tmp_path / "out", "--compile=True", "--max_iters=2", "--total_batch_size=None",
                     environ={"PATH": str(tmp_path), "CC": ""})
    result = finish(run)
    assert "note: no C compiler (gcc, clang or $CC)" in result.stdout and "compile=False" in result.stdout


def signal_when(process, *steps):
    """steps: (prefix, signal) pairs: send each signal once a line of stdout starts with its prefix, in turn.
    (stdout, stderr) at the end."""
    output, steps = [], list(steps)
    for line in process.stdout:
        output.append(line)
        if line.startswith(steps[0][0]):
            process.send_signal(steps.pop(0)[1])
            if not steps:
                break
    stdout, stderr = process.communicate(timeout=60)
    return "".join(output) + stdout, stderr


def test_sigterm_saves_whether_in_an_eval_or_a_step_and_nothing_is_overwritten(dataset, tmp_path):
    # In float16, so that the GradScaler's state goes through the checkpoint too (autocast works on the CPU).
    out_dir = tmp_path / "out"
    args = ["--max_iters=1000000", "--eval_interval=100000", "--total_batch_size=None", "--dtype=float16"]
    # 1. During an eval of 100,000 batches (minutes): it stops between two batches and saves.
    started = time.time()
    stdout, stderr = signal_when(start_train(dataset, out_dir, *args, "--eval_iters=100000"), ("model:", signal.SIGTERM))
    assert "stopped by SIGTERM after iter 0" in stdout and time.time() - started < 60, stdout + stderr
    assert load(out_dir / "ckpt_stopped.pt")["iter_num"] == 0 and not (out_dir / "log.jsonl").exists()  # no eval
    assert not (out_dir / "ckpt.pt").exists()  # no eval saved one
    # 2. A fresh run into that out_dir is refused: the checkpoint and the log stay as they were.
    (out_dir / "log.jsonl").write_text("{}\n")
    saved = (out_dir / "ckpt_stopped.pt").read_bytes()
    result = run_train(dataset, out_dir, "--max_iters=2")
    assert_one_error_line(result, "ckpt_stopped.pt exists", "--init_from=resume, or")  # no copy hint
    assert (out_dir / "ckpt_stopped.pt").read_bytes() == saved and (out_dir / "log.jsonl").read_text() == "{}\n"
    (out_dir / "log.jsonl").unlink()
    # 3. init_from=auto resumes; a temporary left by a save killed mid-write (its process gone) is cleaned.
    (out_dir / "ckpt.pt.tmp.999999999").write_bytes(b"partial")
    stdout, stderr = signal_when(start_train(dataset, out_dir, *args, "--init_from=auto"), ("iter 3:", signal.SIGTERM))
    assert "resuming at iter 0" in stdout and "stopped by SIGTERM" in stdout, stdout + stderr
    assert not (out_dir / "ckpt.pt.tmp.999999999").exists()
    checkpoint = load(out_dir / "ckpt_stopped.pt")
    stopped_at = checkpoint["iter_num"]
    assert stopped_at >= 3 and checkpoint["optimizer"] is not None
    assert checkpoint["scaler"]["_growth_tracker"] == stopped_at  # steps since the scale last changed: all
    assert max(read_log(out_dir)[0]) == stopped_at  # the step in flight was finished and logged, no more
    # 4. A resume whose first eval saves ckpt.pt, then killed (-9, nothing runs): the stop's state went with that
    # save, or the next resume would go on from it, older than ckpt.pt, with an older best_val_loss
    resumed = start_train(dataset, out_dir, "--init_from=resume", *args[:1], f"--eval_interval={stopped_at}", *args[2:])
    signal_when(resumed, (f"iter {stopped_at + 1}:", signal.SIGKILL))
    assert load(out_dir / "ckpt.pt")["iter_num"] == stopped_at and not (out_dir / "ckpt_stopped.pt").exists()
    train(dataset, out_dir, "--init_from=resume", f"--max_iters={stopped_at + 2}", *args[1:],
          "--always_save_checkpoint=True")
    resumed = load(out_dir / "ckpt.pt")
    assert resumed["iter_num"] == stopped_at + 2
    assert resumed["scaler"]["_growth_tracker"] == stopped_at + 2  # the scaler went on, it did not restart


def test_a_stop_in_the_last_step_leaves_the_final_eval_and_milestone_to_the_resume(trained, dataset, tmp_path):
    # The checkpoint of iter 40 (128 tokens a step), resumed for 2 steps of 256 tokens. SIGTERM after step 41's line
    # lands in step 42 (on a slow machine, in the final eval of 100,000 batches): either way ckpt_stopped.pt is saved
    # at max_iters, before the final eval and the milestone of 42, which the next resume must then make. A best val
    # loss of 0 is never beaten: ckpt.pt, the best, is never replaced, not by the stop nor by the resumed run.
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    torch.save(dict(load(trained / "ckpt.pt"), best_val_loss=0.0), out_dir / "ckpt.pt")
    best = (out_dir / "ckpt.pt").read_bytes()
    args = ["--init_from=resume", "--max_iters=42", "--total_batch_size=256", "--eval_interval=100000",
            "--milestones=[42]"]
    stdout, stderr = signal_when(start_train(dataset, out_dir, *args, "--eval_iters=100000"), ("iter 41:", signal.SIGTERM))
    assert "stopped by SIGTERM after iter 42" in stdout and "eval iter" not in stdout, stdout + stderr
    assert not (out_dir / "ckpt_42.pt").exists() and (out_dir / "ckpt.pt").read_bytes() == best
    assert load(out_dir / "ckpt_stopped.pt")["iter_num"] == 42
    result = train(dataset, out_dir, *args, "--sample_prompt=the")
    assert "resuming at iter 42" in result.stdout and "sample iter 42: " in result.stdout, result.stdout
    evals = [r for r in map(json.loads, (out_dir / "log.jsonl").read_text().splitlines()) if "val_loss" in r]
    assert [e["iter"] for e in evals] == [42] and load(out_dir / "ckpt_42.pt")["iter_num"] == 42
    # log.jsonl's tokens are those trained: 40 steps of 128 tokens, then 2 of 256 (not 42 x 256)
    assert evals[0]["tokens"] == 40 * 128 + 2 * 256
    # the run is over: the stop's state is gone, the best stays
    assert not (out_dir / "ckpt_stopped.pt").exists() and (out_dir / "ckpt.pt").read_bytes() == best


def test_ctrl_c_twice_stops_at_once_in_one_line(dataset, tmp_path):
    # Eval batches of 2048 x 128 tokens through 4 layers 64 wide take seconds: the second Ctrl-C mostly comes before
    # the first one's stop, which waits for the batch to end, and stops the run at once, unsaved. On a loaded machine
    # the first stop may be over by then: the second then lands in Python's exit (the next test), with nothing left
    # to stop. Both are one line; a second Ctrl-C that did nothing would always look like the latter, so one of three
    # tries must stop at once.
    for attempt in range(3):
        out_dir = tmp_path / f"out{attempt}"
        process = start_train(dataset, out_dir, "--max_iters=1000000", "--eval_iters=100000", "--batch_size=2048",
                              "--block_size=128", "--n_layer=4", "--n_embd=64")
        stdout, stderr = signal_when(process, ("model:", signal.SIGINT), ("SIGINT: finishing", signal.SIGINT))
        if process.returncode == 1:
            assert_one_error_line(subprocess.CompletedProcess([], 1, stdout, stderr), "interrupted")
            assert not (out_dir / "ckpt.pt").exists()
            return
        assert process.returncode == 0 and stderr == "" and (out_dir / "ckpt.pt").exists(), (stdout, stderr)
    pytest.fail("the second Ctrl-C never stopped the run at once")


def test_ctrl_c_twice_in_a_rank_stops_it_in_one_line(dataset, tmp_path):
    # Under DDP, torch's excepthook holds back the line train.py's hook prints, and prints it once the hook
    # returns: leaving from inside the hook (as one process does) lost it. Two tasks forked as srun starts them
    # get both Ctrl-Cs, as a terminal's reach every process; as in the test above, one of three tries must stop
    # them at once.
    for attempt in range(3):
        out_dir, port = tmp_path / f"out{attempt}", free_port()
        tasks = [fork_train(dataset, out_dir, "--max_iters=1000000", "--eval_iters=100000", "--batch_size=2048",
                            "--block_size=128", "--n_layer=4", "--n_embd=64", "--timeout=30",
                            environ=srun_task(task, port))
                 for task in range(2)]
        if "pid" not in tasks[0]:
            pytest.skip("the script runner could not fork the tasks (its imports printed or started a thread)")
        for awaited in ("model:", "SIGINT: finishing"):
            deadline = time.time() + 120
            while awaited not in Path(tasks[0]["stdout"]).read_text() and time.time() < deadline:
                time.sleep(0.05)
            for task in tasks:
                os.kill(task["pid"], signal.SIGINT)
        rank0, rank1 = [outcome(task) for task in tasks]
        if rank0.returncode == 1:
            lines = [line for line in rank0.stderr.splitlines() if line.startswith("[rank0]:")]
            assert lines == ["[rank0]: error: interrupted: stopped at once, without saving (one Ctrl-C saves first)"], (
                rank0.stdout[-2000:], rank0.stderr[-2000:])
            assert rank1.returncode == 1 and rank1.stderr.count("[rank1]: error: ") == 1, rank1.stderr[-2000:]
            assert not (out_dir / "ckpt.pt").exists()
            return
        assert rank0.returncode == 0 and (out_dir / "ckpt.pt").exists(), (rank0.stdout, rank0.stderr)
    pytest.fail("the second Ctrl-C never stopped rank 0 at once")


def test_ctrl_c_in_pythons_exit_is_no_traceback(dataset, tmp_path):
    # The first Ctrl-C's stop is over, and Python's exit runs its atexit callbacks: a second Ctrl-C there would print
    # "Exception ignored in atexit callback" and a traceback. A callback that waits for the test holds the exit open
    # (as a slow one of torch's or wandb's would), and runs last: train.py's own are registered after it.
    code = ("import atexit, runpy, select, sys\n"
            "atexit.register(lambda: print('exiting', flush=True) or select.select([sys.stdin], [], [], 60))\n"
            "sys.argv.pop(0)\n"  # "-c"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    process = subprocess.Popen([sys.executable, "-c", code, TRAIN, f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}",
                                *TINY, "--max_iters=1000000", "--eval_interval=100000", "--total_batch_size=None"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**ENV, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    stdout, stderr = signal_when(process, ("iter 3:", signal.SIGINT), ("exiting", signal.SIGINT))
    assert "stopped by SIGINT after iter" in stdout, stdout + stderr
    assert (tmp_path / "out" / "ckpt_stopped.pt").exists()
    assert process.returncode == 0 and stderr == ""


def test_nothing_to_train_says_so_and_a_resume_with_other_eval_batches_is_noted(trained, dataset, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for name in ("ckpt.pt", "log.jsonl"):
        (out_dir / name).write_bytes((trained / name).read_bytes())
    resumed = fork_train(dataset, out_dir, "--init_from=resume", "--max_iters=40", "--seed=7", "--batch_size=8",
                         "--eval_iters=2")
    scratch = finish(fork_train(dataset, tmp_path / "scratch", "--max_iters=0"))
    resumed = finish(resumed)
    assert "nothing to train: the run starts at iter 40, max_iters=40" in resumed.stdout
    # the eval batches come from the seed, batch_size and eval_iters: best_val_loss was measured on other ones
    for setting in ("seed=7", "batch_size=8", "eval_iters=2"):
        assert f"note: {setting}, not the checkpoint's: other eval batches than best_val_loss's" in resumed.stdout
    for name in ("ckpt.pt", "log.jsonl"):  # no eval logged, nothing saved
        assert (out_dir / name).read_bytes() == (trained / name).read_bytes()
    assert "nothing to train: the run starts at iter 0, max_iters=0" in scratch.stdout and not (tmp_path / "scratch").exists()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds rank 1's process through Linux's /proc")
def test_a_frozen_rank_stops_the_other_after_the_timeout(dataset, tmp_path):
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 TRAIN, f"--dataset={dataset}", f"--out_dir={tmp_path / 'out'}", *TINY,
                                 "--max_iters=1000000", "--eval_interval=100000", "--timeout=3", "--log_interval=50",
                                 "--total_batch_size=None"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=telling_python_exit(tmp_path), cwd=tmp_path)

    def iter_50():  # rank 0 prints; rank 1 is training too by then. A line per 50 steps only:
        for line in launcher.stdout:  # a full pipe would block rank 0 outside any collective
            if line.startswith("iter 50:"):
                return

    stdout, stderr, seconds = freeze_rank_1(launcher, iter_50)
    assert launcher.returncode != 0 and seconds < 150  # far below --timeout's default of 600 s
    rank0 = [line for line in stderr.splitlines() if line.startswith("[rank0]:")]  # torchrun's prefix
    assert len(rank0) == 1, stderr[-3000:]
    assert rank0[0].startswith("[rank0]: error: rank 0 lost contact with the other ranks (Timed out")
    assert "rank 1 hangs" in rank0[0], stderr[-3000:]
    assert "a rank in Python exit" not in stdout  # rank 0's error ends as its last step does


def test_a_mistake_of_one_rank_alone_is_its_line_and_the_master_lost_contact(dataset, tmp_path):
    # srun on two nodes, the dataset missing on the second: rank 1 says so (the master says a shared mistake,
    # and torchrun stops the others before they repeat it; here the master never sees it), and the master,
    # waiting for rank 1 in init_process_group, says it lost contact rather than ending in a traceback.
    port, tasks = free_port(), []
    for task, data in enumerate([dataset, tmp_path / "only_on_node_1"]):
        tasks.append(fork_train(data, tmp_path / "out", "--timeout=5", environ=srun_task(task, port, local_id=0)))
    master, rank1 = [outcome(task) for task in tasks]
    assert_one_error_line(rank1, f"rank 1: no dataset at {str(tmp_path / 'only_on_node_1')!r}")
    assert_one_error_line(master, "rank 0 lost contact with the other ranks (Timed out after")


def test_a_lost_rank_is_said_to_hang_only_when_a_collective_timed_out():
    """The line of a rank that lost the others says "hangs" on a timeout, "stopped" otherwise: not "hangs" for
    any message with "out" in it ("without", "about"). train.py runs at import: its function's own text is run."""
    namespace = {"re": re, "rank": 0, "world_size": 2}
    exec(function_source("train.py", "lost_contact"), namespace)
    timed_out = ["[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv "
                 "operation to complete",  # gloo's, as the frozen-rank test above gets it
                 "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran "
                 "for 600031 milliseconds before timing out.", "Socket Timeout", "connect: ETIMEDOUT"]
    other = ["[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:37449",
             "NCCL error: the remote process exited without a reply", "Connection reset by peer after about 3 s"]
    for message in timed_out + other:
        line = namespace["lost_contact"](RuntimeError(message))
        reason = line.split("rank 0 lost contact with the other ranks (", 1)[1]
        assert not reason.startswith("["), line  # the "[file:line] " before the message is cut
        assert line.endswith("rank 1 hangs" if message in timed_out else "rank 1 stopped"), line


def test_the_defaults_are_lillms_recipe_but_for_the_settings_the_comment_names():
    """config/lillm.py is the recipe's source of truth; train.py's settings comment names every default that
    differs from it, and only those."""
    result = subprocess.run([sys.executable, TRAIN, "--help"], capture_output=True, text=True, env=ENV, timeout=60)
    defaults = dict(line[4:].split("=", 1) for line in result.stdout.splitlines() if line.startswith("  --"))
    defaults = {key: ast.literal_eval(value) for key, value in defaults.items()}
    preset = {}
    exec((REPO / "config" / "lillm.py").read_text(), preset)
    differ = {key for key, value in preset.items() if not key.startswith("_") and defaults[key] != value}
    comment = re.search(r"((?:^#.*\n)+)out_dir = ", Path(TRAIN).read_text(), re.M)[1]  # the lines above it
    assert differ == {key for key in defaults if re.search(rf"\b{key}\b", comment)}, comment


def test_non_finite_loss_stops_with_the_iteration(dataset, tmp_path):
    # A learning rate of 1e30 without clipping blows the weights up within a few steps.
    result = run_train(dataset, tmp_path / "out", "--learning_rate=1e30", "--warmup_iters=0", "--grad_clip=0",
                       "--max_iters=50", "--total_batch_size=None")
    assert result.returncode == 1
    assert result.stderr.startswith("error: the loss is ") and " at iter " in result.stderr
    assert "learning_rate" in result.stderr and result.stderr.count("\n") == 1
    assert "resume" not in result.stderr  # no checkpoint was saved: none to resume from


def test_a_diverged_run_never_replaces_the_last_good_checkpoint(trained, dataset, tmp_path):
    # A learning rate of 1e300 turns the weights to inf and NaN in one step, whose loss (on the weights before it)
    # is still finite. Then an eval at 41 (saved by always_save_checkpoint), or a milestone without an eval, would save
    # them over the good checkpoint of iter 40.
    runs = {}
    for name, args in [("eval", ["--always_save_checkpoint=True", "--eval_interval=41"]),
                       ("milestone", ["--milestones=[41]", "--eval_interval=100"])]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "ckpt.pt").write_bytes((trained / "ckpt.pt").read_bytes())
        runs[name] = fork_train(dataset, tmp_path / name, "--init_from=resume", "--max_iters=50", "--grad_clip=0",
                                "--learning_rate=1e300", "--min_lr=0", "--warmup_iters=0", "--total_batch_size=None",
                                *args)
    for name, what in [("eval", "the eval loss is nan at iter 41"), ("milestone", "the weights are not finite at iter 41")]:
        result = outcome(runs[name], timeout=120)
        assert_one_error_line(result, what, "training diverged, nothing saved", "--init_from=resume goes on from")
        assert (tmp_path / name / "ckpt.pt").read_bytes() == (trained / "ckpt.pt").read_bytes()
        assert sorted(path.name for path in (tmp_path / name).iterdir()) == ["ckpt.pt", "log.jsonl"]


# -----------------------------------------------------------------------------------------------------
# one writer per out_dir, and a full disk during a save

def test_two_runs_into_one_out_dir_one_refuses(dataset, tmp_path):
    # Two processes (forked from the warm script runner) started together into one out_dir, and a third into its
    # own as the reference.
    args = ["--max_iters=20", "--eval_interval=10", "--total_batch_size=None", "--always_save_checkpoint=True"]
    runs = [fork_train(dataset, tmp_path / out, *args) for out in ("shared", "shared", "alone")]
    results = [outcome(run) for run in runs]
    shared = tmp_path / "shared"
    refused = [result for result in results[:2] if result.returncode != 0]
    assert len(refused) == 1, [result.stderr[-2000:] for result in results]
    assert_one_error_line(refused[0], f"{shared}: another run is writing there")
    assert results[2].returncode == 0, results[2].stderr[-2000:]
    # The one that ran is a clean run: its log and checkpoint are exactly the reference's.
    assert read_log(shared) == read_log(tmp_path / "alone")
    assert len((shared / "log.jsonl").read_text().splitlines()) == 20 + 3
    assert torch.equal(load(shared / "ckpt.pt")["model"]["lm_head.weight"],
                       load(tmp_path / "alone" / "ckpt.pt")["model"]["lm_head.weight"])
    # (kill -9 and a rerun: the same lock_directory, in train_bpe_cpu.py's and prepare_data.py's tests)


def limit_file_size(size):
    """For preexec_fn: files of at most `size` bytes, and a write past it fails with EFBIG (as on a full disk)
    rather than SIGXFSZ killing the process."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return limit


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(trained, dataset, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "ckpt.pt").write_bytes((trained / "ckpt.pt").read_bytes())
    saved = (out_dir / "ckpt.pt").read_bytes()
    assert len(saved) > 50_000  # the premise: the limit below stops the checkpoint, not log.jsonl
    result = subprocess.run([sys.executable, TRAIN, f"--dataset={dataset}", f"--out_dir={out_dir}", *TINY,
                             "--init_from=resume", "--max_iters=42", "--eval_interval=2", "--total_batch_size=None",
                             "--always_save_checkpoint=True"], capture_output=True, text=True, env=ENV,
                            timeout=120, preexec_fn=limit_file_size(50_000))
    assert_one_error_line(result, f"can't write {out_dir / 'ckpt.pt'}", "no space left", "checkpoint is kept")
    assert (out_dir / "ckpt.pt").read_bytes() == saved
    assert sorted(path.name for path in out_dir.iterdir()) == ["ckpt.pt", "log.jsonl"]  # no temporary left


def test_help_says_that_a_preset_runs_as_code():
    result = subprocess.run([sys.executable, TRAIN, "--help"], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 0 and "--learning_rate=0.001" in result.stdout
    assert "a preset is Python and runs as code: use only presets you trust" in result.stdout


# -----------------------------------------------------------------------------------------------------
# user mistakes: one line on stderr, a non-zero exit, no traceback

def broken_dataset(dataset, directory, edit):
    """A copy of the dataset with one thing broken by edit(directory, meta); its meta.json is written after."""
    directory.mkdir()
    for shard in dataset.glob("*.npy"):
        (directory / shard.name).write_bytes(shard.read_bytes())
    meta = edit(directory, json.loads((dataset / "meta.json").read_text()))
    if meta is not None:  # None: edit() made meta.json itself
        (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def shrink_vocab(directory, meta):  # as if meta.json were edited: the shards hold ids past it
    return dict(meta, vocab_size=10, max_token_id=9, chars=meta["chars"][:10])


def resave_shard(directory, meta, change):
    shard = directory / "val_000000.npy"
    np.save(shard, change(np.load(shard)))
    return meta


def another_datasets_shard(directory, meta):
    """As prepare_data.py writes meta.json (its args hold shard_size), but train_000000.npy copied from elsewhere."""
    shard_size = len(np.load(directory / "train_000000.npy", mmap_mode="r"))
    (directory / "train_000000.npy").write_bytes((directory / "val_000000.npy").read_bytes())
    return dict(meta, args={"shard_size": shard_size})


def huge_file(path):
    """A file of 1 TiB that takes no disk: sparse, as `truncate -s 1T` makes it."""
    path.touch()
    os.truncate(path, 2**40)


def truncate_shard(directory, meta):
    shard = directory / "val_000000.npy"
    shard.write_bytes(shard.read_bytes()[:1000])
    return meta


# (command-line arguments, what the one line must say); DATA is a broken copy of the dataset, made by the fixture
MISTAKES = {
    "type": (["--batch_size=abc"], "batch_size must be int, got 'abc'"),
    "eval_only": (["--eval_only=True"], "eval_only=True evaluates a checkpoint: add --init_from=resume"),
    "hellaswag_interval": (["--hellaswag_interval=3", "--eval_interval=2"],
                           "hellaswag_interval=3 is not a multiple of eval_interval=2"),
    "sample_prompt": (["--sample_prompt=\u263a"], "sample_prompt='\u263a' has characters the vocabulary lacks"),
    "eval_only, nothing to resume": (["--eval_only=True", "--init_from=auto"], "eval_only=True: there is no"),
    # (a BOM, U+2028 inside a text, a label as a string: the file loads, and the next check speaks)
    "hellaswag, unicode": (["--hellaswag_interval=1000", "--hellaswag=TMP/unicode.jsonl", "--eval_only=True",
                            "--init_from=auto"], "eval_only=True: there is no"),
    "hellaswag, empty": (["--hellaswag_interval=1000", "--hellaswag=TMP/empty.jsonl"], "the file holds no examples"),
    "hellaswag, label": (["--hellaswag_interval=1000", "--hellaswag=TMP/label.jsonl"],
                         "label.jsonl, line 1: not a HellaSwag example"),
    "hellaswag, not JSON": (["--hellaswag_interval=1000", "--hellaswag=TMP/garbled.jsonl"],
                            "garbled.jsonl, line 2: not a HellaSwag example"),
    "hellaswag, no file": (["--hellaswag_interval=1000", "--hellaswag=TMP/nowhere.jsonl"],
                           "nowhere.jsonl: can't read it ([Errno 2] No such file or directory"),
    "unknown": (["--batchsize=3"], "unknown setting 'batchsize' (did you mean 'batch_size'?)"),
    "preset": (["PRESET"], "PRESET: unknown setting 'learning_rat'"),
    "vocab_size": (["--vocab_size=10"], "vocab_size=10 but the dataset's vocabulary has"),
    "batch": (["--total_batch_size=1000"], "not a multiple of batch_size*block_size*world_size = 4*32*1 = 128"),
    "no dataset": (["--dataset=TMP/nowhere"], "python prepare_data.py"),
    "no value": (["--batch_size"], "--batch_size: expected --key=value"),
    "no preset": (["nowhere.py"], "no preset file 'nowhere.py'"),
    "init_from": (["--init_from=restart"], "init_from='restart': must be 'scratch', 'resume' or 'auto'"),
    "dtype": (["--dtype=fp8"], "dtype='fp8': must be 'auto', 'float32', 'bfloat16' or 'float16'"),
    "compile": (["--compile='yes'"], "compile='yes': must be 'auto', True or False"),
    "milestones": (["--milestones=[2.5]"], "milestones=[2.5]: must be a list of iteration numbers"),
    "positive": (["--eval_iters=0"], "eval_iters=0: must be positive"),
    "negative": (["--max_iters=-1"], "max_iters=-1: must be 0 or more"),
    "heads": (["--n_head=3"], "n_head must divide n_embd"),
    "timeout": (["--timeout=0"], "timeout=0"),
    # else DDP's timedelta overflows, a traceback (max_iters=0: one process would not train either way)
    "timeout huge": (["--timeout=1000000000000000", "--max_iters=0"],
                     "timeout=1000000000000000: must be at most a year (31536000)"),
    "total_batch_size": (["--total_batch_size=0"], "total_batch_size=0: must be positive"),
    "learning_rate": (["--learning_rate=-1"], "learning_rate=-1.0"),
    "dropout": (["--dropout=1.5"], "dropout=1.5: must be in [0, 1)"),
    # a resume takes this run's dropout: checked as it is, not blamed on the checkpoint
    "dropout on resume": (["--dropout=1.5", "--init_from=resume", "--out_dir=TMP/adamw", "--max_iters=0"],
                          "dropout=1.5: must be in [0, 1)"),
    # else an MLP of 0 units, silently
    "ffn_ratio": (["--ffn_ratio=0", "--max_iters=2"], "ffn_ratio=0.0: must be positive"),
    "beta2": (["--beta2=1.5"], "beta2=1.5"),
    "tpu": (["--device=tpu"], "device='tpu': must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    "mps": (["--device=mps"], "no MPS"),
    "out_dir a file": (["--out_dir=TMP/file"], "a file is in the way"),
    "out_dir under a file": (["--out_dir=TMP/file/out"], "a file is in the way"),
    "out_dir unwritable": (["--out_dir=/sys/lillm_test_out"], "can't write in out_dir"),
    "meta a list": (["--dataset=DATA"], "is not the meta.json"),
    "meta empty": (["--dataset=DATA"], "is not the meta.json"),
    "shard outside": (["--dataset=DATA"], "only plain file names"),
    "shard deleted": (["--dataset=DATA"], "is missing", "or delete"),
    "shard truncated": (["--dataset=DATA"], "unreadable"),
    # Found in the first batch, not at start-up (which reads only the shards' headers): its own out_dir.
    "ids past vocab": (["--dataset=DATA", "--out_dir=TMP/found_in_a_batch"], "holds token id",
                       "past the vocabulary", "(0..9)"),
    # The ranges of the settings, and the shards' and meta.json's numbers
    "seed": (["--seed=18446744073709551616"], "seed=18446744073709551616: must be in 0..2**64-1"),
    "n_embd negative": (["--n_embd=-4"], "n_embd=-4", "positive"),
    "n_embd zero": (["--n_embd=0"], "n_embd=0", "positive"),  # else a model of no parameters, silently
    "rate infinite": (["--learning_rate=1e400"], "learning_rate=inf: must be finite"),
    # 50,000 characters: a MemoryError in ast.literal_eval, were it not refused first
    "long value": (["--seed=" + "-" * 49_999 + "1"], "--seed: a value of at most 1,000"),
    "preset exits": (["EXITING"], "EXITING: the preset called sys.exit(0)"),
    "preset raises": (["TMP/raising.py"], "raising.py: ZeroDivisionError: integer division"),
    "shard 2-D": (["--dataset=DATA"], "val_000000.npy holds a 2-D array of uint16"),
    "shard float32": (["--dataset=DATA"], "val_000000.npy holds a 1-D array of float32"),
    "shard int64 negative": (["--dataset=DATA"], "val_000000.npy holds a 1-D array of int64"),
    "vocab 10^12": (["--dataset=DATA"], "is not the meta.json of a finished prepare_data.py run"),
    "chars cut short": (["--dataset=DATA"], "meta.json says vocab_size", "but its tokenizer has 10 ids"),
    # Shards that disagree with meta.json's counts, found from their headers: each named
    "shard of another dataset": (["--dataset=DATA"], "train_000000.npy holds 20,000 tokens, meta.json 90,000",
                                 "another dataset's shard"),
    "shard short, no shard_size": (["--dataset=DATA"], "val_000000.npy holds 1,000 tokens, meta.json 20,000"),
    # Files read whole: a device, a FIFO or a huge (sparse) file is refused before it is read
    "meta.json a device": (["--dataset=DATA"], "meta.json: not a regular file of at most 67,108,864 bytes"),
    "meta.json a FIFO": (["--dataset=DATA"], "meta.json: not a regular file of at most 67,108,864 bytes"),
    "meta.json huge": (["--dataset=DATA"], "meta.json: not a regular file of at most 67,108,864 bytes"),
    "preset huge": (["HUGE"], "huge.py: not a regular file of at most 1,048,576 bytes"),
    "hellaswag a device": (["--hellaswag_interval=1000", "--hellaswag=/dev/zero"], "/dev/zero: not a regular file"),
    # bytes that are not UTF-8 (Python escapes them as surrogates in sys.argv)
    "not UTF-8": (["--wandb_run_name=A\udcff"], "b'--wandb_run_name=A\\xff': not UTF-8 text"),
    "short split": (["--block_size=100000", "--total_batch_size=None"], "split of", "fewer than block_size+1 = 100001 tokens"),
    "config vs weights": (["--init_from=resume", "--out_dir=TMP/misfit"], "does not fit"),
    "no training state": (["--init_from=resume", "--out_dir=TMP/bare"], "lacks the training state"),
    # Resuming with the other optimizer: its state would not fit.
    "adamw resumed with muon": (["--init_from=resume", "--out_dir=TMP/adamw", "--muon=True"],
                                "was trained with muon=False: resume with --muon=False"),
    "muon resumed with adamw": (["--init_from=resume", "--out_dir=TMP/muon"],
                                "was trained with muon=True: resume with --muon=True"),
    # Another char-level dataset: the line names the dataset the checkpoint was trained on (not two {'kind': 'char'})
    "other characters": (["--dataset=DATA", "--init_from=resume", "--out_dir=TMP/adamw", "--max_iters=0"],
                         "other_characters's tokenizer is not the one", "was trained with (on DATASET)"),
    # Only a milestone copy (ckpt.pt was never saved, or deleted): resume reads ckpt.pt, so the hint says to copy it.
    "milestone alone": (["--init_from=auto", "--out_dir=TMP/milestone"], "ckpt_10.pt exists", "once it is copied to ckpt.pt"),
}
if importlib.util.find_spec("wandb") is None:  # where wandb is installed, the run would go on to log in
    MISTAKES["wandb missing"] = (["--wandb_log=True"], "wandb_log=True needs the wandb package")
BREAK = {
    "meta a list": lambda d, meta: [meta],
    "meta empty": lambda d, meta: {},
    "shard outside": lambda d, meta: dict(meta, shards=dict(meta["shards"], train=["../x.npy"])),
    "shard deleted": lambda d, meta: (d / "val_000000.npy").unlink() or meta,
    "shard truncated": truncate_shard,
    "ids past vocab": shrink_vocab,
    "shard 2-D": lambda d, meta: resave_shard(d, meta, lambda ids: ids[:len(ids) // 2 * 2].reshape(-1, 2)),
    "shard float32": lambda d, meta: resave_shard(d, meta, lambda ids: ids.astype(np.float32) + 0.5),
    "shard int64 negative": lambda d, meta: resave_shard(d, meta, lambda ids: ids.astype(np.int64) - 1),
    "vocab 10^12": lambda d, meta: dict(meta, vocab_size=10**12),
    "chars cut short": lambda d, meta: dict(meta, chars=meta["chars"][:10]),
    "shard of another dataset": another_datasets_shard,
    "shard short, no shard_size": lambda d, meta: resave_shard(d, meta, lambda ids: ids[:1000]),
    "meta.json a device": lambda d, meta: (d / "meta.json").symlink_to("/dev/zero"),
    "meta.json a FIFO": lambda d, meta: os.mkfifo(d / "meta.json"),
    "meta.json huge": lambda d, meta: huge_file(d / "meta.json"),
    "other characters": lambda d, meta: dict(meta, chars=meta["chars"][::-1]),
}


@pytest.fixture(scope="module")
def mistakes(dataset, trained, tmp_path_factory, script_runner):
    """Every case of MISTAKES, each a run of train.py forked from one process that imported torch once."""
    tmp = tmp_path_factory.mktemp("mistakes")
    (tmp / "preset.py").write_text("batch_size = 8\nlearning_rat = 1e-3\n")
    (tmp / "exiting.py").write_text("import sys\nsys.exit(0)\n")
    huge_file(tmp / "huge.py")
    (tmp / "file").write_text("not a directory")
    example = {"ctx": "a\u2028b", "endings": ["c", "d", "e", "f"], "label": "2"}
    (tmp / "unicode.jsonl").write_text(json.dumps(example, ensure_ascii=False) + "\n", encoding="utf-8-sig")
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "label.jsonl").write_text(json.dumps(dict(example, label=2.9)) + "\n")
    (tmp / "garbled.jsonl").write_text(json.dumps(example) + "\n" + json.dumps(example)[:-1] + "\n")
    (tmp / "raising.py").write_text("batch_size = 8 // 0\n")
    checkpoint = load(trained / "ckpt.pt")  # trained with AdamW
    for name, edit in [("adamw", {}), ("muon", {"train_config": dict(checkpoint["train_config"], muon=True)}),
                       ("misfit", {"model_config": dict(checkpoint["model_config"], n_layer=3)}),  # the weights have 2
                       ("bare", {"optimizer": None})]:  # as if written by another program: weights only
        (tmp / name).mkdir()
        torch.save(dict(checkpoint, **edit), tmp / name / "ckpt.pt")
    (tmp / "milestone").mkdir()
    torch.save(checkpoint, tmp / "milestone" / "ckpt_10.pt")
    commands = {}
    for name, (args, *_) in MISTAKES.items():
        data = broken_dataset(dataset, tmp / name.replace(" ", "_"), BREAK[name]) if name in BREAK else dataset
        args = [a.replace("PRESET", str(tmp / "preset.py")).replace("EXITING", str(tmp / "exiting.py"))
                .replace("HUGE", str(tmp / "huge.py"))
                .replace("TMP", str(tmp)).replace("DATA", str(data)) for a in args]
        commands[name] = [sys.executable, TRAIN, f"--dataset={dataset}", f"--out_dir={tmp / 'out'}", *TINY, *args]
    results = dict(zip(commands, script_runner.run(list(commands.values()), cwd=tmp, env=ENV)))
    return tmp, results


@pytest.mark.parametrize("case", MISTAKES)
def test_user_mistakes_get_one_line(mistakes, case, dataset):
    tmp, results = mistakes
    fragments = [m.replace("PRESET", str(tmp / "preset.py")).replace("EXITING", str(tmp / "exiting.py"))
                 .replace("DATASET", str(dataset))  # the one the checkpoints were trained on
                 for m in MISTAKES[case][1:]]
    assert_one_error_line(results[case], *fragments)
    assert not (tmp / "out").exists()  # nothing written before the mistake was found
    if case == "ids past vocab":  # start-up passed (the model was built): the batch's check found it
        assert "model:" in results[case].stdout and not list((tmp / "found_in_a_batch").iterdir())


def test_a_resume_keeps_the_checkpoints_model_and_takes_this_runs_training_settings(trained, dataset, tmp_path):
    """The accumulation comes from the block_size that the resume keeps (32), not the command line's (16):
    128 tokens a step is one micro-step of 4 x 32, and the one saved data stream goes on. The optimizer's
    moments come back, but its betas and weight decay are this run's, as its learning rate is; so is its
    dropout (nanoGPT's way: a fine-tune sets its own), which the model then has and the new checkpoint records."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    checkpoint = load(trained / "ckpt.pt")
    del checkpoint["tokens_trained"]  # as an older train.py saved it: its tokens count as 40 steps of 128
    torch.save(checkpoint, out_dir / "ckpt.pt")
    result = train(dataset, out_dir, "--init_from=resume", "--block_size=16", "--total_batch_size=128",
                   "--max_iters=41", "--eval_interval=100", "--always_save_checkpoint=True", "--weight_decay=0.5",
                   "--beta1=0.8", "--beta2=0.9", "--dropout=0.1")
    assert "block_size 32 x world_size 1 x accumulation 1" in result.stdout, result.stdout
    assert "keeps the checkpoint's block_size=32 (not 16)" in result.stdout
    assert "checkpoint's dropout" not in result.stdout
    assert "data streams" not in result.stdout
    assert json.loads((out_dir / "log.jsonl").read_text().splitlines()[-1])["tokens"] == 41 * 128
    saved = load(out_dir / "ckpt.pt")
    assert saved["iter_num"] == 41 and saved["train_config"]["weight_decay"] == 0.5
    assert saved["model_config"]["dropout"] == saved["train_config"]["dropout"] == 0.1
    assert saved["model_config"]["n_layer"] == 2 and saved["model_config"]["block_size"] == 32  # the shapes kept
    groups = saved["optimizer"]["param_groups"]  # the matrices', then the gains'
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [(0.5, (0.8, 0.9)), (0.0, (0.8, 0.9))]
    assert saved["optimizer"]["state"][0]["step"] == 41  # the moments went on from the checkpoint's
