#!/usr/bin/env python3
"""Kernel cost of nftables layouts for N Services x 10 endpoints (no agent involved).

Generates one `nft -f` transaction per layout and times it in a throw-away network
namespace (run as root):

    python3 agent/benches/nft_layouts.py 10000

layouts:
  shared  one table-wide endpoint map bound by every Service chain (quadratic: the kernel
          validates each new element against every rule bound to the map)
  shard   maps of at most S=64 Service chains each (what clusterip-agent does)
  anon    one anonymous numgen map per Service (kube-proxy's layout, without its
          per-endpoint chains)
  rules   no maps: per-Service numgen rules with iptables-style probabilities
  select  no per-Service chain: one shared chain per endpoint count N doing
          `dnat to ip daddr . tcp dport . numgen random mod N map @select-tcp` (what
          clusterip-agent does for ClusterIP-only Services without affinity)

After each layout is loaded, one endpoint element is replaced (`delete element` +
`add element`, a partial sync's typical delta) and timed too (`one_change_seconds`).
"""
import ctypes, os, signal, subprocess, sys, tempfile, time

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_parent = os.getpid()


def _die_with_parent():
    """In each child before exec: die (SIGKILL) when this script dies."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _parent:
        os._exit(127)

T = "ip clusterip"


def gen(n, mode, S=64):
    out = [f"add table {T}",
           f"add chain {T} services {{ type nat hook prerouting priority dstnat; policy accept; }}",
           f"add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict; }}",
           f"add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips"]
    el, si = {}, []
    if mode == "select":
        out.append(f"add map {T} select-tcp {{ typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport; }}")
        out.append(f"add chain {T} select-tcp-10")
        out.append(f"add rule {T} select-tcp-10 dnat to ip daddr . tcp dport . numgen random mod 10 map @select-tcp")
    if mode == "shared":
        out.append(f"add map {T} endpoint-dnat-tcp {{ typeof numgen random mod 1 : ip daddr . tcp dport; }}")
    for i in range(n):
        c = f"svc-ns/s{i}/tcp/http"
        vip = f"198.19.{i // 250}.{i % 250 + 1}"
        if mode != "select":
            out.append(f"add chain {T} {c}")
        ips = []
        for j in range(10):
            k = 1024 + ((i * 10 + j) % 120000)
            ips.append(f"198.{18 + (k >> 16)}.{(k >> 8) & 255}.{k & 255}")
        if mode == "rules":
            for j, ip in enumerate(ips[:-1]):
                out.append(f"add rule {T} {c} numgen random mod {10 - j} 0 meta l4proto tcp dnat to {ip}:8080")
            out.append(f"add rule {T} {c} meta l4proto tcp dnat to {ips[-1]}:8080")
        elif mode in ("shard", "shared"):
            m = "endpoint-dnat-tcp" if mode == "shared" else f"endpoint-dnat-tcp-{i // S}"
            if mode == "shard" and i % S == 0:
                out.append(f"add map {T} {m} {{ typeof numgen random mod 1 : ip daddr . tcp dport; }}")
            out.append(f"add rule {T} {c} meta l4proto tcp dnat to numgen random mod 10 offset {i * 16} map @{m}")
            el.setdefault(m, []).extend(f"{i * 16 + j} : {ip} . 8080" for j, ip in enumerate(ips))
        elif mode == "select":
            c = "select-tcp-10"
            el.setdefault("select-tcp", []).extend(f"{vip} . 80 . {j} : {ip} . 8080" for j, ip in enumerate(ips))
        elif mode == "anon":
            m = ", ".join(f"{j} : {ip} . 8080" for j, ip in enumerate(ips))
            out.append(f"add rule {T} {c} meta l4proto tcp dnat to numgen random mod 10 map {{ {m} }}")
        si.append(f"{vip} . tcp . 80 : goto {c}")
    for name, l in list(el.items()) + [("service-ips", si)]:
        for x in range(0, len(l), 1000):
            out.append(f"add element {T} {name} {{ {', '.join(l[x:x + 1000])} }}")
    return "\n".join(out) + "\n"


def one_change(n, mode):
    """A partial sync's delta: endpoint 0 of the Service in the middle is replaced."""
    i = n // 2
    if mode == "select":
        key = f"198.19.{i // 250}.{i % 250 + 1} . 80 . 0"
        return f"delete element {T} select-tcp {{ {key} }}\nadd element {T} select-tcp {{ {key} : 198.18.250.1 . 8080 }}\n"
    if mode in ("shard", "shared"):
        m = "endpoint-dnat-tcp" if mode == "shared" else f"endpoint-dnat-tcp-{i // 64}"
        return f"delete element {T} {m} {{ {i * 16} }}\nadd element {T} {m} {{ {i * 16} : 198.18.250.1 . 8080 }}\n"
    c = f"svc-ns/s{i}/tcp/http"
    return f"flush chain {T} {c}\nadd rule {T} {c} meta l4proto tcp dnat to 198.18.250.1:8080\n"


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["select", "shard", "anon", "rules", "shared"]
    ns = f"cip{os.getpid()}xnftlayout"  # cip<owner pid>x…: scripts/dev-cluster.sh reap removes it if this process dies
    for mode in modes:
        with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
            f.write(gen(n, mode))
            f.flush()
            subprocess.run(["ip", "netns", "add", ns], check=True, preexec_fn=_die_with_parent)
            try:
                t = time.monotonic()
                r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", f.name], capture_output=True, text=True, preexec_fn=_die_with_parent)
                dt = time.monotonic() - t
                status = "ok" if r.returncode == 0 else "FAILED: " + r.stderr.strip()[:200]
                change = ""
                if r.returncode == 0:
                    delta = one_change(n, mode)
                    t = time.monotonic()
                    r2 = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=delta, capture_output=True, text=True, preexec_fn=_die_with_parent)
                    change = f" one_change_seconds={time.monotonic() - t:.3f}" + ("" if r2.returncode == 0 else " FAILED: " + r2.stderr.strip()[:200])
                print(f"RESULT nft_layout_{mode}_{n} seconds={dt:.2f}{change} {status}")
            finally:
                subprocess.run(["ip", "netns", "del", ns], preexec_fn=_die_with_parent)


if __name__ == "__main__":
    main()
