"""`tandem chat`: an interactive multi-turn chat demo on the async engine, streaming tokens.

Type a message and press Enter; the reply streams as it is generated. ``/reset`` clears the
history, ``exit`` / ``quit`` or end-of-file (Ctrl-D) leaves, Ctrl-C stops the current reply.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

EXIT_WORDS = {"exit", "quit", ":q", "/exit", "/quit"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="interactive chat demo (streams tokens)", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--model", default="default", help="model name or path (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-tokens", type=int, default=512, help="maximum tokens per reply")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_repl(args))


async def _read_line(prompt: str) -> str | None:
    """input() without blocking the event loop; None on EOF."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, input, prompt)
    except EOFError:
        return None


async def _repl(args: argparse.Namespace) -> int:
    from engine import AsyncLLM, ChatPrompt, EngineConfig, SamplingParams

    cfg = {"model": args.model, "dtype": args.dtype}
    if args.kv_cache_gib is not None:
        cfg["kv_cache_gib"] = args.kv_cache_gib
    if args.device is not None:
        cfg["device"] = args.device
    interactive = sys.stdin.isatty()
    print(f"loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    engine = AsyncLLM(EngineConfig(**cfg))
    await engine.start()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = []
    if interactive:
        print("Tandem chat. Type a message; /reset clears the history; exit or Ctrl-D quits.", file=sys.stderr)
    try:
        while True:
            line = await _read_line("you> " if interactive else "")
            if line is None:
                if interactive:
                    print(file=sys.stderr)
                break
            text = line.strip()
            if not text:
                continue
            if text.lower() in EXIT_WORDS:
                break
            if text == "/reset":
                history.clear()
                print("(history cleared)", file=sys.stderr)
                continue
            history.append({"role": "user", "content": text})
            prompt = ChatPrompt(system + history)  # tokenized by the engine thread, which owns the tokenizer
            params = SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                ignore_eos=False,
            )
            request_id = f"chat-{uuid.uuid4().hex[:12]}"
            reply: list[str] = []
            sys.stdout.write("bot> " if interactive else "")
            sys.stdout.flush()
            try:
                async for delta in engine.generate(request_id, prompt, params):
                    if delta.text:
                        reply.append(delta.text)
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
                    if delta.finished:
                        break
            except (KeyboardInterrupt, asyncio.CancelledError):
                engine.abort(request_id)
                sys.stdout.write(" [stopped]")
            except ValueError as exc:  # refused (the history outgrew the context, ...): say why, keep going
                history.pop()
                print(f"[error: {exc}]")
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": "".join(reply).strip()})
    finally:
        await engine.shutdown()
    return 0
