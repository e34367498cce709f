package vsockd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// drainIdle is how long output pipes may stay idle after the process exited
// before the guest stops reading them. It bounds the wait for descendants
// that escaped the process group but still hold the pipes open.
const drainIdle = 250 * time.Millisecond

// drainMax bounds how long, in all, output reads wait for new output once the process
// exited: a descendant that holds the pipes and writes more often than drainIdle (a
// server started with & that logs a heartbeat) kept the command from ever ending. Only
// waiting counts: what the process wrote before it exited is in the pipe already, and
// is read whole, however slowly the host grants credit for it and however long the
// guest takes to read it (see readAfterExit).
const drainMax = 2 * time.Second

// drainCap is the server's drainMax (drainMaxTest where a test set one).
func (s *Server) drainCap() time.Duration {
	if s.drainMaxTest > 0 {
		return s.drainMaxTest
	}
	return drainMax
}

// drain is the server's drainIdle (drainIdleTest where a test set one).
func (s *Server) drain() time.Duration {
	if s.drainIdleTest > 0 {
		return s.drainIdleTest
	}
	return drainIdle
}

// Server is the guest side of the protocol. The zero value is ready to use.
// When the process is PID 1 it also sets the wall clock and hostname from
// Hello and reaps every child (orphans included); otherwise it only waits
// for the processes it started.
type Server struct {
	// Log receives diagnostics; nil discards them.
	Log *log.Logger
	// ExecCgroup, if set, is an open cgroup v2 directory every command starts in
	// (Linux: CLONE_INTO_CGROUP, so not one of its instructions runs outside it): the
	// guest agent's limits on what commands may hold (pids, memory), so that a fork
	// bomb cannot take what the agent needs to accept a request and start a command.
	// Each command gets a cgroup of its own below it, of at most ExecPidsMax tasks (0:
	// no bound of its own), so one command's fork bomb leaves room for the next.
	ExecCgroup  *os.File
	ExecPidsMax int

	cgroups execCgroups
	// drainIdleTest and drainMaxTest replace drainIdle and drainMax in tests (0: the
	// constant).
	drainIdleTest, drainMaxTest time.Duration
}

// PrepareExec makes the cgroups the next commands start in now (see ExecCgroup), so
// that commands started later, in forks of a checkpoint taken after, skip that work on
// their way to starting. Call it once ExecCgroup is set; without one it does nothing.
func (s *Server) PrepareExec() {
	s.cgroups.prepare(s.ExecCgroup, s.ExecPidsMax, 1)
}

func (s *Server) logf(format string, args ...any) {
	if s.Log != nil {
		s.Log.Printf(format, args...)
	}
}

