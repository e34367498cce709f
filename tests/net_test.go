package tests

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
)

// freePort returns a host port that was free a moment ago on 127.0.0.1, below the
// kernel's ephemeral range (net.ipv4.ip_local_port_range). A port of that range, as a
// bind to port 0 gives, can go to any outgoing connection on the host while nothing
// listens on it, and a published port is let go of for a while on purpose: a parked
// VM's between its QEMU's end and the daemon's listener, and at its wake between that
// listener and the new QEMU (a wake then fails with ErrPortInUse).
func freePort(t *testing.T) int {
	t.Helper()
	lo := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		fmt.Sscan(string(b), &lo)
	}
	if first := max(lo-12000, 1024); first < lo {
		for range 500 {
			if p := first + rand.IntN(lo-first); portFree(p) {
				return p
			}
		}
	}
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// portFree reports whether 127.0.0.1:port can be bound (nothing holds it).
func portFree(port int) bool {
	ln, err := net.Listen("tcp4", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

// httpGet fetches url from the host, retrying briefly (a server just started in a guest
// may not listen yet).
func httpGet(t *testing.T, url string) string {
	t.Helper()
	c := &http.Client{Timeout: 10 * time.Second}
	var lastErr error
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		resp, err := c.Get(url)
		if err != nil {
			lastErr = err
			continue
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK {
			lastErr = fmt.Errorf("status %d: %v", resp.StatusCode, err)
			continue
		}
		return string(b)
	}
	t.Fatalf("GET %s: %v", url, lastErr)
	return ""
}

// netWorld boots a small forkable world with a network.
func netWorld(t *testing.T, e *engine.Engine, name string, publish []engine.PortForward) *engine.VM {
	t.Helper()
	ctx := ctxT(t, 3*time.Minute)
	vm, err := e.Create(ctx, engine.Spec{Name: name, CPUs: 1, MemoryMiB: 256, Forkable: true, Net: true, Publish: publish})
	if err != nil {
		t.Fatalf("create %s: %v", name, err)
	}
	return vm
}

// TestNetHostInternal: a networked guest (busybox initramfs) reaches an HTTP server on
// the host's 127.0.0.1 as host.internal, with the addresses of the contract; a VM
// without --net has no NIC at all.
func TestNetHostInternal(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from the host, %s", r.URL.Path)
	}))
	defer srv.Close()
	port := srv.Listener.Addr().(*net.TCPAddr).Port

	w := netWorld(t, env.E, "nw", nil)
	if got := mustRun(t, w, fmt.Sprintf("wget -q -O - http://host.internal:%d/file.txt", port)); got != "hello from the host, /file.txt" {
		t.Errorf("wget through host.internal = %q", got)
	}
	if got := mustRun(t, w, "cat /etc/resolv.conf; grep host.internal /etc/hosts; ls /sys/class/net; cat /sys/class/net/eth0/address"); got != "nameserver 10.0.2.3\n10.0.2.2\thost.internal\neth0\nlo\n52:54:00:12:34:56" {
		t.Errorf("guest network config:\n%s", got)
	}
	if got := mustRun(t, w, "ip -4 addr show eth0 | grep -o 'inet [0-9./]*'; ip route show default"); !strings.Contains(got, "inet 10.0.2.15/24") || !strings.Contains(got, "default via 10.0.2.2 dev eth0") {
		t.Errorf("addresses and routes:\n%s", got)
	}
	// A fork of it (no published ports) reaches the host the same way.
	ctx := ctxT(t, 3*time.Minute)
	f, err := env.E.Fork(ctx, "nw", &engine.ForkOptions{Name: "nwf"})
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	if got := mustRun(t, f, fmt.Sprintf("wget -q -O - http://host.internal:%d/from-fork", port)); got != "hello from the host, /from-fork" {
		t.Errorf("fork's wget = %q", got)
	}

	// No --net: no NIC, no network configuration.
	plain, err := env.E.Create(ctx, engine.Spec{Name: "plain", CPUs: 1, MemoryMiB: 256})
	if err != nil {
		t.Fatalf("create plain: %v", err)
	}
	if got := mustRun(t, plain, "ls /sys/class/net; cat /etc/resolv.conf 2>/dev/null; grep -c . /etc/forkvm/modules-net; lsmod 2>/dev/null | grep -c virtio_net || true"); got != "lo\n3\n0" {
		t.Errorf("VM without --net:\n%s", got)
	}
	deleteAll(t, env)
}

