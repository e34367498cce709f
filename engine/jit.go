package engine

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/api"
)

// ErrNotTCG reports a query that only a TCG (emulated) VM can answer.
var ErrNotTCG = api.ErrNotTCG

// JITStats is the state of a TCG VM's translation cache (QMP x-query-jit, HMP `info
// jit`). A fork starts with an empty cache, and under TCG translating the guest code it
// runs on the way to ready and in its first command is most of a fork's time and of its
// host memory, so these counts profile the fork path without timing noise: the same
// guest path translates nearly the same blocks every time.
type JITStats struct {
	// TBs is the number of translation blocks in the cache.
	TBs int64 `json:"tbs"`
	// CodeBytes is the host code generated for them; BufferBytes is the translation
	// buffer's capacity (Config.TBSizeMiB).
	CodeBytes   int64 `json:"code_bytes"`
	BufferBytes int64 `json:"buffer_bytes"`
	// Flushes counts whole-cache flushes (each one throws every block away).
	Flushes int64 `json:"flushes"`
}

// JITStats queries the translation cache of a running TCG VM. It returns ErrNotTCG
// under kvm or hvf and ErrNotRunning when QEMU is gone.
func (vm *VM) JITStats(ctx context.Context) (JITStats, error) {
	if !vm.alive() {
		return JITStats{}, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	vm.mu.Lock()
	defer vm.mu.Unlock()
	if vm.m.Accel != AccelTCG {
		return JITStats{}, fmt.Errorf("%w: %s runs under %s", ErrNotTCG, vm.m.Name, vm.m.Accel)
	}
	c, err := vm.process().client(ctx)
	if err != nil {
		return JITStats{}, err
	}
	text, err := c.XQueryJIT(ctx)
	if err != nil {
		return JITStats{}, fmt.Errorf("engine: %s: %w", vm.Name(), err)
	}
	return parseJIT(text)
}

// parseJIT parses the text of QEMU's `info jit` (x-query-jit), for example:
//
//	gen code size       18136499/67026944
//	TB count            31386
//	TB flush count      2
//
// A text without "gen code size" or "TB count" is an error; other lines are ignored.
func parseJIT(text string) (JITStats, error) {
	var s JITStats
	var haveCode, haveTBs bool
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		key, val, ok := cutKey(line, "gen code size", "TB count", "TB flush count")
		if !ok {
			continue
		}
		switch key {
		case "gen code size":
			used, capacity, ok := strings.Cut(val, "/")
			if !ok {
				return JITStats{}, fmt.Errorf("engine: info jit: bad gen code size %q", val)
			}
			var err1, err2 error
			s.CodeBytes, err1 = strconv.ParseInt(used, 10, 64)
			s.BufferBytes, err2 = strconv.ParseInt(capacity, 10, 64)
			if err := errors.Join(err1, err2); err != nil || s.CodeBytes < 0 || s.BufferBytes < 0 {
				return JITStats{}, fmt.Errorf("engine: info jit: bad gen code size %q", val)
			}
			haveCode = true
		case "TB count", "TB flush count":
			n, err := strconv.ParseInt(val, 10, 64)
			if err != nil || n < 0 {
				return JITStats{}, fmt.Errorf("engine: info jit: bad %s %q", key, val)
			}
			if key == "TB count" {
				s.TBs, haveTBs = n, true
			} else {
				s.Flushes = n
			}
		}
	}
	if !haveCode || !haveTBs {
		return JITStats{}, errors.New("engine: info jit: no gen code size or TB count")
	}
	return s, nil
}

// cutKey matches a line "KEY<spaces>VALUE" against keys and returns the key and the
// value's first field.
func cutKey(line string, keys ...string) (key, val string, ok bool) {
	for _, k := range keys {
		rest, found := strings.CutPrefix(line, k)
		if !found || rest == "" || (rest[0] != ' ' && rest[0] != '\t') {
			continue
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			return "", "", false
		}
		return k, f[0], true
	}
	return "", "", false
}
