"""model.py: each property checked against an independent route to the same answer (a hand-written attention,
a full recompute, a brute-force filter, the parameter formula of the architecture)."""
import base64
import copy
import io
import itertools
import math
import os
import pickle
import re
import resource
import signal
import sys
import warnings
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from model import (GPT, PEAK_TFLOPS, CharTokenizer, CheckpointError, GPTConfig, MuonAdamW, apply_rope,  # noqa: E402
                   bytes_of_id, encoding_from_checkpoint, load_checkpoint, model_from_checkpoint, orthogonalize,
                   peak_flops, rope_tables, save_checkpoint, top_k_filter, top_p_filter)


def tiny_config(**overrides):
    settings_ = dict(vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_kv_head=2, block_size=32)
    settings_.update(overrides)
    return GPTConfig(**settings_)


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def scrambled_model(seed=0, **overrides):
    """A tiny model with large random weights: at GPT-2's init an untrained model greedily repeats one token,
    which would let a broken cache pass a greedy-decoding comparison."""
    model = tiny_model(seed, **overrides)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)
    return model


def all_logits(model, idx):
    """Logits for every position: forward returns them all when targets are given."""
    logits, _ = model(idx, targets=idx)
    return logits


# ---- the architecture ----


def test_changing_a_token_never_changes_the_logits_before_it():
    model = tiny_model()
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    before = all_logits(model, idx)
    for t in (0, 7, 19):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 97
        after = all_logits(model, changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(after[:, t], before[:, t])  # the change does reach its own position


@settings(max_examples=40, deadline=None)
@given(q_pos=st.integers(0, 200), k_pos=st.integers(0, 200), shift=st.integers(0, 50),
       seed=st.integers(0, 2**16))
def test_rope_scores_depend_only_on_relative_position(q_pos, k_pos, shift, seed):
    head_dim = 16
    cos, sin = rope_tables(head_dim, 256, theta=10000.0)
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 1, head_dim, generator=generator, dtype=torch.float64)
    k = torch.randn(1, 1, 1, head_dim, generator=generator, dtype=torch.float64)

    def score(m, n):
        rotated_q = apply_rope(q, cos[m:m + 1].double(), sin[m:m + 1].double())
        rotated_k = apply_rope(k, cos[n:n + 1].double(), sin[n:n + 1].double())
        return (rotated_q * rotated_k).sum().item()

    assert score(q_pos, k_pos) == pytest.approx(score(q_pos + shift, k_pos + shift), rel=1e-4, abs=1e-4)
    # ...and a rotation that does nothing would pass the line above: the distance must matter.
    if q_pos != k_pos:
        assert score(q_pos, k_pos) != pytest.approx(score(q_pos, q_pos), rel=1e-6, abs=1e-6)


def test_apply_rope_is_the_rotate_half_formula_bit_for_bit():
    # The tables fold the sign into sin; the result must be exactly (x1 cos - x2 sin, x2 cos + x1 sin) with the
    # angles position * theta^(-2i/head_dim), computed here from scratch.
    head_dim, length = 8, 5
    x = torch.randn(2, 3, length, head_dim, generator=torch.Generator().manual_seed(7))
    cos, sin = rope_tables(head_dim, length, theta=10000.0)
    angles = torch.outer(torch.arange(length, dtype=torch.float32),
                         1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    x1, x2 = x[..., :head_dim // 2], x[..., head_dim // 2:]
    expected = torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    assert apply_rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def hand_attention(attn, x, cos, sin):
    """Causal multi-head attention written out: per-head softmax(q k^T / sqrt(d) + causal mask) v. A key/value
    head serves query heads h with h // (n_head / n_kv_head) equal to it."""
    B, T, C = x.shape
    d = attn.head_dim
    group = attn.n_head // attn.n_kv_head
    q = (x @ attn.c_q.weight.T).view(B, T, attn.n_head, d).transpose(1, 2)
    k = (x @ attn.c_k.weight.T).view(B, T, attn.n_kv_head, d).transpose(1, 2)
    v = (x @ attn.c_v.weight.T).view(B, T, attn.n_kv_head, d).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    heads = []
    for h in range(attn.n_head):
        scores = q[:, h] @ k[:, h // group].transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[:, h // group])
    return torch.cat(heads, dim=-1) @ attn.c_proj.weight.T


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_attention_equals_multi_head_attention_by_hand(n_kv_head):
    model = tiny_model(n_kv_head=n_kv_head)
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 11, 48, generator=torch.Generator().manual_seed(2))
    cos, sin = model.rope_cos[:11], model.rope_sin[:11]
    torch.testing.assert_close(attn(x, cos, sin), hand_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ratio, n_embd, hidden", [(8 / 3, 128, 384), (8 / 3, 768, 2048), (2.0, 128, 256),
                                                   (2.0, 384, 768), (4.0, 100, 512)])
def test_ffn_ratio_rounds_up_to_a_multiple_of_128(ratio, n_embd, hidden):
    config = GPTConfig(n_embd=n_embd, n_head=2, n_kv_head=2, ffn_ratio=ratio)  # 100 // 4 is an odd head size
    assert config.ffn_hidden_size == hidden
    small = tiny_config(ffn_ratio=ratio)
    assert GPT(small).transformer.h[0].mlp.c_up.out_features == small.ffn_hidden_size


@pytest.mark.parametrize("setting, message", [
    ({"n_head": 0}, "n_head=0: must be a positive integer"),
    ({"n_embd": -4}, "n_embd=-4: must be a positive integer"),
    ({"n_layer": 2.0}, "n_layer=2.0: must be a positive integer"),
    ({"n_head": 5}, "n_head must divide n_embd into an even head size"),  # 48 / 5
    ({"n_head": 16}, "n_head must divide n_embd into an even head size"),  # 48 / 16 = 3, odd: RoPE rotates pairs
    ({"n_kv_head": 3}, "n_kv_head must divide n_head"),
    ({"dropout": 1.0}, "dropout=1.0: a probability"),
    ({"ffn_ratio": float("inf")}, "ffn_ratio=inf: must be positive, <= 64"),
    # What a hostile or damaged checkpoint's model_config may hold (another type fails in a comparison, a TypeError,
    # one line too in model_from_checkpoint): each field's range is checked.
    ({"rope_theta": float("nan")}, "rope_theta=nan: must be finite, >= 1"),
    ({"rope_theta": float("inf")}, "rope_theta=inf: must be finite, >= 1"),
    ({"rope_theta": 0.0}, "rope_theta=0.0: must be finite, >= 1"),
    ({"norm_eps": -1.0}, "norm_eps=-1.0: must be in (0, 1)"),
    ({"norm_eps": float("nan")}, "norm_eps=nan: must be in (0, 1)"),
    ({"n_kv_head": -2}, "n_kv_head=-2: must be a positive integer"),
    ({"vocab_size": True}, "vocab_size=True: must be a positive integer"),
    # Past these sizes a model only fails slowly (a million layers take minutes to build) or runs out of memory.
    ({"block_size": 2**40}, "block_size=1099511627776: must be a positive integer, at most 2,097,152"),
    ({"n_layer": 10**6}, "n_layer=1000000: must be a positive integer, at most 1,024"),
    ({"dropout": float("nan")}, "dropout=nan: a probability"),
])
def test_a_config_that_cant_be_a_model_is_one_line(setting, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        tiny_config(**setting)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config, documented", [
    (GPTConfig(), 39_596_544),  # lilLM, GPTConfig's defaults: the count model.py's docstring gives
    (GPTConfig(vocab_size=50304, n_embd=768, n_layer=12, n_head=12, n_kv_head=12, block_size=1024), 123_587_328),
], ids=["lillm", "gpt2_size"])
def test_parameter_count_matches_the_architecture_formula(config, documented):
    d, vocab, hidden = config.n_embd, config.vocab_size, config.ffn_hidden_size
    kv_dim = d // config.n_head * config.n_kv_head
    attention = d * d + 2 * d * kv_dim + d * d  # q, k, v, output projection; no biases
    mlp = 3 * d * hidden                         # SwiGLU: gate, up, down
    norms = 2 * d
    expected = vocab * d + config.n_layer * (attention + mlp + norms) + d  # one tied embedding matrix, the final norm
    with torch.device("meta"):  # shapes only: no need to allocate and initialize the weights
        model = GPT(config)
    assert model.get_num_params() == expected == documented
    assert model.lm_head.weight is model.transformer.wte.weight


