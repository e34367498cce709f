package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/procinfo"
)

// TreeSettings are tree's environment.settings.
type TreeSettings struct {
	Depth   int `json:"depth"`
	Branch  int `json:"branch"`
	WriteMB int `json:"write_mb"`
	// SizeMB is the guest size of the second world (0: none); MemForks the forks per
	// checkpoint of the memory comparison.
	SizeMB   int `json:"size_mb"`
	MemForks int `json:"mem_forks"`
	// FreshWave is the size of the fresh-wave comparison (0: none; extra.fresh_wave).
	FreshWave int `json:"fresh_wave"`
	report.RunSettings
}

// TreeLevel is one level of the tree in result.json (extra.levels).
type TreeLevel struct {
	Level int    `json:"level"` // 0: the world's checkpoint
	Node  string `json:"node"`  // the VM checkpointed at this level
	// CheckpointMS and CheckpointRAMMethod: the node's checkpoint (engine Timings.Total).
	CheckpointMS        float64 `json:"checkpoint_ms"`
	CheckpointRAMMethod string  `json:"checkpoint_ram_method"`
	// Phases of the checkpoint (engine CheckpointTimings): the migration (for a delta
	// checkpoint: the guest RAM scan, device state streamed and stripped), the page
	// extraction of a delta checkpoint, and the time the guest was paused.
	CheckpointMigrateMS float64 `json:"checkpoint_migrate_ms,omitempty"`
	CheckpointExtractMS float64 `json:"checkpoint_extract_ms,omitempty"`
	CheckpointPausedMS  float64 `json:"checkpoint_paused_ms,omitempty"`
	// CheckpointDiskMS is the disk freeze; CheckpointFlattening whether a background
	// flatten was running when the checkpoint returned (it competes for the CPUs).
	CheckpointDiskMS     float64 `json:"checkpoint_disk_ms,omitempty"`
	CheckpointFlattening bool    `json:"checkpoint_flattening,omitempty"`
	// ForkP50MS: the level's children, fork until the first `sh -c true` answered.
	ForkP50MS float64 `json:"fork_p50_ms"`
	Ready     int     `json:"ready"`
	// ForkRunningMS: engine.Fork of the running node by name (implicit checkpoint), until
	// ready; 0 at level 0 (see checkpoint-restore for the world). Where it went: the
	// implicit checkpoint (engine Timings.Total, its extraction, the guest paused), then
	// the fork's phases (engine PhaseTimings: prepare, spawn, inject of the layers its
	// RAM file lacks, restore, agent), and the layers injected (MiB).
	ForkRunningMS           float64 `json:"fork_running_ms,omitzero"`
	ForkRunningCheckpointMS float64 `json:"fork_running_checkpoint_ms,omitzero"`
	ForkRunningCkExtractMS  float64 `json:"fork_running_checkpoint_extract_ms,omitzero"`
	ForkRunningCkPausedMS   float64 `json:"fork_running_checkpoint_paused_ms,omitzero"`
	ForkRunningPrepareMS    float64 `json:"fork_running_prepare_ms,omitzero"`
	ForkRunningSpawnMS      float64 `json:"fork_running_spawn_ms,omitzero"`
	ForkRunningInjectMS     float64 `json:"fork_running_inject_ms,omitzero"`
	ForkRunningRestoreMS    float64 `json:"fork_running_restore_ms,omitzero"`
	ForkRunningAgentMS      float64 `json:"fork_running_agent_ms,omitzero"`
	ForkRunningInjectedMB   float64 `json:"fork_running_injected_mb,omitzero"`
	// ForkRunningEarly: the fork's QEMU started while its implicit checkpoint was taken
	// (its spawn span began before the checkpoint's ended): the checkpoint and the
	// fork's prepare and spawn overlap, so ready is less than the phases' sum.
	ForkRunningEarly          bool    `json:"fork_running_early,omitempty"`
	ChildrenInjectedMBAverage float64 `json:"children_injected_mb,omitzero"`
	// RAMFilesMB is the storage all checkpoint RAM files hold after the level;
	// WrittenMB what the benchmark wrote along the lineage (world dirt + one child per
	// level); GuestWrittenMB (MiB) what the guests wrote along it, measured: the data of
	// the world's checkpoint file plus, for each checkpointed node, the guest pages it
	// copied on write itself (VM.Memory GuestWritten - GuestLineage, from pagemap) — the
	// guest's kernel and agent write pages besides the benchmark's files.
	//
	// LineageMB (MiB) is what the lineage itself keeps: the world checkpoint file's data
	// when frozen plus each delta checkpoint's own layer. RAMFilesMB exceeds it by the
	// zero pages running forks' writes fault into the root file's holes (tmpfs allocates
	// a page cache page before the private copy), given back when a fork is deleted or
	// checkpointed. GuestWrittenMB is a lower bound (a node's rewrites of pages its
	// lineage gave it count as lineage).
	RAMFilesMB float64 `json:"ram_files_mb"`
	// FlatMB is the part of RAMFilesMB that flattened checkpoints' RAM files hold (a
	// copy of their lineage each: engine Config.FlattenMiB), reported apart from it.
	FlatMB         float64 `json:"flat_mb"`
	LineageMB      float64 `json:"lineage_mb"`
	WrittenMB      int     `json:"written_mb"`
	GuestWrittenMB float64 `json:"guest_written_mb"`
	// HostMemPerForkMB: drop of available memory (procinfo.Available) while the level's children run, per child.
	HostMemPerForkMB float64 `json:"host_mem_per_fork_mb"`
	// Verified children saw every ancestor's file with its md5 and no sibling's file.
	Verified int `json:"verified"`
	// StockSaveMS / StockRestoreMS: a full save of the node (all RAM, engine Baseline) and
	// its restore until ready; 0 when skipped.
	StockSaveMS    float64 `json:"stock_save_ms,omitzero"`
	StockRestoreMS float64 `json:"stock_restore_ms,omitzero"`
}

