package vsockd

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
)

// DefaultMaxOutput is the default ClientConfig.MaxOutput.
const DefaultMaxOutput = 64 << 20

// ExitCodeTimeout is the exit code reported for a process killed because its
// ExecRequest.Timeout expired (like timeout(1)).
const ExitCodeTimeout = api.ExitCodeTimeout

// writeStall bounds one frame write: a connection that accepts no bytes for
// this long is considered lost (the agent never blocks its reader, so only a
// dead or wedged guest stalls writes).
const writeStall = 15 * time.Second

// closeGrace is how long Close waits for a frame being written to finish, so
// that closing never leaves half a frame on a virtio-serial port.
const closeGrace = 2 * time.Second

// maxResyncSkip bounds the bytes a new client discards before the first valid
// frame: at most the tail of one frame an earlier connection left behind.
const maxResyncSkip = HeaderSize + MaxPayload

// ClientConfig tunes a Client. A nil *ClientConfig selects the defaults.
type ClientConfig struct {
	// MaxOutput bounds the stdout+stderr bytes copied per exec; 0 selects
	// DefaultMaxOutput, a negative value disables the limit. An exec that
	// exceeds it is killed and fails with ErrOutputLimit.
	// ExecRequest.MaxOutput overrides it per exec.
	MaxOutput int64
	// ReadTimeout, if positive, additionally bounds waiting for the replies
	// to Hello and Ping.
	ReadTimeout time.Duration
	// TimeoutGrace is how long after an ExecRequest.Timeout the host waits for
	// the guest to report the command's end (0: DefaultTimeoutGrace). Past it,
	// Wait sends the command SIGKILL itself (see Process.Signal) and returns
	// ExitCodeTimeout with an error: a guest too loaded to run its own timer (a
	// fork bomb) cannot stretch the timeout.
	TimeoutGrace time.Duration
}

// DefaultTimeoutGrace is the default ClientConfig.TimeoutGrace.
const DefaultTimeoutGrace = 5 * time.Second

// Hello is the host's session greeting. Sending it resets the guest session.
type Hello struct {
	Token    [16]byte  // echoed by the guest
	Entropy  []byte    // mixed into the guest CRNG; nil: 32 fresh random bytes
	Time     time.Time // guest wall clock is set to this (PID 1 only); zero: now
	Hostname string    // guest hostname (PID 1 only); empty: unchanged
}

// HelloReply is the guest's answer to Hello.
type HelloReply struct {
	Version int
	Token   [16]byte
	BootID  string
	Uptime  time.Duration
	// Features lists what the agent supports beyond the version's base
	// (FeatureExecUser, FeatureCopy); empty for agents that predate them.
	Features []string
}

// ExecRequest is a command to run in the guest (api.ExecRequest documents its
// fields): the engine, the daemon and its client take the same value.
type ExecRequest = api.ExecRequest

// Client is the host side of an agent connection. All methods are safe for
// concurrent use; any number of execs and file transfers may be in flight
// over the one connection (a virtio-serial port admits a single host
// connection, so a VM's users share one Client).
//
// Concurrency design:
//   - Every request (Hello, Ping, exec, file transfer) gets its own stream id;
//     all its frames in both directions carry that id. Ids start at a random
//     value, so frames a previous connection left in flight never match a
//     stream of this one.
//   - One reader goroutine decodes frames and hands each to its stream's
//     inbox without ever blocking (see inbox); flow-control credit (window)
//     keeps every inbox bounded, so a stream whose consumer is slow (a
//     blocked Stdout writer) stalls only that stream. Frames of streams that
//     are unknown (finished, cancelled) are discarded by id.
//   - One writer goroutine writes frames, each whole with a single Write.
//     Callers hand it a frame and may stop waiting when their ctx ends; the
//     frame is then written whole or not at all, never in part. Cancelling
//     one exec (ctx, output limit, failing writer) therefore only resets its
//     stream: the guest kills the process, and the connection stays in sync
//     for the others and for the next exec.
//   - A broken connection (EOF, I/O error, corrupt stream, write stalled for
//     writeStall) fails every pending operation with ErrConnLost and makes
//     the client Done; callers such as engine.VM redial.
type Client struct {
	conn         net.Conn
	maxOutput    int64
	readTimeout  time.Duration
	timeoutGrace time.Duration

	wq  chan *wreq // to the writer goroutine
	wmu sync.Mutex // held by the writer while a frame is being written

	synced atomic.Bool // a valid frame for a known stream was received

	ctx    context.Context // canceled when the client fails or is closed
	cancel context.CancelFunc

	mu      sync.Mutex
	streams map[uint32]*cstream
	nextID  uint32
	err     error // terminal error, set once
	// features are those the last HelloReply listed; nil before a Hello.
	features map[string]bool
}

