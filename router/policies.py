"""Routing policies: which prefill and which decode instance serve a request.

Contract of a policy (`RoutingPolicy.choose`):
- it is given the request (`RouteContext`: prompt token ids, block hashes on demand, the
  client's `user`) and a non-empty list of *routable* candidates (healthy, not yet tried
  for this request), and returns one of them;
- it may keep its own state (counters, a prefix index) and mutates nothing else;
- it must not fail: "nobody can serve" is decided before it is called.

Policies register by name (`@register_policy`) and cluster.yaml's `router.policy` picks
one. round_robin and random exist now; kv_aware / session plug in at the same seam.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from protocol.hashing import hash_chain
from protocol.ids import BlockHash
from router.instances import Instance, Role


@dataclass
class RouteContext:
    """What a policy may look at to place one request."""

    request_id: str
    prompt_token_ids: Sequence[int]
    user: str | None = None
    """OpenAI's `user` field: a session hint for affinity tie-breaks."""
    _hashes: dict[tuple[int, bytes], list[BlockHash]] = field(default_factory=dict, repr=False)

    def block_hashes(self, block_size: int, root: BlockHash) -> list[BlockHash]:
        """The prompt's hash chain (protocol/hashing.py), computed once per (size, root)."""
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
_POLICIES: dict[str, Callable[[int | None], RoutingPolicy]] = {}


def register_policy(cls: _P) -> _P:
    """Class decorator: make `cls` selectable as `router.policy: <cls.name>`."""
    _POLICIES[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_POLICIES))


def make_policy(name: str, seed: int | None = None) -> RoutingPolicy:
    """A fresh policy by name; ValueError listing the known names otherwise."""
    factory = _POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(policy_names())}")
    return factory(seed)


@register_policy
class RoundRobinPolicy(RoutingPolicy):
    """Cycles through the candidates, one counter per role."""

    name = "round_robin"

    def __init__(self, seed: int | None = None) -> None:
        del seed  # deterministic by construction
        self._next: dict[Role, int] = {"prefill": 0, "decode": 0}

    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        i = self._next[role]
        self._next[role] = i + 1
        return candidates[i % len(candidates)]


@register_policy
class RandomPolicy(RoutingPolicy):
    """Uniform choice; seeded for reproducible tests and benchmarks."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, role: Role, ctx: RouteContext, candidates: Sequence[Instance]) -> Instance:
        return candidates[self._rng.randrange(len(candidates))]
