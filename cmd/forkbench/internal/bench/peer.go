package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
)

// PeerResult is the stock path as result.json records it (extra.peer): times in ms, the
// save in MiB.
type PeerResult struct {
	SaveMS              float64   `json:"save_ms"`
	SaveMB              float64   `json:"save_mb"`
	Restores            int       `json:"restores"`
	RestoreToFirstCmdMS []float64 `json:"restore_to_first_cmd_ms"`
	RestoreP50MS        float64   `json:"restore_p50_ms"`
	ForkP50MS           float64   `json:"fork_p50_ms"`
	// *PeerRestoreRatio's fields are present when both p50s are known.
	*PeerRestoreRatio
	RestoreError  string `json:"restore_error,omitempty"`
	ColdBootError string `json:"cold_boot_error,omitempty"`
	// ColdBootMS is set when the cold boot answered its first command.
	ColdBootMS *float64 `json:"cold_boot_ms,omitempty"`
	// *PeerColdBootRatio's fields are present when ColdBootMS and the fork p50 are known.
	*PeerColdBootRatio
}

// PeerRestoreRatio compares the fork p50 with the restore p50.
type PeerRestoreRatio struct {
	ForkvmVsRestoreRatio   float64 `json:"forkvm_vs_restore_ratio"`
	RestoreVsForkvmSpeedup float64 `json:"restore_vs_forkvm_speedup"`
}

// PeerColdBootRatio compares the fork p50 with the cold boot.
type PeerColdBootRatio struct {
	ForkvmVsColdBootRatio   float64 `json:"forkvm_vs_cold_boot_ratio"`
	ColdBootVsForkvmSpeedup float64 `json:"cold_boot_vs_forkvm_speedup"`
}

// runPeer measures the stock path a user would take instead of a fork: a full save of
// the world (engine.Save: stop + migrate all RAM), then n serial restores (engine.Restore
// with anonymous RAM) until the first `sh -c true` answered; and, when coldBoot, one cold
// boot (engine.Create + first command). forkP50 (ms) is the forkvm figure to compare.
func runPeer(r *Env, w *World, n int, coldBoot bool, forkP50 float64) error {
	if n < 1 {
		n = 1
	}
	ctx := r.ctx
	path := filepath.Join(r.home, "peer.sav")
	defer os.Remove(path)
	src, done, err := peerSource(r, w)
	if err != nil {
		return err
	}
	defer done()
	saveDur, err := r.e.Baseline().Save(ctx, src, path)
	if err != nil {
		return fmt.Errorf("peer: save: %w", err)
	}
	var size int64
	if st, err := os.Stat(path); err == nil {
		size = st.Size()
	}
	r.logf("peer: full save of %s: %.0f ms, %.0f MiB", src, report.Ms(saveDur), float64(size)/(1<<20))
	restores, restoreErr := peerRestores(r, path, n)
	rp50 := report.Median(restores)
	peer := &PeerResult{
		SaveMS: report.Round3(report.Ms(saveDur)), SaveMB: report.Round3(float64(size) / (1 << 20)), Restores: len(restores),
		RestoreToFirstCmdMS: roundAll(restores), RestoreP50MS: report.Round3(rp50), ForkP50MS: report.Round3(forkP50),
		RestoreError: restoreErr,
	}
	if rp50 > 0 && forkP50 > 0 {
		peer.PeerRestoreRatio = &PeerRestoreRatio{ForkvmVsRestoreRatio: report.Round3(forkP50 / rp50), RestoreVsForkvmSpeedup: report.Round3(rp50 / forkP50)}
	}
	r.section("## Peer (stock path)\n\nFull save of the world (engine.Save, stop + migrate all RAM): %.0f ms, %.0f MiB. Restore (engine.Restore, anonymous RAM) → first `sh -c true`: p50 %.0f ms over %d (%v).\n\n",
		report.Ms(saveDur), float64(size)/(1<<20), rp50, len(restores), roundAll(restores))
	if coldBoot {
		peerColdBoot(r, peer, forkP50)
	}
	if q := peer.PeerRestoreRatio; q != nil {
		r.section("**forkvm/peer ratio** (fork p50 %.0f ms / restore p50 %.0f ms): %v (restore is %v× slower).\n\n", forkP50, rp50, q.ForkvmVsRestoreRatio, q.RestoreVsForkvmSpeedup)
	}
	if q := peer.PeerColdBootRatio; q != nil {
		r.section("**forkvm/cold boot ratio**: %v (cold boot is %v× slower).\n\n", q.ForkvmVsColdBootRatio, q.ColdBootVsForkvmSpeedup)
	}
	r.res.Extra["peer"] = peer
	r.res.Method += " Peer: engine.Save of the world to a file in the state dir (full RAM, VM stopped while saving), then serial engine.Restore (anonymous RAM, no disk) until the first `sh -c true` answered; the ratio is forkvm p50 / restore p50."
	return nil
}

