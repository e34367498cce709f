package serve

import (
	"context"
	"net/http"

	"github.com/forkvm/forkvm/engine"
)

func (s *Server) listVMs(w http.ResponseWriter, r *http.Request) {
	infos := s.e.List()
	s.vmf.prune(infos)
	out := make([]VMObject, 0, len(infos))
	for _, inf := range infos {
		s.vmf.fill(&inf)
		out = append(out, NewVMObject(inf))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) createVM(w http.ResponseWriter, r *http.Request) {
	var spec engine.Spec
	if !decode(w, r, MaxBodyBytes, &spec) {
		return
	}
	vm, err := s.e.Create(r.Context(), spec)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusCreated, NewVMObject(vm.Info()))
}

func (s *Server) getVM(w http.ResponseWriter, r *http.Request) {
	vm, err := s.e.Get(r.PathValue("name"))
	if err != nil {
		writeError(w, err)
		return
	}
	inf := vm.Info()
	s.vmf.fill(&inf)
	writeJSON(w, http.StatusOK, NewVMObject(inf))
}

func (s *Server) deleteVM(w http.ResponseWriter, r *http.Request) {
	// A delete is not cut short by a client that goes away: half a delete helps no one.
	ctx := context.WithoutCancel(r.Context())
	name := r.PathValue("name")
	if err := s.e.Delete(ctx, name); err != nil {
		writeError(w, err)
		return
	}
	s.fleetDeleted(name)
	s.releasePorts(name)
	s.vmf.drop(name)
	s.pk.drop(name)
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) memory(w http.ResponseWriter, r *http.Request) {
	vm, err := s.e.Get(r.PathValue("name"))
	if err != nil {
		writeError(w, err)
		return
	}
	mu, err := vm.Memory(r.Context())
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, mu)
}

// reap deletes every VM whose QEMU is gone.
func (s *Server) reap(w http.ResponseWriter, r *http.Request) {
	removed := s.e.Reap(context.WithoutCancel(r.Context()))
	if removed == nil {
		removed = []string{}
	}
	writeJSON(w, http.StatusOK, ReapResponse{Removed: removed})
}
