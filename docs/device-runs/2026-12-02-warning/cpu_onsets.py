"""Each arm's first warning onset per signal, at the thresholds cpu_calibration.sh's calibration chose (read from
/tmp/wc/calibration_L<layer>/calibration.md): which arms the held-out scores count as
warned or as false alarms. Output: cpu_calibration/onsets.txt (stdout)."""
import re
from pathlib import Path
from launcher.warning_calibration import load_set, onsets_of
from launcher.monitors.warning import WarningRule
R = Path("/tmp/wc/runs")
for layer in (1, 0):
    md = Path(f"/tmp/wc/calibration_L{layer}/calibration.md").read_text()
    held = md.split("## Held-out")[1]
    thr = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (\w+) \| ([0-9.]+) \|", held, re.M)}
    rule = WarningRule(layer=layer, window=100, after_step=100, patience=2, baseline=8)
    for name, dirs in (("cal", ["w_cal_fa2", "w_cal_paper"]), ("held", ["w_held_fa2", "w_held_paper"])):
        arms, rep = load_set([R / d for d in dirs], rule)
        ons = {s: onsets_of(rep, s, t, rule) for s, t in thr.items()}
        print(f"== layer {layer} {name}; thresholds {thr}")
        for a in arms:
            row = " ".join(f"{s}={ons[s][a.key]}" for s in thr if ons[s][a.key] is not None)
            print(f"  {a.key:40s} {a.status:8s} {a.step:5d} below={a.below_margin!s:5s} | {row}")
