// Package serve is forkvm's per-host daemon: one process owns the engine of a state
// directory and serves an HTTP/JSON API on a unix socket ($FORKVM_HOME/forkvm.sock,
// mode 0600) and, optionally, on a TCP address guarded by a bearer token. The API is
// described in docs/api.md; package serve/client is its Go client.
//
// The wire types and the error codes are package api's, shared by the server and
// the client; this file gives the daemon's names to them and converts the engine's
// values.
package serve

import (
	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// Schema names of the JSON objects (the CLI's --json prints the same shapes).
const (
	VMSchema         = api.VMSchema
	CheckpointSchema = api.CheckpointSchema
	ForkEventSchema  = api.ForkEventSchema
	DaemonSchema     = api.DaemonSchema
)

// ExecUpgrade is the Upgrade protocol of an attached exec (api.ExecUpgrade).
const ExecUpgrade = api.ExecUpgrade

// The API's JSON objects, under the daemon's names (package api documents each).
type (
	DaemonObject      = api.DaemonObject
	VMObject          = api.VMObject
	CheckpointObject  = api.CheckpointObject
	ForkEventObject   = api.ForkEventObject
	ExecRequest       = api.ExecBody
	ExecInput         = api.ExecInput
	ResizeSize        = api.ResizeSize
	FileStat          = api.FileStat
	CheckpointPatch   = api.CheckpointPatch
	PoolRequest       = api.PoolRequest
	PoolObject        = api.PoolObject
	ReapResponse      = api.ReapResponse
	ExecLine          = api.ExecLine
	CheckpointRequest = api.CheckpointRequest
	ForkRequest       = api.ForkRequest
	ErrorObject       = api.ErrorObject
	ErrorResponse     = api.ErrorResponse
)

// Codes the server produces itself (not from an engine error); api documents each.
const (
	CodeBadRequest          = api.CodeBadRequest
	CodeTooLarge            = api.CodeTooLarge
	CodeUnauthorized        = api.CodeUnauthorized
	CodeNoRoute             = api.CodeNoRoute
	CodeMethodNotAllowed    = api.CodeMethodNotAllowed
	CodeInternal            = api.CodeInternal
	CodeBusy                = api.CodeBusy
	CodeInsufficientStorage = api.CodeInsufficientStorage
)

// NewVMObject wraps an engine.Info.
func NewVMObject(inf engine.Info) VMObject { return api.NewVMObject(inf) }

// NewCheckpointObject wraps an engine.CheckpointInfo (the API's own) as the API's
// object (Forks is [] when empty).
func NewCheckpointObject(c engine.CheckpointInfo) CheckpointObject {
	return api.NewCheckpointObject(c)
}

// ErrorObjectOf maps an error to its code, message and (for admission) budget figures.
func ErrorObjectOf(err error) ErrorObject {
	o, _ := api.ErrorObjectOf(err)
	return o
}
