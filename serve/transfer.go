package serve

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/fleet"
	"github.com/forkvm/forkvm/serve/pull"
)

// The checkpoint transfer endpoints: a daemon holding a checkpoint exports it (its
// relocatable manifest, its files with digests and data extents) and serves its files'
// bytes by HTTP Range; another daemon pulls it (POST /v1/checkpoints/pull). They are
// authenticated like every other endpoint (the socket's mode, or the bearer token).

// transferRoutes registers the transfer endpoints.
func (s *Server) transferRoutes() {
	s.mux.HandleFunc("GET /v1/checkpoints/{name}/export", s.exportCheckpoint)
	s.mux.HandleFunc("GET /v1/checkpoints/{name}/export/file", s.checkpointFile)
	s.mux.HandleFunc("POST /v1/checkpoints/pull", s.pullCheckpoint)
}

// exportCheckpoint answers a checkpoint's export (api.CheckpointExport). The first
// export of a checkpoint hashes its files.
func (s *Server) exportCheckpoint(w http.ResponseWriter, r *http.Request) {
	exp, err := s.e.ExportCheckpoint(r.Context(), r.PathValue("name"))
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, exp)
}

// checkpointFile serves one file of a checkpoint's export (?name=, as the export names
// it) with HTTP Range support (one range or several, RFC 9110).
func (s *Server) checkpointFile(w http.ResponseWriter, r *http.Request) {
	file := r.URL.Query().Get("name")
	if file == "" {
		writeError(w, fmt.Errorf("%w: name is required", engine.ErrInvalidSpec))
		return
	}
	f, err := s.e.OpenCheckpointFile(r.Context(), r.PathValue("name"), file)
	if err != nil {
		writeError(w, err)
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	http.ServeContent(w, r, "", st.ModTime(), f)
}

// pullCheckpoint pulls a checkpoint from another daemon into this one (api.PullRequest,
// answered with an api.PullResult): from its URL, or from a node of this daemon's
// fleet by its name.
func (s *Server) pullCheckpoint(w http.ResponseWriter, r *http.Request) {
	var req api.PullRequest
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	if err := engine.ValidateName(req.Checkpoint); err != nil {
		writeError(w, err)
		return
	}
	if !strings.Contains(req.From, "://") {
		s.pullFromNode(w, r, req)
		return
	}
	u, err := url.Parse(req.From)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		writeError(w, fmt.Errorf("%w: from %q is not a daemon's http(s) URL", engine.ErrInvalidSpec, req.From))
		return
	}
	d, err := req.ProgressTimeout()
	if err != nil {
		writeError(w, err)
		return
	}
	res, err := pull.Checkpoint(r.Context(), s.e, pull.Remote(req.From, req.Token), req.Checkpoint, &pull.Options{ProgressTimeout: d})
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

// pullFromNode pulls req's checkpoint from the node of this daemon's fleet that
// req.From names, with the fleet's credentials (req.Token is not used).
func (s *Server) pullFromNode(w http.ResponseWriter, r *http.Request, req api.PullRequest) {
	if fleet.CheckNodeName(req.From) != nil {
		writeError(w, fmt.Errorf("%w: from %q is neither a daemon's URL (http://host:port) nor a fleet node's name", engine.ErrInvalidSpec, req.From))
		return
	}
	f := s.fleetOf(w)
	if f == nil {
		return
	}
	res, err := f.PullFrom(r.Context(), req.Checkpoint, req.From)
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}
