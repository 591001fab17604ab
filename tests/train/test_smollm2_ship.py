"""train/smollm2/ship.py: the SmolLM2 target carried to another machine in few files, bit for bit."""
import pytest
import torch


def test_ship_target_bit_exact(tmp_path):
    """pack stores Q4_1 / Q8_0-born tensors as their block codes; unpack rebuilds them bit for bit."""
    from safetensors.torch import load_file, save_file
    from ddtree_lab.train.smollm2 import ship
    g = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (256, 32), generator=g).float()  # 4 KiB of codes: more than a part holds
    d4, m4 = (torch.rand(256, generator=g) * 0.01).half(), (-torch.rand(256, generator=g) * 0.05).half()
    q4[:, 0], q4[:, 1] = 0, 15  # the quantizer puts the block's min and max at codes 0 and 15
    w4 = (d4.float()[:, None] * q4 + m4.float()[:, None]).reshape(128, 64)
    q8 = torch.randint(-127, 128, (16, 32), generator=g).float()
    q8[:, 0] = 127
    w8 = ((torch.rand(16, generator=g) * 0.01).half().float()[:, None] * q8).reshape(8, 64)
    src = tmp_path / "target"
    src.mkdir()
    tensors = {"a.weight": w4, "emb.weight": w8, "norm.weight": torch.randn(64, generator=g)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    info = ship.pack(src, tmp_path / "pack", part_mib=0.001)  # tiny parts: several folders
    assert info["kinds"] == {"q4_1": 1, "q8_0": 1, "raw": 1} and len(info["parts_mib"]) >= 3
    parts = sorted((tmp_path / "pack").iterdir())
    from safetensors import safe_open
    names = [k for p in parts for k in safe_open(str(p / "weights.safetensors"), "pt").keys()]
    assert "a.weight.q#0" in names and "a.weight.q#3" in names  # the big blob travels in row chunks
    out = ship.unpack(parts, tmp_path / "rebuilt")  # the parts given one by one, as they travel
    back = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert (out / "config.json").read_text() == "{}"
    with pytest.raises(SystemExit):
        ship.unpack(parts[:-1], tmp_path / "partial")
