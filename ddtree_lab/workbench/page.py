"""A standalone HTML page: sections with navigation, tables and plotly figures, plotly.js embedded once
(inline, so the page works offline), a hook that records JavaScript errors for the browser tests. The study
report and the serving-benchmark report are both built on it."""
from __future__ import annotations

import html
import math
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1180px;margin:0 auto;padding:24px 28px 60px}
h1{margin:0 0 4px} h2{margin-top:38px;border-bottom:2px solid #e4e4e4;padding-bottom:4px}
.sub{color:#666;margin:0 0 18px} .fig{background:#fff;border:1px solid #e6e6e6;border-radius:6px;margin:12px 0;padding:4px}
table{border-collapse:collapse;font-size:13px;background:#fff;margin:8px 0} th,td{border:1px solid #ddd;padding:4px 8px;text-align:left}
th{background:#f0f0f0} td.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#1a7f37;font-weight:600} .bad{color:#c62828;font-weight:600} .na{color:#777}
.callout{background:#fff8e1;border-left:4px solid #e4a11b;padding:8px 12px;margin:10px 0}
pre{background:#f4f4f4;padding:8px;overflow-x:auto;font-size:12px;max-height:260px}
nav a{margin-right:12px;font-size:14px}
"""

ERROR_HOOK = ("<script>window.__reportErrors=[];window.addEventListener('error',function(e){"
              "window.__reportErrors.push(String(e.message||e));});</script>")
# After load, a hidden element carries what the browser tests read: how many figures drew their SVG,
# the JavaScript errors, and every figure's title and visible axis titles (as JSON).
STATUS_HOOK = """<script>window.addEventListener('load',function(){setTimeout(function(){
var plots=Array.prototype.filter.call(document.querySelectorAll('.js-plotly-plot'),
  function(d){return d.querySelector('.main-svg')!==null;});
var figs=plots.map(function(d){var fl=d._fullLayout||{},axes={};
  Object.keys(fl).forEach(function(k){if(/^[xy]axis[0-9]*$/.test(k)&&fl[k].visible){
    axes[k]=(fl[k].title&&fl[k].title.text)||'';}});
  return {id:d.id,title:(fl.title&&fl.title.text)||'',axes:axes};});
var s=document.getElementById('render-status');
s.setAttribute('data-plots',String(plots.length));s.setAttribute('data-errors',String(window.__reportErrors.length));
s.setAttribute('data-figures',JSON.stringify(figs));
s.setAttribute('data-error-text',window.__reportErrors.join(' | '));
},50);});</script>"""


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def fmt_num(x: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else "–"


def html_table(head: list[str], body: list[list[str]]) -> str:
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in row) + "</tr>" for row in body)
    thead = f"<thead><tr>{h}</tr></thead>" if any(head) else ""  # no empty header row for key/value tables
    return f"<table>{thead}<tbody>{b}</tbody></table>"


def verdict_html(v: str | None) -> str:
    cls = {"lossless": "ok", "reference": "ok", "mismatch": "bad", "no tokens": "bad"}.get(v or "", "na")
    return f'<span class="{cls}">{esc(v or "–")}</span>'


class Page:
    def __init__(self):
        self.parts: list[str] = []
        self.nav: list[tuple[str, str]] = []
        self.n_fig = 0

    def section(self, anchor: str, title: str) -> None:
        self.nav.append((anchor, title))
        self.parts.append(f'<h2 id="{anchor}">{esc(title)}</h2>')

    def add(self, s: str) -> None:
        self.parts.append(s)

    def figure(self, fig: go.Figure) -> None:
        self.n_fig += 1
        div = pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"fig{self.n_fig}",
                          config={"displaylogo": False, "responsive": True})
        self.parts.append(f'<div class="fig">{div}</div>')

    def render(self, title: str, subtitle: str) -> str:
        from plotly.offline import get_plotlyjs
        nav = "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in self.nav)
        return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
                f"<meta name='viewport' content='width=device-width,initial-scale=1'><style>{CSS}</style>"
                f"{ERROR_HOOK}<script type='text/javascript'>{get_plotlyjs()}</script></head><body><main>"
                f"<h1>{esc(title)}</h1><p class='sub'>{subtitle}</p><nav>{nav}</nav>{''.join(self.parts)}"
                f"<p id='render-status' hidden></p></main>{STATUS_HOOK}</body></html>")
