"""Frozen configuration objects for the engine.

`ModelConfig` is the architecture as the engine sees it, normalised from a Hugging Face
`config.json` or from GGUF metadata; `EngineConfig` is how one engine instance runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from kernels.cpu.build import target_for
from kernels.cpu_caps import resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, independent of where the weights came from."""

    architecture: str  # "llama" (Llama/Mistral/Qwen2/Qwen3/SmolLM2) or "opt"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP inner size (OPT: ffn_dim)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6  # OPT: layer_norm eps (1e-5)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling dict ("llama3", "linear", ...) or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2: True)
    o_proj_bias: bool = False  # output-projection bias (Llama/Mistral/Qwen3 with attention_bias; never Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    hidden_act: str = "silu"  # OPT: "relu"
    # OPT-specific
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None  # OPT-350m projects embeddings; None = hidden_size
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # recorded; not used (Mistral v0.1 only)
    name: str = ""  # human-readable model name / path

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token across all layers for a float32 cache (scale for dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs: device, dtype, memory and batching limits."""

    model: str = "default"
    # "auto": the model's own weights; "dummy": random weights in its architecture (vLLM's
    # --load-format dummy), where `model` may also name a built-in architecture
    # (engine/loader/dummy.py: qwen3-0.6b, llama-3-8b, opt-13b) that has no files at all
    load_format: str = "auto"
    device: str = "cpu"
    # "auto" | "float32" | "bfloat16" | "float16". auto: bfloat16 on a CPU with native bf16
    # (AVX512-BF16 or AMX) or a GPU with bf16, float32 on other CPUs; `resolved()` decides it
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None  # overrides kv_cache_gib when set (tests)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024  # token budget per step (chunked prefill)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: model's max_position_embeddings
    policy: str = "fcfs"  # "fcfs", "rr" or "bros"
    # RT class defaults (per-request SLO fields override them); BE requests have no SLO
    rt_ttft_s: float = 0.4
    rt_tpot_s: float = 0.2
    bros_base_cap: int = 128  # adaptive batch cap starts (and resets) here, doubling up to max_num_seqs
    bros_min_be_share: float = 0.1  # BE's guaranteed token share while it waits (docs/bros.md; 0 = off)
    bros_token_group: int = 1  # RT tokens per deadline after the first (docs/bros.md)
    bros_be_fills_rt_ends: bool = True  # with no free block, BE may fill an RT block's free end (docs/bros.md)
    bros_be_order: str = "arrival"  # BE packing order: "arrival" or the paper's "checkpointed" (docs/bros.md)
    # a step-time profile: bros and ellm use it instead of profiling; any policy publishes it
    cost_model_path: str | None = None
    # when a profiled cost model is trusted (engine/profile_trust.py, docs/engine.md "Cost
    # profiles"): others' load per CPU while it was measured, the measuring thread's CPU share,
    # the fit's MAPE per phase, and the factor by which a cached profile may miss a spot timing
    # of two decode steps at start (0: no spot check). None: `TANDEM_PROFILE_*` in the
    # environment, else the documented defaults (1.0, 0.5, 0.25, 3.0)
    profile_max_load_per_cpu: float | None = None
    profile_min_cpu_share: float | None = None
    profile_max_fit_error: float | None = None
    profile_spot_check_factor: float | None = None
    swap_space_gib: float = 1.0  # host space for checkpointed / swapped-out KV
    num_host_blocks: int | None = None  # overrides swap_space_gib when set (tests)
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None = leave as is
    packed_weights: bool = True  # CPU: pre-pack linear weights for oneDNN once where it pays (models/packed_linear.py)
    # attention kernel: "cpp" (kernels/cpu/, the C++ decode kernel built for this CPU's ISA),
    # "fused" (kernels/compiled/decode.py, Inductor; CPU decode), "triton" (kernels/triton:
    # decode and prefill on CUDA; on CPU only under TRITON_INTERPRET=1, for tests),
    # "reference" (gather + matmul, any device: the oracle), or "auto": decided per device,
    # dtype and CPU by `decode_kernel` below (measurements in docs/engine.md)
    attention: str = "auto"
    # with the cpp or fused kernel, decode-only steps run each decoder layer as one Inductor
    # graph (models/decode_graph.py; Llama family); False keeps them op by op; None (auto):
    # `layers_compiled` below decides per dtype
    compile_layers: bool | None = None
    # the decoder layers' elementwise work (add + RMSNorm, q/k norm + RoPE, SiLU * up, the KV
    # write): "auto" runs the fused C++ kernels (kernels/cpu/elementwise.cpp) on a CPU in
    # float32 or bfloat16 where they build, PyTorch op by op elsewhere; "cpp" requires them;
    # "off" is op by op (kernels/layer_ops.py; measurements in docs/engine.md)
    fused_ops: str = "auto"
    # how prefill rows are attended: "auto" runs them through the C++ paged kernel with the
    # decode rows, every row of a step in one call (a prompt's row i is a query over its first
    # ctx + i + 1 tokens), wherever the decode kernel is "cpp"; "sdpa" keeps one SDPA call per
    # prompt (the path every other kernel takes; the A/B switch; docs/engine.md)
    prefill_attention: str = "auto"
    # greedy token selection: "auto" runs the C++ argmax (kernels/cpu/argmax.cpp) on a CPU where
    # it builds, torch.argmax elsewhere; "cpp" requires it; "torch" is the A/B switch
    # (kernels/greedy.py; torch.argmax is not vectorised on CPU: docs/engine.md)
    greedy_kernel: str = "auto"
    # repeat each KV head for its query heads after loading (models/kv_expand.py): the same
    # function with multi-head attention's KV memory shape (the hybrid cache's MHA test model)
    kv_heads_expand: bool = False
    # the hybrid cache (docs/aptserve.md): "kv" or "hidden" forces that form for every request
    # (checking and debugging); "auto" lets the policy choose (KV for every policy but aptserve)
    cache_form: str = "auto"
    # aptserve: seconds of K/V rebuild per block of HIDDEN context per step (the penalty's ρ);
    # None: measured by the profiler on this model (docs/aptserve.md), a number overrides it.
    # aptserve_decay: a demoted request's value factor (0: ~zero)
    aptserve_rho: float | None = None
    aptserve_decay: float = 0.0
    # aptserve: price a conversion's (or preemption's) re-prefill so a running request keeps its
    # form unless the gain beats it (docs/aptserve.md; measured worse, hence off); needs the cost
    # model (profiled at start even when aptserve_rho is given). False: the paper's rule.
    aptserve_price_switches: bool = False
    # multi-turn sessions (docs/sessions.md): kept KV in device, host and disk tiers
    session_dir: str | None = None  # disk tier root; None = sessions kept on device + host only
    session_host_gib: float = 1.0  # host-memory budget for kept session KV
    session_disk_gib: float = 20.0  # disk budget; least recently active sessions are deleted beyond it
    session_eviction: str = "idle-layer-size"  # host-tier eviction policy ("idle-layer-size" or "lru")
    session_prefetch_ttl_s: float = 30.0  # a prefetch pin is released if no request of the session comes
    # partial KV residency (eLLM, docs/ellm.md): every request keeps only its newest (1 - r)
    # share of computed tokens in the pool; the oldest whole blocks are rebuilt each step.
    # 0 = off. Fixed r is for checking and debugging; the `ellm` policy chooses it per step
    uncached_ratio: float = 0.0
    # where each step gets the non-resident prefix's K/V (docs/ellm.md): "rebuild" re-runs the
    # prefix tokens through every layer; "host" copies the leaving blocks to host swap space
    # (swap_space_gib) and reads them back layer by layer (falls back to rebuild when host is full);
    # "auto" (policy ellm only): the cheaper of the two per step, as the optimiser prices them
    uncached_source: str = "rebuild"
    # with the host source on a CPU (host swap space and the pool are the same DRAM): keep the
    # swap space in the pool's tensor and read a host-kept prefix in place through the block
    # table, so its steps stay on the compiled decode path (docs/ellm.md). False: copy each
    # layer's prefix into a scratch and attend it apart (what a GPU does; kept for checking)
    host_prefix_in_place: bool = True

    def __post_init__(self) -> None:
        if self.cache_form not in ("auto", "kv", "hidden"):
            raise ValueError(f"cache_form must be auto, kv or hidden, not {self.cache_form!r}")
        if self.fused_ops not in ("auto", "cpp", "off"):
            raise ValueError(f"fused_ops must be auto, cpp or off, not {self.fused_ops!r}")
        if self.greedy_kernel not in ("auto", "cpp", "torch"):
            raise ValueError(f"greedy_kernel must be auto, cpp or torch, not {self.greedy_kernel!r}")
        if self.prefill_attention not in ("auto", "sdpa"):
            raise ValueError(f"prefill_attention must be auto or sdpa, not {self.prefill_attention!r}")

    def resolved(self) -> EngineConfig:
        """This config with `dtype="auto"` decided for this machine (kernels/cpu_caps.py), logged.
        A concrete dtype is checked and kept."""
        dtype, why = resolve_dtype(self.dtype, self.device)
        if self.dtype == "auto":
            log.info("dtype auto -> %s: %s", dtype, why)
        return self if dtype == self.dtype else replace(self, dtype=dtype)

    @property
    def decode_kernel(self) -> str:
        """The decode attention kernel `attention` resolves to; ValueError if it is unknown or unusable.

        auto: Triton on CUDA; the C++ kernel on CPU for float32 and bfloat16 wherever the probe
        finds a kernel target (AVX2 or AVX-512); the reference elsewhere (float16, CPUs below
        AVX2). Measured against the Inductor kernel and the reference in docs/engine.md
        (Decisions). Where the C++ kernel cannot be built (no compiler), the engine warns and
        falls back to the reference (`ModelRunner`)."""
        try:
            on_cuda = torch.device(self.device).type == "cuda"
        except RuntimeError:
            raise ValueError(f"unknown device {self.device!r}: use cpu or cuda") from None
        if self.attention == "auto":
            if self.dtype == "auto":
                raise ValueError("dtype 'auto' is decided by EngineConfig.resolved() before use")
            if on_cuda:
                return "triton"
            if self.device == "cpu" and self.dtype in ("float32", "bfloat16") and target_for() is not None:
                return "cpp"
            return "reference"
        if self.attention not in ("cpp", "fused", "reference", "triton"):
            raise ValueError(f"attention must be auto, cpp, fused, triton or reference, not {self.attention!r}")
        if self.attention in ("cpp", "fused") and self.device != "cpu":
            raise ValueError(
                f"attention={self.attention!r} is a CPU kernel; use 'triton' or 'reference' on other devices"
            )
        if self.attention == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention='triton' runs on CUDA; on CPU only under Triton's interpreter (TRITON_INTERPRET=1), "
                "which is for tests"
            )
        return self.attention

    @property
    def layers_compiled(self) -> bool:
        """Whether decode-only steps run through compiled decoder layers (where the kernel and
        model allow). auto: yes in bfloat16 (decode step -13% measured), no in float32, where
        same-process A/Bs measured a tie on a quiet machine and the compiled layers slower
        under load, and they cost compile time at start (docs/engine.md, Decisions)."""
        if self.compile_layers is None:
            return self.dtype != "float32"
        return self.compile_layers

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is decided by EngineConfig.resolved() before use")
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
