"""Recovery scope "blocks": keep the valid loaded blocks after a hole, recompute the gaps.

With `KVTransferConfig(kv_load_recompute="blocks")` a failed load does not cost the
request everything after its first invalid block. Recovery (`recovery.py`) still cuts
`num_computed_tokens` back to the start of the first hole, so every block below it
stays valid (rule 1's invariant), and records the *kept ranges*: token ranges above
`num_computed_tokens` whose KV was loaded from the store and is valid. The scheduler
computes up to the start of the next kept range (a gap: its queries attend to the KV
below them, all valid by then, and write only into the gap's blocks), jumps over the
kept range, and so on; after the last one it computes the rest of the prompt.

Only KV *loaded* from the store is kept: KV computed locally after a hole attended to
it, so it is invalid too (the tokens a sync load's step computed after its loaded
prefix are recomputed). Kept ranges are whole blocks and never reach the request's
last token (it must be computed to sample). A request with kept ranges does not ask
the connector again (rule 6): what failed is recomputed, what loaded stays. A preemption or restart
drops them with everything else (`Request.restart`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvrecover.engine.request import Request
from kvrecover.kv_groups import KVCacheGroup


def supports_blocks_scope(groups: Sequence[KVCacheGroup], recurrent: bool = False) -> bool:
    """Whether recovery may keep blocks after a hole for a model with these KV cache
    groups (and, with `recurrent`, linear-attention layers): only when every group is
    full attention and no layer keeps a recurrent state. Otherwise scope "blocks" falls
    back to "prefix": a windowed group holds only its window and margin of a load and
    releases blocks as the request advances, so a gap's queries could find the blocks
    their window reads gone, and rule 8's rollback point already keeps what no window
    reads again; a recurrent state after a hole can only be rebuilt by running every
    token from the hole on, so nothing after it can be kept."""
    return not recurrent and all(group.window is None for group in groups)


def plan_kept_ranges(
    rollback_to: int,
    loaded: tuple[int, int] | None,
    earlier: Sequence[tuple[int, int]],
    bad_blocks: Collection[int],
    block_size: int,
    num_tokens: int,
) -> list[tuple[int, int]]:
    """The token ranges above `rollback_to` to keep after a failed load.

    `loaded` is the token range the judged load brought (None when the request is not
    judged for a load of its own), `earlier` the request's kept ranges before this
    verdict, `bad_blocks` the block positions that failed (in any group). A block is
    kept when all of its tokens lie in `loaded` or in an earlier kept range and it did
    not fail; adjacent kept blocks merge into one range. Kept ranges hold whole blocks
    and end before the last token.
    """
    sources = list(earlier)
    if loaded is not None:
        sources.append(loaded)
    last_token = num_tokens - 1  # computed here, to sample from its logits
    first_block = -(-rollback_to // block_size)
    kept: list[tuple[int, int]] = []
    for start, end in sorted(sources):
        # Whole blocks only: a block recomputed in part would be rewritten in place.
        last_block = min(end, last_token) // block_size
        for block in range(max(first_block, -(-start // block_size)), last_block):
            if block in bad_blocks:
                continue
            block_start, block_end = block * block_size, (block + 1) * block_size
            if kept and kept[-1][1] == block_start:
                kept[-1] = (kept[-1][0], block_end)
            elif not kept or block_start > kept[-1][1]:
                kept.append((block_start, block_end))
    return kept


def num_kept_tokens(kept: Sequence[tuple[int, int]], start: int = 0,
                    end: int | None = None) -> int:
    """Tokens of `kept` inside [start, end) (end None: no bound)."""
    total = 0
    for kept_start, kept_end in kept:
        if end is not None:
            kept_end = min(kept_end, end)
        total += max(0, kept_end - max(kept_start, start))
    return total


def truncate_kept(request: Request, end: int) -> int:
    """Drop what of the request's kept ranges lies at or beyond token `end` (its blocks
    there were given back); returns the number of kept tokens dropped."""
    kept = request.kept_ranges
    before = num_kept_tokens(kept)
    request.kept_ranges = [(s, min(e, end)) for s, e in kept if s < end]
    return before - num_kept_tokens(request.kept_ranges)


def compute_limit(request: Request) -> int:
    """Where the request's next chunk must end at the latest: the start of its next kept
    range (a gap's end), else its last token."""
    kept = request.kept_ranges
    return kept[0][0] if kept else request.num_tokens


def skip_kept(request: Request) -> None:
    """After a chunk: if it filled the gap before a kept range, jump over that range."""
    kept = request.kept_ranges
    while kept and request.num_computed_tokens == kept[0][0]:
        request.num_computed_tokens = kept.pop(0)[1]