// wreq is one frame handed to the writer goroutine.
type wreq struct {
	ctx  context.Context
	b    []byte
	done chan error // buffered
}

type cstream struct {
	id  uint32
	in  *inbox
	win *window
}

// NewClient starts a client on conn. The client owns conn and closes it on
// Close or on a fatal protocol error.
func NewClient(conn net.Conn, cfg *ClientConfig) *Client {
	var rb [4]byte
	rand.Read(rb[:])
	c := &Client{
		conn:      conn,
		maxOutput: DefaultMaxOutput,
		wq:        make(chan *wreq),
		streams:   make(map[uint32]*cstream),
		nextID:    binary.BigEndian.Uint32(rb[:]) >> 1, // >> 1: leave room before wrapping
	}
	if cfg != nil {
		if cfg.MaxOutput != 0 {
			c.maxOutput = cfg.MaxOutput
		}
		c.readTimeout = cfg.ReadTimeout
		c.timeoutGrace = cfg.TimeoutGrace
	}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	go c.readLoop()
	go c.writeLoop()
	return c
}

// Close closes the connection; pending operations fail with ErrClosed.
func (c *Client) Close() error {
	c.fail(ErrClosed)
	return nil
}

// Done is closed when the client has failed or been closed.
func (c *Client) Done() <-chan struct{} { return c.ctx.Done() }

// Err returns the error that terminated the client, or nil.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *Client) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	streams := c.streams
	c.streams = map[uint32]*cstream{}
	c.mu.Unlock()
	c.cancel()
	if err == ErrClosed {
		// Let a frame being written finish (the writer takes no new one
		// after cancel), so the peer never sees half a frame.
		idle := make(chan struct{})
		go func() {
			c.wmu.Lock()
			//lint:ignore SA2001 taking the write lock is the wait: the frame being written is done once it is free
			c.wmu.Unlock()
			close(idle)
		}()
		select {
		case <-idle:
		case <-time.After(closeGrace):
		}
	}
	c.conn.Close()
	for _, st := range streams {
		st.in.fail(err, true)
		st.win.close(err)
	}
}

// readLoop decodes frames until the connection fails. Before the first
// valid frame of one of its streams it skips up to maxResyncSkip bytes of
// non-frames (the tail of a frame an earlier connection left on a
// virtio-serial port); afterwards a corrupt frame fails the connection.
func (c *Client) readLoop() {
	d := NewDecoder(c.conn)
	d.maxSkip = maxResyncSkip
	for {
		f, err := d.ReadFrame()
		if err != nil {
			var fe *FrameError
			if errors.As(err, &fe) {
				if fe.Version > 0 && fe.Version < ProtocolVersion {
					c.fail(fmt.Errorf("%w: %w (the guest agent speaks protocol version %d, this host %d: rebuild the guest image)",
						ErrConnLost, err, fe.Version, ProtocolVersion))
					return
				}
				// Only ErrBadFrame can be stale bytes; an oversize length
				// behind a valid checksum is a broken peer.
				if errors.Is(err, ErrBadFrame) && !c.synced.Load() && d.Skipped() <= maxResyncSkip {
					continue
				}
			}
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			c.fail(fmt.Errorf("%w: %w", ErrConnLost, err))
			return
		}
		c.dispatch(f)
	}
}

// writeLoop writes the frames handed to send, each whole.
func (c *Client) writeLoop() {
	for {
		var r *wreq
		select {
		case r = <-c.wq:
		case <-c.ctx.Done():
			return
		}
		if err := r.ctx.Err(); err != nil {
			r.done <- err // abandoned before its first byte: not written at all
			continue
		}
		if err := c.Err(); err != nil {
			r.done <- err
			return
		}
		c.wmu.Lock()
		stall := time.AfterFunc(writeStall, func() {
			c.fail(fmt.Errorf("%w: write stalled for %v", ErrConnLost, writeStall))
		})
		_, err := c.conn.Write(r.b)
		stall.Stop()
		c.wmu.Unlock()
		if err != nil {
			c.fail(fmt.Errorf("%w: write: %w", ErrConnLost, err))
			r.done <- c.Err()
			return
		}
		r.done <- nil
	}
}

// dispatch routes f to its stream. It must never block.
func (c *Client) dispatch(f Frame) {
	c.mu.Lock()
	st := c.streams[f.Stream]
	c.mu.Unlock()
	if st == nil {
		return // stream 0 diagnostics or late frames of a finished stream
	}
	c.synced.Store(true)
	switch f.Type {
	case TypeWindow:
		n, ok := parseWindow(f.Payload)
		if !ok {
			c.abort(st, fmt.Errorf("%w: bad window frame", ErrProtocol), true)
			return
		}
		st.win.add(n)
		return
	case TypeReset:
		c.abort(st, ErrStreamReset, false)
		return
	case TypeError:
		// Wake senders blocked on credit; the error itself is delivered
		// through the inbox in order.
		st.win.close(decodeRemoteError(f.Payload))
	}
	if err := st.in.push(f); err != nil {
		c.abort(st, fmt.Errorf("%w: %v", ErrProtocol, err), true)
	}
}

