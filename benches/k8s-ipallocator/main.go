// Command ipallocbench runs Kubernetes' own allocators from
// k8s.io/kubernetes/pkg/registry/core/service/ipallocator, built from Go modules at the
// Kubernetes version the harness pins:
//
//   - the in-memory bitmap allocator on the workloads of scripts/bench-allocator.sh
//     (the default). Output: one line per workload, "<workload> ns_per_op=<float> ops=<n>".
//   - with -kubeconfig, the IPAddress allocator (ipallocator.NewIPAllocator, the default
//     since Kubernetes 1.33) against that apiserver, as scripts/bench-backends.sh runs
//     `clusterip allocate`: -count dynamic allocations from -cidr by -concurrency callers
//     sharing one allocator, as a kube-apiserver's create requests share its allocator.
//     Output: "ipaddress_allocator allocated=<n> failed=<n> secs=<float> ops_per_s=<float>".
//   - with -kubeconfig and -clear, deletes every IPAddress object in -cidr (64 at a time), so
//     that each run of scripts/bench-backends.sh meets the same cluster.
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	api "k8s.io/kubernetes/pkg/apis/core"
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

// clear deletes every IPAddress object named by an address in cidr, 64 at a time.
func clear(client kubernetes.Interface, cidr string) {
	_, n, err := net.ParseCIDR(cidr)
	must(err)
	list, err := client.NetworkingV1().IPAddresses().List(context.Background(), metav1.ListOptions{})
	must(err)
	names := make(chan string)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w := 0; w < 64; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range names {
				err := client.NetworkingV1().IPAddresses().Delete(context.Background(), name, metav1.DeleteOptions{})
				if err != nil && !apierrors.IsNotFound(err) && failed.Add(1) == 1 {
					fmt.Fprintln(os.Stderr, "ipallocbench: delete:", err)
				}
			}
		}()
	}
	deleted := 0
	for _, o := range list.Items {
		if ip := net.ParseIP(o.Name); ip != nil && n.Contains(ip) {
			names <- o.Name
			deleted++
		}
	}
	close(names)
	wg.Wait()
	if failed.Load() > 0 {
		must(fmt.Errorf("%d deletes failed", failed.Load()))
	}
	fmt.Printf("cleared=%d\n", deleted)
}

func clientFor(kubeconfig string) kubernetes.Interface {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	must(err)
	// The apiserver's own allocator talks to itself unthrottled (loopback client); so does ours.
	cfg.QPS, cfg.Burst = 1e6, 1e6
	client, err := kubernetes.NewForConfig(cfg)
	must(err)
	return client
}

// ipaddresses: count dynamic allocations by concurrency callers through one IPAddress
// allocator, each a create of an IPAddress object naming a Service "bench/s-<i>".
func ipaddresses(client kubernetes.Interface, cidr string, count, concurrency int) {
	factory := informers.NewSharedInformerFactory(client, 0)
	informer := factory.Networking().V1().IPAddresses()
	_, n, err := net.ParseCIDR(cidr)
	must(err)
	alloc, err := ipallocator.NewIPAllocator(n, client.NetworkingV1(), informer)
	must(err)
	stop := make(chan struct{})
	defer close(stop)
	factory.Start(stop)
	if !cache.WaitForCacheSync(stop, informer.Informer().HasSynced) {
		must(fmt.Errorf("the IPAddress informer did not sync"))
	}
	var next, failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(count) {
					return
				}
				svc := &api.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: fmt.Sprintf("s-%d", i)}}
				if _, err := alloc.AllocateNextService(svc); err != nil {
					if failed.Add(1) == 1 {
						fmt.Fprintln(os.Stderr, "ipallocbench: allocation failed:", err)
					}
				}
			}
		}()
	}
	wg.Wait()
	secs := time.Since(start).Seconds()
	ok := int64(count) - failed.Load()
	fmt.Printf("ipaddress_allocator allocated=%d failed=%d secs=%.3f ops_per_s=%.1f\n", ok, failed.Load(), secs, float64(ok)/secs)
}

func main() {
	minFill := flag.Duration("fill-min", 3*time.Second, "minimum time spent filling the /12")
	churnOps := flag.Int("churn-ops", 200000, "release+allocate pairs at 99% fill")
	kubeconfig := flag.String("kubeconfig", "", "run the IPAddress allocator against this apiserver instead of the bitmap workloads")
	cidr := flag.String("cidr", "", "(with -kubeconfig) the range to allocate from")
	count := flag.Int("count", 2000, "(with -kubeconfig) allocations")
	concurrency := flag.Int("concurrency", 1, "(with -kubeconfig) callers at once")
	clearRange := flag.Bool("clear", false, "(with -kubeconfig) delete the IPAddress objects in -cidr instead")
	flag.Parse()
	if *kubeconfig != "" {
		client := clientFor(*kubeconfig)
		if *clearRange {
			clear(client, *cidr)
		} else {
			ipaddresses(client, *cidr, *count, *concurrency)
		}
		return
	}
	fill("10.96.0.0/12", *minFill)
	churn("10.97.0.0/16", *churnOps)
}
