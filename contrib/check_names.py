#!/usr/bin/env python3
"""Checks contrib/'s dashboard and alert rules against src/metrics.rs.

Fails (exit 1, one line per problem) when a PromQL expression of the Grafana
dashboard or of the alert rules names a series that cronlease does not export
(or `up`), or a label that neither cronlease nor the scrape puts on its series,
when the dashboard's panels do not all use the ${DS_PROMETHEUS} input, or
when its templating lacks the `job` and `instance` variables. With promtool on
the PATH it also parses every dashboard expression as PromQL.

Series names come from the `registry.register(...)` calls and the field types
of `struct Metrics`: counters get `_total`, histograms `_bucket`, `_sum` and
`_count`, gauges nothing. Label names come from the `EncodeLabelSet` structs,
and `job` and `instance` are the target's. It also fails when cronlease
labels a series `job` or `instance` (Prometheus keeps those for the scrape
and would rename ours), and when a rule matches the `job` label against a
value (the rules must work whatever the scrape job is called).

Usage: contrib/check_names.py [REPO_ROOT]
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
METRICS_RS = os.path.join(ROOT, "src", "metrics.rs")
DASHBOARD = os.path.join(ROOT, "contrib", "grafana", "cronlease-dashboard.json")
RULES = os.path.join(ROOT, "contrib", "prometheus", "cronlease-alerts.yml")
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

problems = []


def exported_names():
    src = open(METRICS_RS, encoding="utf-8").read()
    struct = re.search(r"pub struct Metrics \{(.*?)\n\}", src, re.S)
    if not struct:
        sys.exit(f"{METRICS_RS}: no `pub struct Metrics`")
    structs = {}
    for name, body in re.findall(r"EncodeLabelSet\)\]\s*pub struct (\w+) \{(.*?)\n\}", src, re.S):
        fields = set(re.findall(r"^\s*pub (\w+):", body, re.M))
        for reserved in sorted(fields & {"job", "instance"}):
            problems.append(f"{METRICS_RS}: {name} labels series `{reserved}`, which Prometheus keeps for the scrape target")
        structs[name] = fields
    kinds, field_labels = {}, {}
    for field, ty in re.findall(r"^\s*pub (\w+): ([^\n]+),$", struct.group(1), re.M):
        m = re.match(r"(?:Family|Histograms)<(\w+)", ty)
        field_labels[field] = structs[m.group(1)] if m else set()
        if "Histogram" in ty:
            kinds[field] = "histogram"
        elif "Counter" in ty:
            kinds[field] = "counter"
        elif "Gauge" in ty:
            kinds[field] = "gauge"
    # series name -> the labels it can carry once scraped
    series = {"up": {"job", "instance"}}
    registered = re.findall(r'register\(\s*"([^"]+)",\s*"(?:[^"\\]|\\.)*",\s*m\.(\w+)\.clone\(\)', src)
    if not registered:
        sys.exit(f"{METRICS_RS}: no registry.register(...) calls found")
    for name, field in registered:
        kind = kinds.get(field)
        own = field_labels[field] | {"job", "instance"}
        if kind == "counter":
            series[name + "_total"] = own
        elif kind == "histogram":
            series[name + "_bucket"] = own | {"le"}
            series[name + "_sum"] = own
            series[name + "_count"] = own
        elif kind == "gauge":
            series[name] = own
        else:
            sys.exit(f"{METRICS_RS}: cannot tell the type of m.{field} ({name})")
    labels = set().union(*series.values())
    return series, labels


def rule_exprs():
    """(where, expr) of every `expr:` in the rules file (plain or block scalar)."""
    out = []
    lines = open(RULES, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(?:- )?expr:\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, rest = len(m.group(1)), m.group(2).strip()
        start = i + 1
        if rest in ("|", "|-", "|+", ">", ">-", ">+"):
            body = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            expr = "\n".join(body)
        else:
            expr = rest.strip("'\"")
            i += 1
        out.append((f"{os.path.relpath(RULES, ROOT)}:{start}", expr))
    return out


def check_expr(where, expr, series, labels):
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values out of the way
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors ([5m], [$__rate_interval])
    named = [t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare) if t.startswith("cronlease_") or t == "up"]
    for name in named:
        if name not in series:
            problems.append(f"{where}: {name} is not a series cronlease exports (src/metrics.rs)")
    if not named:
        problems.append(f"{where}: names no cronlease series: {expr.strip()[:80]}")
    for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", bare):
        if name in series:
            for label in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers):
                if label not in series[name]:
                    problems.append(f"{where}: {name} has no label {label} (it has: {', '.join(sorted(series[name]))})")
    used = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", bare))
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", bare):
        used.update(x.strip() for x in group.split(",") if x.strip())
    used.update(re.findall(r"label_values\(.*,\s*(\w+)\s*\)", bare))
    for label in sorted(used - labels):
        problems.append(f"{where}: label {label} is on no cronlease series (known: {', '.join(sorted(labels))})")


def check_dashboard(series, labels):
    rel = os.path.relpath(DASHBOARD, ROOT)
    dash = json.load(open(DASHBOARD, encoding="utf-8"))
    if not any(i.get("name") == "DS_PROMETHEUS" and i.get("pluginId") == "prometheus" for i in dash.get("__inputs", [])):
        problems.append(f"{rel}: no __inputs entry DS_PROMETHEUS for a prometheus datasource")
    if not dash.get("__requires"):
        problems.append(f"{rel}: no __requires")
    exprs = []
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))
    for p in panels:
        if p.get("type") == "row":
            continue
        where = f"{rel}: panel {p.get('id')} {p.get('title')!r}"
        if p.get("datasource") != DATASOURCE:
            problems.append(f"{where}: datasource is not {DATASOURCE}")
        if not p.get("targets"):
            problems.append(f"{where}: no targets")
        for t in p.get("targets", []):
            if t.get("datasource") != DATASOURCE:
                problems.append(f"{where} target {t.get('refId')}: datasource is not {DATASOURCE}")
            if not t.get("expr", "").strip():
                problems.append(f"{where} target {t.get('refId')}: no expr")
                continue
            exprs.append((f"{where} target {t.get('refId')}", t["expr"]))
    names = set()
    for v in dash.get("templating", {}).get("list", []):
        names.add(v.get("name"))
        where = f"{rel}: variable {v.get('name')}"
        if v.get("type") != "query":
            continue
        if v.get("datasource") != DATASOURCE:
            problems.append(f"{where}: datasource is not {DATASOURCE}")
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q or ""
        if not q.startswith("label_values("):
            problems.append(f"{where}: query is not label_values(...)")
        check_expr(where, q, series, labels)
    for required in ("job", "instance"):
        if required not in names:
            problems.append(f"{rel}: no templating variable {required}")
    for where, expr in exprs:
        check_expr(where, expr, series, labels)
    return exprs


def promql_parses(exprs):
    """Parses the dashboard's expressions with promtool (as recording rules)."""
    if not shutil.which("promtool"):
        print("check_names: promtool not found; dashboard PromQL not parsed")
        return
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for n, (_, expr) in enumerate(exprs):
        e = re.sub(r"\$__\w+", "1m", expr)
        e = re.sub(r"\$(\w+)", r"\1", e)
        rules += [f"      - record: dashboard:expr_{n}", "        expr: " + json.dumps(e)]
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        f.write("\n".join(rules) + "\n")
    try:
        r = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        for m in re.finditer(r"expr_(\d+)", r.stdout + r.stderr):
            problems.append(f"{exprs[int(m.group(1))][0]}: PromQL does not parse")
        problems.append("promtool on the dashboard's expressions:\n" + (r.stdout + r.stderr).strip())


def main():
    series, labels = exported_names()
    exprs = check_dashboard(series, labels)
    promql_parses(exprs)
    rules = rule_exprs()
    if not rules:
        problems.append(f"{os.path.relpath(RULES, ROOT)}: no expr found")
    for where, expr in rules:
        check_expr(where, expr, series, labels)
        bare = re.sub(r"\[[^\]]*\]", "", expr)
        if re.search(r"\bjob\s*(?:=~|!~|!=|=)\s*\"", bare):
            problems.append(f"{where}: matches the scrape job's name (job=...); the rules must not depend on it")
    text = open(RULES, encoding="utf-8").read()
    for label in sorted(set(re.findall(r"\$labels\.(\w+)", text)) - labels):
        problems.append(f"{os.path.relpath(RULES, ROOT)}: annotation uses $labels.{label}, on no series")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"check_names: {len(exprs)} dashboard and {len(rules)} rule expressions name only "
          f"series of src/metrics.rs ({len(series)} names) and known labels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
