package engine

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/minio/highwayhash"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/memfile"
)

// The park's pause. The guest is stopped only while its state is captured: its device
// state saved and its own pages extracted into park.tmp-* (the page cache), and a
// record without digests written. The image is then committed (renamed to park) at
// once; digesting it and flushing it to disk, most of a park's time, follow the
// commit, while the stopped QEMU still exists: the flushes start as soon as the files
// are whole and run while they are digested; the record gets its digests (flushed);
// then the manifest says parked and the QEMU ends.
//
// The commit before the flush keeps the transitions' promise (see the package's
// parking notes): a kill -9 of the engine or of QEMU leaves the files in the page
// cache, so from the rename on the image is whole for any process that reads it, and
// recovery parks the VM. A recovery that finds a record without digests (a park cut
// short before they were written) digests the files if it runs in the boot that wrote
// them (parkState.BootID), whose page cache has them whole; after a restart the flush
// may not have finished, so the VM is listed dead (as a running VM is after a power
// loss) and the image kept. A flush that fails takes the image back out (renamed to a
// park.tmp-* name, which recovery removes) before the guest is resumed, so the VM is
// parked while the image is in place and running once it is not. Park returns only
// once the image, its record and the manifest are on disk.

// parkClock records a park's steps as they end (api.ParkResult.Phases): each lap is
// the time since the previous one.
type parkClock struct {
	last   time.Time
	phases []api.ParkPhase
}

func newParkClock() *parkClock { return &parkClock{last: time.Now()} }

// lap ends the step name.
func (c *parkClock) lap(name string) {
	now := time.Now()
	c.phases = append(c.phases, api.ParkPhase{Name: name, Duration: now.Sub(c.last)})
	c.last = now
}

// parkPause is the park's part under the VM's lock: the guest is stopped, its image
// captured and committed, digested and flushed, and the manifest recorded parked.
// Until the image is durable a failure removes it and resumes the guest. paused is the
// guest's stop until the commit.
func (e *Engine) parkPause(ctx context.Context, vm *VM, pm *checkpointManifest, handoff string, clk *parkClock) (ps *parkState, paused time.Duration, err error) {
	name := vm.Name()
	err = vm.locked(func(s *vmState) error {
		p := vm.process()
		if p == nil || !p.Running() {
			return fmt.Errorf("%w: %s", ErrNotRunning, name)
		}
		tmp := vm.path(parkTmpPrefix + randHex(4))
		if err := os.Mkdir(tmp, 0o700); err != nil {
			return fmt.Errorf("engine: park %s: %w", name, err)
		}
		var img *parkImage
		committed := false
		defer func() {
			if img != nil {
				img.wait() // its flushes hold the files open
			}
			if !committed {
				os.RemoveAll(tmp)
			}
		}()
		t := time.Now()
		if err := p.stopGuest(ctx); err != nil {
			return vm.failure("park", err)
		}
		clk.lap("stop")
		defer func() {
			if !committed {
				if rerr := p.resume(); rerr != nil {
					e.log.Warn("park failed and the guest cannot be resumed", "vm", name, "err", rerr)
				}
			}
		}()
		e.marker(name, ParkStageSave)
		var err error
		if img, err = captureParkImage(ctx, p, s, e.paths, pm, tmp, handoff, clk); err != nil {
			return vm.failure("park", err)
		}
		e.marker(name, ParkStageCommit)
		image := vm.path(parkDirName)
		if err := os.Rename(tmp, image); err != nil {
			return fmt.Errorf("engine: park %s: commit: %w", name, err)
		}
		committed = true
		// From here on the VM is parked: its old QEMU never runs again unless the
		// image cannot be made durable and is taken back out.
		paused = time.Since(t)
		clk.lap("commit")
		e.marker(name, ParkStageSync)
		if err := img.finish(ctx, image, vm.dir(), clk); err != nil {
			back := vm.path(parkTmpPrefix + randHex(4))
			if rerr := os.Rename(image, back); rerr != nil {
				// Still in place: the VM is parked (recovery would say so too), and
				// its QEMU must not run again; the image may not be durable.
				e.log.Warn("park: the image cannot be finished nor taken back out: parked as it is", "vm", name, "err", err, "rename", rerr)
				if !img.ps.digested() {
					return fmt.Errorf("engine: park %s: %w (its image is in place, without digests: the next engine verifies it)", name, err)
				}
			} else {
				syncDir(vm.dir())
				tmp, committed = back, false
				return fmt.Errorf("engine: park %s: %w", name, err)
			}
		}
		ps = img.ps
		e.marker(name, ParkStageRecord)
		s.State, s.Park = StateParked, ps
		err = vm.saveSync(s)
		clk.lap("record")
		return err
	})
	return ps, paused, err
}

