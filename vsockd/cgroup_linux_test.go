package vsockd

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// setPopulated writes what the kernel's cgroup.events would say of dir.
func setPopulated(t *testing.T, dir string, populated bool) {
	t.Helper()
	v := "populated 0\nfrozen 0\n"
	if populated {
		v = "populated 1\nfrozen 0\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.events"), []byte(v), 0o644); err != nil {
		t.Fatal(err)
	}
}

func openDir(t *testing.T, dir string) *os.File {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func TestExecCgroupsReuse(t *testing.T) {
	parent := openDir(t, t.TempDir())
	var c execCgroups
	c.prepare(parent, 64, 1)
	e1 := filepath.Join(parent.Name(), "e1")
	if b, err := os.ReadFile(filepath.Join(e1, "pids.max")); err != nil || string(b) != "64" {
		t.Fatalf("spare's pids.max = %q, %v", b, err)
	}
	setPopulated(t, e1, false)

	// A command takes the spare: no cgroup is made on its way.
	cg, path := c.take(parent, 64)
	if path != e1 {
		t.Fatalf("took %q, want the spare %q", path, e1)
	}
	if _, err := os.Stat(filepath.Join(parent.Name(), "e2")); !os.IsNotExist(err) {
		t.Fatalf("take made a cgroup with a spare at hand: %v", err)
	}
	// It ended with nothing left: the next command gets the same cgroup.
	c.release(cg, path)
	cg, path = c.take(parent, 64)
	if path != e1 {
		t.Fatalf("took %q after release, want %q again", path, e1)
	}
	// It left a daemon: its cgroup is set aside, the next command gets a new one.
	setPopulated(t, e1, true)
	c.release(cg, path)
	cg2, path2 := c.take(parent, 64)
	if path2 != filepath.Join(parent.Name(), "e2") {
		t.Fatalf("took %q while e1 is populated, want e2", path2)
	}
	if !c.left[e1] {
		t.Fatalf("e1 not set aside: %v", c.left)
	}
	// Once the daemon ended, a release looks again and e1 serves again.
	setPopulated(t, e1, false)
	setPopulated(t, path2, false)
	c.release(cg2, path2)
	if len(c.left) != 0 || len(c.idle) != 2 {
		t.Fatalf("after release: left %v, %d idle; want none left, 2 idle", c.left, len(c.idle))
	}
	for _, f := range c.idle {
		f.Close()
	}
}

func TestExecCgroupsIdleBound(t *testing.T) {
	parent := openDir(t, t.TempDir())
	var c execCgroups
	type taken struct {
		f    *os.File
		path string
	}
	var all []taken
	for range idleCgroupsMax + 3 {
		f, p := c.take(parent, 0)
		if p == "" {
			t.Fatal("no cgroup of its own")
		}
		setPopulated(t, p, false)
		all = append(all, taken{f, p})
	}
	for _, tk := range all {
		c.release(tk.f, tk.path)
	}
	if len(c.idle) != idleCgroupsMax {
		t.Fatalf("%d idle, want at most %d", len(c.idle), idleCgroupsMax)
	}
	for _, f := range c.idle {
		f.Close()
	}
}

func TestExecCgroupsFallBack(t *testing.T) {
	var c execCgroups
	if f, p := c.take(nil, 64); f != nil || p != "" {
		t.Fatalf("without a parent: %v %q", f, p)
	}
	dir := t.TempDir()
	parent := openDir(t, dir)
	// A parent whose cgroups cannot be made (here: a file named like the next one):
	// the command starts in the parent itself.
	for i := 1; i <= 17; i++ {
		if err := os.WriteFile(filepath.Join(dir, "e"+strconv.Itoa(i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	f, p := c.take(parent, 64)
	if f == nil || p != "" || f.Name() != dir {
		t.Fatalf("take = %v %q, want the parent itself", f, p)
	}
	c.release(f, p)
}

// TestExecCgroupsSpentNotReused: a cgroup killed through cgroup.kill is never given to
// another command (the kernel kills what is cloned into it afterwards), even once empty.
func TestExecCgroupsSpentNotReused(t *testing.T) {
	parent := openDir(t, t.TempDir())
	var c execCgroups
	cg, path := c.take(parent, 0)
	if !c.killNow(path) {
		t.Fatal("killNow wrote no cgroup.kill")
	}
	setPopulated(t, path, false)
	c.release(cg, path)
	cg2, path2 := c.take(parent, 0)
	if path2 == path {
		t.Fatalf("took the killed cgroup %q again", path)
	}
	cg2.Close()
	for _, f := range c.idle {
		f.Close()
	}
}
