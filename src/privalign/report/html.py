"""``privalign report RESULTS``: one self-contained HTML page with every figure and table."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from ..accounting.zcdp import zcdp_rho_total
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
]


def render(results_dir: str | Path) -> Path:
    """Write RESULTS_DIR/report.html (atomically) and return its path."""
    d = Path(results_dir)
    if not (d / "summary.csv").exists():
        raise FileNotFoundError(f"{d} is not a results directory (no summary.csv)")
    settings = json.loads((d / "settings.json").read_text()) if (d / "settings.json").exists() else {}
    if (d / "headline.json").exists():
        return _write(d, render_reproduce(d, settings))
    if (d / "large_n.json").exists():
        return _write(d, render_large_n(d, settings))
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
    return _write(d, "".join(parts))


def _write(d: Path, text: str) -> Path:
    out = d / "report.html"
    tmp = d / ".report.html.tmp"
    tmp.write_text(text)
    tmp.replace(out)
    return out


def sig3(v) -> str:
    """A number to 3 significant figures for display (exact values stay in the CSV files)."""
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return html.escape(v)
    v = float(v)
    if math.isnan(v):
        return "n/a"
    if abs(v) < 1e-12:  # float noise of a difference (a lift of -2.15e-14 at n = 1) reads 0
        v = 0.0
    if math.isinf(v):
        return "&infin;"
    if v.is_integer() and abs(v) < 1e7:
        return f"{int(v):,}"
    return f"{v:.3g}"


def headline_sentences(h: dict, num=None, verdict=None, name=str) -> list[str]:
    """The reproduce headline (``headline.json``) as sentences, each measured figure with its target
    and verdict; ``num`` formats numbers, ``verdict`` a met / not met flag (HTML or plain text)."""
    num = num or (lambda v: f"{v:.3g}")
    verdict = verdict or (lambda ok: "met" if ok else "NOT MET")
    eps, n, out = h.get("target_epsilon", 1.0), h.get("n_ref", 16), []
    a = h.get("auc")
    if a:
        out.append(f"The reward model {name(str(a['reward']))} ranks a prompt's correct answers above its wrong ones "
                   f"with AUC {num(a['auc'])} on the test prompts"
                   + (f" (the policy's log-probability alone: {num(a['logprob_auc'])}); target >= 0.65 and above the "
                      f"log-probability: {verdict(a['met'])}." if "logprob_auc" in a else "."))
    b = h.get("bon_lift")
    if b:
        out.append(f"Best-of-N's lift at n = {n}: {num(b['points'])} points (95% CI {num(b['ci'][0])} to "
                   f"{num(b['ci'][1])}); the interval {'excludes' if b['excludes_zero'] else 'does not exclude'} 0.")
    k = h.get("privbon_keeps")
    if k and (k.get("share") is None or not math.isfinite(k["share"])):  # BoN has no lift to keep a share of
        out.append(f"Best-of-N has no lift at n = {n} ({num(k['bon_lift'])} points), so Gumbel PrivBoN's share of it "
                   f"is not defined; PrivBoN's own lift at epsilon = {num(eps)} per query: {num(k['privbon_lift'])} "
                   f"points; target 50% of BoN's lift: {verdict(False)}.")
    elif k:
        out.append(f"Gumbel PrivBoN at epsilon = {num(eps)} per query keeps {num(100 * k['share'])}% of BoN's lift at "
                   f"n = {n} ({num(k['privbon_lift'])} of {num(k['bon_lift'])} points); target 50%: {verdict(k['met'])}.")
    q = h.get("privitp_vs_itp")
    if q:
        out.append(f"PrivITP at the held-out-chosen sigma = {num(q['sigma'])} (chosen for accuracy alone, as in the "
                   f"paper) is {num(q['gap_points'])} points below ITP at n = {n}, at epsilon {num(q['epsilon'])} per "
                   f"query; target within 2 points: {verdict(q['met'])}.")
    q2 = h.get("privitp_at_target_vs_itp")
    if q2:
        out.append(f"Constrained to epsilon = {num(eps)} per query (beta and the phase split chosen on held-out "
                   f"prompts), PrivITP is {num(q2['gap_points'])} points below ITP at n = {n}; target within 2 "
                   f"points: {verdict(q2['met'])}.")
    r = h.get("regularisation")
    if r:
        out.append(f"At the largest n = {r['n']}, PrivBoN at epsilon = {num(r['epsilon'])} reaches {num(r['privbon'])} "
                   f"against BoN's {num(r['bon'])} ({num(r['difference_points'])} points); at least as accurate as "
                   f"BoN: {verdict(r['met'])}.")
    f = h.get("fsrc")
    if f:
        out.append(f"Under one budget, FSRC answers {num(f['fsrc_queries'])} PrivITP queries against "
                   f"{num(f['basic_queries'])} for basic composition ({num(f['ratio'])}x): {verdict(f['met'])}"
                   + (f"; zCDP answers {num(f['zcdp_queries'])} (at this worst case per query its conversion "
                      f"{'pays' if f['zcdp_queries'] > f['fsrc_queries'] else 'does not pay'})"
                      if f.get("zcdp_queries") is not None else "") + ".")
    z = h.get("zcdp")
    if z:
        out.append(f"Gumbel PrivBoN at epsilon = {num(z['epsilon'])} per query: one budget (epsilon "
                   f"{num(z['epsilon_total'])}, delta {num(z['delta_total'])}) answers {num(z['zcdp_queries'])} "
                   f"queries under zCDP against {num(z['basic_queries'])} under basic composition "
                   f"({num(z['ratio'])}x), at accuracy {num(z['zcdp_accuracy'])} over the stream: "
                   f"{verdict(z['met'])}.")
    fl = (h.get("noise_floor") or {}).get(f"{eps:g}")
    if fl:
        out.append(_floor_sentence(fl, eps, num))
    rel = h.get("release")
    if rel and rel.get("at"):
        out.append(_release_sentence(rel, num, verdict, name))
    return out


def _floor_sentence(fl: dict, eps: float, num) -> str:
    """Gumbel PrivBoN's noise floor at the largest n: the tau the held-out prompts chose, what it
    spends, and where privacy is free (epsilon*)."""
    n = max(fl, key=int)
    r = fl[n]
    head = (f"Gumbel PrivBoN's noise floor, chosen per n on the held-out prompts: at n = {n}, tau = "
            f"{num(r['temperature'])} (sigma {num(r['sigma'])}) spends {num(r['epsilon_spent'])} of epsilon = "
            f"{num(eps)} per query and reaches {num(r['accuracy'])}, against {num(r['minimum_noise_accuracy'])} at the "
            f"minimum noise and BoN's {num(r['bon_accuracy'])}; ")
    if r["binds"]:
        return head + f"privacy is free above epsilon* = {num(r['epsilon_star'])} per query (more noise selects better)."
    return head + f"the floor does not bind: epsilon* lies above {num(eps)} (more noise than privacy needs selects no better here)."


def _release_sentence(rel: dict, num, verdict, name) -> str:
    """The release's headline sentence: the share of BoN's lift a head released once keeps, by epsilon_w."""
    rows = sorted(rel["at"].values(), key=lambda r: r["epsilon_w"])
    pct = (lambda v: "-" if v is None else f"{num(100 * v)}%")
    shares = "; ".join(f"{num(r['epsilon_w'])}: {pct(r['share_mean'])} ({pct(r['share_p5'])})" for r in rows)
    meets = [r for r in rows if r["share_mean"] is not None and r["share_mean"] >= 0.9 and r["share_p5"] >= 0.8]
    if all(r["share_mean"] is None for r in rows):  # BoN has no lift on the test prompts to keep a share of
        return (f"The head {name(str(rel['name']))} released once (P = {rel['persons']} persons): BoN with the "
                f"exact head has no lift at n = {rel['n']} on the test prompts ({num(rel.get('bon', math.nan))} against "
                f"the base policy's {num(rel.get('base', math.nan))}), so the share a release keeps "
                f"is not defined; released then BoN, by epsilon_w: "
                + "; ".join(f"{num(r['epsilon_w'])}: {num(r['mean'])} ({num(r['p5'])})" for r in rows)
                + f". Target >= 90% of the lift: {verdict(False)}.")
    return (f"The head {name(str(rel['name']))} released once (P = {rel['persons']} persons, k = "
            f"{rel['pairs_per_person']} pairs each, delta_w = {num(rel['delta_w'])}), then BoN at n = "
            f"{rel['n']}, with every later query free, keeps this share of BoN's lift by epsilon_w (5th "
            f"percentile over release draws): {shares}. Target >= 90% on average and >= 80% at the 5th "
            f"percentile at some epsilon_w: "
            + (f"{verdict(True)} from epsilon_w = {num(meets[0]['epsilon_w'])}." if meets else
               f"{verdict(False)} up to epsilon_w = {num(rows[-1]['epsilon_w'])}.") + _smallest_sentence(rel, num)
            + _mode_sentence(rel, meets, num))


def _mode_sentence(rel: dict, meets: list, num) -> str:
    """Which mode a deployment with this head should use, and at what epsilon_w: the release once at
    the smallest epsilon_w that meets the target (or the smallest on the grid that does), when that is
    within the largest epsilon_w studied; else per-query PrivBoN."""
    sm = rel.get("smallest") or {}
    largest = max(r["epsilon_w"] for r in rel["at"].values())
    eps = sm.get("epsilon_w") if sm.get("met") else (meets[0]["epsilon_w"] if meets else None)
    if eps is None or eps > largest:  # beyond the study's largest epsilon_w: no privacy worth the name
        need = "" if eps is None else f" (it would need epsilon_w = {num(eps)}, above the largest studied, {num(largest)})"
        return (f" Recommended mode: per-query PrivBoN: a release keeps too little of BoN's lift at these "
                f"epsilon_w{need}; `privalign plan --target-share` says how many persons it would need.")
    at = meets[0] if meets else min(rel["at"].values(), key=lambda r: abs(r["epsilon_w"] - eps))
    qs = sorted(int(k[len("per_query_q"):]) for k in at if k.startswith("per_query_q"))
    vs = (f"; for comparison, within a total of epsilon_w = {num(at['epsilon_w'])}, per-query PrivBoN over {qs[-1]:,} queries "
          f"reaches {num(at[f'per_query_q{qs[-1]}'])} against the release's {num(at['mean'])}") if qs else ""
    return (f" Recommended mode for a deployment with this head: release it once at epsilon_w = {num(eps)} "
            f"(delta_w = {num(rel['delta_w'])}), then BoN, every query free{vs}.")


def _smallest_sentence(rel: dict, num) -> str:
    """Where the target is first met: the bisection on epsilon_w of ``release.smallest_epsilon``."""
    sm = rel.get("smallest")
    if not sm or sm.get("share_mean") is None:
        return ""
    got = f"{num(100 * sm['share_mean'])}% on average, {num(100 * sm['share_p5'])}% at the 5th percentile"
    if sm["met"]:
        return (f" The smallest epsilon_w that meets it is {num(sm['epsilon_w'])} ({got}, over {sm['draws']} "
                f"draws; bisection to 5%).")
    return f" Not even epsilon_w = {num(sm['bounds'][1])} meets it ({got})."


def _verdict(ok) -> str:
    return "<b style='color:#2a7'>met</b>" if ok else "<b style='color:#c33'>not met</b>"


def _details(title: str, body: str) -> str:
    return f"<details><summary>{html.escape(title)}</summary>{body}</details>"


def _audit_section(d: Path) -> str:
    """The empirical privacy audit (``privalign audit``) of the reward model, when one is attached."""
    a = json.loads((d / "audit.json").read_text())
    names = {"bon": "BoN (not private)", "privbon": "PrivBoN (Gumbel)", "privbon-gaussian": "PrivBoN (Gaussian)",
             "privitp": "PrivITP", "privitp-capped": "PrivITP capped (T = 1 of n = 2)"}
    rows = "".join(
        f"<tr><td>{names.get(r['mechanism'], html.escape(r['mechanism']))}</td><td>{sig3(r['claimed_epsilon'])}</td>"
        f"<td>{sig3(r['delta'])}</td><td>{sig3(r['epsilon_lower_bound'])}</td>"
        f"<td>{r['successes_D']:,} vs {r['successes_D_prime']:,} of {r['runs_per_side']:,}</td></tr>"
        for r in a["rows"])
    private = [r for r in a["rows"] if r["mechanism"] != "bon"]
    holds = all(r["epsilon_lower_bound"] <= float(r["claimed_epsilon"]) for r in private)
    bon = next((r for r in a["rows"] if r["mechanism"] == "bon"), None)
    text = (f"A canary person in the reward model's preference data, the model retrained with and without it, each "
            f"mechanism run many times on the candidate pair the canary moves most; 95% Clopper-Pearson lower bounds "
            f"on epsilon. The realised score change was {sig3(a['realised_sensitivity'])} against the certified "
            f"Delta_r = {sig3(a['certified_sensitivity'])}. "
            + (f"The attack has power: BoN's lower bound is {sig3(bon['epsilon_lower_bound'])}. " if bon else "")
            + ("Every private mechanism's lower bound stays at or below its claim." if holds else
               "<b>A private mechanism's lower bound exceeds its claim.</b>")
            + " A lower bound far below the claim means the claim is not violated, not that it is tight.")
    img = _img(d / "audit.png") if (d / "audit.png").exists() else ""
    return (f"<h2>Empirical privacy audit</h2>{img}<p>{text}</p><table><thead><tr><th>mechanism</th>"
            "<th>claimed epsilon</th><th>delta</th><th>95% lower bound</th><th>target selections, D vs D'</th>"
            f"</tr></thead><tbody>{rows}</tbody></table><p><i>Model {html.escape(str(a.get('model', '?')))}; "
            f"command: <code>privalign audit --model ... --pool TRAIN_POOL --runs "
            f"{a['rows'][0]['runs_per_side'] if a['rows'] else '?'}</code> (docs/accounting.md).</i></p>")


def render_reproduce(d: Path, settings: dict) -> str:
    """The reproduce report: a narrative first screen, then every figure, raw tables collapsed."""
    h = json.loads((d / "headline.json").read_text())
    items = headline_sentences(h, num=sig3, verdict=_verdict, name=html.escape) + _edge_sentences(h)
    verdicts = "<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"
    p = [f"<!doctype html><html><head><meta charset='utf-8'><title>privalign: private selection on real data</title>"
         f"<style>{CSS}</style></head><body><h1>Private Best-of-N on real data</h1>"]
    run = (f"privalign {html.escape(str(settings.get('privalign_version', '?')))}, "
           f"{html.escape(str(settings.get('created', '?')))}"
           + (f", <code>{html.escape(settings['command'])}</code>" if settings.get("command") else ""))
    p.append(f"<p><i>{run}</i></p><h2>Verdicts</h2>{verdicts}")
    p.append(_what_was_run(h, settings))
    p.append(_privacy_summary(d, h, settings))
    p += _figures(d, h)
    if (d / "audit.json").exists():
        p.append(_audit_section(d))
    p += _raw_tables(d, settings)
    p.append("</body></html>")
    return "".join(p)


def _reward_info(settings: dict) -> tuple[dict, str, dict, dict]:
    """(the pool's metadata, the selection reward's name, its reward_model_info, its certificate)."""
    pool = settings.get("pool", {})
    meta = pool.get("metadata", {}) if isinstance(pool, dict) else {}
    reward = settings.get("evaluation", {}).get("reward") or meta.get("default_reward")
    rm = meta.get("reward_model_info", {}).get(reward, {})
    return meta, reward, rm, rm.get("certificate", {})


def _edge_sentences(h: dict) -> list[str]:
    """Tuned values on the edge of their grid, as one sentence (none: [])."""
    edges = []
    for t, per in h.get("edges", {}).items():
        if t == "itp":
            if per.get("edge"):
                edges.append(f"ITP beta = {sig3(per['beta'])}")
            continue
        for algo, c in per.items():
            if c.get("edge"):
                edges.append(f"{algo} at epsilon {t}: {', '.join(c.get('edge_parameters', []))} "
                             f"(beta = {sig3(c.get('beta'))}, phase-1 fraction = {sig3(c.get('phase1_fraction'))})")
    return ["Tuned values on the edge of their grid (the optimum may lie beyond it): " + "; ".join(edges) + "."] if edges else []


def _what_was_run(h: dict, settings: dict) -> str:
    """The policy, the task, the reward model and its certificate, and the held-out / test split."""
    pool = settings.get("pool", {})
    meta, reward, rm, cert = _reward_info(settings)
    samp = meta.get("sampling", {})
    return (
        f"<p><b>What was run.</b> The policy <b>{html.escape(str(meta.get('base_model', '?')))}</b> answered "
        f"{pool.get('prompts', '?')} prompts of the <b>{html.escape(str(meta.get('task', '?')))}</b> task "
        f"({samp.get('samples', '?')} samples each, temperature {samp.get('temperature', '?')}); a grader marks each "
        f"answer right or wrong. The reward model <b>{html.escape(str(reward))}</b> was trained on private "
        f"preference pairs: m = {sig3(cert.get('m'))} pairs, k = {sig3(cert.get('pairs_per_person'))} pair(s) per "
        f"person, lambda = {sig3(cert.get('lambda'))}, certified sensitivity Delta_r = {sig3(rm.get('sensitivity'))} "
        f"on the declared range [{sig3((rm.get('output_range') or [None, None])[0])}, "
        f"{sig3((rm.get('output_range') or [None, None])[1])}]"
        + (f" ({html.escape(str(cert['hyperparameters']))})" if cert.get("hyperparameters") else "")
        + (f"; within-prompt AUC on the test prompts {sig3(h['auc']['auc'])}"
           + (f" (log-probability alone: {sig3(h['auc']['logprob_auc'])})" if "logprob_auc" in h["auc"] else "")
           if h.get("auc") else "")
        + (f"; the range itself was released privately, a one-time epsilon of {sig3(cert.get('range_epsilon'))}"
           if cert.get("range_epsilon") else "") + ". Tuning used "
        f"{settings.get('heldout_prompts', '?')} held-out prompts; every number below is measured on the other "
        f"{settings.get('test_prompts', '?')} (test) prompts.</p>")


def _privacy_summary(d: Path, h: dict, settings: dict) -> str:
    """Each private method's worst-case epsilon and delta per query, the queries one budget answers
    under each composition, and its accuracy at n_ref; the one-time range release."""
    ev = settings.get("evaluation", {})
    cert = _reward_info(settings)[3]
    eps, n = h.get("target_epsilon", 1.0), h.get("n_ref", 16)
    rows = []
    summary = read_csv(d / "stream_summary.csv") if (d / "stream_summary.csv").exists() else []
    stream = {(r.get("algorithm") or "privitp", r["composition"]): r for r in summary}
    util = read_csv(d / "privacy_utility.csv") if (d / "privacy_utility.csv").exists() else []
    for algo, label in (("privbon", "PrivBoN (Gumbel)"), ("privbon-gaussian", "PrivBoN (Gaussian)"), ("privitp", "PrivITP")):
        r = next((r for r in util if r["algorithm"] == algo and r["target_epsilon"] == eps), None)
        if r is None:
            continue
        delta = ev.get("delta") if algo == "privitp" else 0.0
        q = ""
        got = {c: stream.get((algo, c)) for c in ("fsrc", "basic", "zcdp")}
        if algo == "privitp" and got["fsrc"]:
            q = (f"{sig3(got['fsrc']['queries_mean'])} (FSRC) / {sig3(got['basic']['queries_mean'])} (basic)"
                 + (f" / {sig3(got['zcdp']['queries_mean'])} (zCDP)" if got["zcdp"] else "")
                 + f" within epsilon {sig3(got['fsrc']['epsilon_total'])}, delta {sig3(got['fsrc']['delta_total'])}")
        elif algo != "privitp":
            total = float(summary[0]["epsilon_total"]) if summary else 20.0
            dtot = float(summary[0]["delta_total"]) if summary else 1e-3
            per_rho = r["worst_case_epsilon"] ** 2 / (8 if algo == "privbon" else 2)
            zq = int(zcdp_rho_total(total, dtot) // per_rho) if per_rho > 0 else None
            q = (f"{int(total // r['worst_case_epsilon'])} (basic) / {zq} (zCDP) within epsilon {sig3(total)}, "
                 f"delta {sig3(dtot)}")
        rows.append(f"<tr><td>{label}</td><td>{sig3(r['worst_case_epsilon'])}</td><td>{sig3(delta)}</td>"
                    f"<td>{q}</td><td>{sig3(100 * r['accuracy'])}%</td></tr>")
    if cert.get("range_epsilon"):
        rows.append(f"<tr><td>reward model's output range (released once)</td><td>{sig3(cert['range_epsilon'])} "
                    f"(once, not per query)</td><td>0</td><td>all</td><td></td></tr>")
    return ("<h2>Privacy summary</h2><table><thead><tr><th>method</th><th>epsilon per query (worst case)</th>"
            "<th>delta per query</th><th>queries answered in one total budget</th>"
            f"<th>accuracy at n = {n} (% of answers right)</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _figures(d: Path, h: dict) -> list[str]:
    """The headline figure and every other figure the run wrote, each with its caption."""
    eps, n = h.get("target_epsilon", 1.0), h.get("n_ref", 16)
    p = []
    base = h.get("base_accuracy")
    p.append("<h2>Headline</h2>")
    if (d / "headline.png").exists():
        p.append(_img(d / "headline.png"))
    p.append(f"<p><i>Accuracy of each selection method as the number of candidates n grows, private methods at "
             f"epsilon = {sig3(eps)} per query; the base policy (one sample) is at {sig3(base)}. Bands: 95% "
             f"bootstrap intervals over test prompts.</i></p>")
    for fig, title, caption in (
            ("privacy_utility", "Privacy-utility", f"Accuracy at n = {n} against the worst-case epsilon per query; "
                                                    "PrivITP keeps the beta and phase split tuned at the first target."),
            ("curves_all_targets", "Every target", "Each private method at each target epsilon (dashed: epsilon > 1)."),
            ("itp_vs_privitp", "ITP versus PrivITP across noise", "The paper's noise split sigma_X = sigma_Z = sigma/2; "
                                                                "the CSV gives each sigma's epsilon."),
            ("fsrc_stream", "Many queries, one budget", "Real PrivITP queries at the first target's worst case, and "
                                                        "Gumbel PrivBoN queries at a small epsilon, until the budget is "
                                                        "spent, under each composition; bars: mean (min-max) over seeds.")):
        if (d / f"{fig}.png").exists():
            p.append(f"<h2>{title}</h2>" + _img(d / f"{fig}.png") + f"<p><i>{caption}</i></p>")
    for fig, title, caption in (
            ("release_vs_queries", "Release once, or noise every query",
             "The certified head released once with Gaussian noise at epsilon_w (its 5th percentile over release "
             "draws dashed), then BoN, against Gumbel PrivBoN at the largest epsilon per query that zCDP admits Q "
             "times within the same total; test prompts."),
            ("release_vs_n", "The released head at every n",
             "BoN and soft BoN on the released head; the soft-BoN temperature is chosen on held-out prompts "
             "against reward hacking and is not a privacy parameter.")):
        if (d / f"{fig}.png").exists():
            p.append(f"<h2>{title}</h2>" + _img(d / f"{fig}.png") + f"<p><i>{caption}</i></p>")
    return p


def _raw_tables(d: Path, settings: dict) -> list[str]:
    """Every table the run wrote, and the settings, collapsed."""
    p = []
    p.append("<h2>Raw tables</h2>")
    for name, title in (("summary.csv", "Accuracy versus n (test prompts)"), ("tuning.csv", "Tuning (held-out prompts)"),
                        ("privacy_utility.csv", "Privacy-utility"), ("noise_sweep.csv", "ITP versus PrivITP"),
                        ("ablation_sigma_privitp.csv", "PrivITP sigma chosen for accuracy alone"),
                        ("stream_summary.csv", "Stream summary"), ("stream.csv", "Stream, every seed"),
                        ("release_vs_queries.csv", "Release once vs per-query noise"),
                        ("release_vs_n.csv", "The released head at every n")):
        if (d / name).exists():
            p.append(_details(title, _table(read_csv(d / name))))
    p.append(_details("Settings", "<pre>" + html.escape(json.dumps(settings, indent=2)) + "</pre>"))
    return p


def render_large_n(d: Path, settings: dict) -> str:
    """The large-n report (``reproduce --large``): the claim per reward model on the first screen."""
    from ..evaluation.large_n import claim_sentence

    body = json.loads((d / "large_n.json").read_text())
    meta = (settings.get("pool") or {}).get("metadata", {})
    samp = meta.get("sampling", {})
    p = [f"<!doctype html><html><head><meta charset='utf-8'><title>privalign: BoN and private selection to large n"
         f"</title><style>{CSS}</style></head><body><h1>Does Best-of-N fall as n grows, and does private selection?"
         f"</h1>"]
    run = (f"privalign {html.escape(str(settings.get('privalign_version', '?')))}, "
           f"{html.escape(str(settings.get('created', '?')))}"
           + (f", <code>{html.escape(settings['command'])}</code>" if settings.get("command") else ""))
    p.append(f"<p><i>{run}</i></p><h2>Verdicts, one per reward model</h2><ul>")
    for sm in body["studies"]:
        p.append(f"<li>{claim_sentence(sm, num=sig3)}</li>")
    p.append("</ul>")
    p.append(f"<p><b>What was run.</b> {html.escape(str(meta.get('base_model', '?')))} answered "
             f"{(settings.get('pool') or {}).get('prompts', '?')} prompts of the "
             f"<b>{html.escape(str(meta.get('task', '?')))}</b> task ({samp.get('samples', '?')} samples each, "
             f"temperature {samp.get('temperature', '?')}). For each reward model the prompts are split into "
             f"held-out and test halves: the privacy-constrained tuning, ITP's beta at each n and each method's peak "
             f"n are chosen on the held-out half; every curve and drop is measured on the test half. Private methods "
             f"run at epsilon = {sig3(body['epsilon'])} per query, re-calibrated at each n. A method falls when the "
             f"95% paired bootstrap interval of its drop, from its held-out peak to the largest n, lies above 0.</p>")
    p.append(_claims_table(body))
    for sm in body["studies"]:
        p += _study_section(d, sm)
    p.append(_details("Every curve point (summary.csv)", _table(read_csv(d / "summary.csv"), None)))
    p.append("<h2>Settings</h2><pre>" + html.escape(json.dumps(settings, indent=2)) + "</pre></body></html>")
    return "".join(p)


def _claims_table(body: dict) -> str:
    """One row per reward model: its data, AUC, Delta_r, BoN's peak and drop, and each claim's verdict."""
    from ..evaluation.large_n import claim_by_method

    labels = list(dict.fromkeys(label for sm in body["studies"] for label in sm["private"]))
    cols = ["reward", "trained on", "m", "AUC (test)", "log-prob AUC", "Delta_r", "Delta_r / range",
            "BoN peak n", "BoN drop (95% CI)", *(f"claim: {label}" for label in labels), "claim"]
    t = ["<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in cols) + "</tr>"]
    for sm in body["studies"]:
        b = sm["bon"]
        cells = [sm["reward"], sm.get("trained_on") or "?", sig3(sm.get("m")), sig3(sm["auc"]["auc"]),
                 sig3(sm["auc"].get("logprob_auc")), sig3(sm.get("sensitivity")),
                 sig3(sm.get("sensitivity_share_of_range")), str(b["peak_n"]),
                 f"{sig3(b['drop_points'])} ({sig3(b['ci'][0])} to {sig3(b['ci'][1])})"]
        by = claim_by_method(sm)
        t.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                 + "".join(f"<td>{_verdict(by[label]) if label in by else ''}</td>" for label in labels)
                 + f"<td>{_verdict(sm['claim_met'])}</td></tr>")
    return "".join(t) + "</table>"


def _study_section(d: Path, sm: dict) -> list[str]:
    """A reward model's figure, its verdict per method, ITP's beta and capped PrivITP's settings by n."""
    p = []
    fig = d / f"large_n_{sm['reward']}.png"
    p.append(f"<h2>{html.escape(sm['reward'])}</h2>")
    if fig.exists():
        p.append(_img(fig))
    rows = [{"method": label, "held-out peak n": v["peak_n"], "test peak n": v["test_peak_n"],
             f"accuracy at n = {v['last_n']}": v["accuracy_at_last"], "drop (points)": v["drop_points"],
             "95% CI": f"{sig3(v['ci'][0])} to {sig3(v['ci'][1])}", "falls": v["falls"],
             f"minus BoN at n = {v['last_n']} (points, 95% CI)":
                 f"{sig3(v['vs_bon_at_last']['points'])} ({sig3(v['vs_bon_at_last']['ci'][0])} to "
                 f"{sig3(v['vs_bon_at_last']['ci'][1])})"}
            for label, v in sm["verdicts"].items()]
    p.append(_table(rows, list(rows[0])))
    p.append("<p>ITP's beta chosen on held-out prompts at each n: "
             + ", ".join(f"n = {k}: {sig3(v)}" for k, v in sm["itp_beta_by_n"].items())
             + f" (at n_ref: {sig3(sm['itp_beta_at_n_ref'])}).</p>")
    if sm.get("capped_by_n"):
        p.append("<p>Capped PrivITP, chosen on held-out prompts at each n (T, beta, Phase-1 share of the "
                 "noise) and its fallback rate on the test prompts: "
                 + ", ".join(f"n = {k}: T = {c['max_rounds']}, beta {sig3(c['beta'])}, split "
                             f"{sig3(c['phase1_fraction'])}, fallback {sig3(c.get('test_fallback'))}"
                             for k, c in sm["capped_by_n"].items()) + ".</p>")
    if sm.get("privbon_floor_by_n"):
        p.append("<p>Gumbel PrivBoN's noise floor tau, chosen on held-out prompts at each n, and the epsilon per "
                 "query it spends: " + ", ".join(f"n = {k}: tau {sig3(c['temperature'])}, epsilon "
                                                 f"{sig3(c['epsilon_spent'])}"
                                                 for k, c in sm["privbon_floor_by_n"].items()) + ".</p>")
    return p
