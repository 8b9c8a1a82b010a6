"""
Export a model trained by train.py as a Hugging Face Llama model, with its tokenizer.

    python export_hf.py --out_dir=out-lillm --hf_dir=hf-lillm
    python export_hf.py --out_dir=out-quickstart --ckpt=ckpt_2000.pt --hf_dir=hf-quickstart --dtype=bfloat16

Every global in the block below can be overridden with --name=value (the style of sample.py and train.py).
Exporting needs only torch (and tiktoken for a tiktoken-named tokenizer); loading the result needs transformers:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf-lillm")
    tokenizer = AutoTokenizer.from_pretrained("hf-lillm")

Our model already is a Llama (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, tied embeddings, no
biases), so exporting is bookkeeping, not conversion: the same numbers under Llama's names, a config.json that
describes them, and the tokenizer rewritten for HF `tokenizers`. hf_dir gets config.json, model.safetensors,
tokenizer.json and tokenizer_config.json, all at once: they are written to a temporary directory beside it,
which is then renamed, so a failed export never leaves half a model. Char-level models are refused (see step 1).
"""
import base64
import json
import os
import shutil
import struct
import sys

import torch

from model import CheckpointError, load_checkpoint, model_from_checkpoint

# -----------------------------------------------------------------------------
out_dir = "out"            # the directory train.py wrote (its --out_dir)
ckpt = "ckpt.pt"           # file name inside out_dir; milestones are ckpt_<iter>.pt
hf_dir = "hf"              # where the Hugging Face model goes; must not exist, or be empty
dtype = "float32"          # float32 (exactly the trained weights), or bfloat16 / float16 (half the size)
# -----------------------------------------------------------------------------


def die(message):
    """A user mistake: one line on stderr, exit status 1, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


# Command-line overrides of the globals above (all are strings, so no parsing beyond name=value).
option_names = ("out_dir", "ckpt", "hf_dir", "dtype")
for arg in sys.argv[1:]:
    if arg in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0)
    if not arg.startswith("--") or "=" not in arg:
        die(f"expected --name=value, got {arg!r} (see --help)")
    name, value = arg[2:].split("=", 1)
    if name not in option_names:
        die(f"unknown option --{name}; the options are: {', '.join('--' + n for n in option_names)}")
    globals()[name] = value
if dtype not in ("float32", "bfloat16", "float16"):
    die(f"--dtype={dtype}: use float32, bfloat16 or float16")
hf_dir = os.path.normpath(hf_dir)
if os.path.exists(hf_dir) and not (os.path.isdir(hf_dir) and not os.listdir(hf_dir)):
    die(f"--hf_dir={hf_dir} already exists and is not an empty directory: remove it or choose another --hf_dir")

# 1. The checkpoint: the same loader as sample.py, which refuses missing, corrupt and foreign files in one line.
try:
    checkpoint = load_checkpoint(os.path.join(out_dir, ckpt), map_location="cpu")
    model = model_from_checkpoint(checkpoint)
except CheckpointError as err:
    die(str(err))
cfg = model.config
tokenizer = checkpoint.get("tokenizer")
if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in ("bpe", "tiktoken", "char"):
    die(f"{os.path.join(out_dir, ckpt)} records no tokenizer (its 'tokenizer' entry is {tokenizer!r}): "
        f"it was not written by train.py")
if tokenizer["kind"] == "char":
    die("this is a char-level model: its tokens are one dataset's characters, with no bytes for any other text "
        "and no <|endoftext|> to start or stop on, so it can't be the byte-level tokenizer the export promises; "
        "export a model trained on a BPE tokenizer (train_bpe_cpu.py, or a tiktoken name like gpt2)")

# 2. The weights under Llama's names. Only the names change: our checkpoints hold float32 [out, in] matrices
# like any nn.Linear, which is also how LlamaForCausalLM stores them.
#
# Rotary embeddings need a look, because HF's own Llama converter permutes the rows of q and k: Meta's
# checkpoints rotate channel pairs (2i, 2i+1), HF Llama rotates pairs (i, i + head_dim/2) ("rotate half").
# model.py's apply_rope already pairs (i, i + head_dim/2), with the same frequencies (theta^(-2i/head_dim)), so
# q and k are copied as they are; tests/test_export_hf.py compares the logits of both models to check it.
LAYER_NAMES = {"ln_1": "input_layernorm", "attn.c_q": "self_attn.q_proj", "attn.c_k": "self_attn.k_proj",
               "attn.c_v": "self_attn.v_proj", "attn.c_proj": "self_attn.o_proj", "ln_2": "post_attention_layernorm",
               "mlp.c_gate": "mlp.gate_proj", "mlp.c_up": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}


def llama_name(name):
    """model.py's parameter name -> LlamaForCausalLM's, e.g. transformer.h.3.attn.c_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    if name == "transformer.wte.weight":
        return "model.embed_tokens.weight"
    if name == "transformer.ln_f.weight":
        return "model.norm.weight"
    _, _, layer, rest = name.split(".", 3)  # transformer . h . <layer> . <module path>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"model.layers.{layer}.{LAYER_NAMES[module]}.{kind}"


