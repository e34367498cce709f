package engine

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Backing names. A qcow2 layer's header names its backing file; forkvm never reads it
// (forks name their chain in -blockdev), but users back up, inspect and convert these
// files with qemu-img, which does. A layer is created in a VM's directory naming its
// backing by that VM's path; freezing hard-links it into a checkpoint, header and all,
// so once the VM was deleted the checkpoint's layer named a file that was gone
// (checkpoints/ck/layer3.qcow2 -> vms/w1/disk30.qcow2). So a checkpoint's frozen qcow2
// layer i names its backing "layer{i-1}.FMT", relative: the checkpoint's own link,
// there as long as the checkpoint is. The same inode is also the VM's file: the VM's
// directory gets relative symlinks layer{j}.FMT to its chain's files, so the name
// resolves there too.

// qcow2 header fields (big endian): magic, version, backing_file_offset (8 bytes at 8),
// backing_file_size (4 bytes at 16), cluster_bits (4 bytes at 20).
const (
	qcow2Magic           = 0x514649fb
	qcow2BackingOffField = 8
	qcow2BackingLenField = 16
	qcow2ClusterBits     = 20
)

// setBackingName rewrites the backing file name in qcow2 file path's header to name
// (the backing format extension is kept): the name lives in the header's cluster after
// the header, which holds nothing else there, so any name that fits the cluster does.
func setBackingName(path, name string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	var h [24]byte
	if _, err := f.ReadAt(h[:], 0); err != nil {
		return fmt.Errorf("%s: qcow2 header: %w", path, err)
	}
	if binary.BigEndian.Uint32(h[0:]) != qcow2Magic {
		return fmt.Errorf("%s: not a qcow2 file", path)
	}
	off := binary.BigEndian.Uint64(h[qcow2BackingOffField:])
	cbits := binary.BigEndian.Uint32(h[qcow2ClusterBits:])
	if off == 0 {
		return fmt.Errorf("%s: no backing file", path)
	}
	if cbits < 9 || cbits > 21 || off+uint64(len(name)) > 1<<cbits || len(name) > 1023 {
		return fmt.Errorf("%s: backing name %q does not fit its header", path, name)
	}
	var cur [1024]byte
	n := binary.BigEndian.Uint32(h[qcow2BackingLenField:])
	if n <= uint32(len(cur)) {
		if _, err := f.ReadAt(cur[:n], int64(off)); err == nil && string(cur[:n]) == name {
			return nil // already so: a shared layer renamed by an earlier checkpoint
		}
	}
	if _, err := f.WriteAt([]byte(name), int64(off)); err != nil {
		return err
	}
	var size [4]byte
	binary.BigEndian.PutUint32(size[:], uint32(len(name)))
	if _, err := f.WriteAt(size[:], qcow2BackingLenField); err != nil {
		return err
	}
	return f.Sync()
}

// namedTop is the backing, as an overlay on chain's top in dir names it: the top's chain
// name, made to resolve in dir (linkChainNames), so that the name survives the
// directory's renaming (a damaged VM kept aside) and its checkpoint's hard link.
func namedTop(dir string, chain []diskLayer) diskLayer {
	linkChainNames(dir, chain)
	top := chain[len(chain)-1]
	return diskLayer{Path: chainName(len(chain)-1, top), Format: top.Format}
}

// chainName is the name layer i of a chain goes by in a directory holding the chain.
func chainName(i int, l diskLayer) string { return frozenLayerFile(i, l.Format) }

// nameFrozenChain names, in each frozen qcow2 layer of a checkpoint's chain (files
// dir/layer{i}), its backing by its chain name.
func nameFrozenChain(chain []diskLayer) error {
	for i := 1; i < len(chain); i++ {
		if chain[i].Format != "qcow2" {
			continue
		}
		if err := setBackingName(chain[i].Path, chainName(i-1, chain[i-1])); err != nil {
			return err
		}
	}
	return nil
}

// linkChainNames makes the chain names of chain's layers resolve in dir (a VM's
// directory): a relative symlink layer{i}.FMT to each layer's file, unless that name is
// the file itself. Best effort: only outside tools read these names.
func linkChainNames(dir string, chain []diskLayer) {
	for i, l := range chain {
		link := filepath.Join(dir, chainName(i, l))
		if link == l.Path {
			continue
		}
		target, err := filepath.Rel(dir, l.Path)
		if err != nil {
			target = l.Path
		}
		if cur, err := os.Readlink(link); err == nil && cur == target {
			continue
		}
		if err := os.Remove(link); err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
		_ = os.Symlink(target, link)
	}
}

// pruneChainNames removes the symlinks of linkChainNames in dir that chain no longer
// has at their index (a collapse dropped layers) and makes those it has.
func pruneChainNames(dir string, chain []diskLayer) {
	want := map[string]bool{}
	for i, l := range chain {
		want[chainName(i, l)] = true
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.Type()&os.ModeSymlink == 0 || !isChainName(e.Name()) || want[e.Name()] {
			continue
		}
		os.Remove(filepath.Join(dir, e.Name()))
	}
	linkChainNames(dir, chain)
}

// isChainName reports whether name is a chain name (layer{i}.raw or .qcow2).
func isChainName(name string) bool {
	s, ok := strings.CutPrefix(name, "layer")
	if !ok {
		return false
	}
	n, ok := strings.CutSuffix(s, ".qcow2")
	if !ok {
		n, ok = strings.CutSuffix(s, ".raw")
	}
	_, err := strconv.Atoi(n)
	return ok && err == nil
}
