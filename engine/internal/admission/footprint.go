package admission

import (
	"bytes"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
)

// Memory admission by observed footprint.
//
// A VM commits what VMs like it were seen to hold, not a share of its guest RAM: forks
// of one checkpoint run the same guest from the same pages, so what the settled ones
// hold (their QEMU's resident anonymous memory: guest pages they wrote or were given,
// TCG code, heap, libraries copied on write) is what the next one will grow to, give
// or take. Per source (a checkpoint, or for the implicit checkpoints of a running VM,
// that VM: each wave makes a new one), the budget keeps the high-water mark of its live
// settled forks' memory and commits each fork of it
//
//	high-water + max(high-water/4, 16 MiB)
//
// A source none of whose forks has settled yet commits the prior: 64 MiB +
// Config.MemoryCommitRatio × guest RAM (what every VM committed before Footprints were
// measured). A fork counts as a sample once it has been ready (or, ready time unknown,
// seen by the budget) for FootprintSettle: one restoring or just restored holds half of
// what it holds after its first commands.
// Other state directories' QEMUs and pooled processes are never samples (what they will
// run is unknown); they commit the prior.
//
// The guarantee that admitted VMs do not push the host into OOM rests on three things:
// a VM that grew past its commitment is counted at what it holds (MemAvailable and the
// cgroup's usage see it), so a footprint that grows raises the high-water mark and with
// it the commitment of every fork of that source still to grow; the reserve
// (Config.MemoryReserveMiB) covers the growth of forks not yet at their mark; and no VM
// is admitted while the kernel reports memory pressure (PSI, PSISomeLimit), which is
// what a host whose VMs outgrew their estimates shows first. QEMUs get oom_score_adj
// 800, so if guests still write more than was ever seen, the OOM killer takes a VM, not
// the engine or the host's other processes.

// FootprintSettle is how long the budget must have seen a fork before its memory counts
// as a sample of its source.
const FootprintSettle = 10 * time.Second

// footprintSlackMin and footprintSlackDiv make a measured source's commitment: its
// high-water mark plus the larger of a quarter of it and 16 MiB (a fork's first
// commands translate ~8 MiB of TCG code a settled fork may not have run yet).
const (
	footprintSlackMin = 16 << 20
	footprintSlackDiv = 4
)

// FootprintCommit is what a fork of a source whose settled forks hold up to high bytes
// commits.
func FootprintCommit(high int64) int64 {
	return high + max(high/footprintSlackDiv, footprintSlackMin)
}

// Footprints keeps the high-water marks of each source's settled forks.
type Footprints struct {
	now func() time.Time // time.Now; a fake clock in tests

	mu   sync.Mutex
	seen map[int]seenVM // by pid: when the budget first saw the process
	high map[string]int64
	// keys caches each checkpoint's source (sourceOf): reading a manifest per VM per
	// admission would cost more than the rest of the budget.
	keys map[string]string
}

// seenVM is a process the budget saw: its source and when it first saw it.
type seenVM struct {
	source string
	first  time.Time
}

// NewFootprints returns empty marks read on the clock now (time.Now; a fake clock in
// tests).
func NewFootprints(now func() time.Time) *Footprints {
	return &Footprints{now: now, seen: map[int]seenVM{}, high: map[string]int64{}, keys: map[string]string{}}
}

// Update folds vms into the marks and returns them: every sample (own forks) seen for
// FootprintSettle raises its source's mark; sources with no live VM left are forgotten,
// as are processes gone.
func (f *Footprints) Update(vms []QEMU) map[string]int64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.now()
	live := make(map[int]bool, len(vms))
	sources := map[string]bool{}
	for _, v := range vms {
		if !v.Sample || v.Source == "" {
			continue
		}
		live[v.PID] = true
		sources[v.Source] = true
		s, ok := f.seen[v.PID]
		if !ok || s.source != v.Source {
			s = seenVM{source: v.Source, first: now}
			f.seen[v.PID] = s
		}
		if !v.Ready.IsZero() && v.Ready.Before(s.first) {
			// Ready before the budget first looked: its age counts from then.
			s.first = v.Ready
			f.seen[v.PID] = s
		}
		if now.Sub(s.first) >= FootprintSettle && v.Private > f.high[v.Source] {
			f.high[v.Source] = v.Private
		}
	}
	for pid := range f.seen {
		if !live[pid] {
			delete(f.seen, pid)
		}
	}
	for src := range f.high {
		if !sources[src] {
			delete(f.high, src)
		}
	}
	out := make(map[string]int64, len(f.high))
	for k, v := range f.high {
		out[k] = v
	}
	return out
}

// SourceOf returns the source of the forks of checkpoint name (what its footprint is a
// sample of), found once per name through key ("" when key fails: such forks are not
// samples).
func (f *Footprints) SourceOf(name string, key func(name string) (string, error)) string {
	if name == "" {
		return ""
	}
	f.mu.Lock()
	k, ok := f.keys[name]
	f.mu.Unlock()
	if ok {
		return k
	}
	k, err := key(name)
	if err != nil {
		return ""
	}
	f.mu.Lock()
	if len(f.keys) > 4096 { // a long-lived engine's deleted checkpoints
		clear(f.keys)
	}
	f.keys[name] = k
	f.mu.Unlock()
	return k
}

// PSISomeLimit is the memory pressure at which admission refuses every VM: the share of
// the last 10 s in which some task stalled on memory (PSI "some avg10", percent).
const PSISomeLimit = 10.0

// pressure reads memory pressure (PSI): the host's /proc/pressure/memory, and on
// cgroup v2 the engine's cgroup's memory.pressure, the higher of the two. ok is false
// where neither can be read (a kernel without PSI).
func (h Probe) pressure(cg memCgroup) (some, full float64, ok bool) {
	files := []string{filepath.Join(h.Proc, "pressure", "memory")}
	if cg.version == 2 && cg.dir != "" {
		files = append(files, filepath.Join(cg.dir, "memory.pressure"))
	}
	for _, p := range files {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s, fl, good := parsePSI(b)
		if !good {
			continue
		}
		some, full, ok = max(some, s), max(full, fl), true
	}
	return some, full, ok
}

// parsePSI reads the avg10 of the "some" and "full" lines of a PSI file.
func parsePSI(b []byte) (some, full float64, ok bool) {
	for _, line := range bytes.Split(b, []byte("\n")) {
		f := strings.Fields(string(line))
		if len(f) < 2 {
			continue
		}
		v, found := strings.CutPrefix(f[1], "avg10=")
		if !found {
			continue
		}
		n, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, 0, false
		}
		switch f[0] {
		case "some":
			some, ok = n, true
		case "full":
			full = n
		}
	}
	return some, full, ok
}

// sourceFootprints lists the measured sources for the budget's output, largest
// commitment first.
func sourceFootprints(high map[string]int64, counts map[string]int) []api.MemorySource {
	out := make([]api.MemorySource, 0, len(high))
	for k, hw := range high {
		out = append(out, api.MemorySource{Source: k, VMs: counts[k], HighWaterBytes: hw, CommitBytes: FootprintCommit(hw)})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].CommitBytes != out[j].CommitBytes {
			return out[i].CommitBytes > out[j].CommitBytes
		}
		return out[i].Source < out[j].Source
	})
	return out
}
