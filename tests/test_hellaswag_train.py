"""HellaSwag and samples in train.py's evals (issue 26), on a HellaSwag-format file made here from the char-level
dataset's own text (the model learns its bytes, a byte-level BPE, so that export_hf.py can export it): the start
of a passage as the context, its true continuation among four endings, and three distractors made from that
continuation (its words spelled backwards, its letters shifted, its characters shuffled), which a model of a few
hundred steps tells apart where an untrained one guesses."""
import base64
import hashlib
import json
import random
import runpy
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_one_error_line
from test_train import REPO, finish, fork_train, free_port, load, run_train, start_train, train
from test_train import dataset  # noqa: F401 (a fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import load_checkpoint, model_from_checkpoint  # noqa: E402

# vocab_size 320 pads the byte-level BPE's 257 ids: a sample may draw an id past the tokenizer
SETTINGS = ["--max_iters=300", "--lr_decay_iters=300", "--eval_interval=150", "--hellaswag_interval=300",
            "--learning_rate=1e-2", "--total_batch_size=None", "--log_interval=50", "--sample_prompt=ROMEO:",
            "--vocab_size=320", "--hellaswag_batch=32"]


def shifted(text):
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) if "a" <= c <= "z" else c for c in text)


def write_hellaswag(text, path, count=100, seed=0):
    """count examples, each from its own passage of text; the true ending at a random place. Contexts of 6-26
    characters, endings of 10-16: rows of 18-44 bytes, some cut to the tests' block_size + 1 = 33, some padded
    in a batch of examples."""
    rng, lines = random.Random(seed), []
    for start in range(1000, 1000 + 997 * count, 997):
        context_length, ending_length = 6 + start % 21, 10 + start % 7
        context = text[start:start + context_length]
        ending = text[start + context_length:start + context_length + ending_length]
        # (not its characters sorted: at GPT-2's init, tied embeddings predict the input token again, so an
        # untrained model prefers runs of one character and would pick that distractor every time)
        shuffled = "".join(rng.sample(ending, len(ending)))
        distractors = [" ".join(word[::-1] for word in ending.split(" ")), shifted(ending), shuffled]
        label = rng.randrange(4)
        endings = distractors[:label] + [ending] + distractors[label:]
        lines.append(json.dumps({"ctx": context, "endings": endings, "label": label}))
    path.write_text("\n".join(lines) + "\n")
    return path


def chars_text(dataset):
    meta = json.loads((dataset / "meta.json").read_text())
    ids = np.concatenate([np.load(dataset / name) for name in meta["shards"]["train"]])
    return "".join(meta["chars"][i] for i in ids)


def write_byte_dataset(directory, text):
    """The text's UTF-8 bytes as the shards of a byte-level BPE (256 bytes, no merges, <|endoftext|> = 256)."""
    directory.mkdir(parents=True)
    ids = np.array([256] + list(text.encode()), dtype=np.uint16)
    split = int(len(ids) * 0.9)
    np.save(directory / "train_000000.npy", ids[:split])
    np.save(directory / "val_000000.npy", ids[split:])
    ranks = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    (directory / "tokenizer.tiktoken").write_text(ranks)
    info = {"pattern": r"\S+|\s+", "special_tokens": {"<|endoftext|>": 256}, "vocab_size": 257}
    (directory / "tokenizer.json").write_text(json.dumps(info))
    meta = {"version": 1, "vocab_size": 257, "eot_token": 256, "dtype": "uint16", "max_token_id": 256,
            "tokenizer": {"kind": "bpe", "sha256": hashlib.sha256(ranks.encode()).hexdigest()}, "source": "test",
            "num_chars": len(text), "tokens": {"train": split, "val": len(ids) - split},
            "shards": {"train": ["train_000000.npy"], "val": ["val_000000.npy"]}}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def evals_of(out_dir):
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    return {r["iter"]: r for r in records if "val_loss" in r}, {r["iter"]: r["sample"] for r in records if "sample" in r}


