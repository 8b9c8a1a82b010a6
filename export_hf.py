"""
Export a model trained by train.py as a Hugging Face Llama model, with its tokenizer.

    python export_hf.py --out_dir=out-lillm --hf_dir=hf-lillm
    python export_hf.py --out_dir=out-lillm --ckpt=ckpt_10000.pt --hf_dir=hf-10k --dtype=bfloat16

Override any setting below with --key=value. Loading the result needs transformers:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf-lillm")
    tokenizer = AutoTokenizer.from_pretrained("hf-lillm")

Our model already is a Llama, so exporting is bookkeeping, not conversion: the same numbers under
Llama's names, a config.json that describes them, and the tokenizer rewritten for HF `tokenizers`.
hf_dir gets its four files at once (a temporary directory, renamed): never half a model.
"""
import ast
import difflib
import fcntl
import json
import os
import re
import shutil
import signal
import sys

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from model import (CharTokenizer, CheckpointError, encoding_from_checkpoint, load_checkpoint,
                   model_from_checkpoint)

_names_before_settings = set(globals())
# -----------------------------------------------------------------------------
out_dir = "out"    # the directory train.py wrote (its --out_dir)
ckpt = "ckpt.pt"   # file name inside out_dir; milestones are ckpt_<iter>.pt
hf_dir = "hf"      # where the Hugging Face model goes; must not exist, or be empty
dtype = "float32"  # float32 (the weights exactly), or bfloat16 / float16 (half the size)
# -----------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items() if k not in _names_before_settings and k[0] != "_"}
EOT = "<|endoftext|>"


def main():
    globals().update(parse_settings(sys.argv[1:], defaults, {}))
    hf_path = os.path.realpath(hf_dir)  # a link: where it points
    validate(hf_path)

    # 1. The model and its tokenizer.
    checkpoint = load_checkpoint(os.path.join(out_dir, ckpt))
    model = model_from_checkpoint(checkpoint)
    encoding = encoding_from_checkpoint(checkpoint)
    if isinstance(encoding, CharTokenizer):
        raise UserError("a char-level model's tokens are not bytes: export a BPE or tiktoken model")

    # 2. The weights under Llama's names; the output head is the tied embedding, stored once.
    weights = {llama_name(name): tensor.to(getattr(torch, dtype)).contiguous()
               for name, tensor in model.state_dict().items() if name != "lm_head.weight"}

    # 3. The tokenizer, from tiktoken's private fields; config.json.
    ranks, special_tokens = encoding._mergeable_ranks, encoding._special_tokens
    eot_id = special_tokens.get(EOT)  # bos and eos: every training document starts with it
    tokenizer_config = {
        # This class reads tokenizer.json itself: loading runs no Python code of ours.
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.config.block_size,
        "clean_up_tokenization_spaces": False,  # decode gives back the exact text
        "add_bos_token": False, "add_eos_token": False,  # as tiktoken's encode, sample.py
    }
    if eot_id is not None:
        tokenizer_config.update(bos_token=EOT, eos_token=EOT)
    files = {"config.json": llama_config(model.config, eot_id),
             "tokenizer.json": hf_tokenizer_json(ranks, encoding._pat_str, special_tokens),
             "tokenizer_config.json": tokenizer_config}

    # 4. The files.
    write_directory(hf_path, weights, files)
    print(f"wrote {hf_path}: LlamaForCausalLM with {model.get_num_params():,} parameters "
          f"({dtype}), tokenizer of {len(ranks) + len(special_tokens):,} ids "
          f"({checkpoint['tokenizer']['kind']})", file=sys.stderr)


# The matrices are [out, in] in both. HF's converter permutes q and k for Meta's pairs (2i, 2i+1);
# HF rotates (i, i + head_dim/2), as apply_rope does: q and k are copied as is.
LAYER_NAMES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
               "attn.c_q": "self_attn.q_proj", "attn.c_k": "self_attn.k_proj",
               "attn.c_v": "self_attn.v_proj", "attn.c_proj": "self_attn.o_proj",
               "mlp.c_gate": "mlp.gate_proj", "mlp.c_up": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def llama_name(name):
    """transformer.h.3.attn.c_q.weight -> model.layers.3.self_attn.q_proj.weight, and the like."""
    if name == "transformer.wte.weight":
        return "model.embed_tokens.weight"
    if name == "transformer.ln_f.weight":
        return "model.norm.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"model.layers.{layer}.{LAYER_NAMES[module]}.{kind}"


