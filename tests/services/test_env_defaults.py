"""PDSERVE_<FLAG> variables as flag defaults: precedence, on/off flags, bad values, and pdserve up's children."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services import env_defaults
from services.cli import build_parser


def _parse(argv, environ):
    parser = build_parser()
    env_defaults.apply(parser, environ)
    args = parser.parse_args(argv)
    env_defaults.check(parser, args)
    return args


def test_a_variable_is_the_default_and_a_flag_beats_it():
    env = {"PDSERVE_REDIS_URL": "redis://redis:6379/0", "PDSERVE_PORT": "8100", "PDSERVE_MAX_QUEUED_REQUESTS": "7"}
    args = _parse(["gateway"], env)
    assert (args.redis_url, args.port, args.max_queued_requests) == ("redis://redis:6379/0", 8100, 7)
    assert _parse(["gateway", "--port", "9000"], env).port == 9000
    assert _parse(["gateway"], {}).port == 8000
    assert _parse(["gateway"], {"PDSERVE_PORT": ""}).port == 8000  # compose's ${VAR:-} of an unset variable


def test_on_off_flags_and_store_false():
    assert _parse(["gateway"], {"PDSERVE_ALLOW_NO_WORKER": "true"}).allow_no_worker is True
    assert _parse(["gateway"], {"PDSERVE_ALLOW_NO_WORKER": "0"}).allow_no_worker is False
    assert _parse(["router"], {"PDSERVE_NO_QUEUE": "yes"}).queue is False  # --no-queue given
    assert _parse(["router"], {"PDSERVE_NO_QUEUE": "off"}).queue is True


def test_choices_and_types_are_checked_only_for_the_subcommand_that_runs():
    bad = {"PDSERVE_POLICY": "fastest", "PDSERVE_PORT": "eighty"}
    with pytest.raises(SystemExit):
        _parse(["router"], bad)
    # the gateway has --port too: a bad PDSERVE_PORT fails it; a flag given on the command line wins
    assert _parse(["gateway", "--port", "1"], bad).port == 1
    assert _parse(["gateway", "--port", "1"], {"PDSERVE_POLICY": "fastest"}).port == 1  # not a gateway flag


def test_the_cli_names_the_bad_variable_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "services.cli", "router"], capture_output=True, text=True,
                          env=dict(os.environ, PDSERVE_POLICY="fastest"))
    assert proc.returncode == 2
    assert "PDSERVE_POLICY='fastest'" in proc.stderr and "kv-aware" in proc.stderr


def test_variable_names_follow_the_long_flag():
    p = argparse.ArgumentParser()
    action = p.add_argument("--max-num-seqs", "-m", type=int)
    assert env_defaults.variable(action) == "PDSERVE_MAX_NUM_SEQS"
    assert env_defaults.variable(p._actions[0]) is None  # --help


def test_up_keeps_per_process_addresses_from_its_children():
    env = {"PDSERVE_PORT": "9000", "PDSERVE_HOST": "0.0.0.0", "PDSERVE_MAX_NUM_SEQS": "8", "PATH": "/bin"}
    assert env_defaults.without_per_process(env) == {"PDSERVE_MAX_NUM_SEQS": "8", "PATH": "/bin"}
