"""The worker agent: the command loop, its journal, settings and failpoints."""
