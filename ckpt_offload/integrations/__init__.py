"""Glue for other libraries (import-guarded: each module imports its library on first use)."""
