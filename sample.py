"""
Sample text from a model trained by train.py, streaming it token by token.

    python sample.py --out_dir=out-lillm
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out-lillm --start=FILE:prompt.txt --temperature=0.8 --top_k=200 --top_p=0.95
    python sample.py --out_dir=out-lillm --ckpt=ckpt_5000.pt --temperature=0    # greedy, from a milestone

Every global in the block below can be overridden with --name=value (the same style as train.py): the value is
read as a Python literal when the default is a number, bool or None, and taken as-is when it is a string.

- The model and its tokenizer both come from the checkpoint (out_dir/ckpt.pt): the model config and weights,
  and the tokenizer entry (our BPE ranks, a tiktoken name, or the char list), so sampling needs no other file.
- --start="" (the default) samples unconditionally: BPE/tiktoken models start from <|endoftext|>, the token
  that precedes every document in training; char-level models have no such token and start from "\\n" (or
  the first character of the vocabulary when it has no newline). In a BPE prompt, "<|endoftext|>" is the EOT.
- --temperature <= 0 means greedy decoding: always the most likely token (top_k and top_p then do nothing).
- Samples go to stdout, each followed by a separator line; everything else (tokens/s included) goes to stderr.
"""
import base64
import codecs
import os
import sys
import time
from ast import literal_eval
from contextlib import nullcontext

import torch

from model import CheckpointError, load_checkpoint, model_from_checkpoint

# -----------------------------------------------------------------------------
out_dir = "out"            # the directory train.py wrote (its --out_dir)
ckpt = "ckpt.pt"           # file name inside out_dir; milestones are ckpt_<iter>.pt
start = ""                 # the prompt, or "FILE:path" to read it from a file; "" = unconditional (see above)
num_samples = 3            # samples, one after the other
max_new_tokens = 256       # tokens to generate per sample
temperature = 0.8          # < 1 sharpens the distribution, > 1 flattens it; <= 0 is greedy
top_k = 200                # sample only among the k most likely tokens (None or 0: no limit)
top_p = 1.0                # nucleus: the smallest set of tokens holding this much probability (1.0: off)
seed = 1337                # the same seed, checkpoint, device and settings give the same samples
device = "auto"            # "auto" (cuda, then mps, then cpu), or "cpu", "cuda", "cuda:1", "mps"
dtype = "auto"             # "auto" (bfloat16 on a GPU that has it, float16 on older GPUs, float32 on CPU),
                           # or "float32", "bfloat16", "float16"
compile = False            # torch.compile the model: slow to start, faster per token on a GPU
# -----------------------------------------------------------------------------


def die(message):
    """A user mistake: one line on stderr, exit status 1, no traceback."""
    print(f"sample.py: {message}", file=sys.stderr)
    sys.exit(1)


# Command-line overrides of the globals above.
option_names = ("out_dir", "ckpt", "start", "num_samples", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                "device", "dtype", "compile")
kinds = {int: "an integer", float: "a number", bool: "True or False"}
for arg in sys.argv[1:]:
    if arg in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    if not arg.startswith("--") or "=" not in arg:
        die(f"expected --name=value, got {arg!r} (see --help)")
    name, text = arg[2:].split("=", 1)
    if name not in option_names:
        die(f"unknown option --{name}; the options are: {', '.join('--' + n for n in option_names)}")
    default = globals()[name]
    if isinstance(default, str):
        value = text
    else:
        try:
            value = literal_eval(text)
        except (ValueError, SyntaxError):
            die(f"--{name}={text} is not a valid value: it must be {kinds[type(default)]}")
        if isinstance(default, float) and type(value) is int:
            value = float(value)
        allowed = (type(None), int) if name == "top_k" else (type(default),)
        if type(value) not in allowed:
            die(f"--{name}={text} is not a valid value: it must be {kinds[type(default)]}")
    globals()[name] = value

if num_samples < 1 or max_new_tokens < 0:
    die("--num_samples must be at least 1 and --max_new_tokens at least 0")
if top_k is not None and top_k < 0:
    die(f"--top_k={top_k}: use a positive number, or 0/None for no limit")
if not 0.0 < top_p <= 1.0:
    die(f"--top_p={top_p} must be in (0, 1]; 1.0 turns nucleus sampling off")
if temperature <= 0:
    print(f"sample.py: temperature {temperature} <= 0: greedy decoding (always the most likely token)", file=sys.stderr)
if start.startswith("FILE:"):
    try:
        with open(start[len("FILE:"):], encoding="utf-8") as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as err:
        die(f"can't read the prompt file {start[len('FILE:'):]}: {err.strerror if isinstance(err, OSError) else err}")

# The device and the precision.
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
try:
    device_type = torch.device(device).type
except RuntimeError:
    die(f"--device={device} is not a device torch knows (try cpu, cuda, cuda:0, mps)")
if device_type == "cuda" and not torch.cuda.is_available():
    die(f"--device={device} but this torch sees no CUDA GPU: use --device=cpu")
if device_type == "mps" and not torch.backends.mps.is_available():
    die(f"--device={device} but this torch has no MPS (Apple GPU) support here: use --device=cpu")
if dtype == "auto":
    dtype = "float32" if device_type != "cuda" else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
if dtype not in ("float32", "bfloat16", "float16"):
    die(f"--dtype={dtype}: use float32, bfloat16 or float16")
# Weights stay float32; autocast runs the matmuls in the lower precision, as in training.
autocast = nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=getattr(torch, dtype))

