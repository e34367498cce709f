package qmp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultHandshakeTimeout bounds the greeting and qmp_capabilities exchange
// when Config.HandshakeTimeout is zero.
const DefaultHandshakeTimeout = 5 * time.Second

// DefaultEventBuffer is the subscriber buffer used when Config.EventBuffer
// is zero and Subscribe is called with buf <= 0.
const DefaultEventBuffer = 64

// Config tunes a Client. A nil *Config means all defaults.
type Config struct {
	// HandshakeTimeout bounds reading the greeting and negotiating
	// capabilities (default DefaultHandshakeTimeout). The context passed to
	// Dial/NewClient bounds it as well.
	HandshakeTimeout time.Duration
	// EventBuffer is the default channel buffer for Subscribe(buf <= 0) and
	// for WaitEvent (default DefaultEventBuffer).
	EventBuffer int
}

func (c *Config) handshakeTimeout() time.Duration {
	if c == nil || c.HandshakeTimeout <= 0 {
		return DefaultHandshakeTimeout
	}
	return c.HandshakeTimeout
}

func (c *Config) eventBuffer() int {
	if c == nil || c.EventBuffer <= 0 {
		return DefaultEventBuffer
	}
	return c.EventBuffer
}

// aLongTimeAgo is a deadline in the past, used to interrupt blocked I/O.
var aLongTimeAgo = time.Unix(1, 0)

// errClosedByClient is the cause recorded by Close.
var errClosedByClient = errors.New("closed by Close")

// reply is what the reader hands to a waiting Execute.
type reply struct {
	ret json.RawMessage
	err error
}

type subscriber struct {
	ch chan Event
}

// Client is a QMP connection. All methods are safe for concurrent use.
type Client struct {
	conn    net.Conn
	dec     *json.Decoder
	cfg     *Config
	version Version
	caps    []string

	nextID atomic.Uint64
	// session prefixes this client's ids: a monitor hands the reply to a command whose
	// client died to the next client, which must not take it for one of its own.
	session string
	wmu     sync.Mutex // serializes writes to conn

	mu       sync.Mutex // guards the fields below
	pending  map[string]chan reply
	subs     map[*subscriber]struct{}
	cause    error // first reason for shutting down, set before conn.Close
	closeErr error // non-nil once the reader has exited; wraps ErrClosed

	dropped   atomic.Uint64
	done      chan struct{}
	closeOnce sync.Once
}

// Dial connects to the QMP unix socket at socketPath and performs the
// handshake (see NewClient).
func Dial(ctx context.Context, socketPath string, cfg *Config) (*Client, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, cfg.handshakeTimeout())
	defer cancel()
	conn, err := d.DialContext(dctx, "unix", socketPath)
	if err != nil {
		return nil, fmt.Errorf("%w: dial %s: %w", ErrHandshake, socketPath, err)
	}
	return NewClient(ctx, conn, cfg)
}

// NewClient performs the QMP handshake on conn: it reads the greeting and
// negotiates capabilities with qmp_capabilities, bounded by
// cfg.HandshakeTimeout and ctx. On success the Client owns conn and starts
// its reader goroutine; on failure conn is closed and the returned error
// wraps ErrHandshake. ctx only bounds the handshake, not the Client's life.
func NewClient(ctx context.Context, conn net.Conn, cfg *Config) (*Client, error) {
	var sb [4]byte
	_, _ = rand.Read(sb[:]) // crypto/rand never fails on supported platforms
	c := &Client{
		session: hex.EncodeToString(sb[:]),
		conn:    conn,
		dec:     json.NewDecoder(conn),
		cfg:     cfg,
		pending: make(map[string]chan reply),
		subs:    make(map[*subscriber]struct{}),
		done:    make(chan struct{}),
	}
	if err := c.handshake(ctx); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: %w", ErrHandshake, err)
	}
	go c.readLoop()
	return c, nil
}

func (c *Client) handshake(ctx context.Context) (err error) {
	if err := ctx.Err(); err != nil {
		return err
	}
	// The handshake timeout is a conn deadline; ctx (including its own
	// deadline) interrupts I/O via AfterFunc, so that ctx.Err() is already
	// set when the I/O error surfaces.
	// A SetDeadline error (e.g. peer already gone) is left for the read
	// below to report.
	_ = c.conn.SetDeadline(time.Now().Add(c.cfg.handshakeTimeout()))
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		c.conn.SetDeadline(aLongTimeAgo)
		close(fired)
	})
	defer func() {
		if !stop() {
			<-fired
			if err == nil {
				err = ctx.Err()
			}
		}
		if err != nil && ctx.Err() != nil && !errors.Is(err, ctx.Err()) {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		if err == nil {
			err = c.conn.SetDeadline(time.Time{})
		}
	}()

	m, err := c.readMessage()
	if err != nil {
		return fmt.Errorf("reading greeting: %w", err)
	}
	if m.kind != kindGreeting {
		return fmt.Errorf("%w: expected greeting, got message kind %d", ErrProtocol, m.kind)
	}
	c.version = m.greeting.Version
	c.caps = m.greeting.Capabilities

	id := c.newID()
	b, err := encodeCommand("qmp_capabilities", nil, id)
	if err != nil {
		return err
	}
	if _, err := c.conn.Write(b); err != nil {
		return fmt.Errorf("sending qmp_capabilities: %w", err)
	}
	for {
		m, err := c.readMessage()
		if err != nil {
			return fmt.Errorf("reading qmp_capabilities reply: %w", err)
		}
		if m.kind != kindReply {
			continue // no subscribers exist yet; events are dropped
		}
		if m.id != id {
			// A reply to a command an earlier client of this monitor sent and did not
			// wait for (it died mid-command): QEMU gives it to whoever is connected when
			// the command completes. Not ours.
			continue
		}
		if m.err != nil {
			return m.err
		}
		return nil
	}
}

