"""Moved: this measurement is now ``python -m kernels.tie_bias`` (kernels/tie_bias.py).

The old command still works: this file runs the new module as a command."""

import runpy

if __name__ == "__main__":
    runpy.run_module("kernels.tie_bias", run_name="__main__", alter_sys=True)
