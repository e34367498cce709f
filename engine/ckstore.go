package engine

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/memfile"
)

// Checkpoint is a checkpoint known to the engine: Name and Info are its stable view.
// Manifest is the engine's on-disk record, of an unexported type: its fields change
// with the manifest's version (checked on every load) and are for the engine's own
// tools and tests; an embedder reads Info.
type Checkpoint struct {
	Manifest checkpointManifest
	Dir      string
	// gen is the checkpoint's generation in its store (checkpointStore.read; 0 for one
	// not read from the store): work started on this checkpoint (a warm pool, a
	// flatten) is tied to it, not to the name, which a later checkpoint may take.
	gen uint64
}

// Name is the checkpoint's name (as VM.Name is a VM's).
func (c *Checkpoint) Name() string { return c.Manifest.Name }

// statePath is the device-state file of the checkpoint.
func (c *Checkpoint) statePath() string { return filepath.Join(c.Dir, stateFile) }

// CheckpointInfo is a checkpoint as Checkpoints lists it (api.CheckpointInfo documents
// each field): the part of its record that stays stable whatever the engine's manifest
// version, its live forks and the storage of its flattened RAM file (Config.FlattenMiB).
// A checkpoint whose manifest cannot be read is listed with Corrupt set (only Name and
// Forks known) and kept, never collected, until it is deleted explicitly.
type CheckpointInfo = api.CheckpointInfo

// Info is the checkpoint's stable summary (without its forks and flattened file, which
// Engine.CheckpointInfo adds).
func (c *Checkpoint) Info() CheckpointInfo { return infoOf(&c.Manifest) }

// infoOf is the stable summary of the manifest m.
func infoOf(m *checkpointManifest) CheckpointInfo {
	out := CheckpointInfo{
		Name: m.Name, Source: m.Source, Pinned: m.Pinned, Implicit: m.Implicit, Protects: m.Protects, CreatedAt: m.CreatedAt,
		Accel: m.Accel, CPUs: m.CPUs, MemoryMiB: m.MemoryMiB, DiskMiB: m.DiskMiB, Net: m.Net,
		RAMPath: m.RAMPath, RAMSize: m.RAMSize, StateSize: m.StateSize, DiskMethod: m.DiskMethod,
		RAMMethod: m.RAMMethod, Kind: m.Kind, WrittenBytes: m.WrittenBytes(), Timings: m.Timings,
		Spans: m.Spans, Migration: m.Migration,
	}
	if m.Freeze != nil {
		f := api.FreezeStats(*m.Freeze)
		out.Freeze = &f
	}
	return out
}

// checkpointStore reads, verifies, lists and removes committed checkpoints. Writing one
// is Engine.Checkpoint's; the rename of its directory into place is the commit point.
//
// Verification hashes the device state once per store and file identity (size, mtime),
// not on every fork; mu guards that cache.
type checkpointStore struct {
	paths layout
	log   *slog.Logger

	// wmu serialises the rewrites of committed manifests (pinning, recorded digests).
	wmu sync.Mutex

	mu       sync.Mutex
	verified map[string]string // name -> fingerprint of the verified files
	// layers holds the digests of RAM layer files this engine wrote or verified, by
	// file identity (platform.FileID, as digestCache): a checkpoint's lineage layers
	// are hard links to its ancestors' (one inode), and a delta checkpoint's own layer
	// was digested as it was made, so that verifying a new protection point, every few
	// seconds, does not read every layer of its lineage again. A layer rewritten since
	// has another modification time and is read again.
	layers map[[4]int64]string
	// held names the checkpoints that VMs kept aside at recovery (their manifests
	// unreadable) were forked from: never collected while they are kept.
	held map[string]bool
	// beforeRemove, when set, is called with a checkpoint's name and generation before
	// its files go (no lock of the store held), the generation already retired: the
	// background work on it ends first, and its warm pool goes.
	beforeRemove func(name string, gen uint64)
	// afterRename, when set, is called with a checkpoint's name by its removal once its
	// directory is renamed away, before its files go (tests take the name there).
	afterRename func(name string)
	// holdName, when set, keeps a name from being reserved for a VM or checkpoint until
	// release is called (registry.hold): a removal holds its checkpoint's name while it
	// deletes the files that go by that name.
	holdName func(name string) (release func())

	// life orders a checkpoint's removal against the work tied to its generation:
	// remove takes it to claim the checkpoint, retiring its generation (claim), and to
	// rename the directory away; read takes it shared, so that a manifest and the
	// generation it is given go together, and so does what must happen only while that
	// generation is current (whileCurrent). Taken before mu.
	life sync.RWMutex
	// gens holds, under mu, the generation of each checkpoint read since it was
	// committed: a number given to no other checkpoint, whatever its name. removing
	// counts the removals under way per name (between claim and the rename of the
	// directory): read refuses such a checkpoint (ErrNotFound), so that it is given no
	// new generation while it goes.
	gens     map[string]uint64
	lastGen  uint64
	removing map[string]int
}

