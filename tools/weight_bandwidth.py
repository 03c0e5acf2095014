"""Achieved weight bandwidth at concurrency 1, from benchmark records.

At one sequence a decode step reads every weight once and does almost nothing else, so
its speed is set by memory bandwidth: the step cannot be faster than

    weight bytes / peak memory bandwidth

and the achieved bandwidth of a run is ``weight bytes × decode steps per second``, where a
step is one output token of the one request in flight (its TPOT). The ratio to the device's
peak says how much of the memory system the engine uses; on a GPU, launch overhead (what CUDA
graphs remove) is what keeps it low for a small model.

    python tools/weight_bandwidth.py bench/results/2026-12-01-nvidia-h200.jsonl
    python tools/weight_bandwidth.py results.jsonl --peak-gbs 3350   # a device not in the table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Peak memory bandwidth in GB/s (vendor figures), matched against the record's device name.
PEAK_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0,
            "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100 80GB PCIe": 1935.0,
            "L40S": 864.0, "L4": 300.0, "RTX 4090": 1008.0}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def peak_for(device_name: str) -> float | None:
    """The table's peak for a device name, the longest matching key first (H100 NVL, not H100)."""
    for key in sorted(PEAK_GBS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_GBS[key]
    return None


def weight_bandwidth(record: dict, peak_gbs: float | None = None) -> dict | None:
    """For a concurrency-1 record: weight bytes, decode steps/s, achieved GB/s and the
    fraction of the peak (None where the record lacks what it takes)."""
    env = record.get("env", {})
    params = env.get("model_shape", {}).get("num_params")
    itemsize = DTYPE_BYTES.get(env.get("dtype", ""))
    tpot = record.get("median_tpot_ms")
    if record.get("concurrency") != 1 or not (params and itemsize and tpot):
        return None
    weight_bytes = params * itemsize
    steps_per_s = 1000.0 / tpot
    achieved = weight_bytes * steps_per_s / 1e9
    peak = peak_gbs or peak_for(env.get("device_name", ""))
    return {"weight_gb": round(weight_bytes / 1e9, 3), "steps_per_s": round(steps_per_s, 1),
            "achieved_gbs": round(achieved, 1), "peak_gbs": peak,
            "fraction_of_peak": round(achieved / peak, 4) if peak else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="benchmark JSONL files")
    ap.add_argument("--peak-gbs", type=float, help="the device's peak memory bandwidth, GB/s")
    args = ap.parse_args()
    for path in args.results:
        for line in path.read_text().splitlines():
            record = json.loads(line) if line.strip() else {}
            found = weight_bandwidth(record, args.peak_gbs) if record else None
            if found:
                label = record["engine"] + (f"[{record['variant']}]" if record.get("variant") else "")
                share = (f"{100 * found['fraction_of_peak']:.1f} % of {found['peak_gbs']:.0f} GB/s"
                         if found["fraction_of_peak"] is not None else "peak unknown (--peak-gbs)")
                print(f"{path.name} {record['label']} {label} {record['workload']} c=1: "
                      f"{found['weight_gb']} GB of weights x {found['steps_per_s']} steps/s = "
                      f"{found['achieved_gbs']} GB/s, {share}")


if __name__ == "__main__":
    main()
