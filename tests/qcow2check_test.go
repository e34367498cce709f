package tests

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// checkQcow2s runs `qemu-img check` on every qcow2 file under dir (a test's state
// directory), each on its own: the file and its backing chain must open from the names
// in their headers (relative to the file), as a user's backup or qemu-img convert
// opens them. -U: a running VM may hold its top layer. It returns how many it checked.
func checkQcow2s(t testing.TB, dir string) int {
	t.Helper()
	var files []string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && strings.HasSuffix(d.Name(), ".qcow2") {
			files = append(files, p)
		}
		return nil
	})
	for _, f := range files {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		var out bytes.Buffer
		cmd := exec.CommandContext(ctx, "qemu-img", "check", "-q", "-U", f)
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		cancel()
		if err != nil {
			t.Errorf("qemu-img check %s: %v: %s", strings.TrimPrefix(f, dir+"/"), err, strings.TrimSpace(out.String()))
		}
	}
	return len(files)
}

// regularNames lists the names in dir that are not symlinks.
func regularNames(dir string) []string {
	var out []string
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.Type()&fs.ModeSymlink == 0 {
			out = append(out, e.Name())
		}
	}
	return out
}
