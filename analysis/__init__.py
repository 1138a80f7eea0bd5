"""Studies beyond the main job, built on the launcher's library: the stability-margin test (margin.py) and its
report (margin_report.py), the early warning's calibration on margin grids (warning_calibration.py) and the
delta bias of a trained checkpoint (checkpoint_delta_bias.py). Imports run one way: analysis/ imports launcher/, never
the reverse (the main job's own comparison report stays in launcher/compare.py)."""
