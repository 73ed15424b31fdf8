"""Shared prefix blocks: pinned token runs that several sequences hold alike, stored once.

Sessions of one server, or episodes of one sweep, start with the same pinned tokens at the same
positions (the system prompt, the tool schemas, pinned example turns), whose keys and values are
the same: each would hold its own copy. Here they are held once, as vLLM's prefix caching does
(its `kv_cache_manager`: blocks hashed by their parent's hash and their own tokens) and
SGLang's radix cache does (a tree of token runs):
- a *block* is `block_tokens` consecutive tokens starting at a multiple of `block_tokens`; its
  *digest* hashes the digest of the block before it (none for the first), its token ids and the
  cache's identity (model, dtype and store options), so equal digests mean equal tokens at equal
  positions after an equal history, hence equal keys and values;
- a *run* (`PrefixRun`) holds the keys and values of consecutive blocks in one tensor per part,
  `[L, H, n, D]`, attached after some number of blocks of a parent run (a radix tree of runs),
  so a sequence reads its shared prefix as one contiguous segment per run it uses (one or two
  in practice), never a gather of blocks;
- a sequence holds `SharedView`s: a run and how many of its first blocks it reads (a view of
  the run's tensors, no copy). A sequence that diverges inside a run reads the blocks before
  the divergence and keeps its own tokens after them (copy on write: nothing shared is ever
  written);
- runs are reference-counted by the sequences that read them (`SharedPrefix`, whose refs go back
  when its holder is collected, so a dropped session returns its blocks at once); a run no
  sequence reads is forgotten, its blocks gone from the index.
Shared tokens are pinned tokens: read-only, never evicted or quantized by one sequence's policy,
and counted apart from a sequence's own KV (`PrefixReads.nbytes`).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import weakref
from dataclasses import dataclass, field

import torch


def block_digest(parent: bytes, tokens: list[int], identity: bytes) -> bytes:
    """The digest of one block: BLAKE2b-128 of its parent block's digest (b"" for the first),
    the cache identity and its token ids (little-endian int64)."""
    body = torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(parent + identity + body, digest_size=16).digest()


@dataclass(eq=False)
class PrefixRun:
    """Keys and values of consecutive shared blocks.

    Attributes:
        keys, values: `[L, H, n, D]`, `n` a whole number of blocks, in the stores' dtype (keys
            rotated at their positions, as a store holds them).
        digests: one per block.
        start: the position of the run's first token.
        parent: the run it continues, or None for a run from position 0.
        refs: sequences reading it (each reads one view of it).
    """

    keys: torch.Tensor
    values: torch.Tensor
    digests: list[bytes]
    start: int
    parent: PrefixRun | None = None
    refs: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of its keys and values."""
        return self.keys.nbytes + self.values.nbytes


