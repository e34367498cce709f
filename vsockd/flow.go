package vsockd

import (
	"context"
	"encoding/binary"
	"errors"
	"sync"
)

// maxQueuedFrames bounds the number of frames (data or control) queued on one
// stream, so that a peer cannot grow memory with endless empty frames.
const maxQueuedFrames = 1024

// errOverrun is reported when a peer exceeds its flow-control window.
var errOverrun = errors.New("vsockd: peer exceeded flow-control window")

// inbox is the per-stream receive queue. The connection reader pushes frames
// without ever blocking; the stream's consumer pops them in order. Data bytes
// stay accounted until the consumer calls release, which is when credit is
// returned to the peer, so an honest peer can never overrun the inbox and a
// dishonest one is detected by push.
type inbox struct {
	mu     sync.Mutex
	q      []Frame
	bytes  int64 // unreleased data bytes
	ctrl   int64 // queued control payload bytes
	err    error // terminal error, reported once the queue is drained (or at once if hard)
	hard   bool  // report err before queued frames
	signal chan struct{}
}

func newInbox() *inbox { return &inbox{signal: make(chan struct{}, 1)} }

func (b *inbox) wake() {
	select {
	case b.signal <- struct{}{}:
	default:
	}
}

// push queues f, taking its payload (the caller must not reuse it). It returns
// errOverrun if the peer exceeded its window or the frame count limit; the caller
// then resets the stream.
//
// An honest peer keeps within its byte window but may spend it one byte a frame (a
// host's stdin fed by a producer of short lines, a command printing a line at a
// time) while the consumer is busy: counted frame by frame that overran
// maxQueuedFrames with a few KiB queued, and the stream was reset, its command
// killed. So once the queue is half full a data frame joins the latest queued frame
// of its type (see merge), and empty data frames, which carry nothing, are dropped:
// data then queues as many bytes as the window allows in a bounded number of frames,
// and only control frames count towards the limit.
func (b *inbox) push(f Frame) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return nil // stream is finished; drop late frames
	}
	if f.Type.isData() {
		if b.bytes+int64(len(f.Payload)) > InitialWindow {
			return errOverrun
		}
		if len(f.Payload) == 0 {
			return nil
		}
		b.bytes += int64(len(f.Payload))
		if len(b.q) >= maxQueuedFrames/2 && b.merge(f) {
			b.wake()
			return nil
		}
	} else {
		// Control frames are not flow controlled: bound what they may queue too, or a
		// peer could park up to maxQueuedFrames*MaxPayload bytes on one stream.
		if b.ctrl+int64(len(f.Payload)) > InitialWindow {
			return errOverrun
		}
		b.ctrl += int64(len(f.Payload))
	}
	if len(b.q) >= maxQueuedFrames {
		return errOverrun
	}
	b.q = append(b.q, f)
	b.wake()
	return nil
}

// merge appends the data frame f to the latest queued frame of its type, unless a
// control frame was queued after that one (data never moves past a control frame:
// Stdin past StdinClose, Stdout past Exit). Data frames of other types may lie
// between: their bytes are from another pipe, whose order against f's the peer's
// separate readers never fixed. It reports whether f was merged. The caller holds
// b.mu.
func (b *inbox) merge(f Frame) bool {
	for i := len(b.q) - 1; i >= 0; i-- {
		q := &b.q[i]
		switch {
		case !q.Type.isData():
			return false
		case q.Type == f.Type:
			q.Payload = append(q.Payload, f.Payload...)
			return true
		}
	}
	return false
}

// pop returns the next frame, waiting until one is queued, the inbox fails or
// ctx is done.
func (b *inbox) pop(ctx context.Context) (Frame, error) {
	for {
		b.mu.Lock()
		if b.err != nil && (b.hard || len(b.q) == 0) {
			err := b.err
			b.mu.Unlock()
			return Frame{}, err
		}
		if len(b.q) > 0 {
			f := b.q[0]
			b.q[0] = Frame{}
			b.q = b.q[1:]
			if !f.Type.isData() {
				b.ctrl -= int64(len(f.Payload))
			}
			b.mu.Unlock()
			return f, nil
		}
		b.mu.Unlock()
		select {
		case <-b.signal:
		case <-ctx.Done():
			return Frame{}, ctx.Err()
		}
	}
}

// release marks n data bytes as consumed.
func (b *inbox) release(n int) {
	b.mu.Lock()
	b.bytes -= int64(n)
	b.mu.Unlock()
}

// fail terminates the inbox with err. With hard set, queued frames are
// discarded; otherwise they are delivered first. The first error wins.
func (b *inbox) fail(err error, hard bool) {
	b.mu.Lock()
	if b.err == nil {
		b.err, b.hard = err, hard
		if hard {
			b.q = nil
		}
	}
	b.mu.Unlock()
	b.wake()
}

// window is the send-side credit granted by the peer for one stream.
type window struct {
	mu     sync.Mutex
	avail  int64
	err    error
	signal chan struct{}
}

func newWindow() *window { return &window{avail: InitialWindow, signal: make(chan struct{}, 1)} }

// add grants n more bytes of credit.
func (w *window) add(n uint32) {
	w.mu.Lock()
	w.avail += int64(n)
	if w.avail > 1<<40 { // absurd grants from a broken peer: clamp, never overflow
		w.avail = 1 << 40
	}
	w.mu.Unlock()
	select {
	case w.signal <- struct{}{}:
	default:
	}
}

// close makes pending and future acquires fail with err.
func (w *window) close(err error) {
	w.mu.Lock()
	if w.err == nil {
		w.err = err
	}
	w.mu.Unlock()
	select {
	case w.signal <- struct{}{}:
	default:
	}
}

// acquire waits for credit and takes up to n bytes of it (at least 1).
func (w *window) acquire(ctx context.Context, n int) (int, error) {
	for {
		w.mu.Lock()
		if w.err != nil {
			err := w.err
			w.mu.Unlock()
			return 0, err
		}
		if w.avail > 0 {
			k := int64(n)
			if k > w.avail {
				k = w.avail
			}
			w.avail -= k
			w.mu.Unlock()
			return int(k), nil
		}
		w.mu.Unlock()
		select {
		case <-w.signal:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

// windowFrame returns a Window frame granting n bytes on stream id.
func windowFrame(id uint32, n int) Frame {
	return Frame{Type: TypeWindow, Stream: id, Payload: binary.BigEndian.AppendUint32(nil, uint32(n))}
}

// parseWindow decodes a Window payload.
func parseWindow(p []byte) (uint32, bool) {
	if len(p) != 4 {
		return 0, false
	}
	return binary.BigEndian.Uint32(p), true
}
