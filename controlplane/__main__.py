"""`python -m controlplane` runs the CLI."""

from controlplane.cli.main import main

main()
