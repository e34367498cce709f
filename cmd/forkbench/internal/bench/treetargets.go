package bench

import (
	"fmt"
	"os"
	"strings"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
)

// The fork-tree targets (issue 19) that forkbench tree measures.
const (
	treeCkVsWorldTarget  = 1.5 // checkpoint of a running fork / the same run's world checkpoint
	treeCkMSTarget       = 300 // checkpoint of a running fork, ms, at any level and guest size
	treeForkMSTarget     = 500 // fork of a running fork until ready, ms
	treeMemoryDeepTarget = 1.5 // private memory per fork, deepest / depth-1 checkpoint
)

// TreeTarget is one target next to its measured figure (extra.targets).
type TreeTarget struct {
	Target   string `json:"target"`
	Measured string `json:"measured"`
	Met      bool   `json:"met"`
	// Skipped: not measured in this run (its part was skipped or failed).
	Skipped bool `json:"skipped,omitempty"`
}

// flattening reports whether a flatten is being written in ramDir now (its temporary
// file exists).
func flattening(ramDir string) bool {
	ents, _ := os.ReadDir(ramDir)
	for _, e := range ents {
		if strings.Contains(e.Name(), ".flat.tmp-") {
			return true
		}
	}
	return false
}

// worst is the largest of xs with its index (-1 when empty or all <= 0).
func worst(xs []float64) (float64, int) {
	m, at := 0.0, -1
	for i, x := range xs {
		if x > m {
			m, at = x, i
		}
	}
	return m, at
}

// treeTargets puts every fork-tree target next to what this run measured (extra.targets,
// extra.targets_met and a report section). memRatio < 0 and size nil: not measured.
func treeTargets(r *Env, levels []TreeLevel, worldMS, memRatio float64, size *TreeSize) {
	var ck, fork []float64
	var ckLvl, forkLvl []int
	for _, L := range levels {
		if L.Level == 0 {
			continue
		}
		if L.CheckpointMS > 0 {
			ck, ckLvl = append(ck, L.CheckpointMS), append(ckLvl, L.Level)
		}
		if L.ForkRunningMS > 0 {
			fork, forkLvl = append(fork, L.ForkRunningMS), append(forkLvl, L.Level)
		}
	}
	guest := r.shape.MemoryMiB
	var out []TreeTarget
	add := func(target string, skipped, met bool, format string, a ...any) {
		t := TreeTarget{Target: target, Skipped: skipped, Met: met && !skipped, Measured: "not measured"}
		if !skipped {
			t.Measured = fmt.Sprintf(format, a...)
		}
		out = append(out, t)
	}
	maxCk, at := worst(ck)
	lvlOf := func(lv []int, i int) int {
		if i < 0 {
			return -1
		}
		return lv[i]
	}
	add(fmt.Sprintf("checkpoint of a running fork <= %.1fx the world checkpoint, every level", treeCkVsWorldTarget),
		len(ck) == 0 || worldMS <= 0, maxCk <= treeCkVsWorldTarget*worldMS,
		"max %.2fx (level %d: %.0f ms; world %.0f ms), p50 %.2fx", maxCk/worldMS, lvlOf(ckLvl, at), maxCk, worldMS, report.Summarize(ck).P50/worldMS)
	add(fmt.Sprintf("checkpoint of a running fork <= %d ms on the %d MiB guest, every level", treeCkMSTarget, guest),
		len(ck) == 0, maxCk <= treeCkMSTarget,
		"max %.0f ms (level %d), p50 %.0f ms, over %d levels", maxCk, lvlOf(ckLvl, at), report.Summarize(ck).P50, len(ck))
	maxFork, fat := worst(fork)
	add(fmt.Sprintf("fork of a running fork <= %d ms until ready, every level", treeForkMSTarget),
		len(fork) == 0, maxFork <= treeForkMSTarget,
		"max %.0f ms (level %d), p50 %.0f ms, over %d levels", maxFork, lvlOf(forkLvl, fat), report.Summarize(fork).P50, len(fork))
	sizeOK := size != nil && size.ForkCheckpointMS > 0
	sz := TreeSize{}
	if size != nil {
		sz = *size
	}
	add(fmt.Sprintf("checkpoint of a running fork <= %d ms and <= %.1fx its world checkpoint on the %d MiB guest", treeCkMSTarget, treeCkVsWorldTarget, sz.MemoryMiB),
		!sizeOK, sz.ForkCheckpointMS <= treeCkMSTarget && sz.ForkCheckpointMS <= treeCkVsWorldTarget*sz.WorldCheckpointMS,
		"%.0f ms (paused %.0f), %.2fx its world's %.0f ms", sz.ForkCheckpointMS, sz.ForkCheckpointPausedMS, sz.ForkCheckpointMS/sz.WorldCheckpointMS, sz.WorldCheckpointMS)
	add(fmt.Sprintf("fork of a running fork <= %d ms until ready on the %d MiB guest", treeForkMSTarget, sz.MemoryMiB),
		size == nil || size.ForkOfRunningForkMS <= 0, sz.ForkOfRunningForkMS <= treeForkMSTarget,
		"%.0f ms", sz.ForkOfRunningForkMS)
	add("no checkpoint RAM file grows when a fork of it is checkpointed (the big guest's world file)",
		!sizeOK, sz.GrewBytes <= 0, "%d bytes", sz.GrewBytes)
	add(fmt.Sprintf("private memory per fork of the deepest checkpoint <= %.1fx a depth-1 fork's, after flattening", treeMemoryDeepTarget),
		memRatio < 0, memRatio <= treeMemoryDeepTarget, "%.2fx", memRatio)

	all := true
	var b strings.Builder
	b.WriteString("## Targets\n\n| target | measured | met |\n|---|---|---|\n")
	for _, t := range out {
		verdict := "met"
		switch {
		case t.Skipped:
			verdict, all = "not measured", false
		case !t.Met:
			verdict, all = "MISSED", false
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", t.Target, t.Measured, verdict)
	}
	r.res.Extra["targets"] = out
	r.res.Extra["targets_met"] = all
	r.section("%s\n", b.String())
	for _, t := range out {
		r.logf("target: %s: %s (%s)", t.Target, t.Measured, map[bool]string{true: "met", false: "missed"}[t.Met])
	}
}
