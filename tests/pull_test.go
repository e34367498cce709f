package tests

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/vsockd"
)

// pullHost is a daemon on its own state directory (a host), listening on loopback TCP
// with a token, and a CLI runner for it.
type pullHost struct {
	home, url, tokenFile, token string
	d                           *daemonProc
	cli                         func(stdin io.Reader, args ...string) (string, string, int)
}

func newPullHost(t *testing.T, prefix string) *pullHost {
	t.Helper()
	home, err := os.MkdirTemp("/tmp", prefix)
	if err != nil {
		t.Fatal(err)
	}
	return startPullHost(t, home)
}

// startPullHost starts the daemon of a host on state directory home.
func startPullHost(t *testing.T, home string) *pullHost {
	t.Helper()
	h := &pullHost{home: home, cli: cliRunner(t, home), token: "pull-test-token-" + filepath.Base(home)}
	h.tokenFile = filepath.Join(home, "token")
	if err := os.WriteFile(h.tokenFile, []byte(h.token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	h.url = "http://" + addr
	// A raised overcommit: other tests' VMs on this host count against the budget.
	h.d = startDaemon(t, home, serve.SocketPath(home), filepath.Join(home, "daemon.log"),
		"--listen", addr, "--token-file", h.tokenFile, "--overcommit", "32")
	return h
}

func (h *pullHost) ok(t *testing.T, args ...string) string {
	t.Helper()
	out, errs, code := h.cli(nil, args...)
	if code != 0 {
		t.Fatalf("forkvm %v: exit %d: %s%s\n%s", args, code, out, errs, h.d.logText())
	}
	return out
}

// get does an authenticated GET on the host's TCP API and decodes the JSON answer.
func (h *pullHost) get(t *testing.T, path string, out any) {
	t.Helper()
	req, _ := http.NewRequest("GET", h.url+path, nil)
	req.Header.Set("Authorization", "Bearer "+h.token)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: HTTP %d: %s", path, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatal(err)
	}
}

// allocated is a file's storage (st_blocks).
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// TestCheckpointPull: two daemons on loopback, each its own state directory. A world
// checkpoint (with a disk) and a delta checkpoint of a fork of it are pulled from the
// first to the second with `forkvm checkpoint pull` and forked there (the guest's files
// from before each checkpoint are there); the RAM files arrive with their holes; the
// boot files come from what the host has (same digest); pulling again fetches nothing;
// a byte changed at the holder after its digest was recorded is refused with
// digest_mismatch and leaves nothing.
func TestCheckpointPull(t *testing.T) {
	a, b := newPullHost(t, "fvpa-"), newPullHost(t, "fvpb-")
	// The host's blob store (in the shared cache): what this test adds goes at its end.
	blobDir := filepath.Join(cacheDir, "blobs", "sha256")
	had := map[string]bool{}
	for _, n := range dirNames(blobDir) {
		had[n] = true
	}
	var blobs []string
	t.Cleanup(func() {
		for _, n := range dirNames(blobDir) {
			if !had[n] {
				blobs = append(blobs, filepath.Join(blobDir, n))
			}
		}
		b.cli(nil, "rm", "fb1", "fb2")
		b.cli(nil, "checkpoint", "rm", "--force", "ck1", "ckd", "ck2")
		a.cli(nil, "rm", "w1", "fa")
		a.cli(nil, "checkpoint", "rm", "--force", "ck1", "ckd", "ck2")
		a.d.stop()
		b.d.stop()
		for _, h := range []*pullHost{a, b} {
			for pid, args := range procsReferencing(h.home) {
				t.Errorf("leak: process %d still references %s: %q", pid, h.home, args)
			}
			os.RemoveAll(h.home)
		}
		// Base disk images this test put in the host's blob store.
		for _, p := range blobs {
			os.Remove(p)
		}
	})
	a.ok(t, "create", "w1", "--cpus", "1", "--memory-mb", "256", "--forkable", "--disk-mb", "64")
	a.ok(t, "exec", "w1", "--", "sh", "-c", "echo world > /root/m; head -c 8000000 /dev/urandom > /dev/shm/r; sync")
	a.ok(t, "checkpoint", "w1", "ck1", "--pin")
	a.ok(t, "fork", "ck1", "fa")
	a.ok(t, "exec", "fa", "--", "sh", "-c", "echo delta > /root/d; sync")
	a.ok(t, "checkpoint", "fa", "ckd", "--pin")

	var exp api.CheckpointExport
	a.get(t, "/v1/checkpoints/ck1/export", &exp)
	var ramData int64
	for _, f := range exp.Files {
		switch {
		case f.Name == "ram/ck-ck1.ram":
			ramData = f.Data
		case strings.HasSuffix(f.Name, ".raw"):
			blobs = append(blobs, filepath.Join(cacheDir, "blobs", "sha256", f.SHA256))
		}
	}
	if ramData < 8e6 || ramData > 200<<20 {
		t.Fatalf("ck1's RAM file holds %d bytes of data: %+v", ramData, exp.Files)
	}

	pull := func(name string) api.PullResult {
		t.Helper()
		var res api.PullResult
		out := b.ok(t, "checkpoint", "pull", name, "--from", a.url, "--token-file", a.tokenFile, "--json")
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatalf("pull %s: %v: %s", name, err, out)
		}
		return res
	}
	res := pull("ck1")
	t.Logf("pull ck1: %d bytes, %d fetched, %d skipped", res.Bytes, res.FilesFetched, res.FilesSkipped)
	for _, f := range exp.Files {
		t.Logf("ck1 file %s: %d bytes, %d data, sha %s", f.Name, f.Size, f.Data, f.SHA256[:12])
	}
	if res.Present || res.FilesSkipped < 1 || res.Bytes < ramData || res.Checkpoint.Name != "ck1" {
		t.Errorf("pull ck1: %+v, want the kernel skipped and the RAM data fetched", res)
	}
	var info serve.CheckpointObject
	b.get(t, "/v1/checkpoints/ck1", &info)
	if !strings.HasPrefix(info.RAMPath, "/dev/shm/") || strings.Contains(info.RAMPath, a.home) {
		t.Errorf("pulled RAM path %s", info.RAMPath)
	}
	if got := allocated(t, info.RAMPath); got > ramData+(4<<20) || got < ramData {
		t.Errorf("pulled RAM file holds %d bytes, its data is %d: holes not kept", got, ramData)
	}
	if again := pull("ck1"); !again.Present || again.Bytes != 0 {
		t.Errorf("second pull: %+v, want present and nothing fetched", again)
	}
	b.ok(t, "fork", "ck1", "fb1")
	if out := b.ok(t, "exec", "fb1", "--", "cat", "/root/m"); out != "world\n" {
		t.Errorf("fork of the pulled checkpoint: %q", out)
	}

	// The delta checkpoint: its lineage comes with it; the root RAM file and the base
	// disk image (in the host's blob store since ck1) are linked, not fetched again.
	var expd api.CheckpointExport
	a.get(t, "/v1/checkpoints/ckd/export", &expd)
	for _, f := range expd.Files {
		t.Logf("ckd file %s: %d bytes, %d data, sha %s", f.Name, f.Size, f.Data, f.SHA256[:12])
	}
	t.Logf("blob store: %v", dirNames(filepath.Join(cacheDir, "blobs", "sha256")))
	res = pull("ckd")
	t.Logf("pull ckd: %d bytes, %d fetched, %d skipped", res.Bytes, res.FilesFetched, res.FilesSkipped)
	b.ok(t, "fork", "ckd", "fb2")
	if out := b.ok(t, "exec", "fb2", "--", "cat", "/root/m", "/root/d"); out != "world\ndelta\n" {
		t.Errorf("fork of the pulled delta checkpoint: %q", out)
	}

	// A byte changed at the holder after its digest was recorded.
	a.ok(t, "checkpoint", "w1", "ck2", "--pin")
	var exp2 api.CheckpointExport
	a.get(t, "/v1/checkpoints/ck2/export", &exp2)
	var a2 serve.CheckpointObject
	a.get(t, "/v1/checkpoints/ck2", &a2)
	var off int64 = -1
	for _, f := range exp2.Files {
		if f.Name == "ram/ck-ck2.ram" && len(f.Extents) > 0 {
			off = f.Extents[len(f.Extents)/2].Off + 123
		}
	}
	if off < 0 {
		t.Fatalf("ck2's export has no RAM data: %+v", exp2.Files)
	}
	fd, err := os.OpenFile(a2.RAMPath, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	var one [1]byte
	fd.ReadAt(one[:], off)
	one[0] ^= 0x5a
	fd.WriteAt(one[:], off)
	fd.Close()
	out, errs, code := b.cli(nil, "checkpoint", "pull", "ck2", "--from", a.url, "--token-file", a.tokenFile)
	if code == 0 || !strings.Contains(errs, "digest") {
		t.Errorf("pull of a corrupted checkpoint: exit %d: %s%s", code, out, errs)
	}
	if _, errs, code := b.cli(nil, "checkpoint", "rm", "ck2"); code == 0 || !strings.Contains(errs, "not found") {
		t.Errorf("the refused checkpoint is there: %d %s", code, errs)
	}
	for _, dir := range []string{filepath.Join(b.home, "checkpoints")} {
		for _, n := range dirNames(dir) {
			if strings.Contains(n, "tmp") || strings.Contains(n, "ck2") {
				t.Errorf("a refused pull left %s in %s", n, dir)
			}
		}
	}
	ramDir := filepath.Dir(info.RAMPath)
	for _, n := range dirNames(ramDir) {
		if strings.Contains(n, "ck2") || strings.Contains(n, "tmp") {
			t.Errorf("a refused pull left %s in %s", n, ramDir)
		}
	}
	// Without the token the holder refuses.
	if _, errs, code := b.cli(nil, "checkpoint", "pull", "ck1x", "--from", a.url); code == 0 || !strings.Contains(errs, "token") {
		t.Errorf("pull without a token: exit %d %s", code, errs)
	}
}

// TestCheckpointPullThroughput measures `forkvm checkpoint pull` of a 2 GiB world
// checkpoint holding ~900 MB of data between two daemons on loopback (the
// holder's first export, which hashes its files, timed apart), three times. It only
// reports (docs/benchmarks.md records the figures); set FORKVM_PULL_BENCH=1 to run it.
func TestCheckpointPullThroughput(t *testing.T) {
	if os.Getenv("FORKVM_PULL_BENCH") == "" {
		t.Skip("set FORKVM_PULL_BENCH=1 to measure")
	}
	// The world is made by an engine in this process, with boot and exec deadlines for
	// a loaded machine (the CLI has none to give), then handed to the holder's daemon.
	home, err := os.MkdirTemp("/tmp", "fvpa-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	ctx := ctxT(t, 30*time.Minute)
	e, err := engine.New(ctx, &engine.Config{StateDir: home, CacheDir: cacheDir, Kernel: imageInfo.Kernel, Initrd: imageInfo.Initrd,
		BootTimeout: 10 * time.Minute, Overcommit: 32})
	if err != nil {
		t.Fatal(err)
	}
	w, err := e.Create(ctx, engine.Spec{Name: "wbig", CPUs: 1, MemoryMiB: 2048, Forkable: true})
	if err != nil {
		ql, _ := os.ReadFile(filepath.Join(home, "vms", "wbig", "qemu.log"))
		e.Delete(ctx, "wbig")
		e.Close()
		t.Fatalf("%v\nqemu.log: %s", err, ql)
	}
	// ~900 MB of guest data: 64 MiB of random bytes, copied 14 times (no zero pages).
	code, xerr := w.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c",
		"mount -o remount,size=1800M /dev/shm; head -c 67108864 /dev/urandom > /dev/shm/a; for i in $(seq 14); do cat /dev/shm/a >> /dev/shm/r; done; rm /dev/shm/a"}})
	if xerr != nil {
		code = -1
	}
	_, cerr := e.Checkpoint(ctx, "wbig", "big", &engine.CheckpointOptions{Pin: true})
	derr := e.Delete(ctx, "wbig")
	e.Close()
	if code != 0 || cerr != nil || derr != nil {
		t.Fatalf("filling the world: exit %d (%v); checkpoint: %v; delete: %v", code, xerr, cerr, derr)
	}
	a, b := startPullHost(t, home), newPullHost(t, "fvpb-")
	t.Cleanup(func() {
		b.cli(nil, "checkpoint", "rm", "--force", "big")
		a.cli(nil, "checkpoint", "rm", "--force", "big")
		a.d.stop()
		b.d.stop()
		os.RemoveAll(b.home)
	})
	var info serve.CheckpointObject
	a.get(t, "/v1/checkpoints/big", &info)
	t0 := time.Now()
	var exp api.CheckpointExport
	a.get(t, "/v1/checkpoints/big/export", &exp)
	first := time.Since(t0)
	var data int64
	for _, f := range exp.Files {
		data += f.Data
	}
	t.Logf("holder's first export (hashes every file): %v for %d MB of data in a %d MiB RAM file (%d MB allocated)",
		first.Round(time.Millisecond), data/1e6, info.RAMSize>>20, allocated(t, info.RAMPath)/1e6)
	for i := range 3 {
		var res api.PullResult
		out := b.ok(t, "checkpoint", "pull", "big", "--from", a.url, "--token-file", a.tokenFile, "--json")
		if err := json.Unmarshal([]byte(out), &res); err != nil {
			t.Fatal(err)
		}
		var bi serve.CheckpointObject
		b.get(t, "/v1/checkpoints/big", &bi)
		t.Logf("pull %d: %d MB in %.2fs = %.0f MB/s; %d files fetched, %d the host had; arrived with %d MB allocated",
			i+1, res.Bytes/1e6, res.Seconds, float64(res.Bytes)/res.Seconds/1e6, res.FilesFetched, res.FilesSkipped, allocated(t, bi.RAMPath)/1e6)
		b.ok(t, "checkpoint", "rm", "big")
	}
}
