"""Build kvserve's Grafana dashboards (deploy/grafana/dashboards/*.json) from one table.

    python deploy/grafana/build_dashboards.py           write the JSON files
    python deploy/grafana/build_dashboards.py --check   exit 1 if they are out of date

Every panel is a list of PromQL queries over the metrics in docs/observability.md. Every
query selects `cluster=~"$cluster"` and uses Grafana's `$__rate_interval` for rates, so a
panel works for any scrape interval; tests/test_observability.py runs every query against
a live cluster scraped by a real Prometheus and requires data from each. Every panel and
variable takes its datasource from the `datasource` template variable (a Prometheus
datasource picked on the dashboard), so the files import into any Grafana unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import DS, Dashboard, Panel
from panels import DASHBOARDS

OUT_DIR = Path(__file__).resolve().parent / "dashboards"


# -- JSON -------------------------------------------------------------------------------


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, object]:
    targets = [
        {
            "datasource": DS,
            "expr": q.expr,
            "legendFormat": q.legend or "__auto",
            "range": True,
            "refId": chr(ord("A") + i),
        }
        for i, q in enumerate(panel.queries)
    ]
    custom: dict[str, object] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if panel.stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DS,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def templating() -> dict[str, object]:
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            {
                "name": "cluster",
                "label": "Cluster",
                "type": "query",
                "datasource": DS,
                "definition": 'label_values(up{job=~"kvserve-.*"}, cluster)',
                "query": {
                    "query": 'label_values(up{job=~"kvserve-.*"}, cluster)',
                    "refId": "PrometheusVariableQueryEditor-VariableQuery",
                },
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "hide": 0,
                "refresh": 2,
                "sort": 1,
                "regex": "",
                "options": [],
            },
        ]
    }


def dashboard_json(d: Dashboard) -> dict[str, object]:
    panels = []
    x = y = 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y = 0, y + 8
        panels.append(panel_json(p, i, x, y))
        x += p.width
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["kvserve"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "links": [
            {
                "type": "dashboards",
                "tags": ["kvserve"],
                "title": "kvserve",
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": templating(),
        "panels": panels,
    }


def rendered() -> dict[Path, str]:
    """File path -> JSON text of every dashboard."""
    return {
        OUT_DIR / f"{d.uid}.json": json.dumps(dashboard_json(d), indent=2) + "\n"
        for d in DASHBOARDS
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the files are out of date")
    args = ap.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run python deploy/grafana/build_dashboards.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
