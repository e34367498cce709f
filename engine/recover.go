package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/procinfo"
)

// recoverState re-finds what an earlier engine on the state directory left, after a clean
// Close or a crash (kill -9) at any point:
//
//   - VMs (recoverVMs): a VM whose manifest says running was confirmed ready (its agent
//     answered with its own token before the manifest said so) and is re-adopted, its
//     QEMU alive or not (a dead one is listed as dead until deleted). Anything else
//     (no valid manifest, a pooled process, a fork or create still on its way) is
//     half-made: its QEMU is killed, with any QEMU of its QMP socket the manifest does
//     not name, and its files are removed. A fork that became ready just before the
//     crash is re-adopted even if whoever asked for it was never told.
//   - a re-adopted fork's checkpoint is marked forked: a fork's manifest says running
//     before its checkpoint is marked, and an unpinned checkpoint left unmarked would
//     never be collected after its last fork.
//   - a VM whose checkpoint was cut short between its disk freeze and its resume is
//     repaired (VM.recoverCheckpointing): migration cancelled, disk chain settled, guest
//     resumed.
//   - a VM whose handoff checkpoint the crash cut short (VM.recoverHandoff) runs on as
//     before when the checkpoint was not committed; once it was, the handoff is
//     finished: the VM restarts from the checkpoint under its own name (kept as dead,
//     the checkpoint holding its state, only if that restart fails).
//   - checkpoints (checkpointStore.reap): half-written ones, RAM files and temporary
//     files nothing owns are removed; unpinned checkpoints without forks are collected.
//   - the checkpoints of reaped forks get back the zero pages those forks faulted into
//     their RAM files' holes (checkpointStore.punch), as a deleted fork's checkpoint does.
func (e *Engine) recoverState(ctx context.Context) error {
	reapedFrom, err := recoverVMs(ctx, e.paths, e.vms, e.log, e.cks.hold, e.cfg.ForkTimeout)
	if err != nil {
		return err
	}
	for ck := range e.vms.forksByParent() {
		e.cks.markForked(ck)
	}
	if err := e.cks.reap(e.vms.has, e.vms.forksOf); err != nil {
		return err
	}
	for _, ck := range reapedFrom {
		e.cks.punch(ck)
	}
	return nil
}

// recoverVMs re-finds the VMs of a state directory after an engine start: live VMs are
// registered, half-made ones (no valid manifest, a pooled process, a fork never
// confirmed ready) are killed and removed. Nothing is guessed: a VM counts only once its
// agent answered. It returns the checkpoints (sorted, once each) that the half-made
// forks it removed were made from.
func recoverVMs(ctx context.Context, paths layout, reg *registry, log *slog.Logger, held func(ck string), timeout time.Duration) ([]string, error) {
	ents, err := os.ReadDir(paths.vmsDir())
	if err != nil {
		return nil, err
	}
	parents := map[string]bool{}
	for _, ent := range ents {
		if !ent.IsDir() {
			continue
		}
		if strings.HasPrefix(ent.Name(), corruptPrefix) {
			// Kept aside by an earlier start: still holds the checkpoint it names.
			holdParent(paths.vmDir(ent.Name()), held)
			continue
		}
		dir := paths.vmDir(ent.Name())
		m, err := loadManifest(filepath.Join(dir, manifestFile))
		if err == nil && m.Name != ent.Name() {
			err = fmt.Errorf("manifest names %q", m.Name)
		}
		if err != nil {
			pids := qemusOf(paths.runDir(ent.Name()))
			if errors.Is(err, os.ErrNotExist) && len(pids) == 0 {
				// The first manifest is written before QEMU is spawned: no manifest
				// and no QEMU is a create or fork that never started.
				log.Info("reaping vm directory that never had a manifest", "dir", dir)
				paths.removeVMFiles(ent.Name(), nil)
				continue
			}
			keepAside(paths, log, ent.Name(), err, pids, held)
			continue
		}
		vm := adoptVM(dir, log, m)
		if mk, ok := readCheckpointing(vm.path(checkpointingFile)); ok && mk.Handoff {
			vm.recoverHandoff(ctx, paths, log, mk, timeout)
			m = &vm.m
		}
		if m.State == StateRunning || m.State == StateDead {
			// Confirmed ready once: kept (a dead one is listed dead with its reason
			// until the user deletes it), never reaped as half-made.
			// A manifest rewrite the crash cut short (writeJSON's temporary file).
			os.Remove(filepath.Join(dir, manifestFile+".tmp"))
			if _, err := os.Stat(vm.path(checkpointingFile)); err == nil {
				vm.recoverCheckpointing(log)
			}
			reg.add(vm)
			continue
		}
		// A warm-pool process or a fork whose maker died before it was confirmed ready.
		log.Info("reaping half-made vm", "vm", m.Name, "state", m.State, "pid", m.PID)
		vm.kill()
		killOrphans(m)
		paths.removeVMFiles(m.Name, m)
		if m.Parent != "" {
			parents[m.Parent] = true
		}
	}
	out := make([]string, 0, len(parents))
	for p := range parents {
		out = append(out, p)
	}
	sort.Strings(out)
	return out, nil
}

