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
"""
import os, subprocess, sys, tempfile, time

T = "ip clusterip"


def gen(n, mode, S=64):
    out = [f"add table {T}",
           f"add chain {T} services {{ type nat hook prerouting priority dstnat; policy accept; }}",
           f"add map {T} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict; }}",
           f"add rule {T} services ip daddr . meta l4proto . th dport vmap @service-ips"]
    el, si = {}, []
    if mode == "shared":
        out.append(f"add map {T} endpoint-dnat-tcp {{ typeof numgen random mod 1 : ip daddr . tcp dport; }}")
    for i in range(n):
        c = f"svc-ns/s{i}/tcp/http"
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
        elif mode == "anon":
            m = ", ".join(f"{j} : {ip} . 8080" for j, ip in enumerate(ips))
            out.append(f"add rule {T} {c} meta l4proto tcp dnat to numgen random mod 10 map {{ {m} }}")
        si.append(f"198.19.{i // 250}.{i % 250 + 1} . tcp . 80 : goto {c}")
    for name, l in list(el.items()) + [("service-ips", si)]:
        for x in range(0, len(l), 1000):
            out.append(f"add element {T} {name} {{ {', '.join(l[x:x + 1000])} }}")
    return "\n".join(out) + "\n"


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["shard", "anon", "rules", "shared"]
    ns = f"cipnftlayout{os.getpid()}"
    for mode in modes:
        with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
            f.write(gen(n, mode))
            f.flush()
            subprocess.run(["ip", "netns", "add", ns], check=True)
            try:
                t = time.monotonic()
                r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", f.name], capture_output=True, text=True)
                dt = time.monotonic() - t
                status = "ok" if r.returncode == 0 else "FAILED: " + r.stderr.strip()[:200]
                print(f"RESULT nft_layout_{mode}_{n} seconds={dt:.2f} {status}")
            finally:
                subprocess.run(["ip", "netns", "del", ns])


if __name__ == "__main__":
    main()
