package report

import (
	"fmt"
)

// ForkMem is a fork's memory breakdown (engine VM.Memory), in MiB.
type ForkMem struct {
	AnonMB       float64 // all its anonymous memory: RAMCowMB + TCGCodeMB + HeapMB + LibrariesMB
	PrivateMB    float64 // AnonMB + PageTablesMB: what the fork adds to the host
	RAMCowMB     float64 // guest RAM pages it wrote (copied on write from the checkpoint file)
	TCGCodeMB    float64
	HeapMB       float64
	LibrariesMB  float64
	PageTablesMB float64
	SharedMB     float64 // resident but shared: checkpoint pages read, QEMU code and libraries
	GuestFileMB  float64 // checkpoint pages mapped and not copied (0 only if the RAM mapping was not found)
}

// Values are m's columns (MemColumns).
func (m ForkMem) Values() []float64 {
	return []float64{m.PrivateMB, m.RAMCowMB, m.TCGCodeMB, m.HeapMB, m.LibrariesMB, m.PageTablesMB, m.SharedMB}
}

// MemText describes the medians of ms in a sentence ("" when ms is empty); when says
// when they were measured.
func MemText(ms []ForkMem, when string) string {
	sum := SummarizeMem(ms)
	if sum == nil {
		return ""
	}
	return fmt.Sprintf(" Memory per fork %s (medians of %d, MiB): private %.1f = guest pages written %.1f + TCG code %.1f + QEMU heap %.1f + libraries copied on write %.1f + page tables %.1f; shared %.1f.",
		when, sum.N, sum.Private, sum.GuestWritten, sum.TCGCode, sum.Heap, sum.Libraries, sum.PageTables, sum.Shared)
}

// MemSummary is the medians (MiB) of forks' memory breakdowns: memory_mb_p50 in
// result.json. Its keys are memColumns without "_mb", in the same order.
type MemSummary struct {
	N            int     `json:"n"`
	Private      float64 `json:"private"`
	GuestWritten float64 `json:"guest_written"`
	TCGCode      float64 `json:"tcg_code"`
	Heap         float64 `json:"heap"`
	Libraries    float64 `json:"libraries"`
	PageTables   float64 `json:"page_tables"`
	Shared       float64 `json:"shared"`
}

// SummarizeMem is the per-column medians of ms (nil when ms is empty).
func SummarizeMem(ms []ForkMem) *MemSummary {
	if len(ms) == 0 {
		return nil
	}
	cols := make([][]float64, len(MemColumns))
	for _, m := range ms {
		for i, v := range m.Values() {
			cols[i] = append(cols[i], v)
		}
	}
	med := make([]float64, len(cols))
	for i, c := range cols {
		med[i] = Round3(Median(c))
	}
	return &MemSummary{N: len(ms), Private: med[0], GuestWritten: med[1], TCGCode: med[2], Heap: med[3],
		Libraries: med[4], PageTables: med[5], Shared: med[6]}
}

// MemColumns are the forkMem fields in samples.csv and in "memory_mb_p50".
var MemColumns = []string{"private_mb", "guest_written_mb", "tcg_code_mb", "heap_mb", "libraries_mb", "page_tables_mb", "shared_mb"}