// TestNetForkPublish: a world runs a server (busybox httpd) serving a file from memory
// (/dev/shm); after a checkpoint, each fork serves its own copy through its own
// published host port, a write in one does not show in the other, a taken host port is
// refused with ErrPortInUse leaving nothing behind, and deleting the forks frees their
// ports.
func TestNetForkPublish(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	pw, p1, p2 := freePort(t), freePort(t), freePort(t)
	w := netWorld(t, e, "srv", []engine.PortForward{{HostPort: pw, GuestPort: 8080}})
	mustRun(t, w, "mkdir -p /dev/shm/www && echo in-memory-state > /dev/shm/www/index.html && "+
		"setsid httpd -f -p 8080 -h /dev/shm/www </dev/null >/dev/null 2>&1 & echo started")
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", pw)); got != "in-memory-state\n" {
		t.Fatalf("world serves %q", got)
	}
	if _, err := e.Checkpoint(ctx, "srv", "srvck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	mustRun(t, w, "echo world-changed > /dev/shm/www/index.html")

	f1, err := e.Fork(ctx, "srvck", &engine.ForkOptions{Name: "f1", Publish: []engine.PortForward{{HostPort: p1, GuestPort: 8080}}})
	if err != nil {
		t.Fatalf("fork f1: %v", err)
	}
	f2, err := e.Fork(ctx, "srvck", &engine.ForkOptions{Name: "f2", Publish: []engine.PortForward{{HostIP: "127.0.0.1", HostPort: p2, GuestPort: 8080}}})
	if err != nil {
		t.Fatalf("fork f2: %v", err)
	}
	t.Logf("fork with a published port ready in %v", f2.Info().Timings.Total.Round(time.Millisecond))
	for _, c := range []struct {
		port int
		want string
	}{{p1, "in-memory-state\n"}, {p2, "in-memory-state\n"}, {pw, "world-changed\n"}} {
		if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", c.port)); got != c.want {
			t.Errorf("port %d serves %q, want %q", c.port, got, c.want)
		}
	}
	mustRun(t, f1, "echo f1-only > /dev/shm/www/index.html")
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", p1)); got != "f1-only\n" {
		t.Errorf("f1 serves %q after its write", got)
	}
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", p2)); got != "in-memory-state\n" {
		t.Errorf("f2 serves %q after f1's write", got)
	}
	if info := f1.Info(); !info.Net || len(info.Publish) != 1 || info.Publish[0].HostPort != p1 {
		t.Errorf("f1 info: net %v publish %v", info.Net, info.Publish)
	}

	// A taken host port: a typed error, and nothing of the fork is left.
	_, err = e.Fork(ctx, "srvck", &engine.ForkOptions{Name: "f3", Publish: []engine.PortForward{{HostPort: p1, GuestPort: 8080}}})
	if !errors.Is(err, engine.ErrPortInUse) {
		t.Fatalf("fork on a taken port: %v, want ErrPortInUse", err)
	}
	// Bad forwards are refused before anything starts.
	_, err = e.Fork(ctx, "srvck", &engine.ForkOptions{Name: "f4", Publish: []engine.PortForward{{HostIP: "localhost", HostPort: p1 + 1, GuestPort: 80}}})
	wantErr(t, err, engine.ErrInvalidSpec)
	checkState(t, env, expectState{VMs: []string{"srv", "f1", "f2"}, RAM: []string{"vm-srv.ram", "ck-srvck.ram"}, CKs: []string{"srvck"}})

	// Deleting the forks frees their ports; the world keeps its own.
	for _, n := range []string{"f1", "f2"} {
		if err := e.Delete(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []int{p1, p2} {
		if !portFree(p) {
			t.Errorf("host port %d still bound after its fork was deleted", p)
		}
	}
	if portFree(pw) {
		t.Errorf("world's port %d is not bound", pw)
	}
	deleteAll(t, env)
	if !portFree(pw) {
		t.Errorf("world's port %d still bound after delete", pw)
	}
}

// TestNetForkMany: a wave with one published port per fork (ManyOptions.Publish).
func TestNetForkMany(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	netWorld(t, e, "mw", nil)
	w, _ := e.Get("mw")
	mustRun(t, w, "mkdir -p /dev/shm/www && hostname > /dev/shm/www/index.html && "+
		"setsid httpd -f -p 80 -h /dev/shm/www </dev/null >/dev/null 2>&1 & echo started")
	base := freePort(t)
	for !portFree(base+1) || !portFree(base+2) {
		base = freePort(t)
	}
	evs, err := e.ForkMany(ctx, "mw", 3, &engine.ManyOptions{Prefix: "m", Pin: true,
		Publish: func(i int) []engine.PortForward { return []engine.PortForward{{HostPort: base + i, GuestPort: 80}} }})
	if err != nil {
		t.Fatal(err)
	}
	for ev := range evs {
		if ev.Err != nil {
			t.Fatalf("fork %s: %v", ev.Name, ev.Err)
		}
	}
	for i := 0; i < 3; i++ {
		// The file was written in the world before the checkpoint: every fork serves it,
		// each on its own port.
		if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", base+i)); got != "mw\n" {
			t.Errorf("fork %d serves %q", i, got)
		}
	}
	// The same host port for two forks is refused before anything starts.
	_, err = e.ForkMany(ctx, "mw", 2, &engine.ManyOptions{Prefix: "x",
		Publish: func(i int) []engine.PortForward { return []engine.PortForward{{HostPort: base + 10, GuestPort: 80}} }})
	wantErr(t, err, engine.ErrInvalidSpec)
	deleteAll(t, env)
	for i := 0; i < 3; i++ {
		if !portFree(base + i) {
			t.Errorf("port %d still bound", base+i)
		}
	}
}

