package bench

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/forkvm/forkvm/cmd/forkbench/internal/measure"
	"github.com/forkvm/forkvm/cmd/forkbench/internal/report"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/memfile"
	"github.com/forkvm/forkvm/vsockd"
)

// World is a baked VM: dirtied RAM, a data file, a pinned checkpoint.
type World struct {
	Name, Ck         string
	VM               *engine.VM
	DirtyMD5         string
	DiskMD5          string
	RAMPath          string // the checkpoint's frozen RAM file
	BootMS, BakeMS   float64
	CheckpointMS     float64
	PausedMS         float64
	SharedFileMB     float64 // data bytes of the checkpoint RAM file
	SharedResidentMB float64
}

// shell runs a script in vm and returns its stdout; a non-zero exit is an error.
func shell(ctx context.Context, vm *engine.VM, script string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var out, errb bytes.Buffer
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errb})
	if err != nil {
		return "", fmt.Errorf("%s: exec: %w", vm.Name(), err)
	}
	if code != 0 {
		return out.String(), fmt.Errorf("%s: %q exited %d: %s", vm.Name(), script, code, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

// firstCmd runs `sh -c true` and returns how long the round trip took.
func firstCmd(ctx context.Context, vm *engine.VM) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	t := time.Now()
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "true"}})
	d := time.Since(t)
	if err == nil && code != 0 {
		err = fmt.Errorf("%s: sh -c true exited %d", vm.Name(), code)
	}
	return d, err
}

// worldSpec is the spec of a world VM.
func worldSpec(r *Env, name string, forkable bool) engine.Spec {
	return engine.Spec{Name: name, CPUs: r.shape.CPUs, MemoryMiB: r.shape.MemoryMiB, Forkable: forkable, DiskMiB: r.shape.DiskMiB,
		VMGenID: r.vmgenid, Image: r.shape.Image}
}

// diskState is where the world keeps state on disk and each fork writes its own.
type diskState struct {
	world, mine string // paths in the guest
	bytes       int    // size of the world's file
}

// worldDisk is the world's disk state: with a root image, $HOME/state.bin (--state-mb, as in the
// published benchmark's world); with a data disk, /data/world (1 MB); else nil.
func worldDisk(r *Env) *diskState {
	switch {
	case r.shape.Image != "":
		return &diskState{world: "/root/state.bin", mine: "/root/mine", bytes: r.shape.StateMB << 20}
	case r.shape.DiskMiB > 0:
		return &diskState{world: "/data/world", mine: "/data/mine", bytes: 1 << 20}
	}
	return nil
}

// dirtyScript dirties dirty-mb MB of guest RAM (tmpfs /dev/shm/dirty) and writes the
// world's disk file, syncs and prints md5sums.
func dirtyScript(r *Env) string {
	var b strings.Builder
	fmt.Fprintf(&b, "set -e; head -c 1048576 /dev/urandom > /dev/shm/seed; : > /dev/shm/dirty; i=0; while [ $i -lt %d ]; do cat /dev/shm/seed >> /dev/shm/dirty; i=$((i+1)); done; rm -f /dev/shm/seed; ", r.shape.DirtyMB)
	d := worldDisk(r)
	if d != nil {
		fmt.Fprintf(&b, "head -c %d /dev/urandom > %s; ", d.bytes, d.world)
	}
	b.WriteString("sync; md5sum /dev/shm/dirty")
	if d != nil {
		b.WriteString(" " + d.world)
	}
	return b.String()
}

// parseMD5 reads "sum  path" lines into path -> sum.
func parseMD5(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) == 2 {
			m[f[1]] = f[0]
		}
	}
	return m
}

// noteGuestCPU records the CPU of the run's first booted VM (environment.guest_cpu).
func noteGuestCPU(r *Env, vm *engine.VM) {
	if r.res.Environment.GuestCPU == "" {
		r.res.Environment.GuestCPU = vm.Info().CPU
	}
}

