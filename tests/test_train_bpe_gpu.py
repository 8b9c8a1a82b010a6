"""train_bpe_gpu.py against rustbpe (the oracle) and train_bpe_cpu.py (an independent route to the same merges).

CI has no GPU: there the very kernels a GPU runs execute in Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported), on the cpu device. The interpreter runs a kernel's programs one after another, in numpy, at
tens of milliseconds per merge: the corpora here are small on purpose. The CUDA tests run where a GPU exists.
"""
import json
import multiprocessing.util
import os
import re
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import regex
import rustbpe
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")  # before triton's import
pytest.importorskip("triton")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import train_bpe_cpu  # noqa: E402
import train_bpe_gpu as bpe  # noqa: E402

SCRIPT = REPO / "train_bpe_gpu.py"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def chunk_counts_of(docs, pattern=bpe.pattern):
    chunk_counts = Counter()
    for doc in docs:
        chunk_counts.update(regex.findall(pattern, doc))
    return chunk_counts


def train(chunk_counts, vocab_size, max_batch=bpe.max_batch):
    arrays = bpe.chunks_to_arrays(chunk_counts, vocab_size)
    merges, total_tokens, _ = bpe.merge_on_device(arrays, vocab_size, DEVICE, max_batch)
    return merges, total_tokens


def our_vocab(docs, vocab_size, pattern=bpe.pattern, max_batch=bpe.max_batch):
    merges, _ = train(chunk_counts_of(docs, pattern), vocab_size, max_batch)
    return train_bpe_cpu.vocab_bytes(merges)


def cpu_trainer_vocab(docs, vocab_size, pattern=bpe.pattern):
    merges, _ = train_bpe_cpu.train(chunk_counts_of(docs, pattern), vocab_size)
    return train_bpe_cpu.vocab_bytes(merges)


def rustbpe_vocab(docs, vocab_size, pattern=bpe.pattern):
    tokenizer = rustbpe.Tokenizer()
    tokenizer.train_from_iterator(iter(docs), vocab_size, pattern=pattern)
    return [token for token, _ in sorted(tokenizer.get_mergeable_ranks(), key=lambda item: item[1])]


def generated_docs(num_words, num_docs, seed=1234):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdeéfghij ") for _ in range(rng.randrange(1, 9))) for _ in range(num_words)]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(5, 100))) for _ in range(num_docs)]


def run_cli(script, *args, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRITON_INTERPRET=os.environ["TRITON_INTERPRET"])
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------- the merges equal rustbpe's and the CPU trainer's

EDGE_CASES = {
    "aaaa": ["aaaa"],
    "runs of one byte, odd and even": ["a" * 300, "aaa aaaaa aaaaaaa aaaaaaaa " * 20, "b" * 2 + " " + "b" * 33],
    "alternating pairs": ["abababab ab aba abababa", "xyxyxyxyxyxy"],
    "crlf": ["line one\r\nline two\r\n\r\n  indented\r\n" * 10],
    "whitespace only": ["   \n\t  \n\n     \t\t  ", "\n\n\n\n", "        "],
    "emoji and joiners": ["😀😀 👩‍👩‍👧 🇫🇷🇫🇷 hi😀 ok" * 10],
    "long unspaced cjk chunk": ["人人生而自由在尊严和权利上一律平等他们赋有理性和良心并应以兄弟关系的精神相对待" * 30],
    "long run of one cjk character": ["人" * 200 + " " + "中中中中中"],
    "empty documents among others": ["", "abc abc", "", "abcabc"],
    "nothing to merge": ["a b c", ""],
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases_equal_rustbpe_and_cpu_trainer(name):
    docs = EDGE_CASES[name]
    ours = our_vocab(docs, 280)
    assert ours == rustbpe_vocab(docs, 280)
    assert ours == cpu_trainer_vocab(docs, 280)


def test_many_programs_and_small_blocks_give_the_same_merges(monkeypatch):
    # The interpreter's default is one program with one wide block: here 2 programs stride over blocks of 32
    # positions (a pair's list in several blocks, the batch's lists walked as one), appends to the lists cross
    # blocks, dirty rows are refreshed 16 rows by 32 columns at a time, and choose_batch reads 32 block keys (17
    # in use) of 16 rows each (271 ids: the last block holds 15).
    shape = dict(programs=2, block=32, rows=16, choose_block=32, key_block=16)
    monkeypatch.setattr(bpe, "INTERPRETER_SHAPE", shape)
    docs = EDGE_CASES["alternating pairs"] + ["aaa aaaaa aaaaaaa aaaaaaaa " * 2, "qr qr qr st st st xy xy"]
    assert our_vocab(docs, 271) == cpu_trainer_vocab(docs, 271)
    # Row a's second key, (a, B) (B is 66: another item of 32 columns than b's), ranks above (x, y): it ends
    # the first round, so (a, B) is merged before (x, y).
    chunk_counts = Counter({"ab": 10, "aB": 8, "xy": 6})
    assert train(chunk_counts, 259) == train_bpe_cpu.train(chunk_counts, 259)


def test_runs_are_merged_left_to_right_without_overlap():
    # Runs of 1..9 "a": (a, a) is merged at positions 0, 2, 4... of each run, so an odd run keeps a lone "a".
    chunk_counts = Counter({"a" * length: 1 for length in range(1, 10)})
    merges, total_tokens = train(chunk_counts, 260)
    assert merges[0] == ((97, 97), 256)
    assert (merges, total_tokens) == train_bpe_cpu.train(chunk_counts, 260)


def test_counts_past_2_to_the_31_stay_exact():
    # Chunk frequencies this large stand for ~2^33 characters of text: int32 counts would wrap around, and a
    # key with the count in 31 bits would too. The CPU trainer counts with Python ints, which can't overflow.
    chunk_counts = Counter({"ab": 2**31 + 5, "cd": 2**31 + 3, "aaaa": 2**30 + 7, "abcd": 2**31 - 1, "xyx": 3,
                            "cdcd": 2**32 + 1})
    assert bpe.chunks_to_arrays(chunk_counts, 270)["weight"].dtype.itemsize == 8
    assert train(chunk_counts, 270) == train_bpe_cpu.train(chunk_counts, 270)


def test_distinct_chunks_past_int32_positions_are_one_error(monkeypatch):
    # 2^31 bytes of distinct chunks can't be made here: the limit is lowered to the 12 bytes of these chunks.
    chunk_counts = Counter({"abcd": 3, "efgh": 2, "ijkl": 1})
    monkeypatch.setattr(bpe, "MAX_POSITIONS", 14)
    bpe.chunks_to_arrays(chunk_counts, 270)  # 12 bytes + 2 spare slots fit
    monkeypatch.setattr(bpe, "MAX_POSITIONS", 13)
    with pytest.raises(bpe.UserError, match="the distinct chunks hold 12 bytes, more than int32 positions can name"):
        bpe.chunks_to_arrays(chunk_counts, 270)


def test_generated_corpus_equals_rustbpe_and_cpu_trainer():
    docs = generated_docs(100, 50)
    ours = our_vocab(docs, 300)
    assert ours == rustbpe_vocab(docs, 300)
    assert ours == cpu_trainer_vocab(docs, 300)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(st.text(alphabet=st.sampled_from("aab  \n\r.,1é中😀"), max_size=40), max_size=6),
       vocab_size=st.integers(256, 280))
