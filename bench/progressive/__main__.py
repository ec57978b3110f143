"""``python -m bench.progressive``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.progressive.main import main

sys.exit(main())