// corruptPrefix starts the name of a VM directory (and its run directory and RAM file)
// kept aside because its manifest could not be read: no valid name starts with '.'.
const corruptPrefix = ".corrupt-"

// parentRE finds a fork's checkpoint in a manifest too damaged to decode.
var parentRE = regexp.MustCompile(`"parent":\s*"([^"]+)"`)

// keepAside moves a VM whose manifest cannot be read out of the engine's way, deleting
// nothing: its directory, run directory and RAM file get the name .corrupt-NAME (with a
// number when that is taken), and a warning names them, the error and the QEMU
// processes still using its QMP socket (left running: nothing proves they are half-made;
// their data may be needed). The checkpoint a damaged fork names, if any can be read, is
// held: never collected while the directory is there.
func keepAside(paths layout, log *slog.Logger, name string, cause error, pids []int, held func(string)) {
	aside := corruptPrefix + name
	for i := 2; ; i++ {
		_, e1 := os.Lstat(paths.vmDir(aside))
		_, e2 := os.Lstat(paths.runDir(aside))
		_, e3 := os.Lstat(filepath.Join(paths.ram, aside+".ram"))
		if errors.Is(e1, os.ErrNotExist) && errors.Is(e2, os.ErrNotExist) && errors.Is(e3, os.ErrNotExist) {
			break
		}
		aside = fmt.Sprintf("%s%s-%d", corruptPrefix, name, i)
	}
	if err := os.Rename(paths.vmDir(name), paths.vmDir(aside)); err != nil {
		log.Warn("vm manifest unreadable and the vm cannot be moved aside: left in place, not adopted",
			"vm", name, "err", cause, "move_err", err, "qemu_pids", pids)
		return
	}
	os.Rename(paths.runDir(name), paths.runDir(aside))
	os.Rename(paths.vmRAM(name), filepath.Join(paths.ram, aside+".ram"))
	parent := holdParent(paths.vmDir(aside), held)
	log.Warn("vm manifest unreadable: kept aside, not adopted (nothing deleted; inspect and remove it yourself)",
		"vm", name, "moved_to", paths.vmDir(aside), "err", cause, "qemu_pids", pids, "checkpoint", parent)
}

// holdParent holds the checkpoint that the damaged manifest in dir names, if it names
// one, and returns its name.
func holdParent(dir string, held func(string)) string {
	b, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return ""
	}
	m := parentRE.FindSubmatch(b)
	if m == nil || ValidateName(string(m[1])) != nil {
		return ""
	}
	held(string(m[1]))
	return string(m[1])
}

// qemusOf returns the processes using the QMP socket of a VM's run directory.
func qemusOf(runDir string) []int {
	pids, _ := procinfo.ProcessesWithArg("path=" + escapeOpt(filepath.Join(runDir, qmpSockName)) + ",")
	return pids
}

