"""Figures (matplotlib, PNG and PDF) from a results directory's tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = {"bon": "#d62728", "privbon": "#1f77b4", "privbon-gaussian": "#17becf", "itp": "#2ca02c",
          "privitp": "#9467bd"}
CAPPED_COLOR = "#e377c2"  # capped PrivITP (rows that carry max_rounds), apart from the uncapped mechanism
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


def _style(row) -> dict:
    eps = row.get("target_epsilon")
    dashed = eps not in (None, "", float("inf")) and isinstance(eps, (int, float)) and eps > 1.0
    capped = row["algorithm"] == "privitp" and row.get("max_rounds") not in (None, "")
    # large-n: ITP at its own beta per n; reproduce: PrivBoN at its own noise floor per n
    tuned = str(row.get("method", "")).startswith("ITP (beta tuned") or "tau tuned" in str(row.get("method", ""))
    return {"color": CAPPED_COLOR if capped else COLORS.get(row["algorithm"]),
            "ls": "--" if dashed else "-." if tuned else "-"}


def curves_ci(rows: list[dict], out: Path, name: str, title: str, caption_n: str = "") -> list[str]:
    """Accuracy versus n per method with 95% bootstrap bands (the headline figure)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["n"])
        n = np.array([r["n"] for r in rs], float)
        y = np.array([r["accuracy"] for r in rs], float)
        lo = np.array([r["accuracy_lo"] for r in rs], float)
        hi = np.array([r["accuracy_hi"] for r in rs], float)
        st = _style(rs[0])
        ax.plot(n, y, marker="o", ms=3, label=method, **st)
        ax.fill_between(n, lo, hi, color=st["color"], alpha=0.12, lw=0)
    if rows:
        ax.axhline(rows[0]["base_accuracy"], color="k", lw=0.8, ls=":", label="base policy (n = 1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n (candidates)")
    ax.set_ylabel("accuracy on held-out test prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=10)
    if caption_n:
        fig.text(0.01, -0.02, caption_n, fontsize=7, ha="left", va="top")
    return _save(fig, out, name)


def privacy_utility(rows: list[dict], out: Path, name: str = "privacy_utility", n: int = 16,
                    note: str = "") -> list[str]:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for algo, floor in (("privbon", False), ("privbon", True), ("privbon-gaussian", False), ("privitp", False)):
        # PrivBoN at its tuned noise floor ("tau tuned"): a plateau above epsilon*, dash-dotted
        rs = sorted((r for r in rows if r["algorithm"] == algo and ("tau tuned" in str(r.get("method", ""))) == floor),
                    key=lambda r: r["target_epsilon"])
        if not rs:
            continue
        e = np.array([r["target_epsilon"] for r in rs], float)
        ax.plot(e, [r["accuracy"] for r in rs], marker="o", ms=3, color=COLORS[algo], ls="-." if floor else "-",
                label=LABELS[algo] + (", noise floor tuned" if floor else ""))
        ax.fill_between(e, [r["accuracy_lo"] for r in rs], [r["accuracy_hi"] for r in rs], color=COLORS[algo],
                        alpha=0.12, lw=0)
    for algo, ls in (("bon", "--"), ("itp", "-.")):
        r = next((r for r in rows if r["algorithm"] == algo), None)
        if r:
            ax.axhline(r["accuracy"], color=COLORS[algo], ls=ls, lw=1, label=f"{LABELS[algo]} (not private)")
    if rows:
        ax.axhline(rows[0]["base_accuracy"], color="k", lw=0.8, ls=":", label="base policy")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon per query (worst case)")
    ax.set_ylabel(f"accuracy at n = {n}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Privacy-utility trade-off" + (f" ({note})" if note else ""), fontsize=10)
    return _save(fig, out, name)


def stream_bars(summary: list[dict], out: Path, name: str = "fsrc_stream") -> list[str]:
    """Queries answered within one budget, per stream (algorithm) and composition."""
    plt = _plt()
    algos = list(dict.fromkeys(r.get("algorithm") or "privitp" for r in summary))
    fig, axes = plt.subplots(1, max(len(algos), 1), figsize=(4.2 * max(len(algos), 1), 3.6), squeeze=False)
    colours = {"fsrc": "#9467bd", "basic": "#7f7f7f", "zcdp": "#2ca02c"}
    labels = {"fsrc": "FSRC", "basic": "basic", "zcdp": "zCDP"}
    for ax, algo in zip(axes[0], algos):
        sub = [r for r in summary if (r.get("algorithm") or "privitp") == algo]
        comps = [r["composition"] for r in sub]
        ax.bar(range(len(comps)), [r["queries_mean"] for r in sub],
               yerr=[[r["queries_mean"] - r["queries_min"] for r in sub],
                     [r["queries_max"] - r["queries_mean"] for r in sub]],
               capsize=3, color=[colours.get(c, "#777") for c in comps])
        ax.set_xticks(range(len(comps)), [labels.get(c, c) for c in comps])
        ax.set_ylabel(f"{'PrivITP' if algo == 'privitp' else 'Gumbel PrivBoN'} queries answered")
        s = sub[0]
        ax.set_title(f"epsilon {float(s['epsilon_max']):.3g} per query; one budget\n(epsilon {s['epsilon_total']:g}, "
                     f"delta {s['delta_total']:g})", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return _save(fig, out, name)


def audit_bars(rows: list[dict], out: Path, name: str = "audit") -> list[str]:
    """Empirical 95% lower bounds on epsilon against each mechanism's claim."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    x = np.arange(len(rows))
    ax.bar(x, [r["epsilon_lower_bound"] for r in rows], color=[COLORS.get(r["mechanism"], "#777") for r in rows])
    from matplotlib.patches import Patch

    # one legend entry for bars of every colour: a neutral swatch, not the first bar's colour
    ax.add_artist(ax.legend(handles=[Patch(facecolor="#cccccc", edgecolor="#555555",
                                           label="95% lower bound (Clopper-Pearson), one colour per mechanism")],
                            fontsize=7, loc="upper center"))
    for i, r in enumerate(rows):
        if np.isfinite(float(r["claimed_epsilon"])):  # "inf" once read back from JSON
            ax.plot([i - 0.4, i + 0.4], [float(r["claimed_epsilon"])] * 2, color="k", lw=1.5,
                    label="claimed epsilon" if i == 1 else None)
    ax.set_xticks(x, [LABELS.get(r["mechanism"], r["mechanism"]) for r in rows], fontsize=8)
    ax.set_ylabel("epsilon")
    ax.set_title(f"Empirical audit, {rows[0]['runs_per_side']:,} runs per side" if rows else "audit", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out, name)


def release_vs_queries(rows: list[dict], bon: float, base: float, out: Path, name: str = "release_vs_queries",
                       title: str = "") -> list[str]:
    """Accuracy against the number of queries one budget answers, one line per mode and total
    epsilon_w: per-query Gumbel PrivBoN under zCDP (falls with Q: each query gets less), and the head
    released once then BoN (flat in Q: its queries are free), with its 5th percentile over release
    draws as a dashed line; exact BoN and the base policy for scale."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.9))
    totals = sorted({r["epsilon_w"] for r in rows})
    cmap = plt.get_cmap("viridis")
    for i, e in enumerate(totals):
        rs = sorted((r for r in rows if r["epsilon_w"] == e), key=lambda r: r["queries"])
        q = np.array([r["queries"] for r in rs], float)
        color = cmap(i / max(len(totals) - 1, 1))
        per = np.array([np.nan if r["per_query_accuracy"] is None else r["per_query_accuracy"] for r in rs])
        ax.plot(q, per, marker="o", ms=3, color=color, ls=":", label=f"per-query PrivBoN, total {e:g}")
        ax.plot(q, [r["release_mean"] for r in rs], color=color, lw=2, label=f"released at {e:g}, then BoN")
        ax.plot(q, [r["release_p5"] for r in rs], color=color, lw=1, ls="--")
    ax.axhline(bon, color=COLORS["bon"], lw=1, label="BoN, exact head (not private)")
    ax.axhline(base, color="#777", lw=1, label="base policy")
    ax.set_xscale("log")
    ax.set_xlabel("queries answered within the budget (Q)")
    ax.set_ylabel(f"accuracy at n = {rows[0].get('n', 16) if rows else 16}")
    ax.set_title(title or "release once vs per-query noise (dashed: release's 5th percentile)", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.grid(alpha=0.3)
    return _save(fig, out, name)


def release_vs_n(rows: list[dict], bon: dict, base: float, out: Path, name: str = "release_vs_n",
                 title: str = "") -> list[str]:
    """Accuracy against n on the released head, one colour per epsilon_w: BoN (solid) and soft BoN at
    the temperature chosen on held-out prompts (dashed), means over release draws; exact BoN on the
    unreleased head and the base policy for scale. Every point is post-processing of one release."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.9))
    totals = sorted({r["epsilon_w"] for r in rows})
    cmap = plt.get_cmap("viridis")
    for i, e in enumerate(totals):
        color = cmap(i / max(len(totals) - 1, 1))
        for sel, ls in (("bon", "-"), ("soft", "--")):
            rs = sorted((r for r in rows if r["epsilon_w"] == e and r["selector"] == sel), key=lambda r: r["n"])
            if rs:
                tau = f" tau {rs[0]['tau']:g}" if sel == "soft" else ""
                ax.plot([r["n"] for r in rs], [r["mean"] for r in rs], color=color, ls=ls, marker="o", ms=2.5,
                        label=f"{'BoN' if sel == 'bon' else 'soft BoN' + tau}, released at {e:g}")
    ns = sorted(bon)
    ax.plot(ns, [bon[n] for n in ns], color=COLORS["bon"], lw=1.5, label="BoN, exact head (not private)")
    ax.axhline(base, color="#777", lw=1, label="base policy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("n (candidates)")
    ax.set_ylabel("accuracy")
    ax.set_title(title or "released head: BoN and soft BoN against n (means over release draws)", fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.grid(alpha=0.3)
    return _save(fig, out, name)


def release_persons(rows: list[dict], out: Path, name: str = "release-persons", title: str = "") -> list[str]:
    """Share of BoN's lift that a release keeps against the number of persons, one colour per
    epsilon_w: measured on heads trained on subsets of the persons (markers: mean, solid; 5th
    percentile of the release draws, dotted), and the planner's prediction from one head (w held
    fixed; dashed, the smallest head's; dash-dot, the largest's). The targets 90% / 80% for scale."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.0, 3.9))
    totals = sorted({r["epsilon_w"] for r in rows})
    cmap = plt.get_cmap("viridis")
    planners = sorted({r["from_persons"] for r in rows if r["kind"] == "planned"})
    for i, e in enumerate(totals):
        color = cmap(i / max(len(totals) - 1, 1))
        got = sorted((r for r in rows if r["kind"] == "measured" and r["epsilon_w"] == e and r["share_mean"] is not None),
                     key=lambda r: r["persons"])
        if got:
            ax.plot([r["persons"] for r in got], [r["share_mean"] for r in got], color=color, marker="o", ms=4,
                    label=f"measured, epsilon_w {e:g}: mean")
            ax.plot([r["persons"] for r in got], [r["share_p5"] for r in got], color=color, ls=":", marker="v", ms=3,
                    label=f"measured, epsilon_w {e:g}: 5th percentile")
        for own, ls in zip(planners, ("--", "-.")):
            plan = sorted((r for r in rows if r["kind"] == "planned" and r["epsilon_w"] == e and r["from_persons"] == own
                           and r["share_mean"] is not None), key=lambda r: r["persons"])
            if plan:
                ax.plot([r["persons"] for r in plan], [r["share_mean"] for r in plan], color=color, ls=ls, lw=1,
                        alpha=0.8, label=f"planner from the P = {own:,} head, epsilon_w {e:g}: mean")
    ax.axhline(0.9, color="#777", lw=0.8, ls="--")
    ax.axhline(0.8, color="#777", lw=0.8, ls=":")
    ax.axhline(0.0, color="#bbb", lw=0.8)
    ax.set_xscale("log")
    ax.set_ylim(-1.0, 1.1)
    ax.set_xlabel("persons P (k pairs each at most)")
    ax.set_ylabel("share of BoN's lift kept")
    ax.set_title(title or "release: share of BoN's lift kept against persons", fontsize=9)
    ax.legend(fontsize=5.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    ax.grid(alpha=0.3)
    return _save(fig, out, name)
