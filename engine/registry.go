package engine

import (
	"fmt"
	"os"
	"sort"
	"sync"
)

// registry holds the engine's VMs by name and the names being made, so that no two
// VMs or checkpoints share a name. It never holds its lock across QEMU start-up or agent
// round trips.
type registry struct {
	paths layout

	mu       sync.Mutex
	vms      map[string]*VM
	parents  map[string]string // VM name -> the checkpoint it was forked from
	reserved map[string]bool   // names being created (not yet in vms or on disk)
	closed   bool
}

func newRegistry(paths layout) *registry {
	return &registry{paths: paths, vms: map[string]*VM{}, parents: map[string]string{}, reserved: map[string]bool{}}
}

// reserve claims a valid, unused name for a VM or checkpoint being made; release it
// with unreserve.
func (r *registry) reserve(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if r.reserved[name] || r.vms[name] != nil {
		return fmt.Errorf("%w: %s", ErrExists, name)
	}
	if _, err := os.Stat(r.paths.checkpointDir(name)); err == nil {
		return fmt.Errorf("%w: %s (a checkpoint)", ErrExists, name)
	}
	if _, err := os.Stat(r.paths.vmDir(name)); err == nil {
		return fmt.Errorf("%w: %s", ErrExists, name)
	}
	r.reserved[name] = true
	return nil
}

func (r *registry) unreserve(name string) {
	r.mu.Lock()
	delete(r.reserved, name)
	r.mu.Unlock()
}

// get returns the named VM.
func (r *registry) get(name string) (*VM, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, ErrClosed
	}
	vm := r.vms[name]
	if vm == nil {
		return nil, fmt.Errorf("%w: vm %s", ErrNotFound, name)
	}
	return vm, nil
}

// add registers a VM. The registry keeps its parent itself, so that listing a
// checkpoint's forks never waits on a VM's lock (a checkpoint holds it for its length).
func (r *registry) add(vm *VM) {
	name, parent := vm.Name(), vm.snapshot().Parent
	r.mu.Lock()
	r.vms[name] = vm
	r.parents[name] = parent
	r.mu.Unlock()
}

// setParent records a registered VM's new parent (a handoff makes a world a fork).
func (r *registry) setParent(name, parent string) {
	r.mu.Lock()
	if r.vms[name] != nil {
		r.parents[name] = parent
	}
	r.mu.Unlock()
}

func (r *registry) remove(name string) {
	r.mu.Lock()
	delete(r.vms, name)
	delete(r.parents, name)
	r.mu.Unlock()
}

func (r *registry) has(name string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.vms[name] != nil
}

// all returns the VMs sorted by name.
func (r *registry) all() []*VM {
	r.mu.Lock()
	vms := make([]*VM, 0, len(r.vms))
	for _, vm := range r.vms {
		vms = append(vms, vm)
	}
	r.mu.Unlock()
	sort.Slice(vms, func(i, j int) bool { return vms[i].Name() < vms[j].Name() })
	return vms
}

// forksByParent maps each checkpoint to its live forks, sorted.
func (r *registry) forksByParent() map[string][]string {
	r.mu.Lock()
	m := map[string][]string{}
	for name, parent := range r.parents {
		if parent != "" {
			m[parent] = append(m[parent], name)
		}
	}
	r.mu.Unlock()
	for _, forks := range m {
		sort.Strings(forks)
	}
	return m
}

// forksOf counts a checkpoint's forks.
func (r *registry) forksOf(ck string) int { return len(r.forksByParent()[ck]) }

// uses returns the live VMs as admission counts them.
func (r *registry) uses(h hostProbe, sourceOf func(parent string) string) []qemuUse {
	var out []qemuUse
	for _, vm := range r.all() {
		if u, ok := vm.admissionUse(h, sourceOf); ok {
			out = append(out, u)
		}
	}
	return out
}

// close refuses new names and returns the VMs.
func (r *registry) close() []*VM {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	return r.all()
}
