"""Cost as the model grows: SmolLM2-135M, Gemma 3 270M, Qwen2.5-Coder-0.5B and 1.5B.

For each model, in a fresh process on the same probe sizes (16 sentences, 4 repeated
random sequences of 2 x 32 tokens, one 300-token needle haystack, the in-context prompts;
function vectors on 4 prompts, copy suppression over 100 word tokens; 20 bootstrap
resamples):

* ``classify(model, [type])`` for every type that fits, against the bare forward passes
  over the same token batches (its probe's, built once, no hooks): the ratio is
  classify's cost in forwards. The target: the ratio over all types at the largest model
  is at most the ratio at the smallest (classify's overhead does not grow with size);
* peak resident memory during each type above the loaded model, and the loaded model's
  resident memory against the size of its weights (float32 weights are mapped from the
  cached safetensors: file pages, shared by processes that load the same model);
* validation: ``classify(model, ["induction"], validate=True)`` with the sequential test
  (19 to 99 control sets a claim), its seconds over the control sets it drew;
* growth with tokens: bare forward and the streaming statistics of the prose types at 8
  and 32 sentences (the exponent of time in tokens).

Then a log-log fit of each time against the parameter count, the ratios' table and a plot
(``scale.png``: seaborn).

Usage: python benchmarks/bench_scale.py [--models smollm2-135m,gemma3-270m,...] [--threads 1]
       python benchmarks/bench_scale.py --types function_vector  (measure these types again,
       the rest of scale.json kept; each re-measured type records when: ``remeasured``)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import add_arguments, clock, peak_mb, record, reset_peak, rss_mb, start

if TYPE_CHECKING:
    from headmech.classification.records import TypeValidation

MODELS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"
PROBE = {"n_sentences": 16, "n_sequences": 4, "half_len": 32, "needle_lengths": (300,)}
TYPE_OPTIONS = {"function_vector": {"max_prompts": 4}, "copy_suppression": {"n_tokens": 100}}
PLOT = Path(__file__).with_name("scale.png")


def _rss_parts() -> dict[str, float]:
    """Resident memory now, split into anonymous and file-backed pages (MB)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def _draws(v: TypeValidation | None) -> int:
    """Control sets drawn in a validation: every claim's test's, and the backups' test's."""
    if v is None:
        return 0
    backups = len(v.backups.controls["costs"]) if v.backups is not None else 0
    return sum(c.test.n for c in v.tested() if c.test is not None) + backups


