"""Two emulated nodes (``benchmarks/two_nodes.py``): two network namespaces joined by a veth pair.

::

    namespace A = node 0                               namespace B = node 1
    ranks 0, 1 (LOCAL_RANK 0, 1)                       ranks 2, 3 (LOCAL_RANK 0, 1)
    lo: unthrottled (intra-node)                       lo: unthrottled (intra-node)
    hfobv0 10.213.X.1/24 ==== veth, tbf RATE each way ==== hfobv1 10.213.X.2/24

Every rank binds gloo to its namespace's veth address (``GLOO_SOCKET_IFNAME``). Two ranks of
one namespace then share that address, and the kernel delivers a packet to a local address over
the loopback: intra-node traffic never touches the veth (checked: ``ip route get`` says
``local ... dev lo``, and the veth's counters are read around every step). Both veth ends are
rate-limited with the token bucket of ``benchmarks/network.py`` (``tbf rate RATE burst
max(256kb, 2 ms of RATE) latency 50ms``), so each direction of the inter-node link carries RATE.

Counted inter-node bytes (the "model" of :func:`inter_node_counted`): hf_onebit's optimizers
count what leaves the node themselves (``onebit_stats()["inter_node_bytes_sent"]``,
:mod:`hf_onebit.comm.stats`): the exchange by node exactly, the flat collectives by gloo's
algorithms over ranks in rank order: on 2 nodes of 2 ranks a ring (all-reduce, all-gather: rank
``r`` sends to ``r ± 1``) has 2 of its 4 edges between the nodes, so **1/2** of what the ranks
send crosses; the pairwise all-to-all sends 2 of each rank's 3 chunks to the other node, **2/3**
(the flat compressed all-reduce, half all-to-all and half all-gather: about 7/12). The
baselines' rings count **1/2**. DDP also broadcasts the
model's buffers from rank 0 before every forward (``broadcast_buffers``, which no counter sees):
gloo's binomial tree sends 0 -> 1, then 0 -> 2 and 1 -> 3, so **twice the buffers' bytes** cross
per step (16 KB for minilm: its position and token-type ids, 512 int64 each). What the veth sees beyond
that is TCP/IP and gloo headers and ACKs: a few hundred bytes per message.

Inside a node the exchange by node's first round is an all-to-all of the shards and a local sum
(hf_onebit.comm.hierarchical): the bytes of a true reduce-scatter, which its counters assume and
the loopback columns confirm. (gloo's own ``reduce_scatter_tensor`` all-reduces the whole buffer,
twice those bytes: the wiring check of 2026-11-24 saw it before the exchange stopped using it.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from netbench import is_fsdp_method
from netbench.link import _run, tbf_burst_bytes

BROADCAST_CROSSINGS = 2  # DDP's buffer broadcast from rank 0, binomial tree: 0->2 and 1->3 cross
RING_SHARE = 1 / 2  # ring all-reduce / all-gather, 2 nodes x 2 ranks in rank order: 2 of 4 edges cross

VETH = ("hfobv0", "hfobv1")  # the veth end inside namespace A, B


# ====================================================================== the link (parent side)
@dataclass
class NodePair:
    names: tuple[str, str]  # namespaces of node 0 (A) and node 1 (B)
    addrs: tuple[str, str]  # their veth addresses
    bits_per_s: float | None
    veths: tuple[str, str] = VETH


class TwoNodes:
    """The namespace pairs this process created; all deleted by :meth:`cleanup` (deleting a
    namespace destroys its veth end, and with it the peer)."""

    def __init__(self) -> None:
        self.created: list[str] = []
        self.counter = 0

    @staticmethod
    def available() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not running as root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return False, "iproute2 (ip, tc) not found"
        return True, ""

    def create(self, bits_per_s: float | None) -> NodePair:
        """Two namespaces ``hfob<pid>n<i>a``/``b``, lo up in each, the veth pair between them with
        10.213.X.1 and .2 (X from the pid), both ends throttled unless ``bits_per_s`` is None."""
        i = self.counter
        self.counter += 1
        names = (f"hfob{os.getpid()}n{i}a", f"hfob{os.getpid()}n{i}b")
        x = (os.getpid() + i) % 254 + 1
        pair = NodePair(names, (f"10.213.{x}.1", f"10.213.{x}.2"), bits_per_s)
        try:
            for ns in names:
                _must(["ip", "netns", "add", ns])
                self.created.append(ns)
                _must(["ip", "-n", ns, "link", "set", "lo", "up"])
            # created inside A with its peer inside B: no interface ever appears on the host
            _must(["ip", "-n", names[0], "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1],
                   "netns", names[1]])
            for ns, dev, addr in zip(names, VETH, pair.addrs):
                # no IPv6 link-local address on the veth: nothing but the benchmark's IPv4 crosses it
                _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                     check=False)
                _must(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
                _must(["ip", "-n", ns, "link", "set", dev, "up"])
                if bits_per_s is not None:
                    _must(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(bits_per_s)}bit",
                           "burst", str(tbf_burst_bytes(bits_per_s)), "latency", "50ms"])
        except BaseException:
            self.delete(pair)
            raise
        return pair

    def check(self, pair: NodePair) -> list[str]:
        """A TCP connection each way across the veth, and the routes the ranks will use; raises
        RuntimeError if the veth does not carry traffic or a local address is not on lo."""
        lines = []
        for server, client in ((1, 0), (0, 1)):
            lines.append(tcp_check(pair.names[server], pair.addrs[server], pair.names[client]))
        for ns, addr, dev in zip(pair.names, pair.addrs, pair.veths):
            local = _run(["ip", "-n", ns, "route", "get", addr]).stdout.split("\n")[0].strip()
            if " dev lo " not in f" {local} ":
                raise RuntimeError(f"{ns}: its own address {addr} is not routed over lo: {local}")
            other = pair.addrs[1 - pair.names.index(ns)]
            remote = _run(["ip", "-n", ns, "route", "get", other]).stdout.split("\n")[0].strip()
            if f" dev {dev} " not in f" {remote} ":
                raise RuntimeError(f"{ns}: {other} is not routed over {dev}: {remote}")
            lines.append(f"{ns}: ip route get {addr} -> {local!r}; {other} -> {remote!r}")
        return lines

    def counters(self, pair: NodePair) -> dict:
        """tx bytes of each namespace's veth end and loopback."""
        return {f"{dev}_tx": tx_bytes(ns, dev) for ns, dev in zip(pair.names, pair.veths)} | {
            f"lo_{k}_tx": tx_bytes(ns, "lo") for k, ns in zip("ab", pair.names)}

    def qdisc(self, pair: NodePair) -> str:
        return "; ".join(f"{ns}: " + _run(["tc", "-n", ns, "qdisc", "show", "dev", dev], check=False).stdout.strip()
                         for ns, dev in zip(pair.names, pair.veths))

    def delete(self, pair: NodePair) -> None:
        for ns in pair.names:
            if ns in self.created:
                _run(["ip", "netns", "del", ns], check=False)
                self.created.remove(ns)

    def cleanup(self) -> None:
        for ns in list(self.created):
            _run(["ip", "netns", "del", ns], check=False)
            self.created.remove(ns)


