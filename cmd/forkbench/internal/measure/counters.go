package measure

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/memfile"
)

// hostCounterKeys are the /proc/vmstat counters a wave's counter tracks follow: page
// faults, transparent huge pages and reclaim scanning.
var hostCounterKeys = []string{"pgfault", "pgmajfault", "thp_fault_alloc", "thp_fault_fallback", "thp_split_page",
	"thp_collapse_alloc", "pgscan_kswapd", "pgscan_direct", "pgsteal_kswapd", "pgsteal_direct"}

// pressureFiles are the PSI files whose "some" stall time a wave's tracks follow.
var pressureFiles = []string{"cpu", "memory", "io"}

// HostCounters sums up one wave's whole-host counter samples (extra.host_counters).
type HostCounters struct {
	IntervalMS int `json:"interval_ms"`
	Samples    int `json:"samples"`
	// Deltas are each /proc/vmstat counter's growth over the wave.
	Deltas map[string]int64 `json:"vmstat_deltas"`
	// StallPct is each pressure file's "some" stall time over the wave, as a percentage
	// of its wall time (absent where the kernel has no PSI).
	StallPct map[string]float64 `json:"pressure_some_pct,omitempty"`
	// CheckpointResidentMiB is the checkpoint's RAM file resident in the page cache at
	// the start and the end of the wave (mincore; absent when it could not be mapped).
	CheckpointResidentMiB *[2]float64 `json:"checkpoint_resident_mib,omitempty"`
}

// hostSample is one reading of the host's counters.
type hostSample struct {
	at       time.Time
	vmstat   map[string]int64
	stallUS  map[string]int64 // PSI some total, µs
	resident int64            // checkpoint file bytes in memory (-1: unknown)
}

// hostSampler reads the host's counters every interval while a wave runs, adding each
// reading's growth to the trace as counter tracks (one process, "host counters").
type hostSampler struct {
	interval time.Duration
	t        *Trace
	ram      *memfile.ResidencyMap // nil: no checkpoint file
	stop     chan struct{}
	done     sync.WaitGroup
	first    hostSample
	last     hostSample
	n        int
}

// hostCountersPid is the trace process of the counter tracks.
const hostCountersPid = 1 << 20

// StartHostSampler starts sampling (ramPath: the checkpoint's RAM file, "" for none).
func StartHostSampler(t *Trace, interval time.Duration, ramPath string) *hostSampler {
	s := &hostSampler{interval: interval, t: t, stop: make(chan struct{})}
	if ramPath != "" {
		s.ram, _ = memfile.OpenResidency(ramPath) // nil when it cannot be mapped: no track
	}
	s.t.Group(hostCountersPid, "host counters")
	s.first = s.read()
	s.last = s.first
	s.done.Add(1)
	go s.loop()
	return s
}

func (s *hostSampler) loop() {
	defer s.done.Done()
	tk := time.NewTicker(s.interval)
	defer tk.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-tk.C:
			cur := s.read()
			s.emit(s.last, cur)
			s.last = cur
			s.n++
		}
	}
}

// read takes one sample.
func (s *hostSampler) read() hostSample {
	h := hostSample{at: time.Now(), vmstat: readVMStat(), stallUS: map[string]int64{}, resident: -1}
	for _, f := range pressureFiles {
		if us, ok := readPressureSome("/proc/pressure/" + f); ok {
			h.stallUS[f] = us
		}
	}
	if s.ram != nil {
		if n, err := s.ram.Bytes(); err == nil {
			h.resident = n
		}
	}
	return h
}

