package serve

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// lineSink is where an exec's ExecLine lines go: the NDJSON response of a plain exec, or
// the hijacked connection of an attached one.
type lineSink interface{ line(v any) error }

// streamWriter sends what an exec writes as {"stdout": ...} or {"stderr": ...} lines.
type streamWriter struct {
	n      lineSink
	stderr bool
}

func (s streamWriter) Write(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	// The agent's writes are at most a frame (1 MiB); copy, as p may be reused.
	b := bytes.Clone(p)
	l := ExecLine{Stdout: b}
	if s.stderr {
		l = ExecLine{Stderr: b}
	}
	if err := s.n.line(l); err != nil {
		return 0, err
	}
	return len(p), nil
}

// exec runs a command. Without an Upgrade it streams the output as NDJSON: the status is
// sent with the first line, so an exec that fails before any output (unknown command,
// bad user) gets a plain error response; after that a failure is a final {"error": ...}
// line. A client that disconnects cancels the request's context, which ends the exec in
// the guest. With "Upgrade: forkvm-exec/1" it is an attached exec (execAttached).
func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	weight := int64(MaxExecBodyBytes)
	if r.ContentLength >= 0 && r.ContentLength < weight {
		weight = r.ContentLength
	}
	if !s.execBodies.TryAcquire(weight) {
		w.Header().Set("Retry-After", "1")
		writeErrorObject(w, http.StatusServiceUnavailable, ErrorObject{Code: CodeBusy,
			Message: fmt.Sprintf("the daemon holds %d MiB of exec bodies already; try again", MaxExecBodiesBytes>>20)})
		return
	}
	defer s.execBodies.Release(weight)
	// The body is checked before the VM is used: a bad one does not wake a parked VM.
	var req ExecRequest
	rc := http.NewResponseController(w)
	r.Body = &idleBody{ReadCloser: r.Body, rc: rc, idle: s.bodyIdle}
	if !decode(w, r, MaxExecBodyBytes, &req) {
		return // the server then discards what is left of the body within the deadline
	}
	rc.SetReadDeadline(time.Time{}) // the exec, and an attached one's connection, have none
	attached := wantsExecUpgrade(r)
	var err error
	switch {
	case len(req.Argv) == 0:
		err = vsockd.ErrEmptyArgv
	case req.Stdin != "" && len(req.StdinBase64) > 0:
		err = fmt.Errorf("%w: stdin and stdin_base64 are exclusive", engine.ErrInvalidSpec)
	case attached && (req.Stdin != "" || len(req.StdinBase64) > 0):
		err = fmt.Errorf("%w: an attached exec sends stdin on its connection, not in the body", engine.ErrInvalidSpec)
	case req.TimeoutMS < 0:
		err = fmt.Errorf("%w: timeout_ms is negative", engine.ErrInvalidSpec)
	case req.TimeoutMS > maxTimeoutMS:
		// Its nanoseconds would wrap around: 18446744073710 ms was a timeout of 0.45 ms.
		err = fmt.Errorf("%w: timeout_ms %d is over %d", engine.ErrInvalidSpec, req.TimeoutMS, maxTimeoutMS)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	vm, used, err := s.useVM(w, r, true)
	if err != nil {
		writeError(w, err)
		return
	}
	defer used()
	vreq := &vsockd.ExecRequest{
		Argv: req.Argv, Env: req.Env, Dir: req.Workdir, User: req.User, MaxOutput: req.MaxOutput,
		Timeout: time.Duration(req.TimeoutMS) * time.Millisecond,
		TTY:     req.TTY, Rows: req.Rows, Cols: req.Cols, Term: req.Term,
	}
	if attached {
		s.execAttached(w, r, func(ctx context.Context, req *vsockd.ExecRequest) (api.Process, error) {
			p, err := vm.Start(ctx, req)
			if err != nil {
				return nil, err
			}
			return p, nil
		}, vreq)
		return
	}
	n := newNDJSON(w)
	vreq.Stdout, vreq.Stderr = streamWriter{n: n}, streamWriter{n: n, stderr: true}
	switch {
	case req.Stdin != "":
		vreq.Stdin = strings.NewReader(req.Stdin)
	case len(req.StdinBase64) > 0:
		vreq.Stdin = bytes.NewReader(req.StdinBase64)
	}
	code, err := vm.Exec(r.Context(), vreq)
	if err != nil {
		if !n.hasStarted() {
			writeError(w, err)
			return
		}
		o := ErrorObjectOf(stoppingErr(r, err))
		n.line(ExecLine{Error: &o})
		return
	}
	n.line(ExecLine{ExitCode: &code})
}

// wantsExecUpgrade reports whether r asks for an attached exec.
func wantsExecUpgrade(r *http.Request) bool {
	if !strings.EqualFold(r.Header.Get("Upgrade"), ExecUpgrade) {
		return false
	}
	for _, v := range r.Header.Values("Connection") {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), "upgrade") {
				return true
			}
		}
	}
	return false
}

// connLines writes ExecLine lines to a hijacked connection. Output may arrive before the
// connection is switched (the command starts first, so that a failed start is a plain
// error response): line waits until open or fail is called.
type connLines struct {
	ready chan struct{}
	mu    sync.Mutex
	w     io.Writer // nil after fail
}

func (c *connLines) open(w io.Writer) { c.w = w; close(c.ready) }
func (c *connLines) fail()            { close(c.ready) }

func (c *connLines) line(v any) error {
	<-c.ready
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.w == nil {
		return net.ErrClosed
	}
	_, err = c.w.Write(append(b, '\n'))
	return err
}

// stdinQueue is how many stdin lines an attached exec buffers ahead of its command.
const stdinQueue = 16

