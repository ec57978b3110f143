"""``python -m bench.reload``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.reload.main import main

sys.exit(main())
