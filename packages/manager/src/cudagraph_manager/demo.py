"""``python -m cudagraph_manager.demo``: the demo of ``cudagraph_manager.examples.demo``.

A thin entry point, so the command stays short; the package's ``__init__``
never imports it.
"""

from __future__ import annotations

import sys

from cudagraph_manager.examples.demo import main

if __name__ == "__main__":
    sys.exit(main())
