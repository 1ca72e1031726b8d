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


def test_attention_flops_only_prices_decode_attention_as_the_papers_eq3(tmp_path):
    """`--attention-flops-only` (docs/ellm.md, "Eighth session"): decode attention priced by
    its FLOPs, 4·layers·heads·head_dim per context token at the effective FLOPS, instead of
    the roofline's read of each token's 800 KiB of K/V; nothing else of the profile moves."""
    base = roofline.build_profile(*roofline.SHIPPED["llama-2-13b-a100-80gb"])
    path = tmp_path / "flops.json"
    assert roofline.main(["--link-scale", "1000", "--attention-flops-only", "--file", str(path)]) == 0
    cheap = CostModel.load(path)
    m, g = roofline.MODELS["llama-2-13b"], roofline.GPUS["a100-80gb"]
    assert cheap.decode.alpha1 == 4 * m.layers * m.heads * m.head_dim / (g.peak_flops * roofline.Efficiency().mfu)
    assert cheap.decode.alpha1 < base.decode.alpha1 / 50  # ~1/95: the K/V read dominated it
    assert (cheap.decode.alpha0, cheap.decode.beta, cheap.prefill) == (
        base.decode.alpha0,
        base.decode.beta,
        base.prefill,
    )
    assert "FLOPs only" in cheap.meta["source"] and "--attention-flops-only" in cheap.meta["command"]
