"""Monitors on crafted weights and inputs with known answers (CPU, reference attention)."""

import contextlib
import math

import pytest
import torch

from launcher.config import Config
from launcher.monitors import tags
from launcher.monitors.monitors import Monitors
from launcher.parallel.dims import ParallelDims
from kernels.modes import tie_tile_keys
from launcher.monitors.attention_stats import head_stats, layer_stats, scores, tie_band, tile_ties
from launcher.monitors.spectral import SpectralTracker, power_iteration, top_singular_exact
from model import GPT, GPTConfig, build_attention


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------------------------
# Spectral norms


def _with_singular_values(m, n, values, generator):
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=generator))
    s = torch.zeros(m, n)
    s[range(len(values)), range(len(values))] = torch.tensor(values)
    return u @ s @ v.T


@pytest.mark.parametrize("shape", [(96, 96), (256, 64), (64, 256), (16, 64)])
def test_first_call_is_within_one_percent_on_random_matrices(shape):
    # Gaussian matrices are the hard case for power iteration (no spectral gap): the first call must still be exact.
    g = torch.Generator().manual_seed(0)
    mats = 0.02 * torch.randn(5, *shape, generator=g)
    sigma = SpectralTracker(iterations=3)("w", mats)
    ref = torch.linalg.matrix_norm(mats, ord=2)
    assert torch.allclose(sigma, ref, rtol=1e-3)


def test_power_iteration_converges_on_known_singular_values():
    g = torch.Generator().manual_seed(1)
    w = _with_singular_values(64, 48, [5.0, 3.0, 2.0, 1.0], g).unsqueeze(0)
    v0 = torch.randn(1, 48, generator=g)
    sigma, _ = power_iteration(w, v0, iterations=8)
    assert abs(sigma.item() - 5.0) / 5.0 < 0.01
    exact, _ = top_singular_exact(w)
    assert exact.item() == pytest.approx(5.0, rel=1e-5)


def test_tracker_follows_training_within_one_percent():
    # A few iterations per call suffice because the vectors persist; checked along a real AdamW trajectory at a
    # learning rate high enough that the weights change a lot between calls.
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, max_seq_len=32, n_layer=2, n_head=4, d_model=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    tracker = SpectralTracker(iterations=3)
    worst = 0.0
    for step in range(1, 61):
        x = (torch.randint(0, 32, (8, 33)) * 3) % 128
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1 or step % 10 == 0:
            with torch.no_grad():
                wq = torch.stack([b.attn.q_proj.weight for b in model.blocks])
                fc = torch.stack([b.mlp.fc_out.weight for b in model.blocks])
                for name, mats in (("wq", wq), ("heads", wq.reshape(-1, 16, 64)), ("fc_out", fc)):
                    ref = torch.linalg.matrix_norm(mats, ord=2)
                    worst = max(worst, ((tracker(name, mats) - ref).abs() / ref).max().item())
    assert worst < 0.01


def test_tracker_state_round_trip():
    g = torch.Generator().manual_seed(2)
    mats = torch.randn(3, 20, 30, generator=g)
    a = SpectralTracker(iterations=2)
    a("w", mats)
    b = SpectralTracker(iterations=2)
    b.load_state_dict(a.state_dict())
    mats2 = mats + 0.1 * torch.randn(3, 20, 30, generator=g)
    assert torch.equal(a("w", mats2), b("w", mats2))


# ---------------------------------------------------------------------------------------------------------------
# Attention diagnostics


def test_head_stats_on_crafted_scores():
    inf = float("-inf")
    s = torch.tensor([[0.7, inf, inf, inf],          # one key: no tie, entropy 0
                      [2.0, 2.0, inf, inf],          # exact tie: entropy ln 2
                      [1.0, 3.0, 3.0 - 5e-4, inf],   # tie within eps
                      [0.0, 0.0, 1.0, 5.0]])         # single maximum
    per_head = head_stats(s.view(1, 1, 4, 4), eps=1e-3)
    assert per_head["tie_rate"].item() == pytest.approx(0.5)
    assert per_head["max_logit"].item() == pytest.approx(5.0)
    rows = [torch.tensor([0.7]), torch.tensor([2.0, 2.0]), torch.tensor([1.0, 3.0, 3.0 - 5e-4]),
            torch.tensor([0.0, 0.0, 1.0, 5.0])]
    expected = sum(-(p * p.log()).sum().item() for p in (torch.softmax(r, 0) for r in rows)) / 4
    assert per_head["entropy"].item() == pytest.approx(expected, rel=1e-5)


