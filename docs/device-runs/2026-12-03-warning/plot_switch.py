"""The switch_fix demonstration of call 1 as one figure: each arm's training loss from its console log, the arm
that only logged its warning (on_warning=log) against the one that switched to fp32_output there (switch_fix), per
rounding, with the warning's step marked. Run from this folder: python plot_switch.py (writes switch_fix.png)."""
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEP = re.compile(r"\] step +(\d+)/\d+ \| loss ([0-9.]+|nan|inf)")
WARN = re.compile(r"EARLY WARNING at step (\d+)")


def curve(log: Path):
    steps, losses, warned = [], [], None
    for line in log.read_text().splitlines():
        if m := STEP.search(line):
            steps.append(int(m.group(1)))
            losses.append(float(m.group(2)))
        elif warned is None and (m := WARN.search(line)):
            warned = int(m.group(1))
    return steps, losses, warned


def main() -> None:
    here = Path(__file__).parent
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (rounding, title) in zip(axes, (("paper", "paper/none, g = 50, kept sign"),
                                            ("fa2", "fa2/none, g = 100, kept sign"))):
        for arm, colour, label in ((f"sw_off_{rounding}", "tab:red", "on_warning=log"),
                                   (f"sw_on_{rounding}", "tab:blue", "on_warning=switch_fix")):
            steps, losses, warned = curve(here / arm / "arm.log")
            ax.plot(steps, losses, color=colour, lw=1.2, label=label)
            if warned is not None and arm.startswith("sw_on"):
                ax.axvline(warned, color="grey", ls="--", lw=1)
                ax.text(warned, 7.5, f" warning at {warned}:\n fix -> fp32_output", fontsize=8, va="top")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylim(2, 8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("train loss")
    axes[0].legend(loc="upper right")
    fig.suptitle("monitor.on_warning=switch_fix on the H200 (2026-12-03, call 1)")
    fig.tight_layout()
    fig.savefig(here / "switch_fix.png", dpi=110)


if __name__ == "__main__":
    main()