// maxSignal is the largest signal number (SIGRTMAX on Linux).
const maxSignal = 64

// maxInputLine bounds one ExecInput line (a stdin chunk of up to 1 MiB in base64).
const maxInputLine = 2 << 20

// maxTimeoutMS is the largest exec timeout_ms whose nanoseconds fit a time.Duration.
const maxTimeoutMS = math.MaxInt64 / int64(time.Millisecond)

// stopWriteGrace is how long an attached exec's last lines may take to be written once
// the daemon stops.
const stopWriteGrace = time.Second

// execAttached runs an attached exec: it starts the command with start (the VM's
// engine.VM.Start; a test's fake), a failure being a plain error response, answers 101
// and takes over the connection. From then on the client sends ExecInput lines (stdin,
// stdin_eof, signal, resize) and receives ExecLine lines (stdout, stderr, then
// exit_code or error), after which the daemon closes the connection.
//
// Lifetime: the command is killed when the client closes the connection (or its write
// side) before the command ended, when a line it sends is malformed, and when the daemon
// stops (the request's context derives from the server's, which Serve cancels after its
// grace even for connections it no longer tracks).
func (s *Server) execAttached(w http.ResponseWriter, r *http.Request, start func(context.Context, *vsockd.ExecRequest) (api.Process, error), vreq *vsockd.ExecRequest) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	pr, pw := io.Pipe()
	defer pr.Close()
	out := &connLines{ready: make(chan struct{})}
	vreq.Stdin, vreq.Stdout, vreq.Stderr = pr, streamWriter{n: out}, streamWriter{n: out, stderr: true}
	p, err := start(ctx, vreq)
	if err != nil {
		out.fail()
		writeError(w, err)
		return
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		out.fail()
		cancel()
		p.Wait(ctx) // ctx is done: kills the command
		s.log.Warn("serve: attached exec: cannot take over the connection", "err", err)
		return
	}
	defer conn.Close()
	// The connection is no longer the server's, whose close at the end of its grace
	// reaches only its own: when the daemon stops (the request's context ends), what
	// is still to be written gets stopWriteGrace, so that a client that does not read
	// cannot hold the handler (and the command's output) for ever.
	stopWrites := context.AfterFunc(r.Context(), func() { conn.SetWriteDeadline(time.Now().Add(stopWriteGrace)) })
	defer stopWrites()
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", ExecUpgrade)
	if err := brw.Flush(); err != nil {
		out.fail()
		cancel()
		p.Wait(ctx)
		return
	}
	out.open(conn)

	// Stdin goes through its own goroutine and a queue, so that a command that does not
	// read its stdin holds up signals and resizes only once the queue is full.
	stdin := make(chan []byte, stdinQueue)
	go func() {
		for b := range stdin {
			if b == nil {
				pw.Close()
				continue
			}
			pw.Write(b) // fails once the command closed its stdin or ended: data dropped
		}
	}()
	// Input: the client's lines, until it closes (which ends the exec) or the command
	// ends (the deferred conn.Close unblocks the read).
	go func() {
		defer cancel()
		defer close(stdin)
		sc := bufio.NewScanner(brw.Reader)
		sc.Buffer(make([]byte, 64<<10), maxInputLine)
		for sc.Scan() {
			in, err := inputLine(sc.Bytes())
			if err != nil {
				o := ErrorObject{Code: CodeBadRequest, Message: "attached exec: bad input line: " + err.Error()}
				out.line(ExecLine{Error: &o})
				return
			}
			switch {
			case in.Stdin != nil:
				stdin <- in.Stdin
			case in.StdinEOF:
				stdin <- nil
			case in.Signal != 0:
				if in.Signal < 0 || in.Signal > maxSignal {
					o := ErrorObject{Code: CodeBadRequest, Message: fmt.Sprintf("attached exec: no signal %d", in.Signal)}
					out.line(ExecLine{Error: &o})
					return
				}
				p.Signal(ctx, syscall.Signal(in.Signal))
			case in.Resize != nil:
				p.Resize(ctx, in.Resize.Rows, in.Resize.Cols)
			}
		}
	}()

	code, err := p.Wait(ctx)
	pw.CloseWithError(io.ErrClosedPipe)
	if err != nil {
		if errors.Is(err, context.Canceled) && r.Context().Err() == nil {
			return // the client went away (or sent a bad line, already answered)
		}
		o := ErrorObjectOf(stoppingErr(r, err))
		out.line(ExecLine{Error: &o})
		return
	}
	out.line(ExecLine{ExitCode: &code})
}

// inputLine decodes an attached exec's input line: at most one field of ExecInput set
// (none is a no-op: signal 0 has no field on the wire), and nothing else. A field
// misspelt, or one of several set on a line, was ignored, and the command waited for an
// input (a stdin_eof) the client believed sent.
func inputLine(b []byte) (ExecInput, error) {
	var in ExecInput
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&in); err != nil {
		return in, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return in, errors.New("trailing data after the JSON value")
	}
	set := 0
	for _, ok := range []bool{in.Stdin != nil, in.StdinEOF, in.Signal != 0, in.Resize != nil} {
		if ok {
			set++
		}
	}
	if set > 1 {
		return in, fmt.Errorf("%d of stdin, stdin_eof, signal and resize set; a line sets one", set)
	}
	return in, nil
}

// stoppingErr says so when err is the cancellation of a request by a daemon that stops
// (an exec cut by SIGTERM printed only "context canceled").
func stoppingErr(r *http.Request, err error) error {
	if errors.Is(err, context.Canceled) && errors.Is(context.Cause(r.Context()), ErrStopping) {
		return fmt.Errorf("%w; the command was ended in the guest (%w)", ErrStopping, err)
	}
	return err
}
