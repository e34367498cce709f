package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/textproto"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve/pull"
)

// fakePeer is a hostile holder on loopback: it proxies a real holder's API (upstream)
// but may rewrite the export (export), answer file requests itself (file) and counts
// the file requests it was asked.
type fakePeer struct {
	upstream string
	export   func(t *testing.T, exp *api.CheckpointExport)
	file     func(w http.ResponseWriter, r *http.Request)
	files    atomic.Int64
	url      string
}

func (p *fakePeer) start(t *testing.T) string {
	t.Helper()
	up, err := url.Parse(p.upstream)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(up)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.HasSuffix(r.URL.Path, "/export") && p.export != nil:
			rec := httptest.NewRecorder()
			proxy.ServeHTTP(rec, r)
			var exp api.CheckpointExport
			if err := json.Unmarshal(rec.Body.Bytes(), &exp); err != nil {
				t.Errorf("fake peer: holder's export: %v", err)
				http.Error(w, err.Error(), 500)
				return
			}
			p.export(t, &exp)
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(&exp)
		case strings.HasSuffix(r.URL.Path, "/export/file"):
			p.files.Add(1)
			if p.file != nil {
				p.file(w, r)
				return
			}
			proxy.ServeHTTP(w, r)
		default:
			proxy.ServeHTTP(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	p.url = srv.URL
	return srv.URL
}

// declare sets export file name's size to size, all data, one extent.
func declare(exp *api.CheckpointExport, name string, size int64) {
	for i := range exp.Files {
		if exp.Files[i].Name == name {
			exp.Files[i].Size, exp.Files[i].Data = size, size
			exp.Files[i].Extents = []api.Extent{{Off: 0, Len: size}}
		}
	}
}

// setManifest rewrites fields of exp's manifest.
func setManifest(t *testing.T, exp *api.CheckpointExport, fields map[string]any) {
	var m map[string]any
	if err := json.Unmarshal(exp.Manifest, &m); err != nil {
		t.Fatal(err)
	}
	for k, v := range fields {
		m[k] = v
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	exp.Manifest = b
}

// assertNoPullLeft fails if the pulling host h holds anything of checkpoint name: the
// checkpoint, a temporary checkpoint directory, a RAM file or temporary one, or a
// temporary file in the blob store.
func assertNoPullLeft(t *testing.T, h *transferHost, name string) {
	t.Helper()
	if _, err := h.e.CheckpointInfo(name); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("checkpoint %s: %v, want not found", name, err)
	}
	for _, dir := range []string{filepath.Join(h.home, "s", "checkpoints"), h.ram, filepath.Join(h.home, "cache")} {
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && p != dir && (strings.Contains(d.Name(), name) || strings.Contains(d.Name(), ".tmp")) {
				t.Errorf("left %s", p)
			}
			return nil
		})
	}
}