// connServer is a host TCP server that records, per accepted connection, the lines it
// receives.
type connServer struct {
	ln    net.Listener
	mu    sync.Mutex
	conns [][]string
}

func newConnServer(t *testing.T) *connServer {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &connServer{ln: ln}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			i := len(s.conns)
			s.conns = append(s.conns, nil)
			s.mu.Unlock()
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					s.mu.Lock()
					s.conns[i] = append(s.conns[i], sc.Text())
					s.mu.Unlock()
					fmt.Fprintf(c, "ack %s\n", sc.Text())
				}
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return s
}

func (s *connServer) snapshot() [][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([][]string, len(s.conns))
	for i, c := range s.conns {
		out[i] = append([]string(nil), c...)
	}
	return out
}

// waitLines waits until the server's connections hold want (formatted with %q).
func (s *connServer) waitLines(t *testing.T, want string) {
	t.Helper()
	for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if fmt.Sprintf("%q", s.snapshot()) == want {
			return
		}
	}
	t.Fatalf("host server saw %q, want %s", s.snapshot(), want)
}

// TestNetTCPAtCheckpoint: a guest process holds a TCP connection to a host server when
// the world is checkpointed. The world's connection carries on; a fork's copy of it is
// dead: what the fork sends never reaches the server (the user-mode stack of the fork
// does not know the connection and answers with a reset), and the server sees no new
// connection.
func TestNetTCPAtCheckpoint(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	srv := newConnServer(t)
	port := srv.ln.Addr().(*net.TCPAddr).Port
	w := netWorld(t, e, "tw", nil)
	// nc reads lines from a FIFO that a sleeping process keeps open, so more writes
	// later go out on the same connection; its exit status lands in /dev/shm/nc.exit.
	mustRun(t, w, fmt.Sprintf(`mkfifo /dev/shm/in && (setsid sleep 100000 > /dev/shm/in </dev/null 2>/dev/null &) &&
		(setsid sh -c 'nc host.internal %d < /dev/shm/in > /dev/shm/out 2>/dev/shm/nc.err; echo $? > /dev/shm/nc.exit' </dev/null >/dev/null 2>&1 &) &&
		sleep 0.5 && echo before > /dev/shm/in && echo started`, port))
	srv.waitLines(t, `[["before"]]`)
	// The connection quiet before the checkpoint: the server's answer received, and the
	// guest's delayed ACK of it sent (Linux delays one up to 200 ms). One pending in the
	// checkpoint goes out of the fork once it runs, to a slirp that has no such
	// connection, which resets it: the fork's nc ended before it wrote (seen once, exit
	// 0, under make test's load; not reproduced in 10 runs alone: the cause is read
	// from the protocol, not seen).
	mustRun(t, w, "for i in $(seq 100); do grep -q 'ack before' /dev/shm/out && break; sleep 0.1; done; sleep 0.5; cat /dev/shm/out")
	if _, err := e.Checkpoint(ctx, "tw", "twck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	f, err := e.Fork(ctx, "twck", &engine.ForkOptions{Name: "tf"})
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	// EstabResets (/proc/net/snmp) counts connections the guest kernel saw reset.
	const resets = "grep '^Tcp:' /proc/net/snmp | tail -1 | awk '{print $9}'"
	if got := mustRun(t, f, "cat /dev/shm/nc.exit 2>/dev/null || echo running"); got != "running" {
		t.Fatalf("fork's nc before it wrote: %q", got)
	}
	before := mustRun(t, f, resets)
	mustRun(t, f, "echo from-fork > /dev/shm/in")
	mustRun(t, w, "echo after > /dev/shm/in")
	srv.waitLines(t, `[["before" "after"]]`)
	var forkSide string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if forkSide = mustRun(t, f, "cat /dev/shm/nc.exit 2>/dev/null || echo running"); forkSide != "running" {
			break
		}
	}
	after := mustRun(t, f, resets)
	t.Logf("fork's nc after it wrote on the checkpointed connection: exit %q, guest EstabResets %s -> %s", forkSide, before, after)
	if got := srv.snapshot(); fmt.Sprintf("%q", got) != `[["before" "after"]]` {
		t.Errorf("host server saw %q: the fork's data reached it", got)
	}
	if forkSide == "running" {
		t.Errorf("fork's nc still runs on its dead connection")
	}
	if b, _ := strconv.Atoi(before); strconv.Itoa(b+1) != after {
		t.Errorf("guest EstabResets %s -> %s, want one reset", before, after)
	}
	if got := mustRun(t, w, "cat /dev/shm/nc.exit 2>/dev/null || echo running; cat /dev/shm/out"); got != "running\nack before\nack after" {
		t.Errorf("world's nc: %q", got)
	}
	deleteAll(t, env)
}

