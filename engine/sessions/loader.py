"""Layer-wise promotion of a session's KV into device blocks, in a background thread.

A `LayerLoad` copies the chosen blocks layer by layer, each layer from host memory when the
host tier still has it, else from the session's file, and sets layer i's event once that
layer is in place. The forward pass waits on event i right before layer i (see
`LayerWaiter`), so a prefill computes on early layers while later ones are still arriving.
A layer that cannot be read (checksum, truncation, I/O) marks the load failed; its
remaining events are set so nobody waits forever, and the engine recomputes every request
that used the load.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

from engine.sessions.kvfile import KVFormatError, read_header, read_layer

log = logging.getLogger(__name__)


@dataclass
class LayerLoad:
    session_id: str
    block_ids: list[int]  # destination device blocks...
    block_indices: list[int]  # ...and the session block (token_ids[i*bs:(i+1)*bs]) each one receives
    host_layers: list[torch.Tensor | None]  # per layer: the host copy, or None to read the file
    file: Path | None
    file_tokens: tuple[int, ...] = ()  # the file must start with these tokens (it may have been rewritten)
    wait_for_file: Callable[[], object] | None = None  # blocks until a queued write of `file` is done
    ready: list[threading.Event] = field(init=False)
    done: threading.Event = field(default_factory=threading.Event)
    hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash of each destination block
    failed_layer: int | None = None
    error: str | None = None
    retired: bool = False  # the store has stopped tracking it

    def __post_init__(self) -> None:
        self.ready = [threading.Event() for _ in self.host_layers]

    @property
    def failed(self) -> bool:
        return self.failed_layer is not None

    @property
    def from_disk(self) -> bool:
        return any(t is None for t in self.host_layers)

    def nbytes(self, bytes_per_token_layer: int, block_size: int) -> tuple[int, int]:
        """(bytes from host, bytes from disk) this load moves."""
        per_layer = len(self.block_ids) * block_size * bytes_per_token_layer
        on_host = sum(t is not None for t in self.host_layers)
        return on_host * per_layer, (len(self.host_layers) - on_host) * per_layer


class LayerLoader:
    """One thread running loads in submission order.

    `layer_hook(load, layer)` runs after a layer is copied and before its event is set (tests
    use it to make a slow source observable); None in production.
    """

    def __init__(self, layers: Sequence[torch.Tensor], block_size: int) -> None:
        self.layers = layers  # the device cache, one [2, kv_heads, num_blocks, block_size, D] view per layer
        self.block_size = block_size
        self.layer_hook: Callable[[LayerLoad, int], None] | None = None
        self._jobs: queue.Queue[LayerLoad | None] = queue.Queue()
        self._thread: threading.Thread | None = None  # started by the first load: most engines never load

    def submit(self, load: LayerLoad) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tandem-kv-loader", daemon=True)
            self._thread.start()
        self._jobs.put(load)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (load := self._jobs.get()) is not None:
            with torch.inference_mode():
                self._load(load)

    def _load(self, load: LayerLoad) -> None:
        f, i = None, 0
        try:
            ids = torch.tensor(load.block_ids, dtype=torch.long, device=self.layers[0].device)
            index = torch.tensor(load.block_indices, dtype=torch.long)
            for i, host in enumerate(load.host_layers):
                if host is None and f is None:
                    f, header = self._open(load)
                src = host if host is not None else read_layer(f, header, i)
                self._copy(i, src, index, ids)
                if self.layer_hook is not None:
                    self.layer_hook(load, i)
                load.ready[i].set()
        except Exception as exc:  # noqa: BLE001 (whatever it was, the waiting forward pass must learn of it)
            self._fail(load, i, exc)
        finally:
            if f is not None:
                f.close()
            if not all(e.is_set() for e in load.ready):  # only if this thread itself is dying
                self._fail(load, i, RuntimeError("the loader stopped"))
            load.done.set()

    def _open(self, load: LayerLoad) -> tuple[BinaryIO, object]:
        if load.file is None:
            raise KVFormatError("the session has neither a host nor a disk copy of a layer")
        if load.wait_for_file is not None:
            load.wait_for_file()
        f = open(load.file, "rb")
        try:
            header = read_header(f)
            if header.token_ids[: len(load.file_tokens)] != load.file_tokens:
                raise KVFormatError("the session file no longer holds the tokens being promoted")
        except BaseException:
            f.close()
            raise
        return f, header

    def _copy(self, layer: int, src: torch.Tensor, index: torch.Tensor, ids: torch.Tensor) -> None:
        """Session blocks `index` of `src` ([2, kvh, tokens, D]) into device blocks `ids`.

        Both sides are viewed as `[2*kvh, blocks, block_size*D]`, so each block is one
        contiguous chunk per head (a per-dim-2 index_copy on the 5-d view is ~6x slower)."""
        dst = self.layers[layer]
        two, kvh, num_blocks, bs, dim = dst.shape
        blocks = src.reshape(two * kvh, -1, bs * dim).index_select(1, index)
        dst.view(two * kvh, num_blocks, bs * dim).index_copy_(1, ids, blocks.to(ids.device))

    @staticmethod
    def _fail(load: LayerLoad, layer: int, exc: Exception) -> None:
        load.failed_layer, load.error = layer, str(exc)
        log.warning("promoting session %r failed at layer %d: %s; its requests recompute", load.session_id, layer, exc)
        for event in load.ready:  # nobody may wait forever on a failed load
            event.set()


class LayerWaiter:
    """The per-layer barrier for one forward pass: waits for the loads its requests use."""

    def __init__(self, loads_by_request: dict) -> None:
        self.loads_by_request = loads_by_request  # Request -> list[LayerLoad]
        self.loads = list({id(ld): ld for lds in loads_by_request.values() for ld in lds}.values())

    def wait_layer(self, layer: int) -> None:
        for load in self.loads:
            load.ready[layer].wait()

    def failed_requests(self) -> list:
        return [r for r, loads in self.loads_by_request.items() if any(ld.failed for ld in loads)]