// generation returns name's generation, giving it the next one if it has none; s.life
// held (shared at least) and the checkpoint's directory read.
func (s *checkpointStore) generation(name string) uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	if g := s.gens[name]; g != 0 {
		return g
	}
	if s.gens == nil {
		s.gens = map[string]uint64{}
	}
	s.lastGen++
	s.gens[name] = s.lastGen
	return s.lastGen
}

// claim starts the removal of checkpoint c: only while c's generation is still the
// current one of its name, which claim retires, so that a checkpoint is removed once,
// by the first removal that claims it, and never is one of the name that was read
// after c (a later checkpoint). The removal is counted (removing) until remove renamed
// the directory away. false: c is gone already (removed, or being removed), or was
// never read from the store (its generation is 0).
func (s *checkpointStore) claim(c *Checkpoint) bool {
	name := c.Manifest.Name
	s.life.Lock()
	defer s.life.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	if c.gen == 0 || s.gens[name] != c.gen {
		return false
	}
	delete(s.gens, name)
	if s.removing == nil {
		s.removing = map[string]int{}
	}
	s.removing[name]++
	return true
}

// current reports whether gen is the generation of the checkpoint that now holds
// name (never for 0: a checkpoint not read from the store).
func (s *checkpointStore) current(name string, gen uint64) bool {
	s.life.RLock()
	defer s.life.RUnlock()
	return s.currentLocked(name, gen)
}

// currentLocked is current with s.life held.
func (s *checkpointStore) currentLocked(name string, gen uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return gen != 0 && s.gens[name] == gen
}

// whileCurrent runs fn while c is still the checkpoint of its name (its generation is
// current: it is not being removed, nor replaced by another of the name), and no
// removal can begin until fn returns; else it returns an error wrapping ErrNotFound.
// fn must not call the store.
func (s *checkpointStore) whileCurrent(c *Checkpoint, fn func() error) error {
	s.life.RLock()
	defer s.life.RUnlock()
	if !s.currentLocked(c.Manifest.Name, c.gen) {
		return fmt.Errorf("%w: checkpoint %s (deleted since it was read)", ErrNotFound, c.Manifest.Name)
	}
	return fn()
}

func (s *checkpointStore) exists(name string) bool {
	_, err := os.Stat(s.paths.checkpointDir(name))
	return err == nil
}

// beingRemoved reports whether a removal of name is under way (between its claim and the
// rename of its directory); s.life held (shared at least).
func (s *checkpointStore) beingRemoved(name string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.removing[name] > 0
}

// read reads and decodes a checkpoint's manifest without verifying its files, and gives
// the checkpoint its generation. A checkpoint being removed is not found.
func (s *checkpointStore) read(name string) (*Checkpoint, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	s.life.RLock()
	defer s.life.RUnlock()
	going := s.beingRemoved(name)
	if going {
		return nil, fmt.Errorf("%w: checkpoint %s (being deleted)", ErrNotFound, name)
	}
	dir := s.paths.checkpointDir(name)
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: checkpoint %s", ErrNotFound, name)
		}
		return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
	}
	ck, err := s.paths.decodeCheckpoint(b, dir)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
	}
	if ck.Name != name {
		return nil, fmt.Errorf("%w: %s: manifest names %q", ErrCheckpointCorrupt, name, ck.Name)
	}
	return &Checkpoint{Manifest: *ck, Dir: dir, gen: s.generation(name)}, nil
}

