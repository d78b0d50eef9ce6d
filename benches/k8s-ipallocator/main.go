// Command ipallocbench runs the allocator workloads of scripts/bench-allocator.sh on
// Kubernetes' own in-memory bitmap allocator (k8s.io/kubernetes/pkg/registry/core/service/ipallocator),
// built from Go modules at the Kubernetes version the harness pins.
//
// Output: one line per workload, "<workload> ns_per_op=<float> ops=<n>".
package main

import (
	"flag"
	"fmt"
	"math/rand"
	"net"
	"os"
	"time"

	"k8s.io/kubernetes/pkg/registry/core/service/ipallocator"
)

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "ipallocbench:", err)
		os.Exit(1)
	}
}

func newRange(cidr string) *ipallocator.Range {
	_, n, err := net.ParseCIDR(cidr)
	must(err)
	r, err := ipallocator.NewInMemory(n)
	must(err)
	return r
}

// fill: allocate_next from empty to full, repeated until minDur has passed.
func fill(cidr string, minDur time.Duration) {
	var ops int64
	var spent time.Duration
	for spent < minDur {
		r := newRange(cidr)
		free := r.Free()
		start := time.Now()
		for i := 0; i < free; i++ {
			if _, err := r.AllocateNext(); err != nil {
				must(fmt.Errorf("fill %s: allocation %d: %v", cidr, i, err))
			}
		}
		spent += time.Since(start)
		ops += int64(free)
		if _, err := r.AllocateNext(); err == nil {
			must(fmt.Errorf("fill %s: range not full after %d allocations", cidr, free))
		}
	}
	fmt.Printf("fill_slash12 ns_per_op=%.1f ops=%d\n", float64(spent.Nanoseconds())/float64(ops), ops)
}

// churn: at 99% fill, release a random allocated address then allocate_next.
func churn(cidr string, ops int) {
	r := newRange(cidr)
	target := r.Free() * 99 / 100
	held := make([]net.IP, 0, target)
	for len(held) < target {
		ip, err := r.AllocateNext()
		must(err)
		held = append(held, ip)
	}
	rng := rand.New(rand.NewSource(42))
	start := time.Now()
	for i := 0; i < ops; i++ {
		k := rng.Intn(len(held))
		must(r.Release(held[k]))
		ip, err := r.AllocateNext()
		must(err)
		held[k] = ip
	}
	spent := time.Since(start)
	fmt.Printf("churn_99pct_slash16 ns_per_op=%.1f ops=%d\n", float64(spent.Nanoseconds())/float64(ops), ops)
}

func main() {
	minFill := flag.Duration("fill-min", 3*time.Second, "minimum time spent filling the /12")
	churnOps := flag.Int("churn-ops", 200000, "release+allocate pairs at 99% fill")
	flag.Parse()
	fill("10.96.0.0/12", *minFill)
	churn("10.97.0.0/16", *churnOps)
}
