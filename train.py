"""Pretrain the GPT of model.py on the token shards of prepare_data.py: on a CPU, one GPU, many
GPUs (torchrun) or many nodes (torchrun or SLURM's srun).

    python train.py config/shakespeare_char.py --batch_size=32  # a preset, then overrides
    python train.py config/quickstart.py --init_from=resume     # go on exactly where it stopped
    torchrun --standalone --nproc_per_node=8 train.py config/lillm.py
    srun python train.py config/lillm.py --init_from=auto       # SLURM: see the README

Presets and --key=value set the settings block's globals, in order;
a preset is Python and runs as code: use only presets you trust. One run at a time writes in an
out_dir. SIGTERM or Ctrl-C finishes the step in flight, saves out_dir/ckpt_stopped.pt, exits 0.
"""
import json, math, os, time
from dataclasses import asdict, fields
from datetime import timedelta

import numpy as np  # torch comes after the checks: mistakes show at once

# === the settings: lilLM's recipe (config/lillm.py), less what its preset sets for its run
# (out_dir, dataset, hellaswag_interval, sample_prompt, always_save_checkpoint, milestones)
out_dir = "out"                 # ckpt.pt, milestones' ckpt_<iter>.pt and log.jsonl go here
dataset = "data/fineweb"        # a directory of prepare_data.py's: shards and meta.json
init_from = "scratch"           # "scratch" (not over a checkpoint), "resume", "auto"
eval_interval = 1000            # train/val loss (and maybe a save) every this many steps
eval_iters = 100                # batches per split in each estimate
log_interval = 10               # print the step's loss and speed every this many
always_save_checkpoint = False  # save at every eval, not only when val loss improved
milestones = []                 # steps whose checkpoint is kept too, as ckpt_<iter>.pt
wandb_log, wandb_project, wandb_run_name = False, "lillm", "run"  # evals to Weights & Biases
hellaswag_interval = 0          # HellaSwag at evals whose step is a multiple of it; 0: off
hellaswag = "hub"               # "hub" (Rowan/hellaswag: 10,042 examples) or a local .jsonl
hellaswag_batch = 0             # examples (4 rows each) a forward; 0: 32 on CUDA, else 1
sample_prompt = ""              # each eval prints and logs 32 tokens sampled after it; "": off
eval_only = False               # with init_from="resume": the evals once, then exit
# batch: total_batch_size matters to the optimization; the others fit the hardware
batch_size = 64                 # sequences per device in one forward/backward (micro-step)
block_size = 512                # tokens per sequence: the model's context length
total_batch_size = 524288       # tokens per step, over ranks and micro-steps (None: one micro-step)
# model; vocab_size is the dataset's (meta.json) unless set (to pad it: 50257 -> 50304)
vocab_size = None
n_layer = 12
n_head = 16
n_kv_head = 8                   # key/value heads shared by the query heads; None: n_head
n_embd = 512
ffn_ratio = 8 / 3               # SwiGLU hidden / n_embd, up to 128s: GPT-2's MLP params
dropout = 0.0
# optimizer; get_lr schedules the learning rate
muon = False                    # Muon for the blocks' matrices, AdamW for the rest
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 20000               # optimizer steps in all
warmup_iters = 700
lr_decay_iters = 20000          # where the cosine reaches min_lr; usually max_iters
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95        # AdamW's averaging of the gradient and its square
grad_clip = 1.0                 # clip the gradient's global norm to this; 0: off
# system
device = "auto"                 # "auto": cuda if there is a GPU, else cpu; or "cuda:1", "mps"
dtype = "auto"                  # "auto": bfloat16 (float16 on old GPUs); float32 on a CPU
compile = "auto"                # torch.compile; "auto": on CUDA (a CPU loses by it)
timeout = 600                   # seconds a rank waits for the others
seed = 1337
defaults = {k: v for k, v in globals().items()
            if not k.startswith("_") and isinstance(v, (int, float, str, list, type(None)))}

# === the processes: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; srun, SLURM's own
slurm = "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", 1)) > 1
names = "SLURM_PROCID SLURM_NTASKS SLURM_LOCALID" if slurm else "RANK WORLD_SIZE LOCAL_RANK"
rank, world_size, local_rank = [int(os.environ.get(n, d)) for n, d in zip(names.split(), (0, 1, 0))]
ddp, master = world_size > 1, rank == 0  # only the master prints, logs and writes

# === plumbing: errors, the command line, settings' checks
import ast, atexit, difflib, importlib.util, re, signal, stat, sys

class UserError(Exception):
    """A mistake in the input: one line, never a traceback."""

class BatchError(UserError):
    """A bad id in a rank's batch: no other rank sees it, so each prints it."""

def lost_contact(error):
    """The line for a rank whose collective failed: if it timed out, another rank hangs."""
    reason = re.sub(r"^\[[^\]]*\] ", "", str(error).strip().split("\n")[0])[:150]
    other = f"rank {1 - rank}" if world_size == 2 else "another rank"
    # "Timed out", "timeout", "timing out", ETIMEDOUT; not "without" or "about"
    timed_out = re.search(r"\be?tim(e[ds]?|ing)[ _]?outs?\b", str(error), re.I)
    what_happened = "hangs" if timed_out else "stopped"
    return f"rank {rank} lost contact with the other ranks ({reason}): {other} {what_happened}"