// bakeWorld boots the world, dirties it and (when ckName != "") takes a pinned checkpoint.
func bakeWorld(r *Env, name, ckName string) (*World, error) {
	ctx := r.ctx
	w := &World{Name: name, Ck: ckName}
	t0 := time.Now()
	vm, err := r.e.Create(ctx, worldSpec(r, name, true))
	if err != nil {
		return nil, fmt.Errorf("world %s: boot: %w", name, err)
	}
	w.VM = vm
	w.BootMS = report.Ms(time.Since(t0))
	noteGuestCPU(r, vm)
	t1 := time.Now()
	out, err := shell(ctx, vm, dirtyScript(r), 10*time.Minute)
	if err != nil {
		return nil, fmt.Errorf("world %s: dirty: %w", name, err)
	}
	w.BakeMS = report.Ms(time.Since(t1))
	sums := parseMD5(out)
	d := worldDisk(r)
	w.DirtyMD5 = sums["/dev/shm/dirty"]
	if d != nil {
		w.DiskMD5 = sums[d.world]
	}
	if w.DirtyMD5 == "" || (d != nil && w.DiskMD5 == "") {
		return nil, fmt.Errorf("world %s: no md5sum in %q", name, out)
	}
	how := "booted"
	if vm.Info().BootCached {
		how = "restored from the boot cache"
	}
	r.logf("world %s %s in %.0f ms, dirtied %d MB in %.0f ms", name, how, w.BootMS, r.shape.DirtyMB, w.BakeMS)
	if ckName == "" {
		return w, nil
	}
	ck, err := r.e.Checkpoint(ctx, name, ckName, &engine.CheckpointOptions{Pin: true})
	if err != nil {
		return nil, fmt.Errorf("world %s: checkpoint: %w", name, err)
	}
	w.CheckpointMS = report.Ms(ck.Manifest.Timings.Total)
	w.PausedMS = report.Ms(ck.Manifest.Timings.Paused)
	w.RAMPath = ck.Manifest.RAMPath
	if rs, err := memfile.Residency(w.RAMPath); err == nil {
		w.SharedFileMB = float64(rs.DataBytes) / (1 << 20)
		w.SharedResidentMB = float64(rs.ResidentBytes) / (1 << 20)
	}
	r.logf("checkpoint %s: %.0f ms (paused %.0f ms), RAM file data %.0f MiB", ckName, w.CheckpointMS, w.PausedMS, w.SharedFileMB)
	return w, nil
}

// worldExtra records the world's figures in extra.
func worldExtra(r *Env, w *World) {
	r.res.Extra["world_boot_ms"] = report.Round3(w.BootMS)
	r.res.Extra["world_boot_cached"] = w.VM != nil && w.VM.Info().BootCached
	r.res.Extra["world_dirty_ms"] = report.Round3(w.BakeMS)
	if w.Ck != "" {
		r.res.Extra["checkpoint_ms"] = report.Round3(w.CheckpointMS)
		r.res.Extra["checkpoint_paused_ms"] = report.Round3(w.PausedMS)
		r.res.Extra["shared_file_mb"] = report.Round3(w.SharedFileMB)
	}
}

// memMethod describes the memory breakdown for result.json.
const memMethod = "Memory breakdown (engine VM.Memory, from the QEMU process's /proc/PID/smaps and VmPTE; each class counts a mapping's anonymous pages that are the process's alone: Anonymous less KSM pages, at most Private_Dirty): guest pages written = Anonymous of its mapping of the checkpoint RAM file (copies on write); TCG code = anonymous executable mappings (the translation buffer); QEMU heap = other anonymous memory; libraries = Anonymous of QEMU's executable and library mappings (relocations); private = their sum + page tables; shared = Rss - private anonymous (checkpoint pages read, QEMU code)."

// IsoReport summarises isolation checks over a set of forks.
type IsoReport struct {
	Forks        int      `json:"forks"`
	FullChecked  []string `json:"full_checked"`  // md5sum of world state compared
	CheapChecked int      `json:"cheap_checked"` // own write + neighbour + memory bound
	Failures     []string `json:"failures"`
	AnonBoundMB  float64  `json:"anon_bound_mb"`
	MaxAnonMB    float64  `json:"max_anon_mb"`
	MaxRAMCowMB  float64  `json:"max_ram_cow_mb"`
}

// isoMethod describes checkIsolation for result.json.
func isoMethod(r *Env) string {
	mine, world := "", ""
	if d := worldDisk(r); d != nil {
		mine, world = " and "+d.mine, " and "+d.world
	}
	return fmt.Sprintf("Isolation: every fork writes its own name to /dev/shm/mine%s, then every fork must read back only its own name (so no neighbour's write is visible), the world must not see /dev/shm/mine, and the fork's copied-on-write guest RAM (Anonymous of its mapping of the checkpoint RAM file in /proc/PID/smaps) must stay under dirty-mb/2 = %d MiB (its whole-process Anonymous from smaps_rollup is recorded as anon_mb, not bounded, since QEMU's heap and TCG buffers are in it); the full world state (md5sum of /dev/shm/dirty%s equal to the world's) is checked on a sample: the first, the last and one random fork of each wave.",
		mine, r.shape.DirtyMB/2, world)
}

// checkIsolation runs the isolation checks on vms (ready forks of w's checkpoint). mems
// holds each fork's memory measured at ready (by name); missing ones are measured here.
func checkIsolation(r *Env, w *World, vms []*engine.VM, mems map[string]report.ForkMem, full []int) IsoReport {
	c := &isoCheck{r: r, w: w, disk: worldDisk(r), rep: IsoReport{Forks: len(vms), AnonBoundMB: float64(r.shape.DirtyMB) / 2,
		Failures: []string{}, FullChecked: []string{}}}
	okWrite := make([]bool, len(vms))
	eachFork(vms, func(i int, vm *engine.VM) { okWrite[i] = c.ownWrite(vm) })
	eachFork(vms, func(i int, vm *engine.VM) {
		if okWrite[i] {
			c.readBack(vm, mems)
		}
	})
	if w.VM != nil {
		if out, err := shell(r.ctx, w.VM, "if [ -e /dev/shm/mine ]; then cat /dev/shm/mine; exit 1; fi", 60*time.Second); err != nil {
			c.failf("world %s sees a fork's write: %v %q", w.Name, err, out)
		}
	}
	var fwg sync.WaitGroup
	for _, i := range full {
		if i < 0 || i >= len(vms) {
			continue
		}
		fwg.Go(func() { c.worldState(vms[i]) })
	}
	fwg.Wait()
	return c.rep
}

