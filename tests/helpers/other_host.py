"""``python other_host.py HOST LEASE_S [overrides]``: ``python -m train [overrides]`` as a process on host HOST
whose run-folder lock has a lease of LEASE_S seconds (tests/e2e/test_faults_run_folder.py: a holder suspended past
its lease on one host, the launch that takes the folder over from another, on one machine)."""

from __future__ import annotations

import socket
import sys

import train.run.folder as folder


def main() -> None:
    host, lease_s, overrides = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    socket.gethostname = lambda: host  # type: ignore[assignment]
    folder.LEASE_S = lease_s
    sys.argv = [sys.argv[0], *overrides]
    from train.__main__ import command

    command()


if __name__ == "__main__":
    main()
