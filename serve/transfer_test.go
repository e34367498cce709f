package serve

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve/pull"
)

// transferHost is an engine on its own directories (a host) with a fake QEMU.
type transferHost struct {
	e                 *engine.Engine
	home, ram, kernel string
}

func newTransferHost(t *testing.T) *transferHost {
	t.Helper()
	home, err := os.MkdirTemp("/tmp", "fvt-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(home) })
	q := filepath.Join(home, "qemu-system-x86_64")
	os.WriteFile(q, []byte("#!/bin/sh\necho 'QEMU emulator version 10.0.2 (fake)'\n"), 0o755)
	h := &transferHost{home: home, ram: filepath.Join(home, "ram"), kernel: filepath.Join(home, "vmlinuz")}
	os.WriteFile(h.kernel, []byte(strings.Repeat("kernel", 5000)), 0o600)
	t.Setenv("FORKVM_ACCEL", "")
	h.e, err = engine.New(context.Background(), &engine.Config{StateDir: filepath.Join(home, "s"), RAMDir: h.ram,
		CacheDir: filepath.Join(home, "cache"), QEMU: q, QEMUImg: "/nonexistent/qemu-img", Accel: engine.AccelTCG})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.e.Close() })
	return h
}

// writeCheckpoint hand-makes a 4 MiB world checkpoint (format 2 manifest) whose RAM
// file holds the given pages (the rest holes).
func (h *transferHost) writeCheckpoint(t *testing.T, name string, pages map[int64]byte) string {
	t.Helper()
	dir := filepath.Join(h.home, "s", "checkpoints", name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	state := []byte("QEVM device state of " + name)
	os.WriteFile(filepath.Join(dir, "state.mig"), state, 0o600)
	sum := sha256.Sum256(state)
	ram := filepath.Join(h.ram, "ck-"+name+".ram")
	f, err := os.OpenFile(ram, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(4 << 20)
	for pg, b := range pages {
		f.WriteAt([]byte(strings.Repeat(string([]byte{b}), 4096)), pg*4096)
	}
	f.Close()
	m := map[string]any{"version": 2, "name": name, "source": "w0", "created_at": time.Now().UTC(),
		"qemu_version": "10.0.2", "accel": "tcg", "machine": "q35", "cpus": 1, "memory_mib": 4,
		"kernel": h.kernel, "append": "console=ttyS0", "ram_path": "ck-" + name + ".ram", "ram_size": 4 << 20,
		"state_sha256": hex.EncodeToString(sum[:]), "state_size": len(state), "ram_method": "copy"}
	b, _ := json.Marshal(m)
	if err := os.WriteFile(filepath.Join(dir, "manifest.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	return ram
}

// serveTCP serves h's API on a loopback listener with a bearer token.
func (h *transferHost) serveTCP(t *testing.T, token string) string {
	t.Helper()
	srv := httptest.NewServer(New(h.e, nil).TokenHandler(token))
	t.Cleanup(srv.Close)
	return srv.URL
}

// TestExportAndRangeServing: the export lists the RAM file's data extents and digest,
// a Range request gets exactly its bytes (206), the file endpoint serves only files
// the export lists, and both need the token over TCP.
func TestExportAndRangeServing(t *testing.T) {
	h := newTransferHost(t)
	ram := h.writeCheckpoint(t, "w1", map[int64]byte{1: 7, 2: 8, 500: 9})
	url := h.serveTCP(t, "tok")
	ctx := context.Background()
	exp, err := pull.Remote(url, "tok").ExportCheckpoint(ctx, "w1")
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]api.CheckpointFile{}
	for _, f := range exp.Files {
		byName[f.Name] = f
	}
	rf, ok := byName["ram/ck-w1.ram"]
	want := []api.Extent{{Off: 4096, Len: 8192}, {Off: 500 * 4096, Len: 4096}}
	if !ok || fmt.Sprint(rf.Extents) != fmt.Sprint(want) || rf.Data != 3*4096 || rf.Size != 4<<20 || len(rf.SHA256) != 64 {
		t.Fatalf("ram file %+v, want extents %v", rf, want)
	}
	for _, n := range []string{"state.mig", "boot/kernel"} {
		if _, ok := byName[n]; !ok {
			t.Errorf("export lacks %s: %+v", n, exp.Files)
		}
	}
	if strings.Contains(string(exp.Manifest), h.home) {
		t.Errorf("exported manifest names the holder's directories: %s", exp.Manifest)
	}
	// One range.
	body, err := pull.Remote(url, "tok").ReadCheckpointFile(ctx, "w1", "ram/ck-w1.ram", 8192, 4096+10)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(body)
	body.Close()
	if len(b) != 4106 || b[0] != 8 || b[4095] != 8 || b[4096] != 0 {
		t.Errorf("range: %d bytes, first %d", len(b), b[0])
	}
	raw, _ := os.ReadFile(ram)
	_ = raw
	// Not listed, or without the token: refused.
	for _, tc := range []struct {
		path, token string
		status      int
	}{
		{"/v1/checkpoints/w1/export/file?name=../../s/lock", "tok", 404},
		{"/v1/checkpoints/w1/export/file?name=manifest.json", "tok", 404},
		{"/v1/checkpoints/w1/export/file", "tok", 400},
		{"/v1/checkpoints/nope/export", "tok", 404},
		{"/v1/checkpoints/w1/export", "bad", 401},
		{"/v1/checkpoints/w1/export/file?name=state.mig", "", 401},
		{"/v1/checkpoints/w1/export/file?name=state.mig", "tok", 200},
	} {
		req, _ := http.NewRequest("GET", url+tc.path, nil)
		if tc.token != "" {
			req.Header.Set("Authorization", "Bearer "+tc.token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s (token %q): HTTP %d, want %d", tc.path, tc.token, resp.StatusCode, tc.status)
		}
	}
}

// TestPullOverHTTP: a pull through the daemon's endpoint copies the checkpoint with its
// holes kept and loads on the puller; again, nothing is fetched; a byte changed at the
// holder after its digest was recorded is digest_mismatch (ErrDigest through the
// client) and leaves nothing.
func TestPullOverHTTP(t *testing.T) {
	a, b := newTransferHost(t), newTransferHost(t)
	ram := a.writeCheckpoint(t, "w1", map[int64]byte{0: 1, 700: 2})
	url := a.serveTCP(t, "secret")
	ctx := context.Background()
	res, err := pull.Checkpoint(ctx, b.e, pull.Remote(url, "secret"), "w1", &pull.Options{MaxRange: 8192, MaxGap: 0})
	if err != nil {
		t.Fatalf("pull: %v", err)
	}
	if res.Present || res.FilesFetched != 3 || res.Bytes != 2*4096+int64(len("QEVM device state of w1"))+30000 || res.Checkpoint.Name != "w1" {
		t.Errorf("result %+v", res)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(b.ram, "ck-w1.ram"), &st); err != nil || st.Blocks*512 > 64<<10 {
		t.Errorf("pulled RAM file holds %d bytes (%v): holes not kept", st.Blocks*512, err)
	}
	res2, err := pull.Checkpoint(ctx, b.e, pull.Remote(url, "secret"), "w1", nil)
	if err != nil || !res2.Present || res2.Bytes != 0 {
		t.Errorf("second pull: %+v %v", res2, err)
	}
	// Wrong token: refused by the holder.
	if _, err := pull.Checkpoint(ctx, b.e, pull.Remote(url, "wrong"), "w2", nil); err == nil {
		t.Errorf("pull with a wrong token succeeded")
	}
	// Corrupt at the holder after the digest was recorded.
	a.writeCheckpoint(t, "w2", map[int64]byte{3: 4})
	if _, err := a.e.ExportCheckpoint(ctx, "w2"); err != nil {
		t.Fatal(err)
	}
	f, _ := os.OpenFile(filepath.Join(a.ram, "ck-w2.ram"), os.O_RDWR, 0)
	f.WriteAt([]byte{5}, 3*4096+100)
	f.Close()
	_, err = pull.Checkpoint(ctx, b.e, pull.Remote(url, "secret"), "w2", nil)
	if !errors.Is(err, engine.ErrDigest) {
		t.Fatalf("corrupted holder: %v, want ErrDigest", err)
	}
	if _, err := b.e.CheckpointInfo("w2"); !errors.Is(err, engine.ErrNotFound) {
		t.Errorf("after a digest mismatch: %v", err)
	}
	ents, _ := os.ReadDir(b.ram)
	for _, e := range ents {
		if strings.Contains(e.Name(), "w2") {
			t.Errorf("left %s", e.Name())
		}
	}
	// Through the puller's own daemon endpoint, the error keeps its code.
	burl := b.serveTCP(t, "btok")
	if status, er := postPull(t, burl, "btok", `{"checkpoint":"w2","from":"`+url+`","token":"secret"}`); status != 502 || er.Error.Code != "digest_mismatch" {
		t.Errorf("daemon pull of a corrupted checkpoint: HTTP %d %+v", status, er)
	}
	_ = ram
}

// TestPullFromNodeNeedsAFleet: a pull whose from names a node (no URL) is the fleet's:
// a daemon in no fleet answers 409 no_fleet; bad names are refused first.
func TestPullFromNodeNeedsAFleet(t *testing.T) {
	b := newTransferHost(t)
	burl := b.serveTCP(t, "btok")
	for _, c := range []struct {
		body, code string
		status     int
	}{
		{`{"checkpoint":"w1","from":"h2"}`, api.CodeNoFleet, 409},
		{`{"checkpoint":"w1","from":""}`, "invalid_spec", 400},
		{`{"checkpoint":"a,b","from":"h2"}`, "invalid_name", 400},
		{`{"checkpoint":"w1","from":"ftp://h2"}`, "invalid_spec", 400},
		{`{"checkpoint":"w1","from":"10.0.0.2:7070"}`, "invalid_spec", 400},
	} {
		if status, er := postPull(t, burl, "btok", c.body); status != c.status || er.Error.Code != c.code {
			t.Errorf("%s: HTTP %d %+v, want %d %s", c.body, status, er, c.status, c.code)
		}
	}
}

// postPull posts body to the daemon at burl's POST /v1/checkpoints/pull with token and
// returns the status and the error object of its answer.
func postPull(t *testing.T, burl, token, body string) (int, ErrorResponse) {
	t.Helper()
	hreq, _ := http.NewRequest("POST", burl+"/v1/checkpoints/pull", strings.NewReader(body))
	hreq.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(hreq)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var er ErrorResponse
	json.NewDecoder(resp.Body).Decode(&er)
	return resp.StatusCode, er
}
