"""`python -m workers` runs the worker CLI."""

from workers.cli import main

main()
