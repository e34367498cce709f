package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve"
	"github.com/forkvm/forkvm/vsockd"
)

// API is what a program (and the forkvm CLI) does with forkvm, with the same shapes
// whether the engine runs in this process (Local) or in a daemon (*Client). Open picks
// one. VMs and checkpoints are named; values are the engine's own types.
type API interface {
	// Daemon describes the daemon behind the API; ok is false for a Local one.
	Daemon(ctx context.Context) (d serve.DaemonObject, ok bool, err error)

	List(ctx context.Context) ([]engine.Info, error)
	Get(ctx context.Context, name string) (engine.Info, error)
	Create(ctx context.Context, spec engine.Spec) (engine.Info, error)
	Delete(ctx context.Context, name string) error
	// Reap deletes every VM whose QEMU is gone and returns their names.
	Reap(ctx context.Context) ([]string, error)
	Memory(ctx context.Context, name string) (*engine.MemoryUsage, error)

	// Exec runs a command to completion (vsockd.Client.Run: 127/126 for a command
	// not found / not executable, 128+N for a signal).
	Exec(ctx context.Context, name string, req *vsockd.ExecRequest) (int, error)
	// Start starts a command and returns once it runs; ctx bounds the start only. The
	// Process streams req.Stdin to it and its output to req.Stdout/Stderr.
	Start(ctx context.Context, name string, req *vsockd.ExecRequest) (Process, error)

	// CopyIn extracts the tar stream r into the guest directory dir.
	CopyIn(ctx context.Context, name, dir string, r io.Reader) error
	// CopyOut writes the guest path p as a tar stream to w.
	CopyOut(ctx context.Context, name, p string, w io.Writer) error
	// Stat returns a guest path's attributes; a missing path matches fs.ErrNotExist.
	Stat(ctx context.Context, name, p string) (fs.FileInfo, error)
	// Logs writes the VM's serial console to w (engine.VM.Logs).
	Logs(ctx context.Context, name string, follow bool, w io.Writer) error

	Checkpoints(ctx context.Context) ([]engine.CheckpointInfo, error)
	GetCheckpoint(ctx context.Context, name string) (engine.CheckpointInfo, error)
	Checkpoint(ctx context.Context, vmName, name string, opts *engine.CheckpointOptions) (engine.CheckpointInfo, error)
	DeleteCheckpoint(ctx context.Context, name string, opts *engine.DeleteCheckpointOptions) error
	SetPinned(ctx context.Context, name string, pinned bool) error

	// Budget is the vCPU admission budget.
	Budget(ctx context.Context) (engine.Budget, error)
	// Warm keeps n pooled processes for checkpoint ck (engine.Engine.Warm); a pool lives
	// as long as its engine: the daemon, or the Local API until Close.
	Warm(ctx context.Context, ck string, n int, opts *engine.WarmOptions) error
	PoolSize(ctx context.Context, ck string) (int, error)

	Fork(ctx context.Context, src string, opts *engine.ForkOptions) (engine.Info, error)
	ForkMany(ctx context.Context, src string, n int, opts *engine.ManyOptions) (<-chan ForkEvent, error)

	// Close releases the API: a Local one closes its engine (VMs keep running).
	Close() error
}

// Process is a command started with API.Start.
type Process interface {
	// Wait waits for the command and returns its exit code; if ctx ends first the
	// command is killed and ctx's error returned.
	Wait(ctx context.Context) (int, error)
	// Signal sends sig to the command's process group.
	Signal(ctx context.Context, sig int) error
	// Resize changes the command's terminal size (TTY only).
	Resize(ctx context.Context, rows, cols uint16) error
}

// ForkEvent is one fork of a wave: ready (VM set) or failed (Err set). Index -1 reports
// a broken stream.
type ForkEvent struct {
	Index   int
	Name    string
	VM      *engine.Info
	Err     error
	Latency time.Duration
	Timings engine.PhaseTimings
}

// Open returns the API for a state directory (cfg.StateDir, else the engine's default):
// the daemon's client when a daemon answers on the directory's socket, else the engine
// opened in this process (engine.New(ctx, cfg)). A nil cfg means defaults. Open never
// starts a daemon.
func Open(ctx context.Context, cfg *engine.Config) (API, error) {
	var c engine.Config
	if cfg != nil {
		c = *cfg
	}
	dir := c.StateDir
	if dir == "" {
		dir = engine.DefaultStateDir()
	}
	sock := serve.SocketPath(dir)
	if Answers(ctx, sock) {
		return New(sock), nil
	}
	e, err := engine.New(ctx, &c)
	if err != nil {
		return nil, err
	}
	return NewLocal(e), nil
}

