"""``python -m bench.drain``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.drain.main import main

sys.exit(main())