// lineageFile is a file an ancestor wrote, with its md5.
type lineageFile struct{ path, md5 string }

func runTree(r *Env, depth, branch, writeMB int) ([]TreeLevel, float64, error) {
	ctx := r.ctx
	w, err := bakeWorld(r, "world", "t0")
	if err != nil {
		return nil, 0, err
	}
	worldExtra(r, w)
	t := &treeWalk{r: r, lineage: []lineageFile{{"/dev/shm/dirty", w.DirtyMD5}}, node: w.VM, ckName: "t0",
		written: r.shape.DirtyMB, guestWritten: w.SharedFileMB, lineageMB: w.SharedFileMB}
	var levels []TreeLevel
	var ckOfFork []float64
	for lvl := 0; lvl < depth; lvl++ {
		L := TreeLevel{Level: lvl, Node: t.node.Name(), WrittenMB: t.written, GuestWrittenMB: report.Round3(t.guestWritten)}
		if lvl == 0 {
			L.CheckpointMS, L.CheckpointRAMMethod = w.CheckpointMS, "copy"
		} else {
			if err := t.checkpointNode(lvl, &L); err != nil {
				return levels, w.CheckpointMS, err
			}
			ckOfFork = append(ckOfFork, L.CheckpointMS)
		}
		if r.shape.DiskMiB == 0 {
			L.StockSaveMS, L.StockRestoreMS = stockSaveRestore(r, t.node, lvl)
		}
		children := t.forkChildren(lvl, branch, &L)
		mine := t.writeAndVerify(children, lvl, writeMB, &L)
		t.storage(&L)
		levels = append(levels, L)
		r.logf("level %d: checkpoint of %s %.0f ms (%s), %d forks p50 %.0f ms, RAM files %.0f MiB (flattened copies %.0f MiB, lineage %.0f MiB) for %d MB written by the benchmark (at least %.0f MiB by the guests), %d/%d verified",
			lvl, L.Node, L.CheckpointMS, L.CheckpointRAMMethod, L.Ready, L.ForkP50MS, L.RAMFilesMB, L.FlatMB, L.LineageMB, t.written, L.GuestWrittenMB, L.Verified, len(children))
		if len(children) == 0 {
			break
		}
		// The first child is the next node; its siblings and the old node go.
		next := children[0]
		for _, c := range children[1:] {
			_ = r.e.Delete(ctx, c.Name())
		}
		if lvl > 0 {
			_ = r.e.Delete(ctx, t.node.Name())
		}
		t.node = next
		t.lineage = append(t.lineage, mine[next.Name()])
		t.written += writeMB
		if err := ctx.Err(); err != nil {
			return levels, w.CheckpointMS, err
		}
	}
	r.res.Extra["levels"] = levels
	pc := r.p50Headline("tree_checkpoint_of_fork_p50_ms", ckOfFork)
	if len(ckOfFork) > 0 && w.CheckpointMS > 0 {
		r.res.Extra["checkpoint_of_fork_vs_world"] = report.Round3(pc.P50 / w.CheckpointMS)
	}
	r.res.Method = fmt.Sprintf("A world (dirtied %d MB) and its pinned checkpoint t0; then for each of %d levels: engine.Fork of the running node by name (implicit checkpoint, until ready), a pinned checkpoint of the node (levels >= 1: a fork; ms = engine Timings.Total), when the world has no disk the stock path on the same node (engine Baseline: full save to a file, restore into anonymous RAM until ready), %d children forked serially until their first `sh -c true` (fork ms), each writing %d MB of random data to /dev/shm and then checked: md5 of every ancestor's file and none of its siblings'. RAM files MB = allocated storage of all checkpoint RAM files (lineage MB: the world file's frozen data + each delta checkpoint's own layer), against what the benchmark wrote and what the guests wrote (world checkpoint file data + each checkpointed node's own copied-on-write guest pages); host memory per fork = drop of available memory (MemAvailable + the kernel's per-CPU free pages) across the level's forks / forks. The first child is the next node; its siblings are deleted. Percentiles are over the checkpoints of forks.",
		r.shape.DirtyMB, depth, branch, writeMB)
	r.section("%s\ncheckpoint of a fork p50 %.0f ms over %d levels.\n\n", treeTable(levels), pc.P50, len(ckOfFork))
	return levels, w.CheckpointMS, nil
}

