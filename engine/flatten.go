package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/memfile"
)

// Flattening: a fork of a delta checkpoint maps its lineage's root RAM file (or the
// nearest flattened ancestor's file, see lineageBase) and gets the layers that file
// lacks written into its private mapping, so each sibling holds its own copy of every
// page those ancestors wrote (Σ layers per fork at depth n). A flattened checkpoint
// has one more RAM file, the root's data with every layer applied, which forks started
// afterwards map share=off like a world checkpoint's: no injection, every inherited
// page shared through the page cache.
//
// What was measured and chosen (docs/fork-trees.md): the copy costs the root's data
// once more per flattened checkpoint, so flattening every checkpoint would multiply a
// lineage's storage by its depth, and checkpoints that are never forked, or forked once,
// gain nothing. A checkpoint is therefore flattened in the background after its first
// fork (that fork uses the layers) when its layers hold at least Config.FlattenMiB, or
// once its live forks' copies of the layers cost more than the file, before a wave
// whose forks would (flatwave.go), or at once on request (Engine.Flatten). KSM was measured too: it merges the injected
// pages only ~10 s after a fork, at ~15% of a CPU host-wide, for every process.
//
// Crash safety: the file is written under a temporary name (reaped by the next engine)
// and renamed into place complete, its hole list written first; a committed flat file
// is removed only with its checkpoint. Nothing is recorded in the manifest: the file's
// presence, at the guest's size, is the flatten's state.

// flattener runs flattens one at a time (each is a copy at memory bandwidth; two at
// once would only compete) and remembers which are queued.
type flattener struct {
	mu      sync.Mutex // serializes flattens
	qmu     sync.Mutex
	queued  map[string]bool
	wake    chan struct{}
	pending []string
	// running is the checkpoint the background loop flattens ("": none); stop
	// cancels that flatten and done is closed once it has ended.
	running string
	stop    context.CancelFunc
	done    chan struct{}
}

// forget drops checkpoint name from the background flattens, for its deletion: out of
// the queue, and a flatten of it under way cancelled and waited for (it removes its
// temporary files), so that nothing of the checkpoint is written after it is gone.
func (f *flattener) forget(name string) {
	f.qmu.Lock()
	if f.queued[name] {
		delete(f.queued, name)
		f.pending = slices.DeleteFunc(f.pending, func(n string) bool { return n == name })
	}
	var done chan struct{}
	if f.running == name {
		f.stop()
		done = f.done
	}
	f.qmu.Unlock()
	if done != nil {
		<-done
	}
}

func newFlattener() *flattener {
	return &flattener{queued: map[string]bool{}, wake: make(chan struct{}, 1)}
}

// FlattenStats describe a flatten.
type FlattenStats struct {
	// Path is the flattened RAM file.
	Path string `json:"path"`
	// RootBytes is the data copied: the root's, or with BaseLayers > 0 an ancestor's
	// flattened file holding that many of the lineage's layers; LayerBytes the pages of
	// the layers above it, applied over it.
	RootBytes  int64 `json:"root_bytes"`
	BaseLayers int   `json:"base_layers,omitempty"`
	LayerBytes int64 `json:"layer_bytes"`
	// Allocated is the file's storage.
	Allocated int64         `json:"allocated_bytes"`
	Took      time.Duration `json:"took_ns"`
	// Already is set when the checkpoint was flattened before this call.
	Already bool `json:"already,omitempty"`
}

// Flatten writes delta checkpoint name's flattened RAM file now, if it has none yet
// (see Config.FlattenMiB): forks started afterwards map it and share every inherited
// page. A world checkpoint is refused with ErrInvalidSpec (it is flat already).
func (e *Engine) Flatten(ctx context.Context, name string) (*FlattenStats, error) {
	return e.flatten(ctx, name)
}

