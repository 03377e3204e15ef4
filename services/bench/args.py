"""Argument types the ``pdserve bench`` subcommands share."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    """A count flag (requests, prompts, batch sizes): an integer >= 1, else argparse's usage error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """A comma-separated list of counts (concurrency levels, batch sizes): integers >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
