"""``privalign report RESULTS``: one self-contained HTML page with every figure and table."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from .results import read_csv


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if math.isinf(v):
            return "&infin;"
        return f"{v:.4g}"
    return html.escape(str(v))


def _table(rows: list[dict], columns=None) -> str:
    if not rows:
        return "<p><em>empty</em></p>"
    columns = columns or list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c, ''))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}"></figure>'


CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}
th{background:#f3f3f3}figure{margin:1em 0}img{max-width:100%}pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:12px}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}"""

SECTIONS = [
    ("summary.csv", "Accuracy, lift, proxy reward, win-rate and hacking gap versus n",
     ["curves_accuracy", "curves_hacking"],
     ["algorithm", "n", "accuracy", "accuracy_se", "lift", "lift_se", "lift_rel", "proxy_reward", "win_rate",
      "true_win_rate", "hacking_gap", "hacking_gap_se", "halting_time", "epsilon"]),
    ("ablation_sigma.csv", "Ablation: PrivBoN noise sigma (chosen on held-out prompts)", ["ablation_sigma"], None),
    ("ablation_beta_itp.csv", "Ablation: ITP beta", ["ablation_beta_itp"], None),
    ("ablation_beta_privitp.csv", "Ablation: PrivITP beta", ["ablation_beta_privitp"], None),
    ("noise_sweep.csv", "ITP versus PrivITP across noise", ["itp_vs_privitp"], None),
    ("multi_query_summary.csv", "Multi-query deployment: FSRC versus basic composition", ["fsrc_queries"], None),
    ("budget_table.csv", "Privacy budget table (App. G.3)", [], None),
]


def render(results_dir: str | Path) -> Path:
    """Write RESULTS_DIR/report.html (atomically) and return its path."""
    d = Path(results_dir)
    if not (d / "summary.csv").exists():
        raise FileNotFoundError(f"{d} is not a results directory (no summary.csv)")
    settings = json.loads((d / "settings.json").read_text()) if (d / "settings.json").exists() else {}
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>privalign results</title>"
             f"<style>{CSS}</style></head><body><h1>privalign results</h1>"]
    pool = settings.get("pool", {})
    meta = pool.get("metadata", {}) if isinstance(pool, dict) else {}
    headline = "true_win_rate" if meta.get("true_reward_source") == "gold" else "accuracy"
    parts.append(f"<p>Pool: {html.escape(str(pool.get('path', '')))} &middot; task "
                 f"{html.escape(str(meta.get('task', '')))} &middot; prompts {pool.get('prompts', '')} "
                 f"&middot; headline metric: <b>{headline}</b> &middot; privalign "
                 f"{html.escape(str(settings.get('privalign_version', '')))}</p>")
    for csv_name, title, figs, cols in SECTIONS:
        if not (d / csv_name).exists():
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>")
        for f in figs:
            if (d / f"{f}.png").exists():
                parts.append(_img(d / f"{f}.png"))
        parts.append(_table(read_csv(d / csv_name), cols))
    parts.append("<h2>Settings</h2><pre>" + html.escape(json.dumps(settings, indent=2)) + "</pre></body></html>")
    out = d / "report.html"
    tmp = d / ".report.html.tmp"
    tmp.write_text("".join(parts))
    tmp.replace(out)
    return out
