#!/usr/bin/env python3
"""Checks that docs/metrics.md, the code, the dashboard and the rules agree.

- Every metric the code registers (a string literal `"kvgate_..."` followed by its help
  string, the form of every registration in the code) is documented in docs/metrics.md, and
  every metric documented there is registered.
- Every metric the dashboard (deploy/grafana/kvgate.json) and the rules
  (deploy/prometheus/kvgate-rules.yml) query, and every series the rules' unit tests feed, is
  registered (histogram series by their base name); every recording rule used is defined.
- Every alert has a summary, a description and a runbook naming a heading of
  docs/operations.md, and a unit test in which it fires.

Prints each difference; exit 1 on any. Needs python3 with PyYAML.
"""

import glob
import json
import os
import re
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = ["proxy/src", "kv/src", "filters/src", "plugins/host/src", "tokenize/src"]
# Series Prometheus makes itself, which the rules may use.
PROMETHEUS_SERIES = {"up"}

problems = []


def fail(msg):
    problems.append(msg)
    print("FAIL " + msg)


def ok(msg):
    print("PASS " + msg)


def code_metrics():
    names = {}
    for d in SOURCES:
        for f in glob.glob(os.path.join(ROOT, d, "**/*.rs"), recursive=True):
            text = open(f, encoding="utf-8").read()
            for m in re.finditer(r'"(kvgate_[a-z0-9_]+)",\s*"', text):
                names.setdefault(m.group(1), os.path.relpath(f, ROOT))
    return names


def documented_metrics():
    rows = {}
    for line in open(os.path.join(ROOT, "docs/metrics.md"), encoding="utf-8"):
        m = re.match(r"\|\s*`(kvgate_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|", line)
        if m:
            if m.group(1) in rows:
                fail(f"docs/metrics.md documents {m.group(1)} twice")
            rows[m.group(1)] = m.group(2)
    return rows


def identifiers(expr):
    """Metric names and recording rules a PromQL expression reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\(?)", expr):
        name, call = m.group(1), m.group(2)
        if call or name in ("and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"):
            continue
        names.add(name)
    return names


def resolve(name, code, types):
    """The registered metric behind series `name`, or None."""
    if name in code:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name[: -len(suffix)] if name.endswith(suffix) else None
        if base and base in code and types.get(base) == "histogram":
            return base
    return None


def github_anchor(heading):
    a = heading.strip().lower()
    a = re.sub(r"[^\w\- ]", "", a)
    return a.replace(" ", "-")


def main():
    code = code_metrics()
    docs = documented_metrics()
    undocumented = sorted(set(code) - set(docs))
    unregistered = sorted(set(docs) - set(code))
    for n in undocumented:
        fail(f"{n} is registered in {code[n]} but not documented in docs/metrics.md")
    for n in unregistered:
        fail(f"{n} is documented in docs/metrics.md but registered nowhere in the code")
    if not undocumented and not unregistered:
        ok(f"docs/metrics.md documents exactly the {len(code)} metrics the code registers")

    # Recording rules and alerts.
    rules_path = os.path.join(ROOT, "deploy/prometheus/kvgate-rules.yml")
    groups = yaml.safe_load(open(rules_path))["groups"]
    rules = [r for g in groups for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    alerts = [r for r in rules if "alert" in r]

    def check_exprs(where, exprs):
        bad = 0
        for e in exprs:
            for name in sorted(identifiers(e)):
                if ":" in name:
                    if name not in recorded:
                        fail(f"{where}: recording rule {name} is not defined in kvgate-rules.yml")
                        bad += 1
                elif name.startswith("kvgate_"):
                    if not resolve(name, code, docs):
                        fail(f"{where}: {name} is not a metric the code registers")
                        bad += 1
                elif name not in PROMETHEUS_SERIES:
                    fail(f"{where}: {name} is neither a kvgate metric nor a Prometheus series")
                    bad += 1
        return bad

    dash = json.load(open(os.path.join(ROOT, "deploy/grafana/kvgate.json")))
    panels = []
    for p in dash["panels"]:
        panels.append(p)
        panels += p.get("panels", [])
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    exprs = [re.sub(r"label_values\((.*),\s*\w+\)", r"\1", e) for e in exprs]
    if not check_exprs("deploy/grafana/kvgate.json", exprs):
        ok(f"the dashboard's {len(exprs)} queries use only metrics the code registers")
    if not check_exprs("deploy/prometheus/kvgate-rules.yml", [r["expr"] for r in rules]):
        ok(f"the {len(rules)} rules use only metrics the code registers and rules they define")

    tests = yaml.safe_load(open(os.path.join(ROOT, "deploy/prometheus/kvgate-rules.test.yml")))
    series = {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", s["series"]).group(0) for t in tests["tests"] for s in t.get("input_series", [])}
    bad = [s for s in sorted(series) if s not in PROMETHEUS_SERIES and not resolve(s, code, docs)]
    for s in bad:
        fail(f"kvgate-rules.test.yml feeds {s}, which the code does not register")
    if not bad:
        ok(f"the rules' unit tests feed only series the code registers ({len(series)} names)")

    # Alerts: annotations, runbooks, a test that fires each.
    headings = {github_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", open(os.path.join(ROOT, "docs/operations.md"), encoding="utf-8").read(), re.M)}
    fired = {t["alertname"] for test in tests["tests"] for t in test.get("alert_rule_test", []) if t.get("exp_alerts")}
    bad = 0
    for a in alerts:
        ann = a.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            if not ann.get(key):
                fail(f"alert {a['alert']} has no {key} annotation")
                bad += 1
        rb = ann.get("runbook", "")
        path, _, anchor = rb.partition("#")
        if path != "docs/operations.md" or anchor not in headings:
            fail(f"alert {a['alert']}: runbook {rb} names no heading of docs/operations.md")
            bad += 1
        if a["alert"] not in fired:
            fail(f"alert {a['alert']} fires in no test of kvgate-rules.test.yml")
            bad += 1
    if not bad:
        ok(f"{len(alerts)} alerts have a summary, a description, a runbook section in docs/operations.md and a test that fires them")

    print(f"{'FAILED' if problems else 'OK'}: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