def test_tie_rate_uses_the_runs_score_precision():
    # Keys 1 and 2 give scores 10.0 and 10.01 for every query: distinct in FP32 (fa2), equal once rounded to BF16
    # (paper: the BF16 ulp at 10 is 1/16), so every row from position 2 on ties under paper and none under fa2.
    hd, t = 4, 6
    q = torch.zeros(1, 1, t, hd)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, t, hd)
    k[0, 0, 1, 0] = 20.0        # score 20 * 1 * (1/sqrt(4)) = 10.0
    k[0, 0, 2, 0] = 20.02       # 10.01
    per_head_paper = head_stats(scores(q, k, "paper"), eps=1e-3)
    per_head_fa2 = head_stats(scores(q, k, "fa2"), eps=1e-3)
    assert per_head_paper["tie_rate"].item() == pytest.approx(4 / 6)  # rows 2..5
    assert per_head_fa2["tie_rate"].item() == 0.0
    assert per_head_fa2["max_logit"].item() == pytest.approx(10.01, rel=1e-6)
    assert per_head_paper["max_logit"].item() == 10.0


def test_layer_stats_aggregate_heads():
    per_head = {"tie_rate": torch.tensor([0.0, 0.5]), "tile_tie_rate": torch.tensor([0.0, 0.25]),
                "max_logit": torch.tensor([3.0, 7.0]), "entropy": torch.tensor([1.0, 2.0])}
    agg = layer_stats(per_head)
    assert (agg["tie_rate"].item(), agg["max_logit"].item(), agg["entropy"].item()) == (0.25, 7.0, 1.5)
    assert agg["tile_tie_rate"].item() == 0.125


def test_tile_tie_rate_on_hand_built_rows():
    """8 keys in tiles of 4: a tie inside one tile counts, one across tiles does not (but does for the whole row);
    a gap of 1.5e-3 is outside eps = 1e-3 but inside the safe fix's band 2^-8."""
    lo = -5.0
    rows = torch.full((4, 8), lo)
    rows[0, [1, 2]] = 3.0                 # exact tie inside tile 0
    rows[1, [2, 5]] = 3.0                 # exact tie across tiles 0 and 1
    rows[2, [4, 6]] = torch.tensor([3.0, 3.0 - 1.5e-3])  # inside tile 1, outside eps, inside the band
    rows[3, [6, 7]] = torch.tensor([3.0, 3.0 - 0.01])  # inside tile 1, outside the band
    s = rows.view(1, 1, 4, 8)
    assert tile_ties(s, tie_band(1e-3), 4).view(-1).tolist() == [True, False, True, False]
    assert tile_ties(s, tie_band(1e-3), 0).view(-1).tolist() == [True, True, True, False]
    assert tile_ties(s, 1e-3, 4).view(-1).tolist() == [True, False, False, False]
    stats = head_stats(s, eps=1e-3, tile=4)
    assert stats["tie_rate"].item() == 0.5 and stats["tile_tie_rate"].item() == 0.5
    assert tile_ties(s[..., :7], tie_band(1e-3), 4).view(-1).tolist() == [True, False, True, False]  # ragged


def test_tie_tile_follows_the_runs_numerics():
    assert tie_tile_keys("fa2") == 64 and tie_tile_keys("paper") == 512
    assert tie_tile_keys("paper", 512) == 512 and tie_tile_keys("paper", 0) == 0 and tie_tile_keys("fa2", 512) == 64


# ---------------------------------------------------------------------------------------------------------------
# Tags


def test_tag_names_and_parse():
    assert tags.spectral(1, "wq") == "spectral/L01/wq"
    assert tags.spectral(1, "wq", 8) == "spectral/L01/wq/h08"
    assert tags.act(1, "x_rms") == "act/L01/x_rms"
    assert tags.attn(1, "tie_rate") == "attn/L01/tie_rate"
    assert tags.attn(1, "tie_rate", 8) == "attn/L01/h08/tie_rate"
    assert tags.delta_bias(1, "cum", 8) == "delta_bias/L01/h08/cum"
    assert tags.delta_bias(1, "dwq_cos") == "delta_bias/L01/dwq_cos"
    assert tags.parse("spectral/L11/fc_in") == tags.Tag("spectral", 11, None, "fc_in")
    assert tags.parse("spectral/L01/wk/h03") == tags.Tag("spectral", 1, 3, "wk")
    assert tags.parse("delta_bias/L01/h08/cum") == tags.Tag("delta_bias", 1, 8, "cum")
    assert tags.parse("train/loss") is None
    with pytest.raises(ValueError):
        tags.spectral(0, "fc_in", 1)


# ---------------------------------------------------------------------------------------------------------------
# The Monitors object as the trainer uses it


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))


