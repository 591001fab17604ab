"""Draft-tree visualisation: a tidy layout, plotly figures, an ipywidgets explorer and a static
slider version for the report, plus the per-run acceptance figures.

A tree comes from a round trace (RoundTrace or its JSON): nodes 1..n in descending draft score,
`parents` with 0 = root. Depth runs along x; leaves take consecutive rows in child order (best rank
first) and a parent sits midway between its first and last child, so siblings never cross. Nodes
are coloured by their own draft probability q_d[token]; the accepted path is drawn thick, and the
target's choice where the walk stopped is a cross in a header row above the tree, in the column the
walk would have gone on to (beside the last accepted node it would sit on that node's children).

Every widget callback is a plain method (`TreeExplorer.select`) so tests drive it without a browser.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import plotly.graph_objects as go

ACCEPT_COLOR = "#e4572e"
TARGET_COLOR = "#d62728"
EDGE_COLOR = "#b8bcc4"
COLORSCALE = "Viridis"
LABEL_LIMIT = 80  # above this many nodes, token text only on hover
ROW_PX = 20       # vertical pixels per leaf row: labels beside their node never touch a neighbour
HEADER_ROW = -1.0  # the row of the target's choice: one above the first leaf row (the y axis runs downwards)


# ----------------------------------------------------------------------------- data
@dataclass
class RoundView:
    """One round's tree with the root included: index 0 is the root (the bonus token)."""
    tokens: list[int]
    depths: list[int]
    parents: list[int]     # parents[0] = -1
    scores: list[float]
    logprobs: list[float]
    ranks: list[int]
    accepted: list[int]    # node indices, 0 = root
    next_token: int | None
    index: int = 0
    position: int | None = None

    @property
    def n(self) -> int:
        return len(self.tokens) - 1

    @property
    def tau(self) -> int:
        return len(self.accepted)


def _list(x) -> list:
    if x is None:
        return []
    return x.tolist() if hasattr(x, "tolist") else list(x)


def round_view(r: Any) -> RoundView:
    """A RoundTrace object or its to_json() dict (a traces.jsonl row) -> RoundView."""
    get = (lambda k, d=None: r.get(k, d)) if isinstance(r, dict) else (lambda k, d=None: getattr(r, k, d))
    tree = get("tree")
    tget = (lambda k: tree.get(k)) if isinstance(tree, dict) else (lambda k: getattr(tree, k, None))
    tokens = _list(tget("tokens")) if tree is not None else []
    n = len(tokens)
    depths = _list(tget("depths")) if tree is not None else []
    logprobs = _list(tget("logprobs")) if tree is not None else [0.0] * n
    ranks = _list(tget("ranks")) if tree is not None and tget("ranks") is not None else _derive_ranks(tokens, depths, logprobs)
    return RoundView(
        tokens=[int(get("root_token", -1))] + [int(t) for t in tokens],
        depths=[0] + [int(d) for d in depths],
        parents=[-1] + ([int(p) for p in _list(tget("parents"))] if tree is not None else []),
        scores=[0.0] + [float(s) for s in (_list(tget("scores")) if tree is not None else [])],
        logprobs=[0.0] + [float(x) for x in logprobs],
        ranks=[0] + [int(x) for x in ranks],
        accepted=[int(a) for a in _list(get("accepted", [0]))] or [0],
        next_token=None if get("next_token") is None else int(get("next_token")),
        index=int(get("index", 0) or 0), position=get("position"))


def _derive_ranks(tokens, depths, logprobs) -> list[int]:
    # Rank of a token within its depth's top-K = its place among that depth's distinct log-probs.
    by_depth: dict[int, list] = {}
    for t, d, lp in zip(tokens, depths, logprobs):
        by_depth.setdefault(d, {})[t] = lp
    order = {d: {t: i for i, (t, _) in enumerate(sorted(m.items(), key=lambda kv: -kv[1]))}
             for d, m in by_depth.items()}
    return [order[d][t] for t, d in zip(tokens, depths)]


def make_decoder(tok: Any = None) -> Callable[[int], str]:
    """Token id -> display text, from a Pair, a tokenizers.Tokenizer, a callable or nothing."""
    if tok is None:
        return lambda i: f"#{i}"
    tok = getattr(tok, "tokenizer", None) or tok  # a Pair carries its tokenizers.Tokenizer
    fn = tok if callable(tok) and not hasattr(tok, "decode") else tok.decode
    piece = getattr(tok, "id_to_token", None)

    def decode(i: int) -> str:
        if i is None or i < 0:
            return "?"
        try:
            s = fn([int(i)])
        except Exception:  # noqa: BLE001 - an odd id must not break a figure
            return f"#{i}"
        s = s if isinstance(s, str) else str(s)
        if "\ufffd" in s and piece is not None:  # part of a multi-byte character: show the raw piece
            s = piece(int(i)) or s
        return s
    return decode


