"""The package version, defined here and nowhere else (setup.py reads this file)."""

__version__ = "0.1.0"
