"""From the search's answer to a Plan: `make_plan` (the entry), a verdict's stages and baselines, pinned
configurations, a synthesized order for the winner."""