// emit adds the growth from a to b as counter events at b's time.
func (s *hostSampler) emit(a, b hostSample) {
	wall := b.at.Sub(a.at)
	if wall <= 0 {
		return
	}
	faults := map[string]any{}
	for _, k := range hostCounterKeys {
		if v, ok := b.vmstat[k]; ok {
			faults[k] = v - a.vmstat[k]
		}
	}
	s.t.Counter(hostCountersPid, "vmstat per sample", b.at, faults)
	stall := map[string]any{}
	for f, us := range b.stallUS {
		stall[f] = report.Round3(float64(us-a.stallUS[f]) / float64(wall.Microseconds()) * 100)
	}
	if len(stall) > 0 {
		s.t.Counter(hostCountersPid, "pressure some %", b.at, stall)
	}
	if b.resident >= 0 {
		s.t.Counter(hostCountersPid, "checkpoint file resident MiB", b.at, map[string]any{"MiB": report.Round3(float64(b.resident) / (1 << 20))})
	}
}

// Finish stops sampling and sums the wave up.
func (s *hostSampler) Finish() HostCounters {
	close(s.stop)
	s.done.Wait()
	end := s.read()
	s.emit(s.last, end)
	if s.ram != nil {
		_ = s.ram.Close()
	}
	hc := HostCounters{IntervalMS: int(s.interval.Milliseconds()), Samples: s.n + 1, Deltas: map[string]int64{}}
	for _, k := range hostCounterKeys {
		if v, ok := end.vmstat[k]; ok {
			hc.Deltas[k] = v - s.first.vmstat[k]
		}
	}
	if wall := end.at.Sub(s.first.at); wall > 0 && len(end.stallUS) > 0 {
		hc.StallPct = map[string]float64{}
		for f, us := range end.stallUS {
			hc.StallPct[f] = report.Round3(float64(us-s.first.stallUS[f]) / float64(wall.Microseconds()) * 100)
		}
	}
	if s.first.resident >= 0 && end.resident >= 0 {
		hc.CheckpointResidentMiB = &[2]float64{report.Round3(float64(s.first.resident) / (1 << 20)), report.Round3(float64(end.resident) / (1 << 20))}
	}
	return hc
}

// readVMStat reads /proc/vmstat's hostCounterKeys (empty where there is none).
func readVMStat() map[string]int64 {
	b, err := os.ReadFile("/proc/vmstat")
	if err != nil {
		return map[string]int64{}
	}
	return parseVMStat(b)
}

// parseVMStat parses the hostCounterKeys of /proc/vmstat's text.
func parseVMStat(b []byte) map[string]int64 {
	out := map[string]int64{}
	want := map[string]bool{}
	for _, k := range hostCounterKeys {
		want[k] = true
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok || !want[k] {
			continue
		}
		if n, err := strconv.ParseInt(v, 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

// readPressureSome is the "some" line's total (µs stalled) of a PSI file.
func readPressureSome(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	return parsePressureSome(b)
}

// parsePressureSome parses "some avg10=0.00 avg60=0.00 avg300=0.00 total=12345".
func parsePressureSome(b []byte) (int64, bool) {
	for _, line := range strings.Split(string(b), "\n") {
		rest, ok := strings.CutPrefix(line, "some ")
		if !ok {
			continue
		}
		for _, f := range strings.Fields(rest) {
			if v, ok := strings.CutPrefix(f, "total="); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				return n, err == nil && n >= 0
			}
		}
	}
	return 0, false
}

// HostCountersText is the report's line for a wave's counters.
func HostCountersText(label string, hc HostCounters) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Host counters during %s (%d samples every %d ms):", label, hc.Samples, hc.IntervalMS)
	for _, k := range hostCounterKeys {
		if v, ok := hc.Deltas[k]; ok && v != 0 {
			fmt.Fprintf(&b, " %s +%d", k, v)
		}
	}
	for _, f := range pressureFiles {
		if p, ok := hc.StallPct[f]; ok {
			fmt.Fprintf(&b, ", %s pressure %.1f%%", f, p)
		}
	}
	if r := hc.CheckpointResidentMiB; r != nil {
		fmt.Fprintf(&b, ", checkpoint file resident %.1f → %.1f MiB", r[0], r[1])
	}
	return b.String() + ".\n\n"
}
