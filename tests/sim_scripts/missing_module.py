"""Imports, through a module of its own, a package that is not installed (--direct: itself)."""

import os
import sys

if "--direct" in sys.argv:
    import cudapool_no_such_package  # noqa: F401
else:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "missing_pkg"))
    import helpers  # noqa: F401