// TestPullOversizeDeclaration: a peer declaring files larger than the checkpoint's
// manifest can hold (a RAM file of 4 GiB for 4 MiB of RAM, a 2 GiB kernel, a state file
// larger than recorded, a delta layer larger than RAM) is refused from its export, before
// any file is asked for; a manifest consistent with its huge declarations that does not
// fit the free space is insufficient_space, before any file is asked for; and a file
// sending more data than declared fails as the bytes arrive.
func TestPullOversizeDeclaration(t *testing.T) {
	a, b := newTransferHost(t), newTransferHost(t)
	a.writeCheckpoint(t, "w1", map[int64]byte{0: 1, 1: 2, 700: 3})
	holder := a.serveTCP(t, "tok")
	var st syscall.Statfs_t
	if err := syscall.Statfs(b.ram, &st); err != nil {
		t.Fatal(err)
	}
	freeMiB := int64(st.Bavail) * int64(st.Bsize) >> 20
	for _, tc := range []struct {
		name   string
		export func(t *testing.T, exp *api.CheckpointExport)
		want   error
	}{
		{"ram 4 GiB", func(t *testing.T, exp *api.CheckpointExport) { declare(exp, "ram/ck-w1.ram", 4<<30) }, engine.ErrCheckpointCorrupt},
		{"kernel 2 GiB", func(t *testing.T, exp *api.CheckpointExport) { declare(exp, "boot/kernel", 2<<30) }, engine.ErrCheckpointCorrupt},
		{"state larger than recorded", func(t *testing.T, exp *api.CheckpointExport) { declare(exp, "state.mig", 1<<20) }, engine.ErrCheckpointCorrupt},
		{"consistent but larger than the free space", func(t *testing.T, exp *api.CheckpointExport) {
			mib := freeMiB + 1024
			setManifest(t, exp, map[string]any{"memory_mib": mib, "ram_size": mib << 20})
			declare(exp, "ram/ck-w1.ram", mib<<20)
		}, engine.ErrInsufficientSpace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &fakePeer{upstream: holder, export: tc.export}
			url := p.start(t)
			_, err := pull.Checkpoint(context.Background(), b.e, pull.Remote(url, "tok"), "w1", nil)
			if !errors.Is(err, tc.want) {
				t.Fatalf("pull = %v, want %v", err, tc.want)
			}
			if n := p.files.Load(); n != 0 {
				t.Errorf("%d file requests made before the refusal", n)
			}
			assertNoPullLeft(t, b, "w1")
		})
	}
	// Through the daemon's endpoint, the refusal has its code.
	p := &fakePeer{upstream: holder, export: func(t *testing.T, exp *api.CheckpointExport) {
		mib := freeMiB + 1024
		setManifest(t, exp, map[string]any{"memory_mib": mib, "ram_size": mib << 20})
		declare(exp, "ram/ck-w1.ram", mib<<20)
	}}
	purl := p.start(t)
	burl := b.serveTCP(t, "btok")
	if status, er := postPull(t, burl, "btok", `{"checkpoint":"w1","from":"`+purl+`","token":"tok"}`); status != 507 || er.Error.Code != "insufficient_space" {
		t.Errorf("daemon pull too large for the host: HTTP %d %+v", status, er)
	}

	// More data than declared: a 64 MiB RAM file declared to hold one page of data,
	// whose single range the peer fills with non-zero bytes. The pull stops at the
	// first chunk past the declaration, not after the whole range was written.
	const ramMiB = 64
	var sent atomic.Int64
	done := make(chan struct{})
	over := &fakePeer{upstream: holder, export: func(t *testing.T, exp *api.CheckpointExport) {
		setManifest(t, exp, map[string]any{"memory_mib": ramMiB, "ram_size": ramMiB << 20})
		declare(exp, "ram/ck-w1.ram", ramMiB<<20)
		for i := range exp.Files {
			if exp.Files[i].Name == "ram/ck-w1.ram" {
				exp.Files[i].Data = 4096
			}
		}
	}}
	over.file = func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("name") != "ram/ck-w1.ram" {
			over.files.Add(-1)
			httputil.NewSingleHostReverseProxy(mustURL(t, holder)).ServeHTTP(w, r)
			return
		}
		defer close(done)
		w.Header().Set("Content-Range", fmt.Sprintf("bytes 0-%d/%d", ramMiB<<20-1, ramMiB<<20))
		w.Header().Set("Content-Length", fmt.Sprint(ramMiB<<20))
		w.WriteHeader(http.StatusPartialContent)
		chunk := []byte(strings.Repeat("\xff", 1<<16))
		for i := 0; i < ramMiB<<4; i++ {
			n, err := w.Write(chunk)
			sent.Add(int64(n))
			if err != nil {
				return
			}
		}
	}
	ourl := over.start(t)
	_, err := pull.Checkpoint(context.Background(), b.e, pull.Remote(ourl, "tok"), "w1", nil)
	if !errors.Is(err, engine.ErrDigest) || !strings.Contains(err.Error(), "declared") {
		t.Fatalf("pull of more data than declared = %v, want ErrDigest naming the declaration", err)
	}
	<-done
	if s := sent.Load(); s >= ramMiB<<20 {
		t.Errorf("the peer sent all %d bytes: the overrun was not caught as they arrived", s)
	}
	assertNoPullLeft(t, b, "w1")
}