// treeWalk is runTree's position in the tree: the node of the current level, the
// checkpoint its children fork from, the files its lineage wrote, and the storage
// counters carried from level to level.
type treeWalk struct {
	r            *Env
	lineage      []lineageFile
	node         *engine.VM
	ckName       string
	written      int     // MB the benchmark wrote into the lineage
	guestWritten float64 // MiB the guests wrote (at least)
	lineageMB    float64 // the world file's data + every delta layer
}

// checkpointNode forks the running node (timed, then deleted) and takes its pinned
// checkpoint, the next level's parent, into L.
func (t *treeWalk) checkpointNode(lvl int, L *TreeLevel) error {
	r, ctx, node := t.r, t.r.ctx, t.node
	fv, s := serialFork(r, node.Name(), fmt.Sprintf("run%d", lvl), "fork-running", lvl, 2)
	r.addSample(s)
	if fv != nil {
		// Until ready: serialFork's latency runs to the first command's answer.
		in := fv.Info()
		L.ForkRunningMS = report.Round3(s.LatencyMS - s.FirstCmdMS)
		L.ForkRunningPrepareMS, L.ForkRunningSpawnMS, L.ForkRunningInjectMS = report.Ms(in.Timings.Prepare), report.Ms(in.Timings.Spawn), report.Ms(in.Timings.Inject)
		L.ForkRunningRestoreMS, L.ForkRunningAgentMS = report.Ms(in.Timings.Restore), report.Ms(in.Timings.Agent)
		if mu, err := fv.Memory(ctx); err == nil {
			L.ForkRunningInjectedMB = report.Round3(float64(mu.GuestLineage) / (1 << 20))
		}
		if ci, err := r.e.CheckpointInfo(in.Parent); err == nil {
			L.ForkRunningCheckpointMS, L.ForkRunningCkExtractMS, L.ForkRunningCkPausedMS = report.Ms(ci.Timings.Total), report.Ms(ci.Timings.Extract), report.Ms(ci.Timings.Paused)
			L.ForkRunningEarly = startedBefore(in.Spans, "spawn", ci.Spans, "checkpoint")
		}
		_ = r.e.Delete(ctx, fv.Name())
	} else {
		r.fail("level %d: fork of running %s: %s", lvl, node.Name(), s.Error)
	}
	if mu, err := node.Memory(ctx); err == nil {
		t.guestWritten += float64(mu.GuestWritten-mu.GuestLineage) / (1 << 20)
	} else {
		r.fail("level %d: memory of %s: %v", lvl, node.Name(), err)
	}
	L.GuestWrittenMB = report.Round3(t.guestWritten)
	t.ckName = fmt.Sprintf("t%d", lvl)
	ck, err := r.e.Checkpoint(ctx, node.Name(), t.ckName, &engine.CheckpointOptions{Pin: true})
	if err != nil {
		return fmt.Errorf("level %d: checkpoint of %s: %w", lvl, node.Name(), err)
	}
	L.CheckpointMS, L.CheckpointRAMMethod = report.Ms(ck.Manifest.Timings.Total), ck.Manifest.RAMMethod
	if n := len(ck.Manifest.Layers); n > 0 {
		t.lineageMB += float64(ck.Manifest.Layers[n-1].Size) / (1 << 20)
	}
	L.CheckpointMigrateMS, L.CheckpointExtractMS, L.CheckpointPausedMS = report.Ms(ck.Manifest.Timings.Migrate), report.Ms(ck.Manifest.Timings.Extract), report.Ms(ck.Manifest.Timings.Paused)
	L.CheckpointDiskMS = report.Ms(ck.Manifest.Timings.Disk)
	L.CheckpointFlattening = flattening(r.ramDir)
	r.addSample(report.Sample{Group: "checkpoint", Index: lvl, Name: t.ckName, OK: true, LatencyMS: L.CheckpointMS})
	return nil
}

