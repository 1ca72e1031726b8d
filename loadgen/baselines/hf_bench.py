"""Plain `transformers` baseline: the `tandem bench engine` workload with ``model.generate``.

Static batching, the way one would serve with transformers alone: prompts are taken in order in
chunks of ``--batch-size`` (default: all of them at once), left-padded, and each chunk generates
exactly ``--output-len`` tokens greedily (``min_new_tokens = max_new_tokens``, so EOS never stops
it). Run under OUR virtualenv::

    .venv/bin/python loadgen/baselines/hf_bench.py --num-prompts 64 --input-len 50 300 \
        --output-len 128 --dtype bfloat16 --seed 0 [--batch-size 64] [--json FILE]

or ``tandem bench hf ...``. The model is the dequantised Hugging Face export of the bundled GGUF
(``loadgen/baselines/export_hf.py``, made on first use). TTFT of a request is the time from the
start of the run until its chunk produced its first token (all requests arrive at once).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadgen.bench.common import TreeRssSampler, add_workload_args, format_table, summarize, write_json  # noqa: E402
from loadgen.workloads.random_tokens import random_token_prompts, special_token_ids, warmup_prompt  # noqa: E402


def _add_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    p.add_argument("--batch-size", type=int, default=None, help="prompts per generate() call (default: all)")
    p.add_argument("--prompts-file", default=None, help="JSON list of token-id lists to run instead")
    p.add_argument("--quiet", action="store_true")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "hf",
        help="plain transformers model.generate baseline",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    _add_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    res = bench_hf(args)
    write_json(res, args.json_path)
    if not args.quiet:
        print(format_table(res), file=sys.stderr)
    print(json.dumps(res))
    return 0


def bench_hf(args: argparse.Namespace) -> dict:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from loadgen.baselines.export_hf import export

    model_path = str(export()) if args.model == "default" else args.model
    from kernels.cpu_caps import resolve_dtype

    args.dtype = resolve_dtype(args.dtype, "cpu")[0]
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    load_s = time.perf_counter() - t0

    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
    else:
        prompts = random_token_prompts(
            args.num_prompts,
            tuple(args.input_len),
            model.config.vocab_size,
            args.seed,
            exclude_ids=special_token_ids(tok),
        )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    bs = args.batch_size or len(prompts)
    n_out = args.output_len

    def batch_tensors(chunk):
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids, mask

    class FirstTokenTimer(BaseStreamer):
        """generate() calls put() once with the prompt, then once per step: the second call is the first token."""

        def __init__(self):
            self.calls = 0
            self.first_token_time = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.first_token_time is None:
                self.first_token_time = time.perf_counter()

        def end(self):
            pass

    gen_kw = dict(
        max_new_tokens=n_out,
        min_new_tokens=n_out,
        do_sample=False,
        pad_token_id=pad_id,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    with torch.inference_mode():
        ids, mask = batch_tensors([warmup_prompt(prompts)])
        model.generate(input_ids=ids, attention_mask=mask, **{**gen_kw, "max_new_tokens": 4, "min_new_tokens": 4})

        ttfts: list[float] = []
        out_tokens = 0
        with TreeRssSampler() as rss:
            start = time.perf_counter()
            for i in range(0, len(prompts), bs):
                chunk = prompts[i : i + bs]
                ids, mask = batch_tensors(chunk)
                timer = FirstTokenTimer()
                out = model.generate(input_ids=ids, attention_mask=mask, streamer=timer, **gen_kw)
                out_tokens += int((out.shape[1] - ids.shape[1]) * len(chunk))
                if timer.first_token_time is not None:
                    ttfts += [timer.first_token_time - start] * len(chunk)
            elapsed = time.perf_counter() - start

    config = {
        "model": args.model,
        "model_path": model_path,
        "num_prompts": len(prompts),
        "input_len": list(args.input_len),
        "output_len": n_out,
        "dtype": args.dtype,
        "seed": args.seed,
        "batch_size": bs,
        "prompts_file": args.prompts_file,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }
    return summarize(
        system="transformers",
        num_requests=len(prompts),
        input_tokens=sum(map(len, prompts)),
        output_tokens=out_tokens,
        elapsed_s=elapsed,
        ttfts_s=ttfts,
        peak_rss_bytes=rss.peak_bytes,
        config=config,
        extra={"load_s": load_s},
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
