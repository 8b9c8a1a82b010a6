"""
lilLM's model: a Llama-3-style GPT in one file, shared by train.py, sample.py and export_hf.py.

Compared with GPT-2 (nanoGPT), it swaps in what later models settled on: RMSNorm, rotary position
embeddings, a SwiGLU MLP, grouped-query attention, tied embeddings, no biases.

    from model import GPTConfig, GPT
    model = GPT(GPTConfig())             # the lilLM preset, 39,596,544 parameters
    logits, loss = model(idx, targets)   # training: logits for every position
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=50)
"""
import base64
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 8192    # a multiple of 64 keeps the output matmul on fast tiles
    n_embd: int = 512
    n_layer: int = 12
    block_size: int = 512     # longest context; RoPE tables and the KV cache are sized to it
    n_head: int = 16          # query heads
    n_kv_head: int = 8        # key/value heads (grouped-query attention)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    ffn_ratio: float = 8 / 3  # SwiGLU hidden size: ffn_ratio * n_embd, up to a multiple of:
    ffn_multiple_of: int = 128
    dropout: float = 0.0      # pretraining on lots of data doesn't need it
    bias: bool = False

    def __post_init__(self):
        check_config(self)

    @property
    def ffn_hidden_size(self):
        # SwiGLU has three matrices, not two: 8/3*n_embd (not 4*n_embd) keeps GPT-2's MLP size.
        multiple = self.ffn_multiple_of
        return multiple * math.ceil(self.ffn_ratio * self.n_embd / multiple)


