// Package local is the in-process implementation of api.API, an engine opened in this
// program, and Open, which returns the API for a state directory: the daemon's client
// when a daemon answers on its socket, else the engine opened here. It is the one
// package of the API that links the engine; package serve/client, the daemon's client,
// does not.
package local

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"sync"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/tarstream"
	"github.com/forkvm/forkvm/vsockd"
)

// Local is the API of an engine in this process.
//
// Design: with OneShot the engine is given up by the first agent operation (see
// Options.OneShot); mu guards that hand-over and the agent connection it leaves.
type Local struct {
	E       *engine.Engine
	oneShot bool

	mu      sync.Mutex
	closed  bool           // the engine is closed (Close, or a one-shot hand-over)
	agentOf string         // the VM the one-shot agent connection belongs to
	agent   *vsockd.Client // that connection
}

// New returns the API of e; Close closes e. A nil opts means defaults.
func New(e *engine.Engine, opts *Options) *Local {
	l := &Local{E: e}
	if opts != nil {
		l.oneShot = opts.OneShot
	}
	return l
}

var _ api.API = (*Local)(nil)

// engine returns the engine unless a one-shot hand-over or Close gave it up.
func (l *Local) engine() (*engine.Engine, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.E == nil {
		return nil, fmt.Errorf("%w: this API was closed or has handed its engine over (Options.OneShot)", engine.ErrClosed)
	}
	return l.E, nil
}

func (l *Local) Daemon(context.Context) (api.DaemonObject, bool, error) {
	return api.DaemonObject{}, false, nil
}

func (l *Local) List(context.Context) ([]api.Info, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	return e.List(), nil
}

func (l *Local) Get(_ context.Context, name string) (api.Info, error) {
	e, err := l.engine()
	if err != nil {
		return api.Info{}, err
	}
	vm, err := e.Get(name)
	if err != nil {
		return api.Info{}, err
	}
	return vm.Info(), nil
}

func (l *Local) Create(ctx context.Context, spec api.Spec) (api.Info, error) {
	e, err := l.engine()
	if err != nil {
		return api.Info{}, err
	}
	vm, err := e.Create(ctx, spec)
	if err != nil {
		return api.Info{}, err
	}
	return vm.Info(), nil
}

func (l *Local) Delete(ctx context.Context, name string) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	return e.Delete(ctx, name)
}

func (l *Local) Reap(ctx context.Context) ([]string, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	return e.Reap(ctx), nil
}

func (l *Local) Memory(ctx context.Context, name string) (*api.MemoryUsage, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	vm, err := e.Get(name)
	if err != nil {
		return nil, err
	}
	return vm.Memory(ctx)
}

// running returns the named VM, failing at once with ErrNotRunning for a dead one
// (instead of waiting for its agent).
func (l *Local) running(name string) (*engine.VM, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	vm, err := e.Get(name)
	if err != nil {
		return nil, err
	}
	switch vm.Info().State {
	case engine.StateDead:
		return nil, fmt.Errorf("%w: %s", engine.ErrNotRunning, name)
	case engine.StateParked:
		return nil, fmt.Errorf("%w: %s: wake it first (forkvm wake %s), or run a daemon (forkvm serve), which wakes it by itself", engine.ErrParked, name, name)
	}
	return vm, nil
}

// guestAgent is what an agent operation needs of a VM: the engine's VM, or in one-shot
// mode a connection of this API's own to its agent.
type guestAgent interface {
	CopyIn(ctx context.Context, dir string, r io.Reader) error
	CopyOut(ctx context.Context, p string, w io.Writer) error
	Stat(ctx context.Context, p string) (fs.FileInfo, error)
}