def report(error_type, error, traceback):
    """sys.excepthook: a mistake, a second Ctrl-C or a lost rank: one line, exit status 1; a bug
    keeps its traceback."""
    exit_on_ctrl_c(1)
    if issubclass(error_type, KeyboardInterrupt):
        error = "interrupted: stopped at once, without saving (one Ctrl-C saves first)"
    elif ddp and issubclass(error_type, RuntimeError) and re.search(
            r"gloo|nccl|tim\w* ?out|connect|peer", str(error), re.I):
        error = lost_contact(error)
    elif not issubclass(error_type, UserError):
        return sys.__excepthook__(error_type, error, traceback)
    if master or not issubclass(error_type, UserError) or issubclass(error_type, BatchError):
        print(f"error: {error}", file=sys.stderr)
    else:  # torchrun may stop us first
        time.sleep(3)
        print(f"error: rank {rank}: {error}", file=sys.stderr)
    if issubclass(error_type, KeyboardInterrupt) and not ddp:  # DDP: atexit leaves
        leave(1)

sys.excepthook = report

def leave(status):  # DDP keeps gloo threads: one freeing tensors as Python exits aborts it
    sys.stdout.flush()
    os._exit(status)

def note(text):
    if master:
        print(f"note: {text}")

def exit_on_ctrl_c(status):  # a Ctrl-C (or SIGTERM) in Python's exit: no traceback
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda signum, frame: os._exit(status))

def read_whole(path, limit):  # a device or FIFO may not end, a huge file fill memory
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:  # (a FIFO's open waits)
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode) or status.st_size > limit:
            raise UserError(f"{path}: not a regular file of at most {limit:,} bytes")
        return file.read(limit)

# a value has its default's type (these: one more)
extra_types = {"vocab_size": int, "total_batch_size": type(None), "n_kv_head": type(None),
               "compile": bool}

def set_setting(source, key, value):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"{source}: unknown setting {key!r}{hint}; --help lists them")
    allowed = {type(defaults[key]), extra_types.get(key, type(defaults[key]))}
    if type(value) is int and float in allowed:
        value = float(value)
    if type(value) not in allowed:
        names = " or ".join(sorted("None" if t is type(None) else t.__name__ for t in allowed))
        raise UserError(f"{source}: {key} must be {names}, got {value!r} ({type(value).__name__})")
    globals()[key] = value

presets = []
for arg in sys.argv[1:]:
    if re.search("[\udc80-\udcff]", arg):  # bytes not UTF-8 (escaped)
        raise UserError(f"{os.fsencode(arg)}: not UTF-8 text")
    if arg in ("-h", "--help"):
        print(__doc__.strip() + "\n\nsettings and their defaults:")
        print("\n".join(f"  --{k}={v!r}" for k, v in defaults.items()))
        sys.exit(0)
    elif arg.startswith("--"):
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            raise UserError(f"{arg}: expected --key=value")
        if type(defaults.get(key)) is not str or key in extra_types:  # a str setting takes the text
            if len(value) > 1000:  # a huge literal would exhaust the parser
                raise UserError(f"--{key}: a value of at most 1,000 characters")
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pass  # a bare word: the type check says what is expected
        set_setting(arg, key, value)
    elif not os.path.isfile(arg):
        raise UserError(f"no preset file {arg!r} (like config/quickstart.py)")
    else:
        namespace, source = {k: globals()[k] for k in defaults}, read_whole(arg, 2**20)
        try:
            exec(source, namespace)
        except SystemExit as e:
            raise UserError(f"{arg}: the preset called sys.exit({e.code!r})")
        except Exception as e:
            raise UserError(f"{arg}: {type(e).__name__}: {e}")
        presets.append(arg)
        for key, value in namespace.items():
            if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                set_setting(arg, key, value)

