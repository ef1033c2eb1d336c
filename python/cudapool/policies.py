"""Named allocation policies: configurations of the pool that replays (and enable()) can use.

- ``builtin``: the built-in PyTorch caching allocator's default rules (rounding to 512 B,
  a small pool of 2 MiB segments for requests up to 1 MiB, 20 MiB segments for requests
  below 10 MiB, one segment rounded up to 2 MiB above that, its split and stream rules).
  The yardstick.
- ``expandable``: the built-in allocator with ``expandable_segments:True``: each (stream, pool)
  is served by one page-mapped segment that grows in place by mapping chunks (2 MiB for the
  small pool, 20 MiB for the large one) at its end, and gives back whole free chunks on
  empty_cache and when memory runs short. A second yardstick. On a device without page-mapped
  memory it falls back to plain segments (``info()["page_mapped"]`` is then 0).
- ``cudapool``: cudapool's own default, chosen by measurement to waste less (see docs/lab.md).
- ``planned``: ``cudapool`` plus ``plan_steps:True``: once the loop's step has repeated, its
  allocations are served from one range planned for it, by their position in the step
  (Note [Learning the step], csrc/core/plan.h; measured in docs/lab.md).
"""

from typing import Dict

__all__ = ["POLICIES", "DEFAULT_POLICY", "config_for"]

POLICIES: Dict[str, str] = {
    "builtin": "",
    "expandable": "expandable_segments:True",
    "cudapool": "expandable_segments:True,page_stitching:True,release_before_grow:True",
    "planned": "expandable_segments:True,page_stitching:True,release_before_grow:True,plan_steps:True",
}

DEFAULT_POLICY = "cudapool"


def config_for(name: str) -> str:
    """The configuration string of the policy ``name``; ValueError naming the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