// forkChildren forks branch children of the level's checkpoint serially and records
// their latency and the host memory they added.
func (t *treeWalk) forkChildren(lvl, branch int, L *TreeLevel) []*engine.VM {
	r := t.r
	avail0, _, _ := procinfo.Available()
	var children []*engine.VM
	var lat []float64
	var injected float64
	for i := 1; i <= branch; i++ {
		vm, s := serialFork(r, t.ckName, fmt.Sprintf("n%d-%d", lvl+1, i), "fork", lvl*branch+i-1, 1)
		r.addSample(s)
		if vm == nil {
			r.fail("level %d: fork %d: %s", lvl, i, s.Error)
			continue
		}
		children = append(children, vm)
		lat = append(lat, s.LatencyMS)
		if mu, err := vm.Memory(r.ctx); err == nil {
			injected += float64(mu.GuestLineage) / (1 << 20)
		}
	}
	if len(children) > 0 {
		L.ChildrenInjectedMBAverage = report.Round3(injected / float64(len(children)))
	}
	if avail1, _, err := procinfo.Available(); err == nil && len(children) > 0 {
		L.HostMemPerForkMB = report.Round3(float64(avail0-avail1) / float64(len(children)) / (1 << 20))
	}
	L.Ready, L.ForkP50MS = len(children), report.Round3(report.Median(lat))
	return children
}

// writeAndVerify has each child write its own file, then checks that every child sees
// the lineage and only its own file of its level; it returns each child's file.
func (t *treeWalk) writeAndVerify(children []*engine.VM, lvl, writeMB int, L *TreeLevel) map[string]lineageFile {
	r, ctx := t.r, t.r.ctx
	mine := map[string]lineageFile{}
	for _, c := range children {
		p := fmt.Sprintf("/dev/shm/l%d-%s", lvl+1, c.Name())
		out, err := shell(ctx, c, fmt.Sprintf("head -c %d /dev/urandom > %s && md5sum %s", writeMB<<20, p, p), 5*time.Minute)
		if err != nil {
			r.fail("level %d: %s: write: %v", lvl, c.Name(), err)
			continue
		}
		mine[c.Name()] = lineageFile{p, parseMD5(out)[p]}
	}
	for _, c := range children {
		if err := verifyNode(ctx, c, t.lineage, mine); err != nil {
			r.fail("level %d: %s: %v", lvl, c.Name(), err)
			continue
		}
		L.Verified++
	}
	return mine
}

// storage records the level's checkpoint storage: every checkpoint RAM file, the
// flattened copies, the lineage.
func (t *treeWalk) storage(L *TreeLevel) {
	r := t.r
	L.RAMFilesMB = report.Round3(float64(dirAllocated(r.ramDir, "ck-")) / (1 << 20))
	if infos, err := r.e.Checkpoints(); err == nil {
		var flat int64
		for _, in := range infos {
			flat += in.FlatBytes
		}
		L.FlatMB = report.Round3(float64(flat) / (1 << 20))
	}
	L.LineageMB = report.Round3(t.lineageMB)
}