// adopt gives the checkpoint just committed under name its generation (0 when it is
// gone already, or being removed), as read does. Its maker calls it while the name is
// still reserved, so the checkpoint at the name is the one it committed.
func (s *checkpointStore) adopt(name string) uint64 {
	s.life.RLock()
	defer s.life.RUnlock()
	going := s.beingRemoved(name)
	if _, err := os.Stat(filepath.Join(s.paths.checkpointDir(name), manifestFile)); going || err != nil {
		return 0
	}
	return s.generation(name)
}

// readAny is read, and for a checkpoint whose manifest cannot be read (corrupt, or
// missing from a directory that is there) one that has only its name, directory and
// generation: enough to remove it (an explicit delete removes such a checkpoint too).
func (s *checkpointStore) readAny(name string) (*Checkpoint, error) {
	c, err := s.read(name)
	if err == nil || !errors.Is(err, ErrCheckpointCorrupt) && !errors.Is(err, ErrNotFound) {
		return c, err
	}
	s.life.RLock()
	defer s.life.RUnlock()
	going := s.beingRemoved(name)
	dir := s.paths.checkpointDir(name)
	if _, serr := os.Stat(dir); going || errors.Is(serr, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: checkpoint %s", ErrNotFound, name)
	}
	return &Checkpoint{Manifest: checkpointManifest{Name: name}, Dir: dir, gen: s.generation(name)}, nil
}

// load reads and verifies a checkpoint.
func (s *checkpointStore) load(ctx context.Context, name string) (*Checkpoint, error) {
	c, err := s.read(name)
	if err != nil {
		return nil, err
	}
	if err := s.verify(ctx, c); err != nil {
		return nil, err
	}
	return c, nil
}

