"""Key digests of cold KV pages: a bound on `q . k` for every key of a page, without reading it.

Quest (Tang et al., 2024, §3): keep, for each page of keys and each channel, the smallest and
the largest value. For a query `q`, `sum_d max(q_d * min_d, q_d * max_d)` is at least
`q . k` for every key `k` of the page, since each term is the largest value `q_d * k_d` can
take with `k_d` between the channel's min and max. Written as two products,
`relu(q) . max + min(q, 0) . min`, the bound for many queries and pages is two matrix
multiplications.
"""

from __future__ import annotations

import torch


def key_digest(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel min and max of a page's keys.

    Args:
        keys: `[H, n, D]`, one page's keys per KV head (`n >= 1`).

    Returns:
        `(kmin, kmax)`, each `[H, D]` float32.

    Raises:
        ValueError: an empty page.
    """
    if keys.shape[1] == 0:
        raise ValueError("a page needs at least one key")
    keys = keys.float()
    return keys.amin(dim=1), keys.amax(dim=1)


def digest_bound(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bounds of `q . k` over each page's keys, for every query and query head.

    Args:
        query: `[Hq, S, D]`, `S` queries per query head; `Hq` a multiple of the KV heads.
        kmin, kmax: `[P, H, D]`, the digests of `P` pages (`key_digest`), `H` KV heads.

    Returns:
        `[Hq, S, P]` float32: query head `h` is bounded against KV head `h // (Hq // H)`
        (grouped-query attention).

    Raises:
        ValueError: query heads that do not divide among the KV heads.
    """
    q_heads, kv_heads = query.shape[0], kmin.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot share {kv_heads} KV heads")
    group = q_heads // kv_heads
    q = query.float()
    # [P, H, D] -> [Hq, D, P], each query head facing its KV head's digests
    upper = kmax.permute(1, 2, 0).repeat_interleave(group, dim=0)
    lower = kmin.permute(1, 2, 0).repeat_interleave(group, dim=0)
    return torch.bmm(q.clamp(min=0), upper) + torch.bmm(q.clamp(max=0), lower)
