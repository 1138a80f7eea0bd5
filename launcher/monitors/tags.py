"""TensorBoard tag names of the monitors, in one place so the trainer, the monitors and the comparison agree.

Every tag is a *global* name: layer and head indices are the model's global indices (layer 1 is the second block,
the paper's failing layer; head 8 is rows [8*head_dim, 9*head_dim) of the full W_Q), never a shard's local index.
When tensor or pipeline parallelism shards the model later, each stage/rank adds its layer/head offset and logs the
same names; whole-matrix norms are those of the full (unsharded) matrix. Layer indices are zero-padded to two digits
(``L01``), heads too (``h08``), so tags sort in model order.

Families (see docs/monitoring.md for the meaning of each):

- ``spectral/L01/wq``, ``spectral/L01/wq/h08``   spectral norms of weights (whole and per head for wq, wk)
- ``act/L01/x_rms``, ``act/L01/x_sv``, ``act/L01/o_rms``, ``act/L01/o_sv``   probe-batch activations
- ``attn/L01/tie_rate``, ``attn/L01/h08/tie_rate`` (also tile_tie_rate, max_logit, entropy)   attention
  diagnostics
- ``delta_bias/L01/h08/sum``, ``delta_bias/L01/h08/cum``, ``delta_bias/L01/dwq_cos``   delta-bias monitor
- ``qk_update/L01/h08/entropy`` (also srank, norm; entropy2, srank2, norm2 of the second-order term),
  ``qk_update/L01/entropy``   spectra of the query-key weight-product update between spectral calls (qk_update.py)
- ``qk_act/L01/h08/entropy``, ``qk_act/L01/entropy``   spectral entropy of pre-softmax scores of sub-sampled probe
  tokens (qk_update.py)
- ``monitor/spectral_s``, ``monitor/probe_s``, ``monitor/delta_bias_s``, ``monitor/qk_update_s``   seconds spent
  per monitor call
- ``warning/on``, ``warning/<signal>`` (wq_growth, wq_relative, delta_persistence, qk_update_drop, ...)   the
  early-warning rule and the values of its derived signals (launcher/monitors/warning.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# Weights whose spectral norm is tracked: short name -> module path inside blocks.{i}.
WEIGHTS = {
    "wq": "attn.q_proj",
    "wk": "attn.k_proj",
    "wv": "attn.v_proj",
    "wo": "attn.out_proj",
    "fc_in": "mlp.fc_in",
    "fc_out": "mlp.fc_out",
}
PER_HEAD_WEIGHTS = ("wq", "wk")
ACT_STATS = ("x_rms", "x_sv", "o_rms", "o_sv")
ATTN_STATS = ("tie_rate", "tile_tie_rate", "max_logit", "entropy")
DELTA_STATS = ("sum", "cum", "dwq_cos")
# first-order update term D2 (no suffix) and second-order term D3 (suffix 2): launcher/monitors/qk_update.py
QK_UPDATE_STATS = ("entropy", "srank", "norm", "entropy2", "srank2", "norm2")
QK_ACT_STATS = ("entropy",)

# Tags written by the trainer (launcher/metrics.py); the comparison reads them too.
TRAIN_LOSS = "train/loss"
TRAIN_LR = "train/lr"
TRAIN_GRAD_NORM = "train/grad_norm"
EVAL_LOSS = "eval/loss"
TOKENS_PER_S = "perf/tokens_per_s"
STEP_TIME_S = "perf/step_time_s"
MFU = "perf/mfu"
MAX_MEMORY_GB = "perf/max_memory_gb"
GUARD_BAD_STEPS = "guard/bad_steps"

# Cost of the monitors themselves (seconds of one call of that part).
SPECTRAL_SECONDS = "monitor/spectral_s"
PROBE_SECONDS = "monitor/probe_s"
DELTA_BIAS_SECONDS = "monitor/delta_bias_s"
QK_UPDATE_SECONDS = "monitor/qk_update_s"

# Early warning (launcher/monitors/warning.py): 1 while the rule holds, else 0, at every monitor step of
# monitor.warning_layer; and that layer's largest W_Q head norm over its value monitor.warning_window steps earlier.
WARNING = "warning/on"
WARNING_WQ_GROWTH = "warning/wq_growth"


def warning_signal(signal: str) -> str:
    """The value of one derived signal of the early-warning rule (warning.py: SIGNALS), e.g. warning/qk_update_drop."""
    return f"warning/{signal}"


def layer_key(layer: int) -> str:
    return f"L{layer:02d}"


def head_key(head: int) -> str:
    return f"h{head:02d}"


def spectral(layer: int, weight: str, head: Optional[int] = None) -> str:
    """Spectral norm of a weight of a layer, or of one head's row block (wq, wk only)."""
    if weight not in WEIGHTS:
        raise ValueError(f"unknown weight {weight!r}; one of {', '.join(WEIGHTS)}")
    if head is not None and weight not in PER_HEAD_WEIGHTS:
        raise ValueError(f"per-head spectral norms exist only for {PER_HEAD_WEIGHTS}, not {weight!r}")
    base = f"spectral/{layer_key(layer)}/{weight}"
    return base if head is None else f"{base}/{head_key(head)}"