def show_token(s: str) -> str:
    """Whitespace made visible, short: '·' for spaces, '↵' for newlines."""
    s = s.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·")
    return s if len(s) <= 14 else s[:13] + "…"


# ----------------------------------------------------------------------------- layout
def tree_layout(parents: Sequence[int]) -> list[float]:
    """Row (y) of every node given parents (root first, parents[0] = -1). Iterative DFS."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)  # node order = descending score: best child first
    y = [0.0] * n
    next_row = 0
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        node, done = stack.pop()
        if not children[node]:
            y[node] = float(next_row)
            next_row += 1
        elif done:
            y[node] = (y[children[node][0]] + y[children[node][-1]]) / 2
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(children[node]))
    return y


# ----------------------------------------------------------------------------- figures
def tree_traces(v: RoundView, decode: Callable[[int], str] | None = None) -> list[dict]:
    """Four trace dicts, always in this order: edges, accepted edges, nodes, target's choice."""
    decode = decode or make_decoder()
    y = tree_layout(v.parents)
    x = [float(d) for d in v.depths]
    ex, ey = [], []
    for i in range(1, len(v.parents)):
        p = v.parents[i]
        ex += [x[p], x[i], None]
        ey += [y[p], y[i], None]
    acc = [a for a in v.accepted if a < len(x)]
    ax = [x[a] for a in acc]
    ay = [y[a] for a in acc]
    acc_set = set(acc)
    text = [show_token(decode(t)) for t in v.tokens]
    probs = [1.0] + [math.exp(lp) for lp in v.logprobs[1:]]
    hover = []
    for i in range(len(v.tokens)):
        head = "root (bonus token)" if i == 0 else f"node {i}"
        parts = [f"<b>{head}</b>", f"token {text[i]!r} (id {v.tokens[i]})", f"depth {v.depths[i]}"]
        if i:
            parts.append(f"rank {v.ranks[i]} · p {probs[i]:.3f} · score {v.scores[i]:.2f}")
        if i in acc_set:
            parts.append("<b>accepted</b>")
        hover.append("<br>".join(parts))
    labels = len(v.tokens) <= LABEL_LIMIT
    nodes = dict(
        type="scatter", name="draft nodes", x=x, y=y, mode="markers+text" if labels else "markers",
        text=text if labels else None, textposition="middle right", textfont=dict(size=10),
        hovertext=hover, hoverinfo="text",
        marker=dict(color=probs, colorscale=COLORSCALE, cmin=0.0, cmax=1.0, showscale=True,
                    colorbar=dict(title=dict(text="draft p"), thickness=12, len=0.7),
                    size=[13 if i in acc_set else 9 for i in range(len(x))],
                    line=dict(color=[ACCEPT_COLOR if i in acc_set else "#444" for i in range(len(x))],
                              width=[3 if i in acc_set else 0.5 for i in range(len(x))])))
    last = acc[-1] if acc else 0
    choice = "?" if v.next_token is None else show_token(decode(v.next_token))
    stop = dict(
        type="scatter", name="target's choice", x=[x[last] + 1], y=[HEADER_ROW], mode="markers+text",
        text=[f"target: {choice}"], textposition="middle right", textfont=dict(color=TARGET_COLOR),
        hovertext=[f"walk stopped at node {last} (depth {v.depths[last]}): the target chose {choice!r} "
                   f"(id {v.next_token}), which no child carries; it is the next bonus token"], hoverinfo="text",
        marker=dict(symbol="x", size=14, color=TARGET_COLOR))
    return [
        dict(type="scatter", name="tree", x=ex, y=ey, mode="lines", hoverinfo="skip",
             line=dict(color=EDGE_COLOR, width=1)),
        dict(type="scatter", name="accepted path", x=ax, y=ay, mode="lines", hoverinfo="skip",
             line=dict(color=ACCEPT_COLOR, width=4)),
        nodes, stop]


def depth_range(v: RoundView) -> list[float]:
    # Room right of the deepest column for the "target: …" label of a walk that stopped there.
    return [-0.3, max(v.depths, default=0) + 1.9]


def leaf_rows(v: RoundView) -> int:
    return int(max(tree_layout(v.parents), default=0)) + 1


