"""Summaries, tables and goals of a benchmark run (the plots are in plots.py)."""

from __future__ import annotations

import math
import statistics

from netbench import LABELS


# ====================================================================== analysis
def ema(values: list[float], beta: float = 0.8) -> list[float]:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else beta * acc + (1 - beta) * v
        out.append(acc)
    return out


def summarize(raw: dict, args, world: int, target: float | None) -> dict:
    """Per-method figures; with ``--repeats`` the timings are medians over the repeats."""
    out = _summarize(raw["methods"], args, world, target)
    extra = raw.get("repeats") or {}
    if not extra:
        return out
    reps = [_summarize({m: runs[i] for m, runs in extra.items()}, args, world, out["target"])
            for i in range(args.repeats - 1)]
    for m, row in out["rows"].items():
        for key in ("sps_compress", "sps_run", "step_s_compress", "run_s", "fwd_ms", "bwd_ms", "opt_ms"):
            values = [row[key]] + [r["rows"][m][key] for r in reps if m in r["rows"]]
            row[key + "_all"] = values
            row[key] = statistics.median(values)
    return out


def _summarize(methods: dict, args, world: int, target: float | None) -> dict:
    """Per-method figures from the per-step records of every rank (one repeat)."""
    n = args.steps
    first = min(_window_freeze(args) + 3, n)  # first step of the compression-phase window
    gb = world * args.batch
    rows = {}
    for method, res in methods.items():
        recs = res["records"]  # [rank][step]
        t_end = [max(r[s]["t"] for r in recs) for s in range(n)]
        loss = [statistics.fmean(r[s]["loss"] for r in recs) for s in range(n)]
        smooth = ema(loss)
        win_steps = n - first + 1
        t_before = [r[first - 2]["t"] if first >= 2 else 0.0 for r in recs]
        win_time = max(r[n - 1]["t"] - tb for r, tb in zip(recs, t_before))
        r0 = recs[0]
        b_before = r0[first - 2]["bytes"] if first >= 2 else 0
        rd_before = r0[first - 2]["rounds"] if first >= 2 else 0
        lo_before = r0[first - 2]["lo"] if first >= 2 else 0
        lo_end = r0[n - 1]["lo"]
        row = {
            "label": LABELS[method],
            "sps_compress": gb * win_steps / win_time,
            "sps_run": gb * n / t_end[-1],
            "step_s_compress": win_time / win_steps,
            "run_s": t_end[-1],
            "bytes_compress": (r0[n - 1]["bytes"] - b_before) / win_steps,
            "rounds_compress": (r0[n - 1]["rounds"] - rd_before) / win_steps,
            "bytes_run": r0[n - 1]["bytes"] / n,
            "rounds_run": r0[n - 1]["rounds"] / n,
            "lo_compress": None if lo_end is None or lo_before is None else (lo_end - lo_before) / win_steps / world,
            "lo_run": None if lo_end is None else lo_end / n / world,
            "final_loss": smooth[-1],
            # window means on rank 0: forward, backward incl. waiting for the exchange, optimizer step
            "fwd_ms": 1e3 * statistics.fmean(r0[s]["fwd"] for s in range(first - 1, n)),
            "bwd_ms": 1e3 * statistics.fmean(r0[s]["bwd"] for s in range(first - 1, n)),
            "opt_ms": 1e3 * statistics.fmean(r0[s]["opt"] for s in range(first - 1, n)),
            "loss": loss,
            "t": t_end,
            "phases": [r0[s]["phase"] for s in range(n)],
        }
        rows[method] = row
    if target is None:
        ref = rows.get("adamw") or next(iter(rows.values()))
        target = ema(ref["loss"])[max(0, round(0.75 * n) - 1)]
    for row in rows.values():
        smooth = ema(row["loss"])
        hit = next((s for s in range(n) if smooth[s] <= target), None)
        row["steps_to_target"] = None if hit is None else hit + 1
        row["time_to_target"] = None if hit is None else row["t"][hit]
    return {"rows": rows, "target": target, "window": [first, n]}


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def report(results: dict) -> None:
    """Tables and goals of a finished run (``--report-from``)."""
    meta = results["meta"]
    print(f"{meta['command']}\n{meta['machine']}, {meta['world_size']} ranks, {meta['date']}, model {meta.get('model')},"
          f" {meta['steps']} steps, freeze {meta['freeze']}, repeats {meta.get('repeats', 1)}")
    for entry in results["rates"]:
        raw = {"compute_s": entry["compute_s"]}
        print_table(entry["rate"], entry["summary"], raw,
                    f"load avg before {entry['load_before']}, after {entry['load_after']}")
        if "adamw" in entry["summary"]["rows"] and entry["bits_per_s"] is not None:
            print(f"AdamW communication share at {entry['rate']} (vs its unthrottled step):"
                  f" {100 * comm_share(results, entry):.0f}%")
    cost_model_check(results)
    print("\n=== goals (measured figures) ===")
    for line in goals(results):
        print(line)


