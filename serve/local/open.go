package local

import (
	"context"
	"errors"
	"fmt"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/serve/client"
)

// Options tune Open (and New: OneShot only). A nil *Options means defaults.
type Options struct {
	// Socket is where Open looks for a daemon; "" means the state directory's
	// (api.SocketPath).
	Socket string
	// RequireDaemon makes Open fail with ErrNoDaemon when no daemon answers on the
	// socket, instead of opening the engine here (for operations that only a daemon can
	// serve, such as a warm pool that must outlive this process).
	RequireDaemon bool
	// Hint, when set, is called once when another engine holds the state directory,
	// before Open waits up to the config's LockWait for it (so that a caller can say
	// who holds it and that it waits). A zero LockWait fails at once, without Hint.
	Hint func(held *engine.LockedError)
	// OneShot is for a program that does one operation with the API and ends, as the
	// forkvm CLI does. The first agent operation (Exec, Start, CopyIn, CopyOut, Stat) or
	// Logs closes the engine before it runs, so that the state directory is free for
	// other programs during a session or a copy that may be long; the operation then
	// reaches the VM's agent on a connection of its own (ErrAgentBusy when another
	// client holds a virtio-serial port) or reads its console. Later agent operations on
	// the same VM use that connection; anything else fails with ErrClosed.
	OneShot bool
	// AccelUnused is for an operation that starts no QEMU (a listing, an exec, a
	// delete): a daemon is used whatever cfg.Accel says, since the accelerator plays no
	// part in it. Without it a cfg.Accel other than "" or auto is refused by a daemon,
	// which chose its own (`forkvm --accel tcg ls` works while a daemon runs; `forkvm
	// --accel tcg create` is refused rather than silently booted otherwise).
	AccelUnused bool
}

// ErrNoDaemon is returned by Open with RequireDaemon when no daemon answers.
var ErrNoDaemon = errors.New("forkvm: no daemon")

// Open returns the API for a state directory (cfg.StateDir, else the engine's default):
// the daemon's client when a daemon answers on the directory's socket (or opts.Socket),
// else the engine opened in this process (engine.New(ctx, cfg), waiting up to
// cfg.LockWait for another engine holding the directory). A nil cfg or opts means
// defaults. Open never starts a daemon. With a daemon, the daemon's own configuration
// applies: a cfg.Accel other than "" or auto is refused (ErrInvalidSpec) rather than
// silently ignored, unless opts.AccelUnused.
func Open(ctx context.Context, cfg *engine.Config, opts *Options) (api.API, error) {
	var c engine.Config
	if cfg != nil {
		c = *cfg
	}
	var o Options
	if opts != nil {
		o = *opts
	}
	sock := o.Socket
	if sock == "" {
		dir := c.StateDir
		if dir == "" {
			dir = engine.DefaultStateDir()
		}
		sock = api.SocketPath(dir)
	}
	if client.Answers(ctx, sock) {
		if c.Accel != "" && c.Accel != engine.AccelAuto && !o.AccelUnused {
			return nil, fmt.Errorf("%w: the accelerator is chosen by the daemon on %s (forkvm serve --accel), not by its clients", engine.ErrInvalidSpec, sock)
		}
		return client.New(sock), nil
	}
	if o.RequireDaemon {
		return nil, fmt.Errorf("%w: no forkvm daemon answers on %s", ErrNoDaemon, sock)
	}
	wait := c.LockWait
	c.LockWait = 0
	e, err := engine.New(ctx, &c)
	var le *engine.LockedError
	if errors.As(err, &le) && wait > 0 && ctx.Err() == nil {
		if o.Hint != nil {
			o.Hint(le)
		}
		c.LockWait = wait
		e, err = engine.New(ctx, &c)
	}
	if err != nil {
		return nil, err
	}
	return New(e, &o), nil
}
