"""``python -m kvpark``: the same command line as ``kvpark``."""

from __future__ import annotations

import sys

from kvpark.cli.main import main

sys.exit(main())