class RMSNorm(nn.Module):
    # Why not LayerNorm: its re-centering and bias add no measurable quality, only cost (Llama).
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # float32: bf16 loses too many bits.
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim, length, theta):
    """Each (position, channel)'s rotation: cos for both halves, sin with the first negated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (length, head_dim/2)
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([-angles.sin(), angles.sin()], dim=-1)


def apply_rope(x, cos, sin):
    # Why rotary over GPT-2's learned positions: rotating query and key channel pairs by an angle
    # proportional to the position makes q.k depend only on the tokens' distance, with no
    # parameters. Pair (i, i + head_dim/2) = (x1, x2) becomes (x1 cos - x2 sin, x2 cos + x1 sin)
    # = x * cos + (x2, x1) * sin.
    x_float = x.float()
    x1, x2 = x_float.chunk(2, dim=-1)
    return (x_float * cos + torch.cat([x2, x1], dim=-1) * sin).type_as(x)


class CausalSelfAttention(nn.Module):
    # Why grouped-query attention: the KV cache limits generation speed and batch size; sharing each
    # key/value head among n_head/n_kv_head query heads shrinks it that much, for a little quality.
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=config.bias)
        self.c_k = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=config.bias)
        self.c_v = nn.Linear(config.n_embd, config.n_kv_head * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cos, sin, position=None, mask=None, cache=None):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cached_keys, cached_values = cache
            if position is None:  # the prefill, from 0: causal over its own keys
                cached_keys[:, :, :T], cached_values[:, :, :T] = k, v
            else:  # one token at `position`, seeing the cache's first mask.size(-1)
                cached_keys.index_copy_(2, position, k)
                cached_values.index_copy_(2, position, v)
                k, v = cached_keys[:, :, :mask.size(-1)], cached_values[:, :, :mask.size(-1)]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    # Why SwiGLU over GELU: a gated unit (silu(x W_gate) * x W_up) trains to a lower loss at equal
    # parameters and compute (Shazeer 2020); Llama uses it.
    def __init__(self, config):
        super().__init__()
        hidden = config.ffn_hidden_size
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_up = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_up(x)))


class Block(nn.Module):
    # Pre-norm, as in GPT-2: normalizing each branch's input (not the sum) keeps the residual
    # stream an identity path: deep stacks train without warmup tricks.
    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, position=None, mask=None, cache=None):
        x = x + self.attn(self.ln_1(x), cos, sin, position, mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tied embeddings: one matrix maps tokens to vectors and back.
        self.transformer.wte.weight = self.lm_head.weight
        # RoPE tables are computed, not learned: buffers kept out of checkpoints.
        cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # GPT-2 init: N(0, 0.02); the residual stream's 2 writes a layer 0.02/sqrt(2*n_layer): depth
        # does not grow its variance.
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def cast_weights(self, dtype):  # not Module.to: the RoPE tables stay float32
        for param in self.parameters():
            param.data = param.data.to(dtype)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters())  # the tied embedding counted once

    def forward(self, idx, targets=None, reduction="mean", caches=None):
        """idx: (B, T) token ids. With targets (B, T) (-1 = ignore): logits (B, T, vocab) and the
        cross-entropy (`reduction`). Without: the last position's logits (B, 1, vocab) and None.
        caches: a KV cache a block, filled from 0 (the prefill)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.transformer.drop(self.transformer.wte(idx))
        for block, cache in zip(self.transformer.h, caches or [None] * len(self.transformer.h)):
            x = block(x, cos, sin, cache=cache)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        # float32 softmax: bf16 logits visibly round the loss at vocab sizes like ours. Detached, or a
        # compiled backward fills them a zero gradient.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1, reduction=reduction)
        return logits.detach(), loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type,
                             optimizer="adamw", verbose=True):
        """"adamw": AdamW, decaying the matrices, not the 1-D gains and biases (that only fights
        the norm). "muon": Muon for the blocks' matrices, AdamW for the rest."""
        log = print if verbose else (lambda *args, **kwargs: None)
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {optimizer!r}")
        params = [p for p in self.parameters() if p.requires_grad]
        block_matrices = [p for p in self.transformer.h.parameters() if p.requires_grad and p.dim() == 2]
        for_muon = {id(p) for p in block_matrices} if optimizer == "muon" else set()
        decay = [p for p in params if p.dim() >= 2 and id(p) not in for_muon]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if optimizer == "muon":
            others = decay + no_decay
            log(f"optimizer: Muon for {len(block_matrices)} matrices in the blocks "
                f"({sum(p.numel() for p in block_matrices):,} params), AdamW for {len(others)} "
                f"other tensors ({sum(p.numel() for p in others):,} params)")
            # Newton-Schulz is ~1% of a GPU step, up to half a CPU one: there, every step for the
            # first 250 (the momentum turns fast), then every 2nd.
            schedule = {} if device_type == "cuda" else {"ns_every": 2, "ns_warmup": 250}
            muon = {"params": block_matrices, "weight_decay": weight_decay, "use_muon": True, **schedule}
            return MuonAdamW([muon] + groups, lr=learning_rate, betas=betas)
        fused = device_type in ("cuda", "cpu")
        log(f"optimizer: {len(decay)} decayed tensors ({sum(p.numel() for p in decay):,} params), "
            f"{len(no_decay)} not decayed ({sum(p.numel() for p in no_decay):,} params)")
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

    def estimate_mfu(self, fwdbwd_per_iter, dt):
        """Model FLOPs utilization: 0.4 = 40% of the device's bf16 peak. FLOPs per
        token as in PaLM: 6N (matmuls) + 12*L*H*Q*T (attention)."""
        cfg = self.config
        flops_per_token = 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        peak, _ = peak_flops(self.lm_head.weight.device)
        if not peak:
            return float("nan")
        return flops_per_token * cfg.block_size * fwdbwd_per_iter / dt / peak

    # ---- generation ----
    # The KV cache holds each token's keys and values: a step runs only the newest token. Static
    # (block_size positions, kept, written in place): a GPU decode step reads it all, masked to the
    # filled part; fixed shapes (the position a tensor) make one CUDA graph of its 100s of launches.

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, **settings):
        """idx (B, T) -> (B, T + max_new_tokens), with generate_tokens's settings."""
        return torch.cat([idx, *self.generate_tokens(idx, max_new_tokens, **settings)], dim=1)

    @torch.no_grad()
    def generate_tokens(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                        use_cache=True, generator=None, compile_decode=None):
        """Yields the new tokens, each (B, 1). A full cache is refilled from the last block_size//2
        tokens; use_cache=False recomputes the context each step (the same tokens while it fits).
        compile_decode: torch.compile's options for the decode step (None: CUDA graphs on a GPU).
        A second open one gets its own cache, uncompiled."""
        block_size = self.config.block_size
        if idx.size(1) > block_size:
            warnings.warn(f"the prompt has {idx.size(1)} tokens, more than "
                          f"block_size={block_size}: keeping only its last {block_size}")
            idx = idx[:, -block_size:]
        if max_new_tokens <= 0:
            return
        if compile_decode is None and idx.device.type == "cuda" and c_compiler():
            compile_decode = {"mode": "reduce-overhead"}  # 9+ shapes: eager, no error
        kept = use_cache and not getattr(self, "_kv_cache_in_use", False)
        compile_decode = compile_decode if kept else False
        if compile_decode and getattr(self, "_decode_options", None) != compile_decode:
            self._decode_options = compile_decode
            self._decode_compiled = torch.compile(self._decode_step, **compile_decode)
        decode_step = self._decode_compiled if compile_decode else self._decode_step
        caches = self._kv_cache(idx.size(0), idx.device, kept) if use_cache else None
        try:
            window = idx
            position = torch.zeros(1, dtype=torch.long, device=idx.device)
            for step in range(max_new_tokens):
                if step > 0 and use_cache and window.size(1) <= block_size:
                    if compile_decode:  # the graph may overwrite the last logits
                        torch.compiler.cudagraph_mark_step_begin()
                    length = block_size if compile_decode else window.size(1)
                    logits = decode_step(next_token, position.fill_(window.size(1) - 1), length,
                                         caches)
                else:  # prefill or refill
                    keep = max(1, block_size // 2) if use_cache else block_size
                    window = window[:, -keep:] if window.size(1) > block_size else window
                    logits, _ = self(window, caches=caches)
                next_token = sample_next_token(logits[:, -1], temperature, top_k, top_p, generator)
                if kept and step == max_new_tokens - 1:  # we may never be resumed
                    self._kv_cache_in_use = kept = False
                yield next_token
                window = torch.cat((window, next_token), dim=1)
        finally:
            if kept:
                self._kv_cache_in_use = False

    def _decode_step(self, token, position, length, caches):
        """token (B, 1) at position (a (1,) tensor), seeing length cache positions -> logits."""
        mask = (torch.arange(length, device=token.device) <= position).view(1, 1, 1, length)
        cos, sin = self.rope_cos[position], self.rope_sin[position]
        x = self.transformer.drop(self.transformer.wte(token))
        for block, cache in zip(self.transformer.h, caches):
            x = block(x, cos, sin, position, mask, cache)
        return self.lm_head(self.transformer.ln_f(x))

    def _kv_cache(self, batch_size, device, kept):
        cfg = self.config
        dtype = self.lm_head.weight.dtype
        if torch.is_autocast_enabled(device.type):  # keys/values come out in its dtype
            dtype = torch.get_autocast_dtype(device.type)
        shape = (batch_size, cfg.n_kv_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        old = getattr(self, "_kv_caches", [[torch.empty(0)]])[0][0]
        if not kept or (old.shape, old.dtype, old.device) != (shape, dtype, device):
            caches = [[torch.zeros(shape, dtype=dtype, device=device) for _ in "kv"]
                      for _ in self.transformer.h]
            if not kept:
                return caches
            self._kv_caches = caches
            for tensor in [tensor for cache in caches for tensor in cache]:
                torch._dynamo.mark_static_address(tensor)  # a CUDA graph reads it where captured
        self._kv_cache_in_use = True
        return self._kv_caches

    def __getstate__(self):  # copies and pickles leave out the cache, the compiled step
        state = super().__getstate__()
        return {k: v for k, v in state.items() if not k.startswith(("_kv", "_decode"))}

    # ---- scoring continuations (HellaSwag) ----

    @torch.no_grad()
    def continuation_losses(self, contexts, continuations):
        """For each (context, continuation) pair of token-id lists: the continuation's summed and
        mean cross-entropy given the context, two (B,) float32 tensors (of the last block_size + 1
        tokens)."""
        pairs = []
        for context, continuation in zip(contexts, continuations):
            if not context or not continuation:
                raise ValueError("a context and a continuation of at least one token each")
            ids = (context + continuation)[-(self.config.block_size + 1):]
            pairs.append((ids, min(len(continuation), len(ids) - 1)))
        # right-padded rows: causal positions never see the padding after them
        width = max(len(ids) for ids, _ in pairs) - 1
        inputs = torch.zeros(len(pairs), width, dtype=torch.long)
        targets = torch.full((len(pairs), width), -1, dtype=torch.long)
        for row, (ids, scored) in enumerate(pairs):
            inputs[row, :len(ids) - 1] = torch.tensor(ids[:-1])
            targets[row, len(ids) - 1 - scored:len(ids) - 1] = torch.tensor(ids[-scored:])
        device = self.lm_head.weight.device  # built on the host, copied once: no per-row syncs
        inputs, targets = inputs.to(device), targets.to(device)
        _, losses = self(inputs, targets, reduction="none")
        summed = losses.view(len(pairs), width).sum(dim=1)
        return summed, summed / (targets >= 0).sum(dim=1)


# ---- sampling the next token ----

def top_k_filter(logits, k):
    """Set every logit below the k-th largest to -inf (ties with the k-th are kept)."""
    kth_largest = torch.topk(logits, min(k, logits.size(-1)), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def top_p_filter(logits, p):
    """Nucleus filtering: keep the fewest most likely tokens whose probabilities reach p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = F.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    remove_sorted = mass_before >= p  # they reached p without this token
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


# Below it, greedy: a tinier temperature overflows the logits to inf (the softmax to NaN), while
# at 1e-4 a 0.01 lead in logit already takes all the probability.
GREEDY_BELOW = 1e-4


def sample_next_token(logits, temperature, top_k, top_p, generator):
    """logits (B, vocab) -> next token ids (B, 1)."""
    if temperature < GREEDY_BELOW:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


# ---- the Muon optimizer ----

def orthogonalize(matrices, steps=5):
    """Roughly the nearest orthogonal matrix to each of a stack (n, rows, cols): U V^T of its SVD
    U S V^T. A Newton-Schulz step maps X to a X + b (X X^T) X + c (X X^T)^2 X, each singular value
    s to a s + b s^3 + c s^5; Keller Jordan's coefficients take 0.003..1 to about 0.7..1.2 in five
    steps. bfloat16 on a GPU, float32 on a CPU (bf16 emulated: ~27x slower)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrices.bfloat16() if matrices.is_cuda else matrices.float()
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # wide, X X^T is the smaller square
        x = x.mT.contiguous()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # singular values <= the Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x if wide else x.mT


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups marked use_muon (2-D matrices), AdamW for the others.
    Why Muon (Jordan et al. 2024): a few directions dominate a matrix's gradient, and AdamW's step
    follows them. Muon steps along the momentum's nearest orthogonal matrix: the same directions,
    all moved alike (CPU Shakespeare: val loss 1.59, AdamW 1.68). Scaled by 0.2 * sqrt(max(rows,
    cols)), its RMS is 0.2, about AdamW's (Liu et al. 2025): one learning rate drives both.
    ns_every=k orthogonalizes every k-th step after ns_warmup, reusing the direction between (the
    momentum moves ~5% a step)."""

    def __init__(self, param_groups, lr, betas=(0.9, 0.95), eps=1e-8, momentum=0.95, ns_steps=5,
                 ns_every=1, ns_warmup=0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum,
                        ns_steps=ns_steps, ns_every=ns_every, ns_warmup=ns_warmup, use_muon=False)
        super().__init__(param_groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon_step if group["use_muon"] else self._adamw_step)(group, params)

    def _muon_step(self, group, params):
        lr, momentum, every = group["lr"], group["momentum"], group["ns_every"]
        # One shape's matrices (a tall one transposed) share batched matmuls.
        by_shape = {}
        for p in params:
            by_shape.setdefault((min(p.shape), max(p.shape)), []).append(p)
        for (rows, cols), same_shape in by_shape.items():
            states = [self.state[p] for p in same_shape]
            grads = [p.grad for p in same_shape]
            buffers = [state.setdefault("momentum_buffer", torch.zeros_like(p))
                       for state, p in zip(states, same_shape)]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            step = states[0].get("step", 0)
            fresh = step % every == 0 or step < group["ns_warmup"]
            if fresh or "direction" not in states[0]:
                # Nesterov: step where the momentum goes, the gradient plus the buffer.
                nesterov = torch._foreach_lerp(grads, buffers, momentum)
                wide = torch.stack([g if g.size(0) == rows else g.mT for g in nesterov])
                directions = orthogonalize(wide, group["ns_steps"]).to(same_shape[0].dtype)
                directions = [d if p.size(0) == rows else d.mT for d, p in zip(directions, same_shape)]
            else:
                directions = [state["direction"] for state in states]
            if every > 1:  # in the state, so that a resumed run takes the same steps
                for state, direction in zip(states, directions):
                    state.update(step=step + 1, direction=direction)
            torch._foreach_mul_(same_shape, 1 - lr * group["weight_decay"])
            torch._foreach_add_(same_shape, directions, alpha=-lr * 0.2 * cols ** 0.5)

    def _adamw_step(self, group, params):
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        for p in params:
            state = self.state[p]
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            state["step"] += 1
            step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(p.grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            # Both start at 0, biased to it for ~1/(1 - beta) steps: divided out.
            denominator = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(eps)
            p.mul_(1 - lr * group["weight_decay"])
            p.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))


# === plumbing: config checks, GPU peak FLOP/s

def check_config(cfg):
    for name in ("vocab_size", "n_embd", "n_layer", "block_size", "n_head", "n_kv_head",
                 "ffn_multiple_of"):
        value, most = getattr(cfg, name), 2**10 if name == "n_layer" else 2**21
        if type(value) is not int or not 0 < value <= most:  # more: slow failures, OOM
            raise ValueError(f"{name}={value!r}: must be a positive integer, at most {most:,}")
    heads = f"n_embd={cfg.n_embd}, n_head={cfg.n_head}, n_kv_head={cfg.n_kv_head}"
    for bad, reason in [  # NaN fails every comparison
        (cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2,
         f"{heads}: n_head must divide n_embd into an even head size (RoPE rotates pairs)"),
        (cfg.n_head % cfg.n_kv_head, f"{heads}: n_kv_head must divide n_head"),
        (not 1 <= cfg.rope_theta < math.inf, f"rope_theta={cfg.rope_theta}: must be finite, >= 1"),
        (not 0 < cfg.norm_eps < 1, f"norm_eps={cfg.norm_eps}: must be in (0, 1)"),
        (not 0 < cfg.ffn_ratio <= 64, f"ffn_ratio={cfg.ffn_ratio}: must be positive, <= 64"),
        (not 0 <= cfg.dropout < 1, f"dropout={cfg.dropout}: a probability, 0 <= dropout < 1")]:
        if bad:
            raise ValueError(reason)


# Dense bf16 TFLOP/s (fp16: V100, T4) from data sheets; the first key in the GPU's name wins.
PEAK_TFLOPS = {"GB200": 2500, "B200": 2250, "GH200": 989, "H200": 989, "H100 PCIe": 756,
               "H100 NVL": 835, "H100": 989, "H800 PCIe": 756, "H800": 989, "A100": 312,
               "A800": 312, "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "A10": 125,
               "A6000": 155, "A5000": 111, "A4000": 77, "A40": 150, "4090": 165, "3090": 71,
               "MI300X": 1307, "MI250X": 383, "V100": 125, "T4": 65}


def peak_flops(device):
    """(peak FLOP/s, label): None on a CPU; an unknown GPU counts as an A100, and says so."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"n/a on {device.type}"
    name = torch.cuda.get_device_name(device)
    tflops = next((tflops for key, tflops in PEAK_TFLOPS.items() if key in name), None)
    if tflops is None:
        return 312e12, f"{name} is not in the table: assuming an A100's 312 TFLOP/s"
    return tflops * 1e12, f"{name}: {tflops} TFLOP/s peak"


def c_compiler():  # torch.compile's Triton kernels need one on a GPU: slim images (Docker) lack it
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


# === plumbing: checkpoints and their tokenizer

CHECKPOINT_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint that can't be used: one line, why and what to do."""


def save_checkpoint(path, checkpoint):
    """Write it via a temp file, less torch.compile's "_orig_mod." and DDP's "module." prefixes."""
    checkpoint = {"version": CHECKPOINT_VERSION, **checkpoint}
    checkpoint["model"] = {re.sub(r"^(_orig_mod\.|module\.)+", "", key): value
                           for key, value in checkpoint["model"].items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temp_path = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temp_path, "wb") as file:
            try:
                torch.save(checkpoint, file)
            except RuntimeError as err:  # torch's zip writer wraps a failed write's OSError
                if isinstance(err.__context__, OSError):
                    raise err.__context__ from None
                raise
        os.replace(temp_path, path)
    finally:
        if os.path.exists(temp_path):
            os.remove(temp_path)


def load_checkpoint(path, map_location="cpu"):
    """Read a save_checkpoint file, weights_only (running no code); else CheckpointError."""
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}: train one with train.py, or fix --out_dir")
    refused = CheckpointError(f"{path} is not a plain-data checkpoint, refused: its Python "
                              "objects could run code")
    with open(path, "rb") as f:
        if f.read(1) == b"\x80":  # a bare pickle's first opcode; torch.save writes a zip
            raise refused
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # a damaged file fails in many places
        if "unsupported global" in str(err).lower():  # a class or function: weights_only refuses it
            raise refused from None
        raise CheckpointError(f"{path} is truncated or corrupt ({type(err).__name__}): "
                              "use an earlier ckpt_<iter>.pt or train again") from None
    if not isinstance(checkpoint, dict) or {"version", "model", "model_config"} - checkpoint.keys():
        raise CheckpointError(f"{path} is not a lilLM checkpoint (version, model, model_config)")
    version = checkpoint["version"]
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is a version {version} checkpoint; this model.py reads "
                              f"version {CHECKPOINT_VERSION}: use the lilLM version that wrote it")
    return checkpoint


def one_line(error):  # load_state_dict's first line is a header
    return f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"


def model_from_checkpoint(checkpoint):
    """The GPT a checkpoint describes, with its weights; CheckpointError if they don't fit."""
    try:
        settings = dict(checkpoint["model_config"])
        for retired in ("max_batch_size", "ffn_hidden"):
            settings.pop(retired, None)
        model = GPT(GPTConfig(**settings))
        model.load_state_dict(checkpoint["model"])
    except (TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"the model does not fit this model.py: {one_line(err)}") from None
    diverged = [name for name, param in model.named_parameters() if not param.isfinite().all()]
    if diverged:
        raise CheckpointError(f"{diverged[0]} holds inf or NaN: use an earlier ckpt_<iter>.pt")
    return model


class CharTokenizer:
    """One id per character, with the tiktoken.Encoding methods the scripts use."""
    special_tokens_set = frozenset()  # no <|endoftext|>: a char-level dataset is one text

    def __init__(self, chars):
        self.chars, self.n_vocab = chars, len(chars)
        self.ids = {char: token_id for token_id, char in enumerate(chars)}

    def encode(self, text, allowed_special=()):
        missing = sorted(set(text) - self.ids.keys())
        if missing:
            shown = " ".join(map(repr, missing[:20])) + " ..." * (len(missing) > 20)
            raise ValueError(f"{len(missing)} character(s) the model's vocabulary lacks: {shown}")
        return [self.ids[char] for char in text]

    def decode_single_token_bytes(self, token_id):
        return self.chars[token_id].encode("utf-8")


def tokenizer_problem(ranks, special_tokens):
    """Why BPE ranks (token bytes -> id) and special tokens (name -> id) can't be a tokenizer, or None."""
    size = len(ranks)
    if sorted(ranks.values()) != list(range(size)):
        return f"its ranks are not 0..{size - 1}, each exactly once"
    if sorted(token for token, rank in ranks.items() if rank < 256) != [bytes([b]) for b in range(256)]:
        return "its ranks 0-255 are not the 256 single bytes"
    for name, token_id in special_tokens.items():
        if type(token_id) is not int or token_id < size:
            return f"special token {name!r} has id {token_id!r}; special tokens take the ids from {size} up"
    return None


def encoding_from_checkpoint(checkpoint):
    """A checkpoint's tokenizer: a tiktoken.Encoding (our BPE, or a tiktoken name) or a
    CharTokenizer; CheckpointError if it can't be one or outgrows the model's vocab."""
    import tiktoken  # here: training needs only the model

    tokenizer = checkpoint.get("tokenizer")
    kind = tokenizer.get("kind") if isinstance(tokenizer, dict) else None
    if kind not in ("bpe", "tiktoken", "char"):
        raise CheckpointError(f"the checkpoint records no tokenizer (its 'tokenizer' entry is "
                              f"{str(tokenizer)[:80]}): it was not written by train.py")
    if kind == "char":
        chars = tokenizer.get("chars")
        if type(chars) is not list or not all(type(char) is str for char in chars):
            raise CheckpointError("the checkpoint's char-level tokenizer has no list of characters")
        encoding = CharTokenizer(chars)
    elif kind == "tiktoken":
        name = tokenizer.get("name")
        try:
            encoding = tiktoken.get_encoding(name)
        except Exception as err:  # an unknown name, or no internet for the first download
            raise CheckpointError(f"can't load the tiktoken encoding {name!r} ({one_line(err)}); "
                                  "it is downloaded once, then cached") from None
    else:
        try:
            lines = [line.split() for line in tokenizer["ranks"].splitlines() if line.strip()]
            ranks = {base64.b64decode(token, validate=True): int(rank) for token, rank in lines}
            special_tokens = tokenizer.get("special_tokens", {})
            # Checked first: bad ranks panic tiktoken's Rust core, in 80 lines.
            problem = tokenizer_problem(ranks, special_tokens)
            if problem is None:
                encoding = tiktoken.Encoding("lillm", pat_str=tokenizer["pattern"],
                                             mergeable_ranks=ranks, special_tokens=special_tokens)
        except Exception as err:  # a missing key, a bad line or pattern: not train.py's
            problem = one_line(err)
        if problem:
            raise CheckpointError(f"the BPE tokenizer is malformed: {problem}")
    model_config = checkpoint.get("model_config")
    vocab_size = model_config.get("vocab_size") if isinstance(model_config, dict) else None
    if type(vocab_size) is int and encoding.n_vocab > vocab_size:
        raise CheckpointError(f"the checkpoint's tokenizer has {encoding.n_vocab} ids, more than "
                              f"its model's vocab_size={vocab_size}")
    return encoding


def bytes_of_id(encoding, token_id):
    """A token's bytes; b"" for an id it lacks (padding, cl100k's gaps: sampling can draw one)."""
    try:
        return encoding.decode_single_token_bytes(token_id)
    except (KeyError, IndexError):
        return b""
