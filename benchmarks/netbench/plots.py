"""The plots of a benchmark run (and the helpers the convergence benchmark's plots share)."""

from __future__ import annotations

from pathlib import Path

from netbench import LABELS, METHODS
from netbench.report import ema, fmt_bytes


def footer(fig, text: str) -> None:
    fig.text(0.01, 0.01, text, fontsize=7, color="0.3", ha="left", va="bottom", wrap=True)


def save_plot(fig, how: str, path: Path, bottom: float = 0.05) -> Path:
    """Add the how-it-was-made footer, lay out above it, write the PNG and free the figure."""
    import matplotlib.pyplot as plt

    footer(fig, how)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: one colour per method in every plot (network.py and convergence.py)
COLORS = dict(zip(METHODS, ["black", "tab:gray", "tab:purple", "tab:blue", "tab:green", "tab:orange", "tab:red"]))


def make_plots(results: dict, plot_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plot_dir.mkdir(parents=True, exist_ok=True)
    meta = results["meta"]
    loads = [x for r in results["rates"] for x in (r["load_before"][0], r["load_after"][0])]
    how = (f"{meta['command']}  |  {meta['machine']}, {meta['world_size']} gloo ranks in one network namespace"
           f" (tbf on lo), {meta['date']}, 1-min load average {min(loads):.1f}-{max(loads):.1f} (other jobs"
           " shared the machine)")
    rates = results["rates"]
    methods = [m for m in METHODS if any(m in r["summary"]["rows"] for r in rates)]
    colors = COLORS
    markers = {m: mk for m, mk in zip(METHODS, "os^DvPX")}
    paths = []

    # 1. throughput vs bandwidth
    finite = sorted({r["bits_per_s"] for r in rates if r["bits_per_s"]})
    unl_x = (finite[-1] * 4) if finite else 1e9

    def xpos(r):
        return r["bits_per_s"] if r["bits_per_s"] else unl_x

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), sharey=True)
    for ax, key, title in ((axes[0], "sps_compress", "compression phase"), (axes[1], "sps_run", "whole run")):
        for m in methods:
            pts = sorted((xpos(r), r["summary"]["rows"][m][key]) for r in rates if m in r["summary"]["rows"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[m], color=colors[m], label=LABELS[m])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 200]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ticks = finite + ([unl_x] if any(r["bits_per_s"] is None for r in rates) else [])
        ax.set_xticks(ticks)
        ax.set_xticklabels([r_label(x) if x != unl_x else "unlimited" for x in ticks])
        ax.minorticks_off()
        ax.set_xlabel("loopback rate (aggregate of all ranks)")
        ax.set_title(f"samples/s, {title}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("samples / s (global batch)")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Throughput vs bandwidth: {model_title(results)}, {meta['world_size']} ranks,"
                 f" {meta['steps']} steps, freeze {meta['freeze']}")
    paths.append(save_plot(fig, how, plot_dir / "network_throughput.png"))

    # 2. bytes per step
    ref = rates[0]["summary"]["rows"]
    fig, ax = plt.subplots(figsize=(10, 5))
    xs = range(len(methods))
    w = 0.38
    comp = [ref[m]["bytes_compress"] if m in ref else 0 for m in methods]
    run = [ref[m]["bytes_run"] if m in ref else 0 for m in methods]
    b1 = ax.bar([x - w / 2 for x in xs], comp, w, label="compression phase (mean per step)", color="tab:blue")
    b2 = ax.bar([x + w / 2 for x in xs], run, w, label="whole run (mean per step)", color="tab:gray")
    for bars in (b1, b2):
        for b in bars:
            if b.get_height() > 0:
                ax.text(b.get_x() + b.get_width() / 2, b.get_height() * 1.1, fmt_bytes(b.get_height()),
                        ha="center", fontsize=7, rotation=90)
    ax.set_yscale("log")
    ax.set_ylim(top=max(run + comp) * 20)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([LABELS[m] for m in methods], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("bytes sent per rank per step")
    ax.set_title("Bytes on the wire per step (counters; hf_onebit/comm/stats.py accounting)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    paths.append(save_plot(fig, how, plot_dir / "network_bytes.png"))

    # 3. loss vs wall time at the slowest and fastest rate; loss vs step
    shown = [min((r for r in rates if r["bits_per_s"]), key=lambda r: r["bits_per_s"], default=None),
             next((r for r in rates if r["bits_per_s"] is None), None)]
    shown = [r for r in shown if r is not None] or rates[:1]
    ref_loss = ema((shown[0]["summary"]["rows"].get("adamw") or next(iter(shown[0]["summary"]["rows"].values())))["loss"])
    span = max(ref_loss) - min(ref_loss)
    ylim = (min(ref_loss) - 0.5 * span, max(ref_loss) + 0.8 * span)  # divergent curves leave the frame
    fig, axes = plt.subplots(1, len(shown) + 1, figsize=(6 * (len(shown) + 1), 5))
    for ax, r in zip(axes, shown):
        for m in methods:
            row = r["summary"]["rows"].get(m)
            if row:
                ax.plot(row["t"], ema(row["loss"]), color=colors[m], label=LABELS[m])
        ax.axhline(r["summary"]["target"], color="0.5", ls=":", lw=1)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("training loss (EMA 0.8, mean of ranks)")
        ax.set_ylim(*ylim)
        ax.set_title(f"loss vs wall time at {r['rate']}")
        ax.grid(True, alpha=0.3)
    ax = axes[-1]
    r = shown[0]
    for m in methods:
        row = r["summary"]["rows"].get(m)
        if row:
            ax.plot(range(1, len(row["loss"]) + 1), ema(row["loss"]), color=colors[m], label=LABELS[m])
    if isinstance(meta["freeze"], int):  # "auto": each method chose its own step (see the log)
        ax.axvline(meta["freeze"] + 0.5, color="0.5", ls="--", lw=1)
    ax.set_ylim(*ylim)
    ax.set_xlabel("step (dashed: end of warmup/freeze)")
    ax.set_title("loss vs step (same at every rate)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"Training loss of each method, {model_title(results)} (dotted line: target loss;"
                 " curves that leave the frame diverged)")
    paths.append(save_plot(fig, how, plot_dir / "network_loss.png"))
    return paths


def warmup_end(phases: list[str]) -> int | None:
    """The last step of a method's uncompressed warmup (0/1 Adam: its variance phase), from the
    per-step phases a run records; ``None`` for a method without one or that never left it. (The
    benchmark labels the steps of the methods without phases, AdamW and PowerSGD, "warmup" and
    "steady" by its own measuring window: no end of warmup for them.)"""
    ends = [i for i, ph in enumerate(phases) if ph not in ("warmup", "variance", "steady")]
    return ends[0] if ends and ends[0] > 0 else None


def seeds_loss_plot(runs: list[dict], path: Path) -> Path:
    """The same command at several ``--seed`` values (``--plot-from A.json B.json ...``): training
    loss against the step, one panel per run, on one scale; each method's end of warmup dashed in
    its colour. What one seed's curve cannot show: whether a gap is the method's or the draw's."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 5), sharey=True, squeeze=False)
    ref = ema(runs[0]["rates"][0]["summary"]["rows"]["adamw"]["loss"])
    span = max(ref) - min(ref)
    for ax, results in zip(axes[0], runs):
        rows = results["rates"][0]["summary"]["rows"]
        seed = re.search(r"--seed (\d+)", results["meta"]["command"])
        for m in [m for m in METHODS if m in rows]:
            ax.plot(range(1, len(rows[m]["loss"]) + 1), ema(rows[m]["loss"]), color=COLORS[m], label=LABELS[m])
            end = warmup_end(rows[m].get("phases") or [])
            if end is not None:
                ax.axvline(end + 0.5, color=COLORS[m], ls="--", lw=1)
        ax.set_ylim(min(ref) - 0.3 * span, max(ref) + 0.3 * span)
        ax.set_xlabel("step (dashed: each method's end of warmup)")
        ax.set_title(f"--seed {seed.group(1) if seed else 0} ({results['meta']['date']})")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("training loss (EMA 0.8, mean of ranks)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"Training loss at {len(runs)} seeds: {model_title(runs[0])}, {runs[0]['meta']['steps']} steps,"
                 f" freeze {runs[0]['meta']['freeze']}")
    how = " | ".join(dict.fromkeys(r["meta"]["command"].split(" --json")[0] for r in runs))
    return save_plot(fig, how + f" | {runs[0]['meta']['machine']}", path, bottom=0.09)


def model_title(results: dict) -> str:
    m = results["meta"].get("model", "scratch")
    n = results["params"] / 1e6
    if m == "minilm":
        return f"all-MiniLM-L6-v2 sentiment fine-tuning ({n:.1f}M trainable params)"
    return f"BERT from a config, MLM ({n:.1f}M params)"


def r_label(bits: float) -> str:
    for unit, div in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= div:
            v = bits / div
            return f"{v:g}{unit}"
    return f"{bits:g}bit"


def two_node_plot(results: dict, path: Path) -> Path:
    """benchmarks/two_nodes.py: samples/s of every method at every inter-node rate, and the bytes
    per step that crossed between the nodes (counted, and measured on the veth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = results["rates"]
    methods = list(rates[0]["summary"]["rows"])
    fig, (speed, wire) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(rates)
    for i, entry in enumerate(rates):
        rows, link = entry["summary"]["rows"], entry["link"]
        xs = [k + i * width for k in range(len(methods))]
        bars = speed.bar(xs, [rows[m]["sps_compress"] for m in methods], width, label=entry["rate"])
        speed.bar_label(bars, fmt="%.1f", fontsize=7)
        wire.bar(xs, [link[m]["inter_measured"] for m in methods], width, label=f"{entry['rate']}, on the veth")
        wire.scatter(xs, [max(link[m]["inter_counted"], 1) for m in methods], color="black", marker="_", s=200,
                     zorder=3, label="counted" if i == 0 else None)
    for ax in (speed, wire):
        ax.set_xticks([k + width * (len(rates) - 1) / 2 for k in range(len(methods))])
        ax.set_xticklabels([LABELS.get(m, m) for m in methods], rotation=20, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    speed.set_ylabel("samples/s, compression phase (all ranks)")
    speed.set_title("2 nodes x 2 ranks: throughput")
    wire.set_yscale("log")
    wire.set_ylabel("bytes per step between the nodes (both directions)")
    wire.set_title("what crossed the inter-node link")
    loads = [x for r in rates for x in (r["load_before"][0], r["load_after"][0])]
    meta = results["meta"]
    how = (f"{meta['command']}  |  {meta['machine']}, 2 namespaces x 2 gloo ranks, veth rate-limited with tc tbf"
           f"  |  {meta['date']}, load average {min(loads):.1f}-{max(loads):.1f}")
    return save_plot(fig, how, path, bottom=0.07)
