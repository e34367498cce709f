package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

const testGreeting = `{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}, "package": "Debian 1:10.0.2"}, "capabilities": ["oob"]}}`

// peer is a scripted fake QMP server on the other end of a connection.
type peer struct {
	t    *testing.T
	conn net.Conn
	dec  *json.Decoder
}

type wireCmd struct {
	Execute   string          `json:"execute"`
	Arguments json.RawMessage `json:"arguments"`
	ID        string          `json:"id"`
}

func newPeer(t *testing.T, conn net.Conn) *peer {
	return &peer{t: t, conn: conn, dec: json.NewDecoder(conn)}
}

func (p *peer) send(s string) error {
	_, err := io.WriteString(p.conn, s+"\r\n")
	return err
}

func (p *peer) recv() (wireCmd, error) {
	var c wireCmd
	err := p.dec.Decode(&c)
	return c, err
}

// handshake plays the server side of the handshake.
func (p *peer) handshake() error {
	if err := p.send(testGreeting); err != nil {
		return err
	}
	c, err := p.recv()
	if err != nil {
		return err
	}
	if c.Execute != "qmp_capabilities" {
		return fmt.Errorf("first command %q, want qmp_capabilities", c.Execute)
	}
	return p.send(fmt.Sprintf(`{"return": {}, "id": %q}`, c.ID))
}

// reply answers c with a raw "return" value.
func (p *peer) reply(c wireCmd, ret string) error {
	return p.send(fmt.Sprintf(`{"return": %s, "id": %q}`, ret, c.ID))
}

// newPair returns a handshaken client connected over net.Pipe to a peer.
func newPair(t *testing.T, cfg *Config) (*Client, *peer) {
	t.Helper()
	cc, sc := net.Pipe()
	p := newPeer(t, sc)
	errc := make(chan error, 1)
	go func() { errc <- p.handshake() }()
	c, err := NewClient(context.Background(), cc, cfg)
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("peer handshake: %v", err)
	}
	t.Cleanup(func() {
		c.Close()
		sc.Close()
	})
	return c, p
}

