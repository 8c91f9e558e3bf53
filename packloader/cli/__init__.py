"""The `packloader` command: a thin layer over the library."""