def one_model(name: str, device: str | None, only: list[str] | None = None) -> dict[str, Any]:
    """Every measurement of one model (run in its own process); with ``only``, those
    types' classify times alone."""
    import torch

    import headmech
    from headmech.headtypes.registry import collect_statistics, get_head_type
    from headmech.probes import ProbeOptions, build_probe
    from headmech.publish import applicable_types
    from headmech.stream.engine import bare_forward

    t0 = time.perf_counter()
    model = headmech.load_model(name, device=device)
    load_s = time.perf_counter() - t0
    hf = model.original_model
    params = sum(p.numel() for p in hf.parameters())
    weight_mb = sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**20
    loaded = rss_mb()
    out: dict[str, Any] = {
        "params": params, "weights_mb": weight_mb, "load_s": load_s, "loaded_rss_mb": loaded,
        **{f"loaded_{k}_mb": v for k, v in _rss_parts().items()}, "types": {},
    }  # fmt: skip
    names, skipped = applicable_types(model)
    names = names or [t for t in headmech.head_types() if t not in skipped]
    names = [t for t in names if only is None or t in only]
    options = ProbeOptions(**PROBE)
    bare: dict[str, tuple[float, int]] = {}  # probe -> (seconds, tokens)
    for t in names:
        probe = get_head_type(t)().probe
        if probe not in bare:
            p = build_probe(probe, model, options)
            bare_forward(model, p.batches[:1])  # warm-up
            s = clock(device)
            bare_forward(model, p.batches)
            bare[probe] = (clock(device) - s, p.n_tokens)
        kind = get_head_type(t)
        typ = kind(**TYPE_OPTIONS.get(t, {}))
        reset_peak(device)
        base = rss_mb()
        s = clock(device)
        headmech.classify(model, [typ], n_boot=20, **PROBE)  # type: ignore[arg-type]
        seconds = clock(device) - s
        out["types"][t] = {
            "seconds": seconds, "probe": probe, "bare_s": bare[probe][0],
            "tokens": bare[probe][1], "ratio": seconds / bare[probe][0],
            "peak_above_mb": peak_mb(device) - base,
        }  # fmt: skip
        print(
            f"{name} {t}: {seconds:.1f} s = {seconds / bare[probe][0]:.1f} forwards",
            file=sys.stderr,
        )
    if only is not None:
        return out
    # validation: seconds a control set
    s = clock(device)
    plain = headmech.classify(model, ["induction"], n_boot=20, **PROBE)  # type: ignore[arg-type]
    plain_s = clock(device) - s
    s = clock(device)
    cat = headmech.classify(model, ["induction"], validate=True, n_boot=20, **PROBE)  # type: ignore[arg-type]
    validated_s = clock(device) - s
    drawn = _draws(cat.types["induction"].validation)
    del plain
    out["validation"] = {
        "seconds": validated_s - plain_s, "control_sets": drawn,
        "per_set_s": (validated_s - plain_s) / max(drawn, 1),
        "forward_s": bare["repeated_random"][0],
    }  # fmt: skip
    # growth with tokens: the prose probe at 8 and 32 sentences
    prose = [get_head_type(t)() for t in names if get_head_type(t)().probe == "prose"]
    prose = [t for t in prose if t.reducers()]
    growth = {}
    for n in (8, 32):
        p = build_probe("prose", model, ProbeOptions(n_sentences=n))
        s = clock(device)
        bare_forward(model, p.batches)
        b = clock(device) - s
        s = clock(device)
        collect_statistics(prose, model, p.batches)
        growth[n] = {"tokens": p.n_tokens, "bare_s": b, "stats_s": clock(device) - s}
    out["tokens"] = growth
    out["threads"] = torch.get_num_threads()
    return out


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y on log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def _plot(got: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = []
    for m, r in got.items():
        for t, v in r["types"].items():
            rows.append(
                {"model": m, "params (M)": r["params"] / 1e6, "type": t, "ratio": v["ratio"]}
            )
    df = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sns.lineplot(
        data=df, x="params (M)", y="ratio", hue="type", marker="o", ax=axes[0], legend=False
    )
    axes[0].set(xscale="log", yscale="log", title="classify / bare forward, per type")
    total = pd.DataFrame(
        [
            {
                "params (M)": r["params"] / 1e6,
                "seconds": sum(v[k] for v in r["types"].values()),
                "what": "classify, every type" if k == "seconds" else "bare forwards, same tokens",
            }
            for r in got.values()
            for k in ("seconds", "bare_s")
        ]
    )
    sns.lineplot(data=total, x="params (M)", y="seconds", hue="what", marker="o", ax=axes[1])
    axes[1].set(xscale="log", yscale="log", title="seconds against parameters (one thread)")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap, model=None)
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one model, JSON out
    ap.add_argument("--from-json", help="tabulate a saved run (the children's JSON) again")
    ap.add_argument("--types", help="measure only these types again (comma-separated)")
    args = ap.parse_args()
    start(args)
    only = args.types.split(",") if args.types else None
    if args.one:
        print(json.dumps(one_model(args.one, args.device, only)))
        return
    saved = Path(__file__).with_name("scale.json")
    if args.from_json:
        got = json.loads(Path(args.from_json).read_text())
    else:
        got = json.loads(saved.read_text()) if only else {}
        for m in args.models.split(","):  # a fresh process per model
            cmd = [sys.executable, __file__, "--one", m]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            cmd += ["--device", args.device] if args.device else []
            cmd += ["--types", args.types] if args.types else []
            done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
            new = json.loads(done.stdout)
            if only:  # the other types and measurements as saved
                got[m]["types"].update(new["types"])
                when = time.strftime("%Y-%m-%d")
                got[m].setdefault("remeasured", {}).update({t: when for t in new["types"]})
            else:
                got[m] = new
            saved.write_text(json.dumps(got, indent=1) + "\n")  # each model kept as it ends
    models = list(got)
    ratio = {
        m: sum(v["seconds"] for v in r["types"].values())
        / sum(v["bare_s"] for v in r["types"].values())
        for m, r in got.items()
    }
    params = [got[m]["params"] for m in models]
    print(
        "| model | parameters | weights MB | loaded RSS MB (anon) | classify s | bare s | ratio | validation s a set | forward s (repeated) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for m in models:
        r = got[m]
        v = r["validation"]
        print(
            f"| {m} | {r['params'] / 1e6:.0f}M | {r['weights_mb']:.0f} | {r['loaded_rss_mb']:.0f} "
            f"({r.get('loaded_RssAnon_mb', 0):.0f}) | {sum(x['seconds'] for x in r['types'].values()):.0f} | "
            f"{sum(x['bare_s'] for x in r['types'].values()):.1f} | {ratio[m]:.1f}x | "
            f"{v['per_set_s']:.2f} ({v['control_sets']} sets) | {v['forward_s']:.2f} |"
        )
    fits = {
        "bare forward": _slope(
            params, [sum(x["bare_s"] for x in got[m]["types"].values()) for m in models]
        ),
        "classify": _slope(
            params, [sum(x["seconds"] for x in got[m]["types"].values()) for m in models]
        ),
        "validation a set": _slope(params, [got[m]["validation"]["per_set_s"] for m in models]),
        "peak above the model": _slope(
            params,
            [max(1.0, max(x["peak_above_mb"] for x in got[m]["types"].values())) for m in models],
        ),
    }
    tokens = {
        m: {
            "bare": _slope([got[m]["tokens"][k]["tokens"] for k in ("8", "32")],
                           [got[m]["tokens"][k]["bare_s"] for k in ("8", "32")]),
            "stats": _slope([got[m]["tokens"][k]["tokens"] for k in ("8", "32")],
                            [got[m]["tokens"][k]["stats_s"] for k in ("8", "32")]),
        }
        for m in models
    }  # fmt: skip
    print("time ~ parameters^k:", ", ".join(f"{k} {v:.2f}" for k, v in fits.items()))
    print(
        "time ~ tokens^k:",
        "; ".join(
            f"{m} bare {v['bare']:.2f}, statistics {v['stats']:.2f}" for m, v in tokens.items()
        ),
    )
    small, large = models[0], models[-1]
    met = ratio[large] <= ratio[small]
    print(f"ratio at {large} {ratio[large]:.2f}x vs {small} {ratio[small]:.2f}x: target met {met}")
    _plot(got)
    rows = [
        {
            "figure": "scale/ratio",
            "what": f"classify (every type) / bare forwards over the same tokens, {large} vs {small}",
            "result": f"{ratio[large]:.2f}x vs {ratio[small]:.2f}x",
            "target": f"ratio at {large} <= ratio at {small}",
            "met": met,
            "values": {"ratio": ratio, "fits_params": fits, "fits_tokens": tokens},
        },
        *[
            {
                "figure": f"scale/{m}",
                "what": f"{m}: classify every type, validation a control set, memory",
                "result": f"{ratio[m]:.2f}x forwards; {got[m]['validation']['per_set_s']:.2f} s a control set; "
                f"loaded {got[m]['loaded_rss_mb']:.0f} MB for {got[m]['weights_mb']:.0f} MB of weights",
                "target": "",
                "met": None,
                "values": got[m],
            }
            for m in models
        ],
    ]
    record("bench_scale", args.device, rows)


if __name__ == "__main__":
    main()
