"""``python -m bench.aggregate``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.aggregate.main import main

sys.exit(main())