@dataclass(frozen=True)
class SharedView:
    """The first `blocks` blocks of a run, as one sequence reads them."""

    run: PrefixRun
    blocks: int
    block_tokens: int

    @property
    def tokens(self) -> int:
        """Tokens read."""
        return self.blocks * self.block_tokens

    @property
    def keys(self) -> torch.Tensor:
        """`[L, H, tokens, D]`, a view of the run's keys."""
        return self.run.keys[:, :, : self.tokens]

    @property
    def values(self) -> torch.Tensor:
        """`[L, H, tokens, D]`, a view of the run's values."""
        return self.run.values[:, :, : self.tokens]

    @property
    def digest(self) -> bytes:
        """The digest of its last block."""
        return self.run.digests[self.blocks - 1]

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values it reads."""
        return self.keys.nbytes + self.values.nbytes


class PrefixCache:
    """The shared runs of one model, dtype and set of store options (module docstring).

    Args:
        block_tokens: tokens per block.
        identity: what besides tokens makes keys and values equal (model, dtype, options),
            hashed into every digest.

    Thread-safe: sequences of one server attach and release from several threads.
    """

    def __init__(self, block_tokens: int, identity: bytes):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.identity = identity
        self._index: dict[bytes, tuple[PrefixRun, int]] = {}  # digest -> (run, block)
        self._runs: set[PrefixRun] = set()
        self._lock = threading.Lock()
        self._collected: collections.deque[list[SharedView]] = collections.deque()
        """Views of holders the garbage collector took: given back at the next call (a
        finalizer may run inside any call, even one holding the lock)."""

    def digests(self, parent: bytes, tokens: list[int]) -> list[bytes]:
        """The digests of the whole blocks of `tokens` (a block-aligned run after the block
        whose digest is `parent`, b"" from position 0); a partial last block has none."""
        out, size = [], self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            parent = block_digest(parent, tokens[start : start + size], self.identity)
            out.append(parent)
        return out

    def release_later(self, views: list[SharedView]) -> None:
        """Give back the references `views` took at this cache's next call (what a collected
        holder does: safe from any thread, at any point)."""
        self._collected.append(list(views))

    def _drain(self) -> None:
        """Give back the references of collected holders (called holding the lock)."""
        while self._collected:
            self._release(self._collected.popleft())

    def match(self, digests: list[bytes]) -> list[SharedView]:
        """The views that read the longest held chain of `digests` (each block's digest, in
        order, e.g. from `digests`), one per run it crosses; each view takes a reference on
        its run (give them back with `release`). A view reads its run from its first block,
        so the first may cover blocks before `digests[0]` (the ones the chain continues)."""
        with self._lock:
            return self._match(digests)[0]

    def _match(self, digests: list[bytes]) -> tuple[list[SharedView], int]:
        """`match` and how many of `digests` it found (called holding the lock)."""
        self._drain()
        views: list[SharedView] = []
        found = 0
        for digest in digests:
            held = self._index.get(digest)
            if held is None:
                break
            run, block = held
            found += 1
            if views and views[-1].run is run:
                views[-1] = SharedView(run, block + 1, self.block_tokens)
            else:
                views.append(SharedView(run, block + 1, self.block_tokens))
        for view in views:
            view.run.refs += 1
        return views, found

    def publish(
        self,
        parent: SharedView | None,
        digests: list[bytes],
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
    ) -> list[SharedView]:
        """Hold blocks a sequence computed, after the view `parent` (None: from position 0),
        and return the views that read them, references taken. Blocks another sequence
        published meanwhile are read from its run (the copies given here are dropped).

        Args:
            digests: one per block (chained from `parent`'s last block).
            keys, values: `[L, H, len(digests) * block_tokens, D]`, copied.
            start: the position of the first block's first token.
        """
        with self._lock:
            views, done = self._match(digests)
            if done == len(digests):
                return views
            offset = done * self.block_tokens
            run = PrefixRun(
                keys=keys[:, :, offset:].clone(),
                values=values[:, :, offset:].clone(),
                digests=list(digests[done:]),
                start=start + offset,
                parent=views[-1].run if views else (None if parent is None else parent.run),
                refs=1,
            )
            self._runs.add(run)
            for block, digest in enumerate(run.digests):
                self._index.setdefault(digest, (run, block))
        return [*views, SharedView(run, len(run.digests), self.block_tokens)]

    def retain(self, views: list[SharedView]) -> None:
        """Take one more reference on the runs of `views` (a copied holder reads them too)."""
        with self._lock:
            for view in views:
                view.run.refs += 1

    def adopt(self, views: list[SharedView]) -> list[SharedView]:
        """Views of this cache's runs for views of runs it does not hold (a sequence restored
        from disk): the blocks it holds already are read from its runs (the restored copies
        dropped), the others become runs of its own. References taken; `views` is left as it
        is (release it as before)."""
        if not views:
            return []
        keys = torch.cat([view.keys for view in views], dim=2)
        values = torch.cat([view.values for view in views], dim=2)
        digests = [d for view in views for d in view.run.digests[: view.blocks]]
        return self.publish(None, digests, keys, values, views[0].run.start)

    def release(self, views: list[SharedView]) -> None:
        """Give back the references `views` took; a run no sequence reads any more is
        forgotten (its blocks leave the index)."""
        with self._lock:
            self._drain()
            self._release(views)

    def _release(self, views: list[SharedView]) -> None:
        """`release`, called holding the lock."""
        for view in views:
            run = view.run
            run.refs -= 1
            if run.refs <= 0 and run in self._runs:
                self._runs.discard(run)
                for digest in run.digests:
                    if self._index.get(digest, (None,))[0] is run:
                        del self._index[digest]

    @property
    def runs(self) -> int:
        """Runs held."""
        with self._lock:
            self._drain()
            return len(self._runs)

    @property
    def blocks(self) -> int:
        """Blocks held."""
        with self._lock:
            self._drain()
            return len(self._index)

    def nbytes(self) -> int:
        """Bytes of every run held (each shared block once)."""
        with self._lock:
            self._drain()
            return sum(run.nbytes for run in self._runs)


@dataclass(eq=False)
class SharedPrefix:
    """What one store reads from shared runs: its views, in position order from position 0,
    and the cache that holds them (None for views restored from disk and not adopted yet).
    The references go back when the holder is collected or `release`d."""

    cache: PrefixCache | None
    views: list[SharedView] = field(default_factory=list)

    def __post_init__(self):
        self._finalizer = weakref.finalize(self, _release_collected, self.cache, self.views)

    @property
    def tokens(self) -> int:
        """Tokens read (positions `[0, tokens)`)."""
        return sum(view.tokens for view in self.views)

    def nbytes(self) -> int:
        """Bytes of the keys and values read."""
        return sum(view.nbytes for view in self.views)

    def extend(self, views: list[SharedView]) -> None:
        """Read `views` too (their references now this holder's), after the ones read: a view
        of the run the last one reads replaces it (it reads more of that run)."""
        for view in views:
            if self.views and self.views[-1].run is view.run:
                last = self.views.pop()
                if self.cache is not None:
                    self.cache.release([last])
            self.views.append(view)

    def release(self) -> None:
        """Give every reference back now (the store stops reading shared runs)."""
        _release(self.cache, self.views)

    def __deepcopy__(self, memo) -> SharedPrefix:
        """A holder for a copied store: the same runs, references of its own, no tensor
        copied (shared blocks are read-only)."""
        if self.cache is not None:
            self.cache.retain(self.views)
        return SharedPrefix(self.cache, list(self.views))


def _release(cache: PrefixCache | None, views: list[SharedView]) -> None:
    if cache is not None:
        cache.release(views)
    views.clear()


def _release_collected(cache: PrefixCache | None, views: list[SharedView]) -> None:
    """A collected holder's finalizer: its references go back at the cache's next call."""
    if cache is not None:
        cache.release_later(views)
