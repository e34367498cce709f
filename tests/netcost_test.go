package tests

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// BenchmarkNetBackendCost is the experiment behind the choice of slirp over passt for
// forks (docs/benchmarks.md, "Networking"); -benchtime Nx sets the runs per backend:
//
//	go test -count=1 -run '^$' -bench NetBackendCost -benchtime 20x -v ./tests/
//
// Part 1 spawns a fork's QEMU (the machine forks use, waiting in -incoming defer) with
// no network, with slirp (-netdev user + virtio-net) and with passt (a passt process,
// then -netdev stream to its socket + virtio-net), and measures exec until QMP answers
// (for passt: from passt's exec) and the proportional set size of the processes. Part 2
// forks real networked and plain worlds through the engine and compares fork → ready.
func BenchmarkNetBackendCost(b *testing.B) {
	var t testing.TB = b
	runs := b.N
	passt, perr := exec.LookPath("passt")
	backends := []string{"none", "slirp", "passt"}
	if perr != nil {
		t.Logf("passt not installed (apt-get install passt): measuring none and slirp only")
		backends = backends[:2]
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Fatal(err)
	}
	// Backends alternate run by run, so that drift on a shared machine hits all alike.
	spawn := map[string][]time.Duration{}
	mem := map[string][][4]int64{}
	for i := 0; i < runs; i++ {
		for _, b := range backends {
			d, m := spawnWithNet(t, qemu, passt, b)
			spawn[b] = append(spawn[b], d)
			mem[b] = append(mem[b], m)
		}
	}
	for _, b := range backends {
		s := spawn[b]
		slices.Sort(s)
		med := func(k int) int64 {
			v := make([]int64, 0, runs)
			for _, m := range mem[b] {
				v = append(v, m[k])
			}
			slices.Sort(v)
			return v[runs/2]
		}
		t.Logf("RESULT spawn backend=%s runs=%d spawn_p50=%v spawn_min=%v spawn_max=%v qemu_private_kib=%d qemu_pss_kib=%d passt_private_kib=%d passt_pss_kib=%d",
			b, runs, s[runs/2].Round(10*time.Microsecond), s[0].Round(10*time.Microsecond), s[runs-1].Round(10*time.Microsecond),
			med(0), med(1), med(2), med(3))
	}

	env := newRobustEnv(t, nil)
	ctx := ctxT(t, 10*time.Minute)
	kinds := []string{"plain", "net"}
	for _, name := range kinds {
		if _, err := env.E.Create(ctx, engine.Spec{Name: name, CPUs: 1, MemoryMiB: 256, Forkable: true, Net: name == "net"}); err != nil {
			t.Fatal(err)
		}
		if _, err := env.E.Checkpoint(ctx, name, name+"ck", &engine.CheckpointOptions{Pin: true}); err != nil {
			t.Fatal(err)
		}
	}
	ready := map[string][]time.Duration{}
	priv := map[string][]int64{}
	for i := 0; i < runs; i++ {
		for _, name := range kinds {
			f, err := env.E.Fork(ctx, name+"ck", &engine.ForkOptions{Name: fmt.Sprintf("%s-f%d", name, i)})
			if err != nil {
				t.Fatal(err)
			}
			ready[name] = append(ready[name], f.Info().Timings.Total)
			if u, err := f.Memory(ctx); err == nil {
				priv[name] = append(priv[name], u.Private>>10)
			}
			if err := env.E.Delete(ctx, f.Name()); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, name := range kinds {
		r, p := ready[name], priv[name]
		slices.Sort(r)
		slices.Sort(p)
		t.Logf("RESULT fork world=%s runs=%d ready_p50=%v ready_min=%v ready_max=%v private_p50_kib=%d", name, runs,
			r[runs/2].Round(100*time.Microsecond), r[0].Round(100*time.Microsecond), r[runs-1].Round(100*time.Microsecond), p[len(p)/2])
	}
	deleteAll(t, env)
}

// spawnWithNet starts a fork-shaped QEMU with backend b, waits for QMP, measures, and
// kills what it started (by pid). It returns the time from the first exec to QMP's
// greeting and, in KiB, QEMU's private memory and Pss, then passt's (0 without it).
func spawnWithNet(t testing.TB, qemu, passt, b string) (time.Duration, [4]int64) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "fvnet-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	qmpSock := filepath.Join(dir, "qmp.sock")
	args := []string{
		"-name", "netcost", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", "256M",
		"-machine", "q35,sata=off,smbus=off,hpet=off,acpi=off",
		"-kernel", imageInfo.Kernel, "-initrd", imageInfo.Initrd,
		"-chardev", "socket,id=qmp,path=" + qmpSock + ",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		"-device", "virtio-serial-pci,id=vser0,max_ports=2",
		"-incoming", "defer",
	}
	nic := "virtio-net-pci,netdev=net0,id=nic0,mac=52:54:00:12:34:56,romfile="
	var procs []*exec.Cmd
	defer func() {
		for _, p := range procs {
			syscall.Kill(p.Process.Pid, syscall.SIGKILL)
			p.Wait()
		}
	}()
	t0 := time.Now()
	switch b {
	case "slirp":
		args = append(args, "-netdev", `{"type":"user","id":"net0","net":"10.0.2.0/24","host":"10.0.2.2","dns":"10.0.2.3","ipv4":true,"ipv6":false}`, "-device", nic)
	case "passt":
		// passt run as root drops to nobody before it binds its socket: the directory
		// must be writable by nobody (forkvm's run directories are 0700).
		if err := os.Chmod(dir, 0o777); err != nil {
			t.Fatal(err)
		}
		sock := filepath.Join(dir, "passt.sock")
		p := exec.Command(passt, "-f", "-q", "-1", "-s", sock, "-a", "10.0.2.15", "-n", "24", "-g", "10.0.2.2")
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Microsecond) {
			if _, err := os.Stat(sock); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("passt did not create %s", sock)
			}
		}
		args = append(args, "-netdev", "stream,id=net0,server=off,addr.type=unix,addr.path="+sock, "-device", nic)
	}
	q := exec.Command(qemu, args...)
	q.Stderr = os.Stderr
	if err := q.Start(); err != nil {
		t.Fatal(err)
	}
	procs = append(procs, q)
	var conn net.Conn
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Microsecond) {
		if conn, err = net.Dial("unix", qmpSock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: qmp: %v", b, err)
		}
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(time.Minute)) // a QEMU that never greets fails the test
	greeting, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		t.Fatalf("%s: qmp greeting: %v (read: %q)", b, err, greeting)
	}
	d := time.Since(t0)
	var m [4]int64
	for _, p := range procs {
		priv, pss := memKiB(t, p.Process.Pid)
		if p == q {
			m[0], m[1] = priv, pss
		} else {
			m[2], m[3] = priv, pss
		}
	}
	return d, m
}

// memKiB is the private (Private_Clean + Private_Dirty) and proportional set size of a
// process, from /proc/PID/smaps_rollup.
func memKiB(t testing.TB, pid int) (private, pss int64) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "Pss:":
			pss = n
		case "Private_Clean:", "Private_Dirty:":
			private += n
		}
	}
	return private, pss
}
