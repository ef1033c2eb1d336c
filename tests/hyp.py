"""How the property tests draw their examples (docs/testing.md, "Property tests").

By default every Hypothesis test draws the same examples on every run: its generator is seeded
from the test itself (``derandomize``) and no example database is read or written, so a CI run
can be repeated exactly and no file left by an earlier run changes what the next one tries.
``CUDAPOOL_HYPOTHESIS=long`` (``make test-properties``) draws afresh on every run, unseeded, with
``CUDAPOOL_HYPOTHESIS_SCALE`` (default 10) times as many examples: the search for new failures.
A failure found there is reported with the example that fails; it becomes a seeded test's
explicit ``@example`` or a hand-written case.

Loaded by tests/conftest.py before any test module is imported; tests that run Hypothesis in a
child interpreter pass ``profile_settings()`` into it.
"""

import os

from hypothesis import HealthCheck, settings

LONG = os.environ.get("CUDAPOOL_HYPOTHESIS", "") == "long"
SCALE = max(1, int(os.environ.get("CUDAPOOL_HYPOTHESIS_SCALE", "10"))) if LONG else 1

# No deadline and no "too slow" check: both read the clock, which says more of a loaded machine
# than of the test (a test's own settings may name more checks to suppress).
_COMMON = dict(database=None, print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("cudapool-seeded", derandomize=True, **_COMMON)
settings.register_profile("cudapool-long", derandomize=False, **_COMMON)
settings.load_profile("cudapool-long" if LONG else "cudapool-seeded")


def examples(n: int) -> int:
    """``n`` examples in a seeded run, ``n`` times the scale in a long one."""
    return n * SCALE


def profile_settings() -> str:
    """The keyword arguments of ``settings(...)`` that select this run's draw, as Python source
    for a test that runs Hypothesis in another interpreter."""
    return (
        f"derandomize={not LONG}, database=None, deadline=None, "
        "suppress_health_check=[__import__('hypothesis').HealthCheck.too_slow]"
    )
