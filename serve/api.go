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
	"io/fs"
	"net/http"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// Schema names of the JSON objects (the CLI's --json prints the same shapes).
const (
	VMSchema         = "forkvm.vm/v1"
	CheckpointSchema = "forkvm.checkpoint/v1"
	ForkEventSchema  = "forkvm.fork-event/v1"
	DaemonSchema     = "forkvm.daemon/v1"
)

// ExecUpgrade is the Upgrade protocol of an attached exec: POST /v1/vms/{name}/exec
// with "Connection: Upgrade" and "Upgrade: forkvm-exec/1" is answered 101, after which
// the connection carries ExecInput lines to the daemon and ExecLine lines back.
const ExecUpgrade = "forkvm-exec/1"

// DaemonObject describes the daemon (GET /v1/info).
type DaemonObject struct {
	Schema   string `json:"schema"`
	PID      int    `json:"pid"`
	StateDir string `json:"state_dir"`
	Accel    string `json:"accel"`
}

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
	Schema    string  `json:"schema"`
	Index     int     `json:"index"`
	Name      string  `json:"name"`
	OK        bool    `json:"ok"`
	LatencyMS float64 `json:"latency_ms"`
	Error     string  `json:"error,omitempty"`
	Code      string  `json:"code,omitempty"`
	// Resource, Requested, Available and Budget are an admission refusal's figures
	// (code "admission"), as in ErrorObject.
	Resource  string    `json:"resource,omitempty"`
	Requested int64     `json:"requested,omitempty"`
	Available int64     `json:"available,omitempty"`
	Budget    int64     `json:"budget,omitempty"`
	VM        *VMObject `json:"vm,omitempty"`
}

// NewForkEventObject converts an engine.ForkEvent.
func NewForkEventObject(ev engine.ForkEvent) ForkEventObject {
	var inf *engine.Info
	if ev.Err == nil && ev.VM != nil {
		i := ev.VM.Info()
		inf = &i
	}
	return ForkEventObjectOf(ev.Index, ev.Name, ev.Latency(), inf, ev.Err)
}