// ServeConn serves one session on rw until EOF, a read/write error, or ctx
// ends (rw is closed then, to interrupt the read). A clean EOF returns nil.
// All processes started in the session are killed when it ends, and when a
// new Hello arrives (which starts a new session generation on the same rw).
//
// Concurrency design: the calling goroutine is the only reader; it never
// blocks on a stream (incoming data goes to bounded per-stream inboxes) so
// control frames for every stream keep flowing. Each exec has goroutines for
// stdin, each output pipe and the exit waiter; they write frames through
// session.send, which serialises writes and drops frames of stale
// generations so nothing from a reset session leaks into the next one.
func (s *Server) ServeConn(ctx context.Context, rw io.ReadWriteCloser) error {
	ss := &session{srv: s, rw: rw, streams: map[uint32]*gstream{}}
	ss.ctx, ss.cancel = context.WithCancel(ctx)
	defer ss.cancel()
	stop := context.AfterFunc(ss.ctx, func() { rw.Close() })
	defer stop()
	ss.newGeneration()
	// Runs last: once ServeConn returns, nothing of this session is written
	// any more (a virtio-serial port outlives the session, and a late frame
	// would reach the next host connection).
	defer ss.closeWrites()
	defer ss.resetStreams()

	dec := NewDecoder(rw)
	for {
		f, err := dec.ReadFrame()
		if err != nil {
			var fe *FrameError
			if errors.As(err, &fe) {
				s.logf("vsockd: %v", err)
				ss.sendError(ss.curGen(), 0, CodeBadFrame, err.Error())
				continue
			}
			if errors.Is(err, io.EOF) {
				return nil
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if werr := ss.writeErr(); werr != nil {
				return werr
			}
			return err
		}
		ss.handle(f)
	}
}

type session struct {
	srv    *Server
	rw     io.ReadWriteCloser
	ctx    context.Context
	cancel context.CancelFunc

	wmu  sync.Mutex // serialises writes
	werr error      // first write error (under wmu)

	gen atomic.Uint64

	mu      sync.Mutex
	streams map[uint32]*gstream
}

type gstream struct {
	id     uint32
	gen    uint64
	ctx    context.Context
	cancel context.CancelFunc
	in     *inbox
	win    *window
	proc   *proc // exec streams only
}

func (ss *session) curGen() uint64 { return ss.gen.Load() }

func (ss *session) newGeneration() uint64 { return ss.gen.Add(1) }

// closeWrites ends writing: it waits for a frame being written (frames are
// written whole) and makes every later send fail.
func (ss *session) closeWrites() {
	ss.wmu.Lock()
	if ss.werr == nil {
		ss.werr = ErrClosed
	}
	ss.wmu.Unlock()
}

func (ss *session) writeErr() error {
	ss.wmu.Lock()
	defer ss.wmu.Unlock()
	return ss.werr
}

// send writes f unless gen is stale. A write error ends the session.
func (ss *session) send(gen uint64, f Frame) error {
	ss.wmu.Lock()
	defer ss.wmu.Unlock()
	if ss.werr != nil {
		return ss.werr
	}
	if gen != ss.gen.Load() {
		return ErrSessionReset
	}
	if err := WriteFrame(ss.rw, f); err != nil {
		ss.werr = fmt.Errorf("vsockd: write: %w", err)
		ss.cancel()
		return ss.werr
	}
	return nil
}

func (ss *session) sendJSON(gen uint64, t FrameType, id uint32, v any) error {
	p, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return ss.send(gen, Frame{Type: t, Stream: id, Payload: p})
}

func (ss *session) sendError(gen uint64, id uint32, code, msg string) {
	ss.sendJSON(gen, TypeError, id, errorWire{Code: code, Message: msg})
}

func errCode(err error) string {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return CodeNotExist
	case errors.Is(err, ErrFileTooLarge):
		return CodeTooLarge
	}
	return CodeIO
}

func (ss *session) lookup(id uint32) *gstream {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.streams[id]
}

// addStream registers a stream for the current generation, or returns nil
// if id is in use.
func (ss *session) addStream(id uint32, p *proc) *gstream {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.streams[id] != nil {
		return nil
	}
	st := &gstream{id: id, gen: ss.gen.Load(), in: newInbox(), win: newWindow(), proc: p}
	st.ctx, st.cancel = context.WithCancel(ss.ctx)
	ss.streams[id] = st
	return st
}

// drop unregisters st and releases its resources; its process (if any and
// still running) is killed.
func (ss *session) drop(st *gstream) {
	ss.mu.Lock()
	if ss.streams[st.id] == st {
		delete(ss.streams, st.id)
	}
	ss.mu.Unlock()
	st.cancel()
	st.in.fail(ErrClosed, true)
	st.win.close(ErrClosed)
	if st.proc != nil {
		st.proc.kill()
		st.proc.closeFiles()
	}
}

// resetStreams drops every stream (killing their processes).
func (ss *session) resetStreams() {
	ss.mu.Lock()
	streams := ss.streams
	ss.streams = map[uint32]*gstream{}
	ss.mu.Unlock()
	for _, st := range streams {
		ss.drop(st)
	}
}

