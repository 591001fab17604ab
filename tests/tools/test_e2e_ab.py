"""tools/e2e_ab.py: engine choices timed side by side in one process (lab pair, CPU, float32; timings unchecked)."""
import json

import pytest


def test_choices_alternate_in_one_process_and_ratios_are_to_the_first(tmp_path, load_tool, use_options):
    use_options()  # the tool sets choices for each run: restore the process's after this test
    tool = load_tool("e2e_ab")
    out = tmp_path / "ab.json"
    tool.main(["--model", "lab", "--device", "cpu", "--budgets", "8", "--rounds", "2", "--prompt-len", "16",
               "--repeats", "2", "--choice", "tree_build=sort", "--choice", "tree_kernels=torch", "--out", str(out)])
    d = json.loads(out.read_text())
    rows = {r["run"]: r for r in d["rows"]}
    assert set(rows) == {"ar", "dflash", "ddtree_8"}
    for r in rows.values():
        assert r["ratio_to_first"]["tree_build=sort"] == 1.0
        assert r["ratio_to_first"]["tree_kernels=torch"] == pytest.approx(r["tree_kernels=torch"] / r["tree_build=sort"])
    assert {c: len(reps) for c, reps in d["runs"].items()} == {"tree_build=sort": 2, "tree_kernels=torch": 2}
    assert d["command"].startswith("python -m tools.e2e_ab") and d["choices"] == ["tree_build=sort", "tree_kernels=torch"]


def test_a_launch_table_choice_reads_as_the_bench_flag_does(load_tool):
    tool = load_tool("e2e_ab")
    assert tool.parse_choice("moe_launch=SPLIT_K_UP:1;BLOCK_N_DOWN:128") == {
        "moe_launch": {"SPLIT_K_UP": 1, "BLOCK_N_DOWN": 128}}
    assert tool.parse_choice("attention_launch=min_chunk:128,declared_routing=torch") == {
        "attention_launch": {"min_chunk": 128}, "declared_routing": "torch"}


@pytest.mark.parametrize("choice,says", [("colour=red", "NAME an engine option"),
                                         ("tree_build=fastest", "tree_build='fastest' is not one of"),
                                         ("moe_launch=SPLIT:2", "--moe-config 'SPLIT=2'")])
def test_a_choice_that_is_not_an_option_is_refused_in_one_line(load_tool, capsys, choice, says):
    tool = load_tool("e2e_ab")
    with pytest.raises(SystemExit):
        tool.main(["--choice", choice, "--out", "unused.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and not any("Traceback" in line for line in err)
