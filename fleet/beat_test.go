package fleet

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/forkvm/forkvm/api"
)

// TestJobsLeaveTheHeartbeatWhenTheyEnd: once a wave's forks are made, the node that
// made them shows them as VMs and no job in its heartbeat without waiting for its next
// tick (here a minute away): `forkvm nodes` showed VMS 0 JOBS 2 for seconds after a
// wave, a heartbeat written while the forks were being made.
func TestJobsLeaveTheHeartbeatWhenTheyEnd(t *testing.T) {
	t.Parallel()
	s := testServer(t)
	engines := map[string]*fakeEngine{"n1": newFakeEngine(0), "n2": newFakeEngine(100)}
	engines["n1"].cks["ck"] = CheckpointRef{Name: "ck", Digest: "d1", Class: testClass, CPUs: 1}
	engines["n2"].unlisted = true // a fork is listed once ready, as the engine does
	nodes := joinEngines(t, s, engines, 2, 0, func(c *Config) { c.Heartbeat, c.TTL = time.Minute, 2*time.Minute })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	kw, err := nodes[0].f.nodes.Watch(ctx, "n2")
	if err != nil {
		t.Fatal(err)
	}
	defer kw.Stop()
	evs, err := nodes[0].f.ForkMany(ctx, api.FleetForkRequest{ForkRequest: api.ForkRequest{Source: "ck", N: 2, Prefix: "b-"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := collect(t, evs, 20*time.Second); len(got) != 2 || !got[0].OK || !got[1].OK {
		t.Fatalf("events %+v, want 2 forks ready", got)
	}
	var last api.FleetNode
	for {
		select {
		case e := <-kw.Updates():
			if e == nil || e.Operation() != jetstream.KeyValuePut {
				continue
			}
			if err := json.Unmarshal(e.Value(), &last); err != nil {
				t.Fatal(err)
			}
			if last.VMs == 2 && last.Running == 0 {
				return
			}
		case <-ctx.Done():
			t.Fatalf("n2's heartbeat after the wave: %d VMs, %d jobs; want 2 VMs and no job before its next tick", last.VMs, last.Running)
		}
	}
}
