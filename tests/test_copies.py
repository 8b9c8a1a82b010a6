"""The functions that stand in several scripts: the scripts share only model.py, so a function two of them need
is copied, and the copies must stay the same byte for byte (a diff of two trainers then shows only what the GPU
changes). The shared reader section is checked in test_reader.py; these are the single functions."""
import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAINERS = ["train_bpe_cpu.py", "train_bpe_gpu.py", "train_bpe_multigpu.py"]
GPU_TRAINERS = ["train_bpe_gpu.py", "train_bpe_multigpu.py"]  # they count chunks alike, on every core
WRITERS = [*TRAINERS, "prepare_data.py", "train.py", "export_hf.py"]  # each writes a directory and locks it
READERS = ["train_bpe_cpu.py", "train_bpe_gpu.py", "prepare_data.py", "train_bpe_multigpu.py"]  # they read text
COPIES = [("lock_directory", WRITERS),
          ("check_out_dir", TRAINERS),
          ("save_tokenizer", TRAINERS),
          ("vocab_bytes", TRAINERS),
          ("time_is_up", GPU_TRAINERS),
          ("count_batch", GPU_TRAINERS),
          ("count_chunks", GPU_TRAINERS),
          ("check_launcher", GPU_TRAINERS),
          ("tokenizer_problem", ["model.py", "prepare_data.py"]),
          ("parse_settings", ["sample.py", "export_hf.py"]),  # their --key=value options
          ("hub_problem", [*TRAINERS, "prepare_data.py", "train.py"]),  # train.py: for HellaSwag
          ("read_whole", ["prepare_data.py", "train.py"]),  # files they read whole: bounded
          # the text reader: train_bpe_multigpu.py's ranks read byte ranges (read_jsonl, read_parquet) and
          # shares of a Hub dataset (datasets_texts), so those three are its own, and it opens its sources
          # its own way (no local_texts, no offline corpus)
          ("local_files", READERS), ("read_txt", READERS), ("stdlib_documents", READERS[:3]),
          ("datasets_texts", READERS[:3]), ("local_texts", READERS[:2]),
          ("read_jsonl", READERS[:2]), ("read_parquet", READERS[:2]),  # prepare_data.py's --part: byte ranges
          ("read_jsonl", READERS[2:]), ("read_parquet", READERS[2:]),
          ("open_source", ["train_bpe_cpu.py", "train_bpe_gpu.py"]),
          ("first_chars", ["train_bpe_cpu.py", "prepare_data.py"])]


def function_source(script, name):
    """The text of the top-level function `name` in `script`, its decorators and docstring included."""
    text = (REPO / script).read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "\n".join(text.splitlines()[first - 1:node.end_lineno])
    return None


@pytest.mark.parametrize("name, scripts", COPIES, ids=[name for name, _ in COPIES])
def test_the_copies_are_identical(name, scripts):
    sources = {script: function_source(script, name) for script in scripts}
    missing = [script for script, source in sources.items() if source is None]
    assert not missing, f"{name} is missing from {missing}"
    first = sources[scripts[0]]
    differ = [script for script in scripts if sources[script] != first]
    assert not differ, f"{name} in {differ} differs from {scripts[0]}'s"


def test_the_check_sees_a_drifted_copy(tmp_path, monkeypatch):
    """The comparison itself can fail: a copy with one changed character is caught."""
    for script in ("train_bpe_cpu.py", "train_bpe_gpu.py"):
        (tmp_path / script).write_text((REPO / script).read_text(encoding="utf-8"), encoding="utf-8")
    drifted = (tmp_path / "train_bpe_gpu.py").read_text(encoding="utf-8").replace(
        "def save_tokenizer(out_dir", "def save_tokenizer(out_dir ", 1)
    (tmp_path / "train_bpe_gpu.py").write_text(drifted, encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    with pytest.raises(AssertionError, match="differs"):
        test_the_copies_are_identical("save_tokenizer", ["train_bpe_cpu.py", "train_bpe_gpu.py"])


def test_the_interpreter_fix_is_the_same_in_both_gpu_trainers():
    """Not a top-level function (it runs at import, before any kernel): the block from its `if` to its last line."""
    start, end = 'if os.environ["TRITON_INTERPRET"] == "1":', "interpreter._patch_lang_tensor = patch_tensor\n"
    blocks = []
    for script in GPU_TRAINERS:
        text = (REPO / script).read_text(encoding="utf-8")
        blocks.append(text[text.index(start):text.index(end) + len(end)])
    assert blocks[0] == blocks[1] and "squeeze" in blocks[0]


def test_the_utf8_counter_is_the_same_in_every_reader():
    """A class and the two lines that register it as a codec error handler: from `class` to the register line."""
    start, end = "class BadUTF8:", "codecs.register_error(BadUTF8.errors, BadUTF8.replace)\n"
    blocks = []
    for script in READERS:
        text = (REPO / script).read_text(encoding="utf-8")
        blocks.append(text[text.index(start):text.index(end) + len(end)])
    assert len(set(blocks)) == 1 and "BadUTF8.count += 1" in blocks[0]