// treeTable is the report's table of the tree's levels.
func treeTable(levels []TreeLevel) string {
	var b strings.Builder
	b.WriteString("## Fork tree\n\n| level | node | checkpoint ms (RAM) | migrate / extract / paused ms | fork of running node ms | fork p50 ms | RAM files MiB (flattened copies; lineage MiB; written MB; by the guests MiB, at least) | host MiB/fork | verified | stock save / restore ms |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, L := range levels {
		fmt.Fprintf(&b, "| %d | %s | %.0f (%s) | %.0f / %.0f / %.0f | %.0f | %.0f | %.0f (%.0f; %.0f; %d; %.0f) | %.1f | %d/%d | %.0f / %.0f |\n", L.Level, L.Node, L.CheckpointMS,
			L.CheckpointRAMMethod, L.CheckpointMigrateMS, L.CheckpointExtractMS, L.CheckpointPausedMS, L.ForkRunningMS, L.ForkP50MS, L.RAMFilesMB, L.FlatMB, L.LineageMB, L.WrittenMB, L.GuestWrittenMB, L.HostMemPerForkMB, L.Verified, L.Ready, L.StockSaveMS, L.StockRestoreMS)
	}
	b.WriteString("\n### Where the time goes\n\n| level | checkpoint ms: migrate / extract / disk / paused / total (flatten running) | fork of running node ms: implicit checkpoint (extract / paused) + prepare / spawn / inject / restore / agent = ready | layers injected MiB: fork of running node; children (mean) |\n|---|---|---|---|\n")
	anyEarly := false
	for _, L := range levels {
		if L.Level == 0 {
			continue
		}
		fl := ""
		if L.CheckpointFlattening {
			fl = " (yes)"
		}
		early := ""
		if L.ForkRunningEarly {
			early, anyEarly = "*", true
		}
		fmt.Fprintf(&b, "| %d | %.0f / %.0f / %.0f / %.0f / %.0f%s | %.0f (%.0f / %.0f) + %.0f / %.0f%s / %.0f / %.0f / %.0f = %.0f | %.1f; %.1f |\n", L.Level,
			L.CheckpointMigrateMS, L.CheckpointExtractMS, L.CheckpointDiskMS, L.CheckpointPausedMS, L.CheckpointMS, fl,
			L.ForkRunningCheckpointMS, L.ForkRunningCkExtractMS, L.ForkRunningCkPausedMS, L.ForkRunningPrepareMS, L.ForkRunningSpawnMS, early, L.ForkRunningInjectMS, L.ForkRunningRestoreMS, L.ForkRunningAgentMS, L.ForkRunningMS,
			L.ForkRunningInjectedMB, L.ChildrenInjectedMBAverage)
	}
	if anyEarly {
		b.WriteString("\n\\* the fork's QEMU was started (prepare, spawn) while its implicit checkpoint was taken: those overlap, and ready is less than the sum.\n")
	}
	return b.String()
}

// startedBefore says whether span a of as started before span b of bs ended (false when
// either is missing).
func startedBefore(as []api.Span, a string, bs []api.Span, b string) bool {
	var start, end int64
	for _, s := range as {
		if s.Name == a {
			start = s.StartMono
		}
	}
	for _, s := range bs {
		if s.Name == b {
			end = s.EndMono
		}
	}
	return start != 0 && end != 0 && start < end
}

// verifyNode checks that vm sees every lineage file with its md5, its own file, and no
// file of a sibling.
func verifyNode(ctx context.Context, vm *engine.VM, lineage []lineageFile, level map[string]lineageFile) error {
	var paths []string
	for _, f := range lineage {
		paths = append(paths, f.path)
	}
	own, ok := level[vm.Name()]
	if !ok {
		return fmt.Errorf("wrote no file")
	}
	paths = append(paths, own.path)
	out, err := shell(ctx, vm, "md5sum "+strings.Join(paths, " ")+"; ls /dev/shm", 5*time.Minute)
	if err != nil {
		return err
	}
	sums := parseMD5(out)
	for _, f := range append(lineage, own) {
		if sums[f.path] != f.md5 {
			return fmt.Errorf("%s: md5 %q, want %q", f.path, sums[f.path], f.md5)
		}
	}
	for name, f := range level {
		if name != vm.Name() && strings.Contains(out, filepath.Base(f.path)) {
			return fmt.Errorf("sees its sibling's %s", f.path)
		}
	}
	return nil
}

// stockSaveRestore saves node in full (engine Baseline) and restores it as a new VM until
// ready; it returns both times (0 on failure, which is recorded).
func stockSaveRestore(r *Env, node *engine.VM, lvl int) (saveMS, restoreMS float64) {
	path := filepath.Join(r.home, fmt.Sprintf("stock-%d.sav", lvl))
	defer os.Remove(path)
	d, err := r.e.Baseline().Save(r.ctx, node.Name(), path)
	if err != nil {
		r.fail("level %d: stock save of %s: %v", lvl, node.Name(), err)
		return 0, 0
	}
	name := fmt.Sprintf("stock%d", lvl)
	t := time.Now()
	vm, err := r.e.Baseline().Restore(r.ctx, path, worldSpec(r, name, false))
	if err != nil {
		r.fail("level %d: stock restore: %v", lvl, err)
		return report.Ms(d), 0
	}
	restore := report.Ms(time.Since(t))
	_ = r.e.Delete(r.ctx, vm.Name())
	return report.Ms(d), restore
}