func (ss *session) handle(f Frame) {
	switch f.Type {
	case TypeHello:
		ss.hello(f)
		return
	case TypePing:
		ss.send(ss.curGen(), Frame{Type: TypePong, Stream: f.Stream})
		return
	case TypeExecStart:
		ss.startExec(f)
		return
	case TypeFilePut:
		ss.startPut(f)
		return
	case TypeFileGet:
		ss.startGet(f)
		return
	case TypeCopyIn:
		ss.startCopyIn(f)
		return
	case TypeCopyOut:
		ss.startCopyOut(f)
		return
	case TypeStat:
		ss.stat(f)
		return
	}
	st := ss.lookup(f.Stream)
	if st == nil {
		switch f.Type {
		case TypeStdin, TypeStdinClose, TypeFileData, TypeFileEnd, TypeWindow, TypeReset, TypeResize, TypeSignal:
			// Late frame for a finished stream: ignore silently.
		default:
			ss.sendError(ss.curGen(), f.Stream, CodeBadRequest, "unexpected "+f.Type.String()+" frame")
		}
		return
	}
	switch f.Type {
	case TypeStdin, TypeStdinClose, TypeFileData, TypeFileEnd:
		if err := st.in.push(f); err != nil {
			ss.drop(st)
			ss.sendError(st.gen, st.id, CodeOverrun, err.Error())
		}
	case TypeWindow:
		if n, ok := parseWindow(f.Payload); ok {
			st.win.add(n)
		}
	case TypeReset:
		ss.drop(st)
	case TypeResize:
		var r resizeWire
		if json.Unmarshal(f.Payload, &r) == nil && st.proc != nil {
			if err := st.proc.resize(r.Rows, r.Cols); err != nil {
				ss.srv.logf("vsockd: resize: %v", err)
			}
		}
	case TypeSignal:
		var sw signalWire
		if json.Unmarshal(f.Payload, &sw) == nil && st.proc != nil && sw.Signal > 0 {
			st.proc.signal(sw.Signal)
		}
	default:
		ss.sendError(st.gen, f.Stream, CodeBadRequest, "unexpected "+f.Type.String()+" frame")
	}
}

// hello resets the session and answers with HelloReply.
func (ss *session) hello(f Frame) {
	var h helloWire
	if err := json.Unmarshal(f.Payload, &h); err != nil {
		ss.sendError(ss.curGen(), f.Stream, CodeBadRequest, "hello: "+err.Error())
		return
	}
	// Bump the generation first so that frames from old streams still in
	// flight are dropped, then kill the old streams.
	gen := ss.newGeneration()
	ss.resetStreams()
	applyHello(ss.srv, &h)
	r := helloReplyWire{Version: ProtocolVersion, Token: h.Token, BootID: bootID(), UptimeNs: int64(uptime()), Features: serverFeatures}
	ss.sendJSON(gen, TypeHelloReply, f.Stream, r)
}

// startExec starts a process and its stream goroutines.
func (ss *session) startExec(f Frame) {
	gen := ss.curGen()
	var req execStartWire
	if err := json.Unmarshal(f.Payload, &req); err != nil || len(req.Argv) == 0 {
		ss.sendError(gen, f.Stream, CodeBadRequest, "exec: bad request")
		return
	}
	if ss.lookup(f.Stream) != nil {
		ss.sendError(gen, f.Stream, CodeBadRequest, "exec: stream id in use")
		return
	}
	p, err := startProcess(&req, ss.srv)
	if err != nil {
		code := CodeExec
		var ee *execError
		if errors.As(err, &ee) {
			code = ee.code
		}
		ss.sendError(gen, f.Stream, code, err.Error())
		return
	}
	st := ss.addStream(f.Stream, p)
	if st == nil { // cannot happen: only this goroutine adds streams
		p.kill()
		p.closeFiles()
		p.releaseCgroup()
		return
	}
	// ExecStarted must precede any output, so send it before the pumps run.
	ss.sendJSON(st.gen, TypeExecStarted, st.id, execStartedWire{Pid: p.pid})

	var pumps sync.WaitGroup
	outs := p.outputs()
	pumps.Add(len(outs))
	for _, o := range outs {
		go func() {
			defer pumps.Done()
			ss.pumpOutput(st, o.t, o.f, &p.exited)
		}()
	}
	go ss.feedStdin(st, p)
	go ss.waitExec(st, p, time.Duration(req.TimeoutNs), &pumps)
}

// pumpOutput copies one output fd to the host within the stream's credit.
func (ss *session) pumpOutput(st *gstream, t FrameType, f *os.File, exited *atomic.Bool) {
	buf := make([]byte, chunkSize)
	var d afterExit
	for {
		var n int
		var err error
		if exited.Load() {
			n, err = ss.readAfterExit(f, buf, &d)
		} else {
			n, err = f.Read(buf)
			if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
				// markExited's deadline: the process exited; what is left is read by
				// readAfterExit's rules.
				continue
			}
		}
		data := buf[:n]
		for len(data) > 0 {
			k, aerr := st.win.acquire(st.ctx, len(data))
			if aerr != nil {
				return
			}
			if ss.send(st.gen, Frame{Type: t, Stream: st.id, Payload: data[:k]}) != nil {
				return
			}
			data = data[k:]
		}
		if err != nil {
			return // EOF, EIO (pty), idle or drainMax after exit, or closed
		}
	}
}

