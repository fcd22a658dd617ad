"""The errors a user can cause or fix, at the bottom of the house: every layer raises them,
and ``cli`` turns each into one ``plm:`` line and exit 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key or file and the fix.

    Under a launcher every rank meets a config's error alike: only rank 0 prints it (one
    `plm:` line, not one per rank). ``machine_wide``: it depends on the machine (its
    toolchain, a file missing there), so each machine's local rank 0 prints it."""

    def __init__(self, message: str, machine_wide: bool = False):
        super().__init__(message)
        self.machine_wide = machine_wide


class StoreError(ConfigError):
    """A URI's store cannot be used: bucket not found, access denied, cannot connect."""
