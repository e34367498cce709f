package serve

import (
	"context"
	"errors"
	"net/http"
	"sync"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet"
)

// fleetMembership is the daemon's fleet: none, joining, or joined.
//
// Concurrency: mu guards every field; the daemon serves while it joins.
type fleetMembership struct {
	mu      sync.Mutex
	f       *fleet.Fleet
	joining bool
	// deleted are the VMs deleted while the daemon joined, told to the fleet once it
	// has joined.
	deleted []string
}

// SetJoining says the daemon is joining a fleet: until SetFleet its fleet endpoints
// answer 503 fleet_unavailable, and VMs deleted meanwhile are told to the fleet then.
// The daemon serves its own VMs meanwhile: a join may wait seconds for the fleet's
// streams to elect leaders.
func (s *Server) SetJoining() {
	s.fm.mu.Lock()
	s.fm.joining = true
	s.fm.mu.Unlock()
}

// SetFleet makes the daemon a node of a fleet: its fleet endpoints answer from f
// (without one they answer 409 no_fleet). It may be called while serving.
func (s *Server) SetFleet(f *fleet.Fleet) {
	s.fm.mu.Lock()
	s.fm.f, s.fm.joining = f, false
	deleted := s.fm.deleted
	s.fm.deleted = nil
	s.fm.mu.Unlock()
	for _, name := range deleted {
		f.Deleted(name)
	}
}

// fleetDeleted tells the fleet, if any, that VM name was deleted here (later, when the
// daemon is still joining it).
func (s *Server) fleetDeleted(name string) {
	s.fm.mu.Lock()
	f := s.fm.f
	if f == nil && s.fm.joining {
		s.fm.deleted = append(s.fm.deleted, name)
	}
	s.fm.mu.Unlock()
	if f != nil {
		f.Deleted(name) // a fleet fork leaves the fleet's list with its VM
	}
}

// fleetRoutes adds the fleet's endpoints.
func (s *Server) fleetRoutes() {
	s.mux.HandleFunc("GET /v1/fleet/nodes", s.fleetNodes)
	s.mux.HandleFunc("GET /v1/fleet/vms", s.fleetVMs)
	s.mux.HandleFunc("POST /v1/fleet/forks", s.fleetFork)
	s.mux.HandleFunc("DELETE /v1/fleet/vms/{name}", s.fleetDeleteVM)
	s.mux.HandleFunc("DELETE /v1/fleet/checkpoints/{name}", s.fleetDeleteCheckpoint)
}

// fleetDeleteVM deletes a fleet fork on whichever node holds it, and answers that node.
func (s *Server) fleetDeleteVM(w http.ResponseWriter, r *http.Request) {
	f := s.fleetOf(w)
	if f == nil {
		return
	}
	name := r.PathValue("name")
	// As a local delete, not cut short by a client that goes away.
	node, err := f.DeleteVM(context.WithoutCancel(r.Context()), name)
	if err != nil {
		writeFleetError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, api.FleetVMDeleted{Name: name, Node: node})
}

// fleetDeleteCheckpoint deletes a checkpoint here and the wave-pulled copies of it on
// the other nodes, and answers what each node did.
func (s *Server) fleetDeleteCheckpoint(w http.ResponseWriter, r *http.Request) {
	f := s.fleetOf(w)
	if f == nil {
		return
	}
	out, err := f.RemoveCheckpoint(context.WithoutCancel(r.Context()), r.PathValue("name"))
	if err != nil && len(out) == 0 {
		writeFleetError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// writeFleetError answers a fleet error with its code.
func writeFleetError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, fleet.ErrNoNode):
		writeErrorObject(w, http.StatusConflict, ErrorObject{Code: api.CodeNoNode, Message: err.Error()})
	case errors.Is(err, fleet.ErrNodeLost):
		writeErrorObject(w, http.StatusConflict, ErrorObject{Code: api.CodeNodeLost, Message: err.Error()})
	case errors.Is(err, fleet.ErrUnavailable):
		writeErrorObject(w, http.StatusServiceUnavailable, ErrorObject{Code: api.CodeFleetUnavailable, Message: err.Error()})
	default:
		writeError(w, err)
	}
}

// fleetOf returns the daemon's fleet, or answers 409 no_fleet when it is in none (503
// fleet_unavailable while it joins one) and returns nil.
func (s *Server) fleetOf(w http.ResponseWriter) *fleet.Fleet {
	s.fm.mu.Lock()
	f, joining := s.fm.f, s.fm.joining
	s.fm.mu.Unlock()
	switch {
	case f != nil:
		return f
	case joining:
		writeErrorObject(w, http.StatusServiceUnavailable, ErrorObject{Code: api.CodeFleetUnavailable, Message: "this daemon is joining its fleet: try again shortly"})
	default:
		writeErrorObject(w, http.StatusConflict, ErrorObject{Code: api.CodeNoFleet, Message: "this daemon is in no fleet (start it with forkvm serve --cluster or --cluster-listen)"})
	}
	return nil
}

// fleetNodes lists the live nodes.
func (s *Server) fleetNodes(w http.ResponseWriter, r *http.Request) {
	f := s.fleetOf(w)
	if f == nil {
		return
	}
	nodes, err := f.Nodes(r.Context())
	if err != nil {
		writeFleetError(w, err)
		return
	}
	if nodes == nil {
		nodes = []api.FleetNode{}
	}
	writeJSON(w, http.StatusOK, nodes)
}

// fleetVMs lists the fleet's forks by their claims.
func (s *Server) fleetVMs(w http.ResponseWriter, r *http.Request) {
	f := s.fleetOf(w)
	if f == nil {
		return
	}
	vms, err := f.VMs(r.Context())
	if err != nil {
		writeFleetError(w, err)
		return
	}
	if vms == nil {
		vms = []api.FleetVM{}
	}
	writeJSON(w, http.StatusOK, vms)
}

// fleetFork publishes a wave to the fleet and streams one line per fork (a local
// wave's fork event with its node) as each becomes final, and a node_lost line for a
// fork whose node died before the wave ended. A client that disconnects stops the
// stream, not the jobs: their forks are claimed and listed by GET /v1/fleet/vms.
func (s *Server) fleetFork(w http.ResponseWriter, r *http.Request) {
	f := s.fleetOf(w)
	if f == nil {
		return
	}
	var req api.FleetForkRequest
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	events, err := f.ForkMany(r.Context(), req)
	if err != nil {
		writeFleetError(w, err)
		return
	}
	out := newNDJSON(w)
	for ev := range events {
		out.line(ev.FleetForkEventObject)
	}
}
