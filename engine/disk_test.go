package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine/internal/qemu"
	"github.com/forkvm/forkvm/engine/internal/qemu/qemutest"
)

func TestPlanCollapse(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sizes    []int64
		maxDepth int
		keep     int
		ok       bool
	}{
		{"short chain", []int64{100, 1, 1}, 4, 0, false},
		{"at the limit", []int64{100, 1, 1, 1}, 5, 0, false},
		{"one frozen layer", []int64{100}, 1, 0, false},
		{"equal small layers all go but the base", []int64{1000, 10, 10, 10}, 4, 1, true},
		{"a big layer stays", []int64{1000, 500, 10, 10}, 4, 2, true},
		{"newest goes alone when the one below is bigger", []int64{1000, 500, 100, 10}, 4, 3, true},
		{"the base stays even when small", []int64{1, 1, 1, 1}, 4, 1, true},
		{"a long chain comes back under the limit", []int64{1000, 500, 300, 200, 100, 50, 10}, 4, 1, true},
		{"an older layer up to twice what goes goes too", []int64{1000, 30, 10, 10}, 4, 1, true},
		{"a bigger one stays", []int64{1000, 50, 10, 10}, 4, 2, true},
		{"degenerate limit", []int64{1, 1, 1}, 1, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keep, ok := planCollapse(tc.sizes, tc.maxDepth)
			if keep != tc.keep || ok != tc.ok {
				t.Fatalf("planCollapse(%v, %d) = %d, %v; want %d, %v", tc.sizes, tc.maxDepth, keep, ok, tc.keep, tc.ok)
			}
			if ok && keep+1 > tc.maxDepth {
				t.Fatalf("collapsed chain has %d layers, over %d", keep+1, tc.maxDepth)
			}
		})
	}
}

// TestPlanCollapseBoundsWork runs many generations of a chain whose every freeze adds a
// small layer, checking the depth stays bounded and streams copy much less than the
// whole disk each time.
func TestPlanCollapseBoundsWork(t *testing.T) {
	frozen := []int64{1 << 30} // the base
	var active, copied, written int64
	for gen := 0; gen < 5000; gen++ {
		active += 64 << 10 // this generation's writes
		written += 64 << 10
		frozen, active = append(frozen, active), 0 // the freeze: a new empty active layer
		if keep, ok := planCollapse(frozen, maxDiskDepth); ok {
			for _, s := range frozen[keep:] {
				active += s
			}
			copied += active
			frozen = frozen[:keep]
		}
		if len(frozen)+1 > maxDiskDepth {
			t.Fatalf("generation %d: chain of %d layers after the collapse", gen, len(frozen)+1)
		}
	}
	// Each byte written is copied a bounded number of times, not once per generation.
	if copied > 16*written {
		t.Fatalf("streams copied %d bytes for %d written", copied, written)
	}
	t.Logf("copied %.1fx what was written", float64(copied)/float64(written))
}

func TestNodeAndFileNames(t *testing.T) {
	if got := launchNodeName(2, 3); got != "disk0" {
		t.Errorf("top = %s", got)
	}
	if got := launchNodeName(0, 3); got != "disk0-b0" {
		t.Errorf("base = %s", got)
	}
	for n, want := range map[string]bool{"disk0": true, "disk-l1": true, "disk-l12": true, "disk0-b1": false, "disk-lx": false, "#block123": false} {
		if ownDiskNode(n) != want {
			t.Errorf("ownDiskNode(%q) = %v", n, !want)
		}
	}
	for n, want := range map[string]bool{"disk1.qcow2": true, "disk42.qcow2": true, forkTopFile: true, rootTopFile: true,
		"disk0.raw": false, rootBaseFile: false, "disk0.qcow2": false, "manifest.json": false, "diskx.qcow2": false, "disk1.qcow2.tmp": false} {
		if ownLayerFile(n) != want {
			t.Errorf("ownLayerFile(%q) = %v", n, !want)
		}
	}
}

func TestPushOverlayPinsNodeNames(t *testing.T) {
	m := &vmState{DiskNode: "disk0", DiskSeq: 0}
	m.Launch.Disk = []diskLayer{{Path: "/ck/layer0.raw", Format: "raw"}, {Path: "/ck/layer1.qcow2", Format: "qcow2"}, {Path: "/vm/disk-top.qcow2", Format: "qcow2"}}
	m.pushOverlay("disk-l1", "/vm/disk1.qcow2")
	m.pushOverlay("disk-l2", "/vm/disk2.qcow2")
	var got []string
	for _, l := range m.Launch.Disk {
		got = append(got, l.Node)
	}
	want := []string{"disk0-b0", "disk0-b1", "disk0", "disk-l1", "disk-l2"}
	if !slices.Equal(got, want) {
		t.Fatalf("nodes %v, want %v", got, want)
	}
	if m.DiskNode != "disk-l2" || m.DiskSeq != 2 {
		t.Fatalf("top %s seq %d", m.DiskNode, m.DiskSeq)
	}
	// The launch names are the ones the command line gives.
	l := launch{Disk: m.Launch.Disk[:3]}
	bd, err := qemu.BlockdevJSON(l.qemuLaunch().Disk)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range want[:3] {
		if !json.Valid([]byte(bd)) || !strings.Contains(bd, `"node-name":"`+n+`"`) {
			t.Errorf("-blockdev %s lacks node %s", bd, n)
		}
	}
}