// dirAllocated sums the storage held by the files of dir whose names start with prefix
// and by the files inside such directories (a delta checkpoint's layer directory), each
// file once however many hard links it has (a delta checkpoint links its root RAM file
// and its ancestors' layers).
func dirAllocated(dir, prefix string) int64 {
	ents, _ := os.ReadDir(dir)
	seen := map[[2]uint64]bool{}
	var n int64
	add := func(p string) {
		var st syscall.Stat_t
		if syscall.Stat(p, &st) != nil {
			return
		}
		k := [2]uint64{uint64(st.Dev), uint64(st.Ino)}
		if st.Mode&syscall.S_IFMT == syscall.S_IFREG && !seen[k] {
			seen[k] = true
			n += st.Blocks * 512
		}
	}
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), prefix) {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if e.IsDir() {
			sub, _ := os.ReadDir(p)
			for _, f := range sub {
				add(filepath.Join(p, f.Name()))
			}
			continue
		}
		add(p)
	}
	return n
}

// TreeMemory is one checkpoint of the memory-per-fork comparison (extra.memory).
type TreeMemory struct {
	Checkpoint string  `json:"checkpoint"`
	Depth      int     `json:"depth"` // delta layers in its lineage
	LayersMB   float64 `json:"layers_mb"`
	// Before: one fork started before the flatten (the lineage injected as private
	// copies); After: forks started once it was flattened. MiB per fork: Private and its
	// GuestLineage part (engine VM.Memory), averaged.
	BeforePrivateMB float64 `json:"before_private_mb"`
	BeforeLineageMB float64 `json:"before_lineage_mb"`
	AfterPrivateMB  float64 `json:"after_private_mb"`
	AfterLineageMB  float64 `json:"after_lineage_mb"`
	AfterForks      int     `json:"after_forks"`
	// Flatten: the time and the storage of the flattened RAM file (counted apart from
	// the lineage).
	FlattenMS      float64 `json:"flatten_ms"`
	FlatMB         float64 `json:"flat_mb"`
	FlattenedEarly bool    `json:"flattened_early,omitempty"` // in the background, before this measurement
}

