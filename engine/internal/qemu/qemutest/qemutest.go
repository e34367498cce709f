// Package qemutest holds what the engine's tests and its qemu package's tests share: a
// scripted QMP server (QMP) and helpers that read QEMU argv.
package qemutest

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
)

// Call is one command a fake QEMU received.
type Call struct {
	Cmd  string
	Args string // compact JSON; "" without arguments
}

// Handler answers one command: a raw JSON return value, or (errClass not empty) an
// error of that class with ret as its description.
type Handler func(cmd string, args json.RawMessage) (ret, errClass string)

// QMP is a scripted QMP server: it greets as QEMU 10.0.2, accepts qmp_capabilities,
// and answers every other command from its Handler ({} when nil), recording it.
type QMP struct {
	mu     sync.Mutex
	calls  []Call
	handle Handler
}

// NewQMP returns a server that answers with handle.
func NewQMP(handle Handler) *QMP { return &QMP{handle: handle} }

// Calls returns the commands received so far, in order.
func (f *QMP) Calls() []Call {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Call(nil), f.calls...)
}

// Commands returns the names of the commands received so far, in order.
func (f *QMP) Commands() []string {
	var out []string
	for _, c := range f.Calls() {
		out = append(out, c.Cmd)
	}
	return out
}

// Pipe serves one connection over net.Pipe and returns the client's end (closed with
// the test).
func (f *QMP) Pipe(t testing.TB) net.Conn {
	cc, sc := net.Pipe()
	go f.Serve(sc)
	t.Cleanup(func() { cc.Close() })
	return cc
}

// Listen serves QMP on a unix socket in a fresh directory (for code that dials a
// path) and returns the socket's path; the listener closes with the test.
func (f *QMP) Listen(t testing.TB) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			sc, err := ln.Accept()
			if err != nil {
				return
			}
			go f.Serve(sc)
		}
	}()
	return sock
}

// Serve speaks QMP on conn until the client closes it.
func (f *QMP) Serve(conn net.Conn) {
	defer conn.Close()
	dec := json.NewDecoder(conn)
	io.WriteString(conn, `{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": ""}, "capabilities": []}}`+"\r\n")
	for {
		var c struct {
			Execute   string          `json:"execute"`
			Arguments json.RawMessage `json:"arguments"`
			ID        string          `json:"id"`
		}
		if dec.Decode(&c) != nil {
			return
		}
		ret, class := "{}", ""
		if c.Execute != "qmp_capabilities" {
			f.mu.Lock()
			f.calls = append(f.calls, Call{c.Execute, string(c.Arguments)})
			f.mu.Unlock()
			if f.handle != nil {
				ret, class = f.handle(c.Execute, c.Arguments)
			}
		}
		msg := fmt.Sprintf(`{"return": %s, "id": %q}`, ret, c.ID)
		if class != "" {
			msg = fmt.Sprintf(`{"error": {"class": %q, "desc": %q}, "id": %q}`, class, ret, c.ID)
		}
		if _, err := io.WriteString(conn, msg+"\r\n"); err != nil {
			return
		}
	}
}

// FlagValues returns the values following every occurrence of flag in argv ("" for a
// flag at the end).
func FlagValues(argv []string, flag string) []string {
	var out []string
	for i := 0; i < len(argv); i++ {
		if argv[i] == flag {
			if i+1 < len(argv) {
				out = append(out, argv[i+1])
				i++
			} else {
				out = append(out, "")
			}
		}
	}
	return out
}

// FlagValue returns the single value of flag, failing the test if flag is not in
// argv exactly once.
func FlagValue(t testing.TB, argv []string, flag string) string {
	t.Helper()
	vs := FlagValues(argv, flag)
	if len(vs) != 1 {
		t.Fatalf("%s: want exactly one occurrence, got %d in %q", flag, len(vs), argv)
	}
	return vs[0]
}

// HasFlag reports whether flag is in argv.
func HasFlag(argv []string, flag string) bool { return len(FlagValues(argv, flag)) > 0 }

// HasPair reports whether flag value appears as a pair in argv.
func HasPair(argv []string, flag, value string) bool {
	for _, v := range FlagValues(argv, flag) {
		if v == value {
			return true
		}
	}
	return false
}
