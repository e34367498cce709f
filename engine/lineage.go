package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/internal/durable"
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
// What it costs and when it is done (docs/fork-trees.md): the copy costs the root's data
// once more per flattened checkpoint, so flattening every checkpoint would multiply a
// lineage's storage by its depth, and checkpoints that are never forked, or forked once,
// gain nothing. A checkpoint is therefore flattened in the background after its first
// fork (that fork uses the layers) when its layers hold at least Config.FlattenMiB, or
// once its live forks' copies of the layers cost more than the file, before a wave
// whose forks would (flattenForWave), or at once on request (Engine.Flatten). KSM is
// no substitute: it merges the injected pages only once its scan reaches them, long
// after a fork is ready, and that scan costs CPU host-wide, for every process.
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
	queued  map[flatJob]bool
	wake    chan struct{}
	pending []flatJob
	// running is the checkpoint the background loop flattens (zero: none); stop
	// cancels that flatten and done is closed once it has ended.
	running flatJob
	stop    context.CancelFunc
	done    chan struct{}
	// beforeCommit, when set, is called with the checkpoint's name by a flatten whose
	// file is written, before it commits it (tests change the checkpoint there).
	beforeCommit func(name string)
}

// flatJob is a background flatten: of checkpoint name's generation gen
// (Checkpoint.gen), the checkpoint its policy decided on. A later checkpoint of the
// name is another job: the flatten of one never stands for the other's, and the
// removal of one never drops the other's.
type flatJob struct {
	name string
	gen  uint64
}

// forget drops the background flatten of checkpoint name of generation gen, for its
// deletion: out of the queue, and a flatten of it under way cancelled and waited for
// (it removes its temporary files), so that nothing of the checkpoint is written
// after it is gone. Another generation's flatten (a checkpoint that took the name
// since) is left alone.
func (f *flattener) forget(name string, gen uint64) {
	job := flatJob{name, gen}
	f.qmu.Lock()
	if f.queued[job] {
		delete(f.queued, job)
		f.pending = slices.DeleteFunc(f.pending, func(j flatJob) bool { return j == job })
	}
	var done chan struct{}
	if f.running == job {
		f.stop()
		done = f.done
	}
	f.qmu.Unlock()
	if done != nil {
		<-done
	}
}