def test_random_corpora_equal_rustbpe_and_cpu_trainer(docs, vocab_size):
    ours = our_vocab(docs, vocab_size)
    assert ours == rustbpe_vocab(docs, vocab_size)
    assert ours == cpu_trainer_vocab(docs, vocab_size)


class CountRounds:
    """The merges each round makes, read from `state` around each choose_batch launch (the interpreter only: on
    CUDA a graph replays the launches, and reading the device while recording one would break it)."""

    def __init__(self, monkeypatch):
        self.rounds, choose = [], bpe.choose_batch
        counter = self

        class Counted:
            def __getitem__(self, grid):
                def launch(state, *args, **kwargs):
                    before = int(state[bpe.NEXT.value])
                    choose[grid](state, *args, **kwargs)
                    if int(state[bpe.NEXT.value]) > before:
                        counter.rounds.append(int(state[bpe.NEXT.value]) - before)
                return launch
        if DEVICE == "cpu":
            monkeypatch.setattr(bpe, "choose_batch", Counted())


def held_back_enwiki(corpus, num_chars):
    """num_chars characters of enwiki from its 50,000,000th byte on: text no other test trains on."""
    docs = []
    with open(corpus("enwiki.jsonl"), "rb") as f:
        f.seek(50_000_000)
        f.readline()  # the rest of a line
        while sum(map(len, docs)) < num_chars:
            docs.append(json.loads(f.readline())["text"][:num_chars - sum(map(len, docs))])
    return docs


# Pairs whose occurrences touch: runs ("aaaa"), pairs merged in one round side by side ("ab" and "cd" rank above
# "bc", and "abcd" holds both), and CJK's three-byte characters, whose bytes pair up across characters.
OVERLAPS = ["aaaa aaaaaaa", "ab ab ab cd cd cd abcd abcdabcd", "人人生而 中中中中"]


@pytest.mark.parametrize("max_batch", [1, 2, 8, 64])
def test_batched_rounds_make_rustbpes_merges(corpus, monkeypatch, max_batch):
    # Held-back real text and overlapping pairs, until no pair is left (73 merges, vocabulary 400 asked): each
    # batch limit gives rustbpe's merges and the CPU trainer's, in fewer rounds than merges (but at 1).
    docs = held_back_enwiki(corpus, 100) + OVERLAPS
    counter = CountRounds(monkeypatch)
    ours = our_vocab(docs, 400, max_batch=max_batch)
    assert len(ours) == 256 + 73 and ours == rustbpe_vocab(docs, 400) == cpu_trainer_vocab(docs, 400)
    if DEVICE == "cpu":
        assert sum(counter.rounds) == 73 and max(counter.rounds) <= max_batch, counter.rounds
        assert max(counter.rounds) == 1 if max_batch == 1 else len(counter.rounds) <= 73 - 15, counter.rounds


def test_adjacent_pairs_merge_in_one_round(monkeypatch):
    # "ab" and "cd" count 10 each, "bc" and "da" 2: one round merges both, and in "abcd" and "cdab" the left
    # occurrence's lane counts the pair between the two as (ab, cd) or (cd, ab). The interpreter runs the first
    # pair's block first: in "cdab" the right occurrence's lane has already written its token.
    chunk_counts = Counter({"ab": 6, "cd": 6, "abcd": 2, "cdab": 2})
    counter = CountRounds(monkeypatch)
    merges, total_tokens = train(chunk_counts, 262)
    assert merges == [((97, 98), 256), ((99, 100), 257), ((256, 257), 258), ((257, 256), 259)]
    assert (merges, total_tokens) == train_bpe_cpu.train(chunk_counts, 262)
    assert DEVICE != "cpu" or counter.rounds[0] == 2


