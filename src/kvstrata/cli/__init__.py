"""The ``kvstrata`` command line."""