// readMessage decodes the next message from the stream. A message that is
// valid JSON but not valid QMP is returned with its decode error; a JSON
// syntax or I/O error is returned as-is (the stream is then unusable).
func (c *Client) readMessage() (message, error) {
	var raw json.RawMessage
	if err := c.dec.Decode(&raw); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return message{}, fmt.Errorf("%w: %w", ErrProtocol, err)
		}
		return message{}, err
	}
	m, err := decodeMessage(raw)
	if err != nil {
		return m, errDecode{err}
	}
	return m, nil
}

// errDecode marks a per-message decode error after which the stream is
// still in sync.
type errDecode struct{ error }

func (e errDecode) Unwrap() error { return e.error }

func (c *Client) newID() string {
	return "fk-" + c.session + "-" + strconv.FormatUint(c.nextID.Add(1)-1, 10)
}

func encodeCommand(cmd string, args any, id string) ([]byte, error) {
	type command struct {
		Execute   string          `json:"execute"`
		Arguments json.RawMessage `json:"arguments,omitempty"`
		ID        string          `json:"id"`
	}
	out := command{Execute: cmd, ID: id}
	if args != nil {
		a, err := json.Marshal(args)
		if err != nil {
			return nil, fmt.Errorf("qmp: encoding arguments of %s: %w", cmd, err)
		}
		if string(a) != "null" {
			out.Arguments = a
		}
	}
	return json.Marshal(out)
}

// readLoop is the single reader goroutine.
func (c *Client) readLoop() {
	var err error
	for {
		var m message
		m, err = c.readMessage()
		if err != nil {
			var de errDecode
			if errors.As(err, &de) {
				// Stream is still in sync; fail only the affected command.
				if m.id != "" {
					c.deliver(m.id, reply{err: de.error})
				}
				continue
			}
			break
		}
		switch m.kind {
		case kindReply:
			var r reply
			if m.err != nil {
				r.err = m.err
			} else {
				r.ret = m.ret
			}
			c.deliver(m.id, r)
		case kindEvent:
			c.publish(m.event)
		}
	}
	c.conn.Close()

	c.mu.Lock()
	cause := err
	if c.cause != nil {
		cause = c.cause
	}
	c.closeErr = fmt.Errorf("%w: %w", ErrClosed, cause)
	pending := c.pending
	c.pending = nil
	for s := range c.subs {
		close(s.ch)
	}
	c.subs = nil
	c.mu.Unlock()

	for _, ch := range pending {
		ch <- reply{err: c.closeErr}
	}
	close(c.done)
}

// deliver hands r to the pending call with the given id, if any. Replies
// for unknown ids (late replies after a cancelled context) are discarded.
func (c *Client) deliver(id string, r reply) {
	c.mu.Lock()
	ch, ok := c.pending[id]
	if ok {
		delete(c.pending, id)
	}
	c.mu.Unlock()
	if ok {
		ch <- r // capacity 1, never blocks
	}
}

// publish fans ev out to subscribers without ever blocking.
func (c *Client) publish(ev Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for s := range c.subs {
		select {
		case s.ch <- ev:
		default:
			c.dropped.Add(1)
		}
	}
}

// shutdown records cause (first one wins) and closes the connection, which
// makes the reader exit and fail all pending calls.
func (c *Client) shutdown(cause error) {
	c.mu.Lock()
	if c.cause == nil && c.closeErr == nil {
		c.cause = cause
	}
	c.mu.Unlock()
	c.conn.Close()
}

// Execute runs the QMP command cmd with the given arguments (marshalled to
// JSON; nil means none) and waits for its reply or for ctx to be done. On
// success the "return" value is unmarshalled into result unless result is
// nil. A QMP error reply is returned as *Error. If ctx ends first, ctx.Err()
// is returned and a late reply is discarded; note that QEMU may still
// execute the command. After the connection ends, errors wrap ErrClosed.
func (c *Client) Execute(ctx context.Context, cmd string, args, result any) error {
	return c.execute(ctx, cmd, args, result, nil)
}