def test_init_scales_residual_projections():
    model = GPT(GPTConfig(vocab_size=512, n_embd=256, n_layer=8, n_head=4, n_kv_head=2, block_size=64))
    for name, param in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert param.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05), name
        elif name.endswith("c_q.weight") or name == "lm_head.weight":
            assert param.std().item() == pytest.approx(0.02, rel=0.05), name
        elif name.endswith("ln_1.weight"):
            assert torch.equal(param, torch.ones_like(param))


def test_logits_for_every_position_with_targets_and_the_last_without():
    model = tiny_model()
    idx = torch.randint(0, 97, (3, 9))
    full, loss = model(idx, targets=idx)
    last, no_loss = model(idx)
    assert full.shape == (3, 9, 97) and last.shape == (3, 1, 97) and no_loss is None
    torch.testing.assert_close(last[:, 0], full[:, -1])
    torch.testing.assert_close(loss, F.cross_entropy(full.reshape(-1, 97), idx.reshape(-1)))
    too_long = torch.zeros(1, model.config.block_size + 1, dtype=torch.long)  # RoPE's tables end there
    with pytest.raises(ValueError, match=f"sequence of {model.config.block_size + 1} tokens is longer than block_size"):
        model(too_long)


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        os.environ.get("LILLM_SLOW_TESTS") != "1",
        reason="inductor's C++ code generation takes 40-80 s on 2 CPU cores, more than this file's whole budget; "
               "graph breaks are found by dynamo under aot_eager too. Run with LILLM_SLOW_TESTS=1")),
])
def test_torch_compile_fullgraph_training_forward_and_backward(backend):
    # fullgraph=True turns any graph break into an error. aot_eager also traces the backward graph (AOTAutograd)
    # and runs it with eager kernels; inductor generates and compiles the real CPU kernels.
    torch._dynamo.reset()
    model = tiny_model(n_layer=1).train()
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(3))
    _, eager_loss = model(idx, targets=idx)
    eager_loss.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # Issue 36: the logits come back detached, so the compiled backward makes no zero gradient for them
    # (AOTAutograd fills one, B x T x vocab, for an output with a graph that the loss's backward doesn't use).
    with torch.profiler.profile(record_shapes=True) as profiler:
        logits, compiled_loss = torch.compile(model, fullgraph=True, backend=backend)(idx, targets=idx)
        compiled_loss.backward()
    assert not logits.requires_grad
    assert not [event.name for event in profiler.events() if [2, 32, 97] in event.input_shapes
                and event.name in ("aten::zeros", "aten::zero_", "aten::fill_", "aten::new_zeros")]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for param, eager_grad in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(param.grad, eager_grad, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


# ---- generation ----


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_kv_cache_greedy_decoding_equals_full_recompute(n_kv_head):
    model = scrambled_model(n_kv_head=n_kv_head)
    prompt = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(4))
    cached = model.generate(prompt, max_new_tokens=27, temperature=0)  # fills the context to block_size exactly
    recomputed = model.generate(prompt, max_new_tokens=27, temperature=0, use_cache=False)
    assert cached.shape == (3, 32)
    assert torch.equal(cached, recomputed)
    assert all(len(set(row[5:].tolist())) > 5 for row in cached)  # varied output, not one token repeated


