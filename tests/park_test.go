package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/internal/guestscript"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/serve/client"
	"github.com/forkvm/forkvm/vsockd"
)

// parkIdentity is what a VM must still be after a wake: the agent token, the hostname,
// a background process's PID and a value only its memory holds, and a published port
// serving from guest memory.
type parkIdentity struct {
	token, hostname, pid, served string
}

// startParkProbe starts, in vm, a background process that keeps secret in a shell
// variable and writes it to /tmp/said when sent SIGUSR1, and an httpd serving page from
// guest memory on guest port 8080. It returns the process's PID.
func startParkProbe(t *testing.T, vm *engine.VM, secret, page string) string {
	t.Helper()
	return mustRun(t, vm, parkProbeScript(secret, page))
}

// parkProbeScript is startParkProbe's script.
func parkProbeScript(secret, page string) string {
	return "mkdir -p /dev/shm/www && echo " + page + " > /dev/shm/www/index.html && " +
		"(setsid httpd -f -p 8080 -h /dev/shm/www </dev/null >/dev/null 2>&1 &) && " +
		guestscript.TrappedProcess(secret)
}

// probeIdentity reads vm's identity (see parkIdentity); port is its published port.
func probeIdentity(t *testing.T, vm *engine.VM, pid string, port int) parkIdentity {
	t.Helper()
	said := mustRun(t, vm, "rm -f /tmp/said; kill -USR1 "+pid+" && for i in $(seq 50); do [ -s /tmp/said ] && break; sleep 0.1; done; cat /tmp/said")
	return parkIdentity{token: vm.Target().Token, hostname: mustRun(t, vm, "hostname"), pid: pid + ":" + said,
		served: httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", port))}
}

// TestParkWakeIdentity: a fork parked and woken is itself again: same token, hostname,
// a background process with its PID and its memory, a published port serving; while
// parked it holds no QEMU, its image is on disk (not in RAMDir) and listed in Info,
// exec says it is parked, and it can be parked and woken again. A world
// parks through a handoff and wakes the same way.
func TestParkWakeIdentity(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 8*time.Minute)
	pw, pf := freePort(t), freePort(t)
	w := netWorld(t, e, "pw", []engine.PortForward{{HostPort: pw, GuestPort: 8080}})
	if _, err := e.Checkpoint(ctx, "pw", "pwck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	f, err := e.Fork(ctx, "pwck", &engine.ForkOptions{Name: "pf", Publish: []engine.PortForward{{HostPort: pf, GuestPort: 8080}}})
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	pid := startParkProbe(t, f, "secret-of-pf", "served-by-pf")
	mustRun(t, f, "head -c 4000000 /dev/urandom > /dev/shm/blob && md5sum /dev/shm/blob > /tmp/blob.md5")
	before := probeIdentity(t, f, pid, pf)
	if before.served != "served-by-pf\n" || !strings.HasSuffix(before.pid, ":secret-of-pf") || before.hostname != "pf" {
		t.Fatalf("before park: %+v", before)
	}
	qpid := f.PID()

	for round := 1; round <= 2; round++ {
		res, err := e.Park(ctx, "pf")
		if err != nil {
			t.Fatalf("park %d: %v", round, err)
		}
		t.Logf("park %d: %d bytes, paused %v, total %v, freed %d", round, res.Bytes, res.Paused, res.Total, res.FreedBytes)
		if res.Bytes < 4000000 {
			t.Errorf("parked image holds %d bytes, less than the 4 MB the fork wrote", res.Bytes)
		}
		if !waitExited(qpid, 10*time.Second) {
			t.Fatalf("park %d: qemu %d still runs", round, qpid)
		}
		info := f.Info()
		if info.State != engine.StateParked || info.Parked == nil || info.Parked.Bytes != res.Bytes {
			t.Fatalf("parked info: state %s parked %+v", info.State, info.Parked)
		}
		image := filepath.Join(env.Home, "vms", "pf", "park")
		if _, err := os.Stat(filepath.Join(image, "ram.layer")); err != nil {
			t.Fatalf("park image: %v", err)
		}
		if again, err := e.Park(ctx, "pf"); err != nil || !again.Already {
			t.Errorf("parking a parked vm: %+v, %v", again, err)
		}
		_, _, err = runErr(f, "true")
		wantErr(t, err, engine.ErrParked)
		if portFree(pf) != true {
			t.Errorf("published port %d still bound while parked", pf)
		}
		if round == 1 {
			// Its port taken meanwhile: the wake is refused and the VM stays parked.
			taken, err := net.Listen("tcp4", fmt.Sprintf("127.0.0.1:%d", pf))
			if err != nil {
				t.Fatal(err)
			}
			_, err = e.Wake(ctx, "pf", nil)
			taken.Close()
			wantErr(t, err, engine.ErrPortInUse)
			if st := f.Info().State; st != engine.StateParked {
				t.Fatalf("after a wake refused for its port: %s", st)
			}
		}

		wr, err := e.Wake(ctx, "pf", nil)
		if err != nil {
			t.Fatalf("wake %d: %v", round, err)
		}
		t.Logf("wake %d: %v", round, wr.Latency)
		if _, err := os.Stat(image); !os.IsNotExist(err) {
			t.Errorf("park image still there after wake: %v", err)
		}
		after := probeIdentity(t, f, pid, pf)
		if after != before {
			t.Fatalf("after wake %d: %+v, want %+v", round, after, before)
		}
		if got := mustRun(t, f, "md5sum -c /tmp/blob.md5 >/dev/null && echo ok"); got != "ok" {
			t.Errorf("blob after wake: %q", got)
		}
		if info := f.Info(); info.State != engine.StateRunning || info.Parked != nil {
			t.Errorf("woken info: %s %+v", info.State, info.Parked)
		}
		if again, err := e.Wake(ctx, "pf", nil); err != nil || !again.Already {
			t.Errorf("waking a running vm: %+v, %v", again, err)
		}
		qpid = f.PID()
		// The guest's clock was set on wake.
		gt := mustRun(t, f, "date +%s")
		if n, _ := strconv.ParseInt(gt, 10, 64); n < time.Now().Unix()-5 {
			t.Errorf("guest clock %s, host %d", gt, time.Now().Unix())
		}
	}

	// A world parks through a handoff checkpoint and wakes as itself.
	wpid := startParkProbe(t, w, "secret-of-pw", "served-by-pw")
	wbefore := probeIdentity(t, w, wpid, pw)
	res, err := e.Park(ctx, "pw")
	if err != nil {
		t.Fatalf("park world: %v", err)
	}
	if res.Handoff == "" {
		t.Errorf("world parked without a handoff: %+v", res)
	}
	if _, err := e.Wake(ctx, "pw", nil); err != nil {
		t.Fatalf("wake world: %v", err)
	}
	if got := probeIdentity(t, w, wpid, pw); got != wbefore {
		t.Errorf("world after wake: %+v, want %+v", got, wbefore)
	}

	// A parked VM is deleted like any other.
	if _, err := e.Park(ctx, "pf"); err != nil {
		t.Fatalf("park for rm: %v", err)
	}
	if err := e.Delete(ctx, "pf"); err != nil {
		t.Fatalf("delete parked: %v", err)
	}
	if _, err := os.Stat(filepath.Join(env.Home, "vms", "pf")); !os.IsNotExist(err) {
		t.Errorf("parked vm's directory after delete: %v", err)
	}
	deleteAll(t, env)
}

// runErr runs a shell script in vm and returns its stdout, exit code and error.
func runErr(vm *engine.VM, script string) (string, int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out})
	return out.String(), code, err
}

