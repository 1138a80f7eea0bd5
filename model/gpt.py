"""GPT-2 family language model in plain single-device PyTorch.

The layout follows the paper's setup (Qiu & Yao, arXiv 2510.04212): pre-LayerNorm blocks, learned positions,
tied input/output embeddings, a GELU MLP, optional biases and GPT-2 initialisation with scaled residual
projections. Nothing here knows about process groups, FP8 or the training loop: tensor/pipeline parallelism and
FP8 are applied from outside (launcher/), by swapping or wrapping the named submodules below.

With a seed, initialisation is a pure function of (seed, parameter name) (:func:`initial_value`): each parameter
draws from its own generator, so any process can produce any parameter, or only the parameters it holds, without
building the rest. Built under ``torch.device("meta")`` the model has no storage and is not initialised; the
launcher then materialises each rank's slice of it (launcher/parallelize.py).

Module names are part of the contract with the monitors, the checkpoints and the code that applies a layout
(launcher/parallelize.py: tensor parallelism, FP8, activation checkpointing, the pipeline's stages):
``blocks.{i}.attn.{q_proj,k_proj,v_proj,out_proj}`` and ``blocks.{i}.mlp.{fc_in,fc_out}``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionFn, sdpa_attention

# An attention hook sees one attention call (layer index, q, k, v, o) and returns o, possibly with autograd hooks
# attached; the monitors use it to capture attention inputs and output gradients on their probe batch.
AttentionHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GPTConfig:
    """Shape of the network. Defaults are GPT-2 small as trained in the paper."""

    vocab_size: int = 50304
    """Number of token ids the embedding holds. 0 means: take it from the prepared data's meta.json."""
    max_seq_len: int = 1024
    """Number of learned position embeddings, i.e. the longest sequence the model accepts."""
    n_layer: int = 12
    """Number of transformer blocks."""
    n_head: int = 12
    """Number of attention heads per block; must divide d_model."""
    d_model: int = 768
    """Width of the residual stream."""
    ffn_mult: int = 4
    """FFN hidden width as a multiple of d_model (GPT-2: 4)."""
    bias: bool = False
    """Whether linear layers and LayerNorms carry biases (the paper trains without)."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention output and MLP output (0 in the paper)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation; residual projections use init_std / sqrt(2 n_layer)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V projections, computed as one matrix product.

    Separate projections (instead of one fused QKV matrix) keep W_Q addressable on its own: the paper's failure
    shows up first in W_Q's spectral norm, and per-head blocks of W_Q are rows [h*hd, (h+1)*hd) of q_proj.weight.
    The forward concatenates the three weights and multiplies once, which is cheaper than three products (measured:
    docs/results.md, "Training speed"). The projections only need ``weight``, ``bias`` and ``out_features``, so
    tensor parallelism's column-parallel shards fuse the same way (each rank: its own heads of q, k and v).
    ``fused_qkv = False`` calls the three projection modules instead (DeepSpeed ZeRO-3 gathers a module's parameters
    only when that module runs).
    """

    def __init__(self, config: GPTConfig, layer_idx: int, attention_fn: AttentionFn):
        super().__init__()
        d = config.d_model
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, d, bias=config.bias)
        self.v_proj = nn.Linear(d, d, bias=config.bias)
        self.out_proj = nn.Linear(d, d, bias=config.bias)
        self.attention_fn = attention_fn
        self.dropout = nn.Dropout(config.dropout)
        self.attention_hook: Optional[AttentionHook] = None
        self.fused_qkv = True

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, hd)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not self.fused_qkv:
            return tuple(p(x) for p in projections)
        weight = torch.cat([p.weight for p in projections])
        bias = None if self.q_proj.bias is None else torch.cat([p.bias for p in projections])
        return F.linear(x, weight, bias).split([p.out_features for p in projections], dim=-1)

    def forward(self, x: torch.Tensor, row_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (self._heads(y) for y in self._qkv(x))
        o = self.attention_fn(q, k, v, layer=self.layer_idx, row_keys=row_keys)
        if self.attention_hook is not None:
            o = self.attention_hook(self.layer_idx, q, k, v, o)
        o = o.transpose(1, 2).reshape(b, t, -1)  # (B, T, heads * hd): d, or this rank's heads under tensor parallelism
        return self.dropout(self.out_proj(o))


class MLP(nn.Module):
    """GELU feed-forward block; fc_in and fc_out are the matrices FP8 is applied to from outside."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        hidden = config.ffn_mult * config.d_model
        self.fc_in = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.fc_out = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)). ``row_keys`` go to the attention (an
    argument, so that an activation-checkpointed block recomputes with the same keys)."""

    def __init__(self, config: GPTConfig, layer_idx: int, attention_fn: AttentionFn):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx, attention_fn)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, row_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), row_keys)
        return x + self.mlp(self.ln2(x))


