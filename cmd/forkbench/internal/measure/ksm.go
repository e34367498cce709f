package measure

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/procinfo"
)

// ksmDir is where the kernel's same-page merging reports and takes its settings.
const ksmDir = "/sys/kernel/mm/ksm"

// KSMSample is the kernel's same-page merging at one moment: whether ksmd runs, its
// pace, what it keeps merged, and the CPU ksmd used since the host started.
type KSMSample struct {
	Run            int64
	PagesToScan    int64
	SleepMillisecs int64
	// ProfitBytes is general_profit: memory merging saves, less its own metadata.
	ProfitBytes  int64
	PagesSharing int64
	CPU          time.Duration
	OK           bool // false: no KSM on this host (nothing read)
}

// ReadKSM reads the host's KSM counters and ksmd's CPU time.
func ReadKSM() KSMSample {
	num := func(name string) (int64, bool) {
		b, err := os.ReadFile(filepath.Join(ksmDir, name))
		if err != nil {
			return 0, false
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return v, err == nil
	}
	var s KSMSample
	if s.Run, s.OK = num("run"); !s.OK {
		return s
	}
	s.PagesToScan, _ = num("pages_to_scan")
	s.SleepMillisecs, _ = num("sleep_millisecs")
	s.ProfitBytes, _ = num("general_profit")
	s.PagesSharing, _ = num("pages_sharing")
	s.CPU = ksmdCPU()
	return s
}

// State is the settings part of s for a run's host record (nil: no KSM).
func (s KSMSample) State() *report.KSMState {
	if !s.OK {
		return nil
	}
	return &report.KSMState{Run: s.Run, PagesToScan: s.PagesToScan, SleepMillisecs: s.SleepMillisecs}
}

// ksmdCPU is the user+system time of the ksmd kernel thread (0 when it is not found).
func ksmdCPU() time.Duration {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm")); err == nil && strings.TrimSpace(string(b)) == "ksmd" {
			u, s, err := procinfo.ProcessCPU(pid)
			if err != nil {
				return 0
			}
			return u + s
		}
	}
	return 0
}
