"""
Sample text from a model trained by train.py, streaming it token by token.

    python sample.py --out_dir=out-lillm
    python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --max_new_tokens=300
    python sample.py --out_dir=out-lillm --start=FILE:prompt.txt --top_k=200 --top_p=0.95
    python sample.py --out_dir=out-lillm --ckpt=ckpt_5000.pt --temperature=0  # greedy, a milestone

Override any setting below with --key=value. The checkpoint holds the model and its tokenizer.
--start="" starts from <|endoftext|>, which begins every training document (a char model:
"\\n"); in a prompt, "<|endoftext|>" is that token. Samples go to stdout, each followed by a
separator line; the rest to stderr.
"""
import ast
import codecs
import difflib
import math
import os
import signal
import sys
import time

import torch

from model import (GREEDY_BELOW, CharTokenizer, CheckpointError, encoding_from_checkpoint,
                   load_checkpoint, model_from_checkpoint, bytes_of_id)

_names_before_settings = set(globals())
# -----------------------------------------------------------------------------
out_dir = "out"    # the directory train.py wrote (its --out_dir)
ckpt = "ckpt.pt"   # file name inside out_dir; milestones are ckpt_<iter>.pt
start = ""         # the prompt, or "FILE:path" to read it from a file
num_samples = 3
max_new_tokens = 256
temperature = 0.8  # < 1 sharpens the distribution, > 1 flattens it
top_k = 200        # sample among the k most likely tokens (None or 0: all)
top_p = 1.0        # nucleus: the fewest tokens that hold this much probability (1.0: off)
seed = 1337        # same seed, checkpoint, device and settings: same samples
device = "auto"    # "auto": cuda if there is a GPU, else cpu; or "cuda:1", "mps"
dtype = "auto"     # "auto": bfloat16 (float16 on old GPUs); float32 on a CPU
# -----------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items() if k not in _names_before_settings and k[0] != "_"}
EOT = "<|endoftext|>"


def main():
    globals().update(parse_settings(sys.argv[1:], defaults, {"top_k": type(None)}))
    validate()
    prompt = read_prompt(start)
    device_name, device_type = check_device(device)
    precision = dtype
    if dtype == "auto":
        bf16 = device_type == "cuda" and torch.cuda.get_device_capability(device_name) >= (8, 0)
        precision = "bfloat16" if bf16 else "float16" if device_type == "cuda" else "float32"
    # A token reads every weight: cast once to bf16, half the bytes, none of autocast's casts.
    # float16 keeps autocast: a float16 residual stream can overflow.
    ctx = torch.autocast(device_type, torch.float16, enabled=precision == "float16")

    checkpoint = load_checkpoint(os.path.join(out_dir, ckpt))
    model = model_from_checkpoint(checkpoint)
    encoding = encoding_from_checkpoint(checkpoint)
    model.eval().to(device_name)
    if precision == "bfloat16":
        model.cast_weights(torch.bfloat16)
    prompt_ids = encode_prompt(encoding, prompt, model.config.block_size)
    idx = torch.tensor([prompt_ids], device=device_name)

    with ctx:  # untimed: on a GPU the first decode steps compile a CUDA graph
        list(model.generate_tokens(idx, 4, temperature=0))

    torch.manual_seed(seed)
    sys.stdout.reconfigure(errors="replace")  # a character the terminal lacks becomes '?'
    seconds = 0.0
    for _ in range(num_samples):
        # A BPE token can end inside a multi-byte character: the decoder holds it until whole.
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        print(prompt, end="")
        started = time.perf_counter()
        with ctx:
            for token in model.generate_tokens(idx, max_new_tokens, temperature=temperature,
                                               top_k=top_k, top_p=top_p):
                print(decoder.decode(bytes_of_id(encoding, token.item())), end="", flush=True)
        seconds += time.perf_counter() - started
        print(decoder.decode(b"", final=True), end="\n---------------\n", flush=True)
    new_tokens = num_samples * max_new_tokens
    print(f"{new_tokens} tokens in {seconds:.2f} s: {new_tokens / max(seconds, 1e-9):.1f} tokens/s "
          f"({device_name}, {precision}, prompt prefill included)", file=sys.stderr)