func mustURL(t *testing.T, s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// stallPeer answers what stall says it should stall on by holding the request until
// the client goes away; everything else is proxied to the holder. started is closed
// when a request stalls.
func stallPeer(t *testing.T, holder string, stall func(r *http.Request) (stall bool, partial int)) (url string, started <-chan struct{}) {
	ch := make(chan struct{})
	var once atomic.Bool
	proxy := httputil.NewSingleHostReverseProxy(mustURL(t, holder))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok, partial := stall(r)
		if !ok {
			proxy.ServeHTTP(w, r)
			return
		}
		if partial > 0 {
			// The real answer's header and its first bytes, then nothing.
			rec := httptest.NewRecorder()
			proxy.ServeHTTP(rec, r)
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			w.Write(rec.Body.Bytes()[:min(partial, rec.Body.Len()-1)])
			w.(http.Flusher).Flush()
		}
		if once.CompareAndSwap(false, true) {
			close(ch)
		}
		<-r.Context().Done()
	}))
	t.Cleanup(srv.Close)
	return srv.URL, ch
}

// TestPullStalledPeer: a holder that stops sending (never answers the export, answers a
// range's header and a few bytes then nothing, never answers a range) fails the pull
// with ErrStalled once the progress deadline passes without a byte, leaving nothing;
// through the daemon (progress_timeout_ms) it is 504 timeout, and from the CLI without
// a daemon its --progress-timeout.
func TestPullStalledPeer(t *testing.T) {
	a, b := newTransferHost(t), newTransferHost(t)
	a.writeCheckpoint(t, "w1", map[int64]byte{0: 1, 700: 3})
	holder := a.serveTCP(t, "tok")
	const deadline = 200 * time.Millisecond
	for _, tc := range []struct {
		name  string
		stall func(r *http.Request) (bool, int)
	}{
		{"export never answered", func(r *http.Request) (bool, int) { return strings.HasSuffix(r.URL.Path, "/export"), 0 }},
		{"export cut short", func(r *http.Request) (bool, int) { return strings.HasSuffix(r.URL.Path, "/export"), 100 }},
		{"range never answered", func(r *http.Request) (bool, int) { return r.URL.Query().Get("name") == "ram/ck-w1.ram", 0 }},
		{"range cut short", func(r *http.Request) (bool, int) { return r.URL.Query().Get("name") == "boot/kernel", 1000 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url, _ := stallPeer(t, holder, tc.stall)
			_, err := pull.Checkpoint(context.Background(), b.e, pull.Remote(url, "tok"), "w1", &pull.Options{ProgressTimeout: deadline})
			if !errors.Is(err, pull.ErrStalled) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("pull = %v, want ErrStalled", err)
			}
			assertNoPullLeft(t, b, "w1")
		})
	}
	url, _ := stallPeer(t, holder, func(r *http.Request) (bool, int) { return strings.HasSuffix(r.URL.Path, "/export"), 0 })
	burl := b.serveTCP(t, "btok")
	if status, er := postPull(t, burl, "btok", `{"checkpoint":"w1","from":"`+url+`","token":"tok","progress_timeout_ms":200}`); status != 504 || er.Error.Code != "timeout" {
		t.Errorf("daemon pull from a stalled peer: HTTP %d %+v, want 504 timeout", status, er)
	}
	if status, er := postPull(t, burl, "btok", `{"checkpoint":"w1","from":"`+url+`","token":"tok","progress_timeout_ms":-1}`); status != 400 || er.Error.Code != "invalid_spec" {
		t.Errorf("negative progress timeout: HTTP %d %+v, want 400 invalid_spec", status, er)
	}
}

