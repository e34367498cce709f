package serve

import (
	"errors"
	"net/http"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/fleet"
)

// SetFleet makes the daemon a node of a fleet: its fleet endpoints answer from f
// (without one they answer 409 no_fleet). Call it before serving.
func (s *Server) SetFleet(f *fleet.Fleet) { s.fleet = f }

// fleetRoutes adds the fleet's endpoints.
func (s *Server) fleetRoutes() {
	s.mux.HandleFunc("GET /v1/fleet/nodes", s.fleetNodes)
	s.mux.HandleFunc("GET /v1/fleet/vms", s.fleetVMs)
	s.mux.HandleFunc("POST /v1/fleet/forks", s.fleetFork)
}

// writeFleetError answers a fleet error with its code.
func writeFleetError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, fleet.ErrNoNode):
		writeErrorObject(w, http.StatusConflict, ErrorObject{Code: api.CodeNoNode, Message: err.Error()})
	case errors.Is(err, fleet.ErrUnavailable):
		writeErrorObject(w, http.StatusServiceUnavailable, ErrorObject{Code: "fleet_unavailable", Message: err.Error()})
	default:
		writeError(w, err)
	}
}

// noFleet answers 409 no_fleet when the daemon is in no fleet.
func (s *Server) noFleet(w http.ResponseWriter) bool {
	if s.fleet != nil {
		return false
	}
	writeErrorObject(w, http.StatusConflict, ErrorObject{Code: api.CodeNoFleet, Message: "this daemon is in no fleet (start it with forkvm serve --cluster or --cluster-listen)"})
	return true
}

// fleetNodes lists the live nodes.
func (s *Server) fleetNodes(w http.ResponseWriter, r *http.Request) {
	if s.noFleet(w) {
		return
	}
	nodes, err := s.fleet.Nodes(r.Context())
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
	if s.noFleet(w) {
		return
	}
	vms, err := s.fleet.VMs(r.Context())
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
	if s.noFleet(w) {
		return
	}
	var req api.FleetForkRequest
	if !decode(w, r, MaxBodyBytes, &req) {
		return
	}
	events, err := s.fleet.ForkMany(r.Context(), req)
	if err != nil {
		writeFleetError(w, err)
		return
	}
	out := newNDJSON(w)
	for ev := range events {
		out.line(ev.FleetForkEventObject)
	}
}
