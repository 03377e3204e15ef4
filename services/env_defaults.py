"""``PDSERVE_<FLAG>`` environment variables as the defaults of every ``pdserve`` flag.

Containers are configured through their environment (compose ``environment:``,
a Kubernetes ConfigMap), so each flag of each subcommand may also be given as a
variable: ``--redis-url`` is ``PDSERVE_REDIS_URL``, ``--max-num-seqs`` is
``PDSERVE_MAX_NUM_SEQS``. A flag on the command line beats the variable, which
beats the built-in default. On/off flags take ``1/true/yes/on`` or
``0/false/no/off``; ``--no-queue`` is ``PDSERVE_NO_QUEUE=1``. An empty variable is
unset (compose passes ``${VAR:-}`` that way). A value the flag would refuse is an
error naming the variable when its subcommand starts.

Listening addresses are per process: ``pdserve up`` (``LocalStack``) gives each
child its own and removes ``PER_PROCESS`` from the children's environment, so
``PDSERVE_PORT=9000 pdserve up`` moves the gateway and not every worker onto 9000.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "PDSERVE_"
PER_PROCESS = ("PDSERVE_HOST", "PDSERVE_PORT", "PDSERVE_GRPC_PORT", "PDSERVE_METRICS_PORT",
               "PDSERVE_ADVERTISE_HOST")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def variable(action: argparse.Action) -> str | None:
    """The variable of an option (``--redis-url`` -> ``PDSERVE_REDIS_URL``); None for positionals and --help."""
    longs = [s for s in action.option_strings if s.startswith("--")]
    if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    return PREFIX + longs[0][2:].replace("-", "_").upper()


class _Invalid:
    """The default of an option whose variable held a bad value: an error only if that option is used."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:  # what --help would show as the default
        return f"invalid: {self.message}"


def apply(parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> list[str]:
    """Set the defaults of ``parser``'s options (and its subcommands') from ``environ``; returns the
    variables used. A bad value becomes an error when its subcommand runs (``check``), so a variable
    meant for one role does not break another."""
    used = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                used += apply(sub, environ)
            continue
        name = variable(action)
        if name is None or name not in environ:
            continue
        raw = environ[name]
        if raw == "":  # compose's ${VAR:-} passes unset variables as empty: keep the built-in default
            continue
        try:
            action.default = _convert(action, raw)
        except ValueError as exc:
            action.default = _Invalid(f"{name}={raw!r}: {exc}")
        if action.required:  # satisfied by the variable
            action.required = False
        used.append(name)
    return used


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit through ``parser.error`` if a bad variable's option was left to its default."""
    for value in vars(args).values():
        if isinstance(value, _Invalid):
            parser.error(value.message)


def _convert(action: argparse.Action, raw: str):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{action.option_strings[0]} is on/off: give one of {', '.join(_TRUE + _FALSE[:-1])}")
        on = word in _TRUE
        # store_false (--no-queue): "on" means the flag is given, which stores False
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if not isinstance(action, argparse._StoreAction) or action.nargs not in (None, "?"):
        raise ValueError(f"{action.option_strings[0]} cannot be set from the environment")
    value = raw
    if action.type is not None:
        try:
            value = action.type(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "valid")
            raise ValueError(f"{action.option_strings[0]} takes {'an' if kind[0] in 'aeiou' else 'a'} {kind} "
                             "value") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{action.option_strings[0]} is one of {', '.join(map(str, action.choices))}")
    return value


def without_per_process(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the per-process address variables (for the children of ``pdserve up``)."""
    return {k: v for k, v in environ.items() if k not in PER_PROCESS}