func TestHandshake(t *testing.T) {
	tests := []struct {
		name    string
		cfg     *Config
		ctx     func() (context.Context, context.CancelFunc)
		script  func(p *peer)
		wantIs  []error
		wantErr bool
	}{
		{
			name:   "ok",
			script: func(p *peer) { p.handshake() },
		},
		{
			name: "events before reply are skipped",
			script: func(p *peer) {
				p.send(testGreeting)
				c, _ := p.recv()
				p.send(`{"event":"RESUME","timestamp":{"seconds":1,"microseconds":2}}`)
				p.reply(c, "{}")
			},
		},
		{
			name: "an earlier client's reply before ours is skipped",
			script: func(p *peer) {
				p.send(testGreeting)
				c, _ := p.recv()
				p.send(`{"return":{},"id":"fk-5"}`)
				p.reply(c, "{}")
			},
		},
		{
			name:    "silent peer times out",
			cfg:     &Config{HandshakeTimeout: 50 * time.Millisecond},
			script:  func(p *peer) {},
			wantErr: true,
			wantIs:  []error{ErrHandshake},
		},
		{
			name: "ctx deadline",
			ctx: func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), 50*time.Millisecond)
			},
			script:  func(p *peer) {},
			wantErr: true,
			wantIs:  []error{ErrHandshake, context.DeadlineExceeded},
		},
		{
			name: "ctx cancel",
			ctx: func() (context.Context, context.CancelFunc) {
				ctx, cancel := context.WithCancel(context.Background())
				time.AfterFunc(30*time.Millisecond, cancel)
				return ctx, cancel
			},
			script:  func(p *peer) {},
			wantErr: true,
			wantIs:  []error{ErrHandshake, context.Canceled},
		},
		{
			name:    "event instead of greeting",
			script:  func(p *peer) { p.send(`{"event":"STOP"}`) },
			wantErr: true,
			wantIs:  []error{ErrHandshake, ErrProtocol},
		},
		{
			name:    "garbage",
			script:  func(p *peer) { p.send(`hello there`) },
			wantErr: true,
			wantIs:  []error{ErrHandshake, ErrProtocol},
		},
		{
			name:    "peer hangs up",
			script:  func(p *peer) { p.conn.Close() },
			wantErr: true,
			wantIs:  []error{ErrHandshake, io.EOF},
		},
		{
			name: "capabilities refused",
			script: func(p *peer) {
				p.send(testGreeting)
				c, _ := p.recv()
				p.send(fmt.Sprintf(`{"error":{"class":"CommandNotFound","desc":"nope"},"id":%q}`, c.ID))
			},
			wantErr: true,
			wantIs:  []error{ErrHandshake},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cc, sc := net.Pipe()
			defer sc.Close()
			p := newPeer(t, sc)
			go tt.script(p)
			ctx, cancel := context.Background(), context.CancelFunc(func() {})
			if tt.ctx != nil {
				ctx, cancel = tt.ctx()
			}
			defer cancel()
			start := time.Now()
			c, err := NewClient(ctx, cc, tt.cfg)
			if time.Since(start) > 3*time.Second {
				t.Errorf("handshake took %v", time.Since(start))
			}
			if !tt.wantErr {
				if err != nil {
					t.Fatalf("NewClient: %v", err)
				}
				defer c.Close()
				want := Version{Major: 10, Minor: 0, Micro: 2, Package: "Debian 1:10.0.2"}
				if got := c.Version(); got != want {
					t.Errorf("Version() = %+v, want %+v", got, want)
				}
				if caps := c.Capabilities(); len(caps) != 1 || caps[0] != "oob" {
					t.Errorf("Capabilities() = %v", caps)
				}
				return
			}
			if err == nil {
				c.Close()
				t.Fatal("NewClient succeeded, want error")
			}
			for _, target := range tt.wantIs {
				if !errors.Is(err, target) {
					t.Errorf("error %q is not %v", err, target)
				}
			}
			if tt.name == "capabilities refused" {
				var qe *Error
				if !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
					t.Errorf("error %q does not carry *Error CommandNotFound", err)
				}
			}
		})
	}
}

func TestDialHandshake(t *testing.T) {
	sock := t.TempDir() + "/q.sock"
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		conn, err := ln.Accept()
		if err != nil {
			return
		}
		p := newPeer(t, conn)
		p.handshake()
		c, err := p.recv()
		if err == nil {
			p.reply(c, `{"status":"prelaunch","running":false}`)
		}
		conn.Close()
	}()
	ctx := context.Background()
	c, err := Dial(ctx, sock, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var st struct {
		Status  string `json:"status"`
		Running bool   `json:"running"`
	}
	if err := c.Execute(ctx, "query-status", nil, &st); err != nil {
		t.Fatal(err)
	}
	if st.Status != "prelaunch" {
		t.Errorf("status %q", st.Status)
	}

	if _, err := Dial(ctx, t.TempDir()+"/missing.sock", nil); !errors.Is(err, ErrHandshake) {
		t.Errorf("Dial(missing) = %v, want ErrHandshake", err)
	}
}

func TestOutOfOrderReplies(t *testing.T) {
	c, p := newPair(t, nil)
	const n = 8
	ctx := context.Background()
	var wg sync.WaitGroup
	results := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.Execute(ctx, fmt.Sprintf("cmd-%d", i), map[string]int{"i": i}, &results[i])
		}()
	}
	// Collect all commands, then answer in reverse order.
	var cmds []wireCmd
	ids := map[string]bool{}
	for range n {
		cmd, err := p.recv()
		if err != nil {
			t.Fatal(err)
		}
		if ids[cmd.ID] {
			t.Errorf("duplicate id %q", cmd.ID)
		}
		ids[cmd.ID] = true
		if !strings.HasPrefix(cmd.ID, "fk-") {
			t.Errorf("id %q lacks fk- prefix", cmd.ID)
		}
		cmds = append(cmds, cmd)
	}
	for i := len(cmds) - 1; i >= 0; i-- {
		ret, _ := json.Marshal(cmds[i].Execute + string(cmds[i].Arguments))
		if err := p.reply(cmds[i], string(ret)); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			t.Errorf("cmd-%d: %v", i, errs[i])
		}
		want := fmt.Sprintf(`cmd-%d{"i":%d}`, i, i)
		if results[i] != want {
			t.Errorf("cmd-%d got %q, want %q", i, results[i], want)
		}
	}
}