// abort terminates st with err and, if sendReset, tells the guest to drop it
// (which kills its process). It never blocks.
func (c *Client) abort(st *cstream, err error, sendReset bool) {
	st.in.fail(err, true)
	st.win.close(err)
	c.mu.Lock()
	if c.streams[st.id] == st {
		delete(c.streams, st.id)
	}
	c.mu.Unlock()
	if sendReset {
		go func() {
			ctx, cancel := context.WithTimeout(c.ctx, 5*time.Second)
			defer cancel()
			c.send(ctx, Frame{Type: TypeReset, Stream: st.id})
		}()
	}
}

// finish removes a stream that ended normally.
func (c *Client) finish(st *cstream) {
	st.in.fail(ErrClosed, true)
	st.win.close(ErrClosed)
	c.mu.Lock()
	if c.streams[st.id] == st {
		delete(c.streams, st.id)
	}
	c.mu.Unlock()
}

func (c *Client) newStream() (*cstream, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return nil, c.err
	}
	id := c.nextID
	for id == 0 || c.streams[id] != nil {
		id++
	}
	c.nextID = id + 1
	st := &cstream{id: id, in: newInbox(), win: newWindow()}
	c.streams[id] = st
	return st, nil
}

// send writes one frame, whole. It returns when the frame is written, or
// with ctx's error when ctx ends first: the frame is then either written
// whole later or dropped before its first byte, never cut (see Client).
func (c *Client) send(ctx context.Context, f Frame) error {
	b, err := AppendFrame(nil, f)
	if err != nil {
		return err
	}
	r := &wreq{ctx: ctx, b: b, done: make(chan error, 1)}
	select {
	case c.wq <- r:
	case <-ctx.Done():
		return ctx.Err()
	case <-c.ctx.Done():
		return c.Err()
	}
	select {
	case err := <-r.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-c.ctx.Done():
		return c.Err()
	}
}

func (c *Client) sendJSON(ctx context.Context, t FrameType, id uint32, v any) error {
	p, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return c.send(ctx, Frame{Type: t, Stream: id, Payload: p})
}

func decodeRemoteError(p []byte) error {
	var e errorWire
	if err := json.Unmarshal(p, &e); err != nil {
		return fmt.Errorf("%w: undecodable error frame", ErrProtocol)
	}
	return &RemoteError{Code: e.Code, Message: e.Message}
}

// expect pops the next frame of st and checks its type. Error frames become
// *RemoteError.
func (c *Client) expect(ctx context.Context, st *cstream, want FrameType) (Frame, error) {
	f, err := st.in.pop(ctx)
	if err != nil {
		return f, err
	}
	switch f.Type {
	case want:
		return f, nil
	case TypeError:
		return f, decodeRemoteError(f.Payload)
	}
	return f, fmt.Errorf("%w: got %v, want %v", ErrProtocol, f.Type, want)
}

// Hello performs the session handshake. It resets the guest session: all
// guest processes of the previous session are killed, and all operations
// still pending on this client fail with ErrSessionReset. It fails with an
// error wrapping ErrTokenMismatch if the guest echoes a different token.
func (c *Client) Hello(ctx context.Context, h Hello) (*HelloReply, error) {
	if c.readTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.readTimeout)
		defer cancel()
	}
	c.mu.Lock()
	old := c.streams
	if c.err == nil {
		c.streams = make(map[uint32]*cstream)
	}
	c.mu.Unlock()
	for _, st := range old {
		st.in.fail(ErrSessionReset, true)
		st.win.close(ErrSessionReset)
	}
	w := helloWire{Version: ProtocolVersion, Token: h.Token[:], Entropy: h.Entropy, TimeNs: h.Time.UnixNano(), Hostname: h.Hostname}
	if len(w.Entropy) == 0 {
		w.Entropy = make([]byte, 32)
		rand.Read(w.Entropy)
	}
	if h.Time.IsZero() {
		w.TimeNs = time.Now().UnixNano()
	}
	st, err := c.newStream()
	if err != nil {
		return nil, err
	}
	defer c.finish(st)
	if err := c.sendJSON(ctx, TypeHello, st.id, w); err != nil {
		return nil, fmt.Errorf("vsockd: hello: %w", err)
	}
	f, err := c.expect(ctx, st, TypeHelloReply)
	if err != nil {
		return nil, fmt.Errorf("vsockd: hello: %w", err)
	}
	var r helloReplyWire
	if err := json.Unmarshal(f.Payload, &r); err != nil {
		return nil, fmt.Errorf("vsockd: hello: %w: %v", ErrProtocol, err)
	}
	reply := &HelloReply{Version: r.Version, BootID: r.BootID, Uptime: time.Duration(r.UptimeNs), Features: r.Features}
	copy(reply.Token[:], r.Token)
	features := make(map[string]bool, len(r.Features))
	for _, f := range r.Features {
		features[f] = true
	}
	c.mu.Lock()
	c.features = features
	c.mu.Unlock()
	if len(r.Token) != 16 || reply.Token != h.Token {
		return reply, fmt.Errorf("%w: sent %x, guest echoed %x", ErrTokenMismatch, h.Token, r.Token)
	}
	return reply, nil
}