def greedy_by_full_forward(model, prompt, max_new_tokens):
    """The cache's tokens and logits by another route: a full forward of the context the cache holds each step
    (it grows by a token, and past block_size keeps its last block_size//2)."""
    window, tokens, step_logits = prompt, [], []
    for _ in range(max_new_tokens):
        step_logits.append(model(window)[0][:, -1])
        tokens.append(step_logits[-1].argmax(dim=-1, keepdim=True))
        window = torch.cat((window, tokens[-1]), dim=1)
        if window.size(1) > model.config.block_size:
            window = window[:, -(model.config.block_size // 2):]
    return torch.cat(tokens, dim=1), step_logits


def count_graphs(graphs):
    """A torch.compile backend that runs the traced graph as it is (as backend="eager" does) and counts them."""
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    return backend


@pytest.mark.parametrize("graphed", [False, True], ids=["plain", "graphed"])
def test_static_cache_equals_the_full_forward_across_prompts_batches_and_refills(graphed, monkeypatch):
    # The decode step on the GPU's path (graphed: compiled with fullgraph=True, the whole cache masked) or the
    # CPU's (plain): each step's logits equal a full forward's, through two refills, batch 1 and 3, prompts from
    # 1 token to block_size. A long prompt runs first: the shorter ones' cache holds stale keys past them.
    import model as model_module
    torch._dynamo.reset()
    model, graphs, seen_logits = scrambled_model(block_size=16), [], []
    compile_decode = {"backend": count_graphs(graphs), "fullgraph": True} if graphed else False
    sample = model_module.sample_next_token
    monkeypatch.setattr(model_module, "sample_next_token",
                        lambda logits, *args: seen_logits.append(logits) or sample(logits, *args))
    for batch_size, prompt_length in [(3, 16), (3, 5), (1, 15), (1, 1)]:
        prompt = torch.randint(0, 97, (batch_size, prompt_length), generator=torch.Generator().manual_seed(6))
        seen_logits.clear()
        tokens = model.generate(prompt, 30, temperature=0, compile_decode=compile_decode)
        expected_tokens, expected_logits = greedy_by_full_forward(model, prompt, 30)
        assert torch.equal(tokens[:, prompt_length:], expected_tokens)
        for got, expected in zip(seen_logits, expected_logits, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # One graph for batch 3, one for batch 1: never one a position (CUDA graphs need the shapes fixed).
    assert len(graphs) == (2 if graphed else 0)
    torch._dynamo.reset()


def test_bfloat16_weights_keep_float32_rope_and_decode_alike_plain_and_compiled():
    # sample.py's bfloat16 route: cast_weights, no autocast. The RoPE tables stay float32 (Module.to(dtype) would
    # round cos and sin to 3 significant digits), the tie holds, the KV cache takes the weights' dtype, and the
    # compiled decode step (the GPU's, here backend="eager") gives the plain step's greedy tokens.
    torch._dynamo.reset()
    model = scrambled_model()
    model.cast_weights(torch.bfloat16)
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.transformer.wte.weight is model.lm_head.weight
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    plain = model.generate(prompt, 40, temperature=0, compile_decode=False)  # through a refill (block_size 32)
    assert model._kv_caches[0][0].dtype == torch.bfloat16
    compiled = model.generate(prompt, 40, temperature=0, compile_decode={"backend": "eager", "fullgraph": True})
    assert torch.equal(plain, compiled) and all(len(set(row[5:].tolist())) > 5 for row in plain)
    torch._dynamo.reset()


def test_bfloat16_weights_give_logits_near_float32():
    # bf16 keeps 8 significant bits: each rounding is off by at most 2^-9 (0.2%) of its value, the logits' own
    # rounding included; a 2-layer model at GPT-2's init measures 0.3-0.4% of the largest logit off. 1% is the bound.
    model = tiny_model()
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(5))
    in_float32 = all_logits(model, idx)
    model.cast_weights(torch.bfloat16)
    in_bfloat16 = all_logits(model, idx)
    assert in_bfloat16.dtype == torch.bfloat16
    assert (in_bfloat16.float() - in_float32).abs().max() <= 0.01 * in_float32.abs().max()


@pytest.mark.parametrize("graphed", [False, True], ids=["plain", "graphed"])
def test_generators_open_at_once_each_give_the_tokens_they_give_alone(graphed):
    # Two cached generators and a recomputing one, open at once on one model, each resumed in turn, and the model
    # run at another batch size between their tokens. They shared the kept cache: the second's prefill overwrote the
    # first's keys. Now the second makes a cache of its own and steps uncompiled (a CUDA graph reads the kept cache's
    # addresses), and each passes its cache to the model: a forward without one touches none.
    torch._dynamo.reset()
    model, graphs, compiled_steps = scrambled_model(block_size=16), [], []

    def backend(graph_module, example_inputs):  # backend="eager", counting graphs and the steps run through them
        graphs.append(graph_module)
        return lambda *args: compiled_steps.append(1) or graph_module.forward(*args)
    compile_decode = {"backend": backend, "fullgraph": True} if graphed else False
    prompts = [torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5)]
    routes = [dict(compile_decode=compile_decode)] * 2 + [dict(use_cache=False)]
    alone, steps_alone = [], []
    for prompt, route in zip(prompts, routes):
        alone.append(model.generate(prompt, 30, temperature=0, **route)[:, prompt.size(1):])
        steps_alone.append(len(compiled_steps) - sum(steps_alone))
    compiled_steps.clear()
    generators = [model.generate_tokens(prompt, 30, temperature=0, **route) for prompt, route in zip(prompts, routes)]
    together = [[next(generators[0]) for _ in range(4)], [], []]  # the first takes the kept cache, runs ahead
    for _ in range(30):
        for tokens, generator in zip(together, generators):
            tokens.extend(itertools.islice(generator, 1))
            model(torch.zeros(5, 9, dtype=torch.long))
    for tokens, expected in zip(together, alone, strict=True):
        assert torch.equal(torch.cat(tokens, dim=1), expected)
    # Only the first ran the compiled step, through the graph it captured alone: no recompile.
    assert len(graphs) == (1 if graphed else 0) and len(compiled_steps) == steps_alone[0]
    last = model.generate_tokens(prompts[0], 3, temperature=0, **routes[0])
    assert [next(last) for _ in range(3)] and not model._kv_cache_in_use  # at its last yield: the cache is free
    torch._dynamo.reset()


def test_the_cache_is_allocated_once_and_kept_while_the_batch_size_holds():
    # A CUDA graph reads the cache at the addresses it was captured with: a new cache each call would be recaptured.
    model = tiny_model()
    model.generate(torch.zeros(2, 3, dtype=torch.long), 5, temperature=0)
    first = [cache[0].data_ptr() for cache in model._kv_caches]
    model.generate(torch.ones(2, 7, dtype=torch.long), 5, temperature=0)
    assert [cache[0].data_ptr() for cache in model._kv_caches] == first
    model.generate(torch.ones(1, 7, dtype=torch.long), 5, temperature=0)
    assert model._kv_caches[0][0].shape == (1, 2, 32, 12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: the CPU tests above cover the code")
def test_cuda_kv_cache_equals_full_recompute_and_the_cpu():
    # On a GPU: the same logits as the CPU (float32; TF32 off by default), the cache's greedy tokens (graphed and
    # plain) equal the recompute's, and under bf16 autocast the cache takes autocast's dtype and decodes.
    model = scrambled_model(n_kv_head=2)
    idx = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(8))
    on_cpu = all_logits(model, idx)
    model.cuda()
    torch.testing.assert_close(all_logits(model, idx.cuda()).cpu(), on_cpu, rtol=1e-3, atol=1e-4)
    prompt = idx[:, :5].cuda()
    cached = model.generate(prompt, max_new_tokens=27, temperature=0)  # the decode step in CUDA graphs
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=27, temperature=0, use_cache=False))
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=27, temperature=0, compile_decode=False))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        in_bf16 = model.generate(prompt, max_new_tokens=27, temperature=0)
    assert in_bf16.shape == (3, 32) and torch.equal(in_bf16[:, :5], prompt)


