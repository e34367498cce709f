// Package report is what forkbench writes: result.json (forkvm.bench-result/v1), samples.csv
// and report.md, the statistics behind them, the published reference figures they are set
// beside, the comparison of two results and the fanout SVG. It measures nothing.
package report

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/faultclass"
)

// SchemaVersion names the result.json format.
const SchemaVersion = "forkvm.bench-result/v1"

// Result is result.json.
type Result struct {
	Schema      string         `json:"schema"`
	Bench       string         `json:"bench"`
	Metric      string         `json:"metric"`
	Value       float64        `json:"value"`
	Unit        string         `json:"unit"`
	Stat        string         `json:"stat"`
	N           int            `json:"n"`
	Percentiles Percentiles    `json:"percentiles"`
	Extra       map[string]any `json:"extra"`
	MeasuredAt  string         `json:"measured_at"`
	Build       BuildInfo      `json:"build"`
	Host        HostInfo       `json:"host"`
	Environment Environment    `json:"environment"`
	Method      string         `json:"method"`
	Caveats     []string       `json:"caveats"`
	// Profiling names what slowed the run on purpose (--perf: QEMUs with -perfmap, perf
	// record of the whole host); "" for a benchmark run. A profiling run's figures are
	// for seeing where time goes: they are not compared with the published figures.
	Profiling string `json:"profiling,omitempty"`
	// Complete is false when what the headline stands for was not all measured (fanout:
	// a wave of the headline pass was not all admitted or ready); OK is then false too.
	Complete bool `json:"complete"`
	OK       bool `json:"ok"`
	Failures int  `json:"failures"`
}

// BuildInfo identifies what was measured.
type BuildInfo struct {
	Forkvm string `json:"forkvm"`
	QEMU   string `json:"qemu"`
	Kernel string `json:"kernel"`
	// Image is the content hash of the guest image (kernel + initramfs with the agent)
	// the VMs booted: rebuilding the agent changes it.
	Image string `json:"image"`
	Go    string `json:"go"`
}

// HostInfo describes the machine.
type HostInfo struct {
	Model    string  `json:"model"`
	CPUs     int     `json:"cpus"`
	MemoryGB float64 `json:"memory_gb"`
	OS       string  `json:"os"`
	Kernel   string  `json:"kernel"`
	Accel    string  `json:"accel"`
	// KSM is the kernel's same-page merging as the run found it (nil: the host has
	// none). The benchmark never changes it.
	KSM *KSMState `json:"ksm,omitempty"`
}

// KSMState is the host's same-page merging settings (/sys/kernel/mm/ksm): Run 1 means
// ksmd scans (0: nothing is merged), PagesToScan pages every SleepMillisecs.
type KSMState struct {
	Run            int64 `json:"run"`
	PagesToScan    int64 `json:"pages_to_scan"`
	SleepMillisecs int64 `json:"sleep_millisecs"`
}

// Shape is the VM shape of the world.
type Shape struct {
	CPUs      int `json:"cpus"`
	MemoryMiB int `json:"memory_mb"`
	DirtyMB   int `json:"dirty_mb"`
	DiskMiB   int `json:"disk_mb"`
	// Image is the root image the world boots ("": the busybox initramfs); StateMB the
	// size of its $HOME/state.bin.
	Image   string `json:"image,omitempty"`
	StateMB int    `json:"state_mb,omitempty"`
}

// Environment is the run's context.
type Environment struct {
	Shape         Shape    `json:"shape"`
	Settings      Settings `json:"settings"`
	LoadAvgBefore string   `json:"load_avg_before"`
	// GuestCPU is the CPU of the run's first booted VM (its world, or a cold create) as
	// its QEMU was given it (engine Info.CPU): the model and the features set otherwise.
	GuestCPU string `json:"guest_cpu,omitempty"`
	OtherVMs int    `json:"other_vms"`
	// OtherVMsDetail sorts OtherVMs: forkvm VMs per other state directory, and the rest.
	OtherVMsDetail *OtherVMs `json:"other_vms_detail,omitempty"`
}

// Sample is one row of samples.csv.
type Sample struct {
	Bench      string
	Group      string // wave/batch/step label
	Index      int
	Name       string
	OK         bool
	LatencyMS  float64
	PrepareMS  float64
	SpawnMS    float64
	RestoreMS  float64
	AgentMS    float64
	FirstCmdMS float64
	CPUUserMS  float64
	CPUSysMS   float64
	// Mem is the fork's memory breakdown (nil: not measured).
	Mem *ForkMem
	// TBsReady and TBsFirstCmd are the TCG translation blocks a fork's QEMU generated
	// until ready and during its first command (0 when not measured: kvm/hvf).
	TBsReady    int64
	TBsFirstCmd int64
	// Counters and PhaseCounters are the kernel's counters of the fork's QEMU
	// (--counters; nil without), PhaseCounters by span name.
	Counters      *engine.Counters
	PhaseCounters map[string]*engine.KernelCounters
	// Faults are the fork's page faults by class (--faults; nil without).
	Faults *faultclass.Counts
	Error  string
}

// AnonMB is the fork's anonymous memory (0: not measured).
func (s *Sample) AnonMB() float64 {
	if s.Mem == nil {
		return 0
	}
	return s.Mem.AnonMB
}