// require fails with an error wrapping ErrUnsupported when the agent's
// HelloReply did not list feature (an agent older than the feature). A client
// that never said Hello does not know, and sends the request.
func (c *Client) require(feature, what string) error {
	c.mu.Lock()
	f := c.features
	c.mu.Unlock()
	if f != nil && !f[feature] {
		return fmt.Errorf("%w: the guest agent predates %s (rebuild the guest image)", ErrUnsupported, what)
	}
	return nil
}

// Ping checks that the guest is responsive.
func (c *Client) Ping(ctx context.Context) error {
	if c.readTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.readTimeout)
		defer cancel()
	}
	st, err := c.newStream()
	if err != nil {
		return err
	}
	defer c.finish(st)
	if err := c.send(ctx, Frame{Type: TypePing, Stream: st.id}); err != nil {
		return fmt.Errorf("vsockd: ping: %w", err)
	}
	if _, err := c.expect(ctx, st, TypePong); err != nil {
		return fmt.Errorf("vsockd: ping: %w", err)
	}
	return nil
}

// Process is a guest process started with Client.Start.
type Process struct {
	c   *Client
	st  *cstream
	req *ExecRequest
	// Pid is the guest pid of the process.
	Pid int

	maxOutput int64 // < 0: unlimited
	started   time.Time

	done     chan struct{}
	code     int
	err      error
	timedOut bool
}

// Run runs req to completion and returns its exit code: the exit status,
// 128+signal if it was killed by a signal, or ExitCodeTimeout if
// req.Timeout expired. If ctx ends first the process is sent SIGKILL and
// ctx.Err() is returned. Run is safe for concurrent use: any number of Runs
// may share one Client.
//
// A command that could not be started returns ExitCodeNotFound (127) with
// an error wrapping ErrNotFound, or ExitCodeNotExecutable (126) with
// ErrNotExecutable; other failures return -1 and an error (ErrWorkdir,
// ErrEmptyArgv, ErrOutputLimit, ErrConnLost, ...).
func (c *Client) Run(ctx context.Context, req *ExecRequest) (int, error) {
	p, err := c.Start(ctx, req)
	if err != nil {
		return StartErrorCode(err), err
	}
	return p.Wait(ctx)
}

// grace is ClientConfig.TimeoutGrace or its default.
func (c *Client) grace() time.Duration {
	if c.timeoutGrace > 0 {
		return c.timeoutGrace
	}
	return DefaultTimeoutGrace
}

// waitBound is how long after its request the host waits for an exec with timeout
// (> 0): WithGrace of timeout and the client's grace.
func (c *Client) waitBound(timeout time.Duration) time.Duration {
	return WithGrace(timeout, c.grace())
}

// WithGrace is an exec's timeout (> 0) with the host's grace (>= 0) added, the bound a
// host keeps on the exec, saturated at the longest Duration: the plain sum wraps
// negative for a timeout near math.MaxInt64 (a caller's "no real bound"), and a bound in
// the past failed the exec at once with a start timeout.
func WithGrace(timeout, grace time.Duration) time.Duration {
	if timeout > math.MaxInt64-grace {
		return math.MaxInt64
	}
	return timeout + grace
}

// startTimeout is the error of an exec with a timeout that the guest did not start
// within timeout + grace (err, when ctx itself is not what ended): it wraps
// context.DeadlineExceeded, and StartErrorCode is then ExitCodeTimeout.
func startTimeout(ctx context.Context, req *ExecRequest, grace time.Duration, err error) error {
	if ctx.Err() != nil || req.Timeout <= 0 || !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return &startTimeoutError{fmt.Errorf("vsockd: exec %q: the guest had not started the command %v after its %v timeout (too loaded to fork?); stopped waiting: %w",
		req.Argv[0], grace, req.Timeout, context.DeadlineExceeded)}
}

