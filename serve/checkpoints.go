package serve

import (
	"context"
	"fmt"
	"net/http"

	"github.com/forkvm/forkvm/engine"
)

func (s *Server) listCheckpoints(w http.ResponseWriter, r *http.Request) {
	cks, err := s.e.Checkpoints()
	if err != nil {
		writeError(w, err)
		return
	}
	out := make([]CheckpointObject, 0, len(cks))
	for _, c := range cks {
		out = append(out, NewCheckpointObject(c))
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) checkpoint(w http.ResponseWriter, r *http.Request) {
	var req CheckpointRequest
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	if req.VM == "" {
		writeError(w, fmt.Errorf("%w: vm is required", engine.ErrInvalidSpec))
		return
	}
	ck, err := s.e.Checkpoint(r.Context(), req.VM, req.Name, &engine.CheckpointOptions{Pin: req.Pin, Handoff: req.Handoff})
	if err != nil {
		writeError(w, err)
		return
	}
	info, err := s.e.CheckpointInfo(ck.Name())
	if err != nil {
		info = ck.Info()
	}
	writeJSON(w, http.StatusCreated, NewCheckpointObject(info))
}

// getCheckpoint answers one checkpoint with its live forks.
func (s *Server) getCheckpoint(w http.ResponseWriter, r *http.Request) {
	info, err := s.e.CheckpointInfo(r.PathValue("name"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, NewCheckpointObject(info))
}

// patchCheckpoint pins or unpins a checkpoint ({"pinned": bool}).
func (s *Server) patchCheckpoint(w http.ResponseWriter, r *http.Request) {
	var req CheckpointPatch
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	if req.Pinned == nil {
		writeError(w, fmt.Errorf("%w: pinned is required", engine.ErrInvalidSpec))
		return
	}
	name := r.PathValue("name")
	if err := s.e.SetPinned(context.WithoutCancel(r.Context()), name, *req.Pinned); err != nil {
		writeError(w, err)
		return
	}
	info, err := s.e.CheckpointInfo(name)
	if err != nil {
		// Unpinned without forks: SetPinned deleted it.
		w.WriteHeader(http.StatusNoContent)
		return
	}
	writeJSON(w, http.StatusOK, NewCheckpointObject(info))
}

func (s *Server) deleteCheckpoint(w http.ResponseWriter, r *http.Request) {
	force, ok := boolQuery(w, r, "force")
	if !ok {
		return
	}
	ctx := context.WithoutCancel(r.Context())
	if err := s.e.DeleteCheckpoint(ctx, r.PathValue("name"), &engine.DeleteCheckpointOptions{Force: force}); err != nil {
		writeError(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