func TestCommandEncoding(t *testing.T) {
	tests := []struct {
		name string
		args any
		want string // arguments as received; "" means absent
	}{
		{"nil", nil, ""},
		{"nil map", map[string]any(nil), ""},
		{"empty map", map[string]any{}, `{}`},
		{"struct", struct {
			Device string `json:"device"`
		}{"vda"}, `{"device":"vda"}`},
	}
	c, p := newPair(t, nil)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			errc := make(chan error, 1)
			go func() { errc <- c.Execute(context.Background(), "x", tt.args, nil) }()
			cmd, err := p.recv()
			if err != nil {
				t.Fatal(err)
			}
			if got := string(cmd.Arguments); got != tt.want {
				t.Errorf("arguments = %q, want %q", got, tt.want)
			}
			p.reply(cmd, "{}")
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
		})
	}
	if err := c.Execute(context.Background(), "x", func() {}, nil); err == nil {
		t.Error("unmarshalable args: want error")
	}
}

func TestErrorReplies(t *testing.T) {
	tests := []struct {
		name      string
		reply     string // %q is the id
		wantClass string
		wantDesc  string
		wantIs    error
	}{
		{"generic", `{"error":{"class":"GenericError","desc":"boom"},"id":%q}`, "GenericError", "boom", nil},
		{"not found", `{"id":%q,"error":{"class":"CommandNotFound","desc":"The command x has not been found"}}`, "CommandNotFound", "The command x has not been found", nil},
		{"device", `{"error":{"class":"DeviceNotFound","desc":"Device 'vda' not found"},"id":%q}`, "DeviceNotFound", "Device 'vda' not found", nil},
		{"malformed error", `{"error":"oops","id":%q}`, "", "", ErrProtocol},
		{"both return and error", `{"return":{},"error":{"class":"X","desc":"y"},"id":%q}`, "", "", ErrProtocol},
	}
	c, p := newPair(t, nil)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			errc := make(chan error, 1)
			go func() { errc <- c.Execute(context.Background(), "x", nil, nil) }()
			cmd, err := p.recv()
			if err != nil {
				t.Fatal(err)
			}
			p.send(fmt.Sprintf(tt.reply, cmd.ID))
			var got error
			select {
			case got = <-errc:
			case <-time.After(5 * time.Second):
				t.Fatal("Execute did not return")
			}
			if tt.wantIs != nil {
				if !errors.Is(got, tt.wantIs) {
					t.Fatalf("err = %v, want %v", got, tt.wantIs)
				}
				return
			}
			var qe *Error
			if !errors.As(got, &qe) {
				t.Fatalf("err = %T %v, want *Error", got, got)
			}
			if qe.Class != tt.wantClass || qe.Desc != tt.wantDesc {
				t.Errorf("got %+v", qe)
			}
			if want := "qmp: " + tt.wantClass + ": " + tt.wantDesc; qe.Error() != want {
				t.Errorf("Error() = %q, want %q", qe.Error(), want)
			}
		})
	}
	// The connection is still usable after all that.
	go func() {
		cmd, _ := p.recv()
		p.reply(cmd, `42`)
	}()
	var n int
	if err := c.Execute(context.Background(), "y", nil, &n); err != nil || n != 42 {
		t.Fatalf("after errors: n=%d err=%v", n, err)
	}
}