def test_generation_goes_past_block_size_and_crops_long_prompts():
    model = tiny_model()
    long_prompt = torch.randint(0, 97, (1, 40))
    with pytest.warns(UserWarning, match="more than block_size=32"):
        out = model.generate(long_prompt, max_new_tokens=50, temperature=0.8, top_k=10)
    assert out.shape == (1, 40 + 50)  # the whole prompt comes back; the model saw only its last 32 tokens
    assert torch.equal(out[:, :40], long_prompt)
    assert 0 <= out.min() and out.max() < 97
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.generate(long_prompt[:, :10], max_new_tokens=100, temperature=0).shape == (1, 110)
    assert not model._kv_cache_in_use  # the kept cache is free again


def test_a_deepcopy_decodes_with_its_own_weights():
    # The compiled decode step is kept on the model, bound to it: a deepcopy that carried it would run the original.
    # A copy made while a generator is open would carry the cache's flag too, and never compile its own step.
    torch._dynamo.reset()
    model, options = scrambled_model(block_size=16), {"backend": "eager", "fullgraph": True}
    prompt = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(9))
    model.generate(prompt, 4, temperature=0, compile_decode=options)
    open_generator = model.generate_tokens(prompt, 4, temperature=0, compile_decode=options)
    next(open_generator)
    twin = copy.deepcopy(model)
    assert not hasattr(twin, "_kv_cache_in_use") and not hasattr(twin, "_kv_caches")
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1)
    compiled = twin.generate(prompt, 12, temperature=0, compile_decode=options)
    assert twin._decode_compiled is not model._decode_compiled  # its own step: compiled, on its weights
    assert torch.equal(compiled, twin.generate(prompt, 12, temperature=0, compile_decode=False))
    open_generator.close()
    torch._dynamo.reset()


def test_a_copy_of_a_compiled_model_runs_its_own_forward():
    # model.compile() keeps its compiled forward on the model; nn.Module's __getstate__ leaves it out, so ours must
    # start from it: a deepcopy carrying it ran the original's forward, and torch.save raised PicklingError.
    torch._dynamo.reset()
    model = scrambled_model(block_size=16)
    model.compile(backend="eager")
    prompt = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(9))
    model(prompt)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1)
    assert torch.equal(twin(prompt)[0], twin.forward(prompt)[0])  # forward(): not the compiled call
    torch.save(model, io.BytesIO())
    torch._dynamo.reset()


def test_a_model_that_generated_still_pickles():
    # torch.save(model), whole: the compiled decode step (a function of torch.compile's) can't be pickled.
    model = scrambled_model(block_size=16)
    prompt = torch.randint(0, 97, (1, 3), generator=torch.Generator().manual_seed(9))
    model.generate(prompt, 4, temperature=0, compile_decode={"backend": "eager"})
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    twin = torch.load(buffer, weights_only=False)  # our own object, just written: no untrusted file
    assert torch.equal(twin.generate(prompt, 6, temperature=0), model.generate(prompt, 6, temperature=0))


