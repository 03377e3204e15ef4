"""Profiling on demand: record a running stack for a few seconds and merge the processes' traces (issue 26)."""
