package console

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/procinfo"
)

// vmDir makes a VM's run directory under the test's temporary directory and returns
// its console socket and log.
func vmDir(t *testing.T, name string) (runDir, sock, logPath string) {
	t.Helper()
	runDir = filepath.Join(t.TempDir(), name)
	if err := os.Mkdir(runDir, 0o700); err != nil {
		t.Fatal(err)
	}
	return runDir, filepath.Join(runDir, SockName), filepath.Join(runDir, "serial.log")
}

// eventually polls cond for up to 10 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s", what)
		}
	}
}

func logOf(logPath string) string {
	var b bytes.Buffer
	Tail(logPath, 4*LogHalf, &b)
	return b.String()
}

// TestHubBounded: the hub copies a console that floods far more than the cap into
// the rotating log: within 2 × LogHalf, the end of the output kept, private; the
// record names this process; after Stop, nothing holds the log open.
func TestHubBounded(t *testing.T) {
	h := NewHub()
	defer h.Close()
	runDir, sock, logPath := vmDir(t, "w1")
	if err := h.Start(sock, logPath); err != nil {
		t.Fatal(err)
	}
	if r, ok := readRecord(runDir); !ok || r != h.self {
		t.Errorf("record %v %v, want this process %v", r, ok, h.self)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	line := append(bytes.Repeat([]byte("A"), 1023), '\n')
	const total = 5 * LogHalf
	for n := 0; n < total; n += len(line) {
		if _, err := c.Write(line); err != nil {
			t.Fatal(err)
		}
	}
	c.Write([]byte("the end\n"))
	c.Close()
	eventually(t, "the last line logged", func() bool { return strings.HasSuffix(logOf(logPath), "A\nthe end\n") })
	var size int64
	for _, f := range []string{logPath, logPath + RotatedSuffix} {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > LogHalf {
			t.Errorf("%s: %d bytes, cap %d", f, st.Size(), LogHalf)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f, st.Mode().Perm())
		}
		size += st.Size()
	}
	if size > 2*LogHalf || size < LogHalf {
		t.Errorf("console log holds %d bytes of %d sent; want between %d and %d", size, total, LogHalf, 2*LogHalf)
	}
	h.Stop(runDir, logPath)
	if holds(openFiles(os.Getpid()), logPath) {
		t.Errorf("the log is still open after Stop")
	}
	if _, err := net.Dial("unix", sock); err == nil {
		t.Errorf("the console socket still accepts after Stop")
	}
}

// TestHubReconnect: a QEMU whose connection closed (reconnect-ms) is served again on
// the same socket, into the same log.
func TestHubReconnect(t *testing.T) {
	h := NewHub()
	defer h.Close()
	runDir, sock, logPath := vmDir(t, "w1")
	if err := h.Start(sock, logPath); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"one\n", "two\n"} {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(s))
		c.Close()
	}
	eventually(t, "both connections logged", func() bool { return logOf(logPath) == "one\ntwo\n" })
	h.Stop(runDir, logPath)
}

// TestHubRename: a claimed warm-pool VM's directory moves; its console is written
// (and rotated) at the new place.
func TestHubRename(t *testing.T) {
	h := NewHub()
	defer h.Close()
	oldRun, sock, oldLog := vmDir(t, "pool-1")
	if err := h.Start(sock, oldLog); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("pooled\n"))
	eventually(t, "first line", func() bool { return logOf(oldLog) == "pooled\n" })
	newRun := filepath.Join(filepath.Dir(oldRun), "f1")
	if err := os.Rename(oldRun, newRun); err != nil {
		t.Fatal(err)
	}
	newLog := filepath.Join(newRun, "serial.log")
	h.Rename(oldRun, newRun, newLog)
	c.Write(bytes.Repeat([]byte("B"), LogHalf))
	c.Write([]byte("claimed\n"))
	eventually(t, "rotated at the new place", func() bool {
		_, err := os.Stat(newLog + RotatedSuffix)
		return err == nil && strings.HasSuffix(logOf(newLog), "Bclaimed\n") && strings.HasPrefix(logOf(newLog), "pooled\n")
	})
	c.Close()
	h.Stop(newRun, newLog)
	if holds(openFiles(os.Getpid()), newLog) {
		t.Errorf("the log is still open after Stop")
	}
}

// keeperOf returns the live keeper recorded in runDir, failing the test if there is none.
func keeperOf(t *testing.T, runDir string) record {
	t.Helper()
	r, ok := readRecord(runDir)
	if !ok || r.pid == os.Getpid() || !r.alive() {
		t.Fatalf("%s: record %v (ok %v) names no live keeper", runDir, r, ok)
	}
	return r
}

