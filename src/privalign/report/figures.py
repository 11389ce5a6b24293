"""Figures (matplotlib, PNG and PDF) from a results directory's tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = {"bon": "#d62728", "privbon": "#1f77b4", "privbon-gaussian": "#17becf", "itp": "#2ca02c",
          "privitp": "#9467bd"}
LABELS = {"bon": "BoN", "privbon": "PrivBoN (Gumbel)", "privbon-gaussian": "PrivBoN (Gaussian)",
          "itp": "ITP", "privitp": "PrivITP"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> list[str]:
    files = []
    for ext in ("png", "pdf"):
        path = out / f"{name}.{ext}"
        fig.savefig(path, dpi=130, bbox_inches="tight")
        files.append(path.name)
    _plt().close(fig)
    return files


def curves(summary: list[dict], out: Path, metrics, name: str, title: str) -> list[str]:
    """One panel per metric, metric versus n (log2 axis) per algorithm with +-1 SE bands."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8))
    axes = np.atleast_1d(axes)
    algos = list(dict.fromkeys(r["algorithm"] for r in summary))
    for ax, (metric, ylabel) in zip(axes, metrics):
        for algo in algos:
            rows = sorted((r for r in summary if r["algorithm"] == algo), key=lambda r: r["n"])
            n = np.array([r["n"] for r in rows], float)
            y = np.array([r[metric] for r in rows], float)
            se = np.array([r.get(metric + "_se", 0.0) or 0.0 for r in rows], float)
            if not np.isfinite(y).any():
                continue
            ax.plot(n, y, marker="o", ms=3, color=COLORS.get(algo), label=LABELS.get(algo, algo))
            ax.fill_between(n, y - se, y + se, color=COLORS.get(algo), alpha=0.2, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (candidates)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, out, name)


def ablation(rows: list[dict], chosen: float, out: Path, name: str, title: str) -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    for split, style in (("heldout", "o--"), ("eval", "s-")):
        rs = sorted((r for r in rows if r["split"] == split), key=lambda r: r["value"])
        v = np.array([r["value"] for r in rs])
        y = np.array([r["lift"] for r in rs])
        se = np.array([r["lift_se"] for r in rs])
        ax.errorbar(v, y, yerr=se, fmt=style, ms=4, capsize=2, label=f"{split} prompts")
    ax.axvline(chosen, color="k", lw=0.8, ls=":", label=f"chosen = {chosen:g}")
    ax.set_xscale("log")
    ax.set_xlabel(rows[0]["parameter"] if rows else "")
    ax.set_ylabel(f"accuracy lift (points) at n = {rows[0]['n'] if rows else ''}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, out, name)


def noise_sweep(rows: list[dict], out: Path, name: str = "itp_vs_privitp") -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    itp = [r for r in rows if r["algorithm"] == "itp"]
    priv = sorted((r for r in rows if r["algorithm"] == "privitp"), key=lambda r: r["sigma"])
    s = np.array([r["sigma"] for r in priv])
    y = np.array([r["accuracy"] for r in priv])
    se = np.array([r["accuracy_se"] for r in priv])
    ax.errorbar(s, y, yerr=se, fmt="o-", color=COLORS["privitp"], capsize=2, label="PrivITP")
    if itp:
        ax.axhline(itp[0]["accuracy"], color=COLORS["itp"], ls="--", label="ITP (no noise)")
        ax.axhspan(itp[0]["accuracy"] - itp[0]["accuracy_se"], itp[0]["accuracy"] + itp[0]["accuracy_se"],
                   color=COLORS["itp"], alpha=0.15)
    ax.set_xscale("log")
    ax.set_xlabel("total noise sigma = sigma_X + sigma_Z")
    ax.set_ylabel(f"accuracy at n = {priv[0]['n'] if priv else ''}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("ITP versus PrivITP across noise")
    return _save(fig, out, name)


def fsrc_bars(summary: list[dict], out: Path, name: str = "fsrc_queries") -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    sigmas = sorted({r["sigma"] for r in summary})
    width = 0.38
    x = np.arange(len(sigmas))
    for i, (comp, color) in enumerate((("fsrc", "#9467bd"), ("basic", "#7f7f7f"))):
        q = [next(r for r in summary if r["sigma"] == s and r["composition"] == comp) for s in sigmas]
        ax.bar(x + (i - 0.5) * width, [r["queries_mean"] for r in q], width,
               yerr=[r["queries_se"] for r in q], capsize=2, color=color,
               label="FSRC (ex-post)" if comp == "fsrc" else "basic composition")
    ax.set_xticks(x, [f"{s:g}" for s in sigmas])
    ax.set_xlabel("sigma (sigma_X = sigma_Z = sigma / 2)")
    ax.set_ylabel("queries answered")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("PrivITP queries under one budget")
    return _save(fig, out, name)