// afterExit is what an output pump knows once the process exited (readAfterExit).
type afterExit struct {
	seen   bool          // the exit was seen: owed is set
	owed   int           // bytes the output held when the exit was seen, not read yet
	waited time.Duration // waiting for new output since (drainMax)
}

// errDrained ends an output pump whose wait for a descendant's output used up drainMax.
var errDrained = errors.New("vsockd: output drained")

// readAfterExit reads f for a process that exited. What the process wrote before it
// exited is read whole and costs none of drainMax: the bytes f held when the exit was
// seen (owed), and all that is left once no process holds the output's other end any
// more (nothing can be added then; the reads end with EOF, or EIO on a pty). Such reads
// never wait. Only then does drainMax bound the wait for a descendant's output (a
// server started with & that holds the pipe): a read waits at most drainIdle, and
// counts no more than that however long it took.
//
// Before, every read after the exit counted its whole duration, even one that returned
// output already there: a guest stalled for drainMax inside one read (a loaded host not
// running its vCPU) ended the pump with the rest of the command's own output unread.
// Reads of a pty are short (the terminal writes the "\r\n" of ONLCR apart from the line
// before it), so even a command's last line could lose its end: "50 100\r\n" came as
// "50 100".
func (ss *session) readAfterExit(f *os.File, buf []byte, d *afterExit) (int, error) {
	queued, closed := outputLeft(f)
	if !d.seen {
		d.seen, d.owed = true, queued
	}
	if closed || d.owed > 0 {
		n, err := readReady(f, buf)
		if n > 0 {
			d.owed = max(0, d.owed-n)
			return n, nil
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return 0, err // EOF, EIO (pty), or closed
		}
		d.owed = 0 // empty after all: wait as for a descendant's output
	}
	left := ss.srv.drainCap() - d.waited
	if left <= 0 {
		return 0, errDrained // a descendant's output, written after the process exited
	}
	wait := min(ss.srv.drain(), left)
	f.SetReadDeadline(time.Now().Add(wait))
	t0 := time.Now()
	n, err := f.Read(buf)
	// A read waits at most wait for output; longer, it waited for a CPU (a loaded
	// guest, a host not running the vCPU), which is no output's wait.
	d.waited += min(time.Since(t0), wait)
	if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
		// The deadline can pass while this goroutine waits for a CPU rather than for
		// output: only an empty output is idle.
		n, err = readReady(f, buf)
	}
	return n, err
}

// feedStdin writes Stdin frames to the process and returns credit.
func (ss *session) feedStdin(st *gstream, p *proc) {
	for {
		f, err := st.in.pop(st.ctx)
		if err != nil {
			return
		}
		switch f.Type {
		case TypeStdin:
			if _, err := p.writeStdin(f.Payload); err != nil {
				// The process closed its stdin: discard further input but
				// keep returning credit so the host is not stalled.
				ss.srv.logf("vsockd: stdin: %v", err)
			}
			st.in.release(len(f.Payload))
			ss.send(st.gen, windowFrame(st.id, len(f.Payload)))
		case TypeStdinClose:
			if err := p.endStdin(); err != nil {
				ss.srv.logf("vsockd: end of stdin: %v", err)
			}
		}
	}
}

// waitExec waits for the process to exit (enforcing the timeout), drains
// its output and sends Exit.
func (ss *session) waitExec(st *gstream, p *proc, timeout time.Duration, pumps *sync.WaitGroup) {
	defer p.releaseCgroup() // after Exit is sent: the command's answer waits for none of it
	var timer <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		timer = t.C
	}
	timedOut := false
	var res waitResult
wait:
	for {
		select {
		case res = <-p.status:
			break wait
		case <-timer:
			timedOut = true
			timer = nil
			p.kill()
		case <-st.ctx.Done():
			return // dropped: drop killed the process; the reaper collects it
		}
	}
	p.waitKilled(st.ctx) // a killed command's cgroup empties before its Exit
	p.markExited(ss.srv.drain())
	done := make(chan struct{})
	go func() { pumps.Wait(); close(done) }()
	select {
	case <-done:
	case <-st.ctx.Done():
		return
	}
	e := exitWire{Code: res.code, Signal: res.signal, TimedOut: timedOut}
	if timedOut {
		e.Code = ExitCodeTimeout
	}
	ss.sendJSON(st.gen, TypeExit, st.id, e)
	ss.drop(st)
}

