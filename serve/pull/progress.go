package pull

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"
)

// ErrStalled reports a holder that sent nothing (no response, no byte of a body) for a
// pull's progress deadline (Options.ProgressTimeout): a stalled peer fails the pull
// instead of hanging it. Its errors also match context.DeadlineExceeded (the daemon
// answers them 504 timeout).
var ErrStalled = errors.New("pull: the holder stalled")

// stallError is a watchdog's cause: no byte for d.
type stallError struct{ d time.Duration }

func (e *stallError) Error() string {
	return fmt.Sprintf("%v: nothing received for %v (the progress deadline)", ErrStalled, e.d)
}

func (e *stallError) Unwrap() []error { return []error{ErrStalled, context.DeadlineExceeded} }

// watchdog cancels its context when nothing touched it for d.
type watchdog struct {
	d      time.Duration
	t      *time.Timer
	cancel context.CancelCauseFunc
}

// progressKey carries a watchdog's touch in a request's context, so that a Source reading
// a response body (remote's) reports each byte as progress.
type progressKey struct{}

// watch starts a watchdog over one remote read: the returned context ends with a
// *stallError cause once d passes without a touch. Stop it when the read is done.
func watch(ctx context.Context, d time.Duration) (context.Context, *watchdog) {
	wctx, cancel := context.WithCancelCause(ctx)
	w := &watchdog{d: d, cancel: cancel}
	w.t = time.AfterFunc(d, func() { cancel(&stallError{d: d}) })
	return context.WithValue(wctx, progressKey{}, w.touch), w
}

// touch records progress: the deadline starts again.
func (w *watchdog) touch() { w.t.Reset(w.d) }

// stop ends the watchdog and its context.
func (w *watchdog) stop() {
	w.t.Stop()
	w.cancel(nil)
}

// stalled returns err as the stall it is when ctx's watchdog ended it (ctx's cause),
// else err.
func stalled(ctx context.Context, err error) error {
	var se *stallError
	if errors.As(context.Cause(ctx), &se) {
		return se
	}
	return err
}

// progressOf is the touch a watchdog put in ctx, or a no-op.
func progressOf(ctx context.Context) func() {
	if f, ok := ctx.Value(progressKey{}).(func()); ok {
		return f
	}
	return func() {}
}

// progressReader touches its watchdog on every read that returns bytes.
type progressReader struct {
	r     io.Reader
	touch func()
}

func (p progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	if n > 0 {
		p.touch()
	}
	return n, err
}

// progressBody is a response body whose reads touch a watchdog.
type progressBody struct {
	progressReader
	io.Closer
}