def test_a_one_token_context_generates_as_the_recompute_does():
    # block_size=1, a bigram model (train.py accepts it): a full cache keeps at least the newest token, which is all
    # that the recompute sees too, so the two routes give the same tokens.
    model = scrambled_model(block_size=1)
    prompt = torch.randint(0, 97, (2, 1), generator=torch.Generator().manual_seed(7))
    cached = model.generate(prompt, max_new_tokens=10, temperature=0)
    assert cached.shape == (2, 11)
    assert torch.equal(cached, model.generate(prompt, max_new_tokens=10, temperature=0, use_cache=False))


def test_seeded_sampling_is_reproducible():
    model = tiny_model()
    prompt = torch.zeros(2, 1, dtype=torch.long)

    def sample(seed):
        torch.manual_seed(seed)
        return model.generate(prompt, max_new_tokens=30, temperature=1.0, top_k=50, top_p=0.95)

    assert torch.equal(sample(7), sample(7))
    assert not torch.equal(sample(7), sample(8))
    generator_runs = [model.generate(prompt, 30, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*generator_runs)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=30, unique=True),
       k=st.integers(1, 35))
def test_top_k_keeps_exactly_the_k_largest(values, k):
    logits = torch.tensor(values, dtype=torch.float64)
    kept = torch.isfinite(top_k_filter(logits, k)).nonzero().flatten().tolist()
    expected = sorted(range(len(values)), key=lambda i: -values[i])[:k]
    assert sorted(kept) == sorted(expected)


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-8, 8, allow_nan=False), min_size=2, max_size=30, unique=True),
       p=st.floats(0.01, 0.99))
def test_top_p_keeps_the_smallest_set_reaching_p(values, p):
    logits = torch.tensor(values, dtype=torch.float64)
    probs = [math.exp(v - max(values)) for v in values]
    probs = [q / sum(probs) for q in probs]
    order = sorted(range(len(values)), key=lambda i: -probs[i])
    expected, mass = [], 0.0
    for i in order:  # add tokens from the most likely until the mass reaches p
        expected.append(i)
        mass += probs[i]
        if mass >= p:
            break
    # Ties, or a prefix sum within rounding of p, could go either way; such examples are not informative.
    sums = [sum(probs[i] for i in order[:n]) for n in range(1, len(order) + 1)]
    assume(all(abs(total - p) > 1e-9 for total in sums))
    assume(all(probs[a] - probs[b] > 1e-12 for a, b in zip(order, order[1:])))
    kept = torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist()
    assert sorted(kept) == sorted(expected)
    # the filtered distribution, renormalized, samples only from the kept set
    filtered = torch.softmax(top_p_filter(logits, p), dim=-1)
    assert filtered[expected].sum().item() == pytest.approx(1.0)


def test_temperature_zero_is_greedy():
    model = tiny_model()
    prompt = torch.zeros(1, 3, dtype=torch.long)
    greedy = model.generate(prompt, 10, temperature=0)
    # At or near 0: logits / 1e-39 overflow float32 to inf (1e-300 does in any dtype), and softmax gives NaN.
    for temperature in (-1.0, 1e-39, 1e-300):
        assert torch.equal(model.generate(prompt, 10, temperature=temperature), greedy)
    logits, _ = model(prompt)
    assert greedy[0, 3].item() == logits[0, -1].argmax().item()


# ---- optimizer and MFU ----


def test_configure_optimizers_decays_only_matrices():
    model = tiny_model()
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in not_decayed["params"])
    assert len(decayed["params"]) + len(not_decayed["params"]) == len(list(model.parameters()))


def test_configure_optimizers_muon_takes_the_block_matrices():
    model = tiny_model()
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu", optimizer="muon")
    muon, matrices, gains = optimizer.param_groups
    assert muon["use_muon"] and not matrices["use_muon"] and not gains["use_muon"]
    block_matrices = {id(p) for name, p in model.named_parameters() if name.startswith("transformer.h.") and p.dim() == 2}
    assert {id(p) for p in muon["params"]} == block_matrices
    assert [p is model.lm_head.weight for p in matrices["params"]] == [True]  # the tied embedding: AdamW
    assert all(p.dim() == 1 for p in gains["params"]) and gains["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    # Newton-Schulz on the CPU (float32, small batches): every step for 250, then every 2nd; on a GPU every step.
    assert (muon["ns_every"], muon["ns_warmup"]) == (2, 250)
    on_gpu = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda", optimizer="muon").param_groups[0]
    assert (on_gpu["ns_every"], on_gpu["ns_warmup"]) == (1, 0)
    with pytest.raises(ValueError, match="adamw' or 'muon"):
        model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu", optimizer="sgd")


@pytest.mark.parametrize("shape", [(3, 16, 48), (3, 48, 16), (2, 32, 32)])
def test_orthogonalize_is_close_to_the_svd_polar_factor(shape):
    # The independent route: U V^T from an SVD. Singular values spread over two decades, as gradients have.
    torch.manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(shape), full_matrices=False)
    spread = torch.logspace(0, -2, min(shape[1:])).expand(shape[0], -1)
    matrices = u @ torch.diag_embed(spread) @ vh
    result = orthogonalize(matrices).float()
    assert result.shape == matrices.shape
    singular_values = torch.linalg.svdvals(result)
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25
    cosine = F.cosine_similarity(result.flatten(1), (u @ vh).flatten(1), dim=1)
    assert (cosine > 0.97).all(), cosine


def test_orthogonalize_runs_in_float32_on_the_cpu():
    # bfloat16 matmuls are emulated (~27x slower) on CPUs without AVX-512 BF16: the CPU iterates in float32.
    # The same iteration in float64 is the reference; bfloat16 inside would be ~1e-2 off, not ~1e-6.
    matrices = torch.randn(3, 16, 48, generator=torch.Generator().manual_seed(0))
    result = orthogonalize(matrices)
    assert result.dtype == torch.float32
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrices.double() / matrices.double().norm(dim=(-2, -1), keepdim=True)
    for _ in range(5):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(result.double(), x, rtol=0, atol=1e-4)


