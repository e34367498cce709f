package guest

import (
	"bufio"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// initramfsModules are loaded by the agent at boot, in dependency order.
var initramfsModules = []string{
	"vsock",
	"vmw_vsock_virtio_transport",
	"vsock_loopback",
	"virtio_blk",
	"virtio_rng",
}

var moduleSuffixes = []string{".ko", ".ko.xz", ".ko.gz", ".ko.zst"}

// normModName canonicalises a module name: "-" and "_" are equivalent.
func normModName(s string) string {
	return strings.ReplaceAll(strings.TrimSpace(s), "-", "_")
}

// modNameFromPath returns the module name of a path such as
// kernel/drivers/char/hw_random/virtio-rng.ko.xz, or "" if it is not a module.
func modNameFromPath(p string) string {
	base := path.Base(filepath.ToSlash(p))
	for _, s := range moduleSuffixes {
		if n, ok := strings.CutSuffix(base, s); ok && n != "" {
			return normModName(n)
		}
	}
	return ""
}

// ResolveModules finds each named module under modulesDir/kernel (names are
// matched with "-" and "_" treated alike; .ko, .ko.xz, .ko.gz and .ko.zst
// files are recognised), follows the depends= entries of each module's
// .modinfo section, and returns paths relative to modulesDir in load order:
// dependencies first, no duplicates. Modules listed in
// modulesDir/modules.builtin are built into the kernel and skipped. A module
// that is neither present nor built in yields an error wrapping
// ErrModuleNotFound.
func ResolveModules(modulesDir string, names []string) ([]string, error) {
	index := make(map[string]string) // name -> relative slash path
	root := filepath.Join(modulesDir, "kernel")
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		name := modNameFromPath(p)
		if name == "" {
			return nil
		}
		rel, err := filepath.Rel(modulesDir, p)
		if err != nil {
			return err
		}
		if _, dup := index[name]; !dup { // WalkDir is lexical: deterministic
			index[name] = filepath.ToSlash(rel)
		}
		return nil
	})
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("%w: no modules directory %s", ErrModuleNotFound, root)
		}
		return nil, fmt.Errorf("guest: scanning modules: %w", err)
	}
	builtin, err := readBuiltin(filepath.Join(modulesDir, "modules.builtin"))
	if err != nil {
		return nil, err
	}

	var order []string
	const (
		visiting = 1
		done     = 2
	)
	state := make(map[string]int)
	var visit func(name string, chain []string) error
	visit = func(name string, chain []string) error {
		name = normModName(name)
		if name == "" {
			return nil
		}
		switch state[name] {
		case done:
			return nil
		case visiting:
			return fmt.Errorf("guest: module dependency cycle: %s -> %s", strings.Join(chain, " -> "), name)
		}
		rel, ok := index[name]
		if !ok {
			if builtin[name] {
				state[name] = done
				return nil
			}
			via := ""
			if len(chain) > 0 {
				via = " (needed by " + strings.Join(chain, " -> ") + ")"
			}
			return fmt.Errorf("%w: %s%s under %s", ErrModuleNotFound, name, via, modulesDir)
		}
		state[name] = visiting
		deps, err := moduleDepends(filepath.Join(modulesDir, filepath.FromSlash(rel)))
		if err != nil {
			return fmt.Errorf("guest: reading module %s: %w", rel, err)
		}
		for _, d := range deps {
			if err := visit(d, append(chain[:len(chain):len(chain)], name)); err != nil {
				return err
			}
		}
		state[name] = done
		order = append(order, rel)
		return nil
	}
	for _, n := range names {
		if err := visit(n, nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}

// readBuiltin parses modules.builtin (one kernel/.../name.ko per line). A
// missing file means no builtins.
func readBuiltin(name string) (map[string]bool, error) {
	m := make(map[string]bool)
	b, err := os.ReadFile(name)
	if errors.Is(err, fs.ErrNotExist) {
		return m, nil
	}
	if err != nil {
		return nil, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if n := modNameFromPath(sc.Text()); n != "" {
			m[n] = true
		}
	}
	return m, sc.Err()
}

// moduleDepends returns the depends= list from a module's .modinfo section.
func moduleDepends(name string) ([]string, error) {
	info, err := readModinfo(name)
	if err != nil {
		return nil, err
	}
	var deps []string
	for _, kv := range info {
		if v, ok := strings.CutPrefix(kv, "depends="); ok {
			for _, d := range strings.Split(v, ",") {
				if d = strings.TrimSpace(d); d != "" {
					deps = append(deps, d)
				}
			}
		}
	}
	return deps, nil
}

// readModinfo returns the NUL-separated key=value strings of .modinfo.
func readModinfo(name string) ([]string, error) {
	raw, err := decompressModule(name)
	if err != nil {
		return nil, err
	}
	f, err := elf.NewFile(bytes.NewReader(raw))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, errors.New("no .modinfo section")
	}
	data, err := sec.Data()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, s := range bytes.Split(data, []byte{0}) {
		if len(s) > 0 {
			out = append(out, string(s))
		}
	}
	return out, nil
}
