"""The ``controlplane`` command line."""
