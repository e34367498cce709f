package engine

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/engine/internal/platform"
	"github.com/forkvm/forkvm/memfile"
	"golang.org/x/sys/unix"
)

// Moving checkpoints between hosts. A checkpoint's manifest is written relocatable
// (format 2): every file in the engine's own directories is recorded relative to its
// directory (the RAM file and delta layers to Config.RAMDir, the disk chain, overlay
// template and stub kernel to the checkpoint's directory), so the record holds no path
// of this host but the boot files' (kernel, initrd), which another host finds by
// digest. Format 1 manifests (absolute paths) still load.
//
// Export lists the files a fork needs with their content digests
// (memfile.ContentDigest: holes and zero pages never travel, a file's layout does not
// change its digest) and data extents. The digests are computed on a checkpoint's first
// export and kept in its manifest: hashing reads every byte of data, which costs more
// than the checkpoint itself (BenchmarkContentDigest2GiB), and most checkpoints never
// leave their host.
//
// Import takes an export and the files' bytes (a puller fetches them from the holder),
// writes them under temporary names (zero pages stay holes), checks each file's digest
// as it arrives (ErrDigest), and commits by rename like a checkpoint of this host.

// checkpointFormat is the format of the checkpoint manifests the engine writes:
// relocatable (see above). manifestVersion (1, absolute paths) is still read.
const checkpointFormat = 2

// Export names of a checkpoint's files outside its directory.
const (
	exportRAMPrefix = "ram/"
	exportKernel    = "boot/kernel"
	exportInitrd    = "boot/initrd"
	// blobsDir, in Config.CacheDir, holds boot files and base disk images pulled from
	// other hosts by content digest, once per host (the cache is the host's).
	blobsDir = "blobs/sha256"
)

// fileDigest is a file's content digest as the manifest keeps it (Digests).
type fileDigest struct {
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
	Data   int64  `json:"data"`
}

// manifestPathOK checks a recorded path for the manifest's format: absolute in format
// 1, relative and inside its directory in format 2.
func manifestPathOK(version int, p string) bool {
	if version == checkpointFormat {
		return p != "" && filepath.IsLocal(p)
	}
	return p != "" && filepath.IsAbs(p)
}

// portable returns ck as format 2 writes it (paths relative to the RAM directory and to
// dir, the checkpoint's final directory), or ck as format 1 (ok false) when one of its
// files is outside those directories.
func portable(l layout, ck *checkpointManifest, dir string) (out *checkpointManifest, ok bool) {
	c := *ck
	c.Layers = append([]ramLayer(nil), ck.Layers...)
	c.Disk = append([]diskLayer(nil), ck.Disk...)
	ok = true
	rel := func(base string, p *string) {
		if *p == "" {
			return
		}
		r, err := filepath.Rel(base, *p)
		if err != nil || !filepath.IsLocal(r) {
			ok = false
			return
		}
		*p = r
	}
	rel(l.ram, &c.RAMPath)
	for i := range c.Layers {
		rel(l.ram, &c.Layers[i].Path)
	}
	for i := range c.Disk {
		rel(dir, &c.Disk[i].Path)
	}
	rel(dir, &c.OverlayTemplate)
	rel(dir, &c.ForkKernel)
	if !ok {
		c := *ck
		c.Version = manifestVersion
		return &c, false
	}
	c.Version = checkpointFormat
	return &c, true
}

// resolve makes a format 2 manifest's relative paths this host's (the RAM directory's
// and dir's); format 1 is left as it is.
func (l layout) resolve(ck *checkpointManifest, dir string) error {
	if ck.Version != checkpointFormat {
		return nil
	}
	bad := ""
	abs := func(base string, p *string) {
		if *p == "" {
			return
		}
		if !filepath.IsLocal(*p) {
			bad = *p
			return
		}
		*p = filepath.Join(base, *p)
	}
	abs(l.ram, &ck.RAMPath)
	ck.Layers = append([]ramLayer(nil), ck.Layers...)
	for i := range ck.Layers {
		abs(l.ram, &ck.Layers[i].Path)
	}
	ck.Disk = append([]diskLayer(nil), ck.Disk...)
	for i := range ck.Disk {
		abs(dir, &ck.Disk[i].Path)
	}
	abs(dir, &ck.OverlayTemplate)
	abs(dir, &ck.ForkKernel)
	if bad != "" {
		return fmt.Errorf("path %q leaves its directory", bad)
	}
	return nil
}

// decodeCheckpoint decodes a checkpoint manifest read from dir and makes its paths this
// host's.
func (l layout) decodeCheckpoint(b []byte, dir string) (*checkpointManifest, error) {
	ck, err := decodeCheckpointManifest(b)
	if err != nil {
		return nil, err
	}
	if err := l.resolve(ck, dir); err != nil {
		return nil, err
	}
	return ck, nil
}

// writeCheckpointManifest writes ck, a checkpoint whose directory is (or will be) dir,
// to file in the relocatable format.
func writeCheckpointManifest(l layout, dir, file string, ck *checkpointManifest) error {
	p, _ := portable(l, ck, dir)
	return writeJSON(file, p)
}

// rewriteCheckpointManifest replaces the manifest of ck, a committed checkpoint in dir,
// flushed before and after its rename (writeJSONSync): unflushed, a power loss just
// after the rename can leave an empty or zeroed manifest where a good one was, and a
// checkpoint that was whole unreadable. A rewrite (pinning, recorded digests) is off
// any fork's or checkpoint's path; its two flushes cost under a millisecond on a disk.
func rewriteCheckpointManifest(l layout, dir string, ck *checkpointManifest) error {
	p, _ := portable(l, ck, dir)
	return writeJSONSync(filepath.Join(dir, manifestFile), p)
}

// exportFile is one file of a checkpoint as export names it, and its path here.
type exportFile struct {
	name, path string
	optional   bool
	// layer: a delta layer, whose data extents say which pages it holds (zero pages
	// included), so they travel as they are.
	layer bool
}

