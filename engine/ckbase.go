package engine

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/memfile"
)

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
