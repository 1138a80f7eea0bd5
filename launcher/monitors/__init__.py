"""Live monitors of the paper's mechanism (Qiu & Yao, arXiv 2510.04212): the run's monitors (monitors.py: spectral
norms, probe-batch statistics, delta bias, early warning), their parts, and the TensorBoard tag names (tags.py, which
the comparison and the metrics import without the rest)."""