def _must(cmd: list[str]) -> None:
    res = _run(cmd, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()}")


def tx_bytes(ns: str, dev: str) -> int:
    out = _run(["ip", "-j", "-s", "-n", ns, "link", "show", "dev", dev]).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


_SERVER = ("import socket,sys\ns=socket.socket();s.bind((sys.argv[1],0));s.listen(1);s.settimeout(10)\n"
           "print(s.getsockname()[1],flush=True)\nc,a=s.accept();c.sendall(b'hfob '+a[0].encode());c.close()")
_CLIENT = ("import socket,sys\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=5)\n"
           "print(c.recv(64).decode())")


def tcp_check(server_ns: str, addr: str, client_ns: str) -> str:
    """Connect from ``client_ns`` to a listener on ``addr`` inside ``server_ns``; the listener
    answers with the client's address as it saw it."""
    srv = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, "-c", _SERVER, addr],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = srv.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"TCP check: no listener on {addr} in {server_ns}: {srv.stderr.read().strip()}")
        t0 = time.perf_counter()
        res = _run(["ip", "netns", "exec", client_ns, sys.executable, "-c", _CLIENT, addr, port], check=False)
        ms = 1e3 * (time.perf_counter() - t0)
        if res.returncode != 0 or not res.stdout.startswith("hfob "):
            raise RuntimeError(f"TCP check {client_ns} -> {addr}:{port} ({server_ns}) failed: {res.stderr.strip()}")
        return f"TCP {client_ns} -> {addr}:{port} in {server_ns}: ok, seen from {res.stdout.split()[1]} ({ms:.0f} ms)"
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()


# ====================================================================== the probe (each rank)
def read_tx(dev: str) -> int:
    """Bytes sent through ``dev`` of this process's network namespace (/proc/net/dev)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    raise RuntimeError(f"no device {dev!r} in this network namespace")


def node_probe(veth: str):
    """The probe of :func:`netbench.methods.run_method` on a two-node run: this namespace's veth
    and loopback tx bytes, and the optimizer's own counters (inter-node bytes, fp32 equivalent)."""

    def probe(opt) -> dict:
        inter = getattr(opt, "inter_node_stats", None)  # a baseline's count (netbench.methods)
        stats = getattr(getattr(opt, "exchange", None), "stats", None)
        if inter is not None:
            crossed = inter.snapshot().bytes_sent
        else:
            crossed = stats.snapshot().inter_node_sent if stats is not None else 0
        return {"veth": read_tx(veth), "lo_node": read_tx("lo"), "inter": crossed,
                "fp32": stats.snapshot().fp32_equivalent if stats is not None else 0}

    return probe


