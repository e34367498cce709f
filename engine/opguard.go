package engine

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// opGuard tracks the engine's operations under way that start QEMUs or write its state
// (creates, forks and waves, checkpoints, imports, restores, wakes, parks, deletes, ...),
// so that Close can end them before it releases the state directory: an operation it
// let run on would start its QEMU, or write and remove its files, with the directory's
// lock gone (another engine may hold it by then), and register its VM with an engine
// that no longer serves it. Close refuses new operations, cancels those under way and
// waits for them; each cleans up after itself (its QEMU killed, its files removed)
// before it leaves. Things that outlive one call (an import between its calls) are
// held: Close ends them once no operation is under way. The zero value is ready for
// use.
type opGuard struct {
	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
	// under holds every operation under way; held every thing held, with what ends it.
	under map[*opTicket]bool
	held  map[*opTicket]func()
}

// opTicket is one operation under way, or one thing held.
type opTicket struct{ cancel context.CancelCauseFunc }

// errEngineClosing is the cause an operation under way is cancelled with by Close.
var errEngineClosing = fmt.Errorf("%w: the engine was closed while the operation ran", ErrClosed)

// closing reports whether ctx (an operation's, from opGuard.enter) was ended by Close.
func closing(ctx context.Context) bool {
	return errors.Is(context.Cause(ctx), errEngineClosing)
}

// closedErr is err as an operation named what reports it, ctx being its context: one
// that Close ended (ctx's cause) wraps ErrClosed, whatever its clean-up failed with.
func closedErr(ctx context.Context, what string, err error) error {
	if err != nil && !errors.Is(err, ErrClosed) && closing(ctx) {
		return fmt.Errorf("engine: %s: %w: %w", what, errEngineClosing, err)
	}
	return err
}

// enter registers an operation named what ("create c1", for its errors): it returns
// the context to run under (cancelled, with errEngineClosing as its cause, when the
// engine closes) and leave, to call once the operation succeeded or cleaned up after
// itself, with its error: leave returns the error to report (one wrapping ErrClosed
// when Close ended it). ErrClosed once the engine closed. enter never waits, so an
// operation may enter again (a fork's implicit checkpoint, a delete's forks).
func (g *opGuard) enter(ctx context.Context, what string) (context.Context, func(err error) error, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, nil, fmt.Errorf("engine: %s: %w", what, ErrClosed)
	}
	if g.under == nil {
		g.under = map[*opTicket]bool{}
	}
	cctx, cancel := context.WithCancelCause(ctx)
	t := &opTicket{cancel: cancel}
	g.under[t] = true
	g.wg.Add(1)
	return cctx, func(err error) error {
		err = closedErr(cctx, what, err)
		g.mu.Lock()
		delete(g.under, t)
		g.mu.Unlock()
		cancel(nil)
		g.wg.Done()
		return err
	}, nil
}

// hold registers a thing that outlives one call (an import open between its calls),
// which Close ends with end once no operation is under way (no call of it runs then,
// each being an operation). release drops it (it is done). ErrClosed once the engine
// closed.
func (g *opGuard) hold(end func()) (release func(), err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, ErrClosed
	}
	if g.held == nil {
		g.held = map[*opTicket]func(){}
	}
	t := &opTicket{}
	g.held[t] = end
	return func() {
		g.mu.Lock()
		delete(g.held, t)
		g.mu.Unlock()
	}, nil
}

// close refuses new operations, cancels those under way, waits until each has left,
// then ends what is held.
func (g *opGuard) close() {
	g.mu.Lock()
	g.closed = true
	for t := range g.under {
		t.cancel(errEngineClosing)
	}
	g.mu.Unlock()
	g.wg.Wait()
	g.mu.Lock()
	held := g.held
	g.held = nil
	g.mu.Unlock()
	for _, end := range held {
		end()
	}
}

// op enters e's operation guard (opGuard.enter) for an operation named what.
func (e *Engine) op(ctx context.Context, what string) (context.Context, func(err error) error, error) {
	return e.ops.enter(ctx, what)
}
