"""The GPT model: shapes, initialisation, tied embeddings, initial loss, and the attention plug."""

import math

import pytest
import torch

from model import GPT, AttentionConfig, GPTConfig, build_attention


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 512, "max_seq_len": 32, "n_layer": 2, "n_head": 2, "d_model": 64, **kw})


def test_shapes_and_tied_embeddings():
    model = GPT(tiny())
    idx = torch.randint(0, 512, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 512) and loss is None
    assert model.lm_head.weight is model.tok_emb.weight


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(tiny(vocab_size=2048))
    idx = torch.randint(0, 2048, (4, 32))
    _, loss = model(idx, torch.randint(0, 2048, (4, 32)))
    assert abs(loss.item() - math.log(2048)) < 0.1


def test_residual_projections_use_scaled_init():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=8, d_model=256, n_head=4))
    std = model.blocks[0].attn.out_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 0.001


def test_parameter_count_and_flops():
    c = tiny()
    model = GPT(c)
    per_block = 4 * 64 * 64 + 2 * 4 * 64 * 64 + 2 * 64  # attention, MLP, two LayerNorm gains
    expected = 512 * 64 + c.n_layer * per_block + 64  # tied embedding, blocks, final LayerNorm
    assert model.num_parameters() == expected
    assert model.flops_per_token(32) == 6 * expected + 12 * 2 * 64 * 32


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))


def test_attention_is_pluggable_and_the_attention_hook_sees_every_layer():
    seen = []

    def hook(layer, q, k, v, o):
        seen.append((layer, tuple(q.shape)))
        return o

    model = GPT(tiny())
    for block in model.blocks:
        block.attn.attention_hook = hook
    model(torch.randint(0, 512, (2, 8)))
    assert seen == [(0, (2, 2, 8, 32)), (1, (2, 2, 8, 32))]


def test_reference_attention_in_the_model_matches_sdpa_for_fa2_numerics():
    """On fp32 inputs the reference emulates BF16 autocast, so it agrees with fp32 SDPA to BF16 accuracy."""
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 512, (2, 32))
    ref_logits, _ = model(idx)
    model.set_attention(build_attention(AttentionConfig(backend="reference"), torch.device("cpu")))
    emu_logits, _ = model(idx)
    assert not torch.equal(ref_logits, emu_logits)  # the emulated rounding is really applied
    torch.testing.assert_close(emu_logits, ref_logits, atol=2e-2, rtol=2e-2)
