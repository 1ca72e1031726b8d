"""The host-link sweep's profiles (docs/ellm.md) come from a command that stamps them: the
shipped roofline profile with only its host link scaled, and the code and host that wrote it."""

from __future__ import annotations

from engine.cost_model import CostModel
from loadgen.sim import roofline


def test_link_scaled_profile_is_the_shipped_one_with_a_faster_link_and_a_stamp(tmp_path):
    base = roofline.build_profile(*roofline.SHIPPED["llama-2-13b-a100-80gb"])
    path = tmp_path / "x10.json"
    assert roofline.main(["--link-scale", "10", "--file", str(path)]) == 0
    scaled = CostModel.load(path)
    assert scaled.swap_bytes_per_s == base.swap_bytes_per_s * 10
    assert (scaled.prefill, scaled.decode, scaled.hidden_s_per_token) == (
        base.prefill,
        base.decode,
        base.hidden_s_per_token,
    )
    stamp = scaled.meta["provenance"]
    assert stamp["git"]["commit"] and stamp["host"]["hostname"]
    assert "x10" in scaled.meta["source"] and "--link-scale 10" in scaled.meta["command"]
