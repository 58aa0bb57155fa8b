"""A cluster of H hosts on one machine: network namespaces joined by a shaped bridge.

    python -m scripts.cluster --hosts 2 --rate 1gbit -- \\
        .venv/bin/torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d \\
        --rdzv-endpoint host0:29500 -m examples.dlrm.train --demo

runs the command on every host at once (the same line on each, as on real machines) and
exits with the first non-zero status, printing each host's output prefixed `[hostN]`.

Layout: a switch namespace (`unshare -n`) holds a bridge `br0`; host `i` is a namespace of
its own (network, hostname, mounts) named `host<i>` with address `10.77.0.<i+1>/24` on `eth0`,
the peer of `veth<i>` on the bridge. Each host's `/etc/hosts` (bind-mounted in its own mount
namespace) maps every `host<j>` to its address, so `socket.gethostname()` resolves to the
host's own address as on a real machine: torchrun's c10d rendezvous, its `MASTER_ADDR` and
gloo's interface choice need no flags. Both directions of every host link pass `tc tbf` at
`rate` (default 10gbit); loopback inside a host is not shaped. The machine's own network is
never touched; the namespaces end with this process (their holder processes read a pipe
from it and exit at EOF).

Needs root, `unshare`, `nsenter` (util-linux), `ip` and `tc` (iproute2): `missing()` names
what is absent, and the tests skip with that text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Dict, List, Sequence

SUBNET = "10.77.0"
TOOLS = {"unshare": "util-linux", "nsenter": "util-linux", "ip": "iproute2", "tc": "iproute2"}
# tbf's bucket must hold one timer tick of traffic at the rate: 4 MB covers 10gbit at HZ=250.
BURST = "4mb"
LATENCY = "50ms"


def missing() -> List[str]:
    """What this machine lacks to build a cluster (empty when it can): tools, root, and the
    right to create namespaces (a container without CAP_SYS_ADMIN has the tools but not it)."""
    gaps = [
        f"{tool} (apt-get install {package})"
        for tool, package in TOOLS.items()
        if shutil.which(tool) is None
    ]
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        gaps.append(f"root (running as uid {os.geteuid()})")
    if not gaps:
        probe = subprocess.run(
            ["unshare", "-n", "-u", "-m", "--", "true"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            gaps.append(f"namespaces: 'unshare -n -u -m true' failed: {probe.stderr.strip()}")
    return gaps


@dataclass
class Host:
    """One simulated machine: `name` resolves to `address` on every host."""

    index: int
    name: str
    address: str
    pid: int  # the namespace holder; `nsenter -t pid -n -u -m` enters this host
    veth: str  # its link's end on the bridge, in the switch namespace


@dataclass
class Cluster:
    """`hosts` namespaces on a bridge, each link shaped to `rate`. Use as a context manager;
    `popen`/`run` start commands on a host, `set_link` takes a host's link down or up."""

    hosts: int = 2
    rate: str = "10gbit"
    burst: str = BURST  # tbf bucket: traffic up to this size passes at loopback speed
    members: List[Host] = field(default_factory=list, init=False)
    _holders: List[subprocess.Popen] = field(default_factory=list, init=False)
    _jobs: List[subprocess.Popen] = field(default_factory=list, init=False)
    _dir: tempfile.TemporaryDirectory | None = field(default=None, init=False)
    _switch_pid: int = field(default=0, init=False)

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        gaps = missing()
        if gaps:
            raise RuntimeError(f"cannot build a cluster here, missing: {'; '.join(gaps)}")
        if not 1 <= self.hosts <= 250:
            raise ValueError(f"hosts must be in 1..250, got {self.hosts}")
        try:
            self._build()
        except BaseException:
            self.stop()
            raise

    def _build(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="recshard-cluster-")
        hosts_file = Path(self._dir.name) / "hosts"
        names = [(f"host{i}", f"{SUBNET}.{i + 1}") for i in range(self.hosts)]
        hosts_file.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in names)
        )
        self._switch_pid = self._hold(["-n"])
        self._switch("ip link set lo up && ip link add br0 type bridge && ip link set br0 up")
        for index, (name, address) in enumerate(names):
            pid = self._hold(["-n", "-u", "-m", "--propagation", "private"])
            host = Host(index, name, address, pid, f"veth{index}")
            self._switch(
                f"ip link add {host.veth} type veth peer name eth0 netns {pid} && "
                f"ip link set {host.veth} master br0 && ip link set {host.veth} up"
            )
            self._shape(["nsenter", "-t", str(self._switch_pid), "-n"], host.veth, "add")
            self._in_host(
                host,
                f"hostname {name} && mount --bind {hosts_file} /etc/hosts && "
                f"ip link set lo up && ip addr add {address}/24 dev eth0 && "
                f"ip link set eth0 up",
            )
            self._shape(self.enter(host), "eth0", "add")
            self.members.append(host)

    def _hold(self, flags: List[str]) -> int:
        """A process in fresh namespaces that lives until our end of its stdin closes."""
        holder = subprocess.Popen(
            ["unshare", *flags, "--", "sh", "-c", "echo ready; exec cat >/dev/null"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._holders.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            raise RuntimeError(f"unshare {' '.join(flags)} failed (exit {holder.wait()})")
        return holder.pid

    def _switch(self, script: str) -> None:
        _check(["nsenter", "-t", str(self._switch_pid), "-n", "sh", "-c", script])

    def _in_host(self, host: Host, script: str) -> None:
        _check([*self.enter(host), "sh", "-c", script])

    def _shape(self, prefix: List[str], device: str, verb: str) -> None:
        _check(
            [
                *prefix,
                "tc",
                "qdisc",
                verb,
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                self.burst,
                "latency",
                LATENCY,
            ]
        )

    def enter(self, host: Host, cwd: str | None = None) -> List[str]:
        """The command prefix that runs a program on `host`, in `cwd` (default: ours)."""
        return ["nsenter", "-t", str(host.pid), "-n", "-u", "-m", f"--wd={cwd or os.getcwd()}"]

    def popen(
        self, host: int, argv: Sequence[str], cwd: str | None = None, **kwargs: object
    ) -> subprocess.Popen:
        """Start `argv` on host `host` in a session of its own (`stop` kills what is left)."""
        job = subprocess.Popen(
            [*self.enter(self.members[host], cwd), *argv], start_new_session=True, **kwargs
        )  # type: ignore[call-overload]
        self._jobs.append(job)
        return job

    def run(
        self, host: int, argv: Sequence[str], timeout: float = 60.0
    ) -> subprocess.CompletedProcess:
        """Run `argv` on host `host` to the end; its output captured as text."""
        return subprocess.run(
            [*self.enter(self.members[host]), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def set_rate(self, rate: str) -> None:
        """Reshape every host link (both directions) to `rate`."""
        self.rate = rate
        for host in self.members:
            self._shape(["nsenter", "-t", str(self._switch_pid), "-n"], host.veth, "change")
            self._shape(self.enter(host), "eth0", "change")

    def set_link(self, host: int, up: bool) -> None:
        """Take host `host`'s link down (unplugged: its packets are dropped) or up again.

        Plugging back also forgets every host's failed neighbour entries: an address that went
        unanswered while the link was down would otherwise stay "No route to host" for
        seconds after the link is back."""
        self._switch(f"ip link set {self.members[host].veth} {'up' if up else 'down'}")
        if up:
            for member in self.members:
                self.run(member.index, ["ip", "neigh", "flush", "all"])

    def stop(self) -> None:
        """Kill every job started here (whole sessions), then the namespace holders."""
        for job in self._jobs:
            if job.poll() is None:
                try:
                    os.killpg(job.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            job.wait()
        for holder in self._holders:
            if holder.stdin is not None:
                holder.stdin.close()
            try:
                holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
            if holder.stdout is not None:
                holder.stdout.close()
        self._jobs, self._holders, self.members = [], [], []
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def _check(argv: List[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def _relay(prefix: str, stream: IO[str], out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"{prefix}{line}")
            out.flush()


def run_everywhere(cluster: Cluster, argv: Sequence[str], env: Dict[str, str]) -> int:
    """`argv` on every host at once, output prefixed per host; the first non-zero status."""
    lock = threading.Lock()
    jobs, relays = [], []
    for host in cluster.members:
        job = cluster.popen(
            host.index,
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env, "CLUSTER_HOST": str(host.index)},
        )
        relay = threading.Thread(
            target=_relay, args=(f"[{host.name}] ", job.stdout, sys.stdout, lock), daemon=True
        )
        relay.start()
        jobs.append(job)
        relays.append(relay)
    codes = [job.wait() for job in jobs]
    for relay in relays:
        relay.join()
    return next((code for code in codes if code != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.cluster",
        description="Run CMD on every host of a simulated cluster (network namespaces on a "
        "bridge, each link shaped with tc tbf). Hosts are host0, host1, ... "
        f"({SUBNET}.1, .2, ...); CLUSTER_HOST holds the host's index.",
    )
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts")
    parser.add_argument(
        "--rate",
        default="10gbit",
        help="every host link's rate, each direction (tc units: 1gbit, 500mbit)",
    )
    parser.add_argument(
        "--burst",
        default=BURST,
        help="tbf bucket per link (default 4mb, enough for 10gbit); a step's "
        "few-MB bursts pass a slow link at full speed unless it is lower "
        "(1gbit: 512kb)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run on every host after --")
    gaps = missing()
    if gaps:
        print(f"cluster: missing {'; '.join(gaps)}", file=sys.stderr)
        return 2
    with Cluster(args.hosts, args.rate, args.burst) as cluster:
        addresses = ", ".join(f"{h.name}={h.address}" for h in cluster.members)
        print(f"cluster: {args.hosts} hosts ({addresses}), links {args.rate}", file=sys.stderr)
        return run_everywhere(cluster, command, {})


if __name__ == "__main__":
    sys.exit(main())
