"""The simulated cluster itself: hosts with their own names and addresses that reach each
other over the bridge, links shaped with tbf both ways, loopback unshaped, a link that can
be unplugged and plugged back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.cluster import Cluster, missing

pytestmark = pytest.mark.cluster

# A one-shot TCP server on host0 (prints its port, answers with its host name) and a client.
SERVER = (
    "import socket; s = socket.create_server(('0.0.0.0', 0)); "
    "print(s.getsockname()[1], flush=True); c, _ = s.accept(); "
    "c.sendall(socket.gethostname().encode()); c.close()"
)
CLIENT = (
    "import socket, sys; c = socket.create_connection(('host0', int(sys.argv[1])), "
    "timeout=3); print(c.recv(100).decode())"
)


def _ask_host0(cluster: Cluster) -> subprocess.CompletedProcess:
    server = cluster.popen(0, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = server.stdout.readline().strip()
    return cluster.run(1, [sys.executable, "-c", CLIENT, port])


def test_hosts_have_own_names_and_reach_each_other(cluster: Cluster) -> None:
    for host in cluster.members:
        assert cluster.run(host.index, ["hostname"]).stdout.strip() == host.name
        resolved = cluster.run(host.index, ["getent", "hosts", host.name]).stdout
        assert resolved.split()[0] == host.address
        assert host.address in cluster.run(host.index, ["ip", "-4", "addr", "show", "eth0"]).stdout
    answer = _ask_host0(cluster)
    assert answer.returncode == 0 and answer.stdout.strip() == "host0", answer.stderr


def test_links_are_shaped_and_loopback_is_not(cluster: Cluster) -> None:
    for host in cluster.members:
        assert "tbf" in cluster.run(host.index, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" not in cluster.run(host.index, ["tc", "qdisc", "show", "dev", "lo"]).stdout
    cluster.set_rate("1gbit")
    shown = cluster.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in shown and "rate 1Gbit" in shown, shown


def test_unplugged_host_is_unreachable_until_plugged_back(cluster: Cluster) -> None:
    cluster.set_link(1, up=False)
    answer = _ask_host0(cluster)
    assert answer.returncode != 0, answer.stdout
    cluster.set_link(1, up=True)
    answer = _ask_host0(cluster)
    assert answer.returncode == 0 and answer.stdout.strip() == "host0", answer.stderr


def test_missing_names_the_absent_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the cluster tests' skip reason says on a machine without the tools."""
    monkeypatch.setenv("PATH", "/nonexistent")
    gaps = missing()
    for tool in ("unshare", "nsenter", "ip", "tc"):
        assert any(gap.startswith(f"{tool} (apt-get install") for gap in gaps), gaps