// ExecuteFD is like Execute but sends the file descriptor of f along with
// the command bytes (SCM_RIGHTS), as needed by "getfd" and "add-fd". The
// connection must be a *net.UnixConn, otherwise a *FDPassingError is
// returned. f is not closed; QEMU receives its own duplicate.
func (c *Client) ExecuteFD(ctx context.Context, cmd string, args, result any, f *os.File) error {
	if f == nil {
		return errors.New("qmp: ExecuteFD: nil file")
	}
	if _, ok := c.conn.(*net.UnixConn); !ok || !fdPassingSupported {
		return &FDPassingError{ConnType: fmt.Sprintf("%T", c.conn)}
	}
	return c.execute(ctx, cmd, args, result, f)
}

func (c *Client) execute(ctx context.Context, cmd string, args, result any, f *os.File) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	id := c.newID()
	b, err := encodeCommand(cmd, args, id)
	if err != nil {
		return err
	}
	ch := make(chan reply, 1)
	c.mu.Lock()
	if c.closeErr != nil {
		err := c.closeErr
		c.mu.Unlock()
		return err
	}
	c.pending[id] = ch
	c.mu.Unlock()

	if err := c.write(ctx, b, f); err != nil {
		c.forget(id)
		return err
	}

	select {
	case r := <-ch:
		if r.err != nil {
			return r.err
		}
		if result != nil {
			if err := json.Unmarshal(r.ret, result); err != nil {
				return fmt.Errorf("qmp: decoding %s reply: %w", cmd, err)
			}
		}
		return nil
	case <-ctx.Done():
		c.forget(id) // a reply arriving later is discarded by deliver
		return ctx.Err()
	}
}

func (c *Client) forget(id string) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

// write sends b (with f's descriptor when f != nil) under the write mutex.
// ctx cancellation interrupts a blocked write via a past write deadline. A
// partial or failed write leaves the stream in an unknown state, so the
// connection is shut down; an interrupted write of zero bytes is harmless.
func (c *Client) write(ctx context.Context, b []byte, f *os.File) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		c.conn.SetWriteDeadline(aLongTimeAgo)
		close(fired)
	})
	var n int
	var err error
	if f != nil {
		n, err = writeWithFD(c.conn.(*net.UnixConn), b, f)
	} else {
		n, err = c.conn.Write(b)
	}
	if !stop() {
		<-fired
		c.conn.SetWriteDeadline(time.Time{})
	}
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		if n > 0 {
			c.shutdown(fmt.Errorf("partial write interrupted: %w", ctx.Err()))
		}
		return ctx.Err()
	}
	c.shutdown(fmt.Errorf("write: %w", err))
	c.mu.Lock()
	closeErr := c.closeErr
	c.mu.Unlock()
	if closeErr != nil {
		return closeErr
	}
	return fmt.Errorf("%w: write: %w", ErrClosed, err)
}

// Subscribe registers a new event subscriber with a channel buffer of buf
// events (buf <= 0 means Config.EventBuffer). Events are delivered without
// blocking the reader: when the buffer is full the event is dropped for
// this subscriber and counted in Dropped. The channel is closed by cancel
// or when the connection ends. cancel is idempotent.
func (c *Client) Subscribe(buf int) (events <-chan Event, cancel func()) {
	if buf <= 0 {
		buf = c.cfg.eventBuffer()
	}
	s := &subscriber{ch: make(chan Event, buf)}
	c.mu.Lock()
	if c.subs == nil { // connection already ended
		c.mu.Unlock()
		close(s.ch)
		return s.ch, func() {}
	}
	c.subs[s] = struct{}{}
	c.mu.Unlock()
	return s.ch, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if _, ok := c.subs[s]; ok {
			delete(c.subs, s)
			close(s.ch)
		}
	}
}

// WaitEvent waits for the next event named name that arrives after the
// call, returning ctx's error or an ErrClosed error if that happens first.
// Events emitted before WaitEvent subscribes are not seen; callers racing
// with a command that triggers the event should Subscribe before executing.
func (c *Client) WaitEvent(ctx context.Context, name string) (Event, error) {
	events, cancel := c.Subscribe(0)
	defer cancel()
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return Event{}, c.Err()
			}
			if ev.Name == name {
				return ev, nil
			}
		case <-ctx.Done():
			return Event{}, ctx.Err()
		}
	}
}

// Dropped returns how many events were dropped, over all subscribers,
// because a subscriber's buffer was full.
func (c *Client) Dropped() uint64 { return c.dropped.Load() }

// Version returns the QEMU version from the QMP greeting.
func (c *Client) Version() Version { return c.version }

// Capabilities returns the capabilities advertised in the QMP greeting
// (none of which are enabled by this client).
func (c *Client) Capabilities() []string { return append([]string(nil), c.caps...) }

// Done returns a channel that is closed once the connection has ended and
// all pending calls have been failed.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err returns nil while the connection is up, and afterwards the reason it
// ended (wrapping ErrClosed).
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closeErr
}

// Close closes the connection, fails pending calls with ErrClosed and waits
// for the reader goroutine to exit. It is safe to call more than once.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		c.shutdown(errClosedByClient)
		<-c.done
	})
	return nil
}
