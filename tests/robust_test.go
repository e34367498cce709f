package tests

// Robustness / fault-injection tests: processes killed with SIGKILL at awkward moments
// (forks, the engine itself, QEMU during a restore, the world during a checkpoint), a
// guest agent that never answers, and a small soak. Every test checks that nothing
// leaked: no QEMU process of the state dir, no socket, no RAM file, no disk clone and no
// manifest that should not be there.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// ---------------------------------------------------------------------------------------
// 1. kill -9 of forks during a wave

func TestRobustKillForksDuringWave(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	evs, err := e.ForkMany(ctx, "ck", 8, &engine.ManyOptions{Prefix: "f", Concurrency: 8})
	if err != nil {
		t.Fatal(err)
	}
	// Which arrivals get killed: 3 of 8, chosen with a fixed seed.
	rng := rand.New(rand.NewPCG(1, 2))
	killAt := map[int]bool{}
	for len(killAt) < 3 {
		killAt[rng.IntN(8)] = true
	}
	killed := map[string]*engine.VM{}
	killedPID := map[string]int{}
	var alive []*engine.VM
	arrival := 0
	for ev := range evs {
		if ev.Err != nil {
			t.Errorf("fork %s failed: %v", ev.Name, ev.Err)
			continue
		}
		if killAt[arrival] {
			pid := ev.VM.PID()
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatalf("kill %s (%d): %v", ev.Name, pid, err)
			}
			killed[ev.Name], killedPID[ev.Name] = ev.VM, pid
		} else {
			alive = append(alive, ev.VM)
		}
		arrival++
	}
	if len(killed) != 3 || len(alive) != 5 {
		t.Fatalf("killed %d, alive %d; want 3 and 5", len(killed), len(alive))
	}
	var killedNames []string
	for n := range killed {
		killedNames = append(killedNames, n)
	}
	sort.Strings(killedNames)
	t.Logf("killed %v", killedNames)

	for _, vm := range alive {
		if got := mustRun(t, vm, "hostname"); got != vm.Name() {
			t.Fatalf("%s: hostname %q", vm.Name(), got)
		}
	}
	// TCGThread auto: 8 forks of 1 vCPU in flight at once oversubscribe a host with
	// fewer CPUs, so the forks that started last run single-threaded TCG.
	if e.Accel() == "tcg" && runtime.NumCPU() < 8 {
		modes := map[string]int{}
		for _, vm := range alive {
			modes[string(vm.Info().TCGThread)]++
		}
		for _, vm := range killed {
			modes[string(vm.Info().TCGThread)]++
		}
		t.Logf("TCG thread modes of the wave: %v", modes)
		if modes["single"] == 0 {
			t.Errorf("no fork of a wave of 8 on %d CPUs runs single-threaded TCG: %v", runtime.NumCPU(), modes)
		}
	}
	for _, vm := range killed {
		waitDead(t, vm, 30*time.Second)
		_, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"true"}})
		wantErr(t, err, engine.ErrNotRunning)
	}
	for _, inf := range e.List() {
		want := engine.StateRunning
		if killed[inf.Name] != nil {
			want = engine.StateDead
		}
		if inf.State != want {
			t.Errorf("List: %s is %s, want %s", inf.Name, inf.State, want)
		}
	}
	if b := e.Budget(); ownUsed(b) != 1+len(alive) {
		t.Errorf("Budget.Used = %d, want %d (world + %d live forks)", ownUsed(b), 1+len(alive), len(alive))
	}

	dead := e.Reap(ctx)
	sort.Strings(dead)
	if !slices.Equal(dead, killedNames) {
		t.Fatalf("Reap = %v, want exactly %v", dead, killedNames)
	}
	for _, n := range killedNames {
		assertGone(t, env, n, killedPID[n])
	}
	var aliveNames []string
	for _, vm := range alive {
		aliveNames = append(aliveNames, vm.Name())
	}
	checkState(t, env, expectState{VMs: append(aliveNames, "w"), RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
	// The survivors were not disturbed by the reap, and a second reap finds nothing.
	for _, vm := range alive {
		mustRun(t, vm, "echo ok >/dev/shm/ok && cat /dev/shm/ok")
	}
	if d := e.Reap(ctx); len(d) != 0 {
		t.Fatalf("second Reap = %v", d)
	}
	if b := e.Budget(); ownUsed(b) != 1+len(alive) {
		t.Errorf("Budget.Used after reap = %d, want %d", ownUsed(b), 1+len(alive))
	}
	deleteAll(t, env)
}

// ---------------------------------------------------------------------------------------
// 2. kill -9 of the engine process mid-wave

func TestRobustKillEngineMidWave(t *testing.T) {
	helper := engineHelper(t)
	env := newRobustEnv(t, func(c *engine.Config) { c.LockWait = 10 * time.Second })
	// The helper process owns the state dir until it is killed.
	env.E.Close()

	cmd, sc, stderr := startEngineHelper(t, helper, env, "-n", "6")
	helperPID := cmd.Process.Pid
	t.Cleanup(func() { syscall.Kill(helperPID, syscall.SIGKILL); cmd.Wait() })
	lines := make(chan string, 64)
	go func() {
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	timeout := time.After(4 * time.Minute)
	ready, forks := false, 0
	var printed []string
	for forks < 2 {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("helper exited early: %v\nstderr: %s", cmd.Wait(), stderr.String())
			}
			switch {
			case l == "READY":
				ready = true
			case strings.HasPrefix(l, "FORK "):
				forks++
				printed = append(printed, strings.TrimPrefix(l, "FORK "))
			case strings.HasPrefix(l, "FAIL "), strings.HasPrefix(l, "ERROR "):
				t.Fatalf("helper: %s", l)
			}
		case <-timeout:
			t.Fatalf("helper did not make 2 forks (ready=%v); stderr: %s", ready, stderr.String())
		}
	}
	if err := syscall.Kill(helperPID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()

	// What the dead engine left: manifests as they are now (nothing writes them any more).
	type left struct {
		state string
		pid   int
	}
	leftover := map[string]left{}
	for _, n := range dirNames(filepath.Join(env.Home, "vms")) {
		if !strings.HasPrefix(n, "h") {
			continue
		}
		m, err := readManifest(filepath.Join(env.Home, "vms", n, "manifest.json"))
		if err != nil {
			leftover[n] = left{state: "no-manifest"}
			continue
		}
		leftover[n] = left{state: string(m.State), pid: m.PID}
	}
	qemus := map[string]int{}
	for pid, args := range procsReferencing(env.Home) {
		if n := vmOfArgs(args); n != "" {
			qemus[n] = pid
		}
	}
	t.Logf("helper printed %v; left behind: %+v; qemus: %v", printed, leftover, qemus)
	var running, halfMade []string
	for n, l := range leftover {
		if l.state == string(engine.StateRunning) {
			running = append(running, n)
		} else {
			halfMade = append(halfMade, n)
		}
	}
	sort.Strings(running)
	for _, n := range printed {
		if !slices.Contains(running, n) {
			t.Fatalf("fork %s was reported ready but its manifest says %+v", n, leftover[n])
		}
	}
	if len(halfMade) == 0 {
		t.Logf("note: every fork in flight was already confirmed when the engine died; no half-made fork to reap this time")
	}

	// A new engine on the same state dir.
	e2, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	ctx := ctxT(t, 4*time.Minute)
	for _, n := range halfMade {
		assertGone(t, env, n, leftover[n].pid)
		if pid := qemus[n]; pid > 0 && processAlive(pid) {
			t.Errorf("half-made %s: its qemu %d survived the new engine", n, pid)
		}
	}
	var listed []string
	for _, inf := range e2.List() {
		listed = append(listed, inf.Name)
		if inf.State != engine.StateRunning {
			t.Errorf("after restart %s is %s, want running", inf.Name, inf.State)
		}
	}
	if want := sorted(append([]string{"w"}, running...)); !slices.Equal(sorted(listed), want) {
		t.Fatalf("List after restart = %v, want %v", sorted(listed), want)
	}
	for _, n := range append([]string{"w"}, running...) {
		vm, err := e2.Get(n)
		if err != nil {
			t.Fatal(err)
		}
		if got := mustRun(t, vm, "hostname"); got != n {
			t.Errorf("%s: hostname %q", n, got)
		}
	}
	checkState(t, env, expectState{VMs: append([]string{"w"}, running...), RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
	if _, err := e2.LoadCheckpoint(ctx, "ck"); err != nil {
		t.Fatalf("checkpoint after engine crash: %v", err)
	}
	nf, err := e2.Fork(ctx, "ck", &engine.ForkOptions{Name: "n1"})
	if err != nil {
		t.Fatalf("fork after engine crash: %v", err)
	}
	if got := mustRun(t, nf, "hostname"); got != "n1" {
		t.Fatalf("n1 hostname %q", got)
	}
	deleteAll(t, env)
}

// ---------------------------------------------------------------------------------------
// 3. QEMU dies while a fork restores

func TestRobustQEMUDiesDuringFork(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	// Two moments: as soon as the fork's QEMU process exists (start-up / QMP connect),
	// and while QEMU holds the checkpoint's device state file open (migrate-incoming was
	// sent and the device state is loading).
	phases := []struct {
		name string
		at   func(name string) bool
	}{
		{"at spawn", func(string) bool { return true }},
		{"during incoming migration", func(name string) bool {
			return hasOpenFile(qemuPIDOf(env.Home, name), filepath.Join(env.Home, "checkpoints", "ck", "state.mig"))
		}},
	}
	n := 0
	for _, ph := range phases {
		t.Run(ph.name, func(t *testing.T) {
			for attempt := 0; attempt < 5; attempt++ {
				n++
				name := fmt.Sprintf("r%d", n)
				type res struct {
					vm  *engine.VM
					err error
				}
				done := make(chan res, 1)
				go func() {
					vm, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: name})
					done <- res{vm, err}
				}()
				var r res
				killedPID := 0
			poll:
				for {
					select {
					case r = <-done:
						break poll
					default:
					}
					if killedPID == 0 {
						if pid := qemuPIDOf(env.Home, name); pid > 0 && ph.at(name) {
							syscall.Kill(pid, syscall.SIGKILL)
							killedPID = pid
						}
					}
					time.Sleep(time.Millisecond)
				}
				if r.err == nil {
					t.Logf("attempt %d: fork %s won the race (ready before the kill); retrying", attempt, name)
					if err := e.Delete(ctx, name); err != nil {
						t.Fatal(err)
					}
					continue
				}
				if killedPID == 0 {
					t.Fatalf("fork %s failed before its qemu was seen: %v", name, r.err)
				}
				t.Logf("fork %s: %v", name, r.err)
				wantErr(t, r.err, engine.ErrQEMUExited)
				var qe *engine.QEMUError
				if !errors.As(r.err, &qe) {
					t.Fatalf("error is not a *QEMUError: %v", r.err)
				}
				assertGone(t, env, name, killedPID)
				if b := e.Budget(); ownUsed(b) != 1 {
					t.Errorf("Budget.Used = %d after a failed fork, want 1 (the world)", ownUsed(b))
				}
				checkState(t, env, expectState{VMs: []string{"w"}, RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
				return
			}
			t.Fatal("the fork won the race 5 times in a row")
		})
	}
	// The checkpoint is unharmed.
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "ok"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, f, "hostname"); got != "ok" {
		t.Fatalf("hostname %q", got)
	}
	deleteAll(t, env)
}

// ---------------------------------------------------------------------------------------
// 4. the agent never answers in a fork

// TestRobustForkAgentNeverAnswers freezes the world's agent (PID 1) with the guest
// kernel's cgroup v2 freezer before the checkpoint: QEMU and the guest kernel run
// normally in every fork, but the agent never reads the host's Hello, so each fork
// must fail with ErrAgentTimeout after ForkTimeout and be removed.
func TestRobustForkAgentNeverAnswers(t *testing.T) {
	room := parallelVMTest(t) // mostly waits on agents that never answer
	env := newRobustEnv(t, func(c *engine.Config) { room(c); c.ForkTimeout = 3 * time.Second })
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	w := makeWorld(t, e, "w", 256, 0)
	if out, errs, code := run(t, w, "mkdir -p /sys/fs/cgroup; mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null; "+
		"mkdir -p /sys/fs/cgroup/fz && echo 1 > /sys/fs/cgroup/fz/cgroup.procs && test -e /sys/fs/cgroup/fz/cgroup.freeze"); code != 0 {
		t.Skipf("guest kernel has no usable cgroup v2 freezer: %s%s", out, errs)
	}
	// PID 1 is now in cgroup fz; freeze it a second after this exec returned.
	mustRun(t, w, `setsid sh -c "sleep 1; echo 1 > /sys/fs/cgroup/fz/cgroup.freeze" </dev/null >/dev/null 2>&1 & echo started`)
	// Wait for the freeze: execs answer until it lands (each probe is bounded).
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := w.Exec(pctx, &vsockd.ExecRequest{Argv: []string{"true"}})
		cancel()
		if err != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	pctx, cancel := context.WithTimeout(ctx, 4*time.Second)
	_, err := w.Exec(pctx, &vsockd.ExecRequest{Argv: []string{"true"}})
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the world's agent still answers after the freeze: %v", err)
	}
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint of a world with a frozen agent: %v", err)
	}

	_, err = e.Fork(ctx, "ck", &engine.ForkOptions{Name: "nf"})
	t.Logf("fork: %v", err)
	wantErr(t, err, engine.ErrAgentTimeout)
	if errors.Is(err, engine.ErrQEMUExited) {
		t.Fatalf("agent timeout reported as a QEMU exit: %v", err)
	}
	assertGone(t, env, "nf", 0)

	evs, err := e.ForkMany(ctx, "ck", 2, &engine.ManyOptions{Prefix: "m"})
	if err != nil {
		t.Fatal(err)
	}
	for ev := range evs {
		if ev.Err == nil {
			t.Errorf("fork %s of a frozen agent became ready", ev.Name)
			continue
		}
		if !errors.Is(ev.Err, engine.ErrAgentTimeout) {
			t.Errorf("fork %s: %v, want ErrAgentTimeout", ev.Name, ev.Err)
		}
		assertGone(t, env, ev.Name, 0)
	}
	if b := e.Budget(); ownUsed(b) != 1 {
		t.Errorf("Budget.Used = %d after failed forks, want 1", ownUsed(b))
	}
	checkState(t, env, expectState{VMs: []string{"w"}, RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
	deleteAll(t, env)
}

// ---------------------------------------------------------------------------------------
// 5. the world dies during a checkpoint

func TestRobustWorldDiesDuringCheckpoint(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 6*time.Minute)

	// checkpointAndKill starts Checkpoint(world, ck) and SIGKILLs the world's QEMU as
	// soon as trigger reports the checkpoint reached the phase under test.
	checkpointAndKill := func(t *testing.T, world *engine.VM, ck string, trigger func() bool) (*engine.Checkpoint, error, bool) {
		pid := world.PID()
		type res struct {
			c   *engine.Checkpoint
			err error
		}
		done := make(chan res, 1)
		go func() {
			c, err := e.Checkpoint(ctx, world.Name(), ck, nil)
			done <- res{c, err}
		}()
		killed := false
		for {
			select {
			case r := <-done:
				return r.c, r.err, killed
			default:
			}
			if !killed && trigger() {
				syscall.Kill(pid, syscall.SIGKILL)
				killed = true
			}
			time.Sleep(500 * time.Microsecond)
		}
	}
	hasEntry := func(dir, prefix string) func() bool {
		return func() bool {
			for _, n := range dirNames(dir) {
				if strings.HasPrefix(n, prefix) {
					return true
				}
			}
			return false
		}
	}
	afterFailure := func(t *testing.T, world, ck string, err error) {
		t.Helper()
		t.Logf("checkpoint: %v", err)
		// The documented contract: a QEMU that exited is reported with ErrQEMUExited
		// (a *QEMUError carrying its stderr), so callers can tell "the world died" from
		// a refused or failed checkpoint of a live world.
		if !errors.Is(err, engine.ErrQEMUExited) {
			t.Errorf("checkpoint of a world that died: %v; want an error wrapping ErrQEMUExited", err)
		}
		if _, lerr := e.LoadCheckpoint(ctx, ck); !errors.Is(lerr, engine.ErrNotFound) {
			t.Errorf("LoadCheckpoint after a failed checkpoint: %v", lerr)
		}
		// Nothing of the checkpoint is left: no dir, no .tmp-*, no RAM file or temp.
		checkState(t, env, expectState{VMs: []string{world}, Dead: []string{world}, RAM: []string{"vm-" + world + ".ram"}})
	}
	reapWorld := func(t *testing.T, world string, cks []string) {
		t.Helper()
		if dead := e.Reap(ctx); !slices.Equal(dead, []string{world}) {
			t.Fatalf("Reap = %v, want [%s]", dead, world)
		}
		var rams []string
		for _, c := range cks {
			rams = append(rams, "ck-"+c+".ram")
		}
		checkState(t, env, expectState{RAM: rams, CKs: cks})
	}

	t.Run("during migration", func(t *testing.T) {
		for attempt := 1; attempt <= 3; attempt++ {
			wn := fmt.Sprintf("wm%d", attempt)
			world := makeWorld(t, e, wn, 256, 16)
			ck := "cm" + strconv.Itoa(attempt)
			c, err, killed := checkpointAndKill(t, world, ck, hasEntry(filepath.Join(env.Home, "checkpoints"), ".tmp-"+ck+"-"))
			if !killed {
				t.Fatalf("checkpoint finished before the kill: %v", err)
			}
			waitDead(t, world, 30*time.Second)
			if err == nil {
				// The kill landed after the guest was stopped and saved: the checkpoint is
				// consistent. Accept, but this attempt did not test the failure path.
				t.Logf("attempt %d: checkpoint completed before the world died (%v); retrying", attempt, c.Manifest.Timings.Total)
				if _, err := e.LoadCheckpoint(ctx, ck); err != nil {
					t.Fatalf("checkpoint that succeeded does not load: %v", err)
				}
				if err := e.DeleteCheckpoint(ctx, ck, nil); err != nil {
					t.Fatal(err)
				}
				reapWorld(t, wn, nil)
				continue
			}
			afterFailure(t, wn, ck, err)
			reapWorld(t, wn, nil)
			return
		}
		t.Fatal("the checkpoint completed before the kill 3 times")
	})

	t.Run("during RAM freeze", func(t *testing.T) {
		world := makeWorld(t, e, "wf", 512, 0)
		// ~200 MB of dirty guest RAM so that the freeze (the copy of the RAM file) takes
		// a while.
		mustRun(t, world, "head -c 1048576 /dev/urandom > /dev/shm/seed && for i in $(seq 200); do cat /dev/shm/seed; done > /dev/shm/dirty && sync")
		c, err, killed := checkpointAndKill(t, world, "cf", hasEntry(e.Config().RAMDir, ".ck-cf.ram"))
		if !killed {
			t.Fatalf("checkpoint finished before the kill (freeze never observed): %v", err)
		}
		waitDead(t, world, 30*time.Second)
		if err != nil {
			afterFailure(t, "wf", "cf", err)
			reapWorld(t, "wf", nil)
			return
		}
		// The guest was stopped and its device state saved before the freeze started,
		// and a killed QEMU writes no more RAM: such a checkpoint is consistent, so
		// success is acceptable — but only if it really restores.
		t.Logf("checkpoint completed although the world died during the freeze (%v)", c.Manifest.Timings.Total)
		reapWorld(t, "wf", []string{"cf"})
		f, err := e.Fork(ctx, "cf", &engine.ForkOptions{Name: "ff"})
		if err != nil {
			t.Fatalf("fork of the checkpoint whose world died during the freeze: %v", err)
		}
		if got := mustRun(t, f, "wc -c < /dev/shm/dirty"); got != strconv.Itoa(200<<20) {
			t.Fatalf("fork sees /dev/shm/dirty of %s bytes", got)
		}
	})
	deleteAll(t, env)
}

// ---------------------------------------------------------------------------------------
// 6. a small soak

func TestRobustSoak(t *testing.T) {
	env := newRobustEnv(t, nil) // not parallel: it counts the test process's open fds
	e := env.E
	ctx := ctxT(t, 6*time.Minute)
	w := makeWorld(t, e, "w", 256, 16)
	mustRun(t, w, "true")
	if _, err := e.Checkpoint(ctx, "w", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	wave := func(base, n int) (fails int) {
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("s%d", base+i)
		}
		evs, err := e.ForkMany(ctx, "ck", n, &engine.ManyOptions{Names: names, Concurrency: 8})
		if err != nil {
			t.Fatal(err)
		}
		var made []string
		for ev := range evs {
			if ev.Err != nil {
				t.Errorf("fork %s: %v", ev.Name, ev.Err)
				fails++
				continue
			}
			made = append(made, ev.Name)
			code, err := ev.VM.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "true"}})
			if err != nil || code != 0 {
				t.Errorf("exec in %s: %d %v", ev.Name, code, err)
				fails++
			}
		}
		for _, n := range made {
			if err := e.Delete(ctx, n); err != nil {
				t.Errorf("delete %s: %v", n, err)
				fails++
			}
		}
		return fails
	}
	// Warm-up: lazily opened descriptors and the checkpoint's "forked" marker.
	wave(0, 1)
	fds0 := settledFDs(-1)
	procs0 := procsReferencing(env.Home, e.Config().RAMDir)
	files0 := treeSnapshot(env.Home, e.Config().RAMDir)
	const waves = 3 // of 8 forks: a descriptor, process or file left per fork shows 24 times
	fails := 0
	for i := 0; i < waves; i++ {
		fails += wave(100+i*8, 8)
	}
	fds1 := settledFDs(fds0)
	procs1 := procsReferencing(env.Home, e.Config().RAMDir)
	files1 := treeSnapshot(env.Home, e.Config().RAMDir)
	t.Logf("fds %d -> %d, processes %d -> %d, files %d -> %d, failures %d", fds0, fds1, len(procs0), len(procs1), len(files0), len(files1), fails)
	if fails != 0 {
		t.Errorf("%d failures in %d forks", fails, waves*8)
	}
	if fds1 != fds0 {
		t.Errorf("open fds of the test process: %d before, %d after %d forks", fds0, fds1, waves*8)
	}
	if len(procs1) != len(procs0) {
		t.Errorf("processes of the state dir: %v before, %v after", procs0, procs1)
	}
	if a, b := diffLists(files0, files1); len(a)+len(b) > 0 {
		t.Errorf("files changed over the soak: gone %v, new %v", a, b)
	}
	checkState(t, env, expectState{VMs: []string{"w"}, RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
	deleteAll(t, env)
}

// ---------------------------------------------------------------------------------------
// 2b. the engine dies between spawning QEMU and recording its pid

// TestRobustCrashBeforePIDRecorded reproduces the on-disk state an engine leaves when it
// dies inside VM.start between the two manifest writes: the manifest says "starting"
// with pid 0 while the QEMU it just spawned (with Setsid, so it outlives the engine)
// runs. A new engine reaps the half-made VM; it must not leave that QEMU running with
// its files deleted (an orphan nobody can see or delete any more).
func TestRobustCrashBeforePIDRecorded(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	ctx := ctxT(t, 4*time.Minute)
	makePinnedWorld(t, env.E, 256, 0)
	x, err := env.E.Fork(ctx, "ck", &engine.ForkOptions{Name: "x"})
	if err != nil {
		t.Fatal(err)
	}
	pid := x.PID()
	env.E.Close()
	// The manifest as start() writes it before cmd.Start: state starting, no pid yet.
	mp := filepath.Join(env.Home, "vms", "x", "manifest.json")
	b, err := os.ReadFile(mp)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	m["state"], m["pid"], m["start_time"] = engine.StateStarting, 0, 0
	delete(m, "ready_at")
	b, _ = json.Marshal(m)
	if err := os.WriteFile(mp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	e2, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e2
	if _, err := e2.Get("x"); !errors.Is(err, engine.ErrNotFound) {
		t.Fatalf("half-made x after restart: %v", err)
	}
	// Give a kill time to land.
	if !waitExited(pid, 5*time.Second) {
		t.Errorf("the half-made fork's QEMU (pid %d) still runs after the new engine reaped its files: an invisible orphan", pid)
	}
	assertGone(t, env, "x", 0)
	checkState(t, env, expectState{VMs: []string{"w"}, RAM: []string{"vm-w.ram", "ck-ck.ram"}, CKs: []string{"ck"}})
	syscall.Kill(pid, syscall.SIGKILL)
	deleteAll(t, env)
}

// startEngineHelper starts the engine helper binary on env's state directory with
// args; it returns the process, a scanner of its stdout and its stderr.
func startEngineHelper(t *testing.T, helper string, env *testEnv, args ...string) (*exec.Cmd, *bufio.Scanner, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(helper, append([]string{"-state", env.Home, "-cache", cacheDir, "-kernel", imageInfo.Kernel,
		"-initrd", imageInfo.Initrd}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// A helper that hangs fails the test instead of holding it until go test's timeout,
	// and says where (its goroutines, which SIGQUIT writes to its stderr).
	hung := time.AfterFunc(helperLimit, func() {
		if cmd.Process.Signal(syscall.SIGQUIT) == nil { // not yet waited for
			t.Errorf("engine helper %v ran past %v: sent SIGQUIT (its goroutines end its stderr)", args, helperLimit)
		}
	})
	t.Cleanup(func() { hung.Stop() })
	return cmd, bufio.NewScanner(stdout), &stderr
}

// helperLimit bounds one engine helper's run (startEngineHelper).
const helperLimit = 4 * time.Minute

// TestRobustKillEngineMidCheckpoint kills an engine (SIGKILL) while it checkpoints a
// world with a disk and a fork of it in turn (copy and delta checkpoints), at a different
// moment each round, then opens a new engine: both VMs run (a guest a checkpoint left
// stopped is resumed), their disk chains are the ones QEMU writes (an overlay a
// cut-short freeze switched to is adopted, one it only prepared is removed), no partial
// checkpoint is left, and both can be checkpointed and forked with their data.
func TestRobustKillEngineMidCheckpoint(t *testing.T) {
	par := parallelVMTest(t)
	helper := engineHelper(t)
	env := newRobustEnv(t, func(c *engine.Config) { c.LockWait = 10 * time.Second; par(c) })
	env.E.Close()
	cut := 0
	delays := []time.Duration{0, 30 * time.Millisecond, 70 * time.Millisecond, 120 * time.Millisecond, 180 * time.Millisecond, 260 * time.Millisecond}
	for round, delay := range delays {
		cmd, sc, stderr := startEngineHelper(t, helper, env, "-ckloop")
		pid := cmd.Process.Pid
		// Kill after 2 or 3 checkpoints: the next one is of w or of fw.
		cks := 0
		for cks < 2+round%2 && sc.Scan() {
			switch l := sc.Text(); {
			case strings.HasPrefix(l, "CK "):
				cks++
			case strings.HasPrefix(l, "ERROR"):
				t.Fatalf("round %d: helper: %s\n%s", round, l, stderr.String())
			}
		}
		if cks < 2+round%2 {
			syscall.Kill(pid, syscall.SIGKILL)
			cmd.Wait()
			t.Fatalf("round %d: helper ended: %s", round, stderr.String())
		}
		time.Sleep(delay)
		syscall.Kill(pid, syscall.SIGKILL)
		cmd.Wait()
		for _, vm := range []string{"w", "fw"} {
			if _, err := os.Stat(filepath.Join(env.Home, "vms", vm, "checkpointing")); err == nil {
				cut++
			}
		}

		e2, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		env.E = e2
		ctx := ctxT(t, 3*time.Minute)
		for _, n := range dirNames(filepath.Join(env.Home, "checkpoints")) {
			if strings.Contains(n, ".tmp") {
				t.Errorf("round %d: half-written checkpoint left: %s", round, n)
			}
		}
		for _, name := range []string{"w", "fw"} {
			vm, err := e2.Get(name)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(env.Home, "vms", name, "checkpointing")); err == nil {
				t.Errorf("round %d: %s's checkpointing marker is still there", round, name)
			}
			// A guest left stopped would not answer: bound the exec.
			ectx, cancel := context.WithTimeout(ctx, 45*time.Second)
			var out bytes.Buffer
			want := fmt.Sprintf("%s-r%d", name, round)
			code, err := vm.Exec(ectx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "echo " + want + " > /data/r && sync && cat /data/r"}, Stdout: &out})
			cancel()
			if err != nil || code != 0 || out.String() != want+"\n" {
				t.Fatalf("round %d: %s after the engine died mid-checkpoint: %q %d %v", round, name, out.String(), code, err)
			}
			v := fmt.Sprintf("v%d-%s", round, name)
			if _, err := e2.Checkpoint(ctx, name, v, &engine.CheckpointOptions{Pin: true}); err != nil {
				t.Fatalf("round %d: checkpoint of %s after the crash: %v", round, name, err)
			}
			f, err := e2.Fork(ctx, v, &engine.ForkOptions{Name: "f"})
			if err != nil {
				t.Fatalf("round %d: fork of %s after the crash: %v", round, v, err)
			}
			if got := mustRun(t, f, "cat /data/r"); got != want {
				t.Errorf("round %d: the fork of %s reads %q from its disk", round, v, got)
			}
			if err := e2.Delete(ctx, "f"); err != nil {
				t.Fatal(err)
			}
			if err := e2.DeleteCheckpoint(ctx, v, nil); err != nil {
				t.Fatal(err)
			}
		}
		e2.Close()
	}
	t.Logf("%d of %d kills landed between a checkpoint's disk freeze and its resume", cut, len(delays))
	e3, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e3
	deleteAll(t, env)
}

// TestRobustKillEngineMidHandoff kills an engine (SIGKILL) at a different moment of a
// handoff checkpoint each round (the VM's RAM file becomes the checkpoint's and the VM
// restarts as its fork), several in the first 40 ms where the commit lands, then opens
// a new engine: no partial checkpoint is left, and the VM runs again under its own name
// with its data, whether the handoff was not committed (the old QEMU resumed), committed
// but not finished (recovery restarts the VM from the checkpoint) or finished. A
// committed checkpoint forks with the VM's data and is never written to by the VM.
func TestRobustKillEngineMidHandoff(t *testing.T) {
	par := parallelVMTest(t)
	helper := engineHelper(t)
	env := newRobustEnv(t, func(c *engine.Config) { c.LockWait = 10 * time.Second; par(c) })
	env.E.Close()
	outcomes := map[string]int{}
	for round, delay := range []time.Duration{0, 10 * time.Millisecond, 20 * time.Millisecond, 30 * time.Millisecond, 40 * time.Millisecond, 90 * time.Millisecond, 400 * time.Millisecond} {
		name := fmt.Sprintf("h%d", round)
		cmd, sc, stderr := startEngineHelper(t, helper, env, "-handoff", name)
		ready := false
		for !ready && sc.Scan() {
			if l := sc.Text(); l == "READY" {
				ready = true
			} else if strings.HasPrefix(l, "ERROR") {
				t.Fatalf("round %d: helper: %s\n%s", round, l, stderr.String())
			}
		}
		if !ready {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("round %d: helper ended: %s", round, stderr.String())
		}
		time.Sleep(delay)
		cmd.Process.Kill()
		cmd.Wait()

		e2, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		env.E = e2
		ctx := ctxT(t, 3*time.Minute)
		for _, n := range dirNames(filepath.Join(env.Home, "checkpoints")) {
			if strings.Contains(n, ".tmp") {
				t.Errorf("round %d: half-written checkpoint left: %s", round, n)
			}
		}
		if _, err := os.Stat(filepath.Join(env.Home, "vms", name, "checkpointing")); err == nil {
			t.Errorf("round %d: the checkpointing marker is still there", round)
		}
		vm, err := e2.Get(name)
		if err != nil {
			t.Fatalf("round %d: the VM is gone: %v", round, err)
		}
		_, ckErr := e2.LoadCheckpoint(ctx, name+"-ck")
		state := vm.Info().State
		if state != engine.StateRunning {
			t.Fatalf("round %d (kill after %v): the VM is %s after recovery (checkpoint committed: %v)", round, delay, state, ckErr == nil)
		}
		ectx, cancel := context.WithTimeout(ctx, 45*time.Second)
		var out bytes.Buffer
		code, err := vm.Exec(ectx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "cat /data/m && echo after > /data/n && sync"}, Stdout: &out})
		cancel()
		if err != nil || code != 0 || out.String() != name+"\n" {
			t.Fatalf("round %d: running VM after the crash: %q %d %v", round, out.String(), code, err)
		}
		if ckErr == nil && vm.Info().Parent != name+"-ck" {
			t.Errorf("round %d: the VM runs after a committed handoff but its parent is %q", round, vm.Info().Parent)
		}
		outcome := fmt.Sprintf("vm %s, checkpoint %v", state, ckErr == nil)
		outcomes[outcome]++
		if ckErr == nil {
			f, err := e2.Fork(ctx, name+"-ck", &engine.ForkOptions{Name: "f"})
			if err != nil {
				t.Fatalf("round %d (%s): fork of the checkpoint: %v", round, outcome, err)
			}
			if got := mustRun(t, f, "cat /data/m; cat /data/n 2>/dev/null; true"); got != name {
				t.Errorf("round %d (%s): the fork reads %q (the VM's later write must not reach its checkpoint)", round, outcome, got)
			}
			if err := e2.Delete(ctx, "f"); err != nil {
				t.Fatal(err)
			}
		}
		if err := e2.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
		if ckErr == nil {
			if err := e2.DeleteCheckpoint(ctx, name+"-ck", nil); err != nil {
				t.Fatal(err)
			}
		}
		e2.Close()
	}
	t.Logf("outcomes: %v", outcomes)
	e3, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e3
	deleteAll(t, env)
}
