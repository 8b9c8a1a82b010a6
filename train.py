"""Pretrain the GPT of model.py on the token shards of prepare_data.py: on a laptop CPU, one GPU, many GPUs
(torchrun) or many nodes (torchrun or SLURM's srun).

    python train.py config/shakespeare_char.py                        # a preset: a file of assignments
    python train.py config/shakespeare_char.py --batch_size=32        # then --key=value overrides
    python train.py config/shakespeare_char.py --init_from=resume     # go on exactly from out_dir/ckpt.pt
    torchrun --standalone --nproc_per_node=8 train.py config/lillm.py
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 \
        train.py config/lillm.py                                      # and --node_rank=1 on the other node
    srun python train.py config/lillm.py --init_from=auto             # SLURM: see the README's sbatch example

Every global in the settings block below is a setting. Presets and --key=value arguments apply in the order
given; a value must have the setting's type. `python train.py --help` lists the settings.
SIGTERM or Ctrl-C finishes the current step (or eval batch), saves out_dir/ckpt.pt and exits with status 0.
"""
import ast, difflib, glob, hashlib, importlib.util, json, math, os, re, signal, sys, tempfile, time
from dataclasses import asdict, fields
from datetime import timedelta

import numpy as np  # torch comes once the settings and the dataset are checked: mistakes show at once, not in 2 s

# -----------------------------------------------------------------------------------------------------
# settings; the defaults train the lilLM model on FineWeb (config/lillm.py says the same, explicitly)
out_dir = "out"                  # ckpt.pt, the milestone copies ckpt_<iter>.pt and log.jsonl go here
dataset = "data/fineweb"         # a directory written by prepare_data.py: shards and meta.json
init_from = "scratch"            # "scratch" (refused over a checkpoint), "resume" from out_dir/ckpt.pt, "auto": either
eval_interval = 1000             # estimate train/val loss (and maybe save) every this many iterations
eval_iters = 100                 # batches per split in each estimate, shared out among the ranks
log_interval = 10                # print the step loss and the speed every this many iterations
always_save_checkpoint = False   # save at every eval, not only when val loss improved
milestones = []                  # iterations at which to keep a copy of the checkpoint, ckpt_<iter>.pt
wandb_log, wandb_project, wandb_run_name = False, "lillm", "run"  # log evals to Weights & Biases
# batch: total_batch_size is the one that matters to the optimization; the others fit it to the hardware
batch_size = 32                  # sequences per device in one forward/backward (micro-step)
block_size = 512                 # tokens per sequence: the model's context length
total_batch_size = 524288        # tokens per optimizer step over all ranks and micro-steps (None: no accumulation)
# model; vocab_size comes from the dataset's meta.json unless set (to pad it, e.g. 50257 -> 50304)
vocab_size = None
n_layer = 12
n_head = 16
n_kv_head = 8                    # key/value heads shared by the query heads (grouped-query attention); None: n_head
n_embd = 512
ffn_ratio = 8 / 3                # SwiGLU hidden size / n_embd (rounded up to a multiple of 128); 8/3 keeps GPT-2's size
dropout = 0.0
# optimizer: AdamW; learning rate warms up linearly, follows a cosine down to min_lr, then stays flat
muon = False                     # Muon for the matrices in the blocks, AdamW for the rest (model.MuonAdamW)
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 20000                # optimizer steps in all
warmup_iters = 700
lr_decay_iters = 20000           # where the cosine reaches min_lr; usually max_iters
weight_decay = 0.1
beta1, beta2 = 0.9, 0.95         # AdamW's averaging factors of the gradient and of its square
grad_clip = 1.0                  # clip the gradient's global norm to this; 0 turns clipping off
# system
device = "auto"                  # "auto" picks cuda if there is a GPU, else cpu; or name one: "cpu", "cuda:1", "mps"
dtype = "auto"                   # "auto": bfloat16 where the GPU has it, else float16; float32 off the GPU
compile = "auto"                 # torch.compile: "auto" means on CUDA only (on the CPU it costs more than it saves)
timeout = 600                    # seconds a rank waits for the others in a collective before it gives up
seed = 1337
# -----------------------------------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items()  # the globals above are the settings
            if not k.startswith("_") and isinstance(v, (int, float, str, list, type(None)))}
# A value must have its default's type; these settings take one more type.
extra_types = {"vocab_size": int, "total_batch_size": type(None), "n_kv_head": type(None), "compile": bool}

