"""Print what a device call produced, last in its console: each gate report in OUT (PASSED or
FAILED, with the switches it ran away from their defaults, tailored/flags.py) and each
side-by-side tailored result (c, tok/s, TTFT and TPOT p50).

    python3 lab/device_results.py OUT_DIR [SBS_DIR]
"""

from __future__ import annotations

import glob
import json
import sys

from tailored.flags import Flags


def main() -> None:
    out = sys.argv[1]
    dirs = [f"{out}/sbs"] + sys.argv[2:]
    defaults = Flags().snapshot()
    for f in sorted(glob.glob(f"{out}/gate-*.json")):
        r = json.load(open(f))
        switches = r.get("manifest", {}).get("switches", {})
        changed = {k: v for k, v in switches.items() if defaults.get(k, v) != v}
        print(f, "PASSED" if r.get("passed") else "FAILED", changed or "(default switches)")
    for f in sorted({p for d in dirs for p in glob.glob(f"{d}/tailored-*.json")}):
        for x in json.load(open(f))["runs"]:
            print(f"{f}: c={x['max_concurrency']}: {x['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{x['p50_ttft_ms']:.1f} ms, TPOT p50 {x.get('p50_tpot_ms', 0):.2f} ms")


if __name__ == "__main__":
    main()
