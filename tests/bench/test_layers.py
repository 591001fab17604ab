"""bench/layers.py: a layer's kernels and time from two profiles at two depths, against a hand computation."""
import json

import pytest

from ddtree_lab.bench import layers


def profile(depth: int, **settings) -> dict:
    """A profile of a made-up shape whose layer launches 3 kernels (2 × a, 1 × b: 10 µs and 4 µs) in a verify,
    around 5 fixed kernels (c: 20 µs); a DDTree row adds a draft stage that does not grow with depth."""
    def row(method, budget, extra):
        verify = {"kernels_per_round": 5 + 3 * depth, "us_per_round": 20 + 14 * depth}
        stages = {"verify": verify, **({"draft": {"kernels_per_round": 7, "us_per_round": 30}} if extra else {})}
        kernels = [{"stage": "verify", "name": "a", "per_round": 2 * depth, "us_per_round": 10 * depth},
                   {"stage": "verify", "name": "c", "per_round": 5, "us_per_round": 20},
                   {"stage": "verify", "name": "b", "per_round": depth, "us_per_round": 4 * depth}]
        if extra:
            kernels.append({"stage": "draft", "name": "d", "per_round": 7, "us_per_round": 30})
        return {"method": method, "budget": budget, "stages": stages, "top_kernels": kernels,
                "kernels_per_round": sum(s["kernels_per_round"] for s in stages.values()),
                "us_per_round": sum(s["us_per_round"] for s in stages.values())}
    return {"kind": "profile", "model": f"random:kimi-k2.6-ep8-rank@{depth}", "dtype": "bfloat16",
            "attention": "triton", "compile": True, "prompt_len": 4096, "tree_kernels": "auto", "routing": "uniform",
            "rows": [row("ar", None, False), row("ddtree", 16, True)], **settings}


def test_a_layer_is_the_difference_over_the_layers_between():
    got = layers.per_layer(profile(4), profile(8))
    assert got["model"] == "random:kimi-k2.6-ep8-rank" and got["layers"] == [4, 8]
    for r in got["rows"]:
        assert r["kernels"] == 3 and r["us"] == 14
        assert r["stages"]["verify"] == {"kernels": 3, "us": 14}
        assert [(k["name"], k["per_layer"], k["us"]) for k in r["top_kernels"]] == [("a", 2, 10), ("b", 1, 4)]
    assert got["rows"][1]["stages"]["draft"] == {"kernels": 0, "us": 0}  # the drafter cancels


@pytest.mark.parametrize("shallow, deep, message", [
    (profile(8), profile(4), "depths 8 and 4: the second profile must be of the deeper model"),
    (profile(4), {**profile(8), "model": "random:kimi-k2.6-tp8-rank@8"}, "two shapes"),
    (profile(4), {**profile(8), "model": "random:kimi-k2.6-ep8-rank@8~4"}, "two shapes"),  # on fewer weight sets
    (profile(4), profile(8, compile=False), "other settings: compile (True vs False)"),
    ({**profile(4), "model": "random:qwen3-8b"}, profile(8), "not a random shape at a given depth"),
    ({**profile(4), "rows": profile(4)["rows"][:1]}, profile(8), "without a shallower one: [('ddtree', 16)]"),
])
def test_profiles_that_do_not_pair_are_refused(shallow, deep, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        layers.per_layer(shallow, deep)


def test_the_command_reads_two_files_and_refuses_others_in_one_line(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "layers.json"
    a.write_text(json.dumps(profile(4)))
    b.write_text(json.dumps(profile(8)))
    layers.main([str(a), str(b), "--out", str(out)])
    assert json.loads(out.read_text())["rows"][0]["kernels"] == 3
    b.write_text(json.dumps({"kind": "e2e", "rows": []}))
    with pytest.raises(SystemExit):
        layers.main([str(a), str(b)])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"{b}: not a bench profile JSON") and "Traceback" not in "".join(err)
