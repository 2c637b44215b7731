"""Listening sockets and their holders as /proc shows them (datagen/processes.py), on real sockets."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest

from datagen import processes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")


def _listener(family: socket.AddressFamily, host: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_ipv4_and_ipv6_listeners_are_found_by_port_with_their_addresses_and_holder() -> None:
    with _listener(socket.AF_INET, "127.0.0.1") as four, _listener(socket.AF_INET6, "::") as six:
        listening = processes.listening_sockets()
        assert listening is not None
        [(address4, inode4)] = listening[four.getsockname()[1]]
        [(address6, inode6)] = listening[six.getsockname()[1]]

        assert address4 == ipaddress.IPv4Address("127.0.0.1")
        assert address6.is_unspecified and address6.version == 6
        assert processes.socket_holder(inode4) == os.getpid()
        assert processes.not_held_by(os.getpid(), {inode4, inode6}) == set()


def test_a_socket_held_only_by_a_child_counts_as_its_parents_tree() -> None:
    # The child opens the listener; the parent (its group leader here) holds nothing.
    code = "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
    code += "print(s.getsockname()[1], flush=True); time.sleep(60)"
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess,sys; subprocess.run([sys.executable,'-c',{code!r}])"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        port = int(leader.stdout.readline())
        listening = processes.listening_sockets()
        assert listening is not None
        inodes = {inode for _, inode in listening[port]}

        assert processes.socket_inodes(leader.pid) & inodes == set()
        assert processes.not_held_by(leader.pid, inodes) == set()
        assert processes.socket_holder(next(iter(inodes))) not in (None, leader.pid, os.getpid())
    finally:
        processes.terminate_groups([leader.pid], grace_s=0.0)
        leader.wait()
