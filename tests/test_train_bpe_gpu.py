"""train_bpe_gpu.py against rustbpe (the oracle) and train_bpe_cpu.py (an independent route to the same merges).

CI has no GPU: the device engine runs on the cpu device here, which executes the very same tensor program.
The CUDA test runs where a GPU exists and skips otherwise.
"""
import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import regex
import rustbpe
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu  # noqa: E402
import train_bpe_gpu as bpe  # noqa: E402

SCRIPT = REPO / "train_bpe_gpu.py"


def chunk_counts_of(docs, pattern=bpe.pattern):
    chunk_counts = Counter()
    for doc in docs:
        chunk_counts.update(regex.findall(pattern, doc))
    return chunk_counts


def our_vocab(docs, vocab_size, pattern=bpe.pattern, device="cpu"):
    merges, _ = bpe.train(chunk_counts_of(docs, pattern), vocab_size, device)
    return bpe.token_bytes(merges)


def cpu_trainer_vocab(docs, vocab_size, pattern=bpe.pattern):
    merges, _ = train_bpe_cpu.train(chunk_counts_of(docs, pattern), vocab_size)
    return train_bpe_cpu.token_bytes(merges)


def rustbpe_vocab(docs, vocab_size, pattern=bpe.pattern):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=pattern)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def run_cli(script, *args, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------- the merges equal rustbpe's and the CPU trainer's

EDGE_CASES = {
    "aaaa": ["aaaa"],
    "runs of one byte, odd and even": ["a" * 3000, "aaa aaaaa aaaaaaa aaaaaaaa " * 20, "b" * 2 + " " + "b" * 33],
    "alternating pairs": ["abababab ab aba abababa", "xyxyxyxyxyxy"],
    "crlf": ["line one\r\nline two\r\n\r\n  indented\r\n" * 10],
    "whitespace only": ["   \n\t  \n\n     \t\t  ", "\n\n\n\n", "        "],
    "emoji and joiners": ["😀😀 👩‍👩‍👧 🇫🇷🇫🇷 hi😀 ok" * 10],
    "long unspaced cjk chunk": ["人人生而自由在尊严和权利上一律平等他们赋有理性和良心并应以兄弟关系的精神相对待" * 30],
    "long run of one cjk character": ["人" * 500 + " " + "中中中中中"],
    "empty documents among others": ["", "abc abc", "", "abcabc"],
    "nothing to merge": ["a b c", ""],
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
@pytest.mark.parametrize("vocab_size", [257, 300, 600])
def test_edge_cases_equal_rustbpe_and_cpu_trainer(name, vocab_size):
    docs = EDGE_CASES[name]
    ours = our_vocab(docs, vocab_size)
    assert ours == rustbpe_vocab(docs, vocab_size)
    assert ours == cpu_trainer_vocab(docs, vocab_size)


def test_runs_are_merged_left_to_right_without_overlap():
    # Runs of 1..9 "a": (a, a) is merged at positions 0, 2, 4... of each run, so an odd run keeps a lone "a".
    chunk_counts = Counter({"a" * length: 1 for length in range(1, 10)})
    merges, total_tokens = bpe.train(chunk_counts, 260)
    assert merges[0] == ((97, 97), 256)
    assert (merges, total_tokens) == train_bpe_cpu.train(chunk_counts, 260)


def test_counts_past_2_to_the_31_switch_to_int64():
    # Chunk frequencies this large stand for ~2^33 characters of text: int32 pair counts would wrap around.
    # The CPU trainer counts with Python ints, which can't overflow.
    chunk_counts = Counter({"ab": 2**31 + 5, "cd": 2**31 + 3, "aaaa": 2**30 + 7, "abcd": 2**31 - 1, "xyx": 3})
    layout = bpe.chunks_to_tensors(chunk_counts, "cpu")
    assert layout[3].dtype == torch.int64
    assert bpe.train(chunk_counts, 270) == train_bpe_cpu.train(chunk_counts, 270)


def test_generated_corpus_equals_rustbpe_and_cpu_trainer():
    rng = random.Random(1234)
    words = ["".join(rng.choice("abcdeéfghij ") for _ in range(rng.randrange(1, 9))) for _ in range(300)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(5, 200))) for _ in range(200)]
    ours = our_vocab(docs, 1200)
    assert ours == rustbpe_vocab(docs, 1200)
    assert ours == cpu_trainer_vocab(docs, 1200)


