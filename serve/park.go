package serve

import (
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// The daemon's side of parking (docs/park.md): the park and wake endpoints, the wake it
// makes by itself for a request that needs a parked VM's guest, and with
// Server.RunParker, parking VMs that stayed idle, and waking a parked VM when a
// connection comes to one of its published ports.

// parker is the daemon's view of its VMs' use: when each was last used, the requests
// using each now, and the listeners that hold a parked VM's published ports.
type parker struct {
	mu    sync.Mutex
	last  map[string]time.Time
	busy  map[string]int
	ports map[string][]net.Listener
	// waking serializes the daemon's wakes of one VM with its port listeners. A lock is
	// in the map only while a goroutine holds it or waits for it (lockWake): a name
	// the daemon no longer serves, or never did (a park of any name a client sends),
	// leaves nothing behind.
	waking map[string]*wakeLock
}

// wakeLock is one VM's lock in parker.waking, with the goroutines that hold it or wait
// for it (guarded by parker.mu).
type wakeLock struct {
	mu   sync.Mutex
	refs int
}

func (s *Server) parkRoutes() {
	s.pk = &parker{last: map[string]time.Time{}, busy: map[string]int{}, ports: map[string][]net.Listener{}, waking: map[string]*wakeLock{}}
	s.mux.HandleFunc("POST /v1/vms/{name}/park", s.parkVM)
	s.mux.HandleFunc("POST /v1/vms/{name}/wake", s.wakeVM)
	s.mux.HandleFunc("PATCH /v1/vms/{name}", s.patchVM)
}

func (s *Server) parkVM(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	// A park is not cut short by a client that goes away: it commits or undoes itself.
	res, err := s.park(context.WithoutCancel(r.Context()), name)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) wakeVM(w http.ResponseWriter, r *http.Request) {
	res, err := s.wake(r.Context(), r.PathValue("name"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func (s *Server) patchVM(w http.ResponseWriter, r *http.Request) {
	var p api.VMPatch
	if !decode(w, r, MaxBodyBytes, &p) {
		return
	}
	name := r.PathValue("name")
	vm, err := s.e.Get(name)
	if err == nil && p.NoPark != nil {
		err = s.e.SetNoPark(name, *p.NoPark)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, NewVMObject(vm.Info()))
}

// park parks name and, where the daemon parks idle VMs, holds its published ports to
// wake it on a connection.
func (s *Server) park(ctx context.Context, name string) (*api.ParkResult, error) {
	defer s.pk.lockWake(name)()
	return s.parkLocked(ctx, name)
}

// parkLocked is park under name's wake lock.
func (s *Server) parkLocked(ctx context.Context, name string) (*api.ParkResult, error) {
	res, err := s.e.Park(ctx, name)
	if err != nil {
		return nil, err
	}
	if vm, err := s.e.Get(name); err == nil {
		s.holdPorts(name, vm.Info().Publish)
	}
	return res, nil
}

// wake wakes name, first letting go of the ports the daemon held for it (its QEMU binds
// them); a failed wake takes them again.
func (s *Server) wake(ctx context.Context, name string) (*api.WakeResult, error) {
	defer s.pk.lockWake(name)()
	return s.wakeLocked(ctx, name)
}

// wakeLocked is wake under name's wake lock.
func (s *Server) wakeLocked(ctx context.Context, name string) (*api.WakeResult, error) {
	s.releasePorts(name)
	res, err := s.e.Wake(ctx, name, nil)
	if err != nil {
		if vm, gerr := s.e.Get(name); gerr == nil && vm.Info().State == engine.StateParked {
			s.holdPorts(name, vm.Info().Publish)
		}
		return nil, err
	}
	s.pk.touch(name)
	return res, nil
}

// useVM is the VM {name} of a request that uses its guest (exec, cp, logs follow; with
// guest unset only its files on the host): counted busy until done is called, so that
// it is not parked meanwhile, and woken first when it is parked (the wake's latency in
// the WokeHeader response header).
func (s *Server) useVM(w http.ResponseWriter, r *http.Request, guest bool) (vm *engine.VM, done func(), err error) {
	name := r.PathValue("name")
	vm, err = s.e.Get(name)
	if err != nil {
		return nil, nil, err
	}
	// Under the wake lock: an idle park that checked the VM unused cannot park it from
	// under this request, and a parked VM is woken once.
	defer s.pk.lockWake(name)()
	done = s.pk.enter(name)
	if guest && vm.Info().State == engine.StateParked {
		res, err := s.wakeLocked(r.Context(), name)
		if err != nil {
			done()
			return nil, nil, err
		}
		w.Header().Set(api.WokeHeader, res.Latency.String())
	}
	return vm, done, nil
}

// lockWake takes name's wake lock and returns its unlock.
func (p *parker) lockWake(name string) (unlock func()) {
	l := p.refWake(name)
	l.mu.Lock()
	return func() { l.mu.Unlock(); p.unrefWake(name, l) }
}

// tryLockWake takes name's wake lock when it is free.
func (p *parker) tryLockWake(name string) (unlock func(), ok bool) {
	l := p.refWake(name)
	if !l.mu.TryLock() {
		p.unrefWake(name, l)
		return nil, false
	}
	return func() { l.mu.Unlock(); p.unrefWake(name, l) }, true
}

// refWake returns name's wake lock, made when none is in use, counting the caller.
func (p *parker) refWake(name string) *wakeLock {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.waking[name]
	if l == nil {
		l = &wakeLock{}
		p.waking[name] = l
	}
	l.refs++
	return l
}

// unrefWake uncounts a caller of refWake, dropping the lock when it was the last.
func (p *parker) unrefWake(name string, l *wakeLock) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if l.refs--; l.refs == 0 {
		delete(p.waking, name)
	}
}

// enter counts a request using name until done.
func (p *parker) enter(name string) (done func()) {
	p.mu.Lock()
	p.busy[name]++
	p.last[name] = time.Now()
	p.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			p.mu.Lock()
			if p.busy[name]--; p.busy[name] <= 0 {
				delete(p.busy, name)
			}
			p.last[name] = time.Now()
			p.mu.Unlock()
		})
	}
}

