package tests

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/internal/guestscript"
	"github.com/forkvm/forkvm/procinfo"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/pull"
	"github.com/forkvm/forkvm/vsockd"
)

// engineSource is an engine as a pull.Source: another host's daemon, in-process.
type engineSource struct{ e *engine.Engine }

func (s engineSource) ExportCheckpoint(ctx context.Context, name string) (*api.CheckpointExport, error) {
	return s.e.ExportCheckpoint(ctx, name)
}

func (s engineSource) ReadCheckpointFile(ctx context.Context, name, file string, off, n int64) (io.ReadCloser, error) {
	f, err := s.e.OpenCheckpointFile(ctx, name, file)
	if err != nil {
		return nil, err
	}
	return struct {
		io.Reader
		io.Closer
	}{io.NewSectionReader(f, off, n), f}, nil
}

// pullCopier copies each protection point into another engine (the other host) and
// deletes the copy of the point before it there.
type pullCopier struct {
	from, to    *engine.Engine
	last        map[string]string
	copies      int
	unprotected []string
}

func (c *pullCopier) CopyPoint(ctx context.Context, vm string, point *engine.Checkpoint) error {
	if _, err := pull.Checkpoint(ctx, c.to, engineSource{c.from}, point.Manifest.Name, nil); err != nil {
		return err
	}
	if prev := c.last[vm]; prev != "" {
		c.to.DeleteCheckpoint(ctx, prev, nil)
	}
	c.last[vm] = point.Manifest.Name
	c.copies++
	return nil
}

// TestProtectRevive: a protected fork's points are copied to another engine (host);
// after its QEMU is killed, it is revived there from its last complete point as
// itself: its memory and disk as they were at the point (not after), the same token
// and hostname; old points are gone from the first host, and bad revivals are refused.
func TestProtectRevive(t *testing.T) {
	roomy := parallelVMTest(t)
	a := newRobustEnv(t, roomy).E
	b := newRobustEnv(t, roomy).E
	ctx := ctxT(t, 5*time.Minute)
	makeWorld(t, a, "w", 256, 64)
	if _, err := a.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	f, err := a.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	cp := &pullCopier{from: a, to: b, last: map[string]string{}}
	a.SetProtectionCopier(cp)
	if _, err := a.Protect(ctx, "f", &engine.ProtectOptions{Every: 500 * time.Millisecond}); !errors.Is(err, engine.ErrInvalidSpec) {
		t.Fatalf("protect every 500ms: %v, want ErrInvalidSpec", err)
	}
	// An hour apart: the test takes its points itself (ProtectNow).
	if _, err := a.Protect(ctx, "f", &engine.ProtectOptions{Every: time.Hour}); err != nil {
		t.Fatal(err)
	}
	var points []string
	for i := 1; i <= 3; i++ {
		mustRun(t, f, "head -c 4194304 /dev/urandom > /dev/shm/r; echo "+strconvI(i)+" > /dev/shm/c; echo "+strconvI(i)+" > /data/c; sync")
		// The loop's first point may be under way: ProtectNow waits for it.
		p, err := a.ProtectNow(ctx, "f")
		if err != nil {
			t.Fatalf("point %d: %v", i, err)
		}
		if p.Point == "" || p.LastPause <= 0 {
			t.Fatalf("point %d: %+v", i, p)
		}
		t.Logf("point %d: %s, guest paused %v, %d bytes", i, p.Point, p.LastPause, p.LastBytes)
		points = append(points, p.Point)
	}
	want := mustRun(t, f, "md5sum /dev/shm/r; cat /dev/shm/c /data/c; hostname")
	mustRun(t, f, "echo 4 > /dev/shm/c; echo 4 > /data/c; sync") // lost with the host
	last := points[len(points)-1]
	var mine []string
	cks, _ := a.Checkpoints()
	for _, c := range cks {
		if c.Protects == "f" {
			mine = append(mine, c.Name)
		}
	}
	if len(mine) != 1 || mine[0] != last {
		t.Errorf("points of f on its host: %v, want only the last, %s", mine, last)
	}
	token := f.Target().Token
	syscall.Kill(f.PID(), syscall.SIGKILL)
	waitDead(t, f, 30*time.Second)

	for _, tc := range []struct {
		name, ck, vm, token string
		want                error
	}{
		{"another vm's point", last, "g", token, engine.ErrInvalidSpec},
		{"bad token", last, "f", "xyz", engine.ErrInvalidSpec},
		{"no such point", "nope", "f", token, engine.ErrNotFound},
	} {
		if _, err := b.Revive(ctx, tc.ck, tc.vm, tc.token); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	g, err := b.Revive(ctx, last, "f", token)
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, g, "md5sum /dev/shm/r; cat /dev/shm/c /data/c; hostname"); got != want {
		t.Errorf("revived f sees %q, want %q (as at its last point)", got, want)
	}
	if g.Target().Token != token {
		t.Errorf("revived f has token %s, want its own %s", g.Target().Token, token)
	}
	if _, err := b.Revive(ctx, last, "f", token); !errors.Is(err, engine.ErrExists) {
		t.Errorf("second revival: %v, want ErrExists", err)
	}
	// Deleting the dead f on its old host deletes its points there.
	if err := a.Delete(ctx, "f"); err != nil {
		t.Fatal(err)
	}
	cks, _ = a.Checkpoints()
	for _, c := range cks {
		if c.Protects == "f" || strings.HasPrefix(c.Name, "f-p-") {
			t.Errorf("point %s left after f was deleted", c.Name)
		}
	}
}

