package engine

import (
	"context"
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

	"github.com/forkvm/forkvm/engine/internal/console"
	"github.com/forkvm/forkvm/procinfo"
)

// recoverState re-finds what an earlier engine on the state directory left, after a clean
// Close or a crash (kill -9) at any point:
//
//   - VMs (recoverVMs): a VM whose manifest says running was confirmed ready (its agent
//     answered with its own token before the manifest said so) and is re-adopted, its
//     QEMU alive or not (a dead one is listed as dead until deleted). A running VM's
//     console that no live keeper serves (its engine was killed) is served by this
//     engine again (console.Hub.Recover). Anything else (no valid manifest, a pooled
//     process, a fork or create still on its way) is half-made: its QEMU is killed,
//     with any QEMU of its QMP socket the manifest does not name, and its files are
//     removed. A fork that became ready just before the crash is re-adopted even if
//     whoever asked for it was never told.
//   - a re-adopted fork's checkpoint is marked forked: a fork's manifest says running
//     before its checkpoint is marked, and an unpinned checkpoint left unmarked would
//     never be collected after its last fork.
//   - a VM whose checkpoint the crash cut short (its checkpointing marker) is settled by
//     the recovery of its checkpoint's kind (VM.recoverCutShort): a handoff runs on as
//     before when the checkpoint was not committed, and once it was, the handoff is
//     finished: the VM restarts from the checkpoint under its own name (kept as dead,
//     the checkpoint holding its state, only if that restart fails); a pause cut short
//     between the disk freeze and the resume is repaired: migration cancelled, disk
//     chain settled, guest resumed.
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
	var consoles []console.Console
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
		vm := adoptVM(dir, log, m, paths)
		vm.recoverCutShort(ctx, paths, log, timeout)
		vm.recoverPark(ctx, log)
		mv := vm.manifest()
		m = &mv
		if m.State == StateRunning || m.State == StateDead || m.State == StateParked {
			// Confirmed ready once: kept (a dead one is listed dead with its reason
			// until the user deletes it), never reaped as half-made.
			// A manifest rewrite the crash cut short (writeJSON's temporary file).
			os.Remove(filepath.Join(dir, manifestFile+".tmp"))
			if err := reg.add(vm); err != nil {
				return nil, err // never: the registry of an engine being opened is not closed
			}
			if m.State == StateRunning && vm.alive() {
				consoles = append(consoles, console.Console{RunDir: m.Launch.RunDir, Log: m.Launch.SerialLog})
			}
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
	// The consoles of running VMs whose engine died with them (no keeper serves them):
	// their QEMUs reconnect once this engine listens. Best effort, as a console is.
	if err := paths.consoles.Recover(consoles); err != nil {
		log.Warn("console of a running vm not served", "err", err)
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
// held: never collected while the directory is there. A VM that cannot be moved (no
// free name can be found, or a rename fails) is left in place whole, its RAM file
// included (checkpointStore.reap keeps the files of a VM directory that is still
// there), and its checkpoint is held all the same.
func keepAside(paths layout, log *slog.Logger, name string, cause error, pids []int, held func(string)) {
	aside, err := asideName(paths, name)
	if err == nil {
		err = moveAside(paths, name, aside)
	}
	if err != nil {
		parent := holdParent(paths.vmDir(name), held)
		log.Warn("vm manifest unreadable and the vm cannot be moved aside: left in place, not adopted",
			"vm", name, "err", cause, "move_err", err, "qemu_pids", pids, "checkpoint", parent)
		return
	}
	parent := holdParent(paths.vmDir(aside), held)
	if err := nameOwnBackings(paths.vmDir(aside)); err != nil {
		log.Warn("vm kept aside: its disk still names a checkpoint's layer by its path", "vm", name, "err", err)
	}
	if err := ownChainLayers(paths.vmDir(aside)); err != nil {
		log.Warn("vm kept aside: its disk still reads layers of a checkpoint through links", "vm", name, "err", err)
	}
	log.Warn("vm manifest unreadable: kept aside, not adopted (nothing deleted; inspect and remove it yourself)",
		"vm", name, "moved_to", paths.vmDir(aside), "err", cause, "qemu_pids", pids, "checkpoint", parent)
}

// asideName returns the first free name .corrupt-NAME, .corrupt-NAME-2... for the
// directory, run directory and RAM file of the VM name. A name whose freedom cannot be
// told (too long for the file system, say) is an error, not a reason to try the next
// number: every next one would fail the same way, for ever.
func asideName(paths layout, name string) (string, error) {
	aside := corruptPrefix + name
	for i := 2; ; i++ {
		free := true
		for _, p := range []string{paths.vmDir(aside), paths.runDir(aside), filepath.Join(paths.ram, aside+".ram")} {
			_, err := os.Lstat(p)
			if err == nil {
				free = false
			} else if !errors.Is(err, os.ErrNotExist) {
				return "", err
			}
		}
		if free {
			return aside, nil
		}
		aside = fmt.Sprintf("%s%s-%d", corruptPrefix, name, i)
	}
}

// moveAside renames the RAM file, directory and run directory of the VM name to aside.
// The RAM file goes first and comes back when the directory cannot follow: a RAM file
// left under the VM's name beside a directory moved away would look like nobody's,
// and be reaped. The run directory (sockets and logs) follows as best it can, as
// before: nothing reaps run directories.
func moveAside(paths layout, name, aside string) error {
	ram, asideRAM := paths.vmRAM(name), filepath.Join(paths.ram, aside+".ram")
	movedRAM := true
	if err := os.Rename(ram, asideRAM); errors.Is(err, os.ErrNotExist) {
		movedRAM = false
	} else if err != nil {
		return err
	}
	if err := os.Rename(paths.vmDir(name), paths.vmDir(aside)); err != nil {
		if movedRAM {
			if berr := os.Rename(asideRAM, ram); berr != nil {
				// Kept under the aside name: parseRAMName owns nothing so named.
				return fmt.Errorf("%w (its RAM file stays at %s: %v)", err, asideRAM, berr)
			}
		}
		return err
	}
	os.Rename(paths.runDir(name), paths.runDir(aside))
	return nil
}

// nameOwnBackings makes each qcow2 file in dir whose header names its backing by an
// absolute path outside dir (a fork's top: its overlay template names the checkpoint's
// top layer by path) name it by its chain name instead, and links the chain names of
// that layer's directory (the checkpoint's layer{i} files, which name their own
// backings so) into dir, for ownChainLayers to own.
func nameOwnBackings(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if !e.Type().IsRegular() || !strings.HasSuffix(e.Name(), ".qcow2") {
			continue
		}
		path := filepath.Join(dir, e.Name())
		b, err := backingName(path)
		if err != nil || !filepath.IsAbs(b) || filepath.Dir(b) == dir || !isChainName(filepath.Base(b)) {
			continue
		}
		from := filepath.Dir(b)
		layers, err := os.ReadDir(from)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, l := range layers {
			if !isChainName(l.Name()) {
				continue
			}
			if err := os.Symlink(filepath.Join(from, l.Name()), filepath.Join(dir, l.Name())); err != nil && !errors.Is(err, os.ErrExist) {
				errs = append(errs, err)
			}
		}
		if err := setBackingName(path, filepath.Base(b)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// ownChainLayers replaces each chain-name symlink in dir (a layer of a checkpoint the
// VM's disk is backed by) with a hard link to the same file, so that the directory
// holds its whole disk: a damaged manifest may not name its checkpoint, and a
// checkpoint deleted later must not take the kept-aside disk's layers with it. Frozen
// layers are never written, so sharing their inode costs nothing. Hard links cannot
// cross file systems: those links are left as they are and reported.
func ownChainLayers(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if e.Type()&os.ModeSymlink == 0 || !isChainName(e.Name()) {
			continue
		}
		link := filepath.Join(dir, e.Name())
		target, err := filepath.EvalSymlinks(link)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		tmp := link + ".own"
		os.Remove(tmp)
		if err := os.Link(target, tmp); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.Rename(tmp, link); err != nil {
			os.Remove(tmp)
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
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

// waitGone waits (up to d) until none of pids runs.
func waitGone(pids []int, d time.Duration) {
	deadline := time.Now().Add(d)
	for _, pid := range pids {
		for syscall.Kill(pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
	}
}
