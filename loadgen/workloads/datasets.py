"""Named single-turn workloads: length distributions and default SLOs from the papers' notes.

| name | prompt | output | source |
|---|---|---|---|
| sharegpt | 222.76 +- 256.36 | 234.51 +- 268.50 | BROS Table 2 (ShareGPT) |
| lmsys | 90.50 +- 148.52 | 237.04 +- 228.21 | BROS Table 2 (LMSYS-Chat-1M) |
| code | 157 +- 60 | 70 +- 45 | our choice (Apt-Serve gives HumanEval only as a figure: short prompts, short outputs, low variance) |
| summarisation | 1500 +- 600 | 200 +- 150 | our choice (Apt-Serve: LongBench, long prompts, ShareGPT-like outputs, clipped to OPT's 2048) |
| sharegpt-opt | 161.31 +- 185.6 | 337.99 +- 386.9 | vLLM paper (Kwon et al., SOSP'23, Fig. 11a: ShareGPT with the OPT tokenizer, the setup Apt-Serve builds on); stds ours, ShareGPT's CVs |
| sharegpt-ellm | 222.76 +- 256.36 | 1346 +- 1541 | eLLM §6.1 (ShareGPT_Vicuna: mean input 222, output 1,346; output std ours, ShareGPT's CV), TPOT SLO 50 ms (Llama2-13B), no TTFT SLO |
| be | U(512, 1024) | U(32, 128) | BROS/FlexGen synthetic BE |

Default SLOs (seconds) are the papers' GPU values, ``(TTFT, TPOT/P99-TBT)``: chat 0.4/0.2
(BROS), code 0.5/0.5 and summarisation 4.0/1.0 (Apt-Serve OPT-13B). Runs on a slower machine
scale them (``--slo-scale``) together with lengths (``--length-scale``); see docs/loadgen.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.workloads.lengths import LengthDist, lognormal_from_moments, uniform
from loadgen.workloads.spec import SLOSpec

MIN_LEN = 4  # Apt-Serve's sampling scripts drop pairs with prompt or output < 4 tokens


@dataclass(frozen=True)
class LengthProfile:
    name: str
    prompt: LengthDist
    output: LengthDist
    slo: SLOSpec
    req_class: str = "rt"

    def scaled(self, length_scale: float, slo_scale: float) -> LengthProfile:
        """Lengths times `length_scale`, SLOs times `slo_scale`."""
        return LengthProfile(
            self.name,
            self.prompt.scaled(length_scale),
            self.output.scaled(length_scale),
            self.slo.scaled(slo_scale),
            self.req_class,
        )

    def sample_pair(self, rng: np.random.Generator, max_len: int | None) -> tuple[int, int]:
        """One (prompt, output) length pair; pairs longer than the context are redrawn, as
        Apt-Serve's sampling scripts drop them (after 100 tries both are cut to fit)."""
        for _ in range(100):
            p, o = int(self.prompt.sample(rng, 1)[0]), int(self.output.sample(rng, 1)[0])
            if max_len is None or p + o <= max_len:
                return p, o
        half = max(1, max_len // 2)
        return min(p, half), min(o, max_len - min(p, half))


def _ln(mean: float, std: float) -> LengthDist:
    return lognormal_from_moments(mean, std, min_len=MIN_LEN)


PROFILES: dict[str, LengthProfile] = {
    "sharegpt": LengthProfile("sharegpt", _ln(222.76, 256.36), _ln(234.51, 268.50), SLOSpec(0.4, 0.2)),
    # ShareGPT as vLLM's paper sampled it for OPT (Apt-Serve's setup: OPT-13B, vLLM); the means are
    # that paper's, the stds keep `sharegpt`'s coefficients of variation (1.15, 1.14)
    "sharegpt-opt": LengthProfile("sharegpt-opt", _ln(161.31, 185.6), _ln(337.99, 386.9), SLOSpec(0.4, 0.2)),
    # eLLM's ShareGPT (Llama2-13B on one A100): the paper gives the means and the TPOT SLO only
    "sharegpt-ellm": LengthProfile("sharegpt-ellm", _ln(222.76, 256.36), _ln(1346.0, 1541.0), SLOSpec(None, 0.05)),
    "lmsys": LengthProfile("lmsys", _ln(90.50, 148.52), _ln(237.04, 228.21), SLOSpec(0.4, 0.2)),
    "code": LengthProfile("code", _ln(157.0, 60.0), _ln(70.0, 45.0), SLOSpec(0.5, 0.5)),
    "summarisation": LengthProfile("summarisation", _ln(1500.0, 600.0), _ln(200.0, 150.0), SLOSpec(4.0, 1.0)),
    "be": LengthProfile("be", uniform(512, 1024), uniform(32, 128), SLOSpec(), req_class="be"),
}


def get_profile(name: str) -> LengthProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown length profile {name!r}; available: {sorted(PROFILES)}") from None
