"""Plain single-device GPT model; parallelism and FP8 are applied from outside (see launcher/)."""

from model.attention import (AttentionConfig, attention_settings, build_attention, resolve_backend,
                             sdpa_attention)
from model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "AttentionConfig", "attention_settings", "build_attention", "resolve_backend", "sdpa_attention"]