def test_multilingual_udhr_equals_rustbpe(corpus):
    with open(corpus("udhr.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f][::8]  # ~50 languages, every script family
    assert our_vocab(docs, 1500) == rustbpe_vocab(docs, 1500)


def test_other_pattern_equals_rustbpe(corpus):
    gpt2_pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    text = corpus("tinyshakespeare.txt").read_text()[:100_000]
    assert our_vocab([text], 700, gpt2_pattern) == rustbpe_vocab([text], 700, gpt2_pattern)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(st.text(alphabet=st.sampled_from("aab  \n\r.,1é中😀"), max_size=40), max_size=6),
       vocab_size=st.integers(256, 320))
def test_random_corpora_equal_rustbpe_and_cpu_trainer(docs, vocab_size):
    ours = our_vocab(docs, vocab_size)
    assert ours == rustbpe_vocab(docs, vocab_size)
    assert ours == cpu_trainer_vocab(docs, vocab_size)


def test_token_count_after_merges_equals_cpu_trainer(corpus):
    text = corpus("tinyshakespeare.txt").read_text()[:50_000]
    chunk_counts = chunk_counts_of([text])
    assert bpe.train(chunk_counts, 500) == train_bpe_cpu.train(chunk_counts, 500)


def test_about_one_host_read_per_merge(corpus):
    # Every value the host reads from a device tensor (.item(), .tolist(), int()) goes through
    # aten._local_scalar_dense, one call per element; on a GPU each read waits for the device. The design reads
    # one 6-element tensor per merge (plus a rare second round when the best row's bound was stale).
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountHostReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                CountHostReads.reads += 1
            return func(*args, **(kwargs or {}))

    text = corpus("tinyshakespeare.txt").read_text()[:50_000]
    layout = bpe.chunks_to_tensors(chunk_counts_of([text]), "cpu")
    with bpe.one_thread_on_cpu("cpu"), CountHostReads():
        merges, _ = bpe.merge_on_device(layout, 500)
    assert len(merges) == 244
    assert CountHostReads.reads <= 6 * 1.1 * len(merges) + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the cpu device tests cover the engine")
def test_cuda_equals_rustbpe(corpus):
    text = corpus("tinyshakespeare.txt").read_text()[:300_000]
    docs = [text] + EDGE_CASES["runs of one byte, odd and even"] + EDGE_CASES["long unspaced cjk chunk"]
    assert our_vocab(docs, 2000, device="cuda") == rustbpe_vocab(docs, 2000)


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="no Apple GPU (MPS) on this machine")
def test_mps_equals_rustbpe():
    docs = EDGE_CASES["runs of one byte, odd and even"] + EDGE_CASES["emoji and joiners"]
    assert our_vocab(docs, 600, device="mps") == rustbpe_vocab(docs, 600)


# ---------------------------------------------------------------- pre-tokenizing on every core


