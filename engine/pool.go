package engine

import (
	"slices"
	"sync"
)

// poolPrefix names pooled VMs; they are renamed when claimed.
const poolPrefix = "pool-"

// WarmOptions tune a warm pool. A nil *WarmOptions means defaults.
type WarmOptions struct {
	// Restored pre-restores pooled processes: each loads the checkpoint, answers a
	// handshake and runs one warm-up command (so its TCG translation cache is warm), then
	// is stopped. A claim is then cont + a handshake with the fork's own token, entropy,
	// clock and hostname. Trade-off: a pooled fork has run a fraction of a second of guest
	// time after the checkpoint (files and memory contents are those of the checkpoint,
	// but processes that were running at checkpoint time have advanced by that much).
	// Without it, pooled processes wait in -incoming defer and a fork pays restore +
	// handshake.
	Restored bool
	// WarmUp is the command a restored pooled process runs before it is stopped. Default:
	// `sh -c true`. Under TCG a fork is a fresh QEMU whose translation cache starts
	// empty, so a warm-up that walks the path forks will take (ask the world's warm
	// interpreter a question, say) makes that path fast in every fork handed out; its
	// effects on the guest are part of what the fork gets. It must exit 0.
	WarmUp []string
}

// warmUpArgv is the pool's warm-up command.
func (o WarmOptions) warmUpArgv() []string {
	if len(o.WarmUp) == 0 {
		return []string{"sh", "-c", "true"}
	}
	return o.WarmUp
}

// same reports whether two pools of these options hold interchangeable processes.
func (o WarmOptions) same(p WarmOptions) bool {
	return o.Restored == p.Restored && (!o.Restored || slices.Equal(o.warmUpArgv(), p.warmUpArgv()))
}

// warmPool is the set of pooled QEMUs of one checkpoint.
type warmPool struct {
	opts    WarmOptions
	target  int
	ready   []*VM
	filling int // spawns in flight
}

// poolSet holds the warm pools by checkpoint name. Spawning and claiming are the
// engine's (warm.go); this type only keeps the books.
//
// Concurrency: mu guards every pool. A claim takes the first ready process under mu, so
// two forks never get the same one; closed is set under mu before Close waits for
// background spawns, so none can start after that (see Engine.refill).
type poolSet struct {
	mu     sync.Mutex
	pools  map[string]*warmPool
	closed bool
}

// pool returns the pool of ck, creating it.
func (s *poolSet) pool(ck string, opts WarmOptions) *warmPool {
	if s.pools == nil {
		s.pools = map[string]*warmPool{}
	}
	p := s.pools[ck]
	if p == nil {
		p = &warmPool{opts: opts}
		s.pools[ck] = p
	}
	return p
}

// size returns the number of ready pooled processes for ck.
func (s *poolSet) size(ck string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.pools[ck]; p != nil {
		return len(p.ready)
	}
	return 0
}

// uses returns the ready pooled processes as admission counts them.
func (s *poolSet) uses(h hostProbe) []qemuUse {
	s.mu.Lock()
	var vms []*VM
	for _, p := range s.pools {
		vms = append(vms, p.ready...)
	}
	s.mu.Unlock()
	var out []qemuUse
	for _, vm := range vms {
		if u, ok := vm.use(h); ok {
			out = append(out, u)
		}
	}
	return out
}

// take removes and returns the first ready process of ck's pool, or nil.
func (s *poolSet) take(ck string) *VM {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.pools[ck]
	if p == nil || len(p.ready) == 0 {
		return nil
	}
	vm := p.ready[0]
	p.ready = p.ready[1:]
	return vm
}

// close refuses new spawns and returns every ready process, for the caller to kill.
func (s *poolSet) close() []*VM {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	var all []*VM
	for _, p := range s.pools {
		all = append(all, p.ready...)
		p.ready, p.target = nil, 0
	}
	return all
}
