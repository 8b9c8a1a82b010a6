"""
Sample text from a model trained by train.py, streaming it token by token.

    python sample.py --out_dir=out-lillm
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --num_samples=3 --max_new_tokens=300
    python sample.py --out_dir=out-lillm --start=FILE:prompt.txt --temperature=0.8 --top_k=200 --top_p=0.95
    python sample.py --out_dir=out-lillm --ckpt=ckpt_5000.pt --temperature=0    # greedy, from a milestone

Every global in the settings block below can be overridden with --key=value, as in train.py.

- The model and its tokenizer both come from the checkpoint (out_dir/ckpt.pt): the model config and weights,
  and the tokenizer entry (our BPE ranks, a tiktoken name, or the char list), so sampling needs no other file.
- --start="" (the default) samples unconditionally: BPE/tiktoken models start from <|endoftext|>, the token
  that precedes every document in training; char-level models have no such token and start from "\\n" (or
  the first character of the vocabulary when it has no newline). In a BPE prompt, "<|endoftext|>" is the EOT.
- --temperature <= 0 means greedy decoding: always the most likely token (top_k and top_p then do nothing).
- Samples go to stdout, each followed by a separator line; everything else (tokens/s included) goes to stderr.
"""
import ast
import base64
import codecs
import difflib
import os
import signal
import sys
import time
from contextlib import nullcontext

import torch

from model import CheckpointError, load_checkpoint, model_from_checkpoint

# Ctrl-C, or a reader that closed the pipe (`| head`), ends sample.py at once and quietly, as it ends any Unix tool.
signal.signal(signal.SIGINT, signal.SIG_DFL)
if hasattr(signal, "SIGPIPE"):  # not on Windows
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)

_names_before_settings = set(globals())
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
device = "auto"            # "auto" (cuda if there is a GPU, else cpu), or "cpu", "cuda", "cuda:1", "mps"
dtype = "auto"             # "auto": bfloat16 on a GPU that has it, float16 on older GPUs, float32 on the CPU
                           # (most CPUs emulate bfloat16, many times slower); or "float32", "bfloat16", "float16"
compile = False            # torch.compile the model: slow to start, faster per token on a GPU
# -----------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items() if k not in _names_before_settings and not k.startswith("_")}

