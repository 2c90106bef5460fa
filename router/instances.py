"""The worker instances the router knows, and whether each is routable right now.

Health is two-sided: a failed connection marks an instance unhealthy at once (the request
that saw it retries elsewhere when nothing was sent yet), and the HealthMonitor
(router/health.py) polls GET /health on every instance and restores or marks them. A
stream that breaks after its instance was restarted (seen by /health's incarnation)
does not mark the new process.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from router.decode_bindings import DecodeBindings

Role = Literal["prefill", "decode", "unified"]
"""unified: an instance that prefills and decodes in one engine (router/unified.py)."""


@dataclass(eq=False)
class Instance:
    """One prefill, decode or unified instance: its address and its health as the router sees it.

    Mutated only on the router's event loop (no locks needed). Compared by identity.
    """

    name: str
    role: Role
    url: str
    """Base URL, e.g. "http://127.0.0.1:8101"."""
    healthy: bool = True
    last_error: str | None = None
    changed_at: float = field(default_factory=time.monotonic)
    incarnation: str = ""
    """The worker process that last answered /health (protocol/incarnation.py); "" until
    one did."""

    def describe(self) -> str:
        """How error messages name it: "decode instance d0 (http://127.0.0.1:8201)"."""
        return f"{self.role} instance {self.name} ({self.url})"


class InstanceRegistry:
    """Owns the Instance records of every role; answers "who can take work now"."""

    def __init__(
        self,
        prefill: Iterable[Instance],
        decode: Iterable[Instance],
        unified: Iterable[Instance] = (),
    ) -> None:
        self._by_role: dict[Role, list[Instance]] = {
            "prefill": list(prefill),
            "decode": list(decode),
            "unified": list(unified),
        }
        for role, instances in self._by_role.items():
            assert all(i.role == role for i in instances), f"mislabelled {role} instance"
        self.bindings = DecodeBindings()
        """Requests reserved on a decode process while prefill works on them: failed
        (and aborted) when that process is known to be gone (router/decode_bindings.py)."""

    def instances(self, role: Role) -> Sequence[Instance]:
        return self._by_role[role]

    def all(self) -> list[Instance]:
        return [*self._by_role["prefill"], *self._by_role["decode"], *self._by_role["unified"]]

    def candidates(self, role: Role, exclude: Collection[str] = ()) -> list[Instance]:
        """Healthy instances of `role`, minus those named in `exclude` (already tried)."""
        return [i for i in self._by_role[role] if i.healthy and i.name not in exclude]

    def mark_unhealthy(
        self, instance: Instance, reason: str, incarnation: str = "", *, down: bool = True
    ) -> bool:
        """Mark `instance` unhealthy because of `reason`. `incarnation`: the process a
        broken stream came from; when the instance has since been seen running another
        one (the supervisor restarted it), the failure was the old process's and the
        instance stays as it is. `down`: the process is known gone (a refused or broken
        connection, not a slow answer): requests reserved on it that still wait for
        prefill fail at once. True when it was marked."""
        if incarnation and instance.incarnation and incarnation != instance.incarnation:
            return False
        instance.last_error = reason
        if instance.healthy:
            instance.healthy = False
            instance.changed_at = time.monotonic()
        if down and instance.role == "decode":
            self.bindings.lose(instance, reason, incarnation)
        return True

    def mark_healthy(self, instance: Instance, incarnation: str = "") -> None:
        if instance.role == "decode" and incarnation and incarnation != instance.incarnation:
            self.bindings.restarted(instance, incarnation)
        instance.incarnation = incarnation or instance.incarnation
        if not instance.healthy:
            instance.healthy = True
            instance.last_error = None
            instance.changed_at = time.monotonic()

    def summary(self) -> dict[str, dict[str, object]]:
        """For the router's /health body."""
        return {
            role: {
                "total": len(instances),
                "healthy": sum(i.healthy for i in instances),
                "instances": [
                    {
                        "name": i.name,
                        "url": i.url,
                        "healthy": i.healthy,
                        "error": i.last_error,
                        "incarnation": i.incarnation,
                        **(
                            {"waiting_for_prefill": self.bindings.num_bound(i)}
                            if role == "decode"
                            else {}
                        ),
                    }
                    for i in instances
                ],
            }
            for role, instances in self._by_role.items()
            if instances or role != "unified"  # P/D clusters: the body they always had
        }