// TestHubHandOff: Close hands a console mid-stream to one keeper process (this test
// binary, re-executed) with no byte lost or doubled, and one no QEMU connected to yet,
// which the keeper then accepts. Both records name the keeper, whose argv lists both
// logs; it exits when both connections closed.
func TestHubHandOff(t *testing.T) {
	h := NewHub()
	runA, sockA, logA := vmDir(t, "a")
	runB, sockB, logB := vmDir(t, "b")
	for _, c := range [][2]string{{sockA, logA}, {sockB, logB}} {
		if err := h.Start(c[0], c[1]); err != nil {
			t.Fatal(err)
		}
	}
	a, err := net.Dial("unix", sockA)
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	const lines = 30000 // 270 kB: no rotation, so the log is compared whole
	closed := make(chan struct{})
	go func() {
		// Closed in the middle of the stream.
		time.Sleep(20 * time.Millisecond)
		h.Close()
		close(closed)
	}()
	for i := range lines {
		l := fmt.Sprintf("%08d\n", i)
		want.WriteString(l)
		if _, err := a.Write([]byte(l)); err != nil {
			t.Fatal(err)
		}
		if i == lines/2 {
			<-closed
		}
	}
	k := keeperOf(t, runA)
	if kb := keeperOf(t, runB); kb != k {
		t.Errorf("two keepers: %v and %v", k, kb)
	}
	if args, err := procinfo.ProcessArgs(k.pid); err != nil || !slices.Equal(args, []string{consoleKeeperArg0, logA, logB}) {
		t.Errorf("keeper argv %q (%v), want %q", args, err, []string{consoleKeeperArg0, logA, logB})
	}
	if err := h.Start(filepath.Join(t.TempDir(), SockName), filepath.Join(t.TempDir(), "serial.log")); err == nil {
		t.Errorf("Start after Close succeeded")
	}
	b, err := net.Dial("unix", sockB)
	if err != nil {
		t.Fatal(err)
	}
	b.Write([]byte("late\n"))
	b.Close()
	a.Close()
	eventually(t, "keeper exits once both connections closed", func() bool { return !k.alive() })
	if got := logOf(logA); got != want.String() {
		t.Errorf("console a: %d bytes, want %d (lost or doubled at the hand-off)", len(got), want.Len())
	}
	if got := logOf(logB); got != "late\n" {
		t.Errorf("console b: %q, want %q", got, "late\n")
	}
}

// TestStopKeeper: removing a VM served by a keeper waits until the keeper let go of its
// log, and never ends a keeper that serves another VM; one that serves only that VM
// and still holds its log after keeperExitWait is ended. Without a record, the keeper
// is found by its argv.
func TestStopKeeper(t *testing.T) {
	for _, tc := range []struct {
		name     string
		recorded bool
	}{{"recorded", true}, {"unrecorded", false}} {
		t.Run(tc.name, func(t *testing.T) {
			h := NewHub()
			runA, sockA, logA := vmDir(t, "a")
			runB, sockB, logB := vmDir(t, "b")
			h.Start(sockA, logA)
			h.Start(sockB, logB)
			a, err := net.Dial("unix", sockA)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			b, err := net.Dial("unix", sockB)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			if err := h.Close(); err != nil {
				t.Fatal(err)
			}
			k := keeperOf(t, runA)
			defer func() {
				if k.alive() {
					t.Errorf("keeper %d outlived all its VMs", k.pid)
					if p, err := os.FindProcess(k.pid); err == nil {
						p.Kill()
					}
				}
			}()
			eventually(t, "keeper holds both logs", func() bool {
				f := openFiles(k.pid)
				return holds(f, logA) && holds(f, logB)
			})
			if !tc.recorded {
				os.Remove(filepath.Join(runA, recordFile))
				os.Remove(filepath.Join(runB, recordFile))
			}
			next := NewHub() // the engine that removes them
			defer next.Close()
			// VM a's QEMU exited: Stop returns once the keeper let go of a's log.
			a.Close()
			next.Stop(runA, logA)
			if f := openFiles(k.pid); holds(f, logA) {
				t.Errorf("keeper still holds %s after Stop", logA)
			}
			// VM b's connection still open (its QEMU somehow alive): Stop waits its
			// bound; the keeper, serving nothing else now, is ended.
			start := time.Now()
			next.Stop(runB, logB)
			if k.alive() {
				t.Errorf("keeper still runs after Stop of the only VM it serves")
			}
			if d := time.Since(start); d < keeperExitWait {
				t.Errorf("Stop returned after %v, before keeperExitWait", d)
			}
		})
	}
}