// verify checks that a checkpoint's files exist with their recorded sizes and that the
// device state matches its checksum.
// Hashing stops with ctx's error when ctx ends.
func (s *checkpointStore) verify(ctx context.Context, c *Checkpoint) error {
	ck := &c.Manifest
	st, err := os.Stat(ck.RAMPath)
	if err != nil {
		return fmt.Errorf("%w: %s: ram file: %v", ErrCheckpointCorrupt, ck.Name, err)
	}
	if st.Size() != ck.RAMSize {
		return fmt.Errorf("%w: %s: ram file is %d bytes, want %d", ErrCheckpointCorrupt, ck.Name, st.Size(), ck.RAMSize)
	}
	sst, err := os.Stat(c.statePath())
	if err != nil {
		return fmt.Errorf("%w: %s: device state: %v", ErrCheckpointCorrupt, ck.Name, err)
	}
	for _, l := range ck.Disk {
		if _, err := os.Stat(l.Path); err != nil {
			return fmt.Errorf("%w: %s: disk: %v", ErrCheckpointCorrupt, ck.Name, err)
		}
	}
	if ck.ForkKernel != "" {
		if _, err := os.Stat(ck.ForkKernel); err != nil {
			return fmt.Errorf("%w: %s: stub kernel: %v", ErrCheckpointCorrupt, ck.Name, err)
		}
	}
	fp := fmt.Sprintf("%d/%d/%d", sst.Size(), sst.ModTime().UnixNano(), st.Size())
	// Delta layers: every ancestor's must be there, whole, before any QEMU starts.
	for _, l := range ck.Layers {
		lst, err := os.Stat(l.Path)
		if err != nil {
			return fmt.Errorf("%w: %s: ram layer of ancestor %s: %v", ErrCheckpointCorrupt, ck.Name, l.Checkpoint, err)
		}
		if lst.Size() != ck.RAMSize {
			return fmt.Errorf("%w: %s: ram layer of ancestor %s is %d bytes, want %d", ErrCheckpointCorrupt, ck.Name, l.Checkpoint, lst.Size(), ck.RAMSize)
		}
		fp += fmt.Sprintf("/%d/%d", lst.ModTime().UnixNano(), lst.Sys().(*syscall.Stat_t).Blocks)
	}
	s.mu.Lock()
	done := s.verified[ck.Name] == fp
	s.mu.Unlock()
	if done {
		return nil
	}
	for _, l := range ck.Layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		id, known := s.layerID(l.Path)
		if known {
			s.mu.Lock()
			known = s.layers[id] == l.SHA256+"/"+strconv.FormatInt(l.Size, 10)
			s.mu.Unlock()
		}
		if known {
			continue
		}
		sum, size, err := memfile.LayerDigest(l.Path)
		if err != nil {
			return fmt.Errorf("%w: %s: ram layer of ancestor %s: %v", ErrCheckpointCorrupt, ck.Name, l.Checkpoint, err)
		}
		if sum != l.SHA256 || size != l.Size {
			return fmt.Errorf("%w: %s: ram layer of ancestor %s: sha256 %s (%d bytes), manifest says %s (%d bytes)",
				ErrCheckpointCorrupt, ck.Name, l.Checkpoint, sum[:16], size, l.SHA256[:16], l.Size)
		}
		s.knowLayer(l.Path, id, sum, size)
	}
	sum, _, err := fileSHA256(ctx, c.statePath())
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, ck.Name, err)
	}
	if sum != ck.StateSHA256 {
		return fmt.Errorf("%w: %s: device state sha256 %s, manifest says %s", ErrCheckpointCorrupt, ck.Name, sum[:16], ck.StateSHA256[:16])
	}
	s.mu.Lock()
	s.verified[ck.Name] = fp
	s.mu.Unlock()
	return nil
}

// layerID is the identity of the layer file at path (false where it has none).
func (s *checkpointStore) layerID(path string) ([4]int64, bool) {
	st, err := os.Stat(path)
	if err != nil {
		return [4]int64{}, false
	}
	return platform.FileID(st)
}

