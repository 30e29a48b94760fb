"""Summarise a bench_e2e_gpu.py result: validity flags, ratios to flat DFlash, a markdown table, a plot.

    python benchmarks/summarize_e2e.py benchmarks/results/e2e_h200x2_4b.json [--png out.png]

- A run whose outputs left the reference (reference_match < 0.95) is flagged `invalid`: its
  acceptance is not the profile's (the oracle drafts the reference), so its speed says nothing.
- A run that never had its cell's c requests in flight at once (`peak_batch` < c: the engine's KV
  cache holds fewer, e.g. too small a --kv-cache-gib for engines sharing a GPU) is flagged `invalid`
  too: it timed smaller batches and a queue, not concurrency c.
- Flat DFlash's acceptance depends only on the chain's per-depth acceptance p0: the first three
  profiles share it (calibrate_oracle.py), only the off-chain ranks differ; `thinking_2p5` has its
  own. So the flat baseline per concurrency is the mean of its valid runs over the profiles of the
  same chain (one number less noisy than any single 256-token run); with --side-by-side, the flat
  run of the same cell (it ran interleaved with the others; in merged side-by-side parts, of the
  same part); `vs_flat` is each run's tok/s over it, `gain` its tokens per round over flat's and
  `break_even` flat's rounds/s over the run's (the gain it needs). `tok_s_agg` / `vs_flat_agg`: the
  same over all of a cell's timed runs (total tokens over total time), the number the tables show.
- `vs_flat_ci90` (--side-by-side rows of 3 or more paired repeats): the 5th and 95th percentiles of the
  aggregate ratio over the cell's repeats resampled with replacement (a seeded bootstrap, repeat i's
  two runs kept together): whether a cell's ratio is below 1.00x beyond its run-to-run spread (upper
  end < 1), above it (lower end > 1), or neither at this many repeats. Rough at 5 repeats (a bootstrap
  of few samples runs narrow), but it tells a 0.91x that every repeat agrees on from one that a single
  slow run made.
- `step_vs_alike`: in a side-by-side part with the mode "flatalike" (flat DFlash compiled as DDTree's
  engines are: Inductor graph partition at DDTree's ops), each other mode's steady steps over its, what
  DDTree's own round adds to a step with the compile config held equal (a diagnostic; "flat" stays the
  reference of every other number).
- The reference is the mode "flat", in the loop the benchmark gives it (by default vLLM's own: Model
  Runner V2 with async scheduling, rows record `runner` and `async_scheduling`); where the run has
  "flat@v1sync" too (the V1 synchronous flat DFlash of earlier tables), a second table gives every
  mode's ratio to that.
- The plot (matplotlib: `pip install -e .[bench]`): tok/s over flat DFlash per mode, one panel per
  profile, x = concurrency.
- `--kernels` (runs with --gpu-profile): per profiled cell, the GPU's busy ms per round of every mode and
  its kernels side by side, each over the first mode's, and the Triton variants of vLLM's GDN kernels
  that one mode compiled and another did not.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics

VALID = 0.95
OLD_BASELINE = "flat@v1sync"  # bench_e2e_gpu mode: flat DFlash on the V1 runner, async scheduling off
ALIKE = "flatalike"  # bench_e2e_gpu mode: flat DFlash compiled as DDTree's engines are (a diagnostic)


def rounds_per_s(r: dict) -> float:
    """A row's rounds over the wall time they took: all of its cell's timed runs (--repeats), whose
    round counters span them all; parts from before --repeats have one run."""
    return r["rounds"] / r.get("wall_s_total", r["wall_s"])


def tok_s_agg(r: dict) -> float | None:
    """All of a cell's timed runs: total output tokens over total wall time (every run of a cell
    emits the same tokens); None for parts from before --repeats kept every run."""
    n = len(r.get("tok_s_runs") or [])
    return n * r["output_tokens"] / r["wall_s_total"] if n and r.get("wall_s_total") else None


def summarize(result: dict) -> dict:
    runs = result["runs"]
    for r in runs:
        for k in ("vs_flat", "vs_flat_agg", "gain", "break_even", "vs_flat_ci90", "step_vs_flat", "step_vs_alike"):
            # derived here, never kept from a saved file
            r.pop(k, None)
        if "error" not in r and (agg := tok_s_agg(r)) is not None:
            r["tok_s_agg"] = agg
        if "error" not in r and r.get("reference_match", 1.0) < VALID:
            r["invalid"] = f"outputs left the reference (match {r['reference_match']:.3f}); see mismatch_heads"
        if "error" not in r and r.get("peak_batch", r.get("concurrency", 0)) < r.get("concurrency", 0):
            r["invalid"] = (f"at most {r['peak_batch']} of its {r['concurrency']} requests in flight at once "
                            "(the engine's KV cache holds fewer)")
    # --side-by-side: flat DFlash ran interleaved with the others in each (profile, concurrency) cell,
    # so each cell's own flat run is the baseline; else the mean over profiles (see the docstring)
    paired = bool(result.get("args", {}).get("side_by_side"))
    chain = chain_labels(result)

    def key(r):  # (merged side-by-side parts: each part's own flat, bench_e2e_gpu.merge's `pair`)
        if paired:
            return (r.get("pair") or "", r.get("profile"), r["concurrency"])
        return (chain.get(r.get("profile"), ""), r["concurrency"])

    flat = {}
    for k in sorted({key(r) for r in runs if r.get("mode") == "flat" and "error" not in r}, key=str):
        ok = [r for r in runs if r.get("mode") == "flat" and "error" not in r and key(r) == k and "invalid" not in r]
        if ok:
            flat[k] = {"tok_s": statistics.mean(r["tok_s"] for r in ok),
                       "tok_s_agg": (statistics.mean(r["tok_s_agg"] for r in ok)
                                     if all("tok_s_agg" in r for r in ok) else None),
                       "tokens_per_round": statistics.mean(r["tokens_per_round"] for r in ok),
                       "rounds_per_s": statistics.mean(rounds_per_s(r) for r in ok), "runs": len(ok)}
    for r in runs:
        f = flat.get(key(r)) if "concurrency" in r else None
        if f and r.get("mode") not in ("flat", None) and "error" not in r and "invalid" not in r:
            r["vs_flat"] = r["tok_s"] / f["tok_s"]
            if f["tok_s_agg"] and "tok_s_agg" in r:
                r["vs_flat_agg"] = r["tok_s_agg"] / f["tok_s_agg"]
            if r.get("rounds"):
                r["gain"] = r["tokens_per_round"] / f["tokens_per_round"]
                r["break_even"] = f["rounds_per_s"] / rounds_per_s(r)
            if paired:
                f_row = next(x for x in runs if x.get("mode") == "flat" and "error" not in x and key(x) == key(r))
                interval(r, f_row)
                step_ratios(r, f_row)
    if paired:  # a side-by-side part with ALIKE: the other modes' steady steps over its (the compile config aside)
        for r in runs:
            alike = next((x for x in runs if x.get("mode") == ALIKE and "error" not in x and key(x) == key(r)), None)
            if alike is not None and r.get("mode") not in (ALIKE, "flat", None) and "error" not in r \
                    and "invalid" not in r:
                step_ratios(r, alike, out="step_vs_alike")
    result["flat_baseline"] = {(_flat_key(*k) if paired else _unpaired_key(*k)): v for k, v in flat.items()}
    return result


def chain_labels(result: dict) -> dict[str, str]:
    """Profile name -> its chain's label ("chain 5.60": tokens per round), "" where every profile of
    the result has the same chain (older results: one flat baseline per concurrency)."""
    profs = result.get("profiles", {})
    profs = profs.get("profiles", []) if isinstance(profs, dict) else []
    label = {p["name"]: f"chain {p['chain_tokens_per_round']:.2f}" for p in profs if "chain_tokens_per_round" in p}
    return label if len(set(label.values())) > 1 else {}


def step_ratios(r: dict, flat: dict, out: str = "step_vs_flat") -> None:
    """Each steady step kind of r over flat's step of the same cell and batch bucket, on one clock
    (--phase-timers on Model Runner V2: step_clock, _step_clock.py): r[out]["chain@4"]."""
    mine, base = r.get("step_clock") or {}, flat.get("step_clock") or {}
    ratios = {k: v["ms"] / base[f"flat@{k.rsplit('@', 1)[1]}"]["ms"] for k, v in mine.items()
              if f"flat@{k.rsplit('@', 1)[1]}" in base}
    if ratios:
        r[out] = ratios


def interval(r: dict, flat: dict, n: int = 2000, seed: int = 0) -> None:
    """vs_flat_ci90 of a side-by-side row against its cell's flat row (module docstring)."""
    t, ft = r.get("tok_s_runs") or [], flat.get("tok_s_runs") or []
    if len(t) < 3 or len(ft) != len(t):
        return
    rng, k = random.Random(seed), len(t)
    ratios = sorted(sum(1 / ft[i] for i in idx) / sum(1 / t[i] for i in idx)
                    for idx in ([rng.randrange(k) for _ in range(k)] for _ in range(n)))
    r["vs_flat_ci90"] = [ratios[n // 20], ratios[n - 1 - n // 20]]


def _ci_cell(r: dict | None) -> str:
    if r is None or "vs_flat_ci90" not in r:
        return "-"
    lo, hi = r["vs_flat_ci90"]
    return f"{lo:.2f}-{hi:.2f}" + (" below" if hi < 1 else " above" if lo > 1 else "")


def _unpaired_key(chain: str, c: int) -> str:
    return f"{chain} c={c}" if chain else str(c)


def _flat_key(pair: str, profile: str, c: int) -> str:
    return f"{pair + ' ' if pair else ''}{profile} c={c}"


def table(result: dict) -> str:
    """Markdown: tok/s over the flat baseline per mode (rows) and profile x concurrency (columns),
    aggregated over the cell's runs where they were kept."""
    runs = [r for r in result["runs"] if r.get("profile") and "error" not in r and r["mode"] != "flat"]
    profiles = list(dict.fromkeys(r["profile"] for r in runs))
    conc = sorted({r["concurrency"] for r in runs})
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    cell = {}
    for r in runs:  # a mode in several merged side-by-side parts: its row with a ratio to flat shows
        k = (r["mode"], r["profile"], r["concurrency"])
        if k not in cell or ("vs_flat" in r and "vs_flat" not in cell[k]):
            cell[k] = r
    head = "| mode | " + " | ".join(f"{p} c={c}" for p in profiles for c in conc) + " |"
    lines = [head, "|" + " --- |" * (1 + len(profiles) * len(conc))]
    for m in modes:
        vals = []
        for p in profiles:
            for c in conc:
                r = cell.get((m, p, c))
                vals.append("-" if r is None or "vs_flat" not in r else
                            f"{r.get('vs_flat_agg', r['vs_flat']):.2f}x ({r['gain']:.2f})")
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    fb = result.get("flat_baseline", {})
    paired = bool(result.get("args", {}).get("side_by_side"))
    for pair in dict.fromkeys(r.get("pair") or "" for r in runs) if paired else [None]:
        chain = chain_labels(result)
        keys = [_flat_key(pair, p, c) if paired else _unpaired_key(chain.get(p, ""), c) for p in profiles for c in conc]
        label = f"flat DFlash tok/s ({pair})" if pair else "flat DFlash tok/s"
        lines.append(f"| {label} | " + " | ".join(
            f"{fb[k]['tok_s_agg'] or fb[k]['tok_s']:.0f}" if k in fb else "-" for k in keys) + " |")
    if any("vs_flat_ci90" in r for r in runs):
        lines.append("\n90% interval of the aggregate ratio over the cell's repeats (vs_flat_ci90, paired bootstrap; "
                     "below / above: all of it under / over 1.00x):\n")
        lines += [head, lines[1]]
        for m in modes:
            lines.append(f"| {m} | " + " | ".join(_ci_cell(cell.get((m, p, c))) for p in profiles for c in conc) + " |")
    old = [r for r in runs if r["mode"] == OLD_BASELINE and "vs_flat" in r]
    if old:  # the earlier baseline (V1 runner, synchronous loop): every mode's ratio to it, the same cells
        ratio = {(r["profile"], r["concurrency"]): r.get("vs_flat_agg", r["vs_flat"]) for r in old}
        lines.append(f"\nOver {OLD_BASELINE} (the V1 synchronous flat DFlash earlier tables compared against):\n")
        lines += [head, lines[1]]
        for m in modes:
            if m == OLD_BASELINE:
                continue
            lines.append(f"| {m} | " + " | ".join(
                f"{cell[(m, p, c)].get('vs_flat_agg', cell[(m, p, c)]['vs_flat']) / ratio[(p, c)]:.2f}x"
                if (m, p, c) in cell and "vs_flat" in cell[(m, p, c)] and (p, c) in ratio else "-"
                for p in profiles for c in conc) + " |")
    own = [m for m in modes if any("own_host_share" in r for r in runs if r["mode"] == m)]
    if own:  # the goal line: DDTree's own host work <= 5% of a step on Model Runner V2
        lines.append("\nDDTree's own host work per step (round timers but the drafter's forward; share of the step):\n")
        lines += [head, lines[1]]
        for m in own:
            lines.append(f"| {m} | " + " | ".join(
                f"{r['own_host_ms_per_step']:.2f} ms ({100 * r['own_host_share']:.0f}%)"
                if (r := cell.get((m, p, c))) is not None and "own_host_share" in r else "-"
                for p in profiles for c in conc) + " |")
    steps = (  # the goal lines: auto's chain step within 2% of flat's; a tree step at c = 1 <= 1.10x flat's
        ("step_vs_flat", ("Steady steps over flat DFlash's of the same cell, on one clock (_step_clock.py: "
                          "medians, the device's timeline on CUDA), at the cell's batch bucket (c rounded down to "
                          "a power of 2)")),
        # what DDTree's own round adds to a step, vLLM's compile config aside
        ("step_vs_alike", (f"Steady steps over {ALIKE}'s (flat DFlash compiled as DDTree's engines are) of the same "
                           "side-by-side part and cell, on one clock, at the cell's batch bucket")))
    for field, title in steps:
        clocked = [m for m in modes if any(field in r for r in runs if r["mode"] == m)]
        if clocked:
            lines += [f"\n{title}:\n", head, lines[1]]
            for m in clocked:
                lines.append(f"| {m} | " + " | ".join(
                    _steps_cell(r[field], c) if (r := cell.get((m, p, c))) is not None and field in r else "-"
                    for p in profiles for c in conc) + " |")
    nospec = {r["concurrency"]: r["tok_s"] for r in result["runs"] if r.get("mode") == "nospec" and "tok_s" in r}
    if nospec:
        lines.append("| no speculation tok/s | " + " | ".join(
            f"{nospec[c]:.0f}" if c in nospec else "-" for _ in profiles for c in conc) + " |")
    chosen = [m for m in modes if any("auto_decisions_in_cell" in r for r in runs if r["mode"] == m)]
    if chosen:  # budget "auto": the kind it took most at each batch bucket of the cell, and its share
        lines.append("\nBudget \"auto\"'s kinds in each cell (batch bucket: the kind taken most, its share of "
                     "the bucket's decisions):\n")
        lines += [head, lines[1]]
        for m in chosen:
            lines.append(f"| {m} | " + " | ".join(
                _kinds_cell(r["auto_decisions_in_cell"]) if (r := cell.get((m, p, c))) is not None
                and "auto_decisions_in_cell" in r else "-" for p in profiles for c in conc) + " |")
    return "\n".join(lines)


def _steps_cell(ratios: dict, c: int) -> str:
    """{"chain@4": 1.12, "tree:32@4": 1.5, "chain@2": ...} at c = 4 -> "chain 1.12x, tree:32 1.50x"."""
    b = 1 << (c.bit_length() - 1)
    at = sorted((k.rsplit("@", 1)[0], v) for k, v in ratios.items() if k.endswith(f"@{b}"))
    return ", ".join(f"{k} {v:.2f}x" for k, v in at) or "-"


def _kinds_cell(decisions: dict) -> str:
    """{"kind@bucket": n} -> "1: tree 80%, 16: chain 55%" (buckets ascending)."""
    by = {}
    for key, n in decisions.items():
        kind, b = key.rsplit("@", 1)
        by.setdefault(int(b), {})[kind] = n
    return ", ".join(f"{b}: {max(ks, key=ks.get)} {100 * max(ks.values()) / sum(ks.values()):.0f}%"
                     for b, ks in sorted(by.items()))


def plot(result: dict, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "vs_flat" in r]
    profiles = list(dict.fromkeys(r["profile"] for r in runs if r.get("profile")))
    runs = [r for r in runs if r.get("profile")] + [  # no speculation: the same line in every panel
        dict(r, profile=p) for r in runs if not r.get("profile") for p in profiles]
    fig, axes = plt.subplots(1, len(profiles), figsize=(4.2 * len(profiles), 3.6), sharey=True)
    for ax, p in zip(axes if len(profiles) > 1 else [axes], profiles):
        for m in dict.fromkeys(r["mode"] for r in runs):
            pts = sorted((r["concurrency"], r.get("vs_flat_agg", r["vs_flat"]))
                         for r in runs if r["mode"] == m and r["profile"] == p)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(p)
        ax.set_xlabel("concurrency")
    flat = next((r for r in result["runs"] if r.get("mode") == "flat" and "runner" in r), None)
    loop = "" if flat is None else (" (V2, async)" if ".gpu.model_runner" in flat["runner"] and flat.get(
        "async_scheduling") else f" ({flat['runner'].rsplit('.', 2)[-2]}, async {flat.get('async_scheduling')})")
    (axes[0] if len(profiles) > 1 else axes).set_ylabel("tok/s over flat DFlash" + loop)
    (axes[-1] if len(profiles) > 1 else axes).legend(fontsize=8)
    tp = result.get("args", {}).get("tensor_parallel_size") or 1
    fig.suptitle(f"{result.get('args', {}).get('target', '')} on {result.get('device', '')}"
                 f"{f' x{tp} (tensor parallel {tp})' if tp > 1 else ''} "
                 f"(vLLM {result.get('vllm', '')}, CUDA graphs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def kernel_table(result: dict, top: int = 12) -> str:
    """--kernels (module docstring): one block per profiled (profile, concurrency)."""
    cells: dict = {}
    for p in result.get("gpu_profiles", []):
        cells.setdefault((p["profile"], p["concurrency"]), []).append(p)
    out = []
    for (prof, c), ps in cells.items():
        modes = [p["mode"] for p in ps]
        out += [f"{prof} c = {c}: ms per round (x the first mode's)", "| kernel | " + " | ".join(modes) + " |",
                "| --- |" + " --- |" * len(ps)]
        rows = [("GPU busy", [p["gpu_busy_ms_per_round"] for p in ps])]
        by_name = [{k["name"]: k["ms_per_round"] for k in p["kernels"]} for p in ps]
        names = sorted({n for b in by_name for n in b}, key=lambda n: -max(b.get(n, 0.0) for b in by_name))
        rows += [(n[:60], [b.get(n) for b in by_name]) for n in names[:top]]
        for name, ms in rows:
            base = ms[0]
            out.append(f"| {name} | " + " | ".join(
                "-" if m is None else f"{m:.4f}" + ("" if i == 0 or not base else f" ({m / base:.3f}x)")
                for i, m in enumerate(ms)) + " |")
        specs = [p.get("triton_specializations") or {} for p in ps]
        for kernel in sorted({k for s in specs for k in s}):
            keys = [set(s.get(kernel, ())) for s in specs]
            for mode, mine in zip(modes, keys):
                for key in sorted(mine - set.intersection(*keys)):
                    out.append(f"  {kernel} variant only in {mode}: {key}")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--png", default=None)
    ap.add_argument("--kernels", action="store_true", help="the --gpu-profile kernels of each mode side by side")
    args = ap.parse_args(argv)
    path = pathlib.Path(args.result)
    result = summarize(json.loads(path.read_text()))
    path.write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    if args.kernels:
        print(kernel_table(result))
    if args.png:
        plot(result, pathlib.Path(args.png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