// memValues are the samples.csv cells of memColumns ("" when not measured).
func (s *Sample) memValues() []string {
	out := make([]string, len(MemColumns))
	if s.Mem != nil {
		for i, v := range s.Mem.Values() {
			out[i] = Fnum(v)
		}
	}
	return out
}

// SetPhases records p in s (ms).
func (s *Sample) SetPhases(p Phases) {
	s.PrepareMS, s.SpawnMS, s.RestoreMS, s.AgentMS = Ms(p.Prepare), Ms(p.Spawn), Ms(p.Restore), Ms(p.Agent)
}

// csvHeader is the first row of samples.csv.
var csvHeader = append(append([]string{"bench", "wave", "index", "name", "ok", "latency_ms", "prepare_ms", "spawn_ms",
	"restore_ms", "agent_ms", "first_cmd_ms", "cpu_user_ms", "cpu_sys_ms", "anon_mb", "tbs_ready", "tbs_first_cmd"},
	MemColumns...), append(append(counterColumns, faultColumns...), "error")...)

// Fnum formats x rounded to 3 decimals, without trailing zeros.
func Fnum(x float64) string { return strconv.FormatFloat(Round3(x), 'f', -1, 64) }

// WriteCSV writes samples as CSV with csvHeader.
func WriteCSV(w io.Writer, samples []Sample) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(csvHeader); err != nil {
		return err
	}
	for _, s := range samples {
		row := []string{s.Bench, s.Group, strconv.Itoa(s.Index), s.Name, strconv.FormatBool(s.OK),
			Fnum(s.LatencyMS), Fnum(s.PrepareMS), Fnum(s.SpawnMS), Fnum(s.RestoreMS), Fnum(s.AgentMS),
			Fnum(s.FirstCmdMS), Fnum(s.CPUUserMS), Fnum(s.CPUSysMS), Fnum(s.AnonMB()),
			strconv.FormatInt(s.TBsReady, 10), strconv.FormatInt(s.TBsFirstCmd, 10)}
		row = append(append(append(row, s.memValues()...), s.counterValues()...), s.faultValues()...)
		row = append(row, s.Error)
		if err := cw.Write(row); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteResultJSON writes r as indented JSON. A nil extra or caveats becomes {} or [] so
// every schema field is present.
func WriteResultJSON(w io.Writer, r *Result) error {
	if r.Extra == nil {
		r.Extra = map[string]any{}
	}
	if r.Caveats == nil {
		r.Caveats = []string{}
	}
	sanitize(r.Extra)
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// sanitize replaces NaN and Inf (which JSON cannot carry) by 0, recursively.
func sanitize(m map[string]any) {
	for k, v := range m {
		switch x := v.(type) {
		case float64:
			if math.IsNaN(x) || math.IsInf(x, 0) {
				m[k] = 0.0
			}
		case map[string]any:
			sanitize(x)
		}
	}
}

// Bar is one bar of an ASCII chart.
type Bar struct {
	Label string
	Value float64
}

// ASCIIChart renders bars scaled to width characters, one per line, with the value.
func ASCIIChart(bars []Bar, width int, unit string) string {
	if width < 1 {
		width = 40
	}
	maxV, maxL := 0.0, 0
	for _, b := range bars {
		maxV = math.Max(maxV, b.Value)
		maxL = max(maxL, len(b.Label))
	}
	var sb strings.Builder
	for _, b := range bars {
		n := 0
		if maxV > 0 && b.Value > 0 {
			n = int(math.Round(b.Value / maxV * float64(width)))
			n = max(n, 1)
		}
		fmt.Fprintf(&sb, "%-*s |%s%s %s %s\n", maxL, b.Label, strings.Repeat("#", n), strings.Repeat(" ", width-n), Fnum(b.Value), unit)
	}
	return sb.String()
}

// HistogramBars buckets values into at most nb equal-width buckets labelled by range.
func HistogramBars(xs []float64, nb int) []Bar {
	if len(xs) == 0 || nb < 1 {
		return nil
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	lo, hi := s[0], s[len(s)-1]
	if hi == lo {
		return []Bar{{Label: fmt.Sprintf("%.0f ms", lo), Value: float64(len(s))}}
	}
	w := (hi - lo) / float64(nb)
	counts := make([]int, nb)
	for _, x := range s {
		i := min(int((x-lo)/w), nb-1)
		counts[i]++
	}
	bars := make([]Bar, nb)
	for i := range counts {
		bars[i] = Bar{Label: fmt.Sprintf("%5.0f-%5.0f ms", lo+float64(i)*w, lo+float64(i+1)*w), Value: float64(counts[i])}
	}
	return bars
}

// WriteOutputs writes result.json, samples.csv and report.md into dir.
func WriteOutputs(dir string, r *Result, samples []Sample, report string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.Create(filepath.Join(dir, "result.json"))
	if err != nil {
		return err
	}
	if err := WriteResultJSON(f, r); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	f, err = os.Create(filepath.Join(dir, "samples.csv"))
	if err != nil {
		return err
	}
	if err := WriteCSV(f, samples); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "report.md"), []byte(report), 0o644)
}
