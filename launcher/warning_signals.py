"""The early warning's signals by name, with what each measures: the thresholds ``monitor.warning_<signal>``
(launcher/config.py) and the rule that computes them (launcher/monitors/warning.py) both read this table, which
imports nothing, so the configuration need not import the monitors and the report need not import torch."""

WARNING_SIGNALS = {
    "tie_rate": "tie rate (mean over heads)",
    "wq_growth": "largest W_Q head norm / its value warning_window steps earlier",
    "wq_relative": "W_Q norm growth over warning_window steps / the median growth of the other layers",
    "dwq_cos": "cosine of successive W_Q-gradient errors (delta bias)",
    "delta_persistence": "|sum| / sum|.| of the last warning_baseline delta-bias sums",
    "qk_update_drop": "drop of the first-order Q-K update's spectral entropy below its recent mean",
    "qk_update2_drop": "drop of the second-order Q-K update's spectral entropy below its recent mean",
    "qk_srank_drop": "drop of the first-order Q-K update's stable rank below its recent mean",
    "qk_act_drop": "drop of the pre-softmax score spectral entropy below its recent mean",
}