# The checkpoint and the model.
try:
    checkpoint = load_checkpoint(os.path.join(out_dir, ckpt), map_location="cpu")
    model = model_from_checkpoint(checkpoint)
except CheckpointError as err:
    die(str(err))
model.eval().to(device)
if compile:
    model.compile()  # in place: generate() calls self(...), which a torch.compile wrapper would bypass
vocab_size = model.config.vocab_size

# The tokenizer the checkpoint records: encode(text) -> ids, token_bytes(id) -> bytes, and the empty-prompt start.
tokenizer = checkpoint.get("tokenizer")
if tokenizer is None and isinstance(checkpoint.get("dataset"), dict) and checkpoint["dataset"].get("chars"):
    tokenizer = {"kind": "char", "chars": checkpoint["dataset"]["chars"]}  # a char dataset's meta.json
if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in ("bpe", "tiktoken", "char"):
    die(f"{os.path.join(out_dir, ckpt)} records no tokenizer (its 'tokenizer' entry is {tokenizer!r}): "
        f"it was not written by train.py")
if tokenizer["kind"] == "char":
    chars = tokenizer["chars"]
    char_to_id = {char: i for i, char in enumerate(chars)}

    def encode(text):
        missing = sorted(set(text) - set(char_to_id))
        if missing:
            die(f"the prompt has {len(missing)} character(s) the model's vocabulary lacks: "
                f"{' '.join(repr(char) for char in missing[:20])}{' ...' if len(missing) > 20 else ''}; "
                f"remove or replace them")
        return [char_to_id[char] for char in text]

    def token_bytes(token_id):
        return chars[token_id].encode("utf-8") if token_id < len(chars) else b""

    empty_prompt_ids = [char_to_id["\n"] if "\n" in char_to_id else 0]
else:
    import tiktoken
    if tokenizer["kind"] == "bpe":
        try:
            ranks = {}
            for line in tokenizer["ranks"].splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            encoding = tiktoken.Encoding(name=f"lillm_{os.path.basename(os.path.abspath(out_dir))}",
                                         pat_str=tokenizer["pattern"], mergeable_ranks=ranks,
                                         special_tokens=tokenizer.get("special_tokens", {}))
        except Exception as err:  # a missing key, a bad line, a bad pattern: the entry is not what train.py writes
            die(f"the checkpoint's BPE tokenizer entry is malformed ({type(err).__name__}: {str(err)[:100]})")
    else:
        if tokenizer.get("name") not in tiktoken.list_encoding_names():
            die(f"the checkpoint names the tiktoken encoding {tokenizer.get('name')!r}, which this tiktoken does not "
                f"know (it knows {', '.join(tiktoken.list_encoding_names())}): upgrade tiktoken")
        try:
            encoding = tiktoken.get_encoding(tokenizer["name"])
        except Exception as err:  # unknown name, or no internet for tiktoken's first download
            die(f"can't load the tiktoken encoding {tokenizer['name']!r} ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:100] if str(err) else ''}); tiktoken downloads it on first use, "
                f"so run once where its download URL is reachable")

    def encode(text):
        return encoding.encode(text, allowed_special="all")

    def token_bytes(token_id):
        # Ids past the tokenizer (a vocab padded to a multiple of 64) never occur in training data; print nothing.
        return encoding.decode_single_token_bytes(token_id) if token_id < encoding.n_vocab else b""

    has_eot = "<|endoftext|>" in encoding.special_tokens_set
    empty_prompt_ids = [encoding.encode_single_token("<|endoftext|>")] if has_eot else None

# The prompt.
prompt_ids = encode(start) if start else empty_prompt_ids
if prompt_ids is None:
    die("the prompt is empty and this tokenizer has no <|endoftext|> token to start from: give --start=...")
if max(prompt_ids) >= vocab_size:
    die(f"the prompt encodes to token id {max(prompt_ids)}, beyond the model's vocab_size={vocab_size}: "
        f"the checkpoint's tokenizer and model don't match")
if len(prompt_ids) > model.config.block_size:
    print(f"sample.py: the prompt has {len(prompt_ids)} tokens, more than block_size={model.config.block_size}: "
          f"the model sees only the last {model.config.block_size}", file=sys.stderr)
    prompt_ids = prompt_ids[-model.config.block_size:]
idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)

# Generate, printing each token as soon as it is complete text.
torch.manual_seed(seed)
if hasattr(sys.stdout, "reconfigure"):
    sys.stdout.reconfigure(errors="replace")  # a terminal that can't show a character gets '?', not a crash
new_tokens, seconds = 0, 0.0
for sample_number in range(num_samples):
    # A BPE token can end in the middle of a multi-byte character: the incremental decoder keeps such bytes
    # until the character is complete (invalid bytes become U+FFFD, as a whole-text decode would make them).
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(start)
    sys.stdout.flush()
    t0 = time.perf_counter()
    with autocast:
        for token in model.generate_tokens(idx, max_new_tokens, temperature=temperature, top_k=top_k or None,
                                           top_p=top_p):
            text = decoder.decode(token_bytes(token.item()))
            new_tokens += 1
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
    seconds += time.perf_counter() - t0
    sys.stdout.write(decoder.decode(b"", final=True) + "\n---------------\n")
    sys.stdout.flush()
print(f"sample.py: {new_tokens} tokens in {seconds:.2f} s: {new_tokens / max(seconds, 1e-9):.1f} tokens/s "
      f"({device}, {dtype}, prompt prefill included)", file=sys.stderr)