def act(layer: int, stat: str) -> str:
    """Statistic of the layer's attention input X (ln1 output) or attention output O on the probe batch."""
    if stat not in ACT_STATS:
        raise ValueError(f"unknown activation statistic {stat!r}; one of {', '.join(ACT_STATS)}")
    return f"act/{layer_key(layer)}/{stat}"


def attn(layer: int, stat: str, head: Optional[int] = None) -> str:
    """Attention diagnostic of a layer (aggregated over heads) or of one head."""
    if stat not in ATTN_STATS:
        raise ValueError(f"unknown attention statistic {stat!r}; one of {', '.join(ATTN_STATS)}")
    mid = layer_key(layer) if head is None else f"{layer_key(layer)}/{head_key(head)}"
    return f"attn/{mid}/{stat}"


def delta_bias(layer: int, stat: str, head: Optional[int] = None) -> str:
    """Delta-bias statistic of a layer (summed over heads) or of one head."""
    if stat not in DELTA_STATS:
        raise ValueError(f"unknown delta-bias statistic {stat!r}; one of {', '.join(DELTA_STATS)}")
    mid = layer_key(layer) if head is None else f"{layer_key(layer)}/{head_key(head)}"
    return f"delta_bias/{mid}/{stat}"


def qk_update(layer: int, stat: str, head: Optional[int] = None) -> str:
    """Statistic of the query-key weight-product update of a layer (aggregated over heads) or of one head."""
    if stat not in QK_UPDATE_STATS:
        raise ValueError(f"unknown qk-update statistic {stat!r}; one of {', '.join(QK_UPDATE_STATS)}")
    mid = layer_key(layer) if head is None else f"{layer_key(layer)}/{head_key(head)}"
    return f"qk_update/{mid}/{stat}"


def qk_act(layer: int, stat: str, head: Optional[int] = None) -> str:
    """Spectral statistic of the pre-softmax scores of sub-sampled probe tokens, of a layer or of one head."""
    if stat not in QK_ACT_STATS:
        raise ValueError(f"unknown qk-activation statistic {stat!r}; one of {', '.join(QK_ACT_STATS)}")
    mid = layer_key(layer) if head is None else f"{layer_key(layer)}/{head_key(head)}"
    return f"qk_act/{mid}/{stat}"


@dataclass(frozen=True)
class Tag:
    """A monitor tag taken apart: family (spectral, act, attn, delta_bias, qk_update, qk_act), layer, head (or None),
    stat.

    For spectral tags ``stat`` is the weight name (wq, wk, ...)."""

    family: str
    layer: int
    head: Optional[int]
    stat: str


_SPECTRAL = re.compile(r"^spectral/L(\d+)/([a-z_]+)(?:/h(\d+))?$")
_OTHER = re.compile(r"^(act|attn|delta_bias|qk_update|qk_act)/L(\d+)(?:/h(\d+))?/([a-z_0-9]+)$")


def parse(tag: str) -> Optional[Tag]:
    """The parts of a per-layer monitor tag, or None for any other tag (train/loss, monitor/..., unknown)."""
    m = _SPECTRAL.match(tag)
    if m and m.group(2) in WEIGHTS:
        return Tag("spectral", int(m.group(1)), int(m.group(3)) if m.group(3) else None, m.group(2))
    m = _OTHER.match(tag)
    if m:
        return Tag(m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else None, m.group(4))
    return None