// isoCheck is one checkIsolation; mu guards rep (forks are checked concurrently).
type isoCheck struct {
	r    *Env
	w    *World
	disk *diskState
	mu   sync.Mutex
	rep  IsoReport
}

func (c *isoCheck) failf(format string, a ...any) {
	msg := fmt.Sprintf(format, a...)
	c.mu.Lock()
	c.rep.Failures = append(c.rep.Failures, msg)
	c.mu.Unlock()
	c.r.fail("isolation: %s", msg)
}

// eachFork runs fn for every fork, at most 8 at a time.
func eachFork(vms []*engine.VM, fn func(i int, vm *engine.VM)) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, vm := range vms {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			fn(i, vm)
		}()
	}
	wg.Wait()
}

// ownWrite has vm write its name to /dev/shm/mine (and the disk's file); false when it
// could not.
func (c *isoCheck) ownWrite(vm *engine.VM) bool {
	s := fmt.Sprintf("echo %s > /dev/shm/mine", vm.Name())
	if c.disk != nil {
		s += fmt.Sprintf(" && echo %s > %s && sync", vm.Name(), c.disk.mine)
	}
	if _, err := shell(c.r.ctx, vm, s, 60*time.Second); err != nil {
		c.failf("%s: own write: %v", vm.Name(), err)
		return false
	}
	return true
}

// readBack checks that vm reads back only its own write, and that its guest RAM is
// still mostly shared with the checkpoint (its copied-on-write pages under the bound).
func (c *isoCheck) readBack(vm *engine.VM, mems map[string]report.ForkMem) {
	ctx, rep := c.r.ctx, &c.rep
	s := "cat /dev/shm/mine"
	want := vm.Name() + "\n"
	if c.disk != nil {
		s += " " + c.disk.mine
		want += vm.Name() + "\n"
	}
	out, err := shell(ctx, vm, s, 60*time.Second)
	if err != nil {
		c.failf("%s: read back: %v", vm.Name(), err)
		return
	}
	if out != want {
		c.failf("%s: sees %q, want only its own write", vm.Name(), out)
		return
	}
	m, ok := mems[vm.Name()]
	if !ok {
		var err error
		if m, err = measure.MeasureMem(ctx, vm); err != nil {
			c.failf("%s: memory: %v", vm.Name(), err)
			return
		}
	}
	c.mu.Lock()
	rep.MaxAnonMB = max(rep.MaxAnonMB, m.AnonMB)
	rep.MaxRAMCowMB = max(rep.MaxRAMCowMB, m.RAMCowMB)
	c.mu.Unlock()
	if m.RAMCowMB+m.GuestFileMB == 0 {
		c.failf("%s: no resident guest RAM in a mapping of %s", vm.Name(), c.w.RAMPath)
		return
	}
	if m.RAMCowMB >= rep.AnonBoundMB && c.r.shape.DirtyMB > 0 {
		c.failf("%s: %.1f MiB of its guest RAM is private (bound %.1f MiB): pages are not shared", vm.Name(), m.RAMCowMB, rep.AnonBoundMB)
		return
	}
	c.mu.Lock()
	rep.CheapChecked++
	c.mu.Unlock()
}

// worldState checks the whole world state in vm: the md5 of the file the world dirtied (and its
// worldDisk file) equal to the world's.
func (c *isoCheck) worldState(vm *engine.VM) {
	w := c.w
	s := "md5sum /dev/shm/dirty"
	if c.disk != nil {
		s += " " + c.disk.world
	}
	out, err := shell(c.r.ctx, vm, s, 10*time.Minute)
	if err != nil {
		c.failf("%s: world state: %v", vm.Name(), err)
		return
	}
	sums := parseMD5(out)
	if sums["/dev/shm/dirty"] != w.DirtyMD5 || (c.disk != nil && sums[c.disk.world] != w.DiskMD5) {
		c.failf("%s: world state differs: %v, want dirty %s disk %s", vm.Name(), sums, w.DirtyMD5, w.DiskMD5)
		return
	}
	c.mu.Lock()
	c.rep.FullChecked = append(c.rep.FullChecked, vm.Name())
	c.mu.Unlock()
}

// sampleIndices is first, last and one random index of n (deduplicated).
func sampleIndices(n int) []int {
	if n <= 0 {
		return nil
	}
	set := map[int]bool{0: true, n - 1: true, rand.IntN(n): true}
	var out []int
	for i := range n {
		if set[i] {
			out = append(out, i)
		}
	}
	return out
}
