package engine

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// ckWriter writes one checkpoint: its files go to a temporary directory (and a temporary
// RAM file) and commit renames them into place. The directory rename is the commit
// point: a crash before it leaves a .tmp- directory that the next engine reaps, never a
// half-written checkpoint.
type ckWriter struct {
	paths   layout
	qemuImg string
	ck      *checkpointManifest
	t0      time.Time
	t0At    stamp       // t0 on the spans' clocks
	marker  PhaseMarker // Config.Markers (nil: none)

	tmp, final       string // checkpoint directory: being written, committed
	ramTmp, ramFinal string // RAM file: being written, committed
	// A delta checkpoint's layer directory (being written, committed), and the hole list
	// of its root RAM file, copied from its parent instead of measured (the root file's
	// holes may be faulted in by running forks right now).
	layersTmp, layersFinal string
	holesFrom              string
	// pausedAt is when the guest stopped (the save returned); committed: the commit ran.
	pausedAt  time.Time
	committed bool
	// gate, when set, runs before the commit renames anything into place: an early
	// fork's QEMU opens files at their temporary paths (see earlyFork).
	gate func()
	// templateTop, when set, is the frozen disk top an overlay template already in tmp
	// was made for (by an early fork, which copied it): the commit keeps that template
	// if the chain froze with that top, and makes it anew otherwise.
	templateTop string
}

// newCkWriter starts writing checkpoint name.
func newCkWriter(paths layout, qemuImg, name string) (*ckWriter, error) {
	w := &ckWriter{paths: paths, qemuImg: qemuImg, t0: time.Now(), t0At: clockStamp(),
		tmp: paths.tmpCheckpointDir(name), final: paths.checkpointDir(name), ramFinal: paths.checkpointRAM(name)}
	w.ramTmp = w.ramFinal + ".tmp-" + randHex(4)
	if err := os.Mkdir(w.tmp, 0o700); err != nil {
		return nil, fmt.Errorf("engine: checkpoint dir: %w", err)
	}
	return w, nil
}

// phase starts the checkpoint's phase name (told to the marker); end records its span.
// A phase that fails is ended too (its marker), with its span: the manifest is not
// committed then.
func (w *ckWriter) phase(name string) (end func()) {
	start := clockStamp()
	if w.marker != nil {
		w.marker.PhaseStart(w.ck.Name, name)
	}
	done := false
	return func() {
		if done {
			return
		}
		done = true
		if w.marker != nil {
			w.marker.PhaseEnd(w.ck.Name, name)
		}
		at := clockStamp()
		w.ck.Spans = append(w.ck.Spans, Span{Name: name, StartMono: start.mono, EndMono: at.mono, StartBoot: start.boot, EndBoot: at.boot})
	}
}

// statePath is where the device state is saved.
func (w *ckWriter) statePath() string { return filepath.Join(w.tmp, stateFile) }

// commit completes the checkpoint from its files and renames it into place: the RAM
// file first, then the directory (reaping removes RAM files without a checkpoint dir).
// It runs once per checkpoint (runCheckpoint, or the pause of a kind that hands off).
func (w *ckWriter) commit(ctx context.Context) error {
	if w.committed {
		return fmt.Errorf("engine: checkpoint %s: committed twice", w.ck.Name)
	}
	ck := w.ck
	if w.gate != nil {
		w.gate()
	}
	sum, size, err := fileSHA256(ctx, w.statePath())
	if err != nil {
		return fmt.Errorf("engine: checkpoint state: %w", err)
	}
	ck.StateSHA256, ck.StateSize = sum, size
	// Disk paths are recorded at their final location.
	for i := range ck.Disk {
		ck.Disk[i].Path = filepath.Join(w.final, filepath.Base(ck.Disk[i].Path))
	}
	if len(ck.Disk) > 0 {
		if w.templateTop != "" && w.templateTop == ck.Disk[len(ck.Disk)-1].Path {
			ck.OverlayTemplate = filepath.Join(w.final, overlayTemplateFile)
		} else {
			os.Remove(filepath.Join(w.tmp, overlayTemplateFile))
			if err := makeOverlayTemplate(ctx, w.qemuImg, ck, w.tmp, w.final); err != nil {
				return err
			}
		}
	}
	if _, err := os.Stat(filepath.Join(w.tmp, stubKernelFile)); err == nil {
		ck.ForkKernel = filepath.Join(w.final, stubKernelFile) // written for an early fork
	} else if ok, err := writeStubKernel(ck.Kernel, filepath.Join(w.tmp, stubKernelFile)); err != nil {
		return fmt.Errorf("engine: checkpoint stub kernel: %w", err)
	} else if ok {
		ck.ForkKernel = filepath.Join(w.final, stubKernelFile)
	}
	// The RAM file's holes are pages nobody wrote: remember them, so that pages forks
	// fault into them later can be punched back out (checkpointStore.punch).
	// The list is covered by the manifest (RAMHolesSHA256): a damaged one is never
	// acted on.
	var holes []byte
	if w.holesFrom != "" {
		if b, err := os.ReadFile(w.holesFrom); err == nil {
			holes = b
		}
	} else if hs, err := memfile.Holes(w.ramTmp); err == nil {
		holes = memfile.EncodeRanges(hs)
	}
	if holes != nil {
		if err := os.WriteFile(filepath.Join(w.tmp, ramHolesFile), holes, 0o600); err != nil {
			return fmt.Errorf("engine: checkpoint holes: %w", err)
		}
		ck.RAMHolesSHA256 = bytesSHA256(holes)
	}
	ck.Timings.Total = time.Since(w.t0)
	at := clockStamp()
	ck.Spans = append(ck.Spans, Span{Name: "checkpoint", StartMono: w.t0At.mono, EndMono: at.mono, StartBoot: w.t0At.boot, EndBoot: at.boot})
	if err := writeCheckpointManifest(w.paths, w.final, filepath.Join(w.tmp, manifestFile), ck); err != nil {
		return fmt.Errorf("engine: checkpoint manifest: %w", err)
	}
	if err := os.Rename(w.ramTmp, w.ramFinal); err != nil {
		return fmt.Errorf("engine: checkpoint ram: %w", err)
	}
	if w.layersTmp != "" {
		if err := os.Rename(w.layersTmp, w.layersFinal); err != nil {
			os.Rename(w.ramFinal, w.ramTmp)
			return fmt.Errorf("engine: checkpoint ram layers: %w", err)
		}
	}
	if err := os.Rename(w.tmp, w.final); err != nil {
		os.Rename(w.ramFinal, w.ramTmp)
		if w.layersTmp != "" {
			os.Rename(w.layersFinal, w.layersTmp)
		}
		return fmt.Errorf("engine: checkpoint commit: %w", err)
	}
	w.committed = true
	return nil
}

// cleanup removes what an uncommitted checkpoint left.
func (w *ckWriter) cleanup() {
	if !w.committed {
		os.RemoveAll(w.tmp)
		os.Remove(w.ramTmp)
		if w.layersTmp != "" {
			os.RemoveAll(w.layersTmp)
		}
	}
}

// checkpoint is the committed checkpoint.
func (w *ckWriter) checkpoint() *Checkpoint { return &Checkpoint{Manifest: *w.ck, Dir: w.final} }
