package engine

// The boot cache's entries on disk: their use, eviction, setting aside, listing and
// removal (bootcache.go has the notes, the key, the restore and the capture).

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/internal/guestboot"
)

// touchBoot marks the entry dir used now (eviction goes by it).
func touchBoot(dir string) {
	now := time.Now()
	_ = os.Chtimes(filepath.Join(dir, bootRecordFile), now, now)
}

// setBootAside moves the entry of key, found damaged (why), out of the cache's way.
func (e *Engine) setBootAside(key string, why error) {
	root := e.bootRoot()
	aside := filepath.Join(root, fmt.Sprintf("damaged-%s-%d", key, time.Now().UnixNano()))
	if err := os.Rename(filepath.Join(root, key), aside); err != nil {
		e.log.Warn("boot cache: a damaged entry could not be set aside", "key", key, "why", why, "err", err)
		return
	}
	e.log.Warn("boot cache: entry set aside as damaged; the VM boots cold", "key", key, "kept", aside, "why", why)
	e.evictBoots("")
}

// evictBoots keeps the cache within Config.BootCacheEntries entries (the least
// recently used go; keep, just written, stays), bootDamagedKept entries set aside, and
// no temporary directory of a dead engine. An entry is renamed away before it is
// removed, so a reader finds it whole or not at all.
func (e *Engine) evictBoots(keep string) {
	root := e.bootRoot()
	ents, err := os.ReadDir(root)
	if err != nil {
		return
	}
	type aged struct {
		name string
		at   time.Time
	}
	var entries, damaged []aged
	for _, d := range ents {
		name := d.Name()
		switch {
		case !d.IsDir():
		case strings.HasPrefix(name, "tmp-"):
			if st, err := os.Stat(filepath.Join(root, name)); err == nil && time.Since(st.ModTime()) > bootTmpAge {
				os.RemoveAll(filepath.Join(root, name))
			}
		case strings.HasPrefix(name, "damaged-"):
			if st, err := os.Stat(filepath.Join(root, name)); err == nil {
				damaged = append(damaged, aged{name, st.ModTime()})
			}
		default:
			st, err := os.Stat(filepath.Join(root, name, bootRecordFile))
			if err != nil || name == keep {
				continue // being written (no record yet), or just written
			}
			entries = append(entries, aged{name, st.ModTime()})
		}
	}
	newestFirst := func(a, b aged) int { return b.at.Compare(a.at) }
	slices.SortFunc(entries, newestFirst)
	slices.SortFunc(damaged, newestFirst)
	room := e.cfg.BootCacheEntries
	if keep != "" {
		room--
	}
	drop := func(list []aged, n int) {
		for _, a := range list[min(n, len(list)):] {
			_ = removeBootDir(root, a.name)
		}
	}
	drop(entries, max(room, 0))
	drop(damaged, bootDamagedKept)
}

// BootCacheEntry is one boot the cache holds (api.BootCacheEntry).
type BootCacheEntry = api.BootCacheEntry

// bootEntryName matches the names of the cache's entries: a key, or an entry set aside
// (damaged-KEY-TIME).
var bootEntryName = regexp.MustCompile(`^(damaged-)?[0-9a-f]{32}(-[0-9]+)?$`)

// bootCacheRoot is the boot cache's directory in cacheDir ("": the default cache).
func bootCacheRoot(cacheDir string) string {
	if cacheDir == "" {
		cacheDir = guestboot.DefaultCacheDir()
	}
	return filepath.Join(cacheDir, bootCacheDir)
}

// ListBootCache lists the boot cache in cacheDir ("": the default cache, as
// Config.CacheDir), the most recently used first, then the entries set aside as
// damaged. It opens no engine: the cache is the host's, not a state directory's.
func ListBootCache(cacheDir string) ([]BootCacheEntry, error) {
	root := bootCacheRoot(cacheDir)
	ents, err := os.ReadDir(root)
	if errors.Is(err, os.ErrNotExist) {
		return []BootCacheEntry{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("engine: boot cache: %w", err)
	}
	out := []BootCacheEntry{}
	for _, d := range ents {
		if !d.IsDir() || !bootEntryName.MatchString(d.Name()) {
			continue // a temporary directory, or not the cache's
		}
		dir := filepath.Join(root, d.Name())
		b := BootCacheEntry{Key: d.Name(), Damaged: strings.HasPrefix(d.Name(), "damaged-")}
		if f, err := os.Open(filepath.Join(dir, bootRecordFile)); err == nil {
			var rec bootRecord
			if st, err := f.Stat(); err == nil {
				b.UsedAt = st.ModTime().UTC() // touchBoot's
			}
			if json.NewDecoder(f).Decode(&rec) == nil {
				b.From, b.CreatedAt = rec.From, rec.CreatedAt
			}
			f.Close()
		}
		files, _ := os.ReadDir(dir)
		for _, f := range files {
			if fi, err := f.Info(); err == nil {
				if st, ok := fi.Sys().(*syscall.Stat_t); ok {
					b.Bytes += st.Blocks * 512
				} else {
					b.Bytes += fi.Size()
				}
			}
		}
		out = append(out, b)
	}
	slices.SortStableFunc(out, func(a, b BootCacheEntry) int {
		if a.Damaged != b.Damaged {
			if a.Damaged {
				return 1
			}
			return -1
		}
		return b.UsedAt.Compare(a.UsedAt)
	})
	return out, nil
}

// RemoveBootCache removes the boot cache entries keys (as ListBootCache names them) in
// cacheDir, or every entry when keys is empty, and returns the keys removed. A key the
// cache does not hold is ErrNotFound, one that is not an entry's name ErrInvalidSpec;
// nothing is removed then. An entry is renamed away before its files go, so a create
// restoring from it finds it whole or not at all (and boots).
func RemoveBootCache(cacheDir string, keys []string) ([]string, error) {
	root := bootCacheRoot(cacheDir)
	if len(keys) == 0 {
		all, err := ListBootCache(cacheDir)
		if err != nil {
			return nil, err
		}
		for _, b := range all {
			keys = append(keys, b.Key)
		}
	} else {
		for _, k := range keys {
			if !bootEntryName.MatchString(k) {
				return nil, fmt.Errorf("%w: %q is not a boot cache entry's name", ErrInvalidSpec, k)
			}
			if _, err := os.Stat(filepath.Join(root, k)); err != nil {
				return nil, fmt.Errorf("%w: boot cache entry %s", ErrNotFound, k)
			}
		}
	}
	removed := []string{}
	for _, k := range keys {
		if err := removeBootDir(root, k); errors.Is(err, os.ErrNotExist) {
			continue // evicted meanwhile: gone all the same
		} else if err != nil {
			return removed, fmt.Errorf("engine: boot cache: %w", err)
		}
		removed = append(removed, k)
	}
	return removed, nil
}

// removeBootDir removes the directory name of the cache in root: renamed to a
// temporary name first, so that a create restoring from it finds it whole or not at
// all; an error wrapping os.ErrNotExist when it is gone already.
func removeBootDir(root, name string) error {
	gone, err := os.MkdirTemp(root, "tmp-rm-")
	if err != nil {
		return err
	}
	os.Remove(gone)
	if err := os.Rename(filepath.Join(root, name), gone); err != nil {
		return err
	}
	return os.RemoveAll(gone)
}