def _tree_layout_dict(title: str = "", views: Sequence[RoundView] = ()) -> dict:
    rows = max((leaf_rows(v) for v in views), default=1)
    first = views[0] if views else RoundView([-1], [0], [-1], [0.0], [0.0], [0], [0], None)
    return dict(title=dict(text=title), showlegend=True, template="plotly_white",
                height=min(2400, max(520, 170 + ROW_PX * (rows + 1))),  # + the header row
                legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
                margin=dict(l=30, r=30, t=90, b=40), hovermode="closest",
                xaxis=dict(title=dict(text="depth in the draft tree (0 = the root, the last accepted token)"),
                           dtick=1, zeroline=False, range=depth_range(first)),
                yaxis=dict(visible=False, autorange="reversed"))


def round_title(v: RoundView, decode, label: str = "") -> str:
    acc = " ".join(repr(show_token(decode(v.tokens[a]))) for a in v.accepted[1:]) or "(none)"
    return f"{label}round {v.index}: τ = {v.tau}, {v.n} nodes · accepted {acc}"


COLOR_NOTE = "colour: the drafter's probability of the node's token"


def tree_figure(r: Any, tokenizer: Any = None, title: str | None = None) -> go.Figure:
    v = r if isinstance(r, RoundView) else round_view(r)
    decode = make_decoder(tokenizer)
    fig = go.Figure([go.Scatter(**{k: val for k, val in t.items() if k != "type"}) for t in tree_traces(v, decode)])
    fig.update_layout(**_tree_layout_dict(title or round_title(v, decode), [v]))
    return fig


