"""`tandem profile`: fit the BROS cost model for a model on this device (cached), print it; or
show, drop and re-take the cached profiles with how each was measured (engine/profile_cache.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="profile step times and fit the BROS cost model; list, drop or re-take cached profiles",
        description="Time dummy prefill/decode batches and host copies on a power-of-two grid, fit "
        "α0·Ln + α1·Σn·a + β per phase plus swap bandwidth, cache the profile by "
        "model+device+dtype and print it (JSON) with its fit errors and the host's load while it was "
        "measured. --list shows the cached profiles and whether each can be trusted now; --drop and "
        "--retake act on one of them.",
    )
    p.add_argument("--model", default="default", help="model name or path (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--kv-heads-expand",
        action="store_true",
        help="profile the model with each KV head repeated for its query heads (MHA memory shape)",
    )
    p.add_argument("--force", action="store_true", help="re-profile even when a cached profile exists")
    p.add_argument("--out", default=None, help="also write the profile to this file")
    act = p.add_mutually_exclusive_group()
    act.add_argument("--list", action="store_true", help="show the cached profiles (newest first) and exit")
    act.add_argument(
        "--drop",
        metavar="KEY",
        nargs="+",
        help="delete cached profiles: a file name (or a unique prefix) as --list shows it, or 'untrusted'",
    )
    act.add_argument(
        "--retake", metavar="KEY", help="measure a cached profile again with the engine settings it records"
    )
    p.add_argument("--json", action="store_true", help="with --list: one JSON document instead of a table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list:
        return _list(args.json)
    if args.drop:
        return _drop(args.drop)
    if args.retake:
        return _retake(args.retake)
    from engine import EngineConfig, LLMEngine
    from engine.loader import resolve_model
    from engine.profile_cache import cached_profile
    from engine.profiling import profile, profile_path

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_heads_expand=args.kv_heads_expand,
    )
    target = LLMEngine(config).profile_target()  # fcfs: the engine itself does not profile
    source = resolve_model(args.model)
    if args.force:
        model = profile(target)
        model.save(profile_path(target, source))
    else:
        model = cached_profile(target, source).model
    if args.out:
        model.save(args.out)
    print(json.dumps(model.to_dict(), indent=2, sort_keys=True))
    return 0


def _rows() -> list[dict]:
    """One row per cached profile: what --list shows, judged by the bounds in the environment."""
    from engine.profile_cache import cached_profiles
    from engine.profile_trust import TrustBounds, doubts

    bounds = TrustBounds.of(None)
    rows = []
    for path, model in cached_profiles():
        meta = model.meta if model is not None else {}
        cond = meta.get("conditions") or {}
        found = doubts(meta, bounds, str(meta.get("device", "cpu"))) if model is not None else ["unreadable"]
        rows.append(
            {
                "key": path.stem,
                "path": str(path),
                "model": meta.get("model"),
                "dtype": meta.get("dtype"),
                "threads": meta.get("threads"),
                "taken_at": cond.get("taken_at"),
                "load_per_cpu_at_fit": cond.get("others_load_per_cpu"),
                "cpu_share_at_fit": cond.get("cpu_share"),
                "wall_s": cond.get("wall_s", meta.get("profile_seconds")),
                "prefill_mape": meta.get("prefill_mape"),
                "decode_mape": meta.get("decode_mape"),
                "decode_step_s": model.decode.beta + model.decode.alpha0 if model is not None else None,
                "trusted": not found,
                "doubts": found,
                "retakeable": "engine" in meta,
            }
        )
    return rows


def _list(as_json: bool) -> int:
    rows = _rows()
    if as_json:
        print(json.dumps({"profiles": rows}, indent=2))
        return 0
    if not rows:
        print("no cached profiles")
        return 0
    fmt = "{:<9} {:>8} {:>6} {:>7} {:>7} {:>9} {:>20}  {}"
    print(fmt.format("trusted", "load/cpu", "share", "pf MAPE", "dc MAPE", "decode s", "taken at", "key"))

    def num(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in rows:
        cells = (r["load_per_cpu_at_fit"], ".2f"), (r["cpu_share_at_fit"], ".0%"), (r["prefill_mape"], ".1%")
        print(
            fmt.format(
                "yes" if r["trusted"] else "NO",
                *(num(v, s) for v, s in cells),
                num(r["decode_mape"], ".1%"),
                num(r["decode_step_s"], ".4f"),
                r["taken_at"] or "-",
                r["key"],
            )
        )
        for d in r["doubts"]:
            print(f"          - {d}")
    return 0


def _find(key: str, rows: list[dict]) -> dict:
    hits = [r for r in rows if r["key"] == key] or [r for r in rows if r["key"].startswith(key)]
    if len(hits) != 1:
        found = "no cached profile" if not hits else f"{len(hits)} cached profiles"
        raise ValueError(f"{found} named {key!r} (tandem profile --list shows them)")
    return hits[0]


def _drop(keys: list[str]) -> int:
    rows = _rows()
    chosen = [r for r in rows if not r["trusted"]] if keys == ["untrusted"] else [_find(k, rows) for k in keys]
    for r in chosen:
        Path(r["path"]).unlink(missing_ok=True)
        print(f"dropped {r['key']}" + ("" if r["trusted"] else f" ({'; '.join(r['doubts'])})"))
    return 0


def _retake(key: str) -> int:
    """Measure the profile again with the engine settings and thread count it records, into the
    file the cache would look for now (the old one is removed if that name changed)."""
    import torch

    from engine import EngineConfig, LLMEngine
    from engine.cost_model import CostModel
    from engine.loader import resolve_model
    from engine.profiling import profile, profile_path

    row = _find(key, _rows())
    meta = CostModel.load(row["path"]).meta
    if "engine" not in meta:
        raise ValueError(
            f"{row['key']} records no engine settings (an older profile): --drop it, and the next engine "
            "start that needs it measures it"
        )
    torch.set_num_threads(int(meta["threads"]))  # part of the cache key
    config = EngineConfig(**meta["engine"])
    target = LLMEngine(config).profile_target()
    model = profile(target)
    path = profile_path(target, resolve_model(config.model))
    model.save(path)
    if path != Path(row["path"]):
        Path(row["path"]).unlink(missing_ok=True)
        print(f"the model's files or settings changed since: saved as {path.stem}, {row['key']} removed")
    trust = model.meta["trust"]
    verdict = "trusted" if trust["trusted"] else "NOT trusted: " + "; ".join(trust["doubts"])
    print(f"re-took {path.stem} in {model.meta['conditions']['wall_s']:.1f} s ({verdict})")
    return 0