// knowLayer records sum and size (memfile.LayerDigest) for the layer file at path,
// whose identity was id before it was read: kept only if the file did not change since.
func (s *checkpointStore) knowLayer(path string, id [4]int64, sum string, size int64) {
	if now, ok := s.layerID(path); !ok || now != id {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.layers == nil || len(s.layers) >= digestCacheMax {
		s.layers = map[[4]int64]string{}
	}
	s.layers[id] = sum + "/" + strconv.FormatInt(size, 10)
}

// list returns every committed checkpoint with its live forks and, by flat, the
// storage of its flattened RAM file.
func (s *checkpointStore) list(forks map[string][]string, flat func(*checkpointManifest) int64) ([]CheckpointInfo, error) {
	ents, err := os.ReadDir(s.paths.checkpointsDir())
	if err != nil {
		return nil, err
	}
	out := []CheckpointInfo{}
	for _, ent := range ents {
		if !ent.IsDir() || strings.HasPrefix(ent.Name(), ".") {
			continue
		}
		c, err := s.read(ent.Name())
		if errors.Is(err, ErrNotFound) {
			continue // deleted meanwhile
		}
		if err != nil {
			out = append(out, CheckpointInfo{Name: ent.Name(), Forks: forks[ent.Name()], Corrupt: err.Error()})
			continue
		}
		info := c.Info()
		info.Forks, info.FlatBytes = forks[c.Manifest.Name], flat(&c.Manifest)
		out = append(out, info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// save rewrites a checkpoint's manifest (pinning), flushed (rewriteCheckpointManifest).
func (s *checkpointStore) save(c *Checkpoint) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return rewriteCheckpointManifest(s.paths, c.Dir, &c.Manifest)
}

// remove deletes checkpoint c's directory and RAM file, once: c is claimed first
// (claim), which retires its generation, so that no work started on it (a warm pool, a
// flatten) takes hold once its removal began (beforeRemove ends what is under way), and
// so that another removal of it, or of the name, sees it gone (ErrNotFound) instead of
// removing it again, or removing the checkpoint that took its name since (the name is
// all the files go by). c must have been read from the store (read, readAny): one
// that was not is never removed (ErrNotFound). The directory is then renamed
// to a half-written checkpoint's name, the one atomic step: a crash at any later point
// leaves no committed checkpoint without its RAM file (the next engine start reaps the
// renamed directory and the RAM files nothing owns), where removing the RAM file first
// left a checkpoint that no longer loaded yet still held its name.
//
// The RAM file, layers and flattened file are then deleted by the checkpoint's name,
// so the name is held (holdName) from the start until they are gone: with the
// directory renamed away, a checkpoint of the same name could otherwise be committed
// meanwhile (Checkpoint, an import: both commit by those names), and lose them to
// this removal.
func (s *checkpointStore) remove(c *Checkpoint) error {
	name, gen := c.Manifest.Name, c.gen
	if !s.claim(c) {
		return fmt.Errorf("%w: checkpoint %s (deleted meanwhile)", ErrNotFound, name)
	}
	if s.holdName != nil {
		defer s.holdName(name)()
	}
	if s.beforeRemove != nil {
		s.beforeRemove(name, gen)
	}
	dir := s.paths.checkpointDir(name)
	var ramPath string
	if b, err := os.ReadFile(filepath.Join(dir, manifestFile)); err == nil {
		if ck, err := s.paths.decodeCheckpoint(b, dir); err == nil && s.paths.inRAMDir(ck.RAMPath) {
			ramPath = ck.RAMPath
		}
	}
	s.life.Lock()
	if gone := s.paths.tmpCheckpointDir(name); os.Rename(dir, gone) == nil {
		dir = gone
	}
	s.mu.Lock()
	if s.removing[name]--; s.removing[name] <= 0 {
		delete(s.removing, name)
	}
	s.mu.Unlock()
	s.life.Unlock()
	if s.afterRename != nil {
		s.afterRename(name)
	}
	if ramPath != "" {
		os.Remove(ramPath)
	}
	os.Remove(s.paths.checkpointRAM(name))
	os.RemoveAll(s.paths.checkpointLayers(name))
	os.Remove(s.paths.checkpointFlat(name))
	os.RemoveAll(dir)
	s.mu.Lock()
	delete(s.verified, name)
	s.mu.Unlock()
	return nil
}

// punch gives back the storage that forks faulted into the holes the checkpoint's RAM
// file had when it was frozen: a fork's write to, or a full save's read of, guest memory
// that nobody wrote allocates a zero page in the shared file (tmpfs). Those pages only
// ever hold zeros, so punching them changes nothing any fork reads. The hole list is
// acted on only when it matches the manifest's digest, and even then only pages that
// read as zero are punched (memfile.PunchHoles): a damaged list is reported
// (ErrCheckpointCorrupt, logged) and never zeroes data. Checkpoints frozen without a
// recorded list are left alone.
func (s *checkpointStore) punch(name string) {
	freed, err := s.punchHoles(name)
	if err != nil {
		s.log.Warn("not punching a checkpoint's holes", "checkpoint", name, "err", err)
		return
	}
	if freed > 0 {
		s.log.Info("gave back pages faulted into a checkpoint's holes", "checkpoint", name, "bytes", freed)
	}
}

// punchHoles is punch, returning the bytes freed; a missing list is no error.
func (s *checkpointStore) punchHoles(name string) (int64, error) {
	c, err := s.read(name)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return 0, nil
		}
		return 0, err
	}
	b, err := os.ReadFile(filepath.Join(c.Dir, ramHolesFile))
	if errors.Is(err, os.ErrNotExist) && c.Manifest.RAMHolesSHA256 == "" {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("%w: %s: hole list: %v", ErrCheckpointCorrupt, name, err)
	}
	if c.Manifest.RAMHolesSHA256 == "" {
		// Written before lists had digests: unverifiable, so never acted on.
		s.log.Debug("checkpoint hole list has no digest: not punching", "checkpoint", name)
		return 0, nil
	}
	if sum := bytesSHA256(b); sum != c.Manifest.RAMHolesSHA256 {
		return 0, fmt.Errorf("%w: %s: hole list sha256 %s, manifest says %s", ErrCheckpointCorrupt, name, sum[:16], c.Manifest.RAMHolesSHA256[:min(16, len(c.Manifest.RAMHolesSHA256))])
	}
	holes, err := memfile.DecodeRanges(b, c.Manifest.RAMSize)
	if err != nil {
		return 0, fmt.Errorf("%w: %s: hole list: %v", ErrCheckpointCorrupt, name, err)
	}
	freed, err := memfile.PunchHoles(c.Manifest.RAMPath, holes)
	if err != nil {
		return 0, fmt.Errorf("engine: checkpoint %s: %w", name, err)
	}
	return freed, nil
}

// hold keeps checkpoint name from being collected while the engine runs.
func (s *checkpointStore) hold(name string) {
	s.mu.Lock()
	if s.held == nil {
		s.held = map[string]bool{}
	}
	s.held[name] = true
	s.mu.Unlock()
}

// markForked records that a checkpoint has had a fork (see forkedMarker).
func (s *checkpointStore) markForked(name string) {
	f, err := os.OpenFile(filepath.Join(s.paths.checkpointDir(name), forkedMarker), os.O_CREATE|os.O_WRONLY, 0o600)
	if err == nil {
		f.Close()
	}
}

// collect deletes an unpinned checkpoint that has had its forks (or is implicit) when
// forks reports none left (and no VM kept aside holds it). The manifest decides; the files are verified (hashed) only
// for a checkpoint that is about to go, so an engine start does not hash every one.
func (s *checkpointStore) collect(name string, forks func(string) int) {
	c, err := s.read(name)
	if err != nil || c.Manifest.Pinned {
		return
	}
	if _, err := os.Stat(filepath.Join(c.Dir, forkedMarker)); err != nil && !c.Manifest.Implicit {
		return
	}
	s.mu.Lock()
	held := s.held[name]
	s.mu.Unlock()
	// Collection runs after the request that ended the last fork, on no caller's
	// context: the hash is bounded by the checkpoint's size.
	// A removal that finds c gone (another removal took it) does nothing.
	if forks(name) == 0 && !held && s.verify(context.Background(), c) == nil && s.remove(c) == nil {
		s.log.Info("deleted unpinned checkpoint (no forks left)", "checkpoint", name)
	}
}

// reap removes half-written checkpoints (and manifests), RAM files nothing owns (vmLive
// says which VM names are registered; the RAM file of a VM directory still there is
// owned by it even when it is not), then collects unpinned checkpoints without forks.
func (s *checkpointStore) reap(vmLive func(string) bool, forks func(string) int) error {
	ents, err := os.ReadDir(s.paths.checkpointsDir())
	if err != nil {
		return err
	}
	live := map[string]bool{}
	for _, ent := range ents {
		if strings.HasPrefix(ent.Name(), tmpCheckpointPrefix) {
			s.log.Info("reaping half-written checkpoint", "dir", ent.Name())
			if err := removeAllSettled(filepath.Join(s.paths.checkpointsDir(), ent.Name())); err != nil {
				s.log.Warn("could not reap a half-written checkpoint", "dir", ent.Name(), "err", err)
			}
			continue
		}
		live[ent.Name()] = true
		// A manifest rewrite (SetPinned) that a crash cut short: writeJSON's temporary file.
		os.Remove(filepath.Join(s.paths.checkpointsDir(), ent.Name(), manifestFile+".tmp"))
	}
	rams, _ := os.ReadDir(s.paths.ram)
	for _, r := range rams {
		kind, name := parseRAMName(r.Name())
		if kind == "vm" && !vmLive(name) && s.vmDirLeft(name) {
			// A VM that recovery could neither adopt nor move aside (keepAside) is
			// still there, unregistered: its RAM file is its own, not an orphan.
			s.log.Warn("keeping the RAM file of a vm directory that was not adopted", "vm", name, "ram", filepath.Join(s.paths.ram, r.Name()))
			continue
		}
		if kind == "tmp" || kind == "checkpoint" && !live[name] || kind == "vm" && !vmLive(name) {
			os.RemoveAll(filepath.Join(s.paths.ram, r.Name()))
		}
	}
	for name := range live {
		s.collect(name, forks)
	}
	return nil
}

// vmDirLeft reports whether the state directory still has something at the VM
// directory of name (a VM recovery left in place), or cannot tell: either way the files
// named after that VM are not provably orphans.
func (s *checkpointStore) vmDirLeft(name string) bool {
	_, err := os.Lstat(s.paths.vmDir(name))
	return !errors.Is(err, os.ErrNotExist)
}

// removeAllSettled removes dir and what it holds, trying again for up to a second while
// something still writes into it: a helper of a killed engine can create a file between
// the listing and the removal of the directory.
func removeAllSettled(dir string) error {
	var err error
	for i := 0; i < 10; i++ {
		if err = os.RemoveAll(dir); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// LoadCheckpoint reads and verifies a checkpoint's manifest and files. The device-state
// checksum is verified once per engine and file identity, not on every fork; hashing
// (hundreds of MiB for a large guest) stops with ctx's error when ctx ends.
func (e *Engine) LoadCheckpoint(ctx context.Context, name string) (*Checkpoint, error) {
	return e.cks.load(ctx, name)
}

// Checkpoints lists checkpoints with their live forks (an empty list, never nil).
func (e *Engine) Checkpoints() ([]CheckpointInfo, error) {
	return e.cks.list(e.vms.forksByParent(), e.flatBytes)
}

// flatBytes is the storage of the flattened RAM file of the checkpoint m (0: none).
func (e *Engine) flatBytes(m *checkpointManifest) int64 {
	if p := flatPath(e.paths, m); p != "" {
		return allocatedBytes(p)
	}
	return 0
}

// CheckpointInfo returns one checkpoint with its live forks, as Checkpoints lists it
// (its manifest is read, its files are not verified: see LoadCheckpoint).
func (e *Engine) CheckpointInfo(name string) (CheckpointInfo, error) {
	c, err := e.cks.read(name)
	if err != nil {
		return CheckpointInfo{}, err
	}
	info := c.Info()
	info.Forks, info.FlatBytes = e.vms.forksByParent()[name], e.flatBytes(&c.Manifest)
	return info, nil
}

// SetPinned pins or unpins a checkpoint. Unpinning a checkpoint whose forks are all gone
// deletes it.
func (e *Engine) SetPinned(ctx context.Context, name string, pinned bool) (err error) {
	ctx, leave, err := e.op(ctx, "pin "+name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	c, err := e.cks.load(ctx, name)
	if err != nil {
		return err
	}
	c.Manifest.Pinned = pinned
	if err := e.cks.save(c); err != nil {
		return err
	}
	if !pinned {
		e.collect(name)
	}
	return nil
}

// collect is checkpointStore.collect under the fork guard: a fork of name being made
// is not registered yet, so forksOf does not count it, and collecting the checkpoint
// then would remove it under that fork, which would become ready with its parent gone.
// While it decides, new forks of name wait (forkGuard.pause); one under way keeps the
// checkpoint (collected later with its last fork, or by the next engine's start). A
// forced delete of name under way removes it itself: it deletes the checkpoint's forks
// first, and the collection each one's end would start is left to it (a checkpoint is
// removed once: the delete would find it gone).
func (e *Engine) collect(name string) {
	end, making := e.forking.pause(name)
	defer end()
	if making > 0 || e.forking.stopping(name) {
		return
	}
	e.cks.collect(name, e.vms.forksOf)
}
