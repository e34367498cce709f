package serve

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// Body limits: JSON requests are small; an exec carries its stdin in its body.
const (
	MaxBodyBytes     = 1 << 20
	MaxExecBodyBytes = 16 << 20
	// MaxExecBodiesBytes bounds the exec request bodies the daemon holds at once
	// (each decoded body costs about twice its size while its exec runs); an exec
	// beyond it is answered 503 busy, with Retry-After. A body without a
	// Content-Length counts as MaxExecBodyBytes.
	MaxExecBodiesBytes = 64 << 20
	// MaxForks bounds n of one POST /v1/forks: the engine's own limit.
	MaxForks = engine.MaxForks
	// ExecBodyIdle bounds how long an exec's body may send nothing: its bytes count in
	// MaxExecBodiesBytes from its start, so a stalled one (a client stopped mid-upload,
	// a link dead without a reset) must give them back (408).
	ExecBodyIdle = 30 * time.Second
)

// ErrStopping is the cause of the cancellation of requests still running when the
// daemon stops (after its grace); an exec it cuts short says so.
var ErrStopping = errors.New("serve: the daemon is stopping")

// Server serves the API for one engine. Its handlers are safe for concurrent use.
type Server struct {
	e   *engine.Engine
	log *slog.Logger
	mux *http.ServeMux
	pid int
	// inflight counts handlers running, so the engine is closed only after the last
	// one returned (a cancelled wave deletes its forks on its way out).
	inflight sync.WaitGroup
	// execBodies holds the bytes of the exec bodies being served (MaxExecBodiesBytes).
	execBodies *semaphore.Weighted
	// bodyIdle is ExecBodyIdle (a test's shorter).
	bodyIdle time.Duration
	// fm is the daemon's fleet membership (SetJoining, SetFleet).
	fm fleetMembership
	// pk is the daemon's parking (serve/park.go).
	pk *parker
	// faults counts forks' page faults by class (SetFaults; nil: not), vmf keeps them
	// for the VM objects (serve/faults.go).
	faults *Faults
	vmf    vmFaults
}

// New returns a server for e. A nil logger discards.
func New(e *engine.Engine, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{e: e, log: log, mux: http.NewServeMux(), pid: os.Getpid(), execBodies: semaphore.NewWeighted(MaxExecBodiesBytes),
		bodyIdle: ExecBodyIdle}
	s.mux.HandleFunc("GET /v1/info", s.info)
	s.mux.HandleFunc("GET /v1/vms", s.listVMs)
	s.mux.HandleFunc("POST /v1/vms", s.createVM)
	s.mux.HandleFunc("GET /v1/vms/{name}", s.getVM)
	s.mux.HandleFunc("DELETE /v1/vms/{name}", s.deleteVM)
	s.mux.HandleFunc("GET /v1/vms/{name}/memory", s.memory)
	s.mux.HandleFunc("POST /v1/vms/{name}/exec", s.exec)
	s.mux.HandleFunc("PUT /v1/vms/{name}/files", s.copyIn)
	s.mux.HandleFunc("GET /v1/vms/{name}/files", s.copyOut)
	s.mux.HandleFunc("GET /v1/vms/{name}/stat", s.stat)
	s.mux.HandleFunc("GET /v1/vms/{name}/logs", s.logs)
	s.mux.HandleFunc("POST /v1/reap", s.reap)
	s.mux.HandleFunc("GET /v1/checkpoints", s.listCheckpoints)
	s.mux.HandleFunc("POST /v1/checkpoints", s.checkpoint)
	s.mux.HandleFunc("GET /v1/checkpoints/{name}", s.getCheckpoint)
	s.mux.HandleFunc("PATCH /v1/checkpoints/{name}", s.patchCheckpoint)
	s.mux.HandleFunc("DELETE /v1/checkpoints/{name}", s.deleteCheckpoint)
	s.mux.HandleFunc("GET /v1/checkpoints/{name}/pool", s.getPool)
	s.mux.HandleFunc("PUT /v1/checkpoints/{name}/pool", s.putPool)
	s.mux.HandleFunc("GET /v1/budget", s.budget)
	s.mux.HandleFunc("POST /v1/forks", s.fork)
	s.transferRoutes()
	s.fleetRoutes()
	s.parkRoutes()
	s.protectRoutes()
	s.mux.HandleFunc("/", s.noRoute)
	return s
}