# ====================================================================== analysis
def broadcast_crossing(method: str, buffer_bytes: int) -> int:
    """Bytes of DDP's buffer broadcast that cross between the nodes per step (none under FSDP2)."""
    return 0 if is_fsdp_method(method) else BROADCAST_CROSSINGS * buffer_bytes


def inter_node_counted(method: str, recs: list, buffer_bytes: int = 0) -> list[float]:
    """Counted bytes that crossed between the nodes at each step (all ranks, both directions).

    Per rank and step: the optimizer's own count of what left the node, where it counts (an
    hf_onebit optimizer, whose fp32-equivalent counter grows at every step, or hybrid sharding,
    which counts its crossing bytes itself, also on steps with none); otherwise (the torch
    baselines' ring all-reduces) half the step's bytes. Plus DDP's buffer broadcast:
    ``2 · buffer_bytes`` per step.
    """
    steps = len(recs[0])
    hsdp = is_fsdp_method(method)  # FSDP2: what crosses is counted as such
    out = [float(broadcast_crossing(method, buffer_bytes))] * steps
    for r in recs:
        prev = {"bytes": 0, "inter": 0, "fp32": 0}
        for s, rec in enumerate(r):
            db, di, df = (rec[k] - prev[k] for k in ("bytes", "inter", "fp32"))
            prev = rec
            out[s] += di if hsdp or di > 0 or df > 0 else RING_SHARE * db
    return out


def link_summary(raw: dict, summary: dict, local_size: int = 2) -> dict:
    """Per method, in the compression-phase window of ``summary``: inter-node bytes per step
    counted (model, see the module docstring) and measured on the veth (both ends' tx: both
    directions, TCP/IP headers and ACKs included), the loopbacks' bytes (intra-node)."""
    first, n = summary["window"]
    win = n - first + 1
    out = {}
    for method, res in raw["methods"].items():
        recs = res["records"]
        counted = inter_node_counted(method, recs, raw.get("buffer_bytes", 0))
        broadcast = broadcast_crossing(method, raw.get("buffer_bytes", 0))
        sent = [sum(r[s]["bytes"] - (r[s - 1]["bytes"] if s else 0) for r in recs) for s in range(n)]
        heads = recs[::local_size]  # local rank 0 of each node reads its namespace's devices

        def window(key):
            return sum(r[n - 1][key] - (r[first - 2][key] if first >= 2 else 0) for r in heads) / win

        out[method] = {
            "inter_counted": sum(counted[first - 1 : n]) / win,
            "inter_measured": window("veth"),
            # every counted byte that did not cross stayed inside a node (the broadcast's 0 -> 1 aside)
            "intra_counted": sum(sent[first - 1 : n]) / win - (sum(counted[first - 1 : n]) / win - broadcast),
            "intra_measured": window("lo_node"),
            "inter_counted_run": sum(counted) / n,
            "inter_measured_run": sum(r[n - 1]["veth"] for r in heads) / n,
            "inter_counted_by_step": counted,
            "inter_measured_by_step": [sum(r[s]["veth"] - (r[s - 1]["veth"] if s else 0) for r in heads)
                                       for s in range(n)],
        }
    return out


def markdown_table(rate: str, summary: dict, link: dict) -> list[str]:
    """The per-rate table: samples/s and its ratios, bytes per rank, inter-node bytes, rounds."""
    from netbench.report import fmt_bytes

    rows = summary["rows"]
    flat = rows.get("onebit_adam")
    x = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
    lines = [
        f"| {rate} | samples/s | vs AdamW | vs 1-bit Adam | B/step per rank | inter-node B/step counted"
        " | inter-node B/step on the veth | veth / counted | intra-node B/step counted | intra-node B/step on lo"
        " | rounds/step | loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m, r in rows.items():
        lk = link[m]
        base = rows.get("hsdp_adamw" if is_fsdp_method(m) else "adamw")  # like against like (FSDP against HSDP)
        lines.append(
            f"| {r['label']} | {r['sps_compress']:.1f} | {x(r['sps_compress'], base['sps_compress']) if base else '-'}"
            f" | {x(r['sps_compress'], flat['sps_compress']) if flat else '-'} | {fmt_bytes(r['bytes_compress'])}"
            f" | {fmt_bytes(lk['inter_counted'])} | {fmt_bytes(lk['inter_measured'])}"
            f" | {x(lk['inter_measured'], lk['inter_counted'])} | {fmt_bytes(lk['intra_counted'])}"
            f" | {fmt_bytes(lk['intra_measured'])}"
            f" | {r['rounds_compress']:.1f} | {r['final_loss']:.3f} |")
    return lines
