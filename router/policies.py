"""Routing policies: which prefill and which decode instance serve a request.

Contract of a policy (`RoutingPolicy.choose`):
- it is given the request (`RouteContext`: prompt token ids, block hashes on demand, the
  client's `user`) and a non-empty list of *routable* candidates (healthy, not yet tried
  for this request), and returns one of them;
- it may keep its own state (counters, a prefix index) and mutates nothing else;
- it must not fail: "nobody can serve" is decided before it is called.

Policies register by name (`@register_policy`) and cluster.yaml's `router.policy` picks
one: round_robin and random here, session and kv_aware in router/kv_aware.py. A policy is
built with a seed and the router's ClusterView (router/cluster_view.py: KV residency,
load, reservations), which the stateless ones ignore.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

from protocol.hashing import hash_chain
from protocol.ids import BlockHash
from router.instances import Instance, Role

if TYPE_CHECKING:
    from router.cluster_view import ClusterView


@dataclass
class RouteContext:
    """What a policy may look at to place one request."""

    request_id: str
    prompt_token_ids: Sequence[int]
    user: str | None = None
    """OpenAI's `user` field: a session hint for affinity tie-breaks."""
    session_id: str | None = None
    """The client's session (a session header such as x-session-id, else `user`)."""
    predicted_compute_tokens: int | None = None
    """Set by a pricing policy for the prefill it chose: prompt tokens it expects that
    instance to compute (the router counts them as that instance's queued work)."""
    _hashes: dict[tuple[int, bytes], list[BlockHash]] | None = field(default=None, repr=False)
    """Built on the first `block_hashes` (a policy or a view that knows a block size)."""

    def block_hashes(self, block_size: int, root: BlockHash) -> list[BlockHash]:
        """The prompt's hash chain (protocol/hashing.py), computed once per (size, root)."""
        if self._hashes is None:
            self._hashes = {}
        key = (block_size, bytes(root))
        if key not in self._hashes:
            self._hashes[key] = hash_chain(self.prompt_token_ids, block_size, root)
        return self._hashes[key]


class RoutingPolicy(ABC):
    """Chooses an instance of a role for a request. See the module docstring's contract."""

    name: ClassVar[str]

    @abstractmethod
    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        """One of `candidates` (non-empty, all healthy) for `ctx`'s `role` step."""


_P = TypeVar("_P", bound=type[RoutingPolicy])
_POLICIES: dict[str, Callable[[int | None, ClusterView], RoutingPolicy]] = {}


def register_policy(cls: _P) -> _P:
    """Class decorator: make `cls` selectable as `router.policy: <cls.name>`."""
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    import router.kv_aware  # noqa: F401 (registers session and kv_aware)

    return tuple(sorted(_POLICIES))


def make_policy(
    name: str, seed: int | None = None, view: ClusterView | None = None
) -> RoutingPolicy:
    """A fresh policy by name over `view` (an empty one when None); ValueError listing
    the known names otherwise."""
    from router.cluster_view import ClusterView

    factory = _POLICIES.get(name) if name in policy_names() else None
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}")
    return factory(seed, view if view is not None else ClusterView())


@register_policy
class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the candidates, one counter per role."""

    name = "round_robin"

    def __init__(self, seed: int | None = None, view: ClusterView | None = None) -> None:
        del seed, view  # deterministic and stateless by construction
        self._next: dict[Role, int] = {"prefill": 0, "decode": 0, "unified": 0}

    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        i = self._next[role]
        self._next[role] = i + 1
        return candidates[i % len(candidates)]


@register_policy
class RandomPolicy(RoutingPolicy):
    """Uniform choice; seeded for reproducible tests and benchmarks."""

    name = "random"

    def __init__(self, seed: int | None = None, view: ClusterView | None = None) -> None:
        del view
        self._rng = random.Random(seed)

    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        return candidates[self._rng.randrange(len(candidates))]