// startPut receives a file into a temporary file and renames it into place.
func (ss *session) startPut(f Frame) {
	gen := ss.curGen()
	var req filePutWire
	if err := json.Unmarshal(f.Payload, &req); err != nil || !filepath.IsAbs(req.Path) {
		ss.sendError(gen, f.Stream, CodeBadRequest, "put: bad request (path must be absolute)")
		return
	}
	st := ss.addStream(f.Stream, nil)
	if st == nil {
		ss.sendError(gen, f.Stream, CodeBadRequest, "put: stream id in use")
		return
	}
	tmp, err := os.CreateTemp(filepath.Dir(req.Path), ".forkvm-put-*")
	if err != nil {
		ss.drop(st)
		ss.sendError(gen, f.Stream, errCode(err), err.Error())
		return
	}
	go func() {
		committed := false
		defer func() {
			if !committed {
				tmp.Close()
				os.Remove(tmp.Name())
			}
		}()
		fail := func(err error) {
			ss.drop(st)
			ss.sendError(st.gen, st.id, errCode(err), err.Error())
		}
		for {
			fr, err := st.in.pop(st.ctx)
			if err != nil {
				return
			}
			switch fr.Type {
			case TypeFileData:
				if _, err := tmp.Write(fr.Payload); err != nil {
					fail(err)
					return
				}
				st.in.release(len(fr.Payload))
				ss.send(st.gen, windowFrame(st.id, len(fr.Payload)))
			case TypeFileEnd:
				err := tmp.Chmod(fs.FileMode(req.Mode).Perm())
				if err == nil {
					err = tmp.Sync()
				}
				if cerr := tmp.Close(); err == nil {
					err = cerr
				}
				if err == nil {
					err = os.Rename(tmp.Name(), req.Path)
				}
				if err != nil {
					fail(err)
					return
				}
				committed = true
				ss.send(st.gen, Frame{Type: TypeFileEnd, Stream: st.id})
				ss.drop(st)
				return
			}
		}
	}()
}

// startGet streams a file to the host.
func (ss *session) startGet(f Frame) {
	gen := ss.curGen()
	var req fileGetWire
	if err := json.Unmarshal(f.Payload, &req); err != nil || req.Path == "" {
		ss.sendError(gen, f.Stream, CodeBadRequest, "get: bad request")
		return
	}
	st := ss.addStream(f.Stream, nil)
	if st == nil {
		ss.sendError(gen, f.Stream, CodeBadRequest, "get: stream id in use")
		return
	}
	fail := func(err error) {
		ss.drop(st)
		ss.sendError(st.gen, st.id, errCode(err), err.Error())
	}
	// Non-blocking: open of a FIFO (or a device that waits for carrier) must not wait
	// on the connection's reader, which then read no frame any more.
	file, err := os.OpenFile(req.Path, os.O_RDONLY|openNonblock, 0)
	if err != nil {
		fail(err)
		return
	}
	if fi, err := file.Stat(); err == nil && fi.Mode().IsRegular() && req.Max > 0 && fi.Size() > req.Max {
		file.Close()
		fail(fmt.Errorf("%w: %s is %d bytes, max %d", ErrFileTooLarge, req.Path, fi.Size(), req.Max))
		return
	}
	go func() {
		defer file.Close()
		// A reset or the session's end closes the file, so a read that waits for data
		// (a FIFO whose writer writes nothing) ends, and with it this goroutine.
		stop := context.AfterFunc(st.ctx, func() { file.Close() })
		defer stop()
		buf := make([]byte, chunkSize)
		var total int64
		for {
			n, rerr := file.Read(buf)
			total += int64(n)
			if req.Max > 0 && total > req.Max {
				fail(fmt.Errorf("%w: %s exceeds %d bytes", ErrFileTooLarge, req.Path, req.Max))
				return
			}
			data := buf[:n]
			for len(data) > 0 {
				k, err := st.win.acquire(st.ctx, len(data))
				if err != nil {
					return
				}
				if ss.send(st.gen, Frame{Type: TypeFileData, Stream: st.id, Payload: data[:k]}) != nil {
					return
				}
				data = data[k:]
			}
			if rerr == io.EOF {
				ss.send(st.gen, Frame{Type: TypeFileEnd, Stream: st.id})
				ss.drop(st)
				return
			}
			if rerr != nil {
				fail(rerr)
				return
			}
		}
	}()
}
