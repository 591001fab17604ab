"""One machine table (advisor/machines.json) and one matcher from a device name to its entry, for every
consumer: the report's bandwidth floor (profile.py), the advisor's check and `measured` machine, and
ingest's hardware setting (formats.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_lab.workbench import advisor as A
from ddtree_lab.workbench import formats, profile

H200_8B = Path(__file__).resolve().parents[2] / "docs" / "bench" / "e2e_random_qwen3_8b_triton_compile.json"
DEVICES = {"NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200",
           "NVIDIA H100 NVL": "h100-nvl"}


@pytest.mark.parametrize("device, entry", DEVICES.items())
def test_every_consumer_maps_a_device_to_the_same_entry(tmp_path, device, entry):
    table = A.machines_data()["machines"]
    assert A.machine_for_device(device) == entry
    assert profile.peak_bandwidth_gbps(device) == table[entry]["bandwidth_bytes_per_second"] / 1e9
    assert formats.hardware(device) == entry
    vals, _ = formats.field_settings({"completed": 1, "num_prompts": 1, "hardware": device}, formats.VLLM_SERVE)
    assert vals["hardware"] == entry
    bench = json.loads(H200_8B.read_text())
    bench["environment"]["device"] = device
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(bench))
    chk = A.check_bench([path])
    if entry in A.profile_names():
        assert chk["checked"][0]["machine"] == entry
        bench["roofline"].pop("gemm_flops_per_second", None)  # `measured` takes its entry's spec FLOP/s
        assert A.get_machine("measured", bench).flops == table[entry]["bf16_dense_flops"]
    else:  # a GPU the table knows without FLOP/s: not priced as another part
        assert not chk["checked"] and f"is {entry}, which has no FLOP/s" in chk["skipped"][0]["reason"]


def test_names_match_whole_words_and_the_most_specific_wins():
    assert A.machine_for_device("NVIDIA H20") == "h20" and A.machine_for_device("NVIDIA L40S") == "l40s"
    assert A.machine_for_device("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    assert A.machine_for_device("NVIDIA A100-PCIE-40GB") == "a100"
    assert A.machine_for_device("NVIDIA L40") is None and A.machine_for_device("cpu") is None  # L4 is not in it
    assert A.machine_for_device("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtx-pro-6000-server"
    assert A.machine_for_device("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition") == "rtx-pro-6000"
    assert A.machine_for_device("rtx-pro-6000") == "rtx-pro-6000" and A.machine_for_device(None) is None


def test_each_name_belongs_to_one_entry_with_its_source():
    seen = {}
    for key, m in A.machines_data()["machines"].items():
        assert m["source"] and m["bandwidth_bytes_per_second"] > 1e11, key
        for name in (key, *m["names"]):
            words = tuple(name.lower().replace("-", " ").split())
            assert seen.setdefault(words, key) == key, f"{name!r} names {seen[words]} and {key}"


def test_file_name_tokens_are_the_tables_one_word_names():
    """(b200 and b300 read as budgets first, as they did before the table named them.)"""
    got = formats.name_settings(Path("ddtree_b8t4_h100_c256.jsonl"), None)
    assert got["hardware"] == "h100" and got["budget"] == 8
    for key, m in A.machines_data()["machines"].items():
        for name in filter(str.isalnum, (key, *m["names"])):
            got = formats.name_settings(Path(f"run_{name.lower()}.jsonl"), None)
            assert got == ({"budget": int(name[1:])} if name.lower() in ("b200", "b300") else {"hardware": key})