def tree_slider_figure(rounds: Sequence[Any], tokenizer: Any = None, labels: Sequence[str] | None = None,
                       title: str = "draft trees") -> go.Figure:
    """Static figure for the report: one slider step per round (4 traces each, one step visible);
    each step fits the depth axis to its own tree. `title` names what the rounds are (run, prompt)."""
    decode = make_decoder(tokenizer)
    views = [r if isinstance(r, RoundView) else round_view(r) for r in rounds]
    labels = list(labels) if labels else [f"{v.index}" for v in views]
    fig = go.Figure()
    for k, v in enumerate(views):
        for j, t in enumerate(tree_traces(v, decode)):
            t = {key: val for key, val in t.items() if key != "type"}
            if t.get("marker") is None:
                t.pop("marker", None)
            fig.add_trace(go.Scatter(**t, visible=(k == 0), showlegend=j != 0))  # legend: path, nodes, choice

    def head(v: RoundView) -> str:
        return f"{title}<br><sup>{round_title(v, decode)} · {COLOR_NOTE}</sup>"

    steps = []
    for k, v in enumerate(views):
        vis = [j // 4 == k for j in range(4 * len(views))]
        steps.append(dict(method="update", label=labels[k],
                          args=[{"visible": vis}, {"title.text": head(v), "xaxis.range": depth_range(v)}]))
    fig.update_layout(**_tree_layout_dict(head(views[0]) if views else title, views))
    if views:
        fig.update_layout(sliders=[dict(active=0, steps=steps, pad=dict(t=40),
                                        currentvalue=dict(prefix=f"round (of {len(views)} shown): ", visible=True))])
    return fig


# ----------------------------------------------------------------------------- widget
def _figure_widget(fig: go.Figure):
    """A FigureWidget when plotly can make one (needs anywidget), else the plain Figure."""
    try:
        return go.FigureWidget(fig), True
    except Exception:  # noqa: BLE001 - ImportError for anywidget, or no widget support
        return fig, False


class TreeExplorer:
    """Prompt / budget / round pickers over recorded rounds, redrawing one tree figure.

    data: {(prompt_id, budget): [round trace, ...]}, budget an int or "auto". Use `select(...)` from code
    or tests; the widgets built by `widget()` call the same method."""

    def __init__(self, data: dict[tuple[str, int], Sequence[Any]], tokenizer: Any = None,
                 prompt_labels: dict[str, str] | None = None):
        if not data:
            raise ValueError("TreeExplorer needs at least one (prompt, budget) with rounds")
        self.data = {k: [r if isinstance(r, RoundView) else round_view(r) for r in v] for k, v in data.items()}
        self.decode = make_decoder(tokenizer)
        self.prompts = list(dict.fromkeys(k[0] for k in self.data))
        # integer budgets in order, then an `auto` run's rounds (each at the budget it chose)
        self.budgets = sorted({k[1] for k in self.data}, key=lambda b: (0, b) if isinstance(b, int) else (1, 0))
        self.prompt_labels = prompt_labels or {p: p for p in self.prompts}
        self.prompt, self.budget, self.round = self.prompts[0], self.budgets[0], 0
        base = go.Figure([go.Scatter(**{k: v for k, v in t.items() if k != "type"})
                          for t in tree_traces(self.view, self.decode)])
        base.update_layout(**_tree_layout_dict(round_title(self.view, self.decode), [self.view]))
        self.figure, self.is_widget = _figure_widget(base)
        self._controls = None
        self._output = None

    @property
    def rounds(self) -> list[RoundView]:
        return self.data.get((self.prompt, self.budget), [])

    @property
    def view(self) -> RoundView:
        rs = self.rounds
        return rs[min(self.round, len(rs) - 1)] if rs else RoundView([-1], [0], [-1], [0.0], [0.0], [0], [0], None)

    def select(self, prompt: str | None = None, budget: int | None = None, round: int | None = None) -> None:
        """Change any of the three picks and redraw (clamping the round to what exists)."""
        if prompt is not None:
            self.prompt = prompt
        if budget is not None:
            self.budget = budget
        if round is not None:
            self.round = round
        self.round = max(0, min(self.round, len(self.rounds) - 1))
        self.redraw()

    def redraw(self) -> None:
        v = self.view
        traces = tree_traces(v, self.decode)
        with self.figure.batch_update():
            for trace, t in zip(self.figure.data, traces):
                trace.update({k: val for k, val in t.items() if k != "type"})
            self.figure.layout.title.text = round_title(v, self.decode, f"budget {self.budget} · ")
            self.figure.layout.xaxis.range = _tree_layout_dict("", [v])["xaxis"]["range"]
        if self._controls is not None:
            self._sync_controls()
        if self._output is not None:  # no FigureWidget: re-render the plain figure
            from IPython.display import display
            self._output.clear_output(wait=True)
            with self._output:
                display(self.figure)

    # plain callbacks, wired to ipywidgets `observe`
    def on_prompt(self, change: dict) -> None:
        self.select(prompt=change["new"])

    def on_budget(self, change: dict) -> None:
        self.select(budget=change["new"])

    def on_round(self, change: dict) -> None:
        self.select(round=change["new"])

    def _sync_controls(self) -> None:
        self.round_slider.max = max(len(self.rounds) - 1, 0)
        if self.round_slider.value != self.round:
            self.round_slider.value = self.round
        v = self.view
        self.info.value = (f"<b>{self.prompt_labels.get(self.prompt, self.prompt)}</b> · budget {self.budget}"
                           f" · {len(self.rounds)} rounds · this round τ = {v.tau}, {v.n} nodes")

    def widget(self):
        import ipywidgets as W
        self.prompt_picker = W.Dropdown(options=[(self.prompt_labels.get(p, p), p) for p in self.prompts],
                                        value=self.prompt, description="prompt")
        self.budget_picker = W.Dropdown(options=self.budgets, value=self.budget, description="budget")
        self.round_slider = W.IntSlider(value=self.round, min=0, max=max(len(self.rounds) - 1, 0),
                                        description="round", continuous_update=False)
        self.info = W.HTML()
        self.prompt_picker.observe(self.on_prompt, names="value")
        self.budget_picker.observe(self.on_budget, names="value")
        self.round_slider.observe(self.on_round, names="value")
        self._controls = W.HBox([self.prompt_picker, self.budget_picker, self.round_slider])
        if self.is_widget:
            view = self.figure
        else:
            self._output = W.Output()
            view = self._output
        self.redraw()
        return W.VBox([self._controls, self.info, view])

    @classmethod
    def from_traces(cls, runs: dict[int, Sequence[dict]], tokenizer: Any = None, prompt_labels=None):
        """runs: {budget: traces.jsonl rows (with prompt_id)}."""
        data: dict[tuple[str, int], list] = {}
        for budget, rows in runs.items():
            for row in rows:
                if row.get("tree") is not None:
                    data.setdefault((str(row.get("prompt_id", "0")), budget), []).append(row)
        return cls(data, tokenizer, prompt_labels)

    @classmethod
    def from_results(cls, runs: dict[int, Sequence[Any]], prompt_ids: Sequence[str] | None = None,
                     tokenizer: Any = None, prompt_labels=None):
        """runs: {budget: [GenerationResult per prompt]} straight from dl.generate(trace=True)."""
        data = {}
        for budget, results in runs.items():
            for i, res in enumerate(results):
                pid = str(prompt_ids[i]) if prompt_ids else str(i)
                rounds = [r for r in (getattr(res, "rounds", None) or []) if getattr(r, "tree", None) is not None]
                if rounds:
                    data[(pid, budget)] = rounds
        return cls(data, tokenizer, prompt_labels)


# ----------------------------------------------------------------------------- notebook helpers
def setup_notebook() -> None:
    """Figures in notebooks as plotly JSON only: JupyterLab's plotly extension draws them with the
    plotly.js it ships, so neither an open notebook nor an executed one asks the network for
    anything, and no notebook carries 3.5 MB of plotly.js."""
    import plotly.io as pio
    pio.renderers.default = NOTEBOOK_RENDERER


NOTEBOOK_RENDERER = "plotly_mimetype"