// startTimeoutError marks startTimeout's errors for StartErrorCode.
type startTimeoutError struct{ error }

func (e *startTimeoutError) Unwrap() error { return e.error }

// StartErrorCode is the shell-style exit code for an error from Start: 127
// for ErrNotFound, 126 for ErrNotExecutable, ExitCodeTimeout for a command with a
// timeout that the guest did not start within it and the grace, else -1.
func StartErrorCode(err error) int {
	var te *startTimeoutError
	if errors.As(err, &te) {
		return ExitCodeTimeout
	}
	return api.StartErrorCode(err)
}

// startError turns the guest's answer to ExecStart into a typed error.
func startError(argv0 string, err error) error {
	var re *RemoteError
	if errors.As(err, &re) {
		switch re.Code {
		case CodeNotFound:
			return fmt.Errorf("%w: %s", ErrNotFound, re.Message)
		case CodeNotExecutable:
			return fmt.Errorf("%w: %s", ErrNotExecutable, re.Message)
		case CodeWorkdir:
			return fmt.Errorf("%w: %s", ErrWorkdir, re.Message)
		case CodeUser:
			return fmt.Errorf("%w: %s", ErrUnknownUser, re.Message)
		}
	}
	return fmt.Errorf("vsockd: exec %q: %w", argv0, err)
}

// Start starts req in the guest. ctx bounds only the start handshake; use
// Wait (or Signal) to control the running process. Output is copied to
// req.Stdout/req.Stderr by a background goroutine and req.Stdin is copied
// until EOF.
func (c *Client) Start(ctx context.Context, req *ExecRequest) (*Process, error) {
	if req == nil || len(req.Argv) == 0 || req.Argv[0] == "" {
		return nil, ErrEmptyArgv
	}
	if err := checkExecStrings(req); err != nil {
		return nil, err
	}
	if req.User != "" {
		if err := c.require(FeatureExecUser, "exec as another user"); err != nil {
			return nil, err
		}
	}
	w := execStartWire{Argv: req.Argv, Env: req.Env, Dir: req.Dir, TTY: req.TTY,
		Rows: req.Rows, Cols: req.Cols, Term: req.Term, TimeoutNs: int64(req.Timeout), User: req.User}
	if b, err := json.Marshal(w); err == nil && len(b) > MaxPayload {
		return nil, fmt.Errorf("vsockd: exec %q: argv and env take %d bytes encoded, over %d: %w", req.Argv[0], len(b), MaxPayload, syscall.E2BIG)
	}
	st, err := c.newStream()
	if err != nil {
		return nil, err
	}
	// The timeout runs from the request, not from the guest's answer: a guest that
	// cannot even start the command (a fork bomb holding every pid) must not stretch
	// the bound of timeout + grace that Wait keeps.
	sent := time.Now()
	sctx := ctx
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		sctx, cancel = context.WithDeadline(ctx, sent.Add(c.waitBound(req.Timeout)))
		defer cancel()
	}
	if err := c.sendJSON(sctx, TypeExecStart, st.id, w); err != nil {
		c.abort(st, err, true)
		return nil, startTimeout(ctx, req, c.grace(), fmt.Errorf("vsockd: exec %q: %w", req.Argv[0], err))
	}
	f, err := c.expect(sctx, st, TypeExecStarted)
	if err != nil && ctx.Err() == nil && sctx.Err() != nil {
		c.abort(st, err, true)
		return nil, startTimeout(ctx, req, c.grace(), err)
	}
	if err != nil {
		var re *RemoteError
		if errors.As(err, &re) {
			c.finish(st) // the guest ended the stream
		} else {
			c.abort(st, err, true)
		}
		return nil, startError(req.Argv[0], err)
	}
	var sw execStartedWire
	json.Unmarshal(f.Payload, &sw)
	p := &Process{c: c, st: st, req: req, Pid: sw.Pid, done: make(chan struct{}), maxOutput: c.maxOutput, started: sent}
	if req.MaxOutput != 0 {
		p.maxOutput = req.MaxOutput
	}
	go p.pump()
	go p.feedStdin(req.Stdin)
	return p, nil
}

