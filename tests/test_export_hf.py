"""export_hf.py through its command line: the exported directory, loaded by transformers with no custom code, must
give model.py's logits and greedy tokens, and tiktoken's tokens. The checkpoints are tiny, trained here for a few
steps and saved with save_checkpoint. Two exports run as programs (a good one and a refusal); the other cases run
export_hf.py's command line in this process, which saves a torch import (~2 s) per case."""
import base64
import contextlib
import fcntl
import inspect
import io
import json
import os
import resource
import runpy
import signal
import subprocess
import sys
from dataclasses import asdict

import pytest
import tiktoken
import torch

REPO = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, REPO)
from model import GPT, GPTConfig, load_checkpoint, model_from_checkpoint, save_checkpoint  # noqa: E402

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Real text that every Python install carries (stdlib source), and a few scripts of 2, 3 and 4 UTF-8 bytes.
OFFLINE_DOCS = [inspect.getsource(module) for module in (json.decoder, json.encoder, base64)] + [
    "Héllo wörld, ça va? Übermäßig schön; naïve café. " * 8,
    "日本語のテキストです。東京と大阪、京都。 " * 8,
    "Привет, мир! Как дела? 한국어 텍스트입니다. مرحبا بالعالم " * 8,
    "Emoji 🙂🚀👩‍👩‍👧‍👦 and symbols → ≤ ≥ € 12345 6789.01 " * 8,
]
# Where tokenizers most often disagree: whitespace runs and line ends, digit groups, contractions, joiners.
EDGE_CASES = ["", " ", "  ", "\n", "\n\n\n", " \n ", "\t\t x", "a  b   c    ", "trailing   ", "   leading",
              "\r\n\r\n", "x\r\ny", "x\n\n  y", "1", "12", "123", "1234", "12345678901", "3.14159", "1,000,000",
              " 2024-11-23", "A1B22C333", "don't I'LL we've THEY'RE 'S", "😀", "👩‍👩‍👧‍👦", "🙂🚀x", "e\u0301",
              "ﬁ ß ǅ", "\u00a0nbsp\u00a0", "\u3000全角", "a\u200bb", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈", "\x00\x01\x7f", "    def f(x):\n"]
OFFLINE_VOCAB = 400  # byte tokens + merges; <|endoftext|> is id 400
MODELS = {
    # GQA, a SwiGLU hidden size from ffn_ratio 3.5 (8/3 would give 128, not 192), and non-default theta and eps.
    "gqa": GPTConfig(vocab_size=448, n_embd=48, n_layer=2, n_head=4, n_kv_head=2, block_size=96, ffn_ratio=3.5,
                     ffn_multiple_of=32, rope_theta=500.0, norm_eps=1e-6),
    # Multi-head (one key/value head per query head), with the biases that Llama's config can also switch on.
    "mha_bias": GPTConfig(vocab_size=401, n_embd=32, n_layer=1, n_head=2, n_kv_head=2, block_size=64, bias=True),
}
EXPORT = os.path.join(REPO, "export_hf.py")
TIKTOKEN_NAME = "lillm_export_test"


def start_export(*args):
    """export_hf.py as a program, in the background."""
    return subprocess.Popen([sys.executable, EXPORT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONIOENCODING="utf-8"))


def finish(process):
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout.decode(), stderr.decode())


def export_here(*args):
    """export_hf.py's command line run in this process (runpy, as `python export_hf.py ARGS` would), so the other
    cases don't pay torch's import each. An exception it lets escape (a traceback) fails the test with it."""
    argv, stderr, sigterm = sys.argv, io.StringIO(), signal.getsignal(signal.SIGTERM)
    sys.argv = [EXPORT, *args]
    try:
        with contextlib.redirect_stderr(stderr):
            runpy.run_path(EXPORT, run_name="__main__")
        returncode = 0
    except SystemExit as exit_:
        returncode = exit_.code
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, sigterm)  # export_hf.py's own, for its process: not this one's
    return subprocess.CompletedProcess(args, returncode, "", stderr.getvalue())


def train_tokenizer(data_path, vocab_size, out):
    subprocess.run([sys.executable, os.path.join(REPO, "train_bpe_cpu.py"), "--data", str(data_path),
                    "-v", str(vocab_size), "-n", "100000000", "--out", str(out)], check=True, capture_output=True)
    return out


