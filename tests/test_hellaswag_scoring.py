"""GPT.continuation_losses (HellaSwag-style scoring) against a per-pair brute force through forward. The route
through transformers, on an exported trained model, is in test_hellaswag_train.py."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from model import GPT, GPTConfig  # noqa: E402


def scrambled_gpt(seed=0, **overrides):
    """A tiny model with large random weights (N(0, 0.3)), so that different continuations get clearly
    different losses."""
    settings = dict(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_kv_head=2, block_size=16)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**settings)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)
    return model


def brute_force(model, context, continuation):
    """One pair alone, through forward: (summed, mean) cross-entropy of the continuation's scored tokens."""
    ids = (context + continuation)[-(model.config.block_size + 1):]
    scored = min(len(continuation), len(ids) - 1)
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    with torch.no_grad():
        logits, _ = model(x, y)  # with targets: logits at every position
    losses = F.cross_entropy(logits[0].float(), y[0], reduction="none")[-scored:]
    return losses.sum(), losses.mean()


def test_continuation_losses_equal_a_per_pair_brute_force():
    model = scrambled_gpt()
    block_size = model.config.block_size
    generator = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist()

    # (context, continuation) lengths: rows of different lengths (padding), one exactly block_size + 1 long,
    # a context cut from the left (12 + 9 > 17), and a continuation longer than the window by itself.
    lengths = [(3, 4), (10, 2), (1, 7), (12, 9), (1, 1), (9, 8), (2, 20)]
    assert any(c + n > block_size + 1 for c, n in lengths) and len({c + n for c, n in lengths}) > 1
    contexts, continuations = zip(*[(tokens(c), tokens(n)) for c, n in lengths])
    summed, mean = model.continuation_losses(list(contexts), list(continuations))
    assert summed.shape == mean.shape == (len(lengths),)
    assert summed.dtype == mean.dtype == torch.float32
    expected = [brute_force(model, context, continuation) for context, continuation in zip(contexts, continuations)]
    torch.testing.assert_close(summed, torch.stack([s for s, _ in expected]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, torch.stack([m for _, m in expected]), rtol=1e-5, atol=1e-5)
    # The scoring sees only what it should: the same pair alone gives the same figures as in the batch.
    alone_summed, alone_mean = model.continuation_losses([contexts[3]], [continuations[3]])
    torch.testing.assert_close(alone_summed[0], summed[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone_mean[0], mean[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("contexts, continuations", [
    ([[]], [[1, 2]]),
    ([[1, 2]], [[]]),
    ([[1], []], [[2], [3]]),
    ([[1], [4]], [[2], []]),
])
def test_an_empty_context_or_continuation_is_refused(contexts, continuations):
    model = scrambled_gpt()
    with pytest.raises(ValueError, match="at least one token"):
        model.continuation_losses(contexts, continuations)


def test_the_scoring_computes_its_losses_once():
    # forward's per-token losses (reduction="none") are the scoring's: no second cross-entropy over the logits.
    model = scrambled_gpt()
    with torch.profiler.profile() as profiler:
        model.continuation_losses([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert [event.name for event in profiler.events()].count("aten::cross_entropy_loss") == 1
