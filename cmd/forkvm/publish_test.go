package main

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/urfave/cli/v3"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

func TestParsePublish(t *testing.T) {
	for _, tc := range []struct {
		specs  []string
		offset int
		want   []engine.PortForward
		bad    bool
	}{
		{specs: nil, want: nil},
		{specs: []string{"8080:80"}, want: []engine.PortForward{{HostPort: 8080, GuestPort: 80}}},
		{specs: []string{"8080:80", "0.0.0.0:2222:22"}, offset: 3,
			want: []engine.PortForward{{HostPort: 8083, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 2225, GuestPort: 22}}},
		{specs: []string{"65535:80"}, offset: 0, want: []engine.PortForward{{HostPort: 65535, GuestPort: 80}}},
		{specs: []string{"65535:80"}, offset: 1, bad: true}, // a wave past the last port
		{specs: []string{"80"}, bad: true},
		{specs: []string{"8080:80", "127.0.0.1,hostfwd=tcp::22-:22:1:2"}, bad: true},
		{specs: []string{"localhost:8080:80"}, bad: true},
		{specs: []string{"[::1]:8080:80"}, bad: true},
		{specs: []string{"8080:80:"}, bad: true},
	} {
		got, err := parsePublish(tc.specs, tc.offset)
		if tc.bad {
			if !errors.Is(err, engine.ErrInvalidSpec) {
				t.Errorf("parsePublish(%q, %d) = %v, %v; want ErrInvalidSpec", tc.specs, tc.offset, got, err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parsePublish(%q, %d) = %v, %v; want %v", tc.specs, tc.offset, got, err, tc.want)
		}
	}
}

// TestNamesNeverReadAsSubcommands: a VM named like a help or rm subcommand is refused by
// the commands that make names, and no command below the top level has a help
// subcommand that a name could be taken for.
func TestNamesNeverReadAsSubcommands(t *testing.T) {
	if err := checkNewName("rm"); !errors.Is(err, engine.ErrInvalidName) {
		t.Errorf("checkNewName(rm) = %v, want ErrInvalidName", err)
	}
	for _, n := range []string{"w1", "h", "help"} { // no help subcommand to collide with
		if err := checkNewName(n); err != nil {
			t.Errorf("checkNewName(%q) = %v", n, err)
		}
	}
	var walk func(c *cli.Command, top bool)
	walk = func(c *cli.Command, top bool) {
		if !top && !c.HideHelpCommand {
			t.Errorf("command %s keeps a help subcommand", c.Name)
		}
		for _, sub := range c.Commands {
			walk(sub, false)
		}
	}
	walk(newApp(), true)
}

func TestNetColumn(t *testing.T) {
	for _, tc := range []struct {
		v    engine.Info
		want string
	}{
		{engine.Info{}, "-"},
		{engine.Info{Net: true}, "nat"},
		{engine.Info{Net: true, Publish: []engine.PortForward{{HostPort: 8080, GuestPort: 80}, {HostIP: "0.0.0.0", HostPort: 2222, GuestPort: 22}}},
			"nat 8080->80,0.0.0.0:2222->22"},
	} {
		if got := netColumn(tc.v); got != tc.want {
			t.Errorf("netColumn(%+v) = %q, want %q", tc.v, got, tc.want)
		}
	}
}

// TestForkSummary: a wave's summary accounts for every requested fork, those a broken
// stream never reported too, by name when the names are known (after kill -9 of the
// daemon mid-wave, 6 of 8 were missing from "1 of 8 forks failed").
func TestForkSummary(t *testing.T) {
	many := make([]string, 12)
	for i := range many {
		many[i] = api.ForkRequest{Prefix: "p", N: 15}.ForkName(i + 4)
	}
	for _, tc := range []struct {
		n, ready, failed int
		unreported       []string
		want             string
	}{
		{8, 8, 0, nil, "8/8 ready in 459ms"},
		{8, 6, 2, nil, "6/8 ready in 459ms, 2 failed"},
		{8, 1, 1, nil, "1/8 ready in 459ms, 1 failed, 6 not accounted for (the stream ended early; forkvm ls lists those that became ready)"},
		{8, 1, 1, []string{"p3", "p4", "p5", "p6", "p7", "p8"},
			"1/8 ready in 459ms, 1 failed, 6 not accounted for (the stream ended early: p3, p4, p5, p6, p7, p8; forkvm ls lists those that became ready)"},
		{15, 1, 2, many, "1/15 ready in 459ms, 2 failed, 12 not accounted for (the stream ended early: p5, p6, p7, p8, p9, p10, p11, p12, p13, p14 and 2 more; forkvm ls lists those that became ready)"},
	} {
		if got := forkSummary(tc.n, tc.ready, tc.failed, 459*time.Millisecond, tc.unreported); got != tc.want {
			t.Errorf("forkSummary(%d, %d, %d) = %q, want %q", tc.n, tc.ready, tc.failed, got, tc.want)
		}
	}
}

// TestCheckpointTimings: the checkpoint line never reads as a pause longer than the
// whole, nor a parked VM's as a pause, and ls's READY IN of a VM restarted by its own handoff is that restart's.
func TestCheckpointTimings(t *testing.T) {
	h := &api.CheckpointInfo{Name: "ckh", RAMMethod: "handoff"}
	h.Timings.Total, h.Timings.Paused = 31*time.Millisecond, 173*time.Millisecond
	if got, want := checkpointLine(h), "ckh: guest paused 173ms until the VM ran again from it (checkpoint committed after 31ms;"; !strings.HasPrefix(got, want) {
		t.Errorf("handoff: %q, want %q...", got, want)
	}
	c := &api.CheckpointInfo{Name: "ck0", RAMMethod: "copy"}
	c.Timings.Total, c.Timings.Paused = 941*time.Millisecond, 897*time.Millisecond
	if got, want := checkpointLine(c), "ck0: 941ms, guest paused 897ms of it (ram copy;"; !strings.HasPrefix(got, want) {
		t.Errorf("copy: %q, want %q...", got, want)
	}
	pk := &api.CheckpointInfo{Name: "pk", Source: "f1", RAMMethod: "parked"}
	pk.Timings.Total = 16 * time.Millisecond
	if got, want := checkpointLine(pk), "pk: 16ms, from f1's park image (it stays parked; ram parked;"; !strings.HasPrefix(got, want) {
		t.Errorf("parked: %q, want %q...", got, want)
	}
	h.Source = "w1"
	hs := map[string]api.CheckpointInfo{"ckh": *h}
	v := engine.Info{Name: "w1", Parent: "ckh"}
	v.Timings.Total = 3321 * time.Millisecond
	if got := readyIn(v, hs); got != "173ms (handoff)" {
		t.Errorf("after a handoff: %q", got)
	}
	if got := readyIn(engine.Info{Name: "f1", Parent: "ckh", Timings: v.Timings}, hs); got != "3.321s" {
		t.Errorf("a fork of the handoff checkpoint: %q", got)
	}
}

// TestBudgetText: budget says what admission counts: other state directories' vCPUs,
// the overcommit cap, the cgroup's headroom and limit, the reserve, what is committed
// memory pressure, the prior per VM and each measured source's commitment.
func TestBudgetText(t *testing.T) {
	const mib = 1 << 20
	b := api.Budget{HostCPUs: 2, Overcommit: 8, MaxOvercommit: 16, Total: 16, Used: 9, OtherUsed: 7,
		Memory: api.MemoryBudget{Known: true, AvailableBytes: 20000 * mib, TotalBytes: 6144 * mib, CgroupLimitBytes: 6144 * mib,
			CgroupHeadroomBytes: 1000 * mib, ReserveBytes: 512 * mib, CommitRatio: 0.25, CommittedBytes: 300 * mib, FreeBytes: 188 * mib,
			ForkOverheadBytes: 64 * mib, Basis: api.MemoryBasisFootprint, PressureKnown: true, PressureSomeAvg10: 1.5, PressureLimit: 10,
			Sources: []api.MemorySource{{Source: "ck:w", VMs: 3, HighWaterBytes: 24 * mib, CommitBytes: 40 * mib}}}}
	want := "vCPUs 9 used of 16 (2 host CPUs x overcommit 8; 7 by other state directories; requests may ask up to 16)\n" +
		"memory 188 MiB free for VMs = 20000 MiB available (cgroup: 1000 MiB left of 6144) - 512 reserve - 300 committed (what VMs are expected to grow to, less what they hold)\n" +
		"memory pressure: some 1.50%, full 0.00% (avg10; admission stops at some 10%)\n" +
		"commitment per VM (basis footprint): 64 MiB + 0.25 x guest RAM unless its source was measured\n" +
		"  ck:w: 3 VMs, high-water 24 MiB, commits 40 MiB per fork\n"
	if got := budgetText(b); got != want {
		t.Errorf("budget:\n%s\nwant:\n%s", got, want)
	}
	b.Memory = api.MemoryBudget{}
	if got := budgetText(b); strings.Contains(got, "memory") {
		t.Errorf("unknown memory printed: %q", got)
	}
}
