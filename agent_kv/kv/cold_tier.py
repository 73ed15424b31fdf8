"""The cold tier: evicted tokens kept in host memory, quantized, in pages with key digests.

Eviction moves a layer's tokens out of the hot store (what attention reads); with a cold tier
they are not lost. Each eviction of a layer's row is sorted by position and cut into pages of
at most `ColdConfig.page_tokens` tokens (an eviction of `m` tokens makes `ceil(m / page)` pages
of near-equal size). A page holds its tokens' keys and values quantized per channel (one
float16 scale per KV head and channel for the page, `kernels.formats`), their original
positions, and a digest of its keys: the per-channel min and max of the dequantized keys as
attention reads them (`kernels.page_digest`, Quest, Tang et al. 2024, §3), so a query bounds
`q . k` for every key of the page without reading it. In the store's rerotate mode the
digest is taken over the keys rotated at their original positions, and queries are scored at
their original positions too: the bound is then the logit a key would take without in-cache
re-indexing (the rank distance differs from the original one).

Recall (`ColdTier.recall`) scores every page of a layer's row against a call's queries and
hands back the best pages' tokens, dequantized; the pages leave the tier. The tier holds at
most `cap_bytes` over all layers and rows: past it the oldest pages are dropped first.

Bytes (`nbytes`) count the codes, the scales and the digests exactly; positions are metadata
and, as in the hot store, not counted.

Choosing pages across layers (`ColdConfig.select = "vote"`). Ranked per layer, a page that
matters is found by some layers and missed by the others (at 8K the needle's page made a
layer's top 8 in 9 of SmolLM2's 30 layers). With votes, before a call that recalls, a vote
pass feeds the call's last `queries` tokens over the hot store (their tokens are not kept):
each layer scores its pages and spreads one vote over them in proportion to the attention
each page's best key would draw, the softmax of its scores (`ColdTier.vote`): a layer that
singles a page out gives it nearly its whole vote, one that favours the recent past spreads
it thin. The call proper then takes from every layer the pages holding the most-voted
positions, the layer's own vote-pass score breaking ties: the layers that find a page choose
it for every layer, at the same number of pages per layer.

In-cache distances (`ColdConfig.distances = "in_cache"`, rerotate mode, exact scoring): the
queries are scored as attention receives them and each cold key is rotated at the in-cache
position it would take if recalled (its rank among the layer's live tokens), so the
query-key distances that rank pages stay inside the model's trained context; at
`"original"` both sit at original positions, up to the whole history apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.budgets import parse_bytes
from agent_kv.kv.rope import Rotary
from kernels.formats import QUANT_FORMATS
from kernels.int8 import dequantize
from kernels.page_digest import digest_bound, key_digest
from kernels.torch_attention import apply_rotation

DIGEST_DTYPE = torch.float32
"""Digests stay in float32: a float16 min or max rounded the wrong way would no longer bound."""

SCORERS = ("exact", "digest")
"""How recall can rank cold pages (`ColdTier.page_scores`)."""
SELECTIONS = ("layer", "vote")
"""How recall chooses pages: each layer its own best, or by the layers' votes (module
docstring)."""
DISTANCES = ("original", "in_cache")
"""At which positions rerotate-mode scoring rotates queries and cold keys (module
docstring)."""


@dataclass(frozen=True)
class ColdConfig:
    """How evicted tokens are kept and recalled.

    Attributes:
        page_tokens: most tokens per page (16-64 is the range measured).
        pages: pages recalled per layer and row at each recall.
        queries: the last `queries` queries of a forward call score the pages (in a new
            message, the question sits at its end).
        every: also recall every `every` decode tokens (0: only at multi-token calls, i.e.
            when a new message is fed).
        cap_bytes: the most bytes the tier holds per session; the oldest pages go first.
        fmt: the page format, a `kernels.formats.QUANT_FORMATS` name (`int8` or `fp8`).
        score: how recall ranks pages, `"exact"` or `"digest"` (`ColdTier.page_scores`).
        select: how recall chooses pages, `"layer"` (each layer its best) or `"vote"` (by the
            layers' votes from a vote pass; module docstring).
        distances: in rerotate mode, score at `"original"` positions or `"in_cache"` ones
            (exact scoring only; module docstring).
        neighbours: the hot tokens within this many positions of a recalled token are kept
            right after the recalled ones, ahead of the policy's own choices, until the
            layer's next recall (0: none). A fact evicted in part (a pass key's first digits
            in a cold page, its last ones still hot) comes back whole only if its hot part
            is not what the recalled tokens push out of the budget. 64 was chosen on the
            default model's 2K needle contexts at hot budget 1,024: 2 of 5 pass keys with
            0, 3 with 16, 5 with 64 (docs/results.md, section 3).
    """

    page_tokens: int = 16
    pages: int = 8
    queries: int = 32
    every: int = 0
    cap_bytes: int = 256 * 2**20
    fmt: str = "int8"
    score: str = "exact"
    select: str = "layer"
    distances: str = "original"
    neighbours: int = 64

    @classmethod
    def from_params(cls, params: dict) -> ColdConfig:
        """The validated settings from `{name: value}` (`--recall-param`, the API's
        `policy.recall`); `cap_bytes` may be a size such as `"64MB"` (`budgets.parse_bytes`).

        Raises:
            ConfigError: an unknown name (the message lists the known ones), or an invalid
                value (`validate`).
        """
        fields = sorted(cls.__dataclass_fields__)
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise ConfigError(
                f"recall has no parameter {unknown[0]!r} (its parameters: {', '.join(fields)})"
            )
        params = dict(params)
        if isinstance(params.get("cap_bytes"), str):
            params["cap_bytes"] = parse_bytes(params["cap_bytes"])
        config = cls(**params)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise `ConfigError` naming the first invalid setting."""
        for name in ("page_tokens", "pages", "queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"recall {name} must be a whole number >= 1, got {value!r}")
        for name in ("every", "neighbours"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"recall {name} must be a whole number >= 0, got {value!r}")
        if isinstance(self.cap_bytes, bool) or not isinstance(self.cap_bytes, int):
            raise ConfigError(f"recall cap_bytes must be a number of bytes, got {self.cap_bytes!r}")
        if self.cap_bytes < 1:
            raise ConfigError(
                f"recall cap_bytes must be >= 1 (a cold tier that holds nothing recalls "
                f"nothing), got {self.cap_bytes}"
            )
        for name, known in (
            ("score", SCORERS), ("select", SELECTIONS), ("distances", DISTANCES)
        ):  # fmt: skip
            if getattr(self, name) not in known:
                raise ConfigError(
                    f"recall {name} must be one of {', '.join(known)}, got {getattr(self, name)!r}"
                )
        if self.distances == "in_cache" and self.score == "digest":
            raise ConfigError(
                "recall distances 'in_cache' needs score 'exact': a digest is taken once, at "
                "original positions"
            )
        if self.fmt not in QUANT_FORMATS:
            raise ConfigError(
                f"recall fmt must be one of {', '.join(QUANT_FORMATS)}, got {self.fmt!r}"
            )

    def due(self, query_len: int, seen: int) -> bool:
        """Whether a forward call of `query_len` queries, after which its row has seen `seen`
        tokens, recalls: every multi-token call, and every `every`-th decode token."""
        return query_len > 1 or (self.every > 0 and seen % self.every == 0)


def _page_maxima(pages: list[ColdPage], per_token: torch.Tensor) -> torch.Tensor:
    """`[P]`: the largest of `per_token` `[N]` (one value per token of `pages`, in page order)
    over each page's tokens."""
    sizes = torch.tensor([page.positions.numel() for page in pages], device=per_token.device)
    page_of = torch.repeat_interleave(torch.arange(len(pages), device=per_token.device), sizes)
    best = torch.full((len(pages),), -torch.inf, device=per_token.device)
    return best.scatter_reduce(0, page_of, per_token, reduce="amax")


@dataclass
class ColdPage:
    """Evicted tokens of one layer's row, quantized together.

    Attributes:
        positions: `[n]` int64, original positions, ascending.
        keys, values: `[H, n, D]` codes (int8 or float8_e4m3fn); keys as the hot store held
            them (rotated at their original positions, or unrotated in rerotate mode).
        key_scales, value_scales: `[H, 1, D]` float16, one scale per KV head and channel.
        kmin, kmax: `[H, D]` float32, the key digest.
        serial: eviction order over the whole tier (older pages have smaller serials).
    """

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor
    value_scales: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    serial: int

    def nbytes(self) -> int:
        """Bytes of codes, scales and digest."""
        parts = (self.keys, self.values, self.key_scales, self.value_scales, self.kmin, self.kmax)
        return sum(t.nbytes for t in parts)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 keys and values, `[H, n, D]` each."""
        return dequantize(self.keys, self.key_scales), dequantize(self.values, self.value_scales)


@dataclass
class ColdTier:
    """The cold pages of a store's layers and rows.

    Args:
        num_layers, batch: the store's shape.
        config: page size, recall and cap settings.
        rotary: the model's rotary tables when the store runs in rerotate mode (the digest is
            taken at original positions), else None.

    Attributes:
        pages: `pages[layer][row]`, oldest first.
        held: `held[layer][row]`, int64 positions recalled at the layer's last recall (None
            before any): a policy keeps them first until the next recall.
        near: `near[layer][row]`, int64 positions of the hot tokens that were within
            `ColdConfig.neighbours` of a recalled one at that recall (None before any, or
            none): a policy keeps them right after the recalled ones.
        dropped_tokens: tokens dropped past the cap.
        recalled_tokens: tokens returned to the hot store.
        peak_bytes: the most bytes the tier has held.
        recall_s: seconds spent recalling (`RecallTier.recall`: scoring and moving pages back,
            and the vote pass's scoring).
        votes: `votes[row]`, float32 `[seen]`: the votes each position drew in the current
            call's vote pass, one vote per layer spread over its pages (None outside one).
        ballots: `ballots[layer][row]`, `[P]` float32, the vote pass's page scores (None
            outside one).
    """

    num_layers: int
    batch: int
    config: ColdConfig
    rotary: Rotary | None = None
    pages: list[list[list[ColdPage]]] = field(init=False)
    held: list[list[torch.Tensor | None]] = field(init=False)
    near: list[list[torch.Tensor | None]] = field(init=False)
    votes: list[torch.Tensor | None] = field(init=False)
    ballots: list[list[torch.Tensor | None]] = field(init=False)
    dropped_tokens: int = 0
    recalled_tokens: int = 0
    peak_bytes: int = 0
    recall_s: float = 0.0
    _serial: int = 0
    _bytes: int = 0

    def __post_init__(self) -> None:
        self.config.validate()
        self.pages = [[[] for _ in range(self.batch)] for _ in range(self.num_layers)]
        self.held = [[None] * self.batch for _ in range(self.num_layers)]
        self.near = [[None] * self.batch for _ in range(self.num_layers)]
        self.forget_votes()
        self._row_bytes = [0] * self.batch

    def forget_votes(self) -> None:
        """Drop the current vote pass's votes and scores (after the call that used them)."""
        self.votes = [None] * self.batch
        self.ballots = [[None] * self.batch for _ in range(self.num_layers)]

    def nbytes(self, row: int | None = None) -> int:
        """Exact bytes of the pages of one row or (None) all rows."""
        return self._bytes if row is None else self._row_bytes[row]

    def _count(self, row: int, nbytes: int) -> None:
        self._bytes += nbytes
        self._row_bytes[row] += nbytes

    def tokens(self, layer: int, row: int = 0) -> int:
        """Tokens held in the cold pages of one layer's row."""
        return sum(page.positions.numel() for page in self.pages[layer][row])

    def add(
        self,
        layer: int,
        row: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Page and quantize one eviction of a layer's row, then drop the oldest pages while
        the tier is over its cap.

        Args:
            keys, values: `[H, m, D]` float, the evicted tokens as the hot store held them.
            positions: `[m]` int64, their original positions.
        """
        m = positions.numel()
        if m == 0:
            return
        order = torch.argsort(positions)
        fmt = QUANT_FORMATS[self.config.fmt]
        for part in torch.tensor_split(order, math.ceil(m / self.config.page_tokens)):
            k_codes, k_scales = fmt.quantize(keys[:, part], part.numel())
            v_codes, v_scales = fmt.quantize(values[:, part], part.numel())
            page_positions = positions[part].clone()
            read = self._read_keys(dequantize(k_codes, k_scales), page_positions)
            kmin, kmax = key_digest(read)
            page = ColdPage(
                positions=page_positions,
                keys=k_codes,
                values=v_codes,
                key_scales=k_scales,
                value_scales=v_scales,
                kmin=kmin.to(DIGEST_DTYPE),
                kmax=kmax.to(DIGEST_DTYPE),
                serial=self._serial,
            )
            self._serial += 1
            self.pages[layer][row].append(page)
            self._count(row, page.nbytes())
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        self._enforce_cap()

    def _read_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`keys` `[H, n, D]` as the digest sees them: as stored, or rotated at `positions`
        in rerotate mode."""
        if self.rotary is None:
            return keys
        cos, sin = self.rotary.cos_sin(positions[None])
        return apply_rotation(keys[None].float(), cos, sin)[0]

    def _enforce_cap(self) -> None:
        while self._bytes > self.config.cap_bytes:
            holders = [
                (pages, row) for layer in self.pages for row, pages in enumerate(layer) if pages
            ]
            oldest, row = min(holders, key=lambda held: held[0][0].serial)
            page = oldest.pop(0)
            self._count(row, -page.nbytes())
            self.dropped_tokens += page.positions.numel()

    def page_scores(
        self,
        layer: int,
        row: int,
        query: torch.Tensor,
        scale: float,
        placed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`[P]` float32, how strongly the queries would attend each cold page of a layer's
        row (higher first), by `config.score`:

        - `"exact"`: the largest logit `scale * q . k` over the page's dequantized keys, the
          queries and the query heads (reads every cold key of the layer once);
        - `"digest"`: from the digests alone (Quest's bound), per query head and query the
          softmax over the pages of `scale * bound`, summed over query heads and queries.

        Args:
            query: `[Hq, S, D]`, rotated as the digest's keys (`ColdTier` docstring), or in
                rerotate mode with `placed` as attention receives them.
            scale: the attention's softmax scale.
            placed: in rerotate mode, maps `[N]` original positions to the positions the
                exact scorer rotates the keys at (in-cache distances); None: original.
        """
        pages = self.pages[layer][row]
        if self.config.score == "digest":
            kmin = torch.stack([p.kmin for p in pages])
            kmax = torch.stack([p.kmax for p in pages])
            bound = digest_bound(query, kmin, kmax) * scale  # [Hq, S, P]
            return torch.softmax(bound, dim=-1).sum(dim=(0, 1))
        positions = torch.cat([p.positions for p in pages])
        codes = torch.cat([p.keys for p in pages], dim=1)  # [H, N, D]
        scales = torch.cat([p.key_scales.expand(-1, p.positions.numel(), -1) for p in pages], 1)
        keys = self._read_keys(
            dequantize(codes, scales), positions if placed is None else placed(positions)
        )
        group = query.shape[0] // keys.shape[0]
        logits = torch.bmm(query.float(), keys.repeat_interleave(group, 0).transpose(1, 2))
        return _page_maxima(pages, logits.amax(dim=(0, 1)) * scale)

    def vote(self, layer: int, row: int, scores: torch.Tensor, seen: int) -> None:
        """A layer's vote in a vote pass (module docstring): keep its page `scores` `[P]` for
        the call, and spread one vote over its pages' positions (`votes[row]`, positions
        below `seen`) in proportion to the attention each page's best key would draw: the
        softmax of the exact scores (logits), or the digest scores (already attention shares)
        normalised."""
        pages = self.pages[layer][row]
        self.ballots[layer][row] = scores
        if self.votes[row] is None:
            self.votes[row] = torch.zeros(seen, dtype=torch.float32)
        scores = scores.float().cpu()
        shares = scores / scores.sum() if self.config.score == "digest" else scores.softmax(0)
        sizes = torch.tensor([page.positions.numel() for page in pages])
        positions = torch.cat([page.positions for page in pages]).cpu()
        self.votes[row].index_add_(0, positions, shares.repeat_interleave(sizes))

    def picked(self, layer: int, row: int, scores: torch.Tensor) -> list[int]:
        """The indices of the `config.pages` pages of a layer's row to recall, given their
        `scores` `[P]`: the best scored, or during a vote pass's call those holding the
        most-voted positions first (a page's votes are its best position's), the scores
        breaking ties."""
        count = min(self.config.pages, scores.numel())
        votes = self.votes[row]
        if votes is None:
            return torch.topk(scores, count).indices.tolist()
        pages = self.pages[layer][row]
        page_votes = _page_maxima(pages, votes[torch.cat([page.positions for page in pages]).cpu()])
        order = torch.argsort(scores.cpu(), descending=True, stable=True)
        order = order[torch.argsort(page_votes[order], descending=True, stable=True)]
        return order[:count].tolist()

    def recall(
        self, layer: int, row: int, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Take the pages `picked` by `scores` out of a layer's row.

        Args:
            scores: `[P]`, the row's pages' scores (`page_scores`, or the vote pass's).

        Returns:
            `(positions [m] int64 ascending, keys [H, m, D], values [H, m, D])`, keys and
            values dequantized to float32, or None when the row's layer has no cold page.
            The positions become `held[layer][row]`.
        """
        pages = self.pages[layer][row]
        if not pages:
            self.held[layer][row] = None
            return None
        picked = set(self.picked(layer, row, scores))
        taken = [page for i, page in enumerate(pages) if i in picked]
        self.pages[layer][row] = [page for i, page in enumerate(pages) if i not in picked]
        self._count(row, -sum(page.nbytes() for page in taken))
        positions = torch.cat([page.positions for page in taken])
        keys, values = zip(*(page.dequantized() for page in taken), strict=True)
        order = torch.argsort(positions)
        self.recalled_tokens += positions.numel()
        self.held[layer][row] = positions[order]
        return (
            positions[order],
            torch.cat(keys, dim=1)[:, order],
            torch.cat(values, dim=1)[:, order],
        )

    def state(self) -> dict:
        """The tier as tensors and plain values (for `torch.save`)."""
        return {
            "config": vars(self.config).copy(),
            "pages": [
                [[{**vars(page)} for page in pages] for pages in layer] for layer in self.pages
            ],
            "held": self.held,
            "near": self.near,
            "counters": [
                self.dropped_tokens,
                self.recalled_tokens,
                self.peak_bytes,
                self._serial,
                self.recall_s,
            ],  # fmt: skip
        }

    @classmethod
    def from_state(cls, state: dict, rotary: Rotary | None = None) -> ColdTier:
        """The tier `state()` described."""
        pages = state["pages"]
        tier = cls(len(pages), len(pages[0]), ColdConfig(**state["config"]), rotary)
        tier.pages = [[[ColdPage(**p) for p in row] for row in layer] for layer in pages]
        tier.held = [list(row) for row in state["held"]]
        if "near" in state:  # saved before neighbours were kept: none
            tier.near = [list(row) for row in state["near"]]
        counters = state["counters"]
        tier.dropped_tokens, tier.recalled_tokens, tier.peak_bytes, tier._serial = counters[:4]
        tier.recall_s = counters[4]
        for layer in tier.pages:
            for row, pages in enumerate(layer):
                tier._count(row, sum(page.nbytes() for page in pages))
        return tier