# The output head is the embedding matrix (tied), so it is stored once and config.json says it is tied.
weights = {llama_name(name): tensor.to(getattr(torch, dtype)).contiguous()
           for name, tensor in model.state_dict().items() if name != "lm_head.weight"}

# 3. The tokenizer, as the ranks tiktoken encodes with: our BPE directory's rank file (stored in the
# checkpoint), or a tiktoken encoding by name (char-level models were refused in step 1).
if tokenizer["kind"] == "bpe":
    try:
        ranks = {base64.b64decode(token): int(rank)
                 for token, rank in (line.split() for line in tokenizer["ranks"].splitlines() if line.strip())}
        pattern, special_tokens = tokenizer["pattern"], dict(tokenizer.get("special_tokens", {}))
    except Exception as err:  # a missing key or a bad line: the entry is not what train.py writes
        die(f"the checkpoint's BPE tokenizer entry is malformed ({type(err).__name__}: {str(err)[:100]})")
else:
    import tiktoken
    try:
        encoding = tiktoken.get_encoding(tokenizer["name"])
    except Exception as err:  # an unknown name, or tiktoken's first download with no internet
        die(f"can't load the tiktoken encoding {tokenizer['name']!r} ({type(err).__name__}), and its ranks are "
            f"what tokenizer.json is built from: run once where tiktoken can download it (it caches it)")
    # tiktoken keeps the ranks and pattern in private attributes; they are the whole definition of the encoding.
    ranks, pattern, special_tokens = encoding._mergeable_ranks, encoding._pat_str, dict(encoding._special_tokens)
largest_id = max([*ranks.values(), *special_tokens.values()])
if largest_id >= cfg.vocab_size:
    die(f"the tokenizer has ids up to {largest_id}, beyond the model's vocab_size={cfg.vocab_size}: the checkpoint's "
        f"tokenizer and model don't match")
EOT = "<|endoftext|>"
eot_id = special_tokens.get(EOT)  # bos and eos, when the tokenizer has it: every training document starts with it


def byte_to_char():
    """GPT-2's table of the 256 bytes as printable characters. HF's byte-level BPE works on strings, not bytes,
    so every byte gets a visible stand-in (a space becomes 'Ġ'); its ByteLevel pre-tokenizer and decoder use
    this same table, and the vocabulary and merges are written in it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:  # control characters, space, and the like: moved past 255, in order
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def hf_tokenizer_json(ranks, pattern, special_tokens):
    """The tokenizer.json that makes HF `tokenizers` encode exactly like tiktoken with these ranks.

    tiktoken keeps no merge list: in each regex chunk it repeatedly joins the adjacent pair whose bytes form the
    lowest-ranked token (the leftmost on a tie). HF's BPE joins listed pairs, lowest in the list first. So the
    list holds every way to cut each token into two tokens, in the token's rank order: any pair tiktoken would
    join is listed, at its token's place. And tiktoken takes a chunk that is a whole token as it is, without
    merging; ignore_merges does the same in HF. (One corner can differ: two different cuts of the same token
    in one chunk at once, where tiktoken joins the leftmost and HF the one listed first. transformers' own
    tiktoken converter shares it; on the test's real text, 435 languages included, it never happens.)"""
    table = byte_to_char()

    def text(token):
        return "".join(table[byte] for byte in token)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        cuts.sort(key=lambda cut: (ranks[cut[0]], ranks[cut[1]]))
        # "left right" (one string) is readable by every tokenizers version; no byte maps to a space, so it parses.
        merges += [f"{text(left)} {text(right)}" for left, right in cuts]
    return {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": token_id, "content": content, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for content, token_id in special_tokens.items()],
        # First the split regex (chunks never merge across it), then bytes -> characters.
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,  # nothing added around the text: encode() gives what tiktoken's encode gives
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in ranks.items()}, "merges": merges},
    }