// collapseVM is a VM with a five-layer chain whose collapse (keep 1) is recorded, its
// own layer files in its directory, and a QEMU played by handle.
func collapseVM(t *testing.T, handle func(cmd string, args json.RawMessage) (string, string)) (*VM, *qemutest.QMP) {
	t.Helper()
	dir := t.TempDir()
	m := &manifest{Name: "w", DiskNode: "disk-l4", DiskSeq: 4}
	m.Launch.Disk = []diskLayer{{Path: filepath.Join(dir, rawDiskFile), Format: "raw", Node: "disk0"}}
	for i := 1; i <= 4; i++ {
		m.Launch.Disk = append(m.Launch.Disk, diskLayer{Path: nextDiskPath(dir, i-1), Format: "qcow2", Node: nextDiskNode(i - 1)})
	}
	for _, l := range m.Launch.Disk {
		if err := os.WriteFile(l.Path, nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	m.DiskCollapse = &diskCollapse{Job: "collapse-4", Keep: 1, Layers: 5}
	vm := newVM(dir, slog.New(slog.NewTextHandler(io.Discard, nil)), m, layout{})
	f := qemutest.NewQMP(handle)
	sock := f.Listen(t)
	// The QEMU is this test process (alive for the test), its monitor the fake.
	start, err := qemu.ProcStartTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	p := adoptQEMU(m.Name, os.Getpid(), start, sock, "")
	t.Cleanup(p.CloseQMP)
	vm.proc.Store(p)
	return vm, f
}

func TestSettleCollapse(t *testing.T) {
	for _, tc := range []struct {
		name      string
		jobs      string
		depth     int
		wantChain int
		wantGone  []string
	}{
		{"completed", `[{"device":"collapse-4","status":"concluded"}]`, 1, 2, []string{"disk1.qcow2", "disk2.qcow2", "disk3.qcow2"}},
		{"failed", `[{"device":"collapse-4","status":"concluded","error":"io"}]`, 4, 5, nil},
		{"never started", `[]`, 4, 5, nil},
		{"dismissed before a crash", `[]`, 1, 2, []string{"disk1.qcow2", "disk2.qcow2", "disk3.qcow2"}},
		{"unexpected depth", `[]`, 2, 5, nil},
		{"another node on top", `[]`, -1, 5, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var deleted []string
			vm, f := collapseVM(t, func(cmd string, args json.RawMessage) (string, string) {
				switch cmd {
				case "query-block-jobs":
					return tc.jobs, ""
				case "query-block":
					top, depth := "disk-l4", tc.depth
					if depth < 0 {
						top, depth = "#block42", 1
					}
					return fmt.Sprintf(`[{"device":"","qdev":"/machine/peripheral/vda/virtio-backend","inserted":{"node-name":%q,"backing_file_depth":%d}}]`, top, depth), ""
				case "query-named-block-nodes":
					return `[{"node-name":"disk0"},{"node-name":"disk-l1"},{"node-name":"disk-l2"},{"node-name":"disk-l3"},{"node-name":"disk-l4"},{"node-name":"#block1"}]`, ""
				case "blockdev-del":
					var a struct {
						Node string `json:"node-name"`
					}
					json.Unmarshal(args, &a)
					deleted = append(deleted, a.Node)
				}
				return "{}", ""
			})
			if err := vm.locked(func(s *vmState) error { return vm.settleCollapse(context.Background(), s) }); err != nil {
				t.Fatal(err)
			}
			if st := vm.snapshot(); st.DiskCollapse != nil {
				t.Fatalf("record kept: %+v", st.DiskCollapse)
			}
			if st := vm.snapshot(); len(st.Launch.Disk) != tc.wantChain {
				t.Fatalf("chain %d layers, want %d", len(st.Launch.Disk), tc.wantChain)
			}
			saved, err := loadRawManifest(vm.path(manifestFile))
			if err != nil || len(saved.Launch.Disk) != tc.wantChain || saved.DiskCollapse != nil {
				t.Fatalf("saved manifest %+v, %v", saved, err)
			}
			var gone []string
			for _, n := range []string{rawDiskFile, "disk1.qcow2", "disk2.qcow2", "disk3.qcow2", "disk4.qcow2"} {
				if _, err := os.Stat(filepath.Join(vm.dir(), n)); errors.Is(err, os.ErrNotExist) {
					gone = append(gone, n)
				}
			}
			if !slices.Equal(gone, tc.wantGone) {
				t.Fatalf("removed %v, want %v", gone, tc.wantGone)
			}
			if tc.wantGone != nil {
				slices.Sort(deleted)
				if !slices.Equal(deleted, []string{"disk-l1", "disk-l2", "disk-l3"}) {
					t.Fatalf("blockdev-del %v (calls %v)", deleted, f.Commands())
				}
			} else if len(deleted) > 0 {
				t.Fatalf("blockdev-del %v of an unchanged chain", deleted)
			}
		})
	}
}

// A job still running when the context ends: the record stays, nothing is removed.
func TestSettleCollapseRunningJob(t *testing.T) {
	vm, f := collapseVM(t, func(cmd string, _ json.RawMessage) (string, string) {
		return `[{"device":"collapse-4","status":"running"}]`, ""
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if err := vm.locked(func(s *vmState) error { return vm.settleCollapse(ctx, s) }); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want deadline", err)
	}
	if st := vm.snapshot(); st.DiskCollapse == nil || len(st.Launch.Disk) != 5 {
		t.Fatalf("record %+v, chain %d", st.DiskCollapse, len(st.Launch.Disk))
	}
	for _, c := range f.Commands() {
		if c != "query-block-jobs" {
			t.Fatalf("sent %s while the job runs", c)
		}
	}
}

// loadRawManifest reads a manifest without validation (the test VMs have no token).
func loadRawManifest(path string) (*manifest, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var m manifest
	return &m, json.Unmarshal(b, &m)
}

// startCollapse records the job in the manifest before QEMU sees block-stream, streams
// into the active node down to the planned base, and forgets a job QEMU refused.
func TestStartCollapse(t *testing.T) {
	for _, refuse := range []bool{false, true} {
		t.Run(fmt.Sprintf("refused=%v", refuse), func(t *testing.T) {
			var vm *VM
			var args qemu.BlockStreamArgs
			recorded := false
			vm, _ = collapseVM(t, func(cmd string, raw json.RawMessage) (string, string) {
				if cmd != "block-stream" {
					return "{}", ""
				}
				json.Unmarshal(raw, &args)
				saved, err := loadRawManifest(vm.path(manifestFile))
				recorded = err == nil && saved.DiskCollapse != nil && saved.DiskCollapse.Job == args.JobID
				if refuse {
					return "no", "GenericError"
				}
				return "{}", ""
			})
			var m vmState
			_ = vm.locked(func(s *vmState) error {
				s.DiskCollapse = nil
				for i := 5; i <= maxDiskDepth; i++ {
					s.pushOverlay(nextDiskNode(s.DiskSeq), nextDiskPath(vm.dir(), s.DiskSeq))
				}
				vm.startCollapse(context.Background(), s)
				m = *s
				return nil
			})
			if !recorded {
				t.Fatal("block-stream sent before the job was recorded")
			}
			if args.Device != m.DiskNode || args.BaseNode != m.Launch.Disk[0].Node || args.AutoDismiss || args.JobID == "" {
				t.Fatalf("block-stream %+v (top %s, base %s)", args, m.DiskNode, m.Launch.Disk[0].Node)
			}
			if refuse != (m.DiskCollapse == nil) {
				t.Fatalf("record %+v after refused=%v", m.DiskCollapse, refuse)
			}
		})
	}
}

// TestSetBackingName: the header's backing name is replaced (longer and shorter), and
// qemu-img then opens the chain by the new name, relative to the file.
func TestSetBackingName(t *testing.T) {
	qemuImg, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("no qemu-img")
	}
	dir := t.TempDir()
	base, top := filepath.Join(dir, "layer0.raw"), filepath.Join(dir, "top.qcow2")
	for _, args := range [][]string{
		{"create", "-q", "-f", "raw", base, "1M"},
		{"create", "-q", "-u", "-f", "qcow2", "-F", "raw", "-b", "/nonexistent/vms/w1/disk30.raw", top, "1M"},
	} {
		if out, err := exec.Command(qemuImg, args...).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img %v: %v %s", args, err, out)
		}
	}
	if err := exec.Command(qemuImg, "check", "-q", top).Run(); err == nil {
		t.Fatal("the chain opened with its backing missing")
	}
	if err := setBackingName(top, "layer0.raw"); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(qemuImg, "info", "--backing-chain", top).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "backing file: layer0.raw") {
		t.Fatalf("after renaming: %v %s", err, out)
	}
	if err := setBackingName(top, strings.Repeat("x", 70000)); err == nil {
		t.Error("a name larger than the header cluster was written")
	}
}