// flatPath returns the committed flattened RAM file of checkpoint ck, or "" when it has
// none (not a delta checkpoint, not flattened yet, or a file of the wrong size).
func flatPath(paths layout, ck *checkpointManifest) string {
	if ck.Kind != checkpointKindDelta {
		return ""
	}
	p := paths.checkpointFlat(ck.Name)
	if st, err := os.Stat(p); err != nil || st.Size() != ck.RAMSize {
		return ""
	}
	return p
}

// layersBytes is the data of a checkpoint's lineage layers.
func layersBytes(ck *checkpointManifest) int64 {
	var n int64
	for _, l := range ck.Layers {
		n += l.Size
	}
	return n
}

// flattenLater queues checkpoint ck for a background flatten when the policy says so.
// An implicit checkpoint (a fork of a running VM) is never flattened: it serves the
// forks made with it, all prepared before any flatten could finish, and goes with them;
// flattening it only took CPU from whatever ran next (measured: the checkpoint of the
// forked node, taken right after, doubled while the implicit checkpoint's copy ran).
func (e *Engine) flattenLater(ck *checkpointManifest) {
	if ck.Kind != checkpointKindDelta || ck.Implicit || e.cfg.FlattenMiB < 0 || !memfile.ExtractSupported {
		return
	}
	if layersBytes(ck) < e.cfg.FlattenMiB<<20 {
		// Small layers: flattened once its live forks' copies of them cost more than
		// the flattened file (flatwave.go).
		inject, file := flattenCost(e.paths, ck)
		if !worthFlattening(inject, file, e.vms.forksOf(ck.Name)) {
			return
		}
	}
	if flatPath(e.paths, ck) != "" {
		return
	}
	f := e.flat
	f.qmu.Lock()
	if !f.queued[ck.Name] {
		f.queued[ck.Name] = true
		f.pending = append(f.pending, ck.Name)
	}
	f.qmu.Unlock()
	select {
	case f.wake <- struct{}{}:
	default:
	}
}

// flattenLoop runs queued flattens until the engine closes, at the lowest CPU priority:
// a flatten copies the lineage's data (hundreds of MiB) while forks and checkpoints of the
// same tree run, and those must not wait for it.
func (e *Engine) flattenLoop(ctx context.Context) {
	platform.BackgroundThread()
	f := e.flat
	for {
		// Popped and marked running at once: forget sees it queued or running.
		var fctx context.Context
		var stop context.CancelFunc
		var done chan struct{}
		f.qmu.Lock()
		var name string
		if len(f.pending) > 0 {
			name, f.pending = f.pending[0], f.pending[1:]
			fctx, stop = context.WithCancel(ctx)
			done = make(chan struct{})
			f.running, f.stop, f.done = name, stop, done
		}
		f.qmu.Unlock()
		if name == "" {
			select {
			case <-ctx.Done():
				return
			case <-f.wake:
				continue
			}
		}
		st, err := e.flatten(fctx, name)
		forgotten := fctx.Err() != nil && ctx.Err() == nil
		stop()
		f.qmu.Lock()
		delete(f.queued, name)
		f.running = ""
		f.qmu.Unlock()
		close(done)
		if forgotten {
			continue // its checkpoint is being deleted
		}
		switch {
		case err != nil && ctx.Err() == nil && !errors.Is(err, ErrNotFound):
			e.log.Warn("flatten failed", "checkpoint", name, "err", err)
		case err == nil && !st.Already:
			e.log.Info("flattened checkpoint", "checkpoint", name, "root", st.RootBytes, "layers", st.LayerBytes, "took", st.Took)
		}
	}
}

// queueFlattens queues every forked delta checkpoint the policy flattens and that has
// no flat file (after an engine start: a flatten the last engine did not finish).
func (e *Engine) queueFlattens() {
	ents, err := os.ReadDir(e.paths.checkpointsDir())
	if err != nil {
		return
	}
	for _, ent := range ents {
		c, err := e.cks.read(ent.Name())
		if err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(c.Dir, forkedMarker)); err == nil {
			e.flattenLater(&c.Manifest)
		}
	}
}

