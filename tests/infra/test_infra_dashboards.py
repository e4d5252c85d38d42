"""The Grafana dashboard and the alert rules read the metric names core.metrics defines."""
from __future__ import annotations

import json
import re

import yaml

from moe_rl_eks.core import metrics
from moe_rl_eks.infra.grafana import GRAFANA_DASHBOARD, render
from moe_rl_eks.infra.observability import alert_rules, scrape_configuration


def test_committed_grafana_dashboard_is_the_generated_one():
    assert GRAFANA_DASHBOARD.read_text() == render(), "regenerate: python -m moe_rl_eks.infra.grafana > infra/dashboards/moe-rl.json"


def test_grafana_dashboard_plots_every_workload_metric_and_only_those():
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name.removesuffix("_bucket") for e in exprs for name in re.findall(r"\bmoerl_[a-z0-9_]+", e)}
    assert used == {m.name for m in metrics.ALL}
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_alert_rules_are_valid_prometheus_rule_yaml_on_our_metrics():
    rules = yaml.safe_load(alert_rules(stall_seconds=600, straggler_ratio=1.3, rollout_backlog=100))
    by_name = {r["alert"]: r for r in rules["groups"][0]["rules"]}
    assert set(by_name) == {"TrainerStalled", "TrainerStraggler", "RolloutBacklog"}
    assert by_name["TrainerStalled"]["expr"] == f"time() - max by (run) ({metrics.TRAINER_LAST_STEP_TIMESTAMP.name}) > 600"
    assert by_name["TrainerStraggler"]["expr"].endswith(f"({metrics.STRAGGLER_RATIO.name}) > 1.3")
    assert by_name["RolloutBacklog"]["expr"].endswith(f"({metrics.ROLLOUT_QUEUE_DEPTH.name}) > 100")


def test_scrape_configuration_keeps_annotated_pods_of_the_run_namespace():
    config = yaml.safe_load(scrape_configuration("moe-rl"))["scrape_configs"][0]
    assert config["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["moe-rl"]
    relabel = {r.get("target_label") or r["action"]: r for r in config["relabel_configs"]}
    assert relabel["keep"]["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    assert relabel["run"]["source_labels"] == ["__meta_kubernetes_pod_label_moe_rl_run"]
    assert re.sub(relabel["__address__"]["regex"], relabel["__address__"]["replacement"].replace("$", "\\"),
                  "10.0.0.5:8080;9400") == "10.0.0.5:9400"
