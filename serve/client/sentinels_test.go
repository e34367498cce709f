package client

import (
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// sentinels binds the exported Err* variables of the packages whose errors the API
// returns (api, which declares them, and engine and vsockd, which re-export them) to
// their values. TestEverySentinelHasACode parses those packages' source and
// fails on any Err* missing here, so a new sentinel cannot be added without a row in
// serve's code table.
var sentinels = map[string]error{
	"engine.ErrInvalidSpec":       engine.ErrInvalidSpec,
	"engine.ErrInvalidName":       engine.ErrInvalidName,
	"engine.ErrExists":            engine.ErrExists,
	"engine.ErrNotFound":          engine.ErrNotFound,
	"engine.ErrQEMUMissing":       engine.ErrQEMUMissing,
	"engine.ErrQEMUTooOld":        engine.ErrQEMUTooOld,
	"engine.ErrImageMissing":      engine.ErrImageMissing,
	"engine.ErrImageNotFound":     engine.ErrImageNotFound,
	"engine.ErrAgentBusy":         engine.ErrAgentBusy,
	"engine.ErrQEMUExited":        engine.ErrQEMUExited,
	"engine.ErrAgentTimeout":      engine.ErrAgentTimeout,
	"engine.ErrNotRunning":        engine.ErrNotRunning,
	"engine.ErrPaused":            engine.ErrPaused,
	"engine.ErrParked":            engine.ErrParked,
	"engine.ErrFrozen":            engine.ErrFrozen,
	"engine.ErrDiskBudget":        engine.ErrDiskBudget,
	"engine.ErrNotForkable":       engine.ErrNotForkable,
	"engine.ErrLocked":            engine.ErrLocked,
	"engine.ErrCheckpointCorrupt": engine.ErrCheckpointCorrupt,
	"engine.ErrIncompatible":      engine.ErrIncompatible,
	"engine.ErrInUse":             engine.ErrInUse,
	"engine.ErrAdmission":         engine.ErrAdmission,
	"engine.ErrClosed":            engine.ErrClosed,
	"engine.ErrPortInUse":         engine.ErrPortInUse,
	"engine.ErrPortUnavailable":   engine.ErrPortUnavailable,
	"engine.ErrSourceMissing":     engine.ErrSourceMissing,
	"engine.ErrNotDirectory":      engine.ErrNotDirectory,
	"engine.ErrUnsafeEntry":       engine.ErrUnsafeEntry,
	"engine.ErrNotTCG":            engine.ErrNotTCG,
	"engine.ErrDigest":            engine.ErrDigest,
	"engine.ErrInsufficientSpace": engine.ErrInsufficientSpace,
	"vsockd.ErrTokenMismatch":     vsockd.ErrTokenMismatch,
	"vsockd.ErrClosed":            vsockd.ErrClosed,
	"vsockd.ErrOutputLimit":       vsockd.ErrOutputLimit,
	"vsockd.ErrFileTooLarge":      vsockd.ErrFileTooLarge,
	"vsockd.ErrStreamReset":       vsockd.ErrStreamReset,
	"vsockd.ErrSessionReset":      vsockd.ErrSessionReset,
	"vsockd.ErrProtocol":          vsockd.ErrProtocol,
	"vsockd.ErrUnsupported":       vsockd.ErrUnsupported,
	"vsockd.ErrConnLost":          vsockd.ErrConnLost,
	"vsockd.ErrEmptyArgv":         vsockd.ErrEmptyArgv,
	"vsockd.ErrInvalidRequest":    vsockd.ErrInvalidRequest,
	"vsockd.ErrNotFound":          vsockd.ErrNotFound,
	"vsockd.ErrNotExecutable":     vsockd.ErrNotExecutable,
	"vsockd.ErrWorkdir":           vsockd.ErrWorkdir,
	"vsockd.ErrUnknownUser":       vsockd.ErrUnknownUser,
	"vsockd.ErrSourceMissing":     vsockd.ErrSourceMissing,
	"vsockd.ErrNotDirectory":      vsockd.ErrNotDirectory,
	"vsockd.ErrUnsafeEntry":       vsockd.ErrUnsafeEntry,
	"vsockd.ErrBadArchive":        vsockd.ErrBadArchive,
	"vsockd.ErrBadFrame":          vsockd.ErrBadFrame,
	"vsockd.ErrFrameTooLarge":     vsockd.ErrFrameTooLarge,
	"api.ErrInvalidSpec":          api.ErrInvalidSpec,
	"api.ErrInvalidName":          api.ErrInvalidName,
	"api.ErrExists":               api.ErrExists,
	"api.ErrNotFound":             api.ErrNotFound,
	"api.ErrQEMUMissing":          api.ErrQEMUMissing,
	"api.ErrQEMUTooOld":           api.ErrQEMUTooOld,
	"api.ErrImageMissing":         api.ErrImageMissing,
	"api.ErrImageNotFound":        api.ErrImageNotFound,
	"api.ErrAgentBusy":            api.ErrAgentBusy,
	"api.ErrQEMUExited":           api.ErrQEMUExited,
	"api.ErrAgentTimeout":         api.ErrAgentTimeout,
	"api.ErrNotRunning":           api.ErrNotRunning,
	"api.ErrPaused":               api.ErrPaused,
	"api.ErrParked":               api.ErrParked,
	"api.ErrFrozen":               api.ErrFrozen,
	"api.ErrDiskBudget":           api.ErrDiskBudget,
	"api.ErrNotForkable":          api.ErrNotForkable,
	"api.ErrLocked":               api.ErrLocked,
	"api.ErrCheckpointCorrupt":    api.ErrCheckpointCorrupt,
	"api.ErrIncompatible":         api.ErrIncompatible,
	"api.ErrInUse":                api.ErrInUse,
	"api.ErrAdmission":            api.ErrAdmission,
	"api.ErrClosed":               api.ErrClosed,
	"api.ErrPortInUse":            api.ErrPortInUse,
	"api.ErrPortUnavailable":      api.ErrPortUnavailable,
	"api.ErrNotTCG":               api.ErrNotTCG,
	"api.ErrDigest":               api.ErrDigest,
	"api.ErrInsufficientSpace":    api.ErrInsufficientSpace,
	"api.ErrTokenMismatch":        api.ErrTokenMismatch,
	"api.ErrAgentClosed":          api.ErrAgentClosed,
	"api.ErrOutputLimit":          api.ErrOutputLimit,
	"api.ErrFileTooLarge":         api.ErrFileTooLarge,
	"api.ErrStreamReset":          api.ErrStreamReset,
	"api.ErrSessionReset":         api.ErrSessionReset,
	"api.ErrProtocol":             api.ErrProtocol,
	"api.ErrUnsupported":          api.ErrUnsupported,
	"api.ErrConnLost":             api.ErrConnLost,
	"api.ErrEmptyArgv":            api.ErrEmptyArgv,
	"api.ErrInvalidRequest":       api.ErrInvalidRequest,
	"api.ErrCommandNotFound":      api.ErrCommandNotFound,
	"api.ErrNotExecutable":        api.ErrNotExecutable,
	"api.ErrWorkdir":              api.ErrWorkdir,
	"api.ErrUnknownUser":          api.ErrUnknownUser,
	"api.ErrSourceMissing":        api.ErrSourceMissing,
	"api.ErrNotDirectory":         api.ErrNotDirectory,
	"api.ErrUnsafeEntry":          api.ErrUnsafeEntry,
	"api.ErrBadArchive":           api.ErrBadArchive,
	"api.ErrBadFrame":             api.ErrBadFrame,
	"api.ErrFrameTooLarge":        api.ErrFrameTooLarge,
}

// exportedSentinels lists the exported package-level variables named Err* declared in
// the non-test Go files of dir (every build tag), as "pkg.ErrX".
func exportedSentinels(t *testing.T, dir, pkg string) []string {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR {
				continue
			}
			for _, sp := range gd.Specs {
				for _, n := range sp.(*ast.ValueSpec).Names {
					if strings.HasPrefix(n.Name, "Err") && n.IsExported() {
						seen[pkg+"."+n.Name] = true
					}
				}
			}
		}
	}
	var out []string
	for n := range seen {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// TestEverySentinelHasACode: every exported Err* of engine and vsockd maps to a code of
// its own, the code maps back to it, and a daemon's answer carrying the code matches it
// with errors.Is on the client side (ErrUnsafeEntry once came back as internal/500).
func TestEverySentinelHasACode(t *testing.T) {
	var names []string
	for _, p := range []struct{ dir, pkg string }{{"../../engine", "engine"}, {"../../vsockd", "vsockd"}, {"../../api", "api"}} {
		names = append(names, exportedSentinels(t, p.dir, p.pkg)...)
	}
	if len(names) < 20 {
		t.Fatalf("found only %d sentinels in the source: %v", len(names), names)
	}
	for _, n := range names {
		err, ok := sentinels[n]
		if !ok {
			t.Errorf("%s is not in this test's sentinel list (add it here and a row to api's code table)", n)
			continue
		}
		wrapped := fmt.Errorf("context: %w", err)
		o, status := api.ErrorObjectOf(wrapped)
		if o.Code == api.CodeInternal {
			t.Errorf("%s maps to %s", n, o.Code)
			continue
		}
		if s := api.SentinelOf(o.Code); s == nil || !errors.Is(err, s) {
			t.Errorf("%s: code %s maps back to %v", n, o.Code, s)
		}
		got := errorFrom(status, o)
		if !errors.Is(got, err) {
			t.Errorf("%s: the client's error for code %s (HTTP %d) does not match it", n, o.Code, status)
		}
		if got.Error() != wrapped.Error() {
			t.Errorf("%s: the client's message %q, want %q", n, got.Error(), wrapped.Error())
		}
	}
	// Distinct sentinels have distinct codes (aliases such as engine.ErrUnsafeEntry =
	// vsockd.ErrUnsafeEntry share theirs).
	codeOf := map[string]error{}
	for n, err := range sentinels {
		o, _ := api.ErrorObjectOf(err)
		c := o.Code
		if prev, ok := codeOf[c]; ok && prev != err {
			t.Errorf("code %s stands for two errors (%v and %s)", c, prev, n)
		}
		codeOf[c] = err
	}
	// The host's own errnos the API answers as client errors.
	for _, c := range []struct {
		err    error
		errno  syscall.Errno
		status int
	}{
		{&os.PathError{Op: "write", Path: "/x", Err: syscall.ENOSPC}, syscall.ENOSPC, 507},
		{fmt.Errorf("start: %w", syscall.E2BIG), syscall.E2BIG, 400},
	} {
		o, status := api.ErrorObjectOf(c.err)
		if status != c.status || !errors.Is(errorFrom(status, o), c.errno) {
			t.Errorf("%v: code %s HTTP %d, want %d and errors.Is %v on the client", c.err, o.Code, status, c.status, c.errno)
		}
	}
}