LOOPBACK_BITS_PER_S = 8.8e9  # gloo through an unthrottled namespace loopback: `--probe --rates unlimited`


def cost_model_check(results: dict) -> None:
    """Step time predicted by ``T(rate) = K + 8·n·B / rate`` against the measured one.

    ``K = T(unlimited) - 8·n·B / 8.8 Gbit/s``: the method's compression-phase step on the
    unthrottled loopback less its transfer at loopback speed (compute plus compression
    overhead); ``B``: bytes sent per rank per step (counters); ``n·B``: every rank's bytes share
    the one rate-limited loopback. Rounds x latency is left out: ~0.1 ms per round on loopback
    (`--probe`), under 1 ms per step here; on a real network add rounds x RTT.
    """
    unl = next((r for r in results["rates"] if r["bits_per_s"] is None), None)
    if unl is None:
        return
    n = results["meta"]["world_size"]
    print("\n=== cost model check: predicted / measured compression-phase step (s) ===")
    finite = [r for r in results["rates"] if r["bits_per_s"]]
    print(f"{'method':<24} {'K':>7} " + " ".join(f"{r['rate']:>17}" for r in finite))
    for m, row in unl["summary"]["rows"].items():
        cells = []
        for r in finite:
            meas = r["summary"]["rows"].get(m)
            if meas is None:
                cells.append(f"{'-':>17}")
                continue
            k = row["step_s_compress"] - 8 * n * row["bytes_compress"] / LOOPBACK_BITS_PER_S
            pred = k + 8 * n * meas["bytes_compress"] / r["bits_per_s"]
            cells.append(f"{pred:6.2f}/{meas['step_s_compress']:5.2f} {pred / meas['step_s_compress']:4.2f}")
        k = row["step_s_compress"] - 8 * n * row["bytes_compress"] / LOOPBACK_BITS_PER_S
        print(f"{row['label']:<24} {k:7.3f} " + " ".join(cells))
    print("(each cell: predicted/measured ratio; > 1: the model overestimates, e.g. because DDP overlaps"
          " the exchange with backward)")