// exportFiles lists the files of checkpoint ck (paths resolved, directory dir) that a
// fork of it on another host needs, by export name. Names are derived from the
// relocatable manifest alone, so the puller derives the same list.
func exportFiles(l layout, ck *checkpointManifest, dir string) ([]exportFile, error) {
	p, ok := portable(l, ck, dir)
	if !ok {
		return nil, fmt.Errorf("%w: %s: its files are not all in the engine's directories (not relocatable)", ErrCheckpointCorrupt, ck.Name)
	}
	var out []exportFile
	inDir := func(name string) {
		out = append(out, exportFile{name: name, path: filepath.Join(dir, name)})
	}
	inDir(stateFile)
	if ck.RAMHolesSHA256 != "" {
		inDir(ramHolesFile)
	}
	out = append(out, exportFile{name: console.HistoryFile, path: filepath.Join(dir, console.HistoryFile), optional: true})
	for _, d := range p.Disk {
		inDir(d.Path)
	}
	for _, f := range []string{p.OverlayTemplate, p.ForkKernel} {
		if f != "" {
			inDir(f)
		}
	}
	out = append(out, exportFile{name: exportRAMPrefix + p.RAMPath, path: ck.RAMPath})
	for i, lr := range p.Layers {
		out = append(out, exportFile{name: exportRAMPrefix + lr.Path, path: ck.Layers[i].Path, layer: true})
	}
	if ck.Kernel != "" {
		out = append(out, exportFile{name: exportKernel, path: ck.Kernel})
	}
	if ck.Initrd != "" {
		out = append(out, exportFile{name: exportInitrd, path: ck.Initrd})
	}
	seen := map[string]bool{}
	for _, f := range out {
		if seen[f.name] || !filepath.IsLocal(f.name) {
			return nil, fmt.Errorf("%w: %s: file %q twice or outside its directory", ErrCheckpointCorrupt, ck.Name, f.name)
		}
		seen[f.name] = true
	}
	return out, nil
}

// ExportCheckpoint describes checkpoint name for a host that pulls it: its relocatable
// manifest and every file a fork needs, with content digests (computed on the first
// export and kept in the manifest) and data extents. The checkpoint is verified first
// (ErrNotFound, ErrCheckpointCorrupt).
func (e *Engine) ExportCheckpoint(ctx context.Context, name string) (_ *api.CheckpointExport, err error) {
	ctx, leave, err := e.op(ctx, "export "+name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	c, err := e.cks.load(ctx, name)
	if err != nil {
		return nil, err
	}
	ck := &c.Manifest
	files, err := exportFiles(e.paths, ck, c.Dir)
	if err != nil {
		return nil, err
	}
	ver, err := e.bins.version(ctx)
	if err != nil {
		return nil, err
	}
	out := &api.CheckpointExport{Schema: api.CheckpointExportSchema, Checkpoint: name, QEMUVersion: ver, Accel: string(ck.Accel)}
	fresh := map[string]fileDigest{}
	for _, f := range files {
		st, err := os.Stat(f.path)
		if f.optional && errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
		}
		d, ok := ck.Digests[f.name]
		if !ok || d.Size != st.Size() {
			sum, data, err := e.digests.contentDigest(ctx, f.path)
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
			}
			d = fileDigest{Size: st.Size(), SHA256: sum, Data: data}
			fresh[f.name] = d
		}
		exts, err := fileExtents(f.path)
		if err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrCheckpointCorrupt, name, err)
		}
		out.Files = append(out.Files, api.CheckpointFile{Name: f.name, Size: d.Size, SHA256: d.SHA256, Data: d.Data, Extents: exts, Layout: f.layer})
	}
	if len(fresh) > 0 {
		if err := e.cks.recordDigests(name, fresh); err != nil {
			e.log.Warn("cannot keep a checkpoint's file digests", "checkpoint", name, "err", err)
		}
		if ck.Digests == nil {
			ck.Digests = map[string]fileDigest{}
		}
		for k, v := range fresh {
			ck.Digests[k] = v
		}
	}
	// The boot files are named by their export names: the puller finds or fetches
	// them by digest.
	p, _ := portable(e.paths, ck, c.Dir)
	if p.Kernel != "" {
		p.Kernel = exportKernel
	}
	if p.Initrd != "" {
		p.Initrd = exportInitrd
	}
	if out.Manifest, err = json.Marshal(p); err != nil {
		return nil, err
	}
	return out, nil
}

// digestCache keeps the content digests (memfile.ContentDigest) the engine took, by
// the file's identity (platform.FileID: device, inode, size, modification time). A
// checkpoint's lineage files are hard links to its ancestors' (one inode), and a
// protection point exported to a peer every few seconds would otherwise digest its
// whole lineage, root RAM file and disk included, each time. Checkpoint files do not
// change once committed; a file written after its digest has another modification
// time and is digested again (one written and its time set back would keep its old
// digest, and a puller, which checks every byte it receives against the digests,
// would refuse it).
type digestCache struct {
	mu sync.Mutex
	m  map[[4]int64]fileDigest
}

// digestCacheMax bounds the entries kept (the cache starts over past it).
const digestCacheMax = 4096

// contentDigest is memfile.ContentDigest of path through the cache.
func (c *digestCache) contentDigest(ctx context.Context, path string) (string, int64, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", 0, fmt.Errorf("memfile: content digest: %w", err)
	}
	id, ok := platform.FileID(st)
	if ok {
		c.mu.Lock()
		d, hit := c.m[id]
		c.mu.Unlock()
		if hit {
			return d.SHA256, d.Data, nil
		}
	}
	sum, data, err := memfile.ContentDigest(ctx, path)
	if err != nil || !ok {
		return sum, data, err
	}
	// Kept only if the file did not change while it was read.
	if st2, err := os.Stat(path); err == nil {
		if id2, ok2 := platform.FileID(st2); ok2 && id2 == id {
			c.mu.Lock()
			if c.m == nil || len(c.m) >= digestCacheMax {
				c.m = map[[4]int64]fileDigest{}
			}
			c.m[id] = fileDigest{Size: st.Size(), SHA256: sum, Data: data}
			c.mu.Unlock()
		}
	}
	return sum, data, nil
}