def parameter_seed(seed: int, name: str) -> int:
    """The seed of one parameter's generator: a hash of the model's seed and the parameter's name (stable across
    processes and Python versions, unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def initial_value(config: GPTConfig, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial FP32 value (on the CPU) of the single-device model's parameter ``name`` of shape ``shape``:
    GPT-2 initialisation, normal(0, init_std) for embeddings and linear weights, init_std / sqrt(2 n_layer) for the
    residual projections (attn.out_proj, mlp.fc_out) so that the residual stream's variance stays O(1); LayerNorm
    gains 1, biases 0. Drawn from a generator of its own (:func:`parameter_seed`)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros(shape)
    if name.startswith("ln_f.") or ".ln1." in name or ".ln2." in name:
        return torch.ones(shape)
    std = config.init_std
    if name.endswith(("attn.out_proj.weight", "mlp.fc_out.weight")):
        std /= math.sqrt(2 * config.n_layer)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in FP32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx, targets, row_keys)`` returns (logits, mean cross-entropy or None).

    ``row_keys`` (optional int64 (batch,)): one key per batch row for the attention's random bits (random delta signs,
    fix=stochastic_output), from ``kernels.rounding.row_keys``; None means key 0 for every row.

    ``loss_fn(logits, targets)`` is an attribute so that a parallel layout can replace it (tensor parallelism
    computes the cross-entropy of vocabulary-split logits without gathering them)."""

    def __init__(self, config: GPTConfig, attention_fn: AttentionFn = sdpa_attention, seed: Optional[int] = None):
        super().__init__()
        if config.vocab_size <= 0:
            raise ValueError("GPTConfig.vocab_size must be set (the launcher fills it from the data's meta.json)")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i, attention_fn) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied embeddings
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_cross_entropy
        self.seed = seed
        if self.tok_emb.weight.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation (:func:`initial_value`). With a seed, every parameter takes :func:`initial_value` of
        its name and the seed (the launcher's way: any process can produce any parameter alone); without one, the
        same distributions are drawn from torch's global generator in module order, as plain PyTorch modules do."""
        if self.seed is not None:
            for name, param in self.named_parameters():  # the tied output weight once, as tok_emb.weight
                param.copy_(initial_value(self.config, name, tuple(param.shape), self.seed))
            return
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                is_residual = name.endswith("attn.out_proj") or name.endswith("mlp.fc_out")
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def set_attention(self, attention_fn: AttentionFn) -> None:
        """Swap the attention implementation of every layer (e.g. Triton kernel on GPU, reference on CPU)."""
        for block in self.blocks:
            block.attn.attention_fn = attention_fn

    def num_parameters(self, exclude_embeddings: bool = True) -> int:
        """Parameter count; position embeddings are excluded by default (they cost no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if exclude_embeddings else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls with weights plus 12 L d T for attention scores/values."""
        c = self.config
        return 6 * self.num_parameters() + 12 * c.n_layer * c.d_model * seq_len

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                row_keys: Optional[torch.Tensor] = None):
        b, t = idx.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x, row_keys)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        # With a loss the logits come back detached: training differentiates the loss only, and a differentiable
        # logits output would make a compiled backward zero-fill a logits-sized gradient every micro-batch (its cost:
        # docs/results.md, "Training speed").
        return logits.detach(), self.loss_fn(logits, targets)