def test_parallel_chunk_counting_equals_one_process(corpus, monkeypatch):
    with open(corpus("udhr.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f][:60]
    monkeypatch.setattr(bpe, "PARALLEL_BATCH_CHARS", 20_000)  # many batches, so several are in flight at once
    split_pattern = regex.compile(bpe.pattern)
    parallel = bpe.count_chunks(iter(docs), split_pattern, 10**7, workers=2)
    assert parallel == bpe.count_chunks(iter(docs), split_pattern, 10**7, workers=1)
    assert parallel[1] == sum(map(len, docs))


# ---------------------------------------------------------------- the command line: same output as train_bpe_cpu.py


def test_cli_output_is_byte_identical_to_cpu_trainer(tmp_path, corpus):
    path = corpus("tinyshakespeare.txt")
    common = ["--data", path, "-v", 600, "-n", 150_000]
    gpu = run_cli(SCRIPT, *common, "--device", "cpu", "--out", tmp_path / "gpu", cwd=tmp_path)
    cpu = run_cli(REPO / "train_bpe_cpu.py", *common, "--out", tmp_path / "cpu", cwd=tmp_path)
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.stderr + cpu.stderr
    assert (tmp_path / "gpu" / "tokenizer.tiktoken").read_bytes() == (tmp_path / "cpu" / "tokenizer.tiktoken").read_bytes()
    gpu_info = json.loads((tmp_path / "gpu" / "tokenizer.json").read_text())
    cpu_info = json.loads((tmp_path / "cpu" / "tokenizer.json").read_text())
    assert gpu_info.pop("trainer") == "train_bpe_gpu.py" and gpu_info.pop("device") == "cpu"
    assert cpu_info.pop("trainer") == "train_bpe_cpu.py"
    for info in (gpu_info, cpu_info):
        del info["seconds"]
    assert gpu_info == cpu_info
    # The same compression line, and the GPU trainer's own report of phases and memory.
    compression = [line for line in cpu.stdout.splitlines() if line.startswith("compression")]
    assert compression and compression[0] in gpu.stdout
    assert "merges/s" in gpu.stdout and "peak memory:" in gpu.stdout
    assert not list((tmp_path / "gpu").glob("*.tmp"))


# ---------------------------------------------------------------- bad input: one line, non-zero exit, nothing written

BAD_INPUTS = {
    "vocab too small": (["-v", "255"], "vocab_size must be between 256"),
    "vocab too large": (["-v", str(2**31)], "vocab_size must be between 256"),
    "vocab too large for the dense matrix": (["-v", "2000000"], "pair-count matrix"),
    "n zero": (["-n", "0"], "must be positive"),
    "n negative": (["-n", "-5"], "must be positive"),
    "missing path": (["--data", "no/such/file.txt"], "no such file or directory"),
    "unknown file type": (["--data", "SMALL.md"], "unknown file type"),
    "bad pattern": (["--pattern", "(unclosed"], "--pattern does not compile"),
    "named hub source offline": (["--data", "fineweb-edu"], "can't reach the Hugging Face Hub for --data fineweb-edu"),
    "empty corpus": (["--data", "EMPTY.txt"], "is empty"),
    "bad jsonl line": (["--data", "BAD.jsonl"], "is not a JSON object with a \"text\" field"),
    "unknown device": (["--device", "tpu"], "unknown device"),
}


def bad_input_files(tmp_path):
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    (tmp_path / "SMALL.md").write_text("text")
    (tmp_path / "EMPTY.txt").write_text("")
    (tmp_path / "BAD.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_one_clear_error(tmp_path, monkeypatch, case):
    # In-process (the script's own run()), so that a dozen cases cost no interpreter starts; the test below
    # checks once, through a real process, how such an error reaches the user.
    args, message = BAD_INPUTS[case]
    bad_input_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "--data" not in args:
        args = args + ["--data", "ok.txt"]
    with pytest.raises(bpe.UserError, match=regex.escape(message)) as error:
        bpe.run(args + ["--device", "cpu"] * ("--device" not in args) + ["--out", str(tmp_path / "out")])
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda is not a mistake here")
def test_device_cuda_without_gpu_is_one_line_suggesting_cpu(tmp_path):
    bad_input_files(tmp_path)
    result = run_cli(SCRIPT, "--data", tmp_path / "ok.txt", "--device", "cuda", "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "--device cpu" in error_lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_error_while_reading_is_a_line_of_its_own_on_the_command_line(tmp_path):
    # The reading bar must be closed before the error is printed, or the error lands at the end of its line.
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    result = run_cli(SCRIPT, "--data", tmp_path / "bad.jsonl", "--device", "cpu", "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "is not a JSON object" in error_lines[0], result.stderr
    assert not (tmp_path / "out").exists()
