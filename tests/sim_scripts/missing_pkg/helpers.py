"""A module of the script's own that imports a package not installed."""

import cudapool_no_such_package  # noqa: F401