def test_muon_ns_every_reuses_the_direction_and_resumes_exactly(tmp_path):
    # ns_every=3: steps 1-3 move each weight by the same orthogonal direction (the one of step 1; no weight
    # decay, constant lr), step 4 by a new one. A copy resumed from the state after step 2 takes the same steps.
    torch.manual_seed(2)
    weights = [torch.nn.Parameter(torch.randn(8, 24)), torch.nn.Parameter(torch.randn(24, 8))]
    gradients = [[torch.randn_like(w) for w in weights] for _ in range(4)]
    optimizer = MuonAdamW([{"params": weights, "use_muon": True}], lr=0.1, ns_every=3)
    moves, resumed = [], None
    for step, step_gradients in enumerate(gradients):
        before = [w.detach().clone() for w in weights]
        for w, g in zip(weights, step_gradients):
            w.grad = g.clone()
        optimizer.step()
        moves.append([w.detach() - b for w, b in zip(weights, before)])
        if step == 1:
            torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
            resumed = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    for i in range(2):
        torch.testing.assert_close(moves[1][i], moves[0][i], rtol=0, atol=1e-6)
        torch.testing.assert_close(moves[2][i], moves[0][i], rtol=0, atol=1e-6)
        assert (moves[3][i] - moves[0][i]).abs().max() > 1e-3
    restored = MuonAdamW([{"params": resumed, "use_muon": True}], lr=0.1, ns_every=3)
    restored.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for step_gradients in gradients[2:]:
        for w, g in zip(resumed, step_gradients):
            w.grad = g.clone()
        restored.step()
    for w, r in zip(weights, resumed):
        assert torch.equal(w, r)


def test_muon_ns_warmup_orthogonalizes_every_step_before_the_period_starts():
    # ns_warmup=2, ns_every=3: steps 1 and 2 each take a fresh direction, step 3 (index 2, not a multiple of 3)
    # reuses step 2's, step 4 (index 3) takes a fresh one again.
    torch.manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(8, 24))
    optimizer = MuonAdamW([{"params": [weight], "use_muon": True}], lr=0.1, ns_every=3, ns_warmup=2)
    moves = []
    for _ in range(4):
        before = weight.detach().clone()
        weight.grad = torch.randn_like(weight)
        optimizer.step()
        moves.append(weight.detach() - before)
    assert (moves[1] - moves[0]).abs().max() > 1e-3
    torch.testing.assert_close(moves[2], moves[1], rtol=0, atol=1e-6)
    assert (moves[3] - moves[2]).abs().max() > 1e-3


def test_muon_step_is_the_scaled_orthogonal_direction():
    # A wide and a tall matrix, orthogonalized together in one batch (the tall one transposed).
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(8, 24)), torch.nn.Parameter(torch.randn(24, 8))]
    starts = [w.detach().clone() for w in weights]
    for w in weights:
        w.grad = torch.randn_like(w)
    lr, weight_decay = 0.1, 0.5
    optimizer = MuonAdamW([{"params": weights, "use_muon": True, "weight_decay": weight_decay}], lr=lr, momentum=0.0)
    optimizer.step()
    for weight, start in zip(weights, starts):
        # With no momentum the direction is the gradient's; decay shrinks the weight first; RMS 0.2 x lr.
        step = start * (1 - lr * weight_decay) - weight.detach()
        u, _, vh = torch.linalg.svd(weight.grad, full_matrices=False)
        assert F.cosine_similarity(step.flatten(), (u @ vh).flatten(), dim=0) > 0.97
        assert 0.15 < step.pow(2).mean().sqrt() / lr < 0.25


def test_muon_momentum_is_nesterov():
    # Two steps with the same gradient g: the buffer after them is 0.05 g then 0.0975 g, and the nesterov
    # direction lerp(g, buffer, 0.95) is a positive multiple of g both times, so both steps are along orth(g).
    torch.manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(6, 6))
    gradient = torch.randn(6, 6)
    optimizer = MuonAdamW([{"params": [weight], "use_muon": True}], lr=0.01)
    for expected_buffer in (0.05, 0.0975):
        weight.grad = gradient.clone()
        optimizer.step()
        assert torch.allclose(optimizer.state[weight]["momentum_buffer"], expected_buffer * gradient, atol=1e-6)


def test_muon_adamw_groups_match_torch_adamw():
    # The AdamW half, written out by hand, against torch's own AdamW on the same model and batches (the two
    # round differently, ~1e-6 apart after 3 steps of 1e-2; a wrong bias correction is off by ~1e-3).
    ours, reference = tiny_model(seed=3).train(), tiny_model(seed=3).train()

    def groups(model):
        params = list(model.parameters())
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizers = [MuonAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95)),
                  torch.optim.AdamW(groups(reference), lr=1e-2, betas=(0.9, 0.95), foreach=False)]
    torch.manual_seed(4)
    for _ in range(3):
        idx = torch.randint(0, 64, (2, 8))
        for model, optimizer in zip((ours, reference), optimizers):
            _, loss = model(idx, targets=idx.roll(-1, dims=1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, mine), theirs in zip(ours.named_parameters(), reference.parameters()):
        assert torch.allclose(mine, theirs, atol=1e-5), (name, (mine - theirs).abs().max())  # steps are ~1e-2


def test_muon_lowers_the_loss_and_its_state_round_trips(tmp_path):
    model = tiny_model(seed=5).train()
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu", optimizer="muon")
    torch.manual_seed(6)
    idx = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(20):
        _, loss = model(idx, targets=idx.roll(-1, dims=1))
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert losses[-1] < 0.7 * losses[0]
    # The state (momentum buffers, AdamW moments, step counts) survives torch.save / weights_only load.
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    restored = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu", optimizer="muon")
    restored.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    for p in model.parameters():
        for key, value in optimizer.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(restored.state[p][key])), key


