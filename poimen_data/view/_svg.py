"""Charts drawn on the server as SVG text: the branch tree of an episode, failure rate by
step and workflow version, cost over time. Every label from the log goes through
``esc``; nothing here emits a script, a link or an event attribute.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from decimal import Decimal

from markupsafe import Markup

from poimen_data.fold._query import EpisodeView

COLORS = {"succeeded": "#2e9d4f", "failed": "#d64545", "timed_out": "#e07b1f",
          "cancelled": "#8e5cc5", "dispatched": "#c9a400", "recovered": "#2b7bd6"}
FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _svg(width: float, height: float, body: list[str], label: str) -> Markup:
    return Markup(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
                  f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
                  f'aria-label="{esc(label)}" {FONT}>' + "".join(body) + "</svg>")


def branch_tree(view: EpisodeView, state_of: dict[tuple[int, str, int], str]) -> Markup:
    """One lane per branch, one column per step index: each attempt a dot coloured by
    state (retries side by side), a fork drawn from the parent's lane at its fork step."""
    branches = view.branches
    steps: dict[int, str] = {}
    most = 1
    for b in branches:
        per: dict[int, int] = {}
        for a in b.attempts:
            i = a.step_index if a.step_index is not None else -1
            steps.setdefault(i, a.step)
            per[i] = per.get(i, 0) + 1
        most = max([most, *per.values()])
    if not steps:
        steps = {0: ""}
    first = min(0, *steps)
    # a column per step index that is there (and each fork's), in order: not one per
    # index between them (an index of 2**62 made a dict of that many entries)
    cols = sorted({first, *steps, *(b.fork_step_index for b in branches
                                    if b.fork_step_index is not None)})
    cw, lane, left, top = max(64, 12 * most + 24), 34, 150, 34
    x = {i: left + n * cw + 10 for n, i in enumerate(cols)}
    lane_of = {b.branch_id: n for n, b in enumerate(branches)}
    body = []
    for i, name in sorted(steps.items()):
        body.append(f'<text x="{x[i]:.0f}" y="14" fill="#555">{esc(name[:14])}</text>'
                    f'<title>{esc(name)}</title>')
    for b in branches:
        y = top + lane_of[b.branch_id] * lane
        live = b.is_live
        label = f"branch {b.branch_id}" + (" \u00b7 live" if live else " \u00b7 abandoned")
        body.append(f'<text x="6" y="{y + 4}" font-weight="{"bold" if live else "normal"}" '
                    f'fill="{"#111" if live else "#777"}">{esc(label)}</text>')
        own = [a.step_index for a in b.attempts if a.step_index is not None]
        start = b.fork_step_index if b.parent_branch_id is not None else first
        start = start if start is not None else first
        end = max([start, *own])
        body.append(f'<line x1="{x.get(start, left):.0f}" y1="{y}" '
                    f'x2="{x.get(end, left) + cw - 20:.0f}" y2="{y}" '
                    f'stroke="{"#333" if live else "#bbb"}" stroke-width="{2 if live else 1}"/>')
        if b.parent_branch_id is not None and b.parent_branch_id in lane_of:
            py = top + lane_of[b.parent_branch_id] * lane
            fx = x.get(start, left) - 8
            body.append(f'<path d="M {fx - 14:.0f} {py} C {fx:.0f} {py} {fx - 14:.0f} {y} '
                        f'{fx + 8:.0f} {y}" fill="none" stroke="#888" stroke-dasharray="3 2"/>'
                        f'<title>forked from branch {b.parent_branch_id} at step index '
                        f'{start}, lsn {b.fork_lsn}</title>')
        seen: dict[int, int] = {}
        for a in b.attempts:
            i = a.step_index if a.step_index is not None else -1
            k = seen.get(i, 0)
            seen[i] = k + 1
            state = state_of.get((b.branch_id, a.step, a.attempt), a.state)
            cx = x.get(i, left) + k * 12
            body.append(f'<circle cx="{cx:.0f}" cy="{y}" r="5" fill="{COLORS.get(state, "#999")}" '
                        f'stroke="#fff" class="dot {esc(state)}"><title>'
                        f'{esc(f"{a.step} #{a.attempt}: {state}")}</title></circle>')
    width = left + len(cols) * cw + 20
    return _svg(width, top + len(branches) * lane, body, f"branch tree of {view.run_id}")


