"""`python -m autopp`: the `autopp` command."""

from __future__ import annotations

import sys

from .cli import main

__all__: list[str] = []

sys.exit(main())