# the processes: torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; under srun only SLURM's own variables exist
slurm = not ("RANK" in os.environ and "WORLD_SIZE" in os.environ) and int(os.environ.get("SLURM_NTASKS", 1)) > 1
variables = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if slurm else ("RANK", "WORLD_SIZE", "LOCAL_RANK")
rank, world_size, local_rank = (int(os.environ.get(name, default)) for name, default in zip(variables, (0, 1, 0)))
ddp, master = world_size > 1, rank == 0  # the master is the only rank that prints, logs and writes files

def fail(message):
    """A user mistake: one line on stderr (from the first rank only) and exit status 1, never a traceback."""
    if master:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)  # every rank fails alike: don't let torchrun stop rank 0 before it has printed
    sys.exit(1)

def check(ok, message):
    if not ok:
        fail(message)

def one_line_excepthook(kind, error, traceback):
    """A second Ctrl-C, or a rank that hangs or died: one line, as for a mistake. Bugs keep their traceback."""
    if issubclass(kind, KeyboardInterrupt):
        print("error: interrupted: stopped at once, without saving (one Ctrl-C while training saves first)", file=sys.stderr)
    elif ddp and issubclass(kind, RuntimeError) and re.search("gloo|nccl|time.?out|connection|peer", str(error), re.I):
        reason = re.sub(r"^\[[^\]]*\] ", "", (str(error).strip() or kind.__name__).splitlines()[0])[:150]
        print(f"error: rank {rank} lost contact with the other ranks ({reason}): "
              f"{f'rank {1 - rank}' if world_size == 2 else 'another rank'} {'hangs' if 'out' in reason else 'stopped'}"
              f" (see its messages); --timeout={timeout} is how long a rank waits", file=sys.stderr)
    else:
        sys.__excepthook__(kind, error, traceback)

sys.excepthook = one_line_excepthook
check(not slurm or "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ,
      "SLURM with several tasks: export MASTER_ADDR (the first node) and MASTER_PORT in the sbatch script (see the README)")

# the command line: presets (files of Python assignments) and --key=value, in order, then checks across settings
def set_setting(source, key, value):
    hint = "".join(f" (did you mean {close!r}?)" for close in difflib.get_close_matches(key, defaults, n=1))
    check(key in defaults, f"{source}: unknown setting {key!r}{hint}; --help lists them")
    allowed = {type(defaults[key]), extra_types.get(key, type(defaults[key]))}
    value = float(value) if type(value) is int and float in allowed else value  # 3 is fine for 3.0
    names = " or ".join(sorted("None" if t is type(None) else t.__name__ for t in allowed))
    check(type(value) in allowed, f"{source}: {key} must be {names}, got {value!r} ({type(value).__name__})")
    globals()[key] = value

presets = []
for arg in sys.argv[1:]:
    if arg in ("-h", "--help"):
        print(__doc__.strip() + "\n\nsettings and their defaults:\n" + "\n".join(f"  --{k}={v!r}" for k, v in defaults.items()))
        sys.exit(0)
    elif arg.startswith("--"):
        key, has_value, text = arg[2:].partition("=")
        check(has_value, f"{arg}: expected --key=value")
        try:  # a setting whose only type is str takes the text as it is; the others read a Python literal
            set_setting(arg, key, text if type(defaults.get(key)) is str and key not in extra_types else ast.literal_eval(text))
        except (ValueError, SyntaxError):
            set_setting(arg, key, text)  # a bare word: the type check says what was expected
    else:
        check(os.path.isfile(arg), f"no preset file {arg!r} (expected a file like config/shakespeare_char.py, or --key=value)")
        namespace = {k: globals()[k] for k in defaults}
        try:
            exec(open(arg).read(), namespace)
        except Exception as e:
            fail(f"{arg}: {type(e).__name__}: {e}")
        presets.append(arg)
        for key, value in namespace.items():
            if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                set_setting(arg, key, value)
