package bench

import (
	"os"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
)

// noteHostCounters records a wave's host counters in the result (extra.host_counters,
// by wave label) and the report.
func (r *Recorder) noteHostCounters(label string, hc measure.HostCounters) {
	r.mu.Lock()
	m, _ := r.res.Extra["host_counters"].(map[string]measure.HostCounters)
	if m == nil {
		m = map[string]measure.HostCounters{}
		r.res.Extra["host_counters"] = m
	}
	m[label] = hc
	r.mu.Unlock()
	r.section("%s", measure.HostCountersText(label, hc))
}

// startPerf starts --perf's recording (its directory under /tmp, removed at the end).
func (r *Env) startPerf() error {
	dir, err := os.MkdirTemp("/tmp", "fb-perf-")
	if err != nil {
		return err
	}
	if r.perf, err = measure.StartPerf(dir); err != nil {
		os.RemoveAll(dir)
		return err
	}
	return nil
}

// finishPerf stops --perf's recording and keeps perf script's text of the kept forks.
func (r *Env) finishPerf() {
	if r.perf == nil {
		return
	}
	defer func() { r.perf.Close(); r.perf = nil }()
	out, err := r.perf.Script(r.ctx)
	if err != nil {
		r.caveat("--perf: %v", err)
		return
	}
	r.files[measure.PerfScriptFile] = out
	r.res.Extra["perf_script"] = measure.PerfScriptFile
	r.caveat("--perf: QEMU ran with -perfmap and perf record sampled the host at 499 Hz: fork timings are slower than without it")
}
