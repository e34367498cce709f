// Package serve is forkvm's per-host daemon: one process owns the engine of a state
// directory and serves an HTTP/JSON API on a unix socket ($FORKVM_HOME/forkvm.sock,
// mode 0600) and, optionally, on a TCP address guarded by a bearer token. The API is
// described in docs/api.md; package serve/client is its Go client.
//
// This file holds the wire types and the error codes, shared by the server and the
// client.
package serve

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// Schema names of the JSON objects (the CLI's --json prints the same shapes).
const (
	VMSchema         = "forkvm.vm/v1"
	CheckpointSchema = "forkvm.checkpoint/v1"
	ForkEventSchema  = "forkvm.fork-event/v1"
)

// VMObject is a VM (forkvm.vm/v1): the engine's Info with a schema name.
type VMObject struct {
	Schema string `json:"schema"`
	engine.Info
}

// NewVMObject wraps an engine.Info.
func NewVMObject(inf engine.Info) VMObject { return VMObject{Schema: VMSchema, Info: inf} }

// CheckpointObject is a checkpoint with its live forks (forkvm.checkpoint/v1).
type CheckpointObject struct {
	Schema string `json:"schema"`
	engine.CheckpointInfo
}

// NewCheckpointObject wraps an engine.CheckpointInfo (Forks is [] when empty).
func NewCheckpointObject(c engine.CheckpointInfo) CheckpointObject {
	if c.Forks == nil {
		c.Forks = []string{}
	}
	return CheckpointObject{Schema: CheckpointSchema, CheckpointInfo: c}
}

// ForkEventObject is one line of a fork stream (forkvm.fork-event/v1): a fork that
// became ready (VM set) or failed (Error and Code set).
type ForkEventObject struct {
	Schema    string    `json:"schema"`
	Index     int       `json:"index"`
	Name      string    `json:"name"`
	OK        bool      `json:"ok"`
	LatencyMS float64   `json:"latency_ms"`
	Error     string    `json:"error,omitempty"`
	Code      string    `json:"code,omitempty"`
	VM        *VMObject `json:"vm,omitempty"`
}

// NewForkEventObject converts an engine.ForkEvent.
func NewForkEventObject(ev engine.ForkEvent) ForkEventObject {
	out := ForkEventObject{Schema: ForkEventSchema, Index: ev.Index, Name: ev.Name, OK: ev.Err == nil,
		LatencyMS: float64(ev.Latency()) / float64(time.Millisecond)}
	if ev.Err != nil {
		out.Error = ev.Err.Error()
		out.Code = ErrorObjectOf(ev.Err).Code
	} else if ev.VM != nil {
		v := NewVMObject(ev.VM.Info())
		out.VM = &v
	}
	return out
}