// TestNetRootImage: networking in a Debian root image (configured after switch_root, in
// the image's /etc on its overlay): python3's HTTP server started in the world keeps
// serving in a fork through the fork's published port, and the world reaches the host
// as host.internal.
func TestNetRootImage(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	img := debianImage(t, env)
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "host says hi") }))
	defer srv.Close()
	hostPort := srv.Listener.Addr().(*net.TCPAddr).Port
	w, err := e.Create(ctx, engine.Spec{Name: "dn", CPUs: 1, MemoryMiB: 512, Forkable: true, Image: img, Net: true})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	got := mustRun(t, w, fmt.Sprintf(`python3 -c 'import urllib.request; print(urllib.request.urlopen("http://host.internal:%d/").read().decode())'`, hostPort))
	if got != "host says hi" {
		t.Errorf("python3 through host.internal: %q", got)
	}
	if got := mustRun(t, w, "cat /etc/resolv.conf; grep -c localhost /etc/hosts; grep host.internal /etc/hosts"); !strings.HasPrefix(got, "nameserver 10.0.2.3\n") || !strings.HasSuffix(got, "10.0.2.2\thost.internal") {
		t.Errorf("image's /etc: %q", got)
	}
	mustRun(t, w, "mkdir -p /dev/shm/www && echo python-state > /dev/shm/www/index.html && "+
		"cd /dev/shm/www && setsid python3 -m http.server 8000 </dev/null >/dev/null 2>&1 & "+
		"for i in $(seq 50); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))' 2>/dev/null && exit 0; sleep 0.2; done; exit 1")
	if _, err := e.Checkpoint(ctx, "dn", "dnck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint: %v", err)
	}
	p := freePort(t)
	if _, err := e.Fork(ctx, "dnck", &engine.ForkOptions{Name: "dnf", Publish: []engine.PortForward{{HostPort: p, GuestPort: 8000}}}); err != nil {
		t.Fatalf("fork: %v", err)
	}
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/index.html", p)); got != "python-state\n" {
		t.Errorf("fork serves %q", got)
	}
	if files := dirNames(filepath.Join(env.Home, "vms", "dn")); !strings.Contains(strings.Join(files, " "), "root.qcow2") {
		t.Errorf("dn has no root overlay: %v", files)
	}
	deleteAll(t, env)
	if !portFree(p) {
		t.Errorf("port %d still bound", p)
	}
}

