"""Tile sizes and launch settings of the Triton attention kernels, per target.

Two targets:
- **Hopper** (H100/H200, any CUDA device for now): chosen from the structure of the kernels
  and the published choices of vLLM's and SGLang's Triton attention on sm_90, not yet tuned
  on a GPU (`docs/gpu.md` lists the sweep to run). Decode is memory-bound: each program
  streams its split of one sequence's K/V for one KV head; 32-token tiles keep two 8 KiB
  K/V loads (head_dim 128, bf16) in flight per stage, and splits are added until the grid
  has about two programs per multiprocessor. Prefill is matrix-bound: 64 query rows (the
  query heads of one KV head times 64/group tokens) against 64-token K/V tiles, 4 warps.
- **Interpreter** (`TRITON_INTERPRET=1` on CPU tensors, for CI): the same kernels with small
  tiles, so that the small test shapes cross tile, block and split boundaries; every
  `tl.dot` keeps the GPU's minimum of 16 along each dimension, so nothing is tested here
  that would not compile there.

`tl.dot` on Hopper needs every dimension >= 16: query rows are padded to 16 (`min_rows`) and
the key tile and head dimension are at least 16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    decode_tile: int  # context tokens per iteration of the decode kernel
    decode_warps: int
    decode_stages: int
    extend_rows: int  # query rows (tokens x heads of one KV head) per prefill program
    extend_tile: int  # key tokens per iteration of the prefill kernel
    extend_warps: int
    extend_stages: int
    target_programs: int  # decode splits are added until the grid has about this many programs
    max_splits: int  # at most this many splits per sequence (the merge kernel reads them at once)
    min_split_tiles: int  # ...and each split spans at least this many decode tiles
    min_rows: int = 16  # tl.dot's minimum M on the GPU


INTERPRETER = TileConfig(
    decode_tile=16,
    decode_warps=1,
    decode_stages=1,
    extend_rows=16,
    extend_tile=16,
    extend_warps=1,
    extend_stages=1,
    target_programs=8,
    max_splits=4,
    min_split_tiles=1,
)


def hopper(multiprocessors: int) -> TileConfig:
    return TileConfig(
        decode_tile=32,
        decode_warps=4,
        decode_stages=2,
        extend_rows=64,
        extend_tile=64,
        extend_warps=4,
        extend_stages=2,
        target_programs=2 * multiprocessors,
        max_splits=16,
        min_split_tiles=4,  # >= 128 tokens per split: the merge must stay cheap next to the split
    )


@functools.cache
def _cuda_config(index: int) -> TileConfig:
    return hopper(torch.cuda.get_device_properties(index).multi_processor_count)


def tile_config(device: torch.device) -> TileConfig:
    """The tiles for tensors on `device`: Hopper's on CUDA, the interpreter's on CPU."""
    if device.type == "cuda":
        return _cuda_config(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER


def decode_splits(config: TileConfig, seqs: int, kv_heads: int, max_context: int) -> int:
    """How many parts each decode sequence's context is cut into (split-K, flash-decoding).

    Enough programs to fill the GPU when the batch is small, none when it already fills it,
    and never parts shorter than `min_split_tiles` tiles of the longest context."""
    programs = seqs * kv_heads
    wanted = -(-config.target_programs // max(programs, 1))
    longest = -(-max_context // (config.decode_tile * config.min_split_tiles))
    return max(1, min(wanted, longest, config.max_splits))