func newFlattener() *flattener {
	return &flattener{queued: map[flatJob]bool{}, wake: make(chan struct{}, 1)}
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
func (e *Engine) Flatten(ctx context.Context, name string) (_ *FlattenStats, err error) {
	ctx, leave, err := e.op(ctx, "flatten "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	return e.flatten(ctx, name, 0)
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

// flattenLater queues checkpoint c for a background flatten when the policy says so,
// tied to its generation (flatJob): one not read from the store has none, and is not
// queued. An implicit checkpoint (a fork of a running VM) is never flattened: it serves
// the forks made with it, all prepared before any flatten could finish, and goes with
// them; flattening it would only take CPU and disk from whatever runs next (typically
// a checkpoint of the forked node, which the copy would slow down).
func (e *Engine) flattenLater(c *Checkpoint) {
	ck := &c.Manifest
	if ck.Kind != checkpointKindDelta || ck.Implicit || c.gen == 0 || e.cfg.FlattenMiB < 0 || !memfile.ExtractSupported {
		return
	}
	if layersBytes(ck) < e.cfg.FlattenMiB<<20 {
		// Small layers: flattened once its live forks' copies of them cost more than
		// the flattened file (flattenForWave).
		inject, file := flattenCost(e.paths, ck)
		if !worthFlattening(inject, file, e.vms.forksOf(ck.Name)) {
			return
		}
	}
	if flatPath(e.paths, ck) != "" {
		return
	}
	f := e.flat
	job := flatJob{ck.Name, c.gen}
	f.qmu.Lock()
	if !f.queued[job] {
		f.queued[job] = true
		f.pending = append(f.pending, job)
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
		var job flatJob
		if len(f.pending) > 0 {
			job, f.pending = f.pending[0], f.pending[1:]
			fctx, stop = context.WithCancel(ctx)
			done = make(chan struct{})
			f.running, f.stop, f.done = job, stop, done
		}
		f.qmu.Unlock()
		name := job.name
		if name == "" {
			select {
			case <-ctx.Done():
				return
			case <-f.wake:
				continue
			}
		}
		st, err := e.flatten(fctx, name, job.gen)
		forgotten := fctx.Err() != nil && ctx.Err() == nil
		stop()
		f.qmu.Lock()
		delete(f.queued, job)
		f.running = flatJob{}
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
			e.flattenLater(c)
		}
	}
}

// flatten writes checkpoint name's flattened RAM file: a sparse copy of its root file,
// every layer applied (their checksums verified first), its holes recorded, renamed into
// place, as long as the checkpoint it read is still there (else ErrNotFound). gen, when
// not 0, is the generation to flatten (a background flatten's, flatJob): a checkpoint
// of the name of another generation is not flattened (ErrNotFound).
func (e *Engine) flatten(ctx context.Context, name string, gen uint64) (*FlattenStats, error) {
	e.flat.mu.Lock()
	defer e.flat.mu.Unlock()
	c, err := e.cks.load(ctx, name)
	if err != nil {
		return nil, err
	}
	if gen != 0 && c.gen != gen {
		return nil, fmt.Errorf("%w: checkpoint %s (the one queued was deleted)", ErrNotFound, name)
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
	if f := e.flat.beforeCommit; f != nil {
		f(name)
	}
	// The hole list and the file go by the name, which a checkpoint made after c's
	// removal takes (its forks would map this file as their memory): each is written
	// only while c is still the checkpoint of its name (whileCurrent), which holds off
	// c's removal meanwhile (that removes what was written). Otherwise the flatten
	// fails with ErrNotFound.
	//
	// The hole list first: a committed flat file always has one (see punchFlat).
	holes, err := memfile.Holes(tmp)
	if err == nil {
		err = e.cks.whileCurrent(c, func() error {
			return writeFileAtomic(filepath.Join(c.Dir, flatHolesFile), memfile.EncodeRanges(holes))
		})
	}
	if errors.Is(err, ErrNotFound) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("engine: flatten %s: holes: %w", name, err)
	}
	// Flushed before the rename: a flat file is trusted by its size (flatPath), and a
	// power loss must not leave one of the right size whose data never reached the disk.
	// A flatten runs in the background; on a RAM directory in memory (tmpfs, the
	// default) a flush costs nothing.
	if err := durable.File(tmp); err != nil {
		return nil, fmt.Errorf("engine: flatten %s: %w", name, err)
	}
	err = e.cks.whileCurrent(c, func() error {
		if err := os.Rename(tmp, final); err != nil {
			return fmt.Errorf("engine: flatten %s: %w", name, err)
		}
		durable.Dir(filepath.Dir(final))
		return nil
	})
	if err != nil {
		return nil, err
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

// writeFileAtomic writes b to path through a temporary file and a rename, flushed
// before and after the rename: once it returns, a power loss finds the new file whole.
func writeFileAtomic(path string, b []byte) error {
	tmp := path + ".tmp"
	err := os.WriteFile(tmp, b, 0o600)
	if err == nil {
		err = durable.File(tmp)
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	durable.Dir(filepath.Dir(path))
	return nil
}

// Flattening by what forks will cost. A fork of a delta checkpoint that is not
// flattened holds a private copy of every layer its RAM file lacks (the layers above
// its lineage base: see findBase); a flattened file costs its base's data and those
// layers once, shared by every fork started afterwards. So a checkpoint is worth
// flattening as soon as the forks that would copy the layers cost more than the file:
//
//	forks × layers above the base  ≥  base's data + layers above the base
//
// A wave of n forks knows n before its first fork starts: the wave flattens first
// (flattenForWave) when n forks already pass, so that every fork of it maps the flat
// file; a checkpoint's forks made one by one are counted as they come (flattenLater),
// and flattened in the background once its live forks pass. A checkpoint forked a
// moment after it was taken thus gets its siblings sharing from the first wave, where
// the size threshold (Config.FlattenMiB) alone let every fork of a small lineage (tens
// of MiB at depth 3) copy it privately.

// flattenCost is what flattening ck saves each fork that would map its current best
// base (inject: the layers above that base) and what the flattened file stores (file:
// the base's data plus those layers). inject is 0 when ck is flat already or has no
// layer.
func flattenCost(paths layout, ck *checkpointManifest) (inject, file int64) {
	if ck.Kind != checkpointKindDelta || len(ck.Layers) == 0 || flatPath(paths, ck) != "" {
		return 0, 0
	}
	base := findBase(paths, ck)
	for _, l := range ck.Layers[base.Layers:] {
		inject += l.Size
	}
	return inject, allocatedBytes(base.Path) + inject
}

// worthFlattening reports whether n forks of ck copying its layers cost at least as much
// as flattening it (n ≥ 1; see flattenCost).
func worthFlattening(inject, file int64, n int) bool {
	return inject > 0 && int64(n)*inject >= file
}

// flattenForWave flattens plan p's checkpoint before its forks start when the wave's
// forks that will map a RAM file (all but an early fork, already started on the base)
// are worth it. A failed flatten is logged and the wave forks from the layers as
// before.
func (e *Engine) flattenForWave(ctx context.Context, p *forkPlan) {
	if p.ck == nil || e.cfg.FlattenMiB < 0 || !memfile.ExtractSupported {
		return
	}
	ck := &p.ck.Manifest
	n := len(p.names)
	if p.early != nil {
		n--
	}
	inject, file := flattenCost(e.paths, ck)
	if n < 2 || !worthFlattening(inject, file, n) {
		return
	}
	st, err := e.flatten(ctx, ck.Name, p.ck.gen)
	if err != nil {
		if ctx.Err() == nil {
			e.log.Warn("flatten before a wave failed: its forks copy the layers", "checkpoint", ck.Name, "forks", n, "err", err)
		}
		return
	}
	if !st.Already {
		e.log.Info("flattened checkpoint for a wave", "checkpoint", ck.Name, "forks", n, "layers", inject, "file", st.Allocated, "took", st.Took)
	}
}

// Lineage bases: a fork of a delta checkpoint maps one RAM file share=off and gets the
// layers that file lacks injected into its private mapping. The file is the best base
// the lineage has: the checkpoint's own flattened file (nothing to inject), else the
// flattened file of its nearest flattened ancestor (the root with that ancestor's
// layers applied: only the newer layers are injected), else the lineage's root file
// (every layer injected). A checkpoint is flattened only after its first fork, so in a
// tree the children of a fresh checkpoint would otherwise all map the root and each
// hold a private copy of every ancestor's pages, though the parent level's flattened
// file already holds all but the newest layer.
//
// Pinning: an ancestor's flattened file goes with the ancestor. Before a fork maps one,
// it is hard-linked into the checkpoint's own layer directory (baseFile) with a copy of
// its hole list beside it (the list first, so a link always has one); the fork maps the
// link. Deleting the ancestor then leaves the file to this checkpoint, which removes it
// with its layer directory. A link is only ever made to a committed flattened file
// (complete, renamed into place) of a checkpoint whose lineage matches this one's
// (same root file, same layers by digest), so any link present is a valid base: a
// crash between the list and the link leaves a list alone, which goes with the
// directory. Forks running from a link keep its pages mapped whatever is deleted. The
// zero pages their writes fault into the shared file's holes are punched through the
// list when they go (punchBase), as for a checkpoint's own flattened file; a punch only
// ever frees pages that read as zero.

// lineageBase is a RAM file that holds a delta checkpoint's lineage up to one of its
// layers: its root's data with the first Layers layers applied (none: the root).
type lineageBase struct {
	Path   string
	Layers int
	// Holes is the file listing Path's holes when it was written ("" for the root,
	// whose list is the root checkpoint's).
	Holes string
	// From is the checkpoint whose flattened file Path is, and FromState its device
	// state digest (its identity: a name can be reused after a delete).
	From, FromState string
}

const baseFilePrefix = "base-"

// baseFile names, in a checkpoint's layer directory, its link to the flattened file of
// ancestor from, which holds the lineage's first layers layers.
func baseFile(layers int, from string) string {
	return fmt.Sprintf("%s%02d-%s.flat", baseFilePrefix, layers, from)
}

// baseHoles is the hole list beside base link path.
func baseHoles(path string) string { return strings.TrimSuffix(path, ".flat") + ".holes" }

// parseBaseFile returns the layers a base link named n holds, 0 when n is not one.
func parseBaseFile(n string) int {
	rest, ok := strings.CutPrefix(n, baseFilePrefix)
	if !ok || !strings.HasSuffix(rest, ".flat") {
		return 0
	}
	num, _, ok := strings.Cut(rest, "-")
	if !ok {
		return 0
	}
	k, err := strconv.Atoi(num)
	if err != nil || k < 1 {
		return 0
	}
	return k
}

// readCheckpointManifest reads checkpoint name's manifest without verifying its files.
func readCheckpointManifest(paths layout, name string) (*checkpointManifest, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	dir := paths.checkpointDir(name)
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return nil, err
	}
	m, err := paths.decodeCheckpoint(b, dir)
	if err != nil {
		return nil, err
	}
	if m.Name != name {
		return nil, fmt.Errorf("manifest of %s names %q", name, m.Name)
	}
	return m, nil
}

// sharesLineage reports whether checkpoint x holds exactly the first k layers of ck's
// lineage over the same root file: then x's flattened file is a base of ck.
func sharesLineage(ck, x *checkpointManifest, k int) bool {
	if x.Kind != checkpointKindDelta || len(x.Layers) != k || k > len(ck.Layers) || x.RAMSize != ck.RAMSize {
		return false
	}
	for j := range k {
		a, b := x.Layers[j], ck.Layers[j]
		if a.Checkpoint != b.Checkpoint || a.SHA256 != b.SHA256 || a.Size != b.Size {
			return false
		}
	}
	s1, err1 := os.Stat(x.RAMPath)
	s2, err2 := os.Stat(ck.RAMPath)
	return err1 == nil && err2 == nil && os.SameFile(s1, s2)
}

// baseLinks returns the best base link in layer directory dir holding at most max
// layers (Layers 0: none).
func baseLinks(dir string, size int64, max int) lineageBase {
	var best lineageBase
	ents, err := os.ReadDir(dir)
	if err != nil {
		return best
	}
	for _, ent := range ents {
		k := parseBaseFile(ent.Name())
		if k <= best.Layers || k > max {
			continue
		}
		p := filepath.Join(dir, ent.Name())
		if st, err := os.Stat(p); err != nil || st.Size() != size {
			continue
		}
		best = lineageBase{Path: p, Layers: k, Holes: baseHoles(p)}
	}
	return best
}

// findBase returns the best base of delta checkpoint ck that exists now (see
// lineageBase), the root when it has none; it links nothing.
func findBase(paths layout, ck *checkpointManifest) lineageBase {
	root := lineageBase{Path: ck.RAMPath}
	n := len(ck.Layers)
	if ck.Kind != checkpointKindDelta || n == 0 {
		return root
	}
	if p := flatPath(paths, ck); p != "" {
		return lineageBase{Path: p, Layers: n, Holes: filepath.Join(paths.checkpointDir(ck.Name), flatHolesFile)}
	}
	best := baseLinks(paths.checkpointLayers(ck.Name), ck.RAMSize, n-1)
	// The ancestors, nearest first: ck.Layers[i] was written by the ancestor holding
	// i+1 layers.
	for i := n - 2; i >= 0 && i+1 > best.Layers; i-- {
		x, err := readCheckpointManifest(paths, ck.Layers[i].Checkpoint)
		if err != nil || !sharesLineage(ck, x, i+1) {
			continue
		}
		if p := flatPath(paths, x); p != "" {
			best = lineageBase{Path: p, Layers: i + 1, Holes: filepath.Join(paths.checkpointDir(x.Name), flatHolesFile), From: x.Name, FromState: x.StateSHA256}
			break
		}
		if b := baseLinks(paths.checkpointLayers(x.Name), ck.RAMSize, i+1); b.Layers > best.Layers {
			b.From, b.FromState = x.Name, x.StateSHA256
			best = b
		}
	}
	if best.Layers == 0 {
		return root
	}
	return best
}

// pinBase makes base b of checkpoint ck its own: a hard link in its layer directory,
// the hole list first. A base there already is returned as it is.
func pinBase(paths layout, ck *checkpointManifest, b lineageBase) (lineageBase, error) {
	return pinBaseIn(paths, paths.checkpointLayers(ck.Name), ck, b)
}

// pinBaseIn is pinBase into layer directory dir (a checkpoint's being written: an early
// fork's base, see earlyFork).
func pinBaseIn(paths layout, dir string, ck *checkpointManifest, b lineageBase) (lineageBase, error) {
	if b.Layers == 0 || b.From == "" || filepath.Dir(b.Path) == dir {
		return b, nil
	}
	link := filepath.Join(dir, baseFile(b.Layers, ck.Layers[b.Layers-1].Checkpoint))
	holes := baseHoles(link)
	if l, err := os.Stat(link); err == nil && l.Size() == ck.RAMSize {
		// Pinned by another fork meanwhile.
		return lineageBase{Path: link, Layers: b.Layers, Holes: holes}, nil
	}
	if h, err := os.ReadFile(b.Holes); err == nil {
		// A temporary name of its own: forks of a wave pin at the same time.
		tmp := holes + ".tmp-" + randHex(4)
		err := os.WriteFile(tmp, h, 0o600)
		if err == nil {
			err = os.Rename(tmp, holes)
		}
		if err != nil {
			os.Remove(tmp)
			return b, fmt.Errorf("engine: pin base of %s: %w", ck.Name, err)
		}
	}
	if err := os.Link(b.Path, link); err != nil && !os.IsExist(err) {
		return b, fmt.Errorf("engine: pin base of %s: %w", ck.Name, err)
	}
	// The ancestor it came from may have been deleted meanwhile, which leaves the link
	// valid (its file was the verified ancestor's); a different checkpoint of that name
	// would not be.
	if x, err := readCheckpointManifest(paths, b.From); err == nil && x.StateSHA256 != b.FromState {
		os.Remove(link)
		return b, fmt.Errorf("engine: pin base of %s: checkpoint %s was replaced", ck.Name, b.From)
	}
	return lineageBase{Path: link, Layers: b.Layers, Holes: holes}, nil
}

// forkBase is the base a new fork of checkpoint ck maps: the best one found, pinned
// into ck; the root (every layer injected) when pinning fails.
func forkBase(paths layout, log *slog.Logger, ck *checkpointManifest) lineageBase {
	b := findBase(paths, ck)
	pinned, err := pinBase(paths, ck, b)
	if err != nil {
		log.Warn("forking from the lineage's root file", "checkpoint", ck.Name, "err", err)
		return lineageBase{Path: ck.RAMPath}
	}
	return pinned
}

// deltaBase is what the delta of a fork of parent pm is compared against (see
// memfile.ExtractDelta): the file the fork maps when it is a base holding baseLayers of
// pm's layers, with the layers above it (from ancestors, pm's layer paths); else pm's
// root and every layer (a fork of another engine's making, or whose base was unlinked).
func deltaBase(paths layout, pm *checkpointManifest, mapped string, baseLayers int, ancestors []string) (string, []string) {
	k := baseLayers
	if k == 0 && mapped == paths.checkpointFlat(pm.Name) {
		k = len(pm.Layers) // a fork recorded before bases had a count
	}
	if k <= 0 || k > len(ancestors) || mapped == pm.RAMPath {
		return pm.RAMPath, ancestors
	}
	if st, err := os.Stat(mapped); err != nil || st.Size() != pm.RAMSize {
		return pm.RAMPath, ancestors
	}
	return mapped, ancestors[k:]
}

// punchBase gives back the zero pages forks faulted into the holes of the base a fork
// of checkpoint parent mapped at ramPath (the checkpoint's flattened file or a base
// link; nothing for the root, whose holes checkpointStore.punch handles).
func (e *Engine) punchBase(parent, ramPath string) {
	switch {
	case ramPath == e.paths.checkpointFlat(parent):
		e.punchFlat(parent)
	case filepath.Dir(ramPath) == e.paths.checkpointLayers(parent) && parseBaseFile(filepath.Base(ramPath)) > 0:
		b, err := os.ReadFile(baseHoles(ramPath))
		if err != nil {
			return
		}
		st, err := os.Stat(ramPath)
		if err != nil {
			return
		}
		holes, err := memfile.DecodeRanges(b, st.Size())
		if err != nil {
			e.log.Warn("base hole list unreadable", "checkpoint", parent, "err", err)
			return
		}
		if _, err := memfile.PunchHoles(ramPath, holes); err != nil {
			e.log.Warn("punching base holes failed", "checkpoint", parent, "err", err)
		}
	}
}
