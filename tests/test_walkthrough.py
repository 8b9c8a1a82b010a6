"""The README's quickstart, end to end, on a tiny budget: the real command lines in subprocesses, offline.

tokenizer -> shards -> train -> resume -> sample, each stage's output checked against what the next expects.
"""
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import tiktoken
import torch

REPO = Path(__file__).resolve().parent.parent
# The quickstart's own preset, shrunk: if config/quickstart.py breaks, so does this test.
TINY_TRAIN = ["config/quickstart.py", "--n_layer=2", "--n_head=2", "--n_kv_head=1", "--n_embd=64",
              "--block_size=64", "--batch_size=4", "--eval_iters=2", "--eval_interval=10", "--log_interval=5",
              "--warmup_iters=5", "--always_save_checkpoint=True", "--dataset=data/stdlib_v300"]


def run(*command, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, *map(str, command)], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def first_stdlib_document():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    first = min(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    return first.read_text(encoding="utf-8", errors="replace")


def test_quickstart_end_to_end(tmp_path):
    # The scripts run from a copy of the repo, the way a newcomer runs them: relative paths from its root.
    for item in ["train_bpe_cpu.py", "prepare_data.py", "model.py", "train.py", "sample.py", "config"]:
        source = REPO / item
        target = tmp_path / item
        if source.is_dir():
            target.mkdir()
            for file in source.glob("*.py"):
                (target / file.name).write_text(file.read_text())
        else:
            target.write_text(source.read_text())

    # 1. tokenizer: no network, so the default source falls back to the standard library
    result = run("train_bpe_cpu.py", "-v", 300, "-n", 200_000, cwd=tmp_path)
    assert "using the offline corpus" in result.stderr
    tokenizer_dir = tmp_path / "tokenizers" / "stdlib_v300"
    tokenizer_info = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ranks_text = (tokenizer_dir / "tokenizer.tiktoken").read_text()
    eot = tokenizer_info["special_tokens"]["<|endoftext|>"]

    # 2. shards, read with the tokenizer of stage 1
    run("prepare_data.py", "--tokenizer", "tokenizers/stdlib_v300", "-n", 300_000, "--val_tokens", 5_000, cwd=tmp_path)
    dataset_dir = tmp_path / "data" / "stdlib_v300"
    meta = json.loads((dataset_dir / "meta.json").read_text())
    assert meta["vocab_size"] == tokenizer_info["vocab_size"] and meta["eot_token"] == eot
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(ranks_text.encode()).hexdigest()
    encoding = tiktoken.Encoding(
        name="stage1", pat_str=tokenizer_info["pattern"], special_tokens=tokenizer_info["special_tokens"],
        mergeable_ranks={base64.b64decode(t): int(r) for t, r in (line.split() for line in ranks_text.splitlines())})
    val = np.load(dataset_dir / meta["shards"]["val"][0], mmap_mode="r")
    train = np.concatenate([np.load(dataset_dir / name) for name in meta["shards"]["train"]])
    assert val.dtype == np.uint16 and len(val) == meta["tokens"]["val"] and len(train) == meta["tokens"]["train"]
    assert val[0] == eot  # every document is preceded by <|endoftext|>, and val holds the first ones
    first_document = first_stdlib_document()
    assert encoding.decode(val[1:1 + len(encoding.encode_ordinary(first_document))].tolist()) == first_document
    assert int(max(val.max(), train.max())) == meta["max_token_id"] < meta["vocab_size"]

    # 3. train on those shards, with a checkpoint at every eval
    run("train.py", *TINY_TRAIN, "--max_iters=20", cwd=tmp_path)
    out_dir = tmp_path / "out-quickstart"
    checkpoint = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)
    assert checkpoint["iter_num"] == 20
    assert checkpoint["model_config"]["vocab_size"] >= meta["vocab_size"]
    assert checkpoint["tokenizer"]["kind"] == "bpe" and checkpoint["tokenizer"]["ranks"] == ranks_text
    assert checkpoint["dataset"]["tokens"] == meta["tokens"]
    evals = [e for e in map(json.loads, (out_dir / "log.jsonl").read_text().splitlines()) if "val_loss" in e]
    assert [e["iter"] for e in evals] == [0, 10, 20]
    assert evals[-1]["train_loss"] < evals[0]["train_loss"]  # it learned something

    # 4. resume: it goes on from iteration 20, not from scratch
    run("train.py", *TINY_TRAIN, "--max_iters=30", "--init_from=resume", cwd=tmp_path)
    evals = [e for e in map(json.loads, (out_dir / "log.jsonl").read_text().splitlines()) if "val_loss" in e]
    assert [e["iter"] for e in evals][-1] == 30 and [e["iter"] for e in evals].count(0) == 1
    assert torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=True)["iter_num"] == 30

    # 5. sample from the checkpoint, with the tokenizer it carries
    result = run("sample.py", "--out_dir=out-quickstart", "--start=def ", "--num_samples=1", "--max_new_tokens=30",
                 cwd=tmp_path)
    sample = result.stdout.split("\n---------------\n")[0]
    assert sample.startswith("def ") and len(sample) > len("def ")
    assert "tokens/s" in result.stderr


def test_the_readme_stage_table_gives_each_script_its_line_count():
    """The first screen of the README says how long each script is: it must stay true as the scripts change."""
    rows = re.findall(r"^\|[^|\n]*\| `(\w+\.py)` \|[^|\n]*\| (\d+) \|$", (REPO / "README.md").read_text(), re.M)
    assert len(rows) == 8, rows
    actual = {name: len((REPO / name).read_text().splitlines()) for name, _ in rows}
    stale = {name: f"{lines} -> {actual[name]}" for name, lines in rows if actual[name] != int(lines)}
    assert not stale, f"the README's stage table has stale line counts: {stale}"