// TestPullDefaultProgressTimeout: without an option a pull still has a deadline, of at
// most a minute.
func TestPullDefaultProgressTimeout(t *testing.T) {
	d, err := api.PullRequest{}.ProgressTimeout()
	if err != nil || d <= 0 || d > time.Minute {
		t.Errorf("default progress timeout %v, %v: want (0, 1m]", d, err)
	}
}

// TestPullKilledLeavesNothing: a pulling process killed (SIGKILL) while a file is on its
// way (here the kernel, which the blob store keeps) leaves nothing once the next
// command opens the state directory: every temporary file of a pull is in a place the
// state directory's reaper owns.
func TestPullKilledLeavesNothing(t *testing.T) {
	if os.Getenv("FORKVM_TEST_PULL_CHILD") != "" {
		return // the child's part is TestPullKilledChild
	}
	a, b := newTransferHost(t), newTransferHost(t)
	a.writeCheckpoint(t, "w1", map[int64]byte{0: 1, 700: 3})
	holder := a.serveTCP(t, "tok")
	url, started := stallPeer(t, holder, func(r *http.Request) (bool, int) { return r.URL.Query().Get("name") == "boot/kernel", 1000 })
	b.e.Close() // the child owns b's state directory now
	cmd := exec.Command(os.Args[0], "-test.run=^TestPullKilledChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), "FORKVM_TEST_PULL_CHILD="+b.home, "FORKVM_TEST_PULL_FROM="+url)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case <-started:
	case err := <-exited:
		t.Fatalf("the pulling child ended before the kernel was on its way: %v", err)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	<-exited
	var staged []string
	for _, dir := range []string{filepath.Join(b.home, "s", "checkpoints"), filepath.Join(b.home, "cache")} {
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				staged = append(staged, p)
			}
			return nil
		})
	}
	if len(staged) == 0 {
		t.Fatalf("the killed pull had staged nothing: the test did not catch it mid-file")
	}
	// The next command.
	e, err := openTransferEngine(b.home)
	if err != nil {
		t.Fatal(err)
	}
	b.e = e
	t.Cleanup(func() { e.Close() })
	assertNoPullLeft(t, b, "w1")
}

// TestPullKilledChild is TestPullKilledLeavesNothing's pulling process (skipped unless
// it runs it).
func TestPullKilledChild(t *testing.T) {
	home := os.Getenv("FORKVM_TEST_PULL_CHILD")
	if home == "" {
		t.Skip("the child of TestPullKilledLeavesNothing")
	}
	e, err := openTransferEngine(home)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	_, err = pull.Checkpoint(context.Background(), e, pull.Remote(os.Getenv("FORKVM_TEST_PULL_FROM"), "tok"), "w1", nil)
	t.Fatalf("the pull ended (%v): it should have been killed", err)
}

// openTransferEngine opens the engine of a transferHost's directory home, as
// newTransferHost does.
func openTransferEngine(home string) (*engine.Engine, error) {
	return engine.New(context.Background(), &engine.Config{StateDir: filepath.Join(home, "s"), RAMDir: filepath.Join(home, "ram"),
		CacheDir: filepath.Join(home, "cache"), QEMU: filepath.Join(home, "qemu-system-x86_64"), QEMUImg: "/nonexistent/qemu-img", Accel: engine.AccelTCG})
}