# each setting's range, then rules across settings (GPTConfig checks the model's)
for names, test, what in [
    ([k for k, v in defaults.items() if type(v) is float], math.isfinite, "finite"),
    (["batch_size", "block_size", "learning_rate", "eval_interval", "eval_iters", "log_interval",
      "timeout"], lambda v: v > 0, "positive"),
    (["timeout"], lambda v: v <= 365 * 86400, "at most a year (31536000)"),
    (["total_batch_size"], lambda v: v is None or v > 0, "positive, or None"),
    (["max_iters", "warmup_iters", "lr_decay_iters", "min_lr", "weight_decay", "grad_clip",
      "hellaswag_interval", "hellaswag_batch"], lambda v: v >= 0, "0 or more"),
    (["beta1", "beta2", "dropout"], lambda v: 0 <= v < 1, "in [0, 1)"),
    (["seed"], lambda v: 0 <= v < 2**64, "in 0..2**64-1"),
    (["init_from"], lambda v: v in ("scratch", "resume", "auto"), "'scratch', 'resume' or 'auto'"),
    (["dtype"], lambda v: v in ("auto", "float32", "bfloat16", "float16"),
     "'auto', 'float32', 'bfloat16' or 'float16'"),
    (["compile"], lambda v: v in ("auto", True, False), "'auto', True or False"),
    (["device"], lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", v),
     "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    (["milestones"], lambda v: all(type(m) is int for m in v), "a list of iteration numbers"),
]:
    for name in names:
        if not test(globals()[name]):
            raise UserError(f"{name}={globals()[name]!r}: must be {what}")
for ok, message in [
    (min_lr <= learning_rate, f"min_lr={min_lr} is above learning_rate={learning_rate}"),
    (hellaswag_interval % eval_interval == 0, f"hellaswag_interval={hellaswag_interval} is not a "
     f"multiple of eval_interval={eval_interval} (HellaSwag is scored at evals)"),
    (not eval_only or init_from != "scratch", "eval_only=True evaluates a checkpoint: add "
     "--init_from=resume"),
    (not wandb_log or importlib.util.find_spec("wandb"), "wandb_log=True needs the wandb package"),
    (not slurm or {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys(), "SLURM with several tasks: "
     "export MASTER_ADDR (the first node) and MASTER_PORT (see the README)"),
]:
    if not ok:
        raise UserError(message)
n_kv_head = n_head if n_kv_head is None else n_kv_head
if lr_decay_iters > max_iters and not eval_only:
    note(f"lr_decay_iters={lr_decay_iters} is past max_iters={max_iters}: the lr ends above min_lr "
         f"(--lr_decay_iters={max_iters} decays fully)")

# === plumbing: the dataset: meta, tokenizer (the checkpoint carries it), shard_sizes
import hashlib

fix_dataset = f"run prepare_data.py again, or delete {dataset} and rerun it"
meta_path = os.path.join(dataset, "meta.json")
if not os.path.exists(meta_path):
    hint = f" (see the top of {presets[-1]})" if presets else ""
    raise UserError(f"no dataset at {dataset!r}: make it with `python prepare_data.py --data "
                    f"<source> --tokenizer <dir|gpt2|char> --out {dataset}`{hint}")
try:  # its numbers must fit each other and the dtype
    meta = json.loads(read_whole(meta_path, 2**26))
    kind, shard_names = meta["tokenizer"]["kind"], meta["shards"]["train"] + meta["shards"]["val"]
    id_limit = {"uint16": 2**16, "uint32": 2**32}[meta["dtype"]]
    run_args = dict(meta.get("args", {}))  # none in an older meta.json
    # merged parts: each part's last shard is short
    shard_size = None if type(run_args.get("part")) is int else run_args.get("shard_size")
    meta_ok = (meta["version"] == 1 and type(meta["vocab_size"]) is type(meta["max_token_id"]) is int
               and type(meta["tokens"]["train"]) is type(meta["tokens"]["val"]) is int
               and type(shard_size or 0) is int
               and {"bpe": "sha256", "tiktoken": "name", "char": "kind"}[kind] in meta["tokenizer"]
               and -1 <= meta["max_token_id"] < meta["vocab_size"] <= id_limit
               and (kind != "char" or type(meta["chars"]) is list)
               and all(type(name) is str for name in shard_names))
except (OSError, ValueError, KeyError, TypeError):
    meta_ok = False
if not meta_ok:
    raise UserError(f"{meta_path} is not the meta.json of a finished prepare_data.py run; "
                    f"{fix_dataset}")
if kind == "bpe":  # prepare_data.py copies the tokenizer files beside the shards
    try:
        ranks_file = read_whole(os.path.join(dataset, "tokenizer.tiktoken"), 2**28)
        info = json.loads(read_whole(os.path.join(dataset, "tokenizer.json"), 2**26))
        tokenizer = {"kind": "bpe", "ranks": ranks_file.decode(), "pattern": info["pattern"],
                     "special_tokens": info["special_tokens"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{dataset} lacks readable tokenizer files ({e}): {fix_dataset}")
    if hashlib.sha256(ranks_file).hexdigest() != meta["tokenizer"]["sha256"]:
        raise UserError(f"{dataset}/tokenizer.tiktoken is not the tokenizer the shards were made "
                        f"with (see meta.json's sha256): copy it back from "
                        f"{meta['tokenizer'].get('path', 'its directory')}, or {fix_dataset}")
elif kind == "tiktoken":
    tokenizer = {"kind": "tiktoken", "name": meta["tokenizer"]["name"]}
else:
    tokenizer = {"kind": "char", "chars": meta["chars"]}
shard_sizes = {}
for split in ("train", "val"):
    done = 0
    for k, name in enumerate(meta["shards"][split]):
        path = os.path.join(dataset, name)
        if name != os.path.basename(name) or name in ("", ".", ".."):
            raise UserError(f"{meta_path} names the shard {name!r}: only plain file names")
        try:
            tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            what = "unreadable" if os.path.exists(path) else "missing"
            raise UserError(f"{path} is {what} ({type(e).__name__}: {str(e)[:80]}): {fix_dataset}")
        if tokens.ndim != 1 or tokens.dtype != meta["dtype"]:
            raise UserError(f"{path} holds a {tokens.ndim}-D array of {tokens.dtype}, not the 1-D "
                            f"{meta['dtype']} ids of meta.json: {fix_dataset}")
        # shard k holds the split's tokens [k * shard_size, (k + 1) * shard_size)
        expected = min(shard_size or math.inf, meta["tokens"][split] - done)
        if (shard_size or k == len(meta["shards"][split]) - 1) and len(tokens) != expected:
            raise UserError(f"{path} holds {len(tokens):,} tokens, meta.json {expected:,}: another "
                            f"dataset's shard? {fix_dataset}")
        shard_sizes[path], done = len(tokens), done + len(tokens)

def check_ids(rows, path):
    # per batch (start-up reads no tokens); else the embedding fails deep (a GPU asserts)
    largest = rows.max()  # (unsigned: none below 0)
    if largest >= meta["vocab_size"]:
        raise BatchError(f"{path} holds token id {largest}, past the vocabulary of meta.json "
                         f"(0..{meta['vocab_size'] - 1}): {fix_dataset}")

# === plumbing: HellaSwag's examples
import socket, urllib.parse

def hub_problem(timeout=3.0):  # None, or why the Hub can't be used, in 3 s
    for switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(switch, "").upper() in ("1", "ON", "YES", "TRUE"):
            return f"the Hugging Face Hub is off ({switch}={os.environ[switch]})"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        url = urllib.parse.urlsplit(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        socket.create_connection((url.hostname or "", port), timeout).close()
    except (OSError, ValueError):
        return f"can't reach the Hugging Face Hub at {endpoint}"

def hellaswag_examples(source):
    """HellaSwag's (context, endings, label) triples from the Hub or a .jsonl; None: no Hub."""
    if source == "hub":
        problem = hub_problem()
        if problem:  # offline, datasets' cache still serves
            os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        try:
            import datasets
            rows = datasets.load_dataset("Rowan/hellaswag", split="validation")
            return [(row["ctx"], list(row["endings"]), int(row["label"])) for row in rows]
        except Exception as error:
            problem = problem or f"{type(error).__name__}: {str(error)[:100]}"
        note(f"no HellaSwag figures ({problem}); --hellaswag=<file.jsonl> scores a local copy")
        return None
    try:
        lines = read_whole(source, 2**28).decode("utf-8-sig").split("\n")  # JSON may hold U+2028
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--hellaswag={source}: can't read it ({error}): give 'hub' or a .jsonl file")
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            context, endings, label = row["ctx"], row["endings"], row["label"]
            label = int(label) if type(label) is str and label.isdigit() else label
            texts_ok = type(label) is int and all(type(text) is str and text
                                                  for text in [context, *endings])
        except (ValueError, KeyError, TypeError):
            texts_ok = False
        if not (texts_ok and type(endings) is list and len(endings) == 4 and 0 <= label < 4):
            raise UserError(f"{source}, line {number}: not a HellaSwag example (ctx: text, endings: "
                            "4 texts, label: 0-3)")
        examples.append((context, endings, label))
    if not examples:
        raise UserError(f"--hellaswag={source}: the file holds no examples")
    return examples

hellaswag_set = hellaswag_examples(hellaswag) if hellaswag_interval else None

# === torch, the device and the precision
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig, save_checkpoint, bytes_of_id, c_compiler

device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
device_type = device.split(":")[0]
is_cuda = device_type == "cuda"
backend = torch.cuda if is_cuda else torch.backends.mps
if device_type != "cpu" and not backend.is_available():
    raise UserError(f"device={device!r}, but this torch sees no {device_type.upper()} device")
if is_cuda:  # a GPU per process; srun may hide the others (CUDA_VISIBLE_DEVICES)
    device = f"cuda:{local_rank % torch.cuda.device_count()}" if ddp or device == "cuda" else device
    torch.cuda.set_device(device)
if dtype == "auto":  # no bfloat16 on a CPU: most emulate it, many times slower
    bfloat16_ok = is_cuda and torch.cuda.get_device_capability() >= (8, 0)  # not T4's emulation
    dtype = "bfloat16" if bfloat16_ok else "float16" if is_cuda else "float32"
compile = is_cuda if compile == "auto" else compile
hellaswag_batch = hellaswag_batch or (32 if is_cuda else 1)  # CPU caches favour 1
ckpt_path, log_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "log.jsonl")

# === plumbing: the checkpoint a resume reads; the tokenizer and the ids it gives; load_for_resume
from model import CheckpointError, encoding_from_checkpoint, load_checkpoint, model_from_checkpoint

if compile and not c_compiler():
    compile = False
    note("no C compiler (gcc, clang or $CC) for torch.compile's kernels: not compiling (slower)")
stop_path = os.path.join(out_dir, "ckpt_stopped.pt")  # a stop's state, so ckpt.pt keeps the best

def resume_path():  # the latest state
    return stop_path if os.path.exists(stop_path) else ckpt_path

if init_from == "auto":
    init_from = "resume" if os.path.exists(resume_path()) else "scratch"

encoding = None
if kind != "tiktoken" or hellaswag_set or sample_prompt:  # a tiktoken name may need the internet
    try:
        encoding = encoding_from_checkpoint({"tokenizer": tokenizer})
    except CheckpointError as e:
        if kind != "tiktoken":
            raise UserError(f"{dataset}'s tokenizer can't be used ({e}): {fix_dataset}")
        hellaswag_set, sample_prompt = None, ""
        note(f"no HellaSwag figures or samples: the tokenizer can't be loaded ({e})")
if kind != "tiktoken" and encoding.n_vocab != meta["vocab_size"]:
    raise UserError(f"{meta_path} says vocab_size {meta['vocab_size']:,}, but its tokenizer "
                    f"has {encoding.n_vocab:,} ids: {fix_dataset}")

def token_ids(text, allowed_special=frozenset()):
    try:
        return encoding.encode(text, allowed_special=allowed_special)
    except ValueError:  # a character the vocabulary lacks, or <|endoftext|> in HellaSwag
        return None

if hellaswag_set:
    examples = [([token_ids(context)] + [token_ids(" " + ending) for ending in endings], label)
                for context, endings, label in hellaswag_set]
    hellaswag_set = [(ids[0], ids[1:], label) for ids, label in examples if None not in ids]
    hellaswag_set.sort(key=lambda example: len(example[0]) + max(map(len, example[1])))
    if len(hellaswag_set) < len(examples):
        note(f"HellaSwag: {len(examples) - len(hellaswag_set)} of {len(examples)} examples have "
             "text the tokenizer can't encode: left out")
sample_ids = token_ids(sample_prompt, "all") if sample_prompt else None
if sample_prompt and not sample_ids:
    raise UserError(f"sample_prompt={sample_prompt!r} has characters the vocabulary lacks")

def load_for_resume(path):
    try:
        checkpoint = load_checkpoint(path, map_location="cpu")
        if type(checkpoint["model_config"]) is dict:
            checkpoint["model_config"]["dropout"] = dropout
        model = model_from_checkpoint(checkpoint)
    except CheckpointError as e:
        raise UserError(f"cannot resume: {e}")
    training_state = ["optimizer", "iter_num", "best_val_loss", "rng", "tokenizer", "train_config"]
    if None in map(checkpoint.get, training_state):
        raise UserError(f"{path} lacks the training state: only train.py's checkpoints resume")
    if checkpoint["tokenizer"] != tokenizer:  # its ids would mean other text
        trained_on = checkpoint["train_config"].get("dataset")
        raise UserError(f"{dataset}'s tokenizer is not the one {path} was trained with (on "
                        f"{trained_on}): resume on its own dataset")
    if checkpoint["train_config"].get("muon", False) != muon:
        raise UserError(f"{path} was trained with muon={not muon}: resume with --muon={not muon}")
    for key in ("seed", "batch_size", "eval_iters"):
        value = globals()[key]
        if checkpoint["train_config"].get(key) not in (None, value):
            note(f"{key}={value}, not the checkpoint's: other eval batches than best_val_loss's")
    return checkpoint, model

if eval_only and init_from != "resume":
    raise UserError(f"eval_only=True: there is no {ckpt_path} to evaluate")

# === resume: the checkpoint's model, whose shapes win over the command line's (not dropout)
checkpoint = None
if init_from == "resume":
    checkpoint, raw_model = load_for_resume(resume_path())
    for key, value in [(k, v) for k, v in checkpoint["model_config"].items() if k in defaults]:
        if globals()[key] not in (None, value):
            note(f"resuming keeps the checkpoint's {key}={value!r} (not {globals()[key]!r})")
        globals()[key] = value
vocab_size = meta["vocab_size"] if vocab_size is None else vocab_size
if vocab_size < meta["vocab_size"]:
    raise UserError(f"vocab_size={vocab_size} but the dataset's vocabulary has "
                    f"{meta['vocab_size']} ids: leave vocab_size unset, or set it that large")

# === the batch: more GPUs, or a smaller batch_size, only change how many micro-steps make a step
# (here, after a resume has set block_size)
tokens_per_micro_step = batch_size * block_size * world_size
total_batch_size = tokens_per_micro_step if total_batch_size is None else total_batch_size
if total_batch_size % tokens_per_micro_step:
    raise UserError(f"total_batch_size={total_batch_size} is not a multiple of batch_size*"
                    f"block_size*world_size = {batch_size}*{block_size}*{world_size} = "
                    f"{tokens_per_micro_step}: change one so that it divides")
grad_accum_steps = total_batch_size // tokens_per_micro_step  # micro-steps per rank and step
try:
    model_config = GPTConfig(**{f.name: globals()[f.name] for f in fields(GPTConfig)
                                if f.name in defaults})
except ValueError as e:
    raise UserError(e)

# === the data: a batch is batch_size windows of block_size+1 tokens, drawn from all shards alike
windows = {}
for split in ("train", "val"):
    paths = [os.path.join(dataset, name) for name in meta["shards"][split]]
    counts = np.array([max(0, shard_sizes[path] - block_size) for path in paths], dtype=np.int64)
    if counts.sum() == 0:
        raise UserError(f"the {split} split of {dataset} has fewer than block_size+1 = "
                        f"{block_size + 1} tokens in any shard")
    windows[split] = paths, counts, np.cumsum(counts)

def get_batch(split, generator):
    paths, counts, window_ends = windows[split]
    starts = torch.randint(int(window_ends[-1]), (batch_size,), generator=generator).numpy()
    shard_of = np.searchsorted(window_ends, starts, side="right")
    offsets = starts - (window_ends[shard_of] - counts[shard_of])
    rows = np.empty((batch_size, block_size + 1), dtype=np.int64)
    for shard in np.unique(shard_of):
        # opened anew each batch: a memmap kept open keeps every page it has read in memory
        tokens = np.load(paths[shard], mmap_mode="r")
        for row in np.flatnonzero(shard_of == shard):
            rows[row] = tokens[offsets[row]:offsets[row] + block_size + 1]
        check_ids(rows[shard_of == shard], paths[shard])
    x, y = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
    if is_cuda:  # pinned: the copy overlaps the GPU's work on the last batch
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

def get_lr(it):
    """Linear warmup from ~0, cosine from learning_rate to min_lr at lr_decay_iters, then flat."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    progress = min(1.0, (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)

def log(line, **fields):
    """Print a line, append its fields to log.jsonl (evals to wandb too): the master only."""
    fields = {k: None if v != v else v for k, v in fields.items()}  # JSON has no NaN
    if master:
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(json.dumps(fields) + "\n")
        if wandb_log and "val_loss" in fields:
            wandb.log(fields, step=fields["iter"])

def percent(mfu):
    return "n/a" if mfu is None or mfu != mfu else f"{mfu * 100:.1f}%"  # NaN: no known peak

config = {k: globals()[k] for k in defaults}  # the merged settings, "auto" and None resolved
if master:
    print("config: " + ", ".join(f"{k}={v!r}" for k, v in config.items()))
    print(f"{world_size} process(es) on {device} in {dtype}; tokens per step: total_batch_size "
          f"{total_batch_size} = batch_size {batch_size} x block_size {block_size} x world_size "
          f"{world_size} x accumulation {grad_accum_steps}")

# === plumbing: out_dir: writable, locked, not overwritten; nothing to train
import fcntl, glob, tempfile

start_iter = checkpoint["iter_num"] if checkpoint else 0
unfinished = start_iter == max_iters > 0 and checkpoint.get("stopped")  # no final eval yet
if max_iters <= start_iter and not eval_only and not unfinished:
    if master:
        print(f"nothing to train: the run starts at iter {start_iter}, max_iters={max_iters}")
    sys.exit(0)

def lock_directory(path):
    """One writer per directory: an OS lock on `path`, held while this process lives (the kernel
    drops it even after kill -9: no stale lock)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise UserError(f"{path}: another run is writing there; wait for it to end, "
                        "or choose another directory")
    except OSError as error:  # no flock (some Lustre, NFS mounts)
        print(f"warning: {path}: can't lock it ({error.strerror}); make sure that one run at a time "
              "writes there", file=sys.stderr)
    return descriptor  # keep it open: closing it unlocks

if master:  # locked for the run, before anything in it is read
    try:  # find out now, not at the first save
        os.makedirs(out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        reason = e.strerror
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            reason += ": a file is in the way"
        raise UserError(f"can't write in out_dir={out_dir!r} ({reason})")
    out_dir_lock = lock_directory(out_dir)
checkpoints_there = glob.glob(os.path.join(glob.escape(out_dir), "ckpt*.pt"))
if init_from == "scratch" and checkpoints_there:  # a milestone alone too: resume reads ckpt.pt
    copy_hint = " once it is copied to ckpt.pt" if resume_path() not in checkpoints_there else ""
    raise UserError(f"{min(checkpoints_there)} exists and a run from scratch would overwrite it: "
                    f"go on from it with --init_from=resume{copy_hint}, or give another --out_dir")
if master:
    for temp in glob.glob(os.path.join(glob.escape(out_dir), "ckpt*.pt.tmp.*")):
        os.remove(temp)  # a killed save's: no other run writes here (the lock)
    if checkpoint is None and os.path.exists(log_path):
        os.remove(log_path)  # a run's that saved no checkpoint

# === the processes together; the model, the optimizer, the random states
if ddp:  # the timeout makes a hanging rank an error
    dist.init_process_group("nccl" if is_cuda else "gloo", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))
    atexit.register(leave, 1)  # after an error's line
torch.manual_seed(seed)  # the same initial weights on every rank, in every run
torch.set_float32_matmul_precision("high")  # TF32 matmuls (Ampere on): ~free speed
autocast = torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != "float32")
raw_model = (GPT(model_config) if checkpoint is None else raw_model).to(device)
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type,
                                           "muon" if muon else "adamw", verbose=master)
# float16 only: the loss is scaled up, or small gradients would round to 0
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
model = torch.compile(raw_model) if compile else raw_model  # evaluation: no DDP machinery
train_model = model
if ddp:
    train_model = DDP(model, device_ids=[torch.cuda.current_device()] if is_cuda else None)

# The random states of dropout and of the data: a resumed run goes on as if it never stopped (a
# fresh seed would repeat the first batches: nanoGPT's #467). Each of a step's num_slots
# micro-batches has a generator: 1 process with 2 micro-steps sees what 2 do.
iter_num, best_val_loss = start_iter, checkpoint["best_val_loss"] if checkpoint else math.inf
tokens_trained = (checkpoint or {}).get("tokens_trained", iter_num * total_batch_size)
torch.manual_seed((seed + rank) % 2**64)  # dropout differs between ranks, as their data do
num_slots = world_size * grad_accum_steps
my_slots = range(rank * grad_accum_steps, (rank + 1) * grad_accum_steps)
train_generators = [torch.Generator().manual_seed((seed + 1_000_003 * iter_num + slot) % 2**64)
                    for slot in my_slots]
if checkpoint is not None:  # its moments; this run's betas and weight decay
    groups = optimizer.param_groups
    optimizer.load_state_dict(checkpoint["optimizer"])
    optimizer.param_groups = groups
    if checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    saved_states = checkpoint["rng"]
    if len(saved_states["ranks"]) == world_size:
        my_states = saved_states["ranks"][rank]
        torch.set_rng_state(my_states["torch"])
        if is_cuda and my_states["cuda"] is not None:
            torch.cuda.set_rng_state(my_states["cuda"])
    if len(saved_states["data"]) == num_slots:
        for slot, generator in zip(my_slots, train_generators):
            generator.set_state(saved_states["data"][slot])
    else:
        note(f"the checkpoint has {len(saved_states['data'])} data streams, this run {num_slots}")

# === plumbing: the ranks' HellaSwag; SIGTERM (SLURM preemption, torchrun stopping) and Ctrl-C
if ddp and hellaswag_interval:
    counts = [0] * world_size
    dist.all_gather_object(counts, len(hellaswag_set or []))
    if min(counts) != max(counts):
        hellaswag_set = None
        note(f"no HellaSwag figures: the ranks loaded {min(counts):,} to {max(counts):,} examples")

def request_stop(signum, frame):
    global stop_signal
    if stop_signal == "SIGINT" and signum == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C twice: stop now, unsaved
    stop_signal = signal.Signals(signum).name
    if master:
        then = "stopping" if eval_only else "saving"
        print(f"{stop_signal}: finishing this step or eval batch, then {then}", flush=True)

stop_signal = None
signal.signal(signal.SIGTERM, request_stop)
signal.signal(signal.SIGINT, request_stop)

def diverged(what):  # only finite weights are saved
    path = resume_path()
    resume = f"; --init_from=resume goes on from {path}" if os.path.exists(path) else ""
    return UserError(f"{what} at iter {iter_num}: training diverged, nothing saved. Lower "
                     f"learning_rate, lengthen warmup_iters, keep grad_clip on, or avoid float16{resume}")

# === the training loop: at the top of iteration iter_num, iter_num steps are done
if master:
    print(f"model: {raw_model.get_num_params():,} parameters; "
          f"{f'resuming at iter {iter_num}' if checkpoint else 'from scratch'}")
    if wandb_log:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)
checkpoint = None  # free its memory: all is loaded
step_seconds = []  # step times since the last eval
stop_votes = 0  # ranks with a signal when the last step ended
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    last_iter, stopping, save_paths = iter_num >= max_iters, stop_votes > 0, []

    # The loss on eval_iters batches of each split, shared out among the ranks. Batch k has the same
    # seed at every eval: evals compare like with like, whatever the process count.
    if (iter_num % eval_interval == 0 or last_iter or eval_only) and not stopping:
        model.eval()
        totals = torch.zeros(6, device=device)
        for k in range(rank, eval_iters, world_size):
            if stop_signal:  # a long eval must not outlast a preemption's grace
                totals[2] = 1
                break
            for split_index, split in enumerate(("train", "val")):
                eval_seed = (seed + 10**9 + 2 * k + split_index) % 2**64  # never a training one
                x, y = get_batch(split, torch.Generator().manual_seed(eval_seed))
                with torch.no_grad(), autocast:
                    totals[split_index] += model(x, y)[1].float()
        # HellaSwag as build-nanogpt and llm.c score it: the answer is the ending of lowest mean
        # loss (acc_norm) or sum (acc). Sorted by length: little padding. The raw model, here and
        # for the sample: varying shapes would make torch.compile recompile.
        if hellaswag_set and (iter_num % hellaswag_interval == 0 or last_iter or eval_only):
            share = hellaswag_set[rank::world_size]
            for batch in [share[i:i + hellaswag_batch] for i in range(0, len(share), hellaswag_batch)]:
                if stop_signal:
                    totals[2] = 1
                    break
                contexts = [context for context, endings, _ in batch for _ in endings]
                all_endings = [ending for _, endings, _ in batch for ending in endings]
                with torch.no_grad(), autocast:
                    summed, mean = raw_model.continuation_losses(contexts, all_endings)
                labels = torch.tensor([label for _, _, label in batch], device=device)
                right = [(losses.view(-1, 4).argmin(1) == labels).sum() for losses in (mean, summed)]
                totals[3:] += torch.stack([torch.tensor(len(batch), device=device), *right])
        sample = None
        if sample_ids and master:  # 32 tokens, the same seed each time
            prompt = torch.tensor([sample_ids[-block_size:]], device=device)
            sampler = torch.Generator(device).manual_seed(seed)
            with torch.no_grad(), autocast:
                new_ids = raw_model.generate(prompt, 32, top_k=50, generator=sampler)[0, prompt.size(1):]
            new_bytes = b"".join(bytes_of_id(encoding, i) for i in new_ids.tolist())
            sample = sample_prompt + new_bytes.decode("utf-8", "replace")
        if ddp:
            dist.all_reduce(totals)  # every rank reaches it, stopped early or not
        model.train()
        train_loss, val_loss, stopped, examples, right_by_mean, right_by_sum = totals.tolist()
        train_loss, val_loss, stopping = train_loss / eval_iters, val_loss / eval_iters, stopped > 0
        if not math.isfinite(train_loss + val_loss):
            raise diverged(f"the eval loss is {train_loss + val_loss}")
        hellaswag_fields, hellaswag_text = {}, ""
        if examples:
            hellaswag_fields = {"hellaswag_acc": right_by_sum / examples, "hellaswag_examples":
                                int(examples), "hellaswag_acc_norm": right_by_mean / examples}
            hellaswag_text = f", hellaswag acc_norm {right_by_mean / examples:.4f}"
        seconds = np.mean(step_seconds) if step_seconds else None
        mfu = raw_model.estimate_mfu(batch_size * grad_accum_steps, seconds) if seconds else None
        tokens_per_sec = total_batch_size / seconds if seconds else None
        if not stopping:
            log(f"eval iter {iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f}"
                f"{hellaswag_text}, lr {lr:.3g}, {tokens_per_sec or 0:,.0f} tokens/s, "
                f"mfu {percent(mfu)}", iter=iter_num, tokens=tokens_trained,
                train_loss=train_loss, val_loss=val_loss, **hellaswag_fields, lr=lr,
                tokens_per_sec=tokens_per_sec, mfu=mfu)
            if sample is not None:
                log(f"sample iter {iter_num}: {sample!r}", iter=iter_num, sample=sample)
        if iter_num > 0 and not stopping:  # iter 0's weights are never saved: they set no best
            if val_loss < best_val_loss or always_save_checkpoint:
                save_paths.append(ckpt_path)
            best_val_loss = min(best_val_loss, val_loss)
        step_seconds = []
    if eval_only:  # nothing to train, nothing to save
        if stopping and master:
            print(f"stopped by {stop_signal or 'another rank'} during the evals: nothing logged")
        break
    if stopping:
        save_paths = [stop_path]
    elif iter_num in milestones and iter_num > 0:  # again if resumed here: the same state
        save_paths.append(os.path.join(out_dir, f"ckpt_{iter_num}.pt"))

    # checkpoints: the master writes every rank's random states
    if save_paths:
        if not all(torch.isfinite(p).all() for p in raw_model.parameters()):  # cheap beside a save
            raise diverged("the weights are not finite")
        cuda_state = torch.cuda.get_rng_state() if is_cuda else None
        rank_states = {"rng": {"torch": torch.get_rng_state(), "cuda": cuda_state},
                       "data": [generator.get_state() for generator in train_generators]}
        all_states = [rank_states] * world_size
        if ddp:
            dist.all_gather_object(all_states, rank_states)
        for path in save_paths if master else []:
            try:
                save_checkpoint(path, {
                    "model": raw_model.state_dict(), "model_config": asdict(raw_model.config),
                    "train_config": config, "iter_num": iter_num, "best_val_loss": best_val_loss,
                    "tokens_trained": tokens_trained, "stopped": stopping,
                    "tokenizer": tokenizer, "dataset": meta, "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                    "rng": {"ranks": [s["rng"] for s in all_states],
                            "data": [data for s in all_states for data in s["data"]]}})
            except OSError as e:
                raise UserError(f"can't write {path} ({str(e).splitlines()[0][:60]}): no space "
                                f"left? The last checkpoint is kept: make room, then resume")
    stop_done = ckpt_path in save_paths or last_iter and not stopping  # ckpt.pt newer, or run over
    if master and stop_done and os.path.exists(stop_path):
        os.remove(stop_path)
    if stopping or last_iter:
        break

    step_start, step_loss = time.time(), torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        if ddp:  # the last micro-step's backward averages the ranks' gradients
            train_model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        x, y = get_batch("train", train_generators[micro_step])
        with autocast:
            _, loss = train_model(x, y)
            loss = loss / grad_accum_steps  # the accumulated gradient: the step's mean's
        step_loss += loss.detach()
        scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    # one all-reduce a step: the mean loss, and whether a rank got a signal (then all stop)
    signalled = torch.tensor(float(stop_signal is not None), device=device)
    step_status = torch.stack([step_loss.float(), signalled])
    if ddp:
        dist.all_reduce(step_status)
    loss_sum, stop_votes = step_status.tolist()
    step_loss_value, iter_num = loss_sum / world_size, iter_num + 1
    tokens_trained += total_batch_size
    step_seconds.append(time.time() - step_start)
    if not math.isfinite(step_loss_value):
        raise diverged(f"the loss is {step_loss_value}")
    if iter_num % log_interval == 0:
        seconds = np.mean(step_seconds[-log_interval:])
        mfu = raw_model.estimate_mfu(batch_size * grad_accum_steps, seconds)
        log(f"iter {iter_num}: loss {step_loss_value:.4f}, {seconds * 1000:.1f} ms/step, "
            f"{total_batch_size / seconds:,.0f} tokens/s, mfu {percent(mfu)}, "
            f"eta {(max_iters - iter_num) * seconds / 60:.1f} min", iter=iter_num,
            loss=step_loss_value, lr=lr, ms_per_step=seconds * 1000,
            tokens_per_sec=total_batch_size / seconds, mfu=mfu)

# === plumbing: the end: nothing for a Ctrl-C to stop
exit_on_ctrl_c(0)
if stopping and master and not eval_only:
    print(f"stopped by {stop_signal or 'another rank'} after iter {iter_num}; {stop_path} "
          f"saved: go on with --init_from=resume", flush=True)
if ddp:  # together: the master may still be writing the last checkpoint
    dist.barrier()
    dist.destroy_process_group()
    if master and wandb_log:
        wandb.finish()
    leave(0)