// ExecRequest is the body of POST /v1/vms/{name}/exec (non-interactive).
type ExecRequest struct {
	Argv    []string `json:"argv"`
	Env     []string `json:"env,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	User    string   `json:"user,omitempty"`
	// Stdin is the process's standard input as text; StdinBase64 as bytes (JSON
	// base64). At most one of them.
	Stdin       string `json:"stdin,omitempty"`
	StdinBase64 []byte `json:"stdin_base64,omitempty"`
	// MaxOutput bounds stdout+stderr bytes (0: the agent client's default, 64 MiB;
	// negative: no bound).
	MaxOutput int64 `json:"max_output,omitempty"`
	// TimeoutMS, when > 0, is enforced by the guest (exit code 124).
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
}

// ExecLine is one NDJSON line of an exec response: exactly one field is set. Stdout and
// Stderr are base64 in JSON; ExitCode ends a successful stream, Error a failed one.
type ExecLine struct {
	Stdout   []byte       `json:"stdout,omitempty"`
	Stderr   []byte       `json:"stderr,omitempty"`
	ExitCode *int         `json:"exit_code,omitempty"`
	Error    *ErrorObject `json:"error,omitempty"`
}

// CheckpointRequest is the body of POST /v1/checkpoints.
type CheckpointRequest struct {
	VM      string `json:"vm"`
	Name    string `json:"name,omitempty"`
	Pin     bool   `json:"pin,omitempty"`
	Handoff bool   `json:"handoff,omitempty"`
}

// ForkRequest is the body of POST /v1/forks.
type ForkRequest struct {
	Source string `json:"source"`
	// Name names a single fork (n must be 0 or 1).
	Name string `json:"name,omitempty"`
	// N is the number of forks (0 means 1).
	N           int     `json:"n,omitempty"`
	Prefix      string  `json:"prefix,omitempty"`
	Concurrency int     `json:"concurrency,omitempty"`
	Overcommit  float64 `json:"overcommit,omitempty"`
	Pin         bool    `json:"pin,omitempty"`
}

// ErrorObject is the "error" member of an error response
// ({"error": {"code": ..., "message": ...}}); the admission fields are set for code
// "admission".
type ErrorObject struct {
	Code      string `json:"code"`
	Message   string `json:"message"`
	Resource  string `json:"resource,omitempty"`
	Requested int64  `json:"requested,omitempty"`
	Available int64  `json:"available,omitempty"`
	Budget    int64  `json:"budget,omitempty"`
}

// ErrorResponse is the body of every non-2xx response.
type ErrorResponse struct {
	Error ErrorObject `json:"error"`
}

// Codes the server produces itself (not from an engine error).
const (
	CodeBadRequest   = "bad_request"  // malformed JSON, unknown field, bad query value
	CodeTooLarge     = "too_large"    // body over the endpoint's limit
	CodeUnauthorized = "unauthorized" // TCP request without the right bearer token
	CodeNoRoute      = "no_route"     // no such endpoint
	// CodeMethodNotAllowed: the path is an endpoint's, the method is not.
	CodeMethodNotAllowed = "method_not_allowed"
	CodeInternal         = "internal" // anything else (and recovered panics)
)

// errorCodes maps errors to codes and HTTP statuses, first match wins. The client maps
// codes back to the same errors, so errors.Is works on both sides.
var errorCodes = []struct {
	err    error
	code   string
	status int
}{
	{engine.ErrNotFound, "not_found", http.StatusNotFound},
	{engine.ErrExists, "exists", http.StatusConflict},
	{engine.ErrInvalidName, "invalid_name", http.StatusBadRequest},
	{engine.ErrInvalidSpec, "invalid_spec", http.StatusBadRequest},
	{engine.ErrNotRunning, "not_running", http.StatusConflict},
	{engine.ErrNotForkable, "not_forkable", http.StatusConflict},
	{engine.ErrInUse, "in_use", http.StatusConflict},
	{engine.ErrAdmission, "admission", http.StatusServiceUnavailable},
	{engine.ErrIncompatible, "incompatible", http.StatusConflict},
	{engine.ErrCheckpointCorrupt, "checkpoint_corrupt", http.StatusInternalServerError},
	{engine.ErrAgentTimeout, "agent_timeout", http.StatusGatewayTimeout},
	{engine.ErrQEMUExited, "qemu_exited", http.StatusBadGateway},
	{engine.ErrLocked, "locked", http.StatusServiceUnavailable},
	{engine.ErrPortInUse, "port_in_use", http.StatusConflict},
	{engine.ErrPortUnavailable, "port_unavailable", http.StatusBadRequest},
	{engine.ErrClosed, "closed", http.StatusServiceUnavailable},
	{engine.ErrQEMUMissing, "qemu_missing", http.StatusInternalServerError},
	{engine.ErrQEMUTooOld, "qemu_too_old", http.StatusInternalServerError},
	{engine.ErrImageMissing, "image_missing", http.StatusInternalServerError},
	{engine.ErrNotTCG, "not_tcg", http.StatusConflict},
	// exec, reported by the guest agent
	{vsockd.ErrEmptyArgv, "empty_argv", http.StatusBadRequest},
	{vsockd.ErrNotFound, "command_not_found", http.StatusUnprocessableEntity},
	{vsockd.ErrNotExecutable, "not_executable", http.StatusUnprocessableEntity},
	{vsockd.ErrWorkdir, "bad_workdir", http.StatusUnprocessableEntity},
	{vsockd.ErrUnknownUser, "unknown_user", http.StatusUnprocessableEntity},
	{vsockd.ErrOutputLimit, "output_limit", http.StatusUnprocessableEntity},
	{context.DeadlineExceeded, "timeout", http.StatusGatewayTimeout},
	{context.Canceled, "canceled", http.StatusServiceUnavailable},
}

// ErrorObjectOf maps an error to its code, message and (for admission) budget figures.
func ErrorObjectOf(err error) ErrorObject {
	o, _ := errorObject(err)
	return o
}

// errorObject maps an error to its ErrorObject and HTTP status.
func errorObject(err error) (ErrorObject, int) {
	o := ErrorObject{Code: CodeInternal, Message: err.Error()}
	status := http.StatusInternalServerError
	for _, c := range errorCodes {
		if errors.Is(err, c.err) {
			o.Code, status = c.code, c.status
			break
		}
	}
	var ae *engine.AdmissionError
	if errors.As(err, &ae) {
		o.Resource, o.Requested, o.Available, o.Budget = ae.Resource, ae.Requested, ae.Available, ae.Budget
	}
	return o, status
}

// StatusOf is the HTTP status the server answers err with.
func StatusOf(err error) int {
	_, s := errorObject(err)
	return s
}

// SentinelOf is the error a code stands for (nil for the server's own codes and
// unknown ones): the client wraps it so that errors.Is(err, engine.ErrNotFound) holds
// for a daemon's answer as for the engine's.
func SentinelOf(code string) error {
	for _, c := range errorCodes {
		if c.code == code {
			return c.err
		}
	}
	return nil
}
