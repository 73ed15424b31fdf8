"""A store's shared prefix: the first positions of its rows read from runs of shared blocks
(`agent_kv.kv.prefix_cache`), held once for every store that reads them, never in its own
segments (every row of a store reads the same ones); read-only, so a one-row store that cuts
into them copies the cut block (copy on write)."""

from __future__ import annotations

import torch

from agent_kv.kv.prefix_cache import PrefixCache, PrefixRun, SharedPrefix, SharedView
from agent_kv.kv.store.pins import Pins
from agent_kv.kv.store.segments import Segments


class PrefixReads:
    """The shared views a store's rows read before their own tokens.

    Args:
        segments, pins: the store's parts.

    Attributes:
        holder: the views and their references (`SharedPrefix`), or None before any.
    """

    def __init__(self, segments: Segments, pins: Pins):
        self.segments = segments
        self.pins = pins
        self.holder: SharedPrefix | None = None

    @property
    def tokens(self) -> int:
        """Positions `[0, tokens)` of the row are read from shared runs, not held in its own
        segments (0 without any)."""
        return 0 if self.holder is None else self.holder.tokens

    def nbytes(self) -> int:
        """Bytes of the shared keys and values read (held once for every store that reads
        them: never part of the store's own live or allocated bytes)."""
        return 0 if self.holder is None else self.holder.nbytes()

    def views(self) -> list[SharedView]:
        """The shared views read, in position order (empty without any)."""
        return [] if self.holder is None else list(self.holder.views)

    def share(self, cache: PrefixCache, views: list[SharedView]) -> int:
        """Read `views` (references taken, `PrefixCache.match`) as the next positions of every
        row of a store whose rows hold no token of their own yet (all rows read the same
        views): the tokens they add are seen, as if fed. Returns the tokens added per row.

        Raises:
            ValueError: a row holding tokens of its own.
        """
        seg = self.segments
        if any(seg.seen(row) != self.tokens for row in range(seg.batch)):
            raise ValueError("shared blocks go before the store's own tokens, and it holds some")
        holder = self._holder(cache)
        before = holder.tokens
        holder.extend(views)
        added = holder.tokens - before
        for row in range(seg.batch):
            seg.appended[row] += added
        return added

    def _check_one_row(self) -> None:
        if self.segments.batch != 1:
            raise ValueError("only a one-row store reads shared prefix blocks")

    def _holder(self, cache: PrefixCache) -> SharedPrefix:
        if self.holder is None:
            self.holder = SharedPrefix(cache)
        return self.holder

    def front_tokens(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[L, H, count, D]` (views) of the row's first `count` own tokens,
        positions `tokens` onward, which every layer must hold at full precision (a pinned run
        just prefilled).

        Raises:
            ValueError: a layer does not hold exactly those positions first.
        """
        seg = self.segments
        start = self.tokens
        missing = ValueError(f"the store does not hold positions {start}..{start + count} first")
        if seg.fp.capacity < count or seg.q.most():
            raise missing
        expected = torch.arange(start, start + count, device=seg.device)
        held = seg.fp["positions"][:, 0, :count]
        lengths = seg.fp.length_tensor(slice(None), slice(0, 1))
        if bool((lengths < count).any()) or not bool((held == expected).all()):
            raise missing
        return seg.fp["keys"][:, 0, :, :count], seg.fp["values"][:, 0, :, :count]

    def share_front(self, cache: PrefixCache, views: list[SharedView], count: int) -> None:
        """Read the row's first `count` own tokens from `views` instead (the runs
        `PrefixCache.publish` made of them, or found): they leave its own segments (not an
        eviction) and are read shared from now on.

        Raises:
            ValueError: a store of several rows, or one not holding those tokens first.
        """
        self._check_one_row()
        self.front_tokens(count)
        seg = self.segments
        holder = self._holder(cache)
        keep = seg.valid(slice(None), slice(0, 1))
        keep[..., seg.q.capacity : seg.q.capacity + count] = False
        seg.compact(keep, slice(None), slice(0, 1))
        self.pins.changed()
        holder.extend(views)

    def truncate(self, end: int) -> None:
        """Read shared blocks only before position `end` (the one-row store holds no token
        of its own: they all came after the shared ones): the whole blocks before it stay
        shared, the tokens of the block it cuts are copied into the FP segment (copy on
        write).

        Raises:
            ValueError: a store of several rows (they read the same views).
        """
        self._check_one_row()
        views = self.holder.views
        keys = torch.cat([view.keys for view in views], dim=2)
        values = torch.cat([view.values for view in views], dim=2)
        block = views[0].block_tokens
        kept = end - end % block
        dropped, remaining = [], kept
        for i, view in enumerate(views):
            if remaining >= view.tokens:
                remaining -= view.tokens
                continue
            if remaining:
                views[i] = SharedView(view.run, remaining // block, block)
                dropped.extend(views[i + 1 :])
                del views[i + 1 :]
            else:
                dropped.extend(views[i:])
                del views[i:]
            break
        if self.holder.cache is not None:
            self.holder.cache.release(dropped)
        seg = self.segments
        positions = torch.arange(kept, end, device=seg.device)
        if positions.numel():
            for layer in range(seg.num_layers):
                seg.insert(
                    layer, 0, keys[layer, :, kept:end], values[layer, :, kept:end], positions
                )
        self.pins.changed()

    def adopt(self, cache: PrefixCache) -> None:
        """Read the shared views restored from disk (`load`) from `cache`'s runs: the blocks
        it holds replace the restored copies, the others become its runs."""
        if self.holder is None or self.holder.cache is cache:
            return
        adopted = cache.adopt(self.holder.views)
        self.holder.release()
        self.holder = SharedPrefix(cache)
        self.holder.extend(adopted)

    def state(self) -> dict | None:
        """The shared keys and values read, copied, with their blocks' digests (None without
        any)."""
        views = self.views()
        if not views:
            return None
        return {
            "keys": torch.cat([view.keys for view in views], dim=2),
            "values": torch.cat([view.values for view in views], dim=2),
            "digests": [d for view in views for d in view.run.digests[: view.blocks]],
            "block_tokens": views[0].block_tokens,
        }

    def load(self, state: dict) -> None:
        """Read the saved shared tokens of `state()` from a run of their own, until a cache
        adopts them (`adopt`).

        Raises:
            ValueError: the saved keys and values do not match their block digests.
        """
        width = len(state["digests"]) * state["block_tokens"]
        if state["keys"].shape[2] != width or state["values"].shape != state["keys"].shape:
            raise ValueError("the saved shared prefix does not match its block digests")
        run = PrefixRun(state["keys"], state["values"], list(state["digests"]), start=0, refs=1)
        self.holder = SharedPrefix(None)
        self.holder.extend([SharedView(run, len(run.digests), state["block_tokens"])])