def print_table(rate: str, summary: dict, raw: dict, note: str) -> None:
    rows = summary["rows"]
    base = rows.get("adamw")
    first, n = summary["window"]
    print(f"\n=== {rate}  ({note}) ===")
    print(f"compression-phase window: steps {first}..{n}; target loss {summary['target']:.3f} (smoothed);"
          f" compute-only step {raw['compute_s'] * 1e3:.0f} ms")
    if base:
        share = 1 - raw["compute_s"] / base["step_s_compress"]
        print(f"AdamW step {base['step_s_compress']:.2f} s -> communication share ~{100 * share:.0f}% (1 - compute-only step / AdamW step)")
    hdr = (f"{'method':<24} {'samples/s':>9} {'xAdamW':>7} {'run s/s':>8} {'xAdamW':>7} {'B/step':>10}"
           f" {'fewer':>7} {'rounds':>6} {'run B/step':>10} {'run rnd':>7} {'lo B/step':>10}"
           f" {'t->target':>9} {'xAdamW':>7} {'loss':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows.values():
        x = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        ttt = f"{r['time_to_target']:.1f}" if r["time_to_target"] is not None else "never"
        speed_ttt = "-"
        if base and r["time_to_target"] is not None and base["time_to_target"] is not None:
            speed_ttt = f"{base['time_to_target'] / r['time_to_target']:.2f}"
        print(f"{r['label']:<24} {r['sps_compress']:>9.1f} {x(r['sps_compress'], base['sps_compress']) if base else '-':>7}"
              f" {r['sps_run']:>8.1f} {x(r['sps_run'], base['sps_run']) if base else '-':>7}"
              f" {fmt_bytes(r['bytes_compress']):>10} {x(base['bytes_compress'], r['bytes_compress']) if base else '-':>7}"
              f" {r['rounds_compress']:>6.1f} {fmt_bytes(r['bytes_run']):>10} {r['rounds_run']:>7.1f}"
              f" {fmt_bytes(r['lo_compress']):>10} {ttt:>9} {speed_ttt:>7} {r['final_loss']:>6.3f}")
    print("time per step in the window (rank 0, ms): forward | backward incl. waiting for the exchange |"
          " optimizer step (0/1 Adam: incl. its sync)")
    for r in rows.values():
        print(f"  {r['label']:<24} {r['fwd_ms']:7.0f} | {r['bwd_ms']:7.0f} | {r['opt_ms']:7.0f}"
              f"   (step {1e3 * r['step_s_compress']:.0f})")
    print("columns: samples/s = compression-phase window; run s/s = whole run; B/step and rounds = sent per rank"
          " per step in the window (counters); fewer = AdamW's B/step / this; run B/step, run rnd = whole-run"
          " means; lo B/step = measured on the namespace's loopback per rank (window, headers included);"
          " t->target = seconds to the target loss, xAdamW = AdamW's time / this (higher is faster)")


def comm_share(results: dict, entry: dict) -> float:
    """Share of AdamW's step spent on the throttled link at this rate.

    ``1 - AdamW step on the unthrottled loopback / AdamW step at this rate`` when the same run has
    an unlimited rate (robust: both are AdamW steps, measured the same way), else
    ``1 - compute-only step / AdamW step`` (the compute-only step is a 3-step sample at the
    start of each rate and suffers from machine load more).
    """
    step = entry["summary"]["rows"]["adamw"]["step_s_compress"]
    unl = [r for r in results["rates"] if r["bits_per_s"] is None and "adamw" in r["summary"]["rows"]]
    if entry["bits_per_s"] is not None and unl:
        return 1 - unl[0]["summary"]["rows"]["adamw"]["step_s_compress"] / step
    return 1 - entry["compute_s"] / step


def goals(results: dict) -> list[str]:
    """The throughput goals, evaluated on the measured figures (met or not)."""
    out = []
    rates = [r for r in results["rates"] if r["summary"]["rows"].get("adamw")]
    fmt = lambda ok: "MET " if ok else "MISSED"
    for r in rates:
        rows = r["summary"]["rows"]
        base = rows["adamw"]
        share = comm_share(results, r)
        tag = f"[{r['rate']}, AdamW comm share {100 * share:.0f}%]"
        ob = rows.get("onebit_adam")
        if ob:
            x = ob["sps_compress"] / base["sps_compress"]
            if share >= 0.75:
                out.append(f"{fmt(x >= 3)} 1-bit Adam >= 3x AdamW samples/s (compression phase): {x:.2f}x {tag}")
            ps = rows.get("powersgd")
            if ps and share >= 0.75:
                y = ob["sps_compress"] / ps["sps_compress"]
                out.append(f"{fmt(y >= 0.95)} 1-bit Adam >= 0.95x PowerSGD samples/s (compression phase): {y:.2f}x {tag}")
            zo = rows.get("zeroone_adam")
            if zo and share >= 0.75:
                z = zo["sps_run"] / ob["sps_run"]
                out.append(f"{fmt(z >= 1.5)} 0/1 Adam >= 1.5x 1-bit Adam samples/s over the whole run: {z:.2f}x {tag}")
        if r["bits_per_s"] is None:
            for m, row in rows.items():
                if m == "adamw":
                    continue
                a = row["sps_compress"] / base["sps_compress"]
                b = row["sps_run"] / base["sps_run"]
                out.append(f"{fmt(min(a, b) >= 0.95)} unlimited: {row['label']} >= 0.95x AdamW samples/s:"
                           f" {a:.2f}x compression phase, {b:.2f}x whole run")
    out += whole_run_goals(results)
    if rates:
        rows = rates[0]["summary"]["rows"]
        base = rows["adamw"]
        for m in ("onebit_adam", "onebit_lamb", "zeroone_adam", "binsgdm"):
            if m in rows and rows[m]["bytes_compress"]:
                f = base["bytes_compress"] / rows[m]["bytes_compress"] if rows[m]["bytes_compress"] else math.inf
                out.append(f"{fmt(f >= 25)} {LABELS[m]}: >= 25x fewer bytes/step than AdamW in the compression phase:"
                           f" {f:.1f}x")
        ob, zo = rows.get("onebit_adam"), rows.get("zeroone_adam")
        if ob and zo:
            fb = 1 - zo["bytes_run"] / ob["bytes_run"]
            fr = 1 - zo["rounds_run"] / ob["rounds_run"]
            out.append(f"{fmt(fb >= 0.8)} 0/1 Adam >= 80% fewer bytes than 1-bit Adam over the whole run: {100 * fb:.0f}%")
            out.append(f"{fmt(fr >= 0.5)} 0/1 Adam >= 50% fewer rounds than 1-bit Adam over the whole run: {100 * fr:.0f}%")
    return out


#: the phases in which a method still exchanges its warmup (1-bit Adam and LAMB: warmup; 0/1 Adam: variance)
WARMUP_PHASES = ("warmup", "variance")


def warmup_speed(row: dict, base: dict) -> float | None:
    """AdamW's time over this method's warmup steps / the method's time over the same steps.

    The steps are ``2 .. w``, ``w`` the last step whose recorded phase is a warmup phase (step 1
    pays DDP's first-iteration bucket and the buffers' allocation in every method); both times
    are wall times of the slowest rank (``row["t"]``: the end of every step). ``None`` without
    two warmup steps.
    """
    phases = row["phases"]
    last = max((s for s, ph in enumerate(phases) if ph in WARMUP_PHASES), default=None)
    if last is None or last < 2 or row is base:
        return None
    span = lambda r: r["t"][last] - r["t"][0]  # steps 2 .. last + 1 (0-based: 1 .. last)
    return span(base) / span(row)


def whole_run_goals(results: dict) -> list[str]:
    """The whole run at the library's defaults: every method against AdamW and PowerSGD at the
    slowest rate with AdamW, and the warmup's cost on the unthrottled loopback."""
    fmt = lambda ok: "MET " if ok else "MISSED"
    out = []
    for r in results["rates"]:
        rows = r["summary"]["rows"]
        base, ps = rows.get("adamw"), rows.get("powersgd")
        if base is None:
            continue
        ours = {m: row for m, row in rows.items() if m in ("onebit_adam", "zeroone_adam", "onebit_lamb", "binsgdm")}
        if r["bits_per_s"] is not None:
            for m, row in ours.items():
                x = row["sps_run"] / base["sps_run"]
                need = 4.5 if m == "onebit_adam" else 4.0
                out.append(f"{fmt(x >= need)} whole run at {r['rate']}: {row['label']} >= {need}x AdamW samples/s: {x:.2f}x")
                if ps:
                    y = row["sps_run"] / ps["sps_run"]
                    out.append(f"{fmt(y >= 1.3)} whole run at {r['rate']}: {row['label']} >= 1.3x PowerSGD samples/s:"
                               f" {y:.2f}x")
        else:
            for m, row in ours.items():
                w = warmup_speed(row, base)
                if w is not None:
                    out.append(f"{fmt(w >= 0.95)} unlimited: {row['label']}'s warmup >= 0.95x AdamW samples/s over the"
                               f" same steps: {w:.2f}x")
    return out


def _window_freeze(args) -> int:
    """The freeze step that the timing window starts from: under ``auto`` the latest it can be."""
    if args.freeze != "auto":
        return args.freeze
    from hf_onebit.optim.freeze import AutoFreeze

    return AutoFreeze.for_run(args.steps).max_step