func (p *parker) touch(name string) {
	p.mu.Lock()
	p.last[name] = time.Now()
	p.mu.Unlock()
}

// idleSince is when name was last used (first seen, for a VM the daemon never served),
// and whether a request uses it now.
func (p *parker) idleSince(name string, now time.Time) (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	t, ok := p.last[name]
	if !ok {
		p.last[name] = now
		t = now
	}
	return t, p.busy[name] > 0
}

// drop forgets name's last use, the VM being deleted (unless a request still uses the
// name): without idle parking, forget never runs, and a daemon would keep an entry for
// every VM it ever served.
func (p *parker) drop(name string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.busy[name] == 0 {
		delete(p.last, name)
	}
}

// forget drops what the parker knows of VMs not in live.
func (p *parker) forget(live map[string]bool) (gone []net.Listener) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for name := range p.last {
		if !live[name] && p.busy[name] == 0 {
			delete(p.last, name)
		}
	}
	for name, lns := range p.ports {
		if !live[name] {
			gone = append(gone, lns...)
			delete(p.ports, name)
		}
	}
	return gone
}

// RunParker parks every VM that had no exec, attach, cp or logs follow through the
// daemon, and no connection established on its published ports, for idle, except those
// that opted out (Spec.NoPark). A parked VM's published ports are held by the daemon: a
// connection to one wakes the VM and is then relayed to it. It runs until ctx ends,
// then lets go of the ports it held (the VMs stay parked).
func (s *Server) RunParker(ctx context.Context, idle time.Duration) {
	tick := min(max(idle/4, 50*time.Millisecond), time.Second)
	t := time.NewTicker(tick)
	defer t.Stop()
	defer s.releaseAllPorts()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.parkIdle(ctx, idle)
	}
}

// parkIdle is one round of RunParker.
func (s *Server) parkIdle(ctx context.Context, idle time.Duration) {
	now := time.Now()
	live := map[string]bool{}
	infos := s.e.List()
	for _, inf := range infos {
		live[inf.Name] = true
	}
	for _, ln := range s.pk.forget(live) {
		ln.Close()
	}
	for _, inf := range infos {
		if ctx.Err() != nil {
			return
		}
		if inf.State == engine.StateParked {
			s.holdParked(inf.Name)
			continue
		}
		if inf.State != engine.StateRunning || inf.NoPark || inf.RAMFile == "" {
			continue
		}
		res, since, err := s.parkIfIdle(ctx, inf, idle, now)
		if res == nil && err == nil {
			continue
		}
		if err != nil {
			s.log.Warn("idle park failed", "vm", inf.Name, "err", err)
			s.pk.touch(inf.Name) // not again before another idle period
			continue
		}
		s.log.Info("parked idle vm", "vm", inf.Name, "idle", now.Sub(since).Round(time.Millisecond), "bytes", res.Bytes, "paused", res.Paused)
	}
}