// flatten writes checkpoint name's flattened RAM file: a sparse copy of its root file,
// every layer applied (their checksums verified first), its holes recorded, renamed into
// place.
func (e *Engine) flatten(ctx context.Context, name string) (*FlattenStats, error) {
	e.flat.mu.Lock()
	defer e.flat.mu.Unlock()
	c, err := e.cks.load(ctx, name)
	if err != nil {
		return nil, err
	}
	ck := &c.Manifest
	if ck.Kind != checkpointKindDelta {
		return nil, fmt.Errorf("%w: %s is not a checkpoint of a fork: its RAM file is flat already", ErrInvalidSpec, name)
	}
	final := e.paths.checkpointFlat(name)
	if p := flatPath(e.paths, ck); p != "" {
		return &FlattenStats{Path: p, Allocated: allocatedBytes(p), Already: true}, nil
	}
	t0 := time.Now()
	tmp := final + ".tmp-" + randHex(4)
	defer os.Remove(tmp) // a no-op once renamed
	// From the best base there is (an ancestor's flattened file: fewer layers to
	// apply), else the root; a base deleted under the copy falls back to the root.
	base := findBase(e.paths, ck)
	fs, err := memfile.Freeze(ctx, base.Path, tmp)
	if err != nil && base.Layers > 0 && ctx.Err() == nil {
		os.Remove(tmp)
		base = lineageBase{Path: ck.RAMPath}
		fs, err = memfile.Freeze(ctx, base.Path, tmp)
	}
	if err != nil {
		return nil, fmt.Errorf("engine: flatten %s: %w", name, err)
	}
	var paths []string
	for _, l := range ck.Layers[base.Layers:] {
		paths = append(paths, l.Path)
	}
	applied, err := memfile.ApplyLayers(tmp, ck.RAMSize, paths)
	if err != nil {
		return nil, fmt.Errorf("engine: flatten %s: %w", name, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// The hole list first: a committed flat file always has one (see punchFlat).
	holes, err := memfile.Holes(tmp)
	if err == nil {
		err = writeFileAtomic(filepath.Join(c.Dir, flatHolesFile), memfile.EncodeRanges(holes))
	}
	if err != nil {
		return nil, fmt.Errorf("engine: flatten %s: holes: %w", name, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		return nil, fmt.Errorf("engine: flatten %s: %w", name, err)
	}
	if !e.cks.exists(name) {
		// Deleted meanwhile: its removal may have run before the rename.
		os.Remove(final)
		return nil, fmt.Errorf("%w: checkpoint %s (deleted while it was flattened)", ErrNotFound, name)
	}
	return &FlattenStats{Path: final, RootBytes: fs.Bytes, BaseLayers: base.Layers, LayerBytes: applied, Allocated: allocatedBytes(final), Took: time.Since(t0)}, nil
}

// punchFlat gives back the zero pages that forks faulted into the holes of checkpoint
// name's flattened RAM file (see checkpointStore.punch, which does it for the root file).
func (e *Engine) punchFlat(name string) {
	b, err := os.ReadFile(filepath.Join(e.paths.checkpointDir(name), flatHolesFile))
	if err != nil {
		return
	}
	p := e.paths.checkpointFlat(name)
	st, err := os.Stat(p)
	if err != nil {
		return
	}
	holes, err := memfile.DecodeRanges(b, st.Size())
	if err != nil {
		e.log.Warn("flat hole list unreadable", "checkpoint", name, "err", err)
		return
	}
	if _, err := memfile.PunchHoles(p, holes); err != nil {
		e.log.Warn("punching flat file holes failed", "checkpoint", name, "err", err)
	}
}

// allocatedBytes is a file's storage (st_blocks), 0 when unknown.
func allocatedBytes(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		return s.Blocks * 512
	}
	return 0
}

// writeFileAtomic writes b to path through a temporary file and a rename.
func writeFileAtomic(path string, b []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, path)
}
