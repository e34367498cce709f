//go:build linux

package tests

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/memfile"
)

// peer pulls a checkpoint from a hostile holder on loopback (the chaos run's peer
// faults): a malicious one declaring a 4 GiB RAM file for a checkpoint of 256 MiB (the
// pull must fail before it asks for a byte), a stalled one whose export never answers
// (the pull must fail at its progress deadline, not hang), and one that trickles the
// kernel in while the pulling CLI is killed (SIGKILL). None may leave the checkpoint, a
// temporary checkpoint directory, a RAM file or a temporary blob once the next command
// ran.
func (c *chaosRun) peer() { c.peerOf([]string{"malicious", "stalled", "killed"}[c.rng.Intn(3)]) }

// peerOf is peer with a peer of mode ("malicious", "stalled" or "killed"); the run
// plans one of each.
func (c *chaosRun) peerOf(mode string) {
	var accel api.Accel
	for _, inf := range c.ls() {
		accel = inf.Accel
	}
	if accel != "" {
		c.peerPull(accel, mode)
	}
}

// peerPull is peer's pull from a peer of mode ("malicious", "stalled" or "killed") of
// a checkpoint made with accel.
func (c *chaosRun) peerPull(accel api.Accel, mode string) {
	t := c.t
	ver := qemuVersion()
	if ver == "" {
		t.Errorf("no QEMU version for the peer's checkpoint")
		return
	}
	name := c.name("pulled")
	exp := fakeExport(name, string(accel), ver, mode == "malicious")
	var fileReqs atomic.Int64
	started := make(chan struct{})
	var once atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.HasSuffix(r.URL.Path, "/export"):
			if mode == "stalled" {
				<-r.Context().Done()
				return
			}
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(exp)
		case strings.HasSuffix(r.URL.Path, "/export/file"):
			fileReqs.Add(1)
			serveFakeRange(w, r, exp, func() {
				if once.CompareAndSwap(false, true) {
					close(started)
				}
			})
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	c.faults["peer-"+mode]++
	switch mode {
	case "malicious", "stalled":
		out, err := c.cli("checkpoint", "pull", name, "--from", srv.URL, "--progress-timeout", "1s")
		if err == nil {
			t.Errorf("pull from a %s peer succeeded: %s", mode, out)
		} else if mode == "stalled" && !strings.Contains(err.Error(), "stalled") {
			t.Errorf("pull from a stalled peer: %v, want the stall named", err)
		}
		if n := fileReqs.Load(); mode == "malicious" && n != 0 {
			t.Errorf("pull from a malicious peer asked for %d files before refusing", n)
		}
	case "killed":
		cmd := daemonCmd(context.Background(), c.home, "checkpoint", "pull", name, "--from", srv.URL)
		cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-started:
			cmd.Process.Signal(syscall.SIGKILL)
			<-done
		case err := <-done:
			t.Errorf("pull from a trickling peer ended before it was killed: %v", err)
		}
		if _, err := c.cli("ls"); err != nil { // the next command
			t.Errorf("ls after a killed pull: %v", err)
		}
	}
	c.checkNoPull(name)
}

// checkNoPull fails the run if anything of pulled checkpoint name or any pull's
// temporary file is in the state directory, its RAM directory or the blob store.
func (c *chaosRun) checkNoPull(name string) {
	for _, dir := range []string{filepath.Join(c.home, "checkpoints"), defaultRAMDir(c.home), filepath.Join(cacheDir, "blobs")} {
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && p != dir && (strings.Contains(d.Name(), name) || strings.HasPrefix(d.Name(), ".tmp-")) {
				c.t.Errorf("a pull left %s", p)
			}
			return nil
		})
	}
}

// fakeExport is the export of a made-up world checkpoint name of 256 MiB of RAM (all
// zeros), a short device state and a 1 MiB kernel; malicious declares its RAM file 4 GiB.
func fakeExport(name, accel, qemuVer string, malicious bool) *api.CheckpointExport {
	state := []byte("QEVM fake device state of " + name)
	sum := sha256.Sum256(state)
	const ram, kernel = 256 << 20, 1 << 20
	m := map[string]any{"version": 2, "name": name, "source": "elsewhere", "created_at": time.Now().UTC(),
		"qemu_version": qemuVer, "accel": accel, "machine": "q35", "cpus": 1, "memory_mib": ram >> 20,
		"kernel": "boot/kernel", "append": "console=ttyS0", "ram_path": "ck-" + name + ".ram", "ram_size": ram,
		"state_sha256": hex.EncodeToString(sum[:]), "state_size": len(state), "ram_method": "copy"}
	mb, _ := json.Marshal(m)
	// All holes: nothing of it travels.
	ramFile := api.CheckpointFile{Name: "ram/ck-" + name + ".ram", Size: ram, SHA256: contentSum(nil, ram)}
	if malicious {
		ramFile.Size, ramFile.Data, ramFile.Extents = 4<<30, 4<<30, []api.Extent{{Off: 0, Len: 4 << 30}}
	}
	return &api.CheckpointExport{Schema: api.CheckpointExportSchema, Checkpoint: name, Manifest: mb, QEMUVersion: qemuVer, Accel: accel,
		Files: []api.CheckpointFile{
			fakeFile("state.mig", state, int64(len(state))),
			ramFile,
			fakeFile("boot/kernel", fakeKernel(kernel), kernel),
		}}
}

func fakeKernel(n int) []byte { return []byte(strings.Repeat("k", n)) }

func fakeFile(name string, b []byte, size int64) api.CheckpointFile {
	return api.CheckpointFile{Name: name, Size: size, SHA256: contentSum(b, size), Data: int64(len(b)), Extents: []api.Extent{{Off: 0, Len: size}}}
}

// contentSum is memfile.ContentDigest of a file of size bytes holding b at offset 0.
func contentSum(b []byte, size int64) string {
	h := memfile.NewContentHash(size)
	if len(b) > 0 {
		h.Add(0, b)
	}
	return h.Sum()
}

// serveFakeRange answers a Range request for a file of exp: the state file whole, the
// kernel's first bytes and then nothing (calling trickling), the rest zeros.
func serveFakeRange(w http.ResponseWriter, r *http.Request, exp *api.CheckpointExport, trickling func()) {
	var off, last int64
	if _, err := fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &off, &last); err != nil {
		http.Error(w, "bad range", 400)
		return
	}
	file := r.URL.Query().Get("name")
	var size int64
	for _, f := range exp.Files {
		if f.Name == file {
			size = f.Size
		}
	}
	n := last - off + 1
	w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", off, last, size))
	w.Header().Set("Content-Length", fmt.Sprint(n))
	w.WriteHeader(http.StatusPartialContent)
	switch {
	case file == "state.mig":
		w.Write([]byte("QEVM fake device state of " + exp.Checkpoint)[off : off+n])
	case file == "boot/kernel":
		w.Write(fakeKernel(int(min(n, 4096))))
		w.(http.Flusher).Flush()
		trickling()
		<-r.Context().Done()
	default:
		io.CopyN(w, zeroReader{}, n)
	}
}

type zeroReader struct{}

func (zeroReader) Read(b []byte) (int, error) {
	clear(b)
	return len(b), nil
}

var qemuVersionRE = regexp.MustCompile(`version (\d+\.\d+\.\d+)`)

// qemuVersion is the QEMU version in PATH ("10.0.2"), or "".
func qemuVersion() string {
	out, err := exec.Command("qemu-system-x86_64", "--version").Output()
	if err != nil {
		return ""
	}
	if m := qemuVersionRE.FindSubmatch(out); m != nil {
		return string(m[1])
	}
	return ""
}