// killOrphans SIGKILLs QEMU processes of a half-made VM that its manifest does not
// name: the engine may have died between spawning QEMU and recording its pid. They are
// recognised by their QMP socket argument, unique to this state dir and VM.
func killOrphans(m *manifest) {
	if m.Launch.RunDir == "" {
		return
	}
	for _, pid := range qemusOf(m.Launch.RunDir) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// recoverCheckpointing repairs a VM whose engine died during a checkpoint, between the
// disk freeze's preparation and the guest's resume (the checkpointing marker): a
// migration still running is cancelled; the overlay the freeze prepared is adopted into
// the manifest when QEMU already switched to it (blockdev-snapshot ran) and removed
// otherwise, so that the next checkpoint can prepare it again; a guest left stopped
// (postmigrate) is resumed. The half-written checkpoint itself is reaped with the others.
// Failures are logged: the VM is re-adopted either way.
func (vm *VM) recoverCheckpointing(log *slog.Logger) {
	defer os.Remove(vm.path(checkpointingFile))
	p := vm.process()
	if !p.Running() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	c, err := p.client(ctx)
	if err != nil {
		log.Warn("recover: checkpoint cut short: no qmp", "vm", vm.m.Name, "err", err)
		return
	}
	if mig, err := c.QueryMigrate(ctx); err == nil && mig.Active() {
		_ = c.MigrateCancel(ctx)
		for mig.Active() && ctx.Err() == nil {
			time.Sleep(20 * time.Millisecond)
			if mig, err = c.QueryMigrate(ctx); err != nil {
				break
			}
		}
	}
	if len(vm.m.Launch.Disk) > 0 && vm.m.DiskNode != "" {
		node, path := nextDiskNode(vm.m.DiskSeq), nextDiskPath(vm.dir, vm.m.DiskSeq)
		switched := false
		if blocks, err := c.QueryBlock(ctx); err == nil {
			for _, b := range blocks {
				switched = switched || (b.Inserted != nil && b.Inserted.NodeName == node)
			}
		}
		if switched {
			vm.mu.Lock()
			vm.m.pushOverlay(node, path)
			err := vm.saveLocked()
			vm.mu.Unlock()
			log.Info("recover: adopted the disk overlay of a checkpoint cut short", "vm", vm.m.Name, "overlay", path, "err", err)
		} else {
			_ = c.BlockdevDel(ctx, node)
			os.Remove(path)
		}
	}
	if st, err := c.QueryStatus(ctx); err == nil && st.Status != "running" {
		err := c.Cont(ctx)
		log.Info("recover: resumed a guest a checkpoint left stopped", "vm", vm.m.Name, "status", st.Status, "err", err)
	}
}

// readCheckpointing reads a VM's checkpointing marker.
func readCheckpointing(path string) (checkpointing, bool) {
	var mk checkpointing
	b, err := os.ReadFile(path)
	if err != nil {
		return mk, false
	}
	if json.Unmarshal(b, &mk) != nil {
		return checkpointing{}, true // a marker without details: not a handoff
	}
	return mk, true
}

// recoverHandoff settles a VM whose engine died during a handoff checkpoint (its
// marker says where the RAM file was going). Before the checkpoint was committed, the
// RAM file (still at its temporary name, or already at the checkpoint's, whose directory
// never got there) and the disk go back as they were and the marker stays for
// recoverCheckpointing, which resumes the old QEMU. After, the RAM file belongs to the
// checkpoint and the old QEMU must never run again (it maps that file share=on): the
// handoff is finished as it would have been: every QEMU of the VM is killed and the VM
// restarts from the checkpoint under its own name, with its token, disk and ports (a
// handoff that had already finished is left alone). Only when that restart fails is the
// VM kept as dead, the checkpoint holding its state (fork it to go on).
func (vm *VM) recoverHandoff(ctx context.Context, paths layout, log *slog.Logger, mk checkpointing, timeout time.Duration) {
	ckDir := paths.checkpointDir(mk.Checkpoint)
	b, err := os.ReadFile(filepath.Join(ckDir, manifestFile))
	if errors.Is(err, os.ErrNotExist) {
		if mk.RAM != "" {
			if _, err := os.Stat(mk.RAM); errors.Is(err, os.ErrNotExist) {
				// The commit renames the RAM file to the checkpoint's name before the
				// directory: it may be at either.
				for _, from := range []string{mk.RAMTmp, paths.checkpointRAM(mk.Checkpoint)} {
					if from == "" {
						continue
					}
					if err = os.Rename(from, mk.RAM); err == nil {
						break
					}
				}
				if err != nil {
					log.Warn("recover: handoff cut short: cannot put the RAM file back", "vm", vm.m.Name, "err", err)
				}
			}
		}
		if mk.NewTop != "" {
			os.Remove(mk.NewTop)
		}
		return
	}
	defer os.Remove(vm.path(checkpointingFile))
	var ck *checkpointManifest
	if err == nil {
		ck, err = paths.decodeCheckpoint(b, ckDir)
	}
	if err == nil && ck.Name != mk.Checkpoint {
		err = fmt.Errorf("manifest names %q", ck.Name)
	}
	vm.mu.Lock()
	done := vm.m.State == StateRunning && vm.m.Parent == mk.Checkpoint && !vm.m.Launch.RAM.Shared
	vm.mu.Unlock()
	if done && vm.alive() {
		return // the crash came after the restart, before the marker went
	}
	vm.kill()
	pids := qemusOf(vm.m.Launch.RunDir)
	killOrphans(&vm.m)
	waitGone(pids, 5*time.Second)
	if err == nil {
		rctx, cancel := context.WithTimeout(ctx, timeout)
		vm.mu.Lock()
		vm.relaunchHandedOff(paths, ck, mk.NewTop)
		vm.mu.Unlock()
		err = vm.restartHandedOff(rctx, &Checkpoint{Manifest: *ck, Dir: ckDir})
		cancel()
		if err == nil {
			log.Warn("recover: finished a handoff cut short: the vm runs again from its checkpoint", "vm", vm.m.Name, "checkpoint", mk.Checkpoint)
			return
		}
		vm.kill()
	}
	vm.mu.Lock()
	vm.m.State = StateDead
	vm.m.DeadReason = fmt.Sprintf("handoff to checkpoint %s cut short; restart failed: %v", mk.Checkpoint, err)
	serr := vm.saveLocked()
	vm.mu.Unlock()
	log.Warn("recover: handoff cut short after its checkpoint was committed and the vm cannot restart from it; the vm is dead, fork the checkpoint to go on",
		"vm", vm.m.Name, "checkpoint", mk.Checkpoint, "err", err, "save_err", serr)
}

// waitGone waits (up to d) until none of pids runs.
func waitGone(pids []int, d time.Duration) {
	deadline := time.Now().Add(d)
	for _, pid := range pids {
		for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
}
