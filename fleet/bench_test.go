package fleet

import (
	"context"
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet/natsembed"
)

// BenchmarkWaveOverhead measures what the fleet adds to each fork of a wave, without
// QEMU: three clustered embedded servers on 127.0.0.1 (replicas 3, as a fleet of three
// daemons runs), a node on each, and per iteration a 48-fork spread wave of forks that
// take 100 ms each (ns/op is the wave's wall). It reports the p50 and p90 over the
// wave's forks of the overhead forkbench fleet reports (dispatch_ms + fleet_ms) and
// the claim's p50.
//
//	go test ./fleet -run '^$' -bench WaveOverhead -benchtime 5x
func BenchmarkWaveOverhead(b *testing.B) {
	servers := clusterServers(b, 3)
	var nodes []*Fleet
	engines := map[string]*fakeEngine{}
	for i, s := range servers {
		n := joinNode(b, s, fmt.Sprintf("n%d", i+1), engines, Config{MaxVCPUs: 16, Replicas: 3})
		n.eng.forkDelay.Store(int64(100 * time.Millisecond))
		nodes = append(nodes, n.f)
	}
	engines["n1"].cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1, MemoryMiB: 256}
	const n = 48
	var overhead, claim []float64
	b.ResetTimer()
	for it := range b.N {
		evs, err := nodes[0].ForkMany(context.Background(), api.FleetForkRequest{
			ForkRequest: api.ForkRequest{Source: "ck", N: n, Prefix: fmt.Sprintf("b%d-", it)}})
		if err != nil {
			b.Fatal(err)
		}
		got := 0
		for ev := range evs {
			if !ev.OK {
				b.Fatalf("%s failed: %s (%s)", ev.Name, ev.Error, ev.Code)
			}
			got++
			overhead = append(overhead, ev.DispatchMS+ev.FleetMS)
			claim = append(claim, ev.ClaimMS)
		}
		if got != n {
			b.Fatalf("%d events, want %d", got, n)
		}
		b.StopTimer()
		for i, f := range nodes {
			eng := engines[fmt.Sprintf("n%d", i+1)]
			for _, v := range eng.List() {
				eng.Delete(context.Background(), v.Name)
				f.Deleted(v.Name) // as the daemon does
			}
		}
		b.StartTimer()
	}
	b.ReportMetric(quantile(overhead, 0.5), "overhead-p50-ms")
	b.ReportMetric(quantile(overhead, 0.9), "overhead-p90-ms")
	b.ReportMetric(quantile(claim, 0.5), "claim-p50-ms")
}

func quantile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[min(int(q*float64(len(s))), len(s)-1)]
}

// clusterServers starts n embedded servers routed to each other on 127.0.0.1 and
// waits for a JetStream meta leader.
func clusterServers(tb testing.TB, n int) []*natsembed.Server {
	tb.Helper()
	var lns []net.Listener
	var routes []string
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		lns = append(lns, ln)
		routes = append(routes, ln.Addr().String())
	}
	for _, ln := range lns {
		ln.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	servers := make([]*natsembed.Server, n)
	errs := make(chan error, n)
	for i := range n {
		dir := tb.TempDir()
		go func() {
			s, err := natsembed.Start(ctx, natsembed.Config{Name: fmt.Sprintf("s%d", i+1), StoreDir: dir,
				ClusterListen: routes[i], Routes: routes, User: "fleet", Password: "pw"})
			servers[i] = s
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			tb.Fatal(err)
		}
	}
	for _, s := range servers {
		tb.Cleanup(s.Shutdown)
	}
	return servers
}
