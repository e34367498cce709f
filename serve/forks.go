package serve

import (
	"net/http"
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
	// Every rule of the request is checked once, here as in the engine (which checks the
	// source, its network and admission too) before any fork starts.
	if err := req.Validate(); err != nil {
		writeError(w, err)
		return
	}
	req.Normalize()
	if s.faults != nil {
		// Named before any fork starts, so that their QEMUs are watched from their start.
		names := req.ForkNames()
		s.faults.expect(names)
		defer s.faults.done(names)
	}
	events, err := s.e.ForkMany(r.Context(), req.Source, req.N, req.Options())
	if err != nil {
		writeError(w, err)
		return
	}
	out := newNDJSON(w)
	for ev := range events {
		if s.faults != nil {
			s.forkFaults(&ev.ForkEvent)
		}
		// A write error means the client is gone: its context is cancelled too, and the
		// engine cleans up; keep draining so the wave finishes.
		out.line(ev.Object())
	}
}
