use clap::Parser;

/// clusterip-agent: the node agent that programs Service VIPs into the kernel
/// (nftables by default, iptables with --mode iptables) from Services and EndpointSlices.
#[derive(Debug, Parser)]
#[command(name = "clusterip-agent", version, about)]
struct Args {}

fn main() {
    let _ = Args::parse();
}
