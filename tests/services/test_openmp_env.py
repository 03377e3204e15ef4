"""pdserve's processes load libgomp with idle threads asleep (services/openmp_env.py), unless the user chose."""

import os
import subprocess
import sys

import pytest

from services import openmp_env


def libgomp_settings(env: dict) -> dict[str, str]:
    """What libgomp itself read when a ``pdserve decode`` process loaded torch (OMP_DISPLAY_ENV)."""
    env = {k: v for k, v in os.environ.items() if k not in openmp_env.USER_SETTINGS} | env
    proc = subprocess.run([sys.executable, "-m", "services.cli", "decode", "--help"], capture_output=True,
                          text=True, env=env | {"OMP_DISPLAY_ENV": "verbose"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    settings = {}
    for line in proc.stderr.splitlines():
        name, sep, value = line.strip().partition(" = ")
        if sep:
            settings[name] = value.strip("'")
    assert "GOMP_SPINCOUNT" in settings, proc.stderr  # torch (and so libgomp) was loaded
    return settings


def test_a_worker_loads_libgomp_with_idle_threads_asleep():
    assert libgomp_settings({})["GOMP_SPINCOUNT"] == "0"  # libgomp's own default spins 300000 times


@pytest.mark.parametrize("user, expected", [({"GOMP_SPINCOUNT": "300000"}, "300000"),
                                            ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000")])
def test_a_users_own_wait_policy_is_kept(user, expected):
    assert libgomp_settings(user)["GOMP_SPINCOUNT"] == expected


def test_apply_leaves_a_chosen_policy_alone():
    env = {"GOMP_SPINCOUNT": "1000"}
    assert openmp_env.apply(env) is False and env == {"GOMP_SPINCOUNT": "1000"}
    env = {"OMP_WAIT_POLICY": ""}  # empty is unset (compose's ${VAR:-})
    assert openmp_env.apply(env) is True and env["OMP_WAIT_POLICY"] == "PASSIVE"