// agentFor returns how to reach the agent of the VM name: the engine's VM, or in
// one-shot mode the agent connection (vm nil), made at the first call after the engine
// was closed.
func (l *Local) agentFor(ctx context.Context, name string) (vm *engine.VM, c *vsockd.Client, err error) {
	if !l.oneShot {
		vm, err := l.running(name)
		return vm, nil, err
	}
	l.mu.Lock()
	if l.agent != nil {
		defer l.mu.Unlock()
		if l.agentOf != name {
			return nil, nil, fmt.Errorf("%w: this one-shot API is connected to %s's agent, not %s's", engine.ErrClosed, l.agentOf, name)
		}
		return nil, l.agent, nil
	}
	l.mu.Unlock()
	vm, err = l.running(name)
	if err != nil {
		return nil, nil, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		l.closed = true
		l.E.Close()
	}
	c, err = dialTarget(ctx, vm.Target())
	if err != nil {
		return nil, nil, err
	}
	l.agent, l.agentOf = c, name
	return nil, c, nil
}

func (l *Local) Exec(ctx context.Context, name string, req *api.ExecRequest) (int, error) {
	vm, c, err := l.agentFor(ctx, name)
	if err != nil {
		return -1, err
	}
	if c != nil {
		return c.Run(ctx, req)
	}
	return vm.Exec(ctx, req)
}

func (l *Local) Start(ctx context.Context, name string, req *api.ExecRequest) (api.Process, error) {
	vm, c, err := l.agentFor(ctx, name)
	if err != nil {
		return nil, err
	}
	if c != nil {
		p, err := c.Start(ctx, req)
		if err != nil {
			return nil, err
		}
		return p, nil
	}
	p, err := vm.Start(ctx, req)
	if err != nil {
		return nil, err
	}
	return p, nil
}

// files returns the agent operations for the VM name.
func (l *Local) files(ctx context.Context, name string) (guestAgent, error) {
	vm, c, err := l.agentFor(ctx, name)
	switch {
	case err != nil:
		return nil, err
	case c != nil:
		return c, nil
	}
	return vm, nil
}

func (l *Local) CopyIn(ctx context.Context, name, dir string, r io.Reader) error {
	g, err := l.files(ctx, name)
	if err != nil {
		return err
	}
	return g.CopyIn(ctx, dir, r)
}

func (l *Local) CopyInPath(ctx context.Context, name, hostPath, guestDir string) error {
	return tarstream.CopyInPath(ctx, hostPath, func(r io.Reader) error { return l.CopyIn(ctx, name, guestDir, r) })
}

func (l *Local) CopyOut(ctx context.Context, name, p string, w io.Writer) error {
	g, err := l.files(ctx, name)
	if err != nil {
		return err
	}
	return g.CopyOut(ctx, p, w)
}

func (l *Local) Stat(ctx context.Context, name, p string) (fs.FileInfo, error) {
	g, err := l.files(ctx, name)
	if err != nil {
		return nil, err
	}
	return g.Stat(ctx, p)
}

// Logs writes the VM's serial console to w. In one-shot mode the engine is closed
// first: a follow may be long, and it reads a file and watches the QEMU process only.
func (l *Local) Logs(ctx context.Context, name string, follow bool, w io.Writer) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	vm, err := e.Get(name)
	if err != nil {
		return err
	}
	if l.oneShot {
		l.mu.Lock()
		if !l.closed {
			l.closed = true
			l.E.Close()
		}
		l.mu.Unlock()
	}
	return vm.Logs(ctx, follow, w)
}

func (l *Local) Checkpoints(context.Context) ([]api.CheckpointInfo, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	return e.Checkpoints()
}

func (l *Local) GetCheckpoint(_ context.Context, name string) (api.CheckpointInfo, error) {
	e, err := l.engine()
	if err != nil {
		return api.CheckpointInfo{}, err
	}
	return e.CheckpointInfo(name)
}

func (l *Local) Checkpoint(ctx context.Context, vmName, name string, opts *api.CheckpointOptions) (api.CheckpointInfo, error) {
	e, err := l.engine()
	if err != nil {
		return api.CheckpointInfo{}, err
	}
	ck, err := e.Checkpoint(ctx, vmName, name, opts)
	if err != nil {
		return api.CheckpointInfo{}, err
	}
	if info, err := e.CheckpointInfo(ck.Name()); err == nil {
		return info, nil
	}
	return ck.Info(), nil
}

