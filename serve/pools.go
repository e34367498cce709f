package serve

import (
	"fmt"
	"net/http"

	"github.com/forkvm/forkvm/engine"
)

// getPool answers a checkpoint's warm pool size.
func (s *Server) getPool(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("name")
	n, err := s.e.PoolSize(r.Context(), name)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, PoolObject{Checkpoint: name, Size: n})
}

// putPool fills (or empties) a checkpoint's warm pool and answers once it is full. The
// pool lives as long as the daemon (or until emptied).
func (s *Server) putPool(w http.ResponseWriter, r *http.Request) {
	var req PoolRequest
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	if req.N < 0 || req.N > engine.MaxPoolSize {
		writeError(w, fmt.Errorf("%w: n must be 0..%d", engine.ErrInvalidSpec, engine.MaxPoolSize))
		return
	}
	name := r.PathValue("name")
	if err := s.e.Warm(r.Context(), name, req.N, &engine.WarmOptions{Restored: req.Restored, WarmUp: req.WarmUp}); err != nil {
		writeError(w, err)
		return
	}
	n, err := s.e.PoolSize(r.Context(), name)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, PoolObject{Checkpoint: name, Size: n})
}