// peerSource returns the VM the peer saves: the world, or a diskless twin of it when
// the world has a disk (engine.Restore attaches no disk, and QEMU refuses a save stream
// that carries a virtio-blk device the destination lacks). done deletes the twin.
func peerSource(r *Env, w *World) (name string, done func(), err error) {
	if r.shape.DiskMiB == 0 {
		return w.Name, func() {}, nil
	}
	r.caveat("peer: engine.Restore restores no disk and QEMU rejects a stream with a disk device it lacks, so the peer saves a diskless twin of the world (same shape, same %d MB dirtied) instead of the world itself", r.shape.DirtyMB)
	old := r.shape.DiskMiB
	r.shape.DiskMiB = 0
	twin, err := bakeWorld(r, "peer-src", "")
	r.shape.DiskMiB = old
	if err != nil {
		return "", nil, fmt.Errorf("peer: twin: %w", err)
	}
	return twin.Name, func() { _ = r.e.Delete(r.ctx, twin.Name) }, nil
}

// peerRestores restores the save at path n times, serially, each until its first
// command answered, and returns the restore-to-first-command times (ms) and the error
// that stopped them.
func peerRestores(r *Env, path string, n int) (restores []float64, restoreErr string) {
	ctx := r.ctx
	for i := 1; i <= n; i++ {
		name := fmt.Sprintf("peer-%d", i)
		t0 := time.Now()
		vm, err := r.e.Baseline().Restore(ctx, path, worldSpec(r, name, false))
		s := report.Sample{Group: "peer-restore", Index: i - 1, Name: name}
		if err != nil {
			s.Error, s.LatencyMS = err.Error(), report.Ms(time.Since(t0))
			r.addSample(s)
			r.fail("peer restore %s: %v", name, err)
			return restores, err.Error()
		}
		tc := time.Now()
		d, err := firstCmd(ctx, vm)
		total := time.Since(t0)
		p := report.PhasesOf(vm.Info().Timings)
		s.OK = err == nil
		s.LatencyMS, s.FirstCmdMS = report.Ms(total), report.Ms(d)
		s.SetPhases(p)
		if err != nil {
			s.Error = err.Error()
			r.fail("peer restore %s: first command: %v", name, err)
		} else {
			restores = append(restores, report.Ms(total))
		}
		r.addSample(s)
		r.trace.Group(9000, "peer restore")
		r.trace.ForkSpans(9000, i, name, t0, p, nil, tc, d, nil)
		if err := r.e.Delete(ctx, name); err != nil {
			r.logf("peer: delete %s: %v", name, err)
		}
	}
	return restores, ""
}

// peerColdBoot boots a VM of the world's shape until its first command and records it
// in peer (with its ratio to forkP50, ms, when known).
func peerColdBoot(r *Env, peer *PeerResult, forkP50 float64) {
	ctx := r.ctx
	name := "peer-cold"
	t0 := time.Now()
	spec := worldSpec(r, name, false)
	spec.ColdBoot = true // a boot, not a restore from the boot cache
	vm, err := r.e.Create(ctx, spec)
	if err != nil {
		r.fail("peer cold boot: %v", err)
		peer.ColdBootError = err.Error()
		return
	}
	d, err := firstCmd(ctx, vm)
	total := time.Since(t0)
	s := report.Sample{Group: "peer-cold-boot", Name: name, OK: err == nil, LatencyMS: report.Ms(total), FirstCmdMS: report.Ms(d)}
	if err != nil {
		s.Error = err.Error()
		r.fail("peer cold boot: first command: %v", err)
	} else {
		cold := report.Round3(report.Ms(total))
		peer.ColdBootMS = &cold
		if forkP50 > 0 {
			peer.PeerColdBootRatio = &PeerColdBootRatio{ForkvmVsColdBootRatio: report.Round3(forkP50 / report.Ms(total)), ColdBootVsForkvmSpeedup: report.Round3(report.Ms(total) / forkP50)}
		}
		r.section("Cold boot (engine.Create → first `sh -c true`): %.0f ms.\n\n", report.Ms(total))
	}
	r.addSample(s)
	if err := r.e.Delete(ctx, name); err != nil {
		r.logf("peer: delete %s: %v", name, err)
	}
}

func roundAll(xs []float64) []float64 {
	out := make([]float64, len(xs))
	for i, x := range xs {
		out[i] = report.Round3(x)
	}
	return out
}
