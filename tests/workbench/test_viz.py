"""Tree layout, tree figures, the widget explorer driven through its plain callbacks, and the
static slider figure — all without a browser."""
import math

import pytest
import torch

import ddtree_lab as dl
from ddtree_lab.workbench import figures, viz


def _row(seed=0, budget=12, L=5, V=40, accepted=(0, 1), next_token=7, prompt_id="p0", index=0):
    g = torch.Generator().manual_seed(seed)
    tree = dl.build_tree(torch.randn(L, V, generator=g) * 3, budget)
    return {"prompt_id": prompt_id, "index": index, "root_token": 3, "tree": tree.to_json(),
            "accepted": list(accepted), "next_token": next_token, "position": 10}


def test_layout_is_tidy():
    #        0
    #      / | \
    #     1  2  3        node order = best child first
    #    / \     \
    #   4   5     6
    parents = [-1, 0, 0, 0, 1, 1, 3]
    y = viz.tree_layout(parents)
    leaves = [4, 5, 2, 6]
    assert [y[i] for i in leaves] == [0.0, 1.0, 2.0, 3.0]  # leaves on consecutive rows, in order
    assert y[1] == 0.5 and y[3] == 3.0 and y[0] == (0.5 + 3.0) / 2  # parents centred over children


def test_layout_never_overlaps_on_real_trees():
    for seed in range(5):
        v = viz.round_view(_row(seed, budget=64, L=7, V=30))
        y = viz.tree_layout(v.parents)
        spots = list(zip(v.depths, y))
        assert len(set(spots)) == len(spots)
        for i in range(1, len(v.parents)):  # children are one column right of their parent
            assert v.depths[i] == v.depths[v.parents[i]] + 1


def test_round_view_from_object_and_json(tiny_pair):
    res = dl.generate(tiny_pair, "def add(a, b):\n", method="ddtree", budget=6, max_new_tokens=6)
    r = res.rounds[0]
    a, b = viz.round_view(r), viz.round_view(r.to_json())
    assert a == b
    assert a.tokens[0] == r.root_token and a.parents[0] == -1 and a.n == len(r.tree)
    assert a.accepted[0] == 0 and a.next_token == r.next_token
    # ranks derived from log-probs agree with the engine's ranks
    derived = viz._derive_ranks(a.tokens[1:], a.depths[1:], a.logprobs[1:])
    assert derived == a.ranks[1:]


def test_tree_figure_traces():
    row = _row(accepted=(0, 1), next_token=9)
    v = viz.round_view(row)
    fig = viz.tree_figure(row, tokenizer=lambda ids: f"t{ids[0]}")
    edges, acc, nodes, stop = fig.data
    assert len(nodes.x) == v.n + 1 and len(edges.x) == 3 * v.n
    y = viz.tree_layout(v.parents)
    assert list(acc.x) == [0.0, 1.0] and list(acc.y) == [y[0], y[1]]
    assert stop.x == (2.0,) and stop.text == ("target: t9",)
    probs = list(nodes.marker.color)
    assert probs[0] == 1.0 and all(0 < p <= 1 for p in probs)
    assert probs[1] == pytest.approx(math.exp(v.logprobs[1]))
    assert "rank" in nodes.hovertext[1] and "t" in nodes.hovertext[1] and "accepted" in nodes.hovertext[1]
    assert nodes.marker.size[1] > nodes.marker.size[2]  # the accepted node stands out
    assert "τ = 2" in fig.layout.title.text


def test_show_token_and_decoder():
    assert viz.show_token(" a\n") == "·a↵"
    assert viz.make_decoder(None)(5) == "#5"

    class Tok:
        def decode(self, ids):
            return "x" * ids[0]
    assert viz.make_decoder(Tok())(3) == "xxx"


@pytest.fixture
def explorer():
    data = {}
    for pid in ("p0", "p1"):
        for b, L in ((8, 4), (32, 6)):
            data[(pid, b)] = [_row(seed=hash((pid, b, k)) % 1000, budget=b, L=L, index=k,
                                   accepted=(0,) if k % 2 else (0, 1), prompt_id=pid) for k in range(3 if b == 8 else 5)]
    return viz.TreeExplorer(data, tokenizer=None, prompt_labels={"p0": "first", "p1": "second"})


def test_explorer_select_updates_figure(explorer):
    assert explorer.budget == 8 and explorer.round == 0
    nodes_before = len(explorer.figure.data[2].x)
    explorer.select(budget=32, round=4)
    v = explorer.view
    assert v.n == 32 and len(explorer.figure.data[2].x) == 33 != nodes_before
    assert list(explorer.figure.data[2].y) == viz.tree_layout(v.parents)
    assert "budget 32" in explorer.figure.layout.title.text and "round 4" in explorer.figure.layout.title.text
    explorer.select(budget=8)  # budget 8 has 3 rounds: the round is clamped
    assert explorer.round == 2 and len(explorer.figure.data[2].x) == 9


