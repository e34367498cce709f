// Package durable flushes files and directories to stable storage at commit points:
// a file renamed into place and later trusted by its size or its decoding alone, which
// a power loss could otherwise leave at its full size but never written, and the
// directory that holds the rename.
package durable

import (
	"os"
	"sync"
)

// Fsync flushes f to stable storage. A variable so that tests see which files are
// flushed (nothing else shows whether they were): see Record.
var Fsync = (*os.File).Sync

// File flushes the file at path (opened read-only: fsync needs no write access).
func File(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	err = Fsync(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Dir flushes a directory's entries, best effort: a rename into it is durable once it
// is.
func Dir(dir string) {
	if f, err := os.Open(dir); err == nil {
		_ = Fsync(f)
		f.Close()
	}
}

// Record makes Fsync record the name of each file and directory it flushes (and still
// flush it) until t's cleanup (a test's), and returns a function that lists them.
func Record(t interface{ Cleanup(func()) }) (synced func() []string) {
	old := Fsync
	var mu sync.Mutex
	var got []string
	Fsync = func(f *os.File) error {
		mu.Lock()
		got = append(got, f.Name())
		mu.Unlock()
		return old(f)
	}
	t.Cleanup(func() { Fsync = old })
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), got...)
	}
}
