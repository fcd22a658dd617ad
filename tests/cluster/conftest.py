"""The rehearsal cluster for the `cluster` tests: one rig (pipeline/rig.py) for the whole
session, on a part of 198.18.0.0/24 no other rig on this machine uses; the tests skip,
saying why, where the machine cannot make one (no root, no iproute2, no sshd, no pdsh)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pipeline import rig as rigmod

SUBNETS = ("198.18.0.128/26", "198.18.0.192/26", "198.18.0.64/26", "198.18.0.0/26")


@pytest.fixture(scope="session")
def rig():
    why = rigmod.check_prerequisites(ssh=True)
    if why:
        pytest.skip(why)
    if shutil.which("pdsh") is None:
        pytest.skip("the hostfile launch needs pdsh (Debian: pdsh)")
    name = f"t{os.getpid() % 100000}"
    made = None
    for subnet in SUBNETS:
        try:
            made = rigmod.up(3, name=name, subnet=subnet)
            break
        except rigmod.RigError as err:
            if "overlaps" not in str(err):
                raise
    assert made is not None, "every test subnet is in use: `plm rig down` the other rigs"
    try:
        yield made
    finally:
        rigmod.down(name)
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"plm-{name}-" not in left
