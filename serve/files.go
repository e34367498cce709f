package serve

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path"
	"strconv"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// vmAndPath returns the VM {name} and the guest path ?path= of a files request; it
// answers the error itself and returns false when either is bad.
func (s *Server) vmAndPath(w http.ResponseWriter, r *http.Request) (*engine.VM, string, bool) {
	if _, err := s.e.Get(r.PathValue("name")); err != nil {
		writeError(w, err)
		return nil, "", false
	}
	p, ok := guestPath(w, r)
	if !ok {
		return nil, "", false
	}
	vm, used, err := s.useVM(w, r, true)
	if err != nil {
		writeError(w, err)
		return nil, "", false
	}
	// The request's end ends its use of the VM (the handler returns by then).
	context.AfterFunc(r.Context(), used)
	return vm, p, ok
}

// guestPath is the "path" query parameter: an absolute guest path. It answers the error
// itself and returns false when the parameter is missing or relative.
func guestPath(w http.ResponseWriter, r *http.Request) (string, bool) {
	p := r.URL.Query().Get("path")
	if p == "" || !path.IsAbs(p) {
		writeErrorObject(w, http.StatusBadRequest, ErrorObject{Code: CodeBadRequest,
			Message: fmt.Sprintf("path: an absolute guest path is required (got %q)", p)})
		return "", false
	}
	return p, true
}

// copyIn extracts the request body, a tar stream, into the guest directory ?path=
// (vsockd.Client.CopyIn: entries stay below it).
func (s *Server) copyIn(w http.ResponseWriter, r *http.Request) {
	vm, dir, ok := s.vmAndPath(w, r)
	if !ok {
		return
	}
	if err := vm.CopyIn(r.Context(), dir, r.Body); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// lazyWriter sends the response's status and headers with the first byte, so that a
// copy that fails before writing anything gets a plain error response.
type lazyWriter struct {
	w           http.ResponseWriter
	contentType string
	started     bool
	flush       bool
}

func (l *lazyWriter) Write(p []byte) (int, error) {
	if !l.started {
		l.started = true
		l.w.Header().Set("Content-Type", l.contentType)
		l.w.Header().Set("X-Content-Type-Options", "nosniff")
		l.w.WriteHeader(http.StatusOK)
	}
	n, err := l.w.Write(p)
	if err == nil && l.flush {
		err = http.NewResponseController(l.w).Flush()
	}
	return n, err
}

// finish ends a response whose body is written through l: nil sends an empty 200 if
// nothing was written; an error before the first byte is a plain error response; an
// error after it aborts the connection, so that the client sees a broken transfer, not a
// short one.
func (l *lazyWriter) finish(err error) {
	switch {
	case err == nil && !l.started:
		l.Write(nil)
	case err == nil:
	case !l.started:
		writeError(l.w, err)
	default:
		panic(http.ErrAbortHandler)
	}
}

// copyOut streams the guest path ?path= as a tar archive (vsockd.Client.CopyOut).
func (s *Server) copyOut(w http.ResponseWriter, r *http.Request) {
	vm, p, ok := s.vmAndPath(w, r)
	if !ok {
		return
	}
	lw := &lazyWriter{w: w, contentType: "application/x-tar"}
	lw.finish(vm.CopyOut(r.Context(), p, lw))
}

// stat answers a guest path's attributes.
func (s *Server) stat(w http.ResponseWriter, r *http.Request) {
	vm, p, ok := s.vmAndPath(w, r)
	if !ok {
		return
	}
	fi, err := vm.Stat(r.Context(), p)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, api.NewFileStat(fi))
}

// logs streams the VM's serial console (engine.VM.Logs); ?follow=1 keeps streaming
// until the VM's QEMU exits or the client disconnects.
func (s *Server) logs(w http.ResponseWriter, r *http.Request) {
	follow, ok := boolQuery(w, r, "follow")
	if !ok {
		return
	}
	vm, used, err := s.useVM(w, r, follow)
	if err != nil {
		writeError(w, err)
		return
	}
	defer used()
	lw := &lazyWriter{w: w, contentType: "text/plain; charset=utf-8", flush: follow}
	err = vm.Logs(r.Context(), follow, lw)
	if err != nil && errors.Is(err, context.Canceled) && r.Context().Err() != nil {
		return // the client went away while following
	}
	lw.finish(err)
}

// boolQuery parses an optional boolean query parameter; it answers 400 itself and
// returns false when the value is not a boolean.
func boolQuery(w http.ResponseWriter, r *http.Request, name string) (bool, bool) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return false, true
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		writeErrorObject(w, http.StatusBadRequest, ErrorObject{Code: CodeBadRequest, Message: name + ": not a boolean: " + strconv.Quote(v)})
		return false, false
	}
	return b, true
}