# The interpreter runs code that the GPU compiler refuses (`x = y = ...`, say): compile each kernel for an H100
# (sm_90) and an A100 (sm_80), which needs no GPU, only the ptxas that triton bundles; with int32 counts, and
# int64 where it matters.
COMPILE_FOR_A_GPU = """
import os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, sys.argv[1])
import triton
import train_bpe_gpu as bpe
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
barriers = lambda ttir: [found.start() for found in re.finditer(r'(gpu|ttg)[.]barrier', ttir)]  # 3.6: gpu.barrier

INT64 = {"batch", "row_keys", "block_key", "fresh_keys", "list_start", "list_len", "merge_log"}
SHAPE = dict(BLOCK=256, ROWS=4, KEY_BLOCK=256, POSITIONS=256, SLOTS=8)  # CUDA's, at the default max_batch
KERNELS = (bpe.choose_batch, bpe.find_occurrences, bpe.apply_merges, bpe.refresh_rows)
assert INT64 | set(SHAPE) <= {name for kernel in KERNELS for name in kernel.arg_names}  # no stale name
for arch in (90, 80):  # an H100's, an A100's
    for counts in ("*i32", "*i64"):
        for kernel in KERNELS:
            names = kernel.arg_names
            if counts == "*i64" and "counts" not in names:
                continue
            signature = {name: "constexpr" if name in SHAPE else "i32" if name in ("V", "END", "max_batch") else
                         counts if name in ("counts", "weight") else "*i64" if name in INT64 else "*i32" for name in names}
            constexprs = {(names.index(name),): value for name, value in SHAPE.items() if name in names}
            asm = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32)).asm
            ttir, atomics = asm["ttir"], re.findall(r"\\batom[.][\\w.]+", asm["ptx"])
            print(kernel.fn.__name__, counts, "compiled;", len(atomics), "atomics;", "fenced:", sorted(
                {atomic for atomic in atomics if ".relaxed" not in atomic}))
            if kernel is bpe.choose_batch:  # the dirty rows' keys are copied (stores), a barrier, their blocks' keys
                # recomputed (reduce, store), a barrier, then the picks: each scans (reduce), stores, and a barrier
                first, second, third = barriers(ttir)
                block_keys = ttir.index("tt.reduce", first) < ttir.rindex("tt.store", first, second)
                print("barriers between copy, blocks and scan:", ttir.index("tt.store") < first and block_keys
                      and ttir.index("tt.reduce", second) < ttir.rindex("tt.store", second, third))
            if kernel is bpe.refresh_rows:  # the next items' loads in flight (cp.async)
                print(kernel.fn.__name__, "pipelined:", "cp.async" in asm["ptx"])
"""


def test_the_kernels_compile_for_a_gpu():
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_A_GPU, str(REPO)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.count("compiled") == 12, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("barriers between copy, blocks and scan: True") == 2, result.stdout  # a GPU race
    # one program reading a dirty row item by item would wait out each load in turn
    assert result.stdout.count("pipelined: True") == 4, result.stdout
    # Every atomic relaxed (acq_rel puts a device-wide fence around each, on the merge's critical path), and
    # the atomics are there to be checked: the PTX is what the GPU's compiler gets.
    assert result.stdout.count("fenced: []") == 12, result.stdout
    assert sum(int(count) for count in re.findall(r"compiled; (\d+) atomics", result.stdout)) > 0, result.stdout


# ---------------------------------------------------------------- the host stays out of the merge loop


class CountHostReads:
    """Every way the host can read device memory, counted: .item(), .tolist(), int(), bool(), float(), .numpy(),
    indexing with a 0-dim tensor (a hidden .item()), the dispatched _local_scalar_dense under all of those, and
    one-element copies between devices, either way (the uploads of whole arrays before the loop are no reads).
    Each layer counts on its own, so one .item() counts twice: the bound is checked per kind."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = Counter()
        host_reads = {"item", "tolist", "__bool__", "__int__", "__index__", "__float__", "numpy"}

        def zero_dim(index):
            indices = index if isinstance(index, tuple) else (index,)
            return any(isinstance(i, torch.Tensor) and i.dim() == 0 for i in indices)

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in host_reads or (name in ("__getitem__", "__setitem__") and zero_dim(args[1])):
                    counts[name] += 1
                return func(*args, **(kwargs or {}))

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    counts["_local_scalar_dense"] += 1
                devices = {a.device for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)}
                if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and args[0].numel() <= 1 and (
                        len(devices) > 1 or (kwargs or {}).get("device", next(iter(devices), None)) not in devices):
                    counts["scalar copy between devices"] += 1
                return func(*args, **(kwargs or {}))

        self.modes = (Functions(), Dispatch())

    def __enter__(self):
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


def test_at_most_one_host_read_per_16_rounds(monkeypatch):
    # 32 merges at batches of at most 2: 17 to 31 rounds, two groups of 16. One "done?" per group (the spare
    # group in flight at the end is never read), then two reads after the loop, each of its own kind: the merges
    # (.tolist(), as the "done?" reads), the token count (int()).
    arrays = bpe.chunks_to_arrays(chunk_counts_of(generated_docs(30, 8)), 288)
    with CountHostReads() as reads:
        merges, _, _ = bpe.merge_on_device(arrays, 288, DEVICE, 2)
    assert len(merges) == 32
    assert reads.counts and max(reads.counts.values()) <= 2 + 1, reads.counts


class CountLaunches:
    """Counts the Triton kernels the merge loop runs: each launch from Python, and on CUDA each graph replay as
    the 4 x ROUNDS_PER_READ kernels it holds. The setup runs 4 x ROUNDS_PER_READ + 1 (a first refresh, then a
    group with DONE set, which compiles them) and on CUDA records a group: those are not the loop's."""
    KERNELS = ("choose_batch", "find_occurrences", "apply_merges", "refresh_rows")

    def __init__(self, monkeypatch):
        self.launches, self.replays = 0, 0
        for name in self.KERNELS:
            monkeypatch.setattr(bpe, name, self.counted(getattr(bpe, name)))
        replay = torch.cuda.CUDAGraph.replay

        def counted_replay(graph):
            self.replays += 1
            return replay(graph)
        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted_replay)

    def counted(self, kernel):
        counter = self

        class Counted:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counter.launches += 1
                    return kernel[grid](*args, **kwargs)
                return launch
        return Counted()

    def loop_kernels(self):
        group = len(self.KERNELS) * bpe.ROUNDS_PER_READ
        setup = group + 1 + (group if self.replays else 0)
        return self.launches - setup + self.replays * group