// ForkEventObjectOf builds a fork event: a ready fork (inf set, err nil) or a failed one.
func ForkEventObjectOf(index int, name string, latency time.Duration, inf *engine.Info, err error) ForkEventObject {
	out := ForkEventObject{Schema: ForkEventSchema, Index: index, Name: name, OK: err == nil,
		LatencyMS: float64(latency) / float64(time.Millisecond)}
	if err != nil {
		o := ErrorObjectOf(err)
		out.Error, out.Code = err.Error(), o.Code
		out.Resource, out.Requested, out.Available, out.Budget = o.Resource, o.Requested, o.Available, o.Budget
	} else if inf != nil {
		v := NewVMObject(*inf)
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
	// TTY runs the command on a pseudo terminal of Rows x Cols (TERM from Term, default
	// xterm); all output arrives as stdout.
	TTY  bool   `json:"tty,omitempty"`
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
	Term string `json:"term,omitempty"`
}

// ExecInput is one line a client sends on an attached exec's connection: exactly one
// field is set. Stdin is base64 in JSON; StdinEOF closes the command's stdin; Signal
// sends a signal to its process group; Resize changes its terminal's size.
type ExecInput struct {
	Stdin    []byte      `json:"stdin,omitempty"`
	StdinEOF bool        `json:"stdin_eof,omitempty"`
	Signal   int         `json:"signal,omitempty"`
	Resize   *ResizeSize `json:"resize,omitempty"`
}

// ResizeSize is a terminal size.
type ResizeSize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// FileStat is a guest path's attributes (GET /v1/vms/{name}/stat).
type FileStat struct {
	Name    string    `json:"name"`
	Size    int64     `json:"size_bytes"`
	Mode    uint32    `json:"mode"` // Go fs.FileMode bits
	ModTime time.Time `json:"mod_time"`
	IsDir   bool      `json:"is_dir"`
}

// NewFileStat converts an fs.FileInfo.
func NewFileStat(fi fs.FileInfo) FileStat {
	return FileStat{Name: fi.Name(), Size: fi.Size(), Mode: uint32(fi.Mode()), ModTime: fi.ModTime().UTC(), IsDir: fi.IsDir()}
}

// fileInfo is a FileStat as an fs.FileInfo.
type fileInfo struct{ s FileStat }

func (f fileInfo) Name() string       { return f.s.Name }
func (f fileInfo) Size() int64        { return f.s.Size }
func (f fileInfo) Mode() fs.FileMode  { return fs.FileMode(f.s.Mode) }
func (f fileInfo) ModTime() time.Time { return f.s.ModTime }
func (f fileInfo) IsDir() bool        { return f.s.IsDir }
func (f fileInfo) Sys() any           { return nil }

// FileInfo returns s as an fs.FileInfo.
func (s FileStat) FileInfo() fs.FileInfo { return fileInfo{s} }

// CheckpointPatch is the body of PATCH /v1/checkpoints/{name}.
type CheckpointPatch struct {
	Pinned *bool `json:"pinned"`
}

// PoolRequest is the body of PUT /v1/checkpoints/{name}/pool: keep N pooled processes
// (0 empties the pool); Restored and WarmUp as in engine.WarmOptions.
type PoolRequest struct {
	N        int      `json:"n"`
	Restored bool     `json:"restored,omitempty"`
	WarmUp   []string `json:"warm_up,omitempty"`
}

// PoolObject is a checkpoint's warm pool.
type PoolObject struct {
	Checkpoint string `json:"checkpoint"`
	Size       int    `json:"size"`
}

// ReapResponse is the answer of POST /v1/reap: the dead VMs removed.
type ReapResponse struct {
	Removed []string `json:"removed"`
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
	// Name names a single fork (n must be 0 or 1); Names names each of the n forks.
	Name  string   `json:"name,omitempty"`
	Names []string `json:"names,omitempty"`
	// N is the number of forks (0 means 1).
	N           int     `json:"n,omitempty"`
	Prefix      string  `json:"prefix,omitempty"`
	Concurrency int     `json:"concurrency,omitempty"`
	Overcommit  float64 `json:"overcommit,omitempty"`
	Pin         bool    `json:"pin,omitempty"`
	// Publish[i] are fork i's port forwards (the source VM must have a NIC); a shorter
	// list leaves the rest without.
	Publish [][]engine.PortForward `json:"publish,omitempty"`
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
	// CodeBusy: the daemon holds MaxExecBodiesBytes of exec bodies already (503,
	// Retry-After); try again.
	CodeBusy = "busy"
)

// CodeInsufficientStorage is the code of an ENOSPC (507): the state directory's file
// system, or a guest's, is full.
const CodeInsufficientStorage = "insufficient_storage"

// errorCodes maps errors to codes and HTTP statuses, first match wins. The client maps
// codes back to the same errors, so errors.Is works on both sides. Every exported Err*
// sentinel of packages engine and vsockd has a row (a test walks their source), and
// no two rows share a code.
var errorCodes = []struct {
	err    error
	code   string
	status int
}{
	{engine.ErrImageNotFound, "image_not_found", http.StatusNotFound},
	{engine.ErrNotFound, "not_found", http.StatusNotFound},
	{engine.ErrExists, "exists", http.StatusConflict},
	{engine.ErrInvalidName, "invalid_name", http.StatusBadRequest},
	{engine.ErrInvalidSpec, "invalid_spec", http.StatusBadRequest},
	{engine.ErrPaused, "paused", http.StatusConflict},
	{engine.ErrNotRunning, "not_running", http.StatusConflict},
	{engine.ErrNotForkable, "not_forkable", http.StatusConflict},
	{engine.ErrInUse, "in_use", http.StatusConflict},
	{engine.ErrAgentBusy, "agent_busy", http.StatusConflict},
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
	{vsockd.ErrInvalidRequest, "invalid_exec", http.StatusBadRequest},
	{vsockd.ErrNotFound, "command_not_found", http.StatusUnprocessableEntity},
	{vsockd.ErrNotExecutable, "not_executable", http.StatusUnprocessableEntity},
	{vsockd.ErrWorkdir, "bad_workdir", http.StatusUnprocessableEntity},
	{vsockd.ErrUnknownUser, "unknown_user", http.StatusUnprocessableEntity},
	{vsockd.ErrOutputLimit, "output_limit", http.StatusUnprocessableEntity},
	// files
	{vsockd.ErrSourceMissing, "source_missing", http.StatusNotFound},
	{vsockd.ErrNotDirectory, "not_directory", http.StatusUnprocessableEntity},
	{vsockd.ErrUnsafeEntry, "unsafe_entry", http.StatusBadRequest},
	{vsockd.ErrBadArchive, "bad_archive", http.StatusBadRequest},
	{vsockd.ErrFileTooLarge, "file_too_large", http.StatusRequestEntityTooLarge},
	// the agent's connection
	{vsockd.ErrTokenMismatch, "agent_token_mismatch", http.StatusBadGateway},
	{vsockd.ErrConnLost, "agent_connection_lost", http.StatusBadGateway},
	{vsockd.ErrClosed, "agent_closed", http.StatusBadGateway},
	{vsockd.ErrStreamReset, "agent_stream_reset", http.StatusBadGateway},
	{vsockd.ErrSessionReset, "agent_session_reset", http.StatusBadGateway},
	{vsockd.ErrProtocol, "agent_protocol", http.StatusBadGateway},
	{vsockd.ErrBadFrame, "agent_bad_frame", http.StatusBadGateway},
	{vsockd.ErrFrameTooLarge, "agent_frame_too_large", http.StatusBadGateway},
	{vsockd.ErrUnsupported, "unsupported", http.StatusNotImplemented},
	// the host
	{syscall.ENOSPC, CodeInsufficientStorage, http.StatusInsufficientStorage},
	{syscall.E2BIG, "argument_list_too_long", http.StatusBadRequest},
	{fs.ErrNotExist, "no_such_path", http.StatusNotFound},
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
