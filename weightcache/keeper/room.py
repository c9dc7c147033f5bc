"""What a keeper's budget evicts for a publish: the choice, apart from the store that makes it happen.

A publish of ``needed`` bytes by ``uid`` on a placement whose budget is ``limit``: the owner's publish may evict only
the owner's own unleased entries and artifacts (least recently used first); a member's (any other uid) also stays
within its part of what members may hold (:func:`within_share`). Both return the entries to evict, or raise
``over_budget`` (:class:`~weightcache.messages.RequestError`) with a message that says what holds the budget and
what to do; they never evict anything themselves (:class:`~weightcache.keeper.store.Store` drops what they chose,
under its lock), so a refused publish loses nothing. Layer L2: plain values in, plain values out.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import messages
from ..messages import RequestError
from ..units import format_bytes
from .held import Held


def make_room(
    held: Sequence[Held],
    key: str,
    placement: str,
    needed: int,
    uid: int,
    limit: int,
    *,
    owner: int,
    member_share: float,
) -> list[Held]:
    """What to evict so that ``needed`` more bytes of ``uid``'s fit ``limit`` on ``placement``, of ``held`` (every
    entry and artifact; each costs what its memory really holds, :attr:`~weightcache.keeper.held.Entry.charge`):
    for a member, first what :func:`within_share` chooses; then ``uid``'s own unleased entries there, least
    recently used first. Raises ``over_budget`` if even all of them would not be enough: entries of other uids are
    never chosen here, the owner's never at all."""
    out = (
        within_share(held, key, placement, needed, uid, limit, owner=owner, member_share=member_share)
        if uid != owner
        else []
    )
    gone = {id(e) for e in out}
    here = [e for e in held if e.placement == placement and id(e) not in gone]
    total = sum(e.charge for e in here)
    if total + needed <= limit:
        return out
    evictable = [e for e in here if not e.leases and e.publisher == uid]
    spare = sum(e.charge for e in evictable)
    if total - spare + needed > limit:
        leased = sum(e.charge for e in here if e.leases)
        others = sum(e.charge for e in here if not e.leases and e.publisher != uid)
        need, have, pinned, theirs, own = (format_bytes(n) for n in (needed, limit, leased, others, spare))
        raise RequestError(
            messages.OVER_BUDGET,
            f"entry {key[:16]}... of uid {uid} needs {need} on {placement}, but the keeper's budget there is "
            f"{have}: leased entries hold {pinned}, unleased entries of other uids {theirs} (the owner's never evicted "
            f"for another uid's publish), and uid {uid}'s own unleased entries {own} (evictable, not enough). Release "
            "or evict entries (`weightcache ls`, `weightcache evict --force`), publish a smaller model, or "
            "restart the keeper with a larger `weightcache serve --max-bytes`.",
        )
    for e in sorted(evictable, key=lambda e: e.last_used):
        if total + needed <= limit:
            break
        total -= e.charge
        out.append(e)
    return out


def within_share(
    held: Sequence[Held],
    key: str,
    placement: str,
    needed: int,
    uid: int,
    limit: int,
    *,
    owner: int,
    member_share: float,
) -> list[Held]:
    """For a uid other than the owner (a member): make ``needed`` more bytes fit what members may hold on
    ``placement``, or raise ``over_budget``. Members together hold at most ``1 - member_share`` of ``limit``
    (the owner keeps the rest), and while ``k`` members hold entries there each may hold at most its part of
    that pool: ``member_share`` of ``limit``, and never more than the pool over ``k``. A member over its part
    first evicts its own unleased entries, least recently used first; a member whose publish fits its part
    but not the pool evicts unleased entries of the member furthest over its part first, least recently used
    first (never the owner's, never a leased one), so that no member can starve another. Returns what to
    evict."""
    share = int(limit * member_share)
    pool = max(share, int(limit * (1 - member_share)))  # at least one member's share
    here = [e for e in held if e.placement == placement and e.publisher != owner]
    holding: dict[int, int] = {uid: 0}
    for e in here:
        holding[e.publisher] = holding.get(e.publisher, 0) + e.charge
    part = min(share, pool // len(holding))
    mine = sorted((e for e in here if e.publisher == uid and not e.leases), key=lambda e: e.last_used)
    own = holding[uid]
    if own - sum(e.charge for e in mine) + needed > part:
        sharing = (
            f"; {len(holding)} members hold entries there, so each may hold {format_bytes(part)} of the "
            f"members' {format_bytes(pool)}"
            if part < share
            else ""
        )
        raise RequestError(
            messages.OVER_BUDGET,
            f"{key[:16]}... of uid {uid} needs {format_bytes(needed)} on {placement}, but uid {uid}'s share of "
            f"the keeper's budget there is {format_bytes(share)} ({member_share:.0%} of "
            f"{format_bytes(limit)}, `weightcache serve --member-share`){sharing}, and it holds "
            f"{format_bytes(own)} already. Release or evict its entries and artifacts, or ask the keeper's owner "
            "for a larger share.",
        )
    victims: list[Held] = []
    for e in mine:
        if own + needed <= part:
            break
        victims.append(e)
        own -= e.charge
        holding[uid] = own
    members_held = sum(holding.values())
    if members_held + needed > pool:
        # Members over their part give way: the one furthest over first, its least recently used unleased entry
        # first, until the publish fits; an entry goes whole, and a member no longer over its part keeps the rest.
        spare = {
            u: sorted((e for e in here if e.publisher == u and not e.leases), key=lambda e: e.last_used)
            for u in holding
            if u != uid
        }
        while members_held + needed > pool:
            over = [u for u, entries in spare.items() if entries and holding[u] > part]
            if not over:
                break
            worst = max(over, key=lambda u: (holding[u], -spare[u][0].last_used))  # ties: least recently used
            e = spare[worst].pop(0)
            victims.append(e)
            holding[worst] -= e.charge
            members_held -= e.charge
        if members_held + needed > pool:
            raise RequestError(
                messages.OVER_BUDGET,
                f"{key[:16]}... of uid {uid} needs {format_bytes(needed)} on {placement}, but the members of "
                f"the keeper's group hold {format_bytes(members_held)} of the {format_bytes(pool)} they may hold "
                f"together there ({1 - member_share:.0%} of {format_bytes(limit)}; the owner keeps the "
                f"rest), and what members over their part ({format_bytes(part)} each) hold unleased is not "
                "enough to make room: the rest is leased or within its part. Release entries and artifacts, or "
                "ask the keeper's owner for a larger `weightcache serve --max-bytes`.",
            )
    return victims