def _setup(spectral_interval=2, probe_interval=2, delta_layers=None, rounding="paper", fix="none", seed=0):
    config = Config()
    config.model = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=32)
    config.attention.rounding, config.attention.fix, config.attention.backend = rounding, fix, "reference"
    config.monitor.spectral_interval, config.monitor.probe_interval = spectral_interval, probe_interval
    config.monitor.delta_bias_layers = delta_layers
    torch.manual_seed(seed)
    model = GPT(config.model, build_attention(config.attention, torch.device("cpu")))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 33), generator=g)
    return config, model, (tokens[:, :-1], tokens[:, 1:])


def _expected_tags(config, with_delta_cos):
    L, H = config.model.n_layer, config.model.n_head
    names = {tags.SPECTRAL_SECONDS, tags.PROBE_SECONDS, tags.DELTA_BIAS_SECONDS}
    for i in range(L):
        names |= {tags.spectral(i, w) for w in tags.WEIGHTS}
        names |= {tags.spectral(i, w, h) for w in tags.PER_HEAD_WEIGHTS for h in range(H)}
        names |= {tags.act(i, s) for s in tags.ACT_STATS}
        names |= {tags.attn(i, s) for s in tags.ATTN_STATS} | {tags.attn(i, s, h) for s in tags.ATTN_STATS
                                                                for h in range(H)}
        stats = tags.DELTA_STATS if with_delta_cos else ("sum", "cum")
        names |= {tags.delta_bias(i, s) for s in stats} | {tags.delta_bias(i, s, h) for s in stats for h in range(H)}
        names |= {tags.qk_act(i, "entropy")} | {tags.qk_act(i, "entropy", h) for h in range(H)}
        if with_delta_cos:  # a second call: the Q-K update since the first one
            names |= {tags.qk_update(i, s) for s in tags.QK_UPDATE_STATS}
            names |= {tags.qk_update(i, s, h) for s in tags.QK_UPDATE_STATS for h in range(H)}
    if with_delta_cos:
        names.add(tags.QK_UPDATE_SECONDS)
    if config.monitor.warning_layer < config.model.n_layer:  # the early warning (warning.py) logs its flag
        names.add(tags.WARNING)
    return names


def test_monitors_log_every_tag_and_leave_the_model_untouched():
    config, model, batch = _setup()
    model.blocks[0].attn.q_proj.weight.grad = torch.full_like(model.blocks[0].attn.q_proj.weight, 7.0)
    writer = _Writer()
    monitors = Monitors(config, model, batch, writer, contextlib.nullcontext, "reference")
    for training in (True, False):
        model.train(training)
        values = monitors.after_step(1)
        assert model.training is training
    assert set(values) == _expected_tags(config, with_delta_cos=True)
    # the weights did not move between the two calls: a zero Q-K update has no spectrum (NaN), only a zero norm
    spectrum = {t for t in values if t.startswith("qk_update/") and "norm" not in t}
    assert all(math.isnan(values[t]) for t in spectrum)
    assert all(values[t] == 0 for t in values if t.startswith("qk_update/") and "norm" in t)
    assert all(math.isfinite(v) for t, v in values.items() if t not in spectrum)
    # parameter gradients untouched, attention and forward hooks removed
    assert torch.all(model.blocks[0].attn.q_proj.weight.grad == 7.0)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "blocks.0.attn.q_proj.weight")
    assert all(b.attn.attention_hook is None and not b.attn.q_proj._forward_pre_hooks for b in model.blocks)
    assert {s for _, _, s in writer.scalars} == {1}
    assert monitors.after_step(3) == {}
    assert monitors.last_values() == values and monitors.overhead_s > 0