def fail(message):
    """A user mistake: one line on stderr, exit status 1, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)

for arg in sys.argv[1:]:  # --key=value overrides, as in train.py: a setting's value must have its default's type
    if arg in ("-h", "--help"):
        print(__doc__.strip() + "\n\nsettings and their defaults:\n" + "\n".join(f"  --{k}={v!r}" for k, v in defaults.items()))
        sys.exit(0)
    key, has_value, text = arg[2:].partition("=")
    if not arg.startswith("--") or not has_value:
        fail(f"expected --key=value, got {arg!r} (see --help)")
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        fail(f"{arg}: unknown setting {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "") + "; --help lists them")
    try:  # a str setting takes the text as it is; the others read a Python literal
        value = text if type(defaults[key]) is str else ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    allowed = {type(defaults[key])} | ({type(None)} if key == "top_k" else set())
    value = float(value) if type(value) is int and float in allowed else value
    if type(value) not in allowed:
        names = " or ".join(sorted("None" if t is type(None) else t.__name__ for t in allowed))
        fail(f"{arg}: {key} must be {names}, got {value!r} ({type(value).__name__})")
    globals()[key] = value

for bad, message in [(num_samples < 1 or max_new_tokens < 0, "--num_samples must be at least 1 and --max_new_tokens at least 0"),
                     (top_k is not None and top_k < 0, f"--top_k={top_k}: use a positive number, or 0/None for no limit"),
                     (not 0.0 < top_p <= 1.0, f"--top_p={top_p} must be in (0, 1]; 1.0 turns nucleus sampling off"),
                     (dtype not in ("auto", "float32", "bfloat16", "float16"), f"--dtype={dtype}: use float32, bfloat16 or float16")]:
    if bad:
        fail(message)
if temperature <= 0:
    print(f"note: temperature {temperature} <= 0: greedy decoding (always the most likely token)", file=sys.stderr)
if start.startswith("FILE:"):
    try:
        with open(start[len("FILE:"):], encoding="utf-8") as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as err:
        fail(f"can't read the prompt file {start[len('FILE:'):]}: {err.strerror if isinstance(err, OSError) else err}")

# The device and the precision.
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
try:
    device_type = torch.device(device).type
except RuntimeError:
    fail(f"--device={device} is not a device torch knows (try cpu, cuda, cuda:0, mps)")
if not {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}.get(device_type, True):
    fail(f"--device={device} but this torch has no such device here: use --device=cpu")
if dtype == "auto":
    dtype = "float32" if device_type != "cuda" else "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
# Weights stay float32; autocast runs the matmuls in the lower precision, as in training.
autocast = nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=getattr(torch, dtype))

# The checkpoint and the model.
try:
    checkpoint = load_checkpoint(os.path.join(out_dir, ckpt), map_location="cpu")
    model = model_from_checkpoint(checkpoint)
except CheckpointError as err:
    fail(str(err))
model.eval().to(device)
if compile:
    model.compile()  # in place: generate() calls self(...), which a torch.compile wrapper would bypass

# The tokenizer the checkpoint records: encode(text) -> ids, token_bytes(id) -> bytes, and the empty-prompt start.
tokenizer = checkpoint.get("tokenizer")
if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in ("bpe", "tiktoken", "char"):
    fail(f"{os.path.join(out_dir, ckpt)} records no tokenizer (its 'tokenizer' entry is {tokenizer!r}): it was not written by train.py")
if tokenizer["kind"] == "char":
    chars = tokenizer["chars"]
    char_to_id = {char: i for i, char in enumerate(chars)}

    def encode(text):
        missing = sorted(set(text) - set(char_to_id))
        if missing:
            fail(f"the prompt has {len(missing)} character(s) the model's vocabulary lacks: "
                 f"{' '.join(repr(char) for char in missing[:20])}{' ...' * (len(missing) > 20)}; remove or replace them")
        return [char_to_id[char] for char in text]

    def token_bytes(token_id):
        return chars[token_id].encode("utf-8") if token_id < len(chars) else b""

    empty_prompt_ids = [char_to_id["\n"] if "\n" in char_to_id else 0]
else:
    import tiktoken
    if tokenizer["kind"] == "bpe":
        try:
            ranks = {base64.b64decode(token): int(rank) for token, rank in map(str.split, tokenizer["ranks"].splitlines())}
            encoding = tiktoken.Encoding(name=f"lillm_{os.path.basename(os.path.abspath(out_dir))}",
                                         pat_str=tokenizer["pattern"], mergeable_ranks=ranks,
                                         special_tokens=tokenizer.get("special_tokens", {}))
        except Exception as err:  # a missing key, a bad line, a bad pattern: the entry is not what train.py writes
            fail(f"the checkpoint's BPE tokenizer entry is malformed ({type(err).__name__}: {str(err)[:100]})")
    else:
        try:
            encoding = tiktoken.get_encoding(tokenizer.get("name"))
        except Exception as err:  # a name this tiktoken doesn't know, or no internet for its first download
            fail(f"can't load the tiktoken encoding {tokenizer.get('name')!r} ({type(err).__name__}: {str(err)[:100]}); "
                 f"tiktoken knows {', '.join(tiktoken.list_encoding_names())} and downloads one on first use")

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
    fail("the prompt is empty and this tokenizer has no <|endoftext|> token to start from: give --start=...")
if max(prompt_ids) >= model.config.vocab_size:
    fail(f"the prompt encodes to token id {max(prompt_ids)}, beyond the model's vocab_size={model.config.vocab_size}: "
         f"the checkpoint's tokenizer and model don't match")
if len(prompt_ids) > model.config.block_size:
    print(f"warning: the prompt has {len(prompt_ids)} tokens, more than block_size={model.config.block_size}: "
          f"the model sees only the last {model.config.block_size}", file=sys.stderr)
    prompt_ids = prompt_ids[-model.config.block_size:]
idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)

# Generate, printing each token as soon as it is complete text.
torch.manual_seed(seed)
sys.stdout.reconfigure(errors="replace")  # a terminal that can't show a character gets '?', not a crash
new_tokens, seconds = 0, 0.0
for sample_number in range(num_samples):
    # A BPE token can end in the middle of a multi-byte character: the incremental decoder keeps such bytes
    # until the character is complete (invalid bytes become U+FFFD, as a whole-text decode would make them).
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(start)
    t0 = time.perf_counter()
    with autocast:
        for token in model.generate_tokens(idx, max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p):
            sys.stdout.write(decoder.decode(token_bytes(token.item())))
            sys.stdout.flush()
            new_tokens += 1
    seconds += time.perf_counter() - t0
    sys.stdout.write(decoder.decode(b"", final=True) + "\n---------------\n")
    sys.stdout.flush()
print(f"{new_tokens} tokens in {seconds:.2f} s: {new_tokens / max(seconds, 1e-9):.1f} tokens/s "
      f"({device}, {dtype}, prompt prefill included)", file=sys.stderr)
