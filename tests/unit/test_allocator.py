"""glibc's mmap threshold in plm's processes (pipeline/train/ds_ops.configure_allocator,
called by every `plm` command first):
fixed at 64 KiB, so a large block a rank frees goes back to the system, unless the user
chose a threshold. Each case in a fresh process: what the allocator does after a large
block was freed is what changes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

# After an 8 MiB block is mmapped and freed, glibc's own rule raises its threshold to 8 MiB:
# a 1 MiB block then comes from the heap (and stays there once freed). Fixed at 64 KiB, it
# is mmapped. Bit 0x2 of a chunk's size field (the word before the pointer) is IS_MMAPPED.
PROBE = """
import ctypes, sys
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "plm":  # any plm command: this one stops at its bad input (exit 2)
    from pipeline.cli import main
    assert main(["data", "inspect", "/nonexistent/data"]) == 2
libc.free(libc.malloc(8 << 20))
block = libc.malloc(1 << 20)
print("mmapped" if ctypes.c_size_t.from_address(block - 8).value & 2 else "heap")
"""


def probe(who: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, who], env={**base, **env}, cwd=REPO,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.strip()


def test_a_freed_large_block_leaves_the_threshold_at_64_kib_in_a_plm_process():
    assert probe("python") == "heap"  # glibc's default: the threshold rose to 8 MiB
    assert probe("plm") == "mmapped"


def test_the_users_own_threshold_is_kept():
    assert probe("plm", MALLOC_MMAP_THRESHOLD_=str(16 << 20)) == "heap"
