// Package api is forkvm's API as types: the JSON objects of the daemon's HTTP API
// (docs/api.md), the values the Go API takes and returns (Info, Spec, CheckpointInfo,
// options, ExecRequest, ForkEvent), the API interface both the daemon's client and the
// in-process engine implement, the error sentinels with the code table that maps them
// to the wire and back, and the rules of a fork request (ForkRequest.Validate) that the
// CLI, the client, the daemon and the engine all apply.
//
// Of forkvm it imports only internal/names (the naming rule, shared with the engine and
// the image store): a program that talks to a remote daemon links this package and
// serve/client, not the engine, the guest image builder, the memory-file
// layer or the agent protocol. The engine and the agent protocol use these types and
// sentinels under their own names (engine.Info is Info, engine.ErrNotFound is
// ErrNotFound, vsockd.ExecRequest is ExecRequest), so errors.Is and the values are the
// same on both sides and nothing is declared twice (engine.Spec and the checkpoint,
// fork, wave, pool and delete options too). Where the engine's type carries behaviour
// of its own (engine.Budget, with the admitter's methods) this package has a type of its
// own, converted on the way in and out.
package api