// TestParkKillAtEveryStage kills, at each stage of a park and of a wake (the engine's
// stage markers), the engine (SIGKILL of the process that embeds it) or the VM's QEMU,
// then opens a new engine: the VM is running or parked, never both and never neither,
// and once woken it is itself (a background process with its PID and its memory, the
// data it kept in guest RAM). The two cases that end as dead are crashes of a running
// VM, not of a park: QEMU killed while its memory is still being saved (the memory is
// gone), and QEMU killed after a wake finished (the woken VM crashed).
func TestParkKillAtEveryStage(t *testing.T) {
	parallelVMTest(t)
	helper := engineHelper(t)
	// Roomy: admission counts every QEMU on the host, and the helper's is as roomy.
	env := newRobustEnv(t, func(c *engine.Config) { c.LockWait = 10 * time.Second; roomy(c) })
	env.E.Close()
	cases := []struct {
		op, stage, who string
		want           engine.State
	}{
		{"park", engine.ParkStageSave, "engine", engine.StateRunning},
		{"park", engine.ParkStageCommit, "engine", engine.StateRunning},
		{"park", engine.ParkStageSync, "engine", engine.StateParked},
		{"park", engine.ParkStageRecord, "engine", engine.StateParked},
		{"park", engine.ParkStageKill, "engine", engine.StateParked},
		{"wake", engine.WakeStageSpawn, "engine", engine.StateParked},
		{"wake", engine.WakeStageLoad, "engine", engine.StateParked},
		{"wake", engine.WakeStageCommit, "engine", engine.StateParked},
		{"wake", engine.WakeStageResume, "engine", engine.StateRunning},
		{"wake", engine.WakeStageCleanup, "engine", engine.StateRunning},
		{"park", engine.ParkStageSave, "qemu", engine.StateDead},
		{"park", engine.ParkStageCommit, "qemu", engine.StateParked},
		{"park", engine.ParkStageSync, "qemu", engine.StateParked},
		{"park", engine.ParkStageRecord, "qemu", engine.StateParked},
		{"park", engine.ParkStageKill, "qemu", engine.StateParked},
		{"wake", engine.WakeStageLoad, "qemu", engine.StateParked},
		{"wake", engine.WakeStageCommit, "qemu", engine.StateParked},
		{"wake", engine.WakeStageResume, "qemu", engine.StateParked},
		{"wake", engine.WakeStageCleanup, "qemu", engine.StateDead},
	}
	for i, c := range cases {
		name := fmt.Sprintf("k%d", i)
		label := fmt.Sprintf("%s %s at %s", c.who, c.op, c.stage)
		cmd, sc, stderr := startEngineHelper(t, helper, env, "-park", name, "-op", c.op, "-killat", c.stage, "-kill", c.who)
		var pid, done string
		for sc.Scan() {
			l := sc.Text()
			switch {
			case strings.HasPrefix(l, "PID "):
				pid = strings.TrimPrefix(l, "PID ")
			case strings.HasPrefix(l, "DONE "):
				done = strings.TrimPrefix(l, "DONE ")
			case strings.HasPrefix(l, "ERROR"):
				t.Fatalf("%s: helper: %s\n%s", label, l, stderr.String())
			}
		}
		werr := cmd.Wait()
		if c.who == "engine" && done != "" {
			t.Fatalf("%s: the engine was not killed (stage never reached): %s", label, done)
		}
		if c.who == "qemu" && done == "" {
			t.Fatalf("%s: helper ended without finishing: %v\n%s", label, werr, stderr.String())
		}
		e, err := engine.New(context.Background(), &env.cfg)
		if err != nil {
			t.Fatalf("%s: reopen: %v", label, err)
		}
		env.E = e
		vm, err := e.Get(name)
		if err != nil {
			t.Fatalf("%s: %v", label, err)
		}
		info := vm.Info()
		t.Logf("%s: helper said %q; recovered %s", label, done, info.State)
		if info.State != c.want {
			t.Errorf("%s: recovered as %s (%s), want %s", label, info.State, info.Reason, c.want)
		}
		image := filepath.Join(env.Home, "vms", name, "park")
		_, ierr := os.Stat(image)
		if (info.State == engine.StateParked) != (ierr == nil) {
			t.Errorf("%s: state %s, park image: %v", label, info.State, ierr)
		}
		if n := len(qemuPIDs(env.Home)); n > 0 && info.State == engine.StateParked {
			// Only the world's QEMU may run: none of a parked VM's.
			if qp := qemuPIDOf(env.Home, name); qp > 0 {
				t.Errorf("%s: parked, but its QEMU %d runs", label, qp)
			}
		}
		if info.State == engine.StateParked {
			if _, err := e.Wake(ctxT(t, 2*time.Minute), name, nil); err != nil {
				t.Fatalf("%s: wake after recovery: %v", label, err)
			}
		}
		if info.State != engine.StateDead {
			said := mustRun(t, vm, "rm -f /tmp/said; kill -USR1 "+pid+" && for i in $(seq 50); do [ -s /tmp/said ] && break; sleep 0.1; done; cat /tmp/said; md5sum -c /tmp/blob.md5 >/dev/null && echo blob-ok")
			if said != name+"\nblob-ok" {
				t.Errorf("%s: after recovery the probe %s says %q", label, pid, said)
			}
		}
		if err := e.Delete(context.Background(), name); err != nil {
			t.Errorf("%s: delete: %v", label, err)
		}
		for _, n := range dirNames(filepath.Join(env.Home, "vms")) {
			if strings.HasPrefix(n, ".corrupt") {
				t.Errorf("%s: vm kept aside: %s", label, n)
			}
		}
		e.Close()
	}
	e, err := engine.New(context.Background(), &env.cfg)
	if err != nil {
		t.Fatal(err)
	}
	env.E = e
	deleteAll(t, env)
}