@pytest.fixture(scope="module")
def scored(dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("hellaswag")
    text = chars_text(dataset)
    examples = write_hellaswag(text, root / "hellaswag.jsonl")
    result = train(write_byte_dataset(root / "bytes", text), root / "out", *SETTINGS, f"--hellaswag={examples}")
    return root, examples, result


def test_an_untrained_model_guesses_and_a_trained_one_knows(scored):
    root, _, result = scored
    evals, samples = evals_of(root / "out")
    assert sorted(evals) == [0, 150, 300]
    assert "hellaswag_acc" not in evals[150]  # only at steps that are multiples of hellaswag_interval
    for it in (0, 300):
        assert evals[it]["hellaswag_examples"] == 100
    # 100 examples: chance is 25% +- 4.3% (one standard deviation). At GPT-2's init the model is not quite
    # indifferent (0.12 here: it likes an ending whose bytes repeat its input's), but it knows nothing.
    assert evals[0]["hellaswag_acc_norm"] <= 0.4 and evals[0]["hellaswag_acc"] <= 0.4
    assert evals[300]["hellaswag_acc_norm"] >= 0.7 and evals[300]["hellaswag_acc"] >= 0.7
    assert f"hellaswag acc_norm {evals[300]['hellaswag_acc_norm']:.4f}" in result.stdout
    # a sample at each eval, from the prompt, printed and logged
    assert sorted(samples) == [0, 150, 300] and all(s.startswith("ROMEO:") and len(s) > 6 for s in samples.values())
    assert f"sample iter 300: {samples[300]!r}" in result.stdout


def test_eval_only_two_processes_equal_one_and_the_checkpoint_is_untouched(scored):
    # and batches of examples count what one example a forward counts: the training run scored 32 examples a
    # forward, the one process scores one (4 rows: the scoring before batches, 0: the CPU's default), the two 7 each
    root, examples, _ = scored
    trained_evals, _ = evals_of(root / "out")
    runs = {}
    for world in (1, 2):
        out_dir = root / f"eval_only_{world}"
        shutil.copytree(root / "out", out_dir)
        args = [*SETTINGS, f"--hellaswag={examples}", "--init_from=resume", "--eval_only=True",
                f"--hellaswag_batch={0 if world == 1 else 7}"]
        port = str(free_port())  # the ranks: forked from the warm script runner, with torchrun's variables
        ranks = [{"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                  "LOCAL_RANK": str(r)} if world == 2 else None for r in range(world)]
        runs[world] = out_dir, [fork_train(root / "bytes", out_dir, *args, environ=environ) for environ in ranks]
    for world, (out_dir, processes) in runs.items():  # the three processes ran at once
        results = [finish(process) for process in processes]
        # no step trained, no checkpoint written: the same bytes, and the log has one eval more
        assert (out_dir / "ckpt.pt").read_bytes() == (root / "out" / "ckpt.pt").read_bytes()
        assert not [line for line in results[0].stdout.splitlines() if line.startswith("iter ")]
        lines = (out_dir / "log.jsonl").read_text().splitlines()
        assert len(lines) == len((root / "out" / "log.jsonl").read_text().splitlines()) + 2  # eval and sample
        last = json.loads(lines[-2])
        for key in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_examples"):
            assert last[key] == trained_evals[300][key], (world, key)  # the same weights, the same counts
        assert last["val_loss"] == pytest.approx(trained_evals[300]["val_loss"], abs=1e-5)  # summed in another order
    assert load(root / "out" / "ckpt.pt")["iter_num"] == 300


def hub_cache_of(examples, cache):
    """A `datasets` cache that holds examples as Rowan/hellaswag's validation split (labels as strings, as the
    Hub has them), made as load_dataset makes one: a builder prepares the split, here from a local file, and the
    directory is named as a Hub download's (<namespace>___<name>/<config>/<version>/<hash>)."""
    from datasets.packaged_modules.json.json import Json
    rows = [json.loads(line) for line in examples.read_text().splitlines()]
    (cache / "rows.jsonl").write_text("".join(json.dumps(dict(row, label=str(row["label"]))) + "\n" for row in rows))
    builder = Json(cache_dir=str(cache / "build"), dataset_name="hellaswag",
                   data_files={"validation": str(cache / "rows.jsonl")})
    builder.download_and_prepare()
    (cache / "Rowan___hellaswag" / "default" / "0.0.0").mkdir(parents=True)
    Path(builder.cache_dir).rename(cache / "Rowan___hellaswag" / "default" / "0.0.0" / "local")
    return cache


def test_offline_the_hub_route_scores_datasets_cached_copy(scored, tmp_path):
    # --hellaswag=hub with the Hub out of reach: `datasets` still serves a copy it cached, through the same
    # load_dataset call and row mapping as online, and the counts are the file's.
    root, examples, _ = scored
    trained_evals, _ = evals_of(root / "out")
    shutil.copytree(root / "out", tmp_path / "out")
    cache = hub_cache_of(examples, tmp_path)
    result = finish(fork_train(root / "bytes", tmp_path / "out", *SETTINGS, "--hellaswag=hub", "--init_from=resume",
                               "--eval_only=True", environ={"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}))
    assert "note:" not in result.stdout, result.stdout
    last = json.loads((tmp_path / "out" / "log.jsonl").read_text().splitlines()[-2])
    for key in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_examples"):
        assert last[key] == trained_evals[300][key], key


def test_offline_without_a_file_is_a_note_and_a_broken_file_is_one_line(dataset, tmp_path):
    result = finish(fork_train(dataset, tmp_path / "offline", "--max_iters=2", "--eval_interval=1",
                               "--hellaswag_interval=1", "--total_batch_size=None", environ={"HF_HUB_OFFLINE": "1"}))
    notes = [line for line in result.stdout.splitlines() if "HellaSwag" in line]
    assert notes == ["note: no HellaSwag figures (the Hugging Face Hub is off (HF_HUB_OFFLINE=1)); "
                     "--hellaswag=<file.jsonl> scores a local copy"]
    assert "hellaswag_acc" not in (tmp_path / "offline" / "log.jsonl").read_text()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 1}) + "\n\n"
                      + json.dumps({"ctx": "a", "endings": ["b", "c", "d"], "label": 1}) + "\n")
    result = run_train(dataset, tmp_path / "broken", "--hellaswag_interval=1", "--eval_interval=1",
                       f"--hellaswag={broken}")
    assert_one_error_line(result, f"{broken}, line 3: not a HellaSwag example")
    assert not (tmp_path / "broken").exists()


def test_sigterm_during_hellaswag_stops_it_and_saves(dataset, tmp_path):
    # 6,000 examples keep iter 0's HellaSwag busy for many seconds, its one loss batch (eval_iters=1) for
    # milliseconds: SIGTERM 2 s into the eval lands in HellaSwag, which stops within an example; the run saves
    # and exits with 0, and no half-counted figure is logged.
    many = write_hellaswag(chars_text(dataset), tmp_path / "many.jsonl", count=150)
    many.write_text(many.read_text() * 40)
    process = start_train(dataset, tmp_path / "out", "--max_iters=10", "--eval_interval=5", "--hellaswag_interval=5",
                          f"--hellaswag={many}", "--total_batch_size=None", "--eval_iters=1")
    for line in process.stdout:
        if line.startswith("model:"):  # the line before the loop, whose first act is the eval
            time.sleep(2)
            process.send_signal(signal.SIGTERM)
            break
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stdout + stderr
    assert "stopped by SIGTERM after iter 0" in stdout and "eval iter" not in stdout
    assert not (tmp_path / "out" / "log.jsonl").exists()  # no eval was logged
    assert load(tmp_path / "out" / "ckpt_stopped.pt")["iter_num"] == 0


def test_transformers_on_the_export_scores_the_file_as_train_py_did(scored):
    # Two routes to one figure: export_hf.py's Llama model, scored here by transformers and the test's own loss,
    # against train.py's logged acc and acc_norm, and model.py's mean loss of every ending.
    transformers = pytest.importorskip("transformers")
    root, examples, _ = scored
    export = str(REPO / "export_hf.py")
    argv, sys.argv = sys.argv, [export, f"--out_dir={root / 'out'}", f"--hf_dir={root / 'hf'}"]
    sigterm = signal.getsignal(signal.SIGTERM)
    try:  # `python export_hf.py ...`, in this process: no second import of torch
        runpy.run_path(export, run_name="__main__")
    finally:
        sys.argv = argv
        signal.signal(signal.SIGTERM, sigterm)  # export_hf.py's own, for its process: not this one's
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(root / "hf"), torch_dtype=torch.float32).eval()
    ours = model_from_checkpoint(load_checkpoint(root / "out" / "ckpt.pt")).eval()
    block_size, right_by_mean, right_by_sum = ours.config.block_size, 0, 0
    ours_right = torch.zeros(2, dtype=torch.long)
    for line in examples.read_text().splitlines():
        example = json.loads(line)
        context, endings = list(example["ctx"].encode()), [list((" " + e).encode()) for e in example["endings"]]
        means, sums = [], []
        for ending in endings:
            ids = torch.tensor([(context + ending)[-(block_size + 1):]])  # cut from the left, as train.py does
            with torch.no_grad():
                logits = theirs(ids[:, :-1]).logits[0, -len(ending):]
            losses = F.cross_entropy(logits, ids[0, -len(ending):], reduction="none")
            means.append(losses.mean().item())
            sums.append(losses.sum().item())
        our_sums, our_means = ours.continuation_losses([context] * 4, endings)  # one example a forward
        assert our_means.tolist() == pytest.approx(means, abs=1e-4)
        right_by_mean += int(np.argmin(means) == example["label"])
        right_by_sum += int(np.argmin(sums) == example["label"])
        ours_right += torch.stack([our_means.argmin(), our_sums.argmin()]) == example["label"]
    evals, _ = evals_of(root / "out")
    logged = (evals[300]["hellaswag_acc_norm"], evals[300]["hellaswag_acc"])  # 32 examples a forward
    assert (right_by_mean / 100, right_by_sum / 100) == logged
    assert [count / 100 for count in ours_right.tolist()] == list(logged)