// treeMemory forks the shallowest (t1) and the deepest pinned checkpoint of the tree:
// one fork, then engine.Flatten, then n forks, each measured by VM.Memory after a shell
// command; it records private MiB per fork and the ratio deepest / shallowest.
func treeMemory(r *Env, depth, n int) float64 {
	ctx := r.ctx
	ratio := -1.0
	if depth < 2 {
		return ratio
	}
	var out []TreeMemory
	for _, ck := range []string{"t1", fmt.Sprintf("t%d", depth-1)} {
		c, err := r.e.LoadCheckpoint(ctx, ck)
		if err != nil {
			r.fail("memory: %s: %v", ck, err)
			continue
		}
		M := TreeMemory{Checkpoint: ck, Depth: len(c.Manifest.Layers)}
		for _, l := range c.Manifest.Layers {
			M.LayersMB += float64(l.Size) / (1 << 20)
		}
		M.LayersMB = report.Round3(M.LayersMB)
		measure := func(name string) (priv, lin float64, ok bool) {
			vm, s := serialFork(r, ck, name, "fork-memory", 0, 1)
			if vm == nil {
				r.fail("memory: fork of %s: %s", ck, s.Error)
				return 0, 0, false
			}
			defer r.e.Delete(ctx, vm.Name())
			if _, err := shell(ctx, vm, "true", time.Minute); err != nil {
				r.fail("memory: %s: %v", name, err)
				return 0, 0, false
			}
			mu, err := vm.Memory(ctx)
			if err != nil {
				r.fail("memory: %s: %v", name, err)
				return 0, 0, false
			}
			return float64(mu.Private) / (1 << 20), float64(mu.GuestLineage) / (1 << 20), true
		}
		if info, err := r.e.CheckpointInfo(ck); err == nil && info.FlatBytes > 0 {
			M.FlattenedEarly = true
		}
		if p, l, ok := measure("mem-" + ck + "-before"); ok {
			M.BeforePrivateMB, M.BeforeLineageMB = report.Round3(p), report.Round3(l)
		}
		st, err := r.e.Flatten(ctx, ck)
		if err != nil {
			r.fail("memory: flatten %s: %v", ck, err)
		} else {
			M.FlattenMS, M.FlatMB = report.Ms(st.Took), report.Round3(float64(st.Allocated)/(1<<20))
		}
		var priv, lin float64
		for i := 1; i <= n; i++ {
			if p, l, ok := measure(fmt.Sprintf("mem-%s-%d", ck, i)); ok {
				priv += p
				lin += l
				M.AfterForks++
			}
		}
		if M.AfterForks > 0 {
			M.AfterPrivateMB, M.AfterLineageMB = report.Round3(priv/float64(M.AfterForks)), report.Round3(lin/float64(M.AfterForks))
		}
		r.logf("memory: forks of %s (%d layers, %.0f MiB): before flatten %.1f MiB private (lineage %.1f), after %.1f MiB (lineage %.1f) over %d forks; flatten %.0f ms, %.0f MiB",
			ck, M.Depth, M.LayersMB, M.BeforePrivateMB, M.BeforeLineageMB, M.AfterPrivateMB, M.AfterLineageMB, M.AfterForks, M.FlattenMS, M.FlatMB)
		out = append(out, M)
	}
	r.res.Extra["memory"] = out
	var b strings.Builder
	b.WriteString("## Memory per fork\n\n| checkpoint | layers (MiB) | private MiB/fork before flatten (lineage) | after (lineage), forks | flatten ms | flat file MiB |\n|---|---|---|---|---|---|\n")
	for _, M := range out {
		fmt.Fprintf(&b, "| %s | %d (%.0f) | %.1f (%.1f) | %.1f (%.1f), %d | %.0f | %.0f |\n", M.Checkpoint, M.Depth, M.LayersMB, M.BeforePrivateMB, M.BeforeLineageMB, M.AfterPrivateMB, M.AfterLineageMB, M.AfterForks, M.FlattenMS, M.FlatMB)
	}
	if len(out) == 2 && out[0].AfterPrivateMB > 0 && out[1].AfterForks > 0 {
		ratio = out[1].AfterPrivateMB / out[0].AfterPrivateMB
		r.res.Extra["memory_deep_vs_shallow"] = report.Round3(ratio)
		fmt.Fprintf(&b, "\nprivate memory per fork, depth %d / depth %d after flattening: %.2fx\n", out[1].Depth, out[0].Depth, ratio)
	}
	r.section("%s\n", b.String())
	return ratio
}

// TreeSize is the guest-size comparison (extra.size).
type TreeSize struct {
	MemoryMiB              int     `json:"memory_mib"`
	WorldCheckpointMS      float64 `json:"world_checkpoint_ms"`
	ForkCheckpointMS       float64 `json:"fork_checkpoint_ms"`
	ForkCheckpointPausedMS float64 `json:"fork_checkpoint_paused_ms"`
	// The checkpoint of the fork's device-state save and page extraction (both paused).
	ForkCheckpointMigrateMS float64 `json:"fork_checkpoint_migrate_ms"`
	ForkCheckpointExtractMS float64 `json:"fork_checkpoint_extract_ms"`
	ForkOfRunningForkMS     float64 `json:"fork_of_running_fork_ms"`
	GrewBytes               int64   `json:"checkpoint_file_grew_bytes"` // the world checkpoint's RAM file, across the fork's checkpoint
}

