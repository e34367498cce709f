package guest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// debianSourceDateEpoch is SOURCE_DATE_EPOCH for every Debian build
// (2025-01-01T00:00:00Z) and the mtime the staged tree is clamped to. A
// fixed value, not the build time, so that two builds of a recipe are the
// same; not 0, which shadow would record as "password last changed on day 0"
// (change it at next login) for the accounts Debian creates.
const debianSourceDateEpoch = 1735689600

// recipeFormat versions recipe keys and records: bump it when the build
// changes what a recipe produces.
const recipeFormat = "forkvm-rootfs-recipe-v1"

// debianRecipe is what a Debian build depends on, and (in its record) the
// disk the last build of it gave.
type debianRecipe struct {
	Format     string    `json:"format"`
	Key        string    `json:"key"` // hex SHA-256 of the fields below
	Suite      string    `json:"suite"`
	Include    []string  `json:"include,omitempty"` // sorted, without duplicates
	Mirror     string    `json:"mirror,omitempty"`
	Mmdebstrap string    `json:"mmdebstrap"` // `mmdebstrap --version`
	Agent      string    `json:"agentSha256"`
	SizeMiB    int       `json:"sizeMiB,omitempty"`
	Epoch      int64     `json:"sourceDateEpoch"`
	Hash       string    `json:"hash,omitempty"`  // the disk built (record only)
	Built      time.Time `json:"built,omitempty"` // when (record only)
}

// newDebianRecipe describes the build of d with the agent of SHA-256 agent
// and the requested disk size.
func newDebianRecipe(ctx context.Context, d *DebianSource, agent string, sizeMiB int) (*debianRecipe, error) {
	bin, err := findMmdebstrap()
	if err != nil {
		return nil, err
	}
	out, err := exec.CommandContext(ctx, bin, "--version").Output()
	if err != nil {
		return nil, fmt.Errorf("%w: mmdebstrap --version: %v", ErrMmdebstrapMissing, err)
	}
	inc := slices.Clone(d.Include)
	slices.Sort(inc)
	inc = slices.Compact(inc)
	r := &debianRecipe{Format: recipeFormat, Suite: d.Suite, Include: inc, Mirror: d.Mirror,
		Mmdebstrap: strings.TrimSpace(string(out)), Agent: agent, SizeMiB: sizeMiB, Epoch: debianSourceDateEpoch}
	b, _ := json.Marshal(r)
	h := sha256.Sum256(b)
	r.Key = hex.EncodeToString(h[:])
	return r, nil
}

func (d rootfsDirs) recipe(key string) string { return filepath.Join(d.recipes, key[:16]+".json") }

// findRecipe returns the record of the last build of r when its disk is still
// in the cache, else nil.
func findRecipe(dirs rootfsDirs, r *debianRecipe) *debianRecipe {
	b, err := os.ReadFile(dirs.recipe(r.Key))
	if err != nil {
		return nil
	}
	var rec debianRecipe
	if json.Unmarshal(b, &rec) != nil || rec.Format != recipeFormat || rec.Key != r.Key || len(rec.Hash) != 64 || !isHex(rec.Hash) {
		return nil
	}
	if !contentComplete(dirs.content(rec.Hash), rec.Hash) {
		return nil
	}
	return &rec
}

// linkRecipe names the disk of a recipe's earlier build.
func linkRecipe(ctx context.Context, dirs rootfsDirs, rec *debianRecipe, name string, src *ImageSource) (*RootImage, error) {
	unlock, err := lockImages(ctx, dirs)
	if err != nil {
		return nil, err
	}
	defer unlock()
	dir := dirs.content(rec.Hash)
	c, err := readContent(dir)
	if err != nil || !contentComplete(dir, rec.Hash) {
		return nil, fmt.Errorf("guest: disk %s of recipe %s vanished", rec.Hash[:16], rec.Key[:16])
	}
	nr := nameRecord{Format: imageRecordFormat, Name: name, Hash: rec.Hash, Source: *src, Created: time.Now().UTC()}
	if err := linkRecord(dirs, &nr); err != nil {
		return nil, err
	}
	return rootImage(dirs, &nr, c), nil
}

// writeRecipe records r's build (r.Hash), replacing an earlier one.
func writeRecipe(dirs rootfsDirs, r *debianRecipe) error {
	b, _ := json.MarshalIndent(r, "", "  ")
	f, err := os.CreateTemp(dirs.recipes, ".tmp-")
	if err != nil {
		return fmt.Errorf("guest: recording the recipe: %w", err)
	}
	defer os.Remove(f.Name())
	_, err = f.Write(append(b, '\n'))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), dirs.recipe(r.Key))
	}
	if err != nil {
		return fmt.Errorf("guest: recording the recipe: %w", err)
	}
	return nil
}

// clampTimes sets the modification and access times of every entry in root
// (symlinks themselves, not their targets) to its modification time clamped
// to t: files a build wrote get the same times in every build.
func clampTimes(ctx context.Context, root string, t time.Time) error {
	return filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		m := fi.ModTime()
		if m.After(t) {
			m = t
		}
		ts := unix.NsecToTimespec(m.UnixNano())
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("guest: clamping times of %s: %w", p, err)
		}
		return nil
	})
}
