"""Parity GGUFs for llama.cpp: the shipped Q4_1 model's weights, dequantised, in float32 or bfloat16.

Our engine loads the bundled SmolLM2-135M-Instruct Q4_1 GGUF by dequantising every tensor to
float32 (`engine/loader/gguf.py`, with the `gguf` package) and then casting to the run's dtype.
To compare llama.cpp with us on the same numbers, this writes a GGUF whose tensors are exactly
those values: each tensor dequantised with the same `gguf.dequantize`, stored as F32, or for
bfloat16 rounded to nearest even (what torch's float32 -> bfloat16 cast does), and every
metadata key (architecture, tokenizer, chat template) copied unchanged, tensor layout
included (llama.cpp's Q/K row order, which our loader undoes and llama.cpp expects).

Decisions:
- Written with the `gguf` package, not the sdist's `convert_hf_to_gguf.py`: the converter
  needs `sentencepiece` (absent from our virtualenv), and going through the Hugging Face export
  would permute Q/K rows twice; copying the GGUF keeps the file byte-for-byte what llama.cpp
  already runs, minus the quantisation.
- One-dimensional tensors (the RMSNorm weights) stay F32 in the bfloat16 file, as llama.cpp's
  own converter does and its CPU kernels expect; they are already F32 in the Q4_1 file.

    python -m loadgen.baselines.llamacpp_gguf --dtype bfloat16 [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CACHE_DIR = Path(os.environ.get("TANDEM_EXPORT_DIR_GGUF", Path.home() / ".cache" / "tandem" / "export"))
FILE_TYPES = {"float32": ("F32", 0), "bfloat16": ("BF16", 32)}  # LlamaFileType ALL_F32, MOSTLY_BF16


def default_output(dtype: str, source: Path) -> Path:
    tag = FILE_TYPES[dtype][0]
    stem = source.name.removesuffix(".gguf").split(".")[0]
    return CACHE_DIR / f"{stem}.dequantised.{tag}.gguf"


def write_dequantised(source: Path, out: Path, dtype: str) -> Path:
    """Write `source`'s tensors dequantised to `dtype` into `out` (atomic: a temp file renamed)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, dequantize
    from gguf.quants import quantize

    if dtype not in FILE_TYPES:
        raise ValueError(f"dtype must be one of {sorted(FILE_TYPES)}, not {dtype!r}")
    reader = GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # header fields and the architecture are written by GGUFWriter itself
        if name == "general.file_type":
            writer.add_key_value(name, FILE_TYPES[dtype][1], GGUFValueType.UINT32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if dtype == "bfloat16" and values.ndim >= 2:
            packed = quantize(values, GGMLQuantizationType.BF16)
            writer.add_tensor(t.name, packed, raw_dtype=GGMLQuantizationType.BF16)  # byte shape -> elements
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def parity_gguf(dtype: str, source: Path | None = None, out: Path | None = None, force: bool = False) -> Path:
    """The parity file for `dtype` (made once, then reused)."""
    from loadgen.baselines.export_hf import default_gguf_path

    source = Path(source) if source else default_gguf_path()
    out = Path(out) if out else default_output(dtype, source)
    if out.is_file() and not force:
        return out
    return write_dequantised(source, out, dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(FILE_TYPES), required=True)
    ap.add_argument("--source", type=Path, default=None, help="GGUF to dequantise (default: the bundled Q4_1)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    print(parity_gguf(args.dtype, args.source, args.out, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