def encode_prompt(encoding, prompt, block_size):
    if prompt:
        try:
            prompt_ids = encoding.encode(prompt, allowed_special="all")
        except ValueError as err:  # a character the char-level vocabulary lacks
            raise UserError(f"the prompt has {err}; remove or replace them") from None
    elif EOT in encoding.special_tokens_set:
        prompt_ids = [encoding.encode_single_token(EOT)]
    elif isinstance(encoding, CharTokenizer):
        prompt_ids = [encoding.ids.get("\n", 0)]
    else:
        raise UserError(f"this tokenizer has no {EOT} to start from: give a prompt, --start=...")
    if len(prompt_ids) > block_size:
        print(f"warning: the prompt has {len(prompt_ids)} tokens: the model sees only the last "
              f"{block_size} (its block_size)", file=sys.stderr)
    return prompt_ids[-block_size:]


# === plumbing: the settings' checks, the prompt file, the device

class UserError(Exception):
    """Bad input: one line, no traceback."""


def parse_settings(arguments, defaults, extra_types):
    """--key=value overrides as {key: value}: a Python literal of the default's (or
    extra_types[key]'s) type; a str setting's text as is."""
    settings = {}
    for arg in arguments:
        if arg in ("-h", "--help"):
            listing = "\n".join(f"  --{key}={value!r}" for key, value in defaults.items())
            print(f"{__doc__.strip()}\n\nsettings and their defaults:\n{listing}")
            sys.exit(0)
        if any("\udc80" <= char <= "\udcff" for char in arg):  # non-UTF-8 bytes, escaped
            raise UserError(f"{arg!r}: not valid UTF-8")
        key, has_value, text = arg[2:].partition("=")
        if not arg.startswith("--") or not has_value:
            raise UserError(f"expected --key=value, got {arg!r} (see --help)")
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{arg}: unknown setting {key!r}{hint}; --help lists them")
        kinds = {type(defaults[key]), extra_types.get(key, type(defaults[key]))}
        if str not in kinds and len(text) > 1000:  # 50,000 characters exhaust ast's parser
            raise UserError(f"{arg[:30]}...: a value of over 1,000 characters")
        try:
            value = text if str in kinds else ast.literal_eval(text)
        except (ValueError, SyntaxError, RecursionError):
            value = text
        if type(value) is int and float in kinds:
            value = float(value)
        if type(value) not in kinds:
            names = " or ".join(sorted(kind.__name__.replace("NoneType", "None") for kind in kinds))
            raise UserError(f"{arg}: {key} must be {names}, got {value!r} ({type(value).__name__})")
        settings[key] = value
    return settings


def validate():
    for name, ok, rule in [
        ("num_samples", num_samples >= 1, "must be at least 1"),
        ("max_new_tokens", max_new_tokens >= 0, "must be 0 or more"),
        ("top_k", top_k is None or top_k >= 0, "must be 0 (no limit) or more"),
        ("top_p", 0.0 < top_p <= 1.0, "must be in (0, 1]; 1.0 turns it off"),
        ("temperature", 0 <= temperature < math.inf, "must be finite, 0 (greedy) or more"),
        ("seed", 0 <= seed < 2**64, "must be from 0 to 2^64-1"),
        ("dtype", dtype in ("auto", "float32", "bfloat16", "float16"),
         "use float32, bfloat16 or float16"),
    ]:
        if not ok:
            raise UserError(f"--{name}={globals()[name]}: {rule}")
    if temperature < GREEDY_BELOW:
        print(f"note: temperature {temperature}: greedy (the most likely token)", file=sys.stderr)


def read_prompt(text):
    if not text.startswith("FILE:"):
        return text
    path = text[len("FILE:"):]
    try:
        if os.path.getsize(path) > 10**7 or not os.path.isfile(path):  # a FIFO: endless
            raise ValueError("not a regular file of at most 10 MB")
        with open(path, encoding="utf-8-sig", newline="") as f:  # CRLF kept: the model saw bytes
            return f.read(10**7)
    except (OSError, ValueError) as err:
        raise UserError(f"can't read the prompt file {path}: {err}") from None


def check_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = name.split(":")[0]
    try:
        if device_type in ("cpu", "cuda", "mps"):
            torch.empty(1, device=name)  # a GPU this machine lacks fails here
            return name, device_type
    except (RuntimeError, AssertionError):
        pass
    raise UserError(f"--device={name}: not a device of this machine (cpu, cuda, cuda:<index>, mps)")


if __name__ == "__main__":
    # Ctrl-C, or a reader closing the pipe (`| head`), ends it quietly.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if hasattr(signal, "SIGPIPE"):  # not on Windows
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        main()
    except (UserError, CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