// pump copies output to the caller's writers, returning credit to the guest
// as it goes, until the Exit frame (or a failure).
func (p *Process) pump() {
	c, st := p.c, p.st
	var total int64
	for {
		f, err := st.in.pop(context.Background()) // the inbox fails on abort/close
		if err != nil {
			p.end(-1, err)
			return
		}
		switch f.Type {
		case TypeStdout, TypeStderr:
			w := p.req.Stdout
			if f.Type == TypeStderr {
				w = p.req.Stderr
			}
			data := f.Payload
			over := p.maxOutput >= 0 && total+int64(len(data)) > p.maxOutput
			if over {
				data = data[:p.maxOutput-total]
			}
			if w != nil && len(data) > 0 {
				if _, err := w.Write(data); err != nil {
					c.abort(st, err, true)
					p.end(-1, fmt.Errorf("vsockd: writing output: %w", err))
					return
				}
			}
			if over {
				c.abort(st, ErrOutputLimit, true)
				p.end(-1, fmt.Errorf("%w (%d bytes)", ErrOutputLimit, p.maxOutput))
				return
			}
			total += int64(len(data))
			st.in.release(len(f.Payload))
			c.send(c.ctx, windowFrame(st.id, len(f.Payload)))
		case TypeExit:
			var e exitWire
			if err := json.Unmarshal(f.Payload, &e); err != nil {
				c.abort(st, err, true)
				p.end(-1, fmt.Errorf("vsockd: exit: %w: %v", ErrProtocol, err))
				return
			}
			p.timedOut = e.TimedOut
			c.finish(st)
			p.end(e.Code, nil)
			return
		case TypeError:
			c.finish(st)
			p.end(-1, decodeRemoteError(f.Payload))
			return
		}
	}
}

func (p *Process) end(code int, err error) {
	p.code, p.err = code, err
	close(p.done)
}

// feedStdin copies r to the guest within the stream's credit. It stops when
// the stream ends; a Read blocked in r is not interrupted (as with os/exec
// for non-file readers).
func (p *Process) feedStdin(r io.Reader) {
	c, st := p.c, p.st
	if r != nil {
		buf := make([]byte, chunkSize)
		for {
			n, err := r.Read(buf)
			data := buf[:n]
			for len(data) > 0 {
				k, werr := st.win.acquire(c.ctx, len(data))
				if werr != nil {
					return
				}
				if c.send(c.ctx, Frame{Type: TypeStdin, Stream: st.id, Payload: data[:k]}) != nil {
					return
				}
				data = data[k:]
			}
			if err != nil {
				break
			}
		}
	}
	select {
	case <-p.done:
	default:
		c.send(c.ctx, Frame{Type: TypeStdinClose, Stream: st.id})
	}
}

// Wait waits for the process to exit and returns its exit code (see Run).
// If ctx ends first, Wait sends SIGKILL (see Signal), aborts the
// stream and returns ctx.Err().
func (p *Process) Wait(ctx context.Context) (int, error) {
	var bound <-chan time.Time
	if p.req.Timeout > 0 {
		t := time.NewTimer(time.Until(p.started.Add(p.c.waitBound(p.req.Timeout))))
		defer t.Stop()
		bound = t.C
	}
	select {
	case <-p.done:
		return p.code, p.err
	case <-bound:
		// The guest did not end the command in time: kill it from here and stop
		// waiting (what it still prints is dropped).
		p.kill()
		err := fmt.Errorf("vsockd: exec %q: the guest had not ended the command %v after its %v timeout; sent it SIGKILL and stopped waiting: %w",
			p.req.Argv[0], time.Since(p.started.Add(p.req.Timeout)).Round(time.Millisecond), p.req.Timeout, context.DeadlineExceeded)
		p.c.abort(p.st, err, true)
		return ExitCodeTimeout, err
	case <-ctx.Done():
	}
	p.kill()
	p.c.abort(p.st, ctx.Err(), true)
	return -1, ctx.Err()
}

// kill sends SIGKILL (see Signal), bounded by a second.
func (p *Process) kill() {
	kctx, cancel := context.WithTimeout(p.c.ctx, time.Second)
	p.Signal(kctx, syscall.SIGKILL)
	cancel()
}

// Exited reports whether the process has finished (or its stream failed).
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// TimedOut reports whether the guest killed the process because
// ExecRequest.Timeout expired. Valid after Wait returned.
func (p *Process) TimedOut() bool {
	<-p.done
	return p.timedOut
}

// Resize changes the terminal size of a TTY process.
func (p *Process) Resize(ctx context.Context, rows, cols uint16) error {
	return p.c.sendJSON(ctx, TypeResize, p.st.id, resizeWire{Rows: rows, Cols: cols})
}

// Signal sends signal sig to the process group of the process. sig is a Linux signal
// number (the guest's), whatever the host. SIGKILL kills everything the process
// started where the guest gives it a cgroup of its own (the agent does), children that
// left its process group (setsid) included.
func (p *Process) Signal(ctx context.Context, sig syscall.Signal) error {
	return p.c.sendJSON(ctx, TypeSignal, p.st.id, signalWire{Signal: int(sig)})
}