n_kv_head = n_head if n_kv_head is None else n_kv_head  # None: plain multi-head attention
check(init_from in ("scratch", "resume", "auto"), f"init_from must be 'scratch', 'resume' or 'auto', not {init_from!r}")
check(dtype in ("auto", "float32", "bfloat16", "float16"),
      f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', not {dtype!r}")
check(compile in ("auto", True, False), f"compile must be 'auto', True or False, not {compile!r}")
check(re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", device),
      f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', not {device!r}")
check(all(type(m) is int for m in milestones), f"milestones must be a list of iteration numbers, not {milestones!r}")
for key in ("batch_size", "block_size", "eval_interval", "eval_iters", "log_interval", "n_layer", "timeout"):
    check(globals()[key] > 0, f"{key}={globals()[key]}: must be positive")
for key in ("max_iters", "warmup_iters", "lr_decay_iters", "weight_decay", "grad_clip"):
    check(globals()[key] >= 0, f"{key}={globals()[key]}: can't be negative")
check(n_head > 0 and n_kv_head > 0 and n_embd % n_head == n_head % n_kv_head == (n_embd // n_head) % 2 == 0,
      f"n_embd={n_embd}, n_head={n_head}, n_kv_head={n_kv_head}: n_head must divide n_embd into an even head size "
      f"(rotary embeddings rotate pairs), and n_kv_head must divide n_head")
check(0 <= min_lr <= learning_rate and learning_rate > 0,
      f"learning_rate={learning_rate}, min_lr={min_lr}: need learning_rate > 0 and 0 <= min_lr <= learning_rate")
check(0 <= dropout < 1, f"dropout={dropout}: it is a probability, 0 <= dropout < 1")
check(ffn_ratio > 0, f"ffn_ratio={ffn_ratio}: the SwiGLU hidden size is ffn_ratio * n_embd, so it must be positive")
check(not wandb_log or importlib.util.find_spec("wandb"), "wandb_log=True needs the wandb package: pip install wandb")
check(0 <= beta1 < 1 and 0 <= beta2 < 1, f"beta1={beta1}, beta2={beta2}: Adam's averaging factors need 0 <= beta < 1")

# the dataset: meta.json, the tokenizer (the checkpoint carries it, so sampling needs no dataset) and the shards
remake = f"run prepare_data.py again, or delete {dataset} and rerun it"
meta_path = os.path.join(dataset, "meta.json")
check(os.path.exists(meta_path), f"no dataset at {dataset!r} ({meta_path} is missing): make it first with `python "
      f"prepare_data.py --data <source> --tokenizer <dir|gpt2|char> --out {dataset}`"
      + (f" (the exact command is at the top of {presets[-1]})" if presets else "") + ", or point --dataset at one")
try:
    with open(meta_path) as f:
        meta = json.load(f)
    kind, shard_names = meta["tokenizer"]["kind"], meta["shards"]["train"] + meta["shards"]["val"]
    meta_ok = (meta["version"] == 1 and type(meta["vocab_size"]) is type(meta["max_token_id"]) is int
               and {"bpe": "sha256", "tiktoken": "name", "char": "kind"}[kind] in meta["tokenizer"]
               and (kind != "char" or type(meta["chars"]) is list) and all(type(n) is str for n in shard_names))
except (OSError, ValueError, KeyError, TypeError):
    meta_ok = False
check(meta_ok, f"{meta_path} is not the meta.json (version 1) of a finished prepare_data.py run: {remake}")
if kind == "bpe":
    try:
        with open(os.path.join(dataset, "tokenizer.tiktoken"), "rb") as f:
            ranks_bytes = f.read()
        with open(os.path.join(dataset, "tokenizer.json")) as f:
            info = json.load(f)
        tokenizer = {"kind": "bpe", "ranks": ranks_bytes.decode(), "pattern": info["pattern"],
                     "special_tokens": info["special_tokens"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{dataset} lacks readable tokenizer files ({type(e).__name__}: {e}): {remake}")
    check(hashlib.sha256(ranks_bytes).hexdigest() == meta["tokenizer"]["sha256"],  # a BPE trainer's --out pointed here
          f"{dataset}/tokenizer.tiktoken is not the tokenizer the shards were made with (its sha256 differs from "
          f"meta.json's): copy it back from {meta['tokenizer'].get('path', 'the tokenizer directory')}, or {remake}")
else:
    tokenizer = ({"kind": "tiktoken", "name": meta["tokenizer"]["name"]} if kind == "tiktoken"
                 else {"kind": "char", "chars": meta["chars"]})
shard_sizes = {}  # path -> number of tokens
for name in shard_names:
    check(name == os.path.basename(name) and name not in ("", ".", ".."),
          f"{meta_path} names the shard {name!r}: only plain file names inside {dataset} are allowed; {remake}")
    path = os.path.join(dataset, name)
    try:  # every shard is read once now: an id past meta.json's largest would fail later, deep in the embedding
        tokens = np.load(path, mmap_mode="r")
        shard_sizes[path], largest = len(tokens), (int(tokens.max()) if len(tokens) else -1)
    except (OSError, ValueError) as e:
        fail(f"{path}, which {meta_path} lists, is {'missing' if not os.path.exists(path) else 'unreadable'} "
             f"({type(e).__name__}: {str(e)[:80]}): {remake}")
    check(largest <= meta["max_token_id"],
          f"{path} holds token id {largest}, past the largest that {meta_path} records ({meta['max_token_id']}): {remake}")

ckpt_path = os.path.join(out_dir, "ckpt.pt")
init_from = ("resume" if os.path.exists(ckpt_path) else "scratch") if init_from == "auto" else init_from
existing = glob.glob(os.path.join(glob.escape(out_dir), "ckpt*.pt"))
check(init_from != "scratch" or not existing, f"{min(existing, default='')} exists and a run from scratch would overwrite "
      f"it: go on from it with --init_from=resume (or auto){' once it is copied to ckpt.pt' * (ckpt_path not in existing)}"
      f", or give another --out_dir, or delete it first")  # a milestone alone: resume reads only ckpt.pt

# torch, the device, and the checkpoint to resume (it decides the model's shape)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, CheckpointError, GPTConfig, load_checkpoint, model_from_checkpoint, save_checkpoint

device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
device_type = device.split(":")[0]
available = device_type == "cpu" or (torch.cuda if device_type == "cuda" else torch.backends.mps).is_available()
check(available, f"device={device!r} but this torch sees no {device_type.upper()} device; use --device=cpu")
if device_type == "cuda":  # one GPU per process; srun may have hidden the others (CUDA_VISIBLE_DEVICES): the modulo
    device = f"cuda:{local_rank % torch.cuda.device_count()}" if ddp or device == "cuda" else device
    torch.cuda.set_device(device)
if dtype == "auto":  # never bfloat16 on a CPU: most emulate it, many times slower than float32
    dtype = "float32" if device_type != "cuda" else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
compile = device_type == "cuda" if compile == "auto" else compile

checkpoint = None
if init_from == "resume":
    try:
        checkpoint = load_checkpoint(ckpt_path, map_location="cpu")
        raw_model = model_from_checkpoint(checkpoint)  # the plain module: no "_orig_mod." or "module." prefixes
    except CheckpointError as e:
        fail(f"cannot resume: {e}")
    check(None not in map(checkpoint.get, ("optimizer", "iter_num", "best_val_loss", "rng", "tokenizer", "train_config")),
          f"cannot resume from {ckpt_path}: it lacks the training state; only a checkpoint written by train.py can be resumed")
    old = checkpoint.get("dataset") or {"tokenizer": checkpoint["tokenizer"].get("kind"), "vocab_size": "?"}
    check(checkpoint["tokenizer"] == tokenizer,  # the ids would mean other text: kind, ranks, name or characters differ
          f"{ckpt_path} was trained with another tokenizer ({old['tokenizer']}, vocab_size {old['vocab_size']}) than "
          f"{dataset}'s ({meta['tokenizer']}, vocab_size {meta['vocab_size']}): resume on the dataset it was trained "
          f"on (--dataset={checkpoint['train_config'].get('dataset', '?')}), or start anew in another --out_dir")
    check(checkpoint["train_config"].get("muon", False) == muon,
          f"{ckpt_path} was trained with muon={not muon}: resume with --muon={not muon}, or the optimizer state will not fit")
    for key, value in [(k, v) for k, v in checkpoint["model_config"].items() if k in defaults]:
        if globals()[key] not in (None, value) and master:
            print(f"note: resuming keeps the checkpoint's {key}={value!r} (not {globals()[key]!r})")
        globals()[key] = value
vocab_size = meta["vocab_size"] if vocab_size is None else vocab_size
check(vocab_size >= meta["vocab_size"] and vocab_size > meta["max_token_id"],
      f"vocab_size={vocab_size} but the dataset's vocabulary has {meta['vocab_size']} ids (largest token id "
      f"{meta['max_token_id']}): leave vocab_size unset to take meta.json's, or set it at least that large")

# the batches: more GPUs, or a smaller batch_size to fit memory, only change how many micro-steps make total_batch_size
tokens_per_micro_step = batch_size * block_size * world_size
total_batch_size = tokens_per_micro_step if total_batch_size is None else total_batch_size
check(total_batch_size > 0, f"total_batch_size={total_batch_size}: must be a positive number of tokens, or None")
check(total_batch_size % tokens_per_micro_step == 0,
      f"total_batch_size={total_batch_size} tokens is not a multiple of batch_size*block_size*world_size = "
      f"{batch_size}*{block_size}*{world_size} = {tokens_per_micro_step}: change one of them so that it divides")
grad_accum_steps = total_batch_size // tokens_per_micro_step  # micro-steps per rank per optimizer step

windows = {}  # split -> its shard paths, the number of block_size+1 token windows in each, and their running total
for split in ("train", "val"):
    paths = [os.path.join(dataset, name) for name in meta["shards"][split]]
    counts = np.array([max(0, shard_sizes[path] - block_size) for path in paths], dtype=np.int64)
    check(counts.sum() > 0, f"the {split} split of {dataset} has fewer than block_size+1 = {block_size + 1} tokens in any shard")
    windows[split] = paths, counts, np.cumsum(counts)

def get_batch(split, generator):
    """batch_size random windows of the split, drawn uniformly over all of its shards with the generator."""
    paths, counts, window_ends = windows[split]
    starts = torch.randint(int(window_ends[-1]), (batch_size,), generator=generator).numpy()
    shard_of = np.searchsorted(window_ends, starts, side="right")
    offsets = starts - (window_ends[shard_of] - counts[shard_of])
    rows = np.empty((batch_size, block_size + 1), dtype=np.int64)
    for shard in np.unique(shard_of):
        tokens = np.load(paths[shard], mmap_mode="r")  # per batch: an open memmap keeps every page (nanoGPT's leak)
        for row in np.flatnonzero(shard_of == shard):
            rows[row] = tokens[offsets[row]:offsets[row] + block_size + 1]
    x, y = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
    if device_type == "cuda":  # pinned memory: the copy runs while the GPU works on the previous micro-step
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

def get_lr(it):
    """Linear warmup from ~0, cosine from learning_rate down to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    progress = min(1.0, (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)

# out_dir, processes, model, optimizer, random states
config = {k: globals()[k] for k in defaults}  # the merged settings, with "auto" and None resolved
if master:
    print("config: " + ", ".join(f"{k}={v!r}" for k, v in config.items()))
    print(f"{world_size} process(es) on {device} in {dtype}; tokens per step: total_batch_size {total_batch_size} = "
          f"batch_size {batch_size} x block_size {block_size} x world_size {world_size} x accumulation {grad_accum_steps}")
    try:  # find out now, not at the first save, that out_dir can't be written
        os.makedirs(out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        in_the_way = isinstance(e, (FileExistsError, NotADirectoryError))
        fail(f"can't write in out_dir={out_dir!r} ({e.strerror}{': a file is in the way' * in_the_way}): give another --out_dir")
    for temp in glob.glob(os.path.join(glob.escape(out_dir), "ckpt*.pt.tmp.*")):  # left by a save killed mid-write
        if os.path.isdir("/proc") and not os.path.exists(f"/proc/{temp.rsplit('.', 1)[1]}"):  # whose process is gone
            os.remove(temp)
    if checkpoint is None and os.path.exists(os.path.join(out_dir, "log.jsonl")):
        os.remove(os.path.join(out_dir, "log.jsonl"))  # the log of a run that saved no checkpoint
if ddp:  # NCCL between GPUs, gloo on CPUs. The timeout turns a rank that hangs into an error on the others.
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout),
                            rank=rank, world_size=world_size)
torch.manual_seed(seed)  # the same initial weights on every rank and in every run
torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later: ~free speed in float32 parts
autocast = torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != "float32")

if checkpoint is None:
    raw_model = GPT(GPTConfig(**{f.name: globals()[f.name] for f in fields(GPTConfig) if f.name in defaults}))
raw_model.to(device)
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type,
                                           "muon" if muon else "adamw", verbose=master)
# float16 only: small gradients would round to 0, so the loss is scaled up first (and a step that overflowed skipped)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
model = torch.compile(raw_model) if compile else raw_model  # for evaluation: no DDP machinery needed
train_model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None) if ddp else model

# The random states of dropout and of the data, so that a resumed run goes on exactly as if it never stopped (a
# fresh seed would repeat the first batches: nanoGPT's issue #467). A step's global batch is num_slots micro-batches,
# each slot with its own generator (rank r draws slots r*grad_accum_steps...), so 1 process with 2 micro-steps sees
# what 2 processes see. A resume with another batch shape seeds a new data order with iter_num, not the first again.
iter_num, best_val_loss = (checkpoint["iter_num"], checkpoint["best_val_loss"]) if checkpoint else (0, float("inf"))
torch.manual_seed(seed + rank)  # dropout differs between ranks, as their data do
num_slots, my_slots = world_size * grad_accum_steps, range(rank * grad_accum_steps, (rank + 1) * grad_accum_steps)
train_generators = [torch.Generator().manual_seed(seed + 1_000_003 * iter_num + slot) for slot in my_slots]
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint["optimizer"])
    if checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    rng = checkpoint["rng"]
    if len(rng["ranks"]) == world_size:
        torch.set_rng_state(rng["ranks"][rank]["torch"])
        if device_type == "cuda" and rng["ranks"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng["ranks"][rank]["cuda"])
    if len(rng["data"]) == num_slots:
        for slot, generator in zip(my_slots, train_generators):
            generator.set_state(rng["data"][slot])
    elif master:
        print(f"note: the checkpoint has {len(rng['data'])} data streams, this run {num_slots}: new data order")

def save(path):
    """Write a checkpoint (all ranks must call: the random states of every rank are gathered)."""
    mine = {"rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None},
            "data": [g.get_state() for g in train_generators]}
    everyone = [mine] * world_size
    if ddp:
        dist.all_gather_object(everyone, mine)
    if master:
        save_checkpoint(path, {"model": raw_model.state_dict(), "model_config": asdict(raw_model.config),
            "train_config": config, "iter_num": iter_num, "best_val_loss": best_val_loss, "tokenizer": tokenizer,
            "dataset": meta, "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "rng": {"ranks": [e["rng"] for e in everyone], "data": [s for e in everyone for s in e["data"]]}})

@torch.no_grad()
def estimate_loss():
    """Mean train and val loss over eval_iters fixed batches each, shared out among the ranks: batch k always has
    the same seed, so successive evals compare like with like and the number of processes doesn't matter.
    None when a signal came meanwhile: a long eval must not outlast a preemption's grace period."""
    model.eval()
    total = torch.zeros(3, device=device)  # sum of the train batches' losses, of the val ones', ranks a signal stopped
    for k in range(rank, eval_iters, world_size):
        if stop_signal:
            total[2] = 1
            break
        for split_index, split in enumerate(("train", "val")):
            x, y = get_batch(split, torch.Generator().manual_seed(seed + 10**9 + 2 * k + split_index))  # not training's
            with autocast:
                _, loss = model(x, y)
            total[split_index] += loss.float()
    if ddp:
        dist.all_reduce(total)  # every rank reaches it, stopped early or not
    model.train()
    return None if total[2] > 0 else {"train": (total[0] / eval_iters).item(), "val": (total[1] / eval_iters).item()}

def log(line, **record):
    """Print a line, and append the record to log.jsonl (and to wandb for evals), on the first rank only."""
    record = {k: None if v != v else v for k, v in record.items()}  # JSON has no NaN
    if master:
        print(line, flush=True)
        with open(os.path.join(out_dir, "log.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if wandb_log and "val_loss" in record:
            wandb.log(record, step=record["iter"])

def percent(mfu):
    return "n/a" if mfu is None or mfu != mfu else f"{mfu * 100:.1f}%"  # NaN: the CPU's peak is unknown

def request_stop(signum, frame):
    """SIGTERM (SLURM preemption, torchrun shutting down) or Ctrl-C: stop after this step, with a checkpoint."""
    global stop_signal
    if stop_signal == "SIGINT" and signum == signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C twice: stop now, without saving (one_line_excepthook says so)
    stop_signal = signal.Signals(signum).name
    if master:
        print(f"{stop_signal}: finishing this step or eval batch, then saving a checkpoint and exiting", flush=True)

stop_signal = None  # the name of the first signal that asked to stop
signal.signal(signal.SIGTERM, request_stop)
signal.signal(signal.SIGINT, request_stop)
if master:
    print(f"model: {raw_model.get_num_params():,} parameters; "
          f"{f'resuming at iter {iter_num}' if checkpoint else 'from scratch'}")
    if wandb_log:
        import wandb
        wandb.init(project=wandb_project, name=wandb_run_name, config=config)
checkpoint = None  # free its memory: everything is loaded

# the training loop. At the top of iteration iter_num, iter_num steps are done: that is the state a checkpoint records.
losses, stop_votes = {}, 0  # None and > 0 say, after the loop, that a signal stopped it
step_seconds = []  # how long each step since the last eval took: the speed that the log and eval lines report
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    last_iter = iter_num >= max_iters
    if iter_num % eval_interval == 0 or last_iter:
        losses = estimate_loss()
        if losses is None:  # a signal came during the eval
            break
        seconds = np.mean(step_seconds) if step_seconds else None  # None before the first step
        mfu = raw_model.estimate_mfu(batch_size * grad_accum_steps, seconds) if seconds else None
        tokens_per_sec = total_batch_size / seconds if seconds else None
        log(f"eval iter {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, lr {lr:.3g}, "
            f"{tokens_per_sec or 0:,.0f} tokens/s, mfu {percent(mfu)}", iter=iter_num, tokens=iter_num * total_batch_size,
            train_loss=losses["train"], val_loss=losses["val"], lr=lr, tokens_per_sec=tokens_per_sec, mfu=mfu)
        if iter_num > 0:  # iter 0's weights are never saved, so its eval sets no best: a finished run leaves a ckpt
            improved, best_val_loss = losses["val"] < best_val_loss, min(best_val_loss, losses["val"])
            if improved or always_save_checkpoint:
                save(ckpt_path)
        step_seconds = []
    if iter_num in milestones and iter_num > 0:  # again after a resume at this iteration: the same state
        save(os.path.join(out_dir, f"ckpt_{iter_num}.pt"))
    if last_iter:
        break

    step_start, step_loss = time.time(), torch.zeros((), device=device)
    for micro_step in range(grad_accum_steps):
        if ddp:  # gradients are averaged across ranks in the last micro-step's backward; before, each rank accumulates
            train_model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        x, y = get_batch("train", train_generators[micro_step])
        with autocast:
            _, loss = train_model(x, y)
            loss = loss / grad_accum_steps  # so the accumulated gradient is that of the mean over the step
        step_loss += loss.detach()
        scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    # One all-reduce a step: the global batch's mean loss, and whether any rank got a signal (all must stop together)
    status = torch.stack([step_loss.float(), torch.tensor(float(stop_signal is not None), device=device)])
    if ddp:
        dist.all_reduce(status)
    loss_sum, stop_votes = status.tolist()
    step_loss_value, iter_num = loss_sum / world_size, iter_num + 1
    step_seconds.append(time.time() - step_start)
    check(math.isfinite(step_loss_value), f"the loss is {step_loss_value} at iter {iter_num}: training diverged. Lower "
          f"learning_rate, lengthen warmup_iters, keep grad_clip on, or use bfloat16/float32 over float16; "
          f"--init_from=resume restarts from the last checkpoint")
    if iter_num % log_interval == 0:
        seconds = np.mean(step_seconds[-log_interval:])
        mfu = raw_model.estimate_mfu(batch_size * grad_accum_steps, seconds)
        log(f"iter {iter_num}: loss {step_loss_value:.4f}, {seconds * 1000:.1f} ms/step, {total_batch_size / seconds:,.0f} "
            f"tokens/s, mfu {percent(mfu)}, eta {(max_iters - iter_num) * seconds / 60:.1f} min", iter=iter_num,
            loss=step_loss_value, lr=lr, ms_per_step=seconds * 1000, tokens_per_sec=total_batch_size / seconds, mfu=mfu)
    if stop_votes > 0:
        break
if losses is None or stop_votes > 0:
    save(ckpt_path)
    if master:
        print(f"stopped by {stop_signal or 'another rank'} after iter {iter_num}; {ckpt_path} saved: go on with "
              f"--init_from=resume", flush=True)
if ddp:  # leave together: the other ranks get here while rank 0 still writes the last checkpoint
    dist.barrier()
    dist.destroy_process_group()
