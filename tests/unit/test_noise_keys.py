"""Row keys for the attention's random bits (delta_sign=random, fix=stochastic_output): where they come from, how they
reach the attention, and that runs without random bits are untouched (one process, CPU)."""

import numpy as np
import pytest
import torch

from kernels.rounding import layer_keys, row_keys
from launcher.checkpoint import read_whole_checkpoint
from launcher.config import load_config
from launcher.data import BatchSchedule
from launcher.parallel.dims import ParallelDims
from launcher.parallelize import checkpointed
from launcher.trainer import train_arm
from model import GPT, GPTConfig
from model.attention import AttentionConfig, build_attention, noise_keys
from tests.runs import scalars

KEYED = {"random": AttentionConfig(backend="reference", delta_gain=20.0, delta_sign="random"),
         "sr": AttentionConfig(backend="reference", fix="stochastic_output")}


class _Data:  # what BatchSchedule reads of TokenData
    train = np.arange(10_000, dtype=np.uint16)


@pytest.mark.parametrize("dp, mb", [(2, 2), (2, 1), (4, 2), (1, 8)])
def test_row_keys_follow_the_window_not_the_layout(dp, mb):
    """Every window of a step gets the same key whether the batch is split over 1, 2 or 4 data-parallel ranks and
    micro-batches of 1, 2 or 8: the key is a function of the window's index in the step's offsets."""
    def keys_by_offset(dp, mb):
        out = {}
        for rank in range(dp):
            schedule = BatchSchedule(_Data(), 5, 16, 8, mb, rank, dp)
            for (x, _), rows in zip(schedule.micro_batches(3), schedule.global_rows()):
                assert torch.equal(x[:, 0], torch.from_numpy(schedule.offsets(3)[rows.numpy()]).long())
                out.update(zip(rows.tolist(), row_keys(5, 3, rows).tolist()))
        return out

    single = keys_by_offset(1, 2)
    assert sorted(single) == list(range(8)) and len(set(single.values())) == 8
    assert keys_by_offset(dp, mb) == single


def test_no_keys_means_key_zero_and_rows_are_identified_by_their_keys(seed):
    q, k, v = (torch.randn(3, 2, 64, 16) for _ in range(3))
    keys = row_keys(1, 0, torch.arange(3))
    for config in KEYED.values():
        fn = build_attention(config, torch.device("cpu"))
        zeros = torch.zeros(3, dtype=torch.int64)
        assert torch.equal(fn(q, k, v, layer=1), fn(q, k, v, layer=1, row_keys=zeros))
        # a sub-batch with its rows' keys computes what the whole batch does for them (layouts split batches)
        assert torch.equal(fn(q[1:], k[1:], v[1:], layer=1, row_keys=keys[1:]),
                           fn(q, k, v, layer=1, row_keys=keys)[1:])
    sr = build_attention(KEYED["sr"], torch.device("cpu"))
    assert not torch.equal(sr(q, k, v, layer=0, row_keys=keys), sr(q, k, v, layer=1, row_keys=keys))  # layer mixed in
    assert torch.equal(noise_keys(keys, 1, 3, q.device), layer_keys(keys, 1))
    with pytest.raises(ValueError, match="one key per batch row"):
        sr(q, k, v, row_keys=keys[:2])


def test_plain_configs_build_todays_callable():
    """delta_gain=1.0 / delta_sign=kept give the kernel the mode's own settings (no stress, no keys); sdpa takes (and
    ignores) the keywords."""
    from kernels.modes import AttentionSettings

    plain = build_attention(AttentionConfig(backend="reference", delta_gain=1.0), torch.device("cpu"))
    assert not plain.keyed and not plain.settings.amplified
    assert plain.settings == AttentionSettings(backend="reference")
    assert not AttentionConfig().needs_noise_keys
    assert AttentionConfig(delta_sign="random").needs_noise_keys and AttentionConfig(fix="stochastic_output").needs_noise_keys
    q = torch.randn(1, 2, 8, 16)
    sdpa = build_attention(AttentionConfig(backend="sdpa"), torch.device("cpu"))
    assert torch.equal(sdpa(q, q, q, layer=3, row_keys=torch.ones(1, dtype=torch.int64)), sdpa(q, q, q))


def _tiny_gpt(attention: AttentionConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, max_seq_len=64, n_layer=2, n_head=2, d_model=32),
               build_attention(attention, torch.device("cpu")))


@pytest.mark.parametrize("variant", list(KEYED))
def test_checkpointed_blocks_recompute_with_the_same_keys(variant):
    """Keys are an argument of each block, so activation checkpointing replays the forward with the same random
    bits: identical loss and gradients."""
    idx = torch.randint(0, 64, (2, 64))
    keys = row_keys(3, 7, torch.arange(2))

    def gradients(checkpointing, keys):
        model = _tiny_gpt(KEYED[variant])
        if checkpointing:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = checkpointed(block)
        _, loss = model(idx, idx, row_keys=keys)
        loss.backward()
        return [p.grad for p in model.parameters()]

    plain = gradients(False, keys)
    assert all(torch.equal(a, b) for a, b in zip(plain, gradients(True, keys)))
    assert not all(torch.equal(a, b) for a, b in zip(plain, gradients(False, keys + 1)))  # the keys do matter


def test_keys_trace_under_torch_compile():
    """The keyed model compiles (dynamo; the eager backend keeps the test fast): keys are tensors, no graph breaks
    needed by the plumbing, same loss as eager."""
    model = _tiny_gpt(KEYED["random"])
    idx = torch.randint(0, 64, (2, 64))
    keys = row_keys(3, 7, torch.arange(2))
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(compiled(idx, idx, keys)[1], model(idx, idx, row_keys=keys)[1])


def test_delta_gain_one_trains_bit_identically(tiny_overrides):
    """attention.delta_gain=1.0 (and delta_sign=kept) is the mode's own numerics: same losses and final weights as
    no override, bit for bit."""
    runs = {}
    for name, extra in (("plain", []), ("gain1", ["attention.delta_gain=1.0", "attention.delta_sign=kept"])):
        config = load_config("smoke", tiny_overrides + [f"run.experiment={name}", "attention.backend=reference"] + extra,
                             arm="fixed")
        runs[name] = train_arm(config, ParallelDims()).run_dir
    assert scalars(runs["plain"], "train/loss") == scalars(runs["gain1"], "train/loss") != {}
    weights = [read_whole_checkpoint(runs[n] / "checkpoints" / "step_00000006")["model"] for n in ("plain", "gain1")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