def test_each_gpu_in_the_peak_table_can_be_found():
    # The first key in the GPU's name wins: "H100" before "H100 NVL" would give an H100 NVL the SXM's peak, and its
    # MFU would read 15% low. A key must come before every key it holds.
    keys = list(PEAK_TFLOPS)
    for later in range(len(keys)):
        for earlier in range(later):
            assert keys[earlier] not in keys[later], f"{keys[later]!r} is never reached: {keys[earlier]!r} comes first"


def test_cpu_mfu_is_not_a_number():
    assert peak_flops("cpu") == (None, "n/a on cpu")
    assert math.isnan(tiny_model().estimate_mfu(fwdbwd_per_iter=4, dt=0.1))


# ---- checkpoints ----


def test_checkpoint_round_trip(tmp_path):
    model = tiny_model()
    compiled_like_state = {f"_orig_mod.{key}": value for key, value in model.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    save_checkpoint(str(path), {"model": compiled_like_state, "model_config": asdict(model.config), "iter_num": 3,
                                "tokenizer": {"kind": "char", "chars": ["a", "b"]}})
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind
    checkpoint = load_checkpoint(str(path))
    assert checkpoint["version"] == 1 and checkpoint["iter_num"] == 3
    assert not any(key.startswith("_orig_mod.") for key in checkpoint["model"])
    restored = model_from_checkpoint(checkpoint).eval()
    idx = torch.randint(0, 97, (2, 10))
    assert torch.equal(all_logits(restored, idx), all_logits(model, idx))


def test_an_older_checkpoint_with_retired_settings_loads(tmp_path):
    # GPTConfig had max_batch_size (a cap on generate's batch that protected nothing: the KV cache is sized per
    # call) and ffn_hidden (0: the ffn_ratio rule; nothing set it); checkpoints that carry them still load, and
    # generate takes a batch past max_batch_size's old default of 32.
    model = tiny_model()
    path = tmp_path / "ckpt.pt"
    retired = {"max_batch_size": 32, "ffn_hidden": 0}
    save_checkpoint(str(path), {"model": model.state_dict(), "model_config": {**asdict(model.config), **retired}})
    restored = model_from_checkpoint(load_checkpoint(str(path))).eval()
    idx = torch.randint(0, 97, (40, 10))
    assert torch.equal(all_logits(restored, idx), all_logits(model, idx))
    assert restored.generate(idx, max_new_tokens=2, temperature=0).shape == (40, 12)


class NotPlainData:
    """A class in a checkpoint: unpickling it could run code, so weights_only loading refuses it."""


class RunsCode:
    """Unpickled, it would call os.makedirs(path): what a malicious checkpoint does with os.system."""
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


def test_bad_checkpoints_give_one_line_errors(tmp_path):
    model = tiny_model()
    good = tmp_path / "good.pt"
    save_checkpoint(str(good), {"model": model.state_dict(), "model_config": asdict(model.config)})
    data = good.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    torch.save({"version": 2, "model": {}, "model_config": {}}, tmp_path / "v2.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    torch.save({"version": 1, "model": {}}, tmp_path / "no_config.pt")
    torch.save({"version": 1, "model": NotPlainData(), "model_config": {}}, tmp_path / "pickled_object.pt")
    refused = "not a plain-data checkpoint, refused"
    cases = {"pickled_object.pt": refused, "missing.pt": "no checkpoint at", "truncated.pt": "truncated or corrupt",
             "garbage.pt": "truncated or corrupt", "v2.pt": "is a version 2 checkpoint; this model.py reads version 1",
             "foreign.pt": "not a lilLM", "no_config.pt": "not a lilLM"}
    for name, message in cases.items():
        with pytest.raises(CheckpointError, match=message) as info:
            load_checkpoint(str(tmp_path / name))
        assert "\n" not in str(info.value)
    # Pickles that would run code when loaded (os.makedirs here), in torch's zip format and as a bare pickle.
    marker = tmp_path / "code_ran"
    torch.save({"version": 1, "model": RunsCode(str(marker)), "model_config": {}}, tmp_path / "malicious.pt")
    (tmp_path / "malicious_raw.pt").write_bytes(pickle.dumps({"version": 1, "model": RunsCode(str(marker))}))
    for name in ("malicious.pt", "malicious_raw.pt"):
        with pytest.raises(CheckpointError, match=refused):
            load_checkpoint(str(tmp_path / name))
    assert not marker.exists()
    mismatched = load_checkpoint(str(good))
    # torch's message opens with a header line ("Error(s) in loading state_dict for GPT:"): the reason follows
    for setting, reason in [({"n_embd": 64}, "size mismatch for transformer.wte.weight"),
                            ({"n_layer": 3}, 'Missing key(s) in state_dict: "transformer.h.2.')]:
        with pytest.raises(CheckpointError, match=re.escape(reason)) as info:
            model_from_checkpoint({**mismatched, "model_config": {**mismatched["model_config"], **setting}})
        assert "does not fit this model.py: RuntimeError: " in str(info.value) and "\n" not in str(info.value)
    # A model_config that GPTConfig refuses is one line too, a value of the wrong type included.
    for setting, error in [({"n_head": 0}, "ValueError: n_head=0: must be"),
                           ({"n_layer": 2.0}, "ValueError: n_layer=2.0: must be a positive integer"),
                           ({"norm_eps": -1.0}, "ValueError: norm_eps=-1.0: must be in (0, 1)"),
                           ({"rope_theta": "1e4"}, "TypeError: '<=' not supported")]:
        with pytest.raises(CheckpointError, match=re.escape(f"does not fit this model.py: {error}")) as info:
            model_from_checkpoint({**mismatched, "model_config": {**asdict(model.config), **setting}})
        assert "\n" not in str(info.value)
    # Weights that hold inf or NaN (a diverged run's) are refused: sampling would die in multinomial.
    for value in (float("nan"), float("-inf")):
        diverged = load_checkpoint(str(good))
        diverged["model"]["transformer.h.1.mlp.c_up.weight"][3, 5] = value
        with pytest.raises(CheckpointError, match=re.escape("transformer.h.1.mlp.c_up.weight holds inf or NaN")):
            model_from_checkpoint(diverged)


def test_a_save_that_fails_for_space_keeps_the_old_checkpoint(tmp_path):
    # A full disk, as a file size limit (RLIMIT_FSIZE, with its signal ignored: each write past it fails with
    # EFBIG, where a full disk fails with ENOSPC). torch.save alone reports it as a RuntimeError about zip
    # positions; save_checkpoint raises the OSError, removes its temporary file and leaves ckpt.pt as it was.
    path = tmp_path / "ckpt.pt"
    small, large = tiny_model(), tiny_model(n_layer=8)
    save_checkpoint(str(path), {"model": small.state_dict(), "model_config": asdict(small.config)})
    before = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) * 2, hard))
    try:
        with pytest.raises(OSError) as info:
            save_checkpoint(str(path), {"model": large.state_dict(), "model_config": asdict(large.config)})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.strerror == os.strerror(info.value.errno) and info.value.errno is not None
    assert os.listdir(tmp_path) == ["ckpt.pt"] and path.read_bytes() == before


