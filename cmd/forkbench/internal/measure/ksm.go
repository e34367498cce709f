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

// KSMSample is the kernel's same-page merging at one moment (procinfo.KSM: whether
// ksmd runs, its pace, what merging saves) and the CPU ksmd used since the host
// started.
type KSMSample struct {
	procinfo.KSM
	CPU time.Duration
	OK  bool // false: no KSM on this host (nothing read)
}

// ReadKSM reads the host's KSM counters and ksmd's CPU time.
func ReadKSM() KSMSample {
	k, err := procinfo.ReadKSM()
	if err != nil {
		return KSMSample{}
	}
	return KSMSample{KSM: k, CPU: ksmdCPU(), OK: true}
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
