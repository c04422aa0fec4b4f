"""How `tahnode bench swarm` reports: the machine it ran on, the markdown tables, the section it
owns in docs/benchmarks-log.md (replaced on every run, the rest of the page kept), and the PNG plots."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

__all__ = ["machine", "markdown_table", "write_section", "pyplot_for", "save_figure", "plot_throughput", "plot_losses",
           "plot_convergence"]

BEGIN, END = "<!-- bench-swarm:{name}:begin -->", "<!-- bench-swarm:{name}:end -->"


def machine(device: str = "cpu") -> str:
    """CPU, memory, the GPU where `device` is one, Python, torch (and triton on a GPU), in one line."""
    import torch

    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    try:
        mem = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) / 2**20
    except (OSError, StopIteration):
        mem = 0
    gpu, triton = "no GPU used", ""
    if device.startswith("cuda") and torch.cuda.is_available():
        import triton as triton_module

        gpu, triton = f"GPU {torch.cuda.get_device_name(torch.device(device))}", f", triton {triton_module.__version__}"
    return (f"{os.cpu_count()} CPU cores ({model}), {mem:.0f} GiB, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}{triton}")


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def write_section(doc: Path, name: str, title: str, body: list[str], plots: list[Path], device: str = "cpu",
                  where: str | None = None) -> None:
    """Replace (or add at the end) the section `name` of the doc: `body` lines, then a line naming the
    machine (`where`, else this one with `device`) and the date, then the plots (linked relative to the doc)."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    links = [f"![{p.stem}]({os.path.relpath(p, doc.parent)})" for p in plots]
    dated = f"Machine: {where or machine(device)}. Date: {datetime.date.today().isoformat()}."
    section = "\n".join([begin, *body, "", dated, "", *links, end])
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n" + section + "\n"
    doc.write_text(text)


def pyplot_for(out: Path):
    """pyplot on a headless backend, with the plot's folder made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt, fig, axes, out: Path, legend_size: int = 8) -> Path:
    """Grid and legend on every axis, then the PNG at `out`."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_throughput(rows, out: Path) -> Path:
    """tokens/s against link rate per codec pair (and transport), its limit dashed; one panel per (stages, RTT)."""
    plt = pyplot_for(out)
    panels = sorted({(r.stages, r.rtt_ms) for r in rows})
    pairs = list(dict.fromkeys(r.series for r in rows))
    rates = sorted({r.rate_mbps for r in rows if r.rate_mbps}) + ([0.0] if any(not r.rate_mbps for r in rows) else [])
    xs = {rate: k for k, rate in enumerate(rates)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (stages, rtt) in zip(axes[0], panels):
        for k, pair in enumerate(pairs):
            sel = sorted((r for r in rows if r.series == pair and (r.stages, r.rtt_ms) == (stages, rtt)),
                         key=lambda r: xs[r.rate_mbps])
            if sel:
                ax.plot([xs[r.rate_mbps] for r in sel], [r.tokens_per_s for r in sel], "o-", color=f"C{k}", label=pair)
                ax.plot([xs[r.rate_mbps] for r in sel], [r.limit_tokens_per_s or float("nan") for r in sel], "--",
                        color=f"C{k}", alpha=0.6)
        ax.set_xticks(list(xs.values()), [f"{r:g}" if r else "unshaped" for r in xs])
        ax.set(xlabel="link rate, Mbit/s", ylabel="tokens/s (dashed: limit)", yscale="log",
               title=f"{stages} stages, RTT {rtt:g} ms")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_losses(rows, out: Path) -> Path:
    """Loss against step per codec pair and transport (the longest run of each)."""
    plt = pyplot_for(out)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for k, pair in enumerate(dict.fromkeys(r.series for r in rows)):
        runs = [r for r in rows if r.series == pair and r.losses]
        if runs:
            longest = max(runs, key=lambda r: len(r.losses))
            ax.plot(range(len(longest.losses)), longest.losses, color=f"C{k}", label=pair)
    ax.set(xlabel="step", ylabel="loss", title="loss per step (same seed and data)")
    return save_figure(plt, fig, [ax], out)


def plot_convergence(rows, reference: str, out: Path) -> Path:
    """One panel per codec pair side by side, each with the reference pair's curve in grey."""
    plt = pyplot_for(out)
    ref = next(r for r in rows if r.pair == reference)
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), sharey=True, squeeze=False)
    for k, (ax, r) in enumerate(zip(axes[0], rows)):
        if r.pair != reference:
            ax.plot(range(len(ref.losses)), ref.losses, color="0.7", label=reference)
        ax.plot(range(len(r.losses)), r.losses, color=f"C{k}", label=r.pair)
        ax.set(xlabel="step", title=r.pair)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("loss")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
