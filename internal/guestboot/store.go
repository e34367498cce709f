package guestboot

import (
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/forkvm/forkvm/internal/names"
)

// The read side of the root image store that the engine needs: a name's disk. The
// store (package guest's ImageStore) writes the records; its layout and formats are
// documented there, and guest's TestLookupImageDiskMatchesStore keeps this reader in
// step with ImageStore.Lookup.

// MaxImageNameLen bounds image names, as engine.MaxNameLen bounds VM names.
const MaxImageNameLen = 48

// ImageRecordFormat and ContentFormat version the store's JSON records.
const (
	ImageRecordFormat = "forkvm-rootfs-name-v1"
	ContentFormat     = "forkvm-rootfs-content-v1"
)

// ValidateImageName checks an image name with the rule engine.ValidateName applies
// to VM names: 1..MaxImageNameLen characters of [A-Za-z0-9_.-], starting with a
// letter or digit, never "..". Such a name is a safe file name in the cache.
func ValidateImageName(name string) error {
	if err := names.Check(name, MaxImageNameLen); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidImageName, err)
	}
	return nil
}

// ImageDisk is a root image's disk: the raw, sparse ext4 file a VM boots from
// (read-only: attach it through a copy-on-write overlay) and its size.
type ImageDisk struct {
	Path  string
	Bytes int64
}

// LookupImageDisk returns the disk of the image called name in the store of cacheDir
// ("" means DefaultCacheDir()) whose names are in namesDir ("" means the cache's
// own): ErrInvalidImageName, ErrImageNotFound, or ErrCorruptImage when its record or
// disk is unusable, as guest's ImageStore.Lookup.
func LookupImageDisk(cacheDir, namesDir, name string) (*ImageDisk, error) {
	if err := ValidateImageName(name); err != nil {
		return nil, err
	}
	if cacheDir == "" {
		cacheDir = DefaultCacheDir()
	}
	base := filepath.Join(cacheDir, "rootfs")
	if namesDir == "" {
		namesDir = filepath.Join(base, "names")
	} else if abs, err := filepath.Abs(namesDir); err == nil {
		namesDir = abs
	}
	record := filepath.Join(namesDir, name+".json")
	var rec struct {
		Format string `json:"format"`
		Name   string `json:"name"`
		Hash   string `json:"hash"`
	}
	b, err := os.ReadFile(record)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %q", ErrImageNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrCorruptImage, name, err)
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("%w: %q: %v", ErrCorruptImage, name, err)
	}
	if _, herr := hex.DecodeString(rec.Hash); rec.Format != ImageRecordFormat || rec.Name != name || len(rec.Hash) != 64 || herr != nil {
		return nil, fmt.Errorf("%w: %q: bad record %s", ErrCorruptImage, name, record)
	}
	dir := filepath.Join(base, "sha256", rec.Hash[:16])
	var c struct {
		Format    string `json:"format"`
		Hash      string `json:"hash"`
		DiskBytes int64  `json:"diskBytes"`
	}
	b, err = os.ReadFile(filepath.Join(dir, "content.json"))
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err == nil && (c.Format != ContentFormat || len(c.Hash) != 64) {
		err = fmt.Errorf("unknown format %q", c.Format)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %q: disk %s: %v", ErrCorruptImage, name, rec.Hash[:16], err)
	}
	disk := filepath.Join(dir, "disk.ext4")
	if st, err := os.Stat(disk); c.Hash != rec.Hash || err != nil || !st.Mode().IsRegular() || st.Size() != c.DiskBytes {
		return nil, fmt.Errorf("%w: %q: disk %s is missing or has the wrong size", ErrCorruptImage, name, disk)
	}
	return &ImageDisk{Path: disk, Bytes: c.DiskBytes}, nil
}
