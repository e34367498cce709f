package tests

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// checkQcow2s runs `qemu-img check` on every qcow2 file under dir (a test's state
// directory), each on its own: the file and its backing chain must open from the names
// in their headers (relative to the file), as a user's backup or qemu-img convert
// opens them. -U: a running VM may hold its top layer. A layer some process has open
// for writing (a running VM's top) is only opened, not checked: its metadata on disk
// is QEMU's work in progress (an L2 entry written before the file grew reads as a
// cluster past its end), so its check failed now and then though nothing was wrong.
// It returns how many it checked.
func checkQcow2s(t testing.TB, dir string) int {
	t.Helper()
	var files []string
	live := openForWrite(dir)
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && strings.HasSuffix(d.Name(), ".qcow2") {
			files = append(files, p)
		}
		return nil
	})
	for _, f := range files {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		var out bytes.Buffer
		args := []string{"check", "-q", "-U", f}
		if live[f] {
			args = []string{"info", "-U", "--backing-chain", f}
		}
		cmd := exec.CommandContext(ctx, "qemu-img", args...)
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		cancel()
		if err != nil {
			t.Errorf("qemu-img check %s: %v: %s", strings.TrimPrefix(f, dir+"/"), err, strings.TrimSpace(out.String()))
		}
	}
	return len(files)
}

// openForWrite lists the files under dir that some process has open for writing
// (/proc/PID/fdinfo flags O_WRONLY or O_RDWR).
func openForWrite(dir string) map[string]bool {
	out := map[string]bool{}
	procs, _ := filepath.Glob("/proc/[0-9]*/fd")
	for _, fdDir := range procs {
		ents, _ := os.ReadDir(fdDir)
		for _, e := range ents {
			target, err := os.Readlink(filepath.Join(fdDir, e.Name()))
			if err != nil || !strings.HasPrefix(target, dir+"/") {
				continue
			}
			info, err := os.ReadFile(filepath.Join(filepath.Dir(fdDir), "fdinfo", e.Name()))
			if err != nil {
				continue
			}
			for _, l := range strings.Split(string(info), "\n") {
				if v, ok := strings.CutPrefix(l, "flags:"); ok {
					if flags, err := strconv.ParseUint(strings.TrimSpace(v), 8, 64); err == nil && flags&3 != 0 {
						out[target] = true
					}
				}
			}
		}
	}
	return out
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