// TestPullRangesInOneRequest: a file's data extents that no gap joins are asked for
// many at a time (multipart/byteranges), at most 256 ranges a request, and arrive
// whole; a holder answering such a request with other parts than asked (one missing,
// out of order, one longer, one more, the whole file) fails the pull with ErrProtocol
// and leaves nothing.
func TestPullRangesInOneRequest(t *testing.T) {
	a, b := newTransferHost(t), newTransferHost(t)
	pages := map[int64]byte{}
	for i := int64(0); i < 300; i++ {
		pages[2*i] = byte(i%250 + 1)
	}
	ram := a.writeCheckpoint(t, "w1", pages)
	holder := a.serveTCP(t, "tok")
	var maxRanges atomic.Int64
	p := &fakePeer{upstream: holder}
	p.file = func(w http.ResponseWriter, r *http.Request) {
		if n := int64(strings.Count(r.Header.Get("Range"), ",") + 1); n > maxRanges.Load() {
			maxRanges.Store(n)
		}
		httputil.NewSingleHostReverseProxy(mustURL(t, holder)).ServeHTTP(w, r)
	}
	purl := p.start(t)
	opts := &pull.Options{MaxGap: 0}
	if _, err := pull.Checkpoint(context.Background(), b.e, pull.Remote(purl, "tok"), "w1", opts); err != nil {
		t.Fatalf("pull: %v", err)
	}
	// The RAM file's 300 extents in two requests (256 + 44), the state and the kernel in one each.
	if n := p.files.Load(); n != 4 {
		t.Errorf("%d file requests, want 4", n)
	}
	if n := maxRanges.Load(); n != 256 {
		t.Errorf("at most %d ranges in a request, want 256", n)
	}
	want, _ := os.ReadFile(ram)
	got, err := os.ReadFile(filepath.Join(b.ram, "ck-w1.ram"))
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("pulled RAM file differs from the holder's (%v)", err)
	}

	// parts answers a multi-range request for the RAM file with the parts edit makes
	// of the ones asked.
	type part struct{ off, n int64 }
	parts := func(edit func([]part) []part) func(w http.ResponseWriter, r *http.Request) {
		return func(w http.ResponseWriter, r *http.Request) {
			spec := r.Header.Get("Range")
			if r.URL.Query().Get("name") != "ram/ck-w1.ram" || !strings.Contains(spec, ",") {
				httputil.NewSingleHostReverseProxy(mustURL(t, holder)).ServeHTTP(w, r)
				return
			}
			var ps []part
			for _, s := range strings.Split(strings.TrimPrefix(spec, "bytes="), ",") {
				var lo, hi int64
				fmt.Sscanf(s, "%d-%d", &lo, &hi)
				ps = append(ps, part{lo, hi - lo + 1})
			}
			var buf bytes.Buffer
			mw := multipart.NewWriter(&buf)
			for _, x := range edit(ps) {
				pw, _ := mw.CreatePart(textproto.MIMEHeader{"Content-Range": {fmt.Sprintf("bytes %d-%d/%d", x.off, x.off+x.n-1, len(want))}})
				pw.Write(want[x.off : x.off+x.n])
			}
			mw.Close()
			w.Header().Set("Content-Type", "multipart/byteranges; boundary="+mw.Boundary())
			w.WriteHeader(http.StatusPartialContent)
			w.Write(buf.Bytes())
		}
	}
	for _, tc := range []struct {
		name string
		file func(w http.ResponseWriter, r *http.Request)
	}{
		{"a part missing", parts(func(ps []part) []part { return ps[:len(ps)-1] })},
		{"out of order", parts(func(ps []part) []part { ps[0], ps[1] = ps[1], ps[0]; return ps })},
		{"a part longer", parts(func(ps []part) []part { ps[3].n += 4096; return ps })},
		{"a part more", parts(func(ps []part) []part { return append(ps, part{ps[len(ps)-1].off + 4096, 4096}) })},
		{"the whole file", func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Query().Get("name") != "ram/ck-w1.ram" {
				httputil.NewSingleHostReverseProxy(mustURL(t, holder)).ServeHTTP(w, r)
				return
			}
			w.Write(want)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTransferHost(t)
			h := &fakePeer{upstream: holder, file: tc.file}
			_, err := pull.Checkpoint(context.Background(), c.e, pull.Remote(h.start(t), "tok"), "w1", opts)
			if !errors.Is(err, api.ErrProtocol) {
				t.Fatalf("pull = %v, want ErrProtocol", err)
			}
			assertNoPullLeft(t, c, "w1")
		})
	}
}
