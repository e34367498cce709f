package engine

import (
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/forkvm/forkvm/memfile"
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
//   - checkpoints (checkpointStore.reap): half-written ones, RAM files and temporary
//     files nothing owns are removed; unpinned checkpoints without forks are collected.
//   - the checkpoints of reaped forks get back the zero pages those forks faulted into
//     their RAM files' holes (checkpointStore.punch), as a deleted fork's checkpoint does.
func (e *Engine) recoverState() error {
	reapedFrom, err := recoverVMs(e.paths, e.vms, e.log)
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
func recoverVMs(paths layout, reg *registry, log *slog.Logger) ([]string, error) {
	ents, err := os.ReadDir(paths.vmsDir())
	if err != nil {
		return nil, err
	}
	parents := map[string]bool{}
	for _, ent := range ents {
		if !ent.IsDir() {
			continue
		}
		dir := paths.vmDir(ent.Name())
		m, err := loadManifest(filepath.Join(dir, manifestFile))
		if err != nil || m.Name != ent.Name() {
			log.Info("reaping vm directory without a valid manifest", "dir", dir, "err", err)
			paths.removeVMFiles(ent.Name(), nil)
			continue
		}
		vm := adoptVM(dir, log, m)
		if m.State == StateRunning {
			// A manifest rewrite the crash cut short (writeJSON's temporary file).
			os.Remove(filepath.Join(dir, manifestFile+".tmp"))
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

// killOrphans SIGKILLs QEMU processes of a half-made VM that its manifest does not
// name: the engine may have died between spawning QEMU and recording its pid. They are
// recognised by their QMP socket argument, unique to this state dir and VM.
func killOrphans(m *manifest) {
	if m.Launch.RunDir == "" {
		return
	}
	pids, _ := memfile.ProcessesWithArg("path=" + escapeOpt(m.Launch.qmpSocket()) + ",")
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}
