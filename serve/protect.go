package serve

import (
	"net/http"

	"github.com/forkvm/forkvm/api"
)

// The daemon's side of protection (docs/protect.md): the protect and unprotect
// endpoints. The daemon's engine runs the protection loops; the daemon resumes those
// its manifests record when it starts (engine.Engine.ResumeProtection).

func (s *Server) protectRoutes() {
	s.mux.HandleFunc("POST /v1/vms/{name}/protect", s.protectVM)
	s.mux.HandleFunc("DELETE /v1/vms/{name}/protect", s.unprotectVM)
}

func (s *Server) protectVM(w http.ResponseWriter, r *http.Request) {
	var o api.ProtectOptions
	if r.ContentLength != 0 && !decode(w, r, MaxBodyBytes, &o) {
		return
	}
	p, err := s.e.Protect(r.Context(), r.PathValue("name"), &o)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, p)
}

func (s *Server) unprotectVM(w http.ResponseWriter, r *http.Request) {
	if err := s.e.Unprotect(r.Context(), r.PathValue("name")); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