tokenizer_config = {
    # The class that reads tokenizer.json on its own; no Python code of ours is needed to load it.
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": cfg.block_size,
    "clean_up_tokenization_spaces": False,  # decode must give back the exact text, spaces before '.' included
    "add_bos_token": False, "add_eos_token": False,  # like tiktoken's encode (and sample.py's prompts)
    **({"bos_token": EOT, "eos_token": EOT} if eot_id is not None else {}),
}

# 4. config.json: the sizes, and the two constants that are easy to miss (rope_theta and the norm epsilon).
# rope_theta is written both ways: top-level (transformers 4, vLLM, llama.cpp) and in rope_parameters (5.x).
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": cfg.vocab_size,  # the model's: it may be padded past the tokenizer to a multiple of 64
    "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer, "max_position_embeddings": cfg.block_size,
    "intermediate_size": cfg.ffn_hidden_size,  # ffn_ratio * n_embd rounded up to ffn_multiple_of, as in model.py
    "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_kv_head, "head_dim": cfg.n_embd // cfg.n_head,
    "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    "rope_scaling": None,
    # our `bias` switches on the biases of q, k, v, o and the three MLP matrices: Llama has the same two switches
    "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": 0.0,
    "tie_word_embeddings": True, "bos_token_id": eot_id, "eos_token_id": eot_id,
    "torch_dtype": dtype, "dtype": dtype,  # transformers 4's name and 5's
    "use_cache": True, "initializer_range": 0.02,
}

# 5. model.safetensors, written here: the format is an 8-byte header length, a JSON header (each tensor's
# dtype, shape and byte range) and the raw little-endian bytes. Twenty lines save the pipeline a dependency
# (the `safetensors` package), and the test reads the file back with that package as an independent check.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path, tensors):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # pad with spaces so the tensor data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for tensor in tensors.values():  # torch's CPU tensors are little-endian on every platform it runs on
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# 6. Everything into a temporary directory beside hf_dir, then one rename: hf_dir appears complete or not at all.
temp_dir = f"{hf_dir}.tmp.{os.getpid()}"
try:
    os.makedirs(temp_dir)
    write_json(os.path.join(temp_dir, "config.json"), config)
    write_safetensors(os.path.join(temp_dir, "model.safetensors"), weights)
    write_json(os.path.join(temp_dir, "tokenizer.json"), hf_tokenizer_json(ranks, pattern, special_tokens))
    write_json(os.path.join(temp_dir, "tokenizer_config.json"), tokenizer_config)
    if os.path.isdir(hf_dir):
        os.rmdir(hf_dir)  # empty (checked above); rename can't replace a directory on every OS
    os.rename(temp_dir, hf_dir)
except OSError as err:
    die(f"can't write {hf_dir}: {err.strerror or err}")
finally:
    shutil.rmtree(temp_dir, ignore_errors=True)
size = sum(tensor.numel() for tensor in weights.values())
print(f"wrote {hf_dir}: LlamaForCausalLM with {size:,} parameters ({dtype}), tokenizer of {len(ranks) + len(special_tokens):,} "
      f"ids ({tokenizer['kind']}); load it with AutoModelForCausalLM.from_pretrained({hf_dir!r})", file=sys.stderr)
