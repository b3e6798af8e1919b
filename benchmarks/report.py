"""Write benchmarks/RESULTS.md from the rows the benchmark scripts left in results.json.

``make bench`` runs this last. The header names the machine and device each script ran on
(one line when they all agree) and the dates; the table has one row per figure, the
issue's five numbered figures first.

Usage: python benchmarks/report.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def describe(m: dict[str, Any]) -> str:
    if "device" not in m:  # several machines (bench_kv_plans: cells name their device)
        return "; ".join(f"[{name}] {describe(one)}" for name, one in m.items())
    where = f"{m['device']}" + (f" ({m['gpu']})" if "gpu" in m else "")
    threads = m.get("threads")
    where += f", {threads} torch thread{'s' if threads != 1 else ''}" if threads else ""
    return (
        f"{m['cpu']}"
        + (f" ({m['isa'].upper()})" if m.get("isa") else "")
        + f", {m['cores']} cores, {m['ram_gb']} GB RAM; device {where}; "
        f"torch {m['torch']}, transformers {m['transformers']}, "
        f"TransformerLens {m['transformer_lens']}, Python {m['python']}"
    )


def order(row: dict[str, Any]) -> tuple[int, str]:
    fig = str(row["figure"])
    return (int(fig), "") if fig.isdigit() else (99, fig)


def main() -> None:
    data = json.loads((HERE / "results.json").read_text())
    runs = data["runs"]
    machines = {describe(r["machine"]) for r in runs.values()}
    dates = sorted(r["date"][:10] for r in runs.values())
    lines = ["# Benchmark results", ""]
    lines.append(
        f"Measured {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "") + "."
    )
    if len(machines) == 1:
        lines.append(f"Machine: {machines.pop()}.")
    else:
        lines += [f"- `{s}`: {describe(r['machine'])}" for s, r in sorted(runs.items())]
    lines += [
        "",
        "Every figure is a ratio of two measurements taken in the same run (the machine may be",
        "shared, so absolute times vary between runs). Written by `benchmarks/report.py` from",
        "`benchmarks/results.json`; `make bench` regenerates both.",
        "",
        "| # | figure | result | target | met |",
        "|---|---|---|---|---|",
    ]
    rows = [(s, row) for s, r in runs.items() for row in r["rows"]]
    for script, row in sorted(rows, key=lambda sr: order(sr[1])):
        if row["result"] == "":  # rows that only carry data (a table's values) for the JSON
            continue
        met = {True: "yes", False: "**no**", None: ""}[row["met"]]
        numbered = str(row["figure"]).isdigit()
        fig = row["figure"] if numbered else ""
        what = row["what"] if numbered or not row["figure"] else f"{row['figure']}: {row['what']}"
        cells = [fig, f"{what} (`{script}`)", row["result"], row["target"], met]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    (HERE / "RESULTS.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {HERE / 'RESULTS.md'} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
