package engine

import (
	"log/slog"
	"os"
	"path/filepath"
	"syscall"

	"github.com/forkvm/forkvm/memfile"
)

// recoverVMs re-finds the VMs of a state directory after an engine start: live VMs are
// registered, half-made ones (no valid manifest, a pooled process, a fork never
// confirmed ready) are killed and removed. Nothing is guessed: a VM counts only once its
// agent answered.
func recoverVMs(paths layout, reg *registry, log *slog.Logger) error {
	ents, err := os.ReadDir(paths.vmsDir())
	if err != nil {
		return err
	}
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
			reg.add(vm)
			continue
		}
		// A warm-pool process or a fork whose maker died before it was confirmed ready.
		log.Info("reaping half-made vm", "vm", m.Name, "state", m.State, "pid", m.PID)
		vm.kill()
		killOrphans(m)
		paths.removeVMFiles(m.Name, m)
	}
	return nil
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
