"""``python -m bench.signing``: see the package's docstring."""

from __future__ import annotations

import sys

from bench.signing.main import main

sys.exit(main())
