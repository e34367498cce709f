package serve

import (
	"fmt"
	"net/http"

	"github.com/forkvm/forkvm/engine"
)

// fork starts a wave and streams one forkvm.fork-event/v1 line per fork as it becomes
// ready or fails. A client that disconnects before the stream ends cancels the wave:
// forks in flight are abandoned and every fork the wave made is deleted, the ones
// already reported too (engine.ForkMany's contract), so nothing is left that no one
// knows about. A wave whose stream ended keeps its forks.
func (s *Server) fork(w http.ResponseWriter, r *http.Request) {
	var req ForkRequest
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	n := req.N
	if n == 0 {
		n = 1
	}
	// The request's shape only: names, forwards and the rest are checked by the engine
	// (ForkMany) before any fork starts.
	if err := engine.ValidateForkCount(n); err != nil {
		writeError(w, err)
		return
	}
	switch {
	case req.Source == "":
		writeError(w, fmt.Errorf("%w: source is required", engine.ErrInvalidSpec))
		return
	case req.Name != "" && n != 1:
		writeError(w, fmt.Errorf("%w: name names a single fork (n 1); use prefix for n > 1", engine.ErrInvalidSpec))
		return
	case req.Name != "" && req.Prefix != "", req.Name != "" && len(req.Names) > 0, req.Prefix != "" && len(req.Names) > 0:
		writeError(w, fmt.Errorf("%w: name, names and prefix are exclusive", engine.ErrInvalidSpec))
		return
	case len(req.Publish) > n:
		writeError(w, fmt.Errorf("%w: publish has %d lists for n %d", engine.ErrInvalidSpec, len(req.Publish), n))
		return
	}
	opts := &engine.ManyOptions{Prefix: req.Prefix, Concurrency: req.Concurrency, Overcommit: req.Overcommit, Pin: req.Pin}
	if req.Name != "" {
		opts.Names = []string{req.Name}
	}
	if len(req.Names) > 0 {
		opts.Names = req.Names
	}
	if len(req.Publish) > 0 {
		opts.Publish = func(i int) []engine.PortForward {
			if i < len(req.Publish) {
				return req.Publish[i]
			}
			return nil
		}
	}
	events, err := s.e.ForkMany(r.Context(), req.Source, n, opts)
	if err != nil {
		writeError(w, err)
		return
	}
	out := newNDJSON(w)
	for ev := range events {
		// A write error means the client is gone: its context is cancelled too, and the
		// engine cleans up; keep draining so the wave finishes.
		out.line(NewForkEventObject(ev))
	}
}