def test_monitor_values_on_crafted_weights():
    config, model, batch = _setup()
    d, hd = 32, 16
    with torch.no_grad():
        # head h of W_Q reads its own columns with gain c_h: per-head norms c_h, whole-matrix norm max(c_h)
        wq = torch.zeros(d, d)
        wq[:hd, :hd] = 0.5 * torch.eye(hd)
        wq[hd:, hd:2 * hd] = 2.0 * torch.eye(hd)
        model.blocks[1].attn.q_proj.weight.copy_(wq)
        g = torch.Generator().manual_seed(3)
        model.blocks[1].mlp.fc_in.weight.copy_(_with_singular_values(4 * d, d, [3.0, 1.0, 0.5], g))
    values = Monitors(config, model, batch, _Writer(), contextlib.nullcontext, "reference").after_step(1)
    assert values["spectral/L01/wq/h00"] == pytest.approx(0.5, rel=1e-4)
    assert values["spectral/L01/wq/h01"] == pytest.approx(2.0, rel=1e-4)
    assert values["spectral/L01/wq"] == pytest.approx(2.0, rel=1e-4)
    assert values["spectral/L01/fc_in"] == pytest.approx(3.0, rel=1e-4)
    # W_K of layer 0 is compared with the exact norm
    exact = torch.linalg.matrix_norm(model.blocks[0].attn.k_proj.weight.detach(), ord=2).item()
    assert values["spectral/L00/wk"] == pytest.approx(exact, rel=1e-3)
    # layer 0's attention input X = ln1(token + position embeddings), recomputed by hand
    with torch.no_grad():
        inputs = batch[0]
        x = model.blocks[0].ln1(model.tok_emb(inputs) + model.pos_emb(torch.arange(inputs.shape[1])))
        x = x.flatten(0, 1)
    assert values["act/L00/x_rms"] == pytest.approx(x.pow(2).mean().sqrt().item(), rel=1e-5)
    assert values["act/L00/x_sv"] == pytest.approx(torch.linalg.matrix_norm(x, ord=2).item() / x.shape[0] ** 0.5,
                                                   rel=1e-3)


def test_intervals_and_disabled_parts():
    config, model, batch = _setup(spectral_interval=0, probe_interval=0)
    monitors = Monitors(config, model, batch, _Writer(), contextlib.nullcontext, "reference")
    assert all(monitors.after_step(s) == {} for s in (1, 2, 100)) and monitors.overhead_s == 0.0
    config, model, batch = _setup(spectral_interval=5, probe_interval=0)
    monitors = Monitors(config, model, batch, _Writer(), contextlib.nullcontext, "reference")
    assert [bool(monitors.after_step(s)) for s in range(1, 11)] == [True] + [False] * 3 + [True] + [False] * 4 + [True]
    config, model, batch = _setup(spectral_interval=0, probe_interval=3, delta_layers=[])
    values = Monitors(config, model, batch, _Writer(), contextlib.nullcontext, "reference").after_step(3)
    assert values and not any(t.startswith("delta_bias/") for t in values)
    # a data-parallel replica other than the logging rank's computes nothing
    replica = ParallelDims(world_size=2, rank=1)
    assert Monitors(config, model, batch, None, contextlib.nullcontext, "reference", replica).after_step(3) == {}


def test_delta_bias_recomputes_o_with_the_runs_attention_settings(monkeypatch):
    """The delta-bias monitor recomputes O with the model's own attention settings object, launch options included.
    It used to copy 8 attention fields by hand and leave out autotune and deterministic, so with
    attention.autotune=false the GPU monitor recomputed O with autotuned tiles the run never used."""
    import kernels

    config, _, batch = _setup(delta_layers=[0])
    config.attention.autotune, config.attention.deterministic = False, False
    model = GPT(config.model, build_attention(config.attention, torch.device("cpu")))
    seen, real = [], kernels.saved_output

    def spy(q, k, v, settings=None, *, noise_keys=None, **named):
        seen.append((settings, named))
        return real(q, k, v, settings, noise_keys=noise_keys, **named)

    monkeypatch.setattr(kernels, "saved_output", spy)
    Monitors(config, model, batch, _Writer(), contextlib.nullcontext, "reference").after_step(1)
    assert seen
    for settings, named in seen:  # what the kernels would run: the settings given, else the named fields' defaults
        autotune = named.get("autotune", True) if settings is None else settings.autotune
        deterministic = named.get("deterministic", True) if settings is None else settings.deterministic
        assert (autotune, deterministic) == (False, False)
        assert settings is model.blocks[0].attn.attention_fn.settings and not named


def test_state_dict_resume_continues_identically():
    def train_step(model, seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=g))

    config, model_a, batch = _setup(delta_layers=[1])
    monitors_a = Monitors(config, model_a, batch, _Writer(), contextlib.nullcontext, "reference")
    monitors_a.after_step(1)
    train_step(model_a, 1)
    monitors_a.after_step(2)
    state = monitors_a.state_dict()
    _, model_b, _ = _setup(delta_layers=[1])
    model_b.load_state_dict(model_a.state_dict())
    monitors_b = Monitors(config, model_b, batch, _Writer(), contextlib.nullcontext, "reference")
    monitors_b.load_state_dict(state)
    for model in (model_a, model_b):
        train_step(model, 2)
    a, b = monitors_a.after_step(4), monitors_b.after_step(4)
    assert "delta_bias/L01/dwq_cos" in a and "delta_bias/L01/cum" in a
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("monitor/")}  # noqa: E731 - timings differ
    assert strip(a) == strip(b)