def test_four_kernels_a_round_and_the_next_group_launched_before_each_read(monkeypatch):
    # A round is a batch's four kernels: at batches of at most 2, the 32 merges take 17 to 31 rounds, two groups
    # of 16 rounds, and the loop launches a third (one group stays in flight), nothing else. The host reads group
    # k's "done?" only once group k + 1 is launched: 2 groups at the first read, 3 at the second (the last).
    rounds = CountRounds(monkeypatch).rounds
    counter = CountLaunches(monkeypatch)
    merges_done, launched_at_reads = bpe.merges_done, []

    def read(*copy):
        launched_at_reads.append(counter.loop_kernels() // (4 * bpe.ROUNDS_PER_READ))
        return merges_done(*copy)
    monkeypatch.setattr(bpe, "merges_done", read)
    arrays = bpe.chunks_to_arrays(chunk_counts_of(generated_docs(30, 8)), 288)
    merges, _, _ = bpe.merge_on_device(arrays, 288, DEVICE, 2)
    assert len(merges) == 32 and counter.loop_kernels() == 4 * 3 * bpe.ROUNDS_PER_READ
    assert launched_at_reads == [2, 3], launched_at_reads
    assert DEVICE != "cpu" or 16 < len(rounds) < 32


class SlowFirstLaunch:
    """A kernel whose first launch takes `seconds` longer, as compiling it does on a GPU; `launches` holds
    the time each launch began the kernel's work."""

    def __init__(self, kernel, seconds):
        self.kernel, self.seconds, self.launches = kernel, seconds, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not self.launches:
                time.sleep(self.seconds)
            self.launches.append(time.time())
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_merges_per_second_times_the_loop_alone(monkeypatch):
    # The setup (uploads, zeros, compiling, recording the graph) is timed apart: a first launch made 0.5 s
    # slow, as compiling makes it, must end before the loop's clock starts, which is at the latest the loop's
    # own seconds before the return.
    monkeypatch.setattr(bpe, "choose_batch", SlowFirstLaunch(bpe.choose_batch, 0.5))
    arrays = bpe.chunks_to_arrays(chunk_counts_of(["abcabc abd abd"]), 260)
    merges, _, seconds = bpe.merge_on_device(arrays, 260, DEVICE)
    returned = time.time()
    assert len(merges) == 4 and len(bpe.choose_batch.launches) > 1
    assert seconds["setup"] >= 0.5 and bpe.choose_batch.launches[0] <= returned - seconds["loop"], seconds


def test_cuda_n_makes_gpu_n_current_before_anything_runs(monkeypatch):
    # Triton launches, and a CUDA graph records, on the current device: --device cuda:1 must make GPU 1 current
    # before the first upload or launch. No second GPU here: a fake set_device stops the run and says with what.
    # (That the kernels then run on GPU 1 needs a machine with two GPUs to see.)
    class Stop(Exception):
        pass

    def set_device(device):
        raise Stop(device)

    monkeypatch.setattr(bpe.torch.cuda, "set_device", set_device)
    arrays = bpe.chunks_to_arrays(chunk_counts_of(["abcabc abd abd"]), 260)
    with pytest.raises(Stop) as stop:
        bpe.merge_on_device(arrays, 260, "cuda:1")
    assert torch.device(stop.value.args[0]) == torch.device("cuda", 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: the interpreter tests cover the kernels")
def test_cuda_merge_loop_never_syncs_between_the_allowed_reads(corpus, monkeypatch):
    # Between two "done?" reads, any synchronizing call raises. The kernels are compiled (a group run with DONE
    # set) and a group is recorded as a CUDA graph before the loop: from the second read on, nothing but the
    # reads may wait for the device.
    text = corpus("tinyshakespeare.txt").read_text()[:300_000]
    docs = [text] + EDGE_CASES["runs of one byte, odd and even"] + EDGE_CASES["long unspaced cjk chunk"]
    merges_done, reads = bpe.merges_done, []

    def read_then_forbid(*copy):
        # Forbidden only while another group is to come: after the read that says "done", or all 1744 merges
        # made, the loop ends and reads its results.
        torch.cuda.set_sync_debug_mode("default")
        reads.append(merges_done(*copy))
        done, merges_made = reads[-1]
        if len(reads) >= 2 and not done and merges_made < 2000 - 256:
            torch.cuda.set_sync_debug_mode("error")
        return reads[-1]

    monkeypatch.setattr(bpe, "merges_done", read_then_forbid)  # 1744 merges, in 20+ groups of 16 rounds
    try:
        ours = our_vocab(docs, 2000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ours == rustbpe_vocab(docs, 2000)
    assert len(reads) >= 20 and reads[-1][1] == 2000 - 256


def test_plain_cuda_means_the_current_gpu(monkeypatch):
    # --device cuda (the default on a GPU machine) names no index, which torch.cuda.set_device refuses: the
    # current GPU's index is what it gets. Seen on a real H100 before the fix: ValueError, no merge ran.
    class Stop(Exception):
        pass

    def set_device(device):
        raise Stop(torch.cuda._utils._get_device_index(device))  # torch's own check: needs an index

    monkeypatch.setattr(bpe.torch.cuda, "set_device", set_device)
    monkeypatch.setattr(bpe.torch.cuda, "current_device", lambda: 0)
    arrays = bpe.chunks_to_arrays(chunk_counts_of(["abcabc abd abd"]), 260)
    with pytest.raises(Stop) as stop:
        bpe.merge_on_device(arrays, 260, "cuda")
    assert stop.value.args[0] == 0


# ---------------------------------------------------------------- pre-tokenizing: worker processes


def test_workers_count_as_one_stream_and_stop_at_the_budget(tmp_path, monkeypatch):
    # 3 workers, batches of 2,000 characters: many batches in flight, the budget running out inside a
    # document. The counts, what was read and the invalid UTF-8 (read by the parent) match a plain count.
    monkeypatch.setattr(bpe, "BATCH_CHARS", 2_000)
    docs = generated_docs(100, 60) + EDGE_CASES["emoji and joiners"]
    lines = [json.dumps({"text": doc}).encode() + b"\n" * (1 + (i % 3 == 0)) for i, doc in enumerate(docs)]
    path = tmp_path / "docs.jsonl"  # every 5th line with an invalid UTF-8 byte: the warning's count must add up
    path.write_bytes(b"".join(line.replace(b"a", b"\xff", 1) if i % 5 == 0 else line
                              for i, line in enumerate(lines)))
    texts = [json.loads(line.decode("utf-8", "replace"))["text"]
             for line in path.read_bytes().splitlines() if line.strip()]
    documents, _, _ = bpe.open_source(str(path), data_was_named=True)
    for num_chars in (12_345, 10**9):
        kept, left = [], num_chars
        for text in texts:
            if left == 0:
                break
            kept.append(text[:left])
            left -= len(kept[-1])
        bpe.BadUTF8.count = 0
        counts, read = bpe.count_chunks(documents(num_chars), num_chars, bpe.pattern, 3, None)
        assert counts == chunk_counts_of(kept)
        assert read == dict(documents=len(kept), chars=num_chars - left, cut=kept[-1] != texts[len(kept) - 1])
        # the parent decodes each document it reads whole, the last one too
        assert bpe.BadUTF8.count == sum(text.count("\ufffd") for text in texts[:len(kept)]) > 0


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab1 .,'s\n\r\t\u0301中😀"), max_size=120))
def test_a_document_is_cut_only_where_gpt4s_pattern_cannot_match_across(text):
    # Pieces of 8 characters or more: many cuts, after letters, digits and punctuation alike if the rule were
    # wrong ("a.\n" is one chunk, and so is "e\u0301\n"). The chunks must be the whole document's, in order, and
    # the merges rustbpe's on the whole document.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bpe, "BATCH_CHARS", 8)
        pieces = list(bpe.document_pieces(text, bpe.pattern))
        assert list(bpe.document_pieces(text, r"\w+|\s+")) == [text]  # a pattern not known here: never cut
    assert "".join(pieces) == text
    assert [chunk for piece in pieces for chunk in regex.findall(bpe.pattern, piece)] == \
        regex.findall(bpe.pattern, text)
    merges, _ = train_bpe_cpu.train(chunk_counts_of(pieces), 270)
    assert train_bpe_cpu.vocab_bytes(merges) == rustbpe_vocab([text], 270)


def test_one_large_document_goes_to_the_workers_in_pieces_and_equals_rustbpe(corpus, monkeypatch):
    # tinyshakespeare.txt as one document, cut for 2 workers in pieces of 2^16 characters: its lines end in
    # letters and in punctuation ("First Citizen:\n"), so a cut in the wrong place changes the counts.
    text = corpus("tinyshakespeare.txt").read_text(encoding="utf-8")
    monkeypatch.setattr(bpe, "BATCH_CHARS", 2**16)
    assert len(list(bpe.document_pieces(text, bpe.pattern))) > 10
    counts, read = bpe.count_chunks(iter([text]), len(text), bpe.pattern, 2, None)
    assert counts == chunk_counts_of([text]) and read == dict(documents=1, chars=len(text), cut=False)
    merges, _ = train(counts, 264)
    assert train_bpe_cpu.vocab_bytes(merges) == rustbpe_vocab([text], 264)


def test_a_workers_error_stops_the_reading_and_no_worker_is_left(monkeypatch):
    # A pattern that matches the empty string in places, found by a worker in the first of many batches: the
    # parent raises it (it must not wait for the end of the text, nor block on a full queue), and the workers end.
    monkeypatch.setattr(bpe, "BATCH_CHARS", 100)
    read_documents = []

    def documents():
        for number in range(10**6):
            read_documents.append(number)
            yield "two words " * 10

    with pytest.raises(bpe.UserError, match="matches the empty string"):
        bpe.count_chunks(documents(), 10**8, r"\b|\w+", 2, None)
    assert len(read_documents) < 10**4 and not bpe.multiprocessing.active_children()


def test_a_killed_worker_is_one_error_not_a_wait_forever(monkeypatch):
    # A worker killed (by the kernel's out-of-memory killer, say) never answers: the parent, blocked on a full
    # queue of batches or waiting for the workers' sums, would wait forever. It says so within seconds.
    def killed(documents, pattern_text, chunk_counts):
        os.kill(os.getpid(), signal.SIGKILL)

    def waited_too_long(signum, frame):  # a failure, rather than a suite that never ends
        pytest.fail("count_chunks still waits for a killed worker after 60 s")

    monkeypatch.setattr(bpe, "count_batch", killed)  # the workers fork with it
    documents = (f"text number {number} " * 1000 for number in range(10**4))
    previous = signal.signal(signal.SIGALRM, waited_too_long)
    signal.alarm(60)
    try:
        with pytest.raises(bpe.UserError, match=r"a pre-tokenizing worker died \(signal SIGKILL; out of memory"):
            bpe.count_chunks(documents, 10**9, bpe.pattern, 2, None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not bpe.multiprocessing.active_children()


def alive(pid):  # a zombie is dead: PID 1 in a container may never reap it
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_workers_die_with_a_killed_trainer_and_free_its_out(tmp_path):
    # kill -9 of the trainer (a forked copy of this process: --out locked, reading) while its workers wait on
    # their queue: they inherited the lock's descriptor, and they must not wait, holding it, forever.
    def documents():  # a slow source: the workers wait for their first batch
        yield "some text"
        time.sleep(60)

    trainer = os.fork()
    if trainer == 0:
        try:
            bpe.check_out_dir(tmp_path / "tok")
            bpe.count_chunks(documents(), 10**6, bpe.pattern, 2, None)
        finally:
            os._exit(1)
    workers, deadline = [], time.time() + 30
    try:
        while len(workers) < 2:
            assert time.time() < deadline, "the workers never started"
            workers = Path(f"/proc/{trainer}/task/{trainer}/children").read_text().split()
            time.sleep(0.01)
    finally:
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)
    deadline = time.time() + 5
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in workers if alive(pid)]
    try:
        os.close(bpe.check_out_dir(tmp_path / "tok"))  # a rerun's lock is free
        assert not survivors, "a worker outlived its trainer"
    finally:
        for pid in survivors:  # nothing outlives the test
            os.kill(int(pid), signal.SIGKILL)


def test_a_worker_that_fails_to_start_leaves_no_other_holding_the_exit(monkeypatch):
    # fork failing for the second worker (out of memory): the first, started, waits on its queue; were it not
    # a daemon, the exit (multiprocessing's atexit joins such children) would wait for it forever
    start = multiprocessing.get_context("fork").Process.start
    starts = []

    def failing_start(process):
        starts.append(process)
        if len(starts) == 2:
            raise OSError(12, "Cannot allocate memory")
        start(process)

    trainer = os.fork()
    if trainer == 0:
        try:
            monkeypatch.setattr(multiprocessing.get_context("fork").Process, "start", failing_start)
            try:
                bpe.count_chunks(iter(["some text"] * 10), 10**6, bpe.pattern, 2, None)
            except OSError:
                multiprocessing.util._exit_function()  # what the interpreter's exit runs
                os._exit(3)
        finally:
            os._exit(1)
    deadline, (pid, status) = time.time() + 20, os.waitpid(trainer, os.WNOHANG)
    while pid == 0 and time.time() < deadline:
        time.sleep(0.05)
        pid, status = os.waitpid(trainer, os.WNOHANG)
    if pid == 0:
        os.kill(trainer, signal.SIGKILL)
        os.waitpid(trainer, 0)
    assert pid and os.waitstatus_to_exitcode(status) == 3, "the exit waited on a worker for ever"


STOPPED_MID_READ = """
import sys
sys.path.insert(0, sys.argv[1])
import train_bpe_gpu as bpe

def documents():  # megabyte batches in flight, then a bad line
    for _ in range(12):
        yield "word " * 200_000
    raise bpe.UserError("docs.jsonl:13 is not a JSON object")

try:
    bpe.count_chunks(documents(), 10**9, bpe.pattern, 2, None)
except bpe.UserError as error:
    print("error:", error)
"""


def test_an_error_mid_read_ends_the_process():
    # The error stops the reading with batches still on their way to the workers, which are then killed: at
    # exit, Python waited forever for the batch that no worker would read (a hang after the error line).
    result = subprocess.run([sys.executable, "-c", STOPPED_MID_READ, str(REPO)], capture_output=True, text=True,
                            timeout=60, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert result.returncode == 0 and "error: docs.jsonl:13" in result.stdout, result.stderr[-2000:]


def test_the_worker_and_the_document_cutter_are_the_same_in_both_gpu_trainers():
    # count_chunks is checked in test_copies.py; the worker and the cutter it calls, and the table it reads, here
    # (the argument for the table's cut stands in train_bpe_gpu.py; the multigpu trainer points to it)
    sources = [(REPO / name).read_text(encoding="utf-8") for name in ("train_bpe_gpu.py", "train_bpe_multigpu.py")]
    copies = [source[source.index("SAFE_CUTS = "):].split("\n")[0]
              + source[source.index("def count_worker"):].split("\n\n\n")[0]
              + source[source.index("def document_pieces"):].split("\n\n\n")[0] for source in sources]
    assert copies[0] == copies[1] and "yield document[start:]" in copies[0] and "results.put(error)" in copies[0]


def test_a_bad_line_is_one_error_only_where_the_budget_reaches_it(tmp_path):
    docs = generated_docs(100, 30)
    lines = [json.dumps({"text": doc}) + "\n" for doc in docs]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(lines[:20]) + '{"text": 42}\n' + "".join(lines[20:]))
    documents, _, _ = bpe.open_source(str(path), data_was_named=True)
    chars_before_bad = sum(map(len, docs[:20]))
    counts, read = bpe.count_chunks(documents(chars_before_bad), chars_before_bad, bpe.pattern, 2, None)
    assert counts == chunk_counts_of(docs[:20]) and read["documents"] == 20
    with pytest.raises(bpe.UserError, match=regex.escape("docs.jsonl:21")):
        bpe.count_chunks(documents(chars_before_bad + 1), chars_before_bad + 1, bpe.pattern, 2, None)


# ---------------------------------------------------------------- the command line


def test_cli_output_is_byte_identical_to_cpu_trainer(tmp_path, corpus):
    path = corpus("tinyshakespeare.txt")
    common = ["--data", path, "-v", 280, "-n", 20_000]
    gpu = run_cli(SCRIPT, *common, "--device", DEVICE, "--out", tmp_path / "gpu", cwd=tmp_path)
    cpu = run_cli(REPO / "train_bpe_cpu.py", *common, "--out", tmp_path / "cpu", cwd=tmp_path)
    assert gpu.returncode == 0 and cpu.returncode == 0, gpu.stderr + cpu.stderr
    assert (tmp_path / "gpu" / "tokenizer.tiktoken").read_bytes() == (tmp_path / "cpu" / "tokenizer.tiktoken").read_bytes()
    gpu_info = json.loads((tmp_path / "gpu" / "tokenizer.json").read_text())
    cpu_info = json.loads((tmp_path / "cpu" / "tokenizer.json").read_text())
    assert gpu_info.pop("trainer") == "train_bpe_gpu.py" and gpu_info.pop("device") == DEVICE
    assert cpu_info.pop("trainer") == "train_bpe_cpu.py"
    for info in (gpu_info, cpu_info):
        del info["seconds"]
    assert gpu_info == cpu_info
    compression = [line for line in cpu.stdout.splitlines() if line.startswith("compression")]
    assert compression and compression[0] in gpu.stdout
    assert "| setup " in gpu.stdout and "merges/s" in gpu.stdout and "peak memory:" in gpu.stdout
    assert "warning:" not in gpu.stderr  # GPT-4's pattern matches every character
    assert not list((tmp_path / "gpu").glob("*.tmp"))


BAD_INPUTS = {
    "vocab too small": (["-v", "255"], "vocab_size must be between 256"),
    "vocab too large": (["-v", str(2**20 + 1)], "vocab_size must be between 256"),
    "vocab too large for the dense matrix": (["-v", "1000000"], "pair-count matrix"),
    "n zero": (["-n", "0"], "must be positive"),
    "max_batch zero": (["--max_batch", "0"], "--max_batch 0: must be 1 (a merge a round) to 1024"),
    "max_batch past 1024": (["--max_batch", "2000000"], "--max_batch 2000000: must be 1 (a merge a round) to 1024"),
    "bad pattern": (["--pattern", "(unclosed"], "--pattern does not compile"),
    "empty pattern": (["--pattern", ""], "matches the empty string"),
    "pattern matching nothing": (["--pattern", "x*"], "matches the empty string"),
    "pattern matching empty in places": (["--pattern", r"\b"], "matches the empty string"),
    "pattern with a group": (["--pattern", r"(\w+) ?"], "has a capturing group; use (?:...)"),
    "catastrophic pattern": (["--pattern", r"(?:a|a)+b|\s", "--data", "RUNS.txt"], "backtracks catastrophically"),
    "empty corpus": (["--data", "EMPTY.txt"], "is empty"),
    "unknown device": (["--device", "tpu"], "not supported"),
    "a device Triton can't use": (["--device", "meta"], "not supported"),
    "out is a file": (["--out", "ok.txt"], "is a file, not a directory"),
    "out under a file": (["--out", "ok.txt/tok"], "is a file, not a directory"),
    "out is a dataset directory": (["--out", "dataset"], "is a dataset directory"),
    "out holds other files": (["--out", "notes"], "not a tokenizer directory"),
    "out in /proc": (["--out", "/proc/tok"], "--out /proc/tok can't be written"),
}


@pytest.fixture
def bad_input_files(tmp_path, monkeypatch):
    (tmp_path / "ok.txt").write_text("some text to train on " * 10)
    (tmp_path / "EMPTY.txt").write_text("")
    (tmp_path / "RUNS.txt").write_text("a" * 40 + " ")
    (tmp_path / "BAD.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "meta.json").write_text("{}")
    (tmp_path / "dataset" / "tokenizer.json").write_text("the dataset's own tokenizer")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_one_clear_error_before_any_work(bad_input_files, monkeypatch, case):
    # In-process (the script's own run()), so that a dozen cases cost no interpreter starts; the test below
    # checks through a real process how such an error reaches the user.
    args, message = BAD_INPUTS[case]
    args = args + ["--data", "ok.txt"] * ("--data" not in args) + ["--device", DEVICE] * ("--device" not in args)
    args = args + ["--out", "out"] * ("--out" not in args)
    # The real count_chunks, watched: only the errors that need the text (\b matches "" only inside it) read it
    counted = []
    count_chunks = bpe.count_chunks
    monkeypatch.setattr(bpe, "count_chunks", lambda *args: counted.append(1) or count_chunks(*args))
    with pytest.raises(bpe.UserError, match=regex.escape(message)) as error:
        bpe.run(args)
    assert "\n" not in str(error.value)
    needs_the_text = ("catastrophic pattern", "empty corpus", "pattern matching empty in places")
    assert bool(counted) == (case in needs_the_text), "read before it was refused"
    # Nothing is written: a reading error comes after --out is made and locked, and the process removes
    # the empty directory as it exits (the next test sees it gone); here, in the test's process, it is empty.
    assert not (bad_input_files / "out").exists() or not any((bad_input_files / "out").iterdir())
    assert (bad_input_files / "dataset" / "tokenizer.json").read_text() == "the dataset's own tokenizer"


def test_characters_the_pattern_leaves_out_are_one_warning(bad_input_files, capsys):
    # \w+ leaves the spaces out: tiktoken drops them from the encoding too, so the run goes on, but says so.
    # Likewise a byte that is not UTF-8, read as U+FFFD.
    (bad_input_files / "bad.txt").write_bytes((bad_input_files / "ok.txt").read_bytes() + b"\xff")
    text = (bad_input_files / "ok.txt").read_text() + "\ufffd"  # as read
    matched = sum(map(len, regex.findall(r"\w+", text)))
    bpe.BadUTF8.count = 0  # the reader's count is per process: an earlier test here may have left one
    bpe.run(["--data", "bad.txt", "--device", DEVICE, "--out", "out", "-v", "260", "--pattern", r"\w+"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: 1 invalid UTF-8 sequences were replaced with U+FFFD",
                        f"warning: the split pattern matched {matched:,} of {len(text):,} characters; the "
                        f"other {1 - matched / len(text):.1%} are dropped (tiktoken drops them too)"]


def test_fewer_pairs_than_merges_stop_early_and_say_so(bad_input_files, capsys):
    # "ab ab abc": (a, b), then (" ", ab), then (" ab", c) merge; then no pair is left
    (bad_input_files / "few.txt").write_text("ab ab abc")
    bpe.run(["--data", "few.txt", "--device", DEVICE, "--out", "out", "-v", "300"])
    assert "stopped early after 3 merges: no pairs left to merge (vocab 259 < 300)" in capsys.readouterr().out
    info = json.loads((bad_input_files / "out" / "tokenizer.json").read_text())
    assert info["num_merges"] == 3 and info["vocab_size"] == 260 and info["special_tokens"] == {"<|endoftext|>": 259}


def test_errors_while_reading_are_a_line_of_their_own_on_the_command_line(bad_input_files):
    # The reading bar must be closed before the error is printed, or the error lands at the end of its line.
    result = run_cli(SCRIPT, "--data", "BAD.jsonl", "--device", DEVICE, "--out", "out", cwd=bad_input_files)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "is not a JSON object" in error_lines[0], result.stderr
    assert not (bad_input_files / "out").exists()
    result = run_cli(SCRIPT, "--data", "x" * 300 + ".txt", "--device", DEVICE, "--out", "out", cwd=bad_input_files)
    assert result.returncode == 1 and "Traceback" not in result.stderr  # an OSError, like a permission denied
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: [Errno 36] File name too long: '" + "x" * 300 + ".txt'"], result.stderr


def test_a_gpu_this_machine_lacks_is_one_error(bad_input_files, monkeypatch):
    # A machine with one GPU (faked: the test must refuse the same way with or without a GPU here).
    monkeypatch.setattr(bpe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bpe.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(bpe.UserError, match=regex.escape("--device cuda:1: this machine has 1 CUDA GPU(s), "
                                                         "cuda:0 to cuda:0")):
        bpe.run(["--data", "ok.txt", "--out", "out", "--device", "cuda:1"])


@pytest.fixture
def cuda_without_a_c_compiler(tmp_path, monkeypatch):
    """A GPU machine as Docker's CUDA runtime images make it, as far as Triton sees: its CUDA driver (forced), no
    gcc or clang on PATH, CC unset, a cold cache. A stub libcuda: the build fails at the compiler, before linking."""
    from triton.backends.nvidia import driver as nvidia
    from triton.runtime import build
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "_create_driver", nvidia.CudaDriver)
    monkeypatch.setattr(bpe.triton.runtime.driver, "_default", None)
    monkeypatch.setattr(bpe.triton.runtime.driver, "_active", None)
    (tmp_path / "libcuda.so.1").write_bytes(b"")
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cold cache"))
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(bpe.triton.knobs.runtime, "interpret", False)  # a GPU, found: the kernels compile
    monkeypatch.setattr(bpe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bpe.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(bpe.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**37))
    remembered = [build._find_compiler, nvidia.libcuda_dirs, nvidia.library_dirs]  # functools caches
    for function in remembered:
        function.cache_clear()
    yield
    for function in remembered:
        function.cache_clear()


def test_no_c_compiler_is_one_error_before_the_text_is_read(bad_input_files, cuda_without_a_c_compiler,
                                                            monkeypatch):
    # Triton builds its CUDA launcher in C at the first kernel launch, which came after all the reading (minutes
    # on a big corpus), then a traceback. Each way the build fails is one line, before the reading: no compiler,
    # CC naming none, a compiler that fails (gcc without Python.h: its own output above the line).
    from triton.runtime import build
    monkeypatch.setattr(bpe, "count_chunks", lambda *args: pytest.fail("read the text before refusing"))
    failing_compiler = shutil.which("false", path=os.defpath)  # exits 1, as gcc without Python.h does
    for compiler, reason in [(None, "(Failed to find C compiler. Please specify via CC"),
                             ("/no/such/cc", "([Errno 2] No such file or directory: '/no/such/cc')"),
                             (failing_compiler, f"(Command '['{failing_compiler}', ")]:
        if compiler:
            monkeypatch.setenv("CC", compiler)
        build._find_compiler.cache_clear()  # it remembers CC
        with pytest.raises(bpe.UserError) as error:
            bpe.run(["--data", "ok.txt", "--out", "out"])
        message = str(error.value)
        assert message.startswith("Triton can't build its CUDA launcher " + reason), message
        assert message.endswith("; install gcc and python3-dev, or set CC") and "\n" not in message
    assert not (bad_input_files / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the default device works")
def test_no_gpu_and_no_device_is_refused_rather_than_interpreted_slowly(bad_input_files):
    with pytest.raises(bpe.UserError, match="no CUDA GPU here; --device cpu runs the kernels") as error:
        bpe.run(["--data", "ok.txt", "--out", "out"])
    assert "train_bpe_cpu.py" in str(error.value) and not (bad_input_files / "out").exists()