// PutFile writes the contents of r to guestPath with permission mode. The
// guest writes a temporary file in the same directory and renames it into
// place, so the file appears atomically (or not at all).
func (c *Client) PutFile(ctx context.Context, guestPath string, mode os.FileMode, r io.Reader) error {
	st, err := c.newStream()
	if err != nil {
		return err
	}
	what := "put " + guestPath
	if err := c.sendJSON(ctx, TypeFilePut, st.id, filePutWire{Path: guestPath, Mode: uint32(mode.Perm())}); err != nil {
		c.abort(st, err, true)
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	return c.upload(ctx, st, r, what)
}

// CopyIn extracts the tar stream r into the existing guest directory
// guestDir. The guest extracts as the stream arrives (nothing is buffered
// whole on either side) with tarstream.ExtractTar's rules: no entry, however crafted,
// is written outside guestDir. It returns once the guest has extracted
// everything, or with the guest's error: it wraps ErrNotDirectory when
// guestDir is missing or not a directory, ErrUnsafeEntry (naming the entry)
// for an entry that would leave it. What was extracted before an error
// stays. An error reading r aborts the copy.
func (c *Client) CopyIn(ctx context.Context, guestDir string, r io.Reader) error {
	what := "copy to " + guestDir
	if err := c.require(FeatureCopy, "copies"); err != nil {
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	st, err := c.newStream()
	if err != nil {
		return err
	}
	if err := c.sendJSON(ctx, TypeCopyIn, st.id, copyInWire{Dir: guestDir}); err != nil {
		c.abort(st, err, true)
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	return c.upload(ctx, st, r, what)
}

// upload sends r as FileData frames within st's credit, then FileEnd, and
// waits for the guest's FileEnd. what names the operation in errors.
func (c *Client) upload(ctx context.Context, st *cstream, r io.Reader, what string) error {
	fail := func(err error) error {
		c.abort(st, err, true)
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	remote := func(err error) error {
		c.finish(st) // the guest ended the stream
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	buf := make([]byte, chunkSize)
	for {
		n, rerr := r.Read(buf)
		data := buf[:n]
		for len(data) > 0 {
			k, err := st.win.acquire(ctx, len(data))
			if err != nil {
				if re := (*RemoteError)(nil); errors.As(err, &re) {
					return remote(err)
				}
				return fail(err)
			}
			if err := c.send(ctx, Frame{Type: TypeFileData, Stream: st.id, Payload: data[:k]}); err != nil {
				return fail(err)
			}
			data = data[k:]
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return fail(rerr)
		}
	}
	if err := c.send(ctx, Frame{Type: TypeFileEnd, Stream: st.id}); err != nil {
		return fail(err)
	}
	if _, err := c.expect(ctx, st, TypeFileEnd); err != nil {
		if re := (*RemoteError)(nil); errors.As(err, &re) {
			return remote(err)
		}
		return fail(err)
	}
	c.finish(st)
	return nil
}

// GetFile copies the guest file guestPath to w. If max > 0 and the file is
// larger than max bytes, it fails with an error wrapping ErrFileTooLarge
// (w may have received up to max bytes). A missing file matches
// fs.ErrNotExist.
func (c *Client) GetFile(ctx context.Context, guestPath string, w io.Writer, max int64) error {
	st, err := c.newStream()
	if err != nil {
		return err
	}
	what := "get " + guestPath
	if err := c.sendJSON(ctx, TypeFileGet, st.id, fileGetWire{Path: guestPath, Max: max}); err != nil {
		c.abort(st, err, true)
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	return c.download(ctx, st, w, max, what)
}

// CopyOut writes a tar stream of guestPath to w (see tarstream.WriteTar): a file, a
// directory and everything below it, or a symlink as a symlink, in entries
// named after guestPath's base name. The stream is copied to w as it
// arrives. A missing guestPath fails with an error wrapping
// ErrSourceMissing (and fs.ErrNotExist). If the guest fails midway, w has
// received part of the archive and the error is returned. w must not trust
// the archive: extract it with tarstream.ExtractTar (Top set to the base name).
func (c *Client) CopyOut(ctx context.Context, guestPath string, w io.Writer) error {
	what := "copy from " + guestPath
	if err := c.require(FeatureCopy, "copies"); err != nil {
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	st, err := c.newStream()
	if err != nil {
		return err
	}
	if err := c.sendJSON(ctx, TypeCopyOut, st.id, copyOutWire{Path: guestPath}); err != nil {
		c.abort(st, err, true)
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	return c.download(ctx, st, w, 0, what)
}

// download copies the FileData frames of st to w, returning credit as w
// takes them, until FileEnd. max > 0 bounds the bytes (ErrFileTooLarge).
func (c *Client) download(ctx context.Context, st *cstream, w io.Writer, max int64, what string) error {
	fail := func(err error) error {
		c.abort(st, err, true)
		return fmt.Errorf("vsockd: %s: %w", what, err)
	}
	var total int64
	for {
		f, err := st.in.pop(ctx)
		if err != nil {
			return fail(err)
		}
		switch f.Type {
		case TypeFileData:
			total += int64(len(f.Payload))
			if max > 0 && total > max {
				return fail(fmt.Errorf("%w: more than %d bytes", ErrFileTooLarge, max))
			}
			if _, err := w.Write(f.Payload); err != nil {
				return fail(err)
			}
			st.in.release(len(f.Payload))
			if err := c.send(ctx, windowFrame(st.id, len(f.Payload))); err != nil {
				return fail(err)
			}
		case TypeFileEnd:
			c.finish(st)
			return nil
		case TypeError:
			c.finish(st)
			return fmt.Errorf("vsockd: %s: %w", what, decodeRemoteError(f.Payload))
		default:
			return fail(fmt.Errorf("%w: unexpected %v", ErrProtocol, f.Type))
		}
	}
}

// Stat returns the attributes of the guest path guestPath, following
// symlinks. A missing path matches fs.ErrNotExist.
func (c *Client) Stat(ctx context.Context, guestPath string) (fs.FileInfo, error) {
	if err := c.require(FeatureCopy, "stat"); err != nil {
		return nil, fmt.Errorf("vsockd: stat %s: %w", guestPath, err)
	}
	st, err := c.newStream()
	if err != nil {
		return nil, err
	}
	defer c.finish(st)
	if err := c.sendJSON(ctx, TypeStat, st.id, statWire{Path: guestPath}); err != nil {
		return nil, fmt.Errorf("vsockd: stat %s: %w", guestPath, err)
	}
	f, err := c.expect(ctx, st, TypeStatReply)
	if err != nil {
		return nil, fmt.Errorf("vsockd: stat %s: %w", guestPath, err)
	}
	var r statReplyWire
	if err := json.Unmarshal(f.Payload, &r); err != nil {
		return nil, fmt.Errorf("vsockd: stat %s: %w: %v", guestPath, ErrProtocol, err)
	}
	return &fileInfo{name: r.Name, size: r.Size, mode: fs.FileMode(r.Mode), mtime: time.Unix(0, r.MtimeNs)}, nil
}

// fileInfo is a guest file's attributes (Client.Stat).
type fileInfo struct {
	name  string
	size  int64
	mode  fs.FileMode
	mtime time.Time
}

func (fi *fileInfo) Name() string       { return fi.name }
func (fi *fileInfo) Size() int64        { return fi.size }
func (fi *fileInfo) Mode() fs.FileMode  { return fi.mode }
func (fi *fileInfo) ModTime() time.Time { return fi.mtime }
func (fi *fileInfo) IsDir() bool        { return fi.mode.IsDir() }
func (fi *fileInfo) Sys() any           { return nil }

// DialUnix connects to the unix socket at path, retrying every 2ms while
// the socket does not exist yet or refuses connections, until ctx is done.
func DialUnix(ctx context.Context, path string) (net.Conn, error) {
	var d net.Dialer
	for {
		conn, err := d.DialContext(ctx, "unix", path)
		if err == nil {
			return conn, nil
		}
		if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, syscall.ENOENT) && !errors.Is(err, syscall.ECONNREFUSED) {
			return nil, fmt.Errorf("vsockd: dial %s: %w", path, err)
		}
		t := time.NewTimer(2 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("vsockd: dial %s: %w (last error: %v)", path, ctx.Err(), err)
		case <-t.C:
		}
	}
}

// MaxArgLen is the longest argv or env string the guest kernel takes (MAX_ARG_STRLEN:
// 32 pages, with its NUL).
const MaxArgLen = 32*4096 - 1

// checkExecStrings refuses what execve would (a string over MaxArgLen: E2BIG) or cannot
// express (a NUL byte: ErrInvalidRequest) before anything is sent to the guest.
func checkExecStrings(req *ExecRequest) error {
	check := func(what, s string, limit bool) error {
		if strings.IndexByte(s, 0) >= 0 {
			return fmt.Errorf("%w: NUL byte in %s", ErrInvalidRequest, what)
		}
		if limit && len(s) > MaxArgLen {
			return fmt.Errorf("vsockd: exec: %s is %d bytes, over the %d a guest command may take: %w", what, len(s), MaxArgLen, syscall.E2BIG)
		}
		return nil
	}
	for i, a := range req.Argv {
		if err := check(fmt.Sprintf("argv[%d]", i), a, true); err != nil {
			return err
		}
	}
	for i, e := range req.Env {
		if err := check(fmt.Sprintf("env[%d]", i), e, true); err != nil {
			return err
		}
	}
	if err := check("the working directory", req.Dir, false); err != nil {
		return err
	}
	return check("the user", req.User, false)
}