func (l *Local) DeleteCheckpoint(ctx context.Context, name string, opts *api.DeleteCheckpointOptions) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	return e.DeleteCheckpoint(ctx, name, opts)
}

func (l *Local) SetPinned(ctx context.Context, name string, pinned bool) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	return e.SetPinned(ctx, name, pinned)
}

func (l *Local) Budget(context.Context) (api.Budget, error) {
	e, err := l.engine()
	if err != nil {
		return api.Budget{}, err
	}
	return e.Budget(), nil
}

func (l *Local) Warm(ctx context.Context, ck string, n int, opts *api.WarmOptions) error {
	e, err := l.engine()
	if err != nil {
		return err
	}
	return e.Warm(ctx, ck, n, opts)
}

func (l *Local) PoolSize(ctx context.Context, ck string) (int, error) {
	e, err := l.engine()
	if err != nil {
		return 0, err
	}
	return e.PoolSize(ctx, ck)
}

func (l *Local) Fork(ctx context.Context, src string, opts *api.ForkOptions) (api.Info, error) {
	e, err := l.engine()
	if err != nil {
		return api.Info{}, err
	}
	vm, err := e.Fork(ctx, src, opts)
	if err != nil {
		return api.Info{}, err
	}
	return vm.Info(), nil
}

func (l *Local) ForkMany(ctx context.Context, src string, n int, opts *api.ManyOptions) (<-chan api.ForkEvent, error) {
	e, err := l.engine()
	if err != nil {
		return nil, err
	}
	evs, err := e.ForkMany(ctx, src, n, opts)
	if err != nil {
		return nil, err
	}
	return forkEvents(evs), nil
}

// forkEvents forwards the engine's fork events evs as the API's. Its channel has room
// for every event, as evs has (the engine sizes it by the wave's real count, len(Names)
// when n is 0), so that the forwarding goroutine ends even if the caller stops reading,
// as the engine's own does. Sized by the caller's n, it was unbuffered for n 0 with
// Names, and the goroutine leaked blocked on its first event.
func forkEvents(evs <-chan engine.ForkEvent) <-chan api.ForkEvent {
	out := make(chan api.ForkEvent, cap(evs))
	go func() {
		defer close(out)
		for ev := range evs {
			out <- ev.ForkEvent
		}
	}()
	return out
}

// Close closes the engine (VMs keep running) and a one-shot agent connection.
func (l *Local) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	var errs []error
	if l.agent != nil {
		errs = append(errs, l.agent.Close())
		l.agent = nil
	}
	if l.E == nil {
		return errors.New("local: Local without an engine")
	}
	if !l.closed {
		l.closed = true
		errs = append(errs, l.E.Close())
	}
	return errors.Join(errs...)
}

// dialTarget connects to the agent behind target. A virtio-serial port serves one host
// connection at a time and a second one waits unanswered: a port another client holds
// fails at once with ErrAgentBusy, and the handshake is bounded by handshakeTimeout.
func dialTarget(ctx context.Context, target engine.AgentTarget) (*vsockd.Client, error) {
	if target.Socket != "" && socketHeldFor(ctx, target.Socket, releaseWait) {
		return nil, fmt.Errorf("%w: %s's agent is connected to another client (a forkvm exec or cp, or a program embedding the engine); "+
			"run `forkvm serve` for any number of clients at once", engine.ErrAgentBusy, target.Name)
	}
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	c, err := engine.DialAgent(hctx, target)
	if err != nil && ctx.Err() == nil {
		return nil, fmt.Errorf("%w (is another client connected to %s's agent?)", err, target.Name)
	}
	return c, err
}

// handshakeTimeout bounds a one-shot API's connecting to an agent and its handshake.
const handshakeTimeout = 30 * time.Second

// releaseWait is how long a held agent port may take to be released: QEMU closes its
// side of a connection a client just closed (the previous forkvm exec) within moments.
const releaseWait = 2 * time.Second

// socketHeldFor reports whether path stays held (socketHeld) for d.
func socketHeldFor(ctx context.Context, path string, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for socketHeld(path) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}
