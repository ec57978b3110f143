"""``python -m bench.dashboard``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.dashboard.main import main

sys.exit(main())