def bpe_entry(tokens, special_tokens, pattern=r"\S+|\s+"):
    """A checkpoint's tokenizer entry as train.py stores it: the text of a .tiktoken file, rank = position."""
    ranks = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    return {"kind": "bpe", "ranks": ranks, "pattern": pattern, "special_tokens": special_tokens}


BYTES = [bytes([b]) for b in range(256)]


def test_encoding_from_checkpoint_rebuilds_each_kind():
    bpe = encoding_from_checkpoint({"tokenizer": bpe_entry(BYTES + [b"ab", b"abc"], {"<|endoftext|>": 258})})
    assert bpe.encode("abc ab<|endoftext|>", allowed_special="all") == [257, 32, 256, 258]
    assert bpe.n_vocab == 259 and bpe.decode_single_token_bytes(257) == b"abc"
    chars = encoding_from_checkpoint({"tokenizer": {"kind": "char", "chars": ["\n", "a", "é"]},
                                      "model_config": {"vocab_size": 3}})
    assert isinstance(chars, CharTokenizer) and chars.encode("aé\n") == [1, 2, 0] and chars.n_vocab == 3
    assert chars.decode_single_token_bytes(2) == "é".encode()
    with pytest.raises(ValueError, match="1 character\\(s\\) the model's vocabulary lacks: 'b'"):
        chars.encode("ab")


@pytest.mark.parametrize("tokenizer, message", [
    (None, "records no tokenizer"),
    ({"kind": "words"}, "records no tokenizer"),
    ({"kind": "char", "chars": "abc"}, "no list of characters"),
    ({"kind": "tiktoken", "name": "no_such_encoding"}, "can't load the tiktoken encoding 'no_such_encoding'"),
    # A special token on a byte's rank; a byte's rank given to another token (tiktoken's Rust core panics).
    (bpe_entry(BYTES, {"<|endoftext|>": 5}), "special token '<|endoftext|>' has id 5; special tokens take the ids"),
    (bpe_entry(BYTES[:65] + [b"zz"] + BYTES[66:], {}), "its ranks 0-255 are not the 256 single bytes"),
    (bpe_entry(BYTES + [b"ab"], {}) | {"ranks": bpe_entry(BYTES, {})["ranks"] + "YWI= 300\n"}, "not 0..256"),
    (bpe_entry(BYTES, {}, pattern="(unclosed"), "malformed: ValueError"),
    (bpe_entry(BYTES, {}) | {"ranks": "not base64!\n"}, "malformed"),
    (bpe_entry(BYTES, {"<|endoftext|>": 256}), "has 257 ids, more than its model's vocab_size=256"),
])
def test_encoding_from_checkpoint_refuses_a_bad_tokenizer_in_one_line(tokenizer, message):
    with pytest.raises(CheckpointError, match=re.escape(message)) as info:
        encoding_from_checkpoint({"tokenizer": tokenizer, "model_config": {"vocab_size": 256}})
    assert "\n" not in str(info.value)


def test_prepare_data_checks_tokenizers_with_the_same_function():
    """tokenizer_problem() stands in model.py and prepare_data.py as identical copies (the scripts share
    only model.py, and prepare_data.py does not load torch): a fix in one must be made in both."""
    def copy_in(script):
        text = open(os.path.join(os.path.dirname(__file__), "..", script), encoding="utf-8").read()
        start = text.index("def tokenizer_problem(")
        return text[start:text.index("\n\n\n", start)]
    assert copy_in("model.py") == copy_in("prepare_data.py")


def test_the_bytes_of_an_id_the_tokenizer_lacks_are_empty():
    # cl100k_base has no token 100256 (nor 100261-100275), o200k_base none at 200000-200017: a sample may draw
    # such an id, as it may draw a padding id past the tokenizer; it prints nothing rather than a traceback
    import tiktoken
    gap = tiktoken.Encoding(name="gap", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|endoftext|>": 257})  # 256: no token
    assert [bytes_of_id(gap, token_id) for token_id in (65, 256, 257, 300)] == [b"A", b"", b"<|endoftext|>", b""]
    assert [bytes_of_id(CharTokenizer(["a", "\u00e9"]), token_id) for token_id in (1, 2)] == [b"\xc3\xa9", b""]
