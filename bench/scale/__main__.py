"""``python -m bench.scale``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.scale.main import main

sys.exit(main())