func TestContextCancel(t *testing.T) {
	c, p := newPair(t, nil)

	// Already-cancelled context: nothing is sent.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.Execute(ctx, "never", nil, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled ctx: err = %v", err)
	}

	// Timeout while waiting for the reply.
	ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- c.Execute(ctx, "slow", nil, nil) }()
	slow, err := p.recv()
	if err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
	c.mu.Lock()
	np := len(c.pending)
	c.mu.Unlock()
	if np != 0 {
		t.Errorf("pending has %d entries after cancel", np)
	}

	// The late reply is discarded and the next command gets its own reply.
	go func() {
		p.reply(slow, `"late"`)
		cmd, _ := p.recv()
		p.reply(cmd, `"fresh"`)
	}()
	var s string
	if err := c.Execute(context.Background(), "next", nil, &s); err != nil {
		t.Fatal(err)
	}
	if s != "fresh" {
		t.Errorf("got %q, want fresh", s)
	}
}

func TestCancelBlockedWrite(t *testing.T) {
	// net.Pipe writes block until the peer reads; the peer never reads.
	c, _ := newPair(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := c.Execute(ctx, "stuck", nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want DeadlineExceeded", err)
	}
}

func TestEventsDoNotBlockReplies(t *testing.T) {
	c, p := newPair(t, nil)
	stalled, cancelStalled := c.Subscribe(1) // never drained
	defer cancelStalled()
	all, cancelAll := c.Subscribe(100)
	defer cancelAll()

	const nev = 10
	go func() {
		cmd, _ := p.recv()
		for i := range nev {
			p.send(fmt.Sprintf(`{"event":"EV%d","data":{"i":%d},"timestamp":{"seconds":1700000000,"microseconds":%d}}`, i, i, i))
		}
		p.reply(cmd, `{}`)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.Execute(ctx, "x", nil, nil); err != nil {
		t.Fatal(err)
	}
	if got := c.Dropped(); got != nev-1 {
		t.Errorf("Dropped() = %d, want %d", got, nev-1)
	}
	if ev := <-stalled; ev.Name != "EV0" {
		t.Errorf("stalled subscriber got %q, want EV0", ev.Name)
	}
	for i := range nev {
		ev := <-all
		if want := fmt.Sprintf("EV%d", i); ev.Name != want {
			t.Errorf("event %d = %q, want %q", i, ev.Name, want)
		}
		if want := fmt.Sprintf(`{"i":%d}`, i); string(ev.Data) != want {
			t.Errorf("event %d data = %s, want %s", i, ev.Data, want)
		}
		if want := time.Unix(1700000000, int64(i)*1000); !ev.Time.Equal(want) {
			t.Errorf("event %d time = %v, want %v", i, ev.Time, want)
		}
	}
	// cancel closes the channel and is idempotent.
	cancelAll()
	cancelAll()
	if _, ok := <-all; ok {
		t.Error("channel not closed after cancel")
	}
}

func TestWaitEvent(t *testing.T) {
	c, p := newPair(t, nil)
	got := make(chan Event, 1)
	errc := make(chan error, 1)
	go func() {
		ev, err := c.WaitEvent(context.Background(), "SHUTDOWN")
		errc <- err
		got <- ev
	}()
	// Keep sending until WaitEvent has subscribed and seen SHUTDOWN.
	deadline := time.After(5 * time.Second)
	for done := false; !done; {
		p.send(`{"event":"STOP","timestamp":{"seconds":1,"microseconds":0}}`)
		p.send(`{"event":"SHUTDOWN","data":{"guest":false,"reason":"host-qmp-quit"},"timestamp":{"seconds":1,"microseconds":5}}`)
		select {
		case err := <-errc:
			if err != nil {
				t.Fatal(err)
			}
			done = true
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			t.Fatal("WaitEvent did not return")
		}
	}
	ev := <-got
	if ev.Name != "SHUTDOWN" || !strings.Contains(string(ev.Data), "host-qmp-quit") {
		t.Errorf("got %+v", ev)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := c.WaitEvent(ctx, "NEVER"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want DeadlineExceeded", err)
	}
}

func TestHugeReply(t *testing.T) {
	c, p := newPair(t, nil)
	big := strings.Repeat("0123456789abcdef", 3<<16) // 3 MiB
	go func() {
		cmd, _ := p.recv()
		// Also a big event before the reply, with no newline-friendly layout.
		p.send(`{"event":"BIG","data":{"s":"` + big[:1<<20] + `"}}`)
		p.reply(cmd, `{"s":"`+big+`"}`)
	}()
	var out struct{ S string }
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Execute(ctx, "query-qmp-schema", nil, &out); err != nil {
		t.Fatal(err)
	}
	if len(out.S) != len(big) || out.S != big {
		t.Fatalf("reply length %d, want %d", len(out.S), len(big))
	}
}

func TestConnectionCloseFailsPending(t *testing.T) {
	t.Run("peer closes", func(t *testing.T) {
		c, p := newPair(t, nil)
		events, cancel := c.Subscribe(4)
		defer cancel()
		const n = 3
		errc := make(chan error, n)
		for range n {
			go func() { errc <- c.Execute(context.Background(), "x", nil, nil) }()
		}
		for range n {
			if _, err := p.recv(); err != nil {
				t.Fatal(err)
			}
		}
		p.conn.Close()
		for range n {
			select {
			case err := <-errc:
				if !errors.Is(err, ErrClosed) {
					t.Errorf("err = %v, want ErrClosed", err)
				}
				if !errors.Is(err, io.EOF) {
					t.Errorf("err = %v does not wrap the read error (EOF)", err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("pending call not failed")
			}
		}
		select {
		case <-c.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("Done not closed")
		}
		if _, ok := <-events; ok {
			t.Error("subscriber channel not closed")
		}
		if err := c.Execute(context.Background(), "after", nil, nil); !errors.Is(err, ErrClosed) {
			t.Errorf("Execute after close: %v", err)
		}
		if !errors.Is(c.Err(), ErrClosed) {
			t.Errorf("Err() = %v", c.Err())
		}
		ev, cancel2 := c.Subscribe(1)
		cancel2()
		if _, ok := <-ev; ok {
			t.Error("Subscribe after close returned an open channel")
		}
		if _, err := c.WaitEvent(context.Background(), "X"); !errors.Is(err, ErrClosed) {
			t.Errorf("WaitEvent after close: %v", err)
		}
	})
	t.Run("client Close", func(t *testing.T) {
		c, p := newPair(t, nil)
		errc := make(chan error, 1)
		go func() { errc <- c.Execute(context.Background(), "x", nil, nil) }()
		if _, err := p.recv(); err != nil {
			t.Fatal(err)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		if err := <-errc; !errors.Is(err, ErrClosed) || !errors.Is(err, errClosedByClient) {
			t.Errorf("err = %v", err)
		}
		if err := c.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	})
	t.Run("garbage on the wire", func(t *testing.T) {
		c, p := newPair(t, nil)
		errc := make(chan error, 1)
		go func() { errc <- c.Execute(context.Background(), "x", nil, nil) }()
		p.recv()
		p.send(`{"return": nonsense}`)
		if err := <-errc; !errors.Is(err, ErrClosed) || !errors.Is(err, ErrProtocol) {
			t.Errorf("err = %v, want ErrClosed+ErrProtocol", err)
		}
	})
}

func TestExecuteFDNeedsUnixConn(t *testing.T) {
	c, _ := newPair(t, nil)
	f, err := openTemp(t)
	if err != nil {
		t.Fatal(err)
	}
	err = c.ExecuteFD(context.Background(), "getfd", map[string]string{"fdname": "x"}, nil, f)
	var fe *FDPassingError
	if !errors.As(err, &fe) || !errors.Is(err, ErrFDPassing) {
		t.Fatalf("err = %v, want *FDPassingError", err)
	}
	if !strings.Contains(fe.Error(), "net.pipe") {
		t.Errorf("Error() = %q", fe.Error())
	}
}