// TestStopSparesSharedKeeper: a keeper that still serves another VM is never ended for
// one VM's removal, even when it does not let go of the removed VM's log in time.
func TestStopSparesSharedKeeper(t *testing.T) {
	h := NewHub()
	runA, sockA, logA := vmDir(t, "a")
	_, sockB, logB := vmDir(t, "b")
	h.Start(sockA, logA)
	h.Start(sockB, logB)
	a, _ := net.Dial("unix", sockA)
	b, _ := net.Dial("unix", sockB)
	h.Close()
	k := keeperOf(t, runA)
	NewHub().Stop(runA, logA) // a's connection is still open
	if !k.alive() {
		t.Fatalf("keeper serving two VMs ended for one")
	}
	a.Close()
	b.Close()
	eventually(t, "keeper exits", func() bool { return !k.alive() })
}

// TestRecover: after the engine serving a console died (its listener and connection
// gone with it), a reconnecting QEMU is served again by the next engine's Recover; a
// console a live keeper serves is left to it.
func TestRecover(t *testing.T) {
	h := NewHub()
	runA, sockA, logA := vmDir(t, "a")
	runB, sockB, logB := vmDir(t, "b")
	h.Start(sockA, logA)
	h.Start(sockB, logB)
	b, err := net.Dial("unix", sockB)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	// a's serving process died: what kill -9 leaves (its record names a dead process,
	// its socket file stays, nobody listens).
	h.mu.Lock()
	s := h.cons[runA]
	delete(h.cons, runA)
	h.mu.Unlock()
	s.stop(haltStop)
	writeRecord(runA, record{pid: 1 << 30, start: 1})
	h.Close() // b goes to a keeper
	k := keeperOf(t, runB)

	// A QEMU with reconnect-ms: retries until someone listens, then prints.
	printed := make(chan error, 1)
	go func() {
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if c, err := net.Dial("unix", sockA); err == nil {
				_, err = c.Write([]byte("after the crash\n"))
				c.Close()
				printed <- err
				return
			}
		}
		printed <- fmt.Errorf("never reconnected")
	}()
	time.Sleep(50 * time.Millisecond)
	next := NewHub()
	defer next.Close()
	if err := next.Recover([]Console{{runA, logA}, {runB, logB}}); err != nil {
		t.Fatal(err)
	}
	if err := <-printed; err != nil {
		t.Fatal(err)
	}
	eventually(t, "reconnected console logged", func() bool { return logOf(logA) == "after the crash\n" })
	if r, _ := readRecord(runA); r != next.self {
		t.Errorf("a's record %v, want the recovering engine %v", r, next.self)
	}
	if r, _ := readRecord(runB); r != k {
		t.Errorf("b's record %v, want its keeper %v (still serving it)", r, k)
	}
	next.mu.Lock()
	_, servesB := next.cons[runB]
	next.mu.Unlock()
	if servesB {
		t.Errorf("Recover served b, which its keeper serves")
	}
	b.Close()
	eventually(t, "keeper exits", func() bool { return !k.alive() })
	next.Stop(runA, logA)
}

// TestKeeperAcceptWait: a keeper given a console no QEMU connects to gives up after its
// wait, its log closed (in-process: the keeper's body on passed descriptors).
func TestKeeperAcceptWait(t *testing.T) {
	_, sock, logPath := vmDir(t, "a")
	f := listenerFile(t, sock)
	done := make(chan struct{})
	go func() {
		keep([]handed{{ln: f, log: logPath}}, 50*time.Millisecond, func() {})
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("keeper still waits")
	}
	if holds(openFiles(os.Getpid()), logPath) {
		t.Errorf("log still open")
	}
	if _, err := qemu.ProcStartTime(os.Getpid()); err != nil {
		t.Fatal(err)
	}
}

// TestKeeperGivesUpOnDeletedVM: a keeper waiting for a QEMU that never connects stops
// waiting once the VM's directory is gone (the VM was deleted), long before its accept
// wait: it outlived its VMs by a minute in a fleet test.
func TestKeeperGivesUpOnDeletedVM(t *testing.T) {
	_, sock, logPath := vmDir(t, "a")
	f := listenerFile(t, sock)
	done := make(chan struct{})
	go func() {
		keep([]handed{{ln: f, log: logPath}}, time.Hour, func() {})
		close(done)
	}()
	select {
	case <-done:
		t.Fatal("keeper gave up with its VM still there")
	case <-time.After(3 * vmPoll):
	}
	if err := os.RemoveAll(filepath.Dir(logPath)); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("keeper still waits for a deleted VM's QEMU")
	}
}

// listenerFile is a unix listener on sock as a file, as a keeper is handed one.
func listenerFile(t *testing.T, sock string) *os.File {
	t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	f, err := ln.File()
	ln.Close()
	if err != nil {
		t.Fatal(err)
	}
	return f
}