// Unprotected deletes the copy of vm's last point in the other engine.
func (c *pullCopier) Unprotected(ctx context.Context, vm string) {
	if prev := c.last[vm]; prev != "" {
		c.to.DeleteCheckpoint(ctx, prev, nil)
		delete(c.last, vm)
	}
	c.unprotected = append(c.unprotected, vm)
}

func strconvI(i int) string { return string(rune('0' + i)) }

// TestProtectDaemon: forkvm fork --protect through a daemon takes points every
// interval; a daemon killed and restarted resumes them from the VM's manifest; forkvm
// unprotect ends them and deletes the points.
func TestProtectDaemon(t *testing.T) {
	parallelVMTest(t)
	home, err := os.MkdirTemp("/tmp", "fvpd-")
	if err != nil {
		t.Fatal(err)
	}
	cli := cliRunner(t, home)
	t.Cleanup(func() {
		cli(nil, "rm", "pf", "pw")
		cli(nil, "checkpoint", "rm", "--force", "pck")
		for pid, args := range procsReferencing(home) {
			t.Errorf("leak: process %d still references %s: %q", pid, home, args)
		}
		os.RemoveAll(home)
	})
	ok := func(args ...string) string {
		t.Helper()
		out, errs, code := cli(nil, args...)
		if code != 0 {
			t.Fatalf("forkvm %v: exit %d: %s%s", args, code, out, errs)
		}
		return out
	}
	sock := serve.SocketPath(home)
	logPath := filepath.Join(t.TempDir(), "daemon.log")
	d := startDaemon(t, home, sock, logPath, "--overcommit", "32")
	ok("create", "pw", "--cpus", "1", "--memory-mb", "256", "--forkable", "--disk-mb", "64")
	ok("checkpoint", "pw", "pck", "--pin")
	ok("fork", "pck", "pf", "--protect", "1s")
	protection := func() *api.ProtectionInfo {
		t.Helper()
		var vms []serve.VMObject
		if err := json.Unmarshal([]byte(ok("ls", "--json")), &vms); err != nil {
			t.Fatal(err)
		}
		for _, v := range vms {
			if v.Name == "pf" {
				return v.Protection
			}
		}
		t.Fatal("pf not listed")
		return nil
	}
	waitPoints := func(min int64) *api.ProtectionInfo {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			p := protection()
			if p != nil && p.Points >= min {
				return p
			}
			if time.Now().After(deadline) {
				t.Fatalf("pf's protection: %+v, want %d points\n%s", p, min, d.logText())
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	p := waitPoints(3)
	if p.Every != time.Second || p.Point == "" || p.PointAt.IsZero() || p.Failures != 0 {
		t.Errorf("protection after 3 points: %+v", p)
	}
	d.kill9()
	d = startDaemon(t, home, sock, logPath, "--overcommit", "32")
	waitPoints(p.Points + 2) // resumed by the new daemon
	points := func() (n int) {
		var cks []serve.CheckpointObject
		if err := json.Unmarshal([]byte(ok("checkpoints", "--json")), &cks); err != nil {
			t.Fatal(err)
		}
		for _, c := range cks {
			if c.Protects == "pf" {
				n++
			}
		}
		return n
	}
	if n := points(); n < 1 || n > 2 {
		t.Errorf("%d points of pf on disk, want the last (and at most one under way)", n)
	}
	if out := ok("unprotect", "pf"); !strings.Contains(out, "pf unprotected") {
		t.Errorf("unprotect: %q", out)
	}
	if p := protection(); p != nil {
		t.Errorf("pf still protected: %+v", p)
	}
	if n := points(); n != 0 {
		t.Errorf("%d points of pf left after unprotect", n)
	}
	if _, errs, code := cli(nil, "protect", "pf", "--every", "100ms"); code == 0 || !strings.Contains(errs, "protection interval") {
		t.Errorf("protect --every 100ms: exit %d, %q", code, errs)
	}
	d.stop()
}

// slowCopier is a ProtectionCopier whose copies take delay (a throttled link): it
// counts the points it was given.
type slowCopier struct {
	delay  time.Duration
	copies atomic.Int32
}

func (c *slowCopier) CopyPoint(ctx context.Context, _ string, _ *engine.Checkpoint) error {
	select {
	case <-time.After(c.delay):
		c.copies.Add(1)
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (*slowCopier) Unprotected(context.Context, string) {}

// TestProtectionFallsBehind: copies slower than the interval make protection fall
// behind visibly (Behind, the point's age past the interval) while the guest is paused
// only for its points and answers as usual; and 60 points of one fork keep its disk
// chain, its points' lineage and its revival flat: a point is one layer over the fork's
// lineage, however many came before.
func TestProtectionFallsBehind(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 10*time.Minute)
	makeWorld(t, e, "bw", 256, 64)
	if _, err := e.Checkpoint(ctx, "bw", "bck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	f, err := e.Fork(ctx, "bck", &engine.ForkOptions{Name: "bf"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, guestscript.Counter("")+" echo $! > /dev/shm/loop")
	slow := &slowCopier{delay: 2500 * time.Millisecond}
	e.SetProtectionCopier(slow)
	if _, err := e.Protect(ctx, "bf", &engine.ProtectOptions{Every: time.Second}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	var p *engine.ProtectionInfo
	for {
		p = f.Info().Protection
		if p != nil && p.Points >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no 3 points with slow copies: %+v", p)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !p.Behind || p.Age(time.Now()) < time.Second && p.Points < 3 {
		t.Errorf("copies of 2.5 s every 1 s: %+v, want behind", p)
	}
	if p.LastPause <= 0 || p.LastPause > 2*time.Second {
		t.Errorf("pause %v while copies are slow: the copy is not part of the pause", p.LastPause)
	}
	start := time.Now()
	mustRun(t, f, "true")
	t.Logf("behind: %+v; exec took %v meanwhile", *p, time.Since(start))
	if err := e.Unprotect(ctx, "bf"); err != nil {
		t.Fatal(err)
	}

	// Many points, no copier: each point is the fork's lineage plus one layer.
	e.SetProtectionCopier(nil)
	if _, err := e.Protect(ctx, "bf", &engine.ProtectOptions{Every: time.Hour}); err != nil {
		t.Fatal(err)
	}
	var first, last time.Duration
	var layers0 int
	for i := 1; i <= 60; i++ {
		p, err := e.ProtectNow(ctx, "bf")
		if err != nil {
			t.Fatalf("point %d: %v", i, err)
		}
		c, err := e.LoadCheckpoint(ctx, p.Point)
		if err != nil {
			t.Fatal(err)
		}
		if i == 1 {
			first, layers0 = p.LastPause, len(c.Manifest.Layers)
		}
		last = p.LastPause
		if n := len(c.Manifest.Layers); n != layers0 {
			t.Fatalf("point %d has %d RAM layers, the first %d: points chain", i, n, layers0)
		}
		if d := len(c.Manifest.Disk); d > genMaxCkDepth {
			t.Fatalf("point %d has a %d-layer disk chain, want at most %d", i, d, genMaxCkDepth)
		}
		if d := len(vmDiskChain(t, env.Home, "bf")); d > genMaxVMDepth {
			t.Fatalf("point %d: the vm's disk chain has %d layers, want at most %d", i, d, genMaxVMDepth)
		}
	}
	t.Logf("60 points: first paused %v, last %v; %d RAM layers each", first, last, layers0)
	mine := 0
	cks, _ := e.Checkpoints()
	for _, c := range cks {
		if c.Protects == "bf" {
			mine++
		}
	}
	if mine != 1 {
		t.Errorf("%d points of bf kept after 60, want the last", mine)
	}
	// The counter stopped, a last point of a known value, then work it does not hold.
	mustRun(t, f, "kill $(cat /dev/shm/loop); sleep 0.3; echo 7000 > /dev/shm/c")
	p, err = e.ProtectNow(ctx, "bf")
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo 7001 > /dev/shm/c")
	token := f.Target().Token
	if err := e.Fence(ctx, "bf"); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	g, err := e.Revive(ctx, p.Point, "bf", token)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("revived from the 60th point in %v", time.Since(start))
	if got := strings.TrimSpace(mustRun(t, g, "cat /dev/shm/c")); got != "7000" {
		t.Errorf("revived from the last point: counter %q, want 7000 (as at the point)", got)
	}
}

// TestFreezeThaw: a frozen VM's guest runs no more (its QEMU spends next to no CPU,
// though the guest spins) until Thaw, whatever else asks: exec, a checkpoint, a
// protection point and a park are refused with ErrFrozen, a resume leaves it stopped,
// and an engine restarted meanwhile keeps it stopped. Thawed, it runs on as it was
// and its protection loop takes points again.
func TestFreezeThaw(t *testing.T) {
	roomy := parallelVMTest(t)
	env := newRobustEnv(t, roomy)
	e := env.E
	ctx := ctxT(t, 4*time.Minute)
	makePinnedWorld(t, e, 256, 0)
	f := mustFork(t, e, "ck", "f")
	if _, err := e.Protect(ctx, "f", &engine.ProtectOptions{Every: time.Hour}); err != nil {
		t.Fatal(err)
	}
	p, err := e.ProtectNow(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo kept > /dev/shm/k; (while :; do :; done) >/dev/null 2>&1 & echo $! > /dev/shm/spin")
	if err := e.Freeze(ctx, "f"); err != nil {
		t.Fatal(err)
	}
	if err := e.Freeze(ctx, "f"); err != nil {
		t.Fatalf("freeze of a frozen VM: %v", err)
	}
	frozen := func(e *engine.Engine, when string) {
		t.Helper()
		vm, err := e.Get("f")
		if err != nil {
			t.Fatal(err)
		}
		if inf := vm.Info(); inf.State != engine.StatePaused || inf.Reason != api.ReasonFrozen {
			t.Errorf("%s: state %s (%q), want paused (frozen)", when, inf.State, inf.Reason)
		}
		if cpu := cpuOver(t, vm.PID(), 2*time.Second); cpu > 100*time.Millisecond {
			t.Errorf("%s: its QEMU spent %v of CPU in 2 s: the guest runs", when, cpu)
		}
		_, err = vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}})
		_, cerr := e.Checkpoint(ctx, "f", "fck", nil)
		_, perr := e.ProtectNow(ctx, "f")
		_, kerr := e.Park(ctx, "f")
		for what, err := range map[string]error{"exec": err, "checkpoint": cerr, "protection point": perr, "park": kerr, "resume": e.Resume(ctx, "f")} {
			if what == "resume" {
				if err != nil || vm.Info().Reason != api.ReasonFrozen {
					t.Errorf("%s: resume: %v, reason %q; want nothing done", when, err, vm.Info().Reason)
				}
				continue
			}
			if !errors.Is(err, engine.ErrFrozen) {
				t.Errorf("%s: %s: %v, want ErrFrozen", when, what, err)
			}
		}
	}
	frozen(e, "frozen")
	// A restarted engine keeps it frozen.
	e.Close()
	if st := qmpStatus(t, env.Home, "f"); st != "paused" {
		t.Errorf("QEMU's status with no engine: %s, want paused", st)
	}
	e2, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	frozen(e2, "after a restart")
	if err := e2.Thaw(ctx, "f"); err != nil {
		t.Fatal(err)
	}
	f2, err := e2.Get("f")
	if err != nil {
		t.Fatal(err)
	}
	if inf := f2.Info(); inf.State != engine.StateRunning {
		t.Errorf("thawed: state %s (%q), want running", inf.State, inf.Reason)
	}
	if cpu := cpuOver(t, f2.PID(), 2*time.Second); cpu < 100*time.Millisecond {
		t.Errorf("thawed: its QEMU spent %v of CPU in 2 s while its guest spins", cpu)
	}
	if got := mustRun(t, f2, "cat /dev/shm/k; kill $(cat /dev/shm/spin)"); got != "kept" {
		t.Errorf("thawed guest's file: %q, want kept", got)
	}
	deadline := time.Now().Add(time.Minute)
	for {
		q := f2.Info().Protection
		if q != nil && q.Points > p.Points {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no protection point after the thaw: %+v (before the freeze: %d)", q, p.Points)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// cpuOver is the CPU time process pid spends over d.
func cpuOver(t *testing.T, pid int, d time.Duration) time.Duration {
	t.Helper()
	u0, s0, err := procinfo.ProcessCPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(d)
	u1, s1, err := procinfo.ProcessCPU(pid)
	if err != nil {
		t.Fatal(err)
	}
	return u1 + s1 - u0 - s0
}