// parkImage is a captured park image: its record (without digests until finish), and
// the flushes of its data files, started as soon as they were whole.
type parkImage struct {
	ps      *parkState
	flushes sync.WaitGroup
	errs    [2]error
	waited  bool
}

// captureParkImage writes the stopped guest's device state and the pages it holds
// beyond its lineage (pm, the checkpoint it is a fork of) into dir, starts flushing
// them, and writes park.json without digests (not yet flushed: parkImage.finish).
func captureParkImage(ctx context.Context, p *qemuProc, s *vmState, paths layout, pm *checkpointManifest, dir, handoff string, clk *parkClock) (*parkImage, error) {
	state := filepath.Join(dir, stateFile)
	if err := p.saveDevices(ctx, state); err != nil {
		return nil, err
	}
	clk.lap("devices")
	size := pm.RAMSize
	addr, err := memfile.FindMapping(s.PID, s.Launch.RAM.Path, size)
	if err != nil {
		return nil, err
	}
	var ancestors []string
	for _, l := range pm.Layers {
		ancestors = append(ancestors, l.Path)
	}
	base, upper := deltaBase(paths, pm, s.Launch.RAM.Path, s.RAMBaseLayers, ancestors)
	layer := filepath.Join(dir, parkLayerFile)
	// Its pages are not written back while they are extracted: the writeback's block
	// allocation contends with the extraction's writes and lengthens the pause; the
	// flush starts right after it.
	if _, err := memfile.ExtractDelta(s.PID, addr, size, base, upper, layer); err != nil {
		return nil, fmt.Errorf("extract pages: %w", err)
	}
	clk.lap("extract")
	img := &parkImage{ps: &parkState{Stage: parkStageParked, At: time.Now().UTC(), Handoff: handoff, BootID: hostBootID()}}
	// The flushes hold their files open: they go on after the directory's rename.
	for i, path := range []string{state, layer} {
		f, err := os.OpenFile(path, os.O_RDWR, 0)
		if err != nil {
			img.wait()
			return nil, err
		}
		img.flushes.Add(1)
		go func() {
			defer img.flushes.Done()
			img.errs[i] = f.Sync()
			if cerr := f.Close(); img.errs[i] == nil {
				img.errs[i] = cerr
			}
		}()
	}
	// Written in place: the directory's rename is what makes it visible.
	b, err := json.Marshal(img.ps)
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, parkRecord), b, 0o600)
	}
	if err != nil {
		img.wait()
		return nil, err
	}
	clk.lap("mark")
	return img, nil
}

// wait waits for the data files' flushes and returns their error.
func (img *parkImage) wait() error {
	if !img.waited {
		img.flushes.Wait()
		img.waited = true
	}
	return errors.Join(img.errs[:]...)
}

// finish makes the committed image (now at image, in the VM's directory vmDir)
// whole and durable: the digests, taken while the data files are flushed, go into its
// record (flushed), then the data files' flushes and the rename are waited for.
func (img *parkImage) finish(ctx context.Context, image, vmDir string, clk *parkClock) error {
	if err := digestParkImage(ctx, image, img.ps); err != nil {
		img.wait()
		return err
	}
	clk.lap("digest")
	err := writeJSONSync(filepath.Join(image, parkRecord), img.ps)
	if ferr := img.wait(); err == nil {
		err = ferr
	}
	if err != nil {
		return fmt.Errorf("flush: %w", err)
	}
	syncDir(vmDir)
	clk.lap("sync")
	return nil
}

