package measure

import (
	"context"
	"math"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

// Avail is a reading of the host's available memory in MB (-1 when unknown): MemAvailable
// plus the free pages on the kernel's per-CPU lists (procinfo.Available), so that a drop
// across a wave is what the wave took, not what it took less what it drew from those
// lists; PerCPUMB is the lists' part of it, from the same reading.
type Avail struct{ MB, PerCPUMB float64 }

// AvailableNow reads the host's available memory.
func AvailableNow() Avail {
	v, pcp, err := procinfo.Available()
	if err != nil {
		return Avail{-1, -1}
	}
	return Avail{float64(v) / (1 << 20), float64(pcp) / (1 << 20)}
}

// AvailableMB is AvailableNow's MB.
func AvailableMB() float64 { return AvailableNow().MB }

// SettledAvailable waits (up to 5 s, untimed by the benchmarks) until the available
// memory stops moving — memory freed by a just-deleted VM or wave is returned
// asynchronously, and a baseline taken too early makes "memory added per fork" too
// small, even negative — then returns its last reading.
func SettledAvailable(ctx context.Context) Avail {
	prev := AvailableNow()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		select {
		case <-ctx.Done():
			return prev
		case <-time.After(250 * time.Millisecond):
		}
		cur := AvailableNow()
		if cur.MB < 0 || math.Abs(cur.MB-prev.MB) < 2 {
			return cur
		}
		prev = cur
	}
	return prev
}

// MeasureMem is vm's memory breakdown now (engine VM.Memory).
func MeasureMem(ctx context.Context, vm *engine.VM) (report.ForkMem, error) {
	u, err := vm.Memory(ctx)
	if err != nil {
		return report.ForkMem{}, err
	}
	mb := func(b int64) float64 { return float64(b) / (1 << 20) }
	return report.ForkMem{
		AnonMB: mb(u.Private - u.PageTables), PrivateMB: mb(u.Private), RAMCowMB: mb(u.GuestWritten),
		TCGCodeMB: mb(u.TCGCode), HeapMB: mb(u.Heap), LibrariesMB: mb(u.Libraries),
		PageTablesMB: mb(u.PageTables), SharedMB: mb(u.Shared), GuestFileMB: mb(u.GuestFile),
	}, nil
}
