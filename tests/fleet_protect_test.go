package tests

import (
	"encoding/json"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/internal/guestscript"
	"github.com/forkvm/forkvm/procinfo"
	"github.com/forkvm/forkvm/serve"
)

// fleetProtect (TestFleet/Protect): a fleet of three daemons; a fork on n1 counts in its guest (RAM and
// data disk, every 100 ms) and is protected every 2 s. Each point is copied to another
// node before it counts. Then n1's daemon and QEMUs are killed (kill -9): the node that
// holds the last point revives the fork there as itself (hostname, counters as at a
// point no older than the interval plus a copy before the kill) within a bound; it runs
// on exactly one node; the new owner protects it again. n1's daemon restarted removes
// its stale copy and keeps nothing of it. Then the new owner's daemon is stopped
// (SIGSTOP) for twice the TTL: its fence watchdog ends fpf's QEMU before another node
// revives fpf (never two running), and, let go, it removes its stale copy.
func fleetProtect(t *testing.T) {
	hosts := startFleet(t, 3, 4)
	n1 := hosts[0]
	cleanupFleet(t, hosts, "fpck")
	// A copy of a point whose drop its holder missed (the drop is a message no one
	// waits for, and a node here is killed or stopped) stays pinned on the holder: the
	// fleet does not yet collect such copies. Removed here, so the RAM dirs are left
	// empty.
	t.Cleanup(func() {
		for _, h := range hosts {
			var cks []api.CheckpointObject
			out, _, _ := h.cli(nil, "checkpoints", "--json")
			json.Unmarshal([]byte(out), &cks)
			for _, c := range cks {
				if c.Protects != "" {
					t.Logf("%s still holds point %s of %s", h.name, c.Name, c.Protects)
					h.cli(nil, "checkpoint", "rm", "--force", c.Name)
				}
			}
		}
	})
	n1.ok(t, "create", "fpw", "--cpus", "1", "--memory-mb", "256", "--forkable", "--disk-mb", "64")
	n1.ok(t, "checkpoint", "fpw", "fpck", "--pin")
	n1.ok(t, "rm", "fpw")
	n1.ok(t, "fork", "fpck", "fpf")
	n1.ok(t, "exec", "fpf", "--", "sh", "-c", guestscript.Counter(""))
	n1.ok(t, "protect", "fpf", "--every", "2s")
	holder := func() *fleetHost {
		for _, h := range hosts[1:] {
			var cks []api.CheckpointObject
			if json.Unmarshal([]byte(h.ok(t, "checkpoints", "--json")), &cks) != nil {
				continue
			}
			for _, c := range cks {
				if c.Protects == "fpf" {
					return h
				}
			}
		}
		return nil
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		p := nodeVMs(t, n1)["fpf"].Protection
		if p != nil && p.Points >= 3 && holder() != nil {
			t.Logf("protection on n1: %+v", *p)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fpf not protected with a copy: %+v\n%s", p, n1.d.logText())
		}
		time.Sleep(300 * time.Millisecond)
	}
	counter := func(h *fleetHost) (mem, disk int) {
		t.Helper()
		out := strings.Fields(h.ok(t, "exec", "fpf", "--", "sh", "-c", guestscript.ReadNumbers(guestscript.CounterRAM, guestscript.CounterDisk)))
		if len(out) != 2 {
			t.Fatalf("counters on %s: %q", h.name, out)
		}
		mem, _ = strconv.Atoi(out[0])
		disk, _ = strconv.Atoi(out[1])
		return mem, disk
	}
	before, _ := counter(n1)
	n1.d.kill9()
	for pid := range procsReferencing(n1.home) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	killed := time.Now()
	var on *fleetHost
	for on == nil {
		for _, h := range hosts[1:] {
			if v, ok := nodeVMs(t, h)["fpf"]; ok && v.State == api.StateRunning {
				if _, _, code := h.cli(nil, "exec", "fpf", "--", "true"); code == 0 {
					on = h
				}
			}
		}
		if on == nil && time.Since(killed) > 90*time.Second {
			for _, h := range hosts[1:] {
				t.Logf("%s log:\n%s", h.name, h.d.logText())
			}
			t.Fatal("fpf not revived within 90 s of its node's kill")
		}
		time.Sleep(200 * time.Millisecond)
	}
	answering := time.Since(killed)
	mem, disk := counter(on)
	lost := time.Duration(before-mem) * 100 * time.Millisecond
	t.Logf("fpf answering on %s %.1fs after the kill; counter %d before, %d (memory) %d (disk) after: ~%v of work lost",
		on.name, answering.Seconds(), before, mem, disk, lost)
	// The revived guest counts on from its point before it is read: its counter is
	// not compared with the one before the kill (TestProtectRevive checks the point's
	// content exactly); memory and disk must agree.
	if mem <= 0 || mem-disk > 1 || disk-mem > 1 {
		t.Errorf("counters after the revival: memory %d, disk %d; %d before the kill", mem, disk, before)
	}
	if host := strings.TrimSpace(on.ok(t, "exec", "fpf", "--", "hostname")); host != "fpf" {
		t.Errorf("revived fpf's hostname: %q", host)
	}
	for _, h := range hosts[1:] {
		if _, ok := nodeVMs(t, h)["fpf"]; ok != (h == on) {
			t.Errorf("fpf on %s: %v", h.name, ok)
		}
	}
	// Protected again by its new owner: its points go to a live node.
	deadline = time.Now().Add(time.Minute)
	for {
		p := nodeVMs(t, on)["fpf"].Protection
		if p != nil && p.Points >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("revived fpf not protected again: %+v\n%s", p, on.d.logText())
		}
		time.Sleep(300 * time.Millisecond)
	}
	// The fleet's listing names its new node and the fail-over.
	var fvms []api.FleetVM
	if err := json.Unmarshal([]byte(on.ok(t, "ls", "--fleet", "--json")), &fvms); err != nil {
		t.Fatal(err)
	}
	listed := false
	for _, v := range fvms {
		if v.Name == "fpf" {
			listed = true
			if p := v.Protection; v.Node != on.name || p == nil || p.RevivedFrom != "n1" || p.Point == "" {
				t.Errorf("ls --fleet: fpf %+v, protection %+v; want on %s, revived from n1", v, p, on.name)
			} else if p.LostWorkMax <= 0 || p.LostWork > p.LostWorkMax {
				// Bounds of the work lost: to n1's last heartbeat, and to its fence.
				t.Errorf("fpf's work lost: %v to %v", p.LostWork, p.LostWorkMax)
			}
		}
	}
	if !listed {
		t.Errorf("ls --fleet does not list fpf: %+v", fvms)
	}
	// n1 back: its stale fpf (its QEMU gone with the node) and its points are removed.
	n1.d = startDaemon(t, n1.home, serve.SocketPath(n1.home), n1.log, n1.args...)
	// Stopped as the fleet's daemons are, before startDaemon's kill at the end: a daemon
	// killed leaves its fence watchdog guarding its lease.
	t.Cleanup(func() {
		if n1.d.cmd.ProcessState == nil {
			n1.d.stop()
		}
	})
	deadline = time.Now().Add(90 * time.Second)
	for {
		_, stale := nodeVMs(t, n1)["fpf"]
		if !stale {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("n1 kept its stale fpf:\n%s", n1.d.logText())
		}
		time.Sleep(300 * time.Millisecond)
	}
	if _, ok := nodeVMs(t, on)["fpf"]; !ok {
		t.Errorf("fpf gone from %s after n1 came back", on.name)
	}

	// Cut: fpf's owner stopped (SIGSTOP of its daemon, its embedded NATS server with it)
	// for twice the TTL. Its fence watchdog ends fpf's QEMU before another node revives
	// fpf; let go, the owner removes its stale copy.
	cut := on
	deadline = time.Now().Add(time.Minute)
	for {
		p := nodeVMs(t, cut)["fpf"].Protection
		if p != nil && p.Points >= 2 && p.LastError == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fpf on %s: no copied point: %+v\n%s", cut.name, p, cut.d.logText())
		}
		time.Sleep(300 * time.Millisecond)
	}
	oldPID := nodeVMs(t, cut)["fpf"].PID
	if err := cut.d.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	var fencedAt time.Time
	on = nil
	for on == nil {
		if fencedAt.IsZero() && !procinfo.ProcessRuns(oldPID) {
			fencedAt = time.Now()
		}
		for _, h := range hosts {
			if h == cut {
				continue
			}
			if v, ok := nodeVMs(t, h)["fpf"]; ok && v.State == api.StateRunning {
				if _, _, code := h.cli(nil, "exec", "fpf", "--", "true"); code == 0 {
					if procinfo.ProcessRuns(oldPID) {
						t.Errorf("fpf answers on %s while its QEMU on %s (pid %d) still runs", h.name, cut.name, oldPID)
					}
					on = h
				}
			}
		}
		if on == nil && time.Since(stopped) > 90*time.Second {
			cut.d.cmd.Process.Signal(syscall.SIGCONT)
			for _, h := range hosts {
				t.Logf("%s log:\n%s", h.name, h.d.logText())
			}
			t.Fatal("fpf not revived within 90 s of its owner's stop")
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("cut: %s stopped; its fpf fenced %.1fs after, fpf answering on %s %.1fs after",
		cut.name, fencedAt.Sub(stopped).Seconds(), on.name, time.Since(stopped).Seconds())
	time.Sleep(time.Until(stopped.Add(12 * time.Second)))
	if err := cut.d.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline = time.Now().Add(90 * time.Second)
	for {
		_, stale := nodeVMs(t, cut)["fpf"]
		var cks []api.CheckpointObject
		json.Unmarshal([]byte(cut.ok(t, "checkpoints", "--json")), &cks)
		points := 0
		for _, c := range cks {
			if c.Protects == "fpf" {
				points++
			}
		}
		// The copy it may hold of the new owner's point is the fleet's, not stale.
		if !stale && points <= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s kept its stale fpf (%v) or points (%d) after it was let go:\n%s", cut.name, stale, points, cut.d.logText())
		}
		time.Sleep(300 * time.Millisecond)
	}
	running := 0
	for _, h := range hosts {
		if v, ok := nodeVMs(t, h)["fpf"]; ok && v.State == api.StateRunning {
			running++
		}
	}
	if running != 1 {
		t.Errorf("fpf runs on %d nodes after the cut, want 1", running)
	}
	on.ok(t, "unprotect", "fpf")

	// A fleet wave's forks protected by the nodes that made them.
	evs := waveEvents(t, n1.ok(t, "fork", "fpck", "fpq", "--fleet", "--protect", "2s", "--json"))
	if len(evs) != 1 || !evs[0].OK {
		t.Fatalf("fleet fork --protect: %+v", evs)
	}
	var maker *fleetHost
	for _, h := range hosts {
		if h.name == evs[0].Node {
			maker = h
		}
	}
	if maker == nil {
		t.Fatalf("fpq made on %q, not a node of the fleet", evs[0].Node)
	}
	deadline = time.Now().Add(time.Minute)
	for {
		if p := nodeVMs(t, maker)["fpq"].Protection; p != nil && p.Points >= 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("fpq not protected on %s:\n%s", maker.name, maker.d.logText())
		}
		time.Sleep(300 * time.Millisecond)
	}
	maker.ok(t, "rm", "fpq")
}
