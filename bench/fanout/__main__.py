"""``python -m bench.fanout``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.fanout.main import main

sys.exit(main())
