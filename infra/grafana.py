"""The Grafana dashboard for Amazon Managed Prometheus, generated from core.metrics so that it plots every workload
metric. The JSON is committed (import it into Amazon Managed Grafana); regenerate it after adding a metric:

    python -m moe_rl_eks.infra.grafana > infra/dashboards/moe-rl.json
"""
from __future__ import annotations

import json
from pathlib import Path

from moe_rl_eks.core import metrics
from moe_rl_eks.core.labels import RUN_LABEL

GRAFANA_DASHBOARD = Path(__file__).parent / "dashboards" / "moe-rl.json"
RUN = RUN_LABEL.split("/")[-1]  # the label the scraper copies from the pod label moe-rl/run
_UNITS = {"_seconds": "s", "_seconds_total": "s", "_per_second": "short", "_fraction": "percentunit", "_ratio": "short",
          "_bytes_total": "Bps", "_bytes": "bytes"}  # a counter is plotted as its rate: bytes a second


def query(metric: metrics.Metric) -> str:
    """PromQL per run: rates of counters, the 95th percentile of histograms over every server, sums of per-server
    throughputs, the worst value of other gauges."""
    selector = f'{metric.name}{{{RUN}=~"$run"}}'
    if metric.kind == "histogram":
        return f'histogram_quantile(0.95, sum by ({RUN}, le) (rate({metric.name}_bucket{{{RUN}=~"$run"}}[5m])))'
    if metric.kind == "counter":
        return f"sum by ({RUN}) (rate({selector}[5m]))"
    if metric.name.endswith("_per_second"):
        return f"sum by ({RUN}) ({selector})"
    return f"max by ({RUN}) ({selector})"


def _unit(name: str) -> str:
    return next((unit for suffix, unit in _UNITS.items() if name.endswith(suffix)), "short")


def dashboard() -> dict:
    panels = [{
        "id": i + 1, "type": "timeseries", "title": metric.help + (" (p95)" if metric.kind == "histogram" else ""),
        "description": metric.name,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": _unit(metric.name)}, "overrides": []},
        "targets": [{"refId": "A", "expr": query(metric), "legendFormat": f"{{{{{RUN}}}}}"}],
    } for i, metric in enumerate(metrics.ALL)]
    return {
        "title": "moe-rl-eks: RL post-training", "uid": "moe-rl-eks", "schemaVersion": 39, "version": 1,
        "editable": True, "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "tags": ["moe-rl-eks"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Amazon Managed Prometheus"},
            {"name": RUN, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": f"label_values({metrics.TRAINER_STEP_SECONDS.name}, {RUN})", "includeAll": True, "multi": True},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    print(render(), end="")