// parkHashHighway is parkState.Hash for HighwayHash-256 under parkHashKey. A park
// image is a checksum's matter, not a signature's: it never leaves the host, and
// whoever can change its files can change its record as well. HighwayHash runs at
// about ten times SHA-256's speed (with the CPU's SHA extensions) here, and a park
// waits for its digests.
const parkHashHighway = "highwayhash256"

// parkHashKey is HighwayHash's key for park images: fixed, so that any engine
// verifies any image (it is no secret).
var parkHashKey = []byte("forkvm park image checksum key..")

// digestParkImage sets ps's digests (parkHashHighway) and sizes from the image's files:
// the device state's and the page layer's, at once.
func digestParkImage(ctx context.Context, image string, ps *parkState) error {
	var (
		wg                   sync.WaitGroup
		stateSum, layerSum   string
		stateN, layerN       int64
		stateErr, layerErr   error
		statePath, layerPath = filepath.Join(image, stateFile), filepath.Join(image, parkLayerFile)
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		stateSum, stateN, stateErr = parkHashFile(ctx, statePath, false)
	}()
	layerSum, layerN, layerErr = parkHashFile(ctx, layerPath, true)
	wg.Wait()
	if err := errors.Join(stateErr, layerErr); err != nil {
		return fmt.Errorf("%w: parked image: %v", ErrCheckpointCorrupt, err)
	}
	ps.Hash, ps.StateHash, ps.StateSize, ps.LayerHash, ps.LayerSize = parkHashHighway, stateSum, stateN, layerSum, layerN
	return nil
}

// checkParkImageHashes verifies a park image whose record has parkHashHighway digests.
func checkParkImageHashes(ctx context.Context, dir string, ps *parkState) error {
	got := *ps
	if err := digestParkImage(ctx, dir, &got); err != nil {
		return err
	}
	if got.StateHash != ps.StateHash || got.StateSize != ps.StateSize {
		return fmt.Errorf("%w: parked device state does not match its record", ErrCheckpointCorrupt)
	}
	if got.LayerHash != ps.LayerHash || got.LayerSize != ps.LayerSize {
		return fmt.Errorf("%w: parked pages do not match their record", ErrCheckpointCorrupt)
	}
	return nil
}

// parkHashFile is the HighwayHash-256 (parkHashKey) of a park image's file and the
// bytes it covers: of a sparse layer, its size, then each data extent's offset and
// length (little endian) and bytes, so that the cost is the pages it holds; of any
// other file, its bytes. It stops with ctx's error when ctx ends.
func parkHashFile(ctx context.Context, path string, sparse bool) (string, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return "", 0, err
	}
	h, err := highwayhash.New(parkHashKey)
	if err != nil {
		return "", 0, err
	}
	exts := []memfile.Extent{{Off: 0, Len: st.Size()}}
	if sparse {
		if exts, err = memfile.DataExtents(f, st.Size()); err != nil {
			return "", 0, err
		}
		var hdr [8]byte
		binary.LittleEndian.PutUint64(hdr[:], uint64(st.Size()))
		h.Write(hdr[:])
	}
	buf := make([]byte, 1<<20)
	var n int64
	for _, e := range exts {
		if sparse {
			var hdr [16]byte
			binary.LittleEndian.PutUint64(hdr[:8], uint64(e.Off))
			binary.LittleEndian.PutUint64(hdr[8:], uint64(e.Len))
			h.Write(hdr[:])
		}
		for off := e.Off; off < e.Off+e.Len; {
			if err := ctx.Err(); err != nil {
				return "", 0, err
			}
			m, err := f.ReadAt(buf[:min(int64(len(buf)), e.Off+e.Len-off)], off)
			if err != nil && !(errors.Is(err, io.EOF) && m > 0) {
				return "", 0, fmt.Errorf("%s: %w", path, err)
			}
			h.Write(buf[:m])
			off += int64(m)
			n += int64(m)
		}
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// digested reports whether the record has its digests (a park cut short between its
// commit and its digests has not).
func (p *parkState) digested() bool {
	return p.Hash != "" && p.StateHash != "" && p.LayerHash != "" || p.StateSHA256 != "" && p.LayerSHA256 != ""
}

// hostBootID identifies the host's boot ("" where it cannot be read).
func hostBootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
