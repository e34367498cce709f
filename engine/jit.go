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
	// Invalidations counts blocks thrown away one by one: the guest wrote to code
	// pages (a module load, a JIT, self-modifying code), so their translations were
	// stale.
	Invalidations int64 `json:"invalidations"`
	// AvgGuestBytes and MaxGuestBytes are the guest code a block covers; AvgHostBytes
	// the host code it became, and ExpansionRatio host bytes per guest byte.
	AvgGuestBytes  int64   `json:"avg_guest_bytes"`
	MaxGuestBytes  int64   `json:"max_guest_bytes"`
	AvgHostBytes   int64   `json:"avg_host_bytes"`
	ExpansionRatio float64 `json:"expansion_ratio"`
	// CrossPageTBs are blocks spanning two guest pages; DirectJumps blocks chained
	// straight to a successor (without a lookup), DirectJumps2 those chained both ways.
	CrossPageTBs int64 `json:"cross_page_tbs"`
	DirectJumps  int64 `json:"direct_jumps"`
	DirectJumps2 int64 `json:"direct_jumps_2"`
	// TLBFullFlushes, TLBPartialFlushes and TLBElidedFlushes count the softmmu TLB's
	// flushes: whole, by page, and skipped because the TLB was already clean (the
	// guest's TLB shootdowns and address-space switches, seen from the emulator).
	TLBFullFlushes    int64 `json:"tlb_full_flushes"`
	TLBPartialFlushes int64 `json:"tlb_partial_flushes"`
	TLBElidedFlushes  int64 `json:"tlb_elided_flushes"`
	// Text is QEMU's whole answer, for the lines no field holds (the hash table's
	// occupancy histograms, accelerator settings).
	Text string `json:"text,omitempty"`
}

// JITStats queries the translation cache of a running TCG VM. It returns ErrNotTCG
// under kvm or hvf and ErrNotRunning when QEMU is gone.
func (vm *VM) JITStats(ctx context.Context) (JITStats, error) {
	if !vm.alive() {
		return JITStats{}, fmt.Errorf("%w: %s", ErrNotRunning, vm.Name())
	}
	if id := vm.ident(); id.Accel != AccelTCG {
		return JITStats{}, fmt.Errorf("%w: %s runs under %s", ErrNotTCG, id.Name, id.Accel)
	}
	vm.mu.Lock() // one QMP sequence at a time
	defer vm.mu.Unlock()
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
//	TB avg target size  18 max=730 bytes
//	TB avg host size    335 bytes (expansion ratio: 18.4)
//	cross page TB count 76 (0%)
//	direct jump count   19885 (63%) (2 jumps=16637 53%)
//	TB flush count      2
//	TB invalidate count 0
//	TLB full flushes    0
//	TLB partial flushes 1203
//	TLB elided flushes  77
//
// A text without "gen code size" or "TB count" is an error, as is a known line whose
// numbers do not parse; other lines are kept in Text only.
func parseJIT(text string) (JITStats, error) {
	s := JITStats{Text: text}
	var haveCode, haveTBs bool
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		key, val, ok := cutKey(line, jitKeys...)
		if !ok {
			continue
		}
		var err error
		switch key {
		case "gen code size":
			used, capacity, ok := strings.Cut(val, "/")
			if !ok {
				return JITStats{}, fmt.Errorf("engine: info jit: bad gen code size %q", val)
			}
			var err1, err2 error
			s.CodeBytes, err1 = jitCount(used)
			s.BufferBytes, err2 = jitCount(capacity)
			err, haveCode = errors.Join(err1, err2), true
		case "TB count":
			s.TBs, err = jitCount(val)
			haveTBs = true
		case "TB flush count":
			s.Flushes, err = jitCount(val)
		case "TB invalidate count":
			s.Invalidations, err = jitCount(val)
		case "TLB full flushes":
			s.TLBFullFlushes, err = jitCount(val)
		case "TLB partial flushes":
			s.TLBPartialFlushes, err = jitCount(val)
		case "TLB elided flushes":
			s.TLBElidedFlushes, err = jitCount(val)
		case "cross page TB count":
			s.CrossPageTBs, err = jitCount(val)
		case "TB avg target size":
			// "18 max=730 bytes"
			var err2 error
			s.AvgGuestBytes, err = jitCount(val)
			s.MaxGuestBytes, err2 = jitCount(jitAfter(line, "max="))
			err = errors.Join(err, err2)
		case "TB avg host size":
			// "335 bytes (expansion ratio: 18.4)"
			s.AvgHostBytes, err = jitCount(val)
			if r := jitAfter(line, "expansion ratio:"); r != "" {
				s.ExpansionRatio, err = jitRatio(strings.TrimSuffix(r, ")"), err)
			}
		case "direct jump count":
			// "19885 (63%) (2 jumps=16637 53%)"
			s.DirectJumps, err = jitCount(val)
			if j := jitAfter(line, "jumps="); j != "" {
				var err2 error
				s.DirectJumps2, err2 = jitCount(j)
				err = errors.Join(err, err2)
			}
		}
		if err != nil {
			return JITStats{}, fmt.Errorf("engine: info jit: bad %s line %q", key, line)
		}
	}
	if !haveCode || !haveTBs {
		return JITStats{}, errors.New("engine: info jit: no gen code size or TB count")
	}
	return s, nil
}

// jitKeys are the `info jit` lines parseJIT reads, longest first where one is a
// prefix of another.
var jitKeys = []string{
	"gen code size", "TB count", "TB flush count", "TB invalidate count", "TB avg target size",
	"TB avg host size", "cross page TB count", "direct jump count",
	"TLB full flushes", "TLB partial flushes", "TLB elided flushes",
}

// jitCount parses a non-negative count.
func jitCount(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad count %q", s)
	}
	return n, nil
}

// jitRatio parses a non-negative ratio, keeping an earlier error.
func jitRatio(s string, err error) (float64, error) {
	r, perr := strconv.ParseFloat(s, 64)
	if perr != nil || r < 0 || r != r {
		return 0, errors.Join(err, fmt.Errorf("bad ratio %q", s))
	}
	return r, err
}

// jitAfter is the first field after marker in line ("" if none).
func jitAfter(line, marker string) string {
	_, rest, ok := strings.Cut(line, marker)
	if !ok {
		return ""
	}
	f := strings.Fields(rest)
	if len(f) == 0 {
		return ""
	}
	return f[0]
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