// fileExtents lists a file's data extents.
func fileExtents(path string) ([]api.Extent, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	exts, err := memfile.DataExtents(f, st.Size())
	if err != nil {
		return nil, err
	}
	out := make([]api.Extent, len(exts))
	for i, x := range exts {
		out[i] = api.Extent{Off: x.Off, Len: x.Len}
	}
	return out, nil
}

// OpenCheckpointFile opens the file of checkpoint name that its export calls file, for
// reading (ErrNotFound for a name the export does not list).
func (e *Engine) OpenCheckpointFile(ctx context.Context, name, file string) (*os.File, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	c, err := e.cks.read(name)
	if err != nil {
		return nil, err
	}
	files, err := exportFiles(e.paths, &c.Manifest, c.Dir)
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		if f.name == file {
			fd, err := os.Open(f.path)
			if errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("%w: checkpoint %s has no file %q", ErrNotFound, name, file)
			}
			return fd, err
		}
	}
	return nil, fmt.Errorf("%w: checkpoint %s has no file %q", ErrNotFound, name, file)
}

// recordDigests adds file digests to a checkpoint's manifest (re-read under the
// store's lock, so a concurrent pin is kept).
func (s *checkpointStore) recordDigests(name string, ds map[string]fileDigest) error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	c, err := s.read(name)
	if err != nil {
		return err
	}
	if c.Manifest.Digests == nil {
		c.Manifest.Digests = map[string]fileDigest{}
	}
	for k, v := range ds {
		c.Manifest.Digests[k] = v
	}
	return rewriteCheckpointManifest(s.paths, c.Dir, &c.Manifest)
}

// CheckpointImport is a checkpoint being brought from another host (Engine.ImportCheckpoint):
// Fetch lists the files to transfer, Create writes each one (checked against its digest
// as it arrives), Commit makes the checkpoint visible and Abort drops it. Its methods
// are not safe for concurrent use, but files may be written concurrently. The engine's
// Close aborts an import still open (its temporary files are in the engine's
// directories, its name reserved there); its methods then fail with ErrClosed.
type CheckpointImport struct {
	e    *Engine
	name string
	ck   *checkpointManifest // as received (relocatable)
	// Present: a checkpoint of this name and content is here already; nothing to do.
	Present bool

	files       []*importFile
	tmp, ramTmp string
	layersTmp   string
	// mu guards what Abort changes: Close aborts an import open (held, released by
	// the import's end) whatever its caller does meanwhile.
	mu               sync.Mutex
	reserved, closed bool
	held             func()
}

// importFile is one file of an import: where it is written (or, had, where this host
// already has it) and its final place.
type importFile struct {
	api.CheckpointFile
	stage, final string
	blob         bool // a boot file or base image kept in the host's blob store
	had          string
	// alts are other local files with had's content (lineageFiles): had may go with
	// its checkpoint (an old protection point dropped) before the commit links it.
	alts []string
	done bool
}