def checkpoint_tokenizer(directory):
    """A tokenizer directory as train.py stores it in a checkpoint."""
    with open(directory / "tokenizer.json") as f:
        info = json.load(f)
    return {"kind": "bpe", "ranks": (directory / "tokenizer.tiktoken").read_text(), "pattern": info["pattern"],
            "special_tokens": info["special_tokens"]}


def tiktoken_from(tokenizer):
    """The test's own route from a checkpoint's tokenizer entry to tiktoken (as sample.py and the README do)."""
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in tokenizer["ranks"].splitlines() if line.strip())}
    return tiktoken.Encoding(name="test", pat_str=tokenizer["pattern"], mergeable_ranks=ranks,
                             special_tokens=tokenizer["special_tokens"])


def save(path, model, tokenizer):
    save_checkpoint(str(path / "ckpt.pt"), {
        "model": model.state_dict(), "model_config": asdict(model.config), "train_config": {}, "iter_num": 20,
        "best_val_loss": 0.0, "optimizer": None, "scaler": None, "rng": None, "tokenizer": tokenizer, "dataset": None})


def train_a_little(config, tokens):
    """A few AdamW steps on real tokens, so that the exported weights are not an initialization. The matrices start
    at N(0, 0.2), ten times GPT-2's init: the greedy continuation then changes with the context (at 0.02 it repeats
    one token), so the generation test compares 50 different decisions."""
    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.tensor(tokens)
    for _ in range(10):
        starts = torch.randint(0, len(data) - config.block_size - 1, (4,))
        x = torch.stack([data[s:s + config.block_size] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + config.block_size] for s in starts])
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Train a tokenizer and the models, then export them and the bad inputs; returns paths and results."""
    root = tmp_path_factory.mktemp("export")
    (root / "offline.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in OFFLINE_DOCS))
    offline_tokenizer = checkpoint_tokenizer(train_tokenizer(root / "offline.jsonl", OFFLINE_VOCAB, root / "tok"))
    tokens = [t for doc in OFFLINE_DOCS for t in tiktoken_from(offline_tokenizer).encode_ordinary(doc)]
    for name, config in MODELS.items():
        save(root / name, train_a_little(config, tokens), offline_tokenizer)
    # Runs as programs: two exports into one hf_dir started together (one writes it, as a run alone would, and
    # the other refuses in one line) and a refusal; the other cases in this process.
    processes = {race: start_export(f"--out_dir={root / 'gqa'}", f"--hf_dir={root / 'hf_gqa'}")
                 for race in ("gqa", "gqa again")}
    (root / "foreign").mkdir()
    torch.save({"weights": torch.zeros(2)}, root / "foreign" / "ckpt.pt")
    processes["not ours"] = start_export(f"--out_dir={root / 'foreign'}", f"--hf_dir={root / 'hf_foreign'}")
    results = {"mha_bias": export_here(f"--out_dir={root / 'mha_bias'}", f"--hf_dir={root / 'hf_mha_bias'}"),
               "bf16": export_here(f"--out_dir={root / 'mha_bias'}", f"--hf_dir={root / 'hf_bf16'}",
                                   "--dtype=bfloat16")}

    # Bad input: no checkpoint, a file that isn't ours (above), a char-level model, an hf_dir that holds something.
    (root / "empty").mkdir()
    char_config = GPTConfig(vocab_size=70, n_embd=16, n_layer=1, n_head=2, n_kv_head=1, block_size=16)
    save(root / "char", GPT(char_config), {"kind": "char", "chars": [chr(32 + i) for i in range(70)]})
    (root / "hf_taken").mkdir()
    (root / "hf_taken" / "keep.txt").write_text("mine")
    save(root / "n_head_0", GPT(char_config), {"kind": "tiktoken", "name": "gpt2"})
    broken = load_checkpoint(str(root / "n_head_0" / "ckpt.pt"))
    broken["model_config"]["n_head"] = 0  # a model_config that GPTConfig refuses
    save_checkpoint(str(root / "n_head_0" / "ckpt.pt"), broken)
    bad = {"no checkpoint": (root / "empty", "no checkpoint at"),
           "not ours": (root / "foreign", "is not a lilLM checkpoint"),
           "char level": (root / "char", "char-level"),
           "n_head=0": (root / "n_head_0", "does not fit this model.py: ValueError: n_head=0: must be a positive"),
           "hf_dir taken": (root / "gqa", "already exists and is not an empty directory"),
           "dtype": (root / "char", "--dtype=fp8: use float32, bfloat16 or float16")}
    for case in ("no checkpoint", "char level", "n_head=0", "hf_dir taken", "dtype"):
        out_dir = bad[case][0]
        hf_dir = root / "hf_taken" if case == "hf_dir taken" else root / f"hf_{out_dir.name}"
        dtype = ["--dtype=fp8"] if case == "dtype" else []
        results[case] = export_here(f"--out_dir={out_dir}", f"--hf_dir={hf_dir}", *dtype)
    # A tiktoken name: exported where tiktoken has (or can download) gpt2's ranks, else refused in one line.
    gpt2_config = GPTConfig(vocab_size=50304, n_embd=16, n_layer=1, n_head=2, n_kv_head=1, block_size=16)
    save(root / "gpt2", GPT(gpt2_config), {"kind": "tiktoken", "name": "gpt2"})
    results["gpt2"] = export_here(f"--out_dir={root / 'gpt2'}", f"--hf_dir={root / 'hf_gpt2'}")
    # The tiktoken branch offline: our BPE registered with tiktoken under a name (tiktoken's plugin table).
    tiktoken.list_encoding_names()  # fills the table
    tiktoken.registry.ENCODING_CONSTRUCTORS[TIKTOKEN_NAME] = lambda: dict(
        name=TIKTOKEN_NAME, pat_str=offline_tokenizer["pattern"], special_tokens=offline_tokenizer["special_tokens"],
        mergeable_ranks=tiktoken_from(offline_tokenizer)._mergeable_ranks)
    save(root / "named", GPT(MODELS["gqa"]), {"kind": "tiktoken", "name": TIKTOKEN_NAME})
    results["named"] = export_here(f"--out_dir={root / 'named'}", f"--hf_dir={root / 'hf_named'}")
    del tiktoken.registry.ENCODING_CONSTRUCTORS[TIKTOKEN_NAME]

    results.update({case: finish(process) for case, process in processes.items()})
    if results["gqa"].returncode != 0:  # the other one won the race
        results["gqa"], results["gqa again"] = results["gqa again"], results["gqa"]
    for name in (*MODELS, "named", "bf16"):
        assert results[name].returncode == 0, results[name].stderr
    return {"root": root, "results": results, "bad": bad, "tokenizer": offline_tokenizer, "tokens": tokens}


@pytest.fixture(scope="module")
def loaded(exported):
    """(model.py's model, transformers' model) per exported checkpoint."""
    pairs = {}
    for name in MODELS:
        ours = model_from_checkpoint(load_checkpoint(str(exported["root"] / name / "ckpt.pt"))).eval()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(exported["root"] / f"hf_{name}")).eval()
        pairs[name] = (ours, theirs)
    return pairs


@pytest.mark.parametrize("name", MODELS)
def test_same_logits_on_random_and_real_tokens(exported, loaded, name):
    ours, theirs = loaded[name]
    assert isinstance(theirs, transformers.LlamaForCausalLM) and theirs.dtype == torch.float32
    config = ours.config
    generator = torch.Generator().manual_seed(1)
    random_ids = torch.randint(0, config.vocab_size, (3, config.block_size), generator=generator)
    real = torch.tensor(exported["tokens"][:4 * config.block_size]).view(4, config.block_size)
    for ids in (random_ids, real, real[:1, :7]):
        with torch.no_grad():
            our_logits, _ = ours(ids, targets=ids)  # with targets: logits at every position
            their_logits = theirs(ids).logits
        assert their_logits.shape == our_logits.shape
        assert (their_logits - our_logits).abs().max().item() < 1e-5


def test_the_files_say_what_the_model_is(exported, loaded):
    ours, _ = loaded["gqa"]
    hf_dir = exported["root"] / "hf_gqa"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["intermediate_size"] == ours.config.ffn_hidden_size == 192
    assert (config["num_key_value_heads"], config["rope_theta"], config["rms_norm_eps"]) == (2, 500.0, 1e-6)
    assert config["bos_token_id"] == config["eos_token_id"] == OFFLINE_VOCAB
    assert config["max_position_embeddings"] == ours.config.block_size and config["tie_word_embeddings"]
    # model.safetensors, read back by the safetensors package: every tensor, once, bit for bit.
    tensors = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    state = ours.state_dict()
    assert len(tensors) == len(state) - 1  # the tied output head is stored once, as the embedding
    assert torch.equal(tensors["model.embed_tokens.weight"], state["lm_head.weight"])
    assert torch.equal(tensors["model.layers.1.self_attn.k_proj.weight"], state["transformer.h.1.attn.c_k.weight"])
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], state["transformer.h.1.mlp.c_proj.weight"])
    assert not [name for name in os.listdir(exported["root"]) if ".tmp." in name]  # no temporary directory left
    # <|endoftext|> begins every training document: the tokenizer's bos and eos, as config.json's ids say
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == tokenizer_config["eos_token"] == "<|endoftext|>"
    assert not tokenizer_config["add_bos_token"] and tokenizer_config["model_max_length"] == ours.config.block_size
    assert config["torch_dtype"] == config["dtype"] == "float32"


def test_a_bfloat16_export_says_so_and_holds_the_weights_rounded(exported, loaded):
    ours, _ = loaded["mha_bias"]
    hf_dir = exported["root"] / "hf_bf16"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    tensors = safetensors_torch.load_file(str(hf_dir / "model.safetensors"))
    assert {tensor.dtype for tensor in tensors.values()} == {torch.bfloat16}
    state = ours.state_dict()
    query = state["transformer.h.0.attn.c_q.weight"]
    assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"], query.bfloat16())


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_equals_ours(exported, loaded, name):
    ours, theirs = loaded[name]
    prompt = torch.tensor([exported["tokens"][100:110]])
    expected = ours.generate(prompt, 50, temperature=0)
    # eos_token_id=None: model.generate doesn't stop at <|endoftext|>, so neither may transformers.
    got = theirs.generate(prompt, max_new_tokens=50, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert len(set(expected[0, 10:].tolist())) >= 5  # a varied continuation, not one token repeated


@pytest.mark.parametrize("hf_dir", ["hf_gqa", "hf_named"])  # our BPE from the checkpoint / by tiktoken name
def test_same_tokens_as_tiktoken_offline(exported, hf_dir):
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported["root"] / hf_dir))
    encoding = tiktoken_from(exported["tokenizer"])
    for text in OFFLINE_DOCS + EDGE_CASES + ["".join(EDGE_CASES)]:
        ids = hf_tokenizer.encode(text)
        assert ids == encoding.encode_ordinary(text), repr(text[:80])
        assert hf_tokenizer.decode(ids) == text
    # <|endoftext|> in the text is the special token, as in sample.py's prompts.
    assert hf_tokenizer.encode("a<|endoftext|>b") == encoding.encode("a<|endoftext|>b", allowed_special="all")
    assert hf_tokenizer.eos_token == hf_tokenizer.bos_token == "<|endoftext|>"


def export_merges(tmp_path, merged_tokens, pattern, special_tokens=None):
    """A tiny model with the tokenizer of the 256 bytes, then merged_tokens, exported: (its tiktoken encoding, the
    exported HF tokenizer). special_tokens: <|endoftext|> after the last merge unless given."""
    tokens = [bytes([byte]) for byte in range(256)] + merged_tokens
    special_tokens = special_tokens or {"<|endoftext|>": len(tokens)}
    tokenizer = {"kind": "bpe", "ranks": "".join(f"{base64.b64encode(token).decode()} {rank}\n"
                                                 for rank, token in enumerate(tokens)),
                 "pattern": pattern, "special_tokens": special_tokens}
    save(tmp_path / "out", GPT(GPTConfig(vocab_size=max(special_tokens.values()) + 1, n_embd=16, n_layer=1, n_head=2,
                                         n_kv_head=1, block_size=16)), tokenizer)
    assert export_here(f"--out_dir={tmp_path / 'out'}", f"--hf_dir={tmp_path / 'hf'}").returncode == 0
    return tiktoken_from(tokenizer), transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))


def test_a_chunk_that_is_a_token_stays_whole(tmp_path):
    """tiktoken takes a chunk that is a token as that token, even where merging could not reach it: here "bc" joins
    first and leaves [a, bc, d], which no listed pair joins further, yet "abcd" is a token."""
    encoding, hf_tokenizer = export_merges(tmp_path, [b"bc", b"ab", b"cd", b"abcd"], r"\S+|\s+")
    for text in ("abcd", "abcd abc bcd"):
        assert hf_tokenizer.encode(text) == encoding.encode_ordinary(text)
    assert hf_tokenizer.encode("abcd") == [259]


def test_a_possessive_interval_splits_as_tiktoken_splits(tmp_path):
    """cl100k_base's pattern takes digits three at a time with a possessive interval, \\p{N}{1,3}+, which HF's
    regex (Oniguruma) reads as (\\p{N}{1,3})+: a whole run of digits, where "34" could join across the cut."""
    encoding, hf_tokenizer = export_merges(tmp_path, [b"34", b"12", b"123"], r"\p{N}{1,3}+|\s+|[^\s\p{N}]++")
    for text in ("12345", "born 1987, 2024-11-23 x12345678"):
        assert hf_tokenizer.encode(text) == encoding.encode_ordinary(text), text
    assert hf_tokenizer.encode("12345") == [258, 52, 53]  # "123", "4", "5"


def test_special_tokens_keep_their_ids_past_a_gap(tmp_path):
    """cl100k_base's ranks end at 100255, its <|endoftext|> is 100257 and <|endofprompt|> 100276 (o200k_base has gaps
    too). HF `tokenizers` gave such tokens the next free ids, 100256, 100257, ...: the wrong tokens in and out."""
    special_tokens = {"<|endoftext|>": 258, "<|fim_prefix|>": 259, "<|endofprompt|>": 277}  # 257: no token
    encoding, hf_tokenizer = export_merges(tmp_path, [b"ab"], r"\S+|\s+", special_tokens)
    text = "ab<|endoftext|>b<|endofprompt|><|fim_prefix|>"
    assert hf_tokenizer.encode(text) == encoding.encode(text, allowed_special="all") == [256, 258, 98, 277, 259]
    assert hf_tokenizer.decode([98, 277, 258]) == "b<|endofprompt|><|endoftext|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_tokenizer.eos_token_id == hf_tokenizer.bos_token_id == config["eos_token_id"] == 258


def test_same_tokens_as_tiktoken_on_real_text(corpus, tmp_path):
    """A tokenizer trained by train_bpe_cpu.py on the start of every UDHR translation (all its scripts), exported,
    encodes every translation, Wikipedia and Shakespeare exactly as tiktoken does."""
    udhr = [json.loads(line)["text"] for line in corpus("udhr.jsonl").read_text().splitlines()]
    (tmp_path / "udhr_starts.jsonl").write_text("".join(json.dumps({"text": doc[:1500]}) + "\n" for doc in udhr))
    tokenizer = checkpoint_tokenizer(train_tokenizer(tmp_path / "udhr_starts.jsonl", 1000, tmp_path / "tok"))
    save(tmp_path / "out", GPT(GPTConfig(vocab_size=1024, n_embd=16, n_layer=1, n_head=2, n_kv_head=1,
                                         block_size=16)), tokenizer)
    result = export_here(f"--out_dir={tmp_path / 'out'}", f"--hf_dir={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    encoding = tiktoken_from(tokenizer)
    with open(corpus("enwiki.jsonl"), encoding="utf-8") as f:
        wiki = [json.loads(next(f))["text"] for _ in range(100)]
    # Every translation's first 5,000 characters: all the scripts, in a third of the time of the whole texts.
    texts = [doc[:5000] for doc in udhr] + wiki + [corpus("tinyshakespeare.txt").read_text()[:100_000]] + EDGE_CASES
    for text, ids in zip(texts, hf_tokenizer(texts)["input_ids"]):
        assert ids == encoding.encode_ordinary(text), repr(text[:80])
        assert hf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("case", ["no checkpoint", "not ours", "char level", "n_head=0", "hf_dir taken", "dtype"])
def test_bad_input_gets_one_line_and_writes_nothing(exported, case):
    result = exported["results"][case]
    out_dir, message = exported["bad"][case]
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and message in result.stderr and result.stderr.count("\n") == 1
    root = exported["root"]
    assert not (root / f"hf_{out_dir.name}").exists() or case == "hf_dir taken"
    assert os.listdir(root / "hf_taken") == ["keep.txt"] and (root / "hf_taken" / "keep.txt").read_text() == "mine"


def test_tiktoken_name_exports_or_refuses_in_one_line(exported):
    result = exported["results"]["gpt2"]
    if result.returncode != 0:  # offline, with no cached copy of gpt2's ranks
        assert result.stderr.startswith("error: can't load the tiktoken encoding 'gpt2'")
        assert result.stderr.count("\n") == 1
        return
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported["root"] / "hf_gpt2"))
    encoding = tiktoken.get_encoding("gpt2")
    for text in OFFLINE_DOCS + EDGE_CASES:
        assert hf_tokenizer.encode(text) == encoding.encode_ordinary(text), repr(text[:80])


def test_one_writer_per_hf_dir(exported, tmp_path):
    # The two exports into hf_gqa started together: one wrote it (the other tests read it), and the other
    # refused in one line, as another run writing there or as the finished export it found.
    race = exported["results"]["gqa again"]
    assert race.returncode == 1 and race.stderr.count("\n") == 1, race.stderr
    assert race.stderr.startswith(f"error: {exported['root'] / 'hf_gqa'}: another run is writing there") or \
        race.stderr.startswith(f"error: --hf_dir={exported['root'] / 'hf_gqa'} already exists and is not an empty")
    assert sorted(os.listdir(exported["root"] / "hf_gqa")) == ["config.json", "model.safetensors", "tokenizer.json",
                                                                "tokenizer_config.json"]
    # While another process holds the lock (here: this one, on its own descriptor), an export refuses.
    hf_dir = tmp_path / "hf_locked"
    hf_dir.mkdir()
    descriptor = os.open(hf_dir, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={hf_dir}")
    finally:
        os.close(descriptor)
    assert result.returncode == 1 and result.stderr == (f"error: {hf_dir}: another run is writing there; wait for it "
                                                        "to end, or choose another directory\n")
    assert os.listdir(hf_dir) == [] and not list(tmp_path.glob("*.tmp.*"))


def test_a_write_that_fails_for_space_is_one_line_and_leaves_nothing(exported, tmp_path):
    # A full disk, as a file size limit (RLIMIT_FSIZE, its signal ignored: a write past it fails with EFBIG as a
    # full disk fails with ENOSPC). safetensors reports it as its own error, not an OSError: still one line.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, hard))  # the gqa model's weights are ~0.4 MB
    try:
        result = export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={tmp_path / 'hf'}")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: can't write {tmp_path / 'hf'}: ") and "too large" in result.stderr
    assert os.listdir(tmp_path) == []  # no hf_dir, no temporary directory, no half-written file


def assert_one_line(result, message):
    assert result.returncode == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, \
        result.stderr
    assert message in result.stderr, result.stderr


def test_weights_that_are_not_finite_are_refused_and_nothing_is_written(exported, tmp_path):
    # A trained checkpoint whose run diverged (a NaN, an inf in one matrix): one line, and no hf_dir.
    checkpoint = torch.load(exported["root"] / "gqa" / "ckpt.pt", weights_only=True)
    original = checkpoint["model"]["transformer.h.1.mlp.c_up.weight"].clone()
    for value in ("nan", "inf"):
        checkpoint["model"]["transformer.h.1.mlp.c_up.weight"] = original.clone()
        checkpoint["model"]["transformer.h.1.mlp.c_up.weight"][2, 3] = float(value)
        (tmp_path / value).mkdir()
        torch.save(checkpoint, tmp_path / value / "ckpt.pt")
        assert_one_line(export_here(f"--out_dir={tmp_path / value}", f"--hf_dir={tmp_path / 'hf'}"),
                        "transformer.h.1.mlp.c_up.weight holds inf or NaN: use an earlier")
    assert sorted(os.listdir(tmp_path)) == ["inf", "nan"]


def test_an_hf_dir_that_cant_be_written_is_one_line_and_leaves_nothing(exported, tmp_path):
    # Failures that hold for root too: a path under a regular file, a name that isn't UTF-8 (the byte 0xff, as
    # Python gives it: the surrogate U+DCFF). They were tracebacks, or an export under an undecodable name.
    (tmp_path / "a_file").write_text("mine")
    cases = {tmp_path / "a_file" / "hf": f"can't write {tmp_path / 'a_file' / 'hf'}: Not a directory",
             tmp_path / "hf\udcff": "hf\\udcff': not valid UTF-8"}
    try:  # a directory this user may not list (as a shared 0711 one), root included where Linux says so
        os.listdir("/proc/1/map_files")
    except PermissionError:
        cases["/proc/1/map_files"] = "[Errno 13] Permission denied: '/proc/1/map_files'"
    except OSError:
        pass
    for hf_dir, message in cases.items():
        assert_one_line(export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={hf_dir}"), message)
    assert os.listdir(tmp_path) == ["a_file"] and (tmp_path / "a_file").read_text() == "mine"


def test_an_empty_mount_point_is_refused_in_one_line(exported, tmp_path):
    # A volume mounted for the export (docker run -v ...:/hf) is an empty directory that no rename can replace: the
    # whole copy was written beside it, then "can't write ...: Device or resource busy". A tmpfs here, where allowed.
    (tmp_path / "hf").mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "none", str(tmp_path / "hf")], capture_output=True)
    except OSError:  # no mount command
        mounted = None
    if not mounted or mounted.returncode:
        pytest.skip("mounting a tmpfs needs the mount command and root's privileges")
    try:
        result = export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={tmp_path / 'hf'}")
    finally:
        subprocess.run(["umount", "--lazy", str(tmp_path / "hf")], check=True)  # this process may hold it open
    assert_one_line(result, f"--hf_dir={tmp_path / 'hf'} is a mount point: export into a new directory in it")
    assert os.listdir(tmp_path) == ["hf"] and os.listdir(tmp_path / "hf") == []


def test_a_symlinked_hf_dir_is_followed(exported, tmp_path):
    # A link to an empty directory (often one on a bigger disk) gets the export there, as any write through the
    # link would; the temporary directory is made beside the target, on its filesystem. It was a traceback.
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "hf").mkdir()
    (tmp_path / "hf").symlink_to(tmp_path / "disk" / "hf")
    result = export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    assert os.readlink(tmp_path / "hf") == str(tmp_path / "disk" / "hf")
    assert sorted(os.listdir(tmp_path)) == ["disk", "hf"]
    assert sorted(os.listdir(tmp_path / "disk")) == ["hf"]
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "tokenizer.json",
                                                   "tokenizer_config.json"]


def test_a_killed_export_of_the_same_pid_does_not_block_the_next(exported, tmp_path):
    # kill -9 (or the OOM killer) mid-write leaves hf_dir empty and hf_dir.tmp.<pid> holding part of the weights; in
    # a container the export is PID 1 every time, so the rerun meets its own name. It failed: "File exists".
    (tmp_path / f"hf.tmp.{os.getpid()}").mkdir()
    (tmp_path / f"hf.tmp.{os.getpid()}" / "model.safetensors").write_bytes(b"half a file")
    (tmp_path / "hf").mkdir()
    result = export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    assert os.listdir(tmp_path) == ["hf"]
    tensors = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert tensors.keys() == safetensors_torch.load_file(str(exported["root"] / "hf_gqa" / "model.safetensors")).keys()


def test_ctrl_c_during_the_write_is_one_line_and_leaves_nothing(exported, tmp_path, monkeypatch):
    # A real SIGINT, sent once model.safetensors is written and before the JSON files: Python raises
    # KeyboardInterrupt there, as for Ctrl-C in a terminal. It left a traceback and an empty hf_dir.
    def save_then_ctrl_c(*args, **kwargs):
        safetensors_save_file(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    safetensors_save_file = safetensors_torch.save_file
    monkeypatch.setattr(safetensors_torch, "save_file", save_then_ctrl_c)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = export_here(f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={tmp_path / 'hf'}")
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped export_hf.py: a traceback")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert result.returncode == 1 and result.stderr == \
        "error: interrupted; nothing is half-written\n"
    assert os.listdir(tmp_path) == []  # no hf_dir, no temporary directory


# `python export_hf.py ARGS` whose save_file sends its own process a SIGTERM once model.safetensors is written.
SIGTERM_AFTER_THE_WEIGHTS = """
import os, runpy, signal, sys
import safetensors.torch
save_file = safetensors.torch.save_file

def save_then_sigterm(*args, **kwargs):
    save_file(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)

safetensors.torch.save_file = save_then_sigterm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_sigterm_during_the_write_is_one_line_and_leaves_nothing(exported, tmp_path):
    # A real SIGTERM (a scheduler's, `kill`'s) to a real export process, mid-write: it ended the process at once,
    # leaving an empty hf_dir and hf_dir.tmp.<pid> with model.safetensors in it.
    result = subprocess.run([sys.executable, "-c", SIGTERM_AFTER_THE_WEIGHTS, EXPORT,
                             f"--out_dir={exported['root'] / 'gqa'}", f"--hf_dir={tmp_path / 'hf'}"],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (1, "error: interrupted; nothing is half-written\n")
    assert os.listdir(tmp_path) == []  # no hf_dir, no temporary directory
