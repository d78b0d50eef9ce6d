#!/usr/bin/env python3
"""Helpers of scripts/test-monitoring.sh that read deploy/monitoring/ (YAML and JSON).

  monitoring.py rules PROMETHEUSRULE OUT      the PrometheusRule's spec as a Prometheus rule file
  monitoring.py tested-alerts PROMETHEUSRULE TEST...
                                             fails naming every alert no test expects to fire
  monitoring.py scrape-config PODMONITORS KUBECONFIG RULES
                                             a Prometheus configuration scraping what the
                                             PodMonitors select, as the operator generates it
                                             (kubernetes_sd role pod, namespace of the monitor,
                                             selector, port, jobLabel, relabelings), on stdout
  monitoring.py dashboard-queries DASHBOARD  one "panel title<TAB>expr" line per query
"""
import json
import sys

import yaml


def rules(src, out):
    with open(src) as f:
        rule = yaml.safe_load(f)
    if rule.get("kind") != "PrometheusRule":
        sys.exit(f"{src}: kind {rule.get('kind')!r}, want PrometheusRule")
    with open(out, "w") as f:
        yaml.safe_dump(rule["spec"], f, sort_keys=False)


def tested_alerts(src, tests):
    with open(src) as f:
        alerts = {r["alert"] for g in yaml.safe_load(f)["spec"]["groups"] for r in g["rules"] if "alert" in r}
    fired = set()
    for t in tests:
        with open(t) as f:
            for case in yaml.safe_load(f)["tests"]:
                for a in case.get("alert_rule_test", []):
                    if a.get("exp_alerts"):
                        fired.add(a["alertname"])
    missing = sorted(alerts - fired)
    if missing:
        sys.exit(f"alerts without a unit test that expects them to fire: {', '.join(missing)}")
    print(f"{len(alerts)} alerts, each expected to fire by a unit test")


def label(name):
    return "".join(c if c.isalnum() else "_" for c in name)


def scrape_config(podmonitors, kubeconfig, rule_file):
    with open(podmonitors) as f:
        monitors = [m for m in yaml.safe_load_all(f) if m and m.get("kind") == "PodMonitor"]
    jobs = []
    for m in monitors:
        ns, name, spec = m["metadata"]["namespace"], m["metadata"]["name"], m["spec"]
        for i, ep in enumerate(spec["podMetricsEndpoints"]):
            relabel = [
                {"source_labels": [f"__meta_kubernetes_pod_label_{label(k)}"], "regex": v, "action": "keep"}
                for k, v in spec["selector"].get("matchLabels", {}).items()
            ]
            relabel += [
                {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"], "action": "keep"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            ]
            if "jobLabel" in spec:
                relabel.append({"source_labels": [f"__meta_kubernetes_pod_label_{label(spec['jobLabel'])}"], "target_label": "job"})
            for r in ep.get("relabelings", []):
                relabel.append({("source_labels" if k == "sourceLabels" else "target_label" if k == "targetLabel" else k): v for k, v in r.items()})
            jobs.append({
                "job_name": f"podMonitor/{ns}/{name}/{i}",
                "metrics_path": ep.get("path", "/metrics"),
                "scheme": ep.get("scheme", "http"),
                "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": kubeconfig, "namespaces": {"names": [ns]}}],
                "relabel_configs": relabel,
            })
    config = {
        "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
        "rule_files": [rule_file],
        "scrape_configs": jobs,
    }
    yaml.safe_dump(config, sys.stdout, sort_keys=False)


def dashboard_queries(src):
    with open(src) as f:
        dash = json.load(f)
    for p in dash["panels"]:
        for t in p.get("targets", []):
            print(f"{p['title']}\t{t['expr']}")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"rules": rules, "tested-alerts": lambda s, *t: tested_alerts(s, t), "scrape-config": scrape_config,
     "dashboard-queries": dashboard_queries}[cmd](*args)
