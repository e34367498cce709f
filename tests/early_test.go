package tests

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// TestForkOfRunningForkStartsEarly: the first fork of a wave of a running fork starts
// its QEMU while the implicit checkpoint is taken (its spawn begins before the
// checkpoint ends), opening the source's disk layers and a flattened ancestor's RAM file
// before the pause. The source keeps writing new files to its disk meanwhile (fresh
// qcow2 clusters in the layer the fork's QEMU already opened): each fork must read every
// file the source had written by the pause, from its disk chain (page cache dropped), as
// it reads them from its restored page cache, and the lineage's RAM as its ancestors
// wrote it; the second fork is made the usual way, on the overlay template the first
// one's set-up made for the checkpoint.
func TestForkOfRunningForkStartsEarly(t *testing.T) {
	e, n2, sums := flattenedLineage(t, 64, 4)
	ctx := ctxT(t, 5*time.Minute)
	// A writer that allocates new clusters on n2's disk all the time (new files, synced).
	mustRun(t, n2, `(i=0; while :; do i=$((i+1)); dd if=/dev/urandom of=/data/f$i bs=65536 count=4 2>/dev/null; sync; done) </dev/null >/dev/null 2>&1 & echo $! > /dev/shm/loop.pid`)
	// The fork starts once the writer has allocated clusters a few times over.
	mustRun(t, n2, `for i in $(seq 100); do test -e /data/f4 && exit 0; sleep 0.05; done; exit 1`)

	evs, err := e.ForkMany(ctx, "n2", 2, &engine.ManyOptions{Names: []string{"g", "h"}})
	if err != nil {
		t.Fatal(err)
	}
	forks := map[string]*engine.VM{}
	for ev := range evs {
		if ev.Err != nil {
			t.Fatalf("fork %s of the running n2: %v", ev.Name, ev.Err)
		}
		forks[ev.Name] = ev.VM
	}
	g := forks["g"]
	ck, err := e.LoadCheckpoint(ctx, g.Info().Parent)
	if err != nil {
		t.Fatal(err)
	}
	spawn, ckEnd := int64(0), int64(0)
	for _, s := range g.Info().Spans {
		if s.Name == "spawn" {
			spawn = s.StartMono
		}
	}
	for _, s := range ck.Manifest.Spans {
		if s.Name == "checkpoint" {
			ckEnd = s.EndMono
		}
	}
	if spawn == 0 || ckEnd == 0 || spawn >= ckEnd {
		t.Errorf("the fork's QEMU started at %d ns, its implicit checkpoint %s ended at %d ns: not started early", spawn, ck.Name(), ckEnd)
	} else {
		t.Logf("spawn began %v before the checkpoint ended", time.Duration(ckEnd-spawn).Round(time.Millisecond))
	}
	mustRun(t, n2, "kill $(cat /dev/shm/loop.pid)")

	for _, vm := range []*engine.VM{g, forks["h"]} {
		if got, want := mustRun(t, vm, "md5sum /dev/shm/w /dev/shm/n1 /dev/shm/n2"), strings.Join(sums, "\n"); got != want {
			t.Errorf("%s reads %q, want %q", vm.Name(), got, want)
		}
		// The writer came along in the fork's RAM: stop it, then compare every file read
		// from the page cache with the same file read from the disk chain.
		out := mustRun(t, vm, `kill $(cat /dev/shm/loop.pid); sleep 0.2; sync; ls /data | grep -c '^f'; `+
			`cd /data && md5sum f* > /dev/shm/cached && echo 3 > /proc/sys/vm/drop_caches && md5sum f* > /dev/shm/disk; `+
			`cmp /dev/shm/cached /dev/shm/disk && echo same`)
		lines := strings.Split(out, "\n")
		n, _ := strconv.Atoi(lines[0])
		if n < 3 || lines[len(lines)-1] != "same" {
			t.Fatalf("%s's disk: %s", vm.Name(), out)
		}
		t.Logf("%s reads the %d files n2 wrote from its disk as from its page cache", vm.Name(), n)
	}
}
