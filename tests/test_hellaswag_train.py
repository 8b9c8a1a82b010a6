"""HellaSwag and samples in train.py's evals (issue 26), on a HellaSwag-format file made here from the char-level
dataset's own text: the start of a passage as the context, its true continuation among four endings, and three
distractors made from that continuation (its words spelled backwards, its letters shifted, its characters shuffled),
which a model of a few hundred steps tells apart where an untrained one guesses."""
import json
import os
import random
import shutil
import signal
import time

import pytest

from conftest import assert_one_error_line
from test_train import ENV, dataset, finish, free_port, load, run_train, start_train  # noqa: F401 (dataset: a fixture)

SETTINGS = ["--max_iters=300", "--lr_decay_iters=300", "--eval_interval=150", "--hellaswag_interval=300",
            "--learning_rate=1e-2", "--total_batch_size=None", "--log_interval=50", "--sample_prompt=ROMEO:"]


def shifted(text):
    return "".join(chr((ord(c) - 97 + 1) % 26 + 97) if "a" <= c <= "z" else c for c in text)


def write_hellaswag(text, path, count=100, seed=0):
    """count examples, each from its own passage of text; the true ending at a random place."""
    rng, lines = random.Random(seed), []
    for start in range(1000, 1000 + 997 * count, 997):
        context, ending = text[start:start + 40], text[start + 40:start + 60]
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
    import numpy as np
    ids = np.concatenate([np.load(dataset / name) for name in meta["shards"]["train"]])
    return "".join(meta["chars"][i] for i in ids)


def evals_of(out_dir):
    records = [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]
    return {r["iter"]: r for r in records if "val_loss" in r}, {r["iter"]: r["sample"] for r in records if "sample" in r}


@pytest.fixture(scope="module")
def scored(dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("hellaswag")
    examples = write_hellaswag(chars_text(dataset), root / "hellaswag.jsonl")
    result = finish(start_train(dataset, root / "out", *SETTINGS, f"--hellaswag={examples}"))
    return root, examples, result


def test_an_untrained_model_guesses_and_a_trained_one_knows(scored):
    root, _, result = scored
    evals, samples = evals_of(root / "out")
    assert sorted(evals) == [0, 150, 300]
    assert "hellaswag_acc" not in evals[150]  # only at steps that are multiples of hellaswag_interval
    for it in (0, 300):
        assert evals[it]["hellaswag_examples"] == 100
    # 100 examples: chance is 25% +- 4.3% (one standard deviation)
    assert 0.1 <= evals[0]["hellaswag_acc_norm"] <= 0.45 and 0.1 <= evals[0]["hellaswag_acc"] <= 0.45
    assert evals[300]["hellaswag_acc_norm"] >= 0.7 and evals[300]["hellaswag_acc"] >= 0.7
    assert f"hellaswag acc_norm {evals[300]['hellaswag_acc_norm']:.4f}" in result.stdout
    # a sample at each eval, from the prompt, printed and logged
    assert sorted(samples) == [0, 150, 300] and all(s.startswith("ROMEO:") and len(s) > 20 for s in samples.values())
    assert f"sample iter 300: {samples[300]!r}" in result.stdout


def test_eval_only_two_processes_equal_one_and_the_checkpoint_is_untouched(scored, dataset):
    root, examples, _ = scored
    trained_evals, _ = evals_of(root / "out")
    runs = {}
    for world in (1, 2):
        out_dir = root / f"eval_only_{world}"
        shutil.copytree(root / "out", out_dir)
        args = [*SETTINGS, f"--hellaswag={examples}", "--init_from=resume", "--eval_only=True"]
        env = ENV
        if world == 2:
            env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        processes = [start_train(dataset, out_dir, *args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}
                                 if world == 2 else env) for r in range(world)]
        runs[world] = out_dir, [finish(process) for process in processes]
    for world, (out_dir, results) in runs.items():
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


def test_offline_without_a_file_is_a_note_and_a_broken_file_is_one_line(dataset, tmp_path):
    offline = {**ENV, "HF_HUB_OFFLINE": "1"}
    result = finish(start_train(dataset, tmp_path / "offline", "--max_iters=2", "--eval_interval=1",
                                "--hellaswag_interval=1", "--total_batch_size=None", env=offline))
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


@pytest.mark.parametrize("args, message", [
    (["--eval_only=True"], "eval_only=True evaluates a checkpoint: add --init_from=resume"),
    (["--hellaswag_interval=3", "--eval_interval=2"], "hellaswag_interval=3 is not a multiple of eval_interval=2"),
    (["--sample_prompt=\u263a"], "sample_prompt='\u263a' has characters the vocabulary lacks"),
])
def test_settings_that_cant_work_are_one_line(dataset, tmp_path, args, message):
    assert_one_error_line(run_train(dataset, tmp_path / "out", *args), message)
    assert not (tmp_path / "out").exists()


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
    assert load(tmp_path / "out" / "ckpt.pt")["iter_num"] == 0
