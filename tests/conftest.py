"""pytest's set-up for tests/: the Hypothesis profile of this run (tests/hyp.py), chosen before
any test module builds its settings."""

try:
    import hyp  # noqa: F401  (registers and loads the profile)
except ImportError:  # Hypothesis is not installed: its tests skip themselves
    pass