// TestParkDaemonIdle: a daemon with RunParker parks a VM left idle, never one that
// opted out (NoPark); an exec through the daemon wakes a parked VM transparently (the
// wake's latency in the response's header) and runs in the VM as it was; a connection
// to a parked VM's published port wakes it and is served by it. Each wake's spawn is
// held back for a few of the parker's rounds, which then see the VM parked with its
// ports let go: they must not take them from the waking QEMU.
func TestParkDaemonIdle(t *testing.T) {
	mod := parallelVMTest(t)
	env := newRobustEnv(t, func(c *engine.Config) {
		mod(c)
		c.Markers = slowWakeSpawn{hold: 1500 * time.Millisecond}
	})
	e := env.E
	sock := serve.SocketPath(env.Home)
	ln, err := serve.ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve.New(e, nil)
	sctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serve.Serve(sctx, ln, srv.Handler(), 5*time.Second) }()
	parker := make(chan struct{})
	const idle = 2 * time.Second
	go func() { srv.RunParker(sctx, idle); close(parker) }()
	var once sync.Once
	shutdown := func() {
		once.Do(func() {
			stop()
			<-parker
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
		})
	}
	t.Cleanup(shutdown)
	c := client.New(sock)
	defer c.Close()
	ctx := ctxT(t, 8*time.Minute)

	p1 := freePort(t)
	if _, err := c.Create(ctx, api.Spec{Name: "iw", CPUs: 1, MemoryMiB: 128, Forkable: true, Net: true, NoPark: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Checkpoint(ctx, "iw", "iwck", &api.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Fork(ctx, "iwck", &api.ForkOptions{Name: "keep", NoPark: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Fork(ctx, "iwck", &api.ForkOptions{Name: "i1", Publish: []api.PortForward{{HostPort: p1, GuestPort: 8080}}}); err != nil {
		t.Fatal(err)
	}
	// Through the daemon: a request it serves is use.
	var probe bytes.Buffer
	if code, err := c.Exec(ctx, "i1", &vsockd.ExecRequest{Argv: []string{"sh", "-c", parkProbeScript("secret-of-i1", "served-by-i1")}, Stdout: &probe}); err != nil || code != 0 {
		t.Fatalf("probe: %d %v", code, err)
	}
	pid := strings.TrimSpace(probe.String())
	waitState := func(name string, want engine.State) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			inf, err := c.Get(ctx, name)
			if err == nil && inf.State == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: state %s (%v), want %s", name, inf.State, err, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitState("i1", engine.StateParked)

	// An exec through the daemon wakes it: the raw response carries the wake's latency.
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	resp, err := hc.Post("http://forkvm/v1/vms/i1/exec", "application/json", strings.NewReader(`{"argv":["hostname"]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	resp.Body.Close()
	woke := resp.Header.Get(api.WokeHeader)
	if resp.StatusCode != http.StatusOK || woke == "" {
		t.Fatalf("exec on a parked vm: %s, %s %q: %s", resp.Status, api.WokeHeader, woke, body)
	}
	t.Logf("exec woke i1 in %s", woke)
	var out bytes.Buffer
	if code, err := c.Exec(ctx, "i1", &vsockd.ExecRequest{Argv: []string{"sh", "-c", "kill -USR1 " + pid + " && for i in $(seq 50); do [ -s /tmp/said ] && break; sleep 0.1; done; cat /tmp/said"}, Stdout: &out}); err != nil || code != 0 || out.String() != "secret-of-i1\n" {
		t.Fatalf("after the wake: %q %d %v", out.String(), code, err)
	}

	// Parked again once idle (a VM made later, idle as long, too); the VM that opted out
	// keeps running meanwhile.
	if _, err := c.Fork(ctx, "iwck", &api.ForkOptions{Name: "i2"}); err != nil {
		t.Fatal(err)
	}
	waitState("i2", engine.StateParked)
	waitState("i1", engine.StateParked)
	for _, n := range []string{"iw", "keep"} {
		if inf, _ := c.Get(ctx, n); inf.State != engine.StateRunning || !inf.NoPark {
			t.Errorf("%s opted out of parking: %s, no_park %v", n, inf.State, inf.NoPark)
		}
	}

	// A connection to its published port wakes it and is served by it.
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", p1)); got != "served-by-i1\n" {
		t.Errorf("published port of a parked vm serves %q", got)
	}
	if inf, _ := c.Get(ctx, "i1"); inf.State != engine.StateRunning {
		t.Errorf("after the connection i1 is %s", inf.State)
	}
	shutdown()
	deleteAll(t, env)
}

// slowWakeSpawn is a PhaseMarker that holds every wake back for hold before its QEMU
// starts.
type slowWakeSpawn struct{ hold time.Duration }

func (m slowWakeSpawn) PhaseStart(_, phase string) {
	if phase == engine.WakeStageSpawn {
		time.Sleep(m.hold)
	}
}

func (slowWakeSpawn) PhaseEnd(string, string) {}

// TestParkPopulation parks a population of small forks, each holding a value of its own
// in guest memory, then wakes a random sample: each answers with its own value, while
// the parked ones hold no QEMU and no vCPU of the budget (its count of this engine's
// vCPUs is what it was before the first fork). The population is 40 forks of 128 MiB in
// make test, made in waves of 8, each fork writing its value and parking as soon as it
// is ready; FORKVM_PARK_POPULATION sets another size (above the budget's 64 vCPUs:
// 72 and more; forkbench population measures thousands).
func TestParkPopulation(t *testing.T) {
	n := 40
	if v := os.Getenv("FORKVM_PARK_POPULATION"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 2 {
			t.Fatalf("FORKVM_PARK_POPULATION=%q: want a number of at least 2", v)
		}
	}
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 30*time.Minute)
	if _, err := e.Create(ctx, engine.Spec{Name: "popw", CPUs: 1, MemoryMiB: 128, Forkable: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Checkpoint(ctx, "popw", "popck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatal(err)
	}
	usedBefore := ownUsed(e.Budget())
	start := time.Now()
	var parkedBytes atomic.Int64
	// mark writes a fork's own name into its memory and parks it.
	mark := func(vm *engine.VM) error {
		var out bytes.Buffer
		script := "echo " + vm.Name() + " > /dev/shm/me"
		if code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &out}); err != nil || code != 0 {
			return fmt.Errorf("%s: %q: exit %d, %v: %s", vm.Name(), script, code, err, out.String())
		}
		res, err := e.Park(ctx, vm.Name())
		if err != nil {
			return fmt.Errorf("park %s: %w", vm.Name(), err)
		}
		parkedBytes.Add(res.Bytes)
		return nil
	}
	const wave = 8
	for first := 0; first < n; first += wave {
		names := make([]string, min(wave, n-first))
		for j := range names {
			names[j] = fmt.Sprintf("pop%d", first+j)
		}
		ch, err := e.ForkMany(ctx, "popck", len(names), &engine.ManyOptions{Names: names})
		if err != nil {
			t.Fatal(err)
		}
		errs := make(chan error, len(names))
		for ev := range ch {
			if ev.Err != nil {
				errs <- fmt.Errorf("fork %s: %w", ev.Name, ev.Err)
				continue
			}
			go func() { errs <- mark(ev.VM) }()
		}
		for range names {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("%d forks made and parked in %v: %d bytes on disk (%.1f KiB each)", n, time.Since(start).Round(time.Millisecond), parkedBytes.Load(), float64(parkedBytes.Load())/float64(n)/1024)
	if got := e.ParkedBytes(); got != parkedBytes.Load() {
		t.Errorf("ParkedBytes = %d, the parks said %d", got, parkedBytes.Load())
	}
	if used := ownUsed(e.Budget()); used != usedBefore {
		t.Errorf("vCPUs used: %d with %d parked VMs, %d before", used, n, usedBefore)
	}
	if pids := qemuPIDs(env.Home); len(pids) != 1 {
		t.Errorf("%d QEMU processes with %d VMs parked, want only the world's", len(pids), n)
	}
	wakes := max(n/10, 2)
	start = time.Now()
	for _, i := range rand.Perm(n)[:wakes] {
		name := fmt.Sprintf("pop%d", i)
		if _, err := e.Wake(ctx, name, nil); err != nil {
			t.Fatalf("wake %s: %v", name, err)
		}
		vm, _ := e.Get(name)
		if got := mustRun(t, vm, "cat /dev/shm/me"); got != name {
			t.Errorf("%s woke holding %q", name, got)
		}
	}
	t.Logf("%d random wakes, each answering with its own memory, in %v", wakes, time.Since(start).Round(time.Millisecond))
	deleteAll(t, env)
}

// TestParkWakeThenCheckpoint: a fork whose disk has an overlay from an earlier
// checkpoint is parked and woken, then checkpointed again (also by a protection
// point): the woken QEMU names its disk's block nodes afresh, and the checkpoint must
// use those names. A fork of that checkpoint holds what the woken fork wrote to its
// memory and disk before and after the park.
func TestParkWakeThenCheckpoint(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo before > /dev/shm/m && echo before > /data/d && sync")
	if _, err := e.Checkpoint(ctx, "f", "fck1", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint before the park: %v", err)
	}
	if _, err := e.Park(ctx, "f"); err != nil {
		t.Fatalf("park: %v", err)
	}
	if _, err := e.Wake(ctx, "f", nil); err != nil {
		t.Fatalf("wake: %v", err)
	}
	mustRun(t, f, "echo after >> /dev/shm/m && echo after >> /data/d && sync")
	if _, err := e.Checkpoint(ctx, "f", "fck2", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint after the wake: %v", err)
	}
	if _, err := e.Protect(ctx, "f", &engine.ProtectOptions{Every: time.Hour}); err != nil {
		t.Fatalf("protect after the wake: %v", err)
	}
	if p, err := e.ProtectNow(ctx, "f"); err != nil || p.Failures != 0 {
		t.Fatalf("protection point after the wake: %+v, %v", p, err)
	}
	g, err := e.Fork(ctx, "fck2", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatalf("fork of the checkpoint after the wake: %v", err)
	}
	if got := mustRun(t, g, "cat /dev/shm/m /data/d"); got != "before\nafter\nbefore\nafter" {
		t.Errorf("fork of the woken fork's checkpoint holds %q", got)
	}
	deleteAll(t, env)
}

// TestParkedCheckpointFork: a parked fork is checkpointed and forked from its park
// image, without waking: no QEMU starts, it stays parked with its image as it was, and
// the checkpoint's forks hold its memory and its disk as parked. A second checkpoint
// while it is still parked adds no disk layer; after a wake the VM and those forks go
// their own ways (its disk writes reach none of them), and a checkpoint of its next park
// holds what it wrote. A damaged park image is refused (ErrCheckpointCorrupt): no
// checkpoint, nothing removed, the VM still parked.
func TestParkedCheckpointFork(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 6*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo before > /dev/shm/m && echo before > /data/d && sync")
	if _, err := e.Park(ctx, "f"); err != nil {
		t.Fatalf("park: %v", err)
	}
	image := filepath.Join(env.Home, "vms", "f", "park")
	record, err := os.ReadFile(filepath.Join(image, "park.json"))
	if err != nil {
		t.Fatal(err)
	}
	chain := func() int {
		t.Helper()
		var m struct {
			Launch struct {
				Disk []json.RawMessage `json:"disk"`
			} `json:"launch"`
		}
		b, err := os.ReadFile(filepath.Join(env.Home, "vms", "f", "manifest.json"))
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err != nil {
			t.Fatal(err)
		}
		return len(m.Launch.Disk)
	}
	parkedChain := chain()

	ck1, err := e.Checkpoint(ctx, "f", "pk1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		t.Fatalf("checkpoint of the parked fork: %v", err)
	}
	if ck1.Manifest.RAMMethod != "parked" || ck1.Manifest.Source != "f" {
		t.Errorf("checkpoint of the parked fork: ram method %q, source %q", ck1.Manifest.RAMMethod, ck1.Manifest.Source)
	}
	if _, err := e.Checkpoint(ctx, "f", "pk2", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("second checkpoint of the parked fork: %v", err)
	}
	if got := chain(); got != parkedChain+1 {
		t.Errorf("disk chain of the parked fork: %d layers after two checkpoints, %d parked: want one more", got, parkedChain)
	}
	// Forked by name as well: an implicit checkpoint of the parked VM.
	var kids []*engine.VM
	events, err := e.ForkMany(ctx, "f", 2, &engine.ManyOptions{Prefix: "fk"})
	if err != nil {
		t.Fatalf("forks of the parked fork: %v", err)
	}
	for ev := range events {
		if ev.Err != nil {
			t.Fatalf("fork %s of the parked fork: %v", ev.Name, ev.Err)
		}
		kids = append(kids, ev.VM)
	}
	g, err := e.Fork(ctx, "pk1", &engine.ForkOptions{Name: "g"})
	if err != nil {
		t.Fatalf("fork of the parked fork's checkpoint: %v", err)
	}
	for _, k := range append(kids, g) {
		if got := mustRun(t, k, "cat /dev/shm/m /data/d"); got != "before\nbefore" {
			t.Errorf("%s (of the parked fork) holds %q", k.Name(), got)
		}
	}
	if info := f.Info(); info.State != engine.StateParked || info.PID != 0 {
		t.Fatalf("the fork after its checkpoints: state %s, pid %d: want parked, no QEMU", info.State, info.PID)
	}
	if b, err := os.ReadFile(filepath.Join(image, "park.json")); err != nil || !bytes.Equal(b, record) {
		t.Errorf("park record changed by the checkpoints (%v)", err)
	}

	mustRun(t, g, "echo g > /dev/shm/m && echo g > /data/d && sync")
	if _, err := e.Wake(ctx, "f", nil); err != nil {
		t.Fatalf("wake after the checkpoints: %v", err)
	}
	if got := mustRun(t, f, "cat /dev/shm/m /data/d; echo after > /dev/shm/m; echo after > /data/d; sync"); got != "before\nbefore" {
		t.Errorf("the woken fork holds %q", got)
	}
	if got := mustRun(t, g, "cat /dev/shm/m /data/d"); got != "g\ng" {
		t.Errorf("g after the parked fork woke and wrote: %q", got)
	}
	h, err := e.Fork(ctx, "pk2", &engine.ForkOptions{Name: "h"})
	if err != nil {
		t.Fatalf("fork of the second checkpoint after the wake: %v", err)
	}
	if got := mustRun(t, h, "cat /dev/shm/m /data/d"); got != "before\nbefore" {
		t.Errorf("fork of the second checkpoint, after the fork woke and wrote: %q", got)
	}

	// Parked again after writing its disk: a checkpoint freezes what it wrote.
	if _, err := e.Park(ctx, "f"); err != nil {
		t.Fatalf("second park: %v", err)
	}
	if _, err := e.Checkpoint(ctx, "f", "pk3", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint of the second park: %v", err)
	}
	k, err := e.Fork(ctx, "pk3", &engine.ForkOptions{Name: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, k, "cat /dev/shm/m /data/d"); got != "after\nafter" {
		t.Errorf("fork of the second park's checkpoint holds %q", got)
	}

	// A damaged image: refused, kept, still parked.
	state := filepath.Join(image, "state.mig")
	b, err := os.ReadFile(state)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 0xff
	if err := os.WriteFile(state, b, 0o600); err != nil {
		t.Fatal(err)
	}
	entries := func() []string {
		t.Helper()
		var names []string
		for _, dir := range []string{filepath.Join(env.Home, "checkpoints"), e.Config().RAMDir} {
			ents, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			for _, ent := range ents {
				names = append(names, ent.Name())
			}
		}
		return names
	}
	had := entries()
	_, err = e.Checkpoint(ctx, "f", "bad", nil)
	wantErr(t, err, engine.ErrCheckpointCorrupt)
	_, err = e.Fork(ctx, "f", &engine.ForkOptions{Name: "bad2"})
	wantErr(t, err, engine.ErrCheckpointCorrupt)
	if st := f.Info().State; st != engine.StateParked {
		t.Errorf("after a refused checkpoint: %s, want parked", st)
	}
	if _, err := os.Stat(state); err != nil {
		t.Errorf("damaged park image removed: %v", err)
	}
	if got := entries(); !slices.Equal(got, had) {
		t.Errorf("checkpoint and RAM directories after the refused checkpoints: %v, before %v", got, had)
	}
	deleteAll(t, env)
}

// blockManifestAt is a PhaseMarker that, when a park or wake of vm reaches one of
// stages, puts a directory where its manifest is, so that writing the manifest fails
// (as on a full disk) at that transition's commit.
type blockManifestAt struct {
	home, vm string
	mu       sync.Mutex
	stages   map[string]bool // each blocks once
}

func (m *blockManifestAt) PhaseStart(owner, phase string) {
	m.mu.Lock()
	block := owner == m.vm && m.stages[phase]
	delete(m.stages, phase)
	m.mu.Unlock()
	if !block {
		return
	}
	path := filepath.Join(m.home, "vms", m.vm, "manifest.json")
	os.Rename(path, path+".saved")
	os.MkdirAll(filepath.Join(path, "blocked"), 0o700)
}

func (*blockManifestAt) PhaseEnd(string, string) {}

// TestParkManifestUnwritable: a park whose image is committed but whose manifest
// cannot be written fails, and the VM is parked all the same: its stopped QEMU is
// ended (not left beside the one a wake starts). A wake whose commit cannot be written
// fails and leaves it parked; once the manifest can be written again it wakes as
// itself.
func TestParkManifestUnwritable(t *testing.T) {
	mod := parallelVMTest(t)
	var home string
	env := newRobustEnv(t, func(c *engine.Config) {
		mod(c)
		home = c.StateDir
		c.Markers = &blockManifestAt{home: c.StateDir, vm: "f", stages: map[string]bool{engine.ParkStageRecord: true, engine.WakeStageCommit: true}}
	})
	e := env.E
	ctx := ctxT(t, 4*time.Minute)
	makePinnedWorld(t, e, 256, 0)
	f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: "f"})
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, f, "echo kept > /dev/shm/m")
	qpid := f.PID()
	if _, err := e.Park(ctx, "f"); err == nil {
		t.Fatal("park with an unwritable manifest succeeded")
	}
	if !waitExited(qpid, 10*time.Second) {
		t.Errorf("the parked fork's QEMU %d still runs", qpid)
	}
	if info := f.Info(); info.State != engine.StateParked || info.PID != 0 {
		t.Errorf("after the park: state %s, pid %d, want parked, 0", info.State, info.PID)
	}
	path := filepath.Join(home, "vms", "f", "manifest.json")
	unblock := func() {
		t.Helper()
		if err := os.RemoveAll(path); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".saved", path); err != nil {
			t.Fatal(err)
		}
	}
	unblock()
	// A wake whose commit cannot be written: not committed, the VM parked still (its
	// new QEMU ended), and it wakes once the manifest can be written.
	if _, err := e.Wake(ctx, "f", nil); err == nil {
		t.Fatal("wake with an unwritable manifest succeeded")
	}
	if info := f.Info(); info.State != engine.StateParked {
		t.Errorf("after a wake that could not commit: state %s, want parked", info.State)
	}
	if n := len(qemuPIDs(env.Home)); n != 1 {
		t.Errorf("%d QEMUs run after the failed wake, want the world's alone", n)
	}
	unblock()
	if _, err := e.Wake(ctx, "f", nil); err != nil {
		t.Fatalf("wake: %v", err)
	}
	if got := mustRun(t, f, "cat /dev/shm/m"); got != "kept" {
		t.Errorf("after the wake: %q", got)
	}
	if n := len(qemuPIDs(env.Home)); n != 2 {
		t.Errorf("%d QEMUs run for the world and the woken fork, want 2", n)
	}
	deleteAll(t, env)
}

// TestParkedGenerations: a line of parked forks, each forked by name from the one
// before it while that one is parked (a tree search that parks its nodes), holds every
// generation's memory and disk writes, and no chain grows with the generations: each
// VM's disk chain stays within genMaxVMDepth layers and each checkpoint's within
// genMaxCkDepth, as for running VMs (TestGenerations).
func TestParkedGenerations(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 6*time.Minute)
	makePinnedWorld(t, e, 256, 16)
	const generations = 12
	src, want := "ck", ""
	for g := 1; g <= generations; g++ {
		name := fmt.Sprintf("g%d", g)
		vm, err := e.Fork(ctx, src, &engine.ForkOptions{Name: name})
		if err != nil {
			t.Fatalf("generation %d: fork of %s: %v", g, src, err)
		}
		want += name + "\n"
		if got := mustRun(t, vm, "echo "+name+" >> /dev/shm/line && echo "+name+" >> /data/line && sync && cat /dev/shm/line /data/line"); got != strings.TrimSuffix(want+want, "\n") {
			t.Fatalf("generation %d holds %q, want %q twice", g, got, want)
		}
		if _, err := e.Park(ctx, name); err != nil {
			t.Fatalf("generation %d: park: %v", g, err)
		}
		src = name
	}
	for _, dir := range dirNames(filepath.Join(env.Home, "vms")) {
		var m struct {
			Launch struct {
				Disk []json.RawMessage `json:"disk"`
			} `json:"launch"`
		}
		b, err := os.ReadFile(filepath.Join(env.Home, "vms", dir, "manifest.json"))
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err != nil {
			t.Fatal(err)
		}
		if d := len(m.Launch.Disk); d > genMaxVMDepth {
			t.Errorf("vm %s: a %d-layer disk chain, want at most %d", dir, d, genMaxVMDepth)
		}
	}
	cks, err := e.Checkpoints()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cks {
		ck, err := e.LoadCheckpoint(ctx, c.Name)
		if err != nil {
			t.Fatal(err)
		}
		if d := len(ck.Manifest.Disk); d > genMaxCkDepth {
			t.Errorf("checkpoint %s: a %d-layer disk chain, want at most %d", c.Name, d, genMaxCkDepth)
		}
	}
	last := src
	if _, err := e.Wake(ctx, last, nil); err != nil {
		t.Fatalf("wake %s: %v", last, err)
	}
	vm, err := e.Get(last)
	if err != nil {
		t.Fatal(err)
	}
	if got := mustRun(t, vm, "cat /dev/shm/line /data/line"); got != strings.TrimSuffix(want+want, "\n") {
		t.Errorf("the last generation, woken, holds %q", got)
	}
	deleteAll(t, env)
}