// TestNetHandoffAndForkOfFork: a networked world checkpointed with handoff keeps its
// published port (its process is replaced); a fork with a published port can itself be
// checkpointed (a delta checkpoint binds no port; so does the full-save path's helper
// QEMU where page extraction is unsupported), and a fork of that checkpoint serves the
// first fork's memory on a port of its own.
func TestNetHandoffAndForkOfFork(t *testing.T) {
	env := newRobustEnv(t, parallelVMTest(t))
	e := env.E
	ctx := ctxT(t, 5*time.Minute)
	pw, p1, p2 := freePort(t), freePort(t), freePort(t)
	w := netWorld(t, e, "hw", []engine.PortForward{{HostPort: pw, GuestPort: 80}})
	mustRun(t, w, "mkdir -p /dev/shm/www && echo world > /dev/shm/www/index.html && "+
		"setsid httpd -f -p 80 -h /dev/shm/www </dev/null >/dev/null 2>&1 & echo started")
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", pw)); got != "world\n" {
		t.Fatalf("world serves %q", got)
	}
	if _, err := e.Checkpoint(ctx, "hw", "hwck", &engine.CheckpointOptions{Pin: true, Handoff: true}); err != nil {
		t.Fatalf("handoff checkpoint: %v", err)
	}
	if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", pw)); got != "world\n" {
		t.Errorf("world serves %q after its handoff", got)
	}
	f1, err := e.Fork(ctx, "hwck", &engine.ForkOptions{Name: "h1", Publish: []engine.PortForward{{HostPort: p1, GuestPort: 80}}})
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	mustRun(t, f1, "echo fork-one > /dev/shm/www/index.html")
	if _, err := e.Checkpoint(ctx, "h1", "h1ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		t.Fatalf("checkpoint of a fork with a published port: %v", err)
	}
	if _, err := e.Fork(ctx, "h1ck", &engine.ForkOptions{Name: "h2", Publish: []engine.PortForward{{HostPort: p2, GuestPort: 80}}}); err != nil {
		t.Fatalf("fork of the fork: %v", err)
	}
	for _, c := range []struct {
		port int
		want string
	}{{pw, "world\n"}, {p1, "fork-one\n"}, {p2, "fork-one\n"}} {
		if got := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", c.port)); got != c.want {
			t.Errorf("port %d serves %q, want %q", c.port, got, c.want)
		}
	}
	deleteAll(t, env)
	for _, p := range []int{pw, p1, p2} {
		if !portFree(p) {
			t.Errorf("port %d still bound", p)
		}
	}
}