// Answers reports whether a daemon accepts connections on the unix socket path (a
// socket file left by a daemon that died refuses them).
func Answers(ctx context.Context, socket string) bool {
	if fi, err := os.Stat(socket); err != nil || fi.Mode().Type() != fs.ModeSocket {
		return false
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(dctx, "unix", socket)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// Local is the API of an engine in this process.
type Local struct{ E *engine.Engine }

// NewLocal returns the API of e; Close closes e.
func NewLocal(e *engine.Engine) *Local { return &Local{E: e} }

var _ API = (*Local)(nil)
var _ API = (*Client)(nil)

func (l *Local) Daemon(context.Context) (serve.DaemonObject, bool, error) {
	return serve.DaemonObject{}, false, nil
}

func (l *Local) List(context.Context) ([]engine.Info, error) { return l.E.List(), nil }

func (l *Local) Get(_ context.Context, name string) (engine.Info, error) {
	vm, err := l.E.Get(name)
	if err != nil {
		return engine.Info{}, err
	}
	return vm.Info(), nil
}

func (l *Local) Create(ctx context.Context, spec engine.Spec) (engine.Info, error) {
	vm, err := l.E.Create(ctx, spec)
	if err != nil {
		return engine.Info{}, err
	}
	return vm.Info(), nil
}

func (l *Local) Delete(ctx context.Context, name string) error { return l.E.Delete(ctx, name) }

func (l *Local) Reap(ctx context.Context) ([]string, error) { return l.E.Reap(ctx), nil }

func (l *Local) Memory(ctx context.Context, name string) (*engine.MemoryUsage, error) {
	vm, err := l.E.Get(name)
	if err != nil {
		return nil, err
	}
	return vm.Memory(ctx)
}

// Running returns the named VM, failing at once with ErrNotRunning for a dead one
// (instead of waiting for its agent).
func (l *Local) Running(name string) (*engine.VM, error) {
	vm, err := l.E.Get(name)
	if err != nil {
		return nil, err
	}
	if vm.Info().State == engine.StateDead {
		return nil, fmt.Errorf("%w: %s", engine.ErrNotRunning, name)
	}
	return vm, nil
}

func (l *Local) Exec(ctx context.Context, name string, req *vsockd.ExecRequest) (int, error) {
	vm, err := l.Running(name)
	if err != nil {
		return -1, err
	}
	return vm.Exec(ctx, req)
}

func (l *Local) Start(ctx context.Context, name string, req *vsockd.ExecRequest) (Process, error) {
	vm, err := l.Running(name)
	if err != nil {
		return nil, err
	}
	p, err := vm.Start(ctx, req)
	if err != nil {
		return nil, err
	}
	return p, nil
}

func (l *Local) CopyIn(ctx context.Context, name, dir string, r io.Reader) error {
	vm, err := l.Running(name)
	if err != nil {
		return err
	}
	return vm.CopyIn(ctx, dir, r)
}

func (l *Local) CopyOut(ctx context.Context, name, p string, w io.Writer) error {
	vm, err := l.Running(name)
	if err != nil {
		return err
	}
	return vm.CopyOut(ctx, p, w)
}

func (l *Local) Stat(ctx context.Context, name, p string) (fs.FileInfo, error) {
	vm, err := l.Running(name)
	if err != nil {
		return nil, err
	}
	return vm.Stat(ctx, p)
}

func (l *Local) Logs(ctx context.Context, name string, follow bool, w io.Writer) error {
	vm, err := l.E.Get(name)
	if err != nil {
		return err
	}
	return vm.Logs(ctx, follow, w)
}

func (l *Local) Checkpoints(context.Context) ([]engine.CheckpointInfo, error) {
	return l.E.Checkpoints()
}

func (l *Local) GetCheckpoint(_ context.Context, name string) (engine.CheckpointInfo, error) {
	return l.E.CheckpointInfo(name)
}

func (l *Local) Checkpoint(ctx context.Context, vmName, name string, opts *engine.CheckpointOptions) (engine.CheckpointInfo, error) {
	ck, err := l.E.Checkpoint(ctx, vmName, name, opts)
	if err != nil {
		return engine.CheckpointInfo{}, err
	}
	if info, err := l.E.CheckpointInfo(ck.Manifest.Name); err == nil {
		return info, nil
	}
	return engine.CheckpointInfo{CheckpointManifest: ck.Manifest}, nil
}

func (l *Local) DeleteCheckpoint(ctx context.Context, name string, opts *engine.DeleteCheckpointOptions) error {
	return l.E.DeleteCheckpoint(ctx, name, opts)
}

func (l *Local) SetPinned(ctx context.Context, name string, pinned bool) error {
	return l.E.SetPinned(ctx, name, pinned)
}

func (l *Local) Budget(context.Context) (engine.Budget, error) { return l.E.Budget(), nil }

func (l *Local) Warm(ctx context.Context, ck string, n int, opts *engine.WarmOptions) error {
	return l.E.Warm(ctx, ck, n, opts)
}

func (l *Local) PoolSize(_ context.Context, ck string) (int, error) {
	if _, err := l.E.LoadCheckpoint(ck); err != nil {
		return 0, err
	}
	return l.E.PoolSize(ck), nil
}

func (l *Local) Fork(ctx context.Context, src string, opts *engine.ForkOptions) (engine.Info, error) {
	vm, err := l.E.Fork(ctx, src, opts)
	if err != nil {
		return engine.Info{}, err
	}
	return vm.Info(), nil
}

func (l *Local) ForkMany(ctx context.Context, src string, n int, opts *engine.ManyOptions) (<-chan ForkEvent, error) {
	evs, err := l.E.ForkMany(ctx, src, n, opts)
	if err != nil {
		return nil, err
	}
	out := make(chan ForkEvent, n)
	go func() {
		defer close(out)
		for ev := range evs {
			fe := ForkEvent{Index: ev.Index, Name: ev.Name, Err: ev.Err, Latency: ev.Latency(), Timings: ev.Timings}
			if ev.VM != nil && ev.Err == nil {
				inf := ev.VM.Info()
				fe.VM = &inf
			}
			out <- fe
		}
	}()
	return out, nil
}

func (l *Local) Close() error {
	if l.E == nil {
		return errors.New("client: Local without an engine")
	}
	return l.E.Close()
}