// treeSize boots a second world of sizeMB, dirties it like the tree's, checkpoints it,
// forks it, lets the fork write writeMB, checkpoints the fork and forks the running
// fork: a checkpoint of a fork should cost the same at any guest size.
func treeSize(r *Env, sizeMB, writeMB int) *TreeSize {
	ctx := r.ctx
	spec := worldSpec(r, "big", true)
	spec.MemoryMiB = sizeMB
	S := TreeSize{MemoryMiB: sizeMB}
	vm, err := r.e.Create(ctx, spec)
	if err != nil {
		r.fail("size %d: boot: %v", sizeMB, err)
		return nil
	}
	defer r.e.Delete(ctx, vm.Name())
	if _, err := shell(ctx, vm, dirtyScript(r), 10*time.Minute); err != nil {
		r.fail("size %d: dirty: %v", sizeMB, err)
		return nil
	}
	ck, err := r.e.Checkpoint(ctx, "big", "big0", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		r.fail("size %d: checkpoint: %v", sizeMB, err)
		return nil
	}
	defer r.e.DeleteCheckpoint(ctx, "big0", &engine.DeleteCheckpointOptions{Force: true})
	S.WorldCheckpointMS = report.Ms(ck.Manifest.Timings.Total)
	f, s := serialFork(r, "big0", "bigf", "size-fork", 0, 1)
	if f == nil {
		r.fail("size %d: fork: %s", sizeMB, s.Error)
		return nil
	}
	defer r.e.Delete(ctx, f.Name())
	if _, err := shell(ctx, f, fmt.Sprintf("head -c %d /dev/urandom > /dev/shm/bigf", writeMB<<20), 5*time.Minute); err != nil {
		r.fail("size %d: write: %v", sizeMB, err)
		return nil
	}
	before := allocated(ck.Manifest.RAMPath)
	c1, err := r.e.Checkpoint(ctx, "bigf", "big1", &engine.CheckpointOptions{Pin: true})
	if err != nil {
		r.fail("size %d: checkpoint of the fork: %v", sizeMB, err)
		return nil
	}
	defer r.e.DeleteCheckpoint(ctx, "big1", &engine.DeleteCheckpointOptions{Force: true})
	S.GrewBytes = allocated(ck.Manifest.RAMPath) - before
	S.ForkCheckpointMS, S.ForkCheckpointPausedMS = report.Ms(c1.Manifest.Timings.Total), report.Ms(c1.Manifest.Timings.Paused)
	S.ForkCheckpointMigrateMS, S.ForkCheckpointExtractMS = report.Ms(c1.Manifest.Timings.Migrate), report.Ms(c1.Manifest.Timings.Extract)
	g, s := serialFork(r, "bigf", "bigg", "size-fork-running", 0, 1)
	if g == nil {
		r.fail("size %d: fork of the running fork: %s", sizeMB, s.Error)
	} else {
		S.ForkOfRunningForkMS = report.Round3(s.LatencyMS - s.FirstCmdMS) // until ready
		r.e.Delete(ctx, g.Name())
	}
	r.res.Extra["size"] = S
	r.logf("size %d MiB: world checkpoint %.0f ms, checkpoint of its fork %.0f ms (paused %.0f: device state %.0f, extract %.0f), fork of the running fork %.0f ms; the world checkpoint's file grew %d bytes",
		sizeMB, S.WorldCheckpointMS, S.ForkCheckpointMS, S.ForkCheckpointPausedMS, S.ForkCheckpointMigrateMS, S.ForkCheckpointExtractMS, S.ForkOfRunningForkMS, S.GrewBytes)
	r.section("## Guest size\n\n| guest MiB | world checkpoint ms | checkpoint of its fork ms (paused: device state / extract) | fork of the running fork ms | world file grew bytes |\n|---|---|---|---|---|\n| %d | %.0f | %.0f (%.0f: %.0f / %.0f) | %.0f | %d |\n\n",
		sizeMB, S.WorldCheckpointMS, S.ForkCheckpointMS, S.ForkCheckpointPausedMS, S.ForkCheckpointMigrateMS, S.ForkCheckpointExtractMS, S.ForkOfRunningForkMS, S.GrewBytes)
	return &S
}

// allocated is a file's storage (st_blocks), 0 when unknown.
func allocated(path string) int64 {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return 0
	}
	return st.Blocks * 512
}

// RunTreeAll is the tree bench: the tree of s.Depth levels of s.Branch forks, then (as s
// asks) a fresh wave of the deepest level, the memory of its forks and a tree of a larger
// guest, with the targets beside the figures.
func RunTreeAll(r *Env, s *TreeSettings) error {
	d, w := s.Depth, s.WriteMB
	levels, worldMS, err := runTree(r, d, s.Branch, w)
	if err != nil {
		return err
	}
	if s.FreshWave > 0 {
		// Before treeMemory, which flattens the checkpoints it measures.
		treeFreshWave(r, d, s.FreshWave, w)
	}
	memRatio := -1.0
	if s.MemForks > 0 {
		memRatio = treeMemory(r, d, s.MemForks)
	}
	var S *TreeSize
	if s.SizeMB > 0 {
		S = treeSize(r, s.SizeMB, w)
	}
	treeTargets(r, levels, worldMS, memRatio, S)
	return nil
}