// parkIfIdle parks the VM of inf when it is still idle (nil, nil: it is not), checked
// under its wake lock, which a request takes to count itself as using the VM.
func (s *Server) parkIfIdle(ctx context.Context, inf api.Info, idle time.Duration, now time.Time) (*api.ParkResult, time.Time, error) {
	defer s.pk.lockWake(inf.Name)()
	since, busy := s.pk.idleSince(inf.Name, now)
	if busy || now.Sub(since) < idle {
		return nil, since, nil
	}
	if connectedPorts(inf.Publish) {
		s.pk.touch(inf.Name)
		return nil, since, nil
	}
	res, err := s.parkLocked(ctx, inf.Name)
	return res, since, err
}

// holdParked holds the published ports of name, a VM parked without the daemon holding
// them (parked through the engine, or before the daemon started). It does so under
// name's wake lock and only when that lock is free: a wake under way has let go of the
// ports for its new QEMU to bind, and the VM reads parked until the wake commits, so
// holding them then would make that QEMU fail to start.
func (s *Server) holdParked(name string) {
	unlock, ok := s.pk.tryLockWake(name)
	if !ok {
		return // a park or a wake is under way: its end decides
	}
	defer unlock()
	vm, err := s.e.Get(name)
	if err != nil {
		return
	}
	if inf := vm.Info(); inf.State == engine.StateParked && !s.holdsPorts(name) {
		s.holdPorts(name, inf.Publish)
	}
}

func (s *Server) holdsPorts(name string) bool {
	s.pk.mu.Lock()
	defer s.pk.mu.Unlock()
	return s.pk.ports[name] != nil
}

// holdPorts listens on a parked VM's published host addresses; a connection wakes the
// VM and is relayed to it. An address it cannot take is left alone (nothing wakes the
// VM through it).
func (s *Server) holdPorts(name string, pubs []api.PortForward) {
	if len(pubs) == 0 {
		return
	}
	var lns []net.Listener
	for _, p := range pubs {
		addr := net.JoinHostPort(p.BindIP(), strconv.Itoa(p.HostPort))
		ln, err := net.Listen("tcp4", addr)
		if err != nil {
			s.log.Warn("cannot hold a parked vm's published port", "vm", name, "addr", addr, "err", err)
			continue
		}
		lns = append(lns, ln)
		go s.acceptWake(name, ln, addr)
	}
	s.pk.mu.Lock()
	old := s.pk.ports[name]
	s.pk.ports[name] = lns
	s.pk.mu.Unlock()
	for _, ln := range old {
		ln.Close()
	}
}

// releasePorts closes the listeners held for name.
func (s *Server) releasePorts(name string) {
	s.pk.mu.Lock()
	lns := s.pk.ports[name]
	delete(s.pk.ports, name)
	s.pk.mu.Unlock()
	for _, ln := range lns {
		ln.Close()
	}
}

func (s *Server) releaseAllPorts() {
	s.pk.mu.Lock()
	all := s.pk.ports
	s.pk.ports = map[string][]net.Listener{}
	s.pk.mu.Unlock()
	for _, lns := range all {
		for _, ln := range lns {
			ln.Close()
		}
	}
}

// acceptWake waits for a connection on ln, a parked VM's published address addr: it
// wakes the VM (closing ln, so that its QEMU can bind addr) and relays the connection
// to addr, now the VM's.
func (s *Server) acceptWake(name string, ln net.Listener, addr string) {
	c, err := ln.Accept()
	if err != nil {
		return // closed: woken or deleted otherwise
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	done := s.pk.enter(name)
	res, err := s.wake(ctx, name)
	done()
	if err != nil {
		s.log.Warn("wake on a published port failed", "vm", name, "addr", addr, "err", err)
		c.Close()
		return
	}
	s.log.Info("woke parked vm on a connection to its published port", "vm", name, "addr", addr, "latency", res.Latency)
	up, err := (&net.Dialer{}).DialContext(ctx, "tcp4", addr)
	if err != nil {
		c.Close()
		return
	}
	go relay(c, up)
}

// relay copies between a and b until both directions end.
func relay(a, b net.Conn) {
	var wg sync.WaitGroup
	half := func(dst, src net.Conn) {
		defer wg.Done()
		_, _ = io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		} else {
			dst.Close()
		}
	}
	wg.Add(2)
	go half(a, b)
	go half(b, a)
	wg.Wait()
	a.Close()
	b.Close()
}