def byte_to_char():
    """GPT-2's printable stand-in for each byte (a space is 'Ġ'): HF ByteLevel's alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    # The others (control characters, space, ...) move past 255, in order.
    others = [byte for byte in range(256) if byte not in printable]
    table = {byte: chr(byte) for byte in printable}
    table.update({byte: chr(256 + i) for i, byte in enumerate(others)})
    return table


def hf_tokenizer_json(ranks, pattern, special_tokens):
    """The tokenizer.json that makes HF `tokenizers` encode exactly like tiktoken with these ranks.

    tiktoken keeps no merge list: in each regex chunk it joins the adjacent pair whose bytes form
    the lowest-ranked token (leftmost on a tie); HF's BPE joins listed pairs, first listed first. So
    the list holds each token's cuts into two tokens, in rank order. A chunk that is a token stays
    whole in both (HF: ignore_merges). Two cuts of one token in a chunk: tiktoken joins the
    leftmost, HF the first listed, as transformers' converter; never in the test's 435 languages."""
    table = byte_to_char()
    # Oniguruma reads x{1,3}+ (cl100k's possessive) as (x{1,3})+: at an alternative's end as x{1,3}
    pattern = re.sub(r"(\{\d+,?\d*\})\+", r"\1", pattern)

    def text(token):
        return "".join(table[byte] for byte in token)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        cuts = [(token[:i], token[i:]) for i in range(1, len(token))
                if token[:i] in ranks and token[i:] in ranks]
        cuts.sort(key=lambda cut: (ranks[cut[0]], ranks[cut[1]]))
        # "left right": every tokenizers version reads it; no byte maps to a space.
        merges += [f"{text(left)} {text(right)}" for left, right in cuts]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    return {
        "version": "1.0",  # unlisted fields: defaults
        "added_tokens": [{"id": token_id, "content": content, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for content, token_id in special_tokens.items()],
        # First the split regex (chunks never merge across it), then bytes -> characters.
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": None,  # nothing added around the text
        "decoder": byte_level,
        "model": {"type": "BPE", "ignore_merges": True, "merges": merges,
                  # special tokens too: one not in vocab is renumbered (cl100k's 100257 -> 100256)
                  "vocab": {text(token): rank for token, rank in ranks.items()} | special_tokens},
    }


def llama_config(cfg, eot_id):
    """config.json; rope_theta and norm_eps are easy to miss. rope_theta is top-level (transformers
    4, vLLM, llama.cpp) and in rope_parameters (5.x)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size,  # the model's: it may be padded past the tokenizer
        "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer,
        "max_position_embeddings": cfg.block_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head,
        "head_dim": cfg.n_embd // cfg.n_head, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "rope_scaling": None,
        # our `bias` is Llama's two switches in one
        "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "tie_word_embeddings": True, "bos_token_id": eot_id, "eos_token_id": eot_id,
        "torch_dtype": dtype, "dtype": dtype,  # transformers 4's name and 5's
    }


# === plumbing: writing hf_dir, the settings' checks

def write_directory(hf_path, weights, files):
    made = not os.path.lexists(hf_path)
    temp_dir = f"{hf_path}.tmp.{os.getpid()}"
    try:
        os.makedirs(hf_path, exist_ok=True)
        lock_directory(hf_path)
        validate(hf_path)
        os.makedirs(temp_dir, exist_ok=True)  # a killed run's (containers: PID 1)
        save_file(weights, os.path.join(temp_dir, "model.safetensors"), metadata={"format": "pt"})
        for name, content in files.items():
            with open(os.path.join(temp_dir, name), "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, ensure_ascii=False)
                f.write("\n")
        os.rename(temp_dir, hf_path)
    except (OSError, SafetensorError) as err:  # safetensors' own error for a full disk
        raise UserError(f"can't write {hf_path}: {getattr(err, 'strerror', None) or err}") from None
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # a failure, or Ctrl-C, leaves nothing
        if made and os.path.isdir(hf_path) and not os.listdir(hf_path):
            os.rmdir(hf_path)


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


def validate(hf_path):
    if dtype not in ("float32", "bfloat16", "float16"):
        raise UserError(f"--dtype={dtype}: use float32, bfloat16 or float16")
    if os.path.exists(hf_path) and (not os.path.isdir(hf_path) or os.listdir(hf_path)):
        raise UserError(f"--hf_dir={hf_path} already exists and is not an empty directory: choose another")
    if os.path.ismount(hf_path):
        raise UserError(f"--hf_dir={hf_path} is a mount point: export into a new directory in it")


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


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill: as Ctrl-C
    try:
        main()
    except (UserError, CheckpointError, KeyboardInterrupt, OSError) as err:  # Ctrl-C's str(): ""
        print(f"error: {str(err) or 'interrupted; nothing is half-written'}", file=sys.stderr)
        sys.exit(1)
