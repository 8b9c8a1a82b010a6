"""sample.py end to end, in a subprocess, on tiny untrained checkpoints saved with save_checkpoint: its streamed
output must equal what the same model, seed and tokenizer give in this process, decoded all at once."""
import base64
import codecs
import os
import re
import signal
import subprocess
import sys
from dataclasses import asdict

import pytest
import rustbpe
import tiktoken
import torch

REPO = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, REPO)
from conftest import SCRIPT_RUNNER  # noqa: E402
from model import GPT, GPTConfig, load_checkpoint, model_from_checkpoint, save_checkpoint  # noqa: E402

SEPARATOR = "\n---------------\n"
# Accents, CJK and emoji: characters of 2, 3 and 4 UTF-8 bytes, so that BPE tokens split characters.
DOCS = ["The quick brown fox jumps over the lazy dog. " * 20,
        "Héllo wörld, ça va? Übermäßig schön. " * 20,
        "日本語のテキストです。東京と大阪。 " * 20,
        "Emoji 🙂🚀 and symbols → ≤ ≥ € " * 20]
BPE_VOCAB = 300  # byte tokens + merges; <|endoftext|> is id 300


def tiny_config(vocab_size):
    return GPTConfig(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_kv_head=2, block_size=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two out_dirs with an untrained model each: a BPE one (tokenizer trained here with rustbpe, stored as the
    text of a tokenizer.tiktoken file) and a char-level one."""
    root = tmp_path_factory.mktemp("sample")
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(DOCS, BPE_VOCAB)
    ranks_text = "".join(f"{base64.b64encode(bytes(token)).decode()} {rank}\n"
                         for token, rank in trainer.get_mergeable_ranks())
    bpe_tokenizer = {"kind": "bpe", "ranks": ranks_text, "pattern": trainer.get_pattern(),
                     "special_tokens": {"<|endoftext|>": BPE_VOCAB}}
    chars = sorted(set("".join(DOCS[:2]) + "\r\nROMEO:"))
    char_tokenizer = {"kind": "char", "chars": chars}
    # The last: a model_config that GPTConfig refuses (the weights are a good model's); test_model.py tries more.
    for name, vocab_size, tokenizer, broken in [("bpe", 320, bpe_tokenizer, {}),
                                                 ("char", len(chars), char_tokenizer, {}),
                                                 ("n_head_0", len(chars), char_tokenizer, {"n_head": 0}),
                                                 ("theta_nan", len(chars), char_tokenizer,
                                                  {"rope_theta": float("nan")})]:
        torch.manual_seed(0)
        model = GPT(tiny_config(vocab_size))
        save_checkpoint(str(root / name / "ckpt.pt"), {
            "model": model.state_dict(), "model_config": {**asdict(model.config), **broken}, "train_config": {},
            "iter_num": 0, "best_val_loss": float("inf"), "optimizer": None, "scaler": None, "rng": None,
            "tokenizer": tokenizer, "dataset": None})
    return root


def start_sample(*args):
    """sample.py in the background, forked from the process that imported torch once (conftest.py's script
    runner): the test works out its expected output (or starts another run) meanwhile."""
    return SCRIPT_RUNNER.start([sys.executable, os.path.join(REPO, "sample.py"), *args], cwd=os.getcwd(),
                               env=dict(os.environ, PYTHONIOENCODING="utf-8"), text=False)


def finish(run):
    """stdout and stderr as str, decoded without newline translation (samples may hold '\r')."""
    result = SCRIPT_RUNNER.finish(run, timeout=120)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode("utf-8"),
                                       result.stderr.decode("utf-8"))


def tiktoken_from(tokenizer):
    """The test's own route from the checkpoint's tokenizer entry to a tiktoken Encoding."""
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in tokenizer["ranks"].splitlines() if line.strip())}
    return tiktoken.Encoding(name="test", pat_str=tokenizer["pattern"], mergeable_ranks=ranks,
                             special_tokens=tokenizer["special_tokens"])


def generate_here(out_dir, prompt_ids, num_samples, max_new_tokens, seed, **sampling):
    """The token ids sample.py should produce: the same checkpoint, seed and sampling, in this process."""
    checkpoint = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    model = model_from_checkpoint(checkpoint).eval()
    torch.manual_seed(seed)
    idx = torch.tensor([prompt_ids])
    return checkpoint, [[token.item() for token in model.generate_tokens(idx, max_new_tokens, **sampling)]
                        for _ in range(num_samples)]


def test_bpe_streaming_equals_decoding_the_whole_sample(checkpoints):
    prompt = "Héllo 日本"
    process = start_sample(f"--out_dir={checkpoints / 'bpe'}", f"--start={prompt}", "--num_samples=2",
                           "--max_new_tokens=80", "--seed=6", "--temperature=1.0", "--top_k=0", "--device=cpu")
    checkpoint = load_checkpoint(str(checkpoints / "bpe" / "ckpt.pt"))
    encoding = tiktoken_from(checkpoint["tokenizer"])
    _, samples = generate_here(checkpoints / "bpe", encoding.encode(prompt), 2, 80, 6, temperature=1.0)
    result = finish(process)
    assert result.returncode == 0, result.stderr

    def bytes_of_id(token_id):  # ids 301..319 are padding past the tokenizer: sample.py prints nothing for them
        return encoding.decode_single_token_bytes(token_id) if token_id < encoding.n_vocab else b""

    whole = [b"".join(bytes_of_id(t) for t in sample).decode("utf-8", errors="replace") for sample in samples]
    assert result.stdout == "".join(prompt + text + SEPARATOR for text in whole)
    # The check has teeth: decoding token by token on its own would have broken characters in these samples.
    piecewise = ["".join(bytes_of_id(t).decode("utf-8", errors="replace") for t in sample) for sample in samples]
    assert piecewise != whole
    # ...and the second sample ends inside a character: the decoder's final flush prints its U+FFFD.
    held_back = codecs.getincrementaldecoder("utf-8")(errors="replace")
    held_back.decode(b"".join(bytes_of_id(t) for t in samples[1]))
    assert held_back.decode(b"", final=True) == "\ufffd"
    assert "160 tokens in" in result.stderr and "tokens/s" in result.stderr
    assert "(cpu, float32," in result.stderr  # never bfloat16 on the CPU, where most CPUs emulate it slowly


def test_bpe_empty_prompt_starts_from_end_of_text(checkpoints):
    # A temperature of 1e-300 is greedy, as 0 is (dividing the logits by it would make them inf, and NaN).
    process = start_sample(f"--out_dir={checkpoints / 'bpe'}", "--start=", "--num_samples=1", "--max_new_tokens=20",
                           "--temperature=1e-300", "--device=cpu")
    checkpoint, samples = generate_here(checkpoints / "bpe", [BPE_VOCAB], 1, 20, 1337, temperature=0)
    result = finish(process)
    assert result.returncode == 0, result.stderr
    encoding = tiktoken_from(checkpoint["tokenizer"])
    text = b"".join(encoding.decode_single_token_bytes(t) if t < encoding.n_vocab else b""
                    for t in samples[0]).decode("utf-8", errors="replace")
    assert result.stdout == text + SEPARATOR
    assert "greedy" in result.stderr  # a temperature near 0 is greedy, and says so


def test_char_level_sample_from_a_file_prompt_and_from_empty(checkpoints, tmp_path):
    # A prompt file as Windows' Notepad saves it: a UTF-8 BOM (not part of the text) and CRLF line ends, which
    # stay as written (the model was trained on bytes). The BOM was a character outside the vocabulary.
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_bytes("\ufeffROMEO:\r\n".encode("utf-8"))
    from_file = start_sample(f"--out_dir={checkpoints / 'char'}", f"--start=FILE:{prompt_file}", "--num_samples=2",
                             "--max_new_tokens=30", "--seed=9", "--top_k=5", "--top_p=0.7", "--device=cpu")
    from_empty = start_sample(f"--out_dir={checkpoints / 'char'}", "--num_samples=1", "--max_new_tokens=10",
                              "--temperature=0", "--device=cpu")
    chars = load_checkpoint(str(checkpoints / "char" / "ckpt.pt"))["tokenizer"]["chars"]
    prompt_ids = [chars.index(c) for c in "ROMEO:\r\n"]
    _, samples = generate_here(checkpoints / "char", prompt_ids, 2, 30, 9, temperature=0.8, top_k=5, top_p=0.7)
    # Each setting counts: without top_p (or top_k) the same seed draws other samples.
    for other in ({"top_k": 5, "top_p": 1.0}, {"top_k": None, "top_p": 0.7}):
        assert generate_here(checkpoints / "char", prompt_ids, 2, 30, 9, temperature=0.8, **other)[1] != samples
    result = finish(from_file)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join("ROMEO:\r\n" + "".join(chars[t] for t in s) + SEPARATOR for s in samples)

    _, samples = generate_here(checkpoints / "char", [chars.index("\n")], 1, 10, 1337, temperature=0)
    assert finish(from_empty).stdout == "".join(chars[t] for t in samples[0]) + SEPARATOR



def test_the_graphed_decode_step_draws_what_sample_py_prints(checkpoints):
    # sample.py on a GPU compiles the decode step for CUDA graphs; compiled here with backend="eager" (the same
    # traced graph, on the CPU), it draws the tokens of the plain step, which the tests above compare with
    # sample.py's output: seeded top-k/top-p sampling, through the cache's refill (block_size 64).
    chars = load_checkpoint(str(checkpoints / "char" / "ckpt.pt"))["tokenizer"]["chars"]
    prompt = [chars.index(c) for c in "ROMEO:"]
    _, plain = generate_here(checkpoints / "char", prompt, 2, 100, 9, temperature=0.8, top_k=5, top_p=0.9)
    _, graphed = generate_here(checkpoints / "char", prompt, 2, 100, 9, temperature=0.8, top_k=5, top_p=0.9,
                               compile_decode={"backend": "eager", "fullgraph": True})
    assert graphed == plain and len(set(plain[0])) > 5

def test_bfloat16_casts_the_weights_once_and_drops_autocast(checkpoints):
    # --dtype=bfloat16 (a GPU's "auto"): sample.py draws what the model with its weights cast to bf16 draws here,
    # not what float32 weights under bf16 autocast (the old route) draw: an untrained model's near-tied logits
    # make their top 3 differ at token 19. On this CPU bf16 is emulated (~27x slower): a tiny model, 30 tokens.
    process = start_sample(f"--out_dir={checkpoints / 'char'}", "--start=ROMEO:", "--num_samples=1",
                           "--max_new_tokens=30", "--seed=1337", "--temperature=1.0", "--top_k=3",
                           "--device=cpu", "--dtype=bfloat16")
    checkpoint = load_checkpoint(str(checkpoints / "char" / "ckpt.pt"))
    chars, model = checkpoint["tokenizer"]["chars"], model_from_checkpoint(checkpoint).eval()
    prompt = torch.tensor([[chars.index(c) for c in "ROMEO:"]])

    def draw():
        torch.manual_seed(1337)
        return "".join(chars[t.item()] for t in model.generate_tokens(prompt, 30, temperature=1.0, top_k=3))
    with torch.autocast("cpu", torch.bfloat16):
        under_autocast = draw()
    model.cast_weights(torch.bfloat16)
    cast = draw()
    result = finish(process)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ROMEO:" + cast + SEPARATOR
    assert cast != under_autocast
    assert "(cpu, bfloat16," in result.stderr


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # autocast("cuda") on this CPU: off
@pytest.mark.parametrize("capability, chosen", [((7, 5), "float16"), ((8, 0), "bfloat16")], ids=["T4", "A100"])
def test_auto_dtype_is_bfloat16_only_on_a_gpu_that_computes_in_it(checkpoints, monkeypatch, capsys, capability,
                                                                   chosen):
    # --dtype=auto on a GPU: bfloat16 from compute capability 8 (Ampere); float16 before, where bf16 is emulated,
    # slowly, though torch.cuda.is_bf16_supported() says yes (by default it counts emulation). No GPU here: sample.py
    # runs on the CPU, told its device is a GPU that answers as a T4 or an A100 does.
    import importlib.util
    spec = importlib.util.spec_from_file_location("sample_on_a_gpu", os.path.join(REPO, "sample.py"))
    module = importlib.util.module_from_spec(spec)  # its own copy: main() sets the settings' globals
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "check_device", lambda name: ("cpu", "cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation or capability >= (8, 0))
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--out_dir={checkpoints / 'char'}", "--num_samples=1",
                                      "--max_new_tokens=2"])
    module.main()
    assert capsys.readouterr().err.endswith(f"(cpu, {chosen}, prompt prefill included)\n")


def test_train_py_picks_bfloat16_by_the_same_rule():
    # train.py has no main() to run in-process with a pretend GPU: its line is read, to ask what sample.py asks
    with open(os.path.join(REPO, "train.py"), encoding="utf-8") as f:
        source = f.read()
    assert "torch.cuda.get_device_capability() >= (8, 0)" in source and "is_bf16_supported" not in source


# A checkpoint's own faults (truncated, a future version, not ours) are model.py's errors, tested in test_model.py;
# the first case here shows that they reach the user as sample.py's one line.
BAD_INPUTS = {
    "no checkpoint": (["--out_dir={tmp}/empty"], "no checkpoint at"),
    "prompt outside the vocabulary": (["--out_dir={ckpts}/char", "--start=Hi 日本"], "lacks: '日' '本'"),
    "no prompt file": (["--out_dir={ckpts}/char", "--start=FILE:{tmp}/no_such_prompt.txt"], "can't read the prompt file"),
    "a value of the wrong type": (["--out_dir={ckpts}/char", "--temperature=hot"], "temperature must be float, got 'hot'"),
    "unknown setting": (["--out_dir={ckpts}/char", "--top_kk=3"], "unknown setting 'top_kk' (did you mean 'top_k'?)"),
    "a seed past 2^64-1": (["--out_dir={ckpts}/char", "--seed=18446744073709551616"], "from 0 to 2^64-1"),
    "a device torch can't sample on": (["--out_dir={ckpts}/char", "--device=meta"], "--device=meta: not a device"),
    # 50,000 characters exhaust ast.literal_eval (a MemoryError); a long text setting (the prompt) is fine.
    "a 50,000-character setting": (["--out_dir={ckpts}/char", "--seed=" + "-" * 50_000 + "1"],
                                   "a value of over 1,000 characters"),
    "n_head=0 in the checkpoint": (["--out_dir={ckpts}/n_head_0"], "does not fit this model.py: ValueError: n_head=0"),
    # NaN rope tables made every logit NaN: multinomial died with a traceback.
    "rope_theta=nan in the checkpoint": (["--out_dir={ckpts}/theta_nan", "--max_new_tokens=3"],
                                         "ValueError: rope_theta=nan: must be finite, >= 1"),
}


@pytest.fixture(scope="module")
def bad_input_results(checkpoints, tmp_path_factory, script_runner):
    """sample.py on every bad input, each run forked from one process that imported torch once (conftest.py)."""
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "empty").mkdir()
    commands = [[sys.executable, os.path.join(REPO, "sample.py"), *[a.format(tmp=tmp, ckpts=checkpoints) for a in args]]
                for args, _ in BAD_INPUTS.values()]
    results = script_runner.run(commands, cwd=os.getcwd(), env=dict(os.environ, PYTHONIOENCODING="utf-8"), text=False)
    return {case: subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode("utf-8"),
                                              result.stderr.decode("utf-8"))
            for case, result in zip(BAD_INPUTS, results)}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_clear_line(bad_input_results, case):
    result = bad_input_results[case]
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert BAD_INPUTS[case][1] in result.stderr


@pytest.mark.parametrize("how", ["closed pipe", "Ctrl-C"])
def test_a_closed_pipe_or_ctrl_c_ends_quietly(checkpoints, how):
    # As `python sample.py | head -c 20` or Ctrl-C in a terminal: the process ends by the signal, silently.
    process = subprocess.Popen([sys.executable, os.path.join(REPO, "sample.py"), f"--out_dir={checkpoints / 'bpe'}",
                                "--device=cpu", "--max_new_tokens=100000"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    assert len(process.stdout.read(20)) == 20  # it is sampling
    if how == "Ctrl-C":
        process.send_signal(signal.SIGINT)
    process.stdout.close()
    assert process.wait(timeout=60) == -(signal.SIGPIPE if how == "closed pipe" else signal.SIGINT)
    assert process.stderr.read() == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full, a device every write fills")
def test_samples_to_a_full_disk_are_one_line(checkpoints):
    # `python sample.py > file` on a full disk: the print fails with ENOSPC
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, os.path.join(REPO, "sample.py"), f"--out_dir={checkpoints / 'bpe'}",
                                 "--device=cpu", "--max_new_tokens=10"], stdout=full, stderr=subprocess.PIPE, text=True)
    assert result.returncode == 1 and result.stderr == "error: [Errno 28] No space left on device\n", result.stderr


def test_sample_and_export_share_one_settings_parser_byte_for_byte():
    """The --key=value parser and the error class stand in sample.py and export_hf.py as identical copies (the
    scripts share only model.py): a fix in one must be made in both."""
    def copy_in(script):
        text = open(os.path.join(REPO, script), encoding="utf-8").read()
        start = text.index("class UserError(Exception):")
        return text[start:text.index("\ndef ", text.index("def parse_settings(")) + 1]
    assert copy_in("sample.py") == copy_in("export_hf.py")
    assert "def parse_settings(arguments, defaults, extra_types):" in copy_in("sample.py")


@pytest.fixture(scope="module")
def sample():
    """sample.py as a module in this process (its __main__ block does not run): its functions, tried directly."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sample_for_settings", os.path.join(REPO, "sample.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_out_of_range_are_refused(sample, monkeypatch):
    for name, value, rule in [("num_samples", 0, "must be at least 1"), ("max_new_tokens", -1, "must be 0 or more"),
                              ("top_k", -1, "must be 0 (no limit) or more"), ("top_p", 0.0, "must be in (0, 1]"),
                              ("top_p", 1.5, "must be in (0, 1]"), ("temperature", float("inf"), "must be finite, 0 (greedy) or more"),
                              ("temperature", -1.0, "must be finite, 0 (greedy) or more"),
                              ("seed", -1, "must be from 0 to 2^64-1"), ("dtype", "fp8", "use float32, bfloat16")]:
        with monkeypatch.context() as patch:
            patch.setattr(sample, name, value)
            with pytest.raises(sample.UserError, match=re.escape(f"--{name}={value}: {rule}")):
                sample.validate()
    sample.validate()  # the defaults pass


def test_a_prompt_file_that_never_ends_or_is_huge_is_refused(sample, tmp_path):
    """A FIFO (opening it waited for a writer, forever), /dev/zero, a directory and a 1 TB sparse file (read whole:
    all the memory, then MemoryError) are refused in one line, at once."""
    os.mkfifo(tmp_path / "fifo")
    with open(tmp_path / "huge.txt", "wb") as f:
        f.truncate(2**40)
    for path, message in [(tmp_path / "fifo", "not a regular file of at most 10 MB"),
                          ("/dev/zero", "not a regular file of at most 10 MB"),
                          (tmp_path, "not a regular file of at most 10 MB"),
                          (tmp_path / "huge.txt", "not a regular file of at most 10 MB")]:
        with pytest.raises(sample.UserError, match=re.escape(f"can't read the prompt file {path}: {message}") + "$"):
            sample.read_prompt(f"FILE:{path}")


def test_a_value_that_is_not_utf8_is_one_line(sample):
    """The byte 0xff in an argument, as a shell passes it: Python's sys.argv holds it as the surrogate U+DCFF (its
    surrogateescape), which was taken as text: a prompt or an out_dir with a character no one typed."""
    argv = subprocess.run([sys.executable, "-c", "import sys; print(ascii(sys.argv[1]))", b"--start=ROMEO\xff"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert argv == "'--start=ROMEO\\udcff'"  # what Python makes of the byte, without torch: cheap
    for arg in ("--start=ROMEO\udcff", "--out_dir=out\udcff"):
        with pytest.raises(sample.UserError, match=re.escape(f"{arg!r}: not valid UTF-8")):
            sample.parse_settings([arg], sample.defaults, {})


def test_a_long_prompt_is_a_setting_like_any_other(sample):
    """The 1,000-character bound guards ast.literal_eval only: a text setting (the prompt) may be long."""
    prompt = "To be, or not to be, that is the question: " * 50
    assert sample.parse_settings([f"--start={prompt}"], sample.defaults, {}) == {"start": prompt}
    with pytest.raises(sample.UserError, match="a value of over 1,000 characters"):
        sample.parse_settings(["--seed=" + "1" * 1001], sample.defaults, {})


def test_the_prompt_without_end_of_text_or_past_the_block(sample, capsys):
    """An empty prompt needs <|endoftext|> to start from (a tokenizer without it is one line); a prompt longer than
    block_size is cut to its last block_size tokens, with a warning."""
    import tiktoken
    raw_bytes = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                                  special_tokens={})
    with pytest.raises(sample.UserError, match=re.escape("this tokenizer has no <|endoftext|> to start from")):
        sample.encode_prompt(raw_bytes, "", 8)
    assert sample.encode_prompt(raw_bytes, "0123456789", 8) == list(b"23456789")
    assert capsys.readouterr().err == "warning: the prompt has 10 tokens: the model sees only the last 8 (its block_size)\n"


def test_help_lists_the_settings_and_a_bare_word_is_one_line(sample, capsys):
    with pytest.raises(SystemExit) as exit_status:
        sample.parse_settings(["--help"], sample.defaults, {})
    assert exit_status.value.code == 0
    listing = capsys.readouterr().out.split("settings and their defaults:\n")[1]
    assert listing.splitlines() == [f"  --{key}={value!r}" for key, value in sample.defaults.items()]
    with pytest.raises(sample.UserError, match=re.escape("expected --key=value, got 'top_k=3' (see --help)")):
        sample.parse_settings(["top_k=3"], sample.defaults, {})
