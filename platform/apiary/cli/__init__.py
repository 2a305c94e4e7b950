"""The ``apiary`` command line (typer)."""
