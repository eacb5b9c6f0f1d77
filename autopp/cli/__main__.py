"""`python -m autopp.cli`: the `autopp` command."""

from __future__ import annotations

import sys

from . import main

__all__: list[str] = []

sys.exit(main())
