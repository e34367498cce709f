package engine

import "sync"

// poolPrefix names pooled VMs; they are renamed when claimed.
const poolPrefix = "pool-"

// warmPool is the set of pooled QEMUs of one checkpoint.
type warmPool struct {
	restored bool
	target   int
	ready    []*VM
	filling  int // spawns in flight
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
func (s *poolSet) pool(ck string, restored bool) *warmPool {
	if s.pools == nil {
		s.pools = map[string]*warmPool{}
	}
	p := s.pools[ck]
	if p == nil {
		p = &warmPool{restored: restored}
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

// readyCPUs counts the vCPUs held by ready pooled processes.
func (s *poolSet) readyCPUs() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.pools {
		for _, vm := range p.ready {
			n += vm.m.Spec.CPUs
		}
	}
	return n
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
