package report

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/forkvm/forkvm/faultclass"
)

// faultColumns are samples.csv's fault class columns (--faults; empty without).
var faultColumns = []string{"faults_cow_before", "faults_holes_before", "faults_shared_reads_before", "faults_qemu_before",
	"faults_cow_after", "faults_holes_after", "faults_shared_reads_after", "faults_qemu_after"}

// faultValues are the samples.csv cells of faultColumns.
func (s *Sample) faultValues() []string {
	out := make([]string, len(faultColumns))
	if s.Faults == nil {
		return out
	}
	u := func(v uint64) string { return strconv.FormatUint(v, 10) }
	for i, ph := range []int{faultclass.BeforeReady, faultclass.AfterReady} {
		sum := s.Faults.Summary(ph)
		copy(out[4*i:], []string{u(sum.CopyOnWrite), u(sum.Holes), u(sum.SharedReads), u(sum.QEMU)})
	}
	return out
}

// FaultsSection is report.md's table of fault classes (medians over the ready forks
// counted), "" when none was.
func FaultsSection(samples []Sample) string {
	var cols [8][]float64
	n := 0
	for i := range samples {
		s := &samples[i]
		if !s.OK || s.Faults == nil {
			continue
		}
		n++
		for j, v := range s.faultValues() {
			x, _ := strconv.ParseFloat(v, 64)
			cols[j] = append(cols[j], x)
		}
	}
	if n == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n## Page faults of each fork's QEMU by class\n\n")
	fmt.Fprintf(&b, "Medians over %d ready forks, counted in the kernel (eBPF on exceptions:page_fault_user) from QEMU's start (a warm pool's QEMU: from the fork's claim), split at ready; after ready runs to the end of the first command. Copy on write: writes to checkpoint data in guest RAM; holes: faults on guest RAM the checkpoint recorded as holes; shared reads: read faults on checkpoint data (one fault maps neighbouring cached pages too); QEMU: everything outside guest RAM.\n\n", n)
	b.WriteString("| | copy on write | holes | shared reads | QEMU |\n|---|---|---|---|---|\n")
	for i, label := range []string{"before ready", "after ready"} {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s |\n", label, Fnum(Median(cols[4*i])), Fnum(Median(cols[4*i+1])), Fnum(Median(cols[4*i+2])), Fnum(Median(cols[4*i+3])))
	}
	return b.String()
}