// ImportCheckpoint starts importing the checkpoint exp describes (an export of another
// engine): the manifest is checked (ErrCheckpointCorrupt), its QEMU and accelerator must
// be this engine's (ErrIncompatible, as for a fork), and its name free (ErrExists) unless
// the same checkpoint is here already (Present). Files this host has with the same
// digest (boot files and base images in the host's blob store, the current guest
// image's kernel and initrd) are not fetched again. Abort or Commit it.
func (e *Engine) ImportCheckpoint(ctx context.Context, exp *api.CheckpointExport) (_ *CheckpointImport, err error) {
	what := "import"
	if exp != nil {
		what += " " + exp.Checkpoint
	}
	ctx, leave, err := e.op(ctx, what)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	if exp == nil {
		return nil, fmt.Errorf("%w: no export", ErrInvalidSpec)
	}
	ck, err := decodeCheckpointManifest(exp.Manifest)
	if err != nil {
		return nil, fmt.Errorf("%w: import %s: %v", ErrCheckpointCorrupt, exp.Checkpoint, err)
	}
	if ck.Version != checkpointFormat || ck.Name != exp.Checkpoint {
		return nil, fmt.Errorf("%w: import %s: manifest version %d of %q is not relocatable", ErrCheckpointCorrupt, exp.Checkpoint, ck.Version, ck.Name)
	}
	name := ck.Name
	if err := compatible(ctx, e.bins, e.cfg.accel, ck); err != nil {
		return nil, err
	}
	imp := &CheckpointImport{e: e, name: name, ck: ck}
	if old, err := e.cks.read(name); err == nil {
		if old.Manifest.StateSHA256 == ck.StateSHA256 && old.Manifest.RAMSize == ck.RAMSize {
			imp.Present = true
			return imp, nil
		}
		return nil, fmt.Errorf("%w: checkpoint %s (another one)", ErrExists, name)
	}
	final, want, err := e.importTargets(name, ck)
	if err != nil {
		return nil, err
	}
	got, err := exportedFiles(name, exp.Files)
	if err != nil {
		return nil, err
	}
	if err := e.vms.reserve(name); err != nil {
		return nil, err
	}
	imp.reserved = true
	ok := false
	defer func() {
		if !ok {
			imp.Abort()
		}
	}()
	// Open between calls, it is no operation Close waits for: Close aborts it.
	if imp.held, err = e.ops.hold(imp.Abort); err != nil {
		return nil, err
	}
	imp.tmp = e.paths.tmpCheckpointDir(name)
	if err := os.Mkdir(imp.tmp, 0o700); err != nil {
		return nil, fmt.Errorf("engine: import %s: %w", name, err)
	}
	imp.ramTmp = e.paths.checkpointRAM(name) + ".tmp-" + randHex(4)
	if len(ck.Layers) > 0 {
		imp.layersTmp = e.paths.checkpointLayers(name) + ".tmp-" + randHex(4)
		if err := os.Mkdir(imp.layersTmp, 0o700); err != nil {
			return nil, fmt.Errorf("engine: import %s: %w", name, err)
		}
	}
	if err := imp.planFiles(ctx, want, got, final); err != nil {
		return nil, err
	}
	if err := imp.checkSpace(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ok = true
	return imp, nil
}

// importTargets is where each file of checkpoint name (manifest ck, from another
// engine) goes on this host: the manifest resolved against this engine's directories,
// with the files the export must or may hold.
func (e *Engine) importTargets(name string, ck *checkpointManifest) (*checkpointManifest, []exportFile, error) {
	final := *ck
	if err := e.paths.resolve(&final, e.paths.checkpointDir(name)); err != nil {
		return nil, nil, fmt.Errorf("%w: import %s: %v", ErrCheckpointCorrupt, name, err)
	}
	if err := importLayout(e.paths, &final, e.paths.checkpointDir(name)); err != nil {
		return nil, nil, fmt.Errorf("%w: import %s: %v", ErrCheckpointCorrupt, name, err)
	}
	final.Kernel, final.Initrd = "", ""
	if ck.Kernel != "" {
		final.Kernel = exportKernel
	}
	if ck.Initrd != "" {
		final.Initrd = exportInitrd
	}
	want, err := exportFiles(e.paths, &final, e.paths.checkpointDir(name))
	if err != nil {
		return nil, nil, err
	}
	return &final, want, nil
}

// exportedFiles checks the files an export of checkpoint name lists, by name.
func exportedFiles(name string, files []api.CheckpointFile) (map[string]api.CheckpointFile, error) {
	got := map[string]api.CheckpointFile{}
	for _, f := range files {
		if _, dup := got[f.Name]; dup {
			return nil, fmt.Errorf("%w: import %s: file %q listed twice", ErrCheckpointCorrupt, name, f.Name)
		}
		if err := checkExportFile(f); err != nil {
			return nil, fmt.Errorf("%w: import %s: %v", ErrCheckpointCorrupt, name, err)
		}
		got[f.Name] = f
	}
	return got, nil
}

// planFiles decides, for each file the import wants, where it is staged and whether
// this host has it already (blob store, the lineage's RAM files). The export must list
// every file wanted that is not optional, and nothing else.
func (imp *CheckpointImport) planFiles(ctx context.Context, want []exportFile, got map[string]api.CheckpointFile, final *checkpointManifest) error {
	blobs := filepath.Join(imp.e.cfg.CacheDir, blobsDir)
	local := imp.e.lineageFiles()
	staged := map[string]bool{filepath.Join(imp.tmp, manifestFile): true}
	for _, w := range want {
		f, listed := got[w.name]
		delete(got, w.name)
		if !listed {
			if w.optional {
				continue
			}
			return fmt.Errorf("%w: import %s: the export lacks %q", ErrCheckpointCorrupt, imp.name, w.name)
		}
		f.Layout = w.layer
		if err := importBound(final, w, f); err != nil {
			return err
		}
		fi := &importFile{CheckpointFile: f, final: w.path}
		switch {
		case w.name == exportKernel || w.name == exportInitrd || w.name == firstDisk(final):
			fi.blob = true
			fi.final = filepath.Join(blobs, f.SHA256)
			// Staged in the import's own directory, which the state directory's
			// reaper owns (a killed pull leaves nothing in the shared blob store).
			fi.stage = filepath.Join(imp.tmp, filepath.Base(w.path))
			if w.name == exportKernel || w.name == exportInitrd {
				fi.stage = filepath.Join(imp.tmp, strings.ReplaceAll(w.name, "/", "-"))
			}
			fi.had = imp.e.hostHas(ctx, f, fi.final)
		case strings.HasPrefix(w.name, exportRAMPrefix):
			fi.stage = imp.ramStage(w.path)
			if found := local.find(fi, imp.ck, final.Layers, w); len(found) > 0 {
				fi.had, fi.alts = found[0], found[1:]
			}
		default:
			fi.stage = filepath.Join(imp.tmp, filepath.Base(w.path))
		}
		if staged[fi.stage] {
			return fmt.Errorf("%w: import %s: two files staged as %s", ErrCheckpointCorrupt, imp.name, filepath.Base(fi.stage))
		}
		staged[fi.stage] = true
		imp.files = append(imp.files, fi)
	}
	for n := range got {
		return fmt.Errorf("%w: import %s: unexpected file %q", ErrCheckpointCorrupt, imp.name, n)
	}
	return nil
}

// checkpointDirFiles are the files of a checkpoint's directory that mean something to
// the engine by their name alone: its manifest and the manifest's rewrite (removed at
// each start), device state, hole lists, console history, the full save of a checkpoint
// being written, and forkedMarker (which makes an unpinned checkpoint collectable).
// An imported disk layer, overlay template or fork kernel so named would act as that
// file: a disk named "forked" would have the checkpoint collected after its first
// fork's end without it ever having had one.
var checkpointDirFiles = map[string]bool{
	manifestFile: true, manifestFile + ".tmp": true, stateFile: true, fullSaveFile: true,
	ramHolesFile: true, flatHolesFile: true, console.HistoryFile: true, forkedMarker: true,
}

// importLayout checks that a resolved manifest places every file where this engine
// keeps a checkpoint's: its RAM file and layers under its own names in the RAM
// directory, the rest directly in its directory under names that none of the engine's
// own files there has (checkpointDirFiles).
func importLayout(l layout, ck *checkpointManifest, dir string) error {
	if ck.RAMPath != l.checkpointRAM(ck.Name) {
		return fmt.Errorf("ram file %s is not the checkpoint's own", filepath.Base(ck.RAMPath))
	}
	for _, lr := range ck.Layers {
		if filepath.Dir(lr.Path) != l.checkpointLayers(ck.Name) {
			return fmt.Errorf("ram layer %s is not in the checkpoint's layers", filepath.Base(lr.Path))
		}
	}
	in := []string{ck.OverlayTemplate, ck.ForkKernel}
	for _, d := range ck.Disk {
		in = append(in, d.Path)
	}
	for _, p := range in {
		if p != "" && filepath.Dir(p) != dir {
			return fmt.Errorf("file %s is not directly in the checkpoint's directory", p)
		}
		if p != "" && checkpointDirFiles[filepath.Base(p)] {
			return fmt.Errorf("file %s has the name of the engine's own %q", p, filepath.Base(p))
		}
	}
	return nil
}

// localLineage indexes the RAM files and layers of this engine's checkpoints, so that
// an import links those it has instead of fetching them again (a delta checkpoint of a
// lineage pulled before brings only its newer layers): RAM files by the content digest
// recorded on their export or import, layers by their own digest (which covers which
// pages they hold).
type localLineage struct {
	ram    map[string][]string // content digest -> paths
	layers map[string][]string // layer digest -> paths
}

// lineageFiles reads the index from the committed checkpoints' manifests.
func (e *Engine) lineageFiles() localLineage {
	l := localLineage{ram: map[string][]string{}, layers: map[string][]string{}}
	ents, _ := os.ReadDir(e.paths.checkpointsDir())
	for _, ent := range ents {
		if !ent.IsDir() || strings.HasPrefix(ent.Name(), ".") {
			continue
		}
		c, err := e.cks.read(ent.Name())
		if err != nil {
			continue
		}
		m := &c.Manifest
		if d, ok := m.Digests[exportRAMPrefix+filepath.Base(m.RAMPath)]; ok && e.paths.inRAMDir(m.RAMPath) {
			k := fmt.Sprintf("%s/%d", d.SHA256, d.Size)
			l.ram[k] = append(l.ram[k], m.RAMPath)
		}
		for _, lr := range m.Layers {
			k := fmt.Sprintf("%s/%d", lr.SHA256, lr.Size)
			l.layers[k] = append(l.layers[k], lr.Path)
		}
	}
	return l
}

// find returns the local paths holding file f of the import (final: its resolved
// manifest's layers), none if no local checkpoint holds it.
func (l localLineage) find(f *importFile, ck *checkpointManifest, layers []ramLayer, w exportFile) []string {
	var ps []string
	if w.layer {
		for i, lr := range layers {
			if lr.Path == w.path {
				ps = l.layers[fmt.Sprintf("%s/%d", ck.Layers[i].SHA256, ck.Layers[i].Size)]
			}
		}
	} else {
		ps = l.ram[fmt.Sprintf("%s/%d", f.SHA256, f.Size)]
	}
	var out []string
	for _, p := range ps {
		if st, err := os.Stat(p); err == nil && st.Size() == f.Size {
			out = append(out, p)
		}
	}
	return out
}

// firstDisk is the export name of a checkpoint's base disk layer ("" without a disk).
func firstDisk(ck *checkpointManifest) string {
	if len(ck.Disk) == 0 {
		return ""
	}
	return filepath.Base(ck.Disk[0].Path)
}

// ramStage maps a file's final place in the RAM directory to its temporary one.
func (imp *CheckpointImport) ramStage(final string) string {
	l := imp.e.paths
	if final == l.checkpointRAM(imp.name) {
		return imp.ramTmp
	}
	return filepath.Join(imp.layersTmp, filepath.Base(final))
}

// checkExportFile refuses an export's file record that is malformed: a bad digest,
// size or extent list.
func checkExportFile(f api.CheckpointFile) error {
	if _, err := hex.DecodeString(f.SHA256); err != nil || len(f.SHA256) != 64 {
		return fmt.Errorf("file %q: bad digest", f.Name)
	}
	if f.Size < 0 || f.Data < 0 || f.Data > f.Size {
		return fmt.Errorf("file %q: bad size", f.Name)
	}
	var end int64
	for _, x := range f.Extents {
		if x.Off < end || x.Len <= 0 || x.Off%memfile.PageSize != 0 || x.Off+x.Len > f.Size || x.Off+x.Len < x.Off {
			return fmt.Errorf("file %q: bad extent %d+%d", f.Name, x.Off, x.Len)
		}
		end = x.Off + x.Len
	}
	return nil
}

// hostHas returns a path of this host holding f's content (by digest): the blob
// store's copy, or the current guest image's kernel or initrd; "" when none does.
func (e *Engine) hostHas(ctx context.Context, f api.CheckpointFile, blob string) string {
	cands := []string{blob}
	if k, i, err := e.bins.image(); err == nil {
		cands = append(cands, k, i)
	}
	for _, c := range cands {
		if c == "" {
			continue
		}
		if st, err := os.Stat(c); err != nil || st.Size() != f.Size {
			continue
		}
		if sum, _, err := e.digests.contentDigest(ctx, c); err == nil && sum == f.SHA256 {
			return c
		}
	}
	return ""
}

// Fetch lists the files to transfer: those this host does not have.
func (imp *CheckpointImport) Fetch() []api.CheckpointFile {
	var out []api.CheckpointFile
	for _, f := range imp.files {
		if f.had == "" {
			out = append(out, f.CheckpointFile)
		}
	}
	return out
}

// Skipped is how many files the host had already (by digest).
func (imp *CheckpointImport) Skipped() int {
	n := 0
	for _, f := range imp.files {
		if f.had != "" {
			n++
		}
	}
	return n
}

// FileWriter writes one file of an import: ranges in increasing offset order, each
// starting on a page boundary; zero pages are not written (they stay holes), except in
// a file whose layout matters (api.CheckpointFile.Layout: a delta layer), which gets
// every byte of every range. Close checks the content digest.
type FileWriter struct {
	e    *Engine
	f    *os.File
	h    *memfile.ContentHash
	file *importFile
	err  error
	// buf is the writer's, kept across its ranges: a layer comes as one range per
	// run of pages it holds.
	buf []byte
}

// Create starts writing the file the export calls name (ErrNotFound if it is not one
// to fetch).
func (imp *CheckpointImport) Create(name string) (_ *FileWriter, err error) {
	_, leave, err := imp.e.op(context.Background(), "import "+imp.name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	for _, f := range imp.files {
		if f.Name != name || f.had != "" {
			continue
		}
		if imp.closed || f.done {
			return nil, fmt.Errorf("%w: import %s: file %q written already", ErrInvalidSpec, imp.name, name)
		}
		if f.blob {
			if err := os.MkdirAll(filepath.Dir(f.stage), 0o755); err != nil {
				return nil, fmt.Errorf("engine: import %s: %w", imp.name, err)
			}
		}
		fd, err := os.OpenFile(f.stage, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
		if err != nil {
			return nil, fmt.Errorf("engine: import %s: %w", imp.name, err)
		}
		if err := fd.Truncate(f.Size); err != nil {
			fd.Close()
			return nil, fmt.Errorf("engine: import %s: %w", imp.name, err)
		}
		return &FileWriter{f: fd, h: memfile.NewContentHash(f.Size), file: f, e: imp.e}, nil
	}
	return nil, fmt.Errorf("%w: import %s: no file %q to fetch", ErrNotFound, imp.name, name)
}

// WriteRange writes n bytes from r at off (ranges in increasing order, page aligned).
func (w *FileWriter) WriteRange(ctx context.Context, off, n int64, r io.Reader) (err error) {
	if w.err != nil {
		return w.err
	}
	ctx, leave, err := w.e.op(ctx, "import "+w.file.Name)
	if err != nil {
		return err
	}
	defer func() { err = leave(err) }()
	if off < 0 || n < 0 || off > w.file.Size || n > w.file.Size-off {
		w.err = fmt.Errorf("%w: import %s: range %d+%d outside its %d bytes", ErrInvalidSpec, w.file.Name, off, n, w.file.Size)
		return w.err
	}
	if want := int(min(n, 1<<20)); len(w.buf) < want {
		w.buf = make([]byte, max(want, min(2*len(w.buf), 1<<20)))
	}
	buf := w.buf
	for done := int64(0); done < n; {
		if err := ctx.Err(); err != nil {
			w.err = err
			return err
		}
		k := int(min(int64(len(buf)), n-done))
		if _, err := io.ReadFull(r, buf[:k]); err != nil {
			w.err = fmt.Errorf("engine: import %s: %w", w.file.Name, err)
			return w.err
		}
		if err := w.h.Add(off+done, buf[:k]); err != nil {
			w.err = fmt.Errorf("%w: import %s: %v", ErrInvalidSpec, w.file.Name, err)
			return w.err
		}
		// As the bytes arrive: more data than the holder declared can never match its
		// digest, and must not fill the host before Close would say so.
		if got := w.h.Data(); got > w.file.Data {
			w.err = fmt.Errorf("%w: %s: %d bytes of data arrived, the holder declared %d", ErrDigest, w.file.Name, got, w.file.Data)
			return w.err
		}
		var err error
		if w.file.Layout {
			_, err = w.f.WriteAt(buf[:k], off+done)
		} else {
			_, err = memfile.WriteNonZero(w.f, buf[:k], off+done)
		}
		if err != nil {
			w.err = fmt.Errorf("engine: import %s: %w", w.file.Name, err)
			return w.err
		}
		done += int64(k)
	}
	return nil
}

// Close finishes the file: its content must match the export's digest (ErrDigest).
// After the engine's Close (which aborted the import) it only closes the file
// (ErrClosed).
func (w *FileWriter) Close() (err error) {
	_, leave, err := w.e.op(context.Background(), "import "+w.file.Name)
	if err != nil {
		w.f.Close()
		return err
	}
	defer func() { err = leave(err) }()
	cerr := w.f.Close()
	if w.err != nil {
		return w.err
	}
	if cerr != nil {
		return fmt.Errorf("engine: import %s: %w", w.file.Name, cerr)
	}
	if sum := w.h.Sum(); sum != w.file.SHA256 {
		os.Remove(w.file.stage)
		return fmt.Errorf("%w: %s: sha256 %s of what arrived, the holder recorded %s", ErrDigest, w.file.Name, sum[:16], w.file.SHA256[:16])
	}
	w.file.done = true
	return nil
}

// Commit makes the imported checkpoint visible once every file arrived whole and
// verified: its manifest gets this host's paths (its boot files where this host keeps
// them), and the renames commit it as a checkpoint of this host's is. The engine then
// loads and verifies it as it would its own. A failure leaves nothing.
func (imp *CheckpointImport) Commit(ctx context.Context) (_ *Checkpoint, err error) {
	e := imp.e
	ctx, leave, err := e.op(ctx, "import "+imp.name)
	if err != nil {
		return nil, err
	}
	defer func() { err = leave(err) }()
	if imp.Present {
		return e.cks.load(ctx, imp.name)
	}
	if imp.closed {
		return nil, fmt.Errorf("%w: import %s: closed", ErrInvalidSpec, imp.name)
	}
	defer imp.Abort()
	ck := *imp.ck
	final := e.paths.checkpointDir(imp.name)
	if err := e.paths.resolve(&ck, final); err != nil {
		return nil, fmt.Errorf("%w: import %s: %v", ErrCheckpointCorrupt, imp.name, err)
	}
	ck.Implicit = false
	ck.Digests = map[string]fileDigest{}
	var blobs []*importFile
	for _, f := range imp.files {
		if f.had == "" && !f.done {
			return nil, fmt.Errorf("%w: import %s: file %q not transferred", ErrInvalidSpec, imp.name, f.Name)
		}
		ck.Digests[f.Name] = fileDigest{Size: f.Size, SHA256: f.SHA256, Data: f.Data}
		if f.Name == exportKernel || f.Name == exportInitrd {
			p := f.had
			if p == "" {
				p = storeBootFile(ctx, f, final)
			}
			if f.Name == exportKernel {
				ck.Kernel = p
			} else {
				ck.Initrd = p
			}
			continue
		}
		if f.blob {
			blobs = append(blobs, f)
			continue
		}
		if f.had != "" {
			// A lineage file another checkpoint here holds: linked, as a delta
			// checkpoint links its lineage. That checkpoint may have gone since (an
			// old protection point, dropped): then another holding the same file.
			var err error
			for _, p := range append([]string{f.had}, f.alts...) {
				if err = os.Link(p, f.stage); err == nil || !errors.Is(err, os.ErrNotExist) {
					break
				}
			}
			if err != nil {
				return nil, fmt.Errorf("engine: import %s: %w", imp.name, err)
			}
		}
	}
	if err := imp.storeBlobs(ctx, blobs); err != nil {
		return nil, err
	}
	if err := writeCheckpointManifest(e.paths, final, filepath.Join(imp.tmp, manifestFile), &ck); err != nil {
		return nil, fmt.Errorf("engine: import %s: %w", imp.name, err)
	}
	if err := imp.rename(final); err != nil {
		return nil, err
	}
	imp.closed = true
	// Loaded (read and verified) while its name is still reserved, so that it is the
	// checkpoint just committed; one that fails is removed by its generation (never a
	// checkpoint of the name made after a delete of this one).
	c, err := e.cks.read(imp.name)
	if err == nil {
		if err = e.cks.verify(ctx, c); err != nil {
			_ = e.cks.remove(c)
		}
	} else if bare, berr := e.cks.readAny(imp.name); berr == nil {
		_ = e.cks.remove(bare)
	}
	if imp.reserved {
		e.vms.unreserve(imp.name)
		imp.reserved = false
	}
	if err != nil {
		return nil, err
	}
	e.log.Info("imported checkpoint", "checkpoint", imp.name, "files", len(imp.files), "had", imp.Skipped())
	return c, nil
}

// storeBlobs keeps the base image an import brought in the host's blob store (once
// per host, a hard link, best effort), or hard-links the store's copy into the
// checkpoint (copied where the store is on another file system). Boot files are
// storeBootFile's.
func (imp *CheckpointImport) storeBlobs(ctx context.Context, blobs []*importFile) error {
	if len(blobs) > 0 {
		if err := os.MkdirAll(filepath.Dir(blobs[0].final), 0o755); err != nil {
			return fmt.Errorf("engine: import %s: %w", imp.name, err)
		}
	}
	for _, f := range blobs {
		if f.had != "" {
			if err := linkOrCopy(ctx, f.had, f.stage); err != nil {
				return fmt.Errorf("engine: import %s: %w", imp.name, err)
			}
		} else if _, err := os.Stat(f.final); err != nil {
			_ = os.Link(f.stage, f.final) // best effort: the next pull finds it
		}
	}
	return nil
}

// rename commits the import's staged RAM file, layers and directory (final) by renames,
// undoing the earlier ones when a later one fails.
func (imp *CheckpointImport) rename(final string) error {
	ramFinal, layersFinal := imp.e.paths.checkpointRAM(imp.name), imp.e.paths.checkpointLayers(imp.name)
	if err := os.Rename(imp.ramTmp, ramFinal); err != nil {
		return fmt.Errorf("engine: import %s: ram: %w", imp.name, err)
	}
	if imp.layersTmp != "" {
		if err := os.Rename(imp.layersTmp, layersFinal); err != nil {
			os.Rename(ramFinal, imp.ramTmp)
			return fmt.Errorf("engine: import %s: ram layers: %w", imp.name, err)
		}
	}
	if err := os.Rename(imp.tmp, final); err != nil {
		os.Rename(ramFinal, imp.ramTmp)
		if imp.layersTmp != "" {
			os.Rename(layersFinal, imp.layersTmp)
		}
		return fmt.Errorf("engine: import %s: commit: %w", imp.name, err)
	}
	return nil
}

// Abort drops an import that was not committed: its temporary files and its name.
// It may be called at any time, more than once.
func (imp *CheckpointImport) Abort() {
	imp.mu.Lock()
	defer imp.mu.Unlock()
	if imp.held != nil {
		imp.held()
		imp.held = nil
	}
	if !imp.closed {
		imp.closed = true
		if imp.tmp != "" {
			os.RemoveAll(imp.tmp)
		}
		if imp.ramTmp != "" {
			os.Remove(imp.ramTmp)
		}
		if imp.layersTmp != "" {
			os.RemoveAll(imp.layersTmp)
		}
	}
	if imp.reserved {
		imp.e.vms.unreserve(imp.name)
		imp.reserved = false
	}
}

// linkOrCopy hard-links src to dst, or copies it (sparse) across file systems.
func linkOrCopy(ctx context.Context, src, dst string) error {
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	if err := memfile.Clone(ctx, src, dst); err == nil {
		return nil
	}
	_, err := memfile.Freeze(ctx, src, dst)
	return err
}

// What an import may be told before a byte is written: a peer that declares a 4 GiB
// RAM file for a checkpoint of 256 MiB, or a 2 GiB kernel, must be refused from its
// export alone, not after the bytes filled the host. Each file's declared size is
// bounded by the manifest's shape (importBound), and what the files will write by the
// free space of where they are staged (checkSpace); WriteRange then refuses more
// non-zero data than the file declared as it arrives.
const (
	// maxBootFileBytes bounds a pulled kernel and stub kernel; maxInitrdBytes a pulled
	// initrd (a guest image's is tens of MiB).
	maxBootFileBytes = 256 << 20
	maxInitrdBytes   = 1 << 30
	// diskSlackBytes is room for a qcow2 layer's metadata beyond its virtual size.
	diskSlackBytes = 64 << 20
	// importSpaceMargin is kept free on every file system an import writes to, beyond
	// what its files need (file system metadata, the manifest).
	importSpaceMargin = 16 << 20
	// blobTempAge is how old a temporary file in the blob store (written there by an
	// engine before imports staged boot files in their own directory) must be before
	// an engine removes it: nothing writes such files any more, and an hour without a
	// write is no transfer in progress.
	blobTempAge = time.Hour
)

// importBound checks file f of an import, which the resolved manifest ck places as w,
// against what ck can hold: the RAM file is the guest's RAM size, the device state its
// recorded size, a delta layer no larger than RAM and holding no more data than its
// record, a disk layer no larger than the disk plus qcow2 metadata, boot files and
// small files under fixed bounds. ErrCheckpointCorrupt otherwise.
func importBound(ck *checkpointManifest, w exportFile, f api.CheckpointFile) error {
	bad := func(what string, limit int64) error {
		return fmt.Errorf("%w: import %s: file %q declares %d bytes (%d of data), %s %d", ErrCheckpointCorrupt, ck.Name, f.Name, f.Size, f.Data, what, limit)
	}
	disk := int64(ck.DiskMiB)<<20 + int64(ck.DiskMiB)<<17 + diskSlackBytes
	switch {
	case w.name == stateFile:
		if ck.StateSize > 0 && f.Size != ck.StateSize {
			return bad("the manifest records", ck.StateSize)
		}
		if f.Size > ck.RAMSize+diskSlackBytes {
			return bad("more than the guest's RAM allows:", ck.RAMSize+diskSlackBytes)
		}
	case w.name == ramHolesFile:
		// At most one range per two pages (16 bytes each).
		if limit := (ck.RAMSize/memfile.PageSize/2 + 1) * 16; f.Size > limit || f.Size%16 != 0 {
			return bad("a hole list of this RAM holds at most", limit)
		}
	case w.name == console.HistoryFile:
		if f.Size > console.LogHalf {
			return bad("a console history holds at most", console.LogHalf)
		}
	case w.name == exportKernel || w.path == ck.ForkKernel && ck.ForkKernel != "":
		if f.Size > maxBootFileBytes {
			return bad("a kernel is at most", maxBootFileBytes)
		}
	case w.name == exportInitrd:
		if f.Size > maxInitrdBytes {
			return bad("an initrd is at most", maxInitrdBytes)
		}
	case w.layer:
		if f.Size > ck.RAMSize {
			return bad("the guest's RAM is", ck.RAMSize)
		}
		for _, lr := range ck.Layers {
			if lr.Path == w.path && f.Data > lr.Size {
				return bad("the layer's record holds", lr.Size)
			}
		}
	case strings.HasPrefix(w.name, exportRAMPrefix):
		if f.Size != ck.RAMSize {
			return bad("the guest's RAM is", ck.RAMSize)
		}
	default: // disk layers and the overlay template
		if f.Size > disk {
			return bad("the disk and its qcow2 metadata hold at most", disk)
		}
	}
	return nil
}

// writeBytes is what writing f costs on disk at most: its declared non-zero data (zero
// pages stay holes; WriteRange refuses more), or for a file whose layout matters every
// byte of its extents.
func writeBytes(f api.CheckpointFile) int64 {
	if !f.Layout {
		return f.Data
	}
	var n int64
	for _, x := range f.Extents {
		n += x.Len
	}
	return n
}

// checkSpace refuses an import whose files to fetch do not fit, with
// importSpaceMargin to spare, the free space of the file systems they are staged on
// (ErrInsufficientSpace); it runs before any file is created.
func (imp *CheckpointImport) checkSpace() error {
	type fsNeed struct {
		dir        string
		need, free int64
	}
	byDev := map[uint64]*fsNeed{}
	var order []uint64
	for _, f := range imp.files {
		if f.had != "" {
			continue
		}
		dir := filepath.Dir(f.stage)
		dev, free, err := fsSpace(dir)
		if err != nil {
			return fmt.Errorf("engine: import %s: %w", imp.name, err)
		}
		n := byDev[dev]
		if n == nil {
			n = &fsNeed{dir: dir, free: free}
			byDev[dev] = n
			order = append(order, dev)
		}
		n.need += writeBytes(f.CheckpointFile)
	}
	for _, dev := range order {
		n := byDev[dev]
		if n.need > n.free-importSpaceMargin {
			return fmt.Errorf("%w: import %s: %d MiB to write on the file system of %s, %d MiB free (%d MiB kept spare)",
				ErrInsufficientSpace, imp.name, (n.need+1<<20-1)>>20, n.dir, max(n.free, 0)>>20, importSpaceMargin>>20)
		}
	}
	return nil
}

// fsSpace is the device of dir's file system and the bytes free there for this user.
func fsSpace(dir string) (dev uint64, free int64, err error) {
	st, err := os.Stat(dir)
	if err != nil {
		return 0, 0, err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, fmt.Errorf("%s: no device number", dir)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(dir, &fs); err != nil {
		return 0, 0, fmt.Errorf("statfs %s: %w", dir, err)
	}
	return uint64(sys.Dev), int64(min(uint64(fs.Bavail)*uint64(fs.Bsize), 1<<62)), nil
}

// storeBootFile keeps a pulled kernel or initrd f, staged in the import's directory,
// in the host's blob store by digest: a hard link (no temporary file in the shared
// store, so a killed pull leaves nothing there). It returns the path the checkpoint
// boots from: the blob, or, where the store is on another file system or holds other
// bytes under that digest, the staged copy, which stays in the checkpoint's
// directory (ckDir) as its own.
func storeBootFile(ctx context.Context, f *importFile, ckDir string) string {
	own := filepath.Join(ckDir, filepath.Base(f.stage))
	if err := os.MkdirAll(filepath.Dir(f.final), 0o755); err != nil {
		return own
	}
	err := os.Link(f.stage, f.final)
	if errors.Is(err, os.ErrExist) {
		// Another pull stored it meanwhile (or something else is there: not ours to
		// replace).
		if st, serr := os.Stat(f.final); serr == nil && st.Size() == f.Size {
			if sum, _, derr := memfile.ContentDigest(ctx, f.final); derr == nil && sum == f.SHA256 {
				err = nil
			}
		}
	}
	if err != nil {
		return own
	}
	os.Remove(f.stage)
	return f.final
}

// sweepBlobTemps removes the temporary files that engines before this one left in the
// blob store (a pull killed while fetching a boot file), once older than blobTempAge:
// imports now stage them in their own directory, which the state directory's reaper
// owns.
func sweepBlobTemps(cacheDir string) {
	dir := filepath.Join(cacheDir, blobsDir)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, ent := range ents {
		if !strings.HasPrefix(ent.Name(), ".tmp-") || !ent.Type().IsRegular() {
			continue
		}
		if info, err := ent.Info(); err == nil && time.Since(info.ModTime()) > blobTempAge {
			os.Remove(filepath.Join(dir, ent.Name()))
		}
	}
}
