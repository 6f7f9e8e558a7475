"""The conclusion of `lanes poc run`, shown: a terminal table and one self-contained HTML page with charts.

Both read the run's JSON (`PocRun.as_json`), nothing else, so a report can be re-drawn from a saved
`poc.json`. The page embeds plotly's JavaScript inline: it opens offline, from a file, with no asset fetched.
"""

from __future__ import annotations

import html
import json
from typing import Any

import plotly.graph_objects as go
from plotly.io import to_html
from rich.console import Console
from rich.table import Table

from lanes_cli.poc_rung import CAPABILITIES, LANES, STAGES

_STYLE = {"passed": "green", "pending evidence": "yellow", "not applicable": "dim"}
_DRILL_TIMES = ("detect_s", "localise_s", "decide_s", "recover_s")


def _columns(result: dict[str, Any]) -> list[str]:
    labels = [f"{rung['nodes']}x{rung['gpus']}" for rung in result["rungs"]]
    if result["inference"]["steps"]:
        labels.append("inference")
    return labels


def _cells(result: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(cell["capability"], cell["rung"]): cell for cell in result["verdicts"]}


def _short(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    return str(cell["verdict"])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(console: Console, result: dict[str, Any]) -> None:
    """Capabilities x rungs, the stage times and drills per rung, then each pending cell's missing link."""
    columns = _columns(result)
    cells = _cells(result)
    table = Table(title=f"POC {result['plan']['name']}: capabilities x rungs (nodes x GPUs per node)")
    table.add_column("capability")
    for label in columns:
        table.add_column(label)
    for capability in CAPABILITIES:
        row = []
        for label in columns:
            cell = cells.get((capability, label))
            style = _STYLE.get(_short(cell), "")
            row.append(f"[{style}]{_short(cell)}[/{style}]" if style else _short(cell))
        table.add_row(capability, *row)
    console.print(table)

    stages = Table(title="stage times (s from submission), read from the timeline")
    stages.add_column("rung")
    for name in STAGES:
        stages.add_column(name.removesuffix("_s"), justify="right")
    stages.add_column("ettr", justify="right")
    for rung in result["rungs"]:
        ettr = rung["goodput"]["ettr"]
        stages.add_row(
            f"{rung['nodes']}x{rung['gpus']}",
            *(_seconds(rung["stages"][name]) for name in STAGES),
            "-" if ettr is None else f"{ettr:.2f}",
        )
    console.print(stages)
    console.print(_completeness_table(result))
    for rung in result["rungs"]:
        for d in rung["drills"]:
            times = ", ".join(f"{t.removesuffix('_s')} {_seconds(d[t])} s" for t in _DRILL_TIMES)
            console.print(
                f"{rung['nodes']}x{rung['gpus']} {d['kind']} of rank {d['rank']}: named rank {d['named_rank']} on "
                f"{d['named_node']}, {d['named_lane']} lane; {times}; released {d['released']}; {d['verdict']}",
                highlight=False,
            )
    pending: dict[tuple[str, str], list[str]] = {}
    for cell in result["verdicts"]:  # one line per missing link, however many capabilities it holds back
        if cell["verdict"] == "pending evidence":
            pending.setdefault((cell["rung"], cell["missing"]), []).append(cell["capability"])
    for (rung_label, missing), capabilities in pending.items():
        console.print(f"[yellow]pending[/yellow] {', '.join(capabilities)} @ {rung_label}: {missing}", highlight=False)
    for step in result["inference"]["steps"]:
        console.print(f"inference {step['step']}: {step['verdict']}")
    for diff in result["diff"]:
        console.print(
            f"[red]{diff['to']} failed after {diff['from']} passed[/red]: nodes added {diff['nodes_added'] or '-'}, "
            f"domains crossed {diff['domains_crossed']}, interfaces {diff['interfaces'] or '-'}"
            + (f"; never placed: {diff['unplaced_reason']}" if not diff["placed"] else ""),
            highlight=False,
        )


def _completeness_table(result: dict[str, Any]) -> Table:
    """Each lane's share of joinable evidence, side by side per rung: does the evidence hold up as scale grows?"""
    table = Table(title="evidence completeness per lane (share of events that join by job, attempt, node, time)")
    table.add_column("rung")
    for lane in LANES:
        table.add_column(lane, justify="right")
    for rung in result["rungs"]:
        table.add_row(f"{rung['nodes']}x{rung['gpus']}", *(f"{rung['completeness'][lane]:.2f}" for lane in LANES))
    return table


def _html_rows(result: dict[str, Any]) -> str:
    """The stage times, completeness and drills per rung, and the inference steps, as plain HTML tables."""
    head = "".join(f"<th>{html.escape(name)}</th>" for name in (*STAGES, *LANES))
    rows = "".join(
        f"<tr><th>{rung['nodes']}x{rung['gpus']}</th>"
        + "".join(f"<td>{_seconds(rung['stages'][name])}</td>" for name in STAGES)
        + "".join(f"<td>{rung['completeness'][lane]:.2f}</td>" for lane in LANES)
        + "</tr>"
        for rung in result["rungs"]
    )
    drills = "".join(
        f"<li>{rung['nodes']}x{rung['gpus']}: {html.escape(d['kind'])} of rank {d['rank']}, named rank "
        f"{d['named_rank']} on {html.escape(str(d['named_node']))} ({html.escape(str(d['named_lane']))} lane): "
        f"{html.escape(d['verdict'])}</li>"
        for rung in result["rungs"]
        for d in rung["drills"]
    )
    steps = "".join(
        f"<li>{html.escape(step['step'])}: {html.escape(step['verdict'])}"
        + (f" ({html.escape(step['missing'])})" if step.get("missing") else "")
        + "</li>"
        for step in result["inference"]["steps"]
    )
    return (
        f'<h2>Stage times (s) and completeness per lane</h2><table id="stages"><tr><th>rung</th>{head}</tr>{rows}'
        f'</table><h2>Drills</h2><ul id="drills">{drills}</ul><h2>Inference</h2><ul id="inference">{steps}</ul>'
    )


def _stage_chart(result: dict[str, Any]) -> go.Figure:
    figure = go.Figure()
    nodes = [rung["nodes"] for rung in result["rungs"]]
    for name in STAGES:
        figure.add_trace(
            go.Scatter(x=nodes, y=[rung["stages"][name] for rung in result["rungs"]], mode="lines+markers", name=name)
        )
    figure.update_layout(title="Stage times against scale", xaxis_title="nodes", yaxis_title="s from submission")
    figure.update_xaxes(tickmode="array", tickvals=nodes)  # the rungs' node counts, not a continuous scale
    return figure


def _drill_chart(result: dict[str, Any]) -> go.Figure:
    figure = go.Figure()
    drills = [(rung["nodes"], drill) for rung in result["rungs"] for drill in rung["drills"]]
    labels = [f"{nodes} nodes: {drill['kind']} r{drill['rank']}" for nodes, drill in drills]
    for name in _DRILL_TIMES:
        values = [drill[name] for _, drill in drills]
        figure.add_trace(go.Bar(x=labels, y=values, name=name.removesuffix("_s")))
    figure.update_layout(
        title="Detect, localise, decide, recover per drill against scale", barmode="group", yaxis_title="s"
    )
    return figure


def _verdict_table(result: dict[str, Any]) -> str:
    columns = _columns(result)
    cells = _cells(result)
    head = "".join(f"<th>{html.escape(label)}</th>" for label in columns)
    body = []
    for capability in CAPABILITIES:
        row = []
        for label in columns:
            cell = cells.get((capability, label))
            verdict = _short(cell)
            why = html.escape(str((cell or {}).get("missing") or ""))
            css = verdict.replace(" ", "-")
            row.append(f'<td class="{css}" title="{why}" data-verdict="{html.escape(verdict)}">{verdict}</td>')
        body.append(f"<tr><th>{html.escape(capability)}</th>{''.join(row)}</tr>")
    return f'<table id="verdicts"><tr><th>capability</th>{head}</tr>{"".join(body)}</table>'


def render_report(result: dict[str, Any]) -> str:
    """One HTML page: the verdicts table, the two charts, the missing links and the whole JSON."""
    stage = to_html(_stage_chart(result), include_plotlyjs=True, full_html=False, div_id="stage-chart")
    drills = to_html(_drill_chart(result), include_plotlyjs=False, full_html=False, div_id="drill-chart")
    pending = "".join(
        f"<li>{html.escape(cell['capability'])} @ {html.escape(cell['rung'])}: {html.escape(cell['missing'])}</li>"
        for cell in result["verdicts"]
        if cell["verdict"] == "pending evidence"
    )
    # The JSON goes inside a script element: `</` is escaped so no value can close it.
    data = json.dumps(result).replace("</", "<\\/")
    title = html.escape(f"Lanes POC: {result['plan']['name']}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: 0.3em 0.6em; }}
td.passed {{ background: #d9f2d9; }} td.pending-evidence {{ background: #fff2c2; }}
td.not-applicable {{ color: #888; }}
</style></head>
<body>
<h1>{title}</h1>
<p>Each cell is passed, pending evidence (hover: the missing link) or not applicable. There is no total score.</p>
{_verdict_table(result)}
{stage}
{drills}
{_html_rows(result)}
<h2>Pending evidence</h2><ul id="pending">{pending}</ul>
<script type="application/json" id="poc-data">{data}</script>
</body></html>
"""