def _split(wv: str) -> tuple[str, str]:
    wf, at, ver = wv.rpartition("@")
    return (wf, ver) if at else (wv, "")


def failure_heatmap(rows: list[tuple[str, str, int, int, int]]) -> Markup | None:
    """Rows (workflow, step) by columns (version): failed or timed-out share of attempts."""
    if not rows:
        return None
    cells: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    order: dict[tuple[str, str], tuple[str, int, str]] = {}
    versions: set[str] = set()
    for wv, step, index, n, failed in rows:
        wf, ver = _split(wv)
        versions.add(ver)
        key = (wf, step)
        a, f = cells.setdefault(key, {}).get(ver, (0, 0))
        cells[key][ver] = (a + n, f + failed)
        order[key] = min(order.get(key, (wf, index, step)), (wf, index, step))
    keys = sorted(cells, key=lambda k: order[k])[:40]
    cols = sorted(versions)
    left, cw, rh, top = 210, 64, 20, 22
    body = [f'<text x="{left + i * cw + cw / 2:.0f}" y="14" text-anchor="middle" '
            f'fill="#555">{esc((v or "-")[:10])}</text>' for i, v in enumerate(cols)]
    for r, key in enumerate(keys):
        y = top + r * rh
        body.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">'
                    f'{esc(f"{key[0]} / {key[1]}"[:30])}</text>')
        for c, ver in enumerate(cols):
            a, f = cells[key].get(ver, (0, 0))
            if not a:
                continue
            rate = f / a
            shade = int(255 - 200 * rate)
            fill = f"rgb(255,{shade},{shade})"
            body.append(f'<rect x="{left + c * cw}" y="{y}" width="{cw - 2}" height="{rh - 2}" '
                        f'fill="{fill}" stroke="#ddd"><title>{esc(key[1])} {esc(ver)}: '
                        f'{f} of {a} attempts failed or timed out</title></rect>'
                        f'<text x="{left + c * cw + cw / 2 - 1:.0f}" y="{y + 14}" '
                        f'text-anchor="middle">{rate:.0%}</text>')
    return _svg(left + len(cols) * cw + 10, top + len(keys) * rh + 6, body,
                "failure rate by step and workflow version")


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M")


def cost_bars(lo: float, width: float, buckets: list[tuple[int, Decimal, int]],
              n_buckets: int = 30) -> Markup | None:
    """Cost of the runs started in each time bucket (bars), with the range labelled."""
    if not buckets:
        return None
    top_cost = max(c for _, c, _ in buckets) or Decimal(1)
    w, h, left, bottom = 460, 130, 50, 20
    bw = (w - left - 10) / n_buckets
    body = [f'<text x="{left - 4}" y="12" text-anchor="end" fill="#555">${top_cost:.2f}</text>',
            f'<text x="{left - 4}" y="{h - bottom}" text-anchor="end" fill="#555">$0</text>',
            f'<line x1="{left}" y1="{h - bottom}" x2="{w - 10}" y2="{h - bottom}" stroke="#999"/>',
            f'<text x="{left}" y="{h - 4}" fill="#555">{esc(_when(lo))}</text>',
            f'<text x="{w - 10}" y="{h - 4}" text-anchor="end" fill="#555">'
            f'{esc(_when(lo + width * n_buckets))}</text>']
    for b, cost, n in buckets:
        bh = float(cost / top_cost) * (h - bottom - 8)
        body.append(f'<rect x="{left + b * bw + 1:.1f}" y="{h - bottom - bh:.1f}" '
                    f'width="{max(bw - 2, 1):.1f}" height="{bh:.1f}" fill="#4a78c2"><title>'
                    f'{esc(_when(lo + b * width))}: {n} runs, ${cost:.4f}</title></rect>')
    return _svg(w, h, body, "cost of runs by start time")