// noRoute answers a request no pattern takes: 405 method_not_allowed (with Allow) when
// the path is an endpoint's, else 404 no_route.
func (s *Server) noRoute(w http.ResponseWriter, r *http.Request) {
	var allow []string
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		if m == r.Method {
			continue
		}
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pattern := s.mux.Handler(probe); pattern != "/" {
			allow = append(allow, m)
		}
	}
	if len(allow) > 0 {
		w.Header().Set("Allow", strings.Join(allow, ", "))
		writeErrorObject(w, http.StatusMethodNotAllowed, ErrorObject{Code: CodeMethodNotAllowed,
			Message: fmt.Sprintf("%s %s: method not allowed (allowed: %s)", r.Method, r.URL.Path, strings.Join(allow, ", "))})
		return
	}
	writeErrorObject(w, http.StatusNotFound, ErrorObject{Code: CodeNoRoute, Message: fmt.Sprintf("no endpoint %s %s", r.Method, r.URL.Path)})
}

// Handler is the API for the unix socket: no authentication (the socket is 0600).
func (s *Server) Handler() http.Handler { return s.recoverer(s.mux) }

// Wait blocks until no handler runs or ctx ends (ctx's error). Call it after Serve
// returned and before closing the engine: Serve's forced close cancels the requests
// still running but does not wait for their handlers, and a cancelled wave deletes its
// forks on its way out.
func (s *Server) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.inflight.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// TokenHandler is the API for a TCP listener: every request must carry
// "Authorization: Bearer TOKEN" (the scheme in any case, RFC 7235), else 401.
func (s *Server) TokenHandler(token string) http.Handler {
	want := sha256.Sum256([]byte(token))
	h := s.Handler()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		scheme, cred, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		got := sha256.Sum256([]byte(strings.TrimLeft(cred, " ")))
		if token == "" || !strings.EqualFold(scheme, "Bearer") || subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="forkvm"`)
			writeErrorObject(w, http.StatusUnauthorized, ErrorObject{Code: CodeUnauthorized, Message: "missing or wrong bearer token"})
			return
		}
		h.ServeHTTP(w, r)
	})
}

// recordingWriter notes whether a response has started, so the recoverer knows whether
// it can still send an error.
type recordingWriter struct {
	http.ResponseWriter
	started bool
}

func (w *recordingWriter) WriteHeader(code int) { w.started = true; w.ResponseWriter.WriteHeader(code) }
func (w *recordingWriter) Write(p []byte) (int, error) {
	w.started = true
	return w.ResponseWriter.Write(p)
}
func (w *recordingWriter) Flush() {
	w.started = true
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
func (w *recordingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// recoverer turns a panic in a handler into a 500 internal (or a cut stream when the
// response had started) instead of a dead connection with no answer.
func (s *Server) recoverer(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.inflight.Add(1)
		defer s.inflight.Done()
		rw := &recordingWriter{ResponseWriter: w}
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			if v == http.ErrAbortHandler {
				panic(v)
			}
			s.log.Error("serve: handler panic", "method", r.Method, "path", r.URL.Path, "panic", v)
			if !rw.started {
				writeErrorObject(rw, http.StatusInternalServerError, ErrorObject{Code: CodeInternal, Message: "internal error"})
				return
			}
			panic(http.ErrAbortHandler)
		}()
		h.ServeHTTP(rw, r)
	})
}

// ---------------------------------------------------------------------------------------
// helpers

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeErrorObject(w, http.StatusInternalServerError, ErrorObject{Code: CodeInternal, Message: err.Error()})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

func writeErrorObject(w http.ResponseWriter, status int, o ErrorObject) {
	b, _ := json.Marshal(ErrorResponse{Error: o})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

func writeError(w http.ResponseWriter, err error) {
	o, status := api.ErrorObjectOf(err)
	writeErrorObject(w, status, o)
}

// decode reads one JSON value of at most limit bytes into v, refusing unknown fields and
// trailing data. It answers the error itself and returns false on failure.
func decode(w http.ResponseWriter, r *http.Request, limit int64, v any) bool {
	body := http.MaxBytesReader(w, r.Body, limit)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil {
		if _, terr := dec.Token(); terr != io.EOF {
			err = errors.New("trailing data after the JSON value")
		}
	}
	if err == nil {
		return true
	}
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		writeErrorObject(w, http.StatusRequestEntityTooLarge, ErrorObject{Code: CodeTooLarge, Message: fmt.Sprintf("request body over %d bytes", limit)})
		return false
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		writeErrorObject(w, http.StatusRequestTimeout, ErrorObject{Code: CodeBadRequest, Message: "request body stalled: " + err.Error()})
		return false
	}
	if err == io.EOF {
		err = errors.New("empty body")
	}
	writeErrorObject(w, http.StatusBadRequest, ErrorObject{Code: CodeBadRequest, Message: "bad request body: " + err.Error()})
	return false
}

// idleBody is a request body that fails a read after idle without a byte (a read
// deadline on the connection, set again at each read): a stalled body ends its request
// instead of holding what its handler took for it.
type idleBody struct {
	io.ReadCloser
	rc   *http.ResponseController
	idle time.Duration
}

func (b *idleBody) Read(p []byte) (int, error) {
	b.rc.SetReadDeadline(time.Now().Add(b.idle)) // a writer without deadlines: no bound
	return b.ReadCloser.Read(p)
}

// ndjson writes one JSON line at a time and flushes it; safe for concurrent use. The
// first line sends status 200.
type ndjson struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	rc      *http.ResponseController
	started bool
}

func newNDJSON(w http.ResponseWriter) *ndjson {
	return &ndjson{w: w, rc: http.NewResponseController(w)}
}

func (n *ndjson) line(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if !n.started {
		n.started = true
		n.w.Header().Set("Content-Type", "application/x-ndjson")
		n.w.Header().Set("X-Content-Type-Options", "nosniff")
		n.w.WriteHeader(http.StatusOK)
	}
	if _, err := n.w.Write(append(b, '\n')); err != nil {
		return err
	}
	return n.rc.Flush()
}

func (n *ndjson) hasStarted() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.started
}

// ---------------------------------------------------------------------------------------
// VMs

// ---------------------------------------------------------------------------------------
// checkpoints

// ---------------------------------------------------------------------------------------
// forks

// ---------------------------------------------------------------------------------------
// serving

// Serve serves h on ln until ctx ends, then stops accepting, lets in-flight requests
// finish for up to grace and closes what remains (which cancels their contexts: execs
// end, waves delete their forks). It returns nil after a shutdown caused by ctx.
//
// Attached execs run on connections taken over from the server, which Shutdown neither
// waits for nor closes: every request's context derives from a base context that is
// cancelled when the grace ends, which ends them too (Serve may have returned by then;
// Server.Wait waits for their handlers).
func Serve(ctx context.Context, ln net.Listener, h http.Handler, grace time.Duration) error {
	base, cancelBaseCause := context.WithCancelCause(context.Background())
	cancelBase := func() { cancelBaseCause(ErrStopping) }
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		BaseContext:       func(net.Listener) context.Context { return base },
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		cancelBase()
		return err
	case <-ctx.Done():
	}
	time.AfterFunc(grace, cancelBase)
	sctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		// Cancel first, so that requests see ErrStopping as the cause, not their
		// connection's close.
		cancelBase()
		srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// info describes the daemon.
func (s *Server) info(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, DaemonObject{Schema: DaemonSchema, PID: s.pid, StateDir: s.e.Config().StateDir, Accel: string(s.e.Accel()),
		Counters: s.e.Config().Counters, Faults: s.faults != nil})
}

// budget answers the engine's vCPU admission budget.
func (s *Server) budget(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.e.Budget())
}