def test_explorer_widgets_drive_callbacks(explorer):
    w = explorer.widget()
    assert w.children[0].children == (explorer.prompt_picker, explorer.budget_picker, explorer.round_slider)
    explorer.round_slider.value = 1  # round 1 accepted only the root
    assert list(explorer.figure.data[1].x) == [0.0]
    assert explorer.figure.data[3].x == (1.0,)
    explorer.budget_picker.value = 32
    assert explorer.round_slider.max == 4 and len(explorer.figure.data[2].x) == 33
    explorer.prompt_picker.value = "p1"
    assert explorer.prompt == "p1" and explorer.view is explorer.data[("p1", 32)][1]
    assert "second" in explorer.info.value and "budget 32" in explorer.info.value


def test_explorer_from_results(tiny_pair):
    runs = {b: [dl.generate(tiny_pair, "class Point:\n", method="ddtree", budget=b, max_new_tokens=5)]
            for b in (2, 4)}
    ex = viz.TreeExplorer.from_results(runs, prompt_ids=["q"], tokenizer=tiny_pair)
    assert ex.budgets == [2, 4] and ex.prompts == ["q"]
    ex.select(budget=4)
    assert len(ex.figure.data[2].x) == 5
    assert not any(t.startswith("#") for t in ex.figure.data[2].text)  # real token text


def test_tree_slider_figure():
    rows = [_row(seed=k, index=k, accepted=(0, 1) if k else (0,)) for k in range(4)]
    fig = viz.tree_slider_figure(rows, labels=[f"r{k}" for k in range(4)])
    assert len(fig.data) == 16 and [t.visible for t in fig.data[:4]] == [True] * 4
    assert not any(t.visible for t in fig.data[4:])
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["r0", "r1", "r2", "r3"]
    assert steps[2].args[0]["visible"] == [j // 4 == 2 for j in range(16)]
    assert "round 2" in steps[2].args[1]["title.text"]


def test_run_figures():
    rows = [_row(seed=k, index=k, accepted=(0, 1, 2)[: 1 + k % 3]) for k in range(5)]
    fig = figures.accepted_paths_figure(rows)
    assert list(fig.data[0].y) == [1, 2, 3, 1, 2]
    h = figures.tau_histogram_figure({"a": {"values": [1, 2], "counts": [1, 3]}})
    assert list(h.data[0].y) == [0.25, 0.75]
    d = figures.acceptance_depth_figure({"a": {"depth": [1, 2], "survival": [0.5, 0.2], "conditional": [0.5, 0.4]}})
    assert len(d.data) == 2 and list(d.data[1].y) == [0.5, 0.4]


def test_explorer_without_figurewidget(explorer, monkeypatch):
    # Without anywidget plotly cannot make a FigureWidget: a plain Figure in an Output widget.
    monkeypatch.setattr(viz, "_figure_widget", lambda fig: (fig, False))
    ex = viz.TreeExplorer(explorer.data)
    assert not ex.is_widget
    w = ex.widget()
    ex.round_slider.value = 2
    assert w.children[2] is ex._output and ex.round == 2
    assert list(ex.figure.data[2].y) == viz.tree_layout(ex.view.parents)


def test_depth_axis_leaves_room_for_the_target_label(explorer):
    v = explorer.view
    assert explorer.figure.layout.xaxis.range[1] > max(v.depths) + 1  # the ✕ sits at depth + 1
    explorer.select(budget=32)
    assert explorer.figure.layout.xaxis.range[1] == max(explorer.view.depths) + 1.9


def _boxes_overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] < b[3] and b[2] < a[3]


def test_target_label_sits_outside_every_node_box(explorer):
    """Boxes in axis units: a node's marker and the token label right of it fill most of one column and
    row; the target's label starts at its cross and runs right by about a column."""
    def clear(stop, nodes) -> bool:
        label = (stop.x[0], stop.x[0] + 1.0, stop.y[0] - 0.35, stop.y[0] + 0.35)
        return not any(_boxes_overlap(label, (x - 0.2, x + 0.9, y - 0.35, y + 0.35)) for x, y in zip(nodes.x, nodes.y))

    for seed in range(8):
        for accepted in ((0,), (0, 1)):
            row = _row(seed, budget=48, L=6, V=30, accepted=accepted)
            _, _, nodes, stop = viz.tree_figure(row).data
            assert stop.x[0] == nodes.x[accepted[-1]] + 1  # in the column the walk would have gone on to
            assert clear(stop, nodes), (seed, accepted)
    for budget, rounds in ((8, 3), (32, 5)):
        for k in range(rounds):
            explorer.select(budget=budget, round=k)
            assert clear(explorer.figure.data[3], explorer.figure.data[2]), (budget, k)
    fig = viz.tree_slider_figure([_row(seed=k, index=k, budget=32, accepted=(0, 1)) for k in range(3)])
    for k in range(3):
        assert clear(fig.data[4 * k + 3], fig.data[4 * k + 2]), k
